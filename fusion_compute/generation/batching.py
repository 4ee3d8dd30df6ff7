"""Continuous batching: several sessions decode together, one sharded step for all of them.

Decode at N >= 2 is bound by collective round trips, not arithmetic: a step costs about the same
for one token as for eight. So every step carries one new token for each running session (and the
whole prompt of each newcomer: its prefill joins the ongoing decodes in the same step), each session
keeps its own KV slot on every worker (engine.forward_batch), and sessions join and leave between
steps. A session's tokens are what `generate.generate` gives it alone: the same calls in the same
order (prefill, then one token at a time), with its own sampler; only the columns next to it differ,
and a linear layer treats columns independently (up to the BLAS kernel's summation order, which is
why the tests compare greedy tokens, not bits).

With a `speculative.Speculator`, a session's step carries its last token plus the drafts its
drafter proposed, every column's logits come back, and speculative.verify keeps what the target
model would have produced (several tokens per step when drafts are accepted); the rejected columns
are rolled back (engine.rollback). This is the one place speculation happens, for every caller.
The drafts a greedy session keeps are cut by the job's cost (speculative.StepCost): to the step's
expected tokens per second while sessions wait for a slot (`waiting`), and in a fixed batch to what
its tokens save the batch, which ends with its last session (`_worth`).

    runner = BatchRunner(engine, max_batch=8)
    runner.add(Sequence(prompt_ids, max_new_tokens=64, sampling=params, stop_ids=eos, on_token=cb))
    while runner.active:
        for seq in runner.step():   # the sessions that finished at this step
            seq.result()            # a result.GenerationResult
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..runtime.engine import EngineBase
from .result import GenerationResult, check_prompt, next_finish
from .sampling import Sampler
from .sampling_params import SamplingParams
from .speculative import DEPTHS, DraftLength, NgramDrafter, SpecStats, Speculator, chain_gains
from .suffix import SuffixDrafter
from .suffix_tree import Draft
from .token_tree import TokenTree, accept
from .tree_cost import path_gains


@dataclass
class Sequence:
    """One request's session in a batch: its prompt, limits, sampler and what it generated."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: Iterable[int] = ()
    on_token: Callable[[int], bool | None] | None = None  # True: stop now (a stop string matched, a hang-up)
    slot: int = -1
    out: list[int] = field(default_factory=list)
    finish: str | None = None  # set when it is over: "stop" | "length" | "error" (its step failed)
    steps: int = 0
    t0: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    recoveries: list[dict] = field(default_factory=list)  # epochs opened while it ran (a worker lost)
    spec: SpecStats | None = None  # speculative decoding's counters, when the runner speculates

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=self.out,
            prompt_tokens=len(self.prompt_ids),
            finish_reason=self.finish or "length",
            ttft_s=self.t_first - self.t0,
            decode_s=self.t_end - self.t_first,
            steps=self.steps,
            recoveries=self.recoveries,
            speculative=None if self.spec is None else self.spec.as_dict(),
        )


@dataclass(frozen=True)
class StepHooks:
    """Calls around the loop's engine work, for a caller that records every step (the audit runner):
    `before(spans)` ahead of each step, its (slot, position, T) per session; `after()` once the
    step's logits are back (before any token is sampled); `released(slot)` after a session's slot
    was zeroed."""

    before: Callable[[list[tuple[int, int, int]]], None] = lambda spans: None
    after: Callable[[], None] = lambda: None
    released: Callable[[int], None] = lambda slot: None


