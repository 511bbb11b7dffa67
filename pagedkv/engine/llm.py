"""The offline API, shaped like vLLM's:
`LLM(model, **engine_args).generate(prompts, sampling_params)`.

Prompts come as vLLM takes them: a string, a list of token ids, a
{"prompt": ...} or {"prompt_token_ids": [...]} dict (TextPrompt / TokensPrompt, with an
optional "cache_salt"), or a list of those. Outputs carry vLLM's fields and shapes (logprobs as
list[dict[int, Logprob]]). What vLLM accepts but this engine cannot do raises
a ConfigError naming it; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any, TypeVar

import torch

from pagedkv.config import CONTENT_FORMATS, ConfigError, EngineConfig
from pagedkv.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedkv.engine.chat import render_chat
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagedkv.engine.pooling import PoolingParams
from pagedkv.engine.request import LoRARequest, ParamError, SamplingParams
from pagedkv.engine.scoring import plan as scoring_plan

Prompt = str | list[int] | dict
Made = TypeVar("Made")  # what a pooled vector makes (an embedding, a classification)
R = TypeVar("R")  # the call's result for one request
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}
_SALT = "cache_salt"  # a prompt dict's prefix-cache salt (SamplingParams.cache_salt)


def _pooling_params(pp: PoolingParams | None) -> PoolingParams:
    if pp is not None and not isinstance(pp, PoolingParams):
        raise ConfigError("pooling_params must be a PoolingParams")
    return pp or PoolingParams()


def to_prompt(p: Any) -> str | list[int]:
    """One prompt in any of vLLM's single-prompt forms -> text or token ids."""
    if isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p)):
        return p
    if isinstance(p, dict):
        unknown = sorted(set(p) - _PROMPT_KEYS - {_SALT})
        if unknown:
            raise ParamError(
                "prompt",
                f"prompt dict keys {unknown} are not supported "
                "(use 'prompt' or 'prompt_token_ids', and 'cache_salt')",
            )
        if len(set(p) & _PROMPT_KEYS) != 1:
            raise ParamError(
                "prompt", "a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'"
            )
        if "prompt" in p and not isinstance(p["prompt"], str):
            raise ParamError("prompt", "a prompt dict's 'prompt' must be a string")
        ids = p.get("prompt_token_ids")
        if "prompt_token_ids" in p and not (
            isinstance(ids, list) and all(type(t) is int for t in ids)
        ):
            raise ParamError("prompt", "a prompt dict's 'prompt_token_ids' must be a list of ints")
        return to_prompt(p.get("prompt", ids))
    raise ParamError(
        "prompt",
        f"a prompt must be a string, a list of token ids or a prompt dict, got {type(p).__name__}",
    )


def reject_unsupported(method: str, kwargs: dict[str, Any]) -> None:
    """vLLM's other arguments (lora_request, priority, ...): fine at None, an error otherwise."""
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise ConfigError(f"{method}() does not support: {', '.join(given)}")


def prompt_items(prompts: Any) -> list[Any]:
    """A single prompt or a sequence of them -> a list, each as given."""
    single = isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and bool(prompts) and all(type(t) is int for t in prompts)
    )
    return [prompts] if single else list(prompts)


