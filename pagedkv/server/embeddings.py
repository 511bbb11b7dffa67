"""/v1/embeddings: OpenAI's embeddings endpoint (with vLLM's extra fields) over the engine.

Each input runs as an engine request that pools its prompt's final hidden states
(engine/pooling.py), batched with whatever else is running; the answer is OpenAI's list of
embeddings, as float lists or, as the openai client asks by default, base64 of little-endian
float32.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, BeforeValidator

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.pooling import PoolingParams
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import ChatForm, Count, Prompt, PromptInput, check_prompts
from pagedkv.server.serving import OpenAIServing, check_not_aborted, encode, request_id
from pagedkv.server.streaming import ClientGone, merge, until_disconnect
from pagedkv.server.tools import chat_prompt
from pagedkv.server.validation import Int64, Name


class PoolingRequest(ChatForm):
    """The fields of a request whose inputs are pooled (embeddings, /classify): OpenAI's, and
    vLLM's truncate_prompt_tokens, add_special_tokens, priority and request_id; or, in place of
    `input`, vLLM's chat form: `messages` rendered with the chat template into one input (no
    generation prompt unless asked)."""

    text_field = "input"
    input: (
        Annotated[list[Prompt], BeforeValidator(check_prompts, json_schema_input_type=PromptInput)]
        | None
    ) = None
    add_generation_prompt: bool = False
    model: Name | None = None
    user: Name | None = None
    truncate_prompt_tokens: Int64 | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: Int64 = 0
    request_id: Name | None = None


class EmbeddingRequest(PoolingRequest):
    """And OpenAI's encoding_format and dimensions, vLLM's normalize (None: as the model's
    pooling says)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ListAnswer(BaseModel):
    """OpenAI's list answer, which the embeddings, /classify and /pooling give: their `data` and
    `usage` are each one's own."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str


class EmbeddingResponse(ListAnswer):
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encoded(vector: torch.Tensor, encoding_format: str) -> list[Any] | str:
    """As the client asked: floats, or base64 of little-endian float32 (a per-token task's rows
    one after another, as vLLM sends them)."""
    if encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()


def pooled(out: RequestOutput) -> torch.Tensor:
    if out.pooled is None:  # (a failed request raised; an aborted one is a 503 above)
        raise APIError(500, f"request {out.request_id} finished without its embedding")
    return out.pooled


@dataclass
class PoolingRun:
    """A pooling request's run: its answer's id, the model's name, the inputs' vectors in order
    and the prompt tokens they took."""

    answer_id: str
    model: str
    vectors: list[torch.Tensor]
    used: int

    def answer(self, kind: type[ListAnswer], data: list, usage: type[BaseModel]) -> Response:
        """The run's answer: a `kind` of `data`, the prompt tokens used as its `usage`."""
        fields: dict[str, Any] = {
            "id": self.answer_id,
            "created": int(time.time()),
            "model": self.model,
            "data": data,
            "usage": usage(prompt_tokens=self.used, total_tokens=self.used),
        }
        return Response(kind(**fields).model_dump_json(), media_type="application/json")


async def pool_inputs(
    serving: OpenAIServing,
    req: PoolingRequest,
    request: Request,
    kind: str,
    check: Callable[[], object],
    dimensions: int | None = None,
    task: str | None = None,
) -> PoolingRun | Response:
    """Runs each input (a text or token ids, truncated as asked) as a pooling request for `task`
    (None: one vector a prompt), after the model's name and then `check` (what this engine can
    answer) pass: the vectors, or the 499 of a client gone. `kind` prefixes the answer's id."""
    engine = serving.engine
    lora = serving.check_model(req.model)
    check()
    hidden = engine.engine.loaded.config.hidden_size
    pooler = engine.engine.pooler
    params = pooler.request_params(
        hidden, dimensions, req.truncate_prompt_tokens, req.priority, task
    )
    params.lora_name, params.truncation_side = lora, req.truncation_side
    tok = engine.tokenizer
    inputs = req.input if req.input is not None else [chat_prompt(tok, req, engine.config)]
    special = req.special_tokens()
    ends = tok.special_ends(special)  # (what encoding a text adds)
    prompts = [
        params.truncate(p, engine.max_model_len)
        if isinstance(p, list)
        else params.truncate(await encode(tok, p, special), engine.max_model_len, ends)
        for p in inputs
    ]
    answer_id = request_id(kind, request, req.request_id)
    vectors = await pool_prompts(serving, request, prompts, params, answer_id)
    if vectors is None:
        return Response(status_code=499)
    used = sum(len(ids) for ids in prompts)
    return PoolingRun(answer_id, lora or engine.model_name, vectors, used)


async def pool_prompts(
    serving: OpenAIServing, request: Request, prompts: list[list[int]], params, answer_id: str
) -> list[torch.Tensor] | None:
    """Each prompt run as a pooling request (batched with whatever else runs): their vectors in
    order, or None if the client went away first."""
    engine = serving.engine
    for ids in prompts:
        engine.validate(ids, params)
    events = merge(
        [
            engine.generate(ids, params, request_id=f"{answer_id}-{i}")
            for i, ids in enumerate(prompts)
        ]
    )
    try:
        finals = await until_disconnect(request, serving.collect(events, len(prompts)))
    except ClientGone:
        return None
    check_not_aborted(finals)
    for ids in prompts:
        serving.metrics.observe_pooling(len(ids))
    return [pooled(out) for out in finals]


async def embeddings(serving: OpenAIServing, req: EmbeddingRequest, request: Request) -> Response:
    core = serving.engine.engine
    run = await pool_inputs(
        serving, req, request, "embd", lambda: core.check_pools(embeddings=True), req.dimensions
    )
    if isinstance(run, Response):
        return run
    params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
    data = [
        EmbeddingData(
            index=i, embedding=encoded(core.pooled_data("embed", v, params), req.encoding_format)
        )
        for i, v in enumerate(run.vectors)
    ]
    return run.answer(EmbeddingResponse, data, EmbeddingUsage)
