"""`pagedkv serve --data-parallel-size N`: N engine replicas on Ray Serve behind one endpoint.

    client -> Ray Serve proxy -> Ingress (tokenizer) --handle + PagedKVRouter--> EngineReplica x N
                                   | the prompt's block hashes         each: AsyncLLM + build_app
                                   | or the replica keeping a stored response it needs
                                           | /metrics, /v1/kv: ask every replica, merge

Each replica runs the same FastAPI app as the one-process server (`build_app`), so routes,
errors and streaming are that app's; the ingress hands it the raw request and streams its
ASGI messages back. The ingress computes the prompt's block hashes, which the request router
(`ray_router.PagedKVRouter`, Ray's RequestRouter API) turns into a replica with
`pagedkv.routing`; a request that needs a stored response goes to the replica keeping it
(server/response_owners.py). Ray starts, restarts and health-checks the replicas; a replica
that dies is dropped from routing and its in-flight requests get a 503 (an error event if
streaming).
"""

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from pagedkv.config import EngineConfig, is_digits, lora_modules
from pagedkv.routing import prompt_block_hashes
from pagedkv.server import invocations
from pagedkv.server.aggregate import merge_kv, merge_metrics
from pagedkv.server.errors import error_body
from pagedkv.server.metrics import exposition
from pagedkv.server.middleware import MAX_BODY_BYTES, BodySizeLimit, HeaderCountLimit
from pagedkv.server.ray_router import PagedKVRouter, RouteKey
from pagedkv.server.response_owners import ResponseOwners, created_response, needed_response
from pagedkv.server.routes_extra import ADAPTER_HEADER

log = logging.getLogger("pagedkv.server")
REPLICA_HEADER = (
    "x-pagedkv-replica"  # send a request to replica i (tests, debugging); answers say who served
)
SSE = "text/event-stream"
# set by the ingress's CORS middleware on what it sends, so none is taken from a replica's answer
CORS_HEADERS = (b"access-control-", b"vary")
START_ATTEMPTS = 2  # tries to start a request while replicas are found dead
LOAD_LORA, UNLOAD_LORA = "v1/load_lora_adapter", "v1/unload_lora_adapter"


# the body fields a request's prompt is read from, for routing (a query's pairs go together)
_PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    "/completions": ("prompt",),
    "/embeddings": ("input",),
    "/classify": ("input",),
    "/pooling": ("input",),
    "/rerank": ("query",),
    "/score": ("text_1", "queries", "data_1"),
}


class ReplicaGone(Exception):
    """The replica serving a request failed or died."""


ADAPTER_REGISTRY = "pagedkv-runtime-adapters"  # the AdapterRegistry actor's name


