"""A drafter replayed offline over greedy outputs: tokens per forward without workers or timing.

    python -m fusion_compute.bench.replay [--method suffix] [--max-new-tokens 128] [--k 32]
        [--chain] [--no-cache] [--single-match] [--rtt-ms R] [--refs FILE] [--limit N] [--detail]
        [--simulate [--base-ms B] [--span-ms S] [--no-prior] [--job-per-prompt] [--output-tokens N]]
        [--factor F] [--min-prob P] [--uncapped]

Greedy decoding's tokens do not depend on the drafts, so one greedy output per prompt (the target's
dense twin, model/dense.py: the same weights in one process, no workers) tells what any drafter
would have had accepted: the loop's drafter and draft length (speculative.Speculator) run over the
output as the sharded loop would, and a draft is accepted as far as its path equals the output
(the greedy walk of token_tree.accept: at each column, the child whose token is the next one). The
counters are the loop's (SpecStats: τ = tokens per forward, the prefill's forward and token
included; columns per decode step; acceptance by depth). `--rtt-ms R` also runs the loop's cost
budget with a link's model (tree_cost.LinkCost: 120 exchanges of R ms, SmolLM2's bytes per column
over 1 Gbit/s, `--compute-ms` per column and, unless `--base-ms`, per step): the tree sizes a deployment at that round
trip would choose; without it, every draft the drafter makes is verified. `--simulate` times each
step by that model instead (plus `--span-ms` for a step that carries drafts) and lets the budget fit
its costs from those times, its prior first, as an engine without link flags does; it reports the
plain steps' time over the replayed steps' for the same tokens (`speedup`, per prompt with
`--job-per-prompt`: a new job per prompt, as `fusion generate` runs). With a budget, the suffix
drafter's size per match length is capped by the same cost, as a greedy session's in the loop
(generation/suffix_size.py; `--uncapped`: the factor alone).

Beside the counters, `--detail` prints what bounds τ on each workload, from the outputs alone:
  copy oracle   at each step, the longest run of the next output tokens found verbatim anywhere
                earlier in the session (prompt and output so far): a drafter that always knew
                where to copy from would accept exactly that, so its τ bounds every copy drafter
  trie oracle   (suffix) at each step, the longest run of the next output tokens that the session's
                trie or the global cache's holds after a match of the session's last m >= 1 tokens,
                at most K: the best any suffix draft could do (one job per workload, as the replay)
  first miss    verifications whose draft's first token (every root child of a tree) was wrong,
                and how many of those had the right token nowhere among the root's children
  by cause      (suffix) per decode step, why it accepted less than the better of the two oracles:
                budget, cut, other m, jump, empty (`loss`); steps and tokens lost per cause
  by source     (suffix) verifications that accepted drafts, and their tokens, by where the accepted
                run (after the session's last token) occurs: the prompt, else the output so far, else
                only in the global cache

The greedy outputs are cached in `--refs` (JSON; the model and prompts are checked against it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

WORKLOAD_NAMES = ("input_grounded", "open_chat")


def cached_refs(path: Path, model: str, max_new: int) -> dict:
    """greedy_refs for `model` and `max_new`, read from `path` where it holds them (many minutes of
    CPU to make), else made (its progress on stderr) and written there."""
    refs = json.loads(path.read_text()) if path.is_file() else None
    if refs is None or refs["model"] != model or refs["max_new_tokens"] != max_new:
        refs = greedy_refs(model, max_new, None, lambda s: print(s, file=sys.stderr, flush=True))
        path.write_text(json.dumps(refs))
    return refs


def greedy_refs(model: str, max_new: int, limit: int | None, log=lambda s: None) -> dict:
    """Each workload's prompts (chat template ids) and the target's greedy output for each, up to
    `max_new` tokens, stopping after an end-of-turn token (kept, as generate keeps it)."""
    from ..model.dense import DenseModel
    from ..weights.loader import open_weights
    from . import workloads
    from .speculative import dense_greedy, tokenizer_for

    tok = tokenizer_for(model)
    target = DenseModel(open_weights(model), max_seq=1)
    out: dict = {"model": model, "max_new_tokens": max_new, "workloads": {}}
    for name in WORKLOAD_NAMES:
        w = workloads.load(name, tok, limit)
        rows = []
        for i, p in enumerate(w.prompts):
            gen = dense_greedy(target, p, max_new, tok.eos_ids)
            rows.append({"prompt": list(p), "output": gen})
            log(f"refs {name} {i}: {len(gen)} tokens")
        out["workloads"][name] = rows
    return out


def copy_oracle(prompt: list[int], output: list[int]) -> tuple[int, int]:
    """(forwards, tokens) of a drafter that at each step proposes the longest run of the next output
    tokens that occurs verbatim earlier in the session (prompt + output so far): each forward emits
    that run plus the target's own token. The prefill's forward emits the first token."""
    forwards, i = 1, 1
    while i < len(output):
        seen = prompt + output[:i]
        n = 0
        while i + n < len(output) - 1 and _occurs(seen, output[i : i + n + 1]):
            n += 1
        i += n + 1
        forwards += 1
    return forwards, len(output)


def trie_oracle(rows: list[dict], max_depth: int, cache_tokens: int, k: int) -> tuple[int, int]:
    """(forwards, tokens) of a suffix drafter that always chose right: at each step it proposes the
    longest run of the next output tokens that follows, in the session's trie or the global cache's, a
    node matching the session's last m >= 1 tokens (`reach`), at most k. Every draft a suffix trie
    makes is such a path, so this bounds any choice of match length, branches and order; the copy
    oracle's runs that it lacks start after tokens unlike the session's last ones. The cache fills as
    in `replay` (each output after its session)."""
    from ..generation.suffix import SuffixCache, SuffixDrafter

    cache = SuffixCache(max_depth, cache_tokens)
    forwards = tokens = 0
    for r in rows:
        prompt, ref = list(r["prompt"]), list(r["output"])
        drafter = SuffixDrafter(cache, max_depth)
        f, i = 1, 1
        while i < len(ref):
            drafter.draft(prompt + ref[:i], 0, tree=True)  # brings its trie up to the context
            run = ref[i : len(ref) - 1]
            own = reach(drafter.trie, prompt + ref[:i], run)
            cached = reach(cache.trie, prompt + ref[:i], run) if len(cache) else []
            i += min(k, max([0, *own, *cached])) + 1
            f += 1
        drafter.close(ref)
        forwards, tokens = forwards + f, tokens + len(ref)
    return forwards, tokens


def _occurs(hay: list[int], needle: list[int]) -> bool:
    k = len(needle)
    first = needle[0]
    return any(hay[j] == first and hay[j : j + k] == needle for j in range(len(hay) - k + 1))


@dataclass
class Detail:
    """Per verification: the draft's match length, size, root width (children of the last token),
    and accepted depth; plus verifications whose first token missed, and of those, how many had the
    right token nowhere among the root's children."""

    rows: list[tuple[int, int, int, int]] = field(default_factory=list)  # (match, size, root width, accepted)
    first_miss: int = 0
    first_absent: int = 0
    probes: int = 0  # verifications the budget had cut to none and DraftLength.probe let one draft through
    probes_accepted: int = 0
    # per decode step, why it accepted fewer than it could have (`loss`): steps and tokens per cause
    causes: Counter = field(default_factory=Counter)
    lost: Counter = field(default_factory=Counter)
    # accepted drafts by where their run (the session's last token, then the accepted tokens) occurs:
    # "prompt", "output" (the session's output so far, not its prompt), "cache" (neither: an earlier output)
    sources: Counter = field(default_factory=Counter)
    source_tokens: Counter = field(default_factory=Counter)


