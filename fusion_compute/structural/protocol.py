"""Control words between client and workers: a fixed int64 vector [op, T, pos, arg].

Control words carry no state: an operation, a token count, a position, a session size.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Protocol

CONTROL_LEN = 4
MAX_SLOTS = 256  # KV slots (sessions of one batch) a worker accepts


class Op(IntEnum):
    HELLO = 1  # [HELLO, context, plan fingerprint, 0] -> reply [ok, fingerprint, load_ms, rss_kb]
    FORWARD = 2  # [FORWARD, n, ΣT, W], then spans (n, 3) int64 rows [slot, pos, T] (control), then
    #             when W > 0 W int64 tree words (control: per span [n_parents (0 or T), n_keep,
    #             parents..., kept columns of its previous step...], worker.with_trees), then ingress
    #             (d_w, ΣT), the spans' tokens as consecutive columns, and the worker's layer-0 q/k/v
    #             (qkv_w, ΣT); reply egress (H, ΣT), the last down partial.
    #             One session is one span (slot 0); several are continuous batching's step
    RESET = 3  # [RESET, slots, 0, context]: drop and re-zero the KV shards; `slots` KV slots (0: one)
    PING = 4  # [PING, ...] -> [1, rank, 0, rss_kb]
    SHUTDOWN = 5
    # 6, 7 and 9: the bench's STATS, BENCH_RS and PROBE (bench/ops.py), which its worker adds
    WIPE = 8  # [WIPE, ...]: the session is over: zero the KV shards now (hygiene)
    # 10 was FORWARD_BATCH, now FORWARD's only form
    RELEASE = 11  # [RELEASE, slot, 0, 0]: that slot's session is over: zero its KV slot now (hygiene)


class Fingerprinted(Protocol):
    """A plan that names itself by a hex fingerprint (structural.plan.Plan, masked.plan.MaskedPlan)."""

    def fingerprint(self) -> str: ...


def fingerprint_int(plan: Fingerprinted) -> int:
    """The plan's fingerprint as a positive int64, so client and workers can check they agree."""
    return int(plan.fingerprint()[:15], 16)
