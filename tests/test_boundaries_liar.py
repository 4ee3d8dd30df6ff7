"""A process-level liar that leaves with a farewell (issue 47): the real `fusion worker` with
`--inject-fault leave-lie@N` (runtime/faults.py) shuts its link to its victim mid-step, says in its
account that the victim's link failed it, and then leaves the epoch the way an honest worker whose
link failed leaves: a farewell naming the victim (`cause`) on every link. Its word against its
victim's: the evidence is ambiguous, nobody is removed on it, the suspects are set aside (a
standby takes a seat), and the tokens are the run's without the liar. (The same evidence read off real links
without processes: tests/test_boundaries_blame.py; the liar that stays: tests/test_hostile_blame.py.)"""

from __future__ import annotations

import os

import pytest
from procs import children
from test_hostile_blame import LINK_TIMEOUT_S, attacked, reference
from tiny_models import STEP_RS


@pytest.mark.slow
def test_a_liar_leaving_with_a_farewell_is_ambiguous_and_its_victim_never_removed(tiny_qwen2, capfd):
    liar, victim = 2, 1
    want = reference(tiny_qwen2, 3)
    res, order, states = attacked(tiny_qwen2, 3, liar, f"leave-lie@{STEP_RS * 5 + 1}", timeout_s=LINK_TIMEOUT_S)
    assert res.token_ids == want
    assert len(res.recoveries) == 1, res.recoveries
    first = res.recoveries[0]
    reason = first["reason"]
    # the liar's farewell is counted as an accusation (it left naming its victim), and is not enough
    assert f"worker {liar} left naming worker {victim}" in reason, reason
    assert "the evidence is ambiguous between workers" in reason, reason
    # set aside, as many as the standby and the two-worker floor allow (here both), none barred
    assert first["lost"] == [] and first["set_aside"] and set(first["set_aside"]) <= {liar, victim}, first
    assert states[victim] != "removed" and states[liar] != "removed", states
    assert 4 in order and not set(order) & set(first["set_aside"]), order  # the standby took a seat
    err = capfd.readouterr().err
    assert "(not barred)" in err, err[-3000:]


def test_no_stray_processes():
    assert children(os.getpid()) == set()
