"""vLLM's asynchronous engine API over pagedkv's AsyncLLM.

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=path, seed=0))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
        print(out.outputs[0].text)
    await engine.shutdown()

The engine thread starts on the first request, on that event loop. Outputs
are RequestOutput with vLLM's shapes (logprobs decoded as list[dict[int, Logprob]]).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from pagedkv.config import EngineConfig
from pagedkv.engine.async_engine import AsyncLLM, RequestFailedError
from pagedkv.engine.llm import reject_unsupported, to_prompt, token_text, with_salt
from pagedkv.engine.outputs import Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedkv.engine.pooling import PoolingParams
from pagedkv.engine.request import LoRARequest, SamplingParams


class EngineArgs:
    """vLLM's engine arguments: `model` plus any `pagedkv serve` option or vLLM's name for it."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.model, self.options = model, options

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig.from_options(model=self.model, **self.options)


AsyncEngineArgs = EngineArgs


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self._llm = AsyncLLM(config)
        self.config = config
        self._decode = token_text(self._llm.tokenizer)
        self._started = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_: Any) -> AsyncLLMEngine:
        return cls(engine_args.create_engine_config())

    async def get_tokenizer(self, *_: Any):
        return self._llm.tokenizer

    @property
    def is_running(self) -> bool:
        return self._started

    async def generate(
        self,
        prompt: str | list[int] | dict,
        sampling_params: SamplingParams,
        request_id: str,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as tokens arrive; the last has finished=True.

        Closing the iterator aborts the request."""
        priority = kwargs.pop("priority", 0)
        lora_request = kwargs.pop("lora_request", None)
        reject_unsupported("AsyncLLMEngine.generate", kwargs)
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError("sampling_params must be a pagedkv SamplingParams")
        text_or_ids = to_prompt(prompt)
        sampling_params = with_salt(prompt, sampling_params)
        if priority != 0:
            sampling_params = dataclasses.replace(sampling_params, priority=priority)
        if lora_request is not None:  # loaded on first use, off the event loop, between steps
            if not isinstance(lora_request, LoRARequest):
                raise TypeError("lora_request must be a pagedkv LoRARequest")
            name, path = lora_request.lora_name, lora_request.lora_path
            await asyncio.to_thread(self._llm.load_lora, name, path)
            sampling_params = dataclasses.replace(sampling_params, lora_name=lora_request.lora_name)
        if not self._started:
            await self._llm.start()
            self._started = True
        # logprobs already decoded, per sample: each step adds one
        decoded: dict[int, list[dict[int, Logprob]] | None] = {}
        stream = self._llm.generate(text_or_ids, sampling_params, request_id)
        try:
            async for out in stream:
                for o in out.outputs:
                    o.logprobs = (
                        list(decoded.get(o.index) or []) if o.sample_logprobs is not None else None
                    )
                    o.decode_logprobs(self._decode)
                    decoded[o.index] = o.logprobs
                yield out
        finally:
            await stream.aclose()

    async def encode(
        self,
        prompt: str | list[int] | dict,
        pooling_params: PoolingParams,
        request_id: str,
        **kwargs: Any,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's: the prompt pooled and made into pooling_params.task's output (None: the
        model's own task, as LLM.encode); one output, finished. `lora_request`, `priority` and
        `truncate_prompt_tokens` as for generate and LLM.encode."""
        truncate = kwargs.pop("truncate_prompt_tokens", None)
        core = self._llm.engine
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError("pooling_params must be a pagedkv PoolingParams")
        task = core.pooling_task(pooling_params.task, pooling_params)
        hidden = core.loaded.config.hidden_size
        params = core.pooler.request_params(hidden, pooling_params.dimensions, truncate, task=task)
        async for out in self.generate(prompt, params, request_id, **kwargs):
            if out.finished:
                if out.pooled is None:
                    raise RequestFailedError(f"request {request_id} ended without its vector")
                data = core.pooled_data(task, out.pooled, pooling_params)
                yield PoolingRequestOutput(
                    out.request_id,
                    out.prompt_token_ids,
                    PoolingOutput(data),
                    True,
                    out.num_cached_tokens,
                )

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def shutdown(self) -> None:
        if self._started:
            await self._llm.shutdown()
            self._started = False
