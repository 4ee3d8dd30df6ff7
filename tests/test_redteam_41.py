"""Issue 41's claim attacked as a lying worker would (docs/resilience.md "Evidence at the receiver",
"What the rule guarantees"; docs/security.md "What peers may print"): in-process, on the real
readers, checks and blame rules. Each test is one attack; the ones the claim survives pin the reason
it does (the slowness ambiguity a liar once turned into an honest removal included)."""

from __future__ import annotations

import itertools
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from fusion_compute.comm import Comm, PeerPoisoned, TaintedInputs
from fusion_compute.comm.links import MAX_FAREWELL, MAX_WHY, farewell_reason
from fusion_compute.comm.peer_text import printable
from fusion_compute.runtime.blame import CLIENT, blame_link, follows
from fusion_compute.runtime.deadline import StepClock, Verdict, judge
from fusion_compute.runtime.faults import lie_to
from fusion_compute.runtime.membership import Membership, Seat, waiting_pids, waits_by_pid

OPEN = ("open", None)


def left(cause=None, after=None, inputs=False):
    return ("left", {"cause": cause, "after": after, "inputs": inputs, "why": ""})


def account(lost=None, after=None, waiting=()):
    return {"lost": lost, "after": after, "waits": {}, "waiting": list(waiting)}


# ---- accounts: a witness answer is the liar's word, read like any input ----

HOSTILE_WAITS = [
    {"²": 9.0},  # str.isdigit() is true for it, int() refuses it: the old reader raised ValueError
    {"٣": 9.0},  # an Arabic-Indic three: the same
    {"1": "x"},
    {"1": [1]},
    {"1": None},
    {"1": True},
    {"1": -5.0},
    {"1": float("nan")},
    {"1": float("inf")},
    [1, 2],
    "12",
    None,
    7,
]


@pytest.mark.parametrize("waits", HOSTILE_WAITS, ids=repr)
def test_a_witness_answer_of_any_shape_is_read_never_crashed_on(waits):
    """A liar answers the client's 'what did you see' (comm/liveness.py: the answer's `saw` is any
    JSON object) with a `waits` the protocol never makes. The reader every recovery uses
    (membership._blame, _judge_slow) keeps the well-formed entries and drops the rest: before, it
    raised (ValueError for "²", AttributeError for a list, TypeError for null seconds) out of the
    recovery itself (membership.recover -> _blame, or _judge_slow), before any epoch change or
    verdict: the liar was never weighed and the request failed on an error that is not one line.
    What it keeps still goes through the real judgement."""
    ranks = {1: 11, 2: 12, 3: 13}
    got = waits_by_pid(waits, ranks)
    assert got == {}, got
    both = waits_by_pid({**waits, "2": 3.0} if isinstance(waits, dict) else {"2": 3.0}, ranks)
    assert both == {12: 3.0}  # the well-formed entry beside it is kept
    verdict = judge({CLIENT: {}, 11: {}, 13: got}, [11, 12, 13], 1.0)
    assert verdict.named is None


def test_the_client_and_honest_accounts_read_as_before():
    """Negative control: what the protocol makes (liveness.Witness.answer: str ranks, float seconds;
    the client's own answer the same) is read exactly, ranks to participant ids, unknown ranks out."""
    ranks = {1: 4, 2: 2}
    assert waits_by_pid({"1": 0.5, "2": 0, "3": 9.0}, ranks) == {4: 0.5, 2: 0.0}
    assert waits_by_pid({1: 2.5}, ranks) == {4: 2.5}
    pid = {1: 4, 2: 2}.get
    assert waiting_pids([1, 2, 9], lambda r: pid(r) if isinstance(r, int) else None) == [4, 2]
    assert waiting_pids(5, lambda r: 1) == []  # not a list: nobody (before: TypeError)
    assert waiting_pids({"1": 1}, lambda r: 1) == []


# ---- farewells: the cut, escapes split across it, invisible characters ----

TRICKS = ["\x1b]0;owned\x07", "\x1b[2J", "\x1b[31m", "\x9b31m", "\u202e", "\u2066", "\u200b", "\ufeff", "\u00ad"]


