"""`fusion serve`: an OpenAI-compatible HTTP gateway, on the user side.

The gateway *is* the client role (DESIGN.md §2): tokenizer, chat template, embedding, LM head and
sampling run in this process; the workers see embedding shards only, exactly as with
`fusion generate`. Text and token ids never leave this machine except in the HTTP answer to the
caller, which is why it binds 127.0.0.1 unless told otherwise.

    POST /v1/chat/completions   messages -> chat template -> generate      (stream or not)
    POST /v1/completions        prompt text or token ids -> generate         (stream or not)
    GET  /v1/models, /v1/models/{id}, /health

One engine runs one session at a time (the workers hold one KV cache), so requests are queued,
first come first served, by a single engine thread; HTTP handling is threaded, so queued callers
are answered as soon as their turn ends. Concurrency therefore adds waiting time, not throughput:
docs/serving.md has the measured numbers.

Every response carries a `fusion` object: workers, steps run, plan fingerprint, per-request timing,
and `audit` — whether the audit verified this request (it says `checked: false` and why when not).
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sampling import SamplingParams

MAX_BODY = 8 << 20  # bytes of one request body
MAX_STOP = 4  # stop sequences per request, as OpenAI
DEFAULT_MAX_TOKENS = 256  # when the request names none (capped by the context window)
DEFAULT_MAX_QUEUE = 64  # waiting requests before 429
KEEPALIVE_S = 2.0  # SSE comment while a streamed request waits: shows progress, detects hang-ups
# Per-request audit status. The audit (fusion_compute/audit/) verifies the hash-chained logs of a
# finished run (`fusion audit run` / `verify`): its verifier needs every log closed with an end
# record, so it cannot certify one request of a live server. We say so instead of claiming it.
AUDIT_UNCHECKED = {
    "checked": False,
    "reason": "not verified per request: the audit verifier (fusion audit verify) checks the closed logs of a "
    "finished run, not one session of a live server; `split` states the plan's layout, not an observed result",
}


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        kind: str = "invalid_request_error",
    ):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# ---- requests ----


@dataclass(frozen=True)
class ModelCard:
    """What the gateway serves: the name callers use and the limits requests are checked against."""

    id: str
    tokenizer: Any
    context: int
    vocab: int
    eos_ids: tuple[int, ...]
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise _bad(f"{key} must be a number, got {json.dumps(v)}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        lo_s = f"({lo:g}" if lo_open else f"[{lo:g}"
        raise _bad(f"{key} must be in {lo_s}, {hi:g}], got {v}", key)
    return float(v)


def _int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key} must be an integer, got {json.dumps(v)}", key)
    return v


def _unsupported(body: dict) -> None:
    """Parameters we cannot honour are refused, not silently ignored."""
    if body.get("n", 1) != 1:
        raise _bad("only n = 1 is supported", "n")
    if body.get("best_of", 1) not in (1, None):
        raise _bad("only best_of = 1 is supported", "best_of")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(f"{key} is not supported (only 0)", key)
    if body.get("logit_bias"):
        raise _bad("logit_bias is not supported", "logit_bias")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _bad("logprobs are not supported", "logprobs")
    for key in ("tools", "functions"):
        if body.get(key):
            raise _bad(f"{key} (function calling) is not supported", key)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("only response_format {type: text} is supported", "response_format")
    if body.get("echo"):
        raise _bad("echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise _bad("suffix is not supported", "suffix")


def _check_model(body: dict, card: ModelCard) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required (GET /v1/models lists it)", "model")
    if model != card.id:
        raise ApiError(
            404, f"The model `{model}` does not exist (this server serves `{card.id}`)", "model", "model_not_found"
        )


def _common(body: dict, card: ModelCard, kind: str, prompt_ids: list[int]) -> Request:
    from .generate import InputError, check_prompt
    from .sampling import SamplingError, SamplingParams

    _unsupported(body)
    # Default greedy (like `fusion generate`), not OpenAI's 1.0: the same question gets the same answer.
    temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k") or 0  # extension (vLLM, llama.cpp): 0 = off
    if top_k < 0:
        raise _bad(f"top_k must be >= 0, got {top_k}", "top_k")
    seed = _int(body, "seed")
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except SamplingError as e:
        raise _bad(str(e)) from None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = _int(body, key)
    if requested is not None and requested < 1:
        raise _bad(f"{key} must be >= 1, got {requested}", key)
    n_prompt = len(prompt_ids)
    try:
        check_prompt(prompt_ids, card.vocab, card.context, 1)
    except InputError as e:
        code = "context_length_exceeded" if "context window" in str(e) else None
        raise _bad(str(e), "messages" if kind == "chat" else "prompt", code) from None
    room = card.context - n_prompt
    if requested is not None and requested > room:
        raise _bad(
            f"this model's context window is {card.context} tokens; the prompt has {n_prompt} and "
            f"{key} = {requested} asks for more than the {room} left",
            key, "context_length_exceeded",
        )  # fmt: skip
    max_tokens = requested if requested is not None else min(card.default_max_tokens, room)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise _bad(f"stop takes 1 to {MAX_STOP} non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise _bad("stream_options needs stream = true and must be an object", "stream_options")
    include_usage = bool(opts and opts.get("include_usage"))
    return Request(kind, prompt_ids, max_tokens, sampling, stops, stream, include_usage)


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: Any, card: ModelCard) -> Request:
    """A /v1/chat/completions body -> Request, or ApiError (4xx)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _check_model(body, card)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content}", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for system instructions
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise _bad(
                f"messages[{i}].role must be system, user or assistant, got {json.dumps(role)}", f"messages[{i}].role"
            )
        chat.append({"role": role, "content": _content_text(m.get("content"), i)})
    tok = card.tokenizer
    try:
        ids = tok.chat_ids(chat)
    except Exception as e:  # the template is the model's code: it may refuse roles or orders
        raise _bad(f"the model's chat template rejected the messages: {e}", "messages") from None
    return _common(body, card, "chat", ids)


