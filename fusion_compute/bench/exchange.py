"""What one exchange costs across a round trip, against its size: the links alone, no model.

    sudo python -m fusion_compute.bench.exchange [--rtt 5] [--sizes 1024,15360,49152] [--repeats 30]
                                                 [--gap-ms 15] [--backend tls|tcp] [--delay auto|netem|nfqueue]
                                                 [--json]

Two hosts (network namespaces on one bridge, bench/netns.py, RTT/2 of delay on each host's
interface) hold one link (links.py: the same framing, TLS records, socket options and writer thread
as a job) and exchange as two workers in a reduce-scatter do: both send an n-byte message, then
both receive the other's, `--repeats` times per size, with `--gap-ms` between exchanges (a decode
step's compute between two collectives; the gap idles, it does not spin, so the delay tool keeps
its CPU). An exchange in which both send before they receive should cost one one-way delay (half
the round trip) plus the transfer; the report gives each size's median as a fraction of the round
trip measured in the same run (1-byte exchanges with the same gaps), and the kernel's own view of
the link after each size (`ss -tin`: congestion window, retransmits) and its TCP counters (`nstat`).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .netns import DELAYS, Hosts, available, pipe
from .rtt import tcp_rtt_ms

A, B = "10.78.0.1", "10.78.0.2"  # the namespaces' own /24: never the machine's network
PORT = 29450


def peer(argv: list[str]) -> int:
    """One side, run in its host: side a listens, side b connects; prints one JSON line of mean costs."""
    from ..comm.identity import Identity
    from ..comm.links import Link, handshake, tls_context

    side, d, sizes_s, repeats_s, gap_s, backend, cc = argv
    me, other = Identity.load(Path(d) / f"{side}.key"), Identity.load(Path(d) / f"{'b' if side == 'a' else 'a'}.key")
    deadline = time.monotonic() + 60
    if side == "a":
        srv = socket.create_server((A, PORT))
        print("ready", flush=True)
        sock, _ = srv.accept()
    else:
        sock = socket.create_connection((A, PORT), timeout=30)
    ctx = tls_context(me, [other.public], server=side == "a") if backend == "tls" else None
    link = Link(sock, handshake(sock, ctx, server=side == "a", deadline=deadline), 1, f"side {side}")
    if cc:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    out: dict = {"congestion": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()}
    for n in [1, *map(int, sizes_s.split(","))]:
        payload, got = memoryview(bytes(n)), memoryview(bytearray(n))
        # The two sides drift: the one that sent later waits less, and on the next exchange the
        # other way round, so one exchange's own time alternates around its cost. What does not
        # drift is the period: (time between two sends) - (the gap slept) is one exchange's cost,
        # and its mean over an even number of exchanges is what a step of many exchanges pays.
        costs, t_prev = [], None
        for _ in range(int(repeats_s)):
            s0 = time.perf_counter()
            time.sleep(float(gap_s))
            t0 = time.perf_counter()
            if t_prev is not None:
                costs.append(t0 - t_prev - (t0 - s0))
            link.send(payload)
            link.recv_into(got, time.monotonic() + 30)
            t_prev = t0
        costs = costs[2 + len(costs) % 2 :]  # the first two (window growth), then an even count
        ss = subprocess.run(["ss", "-tinH", "dst", A if side == "b" else B], capture_output=True, text=True).stdout
        out[n] = {
            "mean_ms": 1000 * statistics.fmean(costs),
            "ms": [round(1000 * t, 2) for t in costs],
            "ss": ss.split(),
        }
    link.close(time.monotonic() + 5)
    print(json.dumps(out), flush=True)
    return 0


def run(
    rtt_ms: float,
    sizes: list[int],
    repeats: int,
    gap_ms: float,
    backend: str,
    delay: str,
    cc: str | None = None,
    tuned: bool = False,
) -> dict:
    """`cc`: a congestion control to set on the link (TCP_CONGESTION; None: the host's default).
    `tuned`: the hosts get the deployment settings (netns.TUNED_SYSCTLS, TUNED_ROUTE)."""
    from ..comm.identity import Identity

    with tempfile.TemporaryDirectory(prefix="fusion-exchange-") as d:
        for side in "ab":
            Identity.new().save(Path(d) / f"{side}.key")
        args = [d, ",".join(map(str, sizes)), str(repeats), str(gap_ms / 1000), backend, cc or ""]
        delayed = delay if (rtt_ms > 0 or delay == "nfqueue") else None
        with Hosts([A, B], one_way_ms=rtt_ms / 2, delay=delayed, tuned=tuned) as hosts:
            measured = tcp_rtt_ms(hosts, A, B)
            me = [sys.executable, "-m", "fusion_compute.bench.exchange", "peer"]
            pa = hosts.popen(A, [*me, "a", *args])
            if pipe(pa.stdout).readline().strip() != "ready":
                raise RuntimeError(f"side a did not start: {pipe(pa.stderr).read().strip()}")
            pb = hosts.popen(B, [*me, "b", *args])
            outs = []
            for p in (pa, pb):
                o, e = p.communicate(timeout=60 + repeats * len(sizes) * (gap_ms / 1000 + 1))
                if p.returncode != 0:
                    raise RuntimeError(e.strip().splitlines()[-1] if e.strip() else f"exit {p.returncode}")
                outs.append(json.loads(o.strip().splitlines()[-1]))
            counters = {"a": hosts.tcp_counters(A), "b": hosts.tcp_counters(B)}
    a, b = outs
    rows = []
    for n in [1, *sizes]:
        cost = (a[str(n)]["mean_ms"] + b[str(n)]["mean_ms"]) / 2
        rows.append(
            {
                "bytes": n,
                "mean_ms": round(cost, 3),
                "per_rtt": round(cost / measured, 2) if rtt_ms > 0 else None,
                "ss_a": _ss_fields(a[str(n)]["ss"]),
                "ms_a": a[str(n)]["ms"],
            }
        )
    return {
        "rtt_added_ms": rtt_ms,
        "rtt_measured_ms": measured,
        "backend": backend,
        "congestion": a["congestion"],
        "tuned": tuned,
        "delay": delay,
        "gap_ms": gap_ms,
        "repeats": repeats,
        "rows": rows,
        "tcp_counters": counters,
    }


def _ss_fields(words: list[str]) -> dict:
    return {w.split(":")[0]: w.split(":", 1)[1] for w in words if ":" in w and not w[0].isdigit()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peer"]:
        return peer(argv[1:])
    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.exchange", description=__doc__.splitlines()[0])
    p.add_argument("--rtt", type=float, default=5.0, help="added round trip, ms (default 5)")
    p.add_argument("--sizes", default="1024,4096,9216,15360,49152,131072", help="message sizes, bytes")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--gap-ms", type=float, default=15.0, help="idle time between exchanges (default 15)")
    p.add_argument("--backend", choices=("tls", "tcp"), default="tls")
    p.add_argument("--delay", choices=("auto", *DELAYS), default="auto")
    p.add_argument("--cc", help="congestion control to set on the link, e.g. cubic or bbr (default: the host's)")
    p.add_argument("--tuned", action="store_true", help="hosts with the deployment settings (docs/performance.md)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true", help="side a's whole `ss -tin` line after each size")
    a = p.parse_args(argv)
    delay = a.delay if a.delay != "auto" else ("netem" if available(netem=True, delay="netem") is None else "nfqueue")
    why = available(netem=a.rtt > 0 or delay == "nfqueue", delay=delay)
    if why:
        print(f"fusion bench exchange: error: {why}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in a.sizes.split(",")]
    r = run(a.rtt, sizes, a.repeats, a.gap_ms, a.backend, delay, a.cc, a.tuned)
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"RTT added {a.rtt} ms, measured {r['rtt_measured_ms']} ms ({delay}, {a.backend}, {r['congestion']}, gap {a.gap_ms} ms)"
    )
    print("bytes     mean ms  / RTT   side a after it: cwnd ssthresh retrans")
    for row in r["rows"]:
        s = row["ss_a"]
        if a.verbose:
            print("   ", " ".join(f"{k}:{v}" for k, v in s.items()))
            print("    side a, each exchange (ms):", *row["ms_a"])
        print(
            f"{row['bytes']:>8}  {row['mean_ms']:>7.3f}  {row['per_rtt'] or 0:>5.2f}"
            f"   {s.get('cwnd', '-')} {s.get('ssthresh', '-')} {s.get('retrans', '-')}"
        )
    print("TCP counters:", json.dumps(r["tcp_counters"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
