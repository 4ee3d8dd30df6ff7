"""`fusion serve`'s HTTP side: the OpenAI-compatible routes on FastAPI, served by uvicorn.

    POST /v1/chat/completions   messages -> chat template -> generate      (stream or not)
    POST /v1/completions        prompt text or token ids -> generate         (stream or not)
    GET  /v1/models, /v1/models/{id}, /health, /openapi.json

Routes are thin: pydantic checks the body (openai_protocol.py), the template and tokenizer run on
a worker thread (a long prompt never holds up the event loop, which is writing other streams),
and the request goes to the gateway's queue (gateway.py), whose one engine thread sends the
answer back to the loop piece by piece. A caller that hangs up, streaming or not, cancels its
request: it stops at its next token, or is skipped if it was still waiting. Every error is
answered in OpenAI's format by the handlers below; what is refused before a route (malformed
HTTP, size and time limits, the API key) is in http_limits.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .admin_api import add_admin_routes
from .control_page import add_control_routes
from .gateway import ApiError, Gateway, Outcome, chat_request, completion_request
from .gateway import Request as GatewayRequest
from .http_limits import AccessLog, ApiKey, BodyLimit, JsonBody, NoStore, limited_protocol, note, printable
from .openai_protocol import (
    REQUEST_MODELS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelList,
    ModelObject,
    describe_validation_error,
)
from .scheduler import Job, JobEvent, Scheduler

MAX_BODY = 8 << 20  # bytes of one request body
IDLE_TIMEOUT_S = 5  # a kept-alive connection with no request in flight is closed after this
SHUTDOWN_GRACE_S = 10  # for running answers to end after SIGTERM (the running request stops at its next token)
KEEPALIVE_S = 2.0  # an SSE comment when no text came for this long (queued, or a slow step): shows it is alive
SEND_TIMEOUT_S = 60.0  # a streaming caller that stops reading for this long is dropped (and its request cancelled)
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in [
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (408, "request too slow"),
        (413, "body too large"),
        (429, "queue full"),
        (503, "engine unavailable, shutting down, or too many connections"),
    ]
}


class JSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting the caller's text always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSON:
    if e.status in (429, 503):
        headers = {**(headers or {}), "Retry-After": "1"}
    return JSON(e.body(), status_code=e.status, headers=headers)


def create_app(gateway: Gateway, scheduler: Scheduler, admin: bool = False) -> FastAPI:
    """The API; `admin`: the membership endpoints are enabled (admin_api.py; only with an API key)."""
    card = gateway.card
    # No telemetry: this process sees every prompt in the clear; nothing about requests leaves it.
    app = FastAPI(
        title="fusion serve",
        version="1",
        docs_url=None,
        redoc_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )

    def model_object() -> dict:
        return {"id": card.id, "object": "model", "created": card.created, "owned_by": "fusion-compute"}

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> JSON:
        s = scheduler
        status, why = s.health()
        body = {
            "status": status,
            "model": card.id,
            "workers": gateway.engine.plan.n,
            # the workers asked for, and removed in this job: a job running short says "N of M" (never silently)
            "workers_wanted": getattr(gateway.engine, "wanted", gateway.engine.plan.n),
            "removed": len(getattr(gateway.engine, "removed", ())),
            "plan": gateway.engine.plan.fingerprint(),
            "context": card.context,
            "running": s.running_requests,
            "waiting": s.waiting,
            "served": s.served,
            "recoveries": len(gateway.engine.recoveries),
        }
        if why:
            body["error"] = why
        return JSON(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        """Counters in Prometheus' text format, as vLLM's /metrics names them (prefix fusion:). With
        --api-key it needs the key (http_limits.ApiKey): speculation's counters tell how predictable
        the prompts were."""
        rows = [
            ("request_success", "counter", "requests answered", scheduler.served),
            ("num_requests_running", "gauge", "requests decoding now", scheduler.running_requests),
            ("num_requests_waiting", "gauge", "requests queued", scheduler.waiting),
            ("recoveries", "counter", "epochs opened after a lost worker", len(gateway.engine.recoveries)),
        ]
        spec = gateway.speculator
        if spec is not None:
            t = spec.totals
            rows += [
                ("spec_decode_num_drafts", "counter", "verification steps that carried drafts", t.num_drafts),
                ("spec_decode_num_draft_tokens", "counter", "draft tokens proposed", t.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "counter", "draft tokens accepted", t.num_accepted_tokens),
            ]
        label = card.id.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # the format's escapes
        text = ""
        for name, kind, what, value in rows:
            full = f"fusion:{name}" + ("_total" if kind == "counter" else "")
            text += f'# HELP {full} {what}\n# TYPE {full} {kind}\n{full}{{model_name="{label}"}} {value}\n'
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models() -> JSON:
        return JSON({"object": "list", "data": [model_object()]})

    @app.get("/v1/models/{model_id:path}", response_model=ModelObject, responses=ERRORS)
    async def get_model(model_id: str) -> JSON:
        if model_id != card.id:
            raise ApiError(404, f"The model `{model_id}` does not exist", "model", "model_not_found")
        return JSON(model_object())

    streamed = {"text/event-stream": {"schema": {"type": "string"}}}

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses={200: {"content": streamed}, **ERRORS}
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        req = await run_in_threadpool(chat_request, body, card)
        return await answer(gateway, scheduler, req, request)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={200: {"content": streamed}, **ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        req = await run_in_threadpool(completion_request, body, card)
        return await answer(gateway, scheduler, req, request)

    add_admin_routes(app, gateway, scheduler, admin)
    add_control_routes(app, gateway, scheduler, admin)  # GET /control: the page (control_page.py)
    add_error_handlers(app)
    app.openapi = lambda: openapi_without_422(app)  # type: ignore[method-assign]
    return app


# ---- answers ----


async def answer(gateway: Gateway, scheduler: Scheduler, req: GatewayRequest, request: Request) -> Response:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[JobEvent] = asyncio.Queue()
    job = scheduler.submit(req, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    shape = Shape(gateway, req)
    if req.stream:
        return Stream(stream(shape, job, events, request), sep="\n", send_timeout=SEND_TIMEOUT_S)
    waiting = asyncio.ensure_future(_final(events))
    hangup = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not waiting.done():  # the caller hung up (or this task was cancelled): stop generating for it
            waiting.cancel()
            job.cancelled.set()
    if not waiting.done() or waiting.cancelled():
        note(request.scope, "client disconnected", 499)
        return Response(status_code=499)
    kind, value = waiting.result()
    if kind == "error":
        raise value
    out: Outcome = value
    note(request.scope, _summary(out))
    return JSON(shape.final(out))


class Stream(EventSourceResponse):
    """sse-starlette's response; a caller that stops reading is dropped as a hang-up, not a failure."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            note(scope, f"client stopped reading for {SEND_TIMEOUT_S:g} s", 499)


