"""Paged attention equals plain contiguous attention, wherever the blocks lie."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.attention import paged
from pagedkv.attention.paged import AttentionMetadata, contiguous_attention, paged_attention
from pagedkv.attention.store import write_kv
from pagedkv.kvstore.storage import KVStorage

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def naive_attention(q, k, v, scale, offset, window=0, softcap=0.0):
    """Float64 softmax(q k^T) v with an explicit causal mask (and window, and Gemma 2's soft-capped
    scores): the oracle for contiguous_attention."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(q.shape[0])[:, None] + offset
    keys = torch.arange(k.shape[0])[None, :]
    hidden = (keys > qpos) | ((keys <= qpos - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedBatch:
    """Sequences of random K/V scattered over shuffled physical blocks, with the step's metadata."""

    def __init__(
        self,
        ctx_lens: list[int],
        query_lens: list[int],
        block_size: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        need = [-(-n // block_size) for n in ctx_lens]
        num_blocks = sum(need) + 3
        physical = list(range(num_blocks))
        rng.shuffle(physical)
        self.k_cache = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.ks, self.vs, self.qs, tables, slots = [], [], [], [], []
        for n, qlen in zip(ctx_lens, query_lens):
            table = [physical.pop() for _ in range(-(-n // block_size))]
            tables.append(table)
            self.ks.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
            self.vs.append(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype))
            self.qs.append(torch.randn(qlen, num_q_heads, head_dim, generator=gen).to(dtype))
            slots.append(
                torch.tensor(
                    [table[p // block_size] * block_size + p % block_size for p in range(n)]
                )
            )
            # the cached prefix is already in the cache; the new tokens are written by the step
            cached = n - qlen
            write_kv(
                self.k_cache,
                self.v_cache,
                self.ks[-1][:cached],
                self.vs[-1][:cached],
                slots[-1][:cached],
            )
        self.new_k = torch.cat([k[n - q :] for k, n, q in zip(self.ks, ctx_lens, query_lens)])
        self.new_v = torch.cat([v[n - q :] for v, n, q in zip(self.vs, ctx_lens, query_lens)])
        width = max(len(t) for t in tables)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens).cumsum(0)
        self.meta = AttentionMetadata(
            slot_mapping=torch.cat([s[n - q :] for s, n, q in zip(slots, ctx_lens, query_lens)]),
            query_start_loc=qsl,
            seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            query_lens=list(query_lens),
            seq_lens_list=list(ctx_lens),
            block_size=block_size,
            is_decode=all(q == 1 for q in query_lens),
        )
        self.ctx_lens, self.query_lens = ctx_lens, query_lens

    def run(self, scale: float) -> torch.Tensor:
        write_kv(self.k_cache, self.v_cache, self.new_k, self.new_v, self.meta.slot_mapping)
        return paged_attention(torch.cat(self.qs), self.k_cache, self.v_cache, self.meta, scale)

    def reference(self, scale: float) -> torch.Tensor:
        return torch.cat(
            [
                contiguous_attention(q, k, v, scale, n - q.shape[0])
                for q, k, v, n in zip(self.qs, self.ks, self.vs, self.ctx_lens)
            ]
        )


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (3, 0.0), (0, 1.0), (4, 1.5)])
def test_contiguous_attention_matches_naive_softmax(window, softcap):
    gen = torch.Generator().manual_seed(0)
    for qlen, klen in [(7, 7), (5, 12), (1, 9)]:
        q = torch.randn(qlen, 6, 16, generator=gen)
        k, v = torch.randn(2, klen, 2, 16, generator=gen)
        got = contiguous_attention(q, k, v, 0.5, klen - qlen, window, softcap)
        want = naive_attention(q, k, v, 0.5, klen - qlen, window, softcap)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        plain = naive_attention(q, k, v, 0.5, klen - qlen)
        assert torch.allclose(got.double(), plain, atol=1e-3) == (not window and not softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_paged_equals_contiguous(dtype, block_size, kind, decode_backend):
    rng = random.Random(block_size * 7 + len(kind))
    n = 5
    ctx = [rng.randint(1, 600) for _ in range(n)]
    if kind == "prefill":  # some whole prompts, some with a cached prefix
        qlens = [c if i % 2 else rng.randint(1, c) for i, c in enumerate(ctx)]
    elif kind == "decode":
        qlens = [1] * n
    else:  # prefill with cached prefix, fresh prefill and decodes in one step
        qlens = [rng.randint(1, c) if i == 0 else (c if i == 1 else 1) for i, c in enumerate(ctx)]
    batch = PagedBatch(
        ctx,
        qlens,
        block_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=32,
        dtype=dtype,
        seed=block_size + n,
    )
    got, want = batch.run(0.18), batch.reference(0.18)
    assert got.shape == want.shape == (sum(qlens), 8, 32)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_gqa_and_partly_filled_blocks(num_q_heads, num_kv_heads, decode_backend):
    # lengths that end mid-block and exactly on block boundaries, decode and prefill
    for qlens_of in (lambda c: [1] * len(c), lambda c: c):
        ctx = [1, 15, 16, 17, 33, 48]
        batch = PagedBatch(
            ctx, qlens_of(ctx), 16, num_q_heads, num_kv_heads, 64, torch.float32, seed=3
        )
        torch.testing.assert_close(batch.run(0.125), batch.reference(0.125), atol=2e-5, rtol=2e-5)


def test_prefill_in_query_chunks(monkeypatch):
    # A small score budget splits each prompt into chunks of a few queries, each seeing only its keys.
    monkeypatch.setattr(paged, "_SCORE_BYTES", 4 * 8 * 300 * 7)
    batch = PagedBatch([300, 130, 57], [300, 45, 57], 16, 8, 2, 32, torch.float32, seed=9)
    torch.testing.assert_close(batch.run(0.2), batch.reference(0.2), atol=2e-5, rtol=2e-5)


def test_write_kv_puts_each_token_in_its_slot():
    k_cache = torch.zeros(4, 2, 8, 3)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(1, 5 * 2 * 3 + 1, dtype=torch.float32).view(5, 2, 3)
    slots = torch.tensor([31, 0, 9, 17, 8])
    write_kv(k_cache, v_cache, k, -k, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 8, :, s % 8], k[i])
        assert torch.equal(v_cache[s // 8, :, s % 8], -k[i])
    assert (
        k_cache.count_nonzero() == k.numel() and v_cache.count_nonzero() == k.numel()
    )  # nothing else touched


def test_decode_ignores_padding_and_stale_blocks(decode_backend):
    # Garbage in unused blocks and past each sequence's length must not leak into the result.
    batch = PagedBatch([5, 40], [1, 1], 16, 4, 2, 16, torch.float32, seed=5)
    want = batch.reference(0.3)
    batch.k_cache[batch.k_cache == 0] = 1e4
    batch.v_cache[batch.v_cache == 0] = 1e4
    torch.testing.assert_close(batch.run(0.3), want)


def test_kv_storage_views_copy_and_block_io():
    st = KVStorage(
        num_layers=3, num_blocks=6, num_kv_heads=2, block_size=4, head_dim=5, dtype=torch.float32
    )
    st.data.copy_(torch.randn(st.data.shape))
    k1, v1 = st.layer(1)
    assert k1.shape == (6, 2, 4, 5) and k1.data_ptr() == st.kv_caches[1][0].data_ptr()
    assert torch.equal(v1, st.data[1, 1])
    before = st.data.clone()
    st.copy_blocks([(0, 3), (2, 5)])
    assert torch.equal(st.data[:, :, 3], before[:, :, 0]) and torch.equal(
        st.data[:, :, 5], before[:, :, 2]
    )
    assert torch.equal(st.data[:, :, [0, 1, 2, 4]], before[:, :, [0, 1, 2, 4]])
    blocks = st.read_blocks([4, 1])
    assert blocks.shape == (2, 3, 2, 2, 4, 5) and blocks.is_contiguous()
    assert torch.equal(blocks[0, 2, 1], st.data[2, 1, 4])
    host = KVStorage(3, 2, 2, 4, 5, "float32")  # swap space: same layout on the CPU
    host.write_blocks([1, 0], blocks)
    assert torch.equal(host.read_blocks([1, 0]), blocks)
    st.write_blocks([0, 2], host.read_blocks([0, 1]))
    assert torch.equal(st.data[:, :, 0], before[:, :, 1]) and torch.equal(
        st.data[:, :, 2], before[:, :, 4]
    )
    per_block = KVStorage.bytes_per_block(3, 2, 4, 5, torch.bfloat16)
    assert per_block == 2 * 3 * 2 * 4 * 5 * 2 == blocks[0].numel() * 2
    assert KVStorage.bytes_per_token(3, 2, 5, torch.bfloat16) * 4 == per_block
