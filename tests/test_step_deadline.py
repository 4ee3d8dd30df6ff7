"""The per-step deadline's arithmetic and its judgement (runtime/deadline.py, issue 26 item 5), without
processes: the bound follows healthy steps and not slow ones, honest jitter earns no verdict, and the
judgement names a worker only when the accounts leave no other single explanation. The multi-process
runs (a dragging worker named and removed; an honest run never flagged) are in tests/test_slow_steps.py."""

from __future__ import annotations

import random

import pytest

from fusion_compute.errors import UsageError
from fusion_compute.runtime import deadline as D
from fusion_compute.runtime.deadline import CLIENT, StepClock, judge
from fusion_compute.runtime.engine_options import EngineOptions


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(D.time, "monotonic", fake)
    c = StepClock(factor=10, min_s=0.5)

    def step(tokens: int, seconds: float) -> D.Step:
        c.start(tokens)
        fake.now += seconds
        step = c.stop()
        assert step is not None
        return step

    c.step = step  # type: ignore[attr-defined]
    c.fake = fake  # type: ignore[attr-defined]
    return c


def test_no_bound_until_measured_then_factor_or_floor(clock):
    assert clock.deadline(1) is None  # nothing measured: only the per-message timeout holds
    for _ in range(D.WARM):
        clock.step(1, 0.02)
    assert clock.deadline(1) == pytest.approx(0.5)  # 10 x 20 ms is under the floor
    for _ in range(D.KEEP):
        clock.step(1, 0.2)
    assert clock.deadline(1) == pytest.approx(0.5)  # the lowest median stays: slower steps do not raise it
    # an unmeasured size borrows the nearest smaller one's, times its tokens
    assert clock.deadline(40) == pytest.approx(max(0.5, 10 * 0.02 * 40))


def test_slowing_down_little_by_little_does_not_drag_the_bound_up(clock):
    t = 0.1
    for _ in range(D.WARM):
        clock.step(1, t)
        t *= 1.05  # 5 % slower every step: each under 10x the median of the last 16
    first = clock.deadline(1)
    for _ in range(200):
        clock.step(1, t)
        t *= 1.05
    assert clock.deadline(1) == pytest.approx(first) == pytest.approx(10 * 0.105)  # where it was
    assert clock.strikes > 0  # the creep ends in strikes once past it


def test_strikes_and_due(clock):
    for _ in range(D.WARM):
        clock.step(1, 0.1)  # deadline 1.0 s
    assert clock.step(1, 1.5).strikes == 1
    assert clock.step(1, 0.1).strikes == 0
    assert not clock.due()
    assert clock.step(1, 2.2).strikes == 2  # one strike per whole deadline
    assert clock.due()
    assert "2 of the last" in clock.summary()
    clock.forgive()
    assert not clock.due() and clock.deadline(1) == pytest.approx(1.0)


def test_a_step_is_cut_at_strikes_times_its_deadline(clock):
    for _ in range(D.WARM):
        clock.step(1, 0.1)
    clock.start(1)
    clock.fake.now += D.STRIKES * 1.0 - 0.01
    clock.check()  # not yet
    clock.fake.now += 0.02
    with pytest.raises(D.StepOverrun):
        clock.check()
    assert clock.stop(cut=True).strikes == D.STRIKES and clock.due()


def test_factor_zero_is_no_bound(clock):
    clock.factor = 0
    for _ in range(10):
        clock.step(1, 0.01)
    assert clock.deadline(1) is None and clock.step(1, 100.0).strikes == 0


def test_honest_jitter_earns_no_verdict(monkeypatch):
    """A shared machine's step times under the default bound: a lognormal spread (sigma 0.5) around
    30 ms per decode step, prefills of 7 to 300 tokens, and pauses on top (a scheduler or the
    allocator: 0.1 to 1.5 s in 2 % of the steps, 3 s in 0.2 %). 20,000 steps, never judged."""
    fake = FakeTime()
    monkeypatch.setattr(D.time, "monotonic", fake)
    clock = StepClock()  # the defaults: factor 10, at least 2 s
    rng = random.Random(26)
    verdicts = 0
    for _ in range(20000):
        tokens = rng.choice([1] * 20 + [7, 30, 300])
        seconds = 0.03 * tokens**0.8 * rng.lognormvariate(0, 0.5)
        r = rng.random()
        seconds += rng.uniform(0.1, 1.5) if r < 0.02 else 3.0 if r < 0.022 else 0.0
        clock.start(tokens)
        fake.now += seconds
        clock.stop()
        if clock.due():
            verdicts += 1
            clock.forgive()
    assert verdicts == 0, (verdicts, clock.strikes, clock.worst)
    assert clock.steps > 19000  # (the 3 s pauses do earn single strikes: never three in eight steps)