def reach(trie, context: list[int], run: list[int]) -> list[int]:
    """For each match length m = 1.. (context's last m tokens a node of `trie`), how many tokens of
    `run` follow that node in the trie: what a draft grown from the match of length m could accept at
    best. Stops at the first m that is no node (a longer one cannot be either)."""
    out = []
    for m in range(1, min(len(context), trie.max_depth - 1) + 1):
        node = trie.node(context[len(context) - m :])
        if node is None:
            break
        j = 0
        while j < min(len(run), trie.max_depth - m) and run[j] in node.children:
            node, j = node.children[run[j]], j + 1
        out.append(j)
    return out


def oracle_run(seen: list[int], run: list[int]) -> int:
    """The longest prefix of `run` found verbatim in `seen` (the copy oracle's step)."""
    n = 0
    while n < len(run) and _occurs(seen, run[: n + 1]):
        n += 1
    return n


def loss(
    drafter, raw, raw_accepted: int, accepted: int, prompt: list[int], out: list[int], run: list[int]
) -> tuple[str, int]:
    """Why one decode step accepted `accepted` tokens of `run` (the output's next tokens, as many as
    the step could take), against the copy oracle's run and what the suffix tries held after the
    session's context (`reach`, over the session's trie and the global cache's):
      ok        nothing lost: the draft took the oracle's run and every path after a match
      budget    the draft before the cost budget's cut accepted more (raw_accepted > accepted)
      cut       the trie held more of the run under the match length and trie the draft came from,
                and the draft left it out (its size, factor · m or K, its least probability, or its
                best-first order put other branches first)
      other m   another match length, or the other trie, held more of the run after the context
      jump      the run is in the session (the oracle's) but after no suffix of the context: it starts a
                copy from a place whose preceding tokens differ from the session's last ones (with or
                without a draft)
      empty     no draft was made (the draft length was 0, or every continuation was under the least
                probability) though a match held the run
    `raw`: the step's draft before the budget's cut. Returns the cause and the tokens it lost (the
    better of the oracle's run and the tries' reach, less what was taken)."""
    context = prompt + out
    oracle = oracle_run(context, run)
    own = reach(drafter.trie, context, run)
    cached = reach(drafter.cache.trie, context, run) if drafter.cache is not None and len(drafter.cache) else []
    best = max([0, *own, *cached])
    target = max(oracle, best, raw_accepted)
    if accepted >= target:
        return "ok", 0
    if raw_accepted > accepted:
        return "budget", raw_accepted - accepted
    if not raw.tokens:
        return ("empty", best - accepted) if best > accepted else ("jump", oracle - accepted)
    chosen = cached if raw.from_cache else own
    m = raw.match_len
    under = chosen[m - 1] if 0 < m <= len(chosen) else 0
    if under > accepted:
        return "cut", under - accepted
    if best > accepted:
        return "other m", best - accepted
    return "jump", oracle - accepted


