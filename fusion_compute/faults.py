"""Fault injection for the tests (worker flag `--inject-fault SPEC`, never used otherwise).

  close-mid-message@STEP   at its STEP-th forward (counted from 1 over the worker's life), the worker
                           sends the client the header and half of its egress shard, closes its
                           connections and exits: a process dying in the middle of a message.

The other faults the suite injects come from outside the process (kill -9, SIGSTOP, a network link
set down in a namespace): tests/test_faults.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

KINDS = ("close-mid-message",)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int


def parse_fault(spec: str) -> Fault:
    kind, sep, step = spec.strip().partition("@")
    if kind not in KINDS or not sep or not step.isdigit() or int(step) < 1:
        raise UsageError(f"--inject-fault {spec!r}: expected close-mid-message@STEP (STEP >= 1)")
    return Fault(kind, int(step))
