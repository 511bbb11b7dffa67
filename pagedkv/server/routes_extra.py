"""vLLM's utility routes: /tokenize, /detokenize, /version, /ping (GET and POST), HEAD /health,
and, where VLLM_ALLOW_RUNTIME_LORA_UPDATING is set as in vLLM, /v1/load_lora_adapter and
/v1/unload_lora_adapter, and SageMaker's forms of the same, POST /adapters and DELETE
/adapters/{name}.

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


# SageMaker's headers: the adapter a request to /invocations runs on (set as its body's model),
# and the name its adapter routes' answers give an adapter
ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"
ALIAS_HEADER = "x-amzn-sagemaker-adapter-alias"


def add_lora_routes(app: FastAPI, engine, read_json) -> None:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name},
    answered as vLLM answers them (plain text on success); SageMaker's POST /adapters {name, src}
    (or the same as query parameters) and DELETE /adapters/{name}, answered as vLLM's SageMaker
    layer answers them ("Adapter NAME registered", the alias header's name if given)."""

    async def load(name: str, path: str, fields: tuple[str, str]) -> None:
        """Loads the adapter, or the 400 naming `fields`' name or path field."""
        if name in engine.engine.loras:
            message = f"The lora adapter '{name}' has already been loaded."
            raise APIError(400, message, param=fields[0])
        if name in engine.config.served_model_names:
            raise APIError(400, f"{name!r} is the base model's name", param=fields[0])
        try:
            await asyncio.to_thread(engine.load_lora, name, path)
        except ConfigError as e:
            raise APIError(400, str(e), param=fields[1]) from None

    async def unload(name: str, field: str | None) -> None:
        try:
            await asyncio.to_thread(engine.unload_lora, name)
        except LookupError:
            message = f"The lora adapter '{name}' cannot be found."
            raise APIError(404, message, param=field) from None
        except ConfigError as e:
            raise APIError(400, str(e), param=field) from None

    @app.post("/v1/load_lora_adapter", openapi_extra=json_body(api.LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> Response:
        req = await read_json(request, api.LoadLoRAAdapterRequest)
        await load(req.lora_name, req.lora_path, ("lora_name", "lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=json_body(api.UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> Response:
        req = await read_json(request, api.UnloadLoRAAdapterRequest)
        await unload(req.lora_name, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/adapters", openapi_extra=json_body(api.RegisterAdapterRequest))
    async def register_adapter(request: Request) -> Response:
        if not (await request.body()).strip():  # SageMaker's other form: query parameters
            request.state.body = dict(request.query_params)
        req = await read_json(request, api.RegisterAdapterRequest)
        await load(req.name, req.src, ("name", "src"))
        alias = request.headers.get(ALIAS_HEADER) or req.name
        return PlainTextResponse(f"Adapter {alias} registered")

    @app.delete("/adapters/{adapter_name}")
    async def unregister_adapter(adapter_name: str, request: Request) -> Response:
        await unload(adapter_name, None)
        alias = request.headers.get(ALIAS_HEADER) or adapter_name
        return PlainTextResponse(f"Adapter {alias} unregistered")
