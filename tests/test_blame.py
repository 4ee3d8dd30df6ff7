"""Blame by evidence a liar cannot forge or launder (issue 36, items 1-3; runtime/blame.py,
runtime/deadline.py judge, comm.Comm's waits), without worker processes: the rules on every pattern
the red team and the audits named, and the comm layer's charge of a wait to the peer that caused it.
The multi-process runs of the same scenarios are in tests/test_hostile_blame.py."""

from __future__ import annotations

import itertools
import socket
import threading
import time

import pytest
import torch

from fusion_compute.comm import Comm, PeerLeft, Witness
from fusion_compute.comm.links import Link, farewell_reason
from fusion_compute.runtime.blame import blame_link, follows
from fusion_compute.runtime.deadline import CLIENT, judge

W3 = [1, 2, 3]


def left(cause: int | None = None, after: int | None = None, why: str = "") -> tuple[str, dict]:
    return ("left", {"cause": cause, "after": after, "why": why})


OPEN = ("open", None)
CLOSED = ("closed", None)


def account(lost: int | None = None, after: int | None = None, waits: dict | None = None, waiting=()) -> dict:
    return {"lost": lost, "after": after, "waits": waits or {}, "waiting": list(waiting)}


def blame(accounts, seen, workers=W3, owed=None, blocked=None, threshold=1.0):
    """blame_link; `owed`: whose step output the client still waited for (default: every worker
    that did not leave... i.e. all of them: the failure came while it waited for the step)."""
    owed = set(workers) if owed is None else owed
    return blame_link(accounts, seen, workers, owed, blocked or {CLIENT: {}}, threshold)


# ---- the link-closing liar (the red team's item 3), at every rank, against every victim ----


@pytest.mark.parametrize(("liar", "victim"), [(2, 1), (1, 2), (3, 1), (3, 2), (1, 3)])
def test_link_closing_liar_is_named_not_its_victim(liar, victim):
    """The liar shuts only its link to the victim, says the victim failed it, and stays. The victim
    leaves naming the liar; the third worker leaves as a knock-on of the victim's farewell and
    testifies to nothing first-hand (before: it named the victim, whose links it saw close)."""
    third = next(w for w in W3 if w not in (liar, victim))
    accounts = {liar: account(lost=victim), victim: account(lost=liar), third: account(after=victim)}
    seen = {liar: OPEN, victim: left(cause=liar), third: left(after=victim)}
    named, v = blame(accounts, seen)
    assert named == {liar}, v
    assert f"worker {liar} names worker {victim} but did not leave naming it" in v.said


def test_a_liar_that_leaves_naming_its_victim_is_only_ambiguous():
    """The better liar: it leaves too, naming its victim on every link. Two workers naming each other,
    each having left: nothing tells them apart (and the knock-on third adds nothing)."""
    accounts = {2: account(lost=1), 1: account(lost=2), 3: account(after=1)}
    seen = {2: left(cause=1), 1: left(cause=2), 3: left(after=1)}
    named, v = blame(accounts, seen)
    assert named == set() and set(v.causes) == {1, 2}


def test_a_one_sided_accusation_is_not_enough():
    """Worker 2 leaves naming 1; worker 1 says 2's farewell came first (and left as its knock-on).
    One side's word: ambiguous, and the accused is not removed."""
    accounts = {2: account(lost=1), 1: account(after=2), 3: account(after=2)}
    seen = {2: left(cause=1), 1: left(after=2), 3: left(after=2)}
    named, v = blame(accounts, seen)
    assert named == set() and set(v.causes) == {1, 2} and v.causes[0] == 1  # the accused first


def test_an_accusation_from_the_worker_that_closed_the_link():
    """Worker 3 closed its link to 1 itself (silently) and accuses 1; it never left. Worker 1 left
    naming 3. The closer's accusation is not counted; the closer is named."""
    accounts = {3: account(lost=1), 1: account(lost=3), 2: account(after=1)}
    seen = {3: OPEN, 1: left(cause=3), 2: left(after=1)}
    assert blame(accounts, seen)[0] == {3}
    # ... and one that closed its link to the client without a farewell as well: the same
    assert blame(accounts, {**seen, 3: CLOSED})[0] == {3}


