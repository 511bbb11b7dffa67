"""A random GGUF file in the shape of a published Qwen3 model (dense or a mixture of experts), its
matrices in 4-bit blocks as a llama.cpp quantization leaves them, for benchmarks of the packed
path at sizes no package ships and this machine could not quantize from float weights.

    python benchmarks/random_gguf.py qwen3-30b-a3b /tmp/q3moe8.Q4_0.gguf --layers 8

The blocks are drawn at random (codes uniform, scales small), not quantized from anything: speed
depends on the shape and the block type alone; the text is meaningless. Shapes and tokenizer are
random_model.py's; the embedding and lm_head are Q8_0, the norms and routers float32.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from random_model import SHAPES  # same folder

KINDS = {"Q4_0": QT.Q4_0, "Q8_0": QT.Q8_0}


def blocks(
    rows: int, cols: int, kind: QT, rng: np.random.Generator, lead: tuple = ()
) -> np.ndarray:
    """Raw blocks of a [*lead, rows, cols] matrix: a float16 scale (1e-3 .. 1e-2) per block of 32,
    then its codes."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    n = int(np.prod(lead, dtype=np.int64)) * rows * (cols // elems)
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    raw[:, :2] = rng.uniform(1e-3, 1e-2, (n, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(*lead, rows, cols // elems * nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "shape", choices=[s for s, (cls, _) in SHAPES.items() if cls.startswith("Qwen3")]
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, help="keep the first N layers only")
    ap.add_argument("--type", default="Q4_0", choices=sorted(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cls, c = SHAPES[a.shape]
    layers = a.layers or c["num_hidden_layers"]
    kind, rng = KINDS[a.type], np.random.default_rng(a.seed)
    moe = cls == "Qwen3MoeConfig"
    arch = "qwen3moe" if moe else "qwen3"
    hidden, heads, kv, d = (
        c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    w = gguf.GGUFWriter(str(a.out), arch)
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    if moe:
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    vocab = c["vocab_size"]
    alphabet = sorted(_byte_alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = alphabet + [f"<f{i}>" for i in range(vocab - len(alphabet) - len(specials))] + specials
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges([])
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)

    def matrix(name: str, rows: int, cols: int, t: QT = kind, lead: tuple = ()) -> None:
        w.add_tensor(name, blocks(rows, cols, t, rng, lead), raw_dtype=t)

    def vector(name: str, n: int, rows: int = 0) -> None:
        shape = (rows, n) if rows else (n,)
        w.add_tensor(name, rng.normal(0, 0.02, shape).astype(np.float32) + (0 if rows else 1))

    matrix("token_embd.weight", vocab, hidden, QT.Q8_0)
    for i in range(layers):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", hidden)
        vector(f"{b}.ffn_norm.weight", hidden)
        vector(f"{b}.attn_q_norm.weight", d)
        vector(f"{b}.attn_k_norm.weight", d)
        matrix(f"{b}.attn_q.weight", heads * d, hidden)
        matrix(f"{b}.attn_k.weight", kv * d, hidden)
        matrix(f"{b}.attn_v.weight", kv * d, hidden)
        matrix(f"{b}.attn_output.weight", hidden, heads * d)
        if moe:
            e, inter = c["num_experts"], c["moe_intermediate_size"]
            vector(f"{b}.ffn_gate_inp.weight", hidden, rows=e)
            matrix(f"{b}.ffn_gate_exps.weight", inter, hidden, lead=(e,))
            matrix(f"{b}.ffn_up_exps.weight", inter, hidden, lead=(e,))
            matrix(f"{b}.ffn_down_exps.weight", hidden, inter, lead=(e,))
        else:
            inter = c["intermediate_size"]
            matrix(f"{b}.ffn_gate.weight", inter, hidden)
            matrix(f"{b}.ffn_up.weight", inter, hidden)
            matrix(f"{b}.ffn_down.weight", hidden, inter)
    vector("output_norm.weight", hidden)
    matrix("output.weight", vocab, hidden, QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.out}: {a.out.stat().st_size / 2**30:.2f} GiB")


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return list(pre_tokenizers.ByteLevel.alphabet())


if __name__ == "__main__":
    main()
