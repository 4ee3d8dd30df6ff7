"""Batches replayed offline through the loop itself: what the draft budget does when sessions step together.

    python -m fusion_compute.bench.replay_batch --step-width FILE --rtt-ms R
        [--workload input_grounded|open_chat] [--starts 0,4,8] [--sessions 8] [--output-tokens 24]
        [--fresh] [--queued] [--log] [--refs FILE]

bench/replay.py replays one session; a batch's budget (generation/batching.BatchRunner._budget,
speculative.StepCost) sees every session of the step at once, so it is replayed here through the
loop's own code: a BatchRunner with the job's Speculator (drafters, draft lengths, the pooled
acceptance, StepCost with its prior and fit), stepping `--sessions` sessions of a workload's prompts
start..start+7 (the bench's batch: bench/spec_pairs.py) on a ReplayEngine in place of the workers.
That engine answers each column with the target's greedy token, read from the prompt's greedy output
(replay.greedy_refs: greedy tokens do not depend on the drafts), so the tokens are the output's
exactly; and it times each step by a measured table of step shapes (BatchSteps: bench/step_width.py's
medians, `--cpu`: the workers' and client's CPU seconds, which the machine's load moves little), plus
the round trips (120 exchanges of `--rtt-ms`), on a simulated clock that the loop reads instead of the
wall clock, so the budget fits its costs from those times as on an engine. Deterministic: the same
table gives the same choices.

For each batch, the same sessions without speculation on the same clock; `ratio` = tokens/s with
speculation over without, as bench/spec_pairs.py's batch counts them (tokens after each session's
first, over the time from the last first token to the last end). `--log`: every step's sessions,
columns, drafting sessions, drafts per session and tokens accepted, its time and the budget's costs.
One Speculator per workload across its batches, as spec_pairs' one job (`--fresh`: one per batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .replay import interpolate

EXCHANGES = 120  # SmolLM2 at N = 2: a forward's sequential exchanges (docs/performance.md)
PREFILL = "8: all x60 (a prefill's columns)"  # bench/step_width.py's prefill shape


@dataclass(frozen=True)
class BatchSteps:
    """A step's compute seconds by its shape, from bench/step_width.py's medians (ms):

      one session, W columns        the "1xW" points, linear between them (a span included)
      n sessions of one column      the "nx1" points (1, 2, 4, 8), linear in n between them
      n >= 2 sessions with drafts   that plus per_span · s + per_column · E, s the drafting sessions
                                    and E their drafts (W - n), per_span and per_column fitted by
                                    least squares to the batch shapes with drafts ("8: one x2",
                                    "8: one x9", "8: all x2", "8: all x5", "4: all x2") over their
                                    plain step
      a prefill of W columns        linear from the 8 × 1 step (W = 8) through the 8 × 60 prefill's
                                    columns (W = 480), extrapolated

    A model, not a measurement, between and beyond the points: `residuals` says how far it is from
    the measured shapes."""

    one: tuple[tuple[int, float], ...]  # (columns, s) of one session
    plain: tuple[tuple[int, float], ...]  # (sessions, s), one column each
    per_span: float
    per_column: float
    prefill_480: float

    @classmethod
    def from_medians(cls, ms: dict[str, float]) -> BatchSteps:
        """ValueError, naming them, when shapes it needs are missing (bench/step_width.py's names)."""
        need = ["1x1", "1x2", "8x1", "8: one x2", "8: all x2", PREFILL]
        missing = [k for k in need if k not in ms]
        if missing:
            raise ValueError(f"the step table lacks {', '.join(missing)} (bench/step_width.py's shapes)")
        one = tuple(sorted((int(k[2:]), v / 1e3) for k, v in ms.items() if k.startswith("1x")))
        plain = tuple(sorted((int(k[0]), v / 1e3) for k, v in ms.items() if len(k) == 3 and k[1:] == "x1"))
        shapes = {"8: one x2": (8, 1, 1), "8: one x9": (8, 1, 8), "8: all x2": (8, 8, 8), "8: all x5": (8, 8, 32)}
        shapes["4: all x2"] = (4, 4, 4)
        rows, extra = [], []
        for name, (n, s, e) in shapes.items():
            if name in ms:
                rows.append([float(s), float(e)])
                extra.append(ms[name] / 1e3 - interpolate(plain, n))
        coef = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(extra, dtype=torch.float64))
        per_span, per_column = (max(0.0, float(c)) for c in coef.solution)
        return cls(one, plain, per_span, per_column, ms[PREFILL] / 1e3)

    def seconds(self, sessions: int, columns: int, spans: int, prefill: bool = False) -> float:
        if prefill:
            p8 = interpolate(self.plain, 8)
            return max(p8, p8 + (columns - 8) * (self.prefill_480 - p8) / 472)
        if sessions == 1:
            return interpolate(self.one, columns)
        return interpolate(self.plain, sessions) + self.per_span * spans + self.per_column * (columns - sessions)

    def residuals(self, ms: dict[str, float]) -> dict[str, float]:
        """Measured less modelled, ms, for every shape the table names."""
        shapes = {"8: one x2": (8, 9, 1), "8: one x9": (8, 16, 1), "8: all x2": (8, 16, 8), "8: all x5": (8, 40, 8)}
        shapes |= {"4: all x2": (4, 8, 4), "8x1": (8, 8, 0), "4x1": (4, 4, 0), "2x1": (2, 2, 0)}
        return {k: round(ms[k] - 1e3 * self.seconds(*v), 1) for k, v in shapes.items() if k in ms}


