"""The synchronous engine: requests in, one scheduled step at a time, outputs out.

text -> tokenizer -> scheduler (asks the KV manager for blocks) -> runner
(tensors) -> model -> sampler -> detokenizer -> RequestOutput.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from pagedkv.config import ConfigError, EngineConfig, format_size
from pagedkv.engine.detokenizer import Detokenizer, init_offsets, visible_text
from pagedkv.engine.request import RequestOutput, SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.offload import KVOffload
from pagedkv.kv.storage import KVStorage

log = logging.getLogger("pagedkv")

CPU_DEFAULT_KV_CAP = 4 * 2**30   # on CPU, --memory-utilization alone never takes more than this
DEFAULT_MAX_BATCHED_TOKENS = 2048


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    token_utilization: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    block_size: int
    token_capacity: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    offload_hits: int              # prompt tokens loaded back from the host / disk tiers
    offload_saved_blocks: int      # evicted device blocks kept in a tier
    model_weight_bytes: int = 0    # resident weights (after --quantization)


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Tells glibc's malloc to keep freed memory for reuse instead of returning it to the system.

    Every CPU step allocates and frees tens of MB of activations per layer. By default glibc trims
    the heap (or unmaps) on free, so the next step faults the same pages in again: on a 2048-token
    prefill step that was 17% of the step (W1's prefill: 7.5 -> 6.2 s). True when it took effect.
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30) and mallopt(_M_MMAP_THRESHOLD, 32 << 20))


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil
    return psutil.virtual_memory().available


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    """Pool size: an exact block count, else --kv-cache-memory, else a share of free memory."""
    if config.num_gpu_blocks_override is not None:
        n = config.num_gpu_blocks_override
    elif config.kv_cache_memory is not None:
        n = config.kv_cache_memory // bytes_per_block
    else:
        budget = int(free_device_memory(device) * config.memory_utilization)
        if device.type == "cpu" and budget > CPU_DEFAULT_KV_CAP:
            log.info("KV pool capped at %s on CPU; pass --kv-cache-memory for more", format_size(CPU_DEFAULT_KV_CAP))
            budget = CPU_DEFAULT_KV_CAP
        n = budget // bytes_per_block
    if n < 1:
        raise ConfigError(f"the KV cache memory holds no block of {bytes_per_block} bytes; give it more memory")
    return int(n)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded=None) -> None:
        from pagedkv.model.loader import load_model, resolve_dtype

        self.config = config
        self.device = pick_device()
        if self.device.type == "cpu":
            keep_freed_memory()
        dtype = resolve_dtype(config.dtype)
        t0 = time.monotonic()
        self.loaded = loaded or load_model(config.model, dtype, self.device, config.quantization)
        self.weight_bytes = self.loaded.model.weight_bytes()
        log.info("loaded %s in %.1fs: weights %s (quantization %s)", self.loaded.name, time.monotonic() - t0,
                 format_size(self.weight_bytes), self.loaded.quantization)
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.vocab_size = mc.vocab_size
        self.model_name = config.served_model_name or self.loaded.name
        self.max_model_len = min(config.max_model_len or self.loaded.max_model_len, self.loaded.max_model_len)
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        shape = dict(num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                     block_size=config.block_size, head_dim=mc.head_dim, dtype=kv_dtype)
        bytes_per_block = KVStorage.bytes_per_block(**shape)
        num_blocks = num_kv_blocks(config, bytes_per_block, self.device)
        self.storage = KVStorage(num_blocks=num_blocks, device=self.device, **shape)
        hash_extra = f"{self.loaded.fingerprint}:{kv_dtype}".encode()
        self.offload = KVOffload.from_config(config, self.storage, hash_extra)
        host_tier = self.offload.host if self.offload is not None else None
        num_host = 0
        if config.preemption_mode == "swap" and host_tier is None:   # else swap borrows the host tier's slots
            num_host = max(config.swap_space // bytes_per_block, 1)
        host = KVStorage(num_blocks=num_host, device=torch.device("cpu"), **shape) if num_host else None
        if host_tier is not None:
            host = host_tier.storage
        self.kv = KVCacheManager(
            num_blocks, config.block_size, num_host_blocks=num_host,
            enable_prefix_caching=config.enable_prefix_caching, allocation_policy=config.allocation_policy,
            max_model_len=self.max_model_len, hash_extra=hash_extra, offload=self.offload)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS,
                                   preemption_mode=config.preemption_mode)
        self.runner = ModelRunner(self.loaded.model, self.storage, host, self.kv, self.device, self.offload)
        self.sampler = Sampler(self.tokenizer.eos_token_ids)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.groups: dict[str, SequenceGroup] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        log.info("KV pool: %d blocks of %d tokens (%s, %d tokens), max_model_len %d",
                 num_blocks, config.block_size, format_size(num_blocks * bytes_per_block),
                 num_blocks * config.block_size, self.max_model_len)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Reject what can never run, with the reason; returns max_tokens resolved."""
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise ConfigError("the prompt is empty")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        if n_prompt >= self.max_model_len:
            raise ConfigError(f"the prompt has {n_prompt} tokens, but max_model_len is {self.max_model_len}: "
                              "no room is left for output")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise ConfigError(f"max_tokens={max_tokens} plus the prompt's {n_prompt} tokens exceeds "
                              f"max_model_len={self.max_model_len}")
        if params.n > self.config.max_num_seqs:
            raise ConfigError(f"n={params.n} exceeds --max-num-seqs={self.config.max_num_seqs}")
        bs = self.config.block_size
        need = math.ceil(n_prompt / bs) + params.n * math.ceil((max_tokens + 1) / bs)
        if not self.kv.can_fit(n_prompt + max_tokens) or (params.n > 1 and need > self.kv.num_blocks):
            cap = self.kv.num_blocks * bs
            raise ConfigError(f"the request needs KV for {n_prompt} prompt + {max_tokens} output tokens "
                              f"x n={params.n}, more than the KV pool holds ({cap} tokens); "
                              "lower max_tokens or n, or give the pool more memory")
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    add_special_tokens: bool = True) -> SequenceGroup:
        if request_id in self.groups:
            raise ConfigError(f"request id {request_id!r} is already in use")
        prompt_ids = self.tokenize(prompt, add_special_tokens)
        max_tokens = self.validate(prompt_ids, params)
        group = SequenceGroup.create(request_id, prompt if isinstance(prompt, str) else None, prompt_ids,
                                     params, max_tokens)
        init_offsets(group.seqs[0])
        self.groups[request_id] = group
        self.scheduler.add(group.seqs[0])
        self.prompt_tokens_total += len(prompt_ids)
        return group

    def abort(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        group.aborted = True
        group.metrics.finished_time = time.monotonic()
        return group.to_output(visible_text)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        logits = self.runner.execute(out)
        sampling = [s.seq for s in out.scheduled if s.samples]
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        if logits is None:
            return []
        rows, seqs = self._expand_forks(sampling)
        if len(rows) != len(sampling):
            logits = logits[rows]
        result = self.sampler(logits, seqs)
        now = time.monotonic()
        touched: dict[str, SequenceGroup] = {}
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
            self._append(seq, token, lp, now)
            touched[seq.group.request_id] = seq.group
        outputs = []
        for rid, group in touched.items():
            outputs.append(group.to_output(visible_text))
            if group.finished:
                group.metrics.finished_time = now
                self.groups.pop(rid, None)
        return outputs

    def _expand_forks(self, sampling: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """A request with n > 1 forks after its prefill: every sample draws its first token from the same row."""
        rows, seqs = [], []
        for i, seq in enumerate(sampling):
            rows.append(i)
            seqs.append(seq)
            group = seq.group
            if len(group.seqs) < group.params.n and seq.num_output_tokens == 0:
                for index in range(1, group.params.n):
                    child = group.new_seq(index, list(seq.token_ids))
                    init_offsets(child)
                    group.seqs.append(child)
                    self.scheduler.fork(seq, child)
                    rows.append(i)
                    seqs.append(child)
        return rows, seqs

    def _append(self, seq: Sequence, token: int, logprob, now: float) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self.generation_tokens_total += 1
        m = seq.group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        if seq.index == 0:
            m.token_times.append(now)
            m.last_token_time = now
        stopped = self.detokenizer.update(seq)
        p = seq.params
        if stopped:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= seq.group.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        s = self.kv.stats()
        sch = self.scheduler
        return EngineStats(
            num_running=len(sch.running), num_waiting=len(sch.waiting), num_swapped=len(sch.swapped),
            kv_usage=s.usage, token_utilization=s.token_utilization, num_blocks=s.num_blocks,
            num_free_blocks=s.free, num_cached_blocks=s.cached, block_size=self.kv.block_size,
            token_capacity=s.num_blocks * self.kv.block_size, prefix_queries=s.prefix_queries,
            prefix_hits=s.prefix_hits, num_preemptions=sch.num_preemptions,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            offload_hits=s.offload_hits, offload_saved_blocks=self.offload.stats().saved if self.offload else 0,
            model_weight_bytes=self.weight_bytes)

    def kv_snapshot(self) -> dict:
        return self.kv.snapshot()