class BatchRunner:
    """Runs up to `max_batch` sessions at once on one engine."""

    def __init__(
        self,
        engine: EngineBase,
        max_batch: int,
        hooks: StepHooks | None = None,
        speculator: Speculator | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`clock`: seconds, for the sessions' times and the steps' the cost budget fits (a replay's
        simulated clock, bench/replay_batch.py; the wall clock otherwise)."""
        if max_batch < 1:
            raise ValueError(f"max batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.hooks = hooks or StepHooks()
        self.clock = clock
        # sessions waiting for a slot (run_batch's, the server's queue): while any wait, a finished
        # session's slot is filled at once and every accepted token is worth a step's share; while none
        # does, the batch is fixed (_worth)
        self.waiting = 0
        # made at the first session's reset (and kept, zeroed, after); a runner of one (generate) keeps
        # the slots a batch made
        engine.batch_slots = max(max_batch, engine.batch_slots) if max_batch == 1 else max_batch
        self.active: dict[int, Sequence] = {}  # slot -> session
        self._samplers: dict[int, Sampler] = {}
        self._stops: dict[int, set[int]] = {}
        self.speculator = speculator
        engine.draft_hint = speculator.config.num_speculative_tokens if speculator is not None else 0
        self._drafters: dict = {}  # slot -> its session's drafter (speculative.py)
        self._lengths: dict[int, DraftLength] = {}
        self._freqs: dict[int, list[float] | None] = {}  # slot -> its drafts' frequencies (suffix), this step
        if speculator is not None:
            speculator.bind(getattr(engine, "plan", None))  # --link-rtt-ms/--link-mbps: the link's model
        self._cost = speculator.cost if speculator is not None else None  # speculative.StepCost, the job's
        self.steps = 0

    @property
    def room(self) -> int:
        return self.max_batch - len(self.active)

    def add(self, seq: Sequence, fresh: bool = False) -> None:
        """Admit a session; its prefill runs at the next step. Raises errors.InputError for a
        prompt the model cannot run, ValueError when the batch is full. `fresh`: into an empty
        batch, start afresh (every slot zeroed) even when the engine still has sessions open."""
        if self.room <= 0:
            raise ValueError(f"the batch is full ({self.max_batch} sessions)")
        check_prompt(seq.prompt_ids, self.engine.config.vocab, self.engine.context, seq.max_new_tokens)
        seq.slot = min(set(range(self.max_batch)) - set(self.active))
        if not self.active and (fresh or not self.engine.slot_history):
            seen = len(self.engine.recoveries)
            self.engine.reset()  # the first session of a batch: every slot zeroed, every position 0
            seq.recoveries += self.engine.recoveries[seen:]  # noticed while idle, recovered at the reset
        seq.t0 = self.clock()
        self.active[seq.slot] = seq
        self._samplers[seq.slot] = Sampler(seq.sampling)
        self._stops[seq.slot] = set(seq.stop_ids)
        if self.speculator is not None:
            seq.spec = SpecStats(self.speculator.config.method)
            self._drafters[seq.slot] = drafter = self.speculator.drafter(greedy=seq.sampling.greedy)
            self._lengths[seq.slot] = self.speculator.length()
            if isinstance(drafter, SuffixDrafter):
                drafter.start(seq.prompt_ids)  # its trie over the prompt, built during the prefill

    def step(self) -> list[Sequence]:
        """One sharded step for every active session; returns those that finished (their slots are
        zeroed on the workers and free again)."""
        if not self.active:
            return []
        seqs = list(self.active.values())
        drafts = self._budget(seqs, {s.slot: self._draft(s) for s in seqs})
        items = [(s.slot, self._columns(s, drafts[s.slot])) for s in seqs]
        trees = {slot: t.parents_T for slot, t in drafts.items() if t is not None and not t.is_chain()}
        seen = len(self.engine.recoveries)
        self.hooks.before([(slot, len(self.engine.slot_history.get(slot, ())), len(ids)) for slot, ids in items])
        t0 = self.clock()
        full = {slot for slot, t in drafts.items() if t is not None}
        # a tree's parents ride with the step (engine.forward_batch's `trees`); chains need none
        logits = self.engine.forward_batch(items, all_logits=full, **({"trees": trees} if trees else {}))
        if self._cost is not None:  # fitted over decode steps only: a prefill is another cost (the prior's scale)
            prefill = not all(s.out for s in seqs)
            width, seconds = sum(len(ids) for _, ids in items), self.clock() - t0
            self._cost.observe(width, len(full), seconds, prefill, sessions=len(items))
        self.hooks.after()
        self.steps += 1
        for seq in seqs:
            seq.recoveries += self.engine.recoveries[seen:]
        done = []
        for seq, lg in zip(seqs, logits, strict=True):
            seq.steps += 1
            tree = drafts[seq.slot]
            drafted = 0 if tree is None else len(tree) - 1
            if tree is not None:
                toks, path = accept(self._samplers[seq.slot], tree, lg)
                accepted = len(path) - 1
                depth = max(tree.depths_T())  # the verification's trials run along one path this deep
                self._lengths[seq.slot].update(drafted, accepted, depth)
                if isinstance(drafter := self._drafters.get(seq.slot), SuffixDrafter):
                    drafter.verified(depth, accepted)  # what its match length earned (suffix_size.py)
                if seq.spec is not None:
                    seq.spec.add(drafted, accepted)
                    if self.speculator is not None:
                        self.speculator.totals.add(drafted, accepted)
                        self.speculator.pool.add(drafted, accepted, depth)
                if tree.is_chain():
                    if accepted < drafted:  # the rejected columns' KV entries are never attended
                        self.engine.rollback(seq.slot, len(self.engine.slot_history[seq.slot]) - (drafted - accepted))
                else:  # the accepted path's entries are kept, the rest dropped (named in the next step)
                    self.engine.keep_path(seq.slot, path)
            else:
                toks = [self._samplers[seq.slot](lg)]
            budget = self._tokens_allowed(seq)
            emitted = len(seq.out)
            decode = emitted > 0
            for tok in toks:
                seq.out.append(tok)
                if len(seq.out) == 1:
                    seq.t_first = self.clock()
                seq.finish = next_finish(tok, seq.out, self._stops[seq.slot], seq.on_token, budget)
                if seq.finish is not None:
                    done.append(seq)
                    break
            if seq.spec is not None:
                seq.spec.step(1 + drafted, len(seq.out) - emitted, decode)
                if self.speculator is not None:
                    self.speculator.totals.step(1 + drafted, len(seq.out) - emitted, decode)
        for seq in done:
            self._retire(seq)
        return done

    def _tokens_allowed(self, seq: Sequence) -> int:
        """The most tokens `seq` may generate in all: its max_new_tokens, within the context."""
        return min(seq.max_new_tokens, self.engine.context - len(seq.prompt_ids))

    def _draft(self, seq: Sequence) -> TokenTree | None:
        """The columns `seq` proposes this step after its last token, as a token tree (a chain from a
        chain drafter, or where the engine cannot verify trees): none at its prefill, without a
        speculator, or while its draft length says so; never more drafts than its remaining budget
        can use (the step's last token plus its drafts stay within the context and the slot's KV: a
        tree is cut to that many columns, never written past the end)."""
        if not seq.out or self.speculator is None:
            return None
        budget = self._tokens_allowed(seq)
        # a greedy session whose drafts the job's cost model prices: that model is the gate (_budget)
        priced = self._cost is not None and seq.sampling.greedy and self._cost.costs() is not None
        k = min(self._lengths[seq.slot].next(priced), budget - len(seq.out) - 1)
        if k < 1:
            return None
        drafter = self._drafters[seq.slot]
        tokens = seq.prompt_ids + seq.out
        self._freqs[seq.slot] = None
        if isinstance(drafter, SuffixDrafter | NgramDrafter):  # the draft model's chain: see docs/speculative.md
            if self.engine.verifies_trees:
                d = drafter.propose_tree(tokens, k)
            elif isinstance(drafter, SuffixDrafter):
                d = drafter.draft(tokens, k, tree=False)
            else:
                d = Draft()
                for t in drafter.propose(tokens, k):  # a chain, without frequencies
                    d.add(t, len(d.tokens) - 1, 1.0)
            tree = TokenTree.from_drafts(seq.out[-1], d.tokens, d.parents)
            # each column's frequency given its parent's (the drafter's probabilities are path products)
            self._freqs[seq.slot] = [
                q if p < 0 else q / d.probs[p] if d.probs[p] > 0 else 0.0
                for q, p in zip(d.probs, d.parents, strict=True)
            ]
        else:
            tree = TokenTree.chain(seq.out[-1], drafter.propose(tokens, k))
        return tree if len(tree) > 1 else None

    @staticmethod
    def _columns(seq: Sequence, tree: TokenTree | None) -> list[int]:
        if not seq.out:
            return list(seq.prompt_ids)  # its prefill
        return [seq.out[-1]] if tree is None else list(tree.tokens_T)

    def _budget(self, seqs: list[Sequence], drafts: dict[int, TokenTree | None]) -> dict[int, TokenTree | None]:
        """Each decoding session's drafts cut to what StepCost says its columns are worth this step
        (greedy sessions only: a sampled session keeps its drafts, so its draws follow its seed
        whatever the batch and the clock). A tree is cut to its first columns (its drafter lists
        them best first, every parent before its children)."""
        decoding = [s for s in seqs if s.out]
        if self._cost is None or not any(drafts[s.slot] for s in decoding):
            return drafts
        assert self.speculator is not None  # a StepCost is the speculator's
        prior = self.speculator.pool.depth_rates()
        sizes = [0 if (t := drafts[s.slot]) is None else len(t) - 1 for s in decoding]
        qs = [self._lengths[s.slot].depth_rates(prior) for s in decoding]
        rates = [q[0] for q in qs]
        gains: list[list[float] | None] = []
        for s, q in zip(decoding, qs, strict=True):
            t, freqs = drafts[s.slot], self._freqs.get(s.slot)
            # a column's chance given its parent's: the session's acceptance at that column's depth
            # times the drafter's frequency of that branch (siblings share the rate, the frequency
            # ranks them); a chain without frequencies: the product of the depths' rates
            if t is None:
                gains.append(None)
            elif freqs is not None and len(freqs) == len(t) - 1:
                depths = t.depths_T()[1:]
                accept = [q[min(d, DEPTHS) - 1] * f for d, f in zip(depths, freqs, strict=True)]
                gains.append(path_gains([p - 1 for p in t.parents_T[1:]], accept))
            else:
                gains.append(chain_gains(q, len(t) - 1))
        fixed = [not s.sampling.greedy for s in decoding]
        # a fixed batch (none waits for a slot) steps as long as its last session: its tokens' worth
        worth = self._worth(seqs, decoding, gains) if len(decoding) > 1 and not self.waiting else None
        if worth is None:
            ks = self._cost.allocate(sizes, rates, fixed, gains)
        else:
            ks = self._cost.allocate_worth(sizes, gains, worth, fixed)
        out = dict(drafts)
        for s, k in zip(decoding, ks, strict=True):
            t = drafts[s.slot]
            if t is not None and s.sampling.greedy:
                k = self._lengths[s.slot].probe(k)  # one draft now and then where every one was cut
            out[s.slot] = None if t is None or k == 0 else t.cut(1 + k)
        return out

    def _worth(
        self, seqs: list[Sequence], decoding: list[Sequence], gains: list[list[float] | None]
    ) -> list[tuple[float, float, float]] | None:
        """What one accepted token of each decoding session saves a batch that no session waits to
        join, in seconds (None before any cost is known). Such a batch steps until its last session
        ends: session i has L_i = R_i / τ_i steps left (R_i its remaining token budget, τ_i its tokens
        per decode step so far, at least 1). A token of session i saves the batch's plain step (base +
        per_column × sessions) only where i would end last: no session has a step more left than it,
        and every other session within a step of it gains a token this step too (the chance of that:
        the product of their first columns' chances, gains[j][0]; 0 for one that drafts nothing).
        Otherwise it saves only i's own place in the steps it would still run (its column and its
        per-session cost). Either is divided by τ_i (a token is 1 / τ_i of the session's steps). A
        step's tokens per second (allocate) counts every accepted token as a step's share, which a
        fixed batch gets back only from its last session (docs/speculative.md, "A fixed batch's
        drafts")."""
        assert self._cost is not None
        fit = self._cost.costs(len(seqs))
        if fit is None:
            return None
        base, per_column, _ = fit
        plain = base + per_column * len(seqs)
        presence = per_column + self._cost.per_session
        taus, left = [], []
        for s in decoding:
            tau = max(1.0, (len(s.out) - 1) / (s.steps - 1)) if s.steps > 1 else 1.0
            budget = self._tokens_allowed(s)
            taus.append(tau)
            left.append((budget - len(s.out)) / tau)
        first = [g[0] if g else 0.0 for g in gains]
        full = [sum(g) if g else 0.0 for g in gains]
        # a session admitted this step is in its prefill: its whole budget to go, a token a step so far,
        # and no drafts to gain with (it is counted among the others, never as i)
        for s in seqs:
            if not s.out:
                left.append(float(self._tokens_allowed(s)))
                first.append(0.0)
                full.append(0.0)
        worth = []
        for i, (tau, steps) in enumerate(zip(taus, left[: len(taus)], strict=True)):
            shared, limit = 0.0, 0.0
            if all(x < steps + 1 for j, x in enumerate(left) if j != i):  # none outlasts i by a step
                with_i = [j for j, x in enumerate(left) if j != i and x > steps - 1]  # would end with i
                rest = max((x for j, x in enumerate(left) if j != i and j not in with_i), default=0.0)
                shared = plain
                # the steps saved: at most i's lead over the next session that ends a step or more
                # before it, and as many as those ending with i gain too (their full drafts'
                # expected tokens), each of which must gain at all
                limit = min([(steps - rest) * tau] + [full[j] for j in with_i])
                for j in with_i:
                    shared *= first[j]
            worth.append((shared / tau, limit, presence / tau))
        return worth

    def _retire(self, seq: Sequence) -> None:
        seq.t_end = self.clock()
        del self.active[seq.slot], self._samplers[seq.slot], self._stops[seq.slot]
        drafter = self._drafters.pop(seq.slot, None)
        if drafter is not None:  # a finished output may serve later sessions' drafts (the suffix cache)
            drafter.close(seq.out if seq.finish in ("stop", "length") else None)
        self._lengths.pop(seq.slot, None)
        self._freqs.pop(seq.slot, None)
        self.engine.release(seq.slot)  # hygiene: its KV slot is zeroed now, not when it is reused
        self.hooks.released(seq.slot)

    def abort(self) -> list[Sequence]:
        """A step failed: every session ends here (slots zeroed where the workers still answer). The
        runner's own state (samplers, drafters, whose draft-model caches are zeroed) is cleared even
        when telling the workers fails; that error is raised after."""
        seqs = list(self.active.values())
        failed: Exception | None = None
        for seq in seqs:
            seq.finish = seq.finish or "error"
            try:
                self._retire(seq)
            except Exception as e:  # the slot's bookkeeping is gone already (_retire clears it first)
                failed = failed or e
        self.engine.slot_history.clear()
        if failed is not None:
            raise failed
        return seqs


def run_batch(
    engine: EngineBase, seqs: list[Sequence], max_batch: int, speculator: Speculator | None = None
) -> list[GenerationResult]:
    """Run `seqs` to completion, at most `max_batch` at once, newcomers joining as slots free up;
    results in the order given."""
    runner = BatchRunner(engine, max_batch, speculator=speculator)
    waiting = list(seqs)
    try:
        while waiting or runner.active:
            while waiting and runner.room:
                runner.add(waiting.pop(0))
            runner.waiting = len(waiting)
            runner.step()
    except BaseException:
        runner.abort()
        raise
    return [s.result() for s in seqs]
