"""`--dtype auto` on CPU is measured: the faster dtype for this model's matmuls, cached per CPU and shape."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.model import dtype_choice
from pagedkv.model.config import LlamaConfig
from pagedkv.model.loader import resolve_dtype

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
)


def small_config() -> LlamaConfig:
    return LlamaConfig(**SMALL)


def test_pick_is_the_lower_geometric_mean_over_batch_sizes():
    # bf16 wins batch 1 by 2x but loses batched steps by 3x: float32 over both
    assert (
        dtype_choice.pick({"float32": {"1": 2.0, "32": 1.0}, "bfloat16": {"1": 1.0, "32": 3.0}})
        == "float32"
    )
    assert (
        dtype_choice.pick({"float32": {"1": 2.0, "32": 1.0}, "bfloat16": {"1": 1.0, "32": 1.5}})
        == "bfloat16"
    )


def test_layer_shapes_follow_the_model():
    shapes = dtype_choice.layer_shapes(small_config())
    assert shapes == [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]


def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_EXT_DIR", str(tmp_path))
    monkeypatch.setattr(dtype_choice, "MIN_BYTES", 1 << 20)  # a small trial keeps the test quick
    cfg = small_config()
    first = resolve_dtype("auto", "cpu", cfg)
    assert first in (torch.float32, torch.bfloat16)
    cache = json.loads((tmp_path / "dtype.json").read_text())
    (entry,) = cache.values()
    assert entry["dtype"] == str(first).removeprefix("torch.")
    assert set(entry["timings"]) == {"float32", "bfloat16"}
    assert all(v > 0 for t in entry["timings"].values() for v in t.values())
    # the cached verdict is what later starts use, without measuring again
    other = "float32" if first == torch.bfloat16 else "bfloat16"
    entry["dtype"] = other
    (tmp_path / "dtype.json").write_text(json.dumps(cache))
    monkeypatch.setattr(dtype_choice, "measure", lambda shapes: pytest.fail("measured again"))
    assert resolve_dtype("auto", "cpu", cfg) == getattr(torch, other)
    # a damaged cache file is measured again, not trusted
    (tmp_path / "dtype.json").write_text("{not json")
    monkeypatch.setattr(
        dtype_choice,
        "measure",
        lambda shapes: {"float32": {"1": 1.0, "32": 1.0}, "bfloat16": {"1": 2.0, "32": 2.0}},
    )
    assert resolve_dtype("auto", "cpu", cfg) == torch.float32


def test_a_forced_kernel_isa_is_another_machine_to_the_cache(monkeypatch):
    """A verdict measured with our kernels built for AVX-512 must not serve a run forced to AVX2."""
    from pagedkv.model.calibration_cache import cpu_identity

    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    native = cpu_identity()
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx2")
    assert cpu_identity() != native


def test_explicit_dtypes_are_never_measured(monkeypatch):
    monkeypatch.setattr(dtype_choice, "measure", lambda shapes: pytest.fail("measured"))
    assert resolve_dtype("float32", "cpu", small_config()) == torch.float32
    assert resolve_dtype("bfloat16", "cpu", small_config()) == torch.bfloat16
