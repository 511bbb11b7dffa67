"""Quality of the quantized KV cache (fp8, int8) against the unquantized one (auto).

    python benchmarks/bench_kv_quant.py [--model PATH] [--dtype bfloat16] [--tokens 64] [--ppl-chunk 100]

For each KV dtype, through the real paged cache (write_kv quantizes, attention dequantizes):

- greedy agreement: a fixed set of chat prompts, decoded greedily one token
  per step for `--tokens` tokens; per prompt, how many leading tokens equal
  auto's (and how many prompts match all the way);
- mean absolute logit difference: auto's greedy tokens fed back one per step
  (teacher forcing, so every dtype sees the same inputs), |logits - auto's|
  averaged over prompts, steps and the vocabulary; and, on those same
  inputs, how often the top token equals auto's (free of the snowball that
  makes one early flip change the rest of a greedy answer);
- perplexity of the shipped text (pagedkv/data/alice_ch1.txt), fed in chunks
  of `--ppl-chunk` tokens (a size that is not a multiple of the block size
  makes blocks straddle chunks).

    python benchmarks/bench_kv_quant.py --attention [--threads 1]

times one layer's decode attention instead (SmolLM2's shape: 9 query / 3 KV
heads, dim 64; 8 sequences of 100..2000 tokens, bf16 queries): the float
cache through the C++ kernel, and each quantized cache through the torch path
(gather and dequantize padded to the longest, matmuls) and through the path
paged_attention takes (dequantize the blocks read into a compact cache, then
the kernel).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch

from pagedkv.attention import paged
from pagedkv.attention.paged import AttentionMetadata
from pagedkv.attention.store import write_kv
from pagedkv.config import default_model_path
from pagedkv.kvstore.storage import KVStorage

TEXT = Path(__file__).resolve().parent.parent / "pagedkv" / "data" / "alice_ch1.txt"
PROMPTS = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea.",
    "Explain in simple words how a refrigerator keeps food cold.",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Tell me a short story about a robot who learns to paint.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
]


class PagedDriver:
    """Sequences fed through the model's paged attention, each with its own run of blocks."""

    def __init__(self, loaded, kv_dtype, num_seqs: int, max_len: int, block_size: int = 16) -> None:
        mc = loaded.config
        self.model, self.block_size = loaded.model, block_size
        self.blocks_per_seq = -(-max_len // block_size)
        self.storage = KVStorage(
            mc.num_hidden_layers,
            num_seqs * self.blocks_per_seq,
            mc.num_key_value_heads,
            block_size,
            mc.head_dim,
            kv_dtype,
        )
        self.lens = [0] * num_seqs

    def step(self, new: list[list[int]]) -> list[torch.Tensor]:
        """Feed new tokens to sequences 0..len(new)-1; float32 logits [len(tokens), vocab] of each."""
        bs, width = self.block_size, self.blocks_per_seq
        slots, positions, tables = [], [], []
        for i, ids in enumerate(new):
            pos = np.arange(self.lens[i], self.lens[i] + len(ids))
            positions.append(pos)
            slots.append(i * width * bs + pos)  # sequence i owns blocks i*width .. (i+1)*width-1
            tables.append(np.arange(i * width, (i + 1) * width))
        qlens = [len(ids) for ids in new]
        seq_lens = [self.lens[i] + n for i, n in enumerate(qlens)]
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)),
            query_start_loc=torch.tensor(
                np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.from_numpy(np.stack(tables).astype(np.int32)),
            query_lens=qlens,
            seq_lens_list=seq_lens,
            block_size=bs,
            is_decode=all(n == 1 for n in qlens),
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(sum(new, [])),
                torch.from_numpy(np.concatenate(positions)),
                self.storage.kv_caches,
                meta,
            )
            logits = self.model.compute_logits(hidden)
        self.lens[: len(new)] = seq_lens
        return list(logits.split(qlens))


def decode(loaded, kv_dtype, prompts: list[list[int]], steps: int, forced: list[list[int]] | None):
    """Greedy decoding (or, with `forced`, those tokens fed back): tokens and per-step logits [P, steps, V]."""
    driver = PagedDriver(loaded, kv_dtype, len(prompts), max(map(len, prompts)) + steps)
    last = torch.stack([lg[-1] for lg in driver.step(prompts)])
    tokens, logits = [], []
    for t in range(steps):
        logits.append(last)
        chosen = last.argmax(-1).tolist() if forced is None else [f[t] for f in forced]
        tokens.append(chosen)
        if t + 1 < steps:
            last = torch.cat(driver.step([[c] for c in chosen]))
    return [list(col) for col in zip(*tokens)], torch.stack(logits, 1)


def perplexity(loaded, kv_dtype, ids: list[int], chunk: int) -> float:
    driver = PagedDriver(loaded, kv_dtype, 1, len(ids))
    nll, count = 0.0, 0
    for a in range(0, len(ids) - 1, chunk):
        part = ids[a : min(a + chunk, len(ids) - 1)]
        logp = torch.log_softmax(driver.step([part])[0], dim=-1)
        target = torch.tensor(ids[a + 1 : a + 1 + len(part)])
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(part)
    return math.exp(nll / count)