@pytest.mark.parametrize("pad", range(MAX_FAREWELL - 12, MAX_FAREWELL + 1))
def test_an_escape_split_by_the_farewell_cut_never_reaches_the_text_raw(pad):
    """The liar pads its farewell so the 512-byte cut (links.MAX_FAREWELL) falls inside an escape
    sequence or a multi-byte character, raw or inside JSON. The line kept is escaped character by
    character before it is cut to MAX_WHY, so no cut can leave a control or format character: every
    character of `why` is printable and none is a backslash that is not the start of an escape."""
    for trick in TRICKS:
        raw = ("a" * pad).encode() + (trick * 4).encode()
        for payload in (raw, json.dumps({"why": "a" * pad + trick * 4}, ensure_ascii=False).encode()):
            why = farewell_reason(payload[:MAX_FAREWELL])["why"]
            assert len(why) <= MAX_WHY
            assert all(c.isprintable() for c in why), (pad, trick, why[-20:])
            assert "\x1b" not in why and "\u202e" not in why


def test_a_farewell_s_claims_are_typed_not_trusted():
    """`cause`/`after` that are not plain ints in range (true, 1.0, "1", -1, 2**16) and an `inputs`
    that is not exactly true are no claim at all: a liar cannot make `inputs: "yes"` count as a
    tainted departure, nor `cause: true` name rank 1."""
    for bad in (True, 1.0, "1", -1, 1 << 16, [1], None):
        r = farewell_reason(json.dumps({"cause": bad, "after": bad, "inputs": bad if bad is not True else 1}).encode())
        assert r["cause"] is None and r["after"] is None and r["inputs"] is False, (bad, r)
    assert farewell_reason(b'{"cause": 2, "inputs": true}') == {"cause": 2, "after": None, "inputs": True, "why": ""}


def test_invisible_and_direction_characters_are_escaped_where_peer_text_enters():
    """Bidi marks beyond the overrides (U+061C, U+200E/F), zero-width ones (U+200B..U+200D, U+2060,
    U+FEFF), tags (U+E0001), the line and paragraph separators and a no-break space: all escaped.
    Not escaped: letters that render blank (the Hangul fillers U+3164, U+115F are category Lo) and
    combining marks: they cannot move the cursor or reorder a line, only look like spaces."""
    for c in "\u061c\u200e\u200f\u200b\u200c\u200d\u2060\ufeff\U000e0001\u2028\u2029\u00a0\u180e":
        assert printable(c) == ascii(c)[1:-1], hex(ord(c))
    assert printable("\u3164") == "\u3164"


# ---- tainted farewells: a denial of service, never a removal ----


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_liar_saying_inputs_every_epoch_is_in_every_set_and_gets_nobody_else_removed(n):
    """The liar leaves every epoch saying its own block failed though its inputs passed (`inputs:
    true`): every worker of the epoch is a suspect, each time. Over any sequence of epochs drawn
    from a roster of n + 2 (standbys taking seats, the liar set aside and refilled back, at any
    rank), with the honest workers leaving after it (knock-on) or staying open, blame_link names
    nobody, the liar is in every set (first: `_set_aside` spares it before anyone), and `follows`
    never names an honest worker. The cost (an epoch change and a replay each time, the liar never
    removed while it only says this) is the denial of service docs/resilience.md admits."""
    roster, liar = list(range(1, n + 3)), 1
    epochs = [list(c) for c in itertools.combinations(roster, n) if liar in c]
    sets = []
    for order in epochs:
        for rank_of_liar in range(n):
            order = [w for w in order if w != liar]
            order.insert(rank_of_liar, liar)
            for honest_leave in (True, False):
                accounts = {w: account(after=liar) if honest_leave else account(waiting=[liar]) for w in order}
                seen = {w: left(after=liar) if honest_leave else OPEN for w in order}
                accounts[liar], seen[liar] = account(), left(inputs=True)
                owed = set(order) if not honest_leave else {liar}
                named, v = blame_link(accounts, seen, order, owed, {CLIENT: {}}, 1.0)
                assert named == set(), (order, v)
                assert v.causes[0] == liar and set(v.causes) == set(order), (order, v)
                sets.append(frozenset(v.causes))
    for history in itertools.permutations(sets[:6], 4):
        for i in range(1, len(history)):
            assert follows(list(history[:i]), tuple(history[i])) in (None, liar)


