"""Fault injection for the tests (worker flag `--inject-fault SPEC`, never used otherwise). The honest
worker does not import it: controls/worker.py composes a fault onto its Comm and join at start-up;
the masked mode picks a lying member (masked/controls.py).

  close-mid-message@STEP   at its STEP-th forward (counted from 1 over the worker's life), the worker
                           sends the client the header and half of its egress shard, closes its
                           connections and exits: a process dying in the middle of a message.
  nan-egress@STEP          at its STEP-th forward, the worker sends its egress shard full of NaN (and
                           goes on serving): a liar the structural client's finiteness check must name.
  huge-egress@STEP         at its STEP-th forward, the worker sends its egress shard as ±3e38, finite
                           garbage whose squares overflow the final norm's float32 (and goes on
                           serving): the client's scale check must name it.
  hello-fingerprint@1      the worker answers the plan handshake yes, stating another plan fingerprint
                           than the one it computed (STEP must be 1: there is one handshake per epoch).
  fail-hello@1             at the plan handshake the worker fails with an error of its own that it
                           survives (a CommError, as a fabric that cannot start on this machine: the
                           NCCL fabric without CUDA) and waits for the client's next word.
  fail@STEP                at its STEP-th forward the worker fails with an error of its own (a
                           RuntimeError, as a kernel or a device would raise) and its process exits.
  fail-alive@STEP          at its STEP-th forward the worker fails with an error of its own that it
                           survives (a CommError, as a fabric that breaks mid-run): it drops the epoch
                           and waits for the client's next word, its pulse beating.
                           The client must report the worker's own error, not only a closed connection.

  never-join@N      from the N-th word to join a later epoch on, the worker ignores the word (it logs
                    it and waits for the next one) while its pulse keeps beating: a listed worker
                    that holds an epoch change hostage until the client's join deadline.

A listed worker that disrupts its peers while it keeps beating (structural mode; the client must
blame it by its peers' evidence, not the honest worker whose link it was reading):

  cut-peer@N        at its N-th reduce-scatter (over its life), it shuts its links to every peer and
                    stalls: it drops what the client sends until the client ends its epoch
  slow-rs@N         from its N-th reduce-scatter on, it waits SLOW_S before each one (each under the
                    per-message timeout, the step far over it)
  drag-rs@N         from its N-th reduce-scatter on, it waits DRAG_S before each one: every wait and
                    every step stays under the per-message timeout, only the step deadline can see it
                    (runtime/deadline.py)
  drag-sub@N        the same with SUB_S: under the 0.25 s receive tick (the red team's sub-tick dragger)
  drag-lie@N        drags like drag-rs and lies in its account: it charges each of its own delays to
                    its victim (the lowest other rank), as if that peer had kept it waiting
  close-link@N      at its N-th reduce-scatter, it shuts only its link to its victim (the lowest other
                    rank), says in its account that the victim's link failed it, and stalls (beating,
                    its other links open) until the client ends the epoch
  leave-lie@N       the same, and then leaves the epoch as an honest worker whose link failed would:
                    with a farewell naming its victim (`cause`) on every link (links.say_farewell),
                    its pulse beating: a lie told the way the truth is told
  poison-rs@N       at its N-th reduce-scatter, the block it owes its victim (the lowest other rank)
                    is all NaN (skipping its own check on what it sends); otherwise it behaves: its
                    own egress stays clean, and it leaves as a knock-on of its victim's farewell
  huge-rs@N         the same with ±1e30: finite, far over any partial (issue 41's second attack)
  big-rs@N          the same with ±1e19: under the bound every receiver checks, so its victim accepts it,
                    and its own next block or its egress fails its check (the victim leaves saying
                    its inputs made it: nobody named)
  stale-rs@N        at its N-th reduce-scatter, the block it owes its victim goes out stamped with the
                    previous step (a late or replayed message of the right size); otherwise it behaves
  drag-one-lie@N    from its N-th reduce-scatter on, at the last reduce-scatter of each step, it holds
                    back its block to one peer alone (the highest other rank) by SLOW_S, its block to
                    its victim (the lowest other rank) on time, and charges that delay to its victim
                    in its account: the delayed peer's wait truly names the liar, the client's last
                    wait is a few ms (the liar's egress and the delayed peer's leave together), and
                    the victim waits on nobody (issue 43: one honest wait and a lie)
  leave-after@N     at its N-th reduce-scatter, it tells the client alone that it left after its
                    victim's farewell (a farewell with `after`, its account the same), says nothing
                    on its links to its peers (they stay blocked on it), and stalls, beating, until
                    the client ends the epoch: "I left after a peer that never left" (issue 43)

Masked mode, a worker that lies (at its STEP-th forward; the client's product check must catch it):

  lie-one@STEP      one element of the step's last linear is off by one (the smallest lie there is)
  lie-bias@STEP     every element of every linear of the step is off by 2^40: a systematic bias that
                    moves the output yet stays far inside the ±2^62 bound the consistency check knows
  lie-stale@STEP    every linear returns the previous step's result for it (a lazy or replaying worker)
  lie-zeros@STEP    every linear returns zeros
  lie-shape@STEP    the step's first linear comes back one row short (a malformed answer)

The other faults the suite injects come from outside the process (kill -9, SIGSTOP, a network link
set down in a namespace): tests/test_faults.py.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm import CommError, PeerLost
from ..errors import UsageError
from .launch import leave_now

LIES = ("lie-one", "lie-bias", "lie-stale", "lie-zeros", "lie-shape")
POISONS = {"poison-rs": math.nan, "huge-rs": 1e30, "big-rs": 1e19}  # what the block for the victim holds
COMM_FAULTS = (
    "cut-peer",
    "slow-rs",
    "drag-rs",
    "drag-sub",
    "drag-lie",
    "close-link",
    "leave-lie",
    "stale-rs",
    "leave-after",
    "drag-one-lie",
    *POISONS,
)
SEND_FAULTS = (
    "close-mid-message",
    "nan-egress",
    "huge-egress",
    "hello-fingerprint",
    "fail-hello",
    "fail",
    "fail-alive",
)  # composed onto Comm.send
KINDS = (*SEND_FAULTS, "never-join", *COMM_FAULTS, *LIES)
SLOW_S = 2.0
DRAG_S = 0.4  # over one 0.25 s receive tick, far under any --timeout
SUB_S = 0.2  # under one receive tick: the accounts see it only as real wait durations


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int

    @property
    def lie(self) -> bool:
        return self.kind in LIES


def parse_fault(spec: str) -> Fault:
    kind, sep, step = spec.strip().partition("@")
    if kind not in KINDS or not sep or not step.isdigit() or int(step) < 1:
        raise UsageError(f"--inject-fault {spec!r}: expected KIND@STEP (STEP >= 1), KIND one of {', '.join(KINDS)}")
    return Fault(kind, int(step))


def rejoin(fault: Fault | None, join: Callable) -> Callable:
    """The worker's join for later epochs: `join` itself, or (never-join) one that refuses from the
    fault's N-th call on, the way a join the client abandoned fails (worker.run then waits for the
    next word): the honest loop is not branched, the faulty join is composed in at start-up."""
    if fault is None or fault.kind != "never-join":
        return join
    calls = [0]

    def never(cred, epoch, deadline, log):
        calls[0] += 1
        if calls[0] < fault.step:
            return join(cred, epoch, deadline, log)
        raise CommError(f"fault never-join: ignoring the word to join epoch {epoch}")

    return never


def comm_fault(fault: Fault | None) -> Callable:
    """What the worker does to each epoch's Comm: nothing (the identity), or wrap that Comm's
    reduce-scatter (cut-peer, slow-rs, drag-rs) or its sends to the client (close-mid-message,
    nan-egress, hello-fingerprint), so the honest code path is not branched. The counts run over
    the worker's life, across epochs."""
    if fault is not None and fault.kind in SEND_FAULTS:
        return _send_fault(fault)
    if fault is None or fault.kind not in COMM_FAULTS:
        return lambda comm: comm
    calls = [0]
    last: dict = {"step": None, "op": None, "final": None}  # drag-one-lie: the op of each step's last reduce-scatter
    delay = {"slow-rs": SLOW_S, "drag-rs": DRAG_S, "drag-sub": SUB_S, "drag-lie": DRAG_S}.get(fault.kind)

    def patch(comm):
        honest = comm.reduce_scatter_from
        victim = 2 if comm.rank == 1 else 1  # the liar's victim: the lowest other rank

        def faulty(chunk, sizes, op):
            calls[0] += 1
            if calls[0] == fault.step and fault.kind in POISONS:
                return _poisoned(comm, honest, victim, chunk, sizes, op, POISONS[fault.kind])
            if calls[0] == fault.step and fault.kind == "stale-rs":
                return _stale(comm, honest, victim, chunk, sizes, op)
            if calls[0] == fault.step and fault.kind == "leave-after":
                _leave_after(comm, victim)
            if fault.kind == "drag-one-lie":
                if comm.step != last["step"]:  # the previous call was the last of its step: its op is the step's last
                    last["final"], last["step"] = last["op"], comm.step
                last["op"] = op
                if calls[0] >= fault.step and op == last["final"]:
                    return _drag_one(comm, honest, victim, chunk, sizes, op)
                return honest(chunk, sizes, op)
            if calls[0] >= fault.step and delay is not None:
                time.sleep(delay)
                if fault.kind == "drag-lie" and comm.witness is not None:
                    comm.witness.charge(victim, delay)  # the lie: "the victim kept me waiting"
            elif calls[0] == fault.step:  # cut-peer, close-link, leave-lie
                for rank, link in comm.links.items():
                    if rank not in (0, comm.rank) and (fault.kind == "cut-peer" or rank == victim):
                        try:
                            link.sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                if fault.kind in ("close-link", "leave-lie") and comm.witness is not None:
                    comm.witness.lost_peer(victim)  # the lie: "the victim's link failed me"
                if fault.kind == "leave-lie":  # ... said on every link as it leaves (the worker's own path)
                    raise PeerLost(victim, f"{comm.links[victim].label} closed the connection")
                word = torch.zeros(4, dtype=torch.int64)
                while True:  # stall (beating) until the client cuts this epoch's links
                    comm.recv(word, 0, "control", "stall", wait_s=math.inf)
            return honest(chunk, sizes, op)

        comm.reduce_scatter_from = faulty
        return comm

    return patch


