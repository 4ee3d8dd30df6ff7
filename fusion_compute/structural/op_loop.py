"""The structural worker's op loop for one epoch: control words from the client over the epoch's
Comm, each handed to the step runner (runner.py), its results sent back.

  HELLO     [HELLO, context, plan fingerprint, 0]: the fingerprints agree, the share is loaded (or
            kept from the last epoch), the KV cache made -> [1, fingerprint, load_ms, rss_kb]
            (a mismatch: [0, its own fingerprint, 0, 0], and the epoch ends)
  FORWARD   [FORWARD, n spans, ΣT, tree words W], then the spans (n x [slot, pos, T]), the trees'
            W words when W > 0, the ingress (residual shard, layer-0 q/k/v rows) -> the egress
  RELEASE, RESET, WIPE   the runner's; nothing answered
  PING      -> [1, rank, 0, rss_kb]
  SHUTDOWN  every shard wiped, the audit log closed; the loop returns
  another   looked up in the ops the start-up added (the bench's, bench/ops.py), else an error

The bytes on the wire are protocol.py's; every word is received with `new_step=True`, which numbers
the epoch's steps (comm.py, "Numbered steps").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..comm import Comm, Witness
from ..runtime.resources import rss_kb
from .controls import Controls, OpHandler
from .ops import Span
from .plan import Plan
from .protocol import CONTROL_LEN, MAX_SLOTS, Op, fingerprint_int
from .runner import StepRunner
from .sharded import ShardedModel

_log = logging.getLogger(__name__)


def serve(
    comm: Comm,
    plan: Plan,
    w: int,
    load: Callable[[], ShardedModel],
    *,
    controls: Controls,
    ops: Mapping[int, OpHandler],
    witness: Witness,
    audit: Any = None,
) -> None:
    """Serve one epoch as worker `w` (0-based) of `plan`: HELLO, then words until SHUTDOWN.

    load: this epoch's model (the worker's share, loaded or kept; worker.Worker.model_for).
    audit: an `audit.recorder.AuditRecorder` (also the comm's recorder) that closes one log record
    per step; the controls (controls.Controls) arm the audit's negative control and name the
    variant: "sharded" or "megatron" (the replicated-residual baseline, same protocol)."""
    rank = w + 1
    ctrl = torch.zeros(CONTROL_LEN, dtype=torch.int64)
    comm.recv(ctrl, 0, "control", "hello", new_step=True)  # a command word: step 1 (comm.py, "Numbered steps")
    op, context, fp, _ = (int(v) for v in ctrl)
    mine = fingerprint_int(plan)
    if op != Op.HELLO or fp != mine:
        comm.send(torch.tensor([0, mine, 0, 0]), 0, "control", "hello")
        comm.flush()
        raise RuntimeError(f"plan mismatch with the client (worker {mine:x}, client {fp:x}): same model file?")
    t0 = time.perf_counter()
    model = load()
    model.reset(context)
    controls.arm(model)
    if audit is not None:
        model.attach_audit(audit)
        audit.start(plan.workers[w], plan.config, variant=controls.variant, leak=controls.leak)
    run = StepRunner(model, plan, w, audit)
    load_ms = int((time.perf_counter() - t0) * 1000)
    comm.send(torch.tensor([1, mine, load_ms, rss_kb()]), 0, "control", "hello")
    _log.info(
        f"ready: plan {plan.fingerprint()}, its share loaded in {load_ms / 1000:.1f} s, RSS {rss_kb() / 1024:.0f} MiB"
    )
    while True:
        comm.recv(ctrl, 0, "control", "cmd", wait_s=math.inf, new_step=True)  # idle is normal; a gone client is not
        op, t, pos, arg = (int(v) for v in ctrl)
        if op == Op.FORWARD:  # one session's tokens, or several sessions' (continuous batching): [op, n, ΣT, W]
            words = comm.recv(torch.empty(t * 3, dtype=torch.int64), 0, "control", "spans").view(t, 3).tolist()
            spans = [Span(*s) for s in words]
            if sum(s.t for s in spans) != pos or any(
                s.t < 1 or s.pos < 0 or not 0 <= s.slot < MAX_SLOTS for s in spans
            ):
                raise RuntimeError(f"malformed step: {spans} for {pos} tokens")
            if arg:  # token trees and kept paths ride with the spans (speculative decoding): no extra round
                tree = comm.recv(torch.empty(arg, dtype=torch.int64), 0, "control", "tree").tolist()
                spans = with_trees(spans, tree)
            run.begin(spans)
            x_dT = comm.recv(torch.empty(run.n_residual, pos, dtype=model.dtype), 0, "ingress", "embed")
            # layer 0's q/k/v rows, computed by the client (no layer-0 QKV scatter)
            qkv_aT = comm.recv(torch.empty(run.n_qkv, pos, dtype=model.dtype), 0, "ingress", "qkv0")
            witness.step(True)  # its account: a step is in progress here (until its egress leaves)
            comm.send(run.forward(x_dT, qkv_aT), 0, "egress", "final")
            witness.step(False)
            run.end()
        elif op == Op.RELEASE:
            run.release(t)
        elif op == Op.RESET:
            run.reset(arg, t)
        elif op == Op.WIPE:
            run.wipe()
        elif op == Op.PING:
            comm.send(torch.tensor([1, rank, 0, rss_kb()]), 0, "control", "pong")
        elif op == Op.SHUTDOWN:
            run.wipe()
            if audit is not None:
                audit.close()
            return
        elif op in ops:  # an op the start-up added (the bench's: bench/ops.py)
            ops[op](model, comm, plan, t, pos, arg)
        else:
            raise RuntimeError(f"unknown control op {op}")


def with_trees(spans: list[Span], words: list[int]) -> list[Span]:
    """The spans with their trees and kept paths (protocol.Op.FORWARD): per span, in order, [number of
    parents (0 or T), number of kept columns, the parents, the kept columns]. Checked: a parent
    comes before its column, column 0 is the root, kept columns start at 0 and increase."""
    out, at = [], 0
    for s in spans:
        if at + 2 > len(words):
            raise RuntimeError(f"malformed tree words for {spans}")
        n_par, n_keep = words[at], words[at + 1]
        parents, keep = words[at + 2 : at + 2 + n_par], words[at + 2 + n_par : at + 2 + n_par + n_keep]
        at += 2 + n_par + n_keep
        if n_par not in (0, s.t) or len(parents) != n_par or len(keep) != n_keep or n_keep > s.pos:
            raise RuntimeError(f"malformed tree words for span {s}")
        if n_par and (parents[0] != -1 or any(not 0 <= p < j for j, p in enumerate(parents) if j)):
            raise RuntimeError(f"malformed tree for span {s}: parents {parents}")
        if n_keep and (keep[0] != 0 or any(b <= a for a, b in zip(keep, keep[1:], strict=False))):
            raise RuntimeError(f"malformed kept columns for span {s}: {keep}")
        out.append(Span(s.slot, s.pos, s.t, tuple(parents) if n_par else None, tuple(keep) if n_keep else None))
    if at != len(words):
        raise RuntimeError(f"malformed tree words: {len(words) - at} left over")
    return out
