"""The structural client's egress scale check at its boundaries (issue 47), on hand-built shards and
no workers: a token's sum of squares is summed over every worker's shard (a sum, not the largest
part), one token's row at a time (not over the step's tokens), against half of float32's largest
value; and over it, the workers named are those holding more than their even share of the limit
(the limit over N, not the whole), by their participant ids. The multi-process run (a worker sending
±3e38 named and replaced) is tests/test_egress_checks.py's, marked slow."""

from __future__ import annotations

import math
import types

import pytest
import torch

from fusion_compute.errors import WorkerMisbehaved
from fusion_compute.structural import client
from fusion_compute.structural.client import EGRESS_SCALE_LIMIT, Engine

F32_MAX = float(torch.finfo(torch.float32).max)


def engine(order: list[int]) -> Engine:
    """An Engine as far as the check reads it: the epoch's workers (ranks 1..N) and their
    participant ids (`order`)."""
    eng = Engine.__new__(Engine)
    eng.plan = types.SimpleNamespace(workers=[types.SimpleNamespace(rank=r + 1) for r in range(len(order))])
    eng.order = order
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
    """Two workers each hold 0.6 of the limit of token 0: neither part is over the limit, their sum
    is. Both are over their even share (a half) and both are named."""
    L = EGRESS_SCALE_LIMIT
    assert named(engine([4, 7]), [shard(0.6 * L), shard(0.6 * L)]) == [4, 7]
    assert named(engine([4, 7]), [shard(0.49 * L), shard(0.49 * L)]) is None


def test_each_token_is_its_own_row_not_the_steps_sum():
    """Three tokens at 0.8 of the limit each (0.4 from each worker): the step holds 2.4 limits in all,
    and each token's row is under it: honest. One token over: named."""
    L = EGRESS_SCALE_LIMIT
    eng = engine([1, 2])
    assert named(eng, [shard(0.4 * L, 0.4 * L, 0.4 * L), shard(0.4 * L, 0.4 * L, 0.4 * L)]) is None
    assert named(eng, [shard(0.4 * L, 0.4 * L, 0.4 * L), shard(0.4 * L, 0.7 * L, 0.4 * L)]) == [2]


def test_named_are_those_over_their_share_of_the_limit_not_over_the_whole():
    """Three workers: 0.5, 0.3, 0.3 of the limit for one token (1.1 in all). The share is a third:
    only the first is over it. None of them is over the whole limit alone."""
    L = EGRESS_SCALE_LIMIT
    assert named(engine([9, 5, 2]), [shard(0.5 * L), shard(0.3 * L), shard(0.3 * L)]) == [9]
    # the participant named is the shard's worker's, whatever the order of the seats
    assert named(engine([9, 5, 2]), [shard(0.3 * L), shard(0.3 * L), shard(0.5 * L)]) == [2]
    assert named(engine([9, 5, 2]), [shard(0.3 * L), shard(0.5 * L), shard(0.3 * L)]) == [5]


def test_exactly_the_limit_and_exactly_the_even_share_are_not_over_them(monkeypatch):
    """With a limit of 100 (the rule is the same for any), sums of squares of small integers (exact):
    a row of 101, parts 50 (5² + 5²) and 51 (7² + 1 + 1). The share is 50: the worker at exactly
    50 holds no more than its even part and is not named. A row of exactly 100 passes."""
    monkeypatch.setattr(client, "EGRESS_SCALE_LIMIT", 100.0)
    fifty, fifty_one, forty_nine = (
        torch.tensor([[5.0], [5.0]]),
        torch.tensor([[7.0], [1.0], [1.0]]),
        torch.tensor([[7.0]]),
    )
    assert named(engine([1, 2]), [fifty, fifty_one]) == [2]
    assert named(engine([1, 2]), [forty_nine, fifty_one]) is None


def test_the_message_names_the_seat_and_the_participant():
    L = EGRESS_SCALE_LIMIT
    with pytest.raises(WorkerMisbehaved, match=r": worker 2 \(participant 8\): sum of squares 2\.04e\+38$") as e:
        engine([6, 8])._check_egress([shard(0.1 * L), shard(1.2 * L)])
    assert e.value.pids == [8]
