"""What the comm layer reports: one `Event` per transfer (the audit's raw material) and always-on
`Counters` (the benchmark's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Event:
    """One transfer, as the comm layer saw it (sender-side element counts)."""

    kind: str  # reduce_scatter | score_sum | norm_sum | ingress | egress | control | gather | all_reduce (baselines)
    op: str  # operator name, e.g. "L3.qkv"
    sent: tuple[int, ...]  # elements this rank sent to each world rank (index = rank)
    received: tuple[int, ...]  # elements this rank received from each world rank
    itemsize: int = 4  # bytes per element (fp32 state; int64 control words are 8)
    step: int = 0  # the step its frames were stamped with (comm.py, "Numbered steps")


# Transfers among workers (everything else is client <-> worker: ingress, egress, control).
WORKER_COLLECTIVES = frozenset({"reduce_scatter", "score_sum", "norm_sum", "gather", "all_reduce"})


@dataclass
class Counters:
    """Always-on totals for the benchmark (three integer additions per transfer)."""

    collectives: int = 0  # collectives this rank took part in among workers
    peer_bytes_sent: int = 0  # bytes it addressed to other workers (sender-side, payload only)
    client_bytes: int = 0  # bytes to and from the client (rank 0)


class Recorder(Protocol):
    def record(self, event: Event) -> None: ...


class NullRecorder:
    def record(self, event: Event) -> None:
        pass
