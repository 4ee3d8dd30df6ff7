"""Evidence at the receiver (issue 41, docs/resilience.md "Evidence at the receiver"): one liar among
N must not get an honest worker removed with poisoned values.

Before: a listed worker sent NaN or ±1e30 in the reduce-scatter blocks it owed an honest peer and
kept its own egress clean; the honest peer's egress (the sum) failed the client's checks and the
honest peer was removed, then the standby, then the other honest one. Now every worker checks every
block it receives before adding it, and leaves naming the sender first-hand; it checks every block
it sends (and its egress) by the same rule and refuses to send one that fails (naming nobody), so
a block or a shard that fails on arrival is one only a worker that skipped the check sends.

  - the comm layer, in process (real Comm objects over loopback links, one thread per worker): the
    receiver names the liar at every rank, and an honest sender refuses to send a bad block;
  - the property, in process, over every pattern (the real checks and the real blame rules; the
    honest workers follow the protocol): no removal of an honest worker, the liar in every ambiguous
    set, with the liar at every rank of N = 2, 3, 4;
  - a few real jobs (slow): the real `fusion worker` poisoning its victim's block (faults.py).
"""

from __future__ import annotations

import itertools
import math
import random
import socket
import threading

import pytest
import torch
from test_redteam_41 import Bookkeeping

from fusion_compute.comm import Comm, PeerLeft, PeerPoisoned, TaintedInputs
from fusion_compute.comm.links import Link, say_farewell
from fusion_compute.comm.value_checks import PEER_VALUE_LIMIT, ROW_SUMSQ_LIMIT, block_fault, egress_fault
from fusion_compute.errors import WorkerMisbehaved, WorkersSuspected
from fusion_compute.runtime.blame import blame_link
from fusion_compute.runtime.deadline import CLIENT, StepClock, Verdict, judge
from fusion_compute.runtime.faults import comm_fault, parse_fault
from fusion_compute.runtime.membership import Membership, Seat

# ---- the checks themselves ----


def test_the_block_check_refuses_nan_inf_and_values_over_the_bound_and_passes_the_rest():
    assert block_fault(torch.randn(8, 3) * 1e4) is None  # an honest partial (SmolLM2's residual peaks at 4.4e3)
    assert block_fault(torch.full((2, 2), PEER_VALUE_LIMIT * 0.99)) is None  # at the edge: still passes
    assert "1 NaN" in block_fault(torch.tensor([1.0, math.nan]))
    assert "2 NaN or infinite" in block_fault(torch.tensor([math.inf, -math.inf, 0.0]))
    assert "over" in block_fault(torch.tensor([1e30, -1e30]))
    assert "over" in block_fault(torch.tensor([3e38], dtype=torch.bfloat16))  # in a 2-byte dtype too
    assert block_fault(torch.empty(0, 4)) is None
    # the one-pass bound (aminmax) lets none through: a NaN or a negative value over the bound alone in
    # a large block, at its last element (the vectorized kernels' tail), in a 2-byte dtype too
    for dtype in (torch.float32, torch.bfloat16):
        for bad, why in (
            (math.nan, "1 NaN"),
            (-math.inf, "1 NaN or infinite"),
            (-PEER_VALUE_LIMIT * 2, "1 value(s) over"),
        ):
            block = torch.zeros(1536, 33, dtype=dtype)
            block[-1, -1] = bad
            assert why in (block_fault(block) or ""), (dtype, bad)
    # the egress (a partial the client sums with N - 1 others): finite, and each token's sum of
    # squares within its 1/N² share of the client's limit
    assert egress_fault(torch.randn(16, 4), 3) is None
    big = torch.zeros(16, 2)
    big[0, 1] = math.sqrt(ROW_SUMSQ_LIMIT / 9) * 1.01
    assert "sum of squares" in egress_fault(big, 3)
    assert egress_fault(big, 2) is None  # under a quarter of the limit: within two workers' share
    assert egress_fault(big, 1) is None  # one worker's share is the whole limit
    assert "NaN" in egress_fault(torch.tensor([[math.nan]]), 2)


# ---- the comm layer, in process ----


def _mesh(ranks: list[int]) -> dict[int, dict[int, Link]]:
    """Loopback TCP links between every two of `ranks`: links[r][q] is r's end of the r-q link."""
    links: dict[int, dict[int, Link]] = {r: {} for r in ranks}
    for r, q in itertools.combinations(ranks, 2):
        with socket.create_server(("127.0.0.1", 0)) as server:
            a = socket.create_connection(server.getsockname())
            b, _ = server.accept()
        links[r][q] = Link(a, None, q, f"worker {q}")
        links[q][r] = Link(b, None, r, f"worker {r}")
    return links


