"""The audit of speculative decoding: a verification step (the last token plus K drafts, one span of
K + 1 columns) is checked like any step, and a rollback of its rejected columns is a recorded event
the verifier checks (invariant `rollback`: no step runs where rejected positions remain).

Live runs on tiny Qwen2 at N = 3 (split KV groups, so the score sums of the verification spans are
in the accounting and the socket counts), n-gram drafts: the model repeats token 99 after this
prompt, and the prompt's own "99 99" pair is followed by other tokens, so the first drafts are
rejected (rollbacks) and later ones, drawn from the growing run of 99s, accepted. Negative
controls: a worker that ignores the rollbacks (`--inject-leak stale-rollback`), tampered logs, and
hand-made records for the verifier alone (no processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_audit import _rechain, _records, assert_tamper_fails, needs_ss

from fusion_compute.audit import schema as S
from fusion_compute.audit.runner import AuditRunError, RunConfig, run_audit, run_cold_start
from fusion_compute.audit.verify import verify_dir
from fusion_compute.audit.verify.logs import RankLog, check_same_steps, read_event
from fusion_compute.audit.verify.result import Result, Violation
from fusion_compute.audit.verify.sessions import check_slots
from fusion_compute.cli.main import main
from fusion_compute.generation.speculative_config import SpeculativeConfig

# Repeats its 2-grams so that default n-gram drafts (2-grams and longer) are proposed, and on the tiny
# Qwen2 some are accepted and some rejected (tiny_models.py): rollbacks and accepted columns, both.
PROMPT = [237, 30, 118, 230, 237, 30, 118, 230]
TOKENS = 16  # generated after the first (--steps): the same tokens as 16 decode steps without speculation
# every draft verified (no budget): the budget prices columns by this machine's step times, and under
# load it kept too few drafts for a rejection to come (1 run in 4: no rollback record to tamper with)
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)


def config(model: Path, out: Path, speculative=NGRAM, **kw) -> RunConfig:
    return RunConfig(
        out=out,
        model=str(model),
        workers=3,
        steps=TOKENS,
        cold_starts=1,
        prompt_ids=PROMPT,
        timeout_s=60,
        exposure=False,
        speculative=speculative,
        **kw,
    )


@pytest.fixture(scope="module")
def summary(tiny_qwen2, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("spec")
    return run_audit(config(tiny_qwen2, out), log=lambda s: None) | {"out": out}


@pytest.fixture(scope="module")
def good(summary) -> dict:
    return summary["runs"][0]


@pytest.fixture(scope="module")
def plain(tiny_qwen2, tmp_path_factory) -> dict:
    """The same audited run without speculation (worker processes), once: the tokens and forwards
    the speculative runs below are held to."""
    return run_cold_start(config(tiny_qwen2, tmp_path_factory.mktemp("plain"), speculative=None), 0)


def _log(run: dict, rank: int) -> list[dict]:
    return _records(Path(run["dir"]) / "epoch0" / S.log_name(rank))


def accepted_from_logs(log: list[dict]) -> int:
    """Drafts accepted, read from a log alone: a verification span of T columns at p is followed by
    the slot's next span at p + 1 + accepted (after a rollback), or at p + T (all accepted)."""
    spans = [r.get("spans") or [[0, r["pos"], r["t"]]] for r in log if r["type"] == "step"]
    flat = [s for step in spans for s in step]
    accepted = 0
    for i, (slot, pos, t) in enumerate(flat):
        nxt = next((p for s, p, _ in flat[i + 1 :] if s == slot), None)
        if t > 1 and pos > 0 and nxt is not None:
            accepted += nxt - pos - 1
    return accepted


