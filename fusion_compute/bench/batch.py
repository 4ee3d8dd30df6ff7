"""Continuous batching, measured: one session alone vs B sessions decoding together on the same job.

`fusion bench --batch 8` (bench/run.py parses its options). One job (N local workers); the
two workloads alternate `--repeats` times so drift on a shared machine hits both alike:

  single  `generate` on one random prompt (what `fusion serve --max-batch 1` runs per request):
          decode tokens/s = tokens after the first / time after the first.
  batch   B sessions with distinct random prompts admitted together (their prefills share the
          first step), then decoded together (batching.run_batch): aggregate decode tokens/s =
          Σ tokens after each one's first / time from the last first token to the last token.

No end tokens stop a session early (every one decodes `--new-tokens`), and sampling is greedy. The
report says whether session 0's tokens in the batch equal its tokens alone (they must).
"""

from __future__ import annotations

import statistics

import torch


def measure(
    model: str | None,
    n: int,
    engine: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    log=lambda s: None,
    opts=None,
) -> dict:
    """`opts`: the job's EngineOptions (bench/rtt.py: workers named by a topology; MaskedOptions: the
    masked mode, `fusion bench --batch B --masked A+B`); default: n local workers on `engine`."""
    from ..generation.batching import Sequence, run_batch
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..structural.client import Engine, EngineOptions

    greedy = SamplingParams()
    if opts is None:
        opts = EngineOptions(n_workers=n, comm_backend=engine, log=lambda line: None)
    opts.context = prompt_len + new_tokens + 8
    from ..masked.client import MaskedEngine, MaskedOptions

    masked = isinstance(opts, MaskedOptions)
    with (MaskedEngine if masked else Engine)(model, opts) as eng:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, eng.config.vocab, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        singles, batches, same = [], [], True
        for rep in range(repeats):
            log(f"bench batch: repeat {rep + 1}/{repeats}: 1 session, then {batch}")
            alone = generate(eng, prompts[0], max_new_tokens=new_tokens, sampling=greedy)
            singles.append(alone.decode_tokens_per_s)
            seqs = [Sequence(p, new_tokens, greedy) for p in prompts]
            results = run_batch(eng, seqs, batch)
            t_first = max(s.t_first for s in seqs)
            t_end = max(s.t_end for s in seqs)
            batches.append(sum(len(r.token_ids) - 1 for r in results) / (t_end - t_first))
            same &= results[0].token_ids == alone.token_ids
    ratios = [b / s for s, b in zip(singles, batches, strict=True)]
    return {
        "model": str(eng.model_path),
        "workers": "+".join(map(str, opts.sizes)) if masked else n,
        "engine": "masked" if masked else engine,
        "comm_backend": opts.comm_backend,
        "batch": batch,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "single_decode_tokens_per_s": _summary(singles),
        "batch_decode_tokens_per_s": _summary(batches),
        "ratio": _summary(ratios),
        "same_tokens_as_alone": same,
        "tokens": alone.token_ids,
    }


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def table(r: dict) -> str:
    s, b, q = r["single_decode_tokens_per_s"], r["batch_decode_tokens_per_s"], r["ratio"]
    return "\n".join(
        [
            f"continuous batching: N = {r['workers']} ({r['engine']}), prompts of {r['prompt_tokens']} tokens, "
            f"{r['new_tokens']} new tokens each, {r['repeats']} alternating repeats",
            "| workload | decode tokens/s, median (min..max) |",
            "|---|---|",
            f"| 1 session | {s['median']:.2f} ({s['min']:.2f}..{s['max']:.2f}) |",
            f"| {r['batch']} sessions, aggregate | {b['median']:.2f} ({b['min']:.2f}..{b['max']:.2f}) |",
            f"| ratio, per repeat | **{q['median']:.2f}×** ({q['min']:.2f}..{q['max']:.2f}) |",
            f"session 0's tokens in the batch equal its tokens alone: {r['same_tokens_as_alone']}",
        ]
    )
