"""A failed epoch change never wedges the engine (issue 26, item 1).

A listed standby that keeps beating but never joins the epoch it is called to (`--inject-fault
never-join@1`, faults.py) makes the recovery from a lost worker fail at the join deadline. The
request fails with one clear line; the honest survivor that had joined that epoch stays (it waits for
the next word instead of exiting); the standby that never came is removed; and once a fresh standby
is added, the next request opens a new epoch and answers with the tokens of a run with no fault."""

from __future__ import annotations

import os
import signal
import time

import pytest
from procs import wait_gone
from test_faults import LIVENESS_S, no_stray_processes, run  # noqa: F401 (an autouse fixture: after every test here)

from fusion_compute.comm import CommError
from fusion_compute.runtime.membership import TooFewWorkers
from fusion_compute.structural.client import Engine, EngineOptions

JOIN_S = 5.0  # the join deadline of every epoch (start-up's too): what the stuck standby costs once


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
def test_failed_epoch_change_recovers_on_the_next_request(tiny_qwen2):
    opts = EngineOptions(
        n_workers=2,
        standby=1,
        context=128,
        timeout_s=30,
        liveness_s=LIVENESS_S,
        join_timeout_s=JOIN_S,
        args_for_worker={3: ("--inject-fault", "never-join@1")},
    )
    with Engine(tiny_qwen2, opts) as eng:
        ref = run(eng).token_ids
        victim, survivor, liar = eng.procs.pids[0], eng.procs.pids[1], eng.procs.pids[2]
        os.kill(victim, signal.SIGKILL)
        assert wait_gone({victim}) == set()
        with pytest.raises(CommError) as e:
            run(eng)  # recovery calls the standby, which beats but never joins
        line = str(e.value)
        assert (
            "\n" not in line
            and "did not open" in line
            and "did not join" in line
            and "removed worker 3 from the job" in line
        )
        assert eng.comm is None and eng.epoch == 1  # no half-open epoch; its number is spent
        time.sleep(1.0)
        assert _alive(survivor), "the honest worker that joined the abandoned epoch exited"
        assert wait_gone({liar}) == set()  # told to wipe and leave
        t0 = time.monotonic()
        with pytest.raises(TooFewWorkers, match="fewer than --min-workers 2"):
            run(eng)  # no standby left: refused at once, with the reason, not a 500 on a missing comm
        assert time.monotonic() - t0 < JOIN_S / 2
        states = {w["id"]: w["state"] for w in eng.workers()}
        assert states[1] == states[3] == "removed" and states[2] == "active", states
        spare = eng.add_standby()
        res = run(eng)  # the next request opens an epoch over the survivor and the new standby
        assert res.token_ids == ref
        assert eng.comm is not None and sorted(eng.order) == [2, spare] and survivor in eng.procs.pids
        assert {w["id"]: w["state"] for w in eng.workers()}[spare] == "active"