@pytest.mark.parametrize("liar", [1, 2])
def test_two_workers_a_liar_accusing_its_only_peer_is_only_ambiguous(liar):
    """N = 2, where an ambiguous pair is both workers: the liar leaves naming the other first-hand,
    with a matching account, every way the honest one can answer (it left after the liar, it left
    naming the liar, it stayed blocked on the liar). Nobody is removed; the pair is ambiguous; and
    a second pair with a standby (3) that shares only the liar makes `follows` name the liar."""
    honest = 3 - liar
    for h_acc, h_seen, owed in [
        (account(after=liar), left(after=liar), {liar}),
        (account(lost=liar), left(cause=liar), {liar}),
        (account(waiting=[liar]), OPEN, {liar, honest}),
    ]:
        named, v = blame_link(
            {liar: account(lost=honest), honest: h_acc},
            {liar: left(cause=honest), honest: h_seen},
            [1, 2],
            owed,
            {CLIENT: {}},
            1.0,
        )
        assert named <= {liar} and liar in v.causes, v
        if not named:
            assert follows([frozenset(v.causes)], (liar, 3)) == liar


# ---- the Megatron baseline's collectives: the same evidence at the receiver ----


def _lying(comm: Comm, victim: int, value: float) -> Comm:
    """The liar: what it puts on its link to `victim` is `value` throughout (alternating sign), past
    its own check (faults.lie_to, as the poison-rs faults do for one reduce-scatter)."""
    lie_to(comm, victim, value)
    return comm


@pytest.mark.parametrize("verb", ["all_reduce", "all_gather"])
@pytest.mark.parametrize("liar", [1, 3])
@pytest.mark.parametrize("value", [math.nan, 1e30])
def test_a_megatron_liar_is_named_by_its_victim(verb, liar, value):
    """The Megatron-style baseline sums with all_reduce_workers and gathers its ingress with
    all_gather_workers. Before, neither checked what it received nor what it sent: the liar's NaN
    or ±1e30 was added silently, passed on to the other honest worker in the next all-reduce, and
    surfaced only as every honest worker's own egress failing (TaintedInputs: everyone a suspect,
    the liar never named first-hand). Now the victim refuses the block and names the liar
    (PeerPoisoned), and the third worker's result is the honest one."""
    from test_poisoned_partials import _close, _mesh, _run_all

    ranks = [1, 2, 3]
    links = _mesh(ranks)
    comms = {r: Comm(r, 3, links[r], timeout_s=10) for r in ranks}
    victim = 2
    comms[liar] = _lying(comms[liar], victim, value)
    if verb == "all_reduce":
        got = _run_all(comms, lambda c: c.all_reduce_workers(torch.full((2, 3), float(c.rank)), "L0.o"))
        honest = torch.full((2, 3), 6.0)
    else:
        got = _run_all(comms, lambda c: c.all_gather_workers(torch.full((1, 3), float(c.rank)), [1, 1, 1], "ingress"))
        honest = torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3])
    try:
        err = got[victim]
        assert isinstance(err, PeerPoisoned) and err.rank == liar, got
        third = next(r for r in ranks if r not in (liar, victim))
        assert torch.equal(got[third], honest), got
    finally:
        _close(comms)


def test_a_megatron_worker_refuses_to_pass_on_a_block_that_fails():
    """Negative control of the sender's side: an honest worker whose own all-reduce term is not
    finite (its inputs passed, yet made it) sends nothing and names nobody (TaintedInputs)."""
    from test_poisoned_partials import _close, _mesh, _run_all

    links = _mesh([1, 2])
    comms = {r: Comm(r, 2, links[r], timeout_s=2) for r in (1, 2)}
    bad = torch.tensor([[math.inf, 1.0]])
    got = _run_all(comms, lambda c: c.all_reduce_workers(bad.clone() if c.rank == 1 else torch.ones(1, 2), "L0.down"))
    try:
        assert isinstance(got[1], TaintedInputs), got
    finally:
        _close(comms)