def test_knock_on_closes_accuse_nobody():
    """Before: a close was first-hand evidence against whoever closed. A worker that left after a
    peer's farewell is no accuser, and no accused: the chain ends at the first leaver's cause."""
    accounts = {1: account(lost=3), 2: account(after=1), 3: account()}
    seen = {1: left(cause=3), 2: left(after=1), 3: OPEN}
    named, v = blame(accounts, seen)
    assert named == {3} and "worker 2" not in v.said


def test_an_accused_worker_that_owes_nothing_or_waits_is_not_removed():
    """The accused stayed, but: the client already had its step's output (it finished: a liar that
    then leaves naming it proves nothing), or the failure came before the client waited for outputs
    (a liar closed everything between steps: the accused, idle, had no reason to notice), or it says
    it is blocked on a peer (its accuser went silent on it, or a chain ending there). Ambiguous."""
    accounts = {2: account(lost=1), 1: account(), 3: account()}
    seen = {2: left(cause=1), 1: OPEN, 3: OPEN}
    for owed in (set(), {2, 3}):
        named, v = blame(accounts, seen, owed=owed)
        assert named == set() and set(v.causes) == {1, 2}, owed
    for waiting in ([2], [3]):
        named, v = blame({**accounts, 1: account(waiting=waiting)}, seen)
        assert named == set() and set(v.causes) == {1, 2}, waiting
    assert blame(accounts, seen, owed={1, 2, 3})[0] == {1}  # owed, stayed, waits on nobody: two sides


def test_a_worker_that_leaves_on_its_own_error_is_the_one():
    accounts = {1: account(after=2), 2: account(), 3: account(after=2)}
    seen = {1: left(after=2), 2: left(why="RuntimeError: out of memory"), 3: left(after=2)}
    named, v = blame(accounts, seen)
    assert named == {2} and "out of memory" in v.said


def test_no_farewell_evidence_falls_back_to_the_waits():
    accounts = {1: account(waits={3: 4.0}), 2: account(waits={3: 4.0}), 3: account()}
    named, _ = blame(accounts, {w: OPEN for w in W3}, blocked={CLIENT: {}, 1: {3: 4.0}, 2: {3: 4.0}, 3: {}})
    assert named == {3}


def test_one_liar_among_three_never_gets_an_honest_worker_removed():
    """Exhaustively: honest workers follow the protocol and their accounts are true. One whose link
    fails first-hand leaves naming that peer; one that receives a farewell leaves as its knock-on;
    one whose links stay whole is, when the failure came mid-step, either blocked on a peer (the
    liar, or another honest worker) or done with its step (the client has its output), and after the
    first honest leaver's farewell it leaves as its knock-on; when the failure came before the
    step's outputs were due it may sit idle. The liar does anything to each link to an honest peer
    (nothing, shut it silently or stall on it, say a farewell on it), says anything in its account
    and does anything on its link to the client. Whatever it picks, a worker removed is the liar,
    and the liar is in every ambiguous set."""
    for liar in W3:
        honest = [w for w in W3 if w != liar]
        lies = [account(), *(account(lost=w) for w in honest), *(account(after=w) for w in honest)]
        lies += [account(lost=w, waiting=[w]) for w in honest]
        conducts = [OPEN, CLOSED, left(), *(left(cause=w) for w in honest), *(left(after=w) for w in honest)]
        for acts in itertools.product(["none", "shut", "farewell"], repeat=len(honest)):
            act = dict(zip(honest, acts, strict=True))
            for midstep, knock_on in itertools.product((True, False), repeat=2):
                accs, seens = {}, {}
                for h in honest:
                    if act[h] == "shut":
                        accs[h], seens[h] = account(lost=liar), left(cause=liar)
                    elif act[h] == "farewell":
                        accs[h], seens[h] = account(after=liar), left(after=liar)
                first = next((h for h in honest if h in accs), None)
                open_states = []
                for h in honest:
                    if h in accs:
                        continue
                    if first is not None and midstep and knock_on:
                        accs[h], seens[h] = account(after=first), left(after=first)
                    else:  # blocked on anyone else, or done (owes nothing), or idle (not mid-step)
                        options = (
                            [("blocked", w) for w in W3 if w != h] + [("done", None)] if midstep else [("idle", None)]
                        )
                        open_states.append((h, options))
                for picks in itertools.product(*(opts for _, opts in open_states)):
                    a2, s2 = dict(accs), dict(seens)
                    owed = {liar} if midstep else set()
                    for (h, _), (state, on) in zip(open_states, picks, strict=True):
                        a2[h], s2[h] = account(waiting=[on] if state == "blocked" else []), OPEN
                        if state == "blocked":
                            owed.add(h)
                    for lie, conduct in itertools.product(lies, conducts):
                        named, v = blame({**a2, liar: lie}, {**s2, liar: conduct}, owed=owed)
                        case = (liar, act, midstep, picks, lie, conduct, v)
                        assert named <= {liar}, case
                        if not named and v.causes:
                            assert liar in v.causes and v.liar_only, case


