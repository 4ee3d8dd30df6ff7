"""Speculative decoding, measured: acceptance, forwards and exchanges per token, and decode speed with
and without it across round trips of 0, 1 and 5 ms, in one run on one machine.

    python -m fusion_compute.bench.speculative [--workers 2] [--max-new-tokens 128] [--rtt 0,1,5]
        [--rtt-tokens 32] [--batch 8] [--repeats 2] [--k 4,16] [--draft-layers 8] [--out FILE]
        [--singles 2] [--batch-pairs 1] [--workloads input_grounded,open_chat]
        [--method ngram|suffix] [--start-repeat R]

Two workloads (bench/workloads.py): input-grounded (summarise, extract, rewrite, copy, fix given
code) and open chat, in the bundled model's chat template, greedy, stopping at its end-of-turn token.

  acceptance  local workers (N = `--workers`, TLS on loopback), one job: every prompt of both
              workloads without speculation, then with n-gram drafts for each K in `--k` (the
              last is the one the RTT sweep and the draft model use), and, with
              `--draft-layers L`, with an early-exit draft model (the target's first L layers, its
              final norm and head: `DenseModel(src, n_layers=L)` on the client). Per workload: mean
              acceptance length (vLLM's 1 + accepted / drafts), sharded forwards per generated token
              (steps / tokens, the prefill's step and token included), and sequential exchanges per
              generated token (forwards × exchanges per forward). Every speculative run's tokens are
              compared with the plain run's (greedy: they must be equal).
  exchanges   per forward, counted, not assumed: the worker comm layer's collective counter
              (bench/ops.stats) over that job's forwards, plus the client's ingress and egress (one
              message each way, before the first collective and after the last); and the same for
              a short Megatron-style job (`--variant megatron` workers). Printed next to the plan's
              own count (plan.collectives_per_layer).
  rtt         per RTT, fresh network namespaces and workers (bench/rtt.py's hosts, keys, topology and
              delay; needs root, iproute2, iptables and NetfilterQueue where the kernel has no
              netem), the round trip each job really got measured first (TCP ping, client's host to
              worker 1's). In each job, for each workload: one session on a prompt without and with
              speculation, then `--batch` sessions together without and with it, the order of the
              pair alternating; `--repeats` sweeps over every RTT. Speed ratios are medians of the
              per-pair ratios (the two runs of a pair ran back to back in one job), with a
              distribution-free 95 % confidence interval for that median (`median_ci`) once a cell
              has 6 pairs or more. `--singles` prompts and `--batch-pairs` batch pairs per job and
              workload; `--workloads` narrows the sweep to one workload. `--method suffix` sweeps
              the suffix drafter instead of n-grams (K its cap; without its global cache, since
              the pairs repeat prompts); `--start-repeat R` numbers the sweeps from R, so a second
              run continues a first one's prompts with the pairs' order reversed.

Decode tokens/s is generate's (tokens after the first / the time after the first) for one session,
and bench/batch.py's for a batch (every session's tokens after its first / the time from the last
first token to the last token). Writes one JSON report (`--out`) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

WORKLOAD_NAMES = ("input_grounded", "open_chat")
CLIENT_EXCHANGES = 2  # per forward: the client's ingress to every worker, and the workers' egress back


# ---- the pure arithmetic (tests/test_bench_speculative.py) ----


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def per_token(steps: int, tokens: int, exchanges_per_forward: int) -> dict:
    """Sharded forwards and sequential exchanges per generated token over a set of sessions: every
    forward (prefill included) costs `exchanges_per_forward` exchanges one after another, whatever its
    width, and emits at least one token."""
    if tokens < 1:
        raise ValueError("no tokens generated")
    fwd = steps / tokens
    return {"forwards_per_token": round(fwd, 4), "exchanges_per_token": round(fwd * exchanges_per_forward, 2)}


def acceptance(num_drafts: int, num_draft_tokens: int, num_accepted: int) -> dict:
    """vLLM's counters summed over sessions, and its mean acceptance length (1 + accepted / drafts)."""
    return {
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "mean_acceptance_length": round(1 + num_accepted / num_drafts, 4) if num_drafts else None,
        "acceptance_rate": round(num_accepted / num_draft_tokens, 4) if num_draft_tokens else None,
    }


