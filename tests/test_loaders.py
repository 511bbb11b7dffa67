"""Loading: bad inputs give one-line ConfigErrors; GGUF dequantization and layout are exact."""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tiny_model import FAMILIES, make_tiny_model

from pagedkv.config import ConfigError
from pagedkv.model.config import LlamaConfig
from pagedkv.model.gguf_loader import dequantize, open_gguf
from pagedkv.model.loader import fingerprint, load_model, resolve_dtype
from pagedkv.model.tokenizer import Tokenizer


def write_gguf(path: Path, arch: str = "llama", tensors: dict | None = None, meta=None) -> Path:
    """A GGUF file: tensors maps name -> float32 array or (raw uint8 blocks, quant type)."""
    w = gguf.GGUFWriter(str(path), arch)
    if meta:
        meta(w)
    for name, value in (tensors or {}).items():
        if isinstance(value, tuple):
            w.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_back(path: Path) -> np.ndarray:
    return dequantize(open_gguf(path).tensors[0])


# ---- one-line errors ------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="model not found"):
        load_model(tmp_path / "nope.gguf", torch.float32)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a model\n")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_model(path, torch.float32)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match="expected a .gguf file or a Hugging Face model folder"):
        load_model(other, torch.float32)


def test_truncated_gguf(tmp_path):
    path = write_gguf(
        tmp_path / "t.gguf", tensors={"token_embd.weight": np.ones((64, 32), np.float32)}
    )
    data = path.read_bytes()
    for cut in (len(data) - 1000, 40):  # the tensor data, then the header itself cut short
        path.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match="corrupt or truncated GGUF file"):
            load_model(path, torch.float32)


def test_unsupported_gguf_architecture(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", arch="gemma3n")
    with pytest.raises(ConfigError, match="unsupported architecture 'gemma3n'"):
        load_model(path, torch.float32)


def test_unsupported_hf_architecture_and_broken_folders(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(folder, torch.float32)
    partial = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": 0.75}}
    (folder / "config.json").write_text(json.dumps(partial))  # Phi-4-mini's: RoPE on 12 of 16
    assert load_model(folder, torch.float32).config.rope_dim == 12
    for bad, message in (
        ({"sliding_window": -4}, "sliding_window must be a positive whole number, got -4"),
        ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "1 layer types for 2 layers"),
        (
            {"sliding_window": 8, "layer_types": ["chunked_attention", "full_attention"]},
            r"unsupported layer types \['chunked_attention'\]",
        ),
    ):
        (folder / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ConfigError, match=message):
            load_model(folder, torch.float32)
    (folder / "config.json").write_text(json.dumps(cfg))
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_model(folder, torch.float32)
    weights.unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_model(folder, torch.float32)
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(folder, torch.float32)


def test_sharded_hf_folder_loads_like_a_single_file(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, folder / file)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}})
    )
    single, sharded = load_model(tiny_model_dir, torch.float32), load_model(folder, torch.float32)
    for a, b in zip(single.model.state_dict().values(), sharded.model.state_dict().values()):
        assert torch.equal(a, b)
    assert single.fingerprint != sharded.fingerprint
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="shard\\(s\\) missing"):
        load_model(folder, torch.float32)


def test_missing_weight_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ConfigError, match="missing weights: model.layers.1.gate_up_proj"):
        load_model(folder, torch.float32)


def test_resolve_dtype_and_fingerprint(tiny_model_dir, tmp_path):
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("auto") == torch.float32  # no model to measure: the exact dtype
    with pytest.raises(ConfigError, match="unknown dtype"):
        resolve_dtype("int4")
    a = tmp_path / "a.bin"
    a.write_bytes(b"x" * 3_000_000)
    first = fingerprint([a])
    assert fingerprint([a]) == first
    a.write_bytes(b"x" * 2_999_999 + b"y")  # the tail changed
    assert fingerprint([a]) != first
    a.write_bytes(b"x" * 1_500_000 + b"y" + b"x" * 1_499_999)  # the middle (a fine-tune)
    assert fingerprint([a]) != first
    a.write_bytes(b"x" * 3_000_000)
    config = LlamaConfig.from_hf_dict(json.loads(Path(tiny_model_dir, "config.json").read_text()))
    keyed = fingerprint([a], config)
    assert keyed != first and fingerprint([a], config) == keyed
    config.rope_theta *= 2  # an edited config.json: other K/V from the same weights
    assert fingerprint([a], config) != keyed


