"""The red team's scenarios of issue 36, in real jobs (tiny Qwen2, loopback TLS). Each attacker is the
real `fusion worker` with one fault composed in at start-up (runtime/faults.py), never a branch in
honest code:

  drag-sub    sleeps 0.2 s before each of its reduce-scatter sends: under the 0.25 s receive tick, and
              every message and step under the per-message timeout. At rank 1, 2 and 3 of three it
              is named (its two peers' accounts of real wait durations) and replaced; the tokens are
              the run's without it. Before: the client read egress in rank order and its own account
              charged every wait to worker 1; whole ticks hid the waits; worker 1 was removed.
  close-link  shuts only its link to one peer mid-step, says that peer failed it, and stalls. At rank
              1, 2 and 3: removed, never its victim. Before: the third worker saw the victim's links
              close and testified against it.
  drag-lie    two workers and a standby: drags like drag-rs and says in its account that its peer
              kept it waiting. The evidence is a two-sided quarrel; before, every request failed
              while it stayed. Now the suspects are set aside for the standby (none barred), the
              request succeeds with the tokens of the run without it, and when the guess was wrong
              the ambiguity follows the liar into its next epoch and it is removed there.

Timing: each test's verdicts need the liar's delays, not the machine's speed, and the bounds leave
a loaded machine room (see the constants). The rules themselves, on every pattern of evidence, are
tested without processes in tests/test_blame.py."""

from __future__ import annotations

import os

import pytest
from procs import children
from test_faults import LIVENESS_S
from test_slow_steps import run
from tiny_models import STEP_RS

from fusion_compute.structural.client import Engine, EngineOptions

SLOW_FROM = 11  # the dragging starts at this step (the ten before set the healthy median)
# Per message: the sub-tick dragger's 0.2 s and 2 s per step, and the lying dragger's 0.4 s and 4 s
# per step (STEP_RS = 10 reduce-scatters), stay under it; the link liar's stall is noticed by its
# victim at once (EOF).
TIMEOUT_S = 10.0
LINK_TIMEOUT_S = 3.0  # the link liar: what an accused that says it is computing is given (blame.py)
# The step bound's floor. A healthy tiny step takes milliseconds (measured under 0.05 s on this
# loaded machine), so the floor governs: a sub-tick-dragged step (2 s) earns 2 strikes at 1 s and
# the second dragged step brings the verdict; a lying-dragged step (4 s) is cut at 3 x 1 s and
# judged in that step (at a 1.5 s floor it earned 2 strikes a step, and each verdict waited for a
# second dragged step: 8 s of dragging instead of 3). Both ways of reaching a verdict run.
SUB_DEADLINE_MIN_S = 1.0
LIE_DEADLINE_MIN_S = 1.0

_references: dict[int, list[int]] = {}


def reference(model, n: int) -> list[int]:
    """The greedy tokens of a run without any fault, at N = n (compared, never hard-coded)."""
    if n not in _references:
        with Engine(model, EngineOptions(n_workers=n, context=128, timeout_s=30)) as eng:
            _references[n] = run(eng).token_ids
    return _references[n]


def attacked(model, n: int, who: int, fault: str, **kw):
    """One greedy run of N = n workers and a standby, worker `who` running `--inject-fault FAULT`:
    the result, the last epoch's order and every worker's state."""
    kw.setdefault("timeout_s", TIMEOUT_S)
    opts = EngineOptions(
        n_workers=n,
        standby=1,
        context=128,
        liveness_s=LIVENESS_S,
        args_for_worker={who: ("--inject-fault", fault)},
        **kw,
    )
    with Engine(model, opts) as eng:
        res = run(eng)
        return res, eng.order, {w["id"]: w["state"] for w in eng.workers()}


@pytest.mark.slow
@pytest.mark.parametrize("dragger", [1, 2, 3])
def test_sub_tick_dragger_is_named_whatever_its_rank(tiny_qwen2, dragger, capfd):
    want = reference(tiny_qwen2, 3)
    fault = f"drag-sub@{STEP_RS * (SLOW_FROM - 1) + 1}"
    res, order, states = attacked(tiny_qwen2, 3, dragger, fault, step_deadline_min_s=SUB_DEADLINE_MIN_S)
    assert res.token_ids == want
    assert [r["lost"] for r in res.recoveries] == [[dragger]], res.recoveries
    reason = res.recoveries[0]["reason"]
    for honest in {1, 2, 3} - {dragger}:
        assert f"worker {honest} was kept waiting" in reason and f"by worker {dragger}" in reason, reason
    assert "the client was kept waiting" not in reason, reason  # its own account blames nobody
    assert states[dragger] == "removed" and order == [4 if p == dragger else p for p in (1, 2, 3)], states
    err = capfd.readouterr().err
    assert f"worker {dragger} is the cause" in err, err[-3000:]
    print(reason)


@pytest.mark.slow
@pytest.mark.parametrize(("liar", "victim"), [(2, 1), (1, 2), (3, 1)])
def test_link_closing_liar_is_removed_not_its_victim(tiny_qwen2, liar, victim, capfd):
    want = reference(tiny_qwen2, 3)
    res, _, states = attacked(tiny_qwen2, 3, liar, f"close-link@{STEP_RS * 5 + 1}", timeout_s=LINK_TIMEOUT_S)
    assert res.token_ids == want
    assert [r["lost"] for r in res.recoveries] == [[liar]], res.recoveries
    reason = res.recoveries[0]["reason"]
    assert f"worker {victim} left naming worker {liar}" in reason, reason
    assert f"worker {liar} names worker {victim} but did not leave naming it" in reason, reason
    assert states[liar] == "removed" and states[victim] == "active", states
    assert f"blaming worker [{liar}]" in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("liar", [1, 2])
def test_two_workers_a_lying_dragger_does_not_stop_the_service(tiny_qwen2, liar, capfd):
    want = reference(tiny_qwen2, 2)
    honest = 3 - liar
    fault = f"drag-lie@{STEP_RS * (SLOW_FROM - 1) + 1}"
    # before: "ambiguous between workers [1, 2] ... nobody is removed", and every request failed
    res, order, states = attacked(tiny_qwen2, 2, liar, fault, step_deadline_min_s=LIE_DEADLINE_MIN_S)
    assert res.token_ids == want
    assert liar not in order and honest in order and 3 in order, (order, states)
    assert states[honest] == "active", states
    first = res.recoveries[0]
    assert first["lost"] == [] and first["set_aside"] == [1], res.recoveries  # the lower id first: a guess
    if liar == 2:  # the guess was wrong: the liar drags on with 3, ambiguous again, and is set aside (accused first)
        # not removed: a set judged on waits never feeds `follows` (two honest workers slowed by the
        # machine make one too: tests/test_redteam_41.py), the liveness docs/resilience.md admits
        assert [(r["lost"], r["set_aside"]) for r in res.recoveries[1:]] == [([], [2])], res.recoveries
        assert states[2] == "standby" and order == [3, 1], (order, states)
    else:  # right: the job goes on without the liar, which is set aside, not barred
        assert len(res.recoveries) == 1 and states[1] == "standby", (res.recoveries, states)
    err = capfd.readouterr().err
    assert "setting aside worker [1] (not barred)" in err, err[-3000:]
    assert "it is the cause" not in err, err[-3000:]


def test_no_stray_processes():
    assert children(os.getpid()) == set()