# ---- ambiguity that does not come from the liar: set aside, never followed ----


class Bookkeeping(Membership):
    """The client's ambiguity bookkeeping as the engine runs it: a real Membership (`_ambiguous`:
    follows over the job's liar-only sets, every set counted; `_suspected`) over the seats `order`,
    held by a job with nothing but a log, whose epoch change (`_set_aside`) only records whom it set
    aside and whose removal of a liar (`_expel`) only whom it removed."""

    def __init__(self, order, log=lambda line: None):
        super().__init__(SimpleNamespace(opts=SimpleNamespace(log=log)), {p: Seat(p) for p in order}, StepClock())
        self.aside: list[tuple[int, ...]] = []
        self.expelled: list[list[int]] = []

    def _set_aside(self, causes, why, noticed, t0):
        self.aside.append(causes)
        return True

    def _expel(self, err):
        self.expelled.append(err.pids)


def _bookkeeper(order):
    return Bookkeeping(list(order))


def _weigh(job, verdict):
    return job._ambiguous(verdict, "a test", 0.0, 0.0)


def _liar_names_1():
    """Epoch 2 of the red team's attack: the liar (3) is back and leaves naming honest worker 1
    first-hand, with a matching account; 1 and 2 leave as its knock-on, honestly: ambiguous {1, 3}."""
    named, v = blame_link(
        {1: account(after=3), 2: account(after=3), 3: account(lost=1)},
        {1: left(after=3), 2: left(after=3), 3: left(cause=1)},
        [1, 2, 3],
        {3},
        {CLIENT: {}},
        1.0,
    )
    assert named == set() and set(v.causes) == {1, 3} and v.liar_only
    return v


def test_a_liar_cannot_convert_a_slowness_ambiguity_into_an_honest_removal():
    """Epoch 1: honest workers 1 and 2 (the liar, 3, is a standby). Worker 2 is slowed by the
    machine (load, not a lie): 1's account says 2 kept it waiting, the client's charges nobody (both
    egresses late together: test_blame.py::test_two_late_together_charge_nobody). One worker's word
    alone: ambiguous {2, 1} (deadline.judge), both honest. Epoch 2: the liar makes {1, 3}. The two
    sets share only worker 1, so `follows` over both would name it (before: removed on the liar's
    word). The slow-step set is judged on waits (not liar_only): it sets 1 and 2 aside and is
    counted, but never feeds `follows`, before or after the liar's set (both orders)."""
    slow = judge({CLIENT: {}, 1: {2: 3.0}, 2: {}}, [1, 2], 1.0)
    assert slow.named is None and set(slow.causes) == {1, 2} and not slow.liar_only  # the liar-free ambiguity
    assert follows([frozenset(slow.causes)], _liar_names_1().causes) == 1  # what the bookkeeping must not do
    for first, then in ((slow, _liar_names_1()), (_liar_names_1(), slow)):
        job = _bookkeeper([1, 2, 3])
        assert _weigh(job, first) is None and _weigh(job, then) is None
        assert job.aside == [first.causes, then.causes]  # both set aside all the same
        assert sum(1 in s for s in job.suspicions) == 2  # and counted (the control page's suspect counts)
    # negative control: the liar's second pair with another partner still removes it
    assert _weigh(job, Verdict(None, (2, 3), "the liar names 2", liar_only=True)) == 3


def test_a_liar_s_own_slow_step_accusation_under_load_gets_nobody_honest_removed():
    """The red team's follow-up: the machine is loaded, and the liar (3) says in its account that
    honest worker 1 kept it waiting: one worker's word, ambiguous {1, 3}, judged on waits. Then the
    liar makes link ambiguities with 1 and with 2. Its own slowness claim never counts, so it cannot
    pair it with a link set to single out 1 (nor with the honest slow set {1, 2}); its two link sets
    with different partners remove it."""
    job = _bookkeeper([1, 2, 3])
    says = judge({CLIENT: {}, 1: {}, 2: {}, 3: {1: 3.0}}, [1, 2, 3], 1.0)
    assert says.named is None and set(says.causes) == {1, 3} and not says.liar_only
    honest_slow = judge({CLIENT: {}, 1: {2: 3.0}, 2: {}}, [1, 2], 1.0)
    for v in (honest_slow, says, honest_slow, says):
        assert _weigh(job, v) is None
    link_1 = _liar_names_1()
    assert _weigh(job, link_1) is None  # {1, 3} against {1, 2}: would have named 1
    assert _weigh(job, Verdict(None, (2, 3), "the liar names 2", liar_only=True)) == 3


