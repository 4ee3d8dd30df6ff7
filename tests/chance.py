"""How many chance hits a "learns nothing" check may allow, from the binomial tail.

A vocabulary-matching attack on a uniform (masked) view still guesses right now and then by chance.
Counting on zero makes the check fail at random: on SmolLM2 a 37-token prompt against a 49,152-token
vocabulary failed so once (1 recovered) in a fresh-clone run. The bound below is the smallest k with
P(hits > k) ≤ `FALSE_FAILURE_RATE` when each of the n guesses hits with probability p, taken
conservatively as (distinct prompt ids) / V: a guess that lands on any of the prompt's own ids counts
as a risk, not only the one at its position. An attack that works (the controls: the structural
shard, the whole key set) recovers ≥ 90 % of the prompt, far above every bound this gives.
"""

from __future__ import annotations

from math import comb

FALSE_FAILURE_RATE = 1e-6  # one false failure in a million runs of each such check


def tail_above(k: int, n: int, p: float) -> float:
    """P(X > k) for X ~ Binomial(n, p)."""
    return max(0.0, 1.0 - sum(comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1)))


def chance_hits_bound(ids: list[int], vocab: int, rate: float = FALSE_FAILURE_RATE) -> int:
    """The most hits chance explains for a prompt `ids` over a vocabulary of `vocab`, at false-failure `rate`."""
    n, p = len(ids), len(set(ids)) / vocab
    k = 0
    while tail_above(k, n, p) > rate:
        k += 1
    return k