@dataclass
class Clock:
    """`--simulate`: a step-time model the replay runs against in place of the workers, so that the
    loop's StepCost learns the costs from the steps' times as on an engine without link flags (its
    prior first, then its fit), and the time of the same tokens without speculation is known:
    seconds = true.seconds(width) + span_s per drafting session (tree_cost.LinkCost; a prefill's
    columns priced alike)."""

    true: object  # tree_cost.LinkCost
    span_s: float = 0.0
    prior: bool = True  # the StepCost's prior before its first fit (False: unpriced until then)
    spec_s: float = 0.0  # the replayed steps' time
    plain_s: float = 0.0  # the same tokens, one per step
    table: tuple[tuple[int, float], ...] = ()  # `--step-ms`: (columns, s) measured, in place of the model's compute

    def seconds(self, width: int, spans: int) -> float:
        if self.table:  # the link's round trips, and the compute the table measured (drafting included)
            return self.true.exchanges * self.true.round_trip_s + interpolate(self.table, width)  # type: ignore[attr-defined]
        return self.true.seconds(width) + self.span_s * spans  # type: ignore[attr-defined]


def interpolate(table: tuple[tuple[int, float], ...], width: int) -> float:
    """A step's time at `width` columns from a measured table (columns ascending): linear between its
    points, along its last two beyond them (a prefill), its first below."""
    if width <= table[0][0]:
        return table[0][1]
    for (w0, t0), (w1, t1) in zip(table, table[1:], strict=False):
        if width <= w1:
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
    (w0, t0), (w1, t1) = table[-2], table[-1]
    return t1 + (t1 - t0) * (width - w1) / (w1 - w0)