def _run_all(comms: dict[int, Comm], step) -> dict[int, object]:
    """Run step(comm) on every rank at once (a thread each): each rank's result or exception."""
    out: dict[int, object] = {}

    def go(r: int) -> None:
        try:
            out[r] = step(comms[r])
        except BaseException as e:  # noqa: BLE001 - recorded for the test to look at
            out[r] = e

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def _close(comms: dict[int, Comm]) -> None:
    for c in comms.values():
        c.close(grace_s=0)


@pytest.mark.parametrize("kind", ["poison-rs", "huge-rs"])
@pytest.mark.parametrize("liar", [1, 2, 3])
def test_the_receiver_names_the_sender_of_a_poisoned_block(liar, kind):
    """Three workers' reduce-scatter; the liar (the real fault, faults.py) sends its victim (the
    lowest other rank) NaN or ±1e30 and skips its own check. The victim refuses the block and its
    error names the liar (PeerPoisoned: first-hand); its farewell names the liar as `cause`. The
    other honest worker's sum is the honest one (its blocks were clean)."""
    ranks = [1, 2, 3]
    links = _mesh(ranks)
    comms = {r: Comm(r, 3, links[r], timeout_s=10) for r in ranks}
    comms[liar] = comm_fault(parse_fault(f"{kind}@1"))(comms[liar])
    victim = 2 if liar == 1 else 1
    partial = {r: torch.full((6, 2), float(r)) for r in ranks}  # rows 2 per owner; the sum is 1 + 2 + 3
    got = _run_all(comms, lambda c: c.reduce_scatter_from(lambda q: partial[c.rank][2 * q : 2 * q + 2], [2, 2, 2], "o"))
    err = got[victim]
    assert isinstance(err, PeerPoisoned) and err.rank == liar, got
    assert f"worker {liar} sent a o block holding" in str(err) and "no honest sender sends it" in str(err)
    third = next(r for r in ranks if r not in (liar, victim))
    assert torch.equal(got[third], torch.full((2, 2), 6.0)), got
    # its farewell names the liar first-hand: the far end reads `cause`
    say_farewell({liar: links[victim][liar]}, err)
    with pytest.raises(PeerLeft) as left:
        links[liar][victim].recv_size(1e18)
    assert left.value.reason["cause"] == liar and not left.value.reason["inputs"]
    _close(comms)


def test_an_honest_sender_refuses_to_send_a_block_that_fails_and_names_nobody():
    """Its own block failed (its inputs passed one by one, yet made it): not sent, TaintedInputs;
    its farewell says `inputs`, naming no peer. The negative control: the same exchange with a
    clean block sums right."""
    ranks = [1, 2]
    links = _mesh(ranks)
    comms = {r: Comm(r, 2, links[r], timeout_s=1) for r in ranks}
    got = _run_all(comms, lambda c: c.reduce_scatter(torch.ones(4, 1) * c.rank, [2, 2], "down"))
    assert all(torch.equal(got[r], torch.full((2, 1), 3.0)) for r in ranks), got
    bad = {1: torch.tensor([[1.0], [1.0], [math.inf], [1.0]]), 2: torch.ones(4, 1)}  # worker 1's block for 2
    got = _run_all(comms, lambda c: c.reduce_scatter(bad[c.rank], [2, 2], "down"))
    assert isinstance(got[1], TaintedInputs) and "not sent" in str(got[1]), got
    say_farewell({2: links[1][2]}, got[1])
    with pytest.raises(PeerLeft) as left:
        links[2][1].recv_size(1e18)
    assert left.value.reason == {"cause": None, "after": None, "inputs": True, "why": left.value.reason["why"]}
    _close(comms)


@pytest.mark.parametrize("liar", [1, 2, 3])
def test_a_poisoned_score_sum_names_its_sender(liar):
    """The score sum among the owners of a split KV group: the same check, the same naming."""
    ranks = [1, 2, 3]
    links = _mesh(ranks)
    comms = {r: Comm(r, 3, links[r], timeout_s=10, score_groups=[[0, 1, 2]]) for r in ranks}
    honest_put = comms[liar]._put
    comms[liar]._put = lambda peer, t: honest_put(peer, torch.full_like(t, math.nan))
    comms[liar]._check_own = lambda block, dst, op: None  # the liar skips its own check
    got = _run_all(comms, lambda c: c.sum_scores(torch.ones(3), 0, "scores"))
    for r in ranks:
        if r != liar:
            assert isinstance(got[r], PeerPoisoned) and got[r].rank == liar, got
    _close(comms)