# ---- dequantization against the formats' definitions ----------------------------------------------


def f16_bytes(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (qs & 0xF).astype(np.int32), (qs >> 4).astype(np.int32)


def block_q8_0(rng):
    d, q = rng.uniform(0.01, 1), rng.integers(-128, 128, 32).astype(np.int8)
    raw = np.concatenate([f16_bytes(d), q.view(np.uint8)])
    return raw, np.float16(d).astype(np.float32) * q


def block_q4_0(rng):
    d, qs = rng.uniform(0.01, 1), rng.integers(0, 256, 16).astype(np.uint8)
    lo, hi = nibbles(
        qs
    )  # element i < 16 in the low nibble of byte i, element 16 + i in its high nibble
    return np.concatenate([f16_bytes(d), qs]), np.float16(d).astype(np.float32) * (
        np.concatenate([lo, hi]) - 8
    )


def block_q4_1(rng):
    d, m, qs = rng.uniform(0.01, 1), rng.uniform(-1, 1), rng.integers(0, 256, 16).astype(np.uint8)
    lo, hi = nibbles(qs)
    want = np.float16(d).astype(np.float32) * np.concatenate([lo, hi]) + np.float16(m).astype(
        np.float32
    )
    return np.concatenate([f16_bytes(d), f16_bytes(m), qs]), want


def block_q4_k(rng):
    d, dmin = rng.uniform(0.001, 0.1), rng.uniform(0.001, 0.1)
    scales, qs = (
        rng.integers(0, 256, 12).astype(np.uint8),
        rng.integers(0, 256, 128).astype(np.uint8),
    )
    want = np.empty(256, np.float32)
    for j in range(8):  # 6-bit scale and min of sub-block j, packed into 12 bytes
        if j < 4:
            sc, mn = scales[j] & 63, scales[j + 4] & 63
        else:
            sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
            mn = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
        chunk = qs[32 * (j // 2) : 32 * (j // 2) + 32]
        q = nibbles(chunk)[j % 2]
        want[32 * j : 32 * j + 32] = (
            np.float16(d).astype(np.float32) * sc * q - np.float16(dmin).astype(np.float32) * mn
        )
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), scales, qs]), want


