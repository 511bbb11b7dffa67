"""The fused C++ layer ops (csrc/layer_ops.cpp) against their torch paths in model/ops.py and
attention/store.py (RoPE with the K/V store)."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedkv import native
from pagedkv.attention.store import rope_and_store, write_kv
from pagedkv.model import ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32 agrees to rounding; the half types may differ by one unit in the last place where the
# two paths round an intermediate differently.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _need_library() -> None:
    assert native.available(), "the compiler is installed here, so the library must build"


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch):
    """Runs a call on the torch path of model/ops.py or attention/store.py."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(native, "library_for", lambda *tensors: None)
            return fn(*args, **kwargs)

    return run


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp(min=1.0)
    err = (got.float() - want.float()).abs().max() / scale
    assert err <= TOL[dtype], (float(err), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 100), (300, 64)])
def test_rms_norm_with_and_without_residual(dtype, rows, n, torch_path, kernel_isa) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, n + 8, generator=gen).to(dtype)
    x = wide[:, 3 : 3 + n]  # rows of a wider tensor: the C++ path reads strided rows
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    residual = torch.randn(rows, n, generator=gen).to(dtype)

    got, got_res = ops.rms_norm(x, weight, 1e-5)
    want, want_res = torch_path(ops.rms_norm, x, weight, 1e-5)
    close(got, want, dtype)
    assert got_res is x and want_res is x

    mine, theirs = residual.clone(), residual.clone()
    got, got_res = ops.rms_norm(x, weight, 1e-5, mine)
    want, want_res = torch_path(ops.rms_norm, x, weight, 1e-5, theirs)
    assert got_res is mine and want_res is theirs
    assert torch.equal(mine, theirs), "the residual add rounds once, the same way on both paths"
    assert torch.equal(mine, residual + x)
    close(got, want, dtype)

    # Granite's residual_multiplier: x scaled and rounded, then added (transformers' order)
    mine, theirs = residual.clone(), residual.clone()
    got, _ = ops.rms_norm(x, weight, 1e-5, mine, x_scale=0.22)
    want, _ = torch_path(ops.rms_norm, x, weight, 1e-5, theirs, x_scale=0.22)
    assert torch.equal(mine, theirs) and torch.equal(mine, residual + x * 0.22)
    close(got, want, dtype)


def test_rms_norm_matches_the_formula_in_float64() -> None:
    x = torch.randn(5, 64, dtype=torch.float32)
    w = torch.rand(64) + 0.5
    got, _ = ops.rms_norm(x, w, 1e-6)
    xd = x.double()
    want = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("act", [ops.silu_mul, ops.gelu_tanh_mul])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (9, 40), (200, 256)])
def test_silu_mul(act, dtype, rows, n, torch_path, kernel_isa) -> None:
    """SiLU (Llama's) or GELU with tanh (Gemma's) of the gate, times up: as torch's."""
    gen = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(rows, 2 * n, generator=gen) * 6).to(dtype)  # both tails of the sigmoid
    got = act(gate_up)
    want = torch_path(act, gate_up)
    close(got, want, dtype)


@pytest.mark.parametrize("gelu", [False, True])
def test_silu_mul_extremes(gelu, kernel_isa) -> None:
    gate = torch.tensor([[-1e4, -90.0, -1.0, -1e-4, 0.0, 1e-4, 1.0, 90.0, 1e4, -0.0]])
    up = torch.full_like(gate, 2.0)
    got = ops.silu_mul(torch.cat([gate, up], dim=1), gelu=gelu)
    f = torch.nn.functional
    want = (f.gelu(gate, approximate="tanh") if gelu else f.silu(gate)) * up
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30)


