"""Reranking throughput: queries each scored against their documents by a causal LM made a
cross-encoder with vLLM's --hf-overrides (the default model's "no" and "yes" tokens,
from_2_way_softmax, as Qwen3-Reranker is served), through pagedkv's LLM.score or vLLM CPU's
(`--engine vllm`, run with the peer venv's python: its pooling runner, the same overrides).

    python benchmarks/bench_rerank.py [--queries 16] [--docs 32] [--rounds 2]
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \\
        /tmp/peers/venvs/vllm/bin/python benchmarks/bench_rerank.py --engine vllm \\
        --model /tmp/peers/models/smollm2-135m-instruct

The texts are made here from a fixed word list, a seed a round (a query of ~12 words, documents
of 60-160), the same for both engines. Prints, per round, the pairs a second and the first query's
first scores (the two engines' agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import random
import time

from pooling_llm import pooling_llm  # same folder

WORDS = (
    "the a of to in and is for on with as by at from that this it be are was an or which "
    "cache memory block paged attention token model server request prefix query document "
    "search engine result page river mountain city history science music market price water "
    "energy system network data table report design method theory field study learning "
    "language question answer value number time year people world state country school"
).split()
OVERRIDES = {
    "architectures": ["LlamaForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "method": "from_2_way_softmax",
}


def texts(queries: int, docs: int, seed: int) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    return [
        (words(12) + "?", [words(rng.randint(60, 160)) + "." for _ in range(docs)])
        for _ in range(queries)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", default="pagedkv", choices=["pagedkv", "vllm"])
    p.add_argument("--model", default=None)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    llm = pooling_llm(args.engine, args.model, hf_overrides=OVERRIDES)

    def rerank(query: str, docs: list[str]) -> list[float]:
        return [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]

    rerank("warm up", ["a first document", "a second one"])
    for r in range(args.rounds):
        work = texts(args.queries, args.docs, seed=r)  # (new texts each round: none cached)
        t = time.perf_counter()
        scores = [rerank(q, docs) for q, docs in work]
        dt = time.perf_counter() - t
        pairs = args.queries * args.docs
        first = ", ".join(f"{s:.4f}" for s in scores[0][:3])
        print(
            f"{args.engine} round {r}: {args.queries} queries x {args.docs} documents, "
            f"{dt:.2f} s, {pairs / dt:.1f} pairs/s [{first}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
