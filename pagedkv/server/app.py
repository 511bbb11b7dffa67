"""The FastAPI app: OpenAI routes, /metrics, /v1/kv, /v1/simulate and the dashboard page.

`build_app(engine)` wires routes to one AsyncLLM (tests pass their own);
`serve(config, host, port)` loads the model and runs it under uvicorn with a
graceful shutdown: on SIGTERM new connections are refused, running requests
get `shutdown_timeout` seconds to finish, and whatever is still running is
then aborted, its client told with a 503 error (an error event if streaming).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import logging.config
import os
import re
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ValidationError

from pagedkv.config import ConfigError, EngineConfig
from pagedkv.engine.request import INT64_MAX, INT64_MIN
from pagedkv.server import invocations
from pagedkv.server import protocol as api
from pagedkv.server.classify import ClassificationRequest
from pagedkv.server.classify import classify as serve_classify
from pagedkv.server.embeddings import EmbeddingRequest
from pagedkv.server.embeddings import embeddings as serve_embeddings
from pagedkv.server.errors import APIError, install_error_handlers
from pagedkv.server.listen import LOG_LEVELS, HTTPOptions, bind, served_url
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.middleware import (
    IGNORED_HEADER,
    MAX_BODY_BYTES,
    MAX_HEADER_COUNT,
    BearerAuth,
    BodySizeLimit,
    HeaderCountLimit,
    IgnoredFieldsHeader,
    RequestIdHeader,
    ServerLoad,
)
from pagedkv.server.openapi import install_openapi, json_body
from pagedkv.server.pooling import PoolRequest
from pagedkv.server.pooling import pooling as serve_pooling
from pagedkv.server.response_store import item_page
from pagedkv.server.responses import ModelCard, ModelList
from pagedkv.server.responses_protocol import ResponsesRequest
from pagedkv.server.routes_extra import (
    ADAPTER_HEADER,
    add_lora_routes,
    add_vllm_routes,
    is_serving,
    runtime_lora_updating,
)
from pagedkv.server.scoring import RerankRequest, ScoreRequest
from pagedkv.server.scoring import rerank as serve_rerank
from pagedkv.server.scoring import score as serve_score
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.streaming import EventStream
from pagedkv.server.validation import IGNORED, checked, load_json_object
from pagedkv.signals import exit_on_sigterm

log = logging.getLogger("pagedkv.server")
STATIC = Path(__file__).parent / "static"
MAX_SIM_REQUESTS = 100_000
M = TypeVar("M", bound=BaseModel)
CORS_DEFAULTS = {
    "allow_origins": ["*"],
    "allow_methods": ["*"],
    "allow_headers": ["*"],
    "allow_credentials": False,
    "expose_headers": [IGNORED_HEADER],  # so a page's own script can read it too
}


MAX_NAMED = 16  # dropped fields named in a reply's header; the rest are counted
_PLAIN_NAME = re.compile(r"[\w.\[\]-]{1,64}", re.ASCII)
_logged_ignored: set[str] = set()


async def read_json(request: Request, model: type[M]) -> M:
    """The body as `model`, whatever its Content-Type (curl -d sends form-encoded).

    A 400 if the body does not fit `model`. Fields it does not know are dropped and named: in a
    warning (once per name) and in the reply's X-PagedKV-Ignored-Fields header."""
    data = getattr(request.state, "body", None) or load_json_object(await request.body())
    context: dict = {}
    try:
        parsed = model.model_validate(data, context=context)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    if ignored := context.get(IGNORED):
        request.state.ignored = _name_ignored(ignored)
    return parsed


def known_query(request: Request) -> None:
    """A query parameter the route does not declare is a 400: a typo must not pass unseen."""
    known = {p.alias for p in request.scope["route"].dependant.query_params}
    if unknown := sorted(set(request.query_params) - known):
        listed = f" (known: {', '.join(sorted(known))})" if known else ""
        raise APIError(400, f"unknown query parameter {unknown[0]!r}{listed}", param=unknown[0])


