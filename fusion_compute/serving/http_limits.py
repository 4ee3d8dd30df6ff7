"""What `fusion serve` refuses before a request reaches a route, every refusal in OpenAI's error
format: malformed HTTP (400), headers or a body that take too long to arrive (408), a body over the
limit (413), a missing or wrong API key (401), more open connections than allowed, in all or from
one peer (503).

    connection  ─ LimitedH11 (uvicorn's h11 protocol): connection caps, header timeout, JSON 400s
    request     ─ AccessLog ─ NoStore ─ ApiKey ─ BodyLimit ─ JsonBody ─ the FastAPI app (api_server.py)

uvicorn's h11 protocol is used, not httptools: h11 is strict about framing (conflicting
Content-Length, both Content-Length and chunked, bad chunk sizes are all refused and the
connection closed, so a request can never be read as two). What it lacks for a port others can
reach is added here by subclassing it: uvicorn answers malformed HTTP in plain text, has no
timeout for headers that trickle in, and its connection limit answers in plain text too.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..comm.peer_text import printable as printable  # re-exported: a caller's text cannot forge a log line
from .gateway import ApiError

Scope = MutableMapping[str, Any]  # as starlette.types.Scope
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]
App = Callable[[Scope, Receive, Send], Any]

MIN_PER_PEER = 16  # connections from one address that are always allowed (up to the global cap)
OVER_SHARE_S = 2.0  # a connection over its peer's share has this long to send its (keyed) request's headers
LOG_NOTE = "fusion.log"  # scope key: a dict where routes leave `extra` (text) and `status` for AccessLog


def error_bytes(error: ApiError) -> bytes:
    # ensure_ascii: a message may quote the caller's text, which is then escaped, never re-encoded.
    return json.dumps(error.body(), ensure_ascii=True).encode()


async def send_error(send: Send, error: ApiError, close: bool = False, headers: dict[str, str] | None = None) -> None:
    """An error answer over ASGI, for the layers below FastAPI."""
    body = error_bytes(error)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ---- the connection ----


class LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with connection caps, a header timeout and JSON error bodies.
    Set the class attributes on a subclass (`limited_protocol`); uvicorn makes one per connection.

    Two caps. In all, `max_connections`; from one peer (one IP address), `max_per_peer`, so that one
    peer's idle connections cannot take the whole budget and leave everyone else 503 (/health
    included). A connection over either is answered 503, unless its request carries the API key
    (`api_key`: a keyed caller is the user, who must be able to reach /admin to revoke a worker
    during a flood from many addresses too). It counts in neither cap (it cannot fill the budget
    either) and has OVER_SHARE_S, not the header timeout, to send its request's headers. Refusals
    are logged through the server's LogThrottle: one line a second per kind, with a count."""

    max_connections = 256
    max_per_peer = 32
    api_key: str | None = None
    header_timeout_s = 30.0
    log: Callable[[str], None] = staticmethod(lambda line: None)
    throttle: LogThrottle | None = None  # one per server (limited_protocol): repeated lines summed up

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._header_timer: Any = None
        self.over_share = False  # over a cap: counted in neither cap, and given OVER_SHARE_S
        within = [c for c in self.connections if not getattr(c, "over_share", False)]
        keyed = "503 unless keyed" if self.api_key else "503"
        if len(within) > self.max_connections or (
            self.client and sum(1 for c in within if _peer(c) == self.client[0]) > self.max_per_peer
        ):
            which = "in all" if len(within) > self.max_connections else "per peer"
            cap = self.max_connections if which == "in all" else self.max_per_peer
            # The key holder is never locked out by the caps: a connection over either cap is read (it
            # has OVER_SHARE_S for its headers, and counts in neither cap: what a flood of them holds is
            # bounded by its rate x OVER_SHARE_S) and served when its request carries the key, else
            # answered 503 (docs/security.md, "fusion serve's port").
            self.over_share = True
            self.app = _KeyedOnly(self.app, self.api_key, "from this address" if which == "per peer" else "")
            self._log_once(f"over {which}", f"connection from {self._peer()} over the limit of {cap} {which}: {keyed}")
        self._arm_header_timer()

    def _log_once(self, kind: str, line: str) -> None:
        """`line` under `kind`, through the server's throttle: a flood of the same refusal costs a
        line a second, with the count of those left out."""
        if self.throttle is None:
            self.log(f"fusion serve: {line}")
        else:
            self.throttle.say(kind, f"fusion serve: {line}", self.log)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in (or were refused)
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # for the next request on this kept-alive connection

    def send_400_response(self, msg: str) -> None:
        self._log_once("malformed", f"malformed HTTP from {self._peer()}: 400")
        self._answer_and_close(ApiError(400, "malformed HTTP request (not valid HTTP/1.1, or headers over the limit)"))

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        wait = min(self.header_timeout_s, OVER_SHARE_S) if self.over_share else self.header_timeout_s
        self._header_timer = self.loop.call_later(wait, self._header_timeout, wait)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _header_timeout(self, wait: float) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a request came, and not all of its headers
            self._log_once("slow headers", f"headers from {self._peer()} too slow: 408")
            self._answer_and_close(
                ApiError(408, f"the request headers did not arrive within {wait:g} s")  # (OVER_SHARE_S over the share)
            )
        else:
            self.transport.close()

    def _answer_and_close(self, error: ApiError) -> None:
        # Written directly: h11 will not send a response to a request it never saw whole.
        body = error_bytes(error)
        reason = {400: "Bad Request", 408: "Request Timeout"}.get(error.status, "Error")
        head = (
            f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


class LogThrottle:
    """Repeated log lines of one kind, rate-limited: at most one per `every_s` seconds per kind; the
    next one that is written says how many were left out since (a flood of 3,000 refused
    connections wrote 3,042 lines in 2.9 s before)."""

    def __init__(self, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def say(self, kind: str, line: str, log: Callable[[str], None]) -> bool:
        """Write `line` unless a line of `kind` was written less than `every_s` ago; True if written."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return False
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        log(
            line
            + (f" (and {skipped} more like it in the last {now - last:.1f} s)" if skipped and last is not None else "")
        )
        return True


def limited_protocol(
    max_connections: int,
    header_timeout_s: float,
    log: Callable[[str], None],
    max_per_peer: int | None = None,
    api_key: str | None = None,
) -> type[LimitedH11]:
    """`max_per_peer`: by default an eighth of `max_connections`, but never under MIN_PER_PEER (a
    browser or a client library opens several at once; a small budget is then not split)."""
    limits = {
        "max_connections": max_connections,
        "max_per_peer": max_per_peer if max_per_peer is not None else max(MIN_PER_PEER, max_connections // 8),
        "api_key": api_key,
        "header_timeout_s": header_timeout_s,
        "log": staticmethod(log),
        "throttle": LogThrottle(),
    }
    return type("GatewayH11", (LimitedH11,), limits)


class _KeyedOnly:
    """A connection over a cap (its peer's share, or the whole budget): its requests are answered 503
    and the connection closed, unless a request carries the API key (then it goes on, as any keyed
    request)."""

    def __init__(self, app: App, key: str | None, whose: str = "from this address"):
        self.app, self.expected = app, None if key is None else b"Bearer " + key.encode()
        self.whose = whose

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected is not None:
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if hmac.compare_digest(given, self.expected):
                return await self.app(scope, receive, send)
        error = ApiError(
            503,
            f"too many open connections{' ' + self.whose if self.whose else ''}; retry later",
            code="too_many_connections",
            kind="server_error",
        )
        await send_error(send, error, close=True, headers={"Retry-After": "1"})


# ---- the request ----


class AccessLog:
    """One line per request: method, path, status, duration, and what the route noted."""

    def __init__(self, app: App, log: Callable[[str], None]):
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        note: dict[str, Any] = {}
        scope[LOG_NOTE] = note
        status = 0

        async def send_noting(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        finally:
            path = scope.get("raw_path", b"").decode("latin-1") or scope.get("path", "")
            if scope.get("query_string"):  # (never a credential: ApiKey refused it and asked it left out)
                path += (
                    "?(left out: it held a key)"
                    if note.get("redact_query")
                    else "?" + scope["query_string"].decode("latin-1")
                )
            extra = f" {note['extra']}" if note.get("extra") else ""
            self.log(
                f"fusion serve: {scope['method']} {path[:200]} {note.get('status', status or 500)} "
                f"{time.perf_counter() - t0:.2f}s{extra}"
            )


def _peer(conn: object) -> str | None:
    """The IP address a connection in uvicorn's set comes from (the set is typed as any of uvicorn's
    protocols, not all of which declare `client`; ours, an H11Protocol, does), or None."""
    client = getattr(conn, "client", None)
    return client[0] if client else None


def note(scope: Scope, extra: str, status: int | None = None) -> None:
    """Leave `extra` (and a status that overrides the one sent, e.g. 499) for the request's log line."""
    slot = scope.get(LOG_NOTE)
    if slot is not None:
        slot["extra"] = extra[:160]
        if status is not None:
            slot["status"] = status


class NoStore:
    """Every answer under /admin and /control (errors too, the 401 of ApiKey among them) says
    `Cache-Control: no-store`: the participants, their keys and addresses stay out of every cache."""

    def __init__(self, app: App):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not any(path == p or path.startswith(p + "/") for p in ("/admin", "/control")):
            return await self.app(scope, receive, send)

        async def send_no_store(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"cache-control"]
                message = {**message, "headers": [*headers, (b"cache-control", b"no-store")]}
            await send(message)

        await self.app(scope, receive, send_no_store)


class ApiKey:
    """With --api-key, every /v1 and /admin path and /metrics need `Authorization: Bearer KEY`,
    checked before the body is read, in constant time (hmac.compare_digest on bytes). /health and
    /openapi.json stay open (/metrics counts how predictable each prompt was: speculation's drafts
    and accepted tokens, so it is the key holder's)."""

    def __init__(self, app: App, key: str | None):
        self.app = app
        self.expected = None if key is None else b"Bearer " + key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _key_in_query(scope, self.expected):
            slot = scope.get(LOG_NOTE)
            if slot is not None:
                slot["redact_query"] = True  # the access log leaves the query out
            error = ApiError(
                400,
                "a key in the URL is refused (it lands in logs and histories): send Authorization: Bearer KEY",
                code="key_in_query",
            )
            note(scope, error.message)
            return await send_error(send, error)
        if scope["type"] == "http" and self.expected is not None and _under_v1(scope.get("path", "")):
            given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")
                note(scope, error.message)
                return await send_error(send, error)
        await self.app(scope, receive, send)


CREDENTIAL_PARAMS = frozenset({"key", "api_key", "apikey", "api-key", "token", "access_token", "auth", "authorization"})


def _key_in_query(scope: Scope, expected: bytes | None) -> bool:
    """A credential in the query string: a parameter named like one (CREDENTIAL_PARAMS, any case),
    or the server's own key anywhere in it (raw or percent-encoded)."""
    raw = scope.get("query_string") or b""
    if not raw:
        return False
    from urllib.parse import parse_qsl, unquote_to_bytes

    names = {k.strip().lower() for k, _ in parse_qsl(raw.decode("latin-1"), keep_blank_values=True)}
    if names & CREDENTIAL_PARAMS:
        return True
    key = expected[len(b"Bearer ") :] if expected else b""
    return bool(key) and (key in raw or key in unquote_to_bytes(raw))


def _under_v1(path: str) -> bool:
    return path == "/metrics" or any(path == p or path.startswith(p + "/") for p in ("/v1", "/admin"))


class JsonBody:
    """Every request body is read as JSON, whatever its Content-Type says: `curl -d` sends
    form-encoded, and the API has no other kind of body."""

    def __init__(self, app: App):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
            scope["headers"] = [*headers, (b"content-type", b"application/json")]
        await self.app(scope, receive, send)


class BodyLimit:
    """A body over `max_bytes` is refused with 413: by its declared Content-Length before a byte of
    it is read, or as soon as a chunked one goes over. A body must also arrive within `timeout_s`
    (408). Either way the connection is closed, since the rest of the body is not read."""

    def __init__(self, app: App, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        if b"content-length" in headers and b"transfer-encoding" in headers:  # RFC 9112 6.1: a smuggling attempt
            error = ApiError(400, "Content-Length and Transfer-Encoding together are refused")
            note(scope, error.message)
            return await send_error(send, error, close=True)
        declared = headers.get(b"content-length")
        if declared is not None and (len(declared) > 18 or int(declared) > self.max_bytes):  # h11 checked: digits
            error = self._too_large()
            note(scope, error.message)
            return await send_error(send, error, close=True)
        deadline = time.monotonic() + self.timeout_s
        size = 0
        complete = False

        async def receive_limited() -> dict[str, Any]:
            nonlocal size, complete
            if complete:  # after the body only a disconnect can come: wait for it as long as it takes
                return await receive()
            try:
                with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                # An HTTPException passes through FastAPI's body parsing to the app's handler.
                raise HTTPException(
                    408, f"the request body did not arrive within {self.timeout_s:g} s", headers={"Connection": "close"}
                ) from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    raise HTTPException(413, self._too_large().message, headers={"Connection": "close"})
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, receive_limited, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is over the limit of {self.max_bytes} bytes")
