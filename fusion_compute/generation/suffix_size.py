"""How many tokens a suffix match of m tokens may draft (issue 43): as many as would pay for their
columns at what a step costs now, judged by what matches of that length earned on this job.

SuffixDecoding caps a match of m tokens at factor · m drafts: a long match earns a long draft. One
factor cannot suit both ends of the cost: across a wide-area link (120 exchanges of 5-21 ms) a
column costs nearly nothing beside the round trips and a one-token match's 16 drafts pay; on one
machine (0.1 ms) a step of 5+ columns costs about twice a plain one, and a fresh job's first tree,
16 drafts from a one-token match, lost open chat 2-5 % before the job knew anything of its drafts
(docs/speculative.md, "After the token-major products"). So the cap is chosen from the cost:

    cap(m) = tree_cost.best_size([g_1, ..., g_K], base, per_column, span)    (best_sizes: every m at once)
    g_j    = Π_{d ≤ j} q_{m,d}

(base, per_column, span) the job's StepCost.costs() now (its fit, or before the first fit its
prior: a fresh job's first tree is sized too), and q_{m,d} = P(the draft at depth d is accepted | the
one at depth d - 1 was) for drafts from a match of length m: from the job's verifications whose
tree's first draft (the best, which the budget keeps first) came from a match of that length (m
from 1 to MATCH_LENGTHS, longer ones sharing the last; depths from 1 to DEPTHS, deeper sharing the
last), each depth starting from PRIOR_TRIALS pseudo-trials at the prior

    q0_{m,1} = m / (m + 2),        q0_{m,d} = (m + d - 1) / (m + d)  for d ≥ 2

Laplace's rule of succession, (s + 1) / (n + 2) after s agreements in n trials, over the tokens that
agreed with the match's earlier occurrence. The first draft asks whether the match is a copy at
all, and a match's first token is no evidence of one (any token occurs somewhere): s = m - 1 of
n = m, that token counted as a miss. Once the draft at depth d - 1 was accepted the copy is on and
every agreeing token counts: s = n = m + d - 2. So g_j = m / (m + 2) · (m + 1) / (m + j): a one-token
match's first draft is worth 1/3 and its 16 drafts (factor 16) 1.6 tokens in all, a three-token
match's first 3/5 and its 21 drafts 4.7. At a fresh job's prior costs on one machine (the step
table of bench/replay.py at 0.1 ms: a drafting step priced at 16 columns more, a column at 7 % of a
plain step) that caps a one-token match at no draft, two tokens at 15 and three at 19 (K = 32); at
5 ms a one-token match at 26 and the rest at K, so every match drafts to its factor there. For scale, replayed over the
bench's outputs (bench/replay.py, every draft verified): a one-token match's first draft was
accepted 17-45 % of the time (open chat, grounded), a longer match's 40-100 %. The drafter's
frequencies (the budget's gains, speculative.StepCost.allocate) still cut each tree after it is
drafted; this caps how big a draft each match length may grow. Tried in the same replay and not
kept: (m + d - 1) / (m + d + 1) at every depth (one miss more, everywhere) cut the copying
sessions' first long drafts at 5 ms (grounded 2.28 → 2.16); (m + d - 1) / (m + d) at every depth
(no miss) let one-token matches' 16-draft trees through at 0.1 ms, as before (open chat 1.00).

Greedy sessions only: a sampled session's drafts must not depend on the clock (its draws follow
its seed whatever the batch), so its drafter keeps the factor alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

from .tree_cost import best_sizes

MATCH_LENGTHS = 8  # match lengths told apart; longer ones share the last
DEPTHS = 8  # depths told apart per match length (as speculative.DEPTHS); deeper ones share the last
PRIOR_TRIALS = 1.0  # pseudo-trials at q0 per depth (as speculative.PRIOR_TRIALS)
HISTORY = 64  # verifications kept per match length (as speculative.POOL)


class PricesSteps(Protocol):
    """speculative.StepCost, as far as the cap reads it."""

    def costs(self, sessions: int | None = None) -> tuple[float, float, float] | None: ...


def prior_rate(match_len, depth):
    """q0_{m,d} of the module docstring, elementwise over arrays of m and d (numbers or numpy arrays)."""
    return np.where(depth == 1, match_len / (match_len + 2), (match_len + depth - 1) / (match_len + depth))


class MatchSizing:
    """One job's acceptance by match length and depth, and the draft size cap it buys at the job's
    step cost (module docstring). `add` after each verification; `caps` when drafting."""

    def __init__(self, cost: PricesSteps, k_max: int):
        self.cost = cost
        self.k_max = k_max
        self.history: dict[int, deque[tuple[int, int]]] = {}  # match bucket -> (depth, accepted) per verification
        # what `caps` reads, kept until it changes: each step's drafts (every session of a batch, and
        # every match length of a long copy, up to 63) would otherwise scan the history again, some 3 ms
        # of the client's time a draft on this project's 2-core machine, serial with the workers' step
        self._counts: dict[int, tuple[list[int], list[int]]] = {}  # bucket -> (hits, trials) per depth
        self._memo: tuple[tuple[float, float, float], np.ndarray] | None = None  # costs -> cap per match length

    def add(self, match_len: int, depth: int, accepted: int) -> None:
        """One verification of a tree `depth` deep whose first draft came from a match of `match_len`
        tokens, `accepted` of its drafts accepted along one path."""
        if match_len < 1 or depth < 1:
            return
        b = min(match_len, MATCH_LENGTHS)
        self.history.setdefault(b, deque(maxlen=HISTORY)).append((depth, accepted))
        self._counts.pop(b, None)
        self._memo = None

    def _counted(self, bucket: int) -> tuple[list[int], list[int]]:
        """(hits, trials) per depth of a match bucket's history (`gain_table`), counted once per change."""
        if bucket not in self._counts:
            hits, trials = [0] * DEPTHS, [0] * DEPTHS
            for depth, accepted in self.history.get(bucket, ()):
                for d in range(1, min(accepted + 1, depth) + 1):
                    b = min(d, DEPTHS) - 1
                    trials[b] += 1
                    hits[b] += d <= accepted
            self._counts[bucket] = hits, trials
        return self._counts[bucket]

    def gain_table(self, match_lens: np.ndarray, n: int) -> np.ndarray:
        """g_j = q_{m,1} ⋯ q_{m,j} for j = 1..n (columns), one row per match length m: a match's j-th
        draft counts if those before it did. q_{m,d}: a verification that accepted a of a path
        `depth` deep is a success at depths 1..a and a failure at a + 1 (if a < depth), counted at
        min(d, DEPTHS) for m's bucket (`_counted`); each depth starts from PRIOR_TRIALS trials at
        q0_{m,d}."""
        m = match_lens.astype(np.float64)[:, None]
        d = np.arange(1, n + 1, dtype=np.float64)[None, :]
        prior = prior_rate(m, d)  # every (m, d)
        counted = [self._counted(b) for b in range(1, MATCH_LENGTHS + 1)]
        hits = np.array([h for h, _ in counted], dtype=np.float64)
        trials = np.array([t for _, t in counted], dtype=np.float64)
        rows = np.minimum(match_lens, MATCH_LENGTHS)[:, None] - 1
        cols = np.minimum(np.arange(1, n + 1), DEPTHS)[None, :] - 1
        q = (hits[rows, cols] + PRIOR_TRIALS * prior) / (trials[rows, cols] + PRIOR_TRIALS)
        return np.multiply.accumulate(q, axis=1)

    def gains(self, match_len: int, n: int) -> list[float]:
        """One row of `gain_table`."""
        return [float(g) for g in self.gain_table(np.array([match_len]), n)[0]]

    def caps(self) -> Callable[[int], int]:
        """cap(m) for one draft, from a table of every match length's cap (1 to the longest asked,
        at least 64, SuffixTrie's default depth) computed once for as long as the cost and the history
        stay what they were: a batch's sessions in one step share it, and a long copy's drafts ask for
        every match length up to 63, which one at a time cost the client ~2 ms a draft, serial with
        the workers' step (3 % of a plain step at 0.1 ms). K for every m while no step was timed
        (nothing to price drafts by; the budget lets every draft through then too)."""
        costs = self.cost.costs()
        if costs is None:
            return lambda match_len: self.k_max

        def cap(match_len: int) -> int:
            if self._memo is None or self._memo[0] != costs or len(self._memo[1]) < match_len:
                upto = max(64, match_len, len(self._memo[1]) if self._memo is not None else 0)
                gains = self.gain_table(np.arange(1, upto + 1), self.k_max)
                self._memo = (costs, best_sizes(gains, *costs))
            return int(self._memo[1][match_len - 1])

        return cap
