"""`lossless serve`'s HTTP side: the OpenAI routes on FastAPI, over one `Engine`.

Owns the HTTP contract: routes (/health, /v1/models, /v1/chat/completions, /v1/completions, /metrics), request
checks against the model (context, caps, the decoding settings a request may pick), OpenAI's response and
stream chunk shapes with the `lossless` object that says what ran, errors in OpenAI's shape, the API key, the
body size cap, the access log and the Prometheus metrics. Decoding itself happens in `engine.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..decoding.sampling import SamplingConfig
from ..errors import LosslessError
from ..text import encode_messages, encode_prompt
from .engine import ClientBusy, Engine, Job, QueueFull, Result, ShuttingDown
from .protocol import ApiError, ChatRequest, CompletionRequest, LosslessOptions, loggable, parse

log = logging.getLogger("lossless.serve")
ROUTES = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics")


@dataclass
class Defaults:
    """The server's decoding settings: what a request gets for every field it leaves out."""

    mode: str = "orthrus"
    k: int | None = None
    cycle: str = "two-pass"
    groups: int | None = None
    tree: int | None = None  # None: the fastest lossless default (see `loop.auto_cycle`)
    lookup: int | None = None
    temperature: float = 0.0  # greedy, as `lossless generate` (the OpenAI API's default is 1)
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed per request (said in the response)
    max_tokens: int = 2048  # a request's cap, and its default where the context leaves room


class Metrics:
    """The Prometheus series of one server (its own registry, so two servers in a process do not mix)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lossless_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.tokens = Counter("lossless_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_cycle = Histogram("lossless_tokens_per_cycle", "tokens committed per orthrus cycle, per request",
                                          buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 16), registry=r)
        self.queue_depth = Gauge("lossless_queue_depth", "requests waiting or decoding", registry=r)
        self.time_to_first_token = Histogram(
            "lossless_time_to_first_token_seconds", "arrival to the first generated token (queueing included)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.batch_size = Histogram("lossless_batch_size", "requests decoding together, per step (--batch)",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.time_per_token = Histogram(
            "lossless_time_per_output_token_seconds", "seconds per generated token after the first, per request",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28), registry=r)


class Gate:
    """ASGI middleware around every route: the API key (all routes but /health), the access log line and the
    request counter."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and scope["path"] != "/health" and not self._authorized(scope):
                error = ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            path = scope["path"]
            self.metrics.requests.labels(path if path in ROUTES else "other", str(status[0])).inc()
            client = scope.get("client") or ("-", 0)
            log.info('%s "%s %s" %d %.0f ms', client[0], loggable(scope["method"], 16), loggable(path, 200),
                     status[0], 1000 * (time.perf_counter() - start))

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        expected = b"Bearer " + self.api_key.encode()
        return hmac.compare_digest(given, expected)


def client_of(request: Request) -> str:
    """Who sent a request, for the per-client limit: its API key (a digest of it), else its address."""
    auth = request.headers.get("authorization", "")
    if auth.startswith("Bearer ") and len(auth) > 7:
        return "key:" + hashlib.sha256(auth[7:].encode()).hexdigest()[:16]
    return "address:" + (request.client.host if request.client else "-")