def exchanges_per_forward(collectives: int, forwards: int) -> float:
    """Sequential exchanges per sharded forward from a worker's counted collectives over `forwards`
    forwards (each collective is one exchange among workers: every verb sends before it receives)
    plus the client's ingress and egress."""
    if forwards < 1:
        raise ValueError("no forwards counted")
    return collectives / forwards + CLIENT_EXCHANGES


def paired_ratios(pairs: list[tuple[float, float]]) -> dict | None:
    """(speculative, plain) tokens/s of runs that ran back to back: the per-pair ratios' median and
    range, and a 95 % confidence interval for the median ratio (`median_ci`)."""
    ratios = [s / p for s, p in pairs if p > 0]
    out = summary(ratios)
    if out is not None:
        out["ci95"] = median_ci(ratios)
    return out


def median_ci(values: list[float], confidence: float = 0.95) -> list[float] | None:
    """A distribution-free confidence interval for the median (order statistics, the sign test's
    binomial): [x_(j), x_(n+1-j)] with the largest j whose two tails P(Bin(n, 1/2) < j) each stay
    within (1 - confidence) / 2. It assumes only that the pairs are independent draws of one ratio;
    with fewer than 6 values no such interval reaches 95 % (None)."""
    n, tail = len(values), (1 - confidence) / 2
    xs, j, below = sorted(values), 0, 0.0
    while True:
        below += math.comb(n, j) / 2**n  # P(Bin(n, 1/2) <= j)
        if below > tail:
            break
        j += 1
    if j == 0:
        return None
    return [round(xs[j - 1], 4), round(xs[n - j], 4)]


# ---- the acceptance job: local workers ----


def dense_greedy(target, prompt: Sequence[int], max_new: int, eos_ids) -> list[int]:
    """The dense twin's greedy continuation of `prompt`: at most `max_new` tokens, ending after an
    end-of-turn token (kept, as generate keeps it). The reference outputs the drafters are replayed
    against (here and bench/replay.py)."""
    import torch

    cache = target.new_cache(len(prompt) + max_new + 1)
    with torch.no_grad():
        logits = target.forward(list(prompt), 0, cache)[-1]
        gen: list[int] = []
        while True:
            gen.append(int(torch.argmax(logits)))
            if gen[-1] in eos_ids or len(gen) >= max_new:
                return gen
            logits = target.forward(gen[-1:], len(prompt) + len(gen) - 1, cache)[-1]


def tokenizer_for(path):
    from ..weights.tokenizer import Tokenizer, load_tokenizer

    return Tokenizer.from_gguf(path) if Path(path).is_file() else load_tokenizer(path)


def _spec(k: int, method: str = "ngram"):
    """The sweep's config. Suffix without its global cache: the pairs run the same prompts again (the
    batch repeats the single sessions' prompts), and a cache would draft from their earlier outputs."""
    from ..generation.speculative_config import SpeculativeConfig

    if method == "suffix":
        return SpeculativeConfig(method=method, num_speculative_tokens=k, suffix_cache_tokens=0)
    return SpeculativeConfig(method=method, num_speculative_tokens=k)


