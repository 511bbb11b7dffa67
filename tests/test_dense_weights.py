"""Packed weights with a dense copy: a matmul of few rows runs the packed kernel, one of many the
copy; both paths are used, agree to float rounding, are counted in memory, and the crossover is
measured once and cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_model_vs_hf import PagedDriver, Seq

from pagedkv.config import ConfigError
from pagedkv.model import dense_weights
from pagedkv.model.loader import load_model
from pagedkv.model.quant_linear import ACT_DTYPE, Int4Weight, Int8Weight, PackedWeight, linear
from pagedkv.sim.shapes import resolve_shape

FROM = 5  # PAGEDKV_DENSE_WEIGHTS in these tests: the copy from 5 rows up
PROMPT = "Paged attention keeps the KV cache in blocks. Hello world!"


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """quantization -> a tiny random-weight model: the HF folder (int8), its Q4_0 GGUF (gguf)."""
    from test_loaders import hf_to_gguf

    out = tmp_path_factory.mktemp("q4") / "tiny.Q4_0.gguf"
    return {"int8": tiny_model_dir, "gguf": str(hf_to_gguf(Path(tiny_model_dir), out, QT.Q4_0))}


def load(path: str, quantization: str, setting: str, dtype: torch.dtype = torch.float32):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_DENSE_WEIGHTS", setting)
        return load_model(path, dtype, quantization=quantization)


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_few_rows_run_packed_many_rows_dense_and_both_agree(models, quantization, one_torch_thread):
    lm = load(models[quantization], quantization, str(FROM))
    weights = dense_weights.packed_weights(lm.model)
    kinds = {type(w) for w in weights}
    assert kinds == ({Int8Weight} if quantization == "int8" else {Int4Weight})
    torch.manual_seed(0)
    for w in weights:
        assert w.dense is not None and w.dense_from == FROM
        assert w.dense_dtype == dense_weights.copy_dtype(torch.float32)
        for rows in (1, FROM - 1, FROM, 3 * FROM):
            x = torch.randn(rows, w.shape[1])
            got, xb = w.mm(x), x.to(ACT_DTYPE)
            # (float32 as it is where the packed kernel takes it: our int4 GEMM)
            packed = w.packed_mm(x if w.takes(x.dtype) else xb).float()
            dense = linear(x.to(w.dense_dtype), w.dense).float()
            # the path taken is the one the row count asks for, bit for bit ...
            assert torch.equal(got, dense if rows >= FROM else packed)
            # ... and the other one agrees to bfloat16 rounding (weights and output)
            tol = 2**-7 * (xb.float().abs() @ w.dequantize().abs().t()) + 1e-6
            assert ((packed - dense).abs() <= tol).all()
            if w.shape[0] >= 128:  # rows 64:128 alone (how calibration times a big matrix)
                part = w.part(64, 128)
                assert torch.equal(part.packed_mm(xb), w.packed_mm(xb)[:, 64:128])
                assert torch.equal(part.mm(x), got[:, 64:128])


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_a_step_of_many_rows_matches_the_packed_model(models, quantization, one_torch_thread):
    """The same steps through the mixed model (prompt rows dense, one-row decodes packed) and the
    packed-only model: logits within float rounding, the same greedy tokens."""
    mixed = load(models[quantization], quantization, str(FROM))
    packed = load(models[quantization], quantization, "0")
    assert all(w.dense is None for w in dense_weights.packed_weights(packed.model))
    ids = mixed.tokenizer.encode(PROMPT)
    assert len(ids) >= FROM
    drivers = [PagedDriver(m, 16) for m in (mixed, packed)]
    seqs = [Seq(list(ids)) for _ in drivers]
    for step in range(4):
        logits = [d.step([(s, len(s.tokens) - s.computed)]) for d, s in zip(drivers, seqs)]
        a, b = logits
        assert (a - b).abs().max() < 0.02 * b.abs().max(), step
        top2 = b[0].topk(2).values
        if top2[0] - top2[1] > 0.05 * b.abs().max():  # no near-tie: the same token
            assert a[0].argmax() == b[0].argmax()
        for s in seqs:
            s.tokens.append(int(b[0].argmax()))


def test_memory_counts_the_copies_in_plan_and_model(models, monkeypatch):
    for setting in ("0", str(FROM)):
        monkeypatch.setenv("PAGEDKV_DENSE_WEIGHTS", setting)
        lm = load(models["gguf"], "gguf", setting, torch.bfloat16)  # plan's model dtype
        weights = dense_weights.packed_weights(lm.model)
        copies = sum(w.shape[0] * w.shape[1] * 2 for w in weights) if setting != "0" else 0
        assert all(w.dense_dtype == torch.bfloat16 for w in weights)  # a bf16 model's copies
        assert sum(w.nbytes for w in weights) == sum(w.packed_nbytes for w in weights) + copies
        planned = resolve_shape(models["gguf"], quantization="gguf").weight_bytes
        assert planned == lm.model.weight_bytes()  # what `pagedkv plan` says is what is held


def test_auto_measures_once_then_reads_the_cache(models, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_EXT_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDKV_DENSE_WEIGHTS", raising=False)
    lm = load_model(models["gguf"], torch.float32, quantization="gguf")
    cache = json.loads((tmp_path / "dense_weights.json").read_text())
    (key, entry), *others = cache.items()
    assert not others and ":Int4Weight" in key  # one kind of packed weight in this model
    timings = entry["timings"]
    assert set(timings) == {"rows", "packed", "dense"} and timings["rows"][0] == 1
    assert entry["dense_from"] == dense_weights.crossover(timings)
    weights = dense_weights.packed_weights(lm.model)
    assert {w.dense_from for w in weights} == {entry["dense_from"]}
    # a later start reads the verdict (here an edited one) without measuring
    entry["dense_from"] = 7
    (tmp_path / "dense_weights.json").write_text(json.dumps(cache))
    monkeypatch.setattr(dense_weights, "time_both", lambda w, d: pytest.fail("measured again"))
    lm = load_model(models["gguf"], torch.float32, quantization="gguf")
    assert {w.dense_from for w in dense_weights.packed_weights(lm.model)} == {7}


def test_crossover_is_where_the_copy_wins_from_then_on():
    def timings(packed: list[float], dense: list[float]) -> dict[str, list]:
        return {"rows": [1, 2, 4, 8, 16][: len(packed)], "packed": packed, "dense": dense}

    assert dense_weights.crossover(timings([1, 2, 4, 8], [3, 3, 3.5, 4])) == 4
    # a win at 1 row that does not last (noise, or a slow kernel for one row) is not a crossover
    assert dense_weights.crossover(timings([5, 2, 4, 8, 16], [4, 3, 5, 6, 7])) == 8
    assert dense_weights.crossover(timings([1, 2], [3, 3])) == dense_weights.NEVER


def test_a_copy_that_never_wins_is_dropped(models, monkeypatch):
    monkeypatch.setattr(dense_weights, "measured_crossover", lambda k, w, d: dense_weights.NEVER)
    monkeypatch.delenv("PAGEDKV_DENSE_WEIGHTS", raising=False)
    lm = load_model(models["int8"], torch.float32, quantization="int8")
    assert all(w.dense is None for w in dense_weights.packed_weights(lm.model))


def test_copies_are_bf16_where_onednn_prepacks_else_the_models_float32(models, monkeypatch):
    """A float32 model keeps float32 copies only where bf16 GEMMs are slow (no oneDNN bf16)."""
    from pagedkv.model import prepacked

    monkeypatch.setenv("PAGEDKV_DENSE_WEIGHTS", str(FROM))
    try:
        for on in (True, False):
            monkeypatch.setenv(prepacked.ENV, "" if on else "0")
            prepacked.form.cache_clear()
            for dtype in (torch.float32, torch.bfloat16):
                lm = load_model(models["int8"], dtype, quantization="int8")
                want = (
                    torch.float32
                    if dtype == torch.float32 and not prepacked.supported()
                    else ACT_DTYPE
                )
                weights = dense_weights.packed_weights(lm.model)
                assert {w.dense_dtype for w in weights} == {want}, (on, dtype)
                assert {w.dense.nbytes for w in weights[:1]} == {
                    weights[0].shape[0] * weights[0].shape[1] * want.itemsize
                }
    finally:
        monkeypatch.delenv(prepacked.ENV)
        prepacked.form.cache_clear()


def test_bad_setting_is_a_one_line_error(models, monkeypatch):
    monkeypatch.setenv("PAGEDKV_DENSE_WEIGHTS", "some")
    with pytest.raises(ConfigError, match="PAGEDKV_DENSE_WEIGHTS must be auto, 0"):
        load_model(models["int8"], torch.float32, quantization="int8")
    r = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "plan", "--model", models["gguf"]],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PAGEDKV_DENSE_WEIGHTS": "some"},
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


# Which rows share a byte in torch's packed int4 layout depends on the CPU kernel it dispatches to
# (ATEN_CPU_CAPABILITY); unpacking for embeddings and the dense copy must follow each.
LAYOUT_CHECK = """
import torch
from pagedkv.model.quant_linear import ACT_DTYPE, Blocks, pack_int4
q = torch.randint(0, 16, (192, 64), dtype=torch.uint8)
b = Blocks(q, torch.rand(192, 2), torch.rand(192, 2), 32, 4)
w = pack_int4(b)
kernel = w.packed_mm(torch.eye(64, dtype=ACT_DTYPE)).t()
assert torch.equal(w.dequantize().to(ACT_DTYPE), kernel)
ids = torch.tensor([0, 1, 31, 32, 63, 64, 100, 191])
assert torch.equal(w.rows(ids, ACT_DTYPE), kernel[ids])
print(torch.backends.cpu.get_cpu_capability())
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_int4_unpacking_follows_each_cpu_kernels_layout(capability):
    r = subprocess.run(
        [sys.executable, "-c", LAYOUT_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    if r.stdout.strip().lower() != capability:
        pytest.skip(f"this CPU runs {r.stdout.strip()}, not {capability}")


def test_packed_weights_are_found_once(models):
    lm = load(models["gguf"], "gguf", "0")
    weights = dense_weights.packed_weights(lm.model)
    assert all(isinstance(w, PackedWeight) for w in weights)
    assert len({id(w) for w in weights}) == len(weights)
    if lm.config.tie_word_embeddings:
        assert sum(w is lm.model.embed_tokens for w in weights) == 1
