"""The audit of a batched run (continuous batching): every step carries several sessions, each in
its own KV slot, and the verifier checks per session where it is held, from its first token to its
release, on top of every per-step invariant.

One audited run: tiny Qwen2 at N = 3 (split KV groups: the batched score sums are in the
accounting), 3 slots, 4 sessions (session i joins at step i, so steps mix a newcomer's prefill
with the others' decodes; the fourth session reuses the first one's slot). Negative controls: a
worker that keeps a finished session's KV (`--inject-leak keep-slots`), and tampered logs: a
dropped release, a shifted position, a span moved to another slot, sessions never released, values
of the wrong type.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_audit import PROMPT, STEPS, _rechain, _records, _steps, assert_tamper_fails, needs_ss

from fusion_compute.audit.runner import AuditRunError, RunConfig, run_audit, run_cold_start
from fusion_compute.audit.verify import verify_dir
from fusion_compute.audit.verify.expectation import score_elements
from fusion_compute.cli.main import main

SLOTS = 3


def batched(model: Path, out: Path, n: int, **kw) -> dict:
    cfg = RunConfig(
        out=out,
        model=str(model),
        workers=n,
        steps=STEPS,
        cold_starts=1,
        prompt_ids=PROMPT,
        timeout_s=60,
        batch=SLOTS,
        **kw,
    )
    return run_cold_start(cfg, 0)


@pytest.fixture(scope="module")
def run(tiny_qwen2, tmp_path_factory) -> dict:
    return batched(tiny_qwen2, tmp_path_factory.mktemp("batched"), 3)


def _log(run: dict, rank: int) -> list[dict]:
    return _records(Path(run["dir"]) / "epoch0" / f"rank{rank}.jsonl")


@pytest.mark.slow
def test_batched_run_closes_every_step_and_session(run):
    assert run["ok"], run["first_violations"]
    assert (run["closed_sessions"], run["batched_sessions"]) == (SLOTS + 1, SLOTS + 1)
    assert run["closed_decode"] == run["decode_steps"] > 0
    assert run["closed_prefill"] == run["prefill_steps"] > 0
    res = verify_dir(run["dir"])
    assert res.summary_line().startswith(f"closed: {run['decode_steps']}/{run['decode_steps']} decode steps")
    assert f"{SLOTS + 1}/{SLOTS + 1} batched sessions" in res.summary_line()
    log = _log(run, 2)
    steps = [r for r in log if r["type"] == "step"]
    spans = [s for r in steps for s in r["spans"]]
    # every session ran its prompt once (at position 0) and STEPS single tokens after it
    assert sum(1 for s in spans if s[1] == 0) == SLOTS + 1
    assert sum(1 for s in spans if s[1] > 0 and s[2] == 1) == (SLOTS + 1) * STEPS
    assert any(len(r["spans"]) > 1 and any(s[2] > 1 for s in r["spans"]) for r in steps)  # prefill among decodes
    releases = [r for r in log if r["type"] == "release"]
    assert len(releases) == SLOTS + 1 and all(r["zeroed"] for r in releases)
    reused = [s for s in spans if s[1] == 0 and s[0] == releases[0]["slot"]]
    assert len(reused) == 2  # the fourth session started in the first one's slot, after its release
    assert any(e[2] == "score_sum" for r in steps if len(r["spans"]) > 1 for e in r["events"])
    assert run["violation_counts"]["accounting"] == 0 and verify_dir(run["dir"]).checks["accounting"] > 0


@needs_ss
def test_batched_socket_counters_match_the_prediction(run):
    """The spans messages and the padded decode scores are in the wire model: bytes match exactly."""
    assert len(run["os"]) == 3
    for o in run["os"].values():
        assert o["ok"] and o["excess_sent"] == 0 and o["excess_received"] == 0, o


def test_score_elements():
    assert score_elements(None, 5, 0) == 5 * 5
    assert score_elements([(2, 7, 1)], 1, 7) == 8  # one session: as unbatched
    # a prefill of 3 at 0, decodes at positions 4 and 9: padded to 10 positions each
    assert score_elements([(0, 0, 3), (1, 4, 1), (2, 9, 1)], 5, 0) == 3 * 3 + 2 * 10


@pytest.mark.slow
def test_kept_slot_fails_the_session_check(tiny_qwen2, tmp_path):
    r = batched(tiny_qwen2, tmp_path, 3, inject_leak="keep-slots")
    assert not r["ok"] and r["closed_sessions"] < r["batched_sessions"]
    c = r["violation_counts"]
    assert {k for k, v in c.items() if v} == {"holding"}, c
    assert all("still held KV after its session's release" in v for v in r["first_violations"])


def drop_release(d: Path) -> None:
    """A worker's log without its first release: the reused slot then shows a new session on top."""
    recs = _records(d / "rank1.jsonl")
    del recs[next(i for i, r in enumerate(recs) if r["type"] == "release")]
    _rechain(d, 1, recs)


def shift_position(d: Path) -> None:
    recs = _records(d / "rank2.jsonl")
    step = next(recs[i] for i in _steps(recs) if len(recs[i].get("spans", [])) > 1 and recs[i]["spans"][-1][1] > 0)
    step["spans"][-1][1] += 1
    _rechain(d, 2, recs)


def move_slot(d: Path) -> None:
    recs = _records(d / "rank3.jsonl")
    step = next(recs[i] for i in _steps(recs) if len(recs[i].get("spans", [])) > 1)
    step["spans"][0][0] = 9  # a slot nobody opened
    _rechain(d, 3, recs)


def never_released(d: Path) -> None:
    """Every rank's last release dropped: a batched session still held when the logs end."""
    for rank in range(4):
        recs = _records(d / f"rank{rank}.jsonl")
        del recs[max(i for i, r in enumerate(recs) if r["type"] == "release")]
        _rechain(d, rank, recs)


def malformed_spans(d: Path) -> None:
    """Values of the wrong type: reported as violations, never a crash of the verifier."""
    recs = _records(d / "rank1.jsonl")
    recs[_steps(recs)[2]]["spans"] = 5
    next(r for r in recs if r["type"] == "release")["slot"] = [0]
    _rechain(d, 1, recs)


TAMPERS = {
    "dropped-release": (drop_release, {"holding", "structure"}),
    "shifted-position": (shift_position, {"structure"}),
    "moved-slot": (move_slot, {"structure"}),
    "never-released": (never_released, {"holding"}),
    "malformed-spans": (malformed_spans, {"structure"}),
}


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampered_batched_log_fails(run, tmp_path, name, capsys):
    assert_tamper_fails(run["dir"], tmp_path / "audit", name, TAMPERS[name], capsys)


def test_batch_limits(tiny_qwen2, tmp_path, capsys):
    with pytest.raises(AuditRunError, match="--batch and --revoke-at"):
        batched(tiny_qwen2, tmp_path, 2, revoke_at=1)
    cfg = RunConfig(out=tmp_path, model=str(tiny_qwen2), workers=2, steps=2, cold_starts=1, batch=0)
    with pytest.raises(AuditRunError, match="--batch must be in 1..256"):
        run_audit(cfg, log=lambda s: None)
    assert main(["audit", "run", "--model", str(tiny_qwen2), "--out", str(tmp_path), "--batch", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--batch must be in 1..256, got 0" in err