@pytest.mark.slow
def test_speculative_run_passes_with_rollbacks(summary, good):
    assert summary["all_ok"] and good["ok"], good["first_violations"]
    assert good["verify_steps"] > 0 and good["closed_verify"] == good["verify_steps"]
    assert good["forwards"] < good["generated_tokens"] == TOKENS + 1  # fewer forwards than tokens
    client = _log(good, 0)
    rollbacks = [r for r in client if r["type"] == "rollback"]
    assert rollbacks, "no draft was rejected: the run does not exercise rollbacks"
    assert accepted_from_logs(client) >= 1, "no draft was accepted"
    assert good["speculative"]["rollbacks"] == len(rollbacks)
    # the logs show the drafts accepted by every verification but the last (no span follows it)
    assert 1 <= accepted_from_logs(client) <= good["speculative"]["num_accepted_tokens"]
    for rank in (1, 2, 3):  # every worker zeroed the same rollbacks, measured
        mine = [r for r in _log(good, rank) if r["type"] == "rollback"]
        assert [(r["slot"], r["from"], r["to"]) for r in mine] == [(r["slot"], r["from"], r["to"]) for r in rollbacks]
        assert all(r["zeroed"] is True for r in mine)
    steps = [r for r in _log(good, 2) if r["type"] == "step"]
    assert any(r["phase"] == "verify" and any(e[2] == "score_sum" for e in r["events"]) for r in steps)
    res = verify_dir(good["dir"])
    assert res.checks["rollback"] > 0 and res.counts()["rollback"] == 0
    assert f"(+{good['verify_steps']}/{good['verify_steps']} verify)" in res.summary_line()
    report = (summary["out"] / "report.md").read_text()
    assert "## Speculative decoding" in report and "| rollback |" in report


@needs_ss
def test_speculative_socket_counters_match_the_prediction(good):
    """The verification spans' K + 1 columns and score sums are in the wire model: exact to the byte."""
    assert len(good["os"]) == 3
    for o in good["os"].values():
        assert o["ok"] and o["excess_sent"] == 0 and o["excess_received"] == 0, o


@pytest.mark.slow
def test_same_tokens_without_speculation(good, plain):
    assert plain["ok"] and plain["verify_steps"] == 0 and plain["forwards"] == TOKENS + 1
    assert plain["generated_sha256"] == good["generated_sha256"]


@pytest.mark.slow
def test_batched_speculative_run_passes(tiny_qwen2, tmp_path):
    r = run_cold_start(config(tiny_qwen2, tmp_path, batch=3), 0)
    assert r["ok"], r["first_violations"]
    assert (r["closed_sessions"], r["batched_sessions"]) == (4, 4)
    assert r["speculative"]["rollbacks"] > 0 and r["speculative"]["num_accepted_tokens"] > 0
    assert r["closed_verify"] == r["verify_steps"] > 0
    assert sum(1 for x in _log(r, 1) if x["type"] == "rollback") == r["speculative"]["rollbacks"]


@pytest.mark.slow
def test_stale_rollback_fails(good, tiny_qwen2, tmp_path, capsys):
    """The negative control: workers that ignore the rollbacks run the next step where the rejected
    drafts still are. The honest run verifies; this one fails, naming the rollback invariant."""
    r = run_cold_start(config(tiny_qwen2, tmp_path, inject_leak="stale-rollback"), 0)
    assert not r["ok"] and r["speculative"]["rollbacks"] > 0
    c = r["violation_counts"]
    assert c["rollback"] > 0 and c["accounting"] > 0, c  # split groups: score sums over the stale positions
    assert all(not c[k] for k in ("structure", "holding", "partition", "no_full_holder", "closure")), c
    assert any("with no rollback recorded" in v.message for v in verify_dir(r["dir"]).violations)
    assert main(["audit", "verify", good["dir"]]) == 0
    assert main(["audit", "verify", r["dir"]]) == 1
    assert "VIOLATION rollback" in capsys.readouterr().out


# ---- tampered logs ----


def _worker_rollback(d: Path, edit) -> None:
    recs = _records(d / "rank1.jsonl")
    edit(next(r for r in recs if r["type"] == "rollback"))
    _rechain(d, 1, recs)


