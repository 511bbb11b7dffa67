"""Packed weights, their dense copies, or plain bfloat16: the matmuls of one forward step by rows.

    python benchmarks/bench_dense_weights.py [--rows 1,2,4,...] [--rounds 7] [--json out.json]

For a step of T rows (a batch-T decode, or a prefill chunk of T tokens) this times every matmul
of one forward of the default model (per layer q/k/v, o, gate/up, down; the lm_head on T rows,
or on 1 for T > 64, as for a prefill chunk), in three forms:

- packed: `--quantization gguf` with PAGEDKV_DENSE_WEIGHTS=0 (torch's int4 / int8 kernels),
- default: `--quantization gguf` as loaded (each matmul picks the packed form or the dense copy
  by its row count, from the measured crossover),
- none: `--quantization none` (the file dequantized to bfloat16).

The forms alternate round by round in one process and the best round counts (load from other
processes hits all of them alike). Also reported: what unpacking every packed weight to
bfloat16 costs (the alternative to keeping a copy: dequantizing on the fly each step).
Attention and the other per-step work are the same in all three forms and are left out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedkv.model.dense_weights import NEVER, packed_weights
from pagedkv.model.loader import load_model
from pagedkv.model.quant_linear import linear

ROWS = "1,2,4,8,16,24,32,48,64,128,512,2048"


def matmuls(model) -> list[tuple[object, int]]:
    """(weight, rows divisor) of one forward: the layers' four matmuls, then the lm_head."""
    out = []
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            out.append((getattr(layer, name), 0))
    out.append((model.lm_head, 1))
    return out


def step_seconds(model, rows: int, inputs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w, head in matmuls(model):
        k = w.shape[1]
        x = inputs[k][: (1 if rows > 64 else rows) if head else rows]
        linear(x, w)
    return time.perf_counter() - t0


def unpack_seconds(model) -> float:
    """Every packed weight dequantized to bfloat16 once, as a step would on the fly."""
    t0 = time.perf_counter()
    for w in packed_weights(model):
        w.dequantize().to(torch.bfloat16)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    gguf = load_model(None, "bfloat16", quantization="gguf")
    none = load_model(None, "bfloat16", quantization="none")
    weights = packed_weights(gguf.model)
    chosen = {type(w).__name__: w.dense_from for w in weights}
    print(f"default: dense copies from {chosen} rows; weights {gguf.model.weight_bytes():,} B")

    def set_form(form: str) -> None:
        for w in weights:
            w.dense_from = NEVER if form == "packed" else chosen[type(w).__name__]

    forms = {"packed": gguf.model, "default": gguf.model, "none": none.model}
    best = {(f, r): float("inf") for f in forms for r in rows_list}
    unpack = float("inf")
    with torch.inference_mode():
        inputs = {k: torch.randn(max(rows_list), k).to(torch.bfloat16) for k in (576, 1536)}
        for _ in range(args.rounds):
            for rows in rows_list:
                for form, model in forms.items():
                    set_form(form)
                    best[form, rows] = min(best[form, rows], step_seconds(model, rows, inputs))
            unpack = min(unpack, unpack_seconds(gguf.model))
        set_form("default")
    print("| rows | packed ms | none (bf16) ms | default ms | default / best of the two |")
    print("|---:|---:|---:|---:|---:|")
    for rows in rows_list:
        p, n, d = (best[f, rows] * 1e3 for f in ("packed", "none", "default"))
        print(f"| {rows} | {p:.2f} | {n:.2f} | {d:.2f} | {d / min(p, n):.2f} |")
    print(f"unpacking every packed weight to bf16 (per forward, on the fly): {unpack * 1e3:.0f} ms")
    if args.json:
        result = {
            "dense_from": chosen,
            "ms": {f"{f}:{r}": v * 1e3 for (f, r), v in best.items()},
            "unpack_ms": unpack * 1e3,
            "threads": torch.get_num_threads(),
        }
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
