"""`pagedkv` command line: serve, generate, simulate, plan, bench.

Each subcommand lives in its own module exposing `add_parser(subparsers)` and
`run(args) -> int`. A user mistake (bad flag, bad file) prints one line on
stderr and exits with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Mapping

from pagedkv.config import (
    ALWAYS_ON,
    DTYPE_ALIASES,
    DTYPES,
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    NOOP_OPTIONS,
    QUANTIZATIONS,
    UNSUPPORTED_OPTIONS,
    ConfigError,
    EngineConfig,
    note,
)
from pagedkv.config_file import FLAG as CONFIG_FLAG
from pagedkv.config_file import config_tokens, split_config_flag
from pagedkv.signals import exit_on_sigterm

# subcommand -> module that implements it
COMMANDS = {
    "serve": "pagedkv.server.cli",
    "generate": "pagedkv.engine.cli",
    "simulate": "pagedkv.sim.cli",
    "plan": "pagedkv.sim.plan_cli",
    "bench": "pagedkv.bench.cli",
}


class Parser(argparse.ArgumentParser):
    """argparse, but errors are one line and exit 2 (argparse prints usage first), and no flag
    may be abbreviated: vLLM's `--tokenizer PATH` must not pass for our `--tokenizer-mode`."""

    commands: Mapping[str, argparse.ArgumentParser]  # the top parser's subparsers, by name

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        print(
            f"{self.prog}: error: {message}", file=sys.stderr
        )  # prog is "pagedkv" or "pagedkv CMD"
        raise SystemExit(2)


class NoteAction(argparse.Action):
    """A vLLM flag with no meaning here: accepted, with a one-line note on stderr saying why."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name = self.dest
        if name in ALWAYS_ON and option_string and option_string.startswith("--no-"):
            parser.error(f"{option_string} is not supported: {NOOP_OPTIONS[name]}")
        note(f"{option_string} has no effect: {NOOP_OPTIONS[name]}")


_NOOP_BOOL = (
    "language_model_only",
    "numa_bind",
    "log_error_stack",
    "trust_remote_code",
    "enable_chunked_prefill",
    "enable_prompt_tokens_details",
    "disable_log_requests",
    "disable_log_stats",
    "disable_frontend_multiprocessing",
    "disable_custom_all_reduce",
    "async_scheduling",
    "disable_fastapi_docs",
    "calculate_kv_scales",
    "enable_server_load_tracking",
    "use_tqdm_on_load",
    "disable_hybrid_kv_cache_manager",
    "aggregate_engine_logging",
    "disable_cascade_attn",
    "enable_offline_docs",
)
_NOOP_NARGS = {"hf_token": "?", "ignore_patterns": "+", "cudagraph_capture_sizes": "+"}
_NOOP_SHORT = {"compilation_config": "-O", "api_server_count": "-asc"}  # vLLM's -O3: -O 3


class RefuseAction(argparse.Action):
    """A vLLM flag for what pagedkv does not have: one error line saying why (exit 2)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is not supported: {UNSUPPORTED_OPTIONS[self.dest]}")


def add_switch(p, flag: str, help: str, default: bool = False) -> None:
    """A boolean flag with its --no- form, as all of vLLM's are."""
    p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help)


