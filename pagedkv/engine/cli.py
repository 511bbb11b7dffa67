"""`pagedkv generate`: one prompt through the offline engine, printed as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.outputs import RequestMetrics, RequestOutput


def add_parser(sub) -> None:
    from pagedkv.cli import add_engine_args

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--chat", action="store_true", help="render the prompt with the model's chat template"
    )
    # unset: the model's generation config (--generation-config), else SAMPLING_DEFAULTS
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--lora", metavar="NAME", help="run the prompt under this --lora-modules adapter"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object with ids, timings and KV stats"
    )
    p.set_defaults(func=run)


SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def run(args: argparse.Namespace) -> int:
    from pagedkv.cli import engine_config_from_args
    from pagedkv.config import note
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.options import with_defaults
    from pagedkv.engine.request import SamplingParams

    given = {k: getattr(args, k) for k in SAMPLING_DEFAULTS if getattr(args, k) is not None}
    SamplingParams(**given, ignore_eos=args.ignore_eos)  # a bad flag fails before the model loads
    config = engine_config_from_args(args)
    config.note_serve_only("pagedkv generate", flags=True)
    if config.chat_template is not None and not args.chat:
        note("--chat-template has no effect in pagedkv generate without --chat")
    if config.lora_modules and args.lora is None:
        note("--lora-modules: the prompt runs on the base model unless --lora NAME picks one")
    t0 = time.monotonic()
    engine = LLMEngine(config)
    t_load = time.monotonic() - t0
    params = with_defaults(
        SamplingParams(**{**SAMPLING_DEFAULTS, **given}, ignore_eos=args.ignore_eos),
        engine.generation_defaults,
        set(engine.generation_defaults) - set(given),  # all the model's defaults, as serve does
    )
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True
        )
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(args.prompt)
    params.lora_name = args.lora
    group = engine.add_request("generate-0", ids, params)
    peak_tokens = peak_slots = 0
    out = None
    while engine.has_unfinished():
        s = engine.kv.stats()
        peak_tokens, peak_slots = max(peak_tokens, s.tokens_held), max(peak_slots, s.token_slots)
        for o in engine.step():
            out = o
    assert out is not None  # the loop ran until the request finished
    if out.error:  # the request failed in the engine: no output to show, and not a success
        print(f"pagedkv generate: error: {out.error}", file=sys.stderr)
        return 1
    # the last step's K/V (all but the last token) was freed inside that step: count it too
    held = len(out.prompt_token_ids or []) + len(out.outputs[0].token_ids) - 1
    bs = engine.kv.block_size
    peak_tokens, peak_slots = max(peak_tokens, held), max(peak_slots, -(-held // bs) * bs)
    if not args.json:
        print(out.outputs[0].text)
        return 0
    print(json.dumps(_report(engine, group.metrics, out, t_load, peak_tokens, peak_slots)))
    return 0


def _report(
    engine: LLMEngine,
    m: RequestMetrics,
    out: RequestOutput,
    t_load: float,
    peak_tokens: int,
    peak_slots: int,
) -> dict:
    """--json: the ids, the timings from the request's metrics `m`, and the KV peaks."""
    comp = out.outputs[0]
    assert m.first_token_time is not None and m.finished_time is not None  # a finished request
    return {
        "text": comp.text,
        "prompt_token_ids": out.prompt_token_ids,
        "output_token_ids": comp.token_ids,
        "finish_reason": comp.finish_reason,
        "timings": {
            "load_s": round(t_load, 3),
            "ttft_s": round(m.first_token_time - m.arrival_time, 4),
            "e2e_s": round(m.finished_time - m.arrival_time, 4),
            "decode_tok_per_s": round(
                (len(comp.token_ids) - 1) / max(m.finished_time - m.first_token_time, 1e-9),
                2,
            ),
        },
        "kv": {
            "block_size": engine.kv.block_size,
            "num_blocks": engine.kv.num_blocks,
            "blocks_used_peak": -(-peak_slots // engine.kv.block_size),
            "tokens_held_peak": peak_tokens,
            "token_utilization": round(peak_tokens / peak_slots, 4) if peak_slots else 1.0,
            "num_cached_tokens": out.num_cached_tokens,
        },
    }
