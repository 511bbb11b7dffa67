"""vLLM's POST /pooling: each input pooled and made into its task's output, "embed" (an embedding,
as /v1/embeddings makes it) or "classify" (the labels' probabilities, as /classify makes them), by
default the model's own task; or, for "token_embed" and "token_classify", that output for each of
the input's tokens. Answered as vLLM's PoolingResponse, whose `data` holds each input's values as
floats (a list a token for the per-token tasks) or base64 (a per-token task's rows one after
another)."""

from __future__ import annotations

from typing import Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagedkv.engine.pooling import PoolingParams
from pagedkv.server.classify import ClassificationUsage
from pagedkv.server.embeddings import EmbeddingRequest, ListAnswer, encoded, pool_inputs
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.validation import Name


class PoolRequest(EmbeddingRequest):
    """And vLLM's task and use_activation (the classifier's sigmoid or softmax; false: logits)."""

    task: Name | None = None
    use_activation: bool | None = None


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str


class PoolingResponse(ListAnswer):
    data: list[PoolingData]
    usage: ClassificationUsage  # (vLLM's: with completion_tokens 0)


async def pooling(serving: OpenAIServing, req: PoolRequest, request: Request) -> Response:
    core = serving.engine.engine
    params = PoolingParams(req.dimensions, req.normalize, req.use_activation)
    run = await pool_inputs(
        serving,
        req,
        request,
        "pool",
        lambda: core.pooling_task(req.task, params),
        req.dimensions,
        req.task,
    )
    if isinstance(run, Response):
        return run
    task = core.pooling_task(req.task, params)  # (checked above, after the model's name)
    data = [
        PoolingData(index=i, data=encoded(core.pooled_data(task, v, params), req.encoding_format))
        for i, v in enumerate(run.vectors)
    ]
    return run.answer(PoolingResponse, data, ClassificationUsage)