@pytest.mark.parametrize("bad", [math.nan, -1.0])
def test_a_poisoned_post_norm_sum_names_its_sender(bad):
    """Gemma 3's all-worker Σy² sum (comm.sum_norms): every honest worker gets the same sum; a NaN or
    a negative sum of squares from the liar is refused by each receiver, naming it, and an honest
    worker refuses to send a negative one of its own (naming nobody)."""
    ranks = [1, 2, 3]
    links = _mesh(ranks)
    comms = {r: Comm(r, 3, links[r], timeout_s=10) for r in ranks}
    got = _run_all(comms, lambda c: c.sum_norms(torch.full((4,), float(c.rank)), "L0.post_o"))
    assert all(torch.equal(got[r], torch.full((4,), 6.0)) for r in ranks), got
    liar = 2
    honest_put = comms[liar]._put
    comms[liar]._put = lambda peer, t: honest_put(peer, torch.full_like(t, bad))
    comms[liar]._check_own = lambda block, dst, op: None  # the liar skips its own check
    got = _run_all(comms, lambda c: c.sum_norms(torch.ones(4), "L0.post_o"))
    for r in (1, 3):
        assert isinstance(got[r], PeerPoisoned) and got[r].rank == liar, got
    _close(comms)
    links = _mesh([1, 2])
    comms = {r: Comm(r, 2, links[r], timeout_s=1) for r in (1, 2)}
    got = _run_all(comms, lambda c: c.sum_norms(torch.full((2,), -1.0 if c.rank == 1 else 1.0), "L0.post_down"))
    assert isinstance(got[1], TaintedInputs) and "not sent" in str(got[1]), got
    _close(comms)


# ---- the property: one liar, every pattern, the real checks and blame rules ----

OPEN, CLOSED = ("open", None), ("closed", None)


def left(cause=None, after=None, inputs=False):
    return ("left", {"cause": cause, "after": after, "inputs": inputs, "why": ""})


def account(lost=None, after=None, waiting=()):
    return {"lost": lost, "after": after, "waits": {}, "waiting": list(waiting)}


# what the liar may put in the block it owes an honest peer: the values, and whether an honest
# worker's own next block, made from it, fails (a value under the bound that still blows up)
BLOCKS = {
    "clean": (torch.randn(4, 2), False),
    "nan": (torch.tensor([[math.nan, 1.0]]), False),
    "inf": (torch.tensor([[math.inf, 1.0]]), False),
    "huge": (torch.tensor([[1e30, -1e30]]), False),
    "under-but-blows-up": (torch.tensor([[PEER_VALUE_LIMIT * 0.9, 1.0]]), True),
}


def three_and_a_standby(liar: int, fault: str):
    """The job the real-worker liar tests run: 3 workers and a standby on the tiny Qwen2, worker
    `liar` started with `--inject-fault FAULT`, the hostile tests' liveness and timeout."""
    from test_faults import LIVENESS_S
    from test_hostile_blame import TIMEOUT_S

    from fusion_compute.structural.client import EngineOptions

    return EngineOptions(
        n_workers=3,
        standby=1,
        context=128,
        liveness_s=LIVENESS_S,
        timeout_s=TIMEOUT_S,
        args_for_worker={liar: ("--inject-fault", fault)},
    )


def _honest_step(n: int, liar: int, blocks: dict[int, str]):
    """What the honest workers do with the blocks the liar sent them (the protocol, with the real
    checks): a refused block, leave naming the liar; an own block that fails, leave saying `inputs`;
    then every other honest worker leaves as a knock-on of the first leaver."""
    accounts, seen = {}, {}
    first = None
    for h in (w for w in range(1, n + 1) if w != liar):
        values, blows_up = BLOCKS[blocks[h]]
        if block_fault(values) is not None:
            accounts[h], seen[h] = account(lost=liar), left(cause=liar)
        elif blows_up:
            own = values * values  # its next block, made from the accepted one: its square overflows
            assert block_fault(own) is not None
            accounts[h], seen[h] = account(), left(inputs=True)
        else:
            continue
        first = first or h
    for h in (w for w in range(1, n + 1) if w != liar and w not in seen):
        if first is not None:
            accounts[h], seen[h] = account(after=first), left(after=first)
        else:
            accounts[h], seen[h] = account(waiting=[liar]), OPEN
    return accounts, seen


