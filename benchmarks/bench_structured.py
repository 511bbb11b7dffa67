"""Micro-benchmark of structured outputs: the cost the grammar mask adds to a decode step.

Generates constrained outputs with the sampler's own hook (`StructuredOutputs.apply` / `accept`) on
random logits, with the default model's tokenizer (SmolLM2, 49152 tokens), and reports per step:
the llguidance mask computation per request (µs), and the whole batched hook (bitmask fill for every
constrained row + one masked_fill over [batch, vocab]) per step.

    python benchmarks/bench_structured.py [--batch 1 8 32] [--steps 64]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pagedkv.engine.request import SamplingParams, StructuredOutputsParams
from pagedkv.engine.sequence import SequenceGroup
from pagedkv.engine.structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "city", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}},
    },
}
GRAMMARS = {
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,4}\."),
    "choice": StructuredOutputsParams(choice=[f"option number {i}" for i in range(50)]),
}


def default_tokenizer():
    """SmolLM2's tokenizer, from the installed default model."""
    from pagedkv.model.loader import load_model

    loaded = load_model(None, torch.float32, torch.device("cpu"))
    return loaded.tokenizer, loaded.config.vocab_size


def new_seqs(spec: StructuredOutputsParams, batch: int, steps: int) -> list:
    params = SamplingParams(max_tokens=steps, structured_outputs=spec)
    return [
        SequenceGroup.create(f"r{i}", None, [1, 2, 3], params, steps).seqs[0] for i in range(batch)
    ]


def hook_pass(structured: StructuredOutputs, spec, batch: int, steps: int, vocab: int):
    """The sampler's hook on random logits: µs per step, and the tokens each step chose."""
    seqs = new_seqs(spec, batch, steps)
    gen = torch.Generator().manual_seed(0)
    times, chosen = [], []
    for _ in range(steps):
        live = [s for s in seqs if not s.finished]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen)
        t0 = time.perf_counter_ns()
        structured.apply(logits, live)
        times.append((time.perf_counter_ns() - t0) / 1000)
        tokens = logits.argmax(-1).tolist()
        chosen.append(tokens)
        for s, t, done in zip(live, tokens, structured.accept(live, tokens)):
            s.token_ids.append(t)
            if done:
                s.status = s.status.FINISHED
    return times, chosen


def mask_pass(
    structured: StructuredOutputs, spec, batch: int, steps: int, vocab: int, chosen: list[list[int]]
) -> list[float]:
    """The same token paths again, timing only llguidance's mask: µs per request per step."""
    seqs = new_seqs(spec, batch, steps)
    row = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
    times = []
    for tokens in chosen:
        live = [s for s in seqs if not s.finished]
        matchers = [structured._matcher(s) for s in live]
        t0 = time.perf_counter_ns()
        for m in matchers:
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        times.append((time.perf_counter_ns() - t0) / len(live) / 1000)
        for s, t, done in zip(live, tokens, structured.accept(live, tokens)):
            s.token_ids.append(t)
            if done:
                s.status = s.status.FINISHED
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok, vocab = default_tokenizer()
    structured = StructuredOutputs(tok, vocab)
    t0 = time.perf_counter()
    _ = structured.lltokenizer  # built once per engine, on the first constrained request
    print(f"# llguidance tokenizer built in {(time.perf_counter() - t0) * 1000:.0f} ms")
    cpu = platform.processor() or platform.machine()
    print(f"# {cpu}, torch {torch.__version__}, 1 thread, vocab {vocab}")
    for name, spec in GRAMMARS.items():
        t0 = time.perf_counter()
        structured.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1000
        for batch in args.batch:
            hook, chosen = hook_pass(structured, spec, batch, args.steps, vocab)
            mask = mask_pass(structured, spec, batch, args.steps, vocab, chosen)
            print(
                f"{name:12s} batch {batch:3d}: "
                f"mask {statistics.median(mask):7.1f} µs/request/step, "
                f"hook {statistics.median(hook):8.1f} µs/step "
                f"({len(chosen)} steps; compile {compile_ms:.1f} ms)"
            )


if __name__ == "__main__":
    main()
