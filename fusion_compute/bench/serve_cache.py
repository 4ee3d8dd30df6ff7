"""The global suffix cache through `fusion serve`: τ per request with and without it.

    python -m fusion_compute.bench.serve_cache [--workers 2] [--max-tokens 48] [--out FILE]

Two servers one after the other (`fusion serve --speculative suffix`, then the same with
`--suffix-cache-tokens 0`), local workers on 127.0.0.1, the bundled model; each gets the structured
workload's requests (bench/workloads.py: the same JSON object about different people) one at a
time over HTTP, greedy, and each response's `fusion.speculative` counters are kept: τ (tokens per
sharded forward), columns, acceptance. With the cache, a request drafts from the earlier answers'
keys and punctuation; without it, from its own prompt and output only. Both servers must give the
same tokens (greedy); the report says whether they did.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def serve(args: list[str], log: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """A `fusion serve` on 127.0.0.1 with a free port; (process, base URL) once it listens."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fusion_compute", "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://\S+/v1)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"the server did not come up: {log.read_text()[-500:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(cache: bool, workers: int, max_tokens: int, d: Path, link: list[str], log=lambda s: None) -> list[dict]:
    import requests

    from . import workloads

    args = ["--workers", str(workers), "--speculative", "suffix", "--served-model-name", "m", *link]
    if not cache:
        args += ["--suffix-cache-tokens", "0"]
    proc, url = serve(args, d / f"serve-{'cache' if cache else 'nocache'}.log")
    rows = []
    try:
        for i, text in enumerate(workloads.STRUCTURED):
            body: dict[str, Any] = {
                "model": "m",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            r = requests.post(url + "/chat/completions", json=body, timeout=1800)
            r.raise_for_status()
            j = r.json()
            spec = j["fusion"]["speculative"]
            rows.append(
                {
                    "request": i,
                    "content": j["choices"][0]["message"]["content"],
                    "tokens": j["usage"]["completion_tokens"],
                    "forwards": spec["forwards"],
                    "tau": spec["tokens_per_forward"],
                    "columns": spec["columns"],
                    "num_drafts": spec["num_drafts"],
                    "num_accepted_tokens": spec["num_accepted_tokens"],
                }
            )
            log(json.dumps(rows[-1]))
    finally:
        stop(proc)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.serve_cache", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="docs/bench/serve_cache.json")
    p.add_argument(
        "--link-rtt-ms",
        type=float,
        help="the servers' --link-rtt-ms (with --link-mbps): size trees for that link, not loopback's cost",
    )
    p.add_argument("--link-mbps", type=float)
    a = p.parse_args(argv)
    if a.workers < 2 or a.max_tokens < 2:
        print("bench.serve_cache: needs --workers >= 2 and --max-tokens >= 2", file=sys.stderr)
        return 2
    log = lambda s: print(s, file=sys.stderr, flush=True)
    link = [] if a.link_rtt_ms is None else ["--link-rtt-ms", str(a.link_rtt_ms), "--link-mbps", str(a.link_mbps)]
    report: dict = {
        "link": link,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "max_tokens": a.max_tokens,
        "workers": a.workers,
    }
    with tempfile.TemporaryDirectory(prefix="fc-serve-cache-") as tmp:
        for cache in (True, False):
            report["cache" if cache else "no_cache"] = run(cache, a.workers, a.max_tokens, Path(tmp), link, log)
    for key in ("cache", "no_cache"):
        rows = report[key]
        report[f"{key}_tau"] = round(sum(r["tokens"] for r in rows) / sum(r["forwards"] for r in rows), 3)
    report["same_tokens"] = [r["content"] for r in report["cache"]] == [r["content"] for r in report["no_cache"]]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(
        "request | tokens | tau with the cache | tau without\n"
        + "\n".join(
            f"{c['request']} | {c['tokens']} | {c['tau']} | {n['tau']}"
            for c, n in zip(report["cache"], report["no_cache"], strict=True)
        )
        + f"\nall | | {report['cache_tau']} | {report['no_cache_tau']}  (same tokens: {report['same_tokens']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
