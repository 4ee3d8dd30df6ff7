"""The per-step deadline (issue 26, docs/resilience.md "Slow steps"): every step has a bound derived
from what steps of its size measured when healthy, and slowness beyond it is judged by the workers'
accounts (liveness.Witness), never by one side's word.

  deadline(T) = max(--step-deadline-min, --step-deadline-factor × base(T))

  base(T)   the lowest median seen over the last KEEP healthy steps of T's size class (ΣT tokens in
            [2^(c-1), 2^c)), once WARM of them were measured. Lowest, not latest: a worker that slows
            down little by little cannot drag the bound up with it. A class not measured yet
            borrows the nearest smaller one's, times T over that class's smallest step (a step of T
            tokens costs at most T steps of one); with none measured there is no bound yet (the
            per-message --timeout still holds).
  strikes   a step that took t > d earns ⌊t/d⌋. STRIKES of them within the last RECENT steps: the
            slowness is judged. A step still running at STRIKES × d is cut there (its waits end as a
            per-message timeout's would) and judged at once.

So no judged step runs past STRIKES × its deadline, and RECENT steps without a verdict take less than
(RECENT + STRIKES − 1) × d together: a request of S steps is bounded by about
(1 + (STRIKES − 1) / RECENT) × S × d (1.25 × S × d), or it is judged.

The judgement (`judge`) weighs who kept whom blocked over the slow steps: each worker's account of
its peers, and the client's own of the workers (trusted: it is the user's process). A worker that
lies may also lie in its account, so an account is never taken alone: worker x is *a consistent
cause* when, with x's own account set aside, someone was blocked on x, and every other blocked
worker's wait leads to x along the others' accounts (its own delay explained by its own blocker,
and so on), and those accounts are the client's or two workers' at least (one worker's word alone
proves nothing). Exactly one consistent cause, waited on directly by the client or by two workers
(whichever worker lies, a true wait on it remains; else a liar that holds back its messages to one
peer alone and blames an honest worker leads that peer's honest wait to the honest worker, issue
43's red team): it is named and treated as lost. Several, or one
worker's word alone: ambiguous (who lies cannot be told): nobody is barred, the suspects are set aside
for standbys where that keeps the job running (membership.py), else the request fails saying so.
None: nobody's account explains the slowness (an overloaded client or machine), and the request
fails saying that. The accounts are real wait durations (comm.Comm charges each exchange's wait, after
every other peer's message had arrived, to the last one), so a delay under any tick still shows.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from ..comm import CommError, PeerTimeout

STRIKES = 3  # strikes within the last RECENT steps: judged
RECENT = 8
WARM = 3  # healthy steps of a size class before its median is trusted
KEEP = 16  # the healthy steps of a class its median is taken over
DEFAULT_FACTOR = 10.0  # --step-deadline-factor: a healthy step's jitter on a shared machine stays far under it
DEFAULT_MIN_S = 2.0  # --step-deadline-min: a tiny model's ms steps get a bound a scheduler hiccup does not reach
ACCUSE_SHARE = 0.25  # an account is an accusation when it was blocked this share of the slow steps' time
ACCUSE_MIN_S = 0.5  # ... and at least this long (two liveness ticks)
CLIENT = 0  # the client's node in the accounts (workers are their participant ids, >= 1)


class StepOverrun(CommError):
    """A step ran past STRIKES times its deadline: cut, to be judged (never seen outside the engine)."""


class SlowWorker(PeerTimeout):
    """A worker the accounts name as the cause of steps over their deadline: treated as lost (a
    watched failure: `rank` is its participant id)."""

    def __init__(self, pid: int, message: str):
        super().__init__(pid, message, watched=True)


class StepDeadline(CommError):
    """Steps over their deadline that the accounts do not pin on one worker: the request fails,
    nobody is removed."""


def size_class(tokens: int) -> int:
    """1 for a one-token step, then 2 for 2-3 tokens, 3 for 4-7, ... (ΣT's bit length)."""
    return max(1, tokens).bit_length()


@dataclass(frozen=True)
class Step:
    tokens: int
    seconds: float
    deadline: float | None
    strikes: int
    started: float  # time.monotonic() at its start


class StepClock:
    """Each step's deadline, its strikes, and when the slowness is due to be judged."""

    def __init__(self, factor: float = DEFAULT_FACTOR, min_s: float = DEFAULT_MIN_S):
        self.factor, self.min_s = factor, min_s
        self._healthy: dict[int, deque[float]] = {}
        self._base: dict[int, float] = {}
        self._recent: deque[Step] = deque(maxlen=RECENT)
        self._running: tuple[int, float | None, float] | None = None  # tokens, deadline, start
        self._cut_at: float | None = None
        self.steps = 0  # steps measured that had a deadline
        self.strikes = 0  # strikes earned over the job
        self.worst = 0.0  # the largest step time / deadline seen: an honest run stays well under 1

    def deadline(self, tokens: int) -> float | None:
        """This step's bound in seconds, or None (bound off, or nothing measured yet)."""
        if self.factor <= 0:
            return None
        c = size_class(tokens)
        if c in self._base:
            base = self._base[c]
        else:
            known = [k for k in self._base if k < c]
            if not known:
                return None
            k = max(known)
            base = self._base[k] * tokens / (1 << (k - 1))
        return max(self.min_s, self.factor * base)

    def start(self, tokens: int) -> None:
        d = self.deadline(tokens)
        now = time.monotonic()
        self._running = (tokens, d, now)
        self._cut_at = None if d is None else now + STRIKES * d

    def check(self) -> None:
        """Called at every receive tick of the client's links: a step running past STRIKES deadlines
        is cut (once)."""
        if self._cut_at is not None and time.monotonic() >= self._cut_at:
            self._cut_at = None
            raise StepOverrun("step cut at its deadline's limit")

    def abandon(self) -> None:
        """The step failed (a lost worker): nothing to learn from its time."""
        self._running, self._cut_at = None, None

    def stop(self, cut: bool = False) -> Step | None:
        """The running step ended (or was cut): its record, its strikes counted."""
        if self._running is None:
            return None
        tokens, d, t0 = self._running
        self._running, self._cut_at = None, None
        seconds = time.monotonic() - t0
        strikes = 0
        if d is not None:
            self.steps += 1
            self.worst = max(self.worst, seconds / d)
            strikes = STRIKES if cut else int(seconds // d)
        step = Step(tokens, seconds, d, strikes, t0)
        self._recent.append(step)
        self.strikes += strikes
        if strikes == 0:
            c = size_class(tokens)
            healthy = self._healthy.setdefault(c, deque(maxlen=KEEP))
            healthy.append(seconds)
            if len(healthy) >= WARM:
                self._base[c] = min(self._base.get(c, float("inf")), statistics.median(healthy))
        return step

    def due(self) -> bool:
        return sum(s.strikes for s in self._recent) >= STRIKES

    def struck(self) -> list[Step]:
        return [s for s in self._recent if s.strikes]

    def forgive(self) -> None:
        """Judged, or a new epoch: the strikes so far are spent (what was learnt of healthy steps stays)."""
        self._recent.clear()

    def summary(self) -> str:
        """The slow steps in words, e.g. '3 of the last 8 steps over their deadline (2.41 s, 2.43 s, 2.40 s > 2.00 s)'."""
        struck = self.struck()
        times = ", ".join(f"{s.seconds:.2f} s" for s in struck)
        bound = min((s.deadline for s in struck if s.deadline is not None), default=0.0)
        return (
            f"{len(struck)} of the last {len(self._recent)} steps over their deadline "
            f"({times} > {bound:.2f} s; --step-deadline-factor {self.factor:g}, --step-deadline-min {self.min_s:g})"
        )


@dataclass(frozen=True)
class Verdict:
    named: int | None  # the one consistent cause, or None
    causes: tuple[int, ...]  # every consistent cause (two or more: ambiguous; none: unexplained)
    said: str  # the accusations, in words
    # True when `causes` could only have arisen with a liar among them (first-hand evidence: blame_link's
    # counted accusations, contradictions, rings, tainted inputs; the client's value checks). False for
    # timing judged on waits (this module's `judge`): machine load alone makes such a set of honest
    # workers. Only the former feed blame.follows (docs/resilience.md, "What the rule guarantees").
    liar_only: bool = False


def judge(blocked: dict[int, dict[int, float]], workers: list[int], threshold_s: float) -> Verdict:
    """Who made the steps slow. `blocked[a][b]`: seconds node a (CLIENT, or a worker) reports worker b
    alone kept it waiting lately; an entry of at least `threshold_s` is an accusation. See the module
    docstring for the rule; a worker that did not answer has no account (silence accuses nobody).

    Corroboration: a consistent cause is named only when the accusations that lead to it come from
    the client (its own account: trusted) or from two workers at least, and when the client or two
    workers waited on it directly (a wait that reaches it only through a third worker's account
    rests on that account: issue 43's red team). One worker's account alone
    (a two-worker epoch's accusation, or a liar's) makes the accused and its accuser an ambiguous
    pair: `causes` (the accused first), nobody named."""
    members = set(workers)
    edges = {
        (a, b)
        for a, waits in blocked.items()
        for b, s in waits.items()
        if b in members and b != a and s >= threshold_s and (a == CLIENT or a in members)
    }

    def sources(x: int) -> set[int]:
        """The nodes whose accusations all lead to x, x's own account set aside ({} when x is not a
        consistent cause)."""
        trusted = {(a, b) for a, b in edges if a != x}
        if not any(b == x for _, b in trusted):
            return set()
        follows: dict[int, set[int]] = {}
        for a, b in trusted:
            follows.setdefault(a, set()).add(b)

        def leads_to_x(b: int) -> bool:
            seen, todo = {b}, [b]
            while todo:
                for c in follows.get(todo.pop(), ()):
                    if c == x:
                        return True
                    if c not in seen:
                        seen.add(c)
                        todo.append(c)
            return False

        if not all(b == x or leads_to_x(b) for _, b in trusted):
            return set()
        return {a for a, _ in trusted}

    found = {x: sources(x) for x in workers}
    causes = [x for x in workers if CLIENT in found[x] or len(found[x]) >= 2]
    if not causes:  # one worker's word alone: the accused and its accuser, the accused first
        lone = sorted((x, next(iter(s))) for x, s in found.items() if len(s) == 1)
        causes = list(dict.fromkeys([x for x, _ in lone] + [a for _, a in lone]))
    elif len(causes) == 1:
        # The one cause must have been waited on directly by someone other than any one worker y
        # (the client, or a second worker): whichever worker lies, a true wait on x remains. Two
        # workers' accusations may meet at x only through a third's account: a liar that holds back
        # its messages to one peer alone and says an honest worker kept it waiting leads that peer's
        # honest wait to the honest worker (issue 43's red team: the honest worker was named). If y
        # is the only one that waited on x directly, y's word is all there is: ambiguous, x and y.
        x = causes[0]
        causes += [y for y in workers if y != x and not any(b == x and a not in (x, y) for a, b in edges)]
    said = (
        ", ".join(
            f"{'the client' if a == CLIENT else f'worker {a}'} was kept waiting {blocked[a][b]:.1f} s by worker {b}"
            for a, b in sorted(edges)
        )
        or "nobody reports being kept waiting"
    )
    return Verdict(causes[0] if len(causes) == 1 else None, tuple(causes), said)
