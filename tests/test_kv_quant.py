"""Quantized KV cache (fp8, int8): error bounds, per-token scales, attention, block moves, the engine."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.paged import AttentionMetadata, contiguous_attention, paged_attention
from pagedkv.attention.rotation import hadamard, rotate, unrotate
from pagedkv.attention.store import write_kv
from pagedkv.kv.hashing import hash_block_tokens
from pagedkv.kvstore.quant import FP8, INT8, QuantizedCache
from pagedkv.kvstore.storage import KVStorage
from pagedkv.sim.plan import kv_bytes_per_block
from pagedkv.sim.shapes import KNOWN_SHAPES

FORMATS = {"fp8": FP8, "int8": INT8}
BS = 16


def cache(fmt, num_blocks=8, heads=2, dim=32) -> QuantizedCache:
    return QuantizedCache(
        torch.zeros(num_blocks, heads, BS, dim, dtype=fmt.dtype),
        torch.zeros(num_blocks, heads, BS),
        fmt,
    )


def values(c: QuantizedCache, blocks) -> torch.Tensor:
    """Dequantized blocks, rotated back: [n, H, BS, D] float32."""
    x = c.dequantize(torch.as_tensor(blocks), torch.float32)
    return unrotate(x)


def write_tokens(k: QuantizedCache, v: QuantizedCache, x: torch.Tensor, slots) -> None:
    write_kv(k, v, x, -x, torch.as_tensor(slots))


# ---- formats ---------------------------------------------------------------------------------------


def test_fp8_dequantize_is_exact_for_every_code_and_scale():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scale in (2.0**-20, 1.0, FP8.max_scale):
            want = (codes.float() * scale).to(dtype)
            assert torch.equal(
                FP8.dequantize(codes, torch.tensor(scale), dtype)[finite], want[finite]
            )


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_quantize_error_bounds(name):
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    x = (
        torch.randn(64, 64, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    )  # rows of very different size
    amax = x.abs().amax(-1, keepdim=True)
    scale = fmt.scale_for(amax)
    assert (amax / scale <= fmt.qmax * (1 + 1e-6)).all() and (
        amax / scale > fmt.qmax / (2 if fmt.pow2_scales else 1.001)
    ).all()
    err = (fmt.dequantize(fmt.quantize(x, scale), scale, torch.float32) - x).abs()
    if name == "int8":  # half a step of amax / 127
        assert (err <= scale / 2 * 1.0001).all()
    else:  # 3 mantissa bits: half an ulp, 2^-4 relative; subnormals: half of 2^-9 * scale
        assert (err <= torch.maximum(x.abs() / 16, scale * 2.0**-10)).all()
    assert err.mean() / x.abs().mean() < (0.03 if name == "fp8" else 0.01)  # measured: 0.022, 0.006
    huge = torch.tensor([[1e6, -3e5, 1.0]])  # past fp8's largest scale: saturates, stays finite
    s = fmt.scale_for(huge.abs().amax(-1, keepdim=True))
    back = fmt.dequantize(fmt.quantize(huge, s), s, torch.bfloat16).float()
    assert (
        back.isfinite().all() and (back[0, :2].abs() >= (57344 if name == "fp8" else 2.9e5)).all()
    )


def test_hadamard_is_orthonormal_for_any_head_dim():
    for dim in (64, 80, 96, 7):
        h = hadamard(dim)
        torch.testing.assert_close(h @ h.T, torch.eye(dim))
    assert (hadamard(64).abs() == 1 / 8).all()  # dense: spreads every channel over all of them


def test_rotate_is_the_product_with_the_hadamard_matrix():
    """rotate's butterflies (the same as the kernels', vec.h: hadamard) compute x @ hadamard(dim),
    and unrotate takes them back, for any head dim and float type."""
    gen = torch.Generator().manual_seed(3)
    for dim in (64, 80, 96, 7):
        x = torch.randn(5, 3, dim, generator=gen, dtype=torch.float64)
        want = x @ hadamard(dim).double()
        for dtype in (torch.float32, torch.bfloat16):
            got = rotate(x.to(dtype))
            assert got.dtype == torch.float32 and got.shape == x.shape
            exact = x.to(dtype).double() @ hadamard(dim).double()
            torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rotate(x.float()).double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(unrotate(rotate(x.float())).double(), x, atol=1e-5, rtol=1e-5)


# ---- writes: each (token, head) row on its own -------------------------------------------------------


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_token_is_stored_the_same_however_its_block_is_written(name):
    """A row's codes and scale depend on its own values only: not on the tokens written before or
    after it in its block, nor on how the block's tokens were split into writes (prompt chunks,
    decode steps, a recompute after preemption). With a scale per block grown as tokens came, a
    block written token by token held other int8 codes than one written at once."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(1)
    # each token larger than the last, so a shared scale would have to grow at every write
    x = (torch.rand(BS, 2, 32, generator=gen) + 1) * torch.linspace(1, 30, BS)[:, None, None] ** 2
    x *= torch.randint(0, 2, x.shape, generator=gen) * 2 - 1
    slots = torch.arange(3 * BS, 4 * BS)
    splits = {
        "at once": [BS],
        "token by token": [1] * BS,
        "chunks": [5, 1, 7, 3],
    }
    stored = []
    for sizes in splits.values():
        k, v = cache(fmt), cache(fmt)
        for part in torch.arange(BS).split(sizes):
            write_tokens(k, v, x[part], slots[part])
        stored.append((k.data.view(torch.uint8).clone(), k.scales.clone(), v.scales.clone()))
    for other in stored[1:]:
        assert all(torch.equal(a, b) for a, b in zip(stored[0], other))
    k, v = cache(fmt), cache(fmt)
    for t in reversed(range(BS)):  # backwards, one token at a time
        write_tokens(k, v, x[t : t + 1], slots[t : t + 1])
    assert torch.equal(k.data.view(torch.uint8), stored[0][0])
    # each row's scale is the smallest that holds its largest value, and no other block is touched
    y = rotate(x)  # compare where the rounding happens: in the rotated space
    want = fmt.scale_for(y.abs().amax(-1)).transpose(0, 1)
    assert torch.equal(k.scales[3], want) and k.scales.count_nonzero() == 2 * BS
    got = k.dequantize(torch.tensor([3]), torch.float32)[0].transpose(0, 1)
    step = k.scales[3].transpose(0, 1)[:, :, None]
    if name == "int8":  # within half a step of its own row's scale
        assert ((got - y).abs() <= step / 2 * 1.001).all()
    else:  # e4m3 keeps 3 mantissa bits: within 1/16 of the value, or half a subnormal step
        assert ((got - y).abs() <= torch.maximum(y.abs() / 16, step * 2.0**-10)).all()
    torch.testing.assert_close(values(v, [3])[0], -values(k, [3])[0])


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_native_writes_equal_the_torch_path_bit_for_bit(name, monkeypatch, kernel_isa):
    """csrc/kv_quant.cpp against QuantizedCache.write's torch ops: single tokens, several tokens of a
    block in one write, slots written over, tokens out of order, tiny and huge values."""
    from pagedkv import native

    assert native.available()
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(7)
    mine_k, mine_v, ref_k, ref_v = (cache(fmt, num_blocks=6) for _ in range(4))
    writes = []
    for _ in range(40):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        slots = torch.randperm(6 * BS, generator=gen)[:n]
        magnitude = 10.0 ** float(torch.randint(-5, 4, (1,), generator=gen))
        writes.append((torch.randn(n, 2, 32, generator=gen) * magnitude, slots))
    writes.append(
        (torch.randn(BS, 2, 32, generator=gen), torch.arange(2 * BS, 3 * BS).flip(0))
    )  # a whole block
    for x, slots in writes:
        write_kv(mine_k, mine_v, x, -x, slots)
    with monkeypatch.context() as m:
        m.setattr(QuantizedCache, "native_writer", lambda self, x: None)
        for x, slots in writes:
            write_kv(ref_k, ref_v, x, -x, slots)
    for mine, ref in ((mine_k, ref_k), (mine_v, ref_v)):
        assert torch.equal(mine.scales, ref.scales)
        assert torch.equal(mine.data.view(torch.uint8), ref.data.view(torch.uint8))
    with pytest.raises(ValueError, match="outside the cache"):
        write_kv(mine_k, mine_v, writes[0][0][:1], writes[0][0][:1], torch.tensor([6 * BS]))


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_slot_written_over_keeps_nothing_of_its_old_owner(name):
    fmt = FORMATS[name]
    k, v = cache(fmt), cache(fmt)
    write_tokens(k, v, torch.full((BS, 2, 32), 1000.0), range(2 * BS, 3 * BS))  # an earlier owner
    small = torch.linspace(-1, 1, 2 * 32).view(1, 2, 32)
    write_tokens(k, v, small, [2 * BS])  # a new owner starts at offset 0
    fresh_k, fresh_v = cache(fmt), cache(fmt)
    write_tokens(fresh_k, fresh_v, small, [2 * BS])
    assert torch.equal(k.scales[2, :, 0], fresh_k.scales[2, :, 0])
    assert (k.scales[2, :, 0] < 0.05).all()  # not 1000 / 127
    assert torch.equal(k.data[2, :, 0].view(torch.uint8), fresh_k.data[2, :, 0].view(torch.uint8))
    torch.testing.assert_close(values(k, [2])[0, :, 0], small[0], atol=0.02, rtol=0.07)


