"""The latency model: decode speed against the network's round-trip time, measured.

    sudo python -m fusion_compute.bench.rtt [--rtt 0,0.2,1,5] [--workers 2] [--tokens 16] [--json]

Every participant runs in a network namespace of its own on one bridge (bench/netns.py), with a
`tc netem` delay of RTT/2 on every host's interface, so any two hosts are one RTT apart, client and
workers alike. Per RTT, two systems in fresh processes, the same greedy workload (random prompt
ids, a fixed number of new tokens): fusion (sharded residual, 4 reduce-scatters per layer) and
Megatron-style TP (`fusion worker --variant megatron`: replicated residual, 2 all-reduces per
layer), both over the default links (TLS 1.3, pinned keys: a topology file and one key per host).

The model it checks: a decode step is `rounds` sequential network exchanges plus compute, so
tokens/s ≈ 1 / (rounds × t_round + compute), with `compute` the step time at RTT 0 and `t_round`
what one exchange costs at that RTT. The report fits `t_round` per system and RTT from the
measurements (t_round = (1/tok_s - compute) / rounds) and prints it as a fraction of the RTT: an
exchange among workers that all send before they receive costs about half an RTT (one one-way
delay); the client's ingress and egress cost a full one. Needs root, `ip` and `tc`; one run takes a
few minutes on the bundled model.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .netns import Hosts, available

BASE = "10.77.0"  # the namespaces' own /24, on their own bridge: never the machine's network


def _fusion(*args: str) -> list[str]:
    return [sys.executable, "-m", "fusion_compute", *args]


def keys(d: Path, n: int) -> list[str]:
    """Key files client.key, worker1.key, ... in `d`; returns their public lines."""
    lines = []
    for name in ["client"] + [f"worker{i}" for i in range(1, n + 1)]:
        r = subprocess.run(_fusion("keys", "new", str(d / f"{name}.key")), capture_output=True, text=True, check=True)
        lines.append(r.stdout.strip().splitlines()[-1])
    return lines


def topology(d: Path, model: str, lines: list[str], addrs: list[str]) -> Path:
    text = [f'model = "{model}"', "", "[client]", f'address = "{addrs[0]}:29500"', f'key = "{lines[0]}"']
    for addr, line in zip(addrs[1:], lines[1:], strict=True):
        text += ["", "[[worker]]", f'address = "{addr}"', f'key = "{line}"']
    path = d / "topology.toml"
    path.write_text("\n".join(text) + "\n")
    return path


def one(model: str, n: int, rtt_ms: float, variant: str, prompt: list[int], tokens: int, d: Path,
        timeout_s: float) -> dict:  # fmt: skip
    addrs = [f"{BASE}.{i + 1}" for i in range(n + 1)]
    topo = d / "topology.toml"
    with Hosts(addrs, one_way_ms=rtt_ms / 2) as hosts:
        workers = [hosts.popen(addrs[i], _fusion("worker", "--topology", str(topo), "--key", str(d / f"worker{i}.key"),
                                                  "--threads", "1", "--variant", variant))
                   for i in range(1, n + 1)]  # fmt: skip
        client = hosts.popen(addrs[0], _fusion("generate", "--topology", str(topo), "--key", str(d / "client.key"),
                                               "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                                               str(tokens), "--json", "--timeout", "60"))  # fmt: skip
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
        if client.returncode != 0:
            raise RuntimeError(f"RTT {rtt_ms} ms, {variant}: {err.strip().splitlines()[-1] if err.strip() else 'failed'}")
        j = json.loads(out.strip().splitlines()[-1])
    return {"rtt_ms": rtt_ms, "variant": variant, "workers": n, "decode_tokens_per_s": j["timing"]["decode_tokens_per_s"],
            "ttft_s": j["timing"]["ttft_s"], "token_ids": j["token_ids"]}  # fmt: skip


def rounds_per_token(model: str, n: int, variant: str) -> int:
    """Sequential network exchanges per decode step: the client's ingress and egress, plus the
    collectives among workers (fusion: 4 reduce-scatters per layer; megatron: 2 all-reduces)."""
    from ..weights import open_weights

    layers = open_weights(model).config.n_layers
    return 2 + layers * (4 if variant == "sharded" else 2) if n > 1 else 2


def main(argv: list[str] | None = None) -> int:
    from ..weights import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.rtt", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rtt", default="0,0.2,1,5", help="round-trip times to measure, ms (comma-separated)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per run")
    p.add_argument("--prompt", type=int, default=16, help="random prompt tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on one run, seconds")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        rtts = [float(x) for x in a.rtt.split(",")]
    except ValueError:
        print(f"bench.rtt: --rtt expects comma-separated milliseconds, got {a.rtt!r}", file=sys.stderr)
        return 2
    why = available(netem=any(r > 0 for r in rtts))
    if why is not None:
        print(f"bench.rtt: cannot run here: {why}", file=sys.stderr)
        return 2
    if a.workers < 2 or a.tokens < 2 or any(r < 0 for r in rtts):
        print("bench.rtt: needs --workers >= 2, --tokens >= 2 and RTTs >= 0", file=sys.stderr)
        return 2
    model = str(resolve_model_path(a.model))
    prompt = random.Random(0).sample(range(100, 10000), a.prompt)
    d = Path(tempfile.mkdtemp(prefix="fc-rtt-"))
    try:
        lines = keys(d, a.workers)
        topology(d, model, lines, [f"{BASE}.{i + 1}" for i in range(a.workers + 1)])
        runs = []
        for rtt in rtts:
            for variant in ("sharded", "megatron"):
                t0 = time.perf_counter()
                r = one(model, a.workers, rtt, variant, prompt, a.tokens, d, a.timeout)
                r["wall_s"] = round(time.perf_counter() - t0, 2)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), file=sys.stderr)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    table = []
    for variant in ("sharded", "megatron"):
        mine = [r for r in runs if r["variant"] == variant]
        base = next((r for r in mine if r["rtt_ms"] == 0), None)
        rounds = rounds_per_token(model, a.workers, variant)
        for r in mine:
            row = {"system": "fusion" if variant == "sharded" else "megatron-tp", "rtt_ms": r["rtt_ms"],
                   "decode_tokens_per_s": round(r["decode_tokens_per_s"], 3), "rounds_per_token": rounds}  # fmt: skip
            if base is not None and r["rtt_ms"] > 0:
                compute = 1 / base["decode_tokens_per_s"]
                t_round = (1 / r["decode_tokens_per_s"] - compute) / rounds
                row["t_round_ms"] = round(1000 * t_round, 4)
                row["t_round_over_rtt"] = round(1000 * t_round / r["rtt_ms"], 3)
                row["model_tokens_per_s_at_half_rtt"] = round(1 / (compute + rounds * r["rtt_ms"] / 2000), 3)
            table.append(row)
    same = len({tuple(r["token_ids"]) for r in runs}) == 1
    summary = {"model": model, "workers": a.workers, "tokens": a.tokens, "same_tokens_everywhere": same, "table": table}
    print(json.dumps(summary, indent=None if a.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