@ray.remote(num_cpus=0)
class AdapterRegistry:
    """The adapters loaded at runtime through the ingress (name -> its load request's body), so
    that a replica Ray starts later loads them too. Owned by the ingress: it lives as long."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {}

    def put(self, name: str, body: bytes) -> None:
        self.bodies[name] = body

    def drop(self, name: str) -> None:
        self.bodies.pop(name, None)

    def all(self) -> dict[str, bytes]:
        return dict(self.bodies)


@serve.deployment(max_ongoing_requests=1000, health_check_period_s=2, health_check_timeout_s=30)
class EngineReplica:
    """One engine and its FastAPI app, called through ASGI by the ingress."""

    async def __init__(  # type: ignore[misc]  # Serve awaits it
        self, config: EngineConfig, cors: dict | None = None
    ) -> None:
        import torch

        torch.set_num_threads(1)  # replicas share the machine's cores
        from pagedkv.engine.async_engine import AsyncLLM
        from pagedkv.server.app import build_app, log_to_stderr

        log_to_stderr()  # (the request log among them)
        self.name = ray.get_runtime_context().get_actor_name() or "replica"
        self.pid = os.getpid()
        self.app = build_app(AsyncLLM(config), cors=cors)  # for a preflight that reaches it
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        await self._load_runtime_adapters(config.api_key)

    async def _load_runtime_adapters(self, api_key: str | None) -> None:
        """A replica started after adapters were loaded at runtime (Ray replacing one that died)
        loads them as the others did, through its own route, before it takes a request."""
        try:
            registry = ray.get_actor(ADAPTER_REGISTRY)
        except ValueError:  # the first start: the ingress has loaded nothing yet
            return
        headers = [(b"content-type", b"application/json")]
        if api_key is not None:
            headers.append((b"authorization", f"Bearer {api_key}".encode()))
        for name, body in (await registry.all.remote()).items():
            answer = [
                m
                async for m in self.forward(RouteKey(), "POST", f"/{LOAD_LORA}", b"", headers, body)
            ]
            if answer[0]["status"] != 200:
                log.warning(
                    "replica %s: adapter %r did not load again: %s",
                    self.name,
                    name,
                    b"".join(answer[1:]).decode(errors="replace"),
                )

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)

    async def forward(
        self,
        key: RouteKey,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> AsyncIterator[dict | bytes]:
        """One HTTP request through the app: yields {status, headers, replica, pid}, then body."""
        sent: asyncio.Queue = asyncio.Queue()
        gone, body_read = asyncio.Event(), False

        async def receive() -> dict:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("replica", 0),
        }
        task = asyncio.ensure_future(self.app(scope, receive, sent.put))
        task.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while (msg := await sent.get()) is not None:
                if msg["type"] == "http.response.start":
                    yield {
                        "status": msg["status"],
                        "headers": msg.get("headers", []),
                        "replica": self.name,
                        "pid": self.pid,
                    }
                elif msg["type"] == "http.response.body" and msg.get("body"):
                    yield msg["body"]
        finally:
            gone.set()  # a client that went away aborts the engine request, as in one process
            await asyncio.gather(task, return_exceptions=True)


app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)
app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
app.add_middleware(HeaderCountLimit)  # vLLM's default limit (the HTTP flags are refused here)


# Serve pickles the deployment classes where they are declared: what they call must come first.
@dataclass(frozen=True)
class AdapterUpdate:
    """A request that loads or unloads an adapter (vLLM's routes, or SageMaker's /adapters): the
    adapter's name, and for a load the body that loads it through vLLM's route (what a replica
    started later is given)."""

    loads: bool
    name: str | None
    load_body: bytes = b""


def _adapter_update(request: Request, path: str, body: bytes) -> AdapterUpdate | None:
    """What the request changes, if it loads or unloads an adapter; None for any other."""
    sagemaker = path == "adapters" and request.method == "POST"
    if path not in (LOAD_LORA, UNLOAD_LORA) and not sagemaker:
        if path.startswith("adapters/") and request.method == "DELETE":
            return AdapterUpdate(False, path.removeprefix("adapters/") or None)
        return None
    try:
        data = json.loads(body) if body.strip() else dict(request.query_params)
    except ValueError:
        data = None
    fields = ("name", "src") if sagemaker else ("lora_name", "lora_path")
    name = data.get(fields[0]) if isinstance(data, dict) else None
    name = name if isinstance(name, str) else None
    if path == UNLOAD_LORA:
        return AdapterUpdate(False, name)
    src = data.get(fields[1]) if isinstance(data, dict) else None
    load = json.dumps({"lora_name": name, "lora_path": src}).encode() if sagemaker else body
    return AdapterUpdate(True, name, load)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


async def _relay(stream) -> AsyncIterator[bytes]:
    """The replica's event stream; if the replica dies, an error event ends it."""
    try:
        async for chunk in stream:
            yield chunk
    except ray.exceptions.RayError as e:
        err = error_body(503, f"the replica serving this request failed: {type(e).__name__}")
        yield f"data: {json.dumps(err)}\n\n".encode()
    finally:
        stream.cancel()


