"""The masked mode's dishonest members, for the tests and the audit's negative control: subclasses
of worker.MaskedWorker chosen once at start-up (`--inject-fault lie-*@STEP`, `--inject-leak a-to-b`),
so the honest member's hot path carries no branch for them.

  LyingMember   returns a wrong product at its STEP-th forward (faults.py's lie-* kinds): one element
                off by one, a 2^40 bias, the previous step's result, zeros, or a row short. The
                client's product check must catch every one (tests/test_masked_verify.py).
  LeakyMember   a-to-b: A's first member forwards the step's first masked input to the first mask
                group's first member, which receives it: together they read the input (the masked
                audit's control).
"""

from __future__ import annotations

import torch

from ..runtime.faults import Fault
from .worker import MaskedWorker


class LyingMember(MaskedWorker):
    def __init__(self, *args, fault: Fault, **kw):
        super().__init__(*args, **kw)
        self.fault = fault
        self._last: dict[str, torch.Tensor] = {}  # lie-stale: the previous step's result per linear

    def answer(self, name: str, y: torch.Tensor, first: bool, last: bool) -> torch.Tensor:
        f, honest = self.fault, y
        if self.forwards == f.step and y.numel():
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
        if f.kind == "lie-stale":
            self._last[name] = honest
        return y


class LeakyMember(MaskedWorker):
    def received(self, name: str, m_KT: torch.Tensor) -> None:
        if self.member == 0 and name == self._first:
            self.comm.send(m_KT, self.plan.ranks(self.plan.mask_groups[0])[0], "leak", name)

    def step_begins(self, t: int) -> None:
        if self.group == self.plan.mask_groups[0] and self.member == 0:
            self.comm.recv(torch.empty(self.plan.shapes[0].k, t, dtype=torch.int64), 1, "leak", self._first)

    @property
    def _first(self) -> str:
        from . import protocol as P

        return P.op_name(0, self.plan.shapes[0].name)


def member_class(leak: str | None, fault: Fault | None) -> tuple[type[MaskedWorker], dict]:
    """The member this process plays, and its extra arguments: the honest one unless a control says."""
    if fault is not None:
        return LyingMember, {"fault": fault}
    if leak == "a-to-b":
        return LeakyMember, {}
    return MaskedWorker, {}