def _name_ignored(ignored: set[str]) -> str:
    """The header's value, logging names not seen before; a name that could not be shown as sent
    (odd characters, too long) is only counted."""
    plain = sorted(n for n in ignored if _PLAIN_NAME.fullmatch(n))
    new = [n for n in plain if n not in _logged_ignored]
    if new and len(_logged_ignored) < 1024:  # a client sending random names cannot grow it forever
        _logged_ignored.update(new)
        log.warning("request fields that pagedkv does not use were ignored: %s", ", ".join(new))
    rest = len(ignored) - min(len(plain), MAX_NAMED)
    return ", ".join(plain[:MAX_NAMED] + ([f"(+{rest} not shown)"] if rest else []))


def build_app(
    engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_header_count: int = MAX_HEADER_COUNT,
    cors: dict | None = None,
) -> FastAPI:
    """The app over a constructed (not yet started) AsyncLLM; the lifespan starts and stops it.

    `api_key` defaults to `engine.config.api_key`; `cors` holds CORSMiddleware's options
    (default, as vLLM: any origin, method and header, no credentials).
    """
    api_key = api_key if api_key is not None else engine.config.api_key
    metrics = ServerMetrics(engine, engine.model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await engine.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_openapi(app)
    app.state.ready = False
    app.state.server_load = 0
    install_error_handlers(app)
    app.add_middleware(IgnoredFieldsHeader)
    if engine.config.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    app.add_middleware(ServerLoad)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(HeaderCountLimit, max_count=max_header_count)
    # added last = runs first
    app.add_middleware(CORSMiddleware, **{**CORS_DEFAULTS, **(cors or {})})
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _add_routes(app, engine, OpenAIServing(engine, metrics), metrics)
    add_simulate_route(app)
    return app


def _add_routes(app: FastAPI, engine, serving: OpenAIServing, metrics: ServerMetrics) -> None:
    """The dashboard, health, the OpenAI endpoints, /metrics and the KV snapshot."""

    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if not is_serving(request, engine):
            raise APIError(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/load")
    async def load(request: Request) -> JSONResponse:
        """vLLM's: the generation requests in flight (middleware.ServerLoad)."""
        return JSONResponse({"server_load": request.app.state.server_load})

    def model_cards() -> list[ModelCard]:
        base = engine.model_name
        return [
            ModelCard(id=name, root=engine.config.model or base, max_model_len=engine.max_model_len)
            for name in engine.config.served_model_names
        ] + [  # LoRA adapters, as vLLM lists them
            ModelCard(
                id=a.name, root=a.path, parent=a.parent or base, max_model_len=engine.max_model_len
            )
            for a in engine.engine.loras.values()
        ]

    @app.get("/v1/models")
    async def models() -> Response:
        body = ModelList(data=model_cards()).model_dump_json()
        return Response(body, media_type="application/json")

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        """OpenAI's retrieve: one served name's (or adapter's) card."""
        card = next((c for c in model_cards() if c.id == model), None)
        if card is None:
            raise serving.unknown_model(model)
        return Response(card.model_dump_json(), media_type="application/json")

    # /tokenize, /detokenize, /version, /ping
    add_vllm_routes(app, engine, read_json, serving.check_model)
    if runtime_lora_updating():  # as in vLLM, only where asked for
        add_lora_routes(app, engine, read_json)

    @app.post("/v1/completions", openapi_extra=json_body(api.CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serving.completions(await read_json(request, api.CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=json_body(api.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await read_json(request, api.ChatCompletionRequest), request)

    @app.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        return await serve_embeddings(serving, await read_json(request, EmbeddingRequest), request)

    @app.post("/pooling", openapi_extra=json_body(PoolRequest))
    async def pool(request: Request) -> Response:
        return await serve_pooling(serving, await read_json(request, PoolRequest), request)

    for path in api.SCORE_PATHS:

        @app.post(path, openapi_extra=json_body(ScoreRequest))
        async def score(request: Request) -> Response:
            return await serve_score(serving, await read_json(request, ScoreRequest), request)

    for path in api.RERANK_PATHS:

        @app.post(path, openapi_extra=json_body(RerankRequest))
        async def rerank(request: Request) -> Response:
            return await serve_rerank(serving, await read_json(request, RerankRequest), request)

    for path in api.CLASSIFY_PATHS:

        @app.post(path, openapi_extra=json_body(ClassificationRequest))
        async def classify(request: Request) -> Response:
            req = await read_json(request, ClassificationRequest)
            return await serve_classify(serving, req, request)

    answers = {  # invocations.KINDS' endpoints
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        "/v1/embeddings": embeddings,
        api.CLASSIFY_PATHS[0]: classify,
        api.RERANK_PATHS[0]: rerank,
        api.SCORE_PATHS[0]: score,
    }
    bodies: list[type[BaseModel]] = [api.ChatCompletionRequest, api.CompletionRequest]
    bodies += [EmbeddingRequest, ClassificationRequest, RerankRequest, ScoreRequest]

    @app.post(invocations.PATH, openapi_extra=json_body(*bodies))
    async def invoke(request: Request) -> Response:
        """SageMaker's: the body goes to the endpoint its fields name (server/invocations.py)."""
        request.state.body = load_json_object(await request.body())  # (parsed once: read_json)
        if adapter := request.headers.get(ADAPTER_HEADER):  # SageMaker's: the adapter to run on
            request.state.body["model"] = adapter
        kind = invocations.pick(request.state.body, engine.engine)
        if kind is None:
            raise APIError(400, invocations.unmarked(engine.engine))
        return await answers[kind.path](request)

    @app.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await serving.responses(await read_json(request, ResponsesRequest), request)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(
        response_id: str,
        request: Request,
        stream: bool = Query(False),
        starting_after: int | None = Query(None, ge=-1),
    ) -> Response:
        """A kept response (OpenAI's retrieve), as it was answered; with stream=true, a streamed
        background response's events again, all of them or those after `starting_after` (a
        sequence number), then as they come until it ends."""
        known_query(request)
        kept = serving.stored_response(response_id)
        if not stream:
            if starting_after is not None:
                raise APIError(400, "starting_after goes with stream=true", param="starting_after")
            return JSONResponse(kept.body)
        if kept.events is None:
            raise APIError(
                400,
                f"response {response_id!r} was not streamed in the background (background and "
                "stream true): retrieve it without stream",
                param="stream",
            )
        start = 0 if starting_after is None else starting_after + 1
        return EventStream(kept.events.read(start), engine.config.sse_keep_alive_interval)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        known_query(request)
        await serving.delete_response(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        """Cancels a background response still running; answers the Response, cancelled."""
        known_query(request)
        return JSONResponse(await serving.cancel_response(response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str,
        request: Request,
        order: Literal["asc", "desc"] = Query("desc"),
        limit: int = Query(20, ge=1, le=100),
        after: str | None = Query(None, max_length=256),
    ) -> Response:
        """The input items of a kept response's own request, OpenAI's list: newest first unless
        order=asc, `limit` a page, from the item after `after`."""
        known_query(request)
        items = serving.stored_response(response_id).input_items
        return JSONResponse(item_page(items, order == "desc", limit, after))

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # name[]=...: only those series, as prometheus_client's own /metrics app (vLLM's) answers
        body, headers = metrics.render(
            request.query_params.getlist("name[]"),
            request.headers.get("accept", ""),
            request.headers.get("accept-encoding", ""),
        )
        return Response(body, headers=headers)

    @app.get("/v1/kv")
    async def kv() -> JSONResponse:
        snapshot = await asyncio.to_thread(engine.kv_snapshot)  # waits for the step in flight
        snapshot["model"] = engine.model_name
        return JSONResponse(snapshot)


def add_simulate_route(app: FastAPI) -> None:
    """/v1/simulate: the dashboard's Play panel; needs no engine."""

    @app.get("/v1/simulate")
    async def simulate(
        request: Request,
        kv_memory: str = Query("64GiB", max_length=32),
        bytes_per_token: int = Query(131072, ge=1, le=INT64_MAX),
        max_model_len: int = Query(8192, ge=1, le=INT64_MAX),
        max_output: int = Query(2048, ge=1, le=INT64_MAX),
        requests: int = Query(200, ge=1, le=MAX_SIM_REQUESTS),
        seed: int = Query(0, ge=INT64_MIN, le=INT64_MAX),
        policies: str = Query("reserve-max,reserve-output,paged:16,paged:256", max_length=128),
    ) -> JSONResponse:
        """The seeds' experiment, computed exactly as `pagedkv simulate --json` does."""
        known_query(request)
        from pagedkv.sim.cli import load_requests
        from pagedkv.sim.simulate import parse_policies, pool_tokens_for
        from pagedkv.sim.simulate import simulate as run_simulation

        checked("kv_memory", lambda v: pool_tokens_for(v, bytes_per_token), kv_memory)
        checked("policies", parse_policies, policies)
        args = argparse.Namespace(trace=None, requests=requests, seed=seed, max_output=max_output)

        def run() -> dict:  # 100k requests take a while: off the event loop
            trace = load_requests(args)
            return run_simulation(
                trace,
                kv_memory=kv_memory,
                bytes_per_token=bytes_per_token,
                max_model_len=max_model_len,
                max_output=max_output,
                policies=policies,
            ).to_dict()

        return JSONResponse(await asyncio.to_thread(run))


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: `grace` seconds after the exit signal, abort what still runs so it can end."""

    def __init__(self, config: uvicorn.Config, engine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if sockets is not None:  # uvicorn says where it runs only of the sockets it binds itself
            self._log_started_message(sockets)
        for server in self.servers:
            for sock in server.sockets:
                url, how = served_url(sock, self.config)
                log.info(
                    "pagedkv serves %s: OpenAI API at %s/v1, dashboard at %s/%s",
                    self.engine.model_name,
                    url,
                    url,
                    how,
                )

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._abort_after_grace())

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.grace)
        log.warning("requests still running after %.0fs: aborting them", self.grace)
        await self.engine.shutdown()

    async def on_tick(self, counter: int) -> bool:
        if self.engine.error is not None and not self.should_exit:  # exit non-zero: see serve()
            log.critical("the engine stopped after an internal error: exiting for a restart")
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self._drain is not None:
            self._drain.cancel()
        # uvicorn raises the caught signal again once it has stopped, which kills the process
        # (exit status 143 for SIGTERM): a stop it handled cleanly exits 0, as serve() says.
        self._captured_signals.clear()


def log_level() -> str:
    """PAGEDKV_LOGGING_LEVEL (--log-level sets it): where pagedkv's lines start (INFO unless set;
    as vLLM's VLLM_LOGGING_LEVEL, DEBUG adds the request log's prompts)."""
    level = os.environ.get("PAGEDKV_LOGGING_LEVEL", "INFO").strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(
            f"PAGEDKV_LOGGING_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {level!r}"
        )
    return level


def default_log_config() -> dict:
    """uvicorn's logging, with pagedkv's lines in the same form."""
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["pagedkv"] = {
        "handlers": ["default"],
        "level": log_level(),
        "propagate": False,
    }
    return log_config


def log_to_stderr() -> None:
    """pagedkv's lines on stderr, as one process shows them, where nothing set up their logging
    (a Ray Serve replica: Ray relays its stderr to the driver)."""
    logger = logging.getLogger("pagedkv")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(log_level())
        logger.propagate = False


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    cors: dict | None = None,
    log_level: str = "info",
    access_log: bool = True,
    http: HTTPOptions | None = None,
) -> int:
    """Load the model, then serve until SIGINT/SIGTERM (exit code 0) or until the engine loop
    stops on an error (exit code 1, for a supervisor to restart the server)."""
    from pagedkv.engine.async_engine import AsyncLLM

    http = http or HTTPOptions()
    http.check()
    sock = bind(host, port, http.uds)  # before the model loads: an address in use fails at once
    log_config = http.log_config() or default_log_config()
    logging.config.dictConfig(log_config)  # now, so the load's own lines (weights, KV pool) show
    with exit_on_sigterm("pagedkv: stopped by SIGTERM before serving"):
        engine = AsyncLLM(config)
        app = build_app(
            engine, cors=cors, max_header_count=http.h11_max_header_count or MAX_HEADER_COUNT
        )
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            log_config=log_config,
            access_log=access_log,
            **http.uvicorn_options(),
            # annotated int, but uvicorn only hands it to asyncio.wait_for, which takes a float
            timeout_graceful_shutdown=shutdown_timeout + 10,  # type: ignore[arg-type]
        )
        if (quiet := http.quiet_paths()) is not None:  # (uvicorn.Config set the loggers up)
            logging.getLogger("uvicorn.access").addFilter(quiet)
        GracefulServer(uv_config, engine, shutdown_timeout).run(sockets=[sock])
    return 1 if engine.error is not None else 0
