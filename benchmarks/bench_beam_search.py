"""Beam search against sampling the same number of sequences, offline.

    python benchmarks/bench_beam_search.py [--model PATH] [--width 4] [--tokens 64] [--rounds 2]
                                           [--no-prefix-caching]

Four prompts, each with `width` beams (`use_beam_search`) and, alternating in each round, `width`
samples (temperature 1, seeded); EOS ignored, so both produce prompts x width x tokens tokens.
Output tokens per second. A beam search step is one batch of one-token requests, each recomputing
its beam's last partial block (engine/beam_search.py): without prefix caching, its whole beam.
"""

from __future__ import annotations

import argparse
import time

from pagedkv import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "A paged KV cache"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory="1GiB", enable_prefix_caching=not args.no_prefix_caching)
    ways = {
        "beam search": SamplingParams(
            n=args.width, use_beam_search=True, max_tokens=args.tokens, ignore_eos=True
        ),
        "sampling": SamplingParams(
            n=args.width, temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True
        ),
    }
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    print(f"| round | way | output tok/s | (prefix caching {not args.no_prefix_caching}) |")
    print("|---|---|---:|---|")
    for r in range(args.rounds):
        for name, params in ways.items():
            t = time.perf_counter()
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
            print(f"| {r + 1} | {name} | {tokens / dt:.1f} | |")
    llm.close()


if __name__ == "__main__":
    main()
