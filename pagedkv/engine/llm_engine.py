"""The synchronous engine: requests in, one scheduled step at a time, outputs out.

text -> tokenizer -> scheduler (asks the KV manager for blocks) -> runner
(tensors) -> model -> sampler -> detokenizer -> RequestOutput.
A request that fails at any of these stages ends alone (isolation.py); the
others in its batch go on as if it had finished.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pagedkv.config import ConfigError, EngineConfig, lora_modules
from pagedkv.cpu_memory import keep_freed_memory
from pagedkv.engine import prompt_logprobs
from pagedkv.engine.admission import tokenize, validate_request
from pagedkv.engine.beam_search import Candidates, Choice, answer, choose
from pagedkv.engine.detokenizer import Detokenizer, init_offsets, visible_text
from pagedkv.engine.engine_stats import EngineStats, engine_stats
from pagedkv.engine.faults import FaultInjector
from pagedkv.engine.isolation import Failures, IsolatedForward, device_broken
from pagedkv.engine.options import apply_engine_options, generation_defaults
from pagedkv.engine.outputs import RequestOutput, SampleLogprob
from pagedkv.engine.pooling import (
    NO_LM_HEAD,
    POOLING_TASKS,
    Pooler,
    PoolingParams,
    embedding,
)
from pagedkv.engine.reasoning import ReasoningTags, ThinkTracker
from pagedkv.engine.request import EVERY_TOKEN, ParamError, SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.scheduler import ScheduledSeq, Scheduler
from pagedkv.engine.scoring import Classifier, ClassifierSpec
from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.engine.setup import (
    build_engine_kv,
    check_environment,
    load_engine_model,
    pick_device,
    rank_lora_cut,
)
from pagedkv.engine.spec_decode import NgramProposer, SpecDecodeStats
from pagedkv.engine.step_stats import StepTokens
from pagedkv.engine.structured import StructuredOutputs
from pagedkv.model.loader import read_checkpoint
from pagedkv.model.lora import LoRAAdapter, load_adapter

log = logging.getLogger("pagedkv")

# a sampled token: its sequence, id, logprob record, and whether it completes a structured grammar
Drawn = tuple[Sequence, int, SampleLogprob | None, bool]

DEFAULT_MAX_BATCHED_TOKENS = 2048


def encoder_config(config: EngineConfig) -> EngineConfig:
    """An encoder engine's config: no LoRA, no prefix cache (it keeps no K/V to reuse)."""
    if config.enable_lora:
        raise ConfigError("--enable-lora: pagedkv runs no LoRA adapter on an encoder")
    if config.chat_template:
        raise ConfigError(
            "--chat-template: an encoder has no chat, and a cross-encoder reads each pair as its "
            "tokenizer's pair of texts"
        )
    kept = {  # (an encoder keeps no K/V: nothing to quantize, swap or offload)
        "--kv-cache-dtype": config.kv_cache_dtype != "auto",
        "--preemption-mode swap": config.preemption_mode == "swap",
        "--kv-offload-host-memory": config.kv_offload_host_memory is not None,
        "--kv-offload-dir": config.kv_offload_dir is not None,
    }
    asked = [flag for flag, given in kept.items() if given]
    if asked:
        raise ConfigError(f"{asked[0]}: an encoder keeps no K/V (each prompt runs whole)")
    if config.enable_prefix_caching:
        log.info("prefix caching off: an encoder keeps no K/V")
    return dataclasses.replace(config, enable_prefix_caching=False)


