"""The structural client's egress scale check at its boundaries (issue 47), on hand-built egresses
and no workers. An egress is a worker's full-width partial of the final residual (the last layer's
down partial, its residual rows added; the client sums the N of them: issue 43): a token's sum of
squares is that of the summed row (the partials added, not their sums of squares, and not the
largest part), one token's row at a time (not over the step's tokens), against half of float32's
largest value; and over it, the workers named are those whose egress holds more than the limit over
N² (N parts each within it sum to a row within the limit), by their participant ids. The multi-process run (a worker sending
±3e38 named and replaced) is tests/test_egress_checks.py's, marked slow."""

from __future__ import annotations

import math
import types

import pytest
import torch

from fusion_compute.errors import WorkerMisbehaved
from fusion_compute.runtime.deadline import StepClock
from fusion_compute.runtime.membership import Membership, Seat
from fusion_compute.structural import client
from fusion_compute.structural.client import EGRESS_SCALE_LIMIT, Engine

F32_MAX = float(torch.finfo(torch.float32).max)


def engine(order: list[int]) -> Engine:
    """An Engine as far as the check reads it: the epoch's workers (ranks 1..N) and their
    participant ids (`order`)."""
    eng = Engine.__new__(Engine)
    eng.plan = types.SimpleNamespace(workers=[types.SimpleNamespace(rank=r + 1) for r in range(len(order))])
    eng.members = Membership(eng, {p: Seat(p) for p in order}, StepClock())  # its epoch: `order`
    return eng


def shard(*col_sumsq: float, rows: int = 4) -> torch.Tensor:
    """A float32 (rows, T) shard whose column t's sum of squares is col_sumsq[t] (one value per column,
    in the first row: its square root)."""
    out = torch.zeros(rows, len(col_sumsq))
    for t, s in enumerate(col_sumsq):
        out[0, t] = math.sqrt(s)
    return out


def named(eng: Engine, shards: list[torch.Tensor]) -> list[int] | None:
    """The participants the check names, or None when it passes."""
    try:
        eng._check_egress(shards)
    except WorkerMisbehaved as e:
        assert "impossible scale" in e.reason
        return e.pids
    return None


def test_the_limit_is_half_of_float32s_largest_value():
    assert EGRESS_SCALE_LIMIT == F32_MAX / 2
    eng = engine([3])
    assert named(eng, [shard(0.45 * F32_MAX)]) is None  # the norm's float32 sum carries it
    assert named(eng, [shard(0.55 * F32_MAX)]) == [3]  # finite, and still over half of it


def test_a_tokens_row_is_summed_over_the_workers_not_its_largest_part():
    """Two workers' partials of token 0, 0.3 of the limit each in the same coordinate: neither is over
    the limit, their sum (1.2 of it) is. Both are over their share (a quarter) and both are named.
    At 0.2 each the sum is 0.8: it passes. Opposite signs cancel: the partials are added, not their
    squares."""
    L = EGRESS_SCALE_LIMIT
    assert named(engine([4, 7]), [shard(0.3 * L), shard(0.3 * L)]) == [4, 7]
    assert named(engine([4, 7]), [shard(0.2 * L), shard(0.2 * L)]) is None
    assert named(engine([4, 7]), [shard(0.9 * L), -shard(0.9 * L)]) is None


def test_each_token_is_its_own_row_not_the_steps_sum():
    """Three tokens at 0.8 of the limit each (0.2 from each worker, summed): the step holds 2.4
    limits in all, and each token's row is under it: honest. One token over (0.2 and 0.7: 1.65):
    named, the worker over its quarter only."""
    L = EGRESS_SCALE_LIMIT
    eng = engine([1, 2])
    assert named(eng, [shard(0.2 * L, 0.2 * L, 0.2 * L), shard(0.2 * L, 0.2 * L, 0.2 * L)]) is None
    assert named(eng, [shard(0.2 * L, 0.2 * L, 0.2 * L), shard(0.2 * L, 0.7 * L, 0.2 * L)]) == [2]


def test_named_are_those_over_their_share_of_the_limit_not_over_the_whole():
    """Three workers: 0.5, 0.1, 0.1 of the limit for one token, summed in one coordinate (1.87 in
    all). The share is a ninth: only the first is over it. None of them is over the whole limit."""
    L = EGRESS_SCALE_LIMIT
    assert named(engine([9, 5, 2]), [shard(0.5 * L), shard(0.1 * L), shard(0.1 * L)]) == [9]
    # the participant named is the shard's worker's, whatever the order of the seats
    assert named(engine([9, 5, 2]), [shard(0.1 * L), shard(0.1 * L), shard(0.5 * L)]) == [2]
    assert named(engine([9, 5, 2]), [shard(0.1 * L), shard(0.5 * L), shard(0.1 * L)]) == [5]


def test_exactly_the_limit_and_exactly_the_even_share_are_not_over_them(monkeypatch):
    """With a limit of 100 (the rule is the same for any), small integers (exact): partials (3, 4, 0)
    (sum of squares 25) and (6, 1, 1) (38) sum to (9, 5, 1), a row of 107. The share is 100 / 2² = 25:
    the worker at exactly 25 is not named. Partials (3, 4, 0) twice sum to (6, 8, 0), a row of
    exactly 100: it passes."""
    monkeypatch.setattr(client, "EGRESS_SCALE_LIMIT", 100.0)
    twenty_five, thirty_eight = torch.tensor([[3.0], [4.0], [0.0]]), torch.tensor([[6.0], [1.0], [1.0]])
    assert named(engine([1, 2]), [twenty_five, thirty_eight]) == [2]
    assert named(engine([1, 2]), [twenty_five, twenty_five.clone()]) is None


def test_the_message_names_the_seat_and_the_participant():
    L = EGRESS_SCALE_LIMIT
    with pytest.raises(WorkerMisbehaved, match=r": worker 2 \(participant 8\): sum of squares 2\.04e\+38$") as e:
        engine([6, 8])._check_egress([shard(0.1 * L), shard(1.2 * L)])
    assert e.value.pids == [8]