# ---- attention ---------------------------------------------------------------------------------------


def attention_case(name, query_lens, ctx_lens, seed=0, token_by_token=False):
    """Quantized paged attention and the float reference for random sequences."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    heads, q_heads, dim = 2, 6, 32
    k_cache, v_cache = (
        cache(fmt, num_blocks=64, heads=heads, dim=dim),
        cache(fmt, num_blocks=64, heads=heads, dim=dim),
    )
    perm = torch.randperm(64, generator=gen).tolist()
    qs, ks, vs, tables, slots = [], [], [], [], []
    for n, ql in zip(ctx_lens, query_lens):
        table = [perm.pop() for _ in range(-(-n // BS))]
        k = torch.randn(n, heads, dim, generator=gen)
        k[:, :, 3] *= 8  # an outlier channel, as real keys have
        v = torch.randn(n, heads, dim, generator=gen)
        s = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        cached = n - ql
        for a in range(0, cached, 1 if token_by_token else max(cached, 1)):
            b = min(cached, a + (1 if token_by_token else cached))
            write_kv(k_cache, v_cache, k[a:b], v[a:b], s[a:b])
        qs.append(torch.randn(ql, q_heads, dim, generator=gen))
        ks.append(k), vs.append(v), tables.append(table), slots.append(s[cached:])
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0)]).int(),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens=list(query_lens),
        seq_lens_list=list(ctx_lens),
        block_size=BS,
        is_decode=all(q == 1 for q in query_lens),
    )
    write_kv(
        k_cache,
        v_cache,
        torch.cat([k[n - q :] for k, n, q in zip(ks, ctx_lens, query_lens)]),
        torch.cat([v[n - q :] for v, n, q in zip(vs, ctx_lens, query_lens)]),
        meta.slot_mapping,
    )
    got = paged_attention(torch.cat(qs), k_cache, v_cache, meta, 0.2)
    want = torch.cat(
        [
            contiguous_attention(q, k, v, 0.2, n - q.shape[0])
            for q, k, v, n in zip(qs, ks, vs, ctx_lens)
        ]
    )
    return got, want


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed", "decoded_context"])
def test_quantized_paged_attention_is_close_to_float(name, kind, decode_backend):
    ctx = [40, 129, 7, 300]
    qlens = {
        "prefill": [40, 30, 7, 300],
        "decode": [1] * 4,
        "mixed": [1, 129, 3, 1],
        "decoded_context": [1] * 4,
    }[kind]
    got, want = attention_case(
        name, qlens, ctx, seed=len(kind), token_by_token=kind == "decoded_context"
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    rel = (got - want).abs().mean() / want.abs().mean()
    # measured: fp8 0.048-0.059, int8 0.027-0.032 (keys with an 8x outlier channel, peaky softmax)
    assert rel < {"fp8": 0.08, "int8": 0.045}[name], rel


def test_bf16_queries_over_a_quantized_cache_stay_bf16(decode_backend):
    got, want = attention_case("fp8", [1, 5], [20, 5])
    assert got.dtype == torch.float32
    fmt = FP8
    k, v = cache(fmt), cache(fmt)
    x = torch.randn(3, 2, 32)
    write_kv(k, v, x.bfloat16(), x.bfloat16(), torch.tensor([0, 1, 2]))
    meta = AttentionMetadata(
        torch.tensor([2]),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([[0]], dtype=torch.int32),
        [1],
        [3],
        BS,
        True,
    )
    out = paged_attention(torch.randn(1, 4, 32).bfloat16(), k, v, meta, 0.2)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()


# ---- storage: layout, block moves, sizes ------------------------------------------------------------


def filled_storage(name, num_blocks=6, device="cpu") -> KVStorage:
    st = KVStorage(
        num_layers=3,
        num_blocks=num_blocks,
        num_kv_heads=2,
        block_size=BS,
        head_dim=32,
        dtype=name,
        device=device,
    )
    gen = torch.Generator().manual_seed(2)
    for k, v in st.kv_caches:
        x = torch.randn(num_blocks * BS, 2, 32, generator=gen) * torch.rand(
            num_blocks * BS, 1, 1, generator=gen
        )
        write_kv(k, v, x, 3 * x, torch.arange(num_blocks * BS))
    return st


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_storage_layout_and_sizes(name):
    st = filled_storage(name)
    assert st.dtype == FORMATS[name].dtype and st.scales.shape == (3, 2, 6, 2, BS)
    k1, v1 = st.layer(1)
    assert isinstance(k1, QuantizedCache) and k1.data.data_ptr() == st.data[1, 0].data_ptr()
    assert v1.scales.data_ptr() == st.scales[1, 1].data_ptr()
    per_block = KVStorage.bytes_per_block(3, 2, BS, 32, name)
    # (layer, K/V, head, token) rows of 32 one-byte codes and a 4-byte scale
    assert per_block == 2 * 3 * 2 * BS * (32 + 4) == st.block_shape[0]
    assert KVStorage.bytes_per_block(3, 2, BS, 32, torch.bfloat16) == 2 * 3 * 2 * BS * 32 * 2
    assert KVStorage.bytes_per_token(3, 2, 32, name) * BS == per_block


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_block_moves_carry_the_scales(name):
    st = filled_storage(name)
    before_data, before_scales = st.data.view(torch.uint8).clone(), st.scales.clone()
    st.copy_blocks([(0, 3), (2, 5)])
    assert torch.equal(st.data.view(torch.uint8)[:, :, 3], before_data[:, :, 0])
    assert torch.equal(st.scales[:, :, 5], before_scales[:, :, 2])
    assert torch.equal(st.scales[:, :, [0, 1, 2, 4]], before_scales[:, :, [0, 1, 2, 4]])
    blocks = st.read_blocks([4, 1])
    assert (
        blocks.dtype == st.dtype
        and tuple(blocks.shape) == (2, *st.block_shape)
        and blocks.is_contiguous()
    )
    assert blocks[0].numel() * blocks.dtype.itemsize == KVStorage.bytes_per_block(
        3, 2, BS, 32, name
    )
    host = KVStorage(3, 2, 2, BS, 32, name)  # swap space / host tier: same packed blocks
    host.write_blocks([1, 0], blocks)
    assert torch.equal(host.read_blocks([1, 0]).view(torch.uint8), blocks.view(torch.uint8))
    st.write_blocks([0, 2], host.read_blocks([0, 1]))
    for layer in range(3):
        for kv in range(2):
            want = QuantizedCache(
                before_data[layer, kv].view(st.dtype),
                before_scales[layer, kv],
                st.quant,
            ).dequantize(torch.tensor([1, 4]), torch.float32)
            got = st.layer(layer)[kv].dequantize(torch.tensor([0, 2]), torch.float32)
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="packed"):
        st.write_blocks([0], torch.zeros(1, 3, 2, 2, BS, 32))


def test_offload_disk_tier_stores_packed_blocks(tmp_path):
    from pagedkv.kv.hashing import BlockHash
    from pagedkv.kvstore.offload import DiskTier

    st = filled_storage("fp8")
    disk = DiskTier(tmp_path, b"model:fp8", st.block_shape, st.dtype, 1 << 20)
    h, tokens = BlockHash(b"\x01" * 16), tuple(range(BS))
    assert disk.write(h, tokens, st.read_blocks([2])[0])
    again = DiskTier(tmp_path, b"model:fp8", st.block_shape, st.dtype, 1 << 20)
    assert torch.equal(
        again.read(h, tokens).view(torch.uint8), st.read_blocks([2])[0].view(torch.uint8)
    )


@pytest.mark.parametrize("name", ["fp8", "int8", "auto", "bfloat16", "float32"])
def test_plan_bytes_per_block_match_the_pool(name):
    s = KNOWN_SHAPES["smollm2-135m"]
    dtype = "bfloat16" if name == "auto" else name
    assert kv_bytes_per_block(s, name, BS) == KVStorage.bytes_per_block(
        s.num_layers, s.num_kv_heads, BS, s.head_dim, dtype
    )


# ---- the engine ----------------------------------------------------------------------------------------

PROMPTS = [
    "The quick brown fox",
    "Paged attention keeps the KV cache in blocks. Hello world! Serving a model means holding",
    "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. " * 3,
    "Émigré café naïve numbers 0123456789",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def generate(tiny_model_dir, kv, prompts=PROMPTS, params=GREEDY, **options):
    options.setdefault("num_gpu_blocks_override", 128)
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_dtype=kv, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.kv.check_integrity()
    return [[c.token_ids for c in o.outputs] for o in outs], llm


@pytest.fixture(scope="module")
def outputs(tiny_model_dir):
    return {kv: generate(tiny_model_dir, kv)[0] for kv in ("auto", "fp8", "int8")}


def common_prefixes(a, b) -> list[int]:
    """Per request, how many leading greedy tokens two runs share."""
    return [
        next((i for i, (s, t) in enumerate(zip(x[0], y[0])) if s != t), len(x[0]))
        for x, y in zip(a, b)
    ]


def test_engine_greedy_mostly_agrees_with_the_float_cache(tiny_model_dir):
    rng = random.Random(0)
    words = " ".join(PROMPTS).split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 60))) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {
        kv: generate(tiny_model_dir, kv, prompts=prompts, params=params)[0]
        for kv in ("auto", "bfloat16", "fp8", "int8")
    }
    first, agree = {}, {}
    for kv in ("bfloat16", "fp8", "int8"):
        same = common_prefixes(runs[kv], runs["auto"])
        first[kv] = sum(n > 0 for n in same) / len(same)  # the same first token: same inputs
        agree[kv] = sum(same) / (16 * len(same))  # tokens before the first difference
    # This random model's attention is very peaky, so even a bfloat16 cache flips near-ties; measured:
    # first token bf16 1.0, fp8 0.88, int8 0.94; agreement bf16 0.91, fp8 0.33, int8 0.75.
    assert first["fp8"] >= 0.75 and first["int8"] >= 0.85
    assert agree["int8"] >= 0.55 and agree["fp8"] >= 0.2 and agree["bfloat16"] >= agree["fp8"]


def test_same_memory_holds_more_tokens_by_their_bytes(tiny_model_dir):
    blocks = {}
    for kv in ("bfloat16", "fp8", "int8"):
        llm = LLM(tiny_model_dir, dtype="float32", kv_cache_dtype=kv, kv_cache_memory="4MiB")
        blocks[kv] = llm.engine.kv.stats().num_blocks
    head_dim = llm.engine.storage.head_dim
    # a bf16 row is 2 bytes per element; an fp8 / int8 row 1, plus its 4-byte scale
    want = 2 * head_dim / (head_dim + 4)
    assert abs(blocks["fp8"] / blocks["bfloat16"] - want) < 0.01 and blocks["int8"] == blocks["fp8"]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_the_prompts_codes_do_not_depend_on_its_chunks(tiny_model_dir, name):
    """The same prompt, prefilled whole or 7 tokens a step, leaves the same codes in the same
    blocks and scales equal to float rounding (a float32 K differs in its last bits between a
    7-row and a many-row matmul). With a scale per block, grown as chunks came, 26% of the int8
    bytes differed."""
    prompt = PROMPTS[2]
    pools = []
    for budget in (512, 7):
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            kv_cache_dtype=name,
            num_gpu_blocks_override=64,
            max_num_batched_tokens=budget,
        )
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        st = llm.engine.storage
        pools.append((st.data.view(torch.uint8).clone(), st.scales.clone()))
    (whole, whole_scales), (chunked, chunked_scales) = pools
    assert whole.count_nonzero() > 0
    assert (whole != chunked).float().mean() < 1e-3
    torch.testing.assert_close(chunked_scales, whole_scales, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_swap_preemption_keeps_quantized_outputs(tiny_model_dir, outputs, name):
    # a pool too small for all four: requests are swapped out and back (their bytes and scales)
    got, llm = generate(
        tiny_model_dir, name, num_gpu_blocks_override=8, max_num_seqs=4, preemption_mode="swap"
    )
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == outputs[name]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_shared_prefix_and_copy_on_write_keep_quantized_outputs(tiny_model_dir, outputs, name):
    prompt = PROMPTS[1]
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_dtype=name, num_gpu_blocks_override=64)
    assert (
        len(llm.get_tokenizer().encode(prompt)) % BS != 0
    )  # the last prompt block is partly filled
    copied = []
    storage_copy = llm.engine.storage.copy_blocks
    llm.engine.storage.copy_blocks = lambda pairs: (copied.extend(pairs), storage_copy(pairs))
    alone = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # n=3 greedy samples share the prompt's blocks and copy the partly filled last one on write;
    # the prompt's full blocks come from the prefix cache this time
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=3)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert copied and out.num_cached_tokens > 0
    assert [c.token_ids for c in out.outputs] == [alone] * 3


def test_prefix_cache_hash_differs_by_kv_dtype(tiny_model_dir):
    extras = {
        kv: LLM(
            tiny_model_dir, dtype="float32", kv_cache_dtype=kv, num_gpu_blocks_override=8
        ).engine.kv.hash_extra
        for kv in ("auto", "fp8", "int8")
    }
    tokens = tuple(range(BS))
    hashes = {hash_block_tokens(None, tokens, extra) for extra in extras.values()}
    assert len(hashes) == 3


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_offload_tiers_keep_quantized_outputs(tiny_model_dir, tmp_path, name):
    text = "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. "
    conversations = [f"{who}: " + text * 2 for who in ("Ann", "Bob", "Cy", "Di")]
    others = [
        f"{i} Hello world! Serving a model means holding each request's cache. {i}"
        for i in range(4)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def workload(**options):
        """Conversations, traffic that evicts them from the small pool, the conversations again."""
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            kv_cache_dtype=name,
            block_size=4,
            num_gpu_blocks_override=24,
            max_num_batched_tokens=64,
            **options,
        )
        outs = [
            o.outputs[0].token_ids
            for prompts in (conversations, others, conversations)
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        return outs, llm

    want, plain = workload()
    block_bytes = plain.engine.storage.block_shape[0]  # packed: data and scales
    got, llm = workload(kv_offload_host_memory=8 * block_bytes, kv_offload_dir=str(tmp_path))
    st = llm.engine.offload.stats()
    assert (
        st.saved > 0 and st.spilled > 0 and st.loaded_disk > 0
    )  # through the host tier to disk and back
    assert got == want
