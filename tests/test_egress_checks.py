"""What the structural client checks of what a listed worker sends (issue 26): an egress shard with
NaN or infinity names that worker and removes it (a standby takes its seat), instead of becoming
token 0 or a sampling error; a plan handshake that says yes with another fingerprint is refused,
naming the worker. The liars are the real `fusion worker` with a fault injected (faults.py)."""

from __future__ import annotations

import pytest
from test_faults import NEW, run, structural

from fusion_compute.errors import WorkerMisbehaved
from fusion_compute.model.config import ModelError


def test_nan_egress_names_the_worker_and_a_standby_takes_its_seat(tiny_qwen2):
    # worker 2's 60th forward: the 12th of the second request (the first makes NEW = 48 forwards)
    with structural(tiny_qwen2, standby=1, args_for_worker={2: ("--inject-fault", "nan-egress@60")}) as eng:
        ref = run(eng).token_ids
        assert len(ref) == NEW
        with pytest.raises(
            WorkerMisbehaved, match=r"worker 2 \(participant 2\) sent an egress shard holding \d+ NaN"
        ) as e:
            run(eng)
        assert e.value.pids == [2]
        assert 2 not in eng.order and 3 in eng.order and eng.recoveries[-1]["lost"] == [2]
        assert "non-finite egress" in eng.recoveries[-1]["reason"], eng.recoveries[-1]
        assert run(eng).token_ids == ref  # the next request runs on the new epoch, with the no-fault tokens


def test_hello_with_another_fingerprint_is_refused(tiny_qwen2):
    with pytest.raises(
        ModelError,
        match=r"worker 2 \(participant 2\) answered the plan handshake with word 1 and "
        r"fingerprint [0-9a-f]+, not 1 and [0-9a-f]+: refused",
    ):
        with structural(tiny_qwen2, args_for_worker={2: ("--inject-fault", "hello-fingerprint@1")}):
            pass
