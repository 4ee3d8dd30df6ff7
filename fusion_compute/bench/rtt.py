"""The latency model: decode speed against the network's round-trip time, measured.

    sudo python -m fusion_compute.bench.rtt [--rtt 0,0.2,1,5] [--workers 2] [--tokens 16] [--batch 8]
                                            [--delay auto|netem|nfqueue] [--json] [--out DIR]

Every participant runs in a network namespace of its own on one bridge (bench/netns.py), with a
delay of RTT/2 on every host's interface, so any two hosts are one RTT apart, client and workers
alike: `tc netem` where the kernel has it, else a netfilter queue that holds each packet
(bench/nfq_delay.py; it costs CPU per packet and its timer overshoots, so it is used at RTT 0 too
and the round trip is measured, never assumed: a 1-byte TCP ping-pong from the client's host to
worker 1's before each run). Per RTT, two systems in fresh processes over the default links (TLS
1.3, pinned keys: a topology file and one key per host): fusion (sharded residual, 4
reduce-scatters per layer) and Megatron-style TP (`fusion worker --variant megatron`: replicated
residual, 2 all-reduces per layer). Each job runs bench/batch.py's workload once: one session
alone, then `--batch` sessions decoding together (greedy, random prompt ids, `--tokens` each).

The model it checks: a decode step is `rounds` sequential network exchanges plus compute, so
tokens/s ≈ batch / (rounds × t_round + compute), with `compute` the step time at the smallest
measured RTT and t_round what one exchange adds as the RTT grows. The report fits t_round per run
(t_round = (step time - compute) / rounds) and prints it as a fraction of the added round trip (an
exchange among workers that all send before they receive should cost about half an RTT, one
one-way delay; the client's ingress and egress a full one), next to the model's tokens/s with
t_round = half the added RTT. Needs root and `ip` (and `tc` with netem, or iptables and
NetfilterQueue); a run takes a few minutes on the bundled model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .netns import DELAYS, Hosts, available, pipe

BASE = "10.77.0"  # the namespaces' own /24, on their own bridge: never the machine's network


def fusion_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "fusion_compute", *args]


def keys(d: Path, n: int) -> list[str]:
    """Key files client.key, worker1.key, ... in `d`; returns their public lines."""
    lines = []
    for name in ["client"] + [f"worker{i}" for i in range(1, n + 1)]:
        r = subprocess.run(
            fusion_argv("keys", "new", str(d / f"{name}.key")), capture_output=True, text=True, check=True
        )
        lines.append(r.stdout.strip().splitlines()[-1])
    return lines


def topology(d: Path, model: str, lines: list[str], addrs: list[str], port: int = 29500) -> Path:
    text = [f'model = "{model}"', "", "[client]", f'address = "{addrs[0]}:{port}"', f'key = "{lines[0]}"']
    for addr, line in zip(addrs[1:], lines[1:], strict=True):
        text += ["", "[[worker]]", f'address = "{addr}"', f'key = "{line}"']
    path = d / "topology.toml"
    path.write_text("\n".join(text) + "\n")
    return path


def worker_argv(topo: Path, key: Path, *extra: str) -> list[str]:
    """A benchmark worker: `fusion worker` on the topology, with its key, one thread (client and
    workers share the machine's cores)."""
    return fusion_argv("worker", "--topology", str(topo), "--key", str(key), "--threads", "1", *extra)


def one(
    model: str,
    n: int,
    rtt_ms: float,
    variant: str,
    prompt_len: int,
    tokens: int,
    batch: int,
    d: Path,
    timeout_s: float,
    delay: str,
    tuned: bool = False,
) -> dict:
    """One fresh job at one RTT: workers in their hosts, the client job (`client` below) in its own;
    the round trip the client really sees to worker 1 is measured first (TCP ping)."""
    addrs = [f"{BASE}.{i + 1}" for i in range(n + 1)]
    topo = d / "topology.toml"
    delayed = delay if (rtt_ms > 0 or delay == "nfqueue") else None
    with Hosts(addrs, one_way_ms=rtt_ms / 2, delay=delayed, tuned=tuned) as hosts:
        measured = tcp_rtt_ms(hosts, addrs[0], addrs[1])
        workers = [
            hosts.popen(addrs[i], worker_argv(topo, d / f"worker{i}.key", "--variant", variant))
            for i in range(1, n + 1)
        ]
        client = hosts.popen(
            addrs[0],
            [
                sys.executable,
                "-m",
                "fusion_compute.bench.rtt",
                "client",
                str(topo),
                str(d / "client.key"),
                str(prompt_len),
                str(tokens),
                str(batch),
            ],
        )
        try:
            out, err = client.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            client.kill()
            out, err = client.communicate()
            raise RuntimeError(f"RTT {rtt_ms} ms, {variant}: no answer within {timeout_s:.0f} s") from None
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
        counters = {addr: hosts.tcp_counters(addr) for addr in addrs}
        if client.returncode != 0:
            raise RuntimeError(
                f"RTT {rtt_ms} ms, {variant}: {err.strip().splitlines()[-1] if err.strip() else 'failed'}"
            )
        j = json.loads(out.strip().splitlines()[-1])
    return {
        "rtt_ms": rtt_ms,
        "measured_rtt_ms": measured,
        "variant": variant,
        "workers": n,
        "single_tokens_per_s": j["single_decode_tokens_per_s"]["median"],
        "batch_tokens_per_s": j["batch_decode_tokens_per_s"]["median"] if batch > 1 else None,
        "same_tokens_as_alone": j["same_tokens_as_alone"],
        "token_ids": j["tokens"],
        "tcp_counters": counters,  # per host, the whole job: retransmits, loss probes, timeouts
    }


def topology_job(topo_path: str, key_path: str, **kw):
    """(topology, EngineOptions) of a bench client whose workers a topology file names, signed with
    `key_path`; `kw`: more options (timeout_s, liveness_s). Quiet: the bench prints its own lines."""
    from ..cli.options import load_key
    from ..runtime.topology import Topology
    from ..structural.client import EngineOptions

    topo = Topology.load(topo_path)
    opts = EngineOptions(
        n_workers=topo.n_workers,
        capacities=topo.capacities,
        topology=topo,
        key=load_key(key_path),
        log=lambda line: None,
        **kw,
    )
    return topo, opts


def client(argv: list[str]) -> int:
    """The client job, run in the client's host: one session alone, then `batch` sessions together
    (bench/batch.py's workload, once), on the workers the topology names; prints one JSON line."""
    from .batch import measure

    topo_path, key, prompt_len, tokens, batch = argv
    topo, opts = topology_job(topo_path, key, timeout_s=60)
    r = measure(
        topo.model_for(0), topo.n_workers, "tls", max(1, int(batch)), int(prompt_len), int(tokens), 1, opts=opts
    )
    print(json.dumps(r))
    return 0


ECHO = """
import socket
s = socket.create_server(("0.0.0.0", 29400)); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)): c.sendall(b)
"""
PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 29400), timeout=30); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter(); c.sendall(b"x"); c.recv(64); times.append(time.perf_counter() - t0)
print(round(1000 * statistics.median(times[5:]), 4))
"""


def tcp_rtt_ms(hosts: Hosts, a: str, b: str, count: int = 105) -> float:
    """The round trip host a really sees to host b: median of 1-byte TCP ping-pongs (after 5)."""
    echo = hosts.popen(b, [sys.executable, "-c", ECHO])
    try:
        if pipe(echo.stdout).readline().strip() != "ready":
            raise RuntimeError(f"echo server on {b} did not start: {pipe(echo.stderr).read().strip()}")
        r = subprocess.run(
            ["ip", "netns", "exec", hosts.ns[a], sys.executable, "-c", PING, b, str(count)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            raise RuntimeError(f"TCP ping {a} -> {b}: {r.stderr.strip()}")
        return float(r.stdout.strip())
    finally:
        echo.kill()
        echo.wait()


def rounds_per_token(model: str, n: int, variant: str) -> int:
    """Sequential network exchanges per decode step: the client's ingress and egress, plus the
    collectives among workers per layer (fusion: 4 reduce-scatters; megatron: 2 all-reduces) and, in
    both, the score sums of split KV groups (the most any worker makes: they run one after another);
    with post-norms (Gemma 3) the sharded layer's 2 all-worker Σy² sums (megatron's are local); less
    the scatters the boundary merges (plan.boundary: the sharded mode's layer-0 QKV scatter and, but
    with post-norms, either mode's last down exchange)."""
    from ..structural.plan import make_plan
    from ..weights.loader import open_weights

    config = open_weights(model).config
    if n == 1:
        return 2
    plan = make_plan(config, n)
    if variant == "sharded":
        return 2 + max(plan.collectives_per_forward(w) for w in range(n))
    split = max(plan.collectives_per_layer(w)["score_sum"] for w in range(n))
    return 2 + config.n_layers * (2 + split) - (1 if plan.down_to_client else 0)


def median_run(reps: list[dict]) -> dict:
    """One point from its repeats: the median of each measurement, with its range."""
    out = dict(reps[0])
    for k in ("measured_rtt_ms", "single_tokens_per_s", "batch_tokens_per_s"):
        vals = [r[k] for r in reps if r[k] is not None]
        if vals:
            out[k] = statistics.median(vals)
            out[k + "_range"] = [min(vals), max(vals)]
    out["same_tokens_as_alone"] = all(r["same_tokens_as_alone"] for r in reps)
    return out


def fit(runs: list[dict], rounds: int, key: str, per_step: int) -> list[dict]:
    """The model against the measurements of one system and batch size: `compute` = the step time at
    the smallest RTT measured, t_round = (step time - compute) / rounds, as a fraction of the extra
    round trip (the measured RTT minus the baseline's), and the model's tokens/s with t_round = half
    the extra RTT."""
    base = min(runs, key=lambda r: r["measured_rtt_ms"])
    compute = per_step / base[key]
    rows = []
    for r in runs:
        step = per_step / r[key]
        extra = r["measured_rtt_ms"] - base["measured_rtt_ms"]
        row = {
            "rtt_ms": r["rtt_ms"],
            "measured_rtt_ms": r["measured_rtt_ms"],
            "tokens_per_s": round(r[key], 3),
            "range": r.get(key + "_range"),
            "step_ms": round(1000 * step, 2),
        }
        if extra > 0.01:
            t_round = (step - compute) / rounds
            row["t_round_over_extra_rtt"] = round(1000 * t_round / extra, 3)
            row["model_tokens_per_s"] = round(per_step / (compute + rounds * extra / 2000), 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:
        return client(argv[1:])
    from ..weights.loader import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.rtt", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rtt", default="0,0.2,1,5", help="round-trip times to add, ms (comma-separated)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per session")
    p.add_argument("--prompt", type=int, default=16, help="random prompt tokens")
    p.add_argument("--batch", type=int, default=8, help="sessions decoding together in the batched run (1: none)")
    p.add_argument(
        "--delay",
        choices=("auto", *DELAYS),
        default="auto",
        help="how the delay is made: netem, or nfqueue where the kernel has no netem (auto: netem if "
        "it can be made here)",
    )
    p.add_argument(
        "--systems",
        default="fusion,megatron-tp",
        help="which to run: fusion, megatron-tp or both (default both, comma-separated)",
    )
    p.add_argument("--repeats", type=int, default=1, help="sweeps over every point; the table has medians")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on one run, seconds")
    p.add_argument(
        "--tuned", action="store_true", help="hosts with the deployment settings of docs/performance.md (netns.TUNED_*)"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--out", default="out/bench-rtt", help="directory for rtt.json and its plot, rtt.png (default out/bench-rtt)"
    )
    a = p.parse_args(argv)
    try:
        rtts = [float(x) for x in a.rtt.split(",")]
    except ValueError:
        print(f"bench.rtt: --rtt expects comma-separated milliseconds, got {a.rtt!r}", file=sys.stderr)
        return 2
    if a.workers < 2 or a.tokens < 2 or a.batch < 1 or a.repeats < 1 or any(r < 0 for r in rtts):
        print(
            "bench.rtt: needs --workers >= 2, --tokens >= 2, --batch >= 1, --repeats >= 1 and RTTs >= 0",
            file=sys.stderr,
        )
        return 2
    variants = [{"fusion": "sharded", "megatron-tp": "megatron"}.get(x.strip(), "") for x in a.systems.split(",")]
    if not all(variants):
        print(f"bench.rtt: --systems takes fusion and/or megatron-tp, got {a.systems!r}", file=sys.stderr)
        return 2
    delay = a.delay
    if delay == "auto":
        delay = "netem" if available(netem=True, delay="netem") is None else "nfqueue"
    why = available(netem=any(r > 0 for r in rtts) or delay == "nfqueue", delay=delay)
    if why is not None:
        print(f"bench.rtt: cannot run here: {why}", file=sys.stderr)
        return 2
    model = str(resolve_model_path(a.model))
    d = Path(tempfile.mkdtemp(prefix="fc-rtt-"))
    try:
        lines = keys(d, a.workers)
        topology(d, model, lines, [f"{BASE}.{i + 1}" for i in range(a.workers + 1)])
        every = []
        for rep in range(a.repeats):  # the whole sweep again: drift on a shared machine hits every point alike
            for rtt in rtts:
                for variant in variants:
                    t0 = time.perf_counter()
                    r = one(model, a.workers, rtt, variant, a.prompt, a.tokens, a.batch, d, a.timeout, delay, a.tuned)
                    r["wall_s"], r["repeat"] = round(time.perf_counter() - t0, 2), rep
                    every.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), file=sys.stderr)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    runs = [
        median_run([r for r in every if (r["rtt_ms"], r["variant"]) == key])
        for key in dict.fromkeys((r["rtt_ms"], r["variant"]) for r in every)
    ]
    table = []
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        rounds = rounds_per_token(model, a.workers, variant)
        system = "fusion" if variant == "sharded" else "megatron-tp"
        for b, key in ((1, "single_tokens_per_s"), (a.batch, "batch_tokens_per_s")):
            if b == 1 and key == "batch_tokens_per_s":
                continue
            for row in fit(mine, rounds, key, b):
                table.append({"system": system, "batch": b, "rounds_per_step": rounds, **row})
    summary = {
        "model": model,
        "workers": a.workers,
        "tokens": a.tokens,
        "batch": a.batch,
        "delay": delay,
        "tuned": a.tuned,
        "congestion": _host_congestion(),
        "repeats": a.repeats,
        "same_tokens_everywhere": len({tuple(r["token_ids"]) for r in every}) == 1,
        "batch_same_as_alone": all(r["same_tokens_as_alone"] for r in runs),
        "table": table,
    }
    print(json.dumps(summary) if a.json else render(summary))
    save(summary, Path(a.out))
    return 0