def add_noop_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags that mean nothing on this engine (see config.NOOP_OPTIONS)."""
    g = p.add_argument_group("accepted for vLLM compatibility, no effect here (a note says why)")
    for name in NOOP_OPTIONS:
        flag = "--" + name.replace("_", "-")
        paired = name in _NOOP_BOOL  # (as in vLLM, every boolean flag has its --no- form)
        flags = [flag, "--no-" + flag[2:]] if paired else [flag]
        flags += [_NOOP_SHORT[name]] if name in _NOOP_SHORT else []
        g.add_argument(
            *flags,
            dest=name,
            action=NoteAction,
            nargs=0 if name in _NOOP_BOOL else _NOOP_NARGS.get(name),
            default=argparse.SUPPRESS,
            help=NOOP_OPTIONS[name],
        )
    g = p.add_argument_group("vLLM's, for what pagedkv does not have (an error says why)")
    for name, why in UNSUPPORTED_OPTIONS.items():
        g.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            action=RefuseAction,
            nargs="*",
            default=argparse.SUPPRESS,
            help=why,
        )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model and cache flags shared by serve, generate and bench.

    They use vLLM's names, units and defaults."""
    p.add_argument(  # read before parsing (main: with_config_file); here for --help
        CONFIG_FLAG,
        metavar="FILE",
        help="a YAML file of these flags, as vLLM's (max-num-seqs: 8); the command line wins",
    )
    _add_model_args(p)
    _add_cache_args(p)
    _add_scheduler_args(p)
    _add_log_args(p)
    add_noop_args(p)


def text_only(value: str) -> None:
    """vLLM's --limit-mm-per-prompt: every limit 0 (a text-only server) asks for what pagedkv
    does anyway (a note); any other limit is an error."""
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--limit-mm-per-prompt is not JSON: {e}") from None
    if not isinstance(limits, dict):
        raise ConfigError("--limit-mm-per-prompt must be a JSON object, e.g. '{\"image\": 0}'")
    for kind, limit in limits.items():
        if limit != 0 and not (isinstance(limit, dict) and limit.get("count") == 0):
            raise ConfigError(
                f"--limit-mm-per-prompt: pagedkv takes text only, so {kind}'s limit must be 0"
            )
    note("--limit-mm-per-prompt has no effect: pagedkv takes text only")