@serve.deployment(max_ongoing_requests=10_000)
@serve.ingress(app)
class Ingress:
    """The HTTP entry: routes on the prompt's block hashes; /metrics, /v1/kv ask each replica."""

    def __init__(
        self,
        engine,
        model: str | None,
        block_size: int,
        num_replicas: int,
        cors: dict | None = None,
        adapters: frozenset[str] = frozenset(),
        stored_responses: int = 0,
    ) -> None:
        from pagedkv.model.loader import read_checkpoint

        self.engine = engine.options(stream=True)
        self.tokenizer = read_checkpoint(model)[0].tokenizer
        self.block_size, self.num_replicas = block_size, num_replicas
        self.cors = cors or {}
        self.adapters = adapters  # LoRA names: a request naming one is keyed apart, as on replicas
        self.registry = AdapterRegistry.options(  # type: ignore[attr-defined]
            name=ADAPTER_REGISTRY, get_if_exists=True
        ).remote()
        # which replica keeps each stored response (each keeps up to stored_responses)
        self.owners = ResponseOwners(stored_responses * num_replicas)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve's hook, called after the constructor: the app with the server's CORS options.

        The ingress answers HTTP, so its CORS decides (preflights, /metrics and /v1/kv too);
        `app` was copied when the module loaded, before the options were known. Without
        options CORSMiddleware allows no origin."""
        # this replica's own copy of `app`, not yet started; Serve's ingress wrapper sets it
        ingress_app: FastAPI = self.app  # type: ignore[attr-defined]
        ingress_app.add_middleware(CORSMiddleware, **self.cors)
        return ingress_app

    def route_key(self, request: Request, body: bytes) -> RouteKey:
        """The prompt's block hashes (none for a body we cannot read: the replica will say why)."""
        wanted = request.headers.get(REPLICA_HEADER)
        if wanted is not None and is_digits(wanted):
            return RouteKey(replica=int(wanted))
        try:
            data = json.loads(body) if body else {}
            ids = self._prompt_ids(request.url.path, data) if isinstance(data, dict) else []
            salt = data.get("cache_salt") if isinstance(data, dict) else None
            model = data.get("model") if isinstance(data, dict) else None
            if request.url.path.endswith(invocations.PATH):  # its adapter header, as replicas
                model = request.headers.get(ADAPTER_HEADER) or model
        except Exception:  # noqa: BLE001 - bad input is the replica's to reject, with its own message
            ids, salt, model = [], None, None
        salt = salt if isinstance(salt, str) and salt else None
        adapter = model if isinstance(model, str) and model in self.adapters else None
        hashes = prompt_block_hashes(ids, self.block_size, salt=salt, adapter=adapter)
        return RouteKey(hashes=tuple(hashes))

    def _prompt_ids(self, path: str, data: dict) -> list[int]:
        tok = self.tokenizer
        if path.endswith(invocations.PATH):  # routed as the endpoint it stands for
            kind = invocations.pick(data)
            path = kind.path if kind is not None else path
        named = next((f for end, f in _PROMPT_FIELDS.items() if path.endswith(end)), ())
        # (the pooling endpoints, whose prompt is `input`, or vLLM's chat form in its place)
        pooled_chat = named == ("input",) and data.get("input") is None and data.get("messages")
        if path.endswith("/chat/completions") or path.endswith("/responses") or pooled_chat:
            from pagedkv.engine.chat import render_chat
            from pagedkv.server.embeddings import PoolingRequest
            from pagedkv.server.protocol import ChatCompletionRequest
            from pagedkv.server.responses_protocol import ResponsesRequest

            if pooled_chat:  # vLLM's chat form of a pooling request: no generation prompt
                pool = PoolingRequest.model_validate(data)
                assert pool.messages is not None  # (pooled_chat)
                messages = [m.as_template_input() for m in pool.messages]
                text = render_chat(tok, messages, add_generation_prompt=pool.add_generation_prompt)
                return tok.encode(text, add_special_tokens=pool.special_tokens())
            chat = (
                ResponsesRequest.model_validate(data).chat_request({})
                if path.endswith("/responses")
                else ChatCompletionRequest.model_validate(data)
            )
            # content parts shaped as the replica shapes them (render_chat)
            messages = [m.as_template_input() for m in chat.messages]
            return tok.encode(render_chat(tok, messages), add_special_tokens=False)
        prompt = next((data[f] for f in named if data.get(f) is not None), None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tok.encode(prompt, add_special_tokens=True)
        return (
            prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else []
        )

    async def _call(
        self,
        request: Request,
        key: RouteKey,
        body: bytes,
        drop: tuple = (),
        path: str = "",
        method: str = "",
        query: bytes | None = None,
    ):
        """Start the call (without the headers named in `drop`, lower case; to `path`, as
        `method`, with `query`, where given); returns (head, the rest of the stream). Raises
        ReplicaGone.

        A replica found dead before the answer started (routed there before Ray saw it die,
        or dead mid-way through a non-streamed answer) gets one more try elsewhere: nothing
        reached the client yet and a generation changes nothing. Only one, so a request that
        kills replicas cannot take down more than two."""
        drop = (REPLICA_HEADER.encode(), *drop)
        headers = [(k, v) for k, v in request.scope["headers"] if k.lower() not in drop]
        error: Exception
        for attempt in range(START_ATTEMPTS):
            stream = self.engine.forward.remote(
                key,
                method or request.method,
                path or request.url.path,
                request.scope.get("query_string", b"") if query is None else query,
                headers,
                body,
            )
            try:
                return await stream.__anext__(), stream
            except ray.exceptions.ActorDiedError as e:
                error = e
                await asyncio.sleep(0.2 * (attempt + 1))
            except (ray.exceptions.RayError, StopAsyncIteration) as e:
                error = e
                break
        raise ReplicaGone(
            f"the replica serving this request failed: {type(error).__name__}"
        ) from error

    async def _each_replica(self, request: Request, body: bytes = b"") -> list[tuple[dict, bytes]]:
        """The same request on every replica (deduplicated: a replica that died meanwhile is
        skipped); each head also says the replica's index.

        One at a time: Ray gives the calls of one ingress request one internal request id,
        and its router matches concurrent calls by that id. Each answers in plain text and
        uncompressed (the answers are merged here, then given in the form the client asked)."""
        unique: dict[str, tuple[dict, bytes]] = {}
        for i in range(self.num_replicas):
            try:
                head, stream = await self._call(
                    request, RouteKey(replica=i), body, drop=(b"accept", b"accept-encoding")
                )
                head = {**head, "index": i}
                unique[head["replica"]] = head, b"".join([chunk async for chunk in stream])
            except (ReplicaGone, ray.exceptions.RayError):
                continue
        return [unique[name] for name in sorted(unique)]

    async def _owner(self, request: Request, response_id: str) -> str | None:
        """The replica keeping a stored response: known from its answer, else the first replica
        that has it (None: none has, or the caller may not ask)."""
        if (owner := self.owners.get(response_id)) is not None:
            return owner
        path = f"/v1/responses/{response_id}"  # (an ASGI path, as the request's own)
        for i in range(self.num_replicas):
            try:
                head, stream = await self._call(
                    request, RouteKey(replica=i), b"", path=path, method="GET", query=b"",
                    drop=(b"content-length", b"content-type", b"accept", b"accept-encoding"),
                )  # fmt: skip
                [_ async for _ in stream]
            except (ReplicaGone, ray.exceptions.RayError):
                continue
            if head["status"] == 200:
                self.owners.put(response_id, head["replica"])
                return head["replica"]
        return None

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        answers = await self._each_replica(request)
        if not answers:
            return _error(503, "no engine replica is running")
        merged = merge_metrics([text.decode() for _, text in answers])
        body, headers = exposition(
            merged, request.headers.get("accept", ""), request.headers.get("accept-encoding", "")
        )
        return Response(body, headers=headers)

    @app.get("/load")
    async def load(self, request: Request) -> Response:
        """The replicas' requests in flight, summed."""
        answers = await self._each_replica(request)
        if not answers:
            return _error(503, "no engine replica is running")
        total = sum(
            json.loads(body)["server_load"] for head, body in answers if head["status"] == 200
        )
        return JSONResponse({"server_load": total})

    @app.get("/v1/kv")
    async def kv(self, request: Request) -> Response:
        answers = await self._each_replica(request)
        if not answers:
            return _error(503, "no engine replica is running")
        for head, body in answers:
            if head["status"] != 200:  # e.g. a missing API key: the replica's own error
                return Response(body, status_code=head["status"], media_type="application/json")
        return JSONResponse(
            merge_kv(
                [
                    {**json.loads(body), "replica": head["replica"], "pid": head["pid"]}
                    for head, body in answers
                ]
            )
        )

    async def _update_adapters(
        self, request: Request, update: AdapterUpdate, body: bytes
    ) -> Response:
        """Load or unload an adapter on every replica, so that any of them serves it. A load that
        fails on one is undone on the others; an unload counts a replica that never had the
        adapter (404) as done. The registry keeps what is loaded for a replica Ray starts later."""
        answers = await self._each_replica(request, body)
        if not answers:
            return _error(503, "no engine replica is running")
        done = [head for head, _ in answers if head["status"] == 200]
        if not update.loads:
            failed = [(h, b) for h, b in answers if h["status"] not in (200, 404)]
        else:
            failed = [(h, b) for h, b in answers if h["status"] != 200]
        name = update.name
        if failed:
            if update.loads and name is not None:
                undo = json.dumps({"lora_name": name}).encode()
                for head in done:
                    try:
                        _, stream = await self._call(
                            request, RouteKey(replica=head["index"]), undo,
                            drop=(b"content-length",), path=f"/{UNLOAD_LORA}",
                        )  # fmt: skip
                        [_ async for _ in stream]
                    except (ReplicaGone, ray.exceptions.RayError):
                        continue
            head, answer = failed[0]
        elif not done:  # an unload no replica could do: none had it
            head, answer = answers[0]
        else:
            head, answer = done[0], next(b for h, b in answers if h is done[0])
            if name is not None and update.loads:
                self.adapters |= {name}
                await self.registry.put.remote(name, update.load_body)
            elif name is not None:
                self.adapters -= {name}
                await self.registry.drop.remote(name)
        kind = dict(head["headers"]).get(b"content-type", b"application/json").decode()
        return Response(answer, status_code=head["status"], media_type=kind)

    @app.api_route(
        "/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    )
    async def proxy(self, request: Request, path: str) -> Response:
        body = await request.body()
        if (update := _adapter_update(request, path, body)) is not None:  # not one replica alone
            return await self._update_adapters(request, update, body)
        key = self.route_key(request, body)
        method, path = request.method, request.url.path
        needed = needed_response(method, path, body) if self.owners.capacity else None
        try:
            if needed is not None and key.replica is None:
                key = RouteKey(hashes=key.hashes, owner=await self._owner(request, needed))
            head, stream = await self._call(request, key, body)
        except ReplicaGone as e:
            return _error(503, str(e))
        headers = {
            k.decode(): v.decode()
            for k, v in head["headers"]
            if k.lower() != b"content-length" and not k.lower().startswith(CORS_HEADERS)
        }
        headers[REPLICA_HEADER] = head["replica"]
        if not headers.get("content-type", "").startswith(SSE):
            try:  # whole bodies are collected, so a replica dying mid-answer is a clean 503
                content = b"".join([chunk async for chunk in stream])
            except ray.exceptions.RayError as e:
                return _error(503, f"the replica serving this request failed: {type(e).__name__}")
            if (created := created_response(method, path, head["status"], content)) is not None:
                self.owners.put(created, head["replica"])
            elif needed is not None and method == "DELETE" and head["status"] == 200:
                self.owners.drop(needed)
            return Response(content, status_code=head["status"], headers=headers)
        return StreamingResponse(_relay(stream), status_code=head["status"], headers=headers)


def build(
    config: EngineConfig,
    num_replicas: int,
    shutdown_timeout: float = 30.0,
    routing: str = "prefix-aware",
    cors: dict | None = None,
):
    """The Serve application: N engine replicas behind the ingress, routed by `routing`.

    `cors` holds CORSMiddleware's options, complete (the ingress adds no defaults)."""
    # ray's pydantic-v1 model is seen as taking dicts; the field is Union[str, Callable]
    router = RequestRouterConfig(
        request_router_class=PagedKVRouter,  # type: ignore[arg-type]
        request_router_kwargs={"policy": routing},
    )
    # serve.deployment turns each class into a Deployment; its typing keeps the class
    engine = EngineReplica.options(  # type: ignore[attr-defined]
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": 1},
        graceful_shutdown_timeout_s=shutdown_timeout,
        request_router_config=router,
    ).bind(config, cors)
    return Ingress.options(ray_actor_options={"num_cpus": 0}).bind(  # type: ignore[attr-defined]
        engine,
        config.model,
        config.block_size,
        num_replicas,
        cors,
        frozenset(lora_modules(config.lora_modules)) if config.enable_lora else frozenset(),
        config.max_stored_responses,
    )
