"""Speculation against none on loopback, in interleaved pairs: a short check of the draft budget.

    python -m fusion_compute.bench.spec_pairs single|batch WORKLOAD PROMPTS [--tokens 24] [--fresh]

One job (the bundled SmolLM2-135M-Instruct, 2 workers on 127.0.0.1, TLS, no delay added: for round
trips, bench/speculative.py's namespaces) and one Speculator (`--speculative suffix`, K = 32, no
global cache: the pairs repeat prompts), as `fusion serve` keeps one; `--fresh`: a new one per pair,
as each `fusion generate` is a new job. For each prompt index in PROMPTS (comma-separated; WORKLOAD
input_grounded or open_chat, bench/workloads.py) a pair: greedy decoding of `--tokens` new tokens
without speculation and with it, back to back, the order alternating from pair to pair. `single`:
that prompt alone (decode tokens/s after the first token); `batch`: 8 sessions together, prompts
i..i+7 (tokens after each one's first over the time from the last first token to the last end, as
bench/speculative.py's batch). Prints a JSON line per pair (tokens/s both ways, their ratio, whether
the tokens were the same, τ, drafts and accepted of the session or the batch's sessions pooled, the load
average; for a batch, each decode step of its speculative run as the draft budget timed it: sessions,
columns, drafting sessions, ms, at most the budget's last 32) and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

POOLED = ("forwards", "num_draft_tokens", "num_accepted_tokens")


def max_steps(seqs) -> int:
    """The batch's decode steps: its longest-lived session's forwards after its prefill."""
    return max(s.steps for s in seqs) - 1


def main(argv: list[str] | None = None) -> int:
    from ..generation.batching import Sequence, run_batch
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..generation.speculative import Speculator
    from ..generation.speculative_config import SpeculativeConfig
    from ..runtime.engine_options import EngineOptions
    from ..structural.client import Engine
    from ..weights.loader import resolve_model_path
    from . import workloads
    from .speculative import tokenizer_for

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.spec_pairs", description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("single", "batch"))
    p.add_argument("workload", choices=("input_grounded", "open_chat"))
    p.add_argument("prompts", help="prompt indices, comma-separated: one pair each")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--fresh", action="store_true", help="a new job's Speculator per pair (as fusion generate)")
    a = p.parse_args(argv)
    try:
        which = [int(x) for x in a.prompts.split(",")]
    except ValueError:
        print(f"bench.spec_pairs: prompts must be comma-separated indices, got {a.prompts!r}", file=sys.stderr)
        return 2
    model = str(resolve_model_path(None))
    tok = tokenizer_for(model)
    prompts = [list(x) for x in workloads.load(a.workload, tok, None).prompts]
    stop, greedy = list(tok.eos_ids), SamplingParams()
    context = max(len(x) for x in prompts) + a.tokens + 40
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=32, suffix_cache_tokens=0)
    ratios = []
    with Engine(model, EngineOptions(n_workers=2, context=context, log=lambda line: None)) as eng:
        sp = Speculator(cfg, eng.config.vocab, eng.context)
        for j, i in enumerate(which):
            if a.fresh:
                sp = Speculator(cfg, eng.config.vocab, eng.context)
            res = {}
            for on in (False, True) if j % 2 == 0 else (True, False):
                if a.mode == "single":
                    r = generate(
                        eng,
                        prompts[i % len(prompts)],
                        max_new_tokens=a.tokens,
                        sampling=greedy,
                        stop_ids=stop,
                        speculator=sp if on else None,
                    )
                    res[on] = (r.decode_tokens_per_s, [r.token_ids], r.speculative or {})
                else:
                    seqs = [Sequence(prompts[(i + b) % len(prompts)], a.tokens, greedy, stop) for b in range(8)]
                    rs = run_batch(eng, seqs, 8, speculator=sp if on else None)
                    span = max(s.t_end for s in seqs) - max(s.t_first for s in seqs)
                    res[on] = (sum(len(r.token_ids) - 1 for r in rs) / span, [r.token_ids for r in rs], {})
                    if on:  # the batch's counters, pooled, and its decode steps as the budget timed them
                        spec = {k: sum((r.speculative or {}).get(k) or 0 for r in rs) for k in POOLED}
                        spec["tokens_per_forward"] = round(
                            sum(len(r.token_ids) for r in rs) / max(1, spec["forwards"]), 3
                        )
                        cost = sp.cost
                        if cost is not None:  # (sessions, columns, drafting sessions, ms) of its last steps
                            steps = list(zip(cost.sessions, cost.samples, strict=True))[-max_steps(seqs) :]
                            spec["steps"] = [(m, w, k, round(t * 1e3, 1)) for m, (w, k, t) in steps]
                        res[on] = (*res[on][:2], spec)
            ratios.append(res[True][0] / res[False][0])
            spec = res[True][2]
            row = {
                "prompt": i,
                "plain_tokens_per_s": round(res[False][0], 3),
                "spec_tokens_per_s": round(res[True][0], 3),
                "ratio": round(ratios[-1], 3),
                "same_tokens": res[True][1] == res[False][1],
                "tau": spec.get("tokens_per_forward"),
                "drafts": spec.get("num_draft_tokens"),
                "accepted": spec.get("num_accepted_tokens"),
                "load_average_1min": round(os.getloadavg()[0], 2),
            }
            if "steps" in spec:
                row["steps"] = spec["steps"]
            print(json.dumps(row), flush=True)
    print(json.dumps({"median_ratio": round(statistics.median(ratios), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