def _add_log_args(p: argparse.ArgumentParser) -> None:
    """vLLM's request log (pagedkv serve's; elsewhere a note says so)."""
    p = p.add_argument_group("request log (pagedkv serve)")  # type: ignore[assignment]
    add_switch(
        p,
        "--enable-log-requests",
        "log each request as it arrives: its id and parameters (the prompt too at "
        "--log-level DEBUG)",
    )
    add_switch(
        p,
        "--enable-log-outputs",
        "with --enable-log-requests: log each answer's text and finish reason",
    )
    add_switch(
        p,
        "--enable-log-deltas",
        "with --enable-log-outputs: a streamed answer's pieces too (default: on)",
        default=True,
    )
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="characters of a prompt or answer, and token ids, those lines show (default: all)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """What is loaded and how it samples by default."""
    d = EngineConfig.__dataclass_fields__
    p.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help="vLLM's; pagedkv takes text only: every limit must be 0, e.g. '{\"image\": 0}'",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (same as --model)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the API answers to; the first is reported (default: the model's own name)",
    )
    p.add_argument("--dtype", default="auto", choices=[*DTYPES, *DTYPE_ALIASES])
    p.add_argument(
        "--seed",
        type=int,
        default=d["seed"].default,
        help="seeds sampling for requests without their own seed",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=list(QUANTIZATIONS),
        help="weights: none, int8 (per channel), gguf (the file's own blocks; default for a .gguf "
        "on CPU); int8 and gguf keep a bf16 copy for steps of many rows (PAGEDKV_DENSE_WEIGHTS)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or its file, replacing the model's",
    )
    add_switch(p, "--enable-lora", "serve LoRA adapters over the base model")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='PEFT adapter folders, each served as a model name (or JSON {"name": ..., '
        '"path": ...})',
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=d["max_lora_rank"].default,
        help="the largest adapter rank accepted",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=d["max_logprobs"].default,
        help="the most logprobs and prompt_logprobs a request may ask for; -1: the vocabulary",
    )
    p.add_argument(
        "--logprobs-mode",
        default=d["logprobs_mode"].default,
        choices=LOGPROBS_MODES,
        help="what logprobs report: the model's own values (raw_*), or those the token was drawn "
        "from after penalties, banned tokens, a grammar, temperature and top-k/top-p/min-p "
        "(processed_*); as log-probabilities (*_logprobs) or logits (*_logits)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="'auto': sampling defaults from the model folder's generation_config.json; "
        "'vllm': none",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="generation_config.json keys over those defaults, e.g. '{\"temperature\": 0.5}'",
    )


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """The KV pool, its preemption and its offload tiers."""
    d = EngineConfig.__dataclass_fields__
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        default=None,
        help="KV pool size, e.g. 1GiB or bytes (wins over --gpu-memory-utilization)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        "--device-memory-utilization",
        "--memory-utilization",
        dest="memory_utilization",
        type=float,
        default=d["memory_utilization"].default,
        help="fraction of free device memory after the weights to give the KV pool",
    )
    p.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="exact KV pool size in blocks"
    )
    p.add_argument(
        "--swap-space",
        default=d["swap_space"].default,
        help="host memory for swap-preempted blocks: GiB as in vLLM (4), or a size (512MiB)",
    )
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="generate: text only; pooling: embeddings only (/v1/embeddings, LLM.embed); auto "
        "(default): both, or embeddings only from a checkpoint with no LM head",
    )
    p.add_argument(
        "--convert",
        default="auto",
        choices=["auto", "none", "embed"],
        help="vLLM's: embed serves a causal LM's embeddings only (as --runner pooling)",
    )
    p.add_argument(
        "--pooler-config",
        default=None,
        metavar="JSON",
        help='how embeddings are pooled, over what the model says: \'{"pooling_type": "MEAN", '
        '"normalize": false}\' (LAST, MEAN or CLS)',
    )
    p.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help="vLLM's, for an LLM used as a reranker: '{\"architectures\": "
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        "\"is_original_qwen3_reranker\": true}' scores pairs by those tokens' logits (/score, "
        "/rerank)",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="priority: requests wait and are preempted by their priority (lower first), then "
        "arrival",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES]
    )
    p.add_argument(
        "--allocation-policy", default="paged", choices=["paged", "reserve-max", "reserve-output"]
    )
    p.add_argument(
        "--kv-offload-host-memory",
        default=None,
        help="host tier for evicted prefix blocks, e.g. 4GiB",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GIB",
        help="vLLM's CPU KV offloading, in GiB: the same as --kv-offload-host-memory",
    )
    p.add_argument(
        "--kv-offloading-backend",
        default="native",
        choices=["native"],
        help="vLLM's: native (pagedkv's host tier) is the only one",
    )
    p.add_argument(
        "--kv-offload-dir",
        default=None,
        help="disk tier folder: every full prefix block is written "
        "through in the background, so a restart on it finds them",
    )
    p.add_argument(
        "--kv-offload-disk-size", default=None, help="most the disk tier holds (default 10GiB)"
    )


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """Batch and queue limits, parallelism and speculative decoding."""
    d = EngineConfig.__dataclass_fields__
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--max-model-len",
        default=None,
        help="context length: 4096, or 32k (32000), 32K (32768), 1M",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=d["max_waiting"].default,
        help="queue length beyond which new requests get 429",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=d["stream_interval"].default,
        help="new tokens each streamed chunk carries at least, but the first and the last "
        "(vLLM's; a request's stream_interval may raise it)",
    )
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split every layer over N processes (torch.distributed)",
    )
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, help="only 1")
    p.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help="serve: N engine replicas behind one endpoint on Ray Serve "
        "(pip install 'pagedkv[ray]')",
    )
    p.add_argument(
        "--speculative-config",
        default="auto",
        help='n-gram speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 32}\'; '
        '"auto" (default: that config, off with a quantized KV cache) or "off"',
    )
    p.add_argument("--spec-method", default=None, help="vLLM's: --speculative-config's method")
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=None,
        help="vLLM's: --speculative-config's num_speculative_tokens",
    )
    p.add_argument("--spec-model", default=None, help="vLLM's draft model: not supported here")
    add_switch(
        p,
        "--enforce-eager",
        "run every step through Python; by default a decode step of a batch size seen "
        "before replays its recorded kernel calls in one C++ call (same results)",
    )
    add_switch(
        p,
        "--disable-sliding-window",
        "a model with a sliding window attends to the whole context instead, served up to "
        "its window (as vLLM's flag)",
    )


def speculative_shorthand(args: argparse.Namespace) -> None:
    """vLLM's --spec-method and --spec-tokens: fields of --speculative-config (a field in both is
    an error, as in vLLM)."""
    fields = {
        "spec_method": "method",
        "spec_model": "model",
        "spec_tokens": "num_speculative_tokens",
    }
    given = {key: vars(args).pop(name, None) for name, key in fields.items()}
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        return
    from pagedkv.engine.spec_decode import OFF  # (late, as EngineConfig imports it)

    if "model" in given:
        raise ConfigError(
            "--spec-model: pagedkv drafts by n-gram lookup (--spec-method ngram), not with a "
            "draft model"
        )
    base = args.speculative_config.strip()
    if base.lower() in OFF:
        raise ConfigError(f"--spec-method and --spec-tokens need speculation on, not {base!r}")
    try:
        config = {} if base.lower() == "auto" else json.loads(base)
    except ValueError as e:
        raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    for key, value in given.items():
        if key in config:
            flag = next(f for f, k in fields.items() if k == key).replace("_", "-")
            raise ConfigError(f"--{flag} and --speculative-config's {key!r} are mutually exclusive")
        config[key] = value
    args.speculative_config = json.dumps(config)


def engine_config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    speculative_shorthand(args)
    size = vars(args).pop("kv_offloading_size", None)  # (vLLM's name for the host tier)
    if size is not None:
        if args.kv_offload_host_memory is not None:
            raise ConfigError("--kv-offloading-size and --kv-offload-host-memory size one tier")
        if not (math.isfinite(size) and size > 0):
            raise ConfigError(f"--kv-offloading-size must be a number of GiB > 0, got {size}")
        args.kv_offload_host_memory = int(size * 2**30)
    limits = vars(args).pop("limit_mm_per_prompt", None)
    if limits is not None:
        text_only(limits)
    opts = {k: v for k, v in vars(args).items() if k in EngineConfig.field_names()}
    opts.update(extra)
    return EngineConfig.from_options(**opts)


def merge_model_tag(args: argparse.Namespace) -> None:
    """`pagedkv serve MODEL` (vLLM's form) is `--model MODEL`; two different models are an error."""
    tag = vars(args).pop("model_tag", None)
    if tag is None:
        return
    if args.model not in (None, tag):
        raise ConfigError(f"two models given: {tag!r} and --model {args.model!r}")
    args.model = tag


def build_parser() -> Parser:
    parser = Parser(
        prog="pagedkv", description="Paged KV-cache LLM engine and OpenAI-compatible server."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    parser.commands = sub.choices  # name -> subparser, for errors found after parsing
    return parser


def with_config_file(parser: Parser, argv: list[str]) -> tuple[list[str], str | None]:
    """argv with its `--config FILE`'s flags put first (see config_file), and the file's model."""
    command = parser.commands.get(argv[0]) if argv else None
    try:
        argv, path = split_config_flag(argv)
        if path is None:
            return argv, None
        if command is None or CONFIG_FLAG not in command._option_string_actions:  # noqa: SLF001
            raise ConfigError(f"{CONFIG_FLAG} goes after serve, generate or bench")
        tokens, model = config_tokens(path, command)
    except ConfigError as e:
        (command or parser).error(str(e))  # one line, exit code 2
        raise  # (error exits)
    return [argv[0], *tokens, *argv[1:]], model


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, config_model = with_config_file(parser, list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand they were given to
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if config_model is not None and args.model is None and args.model_tag is None:
            args.model = config_model  # the command line's model comes first
        merge_model_tag(args)
        with exit_on_sigterm(f"pagedkv {args.command}: stopped by SIGTERM"):
            return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError) as e:
        print(f"pagedkv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pagedkv simulate | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
