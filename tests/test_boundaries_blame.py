"""Blame's newest guards at their boundaries (issue 47), with fake clocks and hand-built accounts, no
processes: the witness answers for the last `window_s` only (old waits and a long wait in progress
age out, at the exact edge of the window); a worker's own account of a knock-on close; a liar that
leaves with a farewell naming its victim, read off real links by the client; the step deadline of
an unseen width, borrowed from the nearest measured class; strikes, the cut and the judgement's
threshold at their edges."""

from __future__ import annotations

import socket
import time
import types

import pytest

from fusion_compute.comm import liveness
from fusion_compute.comm.errors import PeerLeft, PeerLost, PeerTimeout
from fusion_compute.comm.links import Link, say_farewell
from fusion_compute.comm.liveness import Witness
from fusion_compute.runtime import deadline as D
from fusion_compute.runtime.blame import blame_link, follows
from fusion_compute.runtime.deadline import CLIENT, StepClock, StepOverrun, judge
from fusion_compute.structural.worker import Worker


class FakeClock:
    """time.monotonic for one module: set `now` by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def witness_clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(liveness, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


@pytest.fixture
def step_clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(D, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


# ---- the witness's window ----


def test_old_waits_age_out_of_the_window_at_its_edge(witness_clock):
    w = Witness()
    w.start(7)
    w.charge(2, 0.4)  # at 1000
    witness_clock.now = 1005.0
    w.charge(3, 0.2)
    w.charge(2, 0.1)
    witness_clock.now = 1010.0  # the first wait is exactly window_s old: still in it
    assert w.answer(7, 10)["waits"] == {"2": 0.5, "3": 0.2}
    witness_clock.now = 1010.5  # ... and now out of it
    assert w.answer(7, 10)["waits"] == {"2": 0.1, "3": 0.2}
    assert w.answer(7, 5.5)["waits"] == {"2": 0.1, "3": 0.2}  # a shorter window, asked: its own edge
    assert w.answer(7, 5.4)["waits"] == {}
    witness_clock.now = 1016.0
    assert w.answer(7, 10)["waits"] == {}
    assert w.answer(7, 20)["waits"] == {"2": 0.5, "3": 0.2}  # aged out of the question, not forgotten


def test_a_long_wait_in_progress_counts_only_inside_the_window(witness_clock):
    w = Witness()
    w.start(1)
    w.waiting_on(frozenset({3}), since=1000.0)
    witness_clock.now = 1003.0
    assert w.answer(1, 10)["waits"] == {"3": 3.0}
    witness_clock.now = 1100.0  # blocked on 3 for 100 s: the last 10 of them are the window's
    w.charge(3, 0.5)  # (a finished wait on 3 inside the window adds to it)
    a = w.answer(1, 10)
    assert a["waits"] == {"3": 10.5} and a["waiting"] == [3]
    # blocked on two peers at once: the wait is neither's alone, nobody is charged
    w.waiting_on(frozenset({2, 3}), since=1000.0)
    a = w.answer(1, 10)
    assert a["waits"] == {"3": 0.5} and a["waiting"] == [2, 3]
    # waiting for the client is what an idle worker does: not a wait on a peer
    w.waiting_on(frozenset({0, 2}), since=1095.0)
    assert w.answer(1, 10)["waits"] == {"2": 5.0, "3": 0.5}
    w.waiting_on(frozenset({0}), since=1000.0)
    assert w.answer(1, 10) == {
        "epoch": 1,
        "lost": None,
        "after": None,
        "waits": {"3": 0.5},
        "waiting": [],
        "working": False,
    }


def test_the_client_and_empty_waits_are_never_charged(witness_clock):
    w = Witness()
    w.start(1)
    w.charge(0, 2.0)
    w.charge(2, 0.0)
    assert w.answer(1, 10)["waits"] == {}


def test_another_epochs_question_gets_an_empty_account(witness_clock):
    w = Witness()
    w.start(4)
    w.charge(2, 1.0)
    w.lost_peer(2)
    assert w.answer(5, 10) == {"epoch": 5, "lost": None, "after": None, "waits": {}, "waiting": [], "working": False}
    w.start(5)  # a new epoch forgets the last one's
    assert w.answer(5, 10)["waits"] == {} and w.answer(5, 10)["lost"] is None


# ---- a worker's own account of why it left ----


def leave(err: BaseException, before: tuple[str, int] | None = None) -> dict:
    """A worker's account after its epoch ended on `err` (Worker._leaving, on a worker that holds only
    its witness; no links to say it on), `before`: what it had noted already."""
    worker = types.SimpleNamespace(witness=Witness(), _aborted=False)
    worker.witness.start(1)
    if before is not None:
        getattr(worker.witness, before[0])(before[1])
    Worker._leaving(worker, {}, err)
    a = worker.witness.answer(1, 10)
    return {"lost": a["lost"], "after": a["after"]}


def test_a_knock_on_close_is_noted_as_after_not_lost():
    assert leave(PeerLeft(3, "worker 3 closed the connection: oom", {"why": "oom"})) == {"lost": None, "after": 3}
    assert leave(PeerLost(3, "worker 3 closed the connection")) == {"lost": 3, "after": None}
    assert leave(PeerTimeout(2, "worker 2 did not answer")) == {"lost": 2, "after": None}
    # the watch's verdict, or its own error: nothing about a peer
    assert leave(PeerTimeout(2, "no heartbeat", watched=True)) == {"lost": None, "after": None}
    assert leave(RuntimeError("oom")) == {"lost": None, "after": None}
    # the first word stands: what failed it first is its account, not what came after
    assert leave(PeerLeft(3, "x", {}), before=("lost_peer", 2)) == {"lost": 2, "after": None}
    assert leave(PeerLost(3, "x"), before=("left_after", 2)) == {"lost": None, "after": 2}
    assert leave(PeerLost(0, "the client closed the connection")) == {"lost": None, "after": None}


# ---- a liar that leaves with a farewell, its words read off real links ----


def tcp() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    return ours, theirs


def test_a_liar_leaving_with_a_farewell_naming_its_victim_is_only_ambiguous():
    """Workers 1 (the liar), 2 (its victim), 3, and the client (0), linked pairwise on loopback. The
    liar leaves first, saying on every link that 2 failed it (`cause: 2`, the lie). Worker 2 and 3
    read its farewell and leave as a knock-on (`after: 1`); the client reads each worker's farewell
    (Link.departure) and weighs them with the accounts: the liar's word against 2's, nobody removed,
    the ambiguous set {1, 2} (a standby takes both seats: membership.py); 3 is in nothing."""
    ranks = [0, 1, 2, 3]
    links: dict[int, dict[int, Link]] = {r: {} for r in ranks}
    for i, a in enumerate(ranks):
        for b in ranks[i + 1 :]:
            sa, sb = tcp()
            links[a][b], links[b][a] = Link(sa, None, b, f"rank {b}"), Link(sb, None, a, f"rank {a}")
    try:
        witnesses = {r: Witness() for r in (1, 2, 3)}
        for w in witnesses.values():
            w.start(1)
        witnesses[1].lost_peer(2)  # the lie, in its account too
        say_farewell(links[1], PeerLost(2, "worker 2 closed the connection"))
        for r in (2, 3):  # each reads the liar's farewell on its link to it, and leaves because of it
            with pytest.raises(PeerLeft) as e:
                links[r][1].recv_size(time.monotonic() + 2)
            witnesses[r].left_after(e.value.rank)
            say_farewell({p: link for p, link in links[r].items() if p != 1}, e.value)
        seen = {r: (links[0][r].departure(), links[0][r].left) for r in (1, 2, 3)}
        assert seen == {
            1: ("left", {"cause": 2, "after": None, "inputs": False, "why": "worker 2 closed the connection"}),
            2: (
                "left",
                {
                    "cause": None,
                    "after": 1,
                    "inputs": False,
                    "why": "rank 1 closed the connection: worker 2 closed the connection",
                },
            ),
            3: (
                "left",
                {
                    "cause": None,
                    "after": 1,
                    "inputs": False,
                    "why": "rank 1 closed the connection: worker 2 closed the connection",
                },
            ),
        }
        accounts = {r: w.answer(1, 10) for r, w in witnesses.items()}
        named, verdict = blame_link(accounts, seen, [1, 2, 3], {1, 2, 3}, {CLIENT: {}}, 1.0)
        assert named == set() and set(verdict.causes) == {1, 2}, verdict
        # the same liar, had it stayed (its link to the client open): its accusation is not counted,
        # and the victim, which left naming nobody first-hand, is not the one removed
        named, verdict = blame_link(accounts, {**seen, 1: ("open", None)}, [1, 2, 3], {1, 2, 3}, {CLIENT: {}}, 1.0)
        assert 2 not in named and 2 not in verdict.causes, verdict
    finally:
        for ends in links.values():
            for link in ends.values():
                link.close()


# ---- the step deadline of an unseen width ----


def clock_with(fake: FakeClock, measured: dict[int, float], min_s: float = 0.01) -> StepClock:
    """A StepClock (factor 10) that saw WARM healthy steps of each {tokens: seconds}."""
    c = StepClock(factor=10, min_s=min_s)
    for tokens, seconds in measured.items():
        for _ in range(D.WARM):
            c.start(tokens)
            fake.now += seconds
            assert c.stop() is not None
    return c


def test_an_unseen_width_borrows_from_the_nearest_smaller_measured_class(step_clock):
    """Classes 1 (one token, 10 ms) and 3 (4 tokens, 80 ms) measured. A step of T tokens in an
    unmeasured class c borrows the base of the nearest measured class k < c, times T over that
    class's smallest step 2^(k-1): a step of T tokens costs at most T / 2^(k-1) steps of class k."""
    c = clock_with(step_clock, {1: 0.01, 4: 0.08})
    assert c.deadline(1) == pytest.approx(0.1)  # measured: 10 x 10 ms
    assert c.deadline(4) == pytest.approx(0.8)  # measured, the class's own: 10 x 80 ms
    assert c.deadline(7) == pytest.approx(0.8)  # class 3 too (4-7 tokens)
    assert c.deadline(2) == pytest.approx(10 * 0.01 * 2)  # class 2: from class 1 (2 steps of one)
    assert c.deadline(3) == pytest.approx(10 * 0.01 * 3)
    assert c.deadline(8) == pytest.approx(10 * 0.08 * 8 / 4)  # class 4: from class 3, not class 1
    assert c.deadline(20) == pytest.approx(10 * 0.08 * 20 / 4)  # class 5: still the nearest, class 3
    # the floor holds over a borrowed bound too
    assert clock_with(step_clock, {1: 0.01}, min_s=0.5).deadline(3) == pytest.approx(0.5)