def _liar_conducts(n: int, liar: int):
    honest = [w for w in range(1, n + 1) if w != liar]
    lies = [account(), *(account(lost=h) for h in honest), *(account(after=h) for h in honest)]
    lies += [account(waiting=[h]) for h in honest]
    conducts = [OPEN, CLOSED, left(), left(inputs=True), *(left(cause=h) for h in honest)]
    conducts += [left(after=h) for h in honest]
    return list(itertools.product(lies, conducts))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_one_liar_with_poisoned_values_never_gets_an_honest_worker_removed(n, tiny_qwen2):
    """With the liar at every rank: whatever it puts in each block it owes an honest peer (clean,
    NaN, ±inf, ±1e30, or values under the bound that make the peer's own next block fail), whatever
    egress it sends the client (clean, NaN, ±3e38, a sum of squares over its share) and whatever it
    then says (its account) and does (its link to the client: open, closed, a farewell naming anyone
    or nothing), the workers removed are the liar at most, and the liar is in every ambiguous set:
    from the link evidence (blame_link) and from the client's own checks (_check_egress, names;
    _check_logits, suspects). Then, over random sequences of such steps, the ambiguity that follows
    a worker (blame.follows, through the client's real bookkeeping: Membership._ambiguous) never
    names an honest one, with slow-step ambiguities between the epoch's workers (honest ones slowed
    by the machine, or the liar's own accusation: deadline.judge on one worker's word) interleaved."""
    from fusion_compute.structural.client import Engine
    from fusion_compute.structural.plan import make_plan
    from fusion_compute.weights.loader import open_weights

    config = open_weights(tiny_qwen2).config
    eng = Engine.__new__(Engine)  # the client's checks read the epoch's plan and order only
    eng.plan = make_plan(config, n, (1.0,) * n)
    eng.members = Membership(eng, {p: Seat(p) for p in range(1, n + 1)}, StepClock())  # its epoch: 1..n
    egresses = {
        "clean": lambda rows: torch.randn(rows, 3),
        "nan": lambda rows: torch.full((rows, 3), math.nan),
        "huge": lambda rows: torch.full((rows, 3), 3e38),
        "over-share": lambda rows: torch.full((rows, 3), math.sqrt(ROW_SUMSQ_LIMIT / rows) * 1.1),
    }
    sets: dict[int, list[Verdict]] = {}
    for liar in range(1, n + 1):
        honest = [w for w in range(1, n + 1) if w != liar]
        sets[liar] = []
        for picks in itertools.product(list(BLOCKS), repeat=len(honest)):
            accounts, seen = _honest_step(n, liar, dict(zip(honest, picks, strict=True)))
            if all(s == OPEN for s in seen.values()):  # no honest worker left: the client's checks decide
                for egress in egresses:
                    shards = [
                        egresses[egress](s.n_residual) if s.rank == liar else torch.randn(s.n_residual, 3)
                        for s in eng.plan.workers
                    ]
                    try:
                        eng._check_egress(shards)
                    except WorkerMisbehaved as e:
                        assert e.pids == [liar], (liar, picks, egress, e)
                    else:
                        assert egress in ("clean",), (liar, egress)
                try:
                    eng._check_logits(torch.zeros(1, 8), [torch.randn(s.n_residual, 1) for s in eng.plan.workers], [0])
                except WorkersSuspected as e:
                    assert liar in e.pids
                    sets[liar].append(Verdict(None, tuple(e.pids), str(e), liar_only=True))  # as _suspected marks it
            for lie, conduct in _liar_conducts(n, liar):
                owed = {w for w in range(1, n + 1) if seen.get(w, OPEN) == OPEN} | {liar}
                named, v = blame_link(
                    {**accounts, liar: lie}, {**seen, liar: conduct}, list(range(1, n + 1)), owed, {CLIENT: {}}, 1.0
                )
                case = (n, liar, picks, lie, conduct, v)
                assert named <= {liar}, case
                if not named and v.causes:
                    assert liar in v.causes and v.liar_only, case
                    sets[liar].append(v)
    workers = list(range(1, n + 1))
    slow = [  # one worker's word that a peer kept it waiting, the client charging nobody
        v
        for a, b in itertools.permutations(workers, 2)
        if (v := judge({CLIENT: {}, a: {b: 3.0}}, workers, 1.0)).named is None and len(v.causes) >= 2
    ]
    assert slow and not any(v.liar_only for v in slow)
    rng = random.Random(41)
    for liar, found in sets.items():
        assert found, liar  # the liar can always make some ambiguity
        for _ in range(300):
            job = Bookkeeping(workers)
            run = rng.sample(found, min(len(found), 4)) + rng.sample(slow, min(len(slow), 3))
            rng.shuffle(run)
            for v in run:
                got = job._ambiguous(v, "a test", 0.0, 0.0)
                assert got in (None, liar), (liar, job.suspicions)
                if got == liar:
                    break


