"""What the structural client checks of what a listed worker sends (issues 26, 36): an egress shard
with NaN or infinity, or of a scale no honest residual has (±3e38), names that worker and removes it
(a standby takes its seat), instead of becoming token 0 or a sampling error; so does a row of logits
that is constant or not finite; a plan handshake that says yes with another fingerprint is refused,
naming the worker. The liars are the real `fusion worker` with a fault injected (faults.py)."""

from __future__ import annotations

import pytest
from test_faults import NEW, run, structural

from fusion_compute.errors import WorkerMisbehaved
from fusion_compute.model.config import ModelError


def test_nan_egress_names_the_worker_and_a_standby_takes_its_seat(tiny_qwen2):
    # worker 2's forward NEW + 12: the 12th of the second request (the first makes NEW forwards)
    with structural(tiny_qwen2, standby=1, args_for_worker={2: ("--inject-fault", f"nan-egress@{NEW + 12}")}) as eng:
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


@pytest.mark.slow
def test_huge_finite_egress_names_the_worker_and_a_standby_takes_its_seat(tiny_qwen2):
    """Issue 36: ±3e38 is finite, so the finiteness check let it through; the final norm's float32
    sum of squares overflowed, every logit became 0 and greedy emitted token 0, naming nobody. The
    scale check (its sum of squares in float64 against what float32 can carry) names the worker."""
    with structural(tiny_qwen2, standby=1, args_for_worker={1: ("--inject-fault", f"huge-egress@{NEW + 12}")}) as eng:
        ref = run(eng).token_ids
        with pytest.raises(
            WorkerMisbehaved,
            match=r"egress beyond any residual the model can produce .*: worker 1 \(participant 1\): sum of squares",
        ) as e:
            run(eng)
        assert e.value.pids == [1]
        assert 1 not in eng.order and 3 in eng.order and eng.recoveries[-1]["lost"] == [1]
        assert "impossible scale" in eng.recoveries[-1]["reason"], eng.recoveries[-1]
        assert run(eng).token_ids == ref  # the next request runs on the new epoch, with the no-fault tokens


def test_a_constant_or_non_finite_row_of_logits_suspects_every_contributor(tiny_qwen2):
    """The last line of defence, after the shard checks: a row of logits no honest step makes. Shards
    that passed their checks were made from every worker's partials, so a liar could have fed an
    honest worker what makes the row (issue 41): every worker is a suspect, none convicted, the one
    holding the largest share of that token's residual first. The engine's own check, on a real
    plan, fed the shards such a row comes from."""
    import torch

    from fusion_compute.errors import WorkersSuspected
    from fusion_compute.runtime.deadline import StepClock
    from fusion_compute.runtime.membership import Membership, Seat
    from fusion_compute.structural.client import Engine
    from fusion_compute.structural.plan import make_plan
    from fusion_compute.weights.loader import open_weights

    eng = Engine.__new__(Engine)  # the check reads the epoch's plan and order only: no workers needed
    eng.plan = make_plan(open_weights(tiny_qwen2).config, 2, (1.0, 1.0))
    eng.members = Membership(eng, {4: Seat(4), 7: Seat(7)}, StepClock())  # its epoch: participants 4, 7
    a, b = (torch.randn(s.n_residual, 3) for s in eng.plan.workers)
    fine = torch.randn(3, 256)
    eng._check_logits(fine, [a, b], [0, 1, 2])  # an honest row passes
    b[:, 2] *= 1e6  # worker 2 dominates token 2's residual
    flat = fine.clone()
    flat[1] = 0.5
    with pytest.raises(WorkersSuspected, match=r"a row of logits is constant: .*suspects \[7, 4\]") as e:
        eng._check_logits(flat, [a, b], [0, 2])
    assert e.value.pids == [7, 4] and not isinstance(e.value, WorkerMisbehaved)
    nan = fine.clone()
    nan[2, 5] = float("inf")
    with pytest.raises(WorkersSuspected, match=r"not finite: .*\[4, 7\]|not finite: .*\[7, 4\]"):
        eng._check_logits(nan, [a, b], [0, 1, 2])


def test_hello_with_another_fingerprint_is_refused(tiny_qwen2):
    with pytest.raises(
        ModelError,
        match=r"worker 2 \(participant 2\) answered the plan handshake with word 1 and "
        r"fingerprint [0-9a-f]+, not 1 and [0-9a-f]+: refused",
    ):
        with structural(tiny_qwen2, args_for_worker={2: ("--inject-fault", "hello-fingerprint@1")}):
            pass