# ---- farewells checked against what else the client holds (issue 41 item 2) ----


def test_a_farewell_that_contradicts_its_own_account_removes_its_sayer():
    """Worker 3 tells the client it left after worker 1's farewell, and its own account says worker 1
    failed it first-hand (or names another peer): one of its two statements is a lie, and both are
    its own. It is removed; an honest worker says both from the one error that ended its epoch."""
    accounts = {1: account(lost=3), 2: account(after=1), 3: account(lost=1)}
    seen = {1: left(cause=3), 2: left(after=1), 3: left(after=1)}
    named, v = blame(accounts, seen)
    assert named == {3} and "worker 3's farewell (cause None, after 1) contradicts its own account" in v.said
    named, _ = blame({**accounts, 3: account(after=2)}, seen)  # its account names another peer
    assert named == {3}
    # the negative control: the same farewell with an account that agrees (or none) is only ambiguous
    for agreeing in (account(after=1), account()):
        named, v = blame({**accounts, 3: agreeing}, seen)
        assert named == set() and set(v.causes) == {1, 3}, v


def test_two_workers_each_leaving_after_the_other_are_ambiguous():
    """Each says it left after the other's farewell: both cannot be true (an honest farewell carries
    the reason decided before it was sent), so one lies: both are suspects (before: no accusation
    counted, the waits named nobody, and nobody was set aside)."""
    accounts = {1: account(after=2), 2: account(after=1), 3: account(after=1)}
    seen = {1: left(after=2), 2: left(after=1), 3: left(after=1)}
    named, v = blame(accounts, seen)
    assert named == set() and set(v.causes) == {1, 2} and "one of them lies" in v.said
    # the negative control: a chain of knock-ons (2 after 1, 3 after 1) is nobody's fault here
    seen[1], accounts[1] = left(after=None), account()
    named, v = blame(accounts, seen)
    assert named == {1}  # worker 1 left on its own error, by its own word (rule 2)


def test_the_forged_knock_on_and_its_mirror_leave_the_same_evidence():
    """Issue 41's item 2: the liar (3) cuts its link to worker 1 and says it left after 1's farewell,
    while 1 names 3 first-hand. The mirror: the liar (1) names honest 3 in its farewell to the client
    and says farewell to 3, which honestly leaves after 1. The client holds the same evidence in
    both, so removing the claimant (as the issue proposed) would remove honest 3 in the mirror: both
    are suspects, and the ambiguity that follows the liar removes it (below)."""
    accounts = {1: account(lost=3), 2: account(after=1), 3: account(after=1)}
    seen = {1: left(cause=3), 2: left(after=1), 3: left(after=1)}
    named, v = blame(accounts, seen)
    assert named == set() and set(v.causes) == {1, 3}, v


# ---- the ambiguity that follows one worker ----


def test_follows_names_the_common_suspect_of_two_different_pairs():
    assert follows([], (1, 2)) is None
    assert follows([frozenset({1, 2})], (2, 3)) == 2  # 2 was ambiguous with 1, now with 3
    assert follows([frozenset({1, 2})], (1, 2)) is None  # the same pair again: still no way to tell
    assert follows([frozenset({1, 2}), frozenset({3, 4})], (2, 4)) is None  # two candidates