def test_no_bound_from_a_larger_class_only(step_clock):
    """Only 4-token steps measured: a 1- to 3-token step has no bound (a larger step's time says
    nothing of a smaller one's), and the per-message timeout alone holds."""
    c = clock_with(step_clock, {4: 0.08})
    assert [c.deadline(t) for t in (1, 2, 3)] == [None, None, None]
    assert c.deadline(4) == pytest.approx(0.8)


def test_a_class_is_measured_after_exactly_warm_healthy_steps(step_clock):
    c = StepClock(factor=10, min_s=0.01)
    for i in range(D.WARM):
        assert c.deadline(1) is None, i
        c.start(1)
        step_clock.now += 0.01
        c.stop()
    assert c.deadline(1) == pytest.approx(0.1)


# ---- strikes, the cut and the judgement at their edges ----


def test_strikes_are_whole_deadlines_and_due_at_exactly_strikes(step_clock):
    c = clock_with(step_clock, {1: 0.01})  # deadline 0.1 s
    d = c.deadline(1)
    assert d == pytest.approx(0.1)
    got = []
    for seconds in (0.099, 0.1, 0.25):  # just under: none; exactly one deadline: one; 2.5: two
        c.start(1)
        step_clock.now += seconds
        step = c.stop()
        assert step is not None
        got.append(step.strikes)
    assert got == [0, 1, 2]
    assert c.due()  # 3 strikes: exactly STRIKES
    c.forgive()
    c.start(1)
    step_clock.now += 0.25
    c.stop()
    assert not c.due()  # 2 strikes
    assert c.deadline(1) == pytest.approx(0.1)  # slow steps teach the bound nothing