def measure_acceptance(
    model: str,
    n: int,
    max_new: int,
    ks: list[int],
    draft_layers: int | None,
    log=lambda s: None,
    limit: int | None = None,
) -> dict:
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..generation.speculative import Speculator
    from ..generation.speculative_config import SpeculativeConfig
    from ..structural.client import Engine, EngineOptions
    from . import workloads
    from .ops import stats

    tok = tokenizer_for(model)
    loads = {name: workloads.load(name, tok, limit) for name in WORKLOAD_NAMES}
    longest = max(len(p) for w in loads.values() for p in w.prompts)
    opts = EngineOptions(n_workers=n, comm_backend="tls", log=lambda line: None)
    opts.context = longest + max_new + max(ks) + 8
    greedy = SamplingParams()
    out: dict = {"max_new_tokens": max_new, "workers": n, "workloads": {}}
    with Engine(model, opts) as eng:
        draft = None
        if draft_layers:
            from ..model.dense import DenseModel

            draft = DenseModel(eng.src, n_layers=draft_layers, max_seq=1)
        variants: list[tuple[str, SpeculativeConfig]] = [(f"ngram_k{k}", _spec(k)) for k in ks]
        if draft is not None:
            cfg = SpeculativeConfig(method="draft_model", num_speculative_tokens=ks[-1], draft_model=str(model))
            variants.append((f"early_exit_{draft_layers}_layers_k{ks[-1]}", cfg))
        before = stats(eng)
        forwards = 0
        for name, w in loads.items():
            plain: list = []
            for i, p in enumerate(w.prompts):
                r = generate(eng, list(p), max_new_tokens=max_new, sampling=greedy, stop_ids=tok.eos_ids)
                plain.append(r)
                forwards += r.steps
                log(f"accept {name} {i}: plain {len(r.token_ids)} tokens in {r.steps} steps")
            row: dict = {
                "prompts": len(w.prompts),
                "prompt_tokens": [len(p) for p in w.prompts],
                "plain": {"tokens": sum(len(r.token_ids) for r in plain), "steps": sum(r.steps for r in plain)},
            }
            for vname, cfg in variants:
                tot = [0, 0, 0]
                steps = tokens = 0
                same = True
                for i, p in enumerate(w.prompts):
                    sp = Speculator(cfg, eng.config.vocab, eng.context, draft_model=draft)
                    r = generate(
                        eng, list(p), max_new_tokens=max_new, sampling=greedy, stop_ids=tok.eos_ids, speculator=sp
                    )
                    forwards += r.steps
                    s = r.speculative or {}
                    tot[0] += s.get("num_drafts", 0)
                    tot[1] += s.get("num_draft_tokens", 0)
                    tot[2] += s.get("num_accepted_tokens", 0)
                    steps, tokens = steps + r.steps, tokens + len(r.token_ids)
                    same &= r.token_ids == plain[i].token_ids
                    log(f"accept {name} {i}: {vname} {len(r.token_ids)} tokens in {r.steps} steps, same {same}")
                row[vname] = {"tokens": tokens, "steps": steps, "same_tokens_as_plain": same, **acceptance(*tot)}
            out["workloads"][name] = row
        after = stats(eng)
        counted = [a["collectives"] - b["collectives"] for a, b in zip(after, before, strict=True)]
        out["counted"] = {
            "forwards": forwards,
            "collectives_per_worker": counted,
            "exchanges_per_forward": exchanges_per_forward(max(counted), forwards),
            "plan_collectives_per_layer": [eng.plan.collectives_per_layer(w) for w in range(eng.plan.n)],
            "layers": eng.config.n_layers,
        }
    xf = out["counted"]["exchanges_per_forward"]
    for row in out["workloads"].values():
        for v in row.values():
            if isinstance(v, dict) and "steps" in v:
                v.update(per_token(v["steps"], v["tokens"], round(xf)))
    return out


def count_megatron(model: str, n: int, forwards: int = 8) -> dict:
    """Exchanges per forward of the Megatron-style baseline, counted the same way on a short job."""
    from ..structural.client import Engine, EngineOptions
    from .ops import stats

    opts = EngineOptions(
        n_workers=n, comm_backend="tls", log=lambda line: None, extra_worker_args=("--variant", "megatron")
    )
    opts.context = 64
    with Engine(model, opts) as eng:
        eng.reset()
        before = stats(eng)
        eng.forward([1, 2, 3])
        for t in range(forwards - 1):
            eng.forward([4 + t])
        after = stats(eng)
    counted = [a["collectives"] - b["collectives"] for a, b in zip(after, before, strict=True)]
    return {
        "forwards": forwards,
        "collectives_per_worker": counted,
        "exchanges_per_forward": exchanges_per_forward(max(counted), forwards),
    }