class LLMEngine:
    generation_defaults: dict  # SamplingParams fields from generation_config.json (options.py)

    def __init__(self, config: EngineConfig, loaded=None) -> None:
        if config.data_parallel_size != 1:
            raise ConfigError(
                "--data-parallel-size N runs N engine replicas under `pagedkv serve`; "
                "this is one engine"
            )
        self.config = config
        self.device = pick_device()
        check_environment(self.device)
        # read before the load: a mistake in them is one line at once, not after the weights
        self.generation_defaults = generation_defaults(config)
        pooler = Pooler.of_model(config.model)  # how embeddings are made (engine/pooling.py)
        Pooler().overridden(config.pooler_config)  # (checked now, applied after the load)
        scorer = ClassifierSpec.of(config.hf_overrides)  # a cross-encoder's head (scoring.py)
        if self.device.type == "cpu":
            keep_freed_memory()
        if config.reasoning_parser and loaded is None:  # its tags, before the weights load
            ReasoningTags.of(
                config.reasoning_parser,
                read_checkpoint(config.model)[0].tokenizer,
                config.reasoning_config,
            )
        self.loaded, num_kv_heads = load_engine_model(config, self.device, loaded)
        if self.loaded.config.encoder:
            self.config = config = encoder_config(config)
        self.weight_bytes = self.loaded.model.weight_bytes()
        if pooler is None:  # no sentence-transformers modules: what the model declares
            pooler = Pooler(self.loaded.config.pooling or "LAST")
        self.pooler = pooler.overridden(config.pooler_config)
        self.tokenizer = self.loaded.tokenizer
        self.classifier = Classifier.of_model(scorer, self.loaded.model, self.tokenizer)
        if self.classifier is not None:
            if config.runner == "generate" or config.pooler_config:
                raise ConfigError(
                    f"{self.classifier_source()} makes a classifier, which scores pairs by its "
                    "last token: not "
                    + ("--runner generate" if config.runner == "generate" else "--pooler-config")
                )
            encoder = self.loaded.config.encoder  # (its classifier pools as its config says)
            self.pooler = Pooler(
                (self.loaded.config.pooling or "CLS") if encoder else "LAST", normalize=False
            )
        # the Dense modules' projection of a pooled vector, checked against the model
        self.projection = self.pooler.projection(self.loaded.config.hidden_size)
        apply_engine_options(self, config)  # seed, chat template
        self.reasoning = (
            ReasoningTags.of(config.reasoning_parser, self.tokenizer, config.reasoning_config)
            if config.reasoning_parser
            else None
        )
        self.loras: dict[str, LoRAAdapter] = {}
        self.lora_keys: dict[str, str] = {}  # name -> its prefix-cache key (the scheduler's)
        for module in lora_modules(config.lora_modules).values():
            self.add_lora(module.name, module.path, module.base_model_name)
        self.vocab_size = self.loaded.config.vocab_size
        self.generates = (
            self.loaded.config.generates and config.runner != "pooling" and not self.classifier
        )
        self.pools = config.runner != "generate"
        if config.runner == "generate" and not self.loaded.config.generates:
            raise ConfigError(f"--runner generate: {NO_LM_HEAD}")
        self.model_name = config.served_model_names[0]
        self.max_model_len: int = config.max_model_len or self.loaded.max_model_len
        if self.max_model_len > self.loaded.max_model_len:  # as vLLM: a longer one is refused
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the model's context length "
                f"({self.loaded.max_model_len}: max_position_embeddings, or a sliding window)"
            )
        rope = self.loaded.config.rope_scaling or {}
        long = rope.get("rope_type") == "longrope" and rope["long"] != (
            self.max_model_len > rope["original_max_position_embeddings"]
        )  # (a model loaded for another context: load_model(max_model_len=...) sizes its RoPE)
        if long or self.max_model_len > self.loaded.model.context:
            raise ConfigError(
                f"this model's RoPE tables were built for a context of "
                f"{self.loaded.model.context}, not --max-model-len {self.max_model_len}"
            )
        budget = config.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS
        if self.loaded.config.encoder and self.max_model_len > budget:
            raise ConfigError(
                f"--max-num-batched-tokens must hold a whole prompt of --max-model-len "
                f"{self.max_model_len}: an encoder runs each prompt in one step"
            )
        kv = build_engine_kv(config, self.loaded, num_kv_heads, self.device, self.max_model_len)
        self.tp, self.storage, self.offload, self.kv = kv.tp, kv.storage, kv.offload, kv.manager
        proposer = NgramProposer(config.speculative_config) if config.speculative_config else None
        self.spec_stats = SpecDecodeStats()
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            preemption_mode=config.preemption_mode,
            proposer=proposer,
            policy=config.scheduling_policy,
            adapter_keys=self.lora_keys,
            whole_prompts=bool(self.loaded.config.encoder),
        )
        self.runner = ModelRunner(
            self.loaded.model,
            self.storage,
            kv.host,
            self.device,
            self.kv,
            self.offload,
            self.tp,
            eager=config.enforce_eager,
            loras=self.loras,
            lora_cut=rank_lora_cut(config, self.loaded, 0),
        )
        # sections followed by token: a grammar waits for the answer, a thinking budget ends them
        self.thinking = (
            ThinkTracker(self.reasoning) if self.reasoning and self.reasoning.tokens else None
        )
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.thinking)
        self.sampler = Sampler(
            self.tokenizer.eos_token_ids, self.structured, self.thinking, config.logprobs_mode
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.faults = FaultInjector.from_env(self.tokenizer)  # tests only: see faults.py
        self._forward = IsolatedForward(self.runner, self._check_faults)
        self.groups: dict[str, SequenceGroup] = {}
        self.step_tokens = StepTokens()  # tokens per step, for /metrics' iteration_tokens_total
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_lora(self, name: str, path: str, parent: str | None = None) -> LoRAAdapter:
        """Load a PEFT adapter under `name` (once: the same name again must be the same path);
        `parent`: the model /v1/models names as its base (default: the served model)."""
        if not self.config.enable_lora:
            raise ConfigError("LoRA adapters need --enable-lora (enable_lora=True offline)")
        if name in self.config.served_model_names:
            raise ConfigError(f"LoRA adapter {name!r}: that is the base model's name")
        known = self.loras.get(name)
        if known is not None:
            if known.path != str(path):
                raise ConfigError(f"LoRA adapter {name!r} is already loaded from {known.path}")
            return known
        model = self.loaded.model
        adapter = load_adapter(
            name, path, self.loaded.config, model.dtype, self.config.max_lora_rank
        )
        adapter.parent = parent
        self.loras[name] = adapter
        self.lora_keys[name] = adapter.key
        return adapter

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (vLLM's /v1/unload_lora_adapter): LookupError when none is loaded
        under `name`, ConfigError while a request runs under it. Its prefix-cache blocks stay,
        keyed by its files: loaded again, it finds them."""
        if name not in self.loras:
            raise LookupError(f"no LoRA adapter {name!r} is loaded")
        using = [rid for rid, g in self.groups.items() if g.params.lora_name == name]
        if using:
            raise ConfigError(
                f"LoRA adapter {name!r} is in use by {len(using)} request(s), "
                f"e.g. {using[0]!r}: unload it when they are done"
            )
        del self.loras[name], self.lora_keys[name]

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return tokenize(self.tokenizer, prompt, add_special_tokens)

    def special_ends(self, prompt: str | list[int], add_special_tokens: bool) -> tuple[int, int]:
        """The special tokens tokenizing this prompt puts at its start and its end (truncation
        keeps them)."""
        return self.tokenizer.special_ends(isinstance(prompt, str) and add_special_tokens)

    def check_pools(self, embeddings: bool = False) -> None:
        """Refuse pooling requests (embeddings, scores) where this engine makes none, and
        embeddings where it is a classifier, saying why."""
        if not self.pools:
            raise ConfigError("this engine makes no embeddings or scores (--runner generate)")
        if embeddings and self.classifier is not None:
            raise ConfigError(
                f"this engine is a classifier ({self.classifier_source()}): it classifies texts "
                "and scores pairs (/classify, /score, /rerank, LLM.classify, LLM.score) and makes "
                "no embeddings"
            )

    def check_classifier(self) -> Classifier:
        """The engine's classifier, or the refusal of a model that has none."""
        self.check_pools()
        if self.classifier is None:
            raise ConfigError(
                "this model has no classifier to classify with: a *ForSequenceClassification "
                "checkpoint has one, or --hf-overrides makes one of LM-head rows"
            )
        return self.classifier

    def pooling_task(self, task: str | None, params: PoolingParams) -> str:
        """The pooling task a call runs (POOLING_TASKS; None: this model's own), refused where
        this engine makes no such output or `params` holds what the task does not take."""
        task = task or ("classify" if self.classifier is not None else "embed")
        if task == "plugin":
            raise ParamError(
                "task", "pooling task 'plugin' is not supported: pagedkv has no plugins"
            )
        if task not in POOLING_TASKS:
            raise ParamError(
                "task", f"unknown pooling task {task!r}: one of {', '.join(POOLING_TASKS)}"
            )
        if task.removeprefix("token_") == "embed":
            self.check_pools(embeddings=True)
        else:
            self.check_classifier()
            params.only_activation(task)
        return task

    def pooled_data(self, task: str, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """What a pooling task (checked by pooling_task) makes of a prompt's pooled vector: its
        embedding, or its labels' probabilities (their logits without use_activation); of a
        per-token task's vectors, the same for each."""
        if task.removeprefix("token_") == "embed":
            return embedding(vector, params.normalizes(self.pooler), params.dimensions)
        return self.check_classifier().probs(vector, params.use_activation is not False)

    def classifier_source(self) -> str:
        """What made this engine a classifier, for its refusals."""
        if self.config.hf_overrides:
            return "--hf-overrides"
        return "a *ForSequenceClassification checkpoint"

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Reject what can never run, with the reason; returns max_tokens resolved."""
        return validate_request(self, prompt_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        add_special_tokens: bool = True,
    ) -> SequenceGroup:
        if request_id in self.groups:
            raise ConfigError(f"request id {request_id!r} is already in use")
        prompt_ids = params.truncate(
            self.tokenize(prompt, add_special_tokens),
            self.max_model_len,
            self.special_ends(prompt, add_special_tokens),
        )
        max_tokens = self.validate(prompt_ids, params)
        group = SequenceGroup.create(
            request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params, max_tokens
        )
        if group.pooled is not None and group.pooled.pooling_type != EVERY_TOKEN:
            group.pooled.project = self.projection
        init_offsets(group.seqs[0])
        self.groups[request_id] = group
        self.scheduler.add(group.seqs[0])
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
        """One scheduled batch. A request that fails in it ends alone, with `RequestOutput.error`;
        an exception out of step is the engine's own (its state is then undefined)."""
        if self.faults is not None:
            self.faults.check("step", self.groups.values())
        out = self.scheduler.schedule()
        self.step_tokens.observe(out.num_batched_tokens)
        self.runner.apply_copies(out)
        failures = Failures()
        for seq, error in out.failed:
            if device_broken(error):  # a tier reservation lost a tensor-parallel rank
                raise error
            failures.add(seq.group, error)
        sampling, logits = self._forward(out.scheduled, failures)  # the sampling rows, in order
        prompt_logprobs.record(
            self.runner.model,
            [s for s in out.scheduled if s.seq.group not in failures],
            self.sampler.as_logits,
        )
        self.runner.write_through(out.offload_writes, failures.stale_blocks)
        pooled: list[Sequence] = []  # pooling requests whose prompt this step completes
        for s in out.scheduled:
            if s.seq.group not in failures:
                if s.completes and s.seq.group.pooled is not None:
                    pooled.append(s.seq)
                s.seq.num_computed_tokens += s.num_new_tokens
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        beams: list[tuple[Sequence, int]] = []
        speculative: list[tuple[ScheduledSeq, int]] = []
        row = 0
        for s in sampling:  # a speculating sequence has 1 + len(drafts) consecutive rows
            if s.seq.group not in failures:
                if s.drafts:
                    speculative.append((s, row))
                elif s.seq.group.beam is not None:
                    beams.append((s.seq, row))
                else:
                    plain.append(s.seq)
                    plain_rows.append(row)
            row += 1 + len(s.drafts)
        drawn = []
        if plain:
            assert logits is not None  # plain rows are sampling rows
            rows, seqs = self._expand_forks(plain)
            picked = [plain_rows[r] for r in rows]
            drawn = self._sample(
                logits if picked == list(range(row)) else logits[picked], seqs, failures
            )
        ended = self._advance_beams(beams, logits) if beams else []
        return self._finish_step(drawn, failures, speculative, logits, pooled) + ended

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], failures: Failures
    ) -> list[Drawn]:
        """Sample the batch; if that raises, sample each request alone so only the culprit fails.
        Each sample's uniform is drawn once, before, so a retry draws what the batch would have."""
        uniforms = [seq.rng.random() for seq in seqs]
        try:
            return self._sample_rows(logits, seqs, uniforms)
        except Exception as e:  # noqa: BLE001 - charged to its request below
            log.warning(
                "sampling %d sequences failed (%s: %s); sampling each request alone",
                len(seqs),
                type(e).__name__,
                e,
            )
        by_group: dict[SequenceGroup, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_group.setdefault(seq.group, []).append(i)
        drawn = []
        for group, rows in by_group.items():
            try:
                drawn += self._sample_rows(
                    logits[rows], [seqs[i] for i in rows], [uniforms[i] for i in rows]
                )
            except Exception as e:  # noqa: BLE001
                failures.add(group, e)
        return drawn

    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence], uniforms: list[float]
    ) -> list[Drawn]:
        if self.faults is not None:
            self.faults.check("sample", (seq.group for seq in seqs))
        result = self.sampler(logits, seqs, uniforms)
        done = result.grammar_done or [False] * len(seqs)
        return list(zip(seqs, result.token_ids, result.logprobs, done))

    def _finish_step(
        self,
        drawn: list[Drawn],
        failures: Failures,
        speculative: list[tuple[ScheduledSeq, int]],
        logits: torch.Tensor | None,
        pooled: list[Sequence],
    ) -> list[RequestOutput]:
        """Append each drawn token (detokenize, stop checks), verify each speculating sequence's
        drafts from its rows of `logits` and end each pooling request whose prompt is done; the
        outputs, failed requests too."""
        now = time.monotonic()
        touched: dict[str, SequenceGroup] = {}
        for seq in pooled:  # (as vLLM: a pooling request generates nothing)
            self._time_token(seq.group, now, step=True)
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)
            touched[seq.group.request_id] = seq.group
        for seq, token, lp, grammar_done in drawn:
            if seq.group in failures:
                continue
            try:
                self._append(seq, token, lp, now, grammar_done)
            except Exception as e:  # noqa: BLE001
                failures.add(seq.group, e)
            touched[seq.group.request_id] = seq.group
        for s, row in speculative:
            assert logits is not None  # its rows are sampling rows
            try:
                self._verify(s.seq, s.drafts, logits[row : row + 1 + len(s.drafts)], now)
            except Exception as e:  # noqa: BLE001
                failures.add(s.seq.group, e)
            touched[s.seq.group.request_id] = s.seq.group
        outputs = [self._fail(group, error) for group, error in failures.errors.items()]
        for rid, group in touched.items():
            if group in failures:
                continue
            try:
                outputs.append(group.to_output(visible_text))
            except Exception as e:  # noqa: BLE001
                outputs.append(self._fail(group, e))
                continue
            if group.finished:
                group.metrics.finished_time = now
                self.groups.pop(rid, None)
        return outputs

    def _verify(self, seq: Sequence, drafts: list[int], logits: torch.Tensor, now: float) -> None:
        """Sample row by row as plain decoding would.

        The drafts are kept up to the first that differs."""
        accepted = 0
        for i in range(len(drafts) + 1):
            ((_, token, lp, grammar_done),) = self._sample_rows(
                logits[i : i + 1], [seq], [seq.rng.random()]
            )
            self._append(seq, token, lp, now, grammar_done)
            if seq.finished or i == len(drafts) or token != drafts[i]:
                break
            accepted += 1
        self.spec_stats.num_drafts += 1
        self.spec_stats.num_draft_tokens += len(drafts)
        self.spec_stats.num_accepted_tokens += accepted
        if not seq.finished:  # the accepted drafts' K/V was written by this step
            seq.num_computed_tokens += accepted
            self.kv.accept_lookahead(seq.seq_id, seq.block_hashes, accepted)

    def _fail(self, group: SequenceGroup, error: BaseException) -> RequestOutput:
        """End a request that failed in a step: free its blocks, keep every other request going."""
        log.error(
            "request %s failed: %s: %s",
            group.request_id,
            type(error).__name__,
            error,
            exc_info=error,
        )
        for seq in group.seqs:
            if not seq.finished:
                seq.finish_reason = "error"
                self.kv.uncache_uncomputed(seq.seq_id, seq.num_computed_tokens)
                self.scheduler.finish(seq)
        group.aborted = True
        group.metrics.finished_time = time.monotonic()
        self.groups.pop(group.request_id, None)
        out = group.to_output(visible_text)
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _expand_forks(self, sampling: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """A request with n > 1 forks after its prefill.

        Every sample draws its first token from the same row."""
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

    def _advance_beams(
        self, beams: list[tuple[Sequence, int]], logits: torch.Tensor | None
    ) -> list[RequestOutput]:
        """Every beam-search request of the step moves its beams on by one token (each ran all
        its beams this step); the outputs of those that ended."""
        assert logits is not None  # beams' rows are sampling rows
        wanted = [max(2 * seq.params.n, seq.params.logprobs or 0) for seq, _ in beams]
        rows = logits[[row for _, row in beams]].float()
        top = rows.log_softmax(-1).topk(max(wanted), -1)
        # --logprobs-mode *_logits shows logits: logprob + the row's log-sum-exp
        norms = rows.logsumexp(-1).tolist() if self.sampler.as_logits else [0.0] * len(beams)
        by_group: dict[SequenceGroup, list[Candidates]] = {}
        for i, (seq, _) in enumerate(beams):
            tokens, logprobs = top.indices[i].tolist(), top.values[i].tolist()
            ranked = dict(zip(tokens[: 2 * seq.params.n], logprobs[: 2 * seq.params.n]))
            k = seq.params.logprobs
            shift = norms[i]
            shown = None if k is None else {t: v + shift for t, v in zip(tokens[:k], logprobs[:k])}
            by_group.setdefault(seq.group, []).append(Candidates(seq, ranked, shown, shift))
        outputs = []
        for group, candidates in by_group.items():
            try:
                if self.faults is not None:
                    self.faults.check("sample", (group,))
                if self._step_beams(group, candidates):
                    outputs.append(group.to_output(visible_text))
                    self.groups.pop(group.request_id, None)
            except Exception as e:  # noqa: BLE001 - this request's alone
                outputs.append(self._fail(group, e))
        return outputs

    def _step_beams(self, group: SequenceGroup, candidates: list[Candidates]) -> bool:
        """The next beams: a parent carries on its first child, forks the others, ends without
        one. True when the search is over (its answer is group.beam.outputs)."""
        state, p = group.beam, group.params
        assert state is not None
        now = time.monotonic()
        self._time_token(group, now, step=True)
        children: dict[Sequence, list[Choice]] = {}
        for choice in choose(state, p, candidates, self.tokenizer.eos_token_ids):
            children.setdefault(choice.parent, []).append(choice)
        for seq in (c.beam for c in candidates):
            mine = children.get(seq)
            if not mine:
                self.scheduler.finish(seq)
                group.seqs.remove(seq)
                continue
            for choice in mine[1:]:  # before the parent's own token: the child copies its tokens
                child = group.new_seq(state.next_index, list(seq.token_ids))
                state.next_index += 1
                group.seqs.append(child)
                self.scheduler.fork(seq, child)
                child.cum_logprob = choice.cum_logprob
                child.append_token(choice.token)
                if choice.record is not None:
                    child.logprobs = [*(seq.logprobs or ()), choice.record]
            seq.cum_logprob = mine[0].cum_logprob
            seq.append_token(mine[0].token)
            if mine[0].record is not None and seq.logprobs is not None:
                seq.logprobs.append(mine[0].record)
        state.steps += 1
        live = group.live
        self.generation_tokens_total += len(live)
        full = any(len(s.token_ids) >= self.max_model_len for s in live)
        if live and state.steps < group.max_tokens and not full:
            return False
        tok = self.tokenizer
        answer(state, p, live, lambda t: tok.decode(t, skip_special_tokens=p.skip_special_tokens))
        for seq in live:
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
        group.metrics.finished_time = now
        return True

    def _time_token(self, group: SequenceGroup, now: float, step: bool) -> None:
        """A request's first token (its prompt counted then, as vLLM: once, at its prefill's end,
        not for one abandoned while it waited); with `step`, the time of this step's tokens."""
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.prompt_tokens_total += len(group.prompt_token_ids)
        if step:
            m.token_times.append(now)
            m.last_token_time = now

    def _check_faults(self, stage: str, groups) -> None:
        if self.faults is not None:
            self.faults.check(stage, groups)

    def _append(
        self, seq: Sequence, token: int, logprob, now: float, grammar_done: bool = False
    ) -> None:
        seq.append_token(token)
        if logprob is not None:
            assert seq.logprobs is not None  # a list when params.logprobs asks
            seq.logprobs.append(logprob)
        self.generation_tokens_total += 1
        self._time_token(seq.group, now, step=seq.index == 0)
        if self.faults is not None:
            self.faults.check("detokenize", (seq.group,))
        p = seq.params
        stop_id = token in (p.stop_token_ids or ())  # a list once validated
        eos = not p.ignore_eos and token in self.tokenizer.eos_token_ids
        # as vLLM: a stop token's text is left out of the output unless asked for
        shown = not (stop_id or eos) or p.include_stop_str_in_output
        if shown and self.detokenizer.update(seq):  # a stop string ends the text
            seq.finish_reason = "stop"
        elif stop_id:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif eos:
            seq.finish_reason = "stop"
        elif grammar_done:  # the structured output is complete: nothing else may follow
            seq.finish_reason = "stop"
        elif (
            seq.num_output_tokens >= seq.group.max_tokens
            or len(seq.token_ids) >= self.max_model_len
        ):
            seq.finish_reason = "length"
        elif (
            p.repetition_detection is not None
            and seq.num_output_tokens >= p.min_tokens
            and p.repetition_detection.repeats(seq.output_token_ids)
        ):  # (vLLM's reasons)
            seq.finish_reason, seq.stop_reason = "repetition", "repetition_detected"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        return engine_stats(self)

    def kv_snapshot(self) -> dict:
        return self.kv.snapshot()

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Graceful shutdown: blocks queued for the disk tier are written before this returns, so a
        restart on the same --kv-offload-dir finds everything this engine cached; the
        tensor-parallel workers stop. Idempotent."""
        if self.offload is not None:
            self.offload.close()
        if self.tp is not None:
            self.tp.close()
