"""Embedding throughput: the shared workloads' prompts as inputs to embed, pagedkv's LLM.embed or
vLLM CPU's (`--engine vllm`, run with the peer venv's python: its pooling runner, the same model
as an embedding model, last-token pooling and unit length as pagedkv's default).

    python benchmarks/bench_embed.py [--workloads W1,W2] [--rounds 2] [--no-prefix-caching]
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \
        /tmp/peers/venvs/vllm/bin/python benchmarks/bench_embed.py --engine vllm \
        --model /tmp/peers/models/smollm2-135m-instruct

Prints, per workload and round, the prompt tokens a second and the first vector's first values
(the two engines' vectors agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pooling_llm import pooling_llm  # same folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", default="pagedkv", choices=["pagedkv", "vllm"])
    p.add_argument("--model", default=None)
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="every round computes every prompt (else a repeated input reuses its blocks)",
    )
    p.add_argument(
        "--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "bench")
    )
    args = p.parse_args()
    sys.path.insert(0, args.shared)
    import workloads as wl

    llm = pooling_llm(args.engine, args.model, enable_prefix_caching=not args.no_prefix_caching)
    if args.engine == "vllm":
        from vllm.inputs import TokensPrompt

        def embed(prompts):
            batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
            outs = llm.embed(batch, use_tqdm=False)
            return [o.outputs.embedding for o in outs]
    else:

        def embed(prompts):
            return [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]

    embed([list(range(45000, 45040 + i)) for i in range(4)])  # warm-up
    for key in args.workloads.split(","):
        prompts = [r.prompt for r in wl.get(key).requests]
        tokens = sum(map(len, prompts))
        for r in range(args.rounds):
            t = time.perf_counter()
            vectors = embed(prompts)
            dt = time.perf_counter() - t
            first = ", ".join(f"{v:.4f}" for v in vectors[0][:3])
            print(
                f"{args.engine} {key} round {r}: {len(prompts)} inputs, {tokens} tokens, "
                f"{dt:.2f} s, {tokens / dt:.0f} tok/s, {len(prompts) / dt:.1f} inputs/s [{first}]",
                flush=True,
            )


if __name__ == "__main__":
    main()
