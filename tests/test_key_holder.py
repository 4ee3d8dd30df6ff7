"""The key holder is never locked out, and the key never lands in a log (issue 41 item 5).

Before: 320 idle connections from ten loopback addresses (32 each, every one within its address's
share) filled the whole budget (256) and the next connection was answered 503 whatever it carried,
so the user could not reach /admin to revoke a worker during the flood; 3,000 connect-and-close
attempts over the cap wrote 3,042 log lines in 2.9 s; a key sent as a query parameter landed in the
access log. Now a connection over either cap is read and served when its request carries the key
(it counts in neither cap and has 2 s for its headers), repeated refusal lines cost one line a
second with a count, and a key in the query string is refused (400) and left out of the log."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from fusion_compute.serving.http_limits import AccessLog, ApiKey, LogThrottle

KEY = "holder-key-41"


def test_repeated_log_lines_are_summed_up():
    now = [0.0]
    throttle = LogThrottle(every_s=1.0, clock=lambda: now[0])
    lines: list[str] = []
    for i in range(3000):
        now[0] = i * 0.001  # 3,000 refusals in 3 s
        throttle.say("over", f"refused {i}", lines.append)
        throttle.say("malformed", f"malformed {i}", lines.append)  # another kind: its own budget
    assert len(lines) == 6, lines  # one a second, per kind
    assert lines[0] == "refused 0" and lines[2].startswith("refused 1000 (and 999 more like it in the last 1.0 s)")
    # the negative control: a throttle that lets every line through would have written 6,000
    assert LogThrottle(every_s=0.0, clock=lambda: 0.0).say("x", "a", lines.append)


def _call(app, path: str, query: bytes, authorization: bytes | None = None) -> int:
    """One request through an ASGI app: its status."""
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": [(b"authorization", authorization)] if authorization else [],
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize(
    "query",
    [
        b"api_key=" + KEY.encode(),
        b"x=1&Token=abc",  # a credential's name, any value
        b"q=" + KEY.encode(),  # the server's own key under any name
        b"q=holder%2Dkey%2D41",  # percent-encoded
        b"KEY=nope",
    ],
)
def test_a_key_in_the_query_string_is_refused_and_left_out_of_the_log(query):
    logged: list[str] = []
    app = AccessLog(ApiKey(_ok, KEY), logged.append)
    status = _call(app, "/v1/models", query, b"Bearer " + KEY.encode())
    assert status == 400, query
    assert KEY not in logged[0] and "holder" not in logged[0] and "left out" in logged[0], logged
    # the negative control: an ordinary query passes and is logged as it came
    logged.clear()
    assert _call(app, "/v1/models", b"limit=3", b"Bearer " + KEY.encode()) == 200
    assert "/v1/models?limit=3 200" in logged[0]


# ---- a real server (slow) ----


@pytest.mark.slow
def test_the_key_holder_gets_in_when_the_whole_budget_is_taken(tmp_path):
    """`fusion serve --max-connections 32` (16 per address): 16 idle connections from each of two
    addresses and one more from a third take the whole budget. A caller from a fourth address gets
    503 without the key, and the key holder's /admin/workers answers 200; 500 connect-and-close
    attempts over the cap cost a few log lines, not 500."""
    from test_http_guards import _request
    from test_serve import build_chat_model, on_threads, start_server, stop_server

    model = build_chat_model(tmp_path / "m")
    keyfile = tmp_path / "api.key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    log = tmp_path / "serve.log"
    live = start_server(
        on_threads(model, "--api-key-file", str(keyfile), "--max-connections", "32"),
        log,
    )
    host, port = live.host, int(live.port)
    idle: list[socket.socket] = []
    try:
        for source, n in (("127.0.0.2", 16), ("127.0.0.3", 16), ("127.0.0.4", 1)):
            for _ in range(n):
                s = socket.socket()
                s.bind((source, 0))
                s.connect((host, port))
                idle.append(s)
        time.sleep(1.0)  # the server has accepted them all
        status, _, body = _request(host, port, "/health", source="127.0.0.5")
        assert status == 503 and "too many open connections; retry later" in body, (status, body)
        status, _, body = _request(host, port, "/admin/workers", KEY, source="127.0.0.5")
        assert status == 200 and '"workers"' in body, (status, body)  # before: 503 too_many_connections
        before = len(log.read_text().splitlines())
        for _ in range(500):
            with socket.create_connection((host, port)):
                pass
        time.sleep(0.5)
        added = len(log.read_text().splitlines()) - before
        assert added <= 10, log.read_text()[-2000:]  # measured: 1 (plus the summary) where it was 500
    finally:
        for s in idle:
            s.close()
        stop_server(live.proc)
    assert live.proc.returncode == 0, log.read_text()[-2000:]