def _dropped_rollback(d: Path) -> None:
    recs = _records(d / "rank2.jsonl")
    del recs[next(i for i, r in enumerate(recs) if r["type"] == "rollback")]
    _rechain(d, 2, recs)


def _edited_without_rechain(d: Path) -> None:
    p = d / "rank1.jsonl"
    lines = p.read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"type":"rollback"' in line)
    lines[i] = lines[i].replace('"zeroed":true', '"zeroed":false')  # the stored hash no longer matches
    p.write_text("\n".join(lines) + "\n")


TAMPERS = {
    "rollback-not-zeroed": (lambda d: _worker_rollback(d, lambda r: r.update(zeroed=False)), {"rollback"}),
    "rollback-to-moved": (lambda d: _worker_rollback(d, lambda r: r.update(to=r["to"] + 1)), {"rollback"}),
    "rollback-dropped": (_dropped_rollback, {"rollback"}),
    "rollback-edited-not-rechained": (_edited_without_rechain, {"chain"}),
}


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampered_speculative_log_fails(good, tmp_path, name, capsys):
    assert_tamper_fails(good["dir"], tmp_path / "audit", name, TAMPERS[name], capsys)


# ---- the verifier alone, on hand-made records ----


def _step(session: int, step: int, pos: int, t: int) -> dict:
    return {"type": "step", "session": session, "step": step, "pos": pos, "t": t, "phase": S.step_phase(t, pos)}


def _rollback(held: int, to: int, zeroed: bool | None = True) -> dict:
    r = {"type": "rollback", "session": 1, "slot": 0, "from": held, "to": to}
    return r | ({} if zeroed is None else {"zeroed": zeroed})


def _slots(body: list[dict], worker: bool = True) -> list[Violation]:
    found: list[Violation] = []
    check_slots(body, 1, worker, found.append)
    return found


# a prefill of 8, a decode, a verification of 1 + 3 drafts at 9 (positions 9..12), one accepted: back to 11
PREFIX = [{"type": "session", "session": 1}, _step(1, 0, 0, 8), _step(1, 1, 8, 1), _step(1, 2, 9, 4)]


@pytest.mark.parametrize(
    "case, records, message",
    [
        ("honest", [_rollback(13, 11), _step(1, 3, 11, 2)], None),
        ("client's rollback (no zeroed)", [_rollback(13, 11, None), _step(1, 3, 11, 2)], "client"),
        ("rollback missing", [_step(1, 3, 11, 2)], "with no rollback recorded"),
        ("wrong from", [_rollback(12, 11), _step(1, 3, 11, 2)], "but the slot holds 13 positions"),
        ("not zeroed", [_rollback(13, 11, False), _step(1, 3, 11, 2)], "not zeroed"),
        ("back to 0", [_rollback(13, 0), _step(1, 3, 11, 2)], "back to a position 1..held-1"),
        ("forward", [_rollback(13, 14), _step(1, 3, 13, 1)], "back to a position 1..held-1"),
        ("free slot", [{"type": "session", "session": 1}, _rollback(13, 11)], "which holds no session"),
    ],
)
def test_verifier_checks_rollback_records(case, records, message):
    worker = case != "client's rollback (no zeroed)"
    found = _slots(PREFIX[: 1 if case == "free slot" else None] + records, worker)
    if message is None or message == "client":
        assert found == [], found
        return
    assert found and {v.invariant for v in found} == {"rollback"}, found
    assert any(message in v.message for v in found), found
    if case != "free slot":  # a rollback finding voids a step's certificate (a free slot has none to name)
        assert all(v.step is not None for v in found)