def _drag_one(comm, honest: Callable, victim: int, chunk: Callable, sizes, op: str):
    """drag-one-lie: one reduce-scatter whose block for the highest other rank goes out SLOW_S late
    (the victim's, sent first, on time), the delay charged to the victim in the account."""
    late = max(r for r in comm.links if r not in (0, comm.rank))

    def dragging(put):
        def send(peer, t):
            if peer == late:
                time.sleep(SLOW_S)
                if comm.witness is not None:
                    comm.witness.charge(victim, SLOW_S)  # the lie: "the victim kept me waiting"
            put(peer, t)

        return send

    return _with_put(comm, dragging, honest, chunk, sizes, op)


def _with_put(comm, wrap: Callable, honest: Callable, chunk: Callable, sizes, op: str):
    """One reduce-scatter (`honest`) with comm's link writer replaced by `wrap(put)`, put back after."""
    put = comm._put
    comm._put = wrap(put)
    try:
        return honest(chunk, sizes, op)
    finally:
        comm._put = put


def _leave_after(comm, victim: int) -> None:
    """leave-after: a farewell to the client alone saying this worker left after `victim`'s (which
    never came), the account saying the same; nothing to the peers; then a stall (beating) until
    the client ends the epoch and the pulse thread shuts the links (never returns)."""
    if comm.witness is not None:
        comm.witness.left_after(victim)  # the lie, told the same way in the account
    said = f"{comm.links[victim].label} closed the connection: left the epoch"
    comm.links[0].farewell(said, time.monotonic() + 1.0, after=victim)
    word = torch.zeros(4, dtype=torch.int64)
    while True:
        comm.recv(word, 0, "control", "stall", wait_s=math.inf)


