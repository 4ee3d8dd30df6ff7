"""Negative controls: deliberate leaks the audit must catch (worker flag `--inject-leak SPEC`).

  gather@L         a hidden AllGather of the residual before layer L, every step. Recorded like any
                   transfer (kind "gather") and the worker holds all H coordinates: the log checks
                   (no full holder, closure, accounting) and the socket counters all fail.
  silent-gather@L  the same AllGather with the recorder switched off around it and no holding
                   recorded: the log looks clean; only the OS socket byte counts can catch it.
  rs-allreduce     every reduce-scatter done as an all-reduce in disguise (what gloo's reduce_scatter
                   is): each worker sends every peer its whole partial. The comm layer records the
                   same addressed pieces; the sockets carry N times more.
  keep-slots       a batched session's KV slot is not zeroed at its release (the worker keeps a
                   finished session's KV shard): its release record, which measures the slot, fails
                   the audit's session check (holding).
  stale-rollback   speculative decoding's rollbacks are ignored: the worker neither zeroes the
                   rejected drafts' positions nor records a rollback, and runs each span where its
                   slot's KV ends instead of where the client put it back, so the next step's tokens
                   attend the rejected drafts' keys and values. Its log still names the span the
                   client sent; the audit's rollback check fails (the span starts below what the
                   slot holds, with no rollback; the client's rollbacks are not the worker's), and a
                   split KV group's score sums grow by the stale positions (accounting, socket bytes).

None of the first four changes the worker's output: the gathered residual is dropped after the leak,
and a kept slot is overwritten by its next session (attention reads only a session's own positions).
stale-rollback does change it (stale positions attended, at shifted positions): the tokens differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from ..errors import UsageError

KINDS = ("gather", "silent-gather", "rs-allreduce", "keep-slots", "stale-rollback")
WHOLE_RUN = ("rs-allreduce", "keep-slots", "stale-rollback")  # no @LAYER
# stale-rollback's worker runs past what the client holds by every rejected draft so far: its KV is
# made this many times the session's context, so that the drift fits.
STALE_ROOM = 8


class LeakSpecError(UsageError, ValueError):
    pass


@dataclass(frozen=True)
class Leak:
    kind: str
    layer: int | None = None

    def __str__(self) -> str:
        return self.kind if self.layer is None else f"{self.kind}@{self.layer}"


def parse_leak(spec: str, n_layers: int | None = None) -> Leak:
    """ "gather@3" -> Leak("gather", 3). Raises LeakSpecError with the accepted forms."""
    kind, sep, layer = spec.strip().partition("@")
    if kind not in KINDS:
        raise LeakSpecError(
            f"--inject-leak {spec!r}: expected gather@LAYER, silent-gather@LAYER, rs-allreduce, keep-slots "
            "or stale-rollback"
        )
    if kind in WHOLE_RUN:
        if sep:
            raise LeakSpecError(f"--inject-leak {spec!r}: {kind} applies to every layer, give no @LAYER")
        return Leak(kind)
    if not sep or not layer.isdigit():
        raise LeakSpecError(f"--inject-leak {spec!r}: {kind} needs a layer, e.g. {kind}@0")
    if n_layers is not None and not (0 <= int(layer) < n_layers):
        raise LeakSpecError(f"--inject-leak {spec!r}: layer must be in 0..{n_layers - 1}")
    return Leak(kind, int(layer))


def install_leak(model, spec: str) -> Leak:
    """Arm the leak on a worker's ShardedModel (controls/worker.py, the hook the worker calls after each
    handshake's load and reset; the leak was chosen at start-up)."""
    from ..comm import NullRecorder

    leak = parse_leak(spec, len(model.layers))
    comm = model.comm
    if leak.kind == "rs-allreduce":
        arm_allreduce(comm)
        return leak
    if leak.kind == "keep-slots":
        wipe = model.wipe

        def keep(slot: int | None = None) -> None:  # RELEASE wipes nothing
            if slot is None:
                wipe()
            elif slot < len(model.lengths):
                # the slot's bookkeeping forgets the session (its KV stays): else the next session's
                # first decode would look like a rollback to roll_back, which would zero the kept KV
                model.lengths[slot] = 0

        model.wipe = keep
        return leak
    if leak.kind == "stale-rollback":
        ignore_rollbacks(model)
        return leak
    from ..structural.sharded import ShardedModel

    if type(model) is not ShardedModel:  # the Megatron-style variant gathers already: nothing to hide
        raise LeakSpecError(f"--inject-leak {spec}: not supported by this model variant")
    res_sizes = list(model.plan.residual_sizes)
    full_index = list(range(sum(res_sizes)))  # the gather's output rows: every worker's range, in order
    target = leak.layer
    if target is None:  # parse_leak gives the gathers a layer: a Leak built some other way
        raise LeakSpecError(f"--inject-leak {spec}: {leak.kind} needs a layer, e.g. {leak.kind}@0")

    def gather(layer: int, x_dT) -> None:
        if layer != target:
            return
        if leak.kind == "silent-gather":
            saved, comm.recorder = comm.recorder, NullRecorder()
            try:
                comm.all_gather_workers(x_dT, res_sizes, f"L{layer}.leak")
            finally:
                comm.recorder = saved
            return
        x_HT = comm.all_gather_workers(x_dT, res_sizes, f"L{layer}.leak")  # (H, T): the full residual
        audit = model.layers[layer].audit
        if audit is not None:
            audit.hold(layer, "resid.in", full_index, x_HT.shape[0])

    layer = model.layers[target]  # the gather runs before this layer, composed onto its forward
    honest = layer.forward

    def leaky_forward(x_dT, step):
        gather(target, x_dT)
        return honest(x_dT, step)

    # An attribute on this one instance shadows ShardedLayer.forward for this layer only; mypy reads
    # any assignment to a method as a mistake, so the assignment goes through Any (issue 42 item 6
    # moves the leaks to wrappers chosen at start-up).
    cast(Any, layer).forward = leaky_forward
    return leak