def replay(
    spec_config,
    rows: list[dict],
    tree: bool = True,
    link=None,
    max_new: int | None = None,
    detail: Detail | None = None,
    job=None,
    merge: bool = True,
    per_prompt: list[float] | None = None,
    clock: Clock | None = None,
    capped: bool = True,
):
    """The loop's counters (SpecStats) for `rows` (prompt, greedy output) replayed in order through one
    job's Speculator (its global suffix cache carries from prompt to prompt, as in one `fusion
    serve`). `link`: a tree_cost.LinkCost for the loop's cost budget (else every draft is kept).
    `job`: (Speculator, StepCost or None) of an earlier call, so that several workloads share one job
    (its pooled acceptance and cache), as the bench's runs do. `merge`: the suffix drafter's trees
    merge every match length's draft (False: the best one alone, as before). `per_prompt`: each
    prompt's τ is appended to it. `clock`: the steps timed by a model and the cost fitted from those
    times (`link` unused). `capped`: the suffix drafts' size per match length capped by that cost
    (suffix_size.MatchSizing; False: the factor alone)."""
    from ..generation.speculative import DEPTHS, SpecStats, Speculator, StepCost
    from ..generation.suffix import SuffixDrafter
    from ..generation.suffix_tree import Draft
    from ..generation.token_tree import TokenTree
    from ..generation.tree_cost import path_gains

    context = max(len(r["prompt"]) + len(r["output"]) for r in rows) + spec_config.num_speculative_tokens + 8
    if job is None:
        sp = Speculator(spec_config, 1 << 20, context)
        cost = StepCost(prior=clock.prior) if clock is not None else StepCost(link) if link is not None else None
        bind_sizing(sp, cost, capped)
    else:
        sp, cost = job
    total = SpecStats(spec_config.method)
    for r in rows:
        prompt, ref = list(r["prompt"]), list(r["output"])
        budget = max_new if max_new is not None else len(ref)
        drafter, length, stats = sp.drafter(), sp.length(), SpecStats(spec_config.method)
        if isinstance(drafter, SuffixDrafter):
            drafter.merge = merge
        out = ref[:1]
        stats.step(len(prompt), 1, decode=False)
        if clock is not None:
            t = clock.seconds(len(prompt), 0)
            clock.spec_s += t
            clock.plain_s += t + (len(ref) - 1) * clock.seconds(1, 0)
            if cost is not None:
                cost.observe(len(prompt), 0, t, prefill=True)
        while len(out) < len(ref):
            k = min(length.next(cost is not None and cost.costs() is not None), budget - len(out) - 1)
            d, probed = Draft(), False
            if k >= 1:
                if tree:
                    d = drafter.propose_tree(prompt + out, k)
                elif isinstance(drafter, SuffixDrafter):
                    d = drafter.draft(prompt + out, k, tree=False)
                else:
                    for t in drafter.propose(prompt + out, k):
                        d.add(t, len(d.tokens) - 1, 1.0)
            raw = d
            if d.tokens and cost is not None:  # the loop's budget (batching.BatchRunner._budget), one session
                freqs = [
                    q if p < 0 else q / d.probs[p] if d.probs[p] > 0 else 0.0
                    for q, p in zip(d.probs, d.parents, strict=True)
                ]
                q = length.depth_rates(sp.pool.depth_rates())
                depths = TokenTree.from_drafts(out[-1], d.tokens, d.parents).depths_T()[1:]
                gains = path_gains(d.parents, [q[min(x, DEPTHS) - 1] * f for x, f in zip(depths, freqs, strict=True)])
                budgeted = cost.allocate([len(d.tokens)], [q[0]], None, [gains])[0]
                n = length.probe(budgeted)
                probed = budgeted == 0 and n > 0
                d = _cut(d, n)
            step = TokenTree.from_drafts(out[-1], d.tokens, d.parents)
            accepted = _walk(step, ref, len(out))
            drafted, depth = len(step) - 1, max(step.depths_T())
            if drafted:
                length.update(drafted, accepted, depth)
                if isinstance(drafter, SuffixDrafter):
                    drafter.verified(depth, accepted)
                stats.add(drafted, accepted)
                sp.pool.add(drafted, accepted, depth)
                if detail is not None:
                    if probed:
                        detail.probes += 1
                        detail.probes_accepted += accepted
                    roots = [step.tokens_T[c] for c in step.children(0)]
                    last = getattr(drafter, "last", None)
                    detail.rows.append((getattr(last, "match_len", 0), drafted, len(roots), accepted))
                    if accepted == 0:
                        detail.first_miss += 1
                        detail.first_absent += ref[len(out)] not in roots
            if detail is not None and isinstance(drafter, SuffixDrafter):
                raw_accepted = _walk(TokenTree.from_drafts(out[-1], raw.tokens, raw.parents), ref, len(out))
                why, n = loss(drafter, raw, raw_accepted, accepted, prompt, out, ref[len(out) : len(ref) - 1])
                detail.causes[why] += 1
                detail.lost[why] += n
                if accepted:
                    run = out[-1:] + ref[len(out) : len(out) + accepted]
                    src = "prompt" if _occurs(prompt, run) else "output" if _occurs(out, run) else "cache"
                    detail.sources[src] += 1
                    detail.source_tokens[src] += accepted
            emitted = min(accepted + 1, len(ref) - len(out))
            out = ref[: len(out) + emitted]
            stats.step(1 + drafted, emitted, decode=True)
            if clock is not None:
                t = clock.seconds(1 + drafted, int(drafted > 0))
                clock.spec_s += t
                if cost is not None:
                    cost.observe(1 + drafted, int(drafted > 0), t)
        drafter.close(ref)
        total.merge(stats)
        if per_prompt is not None:
            per_prompt.append(round(stats.tokens / stats.forwards, 2))
    return total


