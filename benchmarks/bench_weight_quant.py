"""Weights at lower precision (--quantization): quality, decode speed and memory.

    python benchmarks/bench_weight_quant.py [--model PATH] [--tokens 64] [--threads 1]
    python benchmarks/bench_weight_quant.py --speed [--rounds 5] [--decode-tokens 128]

Quality (the default): each scheme (quantization:model dtype) against the
dequantized float32 model (none:float32), through the real paged cache, with
bench_kv_quant's measures (greedy prefix agreement on chat prompts, teacher-
forced top-1 agreement and mean |logit difference|, perplexity of
pagedkv/data/alice_ch1.txt).

--requantize Q8_0 (or Q4_0, Q4_1): first writes a copy of the model whose
matrices gguf's own quantizer re-encodes in that type (norms stay float32),
and measures that file: the reference is then its dequantized float32 form.

--speed: W3-like decode through the engine (`LLM`, batch 1, greedy, a short
chat prompt, --decode-tokens output tokens, eos ignored) for each scheme,
the schemes alternating round by round so that load from other processes hits
all of them alike; reports the median decode tok/s (first to last token) and
the median time to first token of a --prefill-tokens prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import torch
from bench_kv_quant import PROMPTS, TEXT, measure  # same folder: one definition of the measures

from pagedkv.config import default_model_path
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import SamplingParams
from pagedkv.model.loader import load_model

QUALITY_SCHEMES = "none:float32,none:bfloat16,int8:float32,gguf:float32,gguf:bfloat16"
SPEED_SCHEMES = "none:bfloat16,none:float32,int8:auto,gguf:auto"


def requantize(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """A copy of a GGUF with every 2-D tensor re-encoded as qtype by gguf's quantizer."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if values.ndim == 2:
            writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def split(scheme: str) -> tuple[str, str]:
    quantization, _, dtype = scheme.partition(":")
    return quantization, dtype or "auto"


def quality(args) -> dict:
    rows, reference = [], None
    text_ids = prompts = None
    for scheme in args.schemes.split(","):
        quantization, dtype = split(scheme)
        loaded = load_model(args.model, dtype, "cpu", quantization)
        if prompts is None:
            tok = loaded.tokenizer
            prompts = [
                tok.encode(
                    tok.apply_chat_template(
                        [{"role": "user", "content": p}], add_generation_prompt=True
                    ),
                    add_special_tokens=False,
                )
                for p in PROMPTS
            ]
            text_ids = tok.encode(TEXT.read_text())
        row, reference = measure(
            loaded, loaded.model.dtype, prompts, args.tokens, reference, text_ids, args.ppl_chunk
        )
        del row["kv_cache_dtype"]
        rows.append({"scheme": scheme, "weight_bytes": loaded.model.weight_bytes(), **row})
    for row in rows:
        row["perplexity_vs_ref"] = row["perplexity"] / rows[0]["perplexity"] - 1
    return {
        "model": loaded.name,
        "prompts": len(prompts),
        "tokens": args.tokens,
        "text_tokens": len(text_ids),
        "threads": args.threads,
        "rows": rows,
    }


def one_run(
    llm: LLM, prompt: list[int], tokens: int, long_prompt: list[int]
) -> tuple[float, float]:
    """(decode tok/s, TTFT in s of the long prompt)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
    decode = (len(m.token_times) - 1) / (m.token_times[-1] - m.token_times[0])
    m = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[
        0
    ].metrics
    return decode, m.first_token_time - m.arrival_time


def speed(args) -> dict:
    engines = {}
    for scheme in args.schemes.split(","):
        quantization, dtype = split(scheme)
        llm = LLM(
            model=args.model,
            quantization=quantization,
            dtype=dtype,
            num_gpu_blocks_override=256,
            enable_prefix_caching=False,
        )
        engines[scheme] = llm
    tok = next(iter(engines.values())).engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    long_prompt = tok.encode(TEXT.read_text())[: args.prefill_tokens]
    runs: dict[str, list[tuple[float, float]]] = {s: [] for s in engines}
    for _ in range(args.rounds):
        for scheme, llm in engines.items():
            runs[scheme].append(one_run(llm, prompt, args.decode_tokens, long_prompt))
    rows = [
        {
            "scheme": s,
            "weight_bytes": llm.engine.weight_bytes,
            "decode_tok_s": statistics.median(r[0] for r in runs[s]),
            "decode_tok_s_all": [round(r[0], 1) for r in runs[s]],
            "ttft_s": statistics.median(r[1] for r in runs[s]),
        }
        for s, llm in engines.items()
    ]
    return {
        "rounds": args.rounds,
        "decode_tokens": args.decode_tokens,
        "prefill_tokens": len(long_prompt),
        "threads": args.threads,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument(
        "--schemes",
        default=None,
        help=f"quantization:dtype list (default {QUALITY_SCHEMES}; with --speed {SPEED_SCHEMES})",
    )
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (quality)")
    ap.add_argument("--ppl-chunk", type=int, default=100)
    ap.add_argument(
        "--requantize",
        default=None,
        choices=["Q8_0", "Q4_0", "Q4_1"],
        help="measure a copy of the model re-encoded in this GGUF type",
    )
    ap.add_argument("--speed", action="store_true", help="decode speed through the engine instead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.schemes = args.schemes or (SPEED_SCHEMES if args.speed else QUALITY_SCHEMES)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if args.requantize:
            src = Path(args.model) if args.model else default_model_path()
            args.model = str(
                requantize(
                    src,
                    Path(tmp) / f"{src.stem}.{args.requantize}.gguf",
                    gguf.GGMLQuantizationType[args.requantize],
                )
            )
        info = speed(args) if args.speed else quality(args)
    info["seconds"] = round(time.monotonic() - t0)
    if args.json:
        print(json.dumps(info, indent=1))
    elif args.speed:
        print(
            f"decode: batch 1, {args.decode_tokens} tokens, median of {args.rounds} alternating rounds; "
            f"TTFT of a {info['prefill_tokens']}-token prompt; {args.threads} thread(s)"
        )
        print(f"{'scheme':<16}{'weights MB':>11}{'decode tok/s':>14}{'TTFT s':>8}  all tok/s")
        for r in info["rows"]:
            print(
                f"{r['scheme']:<16}{r['weight_bytes'] / 1e6:>11.1f}{r['decode_tok_s']:>14.1f}"
                f"{r['ttft_s']:>8.2f}  {r['decode_tok_s_all']}"
            )
    else:
        print(
            f"{info['model']}: {info['prompts']} prompts x {args.tokens} greedy tokens, perplexity on "
            f"{info['text_tokens']} tokens; reference {info['rows'][0]['scheme']}; {args.threads} thread(s)"
        )
        print(
            f"{'scheme':<16}{'weights MB':>11}{'greedy prefix':>15}{'exact':>7}{'forced top-1':>14}"
            f"{'mean |dlogit|':>15}{'perplexity':>12}{'vs ref':>9}"
        )
        for r in info["rows"]:
            print(
                f"{r['scheme']:<16}{r['weight_bytes'] / 1e6:>11.1f}{r['greedy_prefix_agreement']:>15.1%}"
                f"{r['greedy_exact_prompts']:>7}{r['forced_top1_agreement']:>14.1%}"
                f"{r['mean_abs_logit_diff']:>15.4f}{r['perplexity']:>12.3f}{r['perplexity_vs_ref']:>+9.2%}"
            )


if __name__ == "__main__":
    main()
