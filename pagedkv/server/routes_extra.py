"""vLLM's utility routes: /tokenize, /detokenize, /version, /ping (GET and POST), HEAD /health,
and, where VLLM_ALLOW_RUNTIME_LORA_UPDATING is set as in vLLM, /v1/load_lora_adapter and
/v1/unload_lora_adapter.

Kept apart from app.py so the generation routes and these stay small; each
validates its body like the OpenAI routes (400 with the field named).
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from pagedkv import __version__
from pagedkv.config import ConfigError
from pagedkv.server import protocol_extra as api
from pagedkv.server.errors import APIError
from pagedkv.server.openapi import json_body
from pagedkv.server.tools import chat_prompt


def is_serving(request: Request, engine) -> bool:
    """Started, and the engine loop not stopped by an error (the server is then exiting):
    what /health, HEAD /health and /ping all answer, so every probe agrees."""
    return request.app.state.ready and engine.error is None


def add_vllm_routes(app: FastAPI, engine, read_json, check_model) -> None:
    """`read_json(request, Model)` parses a body; `check_model(name)` 404s a model not served."""
    tok = engine.tokenizer

    def json_response(model) -> Response:
        return Response(model.model_dump_json(), media_type="application/json")

    def tokenized(req: api.TokenizeRequest) -> Response:
        """The answer; run off the event loop, as megabytes of prompt take seconds to render,
        encode, decode token by token and write as JSON, and every other request would wait."""
        # (the request has exactly one of prompt and messages)
        text = req.prompt if req.prompt is not None else chat_prompt(tok, req, engine.config)
        ids = tok.encode(text, add_special_tokens=req.special_tokens())
        strs = (
            [tok.decode([t], skip_special_tokens=False) for t in ids]
            if req.return_token_strs
            else None
        )
        return json_response(
            api.TokenizeResponse(
                count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
            )
        )

    @app.post("/tokenize", openapi_extra=json_body(api.TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        req = await read_json(request, api.TokenizeRequest)
        check_model(req.model)
        return await asyncio.to_thread(tokenized, req)

    @app.post("/detokenize", openapi_extra=json_body(api.DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        req = await read_json(request, api.DetokenizeRequest)
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
                param="tokens",
            )
        text = await asyncio.to_thread(tok.decode, req.tokens, skip_special_tokens=False)
        return json_response(api.DetokenizeResponse(prompt=text))

    @app.get("/version")
    async def version() -> Response:
        return json_response(api.VersionResponse(version=__version__))

    async def ping(request: Request) -> Response:
        if not is_serving(request, engine):
            raise APIError(503, "the engine is not running")
        return Response(status_code=200)

    for method in ("GET", "POST"):  # an operation id each (one shared is a duplicate in the schema)
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.head("/health", include_in_schema=False)
    async def health_head(request: Request) -> Response:
        return Response(status_code=200 if is_serving(request, engine) else 503)


# vLLM's switch for the two routes below (they let any client change what the server runs)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


def add_lora_routes(app: FastAPI, engine, read_json) -> None:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name},
    answered as vLLM answers them (plain text on success)."""

    @app.post("/v1/load_lora_adapter", openapi_extra=json_body(api.LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        req = await read_json(request, api.LoadLoRAAdapterRequest)
        if req.lora_name in engine.engine.loras:
            message = f"The lora adapter '{req.lora_name}' has already been loaded."
            raise APIError(400, message, param="lora_name")
        if req.lora_name in engine.config.served_model_names:
            raise APIError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        try:
            await asyncio.to_thread(engine.load_lora, req.lora_name, req.lora_path)
        except ConfigError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=json_body(api.UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        req = await read_json(request, api.UnloadLoRAAdapterRequest)
        try:
            await asyncio.to_thread(engine.unload_lora, req.lora_name)
        except LookupError:
            raise APIError(
                404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name"
            ) from None
        except ConfigError as e:
            raise APIError(400, str(e), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