def parse_completion(body: Any, card: ModelCard) -> Request:
    """A /v1/completions body -> Request. prompt: a string, or token ids (one prompt only)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _check_model(body, card)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # ["text"] or [[1, 2, 3]]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("empty prompt", "prompt")
        ids = card.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise _bad("empty prompt", "prompt")
    else:
        raise _bad("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    return _common(body, card, "completion", ids)


# ---- generation ----


class StopMatcher:
    """Cuts generated text at the first stop sequence. Streaming-safe: text that could be the
    start of a stop sequence is held back until it is known not to be one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """New text in; the text now safe to emit out. After a match, `stopped` is True."""
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)]
        hold = 0  # longest suffix of text that is a proper prefix of a stop sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


@dataclass
class Outcome:
    text: str
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    steps: int
    timing: dict

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Gateway:
    """The client role behind the API: one engine, its tokenizer, one request at a time."""

    def __init__(self, engine: Any, card: ModelCard):
        self.engine = engine
        self.card = card
        self.n_workers = engine.plan.n
        self.fingerprint = engine.plan.fingerprint()
        self.masked = getattr(engine.plan, "n_a", None) is not None  # masked.plan.MaskedPlan

    def run(self, req: Request, emit: Callable[[str], None], cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        """Generate for `req` in a fresh session; `emit(text)` gets each new piece of the answer."""
        from .generate import generate

        eos = set(self.card.eos_ids)
        stream = self.card.tokenizer.stream(skip_special=True)
        matcher = StopMatcher(req.stop)
        parts: list[str] = []
        state = {"cancelled": False}

        def out(text: str) -> None:
            if text:
                parts.append(text)
                emit(text)

        def on_token(tok: int) -> bool:
            if tok not in eos:
                out(matcher.push(stream.push(tok)))
            if cancelled():
                state["cancelled"] = True
                return True
            return matcher.stopped

        t0 = time.perf_counter()
        res = generate(
            self.engine, req.prompt_ids, max_new_tokens=req.max_tokens, sampling=req.sampling,
            stop_ids=eos, on_token=on_token,
        )  # fmt: skip
        if not matcher.stopped:
            out(matcher.push(stream.flush()))
            out(matcher.flush())
        finish = "cancelled" if state["cancelled"] else ("stop" if matcher.stopped else res.finish_reason)
        return Outcome(
            text="".join(parts),
            finish_reason=finish,
            prompt_tokens=res.prompt_tokens,
            completion_tokens=len(res.token_ids),
            steps=res.steps,
            timing={
                "run_s": round(time.perf_counter() - t0, 4),
                "ttft_s": round(res.ttft_s, 4),
                "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
            },
        )

    def protection(self, outcome: Outcome | None) -> dict:
        """The `fusion` extension object: what was protected for this request."""
        n = self.n_workers
        if self.masked:
            p = self.engine.plan
            return {
                "mode": "masked",
                "workers": n,
                "groups": [p.n_a, p.n_b],
                "steps": outcome.steps if outcome else 0,
                "plan": self.fingerprint,
                "protected": ["residual", "qkv", "mlp_activations", "kv_cache"],
                "split": (
                    "by the protocol, group A receives only one-time-pad-masked ring elements, group B only "
                    "the mask key; the client alone holds clear values (assumes A and B do not collude)"
                ),
                "audit": dict(AUDIT_UNCHECKED),
            }
        return {
            "mode": "structural",
            "workers": n,
            "steps": outcome.steps if outcome else 0,
            "plan": self.fingerprint,
            "protected": ["residual", "qkv", "mlp_activations", "kv_cache"],
            "split": (
                f"by the plan, each of the {n} workers holds only its own shard of these, at every layer, "
                "for prefill and every decode step"
                if n > 1
                else "one worker holds everything (N = 1: nothing is split)"
            ),
            "audit": dict(AUDIT_UNCHECKED),
        }


# ---- the queue ----


@dataclass
class Job:
    req: Request
    events: queue.Queue = field(default_factory=queue.Queue)  # ("delta", str) | ("done", Outcome) | ("error", ApiError)
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_enqueued: float = field(default_factory=time.perf_counter)
    t_started: float | None = None
    ahead: int = 0  # requests ahead of it when it arrived (waiting, plus the running one)


class Scheduler:
    """FIFO: handler threads enqueue, one engine thread runs jobs in order."""

    def __init__(self, gateway: Gateway, max_queue: int = DEFAULT_MAX_QUEUE, log: Callable[[str], None] = print):
        self.gateway = gateway
        self.max_queue = max_queue
        self.log = log
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = False
        self.broken: str | None = None
        self.stopping = False
        self.served = 0
        self._thread = threading.Thread(target=self._loop, name="fusion-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> Job:
        with self._lock:
            if self.broken or self.stopping:
                raise ApiError(503, f"the engine is unavailable: {self.broken or 'shutting down'}", kind="server_error")
            if self.waiting >= self.max_queue:
                raise ApiError(429, f"{self.waiting} requests are already waiting; retry later", code="queue_full",
                               kind="rate_limit_error")  # fmt: skip
            job = Job(req, ahead=self.waiting + int(self.running))
            self.waiting += 1
            self._q.put(job)
        return job

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running = True
            try:
                if job.cancelled.is_set() or self.stopping or self.broken:
                    job.events.put(("error", ApiError(503, "cancelled before it started", kind="server_error")))
                    continue
                job.t_started = time.perf_counter()
                try:
                    out = self.gateway.run(
                        job.req,
                        lambda text, job=job: job.events.put(("delta", text)),
                        lambda job=job: job.cancelled.is_set() or self.stopping,
                    )
                    out.timing = {"queued_behind": job.ahead, "queue_s": round(job.t_started - job.t_enqueued, 4),
                                  **out.timing}  # fmt: skip
                    job.events.put(("done", out))
                    self.served += 1
                except Exception as e:  # the engine is gone (a worker vanished, a collective timed out)
                    self.broken = f"{type(e).__name__}: {e}".splitlines()[0]
                    self.log(f"fusion serve: engine failed: {self.broken}")
                    job.events.put(("error", ApiError(503, f"the engine failed: {self.broken}", kind="server_error")))
            finally:
                with self._lock:
                    self.running = False

    def close(self, wait_s: float = 30.0) -> None:
        """Stop: the running request ends at its next token, waiting ones get 503."""
        self.stopping = True
        self._q.put(None)
        self._thread.join(timeout=wait_s)
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.events.put(("error", ApiError(503, "the server is shutting down", kind="server_error")))


# ---- HTTP ----


class App:
    """Routes and response shapes; the handler class below only moves bytes."""

    def __init__(self, gateway: Gateway, scheduler: Scheduler, api_key: str | None = None, log=print):
        self.gateway = gateway
        self.card = gateway.card
        self.scheduler = scheduler
        self.api_key = api_key
        self.log = log

    def model_object(self) -> dict:
        return {"id": self.card.id, "object": "model", "created": self.card.created, "owned_by": "fusion-compute"}

    def health(self) -> tuple[int, dict]:
        s = self.scheduler
        body = {
            "status": "ok" if not s.broken else "error",
            "model": self.card.id,
            "workers": self.gateway.n_workers,
            "plan": self.gateway.fingerprint,
            "context": self.card.context,
            "running": s.running,
            "waiting": s.waiting,
            "served": s.served,
        }
        if s.broken:
            body["error"] = s.broken
        return (200 if not s.broken else 503), body


def _chunk_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def _final_object(req: Request, rid: str, created: int, model: str, fp: str, out: Outcome, fusion: dict) -> dict:
    finish = "stop" if out.finish_reason == "cancelled" else out.finish_reason
    if req.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {
        "id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp,
        "choices": [choice], "usage": out.usage(), "fusion": fusion,
    }  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for the openai client; streams use chunked encoding
    server_version = "fusion-serve"
    timeout = 300  # seconds a silent connection may idle before the thread lets it go

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # one line per request is written by _log_request instead

    def _log_request(self, status: int, t0: float, extra: str = "") -> None:
        self.app.log(f"fusion serve: {self.command} {self.path} {status} {time.perf_counter() - t0:.2f}s{extra}")

    # ---- plumbing ----

    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ApiError) -> None:
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        self._send_json(e.status, e.body(), headers)

    def _read_body(self) -> bytes:
        """The whole body, read before anything else: on a kept-alive connection an unread body
        would be taken for the next request. When it cannot be read, the connection is closed."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length")
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise _bad("bad Content-Length")
        if n > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"request body of {n} bytes is over the {MAX_BODY} byte limit")
        return self.rfile.read(n) if n > 0 else b""

    @staticmethod
    def _json(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the body is not valid JSON: {e}") from None

    def _authorized(self) -> bool:
        key = self.app.api_key
        return key is None or self.headers.get("Authorization", "") == f"Bearer {key}"

    # ---- verbs ----

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        t0 = time.perf_counter()
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path == "/health":
                status, body = self.app.health()
                self._send_json(status, body)
                return
            if not self._authorized():
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
            if path == "/v1/models":
                self._send_json(200, {"object": "list", "data": [self.app.model_object()]})
            elif path.startswith("/v1/models/"):
                if path[len("/v1/models/") :] != self.app.card.id:
                    raise ApiError(
                        404, f"The model `{path[len('/v1/models/') :]}` does not exist", "model", "model_not_found"
                    )
                self._send_json(200, self.app.model_object())
            elif path in ("/v1/chat/completions", "/v1/completions"):
                raise ApiError(405, f"use POST for {path}")
            else:
                raise ApiError(404, f"no route {path}", code="not_found")
        except ApiError as e:
            self._send_error(e)
            self._log_request(e.status, t0)

    def do_POST(self) -> None:  # noqa: N802
        t0 = time.perf_counter()
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            raw = self._read_body()
            if path not in ("/v1/chat/completions", "/v1/completions"):
                if path in ("/v1/models", "/health") or path.startswith("/v1/models/"):
                    raise ApiError(405, f"use GET for {path}")
                raise ApiError(404, f"no route {path}", code="not_found")
            if not self._authorized():
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
            body = self._json(raw)
            parse = parse_chat if path == "/v1/chat/completions" else parse_completion
            req = parse(body, self.app.card)
            job = self.app.scheduler.submit(req)
        except ApiError as e:
            self._send_error(e)
            self._log_request(e.status, t0, f" {e.message[:120]}")
            return
        if req.stream:
            self._stream(job, t0)
        else:
            self._complete(job, t0)

    def do_PUT(self) -> None:  # noqa: N802
        self.close_connection = True  # its body is not read
        self._send_error(ApiError(405, f"{self.command} is not supported"))

    do_DELETE = do_PATCH = do_PUT  # noqa: N815

    # ---- answers ----

    def _events(self, job: Job, on_idle: Callable[[], None] | None = None) -> Iterator[tuple[str, Any]]:
        """The job's events until it ends. Bounded: the engine thread always ends a job with done
        or error (generation is bounded by max_tokens and the context window)."""
        while True:
            try:
                ev = job.events.get(timeout=KEEPALIVE_S)
            except queue.Empty:
                if self.app.scheduler.broken and job.t_started is None:
                    yield "error", ApiError(503, "the engine is unavailable", kind="server_error")
                    return
                if on_idle is not None:
                    on_idle()
                continue
            yield ev
            if ev[0] in ("done", "error"):
                return

    def _complete(self, job: Job, t0: float) -> None:
        try:
            self._complete_inner(job, t0)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
            self._log_request(499, t0, " client disconnected")

    def _complete_inner(self, job: Job, t0: float) -> None:
        for kind, value in self._events(job):
            if kind == "done":
                out: Outcome = value
                fusion = {**self.app.gateway.protection(out), "timing": out.timing}
                rid = _chunk_id(job.req.kind)
                body = _final_object(job.req, rid, int(time.time()), self.app.card.id,
                                     "fusion-" + self.app.gateway.fingerprint, out, fusion)  # fmt: skip
                self._send_json(200, body)
                self._log_request(200, t0, f" prompt={out.prompt_tokens} completion={out.completion_tokens} "
                                           f"queue={out.timing['queue_s']:.2f}s")  # fmt: skip
            elif kind == "error":
                self._send_error(value)
                self._log_request(value.status, t0, f" {value.message[:120]}")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _sse(self, obj: dict | str) -> None:
        payload = obj if isinstance(obj, str) else json.dumps(obj)
        self._write_chunk(f"data: {payload}\n\n".encode())

    def _stream(self, job: Job, t0: float) -> None:
        req = job.req
        rid = _chunk_id(req.kind)
        created = int(time.time())
        model = self.app.card.id
        fp = "fusion-" + self.app.gateway.fingerprint
        obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict:
            if req.kind == "chat":
                d: dict = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": fp,
                    "choices": [choice]}  # fmt: skip

        def keepalive() -> None:
            self._write_chunk(b": waiting\n\n")

        status = 200
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if req.kind == "chat":
                self._sse(chunk(None, None, first=True))
            for kind, value in self._events(job, on_idle=keepalive):
                if kind == "delta":
                    self._sse(chunk(value, None))
                elif kind == "done":
                    out: Outcome = value
                    fusion = {**self.app.gateway.protection(out), "timing": out.timing}
                    final = chunk(None, "stop" if out.finish_reason == "cancelled" else out.finish_reason)
                    final["fusion"] = fusion
                    self._sse(final)
                    if req.include_usage:
                        self._sse({"id": rid, "object": obj, "created": created, "model": model,
                                   "system_fingerprint": fp, "choices": [], "usage": out.usage(), "fusion": fusion})  # fmt: skip
                    self._log_request(200, t0, f" stream prompt={out.prompt_tokens} completion={out.completion_tokens} "
                                               f"queue={out.timing['queue_s']:.2f}s")  # fmt: skip
                else:
                    status = value.status
                    self._sse(value.body())
                    self._log_request(status, t0, f" stream {value.message[:120]}")
            self._sse("[DONE]")
            self._write_chunk(b"")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            job.cancelled.set()  # the caller hung up: stop generating for it
            self.close_connection = True
            self._log_request(499, t0, " client disconnected")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], app: App | None):
        super().__init__(addr, Handler)
        self.app = app

    def handle_error(self, request: Any, client_address: Any) -> None:
        # One line, not socketserver's traceback: a caller's broken connection is not our failure.
        exc = sys.exc_info()[1]
        sys.stderr.write(f"fusion serve: connection from {client_address[0]}: {type(exc).__name__}: {exc}\n")


# ---- `fusion serve` ----


def model_id(path: Any) -> str:
    """The served model's name: the file (without .gguf) or directory name."""
    name = path.name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def open_gateway(a: Any, stderr: Any = None, always_log: bool = True) -> tuple[Gateway, Any]:
    """Engine + tokenizer + card from `fusion serve|chat` arguments (spawns or admits workers).
    Returns (gateway, topology or None). Bad arguments raise before any worker starts."""
    from .engine import effective_context
    from .errors import UsageError
    from .options import engine_options, tokenizer_for
    from .progress import is_tty, load_monitor, log_startup
    from .weights import open_weights, resolve_model_path

    stderr = stderr or sys.stderr
    masked = getattr(a, "mode", "structural") == "masked"
    opts = engine_options(a, masked=masked)
    max_tokens = getattr(a, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    path = resolve_model_path(a.model)
    src = open_weights(path)
    tok = tokenizer_for(path, src, needed=True)
    if tok is None:
        raise UsageError(f"{path}: no tokenizer, which serving text needs")
    context = effective_context(src.config.max_positions, a.context)
    if masked:
        from .masked.client import MaskedEngine

        engine = MaskedEngine(path, opts, source=src)
    else:
        from .client import Engine

        opts.progress = load_monitor(stderr)
        engine = Engine(path, opts, source=src)
        if always_log or is_tty(stderr):
            log_startup(engine, stderr, opts.topology)
    name = getattr(a, "served_model_name", None) or model_id(path)
    card = ModelCard(
        id=name, tokenizer=tok, context=context, vocab=src.config.vocab, eos_ids=tuple(tok.eos_ids),
        default_max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
    )  # fmt: skip
    return Gateway(engine, card), opts.topology


def add_parser(sub: Any, add_engine: Callable[[Any], None]) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP gateway (the client role) over sharded workers")
    add_engine(s)
    s.add_argument("--mode", choices=("structural", "masked"), default="structural",
                   help="masked: --workers A+B compute on one-time-pad-masked data (docs/masked.md)")  # fmt: skip
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    s.add_argument("--served-model-name", help="model id for the API (default: the model file or directory name)")
    s.add_argument(
        "--max-tokens", type=int, help=f"default max_tokens when a request names none (default {DEFAULT_MAX_TOKENS})"
    )
    s.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, help="waiting requests before 429 (default 64)")
    s.add_argument("--api-key", help="require Authorization: Bearer KEY (default: none, as befits 127.0.0.1)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: Any) -> int:
    from .errors import UsageError

    if not (0 <= a.port < 65536):
        raise UsageError(f"--port must be in 0..65535, got {a.port}")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {a.max_queue}")

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    # Bind first: a busy port fails in a second, not after the workers have loaded.
    try:
        server = Server((a.host, a.port), None)
    except OSError as e:
        raise UsageError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    try:
        gateway, _ = open_gateway(a)
    except BaseException:
        server.server_close()
        raise
    scheduler = Scheduler(gateway, a.max_queue, log)
    server.app = App(gateway, scheduler, a.api_key, log)
    host, port = server.server_address[:2]
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        log(f"fusion serve: warning: listening on {a.host}: anyone who can reach it reads the answers "
            "(no TLS" + ("" if a.api_key else ", no API key") + ")")  # fmt: skip
    log(f"fusion serve: listening on http://{host}:{port}/v1 (model {gateway.card.id}, {gateway.n_workers} workers)")

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        log("fusion serve: shutting down")
    finally:
        server.server_close()
        procs = gateway.engine.procs
        if procs is not None:
            procs.closing = True  # Ctrl-C reached the workers too: their exit is expected now
        scheduler.close()
        gateway.engine.close()
    return 0
