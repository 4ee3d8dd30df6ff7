"""The user decides who takes part, during a session: list, revoke, add (migration = add + revoke), from
the engine, from `fusion chat`, and from `fusion serve`'s admin endpoints. A revoked worker wipes and
leaves; the open session moves to the next epoch by replay and continues with the same tokens; bad
requests (an unknown worker, a revocation that would leave too few) are refused and harm nothing.

The workers are threads of this process or of the command's (tests/inproc.py, `--executor inproc`:
the real workers over the real links), but in the migration, which checks that the revoked worker's
process leaves."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from inproc import threads
from procs import fusion, reap, wait_gone

from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.runtime.membership import TooFewWorkers, UnknownWorker
from fusion_compute.structural.client import Engine, EngineOptions

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]


def greedy(eng, logits, n: int) -> tuple[list[int], object]:
    """n greedy tokens in the open session from `logits`; returns them and the next logits."""
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = eng.forward([out[-1]])
    return out, logits


@pytest.mark.slow
def test_migrate_mid_session_by_add_then_revoke(tiny_qwen2):
    with Engine(tiny_qwen2, EngineOptions(n_workers=2, context=128, timeout_s=30)) as eng:
        want = generate(eng, PROMPT, max_new_tokens=24, sampling=SamplingParams()).token_ids
        eng.reset()
        head, logits = greedy(eng, eng.forward(PROMPT), 10)
        old = eng.procs.pids[0]
        pid = eng.add_standby()  # a local run spawns it
        deadline = time.monotonic() + 60
        while next(w for w in eng.workers() if w["id"] == pid)["state"] != "standby" and time.monotonic() < deadline:
            time.sleep(0.1)
        eng.revoke(1)
        states = {w["id"]: w["state"] for w in eng.workers()}
        assert states == {1: "removed", 2: "active", pid: "active"} and eng.order == [pid, 2]
        tail, _ = greedy(eng, logits, 14)  # the session goes on where it was
        assert head + tail == want
        assert eng.recoveries[-1]["reason"] == "worker 1 revoked by the user" and eng.recoveries[-1]["replay_s"] >= 0
        assert wait_gone({old}) == set()  # told to wipe and leave, it left


def test_revocation_mid_session_replays_every_token(tiny_qwen2):
    """The quick guard of the epoch replay: worker 1 revoked after 6 decode steps, the standby takes
    its seat and the session is replayed; every later step's logits equal the no-fault run's (a
    replay that drops the last token, or keeps only it, moves them by far more than the tolerance,
    whose reason is test_parity's)."""
    import torch
    from test_parity import LOGIT_ATOL

    def steps(eng, revoke_at: int | None) -> list[torch.Tensor]:
        eng.reset()
        logits, seen = eng.forward(PROMPT), []
        for i in range(10):
            seen.append(logits)
            if i == revoke_at:
                eng.revoke(1)
            logits = eng.forward([int(logits.argmax())])
        eng.end_session()
        return seen

    with Engine(tiny_qwen2, threads(n_workers=2, standby=1, context=64, timeout_s=30)) as eng:
        want = steps(eng, None)
        got = steps(eng, 6)
        assert eng.order == [3, 2] and eng.recoveries[-1]["reason"] == "worker 1 revoked by the user"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.allclose(a, b, atol=LOGIT_ATOL, rtol=0), (i, float((a - b).abs().max()))


def test_bad_membership_requests_harm_nothing(tiny_qwen2):
    with Engine(tiny_qwen2, threads(n_workers=2, context=128, timeout_s=30)) as eng:
        want = generate(eng, PROMPT, max_new_tokens=12, sampling=SamplingParams()).token_ids
        eng.reset()
        head, logits = greedy(eng, eng.forward(PROMPT), 4)
        with pytest.raises(UnknownWorker, match="no worker 9 to revoke"):
            eng.revoke(9)
        with pytest.raises(TooFewWorkers, match="revoking it would leave 1 worker: fewer than --min-workers 2"):
            eng.revoke(2)
        with pytest.raises(UnknownWorker, match="spawns its own workers"):
            eng.add_standby(key=object())  # a key means nothing to a local run
        assert head + greedy(eng, logits, 8)[0] == want  # the session was not touched
        assert [w["state"] for w in eng.workers()] == ["active", "active"]


@pytest.mark.slow
def test_chat_commands(tiny_qwen2, tmp_path):
    from test_serve import build_chat_model

    model = build_chat_model(tmp_path / "m")
    script = "/workers\n/add\n/revoke 9\n/revoke 1\nhello\n/workers\n"
    chat = ("chat", "--model", str(model), "--workers", "2", "--executor", "inproc", "--max-tokens", "4")
    p = fusion(*chat, stdin=subprocess.PIPE)
    try:
        out, err = p.communicate(script, timeout=120)
    finally:
        reap([p])
    assert p.returncode == 0, err
    first = out.split("epoch")[1]
    assert "worker 1   rank 1   active" in first and "worker 3" not in first, out
    assert "worker 3   -        standby" in out.split("epoch")[2], out  # /add: spawned, enrolled as a spare
    assert "(no worker 9 to revoke (workers: 1, 2, 3))" in out, out
    final = out.rsplit("epoch", 1)[1]
    assert "worker 1   -        removed" in final and "worker 3   rank 1   active" in final, out


def _admin(url: str, method: str, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _serve(model, log, *extra: str) -> tuple[subprocess.Popen, str]:
    """`fusion serve` on 2 workers (threads of the server's process: what is tested is the admin
    endpoints' membership logic); returns the process and its root URL once it listens (bounded)."""
    proc = fusion(
        "serve",
        "--model",
        str(model),
        "--workers",
        "2",
        "--executor",
        "inproc",
        "--port",
        "0",
        *extra,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )
    deadline = time.monotonic() + 120
    while "listening on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if "listening on" not in log.read_text():
        reap([proc], grace_s=30)
        raise AssertionError(f"fusion serve did not come up:\n{log.read_text()[-2000:]}")
    return proc, log.read_text().split("listening on ", 1)[1].split()[0].removesuffix("/v1")


def _states(url: str, key: str) -> dict[int, str]:
    """Each worker's state, as GET /admin/workers lists it."""
    return {w["id"]: w["state"] for w in _admin(url, "GET", "/admin/workers", key)[1]["workers"]}


@pytest.mark.slow
def test_serve_admin_endpoints(tmp_path):
    from test_serve import build_chat_model

    proc, url = _serve(build_chat_model(tmp_path / "m"), tmp_path / "serve.log", "--api-key", "k")
    try:
        assert _admin(url, "GET", "/admin/workers", None)[0] == 401  # the API key guards it
        status, body = _admin(url, "GET", "/admin/workers", "k")
        assert status == 200 and [w["state"] for w in body["workers"]] == ["active", "active"]
        status, body = _admin(url, "POST", "/admin/workers/2/revoke", "k")
        assert status == 409 and body["error"]["code"] == "too_few_workers"
        status, body = _admin(url, "POST", "/admin/workers/7/revoke", "k")
        assert status == 404 and body["error"]["code"] == "unknown_worker"
        status, body = _admin(url, "POST", "/admin/workers", "k", {"key": "nonsense"})
        assert status == 400 and body["error"]["param"] == "key"
        status, body = _admin(url, "POST", "/admin/workers", "k", {})
        assert status == 201 and body["id"] == 3
        deadline = time.monotonic() + 60  # the spare joins: then it is listed as a standby
        while (states := _states(url, "k")).get(3) != "standby":
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        status, body = _admin(url, "POST", "/admin/workers/1/revoke", "k")
        assert status == 200 and body["epoch"] == 1
        assert {w["id"]: w["state"] for w in body["workers"]} == {1: "removed", 2: "active", 3: "active"}
        status, health = _admin(url, "GET", "/health", None)
        assert status == 200 and health["status"] == "ok" and health["recoveries"] == 1
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        status, body = _admin(url, "POST", "/v1/chat/completions", "k", chat)
        assert status == 200 and body["fusion"]["workers"] == 2  # the new epoch serves
    finally:
        reap([proc], grace_s=30)


@pytest.mark.slow
def test_admin_endpoints_need_an_api_key(tmp_path):
    from test_serve import build_chat_model

    proc, url = _serve(build_chat_model(tmp_path / "m"), tmp_path / "serve.log")
    try:
        status, body = _admin(url, "POST", "/admin/workers/1/revoke", None)
        assert status == 403 and body["error"]["code"] == "admin_disabled"
    finally:
        reap([proc], grace_s=30)