async def _final(events: asyncio.Queue[JobEvent]) -> JobEvent:
    while True:
        event = await events.get()
        if event[0] in ("done", "error"):
            return event


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream(shape: Shape, job: Job, events: asyncio.Queue[JobEvent], request: Request) -> AsyncIterator[dict]:
    """Server-sent events: a first chunk with the role (chat), one per piece of text, a final one
    with finish_reason and `fusion`, optionally usage, then [DONE]. Bounded: the engine thread
    ends every job with done or error."""
    ended = False
    try:
        if job.request.kind == "chat":
            yield {"data": json.dumps(shape.chunk(None, None, first=True))}
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), KEEPALIVE_S)
            except TimeoutError:
                yield {"comment": "waiting"}
                continue
            if kind == "delta":
                yield {"data": json.dumps(shape.chunk(value, None))}
                continue
            if kind == "done":
                out: Outcome = value
                final = shape.chunk(None, _finish(out), fusion=shape.fusion(out))
                yield {"data": json.dumps(final)}
                if job.request.include_usage:
                    yield {"data": json.dumps(shape.usage_chunk(out))}
                note(request.scope, "stream " + _summary(out))
            else:
                yield {"data": json.dumps(value.body())}
                note(request.scope, f"stream {value.message}", value.status)
            break
        yield {"data": "[DONE]"}
        ended = True
    finally:
        if not ended:  # the caller hung up (or stopped reading): stop generating for it
            job.cancelled.set()
            note(request.scope, "client disconnected", 499)


def _finish(out: Outcome) -> str:
    """OpenAI's finish_reason; an answer cut short (the server stopping, or its caller gone) says
    "abort", vLLM's word for it, never "stop", which a caller would take for the model's own end."""
    return "abort" if out.finish_reason == "cancelled" else out.finish_reason


def _summary(out: Outcome) -> str:
    return f"prompt={out.prompt_tokens} completion={out.completion_tokens} queue={out.timing['queue_s']:.2f}s"


class Shape:
    """OpenAI's response objects for one request."""

    def __init__(self, gateway: Gateway, req: GatewayRequest):
        self.gateway, self.req = gateway, req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self.final_object = "chat.completion" if self.chat else "text_completion"
        self.model, self.fp = gateway.card.id, "fusion-" + gateway.fingerprint

    def head(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fp,
        }

    def fusion(self, out: Outcome) -> dict:
        return {**self.gateway.protection(out), "timing": out.timing}

    def final(self, out: Outcome) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None,
                "finish_reason": _finish(out),
            }
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": _finish(out)}
        return {**self.head(self.final_object), "choices": [choice], "usage": out.usage(), "fusion": self.fusion(out)}

    def chunk(self, delta: str | None, finish: str | None, first: bool = False, fusion: dict | None = None) -> dict:
        if self.chat:
            d: dict = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        out = {**self.head(self.chunk_object), "choices": [choice]}
        if fusion is not None:
            out["fusion"] = fusion
        return out

    def usage_chunk(self, out: Outcome) -> dict:
        return {**self.head(self.chunk_object), "choices": [], "usage": out.usage(), "fusion": self.fusion(out)}


