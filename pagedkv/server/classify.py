"""vLLM's /classify (also at /v1/classify): each input's labels' probabilities from the model's
classifier (engine/scoring.py), each input an engine request batched with whatever else runs.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagedkv.engine.pooling import PoolingParams
from pagedkv.server.embeddings import ListAnswer, PoolingRequest, pool_inputs
from pagedkv.server.serving import OpenAIServing


class ClassificationRequest(PoolingRequest):
    """And vLLM's use_activation: false answers the logits."""

    use_activation: bool | None = None


class ClassificationData(BaseModel):
    index: int
    label: str  # the most likely one's name
    probs: list[float]
    num_classes: int


class ClassificationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ClassificationResponse(ListAnswer):
    data: list[ClassificationData]
    usage: ClassificationUsage


async def classify(
    serving: OpenAIServing, req: ClassificationRequest, request: Request
) -> Response:
    core = serving.engine.engine
    run = await pool_inputs(serving, req, request, "classify", core.check_classifier)
    if isinstance(run, Response):
        return run
    classifier = core.check_classifier()
    params = PoolingParams(use_activation=req.use_activation)
    data = []
    for i, vector in enumerate(run.vectors):
        probs = core.pooled_data("classify", vector, params).tolist()
        data.append(
            ClassificationData(
                index=i, label=classifier.label(probs), probs=probs, num_classes=len(probs)
            )
        )
    return run.answer(ClassificationResponse, data, ClassificationUsage)
