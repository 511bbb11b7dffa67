"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE, OLMoE): read as transformers
reads them, served by the engine and the server with the same tokens as transformers, from GGUF
files, quantized, split over -tp ranks, under LoRA, and what is not supported refused by name.
(test_model_vs_hf.py's `family` compares the forwards themselves.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from server_process import TINY_SERVER, ServerProcess
from test_engine import assert_pool_clean
from tiny_model import EXPERT_FAMILIES, make_tiny_model

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.model.loader import load_model
from pagedkv.model.quant_linear import Int8Weight

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. Paged attention keeps",
    "Memory is cut into fixed-size blocks handed out on demand, mapped by",
    "Émigré café 東京 😀 0123",
]


@pytest.fixture(scope="module", params=EXPERT_FAMILIES)
def moe(request, tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param)


def hf_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_experts_are_read_as_transformers_reads_them(moe):
    lm, hf = load_model(moe, torch.float32), hf_model(moe)
    c = lm.config
    mlps = [getattr(layer, "mlp", None) or layer.block_sparse_moe for layer in hf.model.layers]
    sparse = [hasattr(mlp, "experts") for mlp in mlps]
    assert [c.layer_moe(i) for i in range(c.num_hidden_layers)] == sparse
    assert any(sparse)
    first = mlps[sparse.index(True)]
    assert c.num_experts == first.experts.gate_up_proj.shape[0]
    assert c.moe_intermediate_size == first.experts.down_proj.shape[2]
    assert c.experts_per_token == hf.config.num_experts_per_tok
    assert c.shared_expert_size == (
        hf.config.shared_expert_intermediate_size if hf.config.model_type == "qwen2_moe" else 0
    )
    assert not all(sparse) or hf.config.model_type != "qwen3_moe"  # (its last layer is dense)
    assert [layer.moe is not None for layer in lm.model.layers] == sparse