def measure(loaded, kv_dtype, prompts, steps, reference, text_ids, chunk) -> dict:
    t0 = time.perf_counter()
    tokens, _ = decode(loaded, kv_dtype, prompts, steps, None)
    decode_s = time.perf_counter() - t0
    if reference is None:
        reference = {
            "tokens": tokens,
            "logits": decode(loaded, kv_dtype, prompts, steps, tokens)[1],
        }
        forced = reference["logits"]
    else:
        forced = decode(loaded, kv_dtype, prompts, steps, reference["tokens"])[1]
    prefix = [
        next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), steps)
        for got, want in zip(tokens, reference["tokens"])
    ]
    row = {
        "kv_cache_dtype": kv_dtype,
        "greedy_prefix_agreement": sum(prefix) / (steps * len(prompts)),
        "greedy_exact_prompts": f"{sum(p == steps for p in prefix)}/{len(prompts)}",
        "mean_abs_logit_diff": (forced - reference["logits"]).abs().mean().item(),
        "forced_top1_agreement": (forced.argmax(-1) == reference["logits"].argmax(-1))
        .float()
        .mean()
        .item(),
        "perplexity": perplexity(loaded, kv_dtype, text_ids, chunk),
        "greedy_ms_per_step": 1000 * decode_s / (steps + 1),
    }
    return row, reference


def attention_speed(rounds: int = 15) -> None:
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(100, 2001, 8)]
    bs, kv_heads, q_heads, dim = 16, 3, 9, 64
    width = -(-max(lens) // bs)
    tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    last = [int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(last),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        query_lens=[1] * len(lens),
        seq_lens_list=lens,
        block_size=bs,
        is_decode=True,
    )
    q = torch.randn(len(lens), q_heads, dim).bfloat16()
    x = torch.randn(tables.numel() * bs, kv_heads, dim)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1000 * min(times)

    print(
        f"decode attention, one layer, {len(lens)} sequences of {min(lens)}..{max(lens)} tokens "
        f"({sum(lens)} in all), best of {rounds}, {torch.get_num_threads()} thread(s)"
    )
    for name in ("bfloat16", "fp8", "int8"):
        st = KVStorage(1, tables.numel(), kv_heads, bs, dim, name)
        k, v = st.layer(0)
        write_kv(k, v, x, x, torch.arange(x.shape[0]))
        torch_ms = best(functools.partial(paged._decode, q, k, v, meta, 0.125))
        used_ms = best(functools.partial(paged.paged_attention, q, k, v, meta, 0.125))
        print(f"  {name:<9} torch path {torch_ms:6.2f} ms   paged_attention {used_ms:6.2f} ms")


def main() -> None:
    from pagedkv.model.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype; float32 keeps the reference free of bfloat16 rounding noise",
    )
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--ppl-chunk", type=int, default=100)
    ap.add_argument("--kv-dtypes", default="auto,fp8,int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--attention", action="store_true", help="time decode attention instead (see above)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention:
        attention_speed()
        return
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model or default_model_path(), dtype, torch.device("cpu"))
    tok = loaded.tokenizer
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in PROMPTS
    ]
    text_ids = tok.encode(TEXT.read_text())
    rows, reference = [], None
    for kv in args.kv_dtypes.split(","):
        row, reference = measure(
            loaded,
            dtype if kv == "auto" else kv,
            prompts,
            args.tokens,
            reference,
            text_ids,
            args.ppl_chunk,
        )
        row["kv_cache_dtype"] = kv
        rows.append(row)
    base = rows[0]["perplexity"]
    for row in rows:
        row["perplexity_vs_auto"] = row["perplexity"] / base - 1
    info = {
        "model": loaded.name,
        "dtype": args.dtype,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "text_tokens": len(text_ids),
        "ppl_chunk": args.ppl_chunk,
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return
    print(
        f"{info['model']} ({args.dtype}), {len(prompts)} prompts x {args.tokens} greedy tokens, "
        f"perplexity on {len(text_ids)} tokens in chunks of {args.ppl_chunk}"
    )
    print(
        f"{'kv dtype':<9}{'greedy prefix':>15}{'exact':>8}{'forced top-1':>14}{'mean |dlogit|':>15}"
        f"{'perplexity':>12}{'vs auto':>9}{'ms/step':>9}"
    )
    for r in rows:
        print(
            f"{r['kv_cache_dtype']:<9}{r['greedy_prefix_agreement']:>15.1%}{r['greedy_exact_prompts']:>8}"
            f"{r['forced_top1_agreement']:>14.1%}{r['mean_abs_logit_diff']:>15.4f}{r['perplexity']:>12.3f}"
            f"{r['perplexity_vs_auto']:>+9.2%}{r['greedy_ms_per_step']:>9.1f}"
        )


if __name__ == "__main__":
    main()
