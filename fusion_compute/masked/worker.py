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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm
from ..errors import UsageError
from ..model import architecture as arch
from ..runtime.faults import Fault, parse_fault
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
        leak: str | None = None,
        fault: Fault | None = None,
    ):
        self.src, self.sizes, self.rank, self.comm = src, tuple(sizes), rank, comm
        self.audit = audit  # masked.audit.AuditLog: taps what this worker received
        self.leak = leak  # "a-to-b": negative control, A's first member forwards an input to B
        self.fault = fault  # tests only: a lie (faults.py) the client's product check must catch
        self.forwards = 0  # FORWARD steps served (the fault's clock)
        self._last: dict[str, torch.Tensor] = {}  # lie-stale: the previous step's result per linear
        self.plan: MaskedPlan | None = None
        self.weights: MemberWeights | None = None

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
        c.send(torch.tensor([1, mine, load_ms, _rss_kb()]), 0, P.KIND_CONTROL, "hello")
        c.send(self.weights.meta.contiguous(), 0, P.KIND_META, "meta")
        return mask_kind

    def serve(self) -> None:
        mask_kind = self.hello()
        if self.group == "A":
            self._serve_a()
        else:
            self._serve_b(mask_kind)

    # ---- lies (tests only) ----

    def _lie(self, name: str, y: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
        """FAULT INJECTION (tests only): what a dishonest member returns for linear `name` (rows, T)
        at the step `--inject-fault` names; the honest `y` otherwise."""
        f, honest = self.fault, y
        if f is not None and f.lie and self.forwards == f.step and y.numel():
            y = y.clone()
            if f.kind == "lie-one" and last:
                y[-1, -1] += 1
            elif f.kind == "lie-bias":
                y += 1 << 40
            elif f.kind == "lie-stale":
                prev = self._last.get(name)
                y = prev[:, -y.shape[1] :] if prev is not None and prev.shape[1] >= y.shape[1] else y.zero_()
            elif f.kind == "lie-zeros":
                y.zero_()
            elif f.kind == "lie-shape" and first:
                y = y[:-1]
        if f is not None and f.kind == "lie-stale":
            self._last[name] = honest
        return y

    # ---- group A: the hot path ----

    def _serve_a(self) -> None:
        c, plan, mats = self.comm, self.plan, self.weights.mats
        ctrl = torch.zeros(P.CONTROL_LEN, dtype=torch.int64)
        leak_to_b = self.leak == "a-to-b" and self.member == 0
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
                        if leak_to_b and layer == 0 and s.op == 0:
                            c.send(m_KT, plan.ranks(plan.mask_groups[0])[0], "leak", name)  # NEGATIVE CONTROL
                        y = self._lie(
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
        leak_from_a = self.leak == "a-to-b" and self.group == self.plan.mask_groups[0] and self.member == 0
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
                if leak_from_a:  # NEGATIVE CONTROL: receive what A's first member forwards
                    c.recv(torch.empty(self.plan.shapes[0].k, t, dtype=torch.int64), 1, "leak", "L0.qkv")
                self.forwards += 1
                ready = ahead[2] if ahead is not None and ahead[:2] == (step, t) else None
                pending = []
                for layer in range(n_layers):
                    y = ready[layer] if ready is not None else self._products(stream, step, layer, t)
                    y = self._lie(P.op_name(layer, "mask"), y, layer == 0, layer == n_layers - 1)
                    pending.append((c.isend(y, 0, P.KIND_OUT, P.op_name(layer, "mask")), y))
                expected = step + 1
                # Work ahead while the client and group A run this step: the next decode step, whose T the
                # client announced (1 for one session; a batch's session count). (The sends above are
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
            self.comm.send(torch.tensor([1, self.rank, 0, _rss_kb()]), 0, P.KIND_CONTROL, "pong")
            return False
        if op == P.Op.SHUTDOWN:
            if self.audit is not None:
                self.audit.close()
            return True
        raise RuntimeError(f"unknown control op {op} for a group {self.group} worker")


def _rss_kb() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def run_member(
    src: WeightSource, welcome: dict, rank: int, links: dict, o: Any, keep: Callable[[Any], None] = lambda log: None
) -> None:
    """A masked worker process after joining: `welcome` names the group sizes; `o` is
    worker.WorkerOptions; `keep` is handed the audit log (the process flushes it if it must exit)."""
    from .audit import AuditLog
    from .ring import limit_blas_threads

    sizes = tuple(int(x) for x in welcome["groups"])
    fault = parse_fault(o.inject_fault) if o.inject_fault else None
    if fault is not None and not fault.lie:
        raise UsageError(f"--inject-fault {o.inject_fault}: a masked worker knows only the lie-* faults")
    limit_blas_threads(o.threads or torch.get_num_threads())  # the ring product's BLAS (numpy's OpenBLAS) too
    group = make_masked_plan(src.config, sizes[0], sizes[1:], 8).group_of(rank)[0] if rank <= sum(sizes) else None
    epoch = int(welcome.get("epoch") or 0)
    audit = AuditLog(o.audit_dir, rank, "worker", group, sizes, epoch=epoch) if o.audit_dir else None
    if audit is not None:
        keep(audit)
    comm = Comm(rank, sum(sizes), links, timeout_s=o.timeout_s, recorder=audit, backend="tls" if o.key else "tcp")
    try:
        run(src, sizes, rank, comm, audit=audit, leak=o.inject_leak, fault=fault)
    finally:
        if audit is not None:
            audit.close()
        comm.close()


def run(
    src: WeightSource,
    sizes: tuple[int, ...],
    rank: int,
    comm: Comm,
    *,
    audit=None,
    leak: str | None = None,
    fault: Fault | None = None,
) -> None:
    if leak not in (None, "a-to-b"):
        raise ValueError(f"masked workers know one negative control, a-to-b (no-mask is the client's); got {leak!r}")
    if rank < 1 or rank > sum(sizes):
        raise ValueError(f"rank {rank} is not a worker of a {'+'.join(map(str, sizes))} job")
    MaskedWorker(src, sizes, rank, comm, audit=audit, leak=leak, fault=fault).serve()
