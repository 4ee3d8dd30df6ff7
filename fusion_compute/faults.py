"""Fault injection for the tests (worker flag `--inject-fault SPEC`, never used otherwise).

  close-mid-message@STEP   at its STEP-th forward (counted from 1 over the worker's life), the worker
                           sends the client the header and half of its egress shard, closes its
                           connections and exits: a process dying in the middle of a message.
  nan-egress@STEP          at its STEP-th forward, the worker sends its egress shard full of NaN (and
                           goes on serving): a liar the structural client's finiteness check must name.
  hello-fingerprint@1      the worker answers the plan handshake yes, stating another plan fingerprint
                           than the one it computed (STEP must be 1: there is one handshake per epoch).

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

from dataclasses import dataclass

from .errors import UsageError

LIES = ("lie-one", "lie-bias", "lie-stale", "lie-zeros", "lie-shape")
KINDS = ("close-mid-message", "nan-egress", "hello-fingerprint", *LIES)


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
