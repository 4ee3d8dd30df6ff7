"""A masked worker. Group A multiplies masked inputs; a mask group (B, or B1..Bk) multiplies its own
masks.

Both hold the same public fixed-point weights: their member's output rows of every linear (plan.py),
as float64 `RingMatrix`es. Neither holds any state of the conversation: no residual, no KV cache,
no token, no position. A receives uniformly random ring elements and returns their products; B
receives a session key and a step number, expands the masks from the key and returns W_fx r.

A mask group works ahead: its products do not depend on the data, so right after streaming step s it computes
step s+1 for T = 1 (the next decode step) while the client and A are still busy; a decode step then
finds its layers ready. A prefill (T > 1) is computed on demand, layer by layer, streamed as each
layer is done so A and B run side by side.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from ..comm import Comm
from ..model import architecture as arch
from ..runtime.resources import rss_kb
from ..weights.loader import WeightSource
from . import protocol as P
from .masks import make_stream
from .plan import MaskedPlan, make_masked_plan
from .ring import RingMatrix, quantize_rows, weight_bits


def read_rows(src: WeightSource, layer: int, name: str, rows: tuple[int, int]) -> torch.Tensor:
    """Rows [a, b) of a (possibly fused) linear's weight, HF layout (out, in), fp32: only those rows
    are read (and, for GGUF, dequantized)."""
    return arch.read_weight(src, layer, name, rows=rows)


@dataclass
class MemberWeights:
    mats: list[list[RingMatrix]]  # [layer][op]
    meta: torch.Tensor  # (2, rows): e_i, ‖W_fx[i]‖₂ per owned row, in (layer, op) order


def load_member(src: WeightSource, plan: MaskedPlan, group: str, member: int) -> MemberWeights:
    mats, exps, norms = [], [], []
    for layer in range(plan.config.n_layers):
        row = []
        for s in plan.shapes:
            w = read_rows(src, layer, s.name, plan.member_rows(group, member, s.op))
            w_fx, e = quantize_rows(w, weight_bits(s.k, plan.limb_bits))
            row.append(RingMatrix(w_fx, plan.limb_bits))
            exps.append(e.to(torch.float64))
            norms.append(w_fx.norm(dim=1))
        mats.append(row)
    return MemberWeights(mats, torch.stack([torch.cat(exps), torch.cat(norms)]))


class MaskedWorker:
    """The command loop of one member of group A or of a mask group."""

    def __init__(
        self,
        src: WeightSource,
        sizes: tuple[int, ...],
        rank: int,
        comm: Comm,
        *,
        audit=None,
    ):
        self.src, self.sizes, self.rank, self.comm = src, tuple(sizes), rank, comm
        self.audit = audit  # masked.audit.AuditLog: taps what this worker received
        self.forwards = 0  # FORWARD steps served
        # set by hello() from the client's handshake; no step is served before it
        self.plan: MaskedPlan
        self.weights: MemberWeights

    def hello(self) -> int:
        """Handshake: check the plan fingerprint, load the weights, send the public metadata."""
        c = self.comm
        ctrl = c.recv(torch.zeros(P.CONTROL_LEN, dtype=torch.int64), 0, P.KIND_CONTROL, "hello")
        op, limb_bits, fp, mask_kind = (int(v) for v in ctrl)
        self.plan = make_masked_plan(self.src.config, self.sizes[0], self.sizes[1:], limb_bits)
        self.group, self.member = self.plan.group_of(self.rank)
        mine = P.fingerprint_int(self.plan)
        if op != P.Op.HELLO or fp != mine:
            c.send(torch.tensor([0, mine, 0, 0]), 0, P.KIND_CONTROL, "hello")
            raise RuntimeError(
                f"plan mismatch with the client (worker {mine:x}, client {fp:x}): same model and groups?"
            )
        t0 = time.perf_counter()
        self.weights = load_member(self.src, self.plan, self.group, self.member)
        load_ms = int((time.perf_counter() - t0) * 1000)
        c.send(torch.tensor([1, mine, load_ms, rss_kb()]), 0, P.KIND_CONTROL, "hello")
        c.send(self.weights.meta.contiguous(), 0, P.KIND_META, "meta")
        logging.getLogger(__name__).info(
            f"ready: group {self.group} member {self.member} of plan {self.plan.fingerprint()}, its rows loaded in "
            f"{load_ms / 1000:.1f} s, RSS {rss_kb() / 1024:.0f} MiB"
        )
        return mask_kind

    def serve(self) -> None:
        mask_kind = self.hello()
        if self.group == "A":
            self._serve_a()
        else:
            self._serve_b(mask_kind)

    # ---- what a step does with its data: the honest member's; controls.py's members override them ----

    def answer(self, name: str, y: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
        """What this member returns for linear `name` (rows, T): its product."""
        return y

    def received(self, name: str, m_KT: torch.Tensor) -> None:
        """A masked input arrived (group A): nothing more to do with it."""

    def step_begins(self, t: int) -> None:
        """A FORWARD of T columns begins (a mask group)."""

    # ---- group A: the hot path ----

    def _serve_a(self) -> None:
        c, plan, mats = self.comm, self.plan, self.weights.mats
        ctrl = torch.zeros(P.CONTROL_LEN, dtype=torch.int64)
        n_layers, n_ops = len(mats), len(plan.shapes)
        while True:
            c.recv(ctrl, 0, P.KIND_CONTROL, "cmd", wait_s=math.inf)  # idle between requests is normal
            op, t = int(ctrl[0]), int(ctrl[1])
            if op == P.Op.FORWARD:
                self.forwards += 1
                for layer, row in enumerate(mats):
                    for s, mat in zip(plan.shapes, row, strict=True):
                        name = P.op_name(layer, s.name)
                        m_KT = c.recv(torch.empty(s.k, t, dtype=torch.int64), 0, P.KIND_MASKED, name)
                        if self.audit is not None:
                            self.audit.tap(name, m_KT)
                        self.received(name, m_KT)
                        y = self.answer(
                            name,
                            mat.matmul(m_KT),
                            layer == 0 and s.op == 0,
                            layer == n_layers - 1 and s.op == n_ops - 1,
                        )
                        c.send(y, 0, P.KIND_OUT, name)
                if self.audit is not None:
                    self.audit.end_step()
            elif self._common(op):
                return

    # ---- a mask group: the masks' products, one step ahead ----

    def _products(self, stream, step: int, layer: int, t: int) -> torch.Tensor:
        """W_fx r for one layer's four ops, stacked: (rows_per_layer, T) int64."""
        out = []
        for s, mat in zip(self.plan.shapes, self.weights.mats[layer], strict=True):
            r_KT = stream.draw(step, layer, s.op, s.k * t).view(s.k, t)
            out.append(mat.matmul(r_KT))
        return torch.cat(out)

    def _serve_b(self, mask_kind: int) -> None:
        c, n_layers = self.comm, self.plan.config.n_layers
        ctrl = torch.zeros(P.CONTROL_LEN, dtype=torch.int64)
        stream, expected = None, 0
        ahead: tuple[int, int, list[torch.Tensor]] | None = None  # (step, T, per-layer products)
        while True:
            c.recv(ctrl, 0, P.KIND_CONTROL, "cmd", wait_s=math.inf)
            op, t, t_next, step = (int(v) for v in ctrl)
            if op == P.Op.RESET:
                key = c.recv(torch.zeros(32, dtype=torch.uint8), 0, P.KIND_KEY, "key")
                stream = make_stream(mask_kind, bytes(key.tolist()), guard=False)
                expected, ahead = 0, None
            elif op == P.Op.FORWARD:
                if stream is None or step != expected:
                    raise RuntimeError(
                        f"FORWARD step {step} out of order (expected {expected}, session started: {stream is not None})"
                    )
                self.step_begins(t)
                self.forwards += 1
                ready = ahead[2] if ahead is not None and ahead[:2] == (step, t) else None
                pending = []
                for layer in range(n_layers):
                    y = ready[layer] if ready is not None else self._products(stream, step, layer, t)
                    y = self.answer(P.op_name(layer, "mask"), y, layer == 0, layer == n_layers - 1)
                    pending.append((c.isend(y, 0, P.KIND_OUT, P.op_name(layer, "mask")), y))
                expected = step + 1
                # Work ahead while the client and group A run this step: the next decode step, whose T the
                # client guessed (1 per session, or the width of a speculating session's step). (The sends above are
                # already queued; the link's writer keeps them moving meanwhile.)
                t_next = max(1, t_next)
                ahead = (
                    expected,
                    t_next,
                    [self._products(stream, expected, layer, t_next) for layer in range(n_layers)],
                )
                for work, _ in pending:
                    work.wait()
                if self.audit is not None:
                    self.audit.end_step()
            elif self._common(op):
                return

    def _common(self, op: int) -> bool:
        """PING / SHUTDOWN; True when the loop must end."""
        if op == P.Op.PING:
            self.comm.send(torch.tensor([1, self.rank, 0, rss_kb()]), 0, P.KIND_CONTROL, "pong")
            return False
        if op == P.Op.SHUTDOWN:
            if self.audit is not None:
                self.audit.close()
            return True
        raise RuntimeError(f"unknown control op {op} for a group {self.group} worker")