def _host_congestion() -> str:
    """The congestion control the links get (the host's default: a new namespace inherits it)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def save(summary: dict, out: Path) -> None:
    """rtt.json, and rtt.png beside it (tokens/s against the round trip) when matplotlib is there."""
    from .run import plot

    out.mkdir(parents=True, exist_ok=True)
    (out / "rtt.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out, who="bench.rtt")


def render(summary: dict) -> str:
    """The table as Markdown (docs/performance.md keeps one)."""
    out = [
        f"model {summary['model']}, N = {summary['workers']}, {summary['tokens']} new tokens per session, "
        f"delay: {summary['delay']}, medians of {summary['repeats']} sweeps; same tokens everywhere: {summary['same_tokens_everywhere']}, batch = alone: "
        f"{summary['batch_same_as_alone']}",
        "",
        "| system | batch | RTT added (ms) | RTT measured (ms) | decode tok/s (range) | step ms "
        "| t_round / extra RTT | model tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["table"]:
        span = f" ({r['range'][0]:.2f}..{r['range'][1]:.2f})" if r.get("range") else ""
        out.append(
            f"| {r['system']} | {r['batch']} | {r['rtt_ms']:g} | {r['measured_rtt_ms']:.3f} | "
            f"{r['tokens_per_s']:.2f}{span} | {r['step_ms']:.1f} | {r.get('t_round_over_extra_rtt', '')} | "
            f"{r.get('model_tokens_per_s', '')} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
