"""Admission: only the keys the user listed join, each only as the rank and group it is listed for.

Rogue processes try to join a real run: one with a key nobody listed, one with a listed key that
claims another rank, one that claims another group. Each is refused before it receives a byte of
state, with a log line on the client naming what was refused; the rogue exits with one line; the run
goes on with the real workers and gives the same tokens as without the rogues. Nothing hangs and
nothing is left running."""

from __future__ import annotations

import json
import time

import pytest
from procs import LOG_LINE, fusion, reap
from test_topology import keys, topo_text, write_keys

from fusion_compute.comm import Identity, free_port

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)

PROMPT = "5,17,33,2,99"


def _rogue(port: int, client_line: str, key_file, *claims: str):
    return fusion(
        "worker",
        "--master",
        f"127.0.0.1:{port}",
        "--client-key",
        client_line,
        "--key",
        str(key_file),
        "--join-timeout",
        "20",
        "--threads",
        "1",
        *claims,
    )


def _wait_for(path, needle: str, proc, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if needle in text or proc.poll() is not None:
            return text
        time.sleep(0.1)
    return path.read_text()


def test_rogues_are_refused_and_the_run_proceeds(tiny_qwen2, tmp_path):
    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    port = free_port()
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"], model=tiny_qwen2, port=port))
    stranger = tmp_path / "stranger.key"
    Identity.new().save(stranger)
    log = tmp_path / "client.err"
    client = fusion(
        "generate",
        "--topology",
        str(topo),
        "--key",
        str(kf[0]),
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "8",
        "--json",
        "--timeout",
        "60",
        "--join-timeout",
        "90",
        stderr=open(log, "w"),
    )
    procs = [client]
    try:
        time.sleep(1.0)  # the client is listening
        client_line = ids[0].public.line()
        unlisted = _rogue(port, client_line, stranger)
        procs.append(unlisted)
        _, u_err = unlisted.communicate(timeout=30)
        text = _wait_for(log, "refused:", client)
        wrong_rank = _rogue(port, client_line, kf[2], "--rank", "1")  # worker 2's key, claiming rank 1
        procs.append(wrong_rank)
        _, r_err = wrong_rank.communicate(timeout=30)
        text = _wait_for(log, "presented itself as rank 1", client)
        workers = [fusion("worker", "--topology", str(topo), "--key", str(k), "--threads", "1") for k in kf[1:]]
        procs += workers
        out, _ = client.communicate(timeout=120)
        for w in workers:
            w.wait(timeout=30)
            assert w.returncode == 0, w.stderr.read()
    finally:
        reap(procs)
    text = log.read_text()
    # The client says what it refused, one line each, naming the key (fingerprint) and the claim.
    assert "refused: connection from 127.0.0.1" in text and "TLS handshake failed" in text, text
    assert (
        f"key {ids[2].public.fingerprint}] presented itself as rank 1, but the roster lists its key as rank 2" in text
    )
    # Each rogue got one error line (after its log's timestamped lines: what it waited for) and a non-zero
    # exit, and never a WELCOME (so never a byte of state).
    u_err, r_err = ("\n".join(ln for ln in e.splitlines() if not LOG_LINE.match(ln)) for e in (u_err, r_err))
    assert unlisted.returncode != 0 and len(u_err.strip().splitlines()) == 1, u_err
    assert "TLS handshake with the client" in u_err or "did not admit this worker" in u_err, u_err
    assert (
        wrong_rank.returncode != 0
        and "the client refused this worker" in r_err
        and len(r_err.strip().splitlines()) == 1
    )
    res = json.loads(out)
    assert client.returncode == 0 and len(res["token_ids"]) == 8
    plain = json.loads(
        fusion(
            "generate", "--model", str(tiny_qwen2), "--prompt-ids", PROMPT, "--max-new-tokens", "8", "--json"
        ).communicate(timeout=120)[0]
    )
    assert res["token_ids"] == plain["token_ids"]


def test_wrong_group_is_refused(tiny_qwen2, tmp_path):
    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    port = free_port()
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"], groups=["A", "B"], model=tiny_qwen2, port=port))
    log = tmp_path / "client.err"
    client = fusion(
        "generate",
        "--mode",
        "masked",
        "--topology",
        str(topo),
        "--key",
        str(kf[0]),
        "--prompt-ids",
        PROMPT,
        "--max-new-tokens",
        "4",
        "--json",
        "--join-timeout",
        "5",
        stderr=open(log, "w"),
    )
    procs = [client]
    try:
        time.sleep(1.0)
        rogue = _rogue(port, ids[0].public.line(), kf[1], "--group", "B")  # group A's key, claiming B
        procs.append(rogue)
        _, r_err = rogue.communicate(timeout=30)
        client.communicate(timeout=60)  # nobody else comes: the client gives up at its join deadline
    finally:
        reap(procs)
    text = log.read_text()
    assert "presented itself for group B, but the roster lists it in group A" in text, text
    assert rogue.returncode != 0 and "refused" in r_err
    assert client.returncode != 0 and "did not join in time" in text and "Traceback" not in text
