"""Decode throughput under LoRA adapters, offline, against the base model alone.

    python benchmarks/bench_lora.py [--model PATH] [--requests 32] [--tokens 64] [--rank 16]
                                    [--rounds 3] [--enforce-eager] [--speculative-config off]

Random rank-r adapters on all seven projections of every layer (written as PEFT folders in a
temporary directory), three ways alternating in each round: every request on the base model,
every request under one adapter, requests alternating between two adapters (their rows
interleaved in every step). Output tokens per second, greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedkv import LLM, LoRARequest, SamplingParams


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> str:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv),
              "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i),
              "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": rank}))
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--speculative-config",
        default=None,
        help="as serve's (off: no n-gram drafts, whose acceptance differs between the ways)",
    )
    args = p.parse_args()
    llm = LLM(
        args.model,
        enable_lora=True,
        max_lora_rank=args.rank,
        kv_cache_memory="1GiB",
        enforce_eager=args.enforce_eager,
        # (None would turn the default n-gram drafts off: passed only when given)
        **({"speculative_config": args.speculative_config} if args.speculative_config else {}),
    )
    cfg = llm.engine.loaded.config
    folder = tempfile.TemporaryDirectory()
    root = Path(folder.name)
    a = LoRARequest("a", 1, write_adapter(root / "a", cfg, args.rank, 1))
    b = LoRARequest("b", 2, write_adapter(root / "b", cfg, args.rank, 2))
    prompts = [[100 + k, 200 + k, 300 + k, 400 + k] * 8 for k in range(args.requests)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ways = {
        "base": None,
        "one adapter": a,
        "two, alternating": [a if k % 2 else b for k in range(args.requests)],
    }
    print("| round | " + " | ".join(ways) + " |")
    print("|---|" + "---:|" * len(ways))
    for r in range(args.rounds):
        rates = []
        for lora in ways.values():
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, False, lora_request=lora)
            took = time.perf_counter() - start
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / took)
        print(f"| {r} | " + " | ".join(f"{x:.1f}" for x in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
