"""One worker's structural step, transport-free: inputs in, outputs out, nothing read off a link.

The op loop (op_loop.py) decodes the client's control words and moves the bytes; this runner does
what a word asks of the worker's share of the model, and its audit records:

  begin(spans)             a FORWARD's spans (speculation's kept columns rolled back first, each
                           rollback recorded); the step's audit record opens (its ingress is then
                           received inside it)
  forward(x_dT, qkv_aT)    ingress in (its residual shard x[R_w] and its rows of layer 0's q/k/v,
                           one column per token) -> egress out: the last layer's down partial with
                           its residual rows added, (H, T); refused (TaintedInputs) when it holds
                           what the client's checks would name this worker for
  end()                    the step's audit record closes (after its egress left)
  release(slot), reset(max_seq, slots), wipe()
                           RELEASE / RESET / WIPE: one slot zeroed (measured), the KV cache made
                           anew, every shard zeroed

The model's own collectives (the reduce-scatters among workers) run on the Comm the model was
built with (ShardedModel.rebind): the runner holds no transport itself, so a test can drive it with
any Comm, an in-memory one included (tests/inproc.py), and no client.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import TaintedInputs
from ..comm.value_checks import egress_fault
from .ops import Span
from .plan import Plan
from .protocol import MAX_SLOTS
from .sharded import ShardedModel


class StepRunner:
    """The structural step of worker `w` (0-based) of `plan`, on its loaded `model`. `audit`: the
    epoch's audit recorder (audit.recorder.AuditRecorder, handed in at start-up), or None."""

    def __init__(self, model: ShardedModel, plan: Plan, w: int, audit: Any = None):
        self.model, self.plan, self.w, self.audit = model, plan, w, audit

    @property
    def n_residual(self) -> int:
        """Rows of this worker's ingress residual shard |R_w|."""
        return self.plan.workers[self.w].n_residual

    @property
    def n_qkv(self) -> int:
        """Rows of this worker's layer-0 q/k/v slice, which the client computes and sends."""
        return self.plan.qkv_sizes[self.w]

    def begin(self, spans: list[Span]) -> None:
        """A FORWARD of `spans` starts: the kept columns of a speculated tree move into place (the
        rest of its positions zeroed), then the step's record opens. It names the spans when the KV
        holds several sessions; one slot holds one session, slot 0, from a RESET to the next
        (audit/verify/sessions.py)."""
        model, audit = self.model, self.audit
        for slot, held, to, zeroed in model.roll_back(spans, measure=audit is not None):
            if audit is not None:
                audit.rollback(slot, held, to, zeroed)
        if audit is not None:
            batch = [[s.slot, s.pos, s.t] for s in spans] if model.n_slots > 1 else None
            audit.begin_step(sum(s.t for s in spans), spans[0].pos, spans=batch)
        self.spans = spans

    def forward(self, x_dT: torch.Tensor, qkv_aT: torch.Tensor) -> torch.Tensor:
        """Ingress -> egress for the spans `begin` named: (|R_w|, T) and (|qkv_w|, T) in, (H, T) out.
        Its inputs passed the comm's checks one by one, so an egress that fails the client's own
        check names nobody: TaintedInputs, and nothing is sent."""
        model = self.model
        e_HT = model.forward(x_dT.to(model.device), self.spans, qkv_aT.to(model.device))
        fault = egress_fault(e_HT, self.plan.n)
        if fault is not None:
            raise TaintedInputs(f"worker {self.w + 1}'s own egress holds {fault}: not sent")
        return e_HT

    def end(self) -> None:
        """The step is over (its egress sent): its record closes."""
        if self.audit is not None:
            self.audit.end_step()

    def release(self, slot: int) -> None:
        """RELEASE: zero one KV slot (a slot outside the cache: nothing to do). Measured, not assumed:
        the record says whether the slot reads all zeros now."""
        model = self.model
        if 0 <= slot < model.n_slots:
            model.wipe(slot)
            if self.audit is not None:
                self.audit.release(slot, zeroed=model.kv_abs_max(slot) == 0.0)

    def reset(self, max_seq: int, slots: int) -> None:
        """RESET: a KV cache of `slots` slots (1..MAX_SLOTS) of `max_seq` positions (0: the model's
        own), zeroed; a new session in the audit."""
        model = self.model
        model.reset(max_seq or model.max_seq, min(max(1, slots), MAX_SLOTS))
        if self.audit is not None:
            self.audit.new_session()

    def wipe(self) -> None:
        """WIPE: every shard zeroed."""
        self.model.wipe()