def with_salt(prompt: Any, params: SamplingParams) -> SamplingParams:
    """`params` with a prompt dict's cache_salt (vLLM's place for it), if it has one."""
    if not isinstance(prompt, dict) or prompt.get(_SALT) is None:
        return params
    return dataclasses.replace(params, cache_salt=prompt[_SALT])


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        """`engine_args`: every `pagedkv serve` option with underscores, or vLLM's name for it."""
        config = EngineConfig.from_options(model=model, **engine_args)
        config.note_serve_only("LLM")
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Write what the disk tier still has queued and stop any tensor-parallel workers."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults.

        These are the defaults of --generation-config auto."""
        return SamplingParams(**self.engine.generation_defaults)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A single prompt may be passed bare."""
        if "params" in kwargs:  # pagedkv's earlier name for sampling_params
            sampling_params = kwargs.pop("params")
        priority = kwargs.pop("priority", None)
        lora_request = kwargs.pop("lora_request", None)
        reject_unsupported("generate", kwargs)
        items = prompt_items(prompts)
        prompt_list = [to_prompt(p) for p in items]
        params = (
            sampling_params if sampling_params is not None else self.get_default_sampling_params()
        )
        plist: list[Any] = (
            list(params) if isinstance(params, (list, tuple)) else [params] * len(prompt_list)
        )
        if len(plist) != len(prompt_list):
            raise ConfigError(f"got {len(plist)} SamplingParams for {len(prompt_list)} prompts")
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise ConfigError("sampling_params must be a SamplingParams or a list of them")
        plist = [with_salt(item, p) for item, p in zip(items, plist)]
        if priority is not None:  # vLLM's: one per prompt
            if not isinstance(priority, (list, tuple)) or len(priority) != len(plist):
                raise ConfigError(f"priority wants a list of {len(plist)} ints, one per prompt")
            plist = [dataclasses.replace(p, priority=v) for p, v in zip(plist, priority)]
        if lora_request is not None:  # one for all prompts, or one (or None) per prompt
            loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
            if len(loras) not in (1, len(plist)):
                raise ConfigError(f"lora_request wants one or {len(plist)} LoRARequests")
            names = [self._lora_name(r) for r in loras] * (len(plist) // len(loras))
            plist = [dataclasses.replace(p, lora_name=n) for p, n in zip(plist, names)]
        return self._run(prompt_list, plist, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's beam_width best beams, their tokens and text with the prompt."""
        kwargs.pop("concurrency_limit", None)  # every prompt's beams run in each step's batch
        reject_unsupported("beam_search", kwargs)
        if not isinstance(params, BeamSearchParams):
            raise ConfigError("params must be a BeamSearchParams")
        outs = self.generate(prompts, params.sampling_params(), use_tqdm, lora_request=lora_request)
        tok = self.engine.tokenizer
        return [BeamSearchOutput.of(o, lambda t: tok.decode(t)) for o in outs]

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: one embedding per prompt, pooled as the model says (engine/pooling.py)."""
        return self._results(
            "embed", pooling_params, prompts, use_tqdm, truncate_prompt_tokens, lora_request,
            EmbeddingRequestOutput, lambda v: EmbeddingOutput(v.tolist()),
        )  # fmt: skip

    def classify(
        self,
        prompts: Prompt | Seq[Prompt],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's labels' probabilities from the model's classifier (a
        *ForSequenceClassification checkpoint's head, or --hf-overrides'), engine/scoring.py."""
        return self._results(
            "classify", pooling_params, prompts, use_tqdm, truncate_prompt_tokens, lora_request,
            ClassificationRequestOutput, lambda v: ClassificationOutput(v.tolist()),
        )  # fmt: skip

    def encode(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's: each prompt pooled and made into `pooling_task`'s output as a tensor ("embed":
        its embedding, "classify": its labels' probabilities; None: pooling_params.task, else the
        model's own)."""
        return self._results(
            pooling_task, pooling_params, prompts, use_tqdm, truncate_prompt_tokens, lora_request,
            PoolingRequestOutput, PoolingOutput,
        )  # fmt: skip

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's: a score for each pair, one query against many documents (1:N) or one to one
        (N:N): the cosine of an embedding model's vectors, or a reranker's (--hf-overrides)
        classifier over the pair read as one prompt (engine/scoring.py)."""
        engine = self.engine
        engine.check_pools()
        activate = _pooling_params(pooling_params).only_activation("a score")
        kwargs = dict(tokenization_kwargs or {})
        truncate = kwargs.pop("truncate_prompt_tokens", None)
        if kwargs:
            raise ParamError(
                "tokenization_kwargs",
                f"tokenization_kwargs {sorted(kwargs)} not supported (truncate_prompt_tokens)",
            )
        if chat_template is not None and engine.classifier is None:
            raise ParamError("chat_template", "a score template is for a cross-encoder's pairs")
        scoring = scoring_plan(
            data_1,
            data_2,
            engine.classifier,
            engine.tokenizer,
            chat_template or engine.config.chat_template,
        )
        hidden, ends = engine.loaded.config.hidden_size, engine.tokenizer.special_ends()
        cut = engine.pooler.request_params(hidden, truncate_prompt_tokens=truncate)
        prompts = [  # (a tokenized pair keeps its [CLS] and last [SEP], as a text its own)
            p if isinstance(p, str) else cut.truncate(p, engine.max_model_len, ends)
            for p in scoring.prompts
        ]
        outs = self._pool(prompts, use_tqdm, None, truncate, lora_request)
        scores = scoring.scores([v for _, v in outs], activate)
        return [
            ScoringRequestOutput.of(outs[i][0], outs[j][0], s)
            for (i, j), s in zip(scoring.pairs, scores)
        ]

    def _results(
        self,
        task: str | None,
        pooling_params: PoolingParams | None,
        prompts: Prompt | Seq[Prompt],
        use_tqdm: bool,
        truncate_prompt_tokens: int | None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None,
        result: Callable[[str, list[int], Made], R],
        output: Callable[[torch.Tensor], Made],
    ) -> list[R]:
        """A pooling call's results: each prompt pooled, and for each its id, prompt and `output`
        of what the task (checked first; None: pooling_params.task, else the model's) makes of
        its vector."""
        pp = _pooling_params(pooling_params)
        task = self.engine.pooling_task(task or pp.task, pp)
        outs = self._pool(
            prompts, use_tqdm, pp.dimensions, truncate_prompt_tokens, lora_request, task
        )
        return [
            result(o.request_id, o.prompt_token_ids, output(self.engine.pooled_data(task, v, pp)))
            for o, v in outs
        ]

    def _pool(
        self,
        prompts: Prompt | Seq[Prompt],
        use_tqdm: bool,
        dimensions: int | None,
        truncate_prompt_tokens: int | None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None,
        task: str | None = None,
    ) -> list[tuple[RequestOutput, torch.Tensor]]:
        """Each prompt run as a pooling request for `task`: its output and pooled vector (a
        vector a token for a per-token task)."""
        hidden = self.engine.loaded.config.hidden_size
        params = self.engine.pooler.request_params(
            hidden, dimensions, truncate_prompt_tokens, task=task
        )
        outs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        for o in outs:
            if o.pooled is None:
                raise ConfigError(f"request {o.request_id} failed: {o.error}")
        return [(o, o.pooled) for o in outs if o.pooled is not None]

    def _lora_name(self, request: LoRARequest | None) -> str | None:
        """The adapter's name, loaded on first use."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ConfigError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        return self.engine.add_lora(request.lora_name, request.lora_path).name

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate;
        `chat_template_content_format` as the server's flag (content parts for a template that
        loops over them, else text)."""
        if "params" in kwargs:
            sampling_params = kwargs.pop("params")
        reject_unsupported("chat", kwargs)
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else messages
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ParamError(
                "chat_template_content_format",
                f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}",
            )
        tok = self.engine.tokenizer
        ids = [
            self.engine.tokenize(
                render_chat(
                    tok,
                    c,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    chat_template_kwargs=chat_template_kwargs,
                    content_format=chat_template_content_format,
                ),
                add_special_tokens=False,
            )
            for c in convs
        ]
        return self.generate(ids, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(
        self, prompts: list[str | list[int]], plist: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for prompt, p in zip(prompts, plist):
                rid = f"offline-{next(self._ids)}"
                engine.add_request(rid, prompt, p)
                order[rid] = len(order)
        except ConfigError:
            for rid in order:  # nothing half-submitted stays behind
                engine.abort(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req", dynamic_ncols=True)
        decode = token_text(engine.tokenizer)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out.decode_logprobs(decode)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]


def token_text(tokenizer):
    """A token's text for Logprob.decoded_token (special tokens shown), cached per id."""
    return functools.lru_cache(maxsize=65536)(
        lambda t: tokenizer.decode([t], skip_special_tokens=False)
    )