def bind_sizing(sp, cost, capped: bool = True) -> None:
    """The job's suffix size caps (suffix_size.MatchSizing) read the cost the replay's budget reads, as
    the engine's read its StepCost; without a budget (no --rtt-ms), or not `capped`, none."""
    if sp.sizing is not None:
        if cost is None or not capped:
            sp.sizing = None
        else:
            sp.sizing.cost = cost


def _walk(step, ref: list[int], at: int) -> int:
    """Drafts accepted greedily at output position `at`: the child whose token is the output's next one,
    while one is (the output's last token is always the target's own)."""
    node, accepted = 0, 0
    while True:
        want = ref[at + accepted] if at + accepted < len(ref) else None
        nxt = next((c for c in step.children(node) if step.tokens_T[c] == want), None)
        if nxt is None or at + accepted + 1 >= len(ref):
            return accepted
        node, accepted = nxt, accepted + 1


def _cut(d, n: int):
    from ..generation.suffix_tree import Draft

    c = Draft(match_len=d.match_len, from_cache=d.from_cache)
    for t, p, q in zip(d.tokens[:n], d.parents[:n], d.probs[:n], strict=True):
        c.add(t, p, q)
    return c


def summarise(stats, sessions: int, exchanges: int = 120) -> dict:
    d = stats.as_dict()
    verifs = d["num_drafts"] or 1
    tau = d["tokens_per_forward"]
    decode_steps = stats.forwards - sessions  # columns are counted over decode steps, not prefills
    return {
        "tau": tau,
        "exchanges_per_token": round(exchanges / tau, 1) if tau else None,
        "columns_per_step": round(stats.columns / max(1, decode_steps), 2),
        "accepted_by_depth": [round(n / verifs, 2) for n in d["accepted_by_depth"][:6]],
        "verifications": d["num_drafts"],
        "forwards": stats.forwards,
        "tokens": stats.tokens,
    }