def replay_draft(model: str, layers: list[int], k: int, max_new: int, limit: int | None, log=lambda s: None) -> dict:
    """An early-exit draft model's acceptance without workers: the target's greedy tokens from its
    dense twin (model/dense.py, the same weights in one process), then the loop's drafter, draft
    length and greedy rule replayed over them (speculative.DraftModelDrafter, DraftLength; a greedy
    verification accepts the drafts that equal the target's next tokens and adds the target's own).
    What the sharded loop would count on the same tokens; no step is timed."""
    from ..generation.speculative import DraftLength, DraftModelDrafter, SpecStats
    from ..model.dense import DenseModel
    from ..structural.plan import make_plan
    from ..weights.loader import open_weights
    from . import workloads

    tok = tokenizer_for(model)
    src = open_weights(model)
    target = DenseModel(src, max_seq=1)
    drafts = {n: DenseModel(src, n_layers=n, max_seq=1) for n in layers}
    exchanges_n2 = make_plan(src.config, 2).exchanges_per_forward(0)  # the sharded loop's at N = 2
    out: dict = {"k": k, "max_new_tokens": max_new, "workloads": {}}
    for name in WORKLOAD_NAMES:
        w = workloads.load(name, tok, limit)
        refs = []
        for p in w.prompts:
            refs.append(dense_greedy(target, p, max_new, tok.eos_ids))
        row: dict = {"prompts": len(w.prompts), "tokens": sum(len(g) for g in refs)}
        for n, dm in drafts.items():
            stats, steps = SpecStats("draft_model"), 0
            for p, ref in zip(w.prompts, refs, strict=True):
                drafter, length = DraftModelDrafter(dm, len(p) + max_new + k + 2), DraftLength(k)
                out_ids, steps = ref[:1], steps + 1  # the prefill's step gives the first token
                while len(out_ids) < len(ref):
                    want = min(length.next(), max_new - len(out_ids) - 1)
                    proposed = drafter.propose(list(p) + out_ids, want) if want >= 1 else []
                    acc = 0
                    while (
                        acc < len(proposed)
                        and len(out_ids) + acc < len(ref)
                        and proposed[acc] == ref[len(out_ids) + acc]
                    ):
                        acc += 1
                    if proposed:
                        length.update(len(proposed), acc)
                        stats.add(len(proposed), acc)
                    out_ids = ref[: len(out_ids) + acc + 1]
                    steps += 1
            d = stats.as_dict()
            row[f"early_exit_{n}_layers"] = {
                "steps": steps,
                **acceptance(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]),
                **per_token(steps, row["tokens"], exchanges_n2),
            }
            log(f"replay {name} early exit {n}: {row[f'early_exit_{n}_layers']}")
        out["workloads"][name] = row
    return out


# ---- the RTT sweep: namespaces, one job per (RTT, repeat) ----


def rtt_job(d: Path, model: str, n: int, rtt_ms: float, delay: str, timeout_s: float) -> dict:
    from .netns import Hosts
    from .rtt import BASE, tcp_rtt_ms, worker_argv

    addrs = [f"{BASE}.{i + 1}" for i in range(n + 1)]
    topo = d / "topology.toml"
    with Hosts(addrs, one_way_ms=rtt_ms / 2, delay=delay if (rtt_ms > 0 or delay == "nfqueue") else None) as hosts:
        measured = tcp_rtt_ms(hosts, addrs[0], addrs[1])
        workers = [
            hosts.popen(
                addrs[i],
                worker_argv(topo, d / f"worker{i}.key"),
            )
            for i in range(1, n + 1)
        ]
        client = hosts.popen(
            addrs[0],
            [sys.executable, "-m", "fusion_compute.bench.speculative", "client", str(d)],
        )
        try:
            out, err = client.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            client.kill()
            client.communicate()
            raise RuntimeError(f"RTT {rtt_ms} ms: no answer within {timeout_s:.0f} s") from None
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
        if client.returncode != 0:
            raise RuntimeError(f"RTT {rtt_ms} ms: {err.strip().splitlines()[-1] if err.strip() else 'failed'}")
        j = json.loads(out.strip().splitlines()[-1])
        measured_after = tcp_rtt_ms(hosts, addrs[0], addrs[1])
    return {"rtt_ms": rtt_ms, "measured_rtt_ms": measured, "measured_rtt_after_ms": measured_after, **j}