# ---- errors ----


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSON:
        note(request.scope, e.message)
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSON:
        message, param = describe_validation_error(e.errors())
        note(request.scope, message)
        return error_response(ApiError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSON:
        error = _from_http_exception(request, e)
        note(request.scope, error.message)
        return error_response(error, dict(e.headers or {}))

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception) -> JSON:  # the traceback is logged by uvicorn: it is ours to fix
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error"))


def _from_http_exception(request: Request, e: HTTPException) -> ApiError:
    path = printable(request.url.path)[:200]
    if e.status_code == 404:
        return ApiError(404, f"no route {path}", code="not_found")
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return ApiError(405, f"{request.method} is not supported for {path}" + (f"; use {allowed}" if allowed else ""))
    if e.status_code == 400 and isinstance(e.__cause__, ClientDisconnect):
        return ApiError(400, "the connection closed before the whole body came")
    if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not parse the body as JSON
        cause = e.__cause__
        why = "it is nested too deeply" if isinstance(cause, RecursionError) else str(cause).split("\n")[0][:200]
        return ApiError(400, f"the body is not valid JSON: {why}")
    kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
    return ApiError(e.status_code, str(e.detail), kind=kind)


def openapi_without_422(app: FastAPI) -> dict:
    """FastAPI's schema, corrected: validation failures are answered 400 (as OpenAI does), not
    422; and the request models' bounds are pydantic's exact integers (FastAPI's OpenAPI model
    turns `maximum: 2**63 - 1` into the float 2**63)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, exact = models_json_schema(
            [(m, "validation") for m in REQUEST_MODELS], ref_template="#/components/schemas/{model}"
        )
        schema["components"]["schemas"].update(exact["$defs"])
        for operations in schema.get("paths", {}).values():
            for op in operations.values():
                op.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


# ---- serving ----


def wrap(app: Any, api_key: str | None, log: Callable[[str], None], timeout_s: float) -> Any:
    """The FastAPI app behind the request-level limits; `timeout_s` bounds the arrival of a body."""
    return AccessLog(NoStore(ApiKey(BodyLimit(JsonBody(app), MAX_BODY, timeout_s), api_key)), log)


class _LogLines(logging.Handler):
    """uvicorn's and asyncio's warnings as `fusion serve:` lines (escaped, like every log line)."""

    def __init__(self, log: Callable[[str], None]):
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:  # a bug of ours: keep the traceback, one escaped line per line
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        for line in text.splitlines():
            self.log(f"fusion serve: {record.name}: {line}")


def forward_logs(log: Callable[[str], None]) -> None:
    # uvicorn's warnings (an upgrade it does not support, malformed HTTP) are logged by http_limits in
    # this server's words; its errors (an exception in the app: a bug of ours) are kept.
    for name, level in (("uvicorn", logging.ERROR), ("asyncio", logging.WARNING), ("sse_starlette", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.handlers = [_LogLines(log)]
        logger.setLevel(level)
        logger.propagate = False


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Any:
        # Signals are ours (run_http): uvicorn would re-raise SIGTERM after shutting down, and the
        # process would then die by it instead of closing the workers and exiting 0.
        yield


def run_http(
    sock: socket.socket,
    app: Any,
    max_connections: int,
    on_stop: Callable[[], None],
    log: Callable[[str], None],
    timeout_s: float,
    api_key: str | None = None,
) -> None:
    """Serve `app` on the bound `sock` until SIGTERM or SIGINT; `on_stop` is called first thing then.
    `timeout_s` bounds the arrival of a request's headers; `api_key` lets a keyed request past the
    per-peer connection cap (http_limits.LimitedH11)."""
    config = uvicorn.Config(
        app,
        http=limited_protocol(max_connections, timeout_s, log, api_key=api_key),
        interface="asgi3",
        lifespan="off",
        ws="none",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        headers=[("server", "fusion-serve")],
        timeout_keep_alive=IDLE_TIMEOUT_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = _Server(config)
    forward_logs(log)

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            if server.should_exit:
                server.force_exit = True  # a second signal: stop waiting for answers to end
                return
            log("fusion serve: shutting down")
            on_stop()
            server.should_exit = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        await server.serve(sockets=[sock])

    asyncio.run(main())
