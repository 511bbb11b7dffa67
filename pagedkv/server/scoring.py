"""vLLM's /score and /rerank (also at /v1/score, /v1/rerank and /v2/rerank, Jina's and Cohere's
shape): query-document pairs scored by an embedding model's cosine or a reranker's classifier
(engine/scoring.py), each text or pair an engine request batched with whatever else runs.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator, Field, ValidationInfo, model_validator

from pagedkv.engine.request import INT64_MAX
from pagedkv.engine.scoring import ScorePlan, plan
from pagedkv.server.embeddings import pool_prompts
from pagedkv.server.request_fields import refusing
from pagedkv.server.serving import OpenAIServing, encode, request_id
from pagedkv.server.validation import MAX_PROMPTS, Int64, Name, RequestModel, SafeStr, check_text

# vLLM's fields pagedkv does not implement: any value but these is a 400 naming the field
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "max_tokens_per_query": (None, 0),
    "max_tokens_per_doc": (None, 0),
    "padding": (None, "do_not_pad"),
    "mm_processor_kwargs": (None,),
}
_WHY = {
    "max_tokens_per_query": "max_tokens_per_query is not supported by pagedkv "
    "(truncate_prompt_tokens cuts each pair as one prompt)",
    "max_tokens_per_doc": "max_tokens_per_doc is not supported by pagedkv "
    "(truncate_prompt_tokens cuts each pair as one prompt)",
}
# the pairs of fields /score takes, as vLLM's four request shapes name them
_SCORE_FIELDS: tuple[tuple[str, str], ...] = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)


def _texts(v: Any, info: ValidationInfo) -> list[str]:
    name = info.field_name or "input"
    texts = [v] if isinstance(v, str) else v
    if not (isinstance(texts, list) and all(isinstance(t, str) for t in texts)):
        raise ValueError(f"{name} must be a string or a list of strings (no multimodal inputs)")
    if not texts:
        raise ValueError(f"{name} must hold at least one text")
    if len(texts) > MAX_PROMPTS:
        raise ValueError(f"{name} takes at most {MAX_PROMPTS} texts in one request")
    for t in texts:
        check_text(t, name)
    return texts


Texts = Annotated[list[str], BeforeValidator(_texts, json_schema_input_type=str | list[str])]


class _ScoringRequest(RequestModel):
    """vLLM's fields common to /score and /rerank."""

    model: Name | None = None
    user: Name | None = None
    truncate_prompt_tokens: Int64 | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: Int64 = 0
    request_id: Name | None = None
    use_activation: bool | None = None
    instruction: SafeStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    understood = frozenset(_UNSUPPORTED)
    _unsupported = model_validator(mode="before")(refusing(_UNSUPPORTED, _WHY))

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with `instruction` in it (the dict's own key wins, as vLLM's)."""
        if self.instruction is None:
            return self.chat_template_kwargs
        return {"instruction": self.instruction, **(self.chat_template_kwargs or {})}


class ScoreRequest(_ScoringRequest):
    text_1: Texts | None = None
    text_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = {f for pair in _SCORE_FIELDS for f in pair if getattr(self, f) is not None}
        if not any(given == set(pair) for pair in _SCORE_FIELDS):
            raise ValueError(
                "give one pair of fields: text_1 and text_2, queries and documents, queries and "
                "items, or data_1 and data_2"
            )
        return self

    def fields(self) -> tuple[str, str]:
        """The pair of fields the request gave."""
        return next(p for p in _SCORE_FIELDS if all(getattr(self, f) is not None for f in p))


class RerankRequest(_ScoringRequest):
    query: SafeStr
    documents: Texts
    top_n: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0  # 0: every document
    return_documents: bool = True  # (Cohere's and Jina's: false leaves each text out)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]


async def _scores(
    serving: OpenAIServing,
    req: _ScoringRequest,
    request: Request,
    first: list[str],
    second: list[str],
    names: tuple[str, str],
) -> tuple[str, str, list[float], int] | Response:
    """The pairs' scores (with the answer's id, the model's name and the prompt tokens used), or
    the 499 of a client gone."""
    engine = serving.engine
    core = engine.engine
    lora = serving.check_model(req.model)
    core.check_pools()
    scoring: ScorePlan = plan(
        first,
        second,
        core.classifier,
        engine.tokenizer,
        core.config.chat_template,
        req.template_kwargs(),
        names,
    )
    hidden = core.loaded.config.hidden_size
    params = core.pooler.request_params(hidden, None, req.truncate_prompt_tokens, req.priority)
    params.lora_name, params.truncation_side = lora, req.truncation_side
    ends = engine.tokenizer.special_ends()  # (a pair's too: [CLS] ... [SEP])
    prompts = [
        params.truncate(
            p if isinstance(p, list) else await encode(engine.tokenizer, p, True),
            engine.max_model_len,
            ends,
        )
        for p in scoring.prompts
    ]
    answer_id = request_id("score", request, req.request_id)
    vectors = await pool_prompts(serving, request, prompts, params, answer_id)
    if vectors is None:
        return Response(status_code=499)
    scores = scoring.scores(vectors, req.use_activation is not False)
    return answer_id, lora or engine.model_name, scores, sum(len(ids) for ids in prompts)


async def score(serving: OpenAIServing, req: ScoreRequest, request: Request) -> Response:
    names = req.fields()
    got = await _scores(
        serving, req, request, getattr(req, names[0]), getattr(req, names[1]), names
    )
    if isinstance(got, Response):
        return got
    answer_id, model, scores, used = got
    body = ScoreResponse(
        id=answer_id,
        created=int(time.time()),
        model=model,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=Usage(prompt_tokens=used, total_tokens=used),
    )
    return Response(body.model_dump_json(), media_type="application/json")


async def rerank(serving: OpenAIServing, req: RerankRequest, request: Request) -> Response:
    got = await _scores(serving, req, request, [req.query], req.documents, ("query", "documents"))
    if isinstance(got, Response):
        return got
    answer_id, model, scores, used = got
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=doc) if req.return_documents else None,
            relevance_score=s,
        )
        for i, (doc, s) in enumerate(zip(req.documents, scores))
    ]
    results.sort(key=lambda r: r.relevance_score, reverse=True)  # (stable: ties keep their order)
    body = RerankResponse(
        id=answer_id,
        model=model,
        usage=Usage(prompt_tokens=used, total_tokens=used),
        results=results[: req.top_n or None],
    )
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json")