def client(d: Path) -> int:
    """The client job, in the client's host: reads `d`/job.json (prompts, tokens, batch, which prompt
    and which order), runs the pairs, prints one JSON line."""
    from ..generation.batching import Sequence, run_batch
    from ..generation.generate import generate
    from ..generation.sampling_params import SamplingParams
    from ..generation.speculative import Speculator
    from ..structural.client import Engine
    from .rtt import topology_job

    job = json.loads((d / "job.json").read_text())
    # a batch of 8 with 17 columns each at 5 ms moves large messages through the delay tool's one
    # Python process per host: a step can take seconds, which is not a lost worker
    topo, opts = topology_job(str(d / "topology.toml"), str(d / "client.key"), timeout_s=300, liveness_s=60)
    opts.context = job["context"]
    greedy = SamplingParams()
    stop, m, batch = job["stop_ids"], job["tokens"], job["batch"]
    cfg = _spec(job["k"], job.get("method", "ngram"))
    results: dict = {}
    with Engine(topo.model_for(0), opts) as eng:
        # One speculator for the job, as `fusion serve` keeps one: what it learns of a wider step's
        # cost (speculative.StepCost) carries from run to run, as from request to request there.
        shared = Speculator(cfg, eng.config.vocab, eng.context)

        def spec() -> Speculator:
            return shared

        for name in job["prompts"]:
            prompts = [list(p) for p in job["prompts"][name]]
            row: dict = {"single": [], "batch": []}
            for i in job["single_prompts"]:
                p = prompts[i % len(prompts)]
                runs = {}
                for on in (False, True) if job["spec_first"] is False else (True, False):
                    r = generate(
                        eng, p, max_new_tokens=m, sampling=greedy, stop_ids=stop, speculator=spec() if on else None
                    )
                    runs[on] = r
                row["single"].append(
                    {
                        "prompt": i % len(prompts),
                        "plain_tokens_per_s": runs[False].decode_tokens_per_s,
                        "spec_tokens_per_s": runs[True].decode_tokens_per_s,
                        "plain_steps": runs[False].steps,
                        "spec_steps": runs[True].steps,
                        "tokens": len(runs[False].token_ids),
                        "speculative": runs[True].speculative,
                        "same_tokens": runs[True].token_ids == runs[False].token_ids,
                    }
                )
            for b in range(job.get("batch_pairs", 1) if batch > 1 else 0):
                bruns = {}
                spec_first = job["spec_first"] != (b % 2 == 1)  # the order alternates within a job too
                for on in (True, False) if spec_first else (False, True):
                    seqs = [Sequence(prompts[i % len(prompts)], m, greedy, stop) for i in range(batch)]
                    res = run_batch(eng, seqs, batch, speculator=spec() if on else None)
                    t_first, t_end = max(s.t_first for s in seqs), max(s.t_end for s in seqs)
                    bruns[on] = (
                        sum(len(r.token_ids) - 1 for r in res) / (t_end - t_first),
                        [r.token_ids for r in res],
                        sum(s.steps for s in seqs),
                    )
                row["batch"].append(
                    {
                        "plain_tokens_per_s": bruns[False][0],
                        "spec_tokens_per_s": bruns[True][0],
                        "tokens": sum(len(t) for t in bruns[False][1]),
                        "same_tokens": bruns[True][1] == bruns[False][1],
                    }
                )
            results[name] = row
    print(json.dumps({"workloads": results}))
    return 0


def rtt_sweep(
    model: str,
    n: int,
    rtts: list[float],
    tokens: int,
    batch: int,
    repeats: int,
    k: int,
    singles: int,
    delay: str,
    timeout_s: float,
    log=lambda s: None,
    on_job=lambda runs: None,
    limit: int | None = None,
    names: tuple[str, ...] = WORKLOAD_NAMES,
    batch_pairs: int = 1,
    method: str = "ngram",
    start_repeat: int = 0,
) -> list[dict]:
    from . import workloads
    from .rtt import keys, topology

    tok = tokenizer_for(model)
    loads = {name: workloads.load(name, tok, limit) for name in names}
    longest = max(len(p) for w in loads.values() for p in w.prompts)
    d = Path(tempfile.mkdtemp(prefix="fc-spec-"))
    every = []
    try:
        from .rtt import BASE

        lines = keys(d, n)
        topology(d, model, lines, [f"{BASE}.{i + 1}" for i in range(n + 1)])
        for rep in range(start_repeat, start_repeat + repeats):
            for rtt in rtts:
                job = {
                    "prompts": {name: [list(p) for p in w.prompts] for name, w in loads.items()},
                    "stop_ids": list(tok.eos_ids),
                    "tokens": tokens,
                    "batch": batch,
                    "batch_pairs": batch_pairs,
                    "k": k,
                    "method": method,
                    "context": longest + tokens + k + 8,
                    # each repeat its own prompts for the single session: pairs over several prompts
                    "single_prompts": [rep * singles + j for j in range(singles)],
                    "spec_first": rep % 2 == 1,  # the pair's order alternates between sweeps
                }
                (d / "job.json").write_text(json.dumps(job))
                t0 = time.perf_counter()
                r = rtt_job(d, model, n, rtt, delay, timeout_s)
                r["wall_s"], r["repeat"], r["load_avg"] = round(time.perf_counter() - t0, 1), rep, os.getloadavg()
                every.append(r)
                log(json.dumps(r))
                on_job(every)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return every