def test_a_failed_logits_check_sets_the_suspects_aside_and_convicts_only_whom_ambiguity_follows():
    """The client's logits check suspects every worker (WorkersSuspected): the engine sets them aside
    (Membership._suspected, then _ambiguous: the same path as an ambiguous verdict of the link
    evidence), convicting nobody the first time; a suspect that an earlier ambiguous set shares with
    this one alone is removed as a liar (WorkerMisbehaved, the request fails)."""
    logged: list[str] = []
    eng = Bookkeeping([1, 2, 3], log=logged.append)
    eng._suspected(WorkersSuspected("a row of logits is constant: suspects [3, 1, 2]", [3, 1, 2]))
    assert eng.aside == [(3, 1, 2)] and eng.expelled == [] and eng.suspicions == [frozenset({1, 2, 3})]
    eng.order = [3, 4, 5]  # the suspects set aside, standbys in their seats; worker 3 came back
    with pytest.raises(WorkerMisbehaved, match="ambiguity followed worker 3") as e:
        eng._suspected(WorkersSuspected("a row of logits is not finite: suspects [3, 4, 5]", [3, 4, 5]))
    assert e.value.pids == [3] and eng.expelled == [[3]] and len(eng.aside) == 1


# ---- real jobs (slow): the real worker, poisoning its victim's block ----


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "liar"), [("poison-rs", 3), ("huge-rs", 1)])
def test_a_worker_poisoning_its_peer_is_suspected_not_its_victim_removed(tiny_qwen2, fault, liar):
    """Issue 41's attack in a real job: three workers and a standby, the liar poisons the block it
    owes its victim at the 6th step. Before: the victim's egress failed the client's checks and the
    victim was removed (then the standby, then the other honest worker). Now the victim refuses the
    block and leaves naming the liar; the liar (which behaves otherwise) leaves as its knock-on, so
    the evidence is ambiguous between the two: both are set aside for the one standby, nobody is
    removed, and the request completes with the tokens of the run without the fault. The job then
    runs 2 of 3 workers and says so (item 3); the next session's start fills the empty seat from
    the workers set aside, and its tokens are the same."""
    from test_hostile_blame import reference
    from test_slow_steps import run
    from tiny_models import STEP_RS

    from fusion_compute.structural.client import Engine

    want = reference(tiny_qwen2, 3)
    with Engine(tiny_qwen2, three_and_a_standby(liar, f"{fault}@{STEP_RS * 5 + 2}")) as eng:
        res = run(eng)
        assert res.token_ids == want
        states = {w["id"]: w["state"] for w in eng.workers()}
        assert "removed" not in states.values(), states
        victim = 2 if liar == 1 else 1
        aside = [r for r in res.recoveries if r.get("set_aside")]
        assert aside and liar in aside[0]["set_aside"], res.recoveries
        assert f"worker {victim} left naming worker {liar}" in aside[0]["reason"], aside[0]
        assert eng.shortfall() is not None and eng.shortfall().startswith("running 2 of 3 workers"), eng.order
        again = run(eng)  # the fault fired once: the refilled job is honest
        assert len(eng.order) == 3 and eng.shortfall() is None and eng.recoveries[-1].get("refilled")
        assert again.token_ids == want


@pytest.mark.slow
def test_a_block_under_the_bound_that_blows_up_its_receiver_names_nobody(tiny_qwen2):
    """The liar (rank 3) sends its victim ±1e19 in the last reduce-scatter of the 6th step (the last
    layer's gate/up: its down goes to the client): under the bound, so the victim uses it; the victim's egress then holds a token whose sum of squares is over
    its share of the client's limit. Its own check refuses to send it (TaintedInputs): it leaves
    saying its inputs made it, and every worker is a suspect, none removed. Without that check the
    client's scale check would name the victim (honest) and remove it. The request completes with
    the tokens of the run without the fault."""
    from test_hostile_blame import reference
    from test_slow_steps import run
    from tiny_models import STEP_RS

    from fusion_compute.structural.client import Engine

    want = reference(tiny_qwen2, 3)
    # the 6th step's last reduce-scatter (L2.gate_up: the last down is the client's, plan.boundary);
    # the victim's egress is next
    with Engine(tiny_qwen2, three_and_a_standby(3, f"big-rs@{STEP_RS * 6}")) as eng:
        res = run(eng)
        assert res.token_ids == want
        assert "removed" not in {w["state"] for w in eng.workers()}, eng.workers()
        aside = [r for r in res.recoveries if r.get("set_aside")]
        assert aside, res.recoveries
        assert "worker 1 left: its own block failed though its inputs had passed" in aside[0]["reason"], aside[0]