def block_q6_k(rng):
    d = rng.uniform(0.001, 0.1)
    ql, qh = rng.integers(0, 256, 128).astype(np.uint8), rng.integers(0, 256, 64).astype(np.uint8)
    sc = rng.integers(-128, 128, 16).astype(np.int8)
    want = np.empty(256, np.float32)
    df = np.float16(d).astype(np.float32)
    for half in range(2):
        l_, h_, s_, y = ql[64 * half :], qh[32 * half :], sc[8 * half :], 128 * half
        for i in range(32):
            q = [
                (l_[i] & 0xF) | (((h_[i] >> 0) & 3) << 4),
                (l_[i + 32] & 0xF) | (((h_[i] >> 2) & 3) << 4),
                (l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4),
                (l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4),
            ]
            for k in range(4):
                want[y + i + 32 * k] = df * s_[i // 16 + 2 * k] * (int(q[k]) - 32)
    return np.concatenate([ql, qh, sc.view(np.uint8), f16_bytes(d)]), want


@pytest.mark.parametrize(
    "qtype,make",
    [
        (QT.Q8_0, block_q8_0),
        (QT.Q4_0, block_q4_0),
        (QT.Q4_1, block_q4_1),
        (QT.Q4_K, block_q4_k),
        (QT.Q6_K, block_q6_k),
    ],
    ids=["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"],
)
def test_dequantize_hand_built_blocks(tmp_path, qtype, make):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 3, 512
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = [make(rng) for _ in range(rows * cols // block_elems)]
    assert all(len(raw) == block_bytes for raw, _ in blocks)
    raw = np.concatenate([b for b, _ in blocks]).reshape(rows, -1)
    want = np.concatenate([v for _, v in blocks]).reshape(rows, cols)
    got = read_back(write_gguf(tmp_path / "q.gguf", tensors={"w.weight": (raw, qtype)}))
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_tensors_keep_their_values_and_shape(tmp_path, dtype):
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(dtype)
    got = read_back(write_gguf(tmp_path / "f.gguf", tensors={"w.weight": x}))
    assert got.shape == (5, 7) and np.array_equal(got, x.astype(np.float32))


def test_bf16_tensor(tmp_path):
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncate to bfloat16
    got = read_back(
        write_gguf(tmp_path / "b.gguf", tensors={"w.weight": (bf16.view(np.uint8), QT.BF16)})
    )
    assert np.array_equal(got, (bf16.astype(np.uint32) << 16).view(np.float32))


def test_reference_quantizer_round_trip(tmp_path):
    # gguf's own quantizer output must come back within each format's error bound
    x = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    for qtype, tol in [(QT.Q8_0, 0.02), (QT.Q4_0, 0.3), (QT.Q4_1, 0.3)]:
        packed = gguf.quants.quantize(x, qtype)
        got = read_back(
            write_gguf(tmp_path / f"{qtype.name}.gguf", tensors={"w.weight": (packed, qtype)})
        )
        assert np.abs(got - x).max() < tol, qtype.name


# ---- a whole model through GGUF -------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleave the two RoPE halves of each head)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_to_gguf(
    folder: Path,
    out: Path,
    qtype: QT | None = None,
    pre: str = "default",
    extra=None,
    stack_experts: bool = True,
) -> Path:
    """The tiny HF model as llama.cpp would convert it (float32, a Llama's q/k permuted, GPT-2 BPE
    vocab; a Qwen2's, Qwen3's, Phi-3's or Gemma 3's under its own architecture, with its biases,
    q/k norms, fused tensors, or 1 + w norms and sliding window; a mixture's router as
    ffn_gate_inp and each projection of all its experts stacked in one tensor, or one tensor an
    expert with stack_experts=False, as the first Mixtral files); with qtype, its matrices
    quantized by gguf's own quantizer."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    tokens += [
        f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])
    ]  # as llama.cpp pads the vocab
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gguf_arch = {"gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
    granite = cfg["model_type"] in ("granite", "granitemoe")
    arch = {**gguf_arch, "mixtral": "llama"}.get(cfg["model_type"], cfg["model_type"])
    rope = cfg["rope_parameters"]

    def meta(w: gguf.GGUFWriter) -> None:
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
        rotated = int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"]) // heads
        if rotated != cfg["hidden_size"] // heads:  # (llama.cpp's rule, for Phi-4-mini)
            w.add_rope_dimension_count(rotated)
        if rope.get("rope_type") == "longrope":
            key = "original_max_position_embeddings"  # (Phi-3's config.json: at the top)
            old = rope.get(key) or cfg[key]
            stretch = cfg["max_position_embeddings"] / old
            w.add_rope_scaling_orig_ctx_len(old)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(stretch) / math.log(old)))
        if arch in ("gemma2", "gemma3"):
            w.add_sliding_window(cfg["sliding_window"])
        if "num_experts_per_tok" in cfg:  # (transformers 5 writes num_experts as Mixtral's name)
            w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            if "moe_intermediate_size" in cfg:
                w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            if cfg.get("shared_expert_intermediate_size"):
                w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if cfg.get("clip_qkv"):  # (OLMoE's)
            w.add_clamp_kqv(cfg["clip_qkv"])
        if granite:  # (llama.cpp's converter: the multipliers as scales)
            w.add_embedding_scale(cfg["embedding_multiplier"])
            w.add_residual_scale(cfg["residual_multiplier"])
            w.add_attention_scale(cfg["attention_multiplier"])
            w.add_logit_scale(cfg["logits_scaling"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(
            [3 if t in specials else 5 if t.startswith("[PAD") else 1 for t in tokens]
        )
        w.add_bos_token_id(cfg["bos_token_id"])
        w.add_eos_token_id(cfg["eos_token_id"])
        w.add_add_bos_token(False)
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
        )
        if extra:
            extra(w)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "self_attn.qkv_proj": "attn_qkv",  # Phi-3's, fused
        "mlp.gate_up_proj": "ffn_up",
        "mlp.gate": "ffn_gate_inp",  # a mixture's router, shared expert and its gate
        "block_sparse_moe.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
        "block_sparse_moe.router.layer": "ffn_gate_inp",  # (GraniteMoE's)
    }
    # each expert's projection, stacked by llama.cpp's converter into one tensor of all experts
    stacked = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
    stacked.update(down_proj="down", w2="down")
    experts: dict[str, dict[int, np.ndarray]] = {}
    gemma = arch.startswith("gemma")  # (llama.cpp's converter stores its norms as 1 + w)
    if arch in ("gemma2", "gemma3"):
        parts.update(
            post_attention_layernorm="post_attention_norm",
            pre_feedforward_layernorm="ffn_norm",
            post_feedforward_layernorm="post_ffw_norm",
        )
    tensors = {}
    for name, w in load_file(folder / "model.safetensors").items():
        if name in names:
            gemma_norm = gemma and name == "model.norm.weight"
            tensors[names[name]] = w + np.float32(1) if gemma_norm else w
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        sub, kind = rest.rsplit(".", 1)
        if sub == "block_sparse_moe.input_linear":  # GraniteMoE's stacked experts: gate, up
            (
                tensors[f"blk.{layer}.ffn_gate_exps.{kind}"],
                tensors[f"blk.{layer}.ffn_up_exps.{kind}"],
            ) = np.split(w, 2, axis=1)
            continue
        if sub == "block_sparse_moe.output_linear":
            tensors[f"blk.{layer}.ffn_down_exps.{kind}"] = w
            continue
        expert = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", sub)
        if expert:
            name = f"blk.{layer}.ffn_{stacked[expert.group(2)]}_exps.{kind}"
            experts.setdefault(name, {})[int(expert.group(1))] = w
            continue
        part = parts[sub]
        if arch in ("llama", "smollm3", "granite", "granitemoe") and part == "attn_q":  # (Llama's)
            w = llama_cpp_permute(w, heads)
        elif arch in ("llama", "smollm3", "granite", "granitemoe") and part == "attn_k":
            w = llama_cpp_permute(w, kv_heads)
        elif gemma and part.endswith("norm"):
            w = w + np.float32(1)
        tensors[f"blk.{layer}.{part}.{kind}"] = w
    for k, e in experts.items():  # (stack_experts=False: a Mixtral file before April 2024's)
        if stack_experts:
            tensors[k] = np.stack([e[i] for i in sorted(e)])
        else:
            tensors.update({k.replace("_exps.", f".{i}."): w for i, w in e.items()})
    if rope.get("rope_type") == "longrope":  # the factor sets as tensors
        for kind in ("long", "short"):
            tensors[f"rope_factors_{kind}.weight"] = np.array(rope[f"{kind}_factor"], np.float32)
    if qtype is not None:
        tensors = {
            k: (gguf.quants.quantize(w, qtype), qtype) if w.ndim >= 2 else w
            for k, w in tensors.items()
        }
    return write_gguf(out, arch=arch, tensors=tensors, meta=meta)


@pytest.mark.parametrize("arch", ["llama", *FAMILIES])
def test_gguf_model_equals_hf_model(arch, tiny_model_dir, tmp_path):
    if arch == "llama":
        folder = Path(tiny_model_dir)
    elif arch == "smollm3":  # four layers, the fourth without RoPE: the step llama.cpp assumes
        folder = Path(make_tiny_model(tmp_path / arch, arch=arch, num_layers=4))
    elif arch == "gemma2":  # (a GGUF has no query_pre_attn_scalar: head_dim's below 27B)
        folder = Path(make_tiny_model(tmp_path / arch, arch=arch))
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "query_pre_attn_scalar": 32}))
    elif arch == "gemma3":  # six layers, the sixth global: the pattern llama.cpp assumes
        folder = Path(make_tiny_model(tmp_path / arch, arch=arch, num_layers=6))
        cfg = json.loads((folder / "config.json").read_text())
        cfg["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"]
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]  # (a GGUF has no such key: head_dim's)
        (folder / "config.json").write_text(json.dumps(cfg))
    else:
        folder = Path(make_tiny_model(tmp_path / arch, arch=arch))
    from_gguf = load_model(hf_to_gguf(folder, tmp_path / "tiny.gguf"), torch.float32)
    from_hf = load_model(folder, torch.float32)
    assert from_gguf.config.num_key_value_heads == 2 and not from_gguf.config.tie_word_embeddings
    layers = range(from_hf.config.num_hidden_layers)
    assert [from_gguf.config.layer_window(i) for i in layers] == [
        from_hf.config.layer_window(i) for i in layers
    ]
    rules = (
        "local_rope_theta",
        "attn_softcap",
        "final_softcap",
        "sandwich_norms",
        "rope_layers",
    )
    assert [getattr(from_gguf.config, k) for k in rules] == [
        getattr(from_hf.config, k) for k in rules
    ]
    granite = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
    assert [getattr(from_gguf.config, k) for k in granite] == pytest.approx(  # (GGUF's float32)
        [getattr(from_hf.config, k) for k in granite], rel=1e-7
    )
    for a, b in zip(from_hf.model.layers, from_gguf.model.layers):
        assert (a.act, a.window, a.softcap) == (b.act, b.window, b.softcap)
        assert a.scale == pytest.approx(b.scale, rel=1e-7)
    assert from_gguf.config.embed_scale == from_hf.config.embed_scale
    for (name, a), b in zip(
        from_hf.model.state_dict().items(), from_gguf.model.state_dict().values()
    ):
        assert torch.equal(a, b), name
    text = "Hello world! Émigré café 😀 <|im_start|>blocks<|im_end|>"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    ids = from_gguf.tokenizer.encode(text)
    assert from_gguf.tokenizer.decode(ids) == from_hf.tokenizer.decode(ids)
    assert from_gguf.tokenizer.eos_token_ids == {2} and from_gguf.name == "tiny"
    shape = ("qkv_bias", "qk_norm", "head_dim", "num_key_value_heads")
    assert [getattr(from_gguf.config, k) for k in shape] == [
        getattr(from_hf.config, k) for k in shape
    ]
    assert (
        from_gguf.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
        == "<|im_start|>x<|im_end|>"
    )


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_and_partial_rope_gguf_equal_their_config(partial, tmp_path):
    """Phi-3.5's and Phi-4-mini's GGUF (llama.cpp's converter: the factor sets as tensors, the
    original length and attention factor as keys, rope.dimension_count for partial RoPE) give the
    RoPE their config.json gives, for either set."""
    folder = Path(make_tiny_model(tmp_path / "phi3", arch="phi3"))  # head_dim 16
    cfg = json.loads((folder / "config.json").read_text())
    pairs = int(16 * partial) // 2
    cfg.update(max_position_embeddings=64, original_max_position_embeddings=16)
    cfg["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
        "long_factor": [2.0 + 0.7 * i for i in range(pairs)],
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    path = hf_to_gguf(folder, tmp_path / "l.gguf")
    for max_len in (16, 64):
        from_gguf = load_model(path, torch.float32, max_model_len=max_len)
        from_hf = load_model(folder, torch.float32, max_model_len=max_len)
        assert from_gguf.config.rope_dim == from_hf.config.rope_dim == 2 * pairs
        assert from_gguf.max_model_len == from_hf.max_model_len == 64
        ours, theirs = from_gguf.config.rope_scaling, from_hf.config.rope_scaling
        assert ours["long"] == theirs["long"] == (max_len == 64)
        assert ours["original_max_position_embeddings"] == 16
        for key in ("long_factor", "short_factor"):  # (as float32: the file's, and transformers')
            assert torch.equal(torch.tensor(ours[key]), torch.tensor(theirs[key]))
        for table in ("cos", "sin"):
            a, b = getattr(from_gguf.model.rotary, table), getattr(from_hf.model.rotary, table)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for (name, a), b in zip(
            from_hf.model.state_dict().items(), from_gguf.model.state_dict().values()
        ):
            assert torch.equal(a, b), name


def test_smollm3_rope_layers_and_windows_read_as_transformers_reads_them(tmp_path):
    """SmolLM3's layers without RoPE (no_rope_layers, else every no_rope_layer_interval-th), and
    its opt-in window on those layers, as transformers reads them; a list of the wrong length is
    refused."""
    from transformers import AutoConfig

    folder = Path(make_tiny_model(tmp_path / "s", arch="smollm3", num_layers=4))
    cfg = {
        k: v
        for k, v in json.loads((folder / "config.json").read_text()).items()
        if k not in ("no_rope_layers", "layer_types", "rope_parameters")
    }
    cases = [
        {"no_rope_layer_interval": 2},
        {"no_rope_layers": [1, 0, 0, 1]},
        {"no_rope_layers": [1, 1, 1, 0], "use_sliding_window": True, "sliding_window": 8},
        {},  # every 4th, and the base of SmolLM3's config (2e6)
    ]
    for changes in cases:
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
        ours = load_model(folder, torch.float32).config
        theirs = AutoConfig.from_pretrained(folder)
        layers = range(4)
        assert [ours.layer_rope(i) for i in layers] == [bool(x) for x in theirs.no_rope_layers]
        windows = [
            8 if theirs.use_sliding_window and t == "sliding_attention" else None
            for t in theirs.layer_types
        ]
        assert [ours.layer_window(i) for i in layers] == windows
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rope_theta == 2e6 and not ours.layer_rope(3)
    for bad, message in (
        ({"no_rope_layers": [1, 0]}, "2 entries in no_rope_layers for 4 layers"),
        ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers must be a list of 0 and 1"),
        ({"no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive whole"),
    ):
        (folder / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ConfigError, match=message):
            load_model(folder, torch.float32)


MULTIMODAL = "Gemma3nForConditionalGeneration"


def test_what_gemma_3_adds_is_read_and_the_rest_refused(tmp_path):
    """Gemma 3 (text): RoPE by layer type, old-style keys too, Gemma 2's soft-capping where a file
    sets it; an activation other than its GELU and Gemma 3n are refused, and soft-capping or
    bidirectional attention (EmbeddingGemma's, test_encoders.py) on any other family."""
    folder = Path(make_tiny_model(tmp_path / "g", arch="gemma3"))
    cfg = json.loads((folder / "config.json").read_text())
    config = load_model(folder, torch.float32).config
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert (config.query_pre_attn_scalar, config.sliding_window) == (24, 8)
    assert [config.layer_window(i) for i in range(2)] == [8, None]
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=5e5, rope_local_base_freq=2e3, sliding_window_pattern=2)
    (folder / "config.json").write_text(json.dumps(old))
    config = load_model(folder, torch.float32).config
    assert (config.rope_theta, config.local_rope_theta) == (5e5, 2e3)
    assert [config.layer_window(i) for i in range(2)] == [8, None]
    assert (config.attn_softcap, config.final_softcap) == (None, None)
    (folder / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 20.0}))
    assert load_model(folder, torch.float32).config.attn_softcap == 20.0
    llama = {**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    llama.update(hidden_act="silu", hidden_activation=None)
    for bad, message in (
        ({**llama, "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({**llama, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"attn_logit_softcapping": -1.0}, "attn_softcap must be a positive number, got -1.0"),
        ({"hidden_activation": "silu"}, "unsupported activation 'silu' for model_type 'gemma3"),
        ({**llama, "use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        ({"model_type": "gemma3n", "architectures": [MULTIMODAL]}, f"'{MULTIMODAL}'"),
    ):
        (folder / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ConfigError, match=message):
            load_model(folder, torch.float32)


def test_a_gguf_sliding_window_is_the_config_json_one(tmp_path):
    """Phi-3 mini's GGUF says attention.sliding_window 2047: every layer attends within it, as
    from its HF folder, and the model is served to its full length."""
    folder = Path(make_tiny_model(tmp_path / "phi3", arch="phi3"))

    def window(w: gguf.GGUFWriter) -> None:
        w.add_sliding_window(64)

    windowed = load_model(hf_to_gguf(folder, tmp_path / "w.gguf", extra=window), torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 64}))
    from_hf = load_model(folder, torch.float32)
    assert windowed.max_model_len == from_hf.max_model_len == 2048
    layers = range(windowed.config.num_hidden_layers)
    assert [windowed.config.layer_window(i) for i in layers] == [64] * len(layers)
    assert [from_hf.config.layer_window(i) for i in layers] == [64] * len(layers)
    plain = load_model(hf_to_gguf(folder, tmp_path / "n.gguf"), torch.float32)
    assert plain.config.sliding_window is None


def test_yarn_gguf_equals_yarn_config(tmp_path):
    """llama.cpp's YaRN keys give the RoPE a config.json's rope_parameters give."""
    folder = Path(make_tiny_model(tmp_path / "qwen2", arch="qwen2"))
    cfg = json.loads((folder / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **yarn}
    (folder / "config.json").write_text(json.dumps(cfg))

    def rope(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(512)

    from_gguf = load_model(hf_to_gguf(folder, tmp_path / "y.gguf", extra=rope), torch.float32)
    from_hf = load_model(folder, torch.float32)
    assert from_gguf.config.rope_scaling == from_hf.config.rope_scaling == yarn
    assert from_gguf.max_model_len == from_hf.max_model_len == 2048  # max(2048, 512 x 4)
    assert torch.equal(from_gguf.model.rotary.cos, from_hf.model.rotary.cos)


def test_qwen2_gguf_pre_tokenizer(tiny_model_dir, tmp_path):
    """llama.cpp's "qwen2" split (Qwen2's and Qwen3's): digits one at a time, text NFC-normalized;
    GPT-2's split keeps digit runs whole for BPE to merge."""
    folder = Path(tiny_model_dir)
    toks = {
        pre: load_model(hf_to_gguf(folder, tmp_path / f"{pre}.gguf", pre=pre), "float32").tokenizer
        for pre in ("default", "qwen2")
    }
    digits = "numbers 0123456789"
    gpt2, qwen = (toks[p].encode(digits) for p in ("default", "qwen2"))
    assert toks["qwen2"].decode(qwen) == digits and len(qwen) > len(gpt2)
    assert [toks["qwen2"].decode([t]) for t in qwen[-10:]] == list("0123456789")
    composed, decomposed = "café", "cafe\u0301"
    assert toks["qwen2"].encode(decomposed) == toks["qwen2"].encode(composed)
    assert toks["default"].encode(decomposed) != toks["default"].encode(composed)


# ---- tokenizers -----------------------------------------------------------------------------------


def test_sentencepiece_gguf_vocabulary():
    # A SentencePiece ("llama") vocabulary: pieces ranked by score, byte fallback for the rest.
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "hell",
        "hello",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    tokens = pieces + words
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))][::-1]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    tok = Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
        }
    )
    ids = tok.encode("hello world!")
    assert ids == [1, tokens.index("▁hello"), tokens.index("▁world"), 3 + ord("!")]
    assert tok.decode(ids) == "hello world!"
    assert tok.encode("hello", add_special_tokens=False) == [tokens.index("▁hello")]
    assert tok.decode(tok.encode("wé")) == "wé"  # é only exists as bytes