def test_follows_names_a_liar_that_returns_to_its_first_partner():
    """Liveness (issue 41): the liar paired with worker 1, then with worker 4, then with 1
    again is named at the second pairing and at the third. "x is in any earlier set" instead of
    "the only worker an earlier set shares" names nobody at the third (1 and 3 both were)."""
    assert follows([frozenset({1, 3})], (3, 4)) == 3
    assert follows([frozenset({1, 3}), frozenset({3, 4})], (1, 3)) == 3
    assert follows([frozenset({1, 3}), frozenset({1, 3})], (3, 4)) == 3  # twice with one, then another
    # sets that hold every worker of the epoch (the client's logits check, an `inputs` farewell)
    assert follows([frozenset({1, 2, 3})], (1, 2, 3)) is None
    assert follows([frozenset({1, 2, 3})], (3, 4, 5)) == 3


def test_one_liar_is_in_every_ambiguous_set_so_follows_never_names_an_honest_worker():
    """Every ambiguous set holds the liar (the test above): any two of them share the liar, so no
    honest worker is ever the only one two sets share."""
    workers = [1, 2, 3, 4, 5]
    liar = 4
    sets = [frozenset({liar, h}) for h in workers if h != liar] + [frozenset({liar, 1, 2})]
    for history in itertools.permutations(sets, 3):
        for i in range(1, len(history)):
            assert follows(list(history[:i]), tuple(history[i])) in (None, liar)


def test_only_sets_that_hold_a_liar_are_marked_to_feed_follows():
    """Verdict.liar_only: the sets blame_link makes from first-hand evidence (rule 4's counted
    accusation, 5's tainted farewell, a mutual or ringed `after`) are marked; a set judged on waits
    (rule 6, deadline.judge: one worker's word, which the machine's load alone can make between two
    honest workers) is not, nor is any verdict of judge's. membership._ambiguous lets only the marked
    ones into follows (tests/test_redteam_41.py drives it)."""
    liar_leaves_naming_1 = blame(
        {1: account(after=3), 2: account(after=3), 3: account(lost=1)},
        {1: left(after=3), 2: left(after=3), 3: left(cause=1)},
        owed={3},
    )
    mutual = blame(
        {1: account(after=2), 2: account(after=1), 3: account(after=1)},
        {1: left(after=2), 2: left(after=1), 3: left(after=1)},
    )
    tainted = blame_link(
        {1: account(), 2: account(after=1), 3: account(after=1)},
        {1: ("left", {"cause": None, "after": None, "inputs": True, "why": ""}), 2: left(after=1), 3: left(after=1)},
        W3,
        {1},
        {CLIENT: {}},
        1.0,
    )
    for named, v in (liar_leaves_naming_1, mutual, tainted):
        assert named == set() and len(v.causes) >= 2 and v.liar_only, v
    # rule 6: nobody left, one worker's word on the waits: ambiguous, not marked
    named, v = blame(
        {w: account() for w in [1, 2]}, {1: OPEN, 2: OPEN}, [1, 2], blocked={CLIENT: {}, 1: {2: 4.0}, 2: {}}
    )
    assert named == set() and v.causes == (2, 1) and not v.liar_only, v
    assert not judge({CLIENT: {}, 1: {2: 4.0}, 2: {}}, [1, 2], 1.0).liar_only


# ---- the waits: corroboration (deadline.judge) ----


def test_one_workers_word_alone_names_nobody():
    """A liar among three blames an honest worker while steps are slow for another reason (the
    machine): one account alone is an ambiguous pair, not a verdict (before: worker 1 was named)."""
    v = judge({CLIENT: {}, 1: {}, 2: {}, 3: {1: 5.0}}, W3, 1.0)
    assert v.named is None and v.causes == (1, 3)
    # two workers, a silent dragger: the same (either could be lying); the accused comes first
    v = judge({CLIENT: {}, 1: {2: 5.0}, 2: {}}, [1, 2], 1.0)
    assert v.named is None and v.causes == (2, 1)
    # two accusers, or the client's own account: named
    assert judge({CLIENT: {}, 1: {3: 5.0}, 2: {3: 5.0}, 3: {}}, W3, 1.0).named == 3
    assert judge({CLIENT: {2: 5.0}, 1: {}, 2: {}}, [1, 2], 1.0).named == 2


# ---- the comm layer: waits charged to the peer that caused them, whatever its rank ----


