"""How big a token tree pays (issue 43 item 3): a step's time from the link and the workers' compute,
a tree's worth from its drafter's per-node probabilities, and the size that maximises the two's ratio.

A sharded decode step of W columns (the last token plus W - 1 drafts) costs

    seconds(W) = X · rtt + base_compute + W · (bytes_per_column / link_rate + compute_per_column)

X the forward's sequential exchanges (Plan.exchanges_per_forward: 120 for SmolLM2 at N = 2), rtt one exchange's latency,
bytes_per_column the bytes one more column adds on the critical path summed over those X exchanges
(a message grows by one row per column: SmolLM2's hidden row is 576 fp32 = 2.3 KB; a 7B-class
model's gate/up message is ~76 KB per column, once per layer), link_rate the link's bytes per
second and compute_per_column a worker's arithmetic for one more column. The first term does not
depend on W: it is why a column is nearly free across a wide area, and why a wide tree pays there.

A tree's columns, best first (every parent before its children), are worth their expected accepted
length: with q(c) the chance that column c's token is accepted given its parent's was,

    E[accepted | first n columns] = Σ_{c ≤ n} Π_{u on the path root → c} q(u)

(a node counts only if every node above it was accepted; siblings exclude each other, and the sum
is exact for greedy acceptance, where at most one child of a node can be the target's argmax). The
step emits that plus one token (the target's own after the last accepted), so the size chosen is

    n* = argmax_n (1 + Σ_{c ≤ n} g(c)) / seconds(1 + n),    g(c) = Π_{u on the path to c} q(u)

over the prefixes of the drafter's order. As columns are added, the numerator grows by g(c) (falling
with depth) and the denominator by per_column = bytes_per_column / link_rate + compute_per_column:
the tree stops growing where g(c) · seconds(1 + n) < per_column · (1 + Σ g), so a large X · rtt
lets it grow and a slow link or slow compute cuts it.

Measured at run time (speculative.StepCost): the loop fits time = base + per_column · W (+ per
drafting session) to its decode steps' wall times, which measures X · rtt + base_compute as the
base and the sum of both per-column terms on the link it runs on. `LinkCost` is the decomposition
for a link one has not run on (the bench's emulated links, a deployment's rate): the fitted
per-column compute plus the bytes one column moves (the comm layer's counters: `bytes_per_column`
below) over that link's rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinkCost:
    """The step-time model of the module docstring, its terms in seconds and bytes."""

    round_trip_s: float  # one sequential exchange's latency
    exchanges: int  # sequential exchanges per forward (X)
    bytes_per_column: float  # bytes one more column adds on the critical path, over the X exchanges
    link_bytes_per_s: float  # the link's rate
    compute_per_column_s: float  # a worker's arithmetic for one more column
    compute_base_s: float = 0.0  # the step's arithmetic and bookkeeping whatever its width

    def __post_init__(self) -> None:
        if self.link_bytes_per_s <= 0 or self.exchanges < 0 or min(self.round_trip_s, self.bytes_per_column) < 0:
            raise ValueError("a link needs a positive rate and non-negative latency, exchanges and bytes")

    @property
    def base_s(self) -> float:
        """What a step costs whatever its width: X round trips and the fixed compute."""
        return self.exchanges * self.round_trip_s + self.compute_base_s

    @property
    def per_column_s(self) -> float:
        """What one more column costs: its bytes over the link's rate plus its compute."""
        return self.bytes_per_column / self.link_bytes_per_s + self.compute_per_column_s

    def seconds(self, columns: int) -> float:
        return self.base_s + columns * self.per_column_s


def bytes_per_column(peer_bytes_before: Sequence[int], peer_bytes_after: Sequence[int], columns: int) -> float:
    """Bytes one column adds on the critical path, from the comm layer's counters (each worker's
    `peer_bytes_sent`, structural client's `stats()`) read before and after steps that carried
    `columns` columns in all: the busiest worker's bytes per column (the exchanges wait for it)."""
    if columns < 1:
        raise ValueError("bytes per column needs at least one column")
    return max(a - b for b, a in zip(peer_bytes_before, peer_bytes_after, strict=True)) / columns


def path_gains(parents: Sequence[int], accept: Sequence[float]) -> list[float]:
    """g(c) per draft column: the product of `accept` (each column's chance of acceptance given its
    parent's) over the path to it. parents[i] indexes the drafts (-1: the last token's child, which is
    always accepted as a root), every parent before its child."""
    gains: list[float] = []
    for p, q in zip(parents, accept, strict=True):
        gains.append(q * (gains[p] if p >= 0 else 1.0))
    return gains


def expected_accepted(parents: Sequence[int], accept: Sequence[float]) -> float:
    """E[accepted drafts] of a tree: Σ over its nodes of the product of acceptance on its path."""
    return sum(path_gains(parents, accept))


def best_size(gains: Sequence[float], base_s: float, per_column_s: float, span_s: float = 0.0) -> int:
    """n* of the module docstring: how many of the first draft columns to run (0: none) so that
    (1 + Σ_{c ≤ n} gains[c]) / (base_s + (1 + n) · per_column_s + [n > 0] · span_s) is highest (ties:
    fewer); `span_s`: what a step that carries drafts costs beyond its columns (speculative.StepCost's
    per drafting session)."""
    return int(best_sizes(np.asarray([gains], dtype=np.float64).reshape(1, -1), base_s, per_column_s, span_s)[0])


def best_sizes(gains: np.ndarray, base_s: float, per_column_s: float, span_s: float = 0.0) -> np.ndarray:
    """best_size of every row of `gains` (candidates × draft columns) at once, in the same float64
    operations in the same order (the running sum starts at 1 and adds one gain at a time, as
    `np.add.accumulate` does; argmax takes the first of equal rates: ties to fewer columns)."""
    rows, n = gains.shape
    tokens = np.add.accumulate(np.concatenate([np.ones((rows, 1)), gains], axis=1), axis=1)
    columns = np.arange(2, n + 2, dtype=np.float64)  # 1 + n for n = 1..len(gains)
    seconds = np.concatenate([[base_s + per_column_s], base_s + span_s + columns * per_column_s])
    return np.argmax(tokens / np.maximum(seconds, 1e-12), axis=1)