@pytest.mark.parametrize("n", [2, 3])
def test_a_liar_that_only_drags_is_set_aside_not_removed_by_follows(n):
    """The liveness this costs (docs/resilience.md): a liar that only drags (holds its reduce-scatter
    back, the client waiting on every worker alike) with one honest peer to see it (n = 2) is one
    worker's word each time: set aside, again and again with every partner of a roster of four,
    never removed by `follows`. Removed by another rule when its slowness is corroborated: the
    client's own account (it holds back its egress: the client waited on it alone) or, at n = 3,
    two honest peers' waits (deadline.judge names it, membership treats it as lost)."""
    liar, workers = n, list(range(1, n + 1))
    if n == 2:
        job = _bookkeeper([1, 2])
        for partner in [1, 3, 4] * 2:
            v = judge({CLIENT: {}, partner: {liar: 3.0}, liar: {}}, [partner, liar], 1.0)
            assert v.named is None and set(v.causes) == {partner, liar} and not v.liar_only, v
            assert _weigh(job, v) is None
        assert len(job.aside) == 6 and job.liar_sets == []
    assert judge({CLIENT: {liar: 3.0}, **{w: {} for w in workers}}, workers, 1.0).named == liar
    if n >= 3:
        peers = {CLIENT: {}, liar: {}, **{h: {liar: 3.0} for h in workers if h != liar}}
        assert judge(peers, workers, 1.0).named == liar


def _liar_made(members: tuple[int, ...], liar: int) -> list[Verdict]:
    """Every ambiguous verdict the liar can make by its conduct in an epoch of `members` (blame_link,
    the honest workers following the protocol: each leaves naming the liar first-hand, leaves as its
    knock-on, or stays blocked on it), asserting on the way that none removes an honest worker."""
    honest = [w for w in members if w != liar]
    lies = [account(), *(account(lost=h) for h in honest), *(account(after=h) for h in honest)]
    conducts = [OPEN, left(), left(inputs=True), *(left(cause=h) for h in honest), *(left(after=h) for h in honest)]
    reactions = [(account(lost=liar), left(cause=liar)), (account(after=liar), left(after=liar))]
    reactions.append((account(waiting=[liar]), OPEN))
    found = {}
    for picks in itertools.product(reactions, repeat=len(honest)):
        accounts = {h: a for h, (a, _) in zip(honest, picks, strict=True)}
        seen = {h: s for h, (_, s) in zip(honest, picks, strict=True)}
        owed = {h for h in honest if seen[h] == OPEN} | {liar}
        for lie, conduct in itertools.product(lies, conducts):
            named, v = blame_link(
                {**accounts, liar: lie}, {**seen, liar: conduct}, list(members), owed, {CLIENT: {}}, 1.0
            )
            assert named <= {liar}, (members, liar, picks, lie, conduct, v)
            if not named and len(v.causes) >= 2:
                assert liar in v.causes and v.liar_only, v
                found[v.causes] = v
    return list(found.values())


def _slow(members: tuple[int, ...]) -> list[Verdict]:
    """Every ambiguous slow-step verdict over `members` when each worker's account (honest under the
    machine's load, or the liar's) charges any one peer or nobody, the client charging nobody: judge
    directly (_judge_slow) and through blame_link's rule 6 (nobody left)."""
    found = {}
    for waits in itertools.product([None, *members], repeat=len(members)):
        blocked = {
            CLIENT: {},
            **{w: ({x: 3.0} if x not in (None, w) else {}) for w, x in zip(members, waits, strict=True)},
        }
        for v in (
            judge(blocked, list(members), 1.0),
            blame_link({}, {w: OPEN for w in members}, list(members), set(members), blocked, 1.0)[1],
        ):
            if v.named is None and len(v.causes) >= 2:
                assert not v.liar_only, v
                found[v.causes] = v
    return list(found.values())


