"""The audit across plan epochs: a worker revoked at a decode step, the session replayed on epoch 1 with a
standby in its seat. Both epochs pass the per-epoch invariants (the replay is epoch 1's first step, so
"no worker holds every coordinate during the replay" is its no_full_holder check), and the run-level
membership check proves the revoked worker took no part and received nothing afterwards. Negative
controls: a client that keeps the revoked worker (audit/inject.keep_revoked, composed at start-up), and
tampered membership records, socket counts, logs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_audit import PROMPT, _rechain, _records, assert_tamper_fails, redigest, table_of

from fusion_compute.audit import netcount
from fusion_compute.audit import schema as S
from fusion_compute.audit.runner import RunConfig, run_cold_start
from fusion_compute.audit.verify import RunResult, verify_dir
from fusion_compute.cli.main import main

STEPS, REVOKE_AT = 4, 2


def revoked_run(model: Path, out: Path, **kw) -> dict:
    cfg = RunConfig(
        out=out,
        model=str(model),
        workers=2,
        steps=STEPS,
        cold_starts=1,
        prompt_ids=PROMPT,
        timeout_s=60,
        revoke_at=REVOKE_AT,
        exposure=False,
        **kw,
    )
    return run_cold_start(cfg, 0)


@pytest.fixture(scope="module")
def revoked(tiny_qwen2, tmp_path_factory) -> dict:
    return revoked_run(tiny_qwen2, tmp_path_factory.mktemp("revoked"))


@pytest.fixture(scope="module")
def kept(tiny_qwen2, tmp_path_factory) -> dict:
    """The negative control: the client records the revocation but keeps the worker in epoch 1."""
    return revoked_run(tiny_qwen2, tmp_path_factory.mktemp("kept"), negative_control="keep-revoked")


@pytest.mark.slow
def test_revocation_at_a_decode_step_passes_over_two_epochs(revoked):
    r = revoked
    assert r["ok"], r["first_violations"]
    d = Path(r["dir"])
    assert sorted(p.name for p in d.iterdir()) == ["epoch0", "epoch1", S.MANIFEST, S.MEMBERSHIP] + (
        [S.NETCOUNT] if netcount.available() else []
    )
    assert [e["order"] for e in r["epochs"]] == [[1, 2], [3, 2]]  # the standby (3) took worker 1's seat
    assert all(e["ok"] for e in r["epochs"])
    # every decode step closed, in either epoch; two prefills: the prompt, and the replay
    assert (r["closed_decode"], r["decode_steps"], r["closed_prefill"], r["prefill_steps"]) == (STEPS, STEPS, 2, 2)
    assert (
        r["summary"] == f"closed: {STEPS}/{STEPS} decode steps (+2/2 prefill) in 2 epochs, 3 layers each, 0 violations"
    )
    # the replay: epoch 1's first step, the prompt and the tokens fed so far, closed (no full holder in it)
    (replay,) = r["membership"]["replays"]
    assert replay == {
        "epoch": 1,
        "session": 1,
        "step": 0,
        "tokens": len(PROMPT) + REVOKE_AT,
        "closed": True,
        "violations": 0,
        "no_full_holder_violations": 0,
    }
    assert r["replay_same_next_token"] is True  # exact: the replay predicts the token already generated
    (dep,) = r["membership"]["departures"]
    assert dep["participant"] == 1 and dep["why"] == "revoked by the user" and dep["absent"]
    assert r["membership"]["ok"] and r["membership"]["checked"] > 0
    # the workers' own word: each header names its epoch and participant
    for e, order in enumerate([[1, 2], [3, 2]]):
        for rank, p in enumerate(order, 1):
            header = _records(d / S.epoch_dir(e) / S.log_name(rank))[0]
            assert (header["epoch"], header["participant"]) == (e, p)
    assert not (d / "epoch1" / "rank3.jsonl").exists()
    res = verify_dir(d)
    assert isinstance(res, RunResult) and res.ok and len(res.epochs) == 2
    # 2 epochs x 3 steps x (3 layers x 12 roles, less the last layer's resid.out: no worker holds any of
    # it, the last down partials go to the client, plan.boundary)
    assert res.checks["no_full_holder"] == 2 * (STEPS // 2 + 1) * (3 * 12 - 1)


@pytest.mark.skipif(not netcount.available(), reason="`ss` not installed: no OS byte accounting")
def test_revoked_worker_received_nothing_after_its_revocation(revoked):
    (dep,) = revoked["membership"]["departures"]
    k = dep["kernel"]
    assert k is not None and (k["sent"], k["received"]) == (0, 0), k
    header = _records(Path(revoked["dir"]) / "epoch0" / "rank1.jsonl")[0]
    assert k["os_pid"] == header["pid"]  # the counted process is the one that wrote worker 1's log
    for e in revoked["epochs"]:
        assert len(e["os"]) == 2 and all(o["ok"] and o["excess_sent"] == 0 for o in e["os"].values()), e["os"]


@pytest.mark.slow
def test_keeping_a_revoked_worker_fails_the_membership_check(kept, capsys):
    r = kept
    assert not r["ok"] and r["closed_decode"] == 0  # a run-level violation voids every certificate
    c = r["violation_counts"]
    assert {k for k, v in c.items() if v} == {"membership"}, c  # every other check passes
    assert all(e["ok"] for e in r["epochs"]) and [e["order"] for e in r["epochs"]] == [[1, 2], [1, 2]]
    res = verify_dir(r["dir"])
    msgs = [v.message for v in res.violations if v.invariant == "membership"]
    assert all("worker 1 (revoked by the user before epoch 1)" in m for m in msgs), msgs
    assert any("its own log epoch1/rank1.jsonl" in m for m in msgs), msgs  # the worker's own word
    assert any("the client sent" in m for m in msgs), msgs  # the client's log addresses it
    if netcount.available():  # the kernel saw its process receive the epoch's traffic
        assert any("after it left (kernel counters" in m for m in msgs), msgs
        assert r["membership"]["departures"][0]["kernel"]["received"] > 0
    assert main(["audit", "verify", r["dir"]]) == 1
    assert "VIOLATION membership [epoch 1]: worker 1 (revoked by the user before epoch 1)" in capsys.readouterr().out


def test_verify_cli_covers_every_epoch(revoked, capsys):
    assert main(["audit", "verify", revoked["dir"]]) == 0
    out = capsys.readouterr().out
    assert "epoch 0: workers (participants in rank order) [1, 2]" in out
    assert "epoch 1: workers (participants in rank order) [3, 2]" in out
    assert "worker 1 revoked by the user before epoch 1: takes no part after" in out
    assert "replay in epoch 1: session 1 step 0" in out and "0 violations" in out
    # one table for the cold start: both epochs and the checks across them, as summary.json counts them
    assert table_of(out) == {inv: (n, revoked["violation_counts"][inv]) for inv, n in revoked["checks"].items()}
    assert revoked["checks"]["membership"] > 0 and out.splitlines()[-1].startswith("audit PASS: ")
    assert main(["audit", "verify", str(Path(revoked["dir"]) / "epoch1")]) == 0  # one epoch on its own
    capsys.readouterr()
    assert main(["audit", "verify", "--json", revoked["dir"]]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["ok"] and len(j["epochs"]) == 2 and j["orders"] == [[1, 2], [3, 2]]


# ---- tampered cold starts ----


def _membership(d: Path) -> dict:
    return json.loads((d / S.MEMBERSHIP).read_text())


def membership_altered(d: Path) -> None:
    """The revocation erased from the record, the digest left as it was."""
    m = _membership(d)
    m["epochs"][1]["left"] = []
    (d / S.MEMBERSHIP).write_text(json.dumps(m))


def membership_altered_redigested(d: Path) -> None:
    """The same, with the digest rewritten too: worker 1 now leaves without a reason."""
    membership_altered(d)
    redigest(d, ".", S.MEMBERSHIP, lambda c, h: c.update(membership_sha256=h))


def order_forged(d: Path) -> None:
    """The record and epoch 1's manifest claim worker 1 is still rank 1: the workers' headers disagree."""
    m = _membership(d)
    m["epochs"][1]["order"] = [1, 2]
    (d / S.MEMBERSHIP).write_text(json.dumps(m))
    redigest(d, ".", S.MEMBERSHIP, lambda c, h: c.update(membership_sha256=h))
    em = json.loads((d / "epoch1" / S.MANIFEST).read_text())
    em["order"] = [1, 2]
    (d / "epoch1" / S.MANIFEST).write_text(json.dumps(em))
    redigest(d, "epoch1", S.MANIFEST, lambda c, h: c["epochs"][1].update(manifest_sha256=h))


def kernel_count_altered(d: Path) -> None:
    p = d / S.NETCOUNT
    if not p.exists():
        pytest.skip("no netcount.json (ss unavailable)")
    net = json.loads(p.read_text())
    net["departed"]["1"]["received"] = 0 if net["departed"]["1"]["received"] else 1
    p.write_text(json.dumps(net))


def kernel_count_of_another_process(d: Path) -> None:
    p = d / S.NETCOUNT
    if not p.exists():
        pytest.skip("no netcount.json (ss unavailable)")
    net = json.loads(p.read_text())
    net["departed"]["1"]["os_pid"] += 1
    p.write_text(json.dumps(net))
    redigest(d, ".", S.NETCOUNT, lambda c, h: c.update(netcount_sha256=h))


def stray_log(d: Path) -> None:
    """A log of worker 1 slipped into epoch 1 (not in its manifest)."""
    shutil.copy(d / "epoch0" / "rank1.jsonl", d / "epoch1" / "rank3.jsonl")


def epoch_manifest_altered(d: Path) -> None:
    em = json.loads((d / "epoch1" / S.MANIFEST).read_text())
    em["variant"] = "forged"
    (d / "epoch1" / S.MANIFEST).write_text(json.dumps(em))


def survivor_end_dropped(d: Path) -> None:
    """Only a worker that left may lack its end record: drop the survivor's (re-chained)."""
    recs = _records(d / "epoch0" / "rank2.jsonl")
    assert recs[-1]["type"] == "end"
    _rechain(d / "epoch0", 2, recs[:-1])


