"""Tiered KV offload on a multi-turn chat workload: time to first token and prompt tokens computed.

    python benchmarks/bench_offload.py [--model PATH] [--conversations 8] [--turns 4] [--gpu-blocks 32]

Conversations take turns one request at a time (users 1..N each send turn 1,
then each sends turn 2, ...); every turn resends the whole conversation so
far (system prompt, earlier user messages and the model's replies) plus a
new user message. The device pool holds about one conversation, so
by the time a conversation comes back its blocks have been evicted: without
offload they are recomputed, with offload they are loaded back from the host
tier (or from the disk tier, third configuration). All configurations run in
one process, one after the other, and must give the same outputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

import torch

from pagedkv import LLM, SamplingParams

SYSTEM = (
    "You are a careful assistant for the operations team of a small logistics company. Answer briefly "
    "and precisely, name the assumptions you make, and prefer plain words over jargon. When numbers are "
    "involved, show the arithmetic in one line."
)
TOPICS = [
    "a warehouse that stores frozen food",
    "a fleet of twelve delivery vans",
    "a customer support desk",
    "a spare parts catalogue",
    "a weekly staff rota",
    "a returns process for damaged goods",
    "a fuel budget for the winter",
    "a move to a larger depot",
]
QUESTIONS = [
    "Describe the three biggest risks you see for {topic}, and for each one a first step to reduce it.",
    "Take the second risk. What would you measure every week to know whether it is getting better?",
    "Write a short note to the team that explains the plan for {topic} in five sentences.",
    "Which one decision about {topic} should we take first, and what could make it go wrong?",
    "Summarise everything we agreed so far as a checklist of at most six items.",
]


def conversation_turn(history: list[dict], conv: int, turn: int) -> list[dict]:
    question = QUESTIONS[turn % len(QUESTIONS)].format(topic=TOPICS[conv % len(TOPICS)])
    return history + [{"role": "user", "content": f"(Conversation {conv + 1}) {question}"}]


def run(model: str | None, args: argparse.Namespace, **offload) -> dict:
    llm = LLM(
        model,
        dtype=args.dtype,
        num_gpu_blocks_override=args.gpu_blocks,
        block_size=args.block_size,
        **offload,
    )
    engine = llm.engine
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate("warm up", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    engine.kv.reset_prefix_cache()
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
    ttft: list[list[float]] = [[] for _ in range(args.turns)]
    prompt_tokens = [0] * args.turns
    computed = [0] * args.turns
    outputs = []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for conv in range(args.conversations):
            messages = conversation_turn(histories[conv], conv, turn)
            ids = tok.encode(
                tok.apply_chat_template(messages, add_generation_prompt=True),
                add_special_tokens=False,
            )
            out = llm.generate(ids, params, use_tqdm=False)[0]
            m = out.metrics
            ttft[turn].append(m.first_token_time - m.arrival_time)
            prompt_tokens[turn] += len(ids)
            computed[turn] += (
                len(ids) - out.num_cached_tokens
            )  # one request at a time: no preemption
            reply = out.outputs[0]
            outputs.append(reply.token_ids)
            histories[conv] = messages + [{"role": "assistant", "content": reply.text}]
    wall = time.perf_counter() - t0
    assert engine.scheduler.num_preemptions == 0
    st = engine.offload.stats() if engine.offload is not None else None
    return {
        "ttft_by_turn": [statistics.mean(t) for t in ttft],
        "prompt_tokens": prompt_tokens,
        "computed_by_turn": computed,
        "wall_s": wall,
        "outputs": outputs,
        "loaded_host": st.loaded_host if st else 0,
        "loaded_disk": st.loaded_disk if st else 0,
        "saved": st.saved if st else 0,
        "dtype": str(engine.storage.dtype),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32 so that outputs can be compared exactly: in bf16 any prefix-cache hit (device "
        "or tier) computes the rest of the prompt in another batch shape, and bf16 rounding "
        "can then flip a greedy token",
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--gpu-blocks", type=int, default=32, help="device pool, in blocks (too small on purpose)"
    )
    p.add_argument("--host-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        results = {
            "off": run(args.model, args),
            "host": run(args.model, args, kv_offload_host_memory=args.host_memory),
            "disk": run(args.model, args, kv_offload_dir=folder),
        }
    same = all(r["outputs"] == results["off"]["outputs"] for r in results.values())
    for r in results.values():
        del r["outputs"]
    if args.json:
        print(json.dumps({"outputs_equal": same, **results}, indent=1))
        return 0 if same else 1
    off = results["off"]
    print(
        f"# {args.conversations} conversations x {args.turns} turns, "
        f"{args.gpu_blocks} device blocks of {args.block_size} tokens, {off['dtype']}, "
        f"{args.threads} thread(s), {platform.processor() or platform.machine()}"
    )
    print(f"# outputs equal across configurations: {same}")
    turns = range(1, args.turns + 1)
    print(
        "| offload | prompt tokens computed | "
        + " | ".join(f"TTFT turn {t}" for t in turns)
        + " | TTFT turns 2+ vs off | blocks loaded (host/disk) | wall |"
    )
    print("|---|---:|" + "---:|" * args.turns + "---:|---:|---:|")
    base = statistics.mean(off["ttft_by_turn"][1:])
    for name, r in results.items():
        later = statistics.mean(r["ttft_by_turn"][1:])
        print(
            f"| {name} | {sum(r['computed_by_turn'])} of {sum(r['prompt_tokens'])} | "
            + " | ".join(f"{t * 1000:.0f} ms" for t in r["ttft_by_turn"])
            + f" | {later / base:.2f}x | {r['loaded_host']}/{r['loaded_disk']} | {r['wall_s']:.0f} s |"
        )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