def json_body(kind) -> dict:
    """The OpenAPI request body of a route that reads its JSON itself (`parse`: size caps, OpenAI's error shape): the
    request model's schema, for `app.openapi()` and the tools that read it (the schema fuzzer of the tests)."""
    schema = kind.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)  # the models it refers to: in the document's components (`with_body_models`)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def with_body_models(app: FastAPI, kinds) -> None:
    """`app.openapi()` with the request models' nested models in its components (where `json_body`'s refer)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            models = schema.setdefault("components", {}).setdefault("schemas", {})
            for kind in kinds:
                models.update(kind.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


def max_token_chars(tokenizer) -> int:
    """The most characters of text one token of `tokenizer` stands for (at least 1): its longest vocabulary entry's
    length, which for byte-level vocabularies counts bytes, never fewer than the characters they spell."""
    if tokenizer is None:
        return 1
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def create_app(model, defaults: Defaults | None = None, *, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 16, max_body: int = 1 << 20, batch: int = 1,
               prefill_chunk: int | None = None, max_per_client: int | None = None) -> FastAPI:
    """The server's ASGI app for `model` (an OrthrusLM). `lossless serve` runs it with uvicorn. `batch` > 1:
    up to that many requests decode together (exact kernels; see `engine.py`), a joining prompt running at most
    `prefill_chunk` rows a step."""
    defaults = defaults or Defaults()
    name = model_name or model.name
    metrics = Metrics()
    engine = Engine(model, max_queue=max_queue, metrics=metrics, batch=batch, prefill_chunk=prefill_chunk,
                    max_per_client=max_per_client)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        yield
        engine.close()

    app = FastAPI(title="lossless", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        message = {404: "no such route: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions",
                   405: "this route does not take that method"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(ApiError(exc.status_code, message).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.error("internal error", exc_info=exc)
        return JSONResponse(ApiError(500, "internal error: see the server's log").body(), 500)

    @app.get("/health")
    async def health():
        if engine.failure is not None:  # the decoding thread died: nothing will be answered (the server exits)
            return JSONResponse({"status": "engine failed", "model": name, "error": type(engine.failure).__name__},
                                503)
        return {"status": "ok", "model": name, "queue": await asyncio.to_thread(engine.depth)}

    def check_model(asked: str) -> None:
        if asked != name:
            raise ApiError(404, f"model '{asked}' is not served here: this server serves '{name}'", param="model",
                           code="model_not_found")

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "lossless",
                "lossless": {"dtype": model.dtype_name, "attn": model.attn, "k": model.k,
                             "context": model.max_positions}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # the most characters a prompt can have and still fit the context: no token covers more characters than its
    # vocabulary entry has (byte-level entries: one per byte, and a character is a byte or more)
    prompt_chars = model.max_positions * max_token_chars(model.tokenizer)

    def check_chars(texts: list[str], param: str) -> None:
        """Refuse, before the template and the tokenizer run, a prompt too long for the context by its length alone."""
        if sum(len(t) for t in texts) > prompt_chars:
            raise ApiError(400, f"the prompt has {sum(len(t) for t in texts)} characters, more than the model's "
                                f"context of {model.max_positions} tokens can hold: shorten it", param=param,
                           code="context_length_exceeded")

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatRequest))
    async def chat(request: Request):
        arrived = time.perf_counter()  # time to first token counts from here: reading, templating, tokenizing too
        req = parse(ChatRequest, await read_body(request, max_body))
        conversation = req.conversation()
        check_chars([m["content"] for m in conversation], "messages")
        try:  # off the event loop: a long prompt's tokenization must not stall the other streams
            ids = await asyncio.to_thread(encode_messages, model.tokenizer, conversation)
        except LosslessError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return await answer(request, req, ids, chat=True, arrived=arrived)

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request):
        arrived = time.perf_counter()
        req = parse(CompletionRequest, await read_body(request, max_body))
        if isinstance(req.prompt, list):
            vocab = int(model.config.vocab_size)
            if not req.prompt or not all(0 <= i < vocab for i in req.prompt):
                raise ApiError(400, f"'prompt': token ids must be a non-empty list of ids in [0, {vocab})",
                               param="prompt")
            ids = list(req.prompt)
        else:
            check_chars([req.prompt], "prompt")
            try:
                ids = await asyncio.to_thread(encode_prompt, model.tokenizer, req.prompt, chat_template=False)
            except LosslessError as exc:
                raise ApiError(400, str(exc), param="prompt") from None
        return await answer(request, req, ids, chat=False, arrived=arrived)

    async def answer(request: Request, req, ids: list[int], chat: bool, arrived: float):
        if req.model is not None:
            check_model(req.model)
        settings = generate_settings(req, ids, model, defaults)
        job = Job(prompt_ids=ids, settings=settings, stops=req.stops(), loop=asyncio.get_running_loop(),
                  arrived=arrived, client=client_of(request))
        try:
            engine.submit(job)
        except ClientBusy as exc:
            raise ApiError(429, f"{exc}: wait for one to finish", code="client_limit") from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}): retry later", code="queue_full") from None
        except ShuttingDown as exc:
            raise job_error(exc) from None
        shape = ChunkShape(chat, name, settings)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job, stream(job, shape, include_usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        result = await until_done_or_gone(request, job)
        if result is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return shape.whole(result)

    app.add_middleware(Gate, api_key=api_key, metrics=metrics)
    with_body_models(app, (ChatRequest, CompletionRequest))
    return app


BODY_SECONDS = 30.0  # the longest a client may take to send its body (a slow sender holds a connection)


async def read_body(request: Request, cap: int, seconds: float = BODY_SECONDS) -> bytes:
    """The request body, refused (413) past `cap` bytes without reading the rest, and (408) when it has not all
    arrived within `seconds`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > cap:
        raise ApiError(413, f"the request body is {declared} bytes; this server takes at most {cap}")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise ApiError(413, f"the request body is over {cap} bytes, the most this server takes")
            chunks.append(chunk)
    try:
        await asyncio.wait_for(read(), seconds)
    except ClientDisconnect:  # gone before the body arrived: nobody reads the answer
        raise ApiError(499, "the client closed the connection before sending the whole request") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s", code="request_timeout") from None
    return b"".join(chunks)