@pytest.mark.parametrize("n", [2, 3, 4])
def test_no_interleaving_of_liar_made_and_slow_step_sets_removes_an_honest_worker(n):
    """The property: a roster of n + 2 (two standbys), the liar any one of them (so at every rank of
    the epochs it is in, and a standby in the others). Over random runs of epochs, each epoch's
    members drawn from the roster (refilled standbys, the liar in or out), each ambiguity either one
    the liar makes by its conduct (every one blame_link can produce, above) or a slow-step verdict
    among the epoch's workers (honest ones slowed by the machine, or the liar's own accusation):
    the real bookkeeping (Membership._ambiguous) removes nobody but the liar. And liveness where it
    is kept: in runs where the liar made link ambiguities with two different partners, it is removed."""
    roster = list(range(1, n + 3))
    epochs = list(itertools.combinations(roster, n))
    slow = {m: _slow(m) for m in epochs}
    rng = random.Random(41 * n)
    for liar in roster:
        made = {m: _liar_made(m, liar) for m in epochs if liar in m}
        removed_liar = 0
        for _ in range(150):
            job, partners = _bookkeeper(roster[:n]), []
            for _ in range(8):
                members = rng.choice(epochs)
                job.order = list(members)
                if members in made and rng.random() < 0.5:
                    v = rng.choice(made[members])
                    partners.append(frozenset(v.causes))
                elif slow[members]:
                    v = rng.choice(slow[members])
                else:
                    continue
                got = _weigh(job, v)
                assert got in (None, liar), (liar, job.suspicions, v)
                if got == liar:
                    removed_liar += 1
                    break
            else:
                # never removed: no two of its link sets shared only it (two partners apart)
                assert not any(a & b == {liar} for a, b in itertools.combinations(partners, 2)), partners
        assert removed_liar, liar  # the rule still bites: runs with two different partners removed it


# ---- `after` claims in a ring ----


@pytest.mark.parametrize("n", [3, 4])
def test_a_ring_of_after_claims_holds_the_liar_and_makes_it_a_suspect(n):
    """The liar leaves saying it left after honest worker a's farewell, where a left after honest
    b, and b after the liar (a knock-on chain that the liar closes into a ring). Before, only a
    two-worker ring (each after the other) was a contradiction: a ring of three made no suspect at
    all (blame_link: nobody removed, no ambiguous set), and the liar escaped every ambiguity. Now
    every worker of the ring is a suspect, nobody removed. And over every `after` the honest
    workers can truthfully say (pointing back in time: no ring among them) and any the liar says,
    every ring blame_link finds holds the liar."""
    workers = list(range(1, n + 1))
    for liar in workers:
        honest = [w for w in workers if w != liar]
        a, b = honest[0], honest[1]
        seen = {w: OPEN for w in workers}
        accounts = {w: account(waiting=[liar]) for w in workers}
        for q, x in ((liar, a), (a, b), (b, liar)):
            seen[q], accounts[q] = left(after=x), account(after=x)
        named, v = blame_link(accounts, seen, workers, {liar}, {CLIENT: {}}, 1.0)
        assert named == set() and set(v.causes) >= {liar, a, b}, v
        assert "the last after the first" in v.said
        # the exhaustive side: honest `after`s in every time order, the liar's anything
        for order in itertools.permutations(honest):
            earlier = {h: order[: order.index(h)] for h in honest}  # whose farewell could precede h's decision
            for picks in itertools.product(*[[None, liar, *earlier[h]] for h in honest]):
                for lie in [None, *honest]:
                    seen = {
                        h: left(after=x) if x is not None else left(cause=liar)
                        for h, x in zip(honest, picks, strict=True)
                    }
                    seen[liar] = left(after=lie)
                    accs = {
                        h: account(after=x) if x is not None else account(lost=liar)
                        for h, x in zip(honest, picks, strict=True)
                    }
                    accs[liar] = account(after=lie)
                    named, v = blame_link(accs, seen, workers, set(), {CLIENT: {}}, 1.0)
                    assert named <= {liar}, (picks, lie, v)
                    if v.causes:
                        assert liar in v.causes, (picks, lie, v)