def greedy(llm: LLM, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def test_the_engine_gives_transformers_tokens_alone_batched_and_preempted(moe):
    """A step's experts see every running sequence's rows at once: batching, a small pool that
    preempts, and prefix caching change no token."""
    hf = hf_model(moe)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{moe}/tokenizer.json")
    want = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        out = hf.generate(
            ids, max_new_tokens=12, do_sample=False, min_new_tokens=12, eos_token_id=None
        )
        want.append(out[0, ids.shape[1] :].tolist())
    roomy = LLM(moe, dtype="float32", block_size=4, num_gpu_blocks_override=256)
    assert roomy.engine.runner.graphs is None  # (routing is torch's: nothing to replay)
    assert greedy(roomy, PROMPTS) == want
    assert [greedy(roomy, [p])[0] for p in PROMPTS] == want
    tight = LLM(moe, dtype="float32", block_size=4, num_gpu_blocks_override=14)
    assert greedy(tight, PROMPTS * 2) == want * 2
    assert tight.engine.scheduler.num_preemptions > 0
    for llm in (roomy, tight):
        assert_pool_clean(llm.engine)


@pytest.mark.parametrize("arch", ["qwen2_moe"])
def test_int8_and_bfloat16_experts_stay_close_to_float32(arch, tmp_path):
    folder = make_tiny_model(tmp_path / arch, arch=arch)
    ref = load_model(folder, torch.float32)
    ids = torch.tensor(ref.tokenizer.encode(PROMPTS[1]))
    for dtype, quantization in ((torch.float32, "int8"), (torch.bfloat16, "none")):
        lm = load_model(folder, dtype, quantization=quantization)
        moe = lm.model.layers[0].moe
        assert moe is not None
        if quantization == "int8":  # every expert's matrices (the router stays as it was)
            assert all(isinstance(w, Int8Weight) for e in moe._experts for w in e)
            assert all(isinstance(w, Int8Weight) for w in moe._shared)
            assert moe.router.dtype == torch.float32
        logits = [_last_logits(m, ids) for m in (ref, lm)]
        assert (logits[1] - logits[0]).abs().max() < 0.05 * logits[0].abs().max()


def _last_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's last logits through the engine's own forward (test_model_vs_hf's driver)."""
    from test_model_vs_hf import PagedDriver, Seq

    return PagedDriver(lm, 16).step([(Seq(ids.tolist()), len(ids))])[0].float()


def test_the_server_serves_a_mixture_of_experts(tmp_path):
    folder = make_tiny_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    offline = greedy(LLM(folder, dtype="float32", block_size=4), PROMPTS[:2], 10)
    with ServerProcess(folder, *TINY_SERVER, "--dtype", "float32") as server:
        client = server.openai()
        for prompt, want in zip(PROMPTS[:2], offline):
            r = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert r.choices[0].model_extra["token_ids"] == want
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        server.wait_idle()


def test_an_adapter_of_the_attention_applies_and_one_of_the_experts_is_refused(tmp_path):
    """LoRA on a mixture: the attention's projections take an adapter (greedy output equals
    transformers with it merged); the experts' do not, named (Qwen3-MoE's dense last layer's
    MLP does)."""
    from test_lora import make_adapter, merged_greedy

    from pagedkv import LoRARequest

    model = make_tiny_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter = make_adapter(tmp_path / "attn", model, seed=3, modules=attention)
    llm = LLM(model, dtype="float32", enable_lora=True, num_gpu_blocks_override=128)
    try:
        prompts = [[5, 9, 23, 7, 81, 3], [40, 2, 2, 19]]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        got = [
            list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, sp, lora_request=LoRARequest("a", 1, adapter))
        ]
        assert got == merged_greedy(model, adapter, prompts)
        assert got != [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
        mlp = make_adapter(tmp_path / "mlp", model, modules=("q_proj", "gate_proj"))
        with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.gate_proj'.* layer 0 is a mixture"):
            llm.generate(prompts, sp, lora_request=LoRARequest("m", 2, mlp))
    finally:
        llm.close()


def test_a_tensor_parallel_size_must_divide_every_expert():
    """Each expert (and the shared one) is cut as an MLP: -tp must divide its features."""
    from dataclasses import replace

    from pagedkv.distributed.shard import check_shardable

    shape = {"num_attention_heads": 6, "num_key_value_heads": 6, "moe_layers": None}
    config = replace(_config(num_experts=8, moe_intermediate_size=64), **shape)
    check_shardable(config, 2)
    with pytest.raises(ConfigError, match="3 does not divide the experts's 64 features"):
        check_shardable(config, 3)
    shared = replace(config, moe_intermediate_size=48, shared_expert_size=128)
    with pytest.raises(ConfigError, match="3 does not divide the shared expert's 128 features"):
        check_shardable(shared, 3)
    olmoe = replace(config, qk_norm=True, qk_norm_whole=True)  # (its norms span every head)
    with pytest.raises(ConfigError, match="cannot split q and k norms taken over all heads"):
        check_shardable(olmoe, 2)


def _config(**changes):
    """A Qwen3-MoE LlamaConfig as transformers' config would have it, with `changes`."""
    from pagedkv.model.config import LlamaConfig

    base = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=8,
    ).to_dict()
    return LlamaConfig.from_hf_dict({**base, **changes})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size must be"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be"),
        ({"mlp_only_layers": "all"}, "mlp_only_layers must be"),
    ],
)
def test_a_broken_expert_config_is_refused_by_name(changes, message):
    _config()  # (the base itself is fine)
    with pytest.raises(ConfigError, match=message):
        _config(**changes)