def rtt_table(every: list[dict]) -> list[dict]:
    """Per (RTT, workload, single/batch): medians of the measured RTT and of both speeds, the paired
    ratios, and whether every speculative run's tokens equalled the plain run's."""
    rows = []
    for rtt in dict.fromkeys(r["rtt_ms"] for r in every):
        jobs = [r for r in every if r["rtt_ms"] == rtt]
        measured = [r["measured_rtt_ms"] for r in jobs] + [r["measured_rtt_after_ms"] for r in jobs]
        for name in WORKLOAD_NAMES:
            for mode in ("single", "batch"):
                pairs = [p for r in jobs for p in r["workloads"].get(name, {}).get(mode, [])]
                if not pairs:
                    continue
                rows.append(
                    {
                        "rtt_ms": rtt,
                        "measured_rtt_ms": summary(measured),
                        "workload": name,
                        "mode": mode,
                        "pairs": len(pairs),
                        "plain_tokens_per_s": summary([p["plain_tokens_per_s"] for p in pairs]),
                        "spec_tokens_per_s": summary([p["spec_tokens_per_s"] for p in pairs]),
                        "ratio": paired_ratios([(p["spec_tokens_per_s"], p["plain_tokens_per_s"]) for p in pairs]),
                        "same_tokens": all(p["same_tokens"] for p in pairs),
                    }
                )
    return rows


# ---- report ----