def generate_settings(req, ids: list[int], model, defaults: Defaults) -> dict:
    """Keyword arguments of `OrthrusLM.generate` for a request: its fields, else the server's defaults; every
    choice checked here, so a request that cannot run is refused before it queues."""
    ext = req.lossless or LosslessOptions()
    temperature = defaults.temperature if req.temperature is None else float(req.temperature)
    cycle = ext.cycle or defaults.cycle
    if ext.tree and cycle != "two-pass":
        raise ApiError(400, "'lossless.tree' works with the two-pass cycle", param="lossless.tree")
    k = ext.k or defaults.k
    if k is not None and k > model.k:
        raise ApiError(400, f"'lossless.k' must be at most the head's k ({model.k}), got {k}", param="lossless.k")

    def default_for(field):  # the server's tree/lookup apply where they can run (greedy or sampled)
        value = getattr(defaults, field)
        return value if not (field == "tree" and cycle != "two-pass") else None

    tree = ext.tree if ext.tree is not None else default_for("tree")
    lookup = ext.lookup if ext.lookup is not None else default_for("lookup")
    room = model.max_positions - len(ids)
    asked = req.new_tokens()
    if room < 1:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; the model's context is {model.max_positions}: "
                            f"shorten it", param="messages" if hasattr(req, "messages") else "prompt",
                       code="context_length_exceeded")
    if asked is not None and asked > defaults.max_tokens:
        raise ApiError(400, f"'max_tokens' is at most {defaults.max_tokens} on this server, got {asked}",
                       param="max_tokens")
    if asked is not None and asked > room:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) + max_tokens ({asked}) exceeds the model's context of "
                            f"{model.max_positions}: shorten the prompt or lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    seed = req.seed if req.seed is not None else defaults.seed if defaults.seed is not None else secrets.randbits(62)
    top_k = ext.top_k if ext.top_k is not None else defaults.top_k
    top_p = defaults.top_p if req.top_p is None else float(req.top_p)
    try:  # values no sampler can use (a temperature that overflows the logits): refused before the job queues
        SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except LosslessError as exc:
        param = "temperature" if "temperature" in str(exc) else "top_p" if "top-p" in str(exc) else "lossless.top_k"
        raise ApiError(400, str(exc).replace("--top-p", "top_p").replace("--top-k", "top_k")
                       .replace("--temperature", "temperature"), param=param, code="invalid_value") from None
    return dict(mode=ext.mode or defaults.mode, max_new_tokens=asked or min(defaults.max_tokens, room), k=k,
                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, cycle=cycle,
                groups=defaults.groups, tree=tree, lookup=lookup)


async def until_done_or_gone(request: Request, job: Job) -> Result | None:
    """The job's result, or None (the job cancelled) once the client has disconnected."""
    done = asyncio.ensure_future(final(job))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not done.done():
            job.cancel()
            done.cancel()
    return done.result() if done.done() and not done.cancelled() else None


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def final(job: Job) -> Result:
    while True:
        kind, value = await job.events.get()
        if kind == "done":
            return value
        if kind == "error":
            raise job_error(value)


def job_error(exc: Exception) -> ApiError:
    if isinstance(exc, LosslessError):
        return ApiError(400, str(exc))
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), code="shutting_down", type="server_error")
    return ApiError(500, "internal error: see the server's log")


class ChunkShape:
    """OpenAI's objects for one request: the whole answer, or the chunks of its stream."""

    def __init__(self, chat: bool, model_name: str, settings: dict):
        self.chat, self.model_name, self.settings = chat, model_name, settings
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def _choice(self, text: str | None, finish: str | None, chunk: bool, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if chunk:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def report(self, result: Result) -> dict:
        """What ran and how it went: the `lossless` object of every answer."""
        s = result.stats
        return {**result.config, "seed": self.settings["seed"], "temperature": self.settings["temperature"],
                "max_tokens": self.settings["max_new_tokens"], "finish": result.stopped_by,
                "tokens_per_cycle": s["tokens_per_step"], "cycles": s["steps"], "forwards": s["forwards"],
                "seconds": s["seconds"], "tokens_per_second": s["tokens_per_second"]}

    @staticmethod
    def usage(result: Result) -> dict:
        n = len(result.token_ids)
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}

    def whole(self, result: Result) -> dict:
        return {**self._head(False), "choices": [self._choice(result.text, result.finish_reason, False)],
                "usage": self.usage(result), "system_fingerprint": fingerprint(result.config),
                "lossless": self.report(result)}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False, **extra) -> str:
        body = {**self._head(True), "choices": [self._choice(text, finish, True, role)], **extra}
        return sse(body)


def fingerprint(config: dict) -> str:
    from .. import __version__

    return f"lossless-{__version__}-{config['dtype']}-{config['attn']}"


def sse(body) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class JobStream(StreamingResponse):
    """A stream that cancels its job however the response ends (a client gone mid-send included)."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def stream(job: Job, shape: ChunkShape, include_usage: bool):
    """Server-sent events: a role chunk (chat), text chunks as tokens commit, a last chunk with the finish
    reason and the `lossless` object, the usage chunk if asked, then `data: [DONE]`. A client that goes away
    cancels the decode (Starlette cancels this generator)."""
    try:
        if shape.chat:
            yield shape.chunk(role=True)
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield shape.chunk(value)
            elif kind == "done":
                yield shape.chunk(finish=value.finish_reason, system_fingerprint=fingerprint(value.config),
                                  lossless=shape.report(value))
                if include_usage:
                    yield sse({**shape._head(True), "choices": [], "usage": shape.usage(value)})
                break
            else:
                yield sse(job_error(value).body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()