@pytest.mark.parametrize("arch", ["qwen2_moe", "granitemoe"])
def test_each_rank_holds_its_share_of_every_experts_4_bit_codes(arch, tmp_path):
    """-tp 2 over a GGUF mixture: each expert's (and the shared expert's) blocks are cut as an
    MLP's before they are packed, so each rank multiplies by -tp 1's own codes for its part."""
    from gguf import GGMLQuantizationType as QT
    from test_loaders import hf_to_gguf
    from test_tp_quant import transposed

    from pagedkv.distributed.shard import shard_model
    from pagedkv.model.quant_linear import QuantWeight

    folder = make_tiny_model(tmp_path / arch, arch=arch, hidden=64, intermediate=256)
    q4 = str(hf_to_gguf(Path(folder), tmp_path / "q4.gguf", QT.Q4_1))
    whole = load_model(q4, torch.float32, quantization="gguf").model
    for rank in range(2):
        part = load_model(q4, torch.float32, quantization="gguf", pack=False).model
        shard_model(part, rank, 2, lambda t: None)
        for mine, ref in zip(part.layers, whole.layers):
            pairs = list(zip(mine.moe.experts, ref.moe.experts))
            if ref.moe.shared is not None:
                pairs.append((mine.moe.shared, ref.moe.shared))
            for got, want in pairs:
                assert isinstance(got.gate_up_proj, QuantWeight)  # (packed after the cut)
                inter = want.down_proj.shape[1]
                mlp = torch.arange(rank * inter // 2, (rank + 1) * inter // 2)
                gate_up = transposed(want.gate_up_proj, want.gate_up_proj.shape[1])
                assert torch.equal(
                    transposed(got.gate_up_proj, got.gate_up_proj.shape[1]),
                    gate_up[:, torch.cat([mlp, inter + mlp])],
                )
                down = transposed(want.down_proj, inter)[mlp]
                assert torch.equal(transposed(got.down_proj, inter // 2), down)
            assert torch.equal(mine.moe.router, ref.moe.router)


@pytest.mark.parametrize("arch", EXPERT_FAMILIES)
def test_a_gguf_mixture_equals_its_folder(arch, tmp_path, monkeypatch):
    """llama.cpp's layout (each projection of all experts stacked in one tensor, the router as
    ffn_gate_inp, Qwen2-MoE's shared expert as *_shexp) read back expert by expert; with 4-bit
    blocks kept, every expert multiplies by its packed codes, as close to the same file
    dequantized as our int4 GEMM is for a dense model, and `pagedkv plan` counts what it holds:
    the experts keep no dense copy (the attention does, from 8 rows here)."""
    from gguf import GGMLQuantizationType as QT
    from test_loaders import hf_to_gguf

    from pagedkv.model.quant_linear import QuantWeight
    from pagedkv.sim.shapes import shape_from_gguf

    # (copies from 8 rows: where they are measured, a CPU whose packed kernel wins every row
    # count, as the int4 one does against bf16 on AVX2, drops them, and the plan cannot know)
    monkeypatch.setenv("PAGEDKV_DENSE_WEIGHTS", "8")
    folder = make_tiny_model(tmp_path / arch, arch=arch)
    want = greedy(LLM(folder, dtype="float32"), PROMPTS)
    path = hf_to_gguf(Path(folder), tmp_path / "f32.gguf")
    assert greedy(LLM(str(path), dtype="float32"), PROMPTS) == want
    if arch == "mixtral":  # (llama.cpp's first Mixtral files: a tensor an expert)
        old = hf_to_gguf(Path(folder), tmp_path / "old.gguf", stack_experts=False)
        assert greedy(LLM(str(old), dtype="float32"), PROMPTS) == want
        old_q4 = hf_to_gguf(Path(folder), tmp_path / "old_q4.gguf", QT.Q4_0, stack_experts=False)
        held = load_model(old_q4, torch.bfloat16, quantization="gguf").model.weight_bytes()
        assert shape_from_gguf(old_q4).weight_bytes == held
    q4_path = hf_to_gguf(Path(folder), tmp_path / "q4.gguf", QT.Q4_0)
    q4 = load_model(q4_path, torch.float32, quantization="gguf")
    moe = q4.model.layers[0].moe
    assert moe is not None and all(isinstance(w, QuantWeight) for e in moe._experts for w in e)
    assert all(w.dense is None for e in moe._experts for w in e)
    assert q4.model.layers[0].qkv_proj.dense is not None
    ids = torch.tensor(q4.tokenizer.encode(PROMPTS[1]))
    ref = _last_logits(load_model(q4_path, torch.float32, quantization="none"), ids)
    assert (_last_logits(q4, ids) - ref).abs().max() < 0.05 * ref.abs().max()
    held = load_model(q4_path, torch.bfloat16, quantization="gguf").model.weight_bytes()
    assert shape_from_gguf(q4_path).weight_bytes == held