def main(argv: list[str] | None = None) -> int:
    from ..generation.speculative_config import SpeculativeConfig, SpeculativeError
    from ..weights.loader import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.replay", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--method", default="suffix", choices=("suffix", "ngram"))
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int)
    p.add_argument("--chain", action="store_true", help="chains, not trees")
    p.add_argument("--no-cache", action="store_true", help="suffix: no global cache")
    p.add_argument("--rtt-ms", type=float, help="run the cost budget with a link of this round trip")
    p.add_argument("--compute-ms", type=float, default=0.5, help="with --rtt-ms: compute per column, ms")
    p.add_argument("--refs", default="/tmp/fc-replay-refs.json", help="greedy outputs' cache (JSON)")
    p.add_argument("--detail", action="store_true")
    p.add_argument(
        "--one-job", action="store_true", help="both workloads through one job (grounded first), as the bench runs them"
    )
    p.add_argument(
        "--single-match",
        action="store_true",
        help="suffix trees: the best match length's draft alone (before the merge)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="with --rtt-ms: time the steps by the link's model "
        "and fit the budget from those times, as an engine without link flags does (reports speedup)",
    )
    p.add_argument(
        "--base-ms", type=float, help="--simulate: a step's compute whatever its width (default --compute-ms)"
    )
    p.add_argument("--span-ms", type=float, default=0.0, help="--simulate: what a step with drafts costs more")
    p.add_argument("--no-prior", action="store_true", help="--simulate: drafts unpriced until the first fit")
    p.add_argument(
        "--step-ms",
        help="--simulate: a step's compute by its columns, measured (e.g. bench/step_width's medians): "
        "'1:140,2:243,3:262,5:284' (linear between the points; replaces --compute-ms, --base-ms, --span-ms)",
    )
    p.add_argument("--job-per-prompt", action="store_true", help="a new job per prompt, as `fusion generate` runs")
    p.add_argument("--output-tokens", type=int, help="only the first N tokens of each output (the bench's runs: 24)")
    p.add_argument("--factor", type=float, help="suffix: draft size per matched token")
    p.add_argument("--min-prob", type=float, help="suffix: the least estimated probability a draft token keeps")
    p.add_argument(
        "--uncapped",
        action="store_true",
        help="suffix: each match's draft size by the factor alone, not capped by the cost (suffix_size.py)",
    )
    a = p.parse_args(argv)
    table: tuple[tuple[int, float], ...] = ()
    if a.step_ms:
        try:
            table = tuple(sorted((int(w), float(ms) / 1e3) for w, ms in (x.split(":") for x in a.step_ms.split(","))))
        except ValueError:
            table = ()
        if len(table) < 2 or table[0][0] < 1 or len({w for w, _ in table}) != len(table):
            print(
                f"bench.replay: --step-ms needs two or more distinct 'columns:ms' points, got {a.step_ms!r}",
                file=sys.stderr,
            )
            return 2
    model = str(resolve_model_path(a.model))
    refs = cached_refs(Path(a.refs), model, a.max_new_tokens)
    try:
        kw: dict = {"suffix_cache_tokens": 0} if a.no_cache and a.method == "suffix" else {}
        if a.factor is not None:
            kw["suffix_max_spec_factor"] = a.factor
        if a.min_prob is not None:
            kw["suffix_min_token_prob"] = a.min_prob
        cfg = SpeculativeConfig(method=a.method, num_speculative_tokens=a.k, **kw)
    except SpeculativeError as e:
        print(f"bench.replay: {e}", file=sys.stderr)
        return 2
    link = None
    if a.rtt_ms is not None:
        from ..generation.tree_cost import LinkCost

        # SmolLM2 at N = 2: 120 exchanges; a column adds a 576-float row to each, 2.3 KB x 120
        base_ms = a.compute_ms if a.base_ms is None else a.base_ms
        link = LinkCost(a.rtt_ms / 1e3, 120, 576 * 4 * 120, 125e6, a.compute_ms / 1e3, base_ms / 1e3)
    elif a.simulate:
        print("bench.replay: --simulate needs --rtt-ms", file=sys.stderr)
        return 2
    report = {}
    job = None
    if a.one_job:
        from ..generation.speculative import Speculator, StepCost

        every = [r for name in WORKLOAD_NAMES for r in refs["workloads"][name][: a.limit]]
        context = max(len(r["prompt"]) + len(r["output"]) for r in every) + a.k + 8
        job = Speculator(cfg, 1 << 20, context), StepCost(link) if link is not None else None
        bind_sizing(job[0], job[1], not a.uncapped)
    for name in WORKLOAD_NAMES:
        rows = refs["workloads"][name][: a.limit]
        det = Detail() if a.detail else None
        if a.output_tokens is not None:
            rows = [{"prompt": r["prompt"], "output": r["output"][: a.output_tokens]} for r in rows]
        groups = [[r] for r in rows] if a.job_per_prompt else [rows]
        s, plain_s, spec_s, each = None, 0.0, 0.0, []
        taus: list[float] = []
        for g in groups:
            clock = Clock(link, a.span_ms / 1e3, prior=not a.no_prior, table=table) if a.simulate else None
            budget = a.max_new_tokens if a.output_tokens is None else min(a.max_new_tokens, a.output_tokens)
            one = replay(
                cfg,
                g,
                tree=not a.chain,
                link=link,
                max_new=budget,
                detail=det,
                job=None if a.job_per_prompt else job,
                merge=not a.single_match,
                per_prompt=taus,
                clock=clock,
                capped=not a.uncapped,
            )
            s = one if s is None else (s.merge(one) or s)
            if clock is not None:
                plain_s, spec_s = plain_s + clock.plain_s, spec_s + clock.spec_s
                each.append(round(clock.plain_s / clock.spec_s, 2))
        report[name] = summarise(s, len(rows))
        report[name]["tau_per_prompt"] = taus
        if a.simulate:  # the plain steps' time over the replayed steps' for the same tokens
            report[name]["speedup"] = round(plain_s / spec_s, 3)
            if a.job_per_prompt:
                report[name]["speedup_per_prompt"] = each
        if det is not None:
            fw = tok = 0
            for r in rows:
                f, t = copy_oracle(r["prompt"], r["output"])
                fw, tok = fw + f, tok + t
            report[name]["copy_oracle_tau"] = round(tok / fw, 2)
            if a.method == "suffix":
                fw, tok = trie_oracle(rows, cfg.suffix_max_depth, cfg.suffix_cache_tokens, a.k)
                report[name]["trie_oracle_tau"] = round(tok / fw, 2)
            report[name]["first_miss"] = det.first_miss
            report[name]["first_absent"] = det.first_absent
            report[name]["probes"] = det.probes
            report[name]["probes_accepted"] = det.probes_accepted
            report[name]["mean_match"] = round(sum(r[0] for r in det.rows) / max(1, len(det.rows)), 2)
            report[name]["mean_root_width"] = round(sum(r[2] for r in det.rows) / max(1, len(det.rows)), 2)
            if det.causes:
                report[name]["steps_by_cause"] = dict(det.causes.most_common())
                report[name]["tokens_lost_by_cause"] = dict(det.lost.most_common())
                report[name]["accepted_steps_by_source"] = dict(det.sources.most_common())
                report[name]["accepted_tokens_by_source"] = dict(det.source_tokens.most_common())
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