def arm_allreduce(comm) -> None:
    """Make this Comm's reduce-scatters all-reduces in disguise (rs-allreduce): every peer gets the
    whole partial, while the event records only the addressed rows (a lie the socket counters catch).
    Composed onto the instance at start-up, so the honest Comm carries no branch for it."""
    import torch

    honest = comm.reduce_scatter

    def leaky(send, sizes, op):
        if len(sizes) == 1 or comm.fabric is not None:
            return honest(send, sizes, op)
        me, n, t = comm.rank - 1, len(sizes), send.shape[1]
        for q in range(n):
            if q != me:
                comm._put(q + 1, send)
        stack = torch.empty((n, sum(sizes), t), dtype=send.dtype)
        stack[me] = send
        for q in range(n):
            if q != me:
                comm._get(q + 1, stack[q], op)
        comm._emit("reduce_scatter", op, *comm._rs_counts(sizes, t))  # records only the addressed rows
        a = sum(sizes[:me])
        return stack.sum(0)[a : a + sizes[me]].contiguous()

    comm.reduce_scatter = leaky
    comm.reduce_scatter_from = lambda chunk, sizes, op: leaky(
        torch.cat([chunk(q) for q in range(len(sizes))]), sizes, op
    )


def ignore_rollbacks(model) -> None:
    """stale-rollback on a worker's ShardedModel, by composition (the honest model is untouched): no
    rollback (nothing zeroed, nothing returned for the log), and every span runs from where its slot's
    KV ends when that is past where the client put it: the rejected drafts' positions stay and are
    attended, and the span's tokens land after them."""
    from ..structural.ops import Span

    forward, reset = model.forward, model.reset
    model.roll_back = lambda spans, measure=False: []
    model.reset = lambda max_seq, slots=1: reset(max_seq * STALE_ROOM, slots)

    def forward_past_rollback(x_dT, spans, qkv_aT):
        return forward(x_dT, [Span(s.slot, max(s.pos, model.lengths[s.slot]), s.t) for s in spans], qkv_aT)

    model.forward = forward_past_rollback


def keep_revoked(engine) -> None:
    """The membership control (`fusion audit run --negative-control keep-revoked`), composed onto the
    client's engine at start-up: a revocation is recorded, but the revoked worker stays in the next
    epoch (nobody leaves). The membership check must fail."""

    def revocation(pid: int) -> tuple[list[int], set[int]]:
        engine.opts.log(f"audit negative control keep-revoked: worker {pid} stays in epoch {engine.epoch + 1}")
        return list(engine.order), set()

    engine.members._revocation = revocation