def _with_tokenizer_config(src, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_chat_template_helpers_and_errors(tiny_model_dir, tmp_path):
    tok = Tokenizer.from_hf_folder(tiny_model_dir)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    ).endswith("<|im_end|>\n")
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ strftime_now('%Y') | length }} {{ messages | tojson }} {{ bos_token }}"
    )
    strict = Tokenizer.from_hf_folder(
        _with_tokenizer_config(tiny_model_dir, tmp_path / "a", chat_template=template)
    )
    assert (
        strict.apply_chat_template([{"role": "user", "content": "é"}])
        == '4 [{"role": "user", "content": "é"}] <|endoftext|>'
    )
    with pytest.raises(ConfigError, match="one message only"):
        strict.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
    broken = Tokenizer.from_hf_folder(
        _with_tokenizer_config(tiny_model_dir, tmp_path / "c", chat_template="{% for %}")
    )
    assert broken.encode("hi") == tok.encode("hi")  # still loads for plain prompts
    with pytest.raises(ConfigError, match="chat template"):
        broken.apply_chat_template([{"role": "user", "content": "a"}])
    bare = Tokenizer.from_hf_folder(
        _with_tokenizer_config(tiny_model_dir, tmp_path / "b", chat_template=None)
    )
    with pytest.raises(ConfigError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "a"}])