def _rotary_tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(max_pos).float(), inv)
    ang = torch.cat([ang, ang], dim=-1)
    half = head_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return ang.cos(), ang.sin() * sign


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (50, 4, 2, 40), (7, 2, 2, 128)]
)
@pytest.mark.parametrize("partial", [False, True])
def test_rope_and_store_equals_torch_rotation_and_write(
    dtype, tokens, heads, kv_heads, head_dim, partial, torch_path, kernel_isa
) -> None:
    """HF's rotation, then the cache write; with `partial`, RoPE on the first 3/4 of each head
    only (Phi-4-mini's partial_rotary_factor), the rest of it passed through."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    rotary = head_dim * 3 // 4 if partial else head_dim  # (40 -> 30: not whole vectors)
    cos, sin = _rotary_tables(256, rotary)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    num_blocks, block_size = 12, 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    mine = qkv.clone()
    q = rope_and_store(mine, heads, kv_heads, positions, cos, sin, (k_cache, v_cache), slots)
    assert q.data_ptr() == mine.data_ptr() and q.shape == (tokens, heads, head_dim)

    # the reference: HF's rotation in float32, then the torch cache write
    x = qkv.float().view(tokens, -1, head_dim)[:, : heads + kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    turned = x[..., :rotary] * c + x[..., :rotary].roll(rotary // 2, dims=-1) * s
    rotated = torch.cat([turned, x[..., rotary:]], dim=-1).to(dtype)
    close(mine.view(tokens, -1, head_dim)[:, : heads + kv_heads], rotated, dtype)
    assert torch.equal(
        mine[:, (heads + kv_heads) * head_dim :], qkv[:, (heads + kv_heads) * head_dim :]
    ), "v untouched"
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    heads_view = mine.view(tokens, -1, head_dim)
    write_kv(
        want_k,
        want_v,
        heads_view[:, heads : heads + kv_heads],
        heads_view[:, heads + kv_heads :],
        slots,
    )
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

    # the torch path of the same function: rotation to rounding, the same store
    theirs, k_torch, v_torch = qkv.clone(), torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    torch_path(
        rope_and_store, theirs, heads, kv_heads, positions, cos, sin, (k_torch, v_torch), slots
    )
    close(theirs, mine, dtype)
    close(k_torch, k_cache, dtype)
    assert torch.equal(v_torch, v_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,norm", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("cache", ["float", "int8"])
def test_rope_and_store_with_bias_and_qk_norm(dtype, bias, norm, cache, torch_path, kernel_isa):
    """Qwen2's q/k/v bias and Qwen3's per-head q/k RMSNorm, applied before the rotation, as
    transformers applies them, on every ISA, into a plain and a quantized cache."""
    from pagedkv.attention.store import QKNorm
    from pagedkv.kvstore.quant import INT8, QuantizedCache

    # (the quantized cache's rotation takes power-of-two heads; 40 has a partial vector)
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 32 if cache == "int8" else 40
    gen = torch.Generator().manual_seed(head_dim + 2 * bias + norm)
    cos, sin = _rotary_tables(64, head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    b = (torch.randn(width, generator=gen) * 3).to(dtype) if bias else None
    qk = None
    if norm:
        q_w, k_w = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype) for _ in range(2))
        qk = QKNorm(q_w, k_w, 1e-6)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(32, generator=gen)[:tokens]

    def caches():
        if cache == "int8":
            shape = (4, kv_heads, 8, head_dim)
            return tuple(
                QuantizedCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:3]), INT8)
                for _ in "kv"
            )
        return tuple(torch.zeros(4, kv_heads, 8, head_dim, dtype=dtype) for _ in "kv")

    mine, mine_cache = qkv.clone(), caches()
    rope_and_store(mine, heads, kv_heads, positions, cos, sin, mine_cache, slots, b, qk)

    # the reference: transformers' order (bias in the projection, norm per head, then RoPE)
    x = qkv.float() + (b.float() if bias else 0)
    x = x.to(dtype).float().view(tokens, -1, head_dim)
    if norm:
        for part, w in ((slice(0, heads), q_w), (slice(heads, heads + kv_heads), k_w)):
            h = x[:, part]
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            x[:, part] = (w * h).float()
    qk_part = x[:, : heads + kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x[:, : heads + kv_heads] = qk_part * c + qk_part.roll(head_dim // 2, dims=-1) * s
    close(mine, x.reshape(tokens, width).to(dtype), dtype)

    theirs, their_cache = qkv.clone(), caches()
    torch_path(
        rope_and_store, theirs, heads, kv_heads, positions, cos, sin, their_cache, slots, b, qk
    )
    close(theirs, mine, dtype)
    for ours, ref in zip(mine_cache, their_cache):
        got, want = (
            c.dequantize(torch.arange(4), torch.float32) if cache == "int8" else c
            for c in (ours, ref)
        )
        assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()
        assert got.abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_without_tables_stores_unturned(dtype, torch_path, kernel_isa) -> None:
    """A NoPE layer (SmolLM3's every 4th): no tables, so q and k stay as projected and k and v
    are stored as they are, the Qwen3-style norm still applied."""
    from pagedkv.attention.store import QKNorm

    tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    slots = torch.randperm(32, generator=gen)[:tokens]
    positions = torch.tensor([0, 3, 1000, 7, 2])  # (no table to be outside of)
    ones = QKNorm(*(torch.ones(head_dim, dtype=dtype) for _ in "qk"), 1e-6)
    for norm in (None, ones):
        outs = []
        for run in (rope_and_store, functools.partial(torch_path, rope_and_store)):
            mine = qkv.clone()
            cache = tuple(torch.zeros(4, kv_heads, 8, head_dim, dtype=dtype) for _ in "kv")
            run(mine, heads, kv_heads, positions, None, None, cache, slots, None, norm)
            outs.append((mine, cache))
            x = qkv.float().view(tokens, -1, head_dim)
            if norm is not None:  # (weights of one: just the RMS scaling of each q and k head)
                qk = x[:, : heads + kv_heads]
                x[:, : heads + kv_heads] = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6)
            close(mine, x.reshape(tokens, -1).to(dtype), dtype)
            want = tuple(torch.zeros_like(c) for c in cache)
            heads_view = mine.view(tokens, -1, head_dim)
            write_kv(
                *want,
                heads_view[:, heads : heads + kv_heads],
                heads_view[:, heads + kv_heads :],
                slots,
            )
            assert all(torch.equal(a, b) for a, b in zip(cache, want))
        close(outs[0][0], outs[1][0], dtype)


def test_rope_and_store_rejects_bad_indices() -> None:
    cos, sin = _rotary_tables(16, 8)
    qkv = torch.randn(2, 3 * 8)
    cache = torch.zeros(2, 1, 4, 8)
    kv_cache = (cache, cache.clone())
    with pytest.raises(native.KernelError, match="position 16 is outside the rotary table of 16"):
        rope_and_store(qkv, 1, 1, torch.tensor([0, 16]), cos, sin, kv_cache, torch.tensor([0, 1]))
    with pytest.raises(native.KernelError, match="slot 8 is outside the cache of 8 slots"):
        rope_and_store(qkv, 1, 1, torch.tensor([0, 1]), cos, sin, kv_cache, torch.tensor([8, 0]))
    for bad in (3, 10):  # odd, and more than the head
        c3, s3 = torch.ones(16, bad), torch.zeros(16, bad)
        with pytest.raises(native.KernelError, match=f"rotary_dim {bad}: not an even count"):
            rope_and_store(qkv, 1, 1, torch.tensor([0, 1]), c3, s3, kv_cache, torch.tensor([0, 1]))
    assert torch.equal(cache, torch.zeros_like(cache)), "nothing is written when an index is bad"