def lie_to(comm, victim: int, value: float) -> Callable[[], None]:
    """From now on, what `comm` puts on its link to `victim` is `value` throughout (alternating sign),
    sent past its own check (comm.Comm._check_own) as a liar would. Returns the undo."""
    put, check = comm._put, comm._check_own

    def poisoning(peer, t):
        if peer == victim:
            bad = torch.full((t.numel(),), value, dtype=t.dtype)
            bad[1::2] = -value
            t = bad.view_as(t)
        put(peer, t)

    comm._put, comm._check_own = poisoning, lambda block, dst, op: None

    def undo() -> None:
        comm._put, comm._check_own = put, check

    return undo


def _poisoned(comm, honest: Callable, victim: int, chunk: Callable, sizes, op: str, value: float):
    """One reduce-scatter whose block for `victim` is `value` (alternating sign): `lie_to` for it."""
    undo = lie_to(comm, victim, value)
    try:
        return honest(chunk, sizes, op)
    finally:
        undo()


def _stale(comm, honest: Callable, victim: int, chunk: Callable, sizes, op: str):
    """One reduce-scatter whose block for `victim` carries the previous step's number in its frame
    header (comm/links.py), as a late or replayed message of the right size would."""
    link = comm.links[victim]

    def stale(put):
        def send(peer, t):
            if peer == victim:
                link.step -= 1
                try:
                    put(peer, t)
                finally:
                    link.step += 1
            else:
                put(peer, t)

        return send

    return _with_put(comm, stale, honest, chunk, sizes, op)


def _send_fault(fault: Fault) -> Callable:
    egresses = [0]

    def patch(comm):
        honest = comm.send

        def faulty(tensor, dst, kind, op):
            hello = kind == "control" and op == "hello" and int(tensor[0]) == 1
            if fault.kind == "hello-fingerprint" and hello:
                tensor = tensor.clone()
                tensor[1] ^= 1  # yes, and another plan's fingerprint than the one it computed
            elif fault.kind == "fail-hello" and hello:
                raise CommError("fault fail-hello: this worker cannot honour its setup here")
            elif kind == "egress" and fault.kind not in ("hello-fingerprint", "fail-hello"):
                egresses[0] += 1
                if egresses[0] == fault.step:
                    if fault.kind == "fail":
                        raise RuntimeError(f"fault fail@{fault.step}: this worker's own error at its forward")
                    if fault.kind == "fail-alive":
                        raise CommError(f"fault fail-alive@{fault.step}: this worker's fabric failed at its forward")
                    if fault.kind == "nan-egress":
                        tensor = torch.full_like(tensor, math.nan)
                    elif fault.kind == "huge-egress":  # +3e38, -3e38, ... : finite, and far past any residual
                        huge = torch.full((tensor.numel(),), 3e38, dtype=tensor.dtype)
                        huge[1::2] = -3e38
                        tensor = huge.view_as(tensor)
                    else:  # close-mid-message: the header and half the shard, then the process is gone
                        comm.send_truncated(tensor, dst, 0.5)
                        leave_now(3)
            return honest(tensor, dst, kind, op)

        comm.send = faulty
        return comm

    return patch