def test_a_step_is_cut_at_exactly_strikes_times_its_deadline(step_clock):
    c = clock_with(step_clock, {1: 0.01})
    c.start(1)
    step_clock.now += D.STRIKES * 0.1 - 1e-6
    c.check()  # not yet
    step_clock.now += 2e-6
    with pytest.raises(StepOverrun):
        c.check()
    c.check()  # cut once
    step = c.stop(cut=True)
    assert step is not None and step.strikes == D.STRIKES


def test_an_account_of_exactly_the_threshold_is_an_accusation():
    assert judge({CLIENT: {2: 1.0}, 1: {}, 2: {}}, [1, 2], 1.0).named == 2
    v = judge({CLIENT: {2: 0.999}, 1: {}, 2: {}}, [1, 2], 1.0)
    assert v.named is None and v.causes == ()


# ---- the ambiguity that follows one worker ----


def test_follows_a_suspect_isolated_by_one_earlier_set_though_another_shares_more():
    """Worker 2 was ambiguous with 1, then with 3, and is again with 3: the first set isolates 2 (it
    shares only 2 with this one); the second shares the whole pair, which tells nothing. Being in an
    earlier set is not enough: 3 was in one too."""
    assert follows([frozenset({1, 2}), frozenset({2, 3})], (2, 3)) == 2
    assert follows([frozenset({2, 3})], (2, 3)) is None
    assert follows([frozenset({1, 2, 3})], (2, 3)) is None


def test_many_short_waits_add_up_before_they_are_rounded(witness_clock):
    """The answer is rounded to 0.1 ms once, not after each wait added: 1000 waits of 40 µs each are
    40 ms (rounded after each addition, each one vanished and the account said 0), and 1000 of 60 µs
    are 60 ms (not 100 ms)."""
    w = Witness()
    w.start(1)
    for _ in range(1000):
        w.charge(2, 40e-6)
        w.charge(3, 60e-6)
    assert w.answer(1, 10)["waits"] == {"2": 0.04, "3": 0.06}
