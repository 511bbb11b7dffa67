"""The offline API, shaped like vLLM's: `LLM(model, **options).generate(prompts, params)`."""
from __future__ import annotations

import itertools
from typing import Sequence as Seq

from pagedkv.config import ConfigError, EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.request import RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **options) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A single prompt may be passed bare."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        return self._run(prompts, plist, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        ids = [self.engine.tokenize(tok.apply_chat_template(c, add_generation_prompt=True),
                                    add_special_tokens=False) for c in convs]
        return self.generate(ids, params, use_tqdm)

    def _run(self, prompts: list[Prompt], plist: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        added = []
        try:
            for prompt, p in zip(prompts, plist):
                rid = f"offline-{next(self._ids)}"
                engine.add_request(rid, prompt, p)
                order[rid] = len(order)
                added.append(rid)
        except ConfigError:
            for rid in added:   # nothing half-submitted stays behind
                engine.abort(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), desc="generate", unit="req", dynamic_ncols=True)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results  # type: ignore[return-value]
