"""Classification throughput: texts classified by a *ForSequenceClassification checkpoint, pagedkv's
LLM.classify or vLLM CPU's (`--engine vllm`, run with the peer venv's python: its pooling
runner). The checkpoint is the default model with a seeded random head of --labels labels, made
first by `--make` (transformers, in pagedkv's environment):

    python benchmarks/bench_classify.py --make /tmp/classifier \\
        --base /tmp/peers/models/smollm2-135m-instruct
    python benchmarks/bench_classify.py --model /tmp/classifier [--texts 512] [--rounds 2]
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4 \\
        /tmp/peers/venvs/vllm/bin/python benchmarks/bench_classify.py --engine vllm \\
        --model /tmp/classifier --dtype float32

The texts (20-160 words) are made here from bench_rerank.py's word list, a seed a round, the same
for both engines. Prints, per round, the texts a second and the first text's probabilities (the
two engines' agree to rounding).
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

from bench_rerank import WORDS  # same folder
from pooling_llm import pooling_llm


def make(base: str, folder: str, labels: int) -> None:
    """The base model as a classifier of `labels` labels with a seeded random score head."""
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        base,
        num_labels=labels,
        dtype=torch.float32,
        id2label={i: f"topic {i}" for i in range(labels)},
    )
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.05)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(base) / name).exists():
            shutil.copy(Path(base) / name, folder)


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 160))) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", default="pagedkv", choices=["pagedkv", "vllm"])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None, help="default: pagedkv's auto, vLLM's bfloat16")
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--make", metavar="FOLDER", help="write the classifier checkpoint and stop")
    p.add_argument("--base", help="the model --make starts from")
    p.add_argument("--labels", type=int, default=4)
    args = p.parse_args()
    if args.make:
        make(args.base, args.make, args.labels)
        return
    llm = pooling_llm(args.engine, args.model, dtype=args.dtype)

    def classify(batch: list[str]) -> list[list[float]]:
        return [o.outputs.probs for o in llm.classify(batch, use_tqdm=False)]

    classify(["warm up", "a second text"])
    for r in range(args.rounds):
        work = texts(args.texts, seed=r)  # (new texts each round: none cached)
        t = time.perf_counter()
        probs = classify(work)
        dt = time.perf_counter() - t
        first = ", ".join(f"{x:.4f}" for x in probs[0])
        print(
            f"{args.engine} round {r}: {args.texts} texts, {dt:.2f} s, "
            f"{args.texts / dt:.1f} texts/s [{first}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