def _tcp() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback TCP sockets (a Link tunes TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    return ours, theirs


def _pair(rank: int) -> tuple[Link, socket.socket]:
    ours, theirs = _tcp()
    return Link(ours, None, rank, f"worker {rank}"), theirs


def _send_later(sock: socket.socket, tensor: torch.Tensor, delay_s: float) -> threading.Thread:
    from fusion_compute.comm.links import frame_header

    def go() -> None:
        time.sleep(delay_s)
        payload = tensor.numpy().tobytes()
        sock.sendall(frame_header(len(payload)) + payload)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("late", [1, 2, 3])
def test_the_client_charges_only_the_last_egress_whatever_its_rank(late):
    """Three workers' egress: one is 0.3 s late (a sub-tick delay). The client, waiting on all at
    once, charges that one the time after the others had arrived, and nobody else; reading in rank
    order would have charged worker 1 whenever its shard came after a late one's."""
    links, far = {}, {}
    for r in (1, 2, 3):
        links[r], far[r] = _pair(r)
    witness = Witness()
    witness.start(0)
    comm = Comm(0, 3, links, timeout_s=5, witness=witness)
    shard = torch.arange(6, dtype=torch.float32)
    threads = [_send_later(far[r], shard, 0.3 if r == late else 0.0) for r in (1, 2, 3)]
    got = comm.recv_all({r: torch.empty(6) for r in (1, 2, 3)}, "egress", "final")
    for t in threads:
        t.join()
    assert all(torch.equal(t, shard) for t in got.values())
    waits = witness.answer(0, 10)["waits"]
    # measured 0.30 s; bounds leave a loaded machine 0.15 s either way
    assert set(waits) == {str(late)} and 0.15 <= waits[str(late)] <= 0.6, waits
    for r in (1, 2, 3):
        far[r].close()
        links[r].close()


def test_two_late_together_charge_nobody():
    """Workers 1 and 2 both 0.3 s late (their common cause is elsewhere): the time waited on both
    is nobody's alone; only what the last one added after the other is charged."""
    links, far = {}, {}
    for r in (1, 2):
        links[r], far[r] = _pair(r)
    witness = Witness()
    witness.start(0)
    comm = Comm(0, 2, links, timeout_s=5, witness=witness)
    shard = torch.zeros(4)
    threads = [_send_later(far[r], shard, 0.3) for r in (1, 2)]
    comm.recv_all({r: torch.empty(4) for r in (1, 2)}, "egress", "final")
    for t in threads:
        t.join()
    assert sum(witness.answer(0, 10)["waits"].values()) < 0.15  # measured: under 1 ms
    for r in (1, 2):
        far[r].close()
        links[r].close()


def test_a_farewell_says_why_and_is_read_as_one():
    """The cause travels with the close: the receiver gets PeerLeft with the reason, not a bare close;
    a send to a peer that left first reports its farewell too; a malformed reason is bounded."""
    a, b = _tcp()
    mine, theirs = Link(a, None, 2, "worker 2"), Link(b, None, 1, "worker 1")
    theirs.farewell("worker 3 closed the connection\nsecond line", time.monotonic() + 2, cause=3)
    with pytest.raises(PeerLeft, match="worker 2 closed the connection: worker 3 closed the connection$") as e:
        mine.recv_size(time.monotonic() + 2)
    assert e.value.reason == {"cause": 3, "after": None, "inputs": False, "why": "worker 3 closed the connection"}
    assert e.value.said == "worker 3 closed the connection"
    assert mine.departure() == "left"
    with pytest.raises(PeerLeft):
        mine.recv_size(time.monotonic() + 2)  # nothing follows a farewell
    mine.close()
    theirs.close()
    # the peer's word is checked: wrong types dropped, the line bounded, a bare line taken as the reason
    assert farewell_reason(b'{"cause": true, "after": -1, "why": "' + b"x" * 5000 + b'"}') == {
        "cause": None,
        "after": None,
        "inputs": False,
        "why": "x" * 300,
    }
    assert farewell_reason(b"out of\nmemory") == {"cause": None, "after": None, "inputs": False, "why": "out of memory"}
    assert farewell_reason(b'{"inputs": 1, "why": "x"}')["inputs"] is False  # only a true JSON boolean


def test_departure_tells_left_closed_open():
    a, b = _tcp()
    link = Link(a, None, 1, "worker 1")
    assert link.departure() == "open"
    b.sendall(b"\x02\x00\x00\x00\x00\x00\x00\x00ab")  # a message first (dropped), then the close
    b.close()
    assert link.departure() == "closed"
    link.close()