def test_options_are_usage_errors():
    for bad in (dict(step_deadline_factor=0.5), dict(step_deadline_factor=-1), dict(step_deadline_min_s=0)):
        with pytest.raises(UsageError, match="--step-deadline"):
            EngineOptions(**bad).check()
    with pytest.raises(UsageError, match="--step-deadline-factor"):
        EngineOptions(step_deadline_factor=float("nan")).check()
    EngineOptions(step_deadline_factor=0).check()  # off


# ---- the judgement: who kept whom waiting (seconds), CLIENT = the client's own account ----


def test_a_silent_slow_worker_is_named():
    # worker 3 drags every reduce-scatter: its peers wait on it, the client waits on worker 1's egress
    accounts = {CLIENT: {1: 6.8}, 1: {3: 4.5}, 2: {3: 4.2}, 3: {}}
    v = judge(accounts, [1, 2, 3], 1.8)
    assert v.named == 3 and v.causes == (3,)
    assert "worker 1 was kept waiting 4.5 s by worker 3" in v.said


def test_a_slow_worker_that_lies_in_its_account_is_ambiguous_not_misblamed():
    # worker 3 also says worker 1 kept it waiting: worker 1 could be a liar that held back only its
    # messages to 3 (and 2 waits on 3 because of that), so nobody can be removed on this evidence
    accounts = {CLIENT: {1: 6.8}, 1: {3: 4.5}, 2: {3: 4.2}, 3: {1: 4.5}}
    v = judge(accounts, [1, 2, 3], 1.8)
    assert v.named is None and set(v.causes) == {1, 3}


def test_two_workers_one_accusation_is_ambiguous():
    # the previous session's note: with two workers a lone accusation looks like an honest one. Worker
    # 2 drags and says nothing; but worker 1 could as well be late with its egress and lying about 2
    v = judge({CLIENT: {1: 6.0}, 1: {2: 4.5}, 2: {}}, [1, 2], 1.5)
    assert v.named is None and set(v.causes) == {1, 2}


def test_two_workers_a_silent_late_egress_is_named():
    # worker 2 holds back its egress and says nothing: the client waited on it, nobody on worker 1
    v = judge({CLIENT: {2: 6.0}, 1: {}, 2: {}}, [1, 2], 1.5)
    assert v.named == 2


def test_a_worker_late_to_the_client_is_named_by_the_clients_account():
    # worker 2 holds back its egress (the 9 s per egress): no peer waits on it, the client does
    v = judge({CLIENT: {2: 8.0}, 1: {}, 2: {}, 3: {}}, [1, 2, 3], 2.0)
    assert v.named == 2
    # ... and when it blames worker 1 for it, worker 1 cannot be cleared: ambiguous
    v = judge({CLIENT: {2: 8.0}, 1: {}, 2: {1: 8.0}, 3: {}}, [1, 2, 3], 2.0)
    assert v.named is None and set(v.causes) == {1, 2}


def test_a_waiting_chain_leads_to_its_end():
    # worker 4 is slow; worker 2 waits on it, worker 1 waits on 2 (2 was late because of 4)
    v = judge({CLIENT: {1: 5.0}, 1: {2: 3.0}, 2: {4: 3.5}, 3: {4: 3.0}, 4: {}}, [1, 2, 3, 4], 1.0)
    assert v.named == 4


def test_nobody_reports_anything():
    v = judge({CLIENT: {}, 1: {}, 2: {}, 3: {}}, [1, 2, 3], 1.0)
    assert v.named is None and v.causes == () and v.said == "nobody reports being kept waiting"


def test_waits_under_the_threshold_are_no_accusation():
    v = judge({CLIENT: {1: 0.4}, 1: {3: 0.3}, 2: {3: 0.25}}, [1, 2, 3], 1.0)
    assert v.causes == ()


def test_a_liars_accusation_alone_never_names_an_honest_worker():
    """Exhaustively, for three workers: whatever the liar reports, a worker named by the judgement
    is the liar, given honest accounts from the others of a liar that drags everyone."""
    workers = [1, 2, 3]
    for liar in workers:
        honest = {w: {liar: 4.0} for w in workers if w != liar}
        for lie in [{}, *({w: 4.0} for w in workers if w != liar), {w: 4.0 for w in workers if w != liar}]:
            v = judge({CLIENT: {min(set(workers) - {liar}): 6.0}, **honest, liar: lie}, workers, 1.0)
            assert v.named in (None, liar), (liar, lie, v)
