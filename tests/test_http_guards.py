"""What `fusion serve` keeps from whoever reaches its port without the key (issue 36 item 5, issue 38
item 8): /metrics behind the key; the key from a file or the environment, the command-line flag
still taken with a warning (any local user reads a command line); `Cache-Control: no-store` on every
/admin answer, errors too; the control page never framed; a per-peer cap on connections, so that one
peer's idle connections do not make /health 503 for everyone; the control page's URL at start-up."""

from __future__ import annotations

import argparse
import http.client
import re
import socket
import time

import pytest
from procs import run
from test_serve import on_threads, start_server, stop_server

from fusion_compute.cli.options import API_KEY_ENV, api_key
from fusion_compute.errors import UsageError

KEY = "guard-key-7"


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_the_key_from_a_file_the_environment_or_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    f = tmp_path / "key"
    f.write_text(f"{KEY}\n")
    f.chmod(0o600)
    assert api_key(_args(api_key_file=str(f)), "serve") == KEY  # its first line, stripped
    assert capsys.readouterr().err == ""
    assert api_key(_args(), "serve") is None  # no key anywhere: none
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(_args(), "serve") == "from-env"
    assert capsys.readouterr().err == ""
    assert api_key(_args(api_key_file=str(f)), "serve") == KEY  # a flag wins over the environment
    assert api_key(_args(api_key="on-the-line"), "serve") == "on-the-line"
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and "--api-key shows the key to every user of this machine (ps)" in warned[0]
    f.chmod(0o644)
    assert api_key(_args(api_key_file=str(f)), "chat") == KEY
    assert "readable by others (mode 644)" in capsys.readouterr().err
    for bad, why in [
        (_args(api_key="a", api_key_file=str(f)), "not both"),
        (_args(api_key_file=str(tmp_path / "none")), "not found"),
        (_args(api_key_file=str(tmp_path)), "is a directory"),
        (_args(api_key_file="/dev/zero"), "not a regular file"),
        (_args(api_key=""), "--api-key is empty"),
    ]:
        with pytest.raises(UsageError, match=why):
            api_key(bad, "serve")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UsageError, match="first line is empty"):
        api_key(_args(api_key_file=str(tmp_path / "empty")), "serve")


def test_the_flag_is_still_taken_and_warned_about():
    """The real command: the warning comes before anything else (here a refused value)."""
    r = run("serve", "--api-key", KEY, "--max-queue", "-1", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 2, r.stderr
    assert "warning: --api-key shows the key" in lines[0] and "error:" in lines[1]


def _request(host: str, port: int, path: str, key: str | None = None, source: str | None = None):
    conn = http.client.HTTPConnection(host, port, timeout=30, source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        conn.close()


@pytest.mark.slow
def test_a_served_job_keeps_its_counters_admin_answers_and_connections_guarded(tmp_path):
    from test_serve import build_chat_model

    model = build_chat_model(tmp_path / "m")
    keyfile = tmp_path / "api.key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    log = tmp_path / "serve.log"
    live = start_server(
        on_threads(model, "--api-key-file", str(keyfile)),
        log,
    )
    host, port = live.host, int(live.port)
    try:
        # the control page's address, printed at start-up, and no warning: the key came from a file
        deadline = time.monotonic() + 10
        while "control page" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert re.search(rf"fusion serve: control page: http://{host}:{port}/control", log.read_text())
        assert "warning" not in log.read_text()

        # /metrics: the key's (speculation's counters tell how predictable the prompts were)
        status, _, body = _request(host, port, "/metrics")
        assert status == 401 and "missing or wrong API key" in body
        status, _, body = _request(host, port, "/metrics", KEY)
        assert status == 200 and "fusion:request_success_total" in body
        assert _request(host, port, "/health")[0] == 200  # /health stays open

        # no-store on every /admin answer: refused, unknown, listed, the picture; and the page
        for path, key, want in [
            ("/admin/workers", None, 401),
            ("/admin/workers", "wrong", 401),
            ("/admin/workers", KEY, 200),
            ("/admin/nothing-here", KEY, 404),
            ("/admin/picture.svg", KEY, 200),
            ("/control", None, 200),
        ]:
            status, headers, _ = _request(host, port, path, key)
            assert status == want and headers.get("cache-control") == "no-store", (path, key, status, headers)
        _, headers, _ = _request(host, port, "/control")
        assert "frame-ancestors 'none'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"

        # one peer (127.0.0.2) opens 300 idle connections, more than the whole budget (256)
        idle = []
        try:
            for _ in range(300):
                s = socket.socket()
                s.bind(("127.0.0.2", 0))
                s.connect((host, port))
                idle.append(s)
            time.sleep(1.0)  # the server has accepted them all
            status, _, body = _request(host, port, "/health")  # everyone else: still served
            assert status == 200, body
            status, _, body = _request(host, port, "/health", source="127.0.0.2")  # that peer: over its share
            assert status == 503 and "too many open connections from this address" in body
            assert _request(host, port, "/v1/models", KEY, source="127.0.0.2")[0] == 200  # the key holder passes
        finally:
            for s in idle:
                s.close()
        assert "over the limit of 32 per peer: 503 unless keyed" in log.read_text()
    finally:
        stop_server(live.proc)
    assert live.proc.returncode == 0, log.read_text()[-2000:]
