"""The most that several batches in flight could give, measured: J independent jobs at once.

    sudo python -m fusion_compute.bench.inflight [--rtt 5] [--sessions 16] [--jobs 1,2,4]
                                                 [--tokens 24] [--rounds 2] [--repeats 2] [--out FILE]

Several batches in flight (issue 24 item 2) would keep J independent batch steps going on the same
workers, so that while one batch waits on the network the cores compute another. Before building
that, this measures its ceiling. For each J, `--sessions` sessions are split into J equal batches,
and each batch gets a whole job of its own: its own client, its own N workers, links and copy of the
weights, side by side with the other jobs in the same network namespaces and behind the same delay
(bench/rtt.py's hosts, keys and topology; one topology per job, on its own client port). The jobs
open, warm up (one short batch), wait at a barrier, then each decodes its batch `--rounds` times back
to back (random 16-token prompts, greedy, `--tokens` new tokens per session, no end token). J such
jobs share nothing but the cores and the network, so their aggregate decode tokens/s bounds what J
batches in flight inside one job could reach: those would also share one worker's threads, its
locks and its links. J = 1 is one batch of every session: `fusion serve --max-batch 16` today.

Aggregate decode tokens/s = the sum over jobs of (tokens after each session's first) / (its decode
time), per round; the report also gives the fraction of the union of the jobs' decode windows that
all of them spent decoding at once (1.0: they ran fully side by side), and whether every session's
tokens were the same as in the J = 1 run of the same prompts (they must be). Needs root, iproute2,
and the nfqueue delay's tools, as bench/rtt.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .netns import Hosts, available, pipe
from .rtt import BASE, keys, tcp_rtt_ms, topology, topology_job, worker_argv

PROMPT_LEN = 16


def prompts(sessions: int, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(sessions)]


def client(argv: list[str]) -> int:
    """One job's client, in the client's host: open, warm up, say "ready", wait for "go" on stdin,
    decode its sessions `rounds` times; print one JSON line (times on the wall clock, comparable
    across the jobs of one machine)."""
    from ..generation.batching import Sequence, run_batch
    from ..generation.sampling_params import SamplingParams
    from ..structural.client import Engine

    d, first, count, total, tokens, rounds = Path(argv[0]), *(int(x) for x in argv[1:6])
    # J jobs on 2 cores: a step can take long without a worker being lost
    topo, opts = topology_job(str(d / "topology.toml"), str(d / "client.key"), timeout_s=300, liveness_s=60)
    opts.context = PROMPT_LEN + tokens + 8
    greedy = SamplingParams()
    clock = time.time() - time.perf_counter()  # perf_counter -> wall clock
    with Engine(topo.model_for(0), opts) as eng:
        mine = prompts(total, eng.config.vocab)[first : first + count]
        run_batch(eng, [Sequence(p, 2, greedy) for p in mine], count)  # warm-up: the first step's allocations
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        runs = []
        for _ in range(rounds):
            seqs = [Sequence(p, tokens, greedy) for p in mine]
            res = run_batch(eng, seqs, count)
            t_first, t_end = max(s.t_first for s in seqs), max(s.t_end for s in seqs)
            runs.append(
                {
                    "start": clock + t_first,
                    "end": clock + t_end,
                    "decoded": sum(len(r.token_ids) - 1 for r in res),
                    "tokens": [r.token_ids for r in res],
                }
            )
    print(json.dumps({"runs": runs}))
    return 0


def combine(outs: list[dict], rounds: int) -> list[dict]:
    """Per round, the jobs' aggregate decode tokens/s (each job's tokens after every session's first,
    over its own decode window, summed) and how far they ran side by side: the time all of them were
    decoding at once over the union of their windows (1.0: together throughout, 0: one after another)."""
    per_round = []
    for r in range(rounds):
        runs = [o["runs"][r] for o in outs]
        union = max(x["end"] for x in runs) - min(x["start"] for x in runs)
        common = min(x["end"] for x in runs) - max(x["start"] for x in runs)
        per_round.append(
            {
                "tokens_per_s": sum(x["decoded"] / (x["end"] - x["start"]) for x in runs),
                "side_by_side": max(0.0, common) / union,
            }
        )
    return per_round


def point(model: str, n: int, rtt_ms: float, jobs: int, sessions: int, tokens: int, rounds: int, d: Path) -> dict:
    """One measurement: `jobs` jobs of sessions / jobs sessions each, side by side at one RTT."""
    addrs = [f"{BASE}.{i + 1}" for i in range(n + 1)]
    each = sessions // jobs
    with Hosts(addrs, one_way_ms=rtt_ms / 2, delay="nfqueue") as hosts:
        measured = tcp_rtt_ms(hosts, addrs[0], addrs[1])
        clients = []
        for j in range(jobs):
            dj = d / f"job{j}"
            for i in range(1, n + 1):
                hosts.popen(addrs[i], worker_argv(dj / "topology.toml", dj / f"worker{i}.key"))
            clients.append(
                hosts.popen(
                    addrs[0],
                    [
                        sys.executable,
                        "-m",
                        "fusion_compute.bench.inflight",
                        "client",
                        str(dj),
                        str(j * each),
                        str(each),
                        str(sessions),
                        str(tokens),
                        str(rounds),
                    ],
                    stdin=subprocess.PIPE,
                )
            )
        for c in clients:  # the barrier: every job open and warm before any decodes
            line = pipe(c.stdout).readline().strip()
            if line != "ready":
                raise RuntimeError(f"a job did not start: {pipe(c.stderr).read().strip().splitlines()[-1:]}")
        for c in clients:
            go = pipe(c.stdin)
            go.write("go\n")
            go.flush()
        outs = []
        for c in clients:
            out, err = c.communicate(timeout=1800)
            if c.returncode != 0:
                raise RuntimeError(f"a job failed: {err.strip().splitlines()[-1:] if err.strip() else c.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        measured_after = tcp_rtt_ms(hosts, addrs[0], addrs[1])
    per_round = combine(outs, rounds)
    return {
        "rtt_ms": rtt_ms,
        "measured_rtt_ms": [measured, measured_after],
        "jobs": jobs,
        "sessions_per_job": each,
        "rounds": per_round,
        "tokens_per_s": statistics.median(x["tokens_per_s"] for x in per_round),
        "token_ids": [t for o in outs for t in o["runs"][0]["tokens"]],
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:
        return client(argv[1:])
    from ..weights.loader import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.inflight", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rtt", type=float, default=5.0, help="round trip to add, ms")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--jobs", default="1,2,4", help="J values: the sessions split into J side-by-side jobs")
    p.add_argument("--tokens", type=int, default=24, help="new tokens per session")
    p.add_argument("--rounds", type=int, default=2, help="decodes of each job's batch after the barrier")
    p.add_argument("--repeats", type=int, default=2, help="sweeps over the J values (interleaved)")
    p.add_argument("--out", default="docs/bench/inflight.json")
    a = p.parse_args(argv)
    try:
        js = [int(x) for x in a.jobs.split(",") if x]
    except ValueError:
        js = []
    if not js or any(j < 1 or a.sessions % j for j in js) or a.workers < 2 or a.tokens < 2 or a.rounds < 1:
        print("bench.inflight: --jobs must divide --sessions; needs --workers >= 2, --tokens >= 2", file=sys.stderr)
        return 2
    why = available(netem=True, delay="nfqueue")
    if why is not None:
        print(f"bench.inflight: cannot run here: {why}", file=sys.stderr)
        return 2
    model = str(resolve_model_path(a.model))
    d = Path(tempfile.mkdtemp(prefix="fc-inflight-"))
    every = []
    try:
        addrs = [f"{BASE}.{i + 1}" for i in range(a.workers + 1)]
        for j in range(max(js)):
            (d / f"job{j}").mkdir()
            topology(d / f"job{j}", model, keys(d / f"job{j}", a.workers), addrs, 29500 + j)
        for rep in range(a.repeats):
            for jobs in js if rep % 2 == 0 else js[::-1]:  # interleaved, the order alternating
                r = point(model, a.workers, a.rtt, jobs, a.sessions, a.tokens, a.rounds, d)
                r["repeat"], r["load_avg"] = rep, os.getloadavg()
                every.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    ref = next(r["token_ids"] for r in every if r["jobs"] == min(js))
    rows = []
    for jobs in js:
        mine = [r for r in every if r["jobs"] == jobs]
        vals = [x["tokens_per_s"] for r in mine for x in r["rounds"]]
        rows.append(
            {
                "jobs": jobs,
                "sessions_per_job": a.sessions // jobs,
                "tokens_per_s": round(statistics.median(vals), 2),
                "range": [round(min(vals), 2), round(max(vals), 2)],
                "side_by_side": round(min(x["side_by_side"] for r in mine for x in r["rounds"]), 3),
                "measured_rtt_ms": [
                    min(x for r in mine for x in r["measured_rtt_ms"]),
                    max(x for r in mine for x in r["measured_rtt_ms"]),
                ],
                "same_tokens": all(r["token_ids"] == ref for r in mine),
            }
        )
    report = {
        "model": model,
        "workers": a.workers,
        "rtt_ms": a.rtt,
        "sessions": a.sessions,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "repeats": a.repeats,
        "table": rows,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in every],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    base = rows[0]["tokens_per_s"]
    print(f"{a.sessions} sessions, N = {a.workers}, RTT {a.rtt:g} ms added, {a.tokens} new tokens each")
    print(
        f"| jobs side by side | sessions per job | aggregate decode tok/s (range) | vs J = {js[0]} | side by side "
        "| RTT measured (ms) | same tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['jobs']} | {r['sessions_per_job']} | {r['tokens_per_s']:.2f} ({r['range'][0]:.2f}..{r['range'][1]:.2f}) | "
            f"{r['tokens_per_s'] / base:.2f}× | {r['side_by_side']:.2f} | {r['measured_rtt_ms'][0]:.2f}..{r['measured_rtt_ms'][1]:.2f} | {r['same_tokens']} |"
        )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
