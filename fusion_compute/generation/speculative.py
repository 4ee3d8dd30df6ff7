"""Speculative decoding on the user's side: drafts proposed on the client, verified by one sharded
forward, accepted so that the output is the target model's exactly.

Across a wide-area boundary a decode step costs 4 sequential exchanges per layer whatever its width,
so a step that carries the last token plus K proposals costs about what one token does, and every
accepted proposal is a step saved. The loop (batching.BatchRunner) asks each session's drafter for
up to K tokens, runs [last, d1..dK] in that session's KV slot with every column's logits, and keeps:

  greedy    the longest prefix of the drafts that equals the target's argmax, then the target's own
            token at the first mismatch (or after the last draft): exactly the tokens greedy
            decoding would give, one per column
  sampled   the rejection rule of Leviathan et al. 2023 / Chen et al. 2023 with the drafter's
            proposal q a point mass (both drafters propose deterministically): draft d is kept with
            probability p(d), else the token is drawn from p with d removed, renormalised
            ((p - q)+); after the last kept draft one token is drawn from p. Each emitted token is
            then distributed as p given the tokens before it, as without speculation.

p is the target's distribution after temperature, top-k and top-p (sampling.Sampler.probs). The
rejected columns' KV entries are rolled back (engine.rollback): the next step starts at the first
rejected position, and a worker zeroes the stale positions before writing there (structural
worker), or the client zeroes its own cache (masked mode). Nothing rejected is ever attended.

Drafters (one per session):
  NgramDrafter       prompt lookup: the longest n-gram that ends the session's tokens (prompt
                     included) found earlier in them; proposes what followed its latest occurrence
                     that has K tokens after it (or the most it finds), or as a tree what followed
                     each occurrence, branching where they differ (propose_tree)
  SuffixDrafter      SuffixDecoding (suffix.py): suffix tries over the session's tokens and over
                     the job's earlier outputs, the draft scored by frequency and sized by the match
  DraftModelDrafter  a small model of the same vocabulary on the client (the dense twin), greedy,
                     with its own KV cache per session, rolled back to the common prefix each step;
                     as a tree (propose_tree; not used by the loop: docs/speculative.md) its next
                     likeliest tokens as leaves where its top-1 is unsure

DraftLength adapts K per session: longer after a fully accepted step, shorter after a miss, and no
drafts at all (for a growing number of steps) while acceptance stays low, so a session whose
drafts do not pay costs only plain decode steps.

StepCost (one per job) weighs acceptance against what a wider step costs: the loop tells it each decode
step's width (columns), how many sessions in it carried drafts, and its wall time; it fits time =
base + per_column × columns + per_span × drafting sessions over the recent steps, and gives each
greedy session the number of drafts that makes the step's expected tokens per second highest (a
session's j-th draft is worth q_1 ⋯ q_j, q_d its acceptance at depth d: depth_rates). Where a step's
time is the network's (a wide-area round trip) a column costs almost nothing and every draft
DraftLength allows is kept; where it is compute (one machine, a batch), long drafts with little
acceptance are cut. A fixed batch (no session waiting for a slot: batching.BatchRunner._worth) runs
until its last session ends, so there a session's tokens are worth the seconds they save that batch
(allocate_worth), not a step's share. Sampled sessions keep DraftLength's count: their drafts, and so the draws a
seed gives, must not depend on the batch or the clock. A tree's j-th column is worth the product of
acceptance on its path (tree_cost.py: the session's acceptance at each node's depth times the
drafter's branch frequency), and a StepCost given a link's model (tree_cost.LinkCost, from
--link-rtt-ms/--link-mbps: round trips, bytes per column over the link's rate) adds it to the
compute it fits. Before its first fit a StepCost prices drafts by a prior (StepCost.prior: a column
at what a prompt token cost the job's prefill beyond a plain step, a drafting session at
PRIOR_SPAN_COLUMNS columns), so no draft of a greedy session runs unpriced after the job's first
prefill. Where a cost model prices a greedy session's drafts, it is the gate: DraftLength's pause
applies only before one does (and to sampled sessions), and a session the budget starves probes
with one draft now and then.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from ..errors import UsageError
from .sampling import Sampler
from .speculative_config import SpeculativeConfig
from .suffix import SuffixCache, SuffixDrafter
from .suffix_size import MatchSizing
from .suffix_tree import Draft
from .token_tree import TokenTree, accept
from .tree_cost import LinkCost

# DraftLength's low-acceptance pause: over the last WINDOW verifications, fewer than MIN_GAIN accepted
# tokens per verification stops drafting for PAUSE_STEPS steps, doubling (to PAUSE_MAX) each time it
# stops again without a verification that paid in between.
WINDOW = 6
MIN_GAIN = 0.5
PAUSE_STEPS = 8
PAUSE_MAX = 128


def verify(sampler: Sampler, logits_TV: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """The tokens one verification of a chain emits and how many drafts it accepted: token_tree.accept
    on the chain [last, d1..dK] (the rule above; a tree's is the same walk with siblings). logits_TV:
    the target's logits at [last, d1..dK], (K + 1, V); row i scores the token after column i."""
    out, path = accept(sampler, TokenTree.chain(-1, drafts), logits_TV)
    return out, len(path) - 1


class DraftLength:
    """How many tokens a session drafts at its next step (0: none), from what its last steps accepted.
    Not adaptive: always the most allowed. `sized_by_drafter` (the suffix drafter, whose drafts are
    as long as its match earns): the cap stays K, only the low-acceptance pause applies."""

    def __init__(self, k_max: int, adaptive: bool = True, sized_by_drafter: bool = False):
        self.k_max = k_max
        self.adaptive = adaptive
        self.sized_by_drafter = sized_by_drafter
        self.k = k_max
        self.recent: deque[int] = deque(maxlen=WINDOW)  # accepted tokens of the last verifications
        self.paused = 0  # steps left without drafting
        self.starved = 0  # steps in a row the cost budget cut every draft (probe)
        self.probe_every = PAUSE_STEPS  # starved steps before a probe: doubles while probes find nothing
        self.probing = False  # this step's draft is a probe
        self.pause = PAUSE_STEPS
        self.history: deque[tuple[int, int]] = deque(maxlen=4 * WINDOW)  # (drafted, accepted) per verification

    def next(self, priced: bool = False) -> int:
        """Drafts for the next step. `priced`: a cost model prices this step's drafts (StepCost has
        costs, and the session is greedy, so the budget may cut it): it is the gate then, and the
        low-acceptance pause, a guess made before any cost was known, does not apply (the pause kept
        drafts from wide-area steps where a column costs nearly nothing: docs/speculative.md)."""
        if self.paused:
            self.paused -= 1
            if not priced:
                return 0
        return self.k

    def update(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One verification: its drafts, how many it accepted, and the depth of its tree (a chain's
        is its length; the history counts a verification as trials along one path, so a tree whose
        every level was accepted is no miss)."""
        if drafted:
            self.history.append((drafted if depth is None else depth, accepted))
        if self.probing and drafted:  # a probe that found nothing waits twice as long for the next
            self.probing = False
            self.probe_every = PAUSE_STEPS if accepted else min(PAUSE_MAX, 2 * self.probe_every)
        if not self.adaptive or drafted == 0:
            return
        if not self.sized_by_drafter:
            self.k = (
                min(self.k_max, self.k + 2) if accepted == drafted else max(1, self.k - 1)
            )  # transformers' heuristic
        self.recent.append(accepted)
        if accepted:
            self.pause = PAUSE_STEPS
        if len(self.recent) == WINDOW and sum(self.recent) < MIN_GAIN * WINDOW:
            self.paused, self.pause = self.pause, min(PAUSE_MAX, 2 * self.pause)
            self.recent.clear()
            self.k = self.k if self.sized_by_drafter else 1  # after a pause, probe with one draft

    def acceptance(self, prior: float = 0.5) -> float:
        """The chance that a draft is accepted given the ones before it were, from the recent
        verifications (a verification accepts a prefix: `accepted` successes, then one failure unless
        all were accepted), with PRIOR_TRIALS trials at rate `prior` before them: the job's own rate
        (Speculator.pool), so that a new session starts from what drafts earn on this job, not from
        even odds."""
        return acceptance_rate(self.history, prior)

    def probe(self, budgeted: int) -> int:
        """The drafts a priced session runs after the budget gave it `budgeted`: that, except that
        after `probe_every` steps in a row cut to none, one draft, so that its acceptance (which the
        budget judges it by) can still learn that its text turned predictable (a copied passage).
        `probe_every` starts at PAUSE_STEPS and doubles (to PAUSE_MAX) after each probe that accepted
        nothing, back to PAUSE_STEPS after one that accepted: a probe is a column the budget judged
        not worth its cost, so a session whose probes keep missing (open chat) pays for ever fewer."""
        self.probing = False
        if budgeted:
            self.starved = 0
            return budgeted
        self.starved += 1
        if self.starved >= self.probe_every:
            self.starved = 0
            self.probing = True
            return 1
        return 0

    def depth_rates(self, prior: list[float]) -> list[float]:
        """depth_rates of the recent verifications, after PRIOR_TRIALS trials per depth at the job's
        rates (`prior`, JobAcceptance.depth_rates)."""
        return depth_rates(self.history, prior)


# A session's acceptance estimate starts from the job's: PRIOR_TRIALS pseudo-trials at the rate the job's
# last POOL verifications (every session's) had, itself from one success and one failure while the job
# has none. Measured (docs/performance.md, issue 23): with even odds for every new session, a batch of
# open-chat sessions of 24 tokens each drafted on that prior for most of their short lives, and read
# 0.92-0.95x the plain batch at 0-5 ms on a quiet machine (18 pairs per cell). One pseudo-trial, not
# two: a session's own first verification weighs as much as the whole job's, so an open-chat session
# on a job whose pool grounded sessions filled stops drafting on their rate after one miss. Replayed
# (bench/replay.py --one-job, both workloads in one job; docs/speculative.md): grounded τ at 0.1 ms
# 1.56 -> 1.59 with two -> one, 2.46 at 21 ms either way.
PRIOR_TRIALS = 1.0
POOL = 64
# A job without verifications yet: a draft token is as likely as its drafter says (the budget's gains
# multiply this by the drafter's frequency of each branch; a chain without frequencies drafts in full),
# not one hit and one miss, which halved every depth again below the drafter's own estimate and, once
# drafts were priced from the first step (StepCost.prior), kept copying sessions from drafting until a
# probe: replayed (bench/replay.py --simulate --job-per-prompt --output-tokens 24, docs/speculative.md)
# grounded τ at 5 and 21 ms 2.53 with 0.5, 2.69 with 1, 2.77 unpriced.
EMPTY_JOB_RATE = 1.0


def acceptance_rate(history: Iterable[tuple[int, int]], prior: float = 0.5) -> float:
    """P(a draft is accepted | the drafts before it were) from (drafted, accepted) verifications, each
    `accepted` successes then one failure unless all were accepted, after PRIOR_TRIALS trials at rate
    `prior` (0.5: one success and one failure)."""
    hits = misses = 0
    for drafted, accepted in history:
        hits += accepted
        misses += accepted < drafted
    return (hits + PRIOR_TRIALS * prior) / (hits + misses + PRIOR_TRIALS)


# Acceptance by depth: q_d = P(the draft at depth d is accepted | the one at depth d - 1 was), for
# d = 1..DEPTHS (deeper drafts share the last). One rate for every depth (acceptance_rate) overstates
# the first draft and understates the deeper ones: replayed over the bench's grounded outputs with the
# suffix drafter (docs/speculative.md), the one rate was 0.68 where P(depth 1) was 0.39, P(2 | 1) 0.66
# and P(3 | 2) 0.81 (open chat: 0.39 against 0.27, 0.42, 0.60). The budget prices each column with it.
DEPTHS = 8


def depth_rates(history: Iterable[tuple[int, int]], prior: list[float]) -> list[float]:
    """q_d for d = 1..DEPTHS from (depth, accepted) verifications: a verification that accepted a of a
    path `depth` deep is a success at depths 1..a and a failure at a + 1 (if a < depth); each depth
    starts from PRIOR_TRIALS trials at prior[d - 1]."""
    hits, trials = [0] * DEPTHS, [0] * DEPTHS
    for depth, accepted in history:
        for d in range(1, min(accepted + 1, depth) + 1):
            b = min(d, DEPTHS) - 1
            trials[b] += 1
            hits[b] += d <= accepted
    return [(h + PRIOR_TRIALS * p) / (n + PRIOR_TRIALS) for h, n, p in zip(hits, trials, prior, strict=True)]


def chain_gains(q: list[float], n: int) -> list[float]:
    """g_j = q_1 ... q_j for j = 1..n: the j-th draft of a chain counts if every one before it did."""
    out, g = [], 1.0
    for j in range(1, n + 1):
        g *= q[min(j, DEPTHS) - 1]
        out.append(g)
    return out


class JobAcceptance:
    """Every session's recent verifications on one job, pooled: the prior of a session's own rate."""

    def __init__(self) -> None:
        self.history: deque[tuple[int, int]] = deque(maxlen=POOL)

    def add(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        if drafted:
            self.history.append((drafted if depth is None else depth, accepted))

    def rate(self) -> float:
        """The job's rate, from its verifications after PRIOR_TRIALS trials at EMPTY_JOB_RATE."""
        return acceptance_rate(self.history, EMPTY_JOB_RATE)

    def depth_rates(self) -> list[float]:
        """Per depth, from the job's verifications, each depth's prior the job's one rate."""
        return depth_rates(self.history, [self.rate()] * DEPTHS)


# StepCost: the decode steps it fits over, the fewest it needs, and the least spread of widths that
# lets it tell a column's cost from noise (below that it keeps its last fit's per-column and
# per-session costs and refits only the base; before any fit its prior prices the drafts).
COST_WINDOW = 32
COST_MIN_STEPS = 6
COST_MIN_SPREAD = 2.0
SPAN_MIN_STEPS = 3  # steps at the fewest drafting sessions and steps above it, each, to fit a span's cost
# Before its first fit a job's drafts are priced by a prior, not let through unpriced (issue 43: a
# session that accepted nothing drafted 49 columns in its job's first steps and read 0.88x): a column
# costs what one more prompt token cost the job's prefill over a plain decode step (the round trips
# cancel: both steps make the same exchanges), and a drafting session PRIOR_SPAN_COLUMNS columns
# (StepCost.prior). Measured on the bundled SmolLM2 at N = 2 on loopback (docs/speculative.md, "Priced
# from the first step", bench/step_width.py): at load 6-7 one session's step going from 1 column to 2
# cost 80-100 ms and each further column 1-9 ms; at load 10-11 the second 23 ms and the next ~20 ms each:
# 16 is the upper end, a prior that errs toward not drafting until the fit.
PRIOR_SPAN_COLUMNS = 16.0


class StepCost:
    """What a wider decode step costs, fitted from the steps the loop ran (least squares over the last
    COST_WINDOW decode steps): time ≈ base + per_column × columns + per_span × spans (+ per_session ×
    sessions), where `spans` counts the sessions whose step carries drafts (a verification span takes
    another attention path on the workers and every column's logits on the client, whatever its
    length) and `sessions` those in the step (a session's own column costs its attention and its
    bookkeeping beyond a draft column's: fitted where the count spreads, as a batch's sessions
    finish), and the drafts worth what they cost."""

    def __init__(self, link: LinkCost | None = None, prior: bool = True):
        self.link = link  # a link's model in place of the fitted base and per-column cost (tree_cost.py)
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=COST_WINDOW)
        self.sessions: deque[int] = deque(maxlen=COST_WINDOW)  # each sample's sessions in the step
        self.per_session = 0.0  # the fit's s per session in the step beyond its column (0: not told apart)
        self.use_prior = prior  # False: drafts go unpriced until the first fit (as before issue 43's round)
        self.prefill_s: tuple[int, float] | None = None  # the last step with a prefill in it: (columns, s), the prior's
        # the last fit that could tell a column's cost: once the budget cuts every draft, the steps all
        # have one width and the window alone would forget what a column costs, let every draft back
        # in, and learn it again (measured, docs/performance.md: an open-chat batch at 0 ms read 0.89x the
        # plain batch without this, 1.01x with it)
        self.last: tuple[float, float] | None = None  # (s per column, s per drafting session)
        self.last_session = 0.0  # and its s per session in the step
        self._answer: tuple[float, float, float] | None = None  # fit()'s answer for the samples as they are
        self._fresh = False

    def observe(self, width: int, spans: int, seconds: float, prefill: bool = False, sessions: int = 1) -> None:
        """One decode step: its columns, the sessions in it that carried drafts, its wall time, and the
        sessions in it. A step with a prefill in it (`prefill`) is another cost and is not fitted: the
        prior reads it."""
        if prefill:
            self.prefill_s = width, seconds
            return
        self.samples.append((width, spans, seconds))
        self.sessions.append(sessions)
        self._fresh = False
        if spans:  # a step with drafts: the window may tell a column's cost now; keep it (self.last)
            self.fit()

    def fit(self) -> tuple[float, float, float] | None:
        """(base s, s per column, s per drafting session), or None while the steps seen cannot
        separate a column's cost from the rest (too few, or all of about one width) and none before
        them could: then the last such fit's costs, with the base refitted to the recent steps.
        Computed once per observed step (observe and the next allocate share it)."""
        if not self._fresh:
            self._answer, self._fresh = self._fit(), True
        return self._answer

    def _fit(self) -> tuple[float, float, float] | None:
        if len(self.samples) < COST_MIN_STEPS:
            return None
        ws = [float(w) for w, _, _ in self.samples]
        ss = [float(n) for _, n, _ in self.samples]
        ts = [t for _, _, t in self.samples]
        ns = [float(n) for n in self.sessions]
        if statistics.pstdev(ws) < COST_MIN_SPREAD:
            if self.last is None:
                return None
            (per_column, per_span), self.per_session = self.last, self.last_session
            base = statistics.fmean(
                t - per_column * w - per_span * n - self.per_session * m
                for w, n, t, m in zip(ws, ss, ts, ns, strict=True)
            )
            return base, per_column, per_span
        fitted = None
        self.per_session = 0.0
        # a batch whose sessions finish: its steps narrow by a session's column, which costs more than a
        # draft column (its own attention and bookkeeping); one regressor for both read a draft column
        # at 21 ms and the base 400-540 ms as 8 sessions went to 2 (docs/speculative.md, "8 sessions")
        if statistics.pstdev(ns) > 0.5:
            x = torch.tensor([[1.0, w, n, m] for w, n, m in zip(ws, ss, ns, strict=True)], dtype=torch.float64)
            coef = torch.linalg.lstsq(x, torch.tensor(ts, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
            base, per_column, per_span, per_session = (float(c) for c in coef)
            if min(per_column, per_span, per_session) >= 0:
                fitted, self.per_session = (base, per_column, per_span), per_session
        # the drafting sessions' cost needs steps with more and with fewer of them: a single session's
        # 0-or-1 never spreads by more than 0.5, so that test alone folded its span's cost into the base
        # and priced its first draft at one column's cost (docs/speculative.md, branch nevers)
        low = min(ss)
        if fitted is None and (
            statistics.pstdev(ss) > 0.5 or min(ss.count(low), len(ss) - ss.count(low)) >= SPAN_MIN_STEPS
        ):
            x = torch.tensor([[1.0, w, n] for w, n in zip(ws, ss, strict=True)], dtype=torch.float64)
            coef = torch.linalg.lstsq(x, torch.tensor(ts, dtype=torch.float64).unsqueeze(1)).solution.squeeze(1)
            base, per_column, per_span = (float(c) for c in coef)
            if per_column >= 0 and per_span >= 0:
                fitted = base, per_column, per_span
        if fitted is None:
            per_column, base = statistics.linear_regression(ws, ts)  # one regressor: spans folded into the rest
            fitted = base, max(0.0, per_column), 0.0
        self.last, self.last_session = fitted[1:], self.per_session
        return fitted

    def prior(self) -> tuple[float, float, float] | None:
        """The costs before the first fit. Per column c = (t_p - t_d) / (w_p - w_d): what the last
        prefill's step (w_p columns in t_p s) cost beyond the plain decode steps seen (medians: w_d
        columns in t_d) per column, the round trips cancelling; before any plain decode step,
        c = t_p / w_p (a step costs at least its columns). Per drafting session PRIOR_SPAN_COLUMNS · c.
        The base: the median over the decode steps seen of their time less their columns and spans
        at those prices; before any, t_p - c · w_p = 0, so that the job's first decode step drafts
        nothing (no draft pays for 16 columns where a column costs as much as the rest of the step):
        the prefill's time alone cannot tell how much of it a decode step's base is. None before any
        step was timed."""
        if self.prefill_s is None:
            return None
        w_p, t_p = self.prefill_s
        plain = [(w, t) for w, n, t in self.samples if n == 0]
        if plain:
            w_d, t_d = statistics.median(w for w, _ in plain), statistics.median(t for _, t in plain)
            c = max(0.0, (t_p - t_d) / max(1.0, w_p - w_d))
        else:
            c = t_p / max(1, w_p)
        span = PRIOR_SPAN_COLUMNS * c
        if not self.samples:
            return 0.0, c, span
        return max(0.0, statistics.median(t - c * w - span * n for w, n, t in self.samples)), c, span

    def costs(self, sessions: int | None = None) -> tuple[float, float, float] | None:
        """(base s, s per column, s per drafting session) of a step of `sessions` sessions (default: as
        many as the last step had): the link's model when one was given (tree_cost.LinkCost, its
        compute terms the fit's once there is one: what the steps measured is taken as the workers'
        compute, the link's round trips and bytes added to it; the drafting session's cost fitted,
        else 0), else the fit (its base with per_session × sessions); before the first fit, the prior
        in the fit's place (None only before any step was timed, or with the prior off)."""
        fit = self.fit()
        if fit is not None and self.per_session:
            n = sessions if sessions is not None else self.sessions[-1] if self.sessions else 0
            fit = fit[0] + self.per_session * n, fit[1], fit[2]
        elif fit is None and self.use_prior:
            fit = self.prior()
        if self.link is None:
            return fit
        link = self.link
        if fit is not None:
            link = replace(link, compute_base_s=max(0.0, fit[0]), compute_per_column_s=fit[1])
        return link.base_s, link.per_column_s, 0.0 if fit is None else fit[2]

    def allocate(
        self,
        caps: list[int],
        rates: list[float],
        fixed: list[bool] | None = None,
        gains: list[list[float] | None] | None = None,
    ) -> list[int]:
        """Drafts per decoding session (each at most its cap; a `fixed` one keeps its cap). The
        expected tokens of a session's first m drafts are g_1 + ... + g_m, g_j the j-th column's
        chance to be accepted (tree_cost: the product of acceptance on its path): `gains[i]` when
        given (a tree's, from its drafter's per-node probabilities), else rate^j (a chain's j-th
        draft counts only if those before it were accepted). Sessions are taken by falling rate,
        each given the m (0 included) that makes the step's expected tokens per second highest
        (tree_cost.best_size for one session alone). With no cost at all (no step timed yet, or the
        prior off and no fit): the caps."""
        fit = self.costs(len(caps))
        if fit is None or not caps:
            return list(caps)
        base, per_column, per_span = fit
        fixed = fixed or [False] * len(caps)
        g: list[list[float]] = []
        for i in range(len(caps)):
            given = gains[i] if gains else None
            g.append(list(given[: caps[i]]) if given is not None else [rates[i] ** j for j in range(1, caps[i] + 1)])
        ks = [cap if f else 0 for cap, f in zip(caps, fixed, strict=True)]
        tokens = len(caps) + sum(sum(g[i][: ks[i]]) for i in range(len(caps)))
        seconds = max(base + per_column * (len(caps) + sum(ks)) + per_span * sum(k > 0 for k in ks), 1e-6)
        for i in sorted(range(len(caps)), key=lambda i: -rates[i]):
            if fixed[i]:
                continue
            best_m, best, gained, best_gain = 0, tokens / seconds, 0.0, 0.0
            for m in range(1, len(g[i]) + 1):
                gained += g[i][m - 1]
                rate = (tokens + gained) / (seconds + per_span + m * per_column)
                if rate > best:
                    best_m, best, best_gain = m, rate, gained
            if best_m:
                ks[i] = best_m
                tokens += best_gain
                seconds += per_span + best_m * per_column
        return ks

    def allocate_worth(
        self,
        caps: list[int],
        gains: list[list[float] | None],
        worth: list[tuple[float, float, float]],
        fixed: list[bool] | None = None,
    ) -> list[int]:
        """Drafts per decoding session of a batch whose sessions' tokens save unequal time (a fixed
        batch: generation/batching.BatchRunner._worth): session i, worth[i] = (shared, limit, own),
        gets the m (0 included) that makes

            shared · min(G_m, limit) + own · G_m - per_span · [m > 0] - per_column · m

        highest (G_m = g_1 + ... + g_m its first m columns' expected accepted tokens, `gains[i]`): the
        seconds its tokens are expected to save the batch, the shared step's for at most `limit`
        tokens and its own place in the steps for each, less the seconds its drafts add to the step.
        A `fixed` one keeps its cap. With no cost at all: the caps."""
        fit = self.costs(len(caps))
        if fit is None or not caps:
            return list(caps)
        _, per_column, per_span = fit
        fixed = fixed or [False] * len(caps)
        ks = []
        for cap, g, (shared, limit, own), f in zip(caps, gains, worth, fixed, strict=True):
            if f or g is None:
                ks.append(cap if f else 0)
                continue
            best_m, best, gained = 0, 0.0, 0.0
            for m, gj in enumerate(g[:cap], start=1):
                gained += gj
                net = shared * min(gained, limit) + own * gained - per_span - per_column * m
                if net > best:
                    best_m, best = m, net
            ks.append(best_m)
        return ks


@dataclass
class SpecStats:
    """vLLM's counters (verification steps that carried drafts, drafts proposed, drafts accepted), and
    what the issue's report needs: sharded forwards (the prefill included), the columns of the decode
    steps (1 + the drafts of each), and acceptance by depth (accepted_by_depth[j]: verifications whose
    draft at depth j + 1 was accepted)."""

    method: str
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    forwards: int = 0
    columns: int = 0
    tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)

    def step(self, columns: int, tokens: int, decode: bool) -> None:
        """One sharded forward of the session: its columns (counted for decode steps) and the tokens
        it emitted."""
        self.forwards += 1
        self.tokens += tokens
        if decode:
            self.columns += columns

    def add(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            self._depths(accepted)

    def _depths(self, accepted: int) -> None:
        if len(self.accepted_by_depth) < accepted:
            self.accepted_by_depth += [0] * (accepted - len(self.accepted_by_depth))
        for j in range(accepted):
            self.accepted_by_depth[j] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.forwards += other.forwards
        self.columns += other.columns
        self.tokens += other.tokens
        if len(self.accepted_by_depth) < len(other.accepted_by_depth):
            self.accepted_by_depth += [0] * (len(other.accepted_by_depth) - len(self.accepted_by_depth))
        for j, n in enumerate(other.accepted_by_depth):
            self.accepted_by_depth[j] += n

    def as_dict(self) -> dict:
        mal = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None  # vLLM's definition
        return {
            "method": self.method,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": None if mal is None else round(mal, 4),
            "forwards": self.forwards,
            "columns": self.columns,
            # tau: tokens per sharded forward, the prefill (which emits the first token) included
            "tokens_per_forward": round(self.tokens / self.forwards, 4) if self.forwards else None,
            "accepted_by_depth": list(self.accepted_by_depth),
        }


def session_report(spec: dict, exchanges_per_forward: int | None) -> dict:
    """One session's counters (SpecStats.as_dict) as `fusion generate --json` reports them, with what
    its forwards cost on the wire and the tree sizes chosen: exchanges_per_forward (the plan's
    sequential exchanges of one forward: 120 for SmolLM2 at N = 2; None where the plan does not count
    them, the masked mode's), exchanges_per_token = that / τ (τ = tokens per forward, the prefill
    included) and columns_per_step = columns / decode steps (the last token plus the drafts kept,
    on average; the prefill is the session's first forward)."""
    out = dict(spec)
    tau, decode_steps = spec.get("tokens_per_forward"), spec["forwards"] - 1
    out["columns_per_step"] = round(spec["columns"] / decode_steps, 4) if decode_steps > 0 else None
    out["exchanges_per_forward"] = exchanges_per_forward
    out["exchanges_per_token"] = round(exchanges_per_forward / tau, 2) if exchanges_per_forward and tau else None
    return out


class NgramDrafter:
    """Prompt lookup: find the longest n-gram (prompt_lookup_max down to _min tokens) ending the
    session's tokens that also occurs earlier, and propose the tokens that followed its latest
    earlier occurrence with K tokens after it (else the one with the most). Keeps an index of
    positions per token, grown as the session grows."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}  # token -> its positions in self.tokens, ascending

    def _sync(self, tokens: list[int]) -> None:
        keep = 0
        limit = min(len(tokens), len(self.tokens))
        while keep < limit and tokens[keep] == self.tokens[keep]:
            keep += 1
        for j in range(len(self.tokens) - 1, keep - 1, -1):  # what changed since the last call is re-indexed
            self.where[self.tokens[j]].pop()
        self.tokens = list(tokens)
        for j in range(keep, len(tokens)):
            self.where.setdefault(tokens[j], []).append(j)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self._sync(tokens)
        n_tok = len(tokens)
        if k < 1 or n_tok < self.n_min + 1:
            return []
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            suffix = tokens[n_tok - n :]
            best: list[int] = []
            for j in reversed(self.where.get(tokens[-1], ())):  # j: where an earlier copy would end
                if j >= n_tok - 1 or j < n - 1:
                    continue
                if tokens[j - n + 1 : j + 1] == suffix:
                    follow = tokens[j + 1 : j + 1 + k]  # a copy just before the end has few tokens after it
                    if len(follow) > len(best):
                        best = follow
                    if len(best) == k:
                        break
            if best:
                return best
        return []

    def propose_tree(self, tokens: list[int], k: int) -> Draft:
        """A token tree of at most k drafts: every earlier occurrence of the longest matching n-gram
        (prompt_lookup_max down to _min) contributes what followed it (up to k tokens), merged into a
        trie whose node counts are the occurrences that continue so; columns are taken best first by
        estimated probability, a node's count over the matches' (the product of the branch
        frequencies on its path), a parent before its children, ties to the latest occurrence. Where
        every occurrence continued alike the tree is a chain; where they differ (an uncertain
        position) it branches into the continuations seen, most frequent first."""
        self._sync(tokens)
        n_tok = len(tokens)
        if k < 1 or n_tok < self.n_min + 1:
            return Draft()
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            suffix = tokens[n_tok - n :]
            follows = [
                tokens[j + 1 : j + 1 + k]
                for j in reversed(self.where.get(tokens[-1], ()))  # latest first
                if n - 1 <= j < n_tok - 1 and tokens[j - n + 1 : j + 1] == suffix
            ]
            if follows:
                return _merge(follows, k)
        return Draft()

    def close(self, output: list[int] | None = None) -> None:
        self.tokens, self.where = [], {}


def _merge(follows: list[list[int]], k: int) -> Draft:
    """The continuations (latest first) as a tree of at most k nodes, best first (propose_tree)."""
    # trie: node id -> (token, parent node id, count, first continuation that reached it)
    nodes: list[list[int]] = []
    kids: dict[tuple[int, int], int] = {}
    for rank, follow in enumerate(follows):
        parent = -1
        for t in follow:
            node = kids.get((parent, t))
            if node is None:
                node = kids[(parent, t)] = len(nodes)
                nodes.append([t, parent, 0, rank])
            nodes[node][2] += 1
            parent = node
    total = len(follows)
    children: dict[int, list[int]] = {}
    for i, (_, parent, _, _) in enumerate(nodes):
        children.setdefault(parent, []).append(i)
    draft, column = Draft(), {-1: -1}
    heap = [(-nodes[c][2], nodes[c][3], c) for c in children.get(-1, ())]
    heapq.heapify(heap)
    while heap and len(draft.tokens) < k:
        neg, _, c = heapq.heappop(heap)
        t, parent = nodes[c][0], nodes[c][1]
        column[c] = draft.add(t, column[parent], -neg / total)
        for d in children.get(c, ()):
            heapq.heappush(heap, (-nodes[d][2], nodes[d][3], d))
    return draft


# The draft model's tree: a position whose top-1 probability is under UNSURE branches into its BRANCHES
# likeliest tokens (the chain's and BRANCHES - 1 leaves beside it)
UNSURE = 0.5
BRANCHES = 3


class DraftModelDrafter:
    """A draft model's greedy proposals for one session, over the session's own KV cache of the draft
    model (the tokens it holds are `seen`; a step re-runs from the first one that changed)."""

    def __init__(self, model, max_seq: int):
        self.model = model
        self.max_seq = max_seq
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seen: list[int] = []

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self._chain(tokens, k)[0]

    def propose_tree(self, tokens: list[int], k: int) -> Draft:
        """A token tree of at most k drafts: the greedy chain, and at each of its positions where the
        draft model's top-1 probability is below UNSURE, its next likeliest tokens (BRANCHES in all
        at that position) as leaves beside the chain's token (a leaf costs no forward of the draft
        model: only the chain runs). A column's probability is the draft model's along its path (a
        product of softmax probabilities); columns are taken best first by it (a parent before its
        children: a child's is at most its parent's, and the parent was made first), the first k."""
        chain, probs = self._chain(tokens, k)
        nodes: list[tuple[float, int, int]] = []  # (path probability, token, parent node), in order made
        parent, path = -1, 1.0
        for t, p_V in zip(chain, probs, strict=True):
            top_p, top_t = torch.topk(p_V, min(BRANCHES, p_V.numel()))
            if float(top_p[0]) < UNSURE:  # an uncertain position: its alternatives, as leaves
                nodes += [
                    (path * q, alt, parent) for q, alt in zip(top_p.tolist(), top_t.tolist(), strict=True) if alt != t
                ]
            path *= float(p_V[t])
            nodes.append((path, t, parent))
            parent = len(nodes) - 1
        order = sorted(range(len(nodes)), key=lambda j: (-nodes[j][0], j))[:k]
        draft, column = Draft(), {-1: -1}
        for j in order:
            prob, t, par = nodes[j]
            column[j] = draft.add(t, column[par], prob)
        return draft

    def _chain(self, tokens: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """The greedy drafts and the draft model's softmax at each (what each was the argmax of)."""
        if k < 1:
            return [], []
        if self.cache is None:
            self.cache = self.model.new_cache(self.max_seq)
        keep = 0
        limit = min(len(tokens) - 1, len(self.seen))  # the last token always runs: its logits propose
        while keep < limit and tokens[keep] == self.seen[keep]:
            keep += 1
        logits = self.model.forward(tokens[keep:], keep, self.cache)[-1]
        self.seen = list(tokens)
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            drafts.append(int(torch.argmax(logits)))
            probs.append(torch.softmax(logits.float(), dim=-1))
            if len(drafts) == k or len(self.seen) >= self.max_seq:
                return drafts, probs
            logits = self.model.forward(drafts[-1:], len(self.seen), self.cache)[-1]
            self.seen.append(drafts[-1])

    def close(self, output: list[int] | None = None) -> None:
        if self.cache is not None:  # the user's own tokens' keys and values: zeroed, not left behind
            for t in self.cache:
                t.zero_()
        self.seen = []


class Speculator:
    """One job's speculative decoding: its config, the draft model (loaded once, shared by every
    session), a drafter and a draft length per session, the counters of the whole job and what a
    wider step costs on it (StepCost)."""

    def __init__(self, config: SpeculativeConfig, target_vocab: int, context: int, draft_model=None):
        """`draft_model`: an already loaded DenseModel (tests); else config.draft_model is loaded."""
        config.check_context(context)
        self.config = config
        self.context = context
        self.model = None
        if config.method == "draft_model":
            self.model = draft_model if draft_model is not None else load_draft_model(config.draft_model, target_vocab)
            check_vocab(self.model.config.vocab, target_vocab)
        self.totals = SpecStats(config.method)
        # SuffixDecoding's global cache: the job's finished outputs, from request to request
        self.suffix_cache = (
            SuffixCache(config.suffix_max_depth, config.suffix_cache_tokens) if config.method == "suffix" else None
        )
        self.pool = JobAcceptance()  # what drafts earn on this job, across sessions and requests
        # what a wider step costs on this job's workers and network, learned across its runs and
        # requests; with a fixed draft length nothing is cut
        self.cost = StepCost() if config.adaptive else None
        # the suffix drafts' size cap per match length, from that cost and what each length earned
        self.sizing = (
            MatchSizing(self.cost, config.num_speculative_tokens)
            if self.cost is not None and config.method == "suffix"
            else None
        )

    def bind(self, plan) -> None:
        """The job's link model from `--link-rtt-ms/--link-mbps` and the engine's plan (its exchanges
        per forward and the busiest worker's bytes per column: structural.plan's count), once. A plan
        that does not count them (the masked mode's) leaves the cost fitted."""
        c = self.config
        if c.link_rtt_ms is None or self.cost is None or self.cost.link is not None:
            return
        if not hasattr(plan, "exchanges_per_forward") or not hasattr(plan, "bytes_sent_per_token"):
            return
        self.cost.link = LinkCost(
            round_trip_s=c.link_rtt_ms / 1e3,
            exchanges=plan.exchanges_per_forward(0),
            bytes_per_column=float(max(plan.bytes_sent_per_token(w) for w in range(plan.n))),
            link_bytes_per_s=c.link_mbps * 1e6 / 8,  # type: ignore[operator]
            compute_per_column_s=0.0,
        )

    def drafter(self, greedy: bool = True) -> NgramDrafter | SuffixDrafter | DraftModelDrafter:
        """A new session's drafter. A greedy session's suffix drafts are capped by the job's cost
        (suffix_size.MatchSizing); a sampled one's keep the factor alone: its drafts, and so the draws
        its seed gives, must not depend on the clock."""
        c = self.config
        if self.model is not None:
            return DraftModelDrafter(self.model, self.context)
        if c.method == "suffix":
            return SuffixDrafter(
                self.suffix_cache,
                c.suffix_max_depth,
                c.suffix_max_spec_factor,
                c.suffix_max_spec_offset,
                c.suffix_min_token_prob,
                sizing=self.sizing if greedy else None,
            )
        return NgramDrafter(c.prompt_lookup_min, c.prompt_lookup_max)

    def length(self) -> DraftLength:
        c = self.config
        return DraftLength(c.num_speculative_tokens, c.adaptive, sized_by_drafter=c.method == "suffix")


def check_vocab(draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise UsageError(
            f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}): "
            "its proposals could not be verified"
        )


def load_draft_model(path: str | None, target_vocab: int):
    """The dense twin of the draft model, checked against the target's vocabulary before its weights load."""
    from ..model.dense import DenseModel
    from ..weights.loader import open_weights, resolve_model_path

    src = open_weights(resolve_model_path(path))
    check_vocab(src.config.vocab, target_vocab)
    return DenseModel(src, max_seq=1)  # its own cache is unused: every session keeps one (new_cache)