def render(report: dict) -> str:
    out = []
    acc = report.get("acceptance")
    if acc:
        c = acc["counted"]
        out += [
            f"acceptance: N = {acc['workers']}, up to {acc['max_new_tokens']} new tokens, greedy; exchanges per "
            f"forward counted: fusion {c['exchanges_per_forward']:.2f} (collectives per worker {c['collectives_per_worker']} "
            f"over {c['forwards']} forwards, + {CLIENT_EXCHANGES} client)"
            + (f", megatron-tp {report['megatron']['exchanges_per_forward']:.2f}" if report.get("megatron") else ""),
            "",
            "| workload | drafts | tokens | forwards | mean acceptance length | forwards/token | exchanges/token | same tokens as plain |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, row in acc["workloads"].items():
            for k, v in row.items():
                if not isinstance(v, dict) or "steps" not in v:
                    continue
                mal = v.get("mean_acceptance_length")
                out.append(
                    f"| {name} | {k} | {v['tokens']} | {v['steps']} | {'-' if mal is None else f'{mal:.2f}'} | "
                    f"{v['forwards_per_token']:.3f} | {v['exchanges_per_token']:.1f} | {v.get('same_tokens_as_plain', '-')} |"
                )
    rows = report.get("rtt_table")
    if rows:
        out += [
            "",
            "| RTT added (ms) | RTT measured (ms, median (min..max)) | workload | sessions | pairs | plain tok/s | speculative tok/s | ratio per pair, median (min..max) | median's 95 % CI | same tokens |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            m, q = r["measured_rtt_ms"], r["ratio"]
            out.append(
                f"| {r['rtt_ms']:g} | {m['median']:.2f} ({m['min']:.2f}..{m['max']:.2f}) | {r['workload']} | "
                f"{'1' if r['mode'] == 'single' else report['batch']} | {r['pairs']} | "
                f"{r['plain_tokens_per_s']['median']:.2f} | {r['spec_tokens_per_s']['median']:.2f} | "
                f"**{q['median']:.2f}×** ({q['min']:.2f}..{q['max']:.2f}) | "
                f"{'-' if not q.get('ci95') else '{:.2f}..{:.2f}'.format(*q['ci95'])} | {r['same_tokens']} |"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:
        return client(Path(argv[1]))
    if argv[:1] == ["replay-draft"]:  # replay-draft LAYERS K MAX_NEW LIMIT OUT
        from ..weights.loader import resolve_model_path

        layers, k, max_new, limit, dest = argv[1:6]
        r = replay_draft(
            str(resolve_model_path(None)),
            [int(x) for x in layers.split(",")],
            int(k),
            int(max_new),
            int(limit),
            lambda s: print(s, file=sys.stderr, flush=True),
        )
        Path(dest).write_text(json.dumps(r, indent=1))
        return 0
    from ..weights.loader import resolve_model_path
    from .netns import available

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.speculative", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128, help="per session in the acceptance job")
    p.add_argument("--k", default="4,16", help="n-gram K values in the acceptance job; the sweep uses the last")
    p.add_argument("--draft-layers", type=int, help="also an early-exit draft model of this many layers")
    p.add_argument("--rtt", default="0,1,5", help="round trips to add, ms ('' skips the sweep)")
    p.add_argument("--rtt-tokens", type=int, default=32, help="new tokens per session in the sweep")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--singles", type=int, default=2, help="single-session prompts per workload per job")
    p.add_argument(
        "--batch-pairs", type=int, default=1, help="batch pairs (plain and speculative) per workload per job"
    )
    p.add_argument(
        "--workloads", default=",".join(WORKLOAD_NAMES), help="which workloads the RTT sweep runs (comma-separated)"
    )
    p.add_argument("--repeats", type=int, default=2, help="sweeps over every RTT")
    p.add_argument(
        "--start-repeat",
        type=int,
        default=0,
        help="the first sweep's index: a later run continues an earlier one's (its prompts, the pairs' order)",
    )
    p.add_argument(
        "--method",
        choices=("ngram", "suffix"),
        default="ngram",
        help="the RTT sweep's drafter (the acceptance job runs n-gram drafts); suffix: K is its cap",
    )
    p.add_argument("--delay", choices=("netem", "nfqueue"), default="nfqueue")
    p.add_argument("--skip-acceptance", action="store_true")
    p.add_argument("--limit", type=int, help="only the first N prompts of each workload (a smoke test)")
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on one RTT job, seconds")
    p.add_argument("--out", default="docs/bench/speculative.json")
    a = p.parse_args(argv)
    try:
        ks = [int(x) for x in a.k.split(",") if x]
        rtts = [float(x) for x in a.rtt.split(",") if x]
    except ValueError:
        print("bench.speculative: --k and --rtt take comma-separated numbers", file=sys.stderr)
        return 2
    if a.workers < 2 or not ks or min(ks) < 1 or a.max_new_tokens < 2 or a.repeats < 1 or a.batch < 1:
        print("bench.speculative: needs --workers >= 2, K >= 1, --max-new-tokens >= 2, --repeats, --batch >= 1")
        return 2
    names = tuple(x for x in a.workloads.split(",") if x)
    if not names or set(names) - set(WORKLOAD_NAMES) or a.batch_pairs < 0 or a.singles < 0 or a.start_repeat < 0:
        print(
            f"bench.speculative: --workloads takes {', '.join(WORKLOAD_NAMES)}; --batch-pairs and --singles >= 0",
            file=sys.stderr,
        )
        return 2
    if rtts:
        why = available(netem=True, delay=a.delay)
        if why is not None:
            print(f"bench.speculative: cannot run the RTT sweep here: {why}", file=sys.stderr)
            return 2
    model = str(resolve_model_path(a.model))
    log = lambda s: print(s, file=sys.stderr, flush=True)
    report: dict = {
        "model": model,
        "workers": a.workers,
        "batch": a.batch,
        "cores": os.cpu_count(),
        "load_avg_start": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if a.skip_acceptance and out.is_file():  # an earlier run's acceptance job, kept (and said so)
        prev = json.loads(out.read_text())
        for k in ("acceptance", "megatron"):
            if k in prev:
                report[k] = prev[k]
        report["acceptance_started"] = prev.get("started")
    if not a.skip_acceptance:
        report["acceptance"] = measure_acceptance(model, a.workers, a.max_new_tokens, ks, a.draft_layers, log, a.limit)
        report["megatron"] = count_megatron(model, a.workers)
        out.write_text(json.dumps(report, indent=1))  # what is measured so far survives a later failure
    if rtts:
        report |= {"rtt_tokens": a.rtt_tokens, "repeats": a.repeats, "delay": a.delay, "k": ks[-1], "method": a.method}
        every: list[dict] = []
        try:
            every = rtt_sweep(
                model,
                a.workers,
                rtts,
                a.rtt_tokens,
                a.batch,
                a.repeats,
                ks[-1],
                a.singles,
                a.delay,
                a.timeout,
                log=log,
                limit=a.limit,
                on_job=lambda runs: out.write_text(json.dumps(report | {"rtt_runs": runs}, indent=1)),
                names=names,
                batch_pairs=a.batch_pairs,
                method=a.method,
                start_repeat=a.start_repeat,
            )
        finally:
            report["rtt_runs"] = every
            report["rtt_table"] = rtt_table(every) if every else []
    report["load_avg_end"] = os.getloadavg()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(report, indent=1))
    print(render(report))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
