"""Makes torch (and so vLLM) see an AVX2-only CPU when FAKE_AVX2=1: vLLM then loads _C_AVX2."""

import os

if os.environ.get("FAKE_AVX2") == "1":
    import torch.cpu

    for name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)
