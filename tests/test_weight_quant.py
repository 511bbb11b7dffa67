"""--quantization: GGUF blocks packed for torch's int4/int8 kernels equal gguf's own dequantization;
int8 and gguf models stay close to float32; scheduling (preemption, prefix cache) never changes
their outputs; bad values are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_loaders import block_q4_0, block_q4_1, block_q4_k, block_q6_k, block_q8_0
from test_model_vs_hf import PagedDriver, Seq

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.model.dense_weights import copy_dtype, keeps_copies, packed_weights
from pagedkv.model.loader import load_model
from pagedkv.model.quant_linear import (
    ACT_DTYPE,
    Int4Weight,
    Int8Weight,
    blocks_from_gguf,
    gguf_weight,
)

MAKERS = {
    QT.Q8_0: block_q8_0,
    QT.Q4_0: block_q4_0,
    QT.Q4_1: block_q4_1,
    QT.Q4_K: block_q4_k,
    QT.Q6_K: block_q6_k,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [
    "The quick brown fox",
    "Paged attention keeps the KV cache in blocks. Hello world!",
    "Hi",
    "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. " * 3,
]


def random_tensor(qtype: QT, rows: int = 128, cols: int = 512, seed: int = 0) -> np.ndarray:
    """Raw blocks [rows, bytes per row] of hand-built, valid blocks (test_loaders' builders)."""
    rng = np.random.default_rng(seed + int(qtype))
    block_elems, _ = gguf.GGML_QUANT_SIZES[qtype]
    return np.concatenate(
        [MAKERS[qtype](rng)[0] for _ in range(rows * cols // block_elems)]
    ).reshape(rows, -1)


def kernel_weights(w) -> torch.Tensor:
    """What a packed weight multiplies by: W as float32, read back through the kernel (x = I)."""
    return w.packed_mm(torch.eye(w.shape[1], dtype=ACT_DTYPE)).t().float()


@pytest.mark.parametrize("qtype", list(MAKERS), ids=lambda q: q.name)
def test_packing_round_trip_equals_gguf_dequantization(qtype, one_torch_thread):
    raw = random_tensor(qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    blocks = blocks_from_gguf(raw, qtype, tuple(want.shape))
    assert torch.equal(blocks.dequantize(), want)  # codes, scales, zeros read exactly
    packed = gguf_weight(blocks, "embed_tokens", torch.float32)
    got = kernel_weights(packed)
    # a dense copy holds the kernel's own weight values, rounded once to bfloat16
    assert torch.equal(packed.dequantize().to(ACT_DTYPE).float(), got)
    if qtype in (QT.Q4_0, QT.Q4_1, QT.Q4_K):
        assert isinstance(gguf_weight(blocks, "gate_up_proj", torch.float32), Int4Weight)
        assert isinstance(packed, Int4Weight)
        # the same 4-bit codes: only scales and zeros are rounded to bfloat16 (and the product read back)
        s = blocks.scale.to(ACT_DTYPE).float().repeat_interleave(blocks.group, 1)
        zero = (
            (blocks.zero + 8 * blocks.scale)
            .to(ACT_DTYPE)
            .float()
            .repeat_interleave(blocks.group, 1)
        )
        exact = (blocks.q.float() - 8) * s + zero
        torch.testing.assert_close(got, exact.to(ACT_DTYPE).float(), rtol=2**-7, atol=1e-6)
        # against gguf's float32 values: off by the bfloat16 rounding of scale, zero and the product
        step = blocks.scale.repeat_interleave(blocks.group, 1)
        offset = (blocks.zero + 8 * blocks.scale).abs().repeat_interleave(blocks.group, 1)
        assert ((got - want).abs() <= 2**-8 * (offset + 8 * step + want.abs())).all()
        ids = torch.tensor([0, 1, 31, 32, 33, 63, 64, 127, 5])  # embedding lookups
        torch.testing.assert_close(
            packed.rows(ids, torch.float32), exact[ids], rtol=2**-7, atol=1e-6
        )
    else:
        # no torch kernel runs these blocks: other matrices are dequantized, exactly in float32 ...
        assert torch.equal(gguf_weight(blocks, "down_proj", torch.float32), want)
        # ... and the vocabulary ones re-quantized per row, at most half an int8 step off
        assert isinstance(packed, Int8Weight)
        row_step = want.abs().amax(1, keepdim=True) / 127
        assert ((got - want).abs() <= 0.51 * row_step + 2**-7 * want.abs()).all()


def test_rows_not_a_multiple_of_16_fall_back_to_int8():
    raw = random_tensor(QT.Q4_0, rows=24, cols=64)
    assert isinstance(
        gguf_weight(blocks_from_gguf(raw, QT.Q4_0, (24, 64)), "o_proj", torch.float32), Int8Weight
    )


@pytest.fixture(scope="module")
def tiny32(tiny_model_dir):
    return load_model(tiny_model_dir, torch.float32)


def test_int8_tiny_model_stays_close_to_float32(tiny_model_dir, tiny32, one_torch_thread):
    lm8 = load_model(tiny_model_dir, torch.float32, quantization="int8")
    assert isinstance(lm8.model.layers[0].qkv_proj, Int8Weight)
    assert lm8.model.lm_head is lm8.model.embed_tokens or not lm8.config.tie_word_embeddings
    weights = packed_weights(lm8.model)
    packed = sum(w.packed_nbytes for w in weights)
    assert packed < 0.3 * tiny32.model.weight_bytes()
    if keeps_copies():  # (unless PAGEDKV_DENSE_WEIGHTS=0) plus the copy's bytes per weight
        size = copy_dtype(torch.float32).itemsize  # 2, or 4 where bf16 GEMMs are slow
        copies = sum(w.shape[0] * w.shape[1] * size for w in weights)
        assert sum(w.nbytes for w in weights) == packed + copies
    ids = tiny32.tokenizer.encode(PROMPTS[1])
    l32 = PagedDriver(tiny32, 16).step([(Seq(list(ids)), len(ids))])
    l8 = PagedDriver(lm8, 16).step([(Seq(list(ids)), len(ids))])
    assert (l8 - l32).abs().max() < 0.05 * l32.abs().max()
    seqs = [tiny32.tokenizer.encode(p) for p in PROMPTS]
    want = PagedDriver(tiny32, 16).greedy([Seq(list(s)) for s in seqs], 4)
    got = PagedDriver(lm8, 16).greedy([Seq(list(s)) for s in seqs], 4)
    assert [g[0] for g in got] == [
        w[0] for w in want
    ]  # random weights: later tokens may flip on ties


@pytest.fixture(scope="module")
def quantized_models(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """quantization -> model: the tiny HF folder for int8, and a Q4_0 GGUF of it for gguf."""
    from test_loaders import hf_to_gguf

    q4 = hf_to_gguf(Path(tiny_model_dir), tmp_path_factory.mktemp("q4") / "tiny.Q4_0.gguf", QT.Q4_0)
    return {"int8": str(tiny_model_dir), "gguf": str(q4)}


# PAGEDKV_DENSE_WEIGHTS for one form of the weights in every matmul: the packed kernel ("0") or
# the dense copy ("1"). By default the form follows a matmul's row count, which changes results
# by float rounding (test_dense_weights.py); scheduling must change nothing within one form.
FORMS = {"packed": "0", "dense": "1"}


def quantized_llm(models: dict[str, str], quantization: str, form: str, **options) -> LLM:
    options.setdefault("num_gpu_blocks_override", 256)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_DENSE_WEIGHTS", FORMS[form])
        return LLM(models[quantization], quantization=quantization, dtype="float32", **options)


@pytest.fixture(scope="module")
def references(quantized_models) -> dict[tuple[str, str], list[list[int]]]:
    """Greedy outputs per (quantization, form), one prompt at a time, with a roomy pool."""
    refs = {}
    for q in quantized_models:
        for form in FORMS:
            llm = quantized_llm(quantized_models, q, form)
            o_proj = llm.engine.loaded.model.layers[0].o_proj
            assert not isinstance(o_proj, torch.Tensor)
            assert (o_proj.dense is None) == (form == "packed")
            refs[q, form] = [
                llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS
            ]
    return refs


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("quantization", ["int8", "gguf"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_quantized_outputs(
    quantized_models, references, quantization, form, mode, one_torch_thread
):
    llm = quantized_llm(
        quantized_models,
        quantization,
        form,
        num_gpu_blocks_override=24,
        block_size=4,
        preemption_mode=mode,
        swap_space="64MiB",
        max_num_batched_tokens=32,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == references[quantization, form]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_prefix_cache_keeps_quantized_outputs(
    quantized_models, references, quantization, form, one_torch_thread
):
    llm = quantized_llm(
        quantized_models, quantization, form, block_size=4, max_num_batched_tokens=7
    )
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert again[3].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in first] == references[quantization, form]
    assert [o.outputs[0].token_ids for o in again] == references[quantization, form]


def test_bad_quantization_values(tiny_model_dir):
    with pytest.raises(ConfigError, match="--quantization must be one of"):
        LLM(tiny_model_dir, quantization="foo")
    with pytest.raises(ConfigError, match="needs a .gguf model"):
        load_model(tiny_model_dir, torch.float32, quantization="gguf")
    for args in (
        ["--quantization", "foo"],
        ["--model", str(tiny_model_dir), "--quantization", "gguf"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "pagedkv.cli", "generate", *args, "--prompt", "hi"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "quantization" in r.stderr


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 blocks, Q8_0 embedding) -----------------------


@pytest.fixture(scope="module")
def smol_gguf():
    return load_model(None, torch.float32)  # no quantization: load_model's default is "none"


@pytest.mark.slow
def test_default_model_gguf_blocks_follow_the_dequantized_model(smol_gguf, one_torch_thread):
    q = load_model(None, torch.float32, quantization=None)  # None: the default for a GGUF on CPU
    assert q.quantization == "gguf" and isinstance(q.model.layers[0].gate_up_proj, Int4Weight)
    assert isinstance(q.model.embed_tokens, Int8Weight) and q.model.lm_head is q.model.embed_tokens
    copies = sum(0 if w.dense is None else w.dense.nbytes for w in packed_weights(q.model))
    assert q.model.weight_bytes() - copies < 100e6 < 0.5 * smol_gguf.model.weight_bytes()
    tok = q.tokenizer
    # (prompts whose next tokens are no near-tie: "What is the capital of France?" starts with a
    # 0.08 logit margin between two answers in float32, so any rounding may pick either)
    chats = ["Write a haiku about memory.", "List three prime numbers."]
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for c in chats
    ]
    want = PagedDriver(smol_gguf, 16, 64).greedy([Seq(list(p)) for p in prompts], 12)
    got = PagedDriver(q, 16, 64).greedy([Seq(list(p)) for p in prompts], 12)
    assert [g[:8] for g in got] == [w[:8] for w in want]
    llm = LLM(num_gpu_blocks_override=64)  # the engine's default: gguf blocks
    assert llm.engine.loaded.quantization == "gguf"
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert "Paris" in out[0].outputs[0].text


def test_weight_bytes_in_plan_stats_and_metrics(tiny_model_dir, tiny32):
    from pagedkv.server.metrics import ServerMetrics
    from pagedkv.sim.shapes import resolve_shape

    plain = resolve_shape(str(tiny_model_dir))
    # one byte per weight, plus two for the dense copy unless PAGEDKV_DENSE_WEIGHTS=0
    for setting, per_weight in (("0", 1), ("auto", 3)):
        r = subprocess.run(
            [sys.executable, "-m", "pagedkv.cli", "plan", "--model", str(tiny_model_dir)]
            + ["--quantization", "int8", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PAGEDKV_DENSE_WEIGHTS": setting},
        )
        assert r.returncode == 0, r.stderr
        assert f'"weight_bytes": {per_weight * plain.num_params}' in r.stdout
    llm = LLM(tiny_model_dir, quantization="int8", dtype="float32", num_gpu_blocks_override=64)
    held = llm.engine.stats().model_weight_bytes
    # int8 and its copy: 3 bytes a weight against 4 in float32 (5 where the copy is float32)
    size = 1 + copy_dtype(torch.float32).itemsize
    assert (
        held
        == llm.engine.loaded.model.weight_bytes()
        < (size + 0.5) / 4 * tiny32.model.weight_bytes()
    )
    from pagedkv.engine.async_engine import AsyncLLM

    text = ServerMetrics(AsyncLLM(llm.engine.config, llm.engine), "tiny").render()[0].decode()
    assert f'pagedkv:model_weight_bytes{{model_name="tiny"}} {float(held)}' in text