class _Config:
    def __init__(self, vocab: int):
        self.vocab = vocab


class ReplayEngine:
    """The loop's engine (runtime/engine.EngineBase's session calls) without workers: each step's
    logits are one-hot at the target's greedy token after each column's path, read from the session's
    greedy output (a column off the output's path gets token 0: acceptance never reads it), and each
    step advances `now` by `steps`' time for its shape plus `rtt_s` × EXCHANGES. Verifies trees."""

    verifies_trees = True
    batch_slots = 1
    draft_hint = 0

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], vocab: int, context: int, steps, rtt_s: float):
        self.outputs = outputs  # prompt -> its greedy output
        self.config = _Config(vocab)
        self.context = context
        self.steps, self.rtt_s = steps, rtt_s
        self.now = 0.0
        self.slot_history: dict[int, list[int]] = {}
        self.prompt: dict[int, tuple[int, ...]] = {}
        self.widths: dict[int, int] = {}
        self.recoveries: list[dict] = []
        self.log: list[dict] = []  # one entry per step: its shape and time

    def reset(self) -> None:
        self.slot_history, self.prompt, self.widths = {}, {}, {}

    def forward_batch(self, items, all_logits=(), trees=None) -> list[torch.Tensor]:
        trees = trees or {}
        out, prefill, spans = [], False, 0
        for slot, ids in items:
            if slot not in self.slot_history:  # its prefill: the output's first token
                prefill = True
                self.prompt[slot] = tuple(ids)
                out.append(self._one_hot([self.outputs[tuple(ids)][0]])[0])
                self.slot_history[slot] = list(ids)
                continue
            ref, hist = self.outputs[self.prompt[slot]], self.slot_history[slot]
            done = len(hist) - len(self.prompt[slot]) + 1  # output tokens emitted, ids[0] the last of them
            parents = trees.get(slot, tuple(range(-1, len(ids) - 1)))
            paths: list[list[int]] = []
            want = []
            for j, p in enumerate(parents):
                paths.append([] if p < 0 else paths[p] + [ids[j]])
                at = done + len(paths[j])
                on_path = ref[done:at] == paths[j] and at < len(ref)
                want.append(ref[at] if on_path else 0)
            rows = self._one_hot(want)
            out.append(rows if slot in all_logits else rows[-1])
            spans += len(ids) > 1
            hist.extend(ids)
            self.widths[slot] = len(ids) if slot in trees else 0
        width = sum(len(ids) for _, ids in items)
        t = self.steps.seconds(len(items), width, spans, prefill) + EXCHANGES * self.rtt_s
        self.now += t
        self.log.append({"sessions": len(items), "columns": width, "spans": spans, "ms": round(t * 1e3, 1)})
        return out

    def _one_hot(self, tokens: list[int]) -> torch.Tensor:
        x = torch.zeros(len(tokens), self.config.vocab)
        x[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return x

    def rollback(self, slot: int, keep: int) -> None:
        del self.slot_history[slot][keep:]

    def keep_path(self, slot: int, path: list[int]) -> None:
        hist, width = self.slot_history[slot], self.widths[slot]
        base = len(hist) - width
        hist[base:] = [hist[base + c] for c in path]
        self.widths[slot] = 0

    def release(self, slot: int) -> None:
        self.slot_history.pop(slot, None)


def run(
    rows: list[dict], steps: BatchSteps, rtt_s: float, speculator=None, log: list | None = None, queued: bool = False
) -> dict:
    """One batch of `rows` (prompt, greedy output, stop ids) through BatchRunner on a ReplayEngine:
    tokens/s as bench/spec_pairs.py counts a batch's, the tokens, and (`log`) each step's shape, time,
    drafts and accepted per session. `queued`: the loop told that a session waits for a slot at every
    step, so the budget prices a batch step by its tokens per second (BatchRunner.waiting; the rule
    before the fixed batch's, docs/speculative.md)."""
    from ..generation.batching import BatchRunner, Sequence
    from ..generation.sampling_params import SamplingParams

    outputs = {tuple(r["prompt"]): list(r["output"]) for r in rows}
    vocab = 1 + max(max(r["prompt"] + r["output"]) for r in rows)
    context = max(len(r["prompt"]) + len(r["output"]) for r in rows) + 64
    eng = ReplayEngine(outputs, vocab, context, steps, rtt_s)
    runner = BatchRunner(eng, len(rows), speculator=speculator, clock=lambda: eng.now)  # type: ignore[arg-type]
    seqs = [Sequence(list(r["prompt"]), len(r["output"]), SamplingParams(), r["stop"]) for r in rows]
    for s in seqs:
        runner.add(s)
    seq_of = {s.slot: s for s in seqs}
    while runner.active:
        runner.waiting = int(queued)
        before = {s.slot: (len(s.out), _drafted(s)) for s in runner.active.values()}
        runner.step()
        if log is not None:
            entry = dict(eng.log[-1])
            entry["drafts"] = [_drafted(seq_of[k]) - d for k, (_, d) in before.items()]
            entry["tokens"] = [len(seq_of[k].out) - n for k, (n, _) in before.items()]
            cost = speculator.cost.costs() if speculator is not None and speculator.cost is not None else None
            entry["cost_ms"] = None if cost is None else [round(c * 1e3, 1) for c in cost]
            log.append(entry)
    span = max(s.t_end for s in seqs) - max(s.t_first for s in seqs)
    tokens = sum(len(s.out) - 1 for s in seqs)
    return {"tokens_per_s": tokens / span, "ids": [s.out for s in seqs], "seconds": span, "steps": len(eng.log)}


def _drafted(seq) -> int:
    return 0 if seq.spec is None else seq.spec.num_draft_tokens


def batches(
    refs_rows: list[dict],
    max_new: int,
    starts: list[int],
    sessions: int,
    output_tokens: int,
    steps: BatchSteps,
    rtt_s: float,
    cfg,
    fresh: bool = False,
    log: bool = False,
    queued: bool = False,
) -> dict:
    """Each batch of `sessions` prompts start..start+sessions-1 (wrapping), with and without
    speculation: the ratio per batch, its median, τ and columns per decode step of the speculative
    runs, and that the tokens were the same."""
    from ..generation.speculative import Speculator

    rows = []
    for r in refs_rows:
        out = list(r["output"])
        stop = [out[-1]] if len(out) < max_new else []  # it ended at an end-of-turn token (kept)
        rows.append({"prompt": list(r["prompt"]), "output": out[:output_tokens], "stop": stop})
    context = max(len(r["prompt"]) + len(r["output"]) for r in rows) + 64
    sp = None
    report: dict = {"batches": []}
    for start in starts:
        group = [rows[(start + b) % len(rows)] for b in range(sessions)]
        if sp is None or fresh:
            sp = Speculator(cfg, 1 << 20, context)
        plain = run(group, steps, rtt_s)
        steps_log: list | None = [] if log else None
        before = (sp.totals.forwards, sp.totals.tokens, sp.totals.columns, sp.totals.num_drafts)
        spec = run(group, steps, rtt_s, sp, steps_log, queued)
        t = sp.totals
        forwards, tokens, columns = t.forwards - before[0], t.tokens - before[1], t.columns - before[2]
        entry = {
            "start": start,
            "ratio": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3),
            "same_ids": spec["ids"] == plain["ids"],
            "tau": round(tokens / forwards, 2),
            "columns_per_step": round(columns / max(1, forwards - sessions), 2),
            "steps": [plain["steps"], spec["steps"]],
        }
        if steps_log is not None:
            entry["log"] = steps_log
        report["batches"].append(entry)
    ratios = [b["ratio"] for b in report["batches"]]
    report["median_ratio"] = round(statistics.median(ratios), 3)
    report["min_ratio"] = min(ratios)
    return report