def test_verifier_holds_workers_to_the_clients_rollbacks():
    client = PREFIX + [_rollback(13, 11, None), _step(1, 3, 11, 2)]
    worker = PREFIX + [_step(1, 3, 11, 2)]  # it never rolled back
    logs = {
        rank: RankLog({}, body, [r for r in body if r["type"] == "step"], {})
        for rank, body in enumerate([client, worker])
    }
    res = Result(dir="", workers=1, layers=1, variant="sharded")
    keys = check_same_steps(logs, 1, res)
    assert [v.invariant for v in res.violations] == ["rollback"], res.violations
    assert "the client's log has it, this worker's not" in res.violations[0].message
    assert (res.violations[0].session, res.violations[0].step) == (1, 3)  # the step that ran on those positions
    assert (res.decode_steps, res.verify_steps, res.prefill_steps) == (1, 2, 1) and len(keys) == 4


def test_step_phase():
    assert S.step_phase(8, 0) == "prefill" and S.step_phase(1, 8) == "decode" and S.step_phase(5, 9) == "verify"
    assert S.step_phase(6, 0, [[0, 0, 4], [1, 7, 2]]) == "prefill"
    assert S.step_phase(3, 7, [[0, 7, 2], [1, 4, 1]]) == "verify"
    assert S.step_phase(2, 7, [[0, 7, 1], [1, 4, 1]]) == "decode"


def test_speculative_limits(tiny_qwen2, tmp_path, capsys):
    with pytest.raises(AuditRunError, match="--speculative and --revoke-at"):
        run_audit(config(tiny_qwen2, tmp_path, revoke_at=1), log=lambda s: None)
    base = ["audit", "run", "--model", str(tiny_qwen2), "--out", str(tmp_path)]
    for extra, msg in (
        (["--speculative", "nope"], "unknown speculative method 'nope'"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be in"),
        (["--num-speculative-tokens", "3"], "needs --speculative ngram"),
        (["--inject-leak", "stale-rollback"], "needs --speculative: without drafts there is no rollback to ignore"),
    ):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and msg in err, err


@pytest.mark.slow
def test_tree_run_passes(tiny_qwen2, plain, tmp_path, monkeypatch):
    """Token trees under the audit: the suffix drafter is made to propose, at every step, a tree whose
    first branch is wrong and whose second is the target's own greedy continuation (from
    transformers), so every verification keeps a path that is not a prefix of its columns: the
    workers move its entries and zero the rest (a recorded rollback to the path's end), the parents
    and kept columns come as control messages counted in the socket prediction, and the run passes
    the verifier with the same tokens as without speculation."""
    from fusion_compute.generation.suffix import SuffixDrafter
    from fusion_compute.generation.suffix_tree import Draft
    from fusion_compute.model import reference

    want = reference.greedy(reference.load_reference(tiny_qwen2), PROMPT, TOKENS + 1)

    def two_branches(self, tokens: list[int], k: int) -> Draft:
        done = len(tokens) - len(PROMPT)  # tokens generated so far
        right = want[done : done + 2]
        d = Draft()
        if len(right) == 2 and k >= 3:
            d.add((right[0] + 1) % 300, -1, 0.5)  # a wrong first branch
            d.add(right[0], -1, 0.5)
            d.add(right[1], 1, 0.5)
        return d

    monkeypatch.setattr(SuffixDrafter, "propose_tree", two_branches)
    suffix = SpeculativeConfig("suffix", num_speculative_tokens=4, adaptive=False)
    r = run_cold_start(config(tiny_qwen2, tmp_path / "suffix", speculative=suffix), 0)
    assert r["ok"], r["first_violations"]
    assert r["generated_sha256"] == plain["generated_sha256"]
    assert r["verify_steps"] > 0 and r["forwards"] < plain["forwards"]
    assert r["speculative"]["num_accepted_tokens"] == 2 * r["speculative"]["num_drafts"]  # the second branch
    tree_words = [
        sum(e.received)
        for rec in _log(r, 1)
        if rec["type"] == "step"
        for e in map(read_event, rec.get("control") or [])
        if e.op == "tree"
    ]
    assert len(tree_words) >= r["speculative"]["num_drafts"]  # every tree, and every kept path after one
    assert r["speculative"]["rollbacks"] == r["speculative"]["num_drafts"]  # the dropped branch, each time