def test_encode_long_text_lets_other_threads_run_and_refuses_a_lone_surrogate(tiny_model_dir):
    """A megabyte prompt is cut up without the GIL (the server's other requests keep streaming),
    into the same ids; text with a lone surrogate that reaches the tokenizer is a ConfigError."""
    tok = Tokenizer.from_hf_folder(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 40_000
    ticks, done = [0], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        ids = tok.encode(text)
        during = ticks[0]
    finally:
        done.set()
        ticker.join()
    assert ids == tok._tok.encode(text).ids
    assert during >= 10  # holding the GIL, the ticker gets one or two turns in a second's encode
    with pytest.raises(ConfigError, match="lone surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(ConfigError, match="lone surrogate"):
        tok.encode("a\ud800b" * 10_000)


def test_add_bos_from_tokenizer_config(tiny_model_dir, tmp_path):
    tok = Tokenizer.from_hf_folder(
        _with_tokenizer_config(tiny_model_dir, tmp_path / "m", add_bos_token=True)
    )
    assert tok.encode("Hello")[0] == tok.bos_token_id == 0
    assert tok.encode("Hello", add_special_tokens=False)[0] != 0
    assert tok.decode(tok.encode("Hello")) == "Hello"
    assert Tokenizer.from_hf_folder(tiny_model_dir).encode("Hello")[0] != 0


def test_a_sparse_gemma_3_image_and_text_config_reads_as_transformers_reads_it(tmp_path):
    """Gemma 3 4B's config.json names only what differs from Gemma3TextConfig's defaults (and
    RoPE scaling of the global layers the old way): the text model is the one transformers
    builds from it, and `pagedkv plan` counts its parameters."""
    import transformers

    from pagedkv.model.config import LlamaConfig
    from pagedkv.sim.shapes import resolve_shape

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text"}
    text.update(
        num_hidden_layers=34,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        sliding_window=1024,
    )
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    ours = LlamaConfig.from_hf_dict(json.loads(json.dumps(cfg)))
    theirs = transformers.Gemma3Config(**json.loads(json.dumps(cfg))).text_config
    same = (
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
    )
    same += ("max_position_embeddings", "query_pre_attn_scalar", "tie_word_embeddings")
    assert [getattr(ours, k) for k in same] == [getattr(theirs, k) for k in same]
    assert ours.num_key_value_heads == 4 and ours.vocab_size == 262_208
    windows = [ours.layer_window(i) is not None for i in range(34)]
    assert windows == [t == "sliding_attention" for t in theirs.layer_types] and not windows[5]
    rope = theirs.rope_parameters
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert rope["full_attention"]["rope_type"] == "linear" and rope["full_attention"]["factor"] == 8
    assert (ours.rope_theta, ours.local_rope_theta) == (
        rope["full_attention"]["rope_theta"],
        rope["sliding_attention"]["rope_theta"],
    )
    assert rope["sliding_attention"]["rope_type"] == "default"
    assert ours.eos_token_id == [1, 106]
    with torch.device("meta"):
        held = sum(p.numel() for p in transformers.Gemma3ForCausalLM(theirs).parameters())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    shape = resolve_shape(model=str(tmp_path))  # (not the files' size: they hold the vision tower)
    assert shape.num_params == held and shape.weight_bytes == 2 * held
