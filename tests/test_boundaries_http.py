"""The HTTP connection caps at their exact boundary connection (issue 47): uvicorn with `fusion serve`'s
protocol (http_limits.LimitedH11) and a trivial app, in a thread of this process, on 127.0.0.1; raw
keep-alive connections opened one after another. The connection that reaches a cap is served, the
next one is answered 503; one over its peer's share counts in neither cap. (The 300-connection
flood against a real `fusion serve` is tests/test_http_guards.py's, marked slow.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from fusion_compute.serving import http_limits
from fusion_compute.serving.http_limits import LimitedH11, limited_protocol

PER_PEER = "too many open connections from this address; retry later"
IN_ALL = "too many open connections; retry later"


async def hello(scope, receive, send) -> None:
    body = b'{"ok": true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(protocol: type[LimitedH11]) -> Iterator[tuple[str, int]]:
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(hello, http=protocol, lifespan="off", ws="none", log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive()


def connect(addr: tuple[str, int]) -> socket.socket:
    s = socket.create_connection(addr, timeout=5)
    return s


def ask(s: socket.socket) -> tuple[int, str]:
    """One keep-alive GET on `s`: (status, the error message or "")."""
    s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(v for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:]) if k.lower() == b"content-length")
    )
    while len(body) < length:
        body += s.recv(4096)
    status = int(head.split()[1])
    return status, "" if status == 200 else json.loads(body)["error"]["message"]


def test_the_default_share_is_an_eighth_but_never_under_the_minimum():
    assert limited_protocol(256, 30, print).max_per_peer == 32
    assert limited_protocol(1024, 30, print).max_per_peer == 128
    assert limited_protocol(64, 30, print).max_per_peer == http_limits.MIN_PER_PEER == 16
    assert limited_protocol(8, 30, print).max_per_peer == 16  # a small budget is not split
    assert limited_protocol(256, 30, print, max_per_peer=3).max_per_peer == 3


def test_the_peers_share_is_served_to_its_last_connection_and_refused_after():
    with serving(limited_protocol(100, 30, lambda line: None, max_per_peer=3)) as addr:
        held = [connect(addr) for _ in range(3)]
        try:
            assert [ask(s) for s in held] == [(200, "")] * 3  # the third: exactly the share
            over = connect(addr)
            assert ask(over) == (503, PER_PEER)
            over.close()
            # one of the share's closes: its seat is free again (once the server has seen the close)
            held.pop(0).close()
            deadline = time.monotonic() + 5
            while True:
                again = connect(addr)
                got = ask(again)
                if got == (200, "") or time.monotonic() > deadline:
                    break
                again.close()
            held.append(again)
            assert got == (200, "")
            assert ask(held[0]) == (200, "")  # and the kept-alive ones go on being served
        finally:
            for s in held:
                s.close()


def test_the_cap_in_all_is_served_to_its_last_connection_and_refused_after():
    with serving(limited_protocol(3, 30, lambda line: None, max_per_peer=10)) as addr:
        held = [connect(addr) for _ in range(3)]
        try:
            assert [ask(s) for s in held] == [(200, "")] * 3
            over = connect(addr)
            assert ask(over) == (503, IN_ALL)
            over.close()
        finally:
            for s in held:
                s.close()


def test_a_connection_over_its_share_counts_in_neither_cap():
    """Cap 3 in all, 2 per peer: two served; a third connection, over the share, stays open and
    silent; a fourth is over the share too (503 from this address), not over the cap in all, since
    the third does not count."""
    with serving(limited_protocol(3, 30, lambda line: None, max_per_peer=2)) as addr:
        held = [connect(addr) for _ in range(2)]
        try:
            assert [ask(s) for s in held] == [(200, "")] * 2
            held.append(connect(addr))  # over the share, silent (accepted before the next: in order)
            time.sleep(0.05)
            fourth = connect(addr)
            assert ask(fourth) == (503, PER_PEER)
            fourth.close()
            assert ask(held[2]) == (503, PER_PEER)
        finally:
            for s in held:
                s.close()


def test_a_connection_over_its_share_has_the_shorter_header_wait_and_is_told_so(monkeypatch):
    """Over its peer's share, a connection has OVER_SHARE_S (here 0.3 s), not the header timeout
    (30 s), to send its headers; the 408 says the wait it had (it said 30 s)."""
    monkeypatch.setattr(http_limits, "OVER_SHARE_S", 0.3)
    with serving(limited_protocol(100, 30, lambda line: None, max_per_peer=1)) as addr:
        first = connect(addr)
        try:
            assert ask(first) == (200, "")
            slow = connect(addr)
            t0 = time.monotonic()
            slow.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
            answer = b""
            while chunk := slow.recv(4096):
                answer += chunk
            assert time.monotonic() - t0 < 5  # measured 0.3 s
            assert answer.startswith(b"HTTP/1.1 408 ")
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"] == (
                "the request headers did not arrive within 0.3 s"
            )
            slow.close()
        finally:
            first.close()