def main(argv: list[str] | None = None) -> int:
    from ..generation.speculative_config import SpeculativeConfig
    from ..weights.loader import resolve_model_path
    from .replay import WORKLOAD_NAMES, cached_refs

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.replay_batch", description=__doc__.splitlines()[0])
    p.add_argument("--step-width", required=True, help="bench/step_width.py's JSON line (its median_ms)")
    p.add_argument("--rtt-ms", type=float, required=True)
    p.add_argument("--workload", choices=WORKLOAD_NAMES, action="append", help="default: both")
    p.add_argument("--starts", default="0,4,8", help="each batch's first prompt, comma-separated")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=24)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--fresh", action="store_true", help="a new job per batch")
    p.add_argument("--log", action="store_true", help="every speculative step")
    p.add_argument(
        "--queued",
        action="store_true",
        help="price every step as if a session waited (the rule before the fixed batch's)",
    )
    p.add_argument("--refs", default="/tmp/fc-replay-batch-refs.json", help="greedy outputs cache (as bench/replay.py)")
    a = p.parse_args(argv)
    try:
        ms = json.loads(Path(a.step_width).read_text())["median_ms"]
        steps = BatchSteps.from_medians(ms)
        starts = [int(x) for x in a.starts.split(",")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bench.replay_batch: {e}", file=sys.stderr)
        return 2
    if a.rtt_ms < 0 or a.sessions < 1 or a.output_tokens < 2:
        print("bench.replay_batch: --rtt-ms >= 0, --sessions >= 1 and --output-tokens >= 2", file=sys.stderr)
        return 2
    refs = cached_refs(Path(a.refs), str(resolve_model_path(None)), 128)  # bench/replay.py's default length
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=a.k, suffix_cache_tokens=0)
    report: dict = {"rtt_ms": a.rtt_ms, "model_residual_ms": steps.residuals(ms)}
    for name in a.workload or WORKLOAD_NAMES:
        report[name] = batches(
            refs["workloads"][name],
            refs["max_new_tokens"],
            starts,
            a.sessions,
            a.output_tokens,
            steps,
            a.rtt_ms / 1e3,
            cfg,
            a.fresh,
            a.log,
            a.queued,
        )
    print(json.dumps(report, indent=None if a.log else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