TAMPERS = {
    "membership-altered": (membership_altered, {"chain"}),
    "membership-altered-redigested": (membership_altered_redigested, {"membership"}),
    "order-forged": (order_forged, {"membership"}),
    "kernel-count-altered": (kernel_count_altered, {"chain"}),
    "kernel-count-of-another-process": (kernel_count_of_another_process, {"membership"}),
    "stray-log": (stray_log, {"structure", "membership"}),
    "epoch-manifest-altered": (epoch_manifest_altered, {"chain"}),
    "survivor-end-dropped": (survivor_end_dropped, {"structure"}),
}


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampered_cold_start_fails(revoked, tmp_path, name, capsys):
    assert_tamper_fails(revoked["dir"], tmp_path / "cold", name, TAMPERS[name], capsys, epoch=None)


def test_revoked_worker_may_lack_its_end_record(revoked, tmp_path):
    """It is told to wipe and leave at once, so its process can exit before writing the end record:
    accepted (and said) for the worker the record says left, and only for it."""
    d = tmp_path / "cold"
    shutil.copytree(revoked["dir"], d)
    recs = _records(d / "epoch0" / "rank1.jsonl")
    if recs[-1]["type"] == "end":
        _rechain(d / "epoch0", 1, recs[:-1])
    res = verify_dir(d)
    assert res.ok, [v.message for v in res.violations]
    assert any("no end record: its worker left the job (revoked by the user)" in n for n in res.epochs[0].notes)


def test_revocation_options_are_checked(tiny_qwen2, tmp_path, capsys):
    cases = [
        (["--revoke-at", "4"], "--revoke-at must be in 0..3"),
        (["--negative-control", "keep-revoked"], "needs --revoke-at"),
        (["--revoke-at", "1", "--standby", "0"], "leaves fewer than 2"),
    ]
    for extra, msg in cases:
        rc = main(["audit", "run", "--model", str(tiny_qwen2), "--steps", "4", "--out", str(tmp_path / "x"), *extra])
        err = capsys.readouterr().err
        assert rc != 0 and msg in err and err.count("\n") == 1, (extra, err)
