"""A soak test of `fusion serve`: does a server that lives through many requests, revocations and lost
workers, with hundreds of idle connections open, hold steady in descriptors, threads and memory?

    python scripts/soak.py                                  # the bundled SmolLM2, the defaults below
    python scripts/soak.py --model DIR --requests 300 --idle 500 --revocations 3 --kills 2 --time-limit 600

On loopback only (127.0.0.1; the idle connections come from 127.0.0.2 and up, 25 from each, within
the server's per-address share). It starts `python -m fusion_compute serve --workers 2 --standby 1`
(a real process, its workers its children), answers one request (the warm-up), and samples the
server process: open descriptors (/proc/PID/fd), threads and resident memory (/proc/PID/status),
and worker 2's, a worker that stays through every change. Then it opens `--idle` HTTP connections
that send nothing (the server's header timeout is set past the run's time limit, so they stay),
samples again ("start": after --quiet-s of quiet and one request, as "end" is; settled_sample says
why), and sends `--requests` completions (greedy) from `--clients` threads while,
at even intervals, it revokes an active worker other than 2 through the admin API (the standby
takes the seat) or kills one with SIGKILL (the standby takes the seat at the next step: a
recovery), each time adding a new standby through the admin API and waiting until it has joined.
When the requests are done it samples ("end"), closes the idle connections, waits for the server to
see them closed and samples a last time. Every sample and the verdict go to stdout as JSON lines.

Exit status 0 when every request got 200, each prompt got one answer whatever the epoch, and the
end differs from the start by no more than the margins (--fd-margin descriptors, --thread-margin
threads, --rss-margin MiB; the server's and worker 2's); 1 otherwise, or when the time limit cut
the run short (it says so); 2 on a bad argument or a server that does not come up. Everything it
starts it stops, by PID.

Not part of .ci/run: minutes of CPU. docs/resilience.md ("Weeks, not hours") has a run's numbers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KEY = "soak-key"
PROMPTS = [[5, 17, 33, 2, 99, 100, 7, 8], [11, 3, 250, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def sample(pid: int, what: str, worker: int | None = None) -> dict:
    """The server's open descriptors, threads and resident memory now; `worker`'s too (a worker
    process that stays through every epoch change), under "worker"."""
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return {
        "sample": what,
        "t_s": round(time.monotonic() - T0, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": threads,
        "rss_mib": round(rss_kib / 1024, 1),
        "workers": len(children(pid)),
        **(
            {"worker": {k: v for k, v in sample(worker, "").items() if k in ("fds", "threads", "rss_mib")}}
            if worker
            else {}
        ),
    }


def children(pid: int) -> list[int]:
    """The server's live child processes (its workers), oldest first."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()

    def started(p: str) -> tuple[int, int]:  # (start time in clock ticks, pid): spawn order
        try:
            return int(Path(f"/proc/{p}/stat").read_text().rsplit(") ", 1)[1].split()[19]), int(p)
        except (OSError, IndexError):
            return 0, int(p)

    return [int(p) for p in sorted(out, key=started)]


class Server:
    def __init__(self, args: argparse.Namespace, log: Path):
        cmd = [sys.executable, "-m", "fusion_compute", "serve", "--workers", "2", "--standby", "1"]
        cmd += ["--port", "0", "--api-key", KEY, "--served-model-name", "m", "--max-tokens", str(args.max_tokens)]
        cmd += ["--max-connections", str(args.idle + 256), "--request-timeout", str(args.time_limit + 120)]
        cmd += ["--model", args.model] if args.model else []
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text())
            if m:
                self.port = int(m.group(1))
                return
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"soak: fusion serve did not come up:\n{log.read_text()[-2000:]}")

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(
                method, path, body=data, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
            )
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"{}")
        finally:
            conn.close()

    def workers(self) -> list[dict]:
        return self.call("GET", "/admin/workers")[1]["workers"]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; then any worker still there (by PID)."""
        kids = children(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in kids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def complete(server: Server, i: int) -> tuple[int, str]:
    status, body = server.call(
        "POST", "/v1/completions", {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0}
    )
    return status, body["choices"][0]["text"] if status == 200 else json.dumps(body)[:300]


def run(args: argparse.Namespace) -> int:
    log = Path(tempfile.mkdtemp(prefix="fusion-soak-")) / "serve.log"
    server = Server(args, log)
    idle: list[http.client.HTTPConnection] = []
    failures: list[str] = []
    answers: dict[int, set[str]] = {}
    try:
        seat_pids = dict(zip((1, 2, 3), children(server.proc.pid), strict=False))  # ids in spawn order
        status, text = complete(server, 0)
        if status != 200:
            raise SystemExit(f"soak: the warm-up request failed: {status} {text}")
        emit(sample(server.proc.pid, "warm", seat_pids.get(2)))
        for i in range(args.idle):  # 25 per source address: within the per-peer share (an eighth of the cap)
            conn = http.client.HTTPConnection(
                "127.0.0.1", server.port, timeout=30, source_address=(f"127.0.0.{2 + i // 25}", 0)
            )
            conn.connect()
            idle.append(conn)
        start = settled_sample(server, args.quiet_s, "start", seat_pids.get(2))
        emit(start)

        # The requests go in chunks, one per event and one more: the clients start a chunk's requests,
        # and when the last of them has started the event happens, with those still in flight; the
        # next chunk waits for the event (and its new standby). So every event meets traffic, and
        # every epoch serves requests.
        order = interleave(args.revocations, args.kills)
        bounds = [(k + 1) * args.requests // (len(order) + 1) for k in range(len(order))] + [args.requests]
        started = finished = 0
        allowed = bounds[0]
        gate = threading.Condition()
        stop_at = T0 + args.time_limit

        def client() -> None:
            nonlocal started, finished
            while True:
                with gate:
                    while started >= allowed and started < args.requests and time.monotonic() < stop_at:
                        gate.wait(0.5)
                    if started >= args.requests or time.monotonic() >= stop_at:
                        return
                    i = started
                    started += 1
                    gate.notify_all()
                try:
                    status, text = complete(server, i)
                except Exception as e:  # a refused or cut connection is a failure like a 5xx
                    status, text = 0, f"{type(e).__name__}: {e}"
                with gate:
                    finished += 1
                    if status == 200:
                        answers.setdefault(i % len(PROMPTS), set()).add(text)
                    else:
                        failures.append(f"request {i}: {status} {text}")

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for k, event in enumerate(order):
            with gate:
                while started < allowed and time.monotonic() < stop_at:
                    gate.wait(0.5)
            # two active workers (a kill's seat is taken at the next step), and worker 2 stays through
            # every change: the long-lived worker whose own counts are sampled
            wait_for(lambda: len(active(server)) == 2, stop_at)
            victim = next(w for w in active(server) if w != 2)
            if event == "revoke":
                status, body = server.call("POST", f"/admin/workers/{victim}/revoke")
                if status != 200:
                    failures.append(f"revoke {victim}: {status} {body}")
            else:
                os.kill(seat_pids[victim], signal.SIGKILL)
                wait_for(
                    lambda a=victim: any(
                        w["id"] == a and w["state"] in ("failed", "removed") for w in server.workers()
                    ),
                    stop_at,
                )
            before = set(children(server.proc.pid))
            status, body = server.call("POST", "/admin/workers", {})
            if status != 201:
                failures.append(f"add: {status} {body}")
            else:
                new = body["id"]
                wait_for(lambda b=before: bool(set(children(server.proc.pid)) - b), stop_at)
                seat_pids[new] = next(iter(set(children(server.proc.pid)) - before), -1)
                wait_for(lambda n=new: any(w["id"] == n and w["state"] == "standby" for w in server.workers()), stop_at)
            emit({**sample(server.proc.pid, f"after {event} {k + 1}", seat_pids.get(2)), "requests_done": finished})
            with gate:
                allowed = bounds[k + 1]
                gate.notify_all()
        for t in threads:
            t.join(timeout=max(0.0, stop_at - time.monotonic()) + 5)
        end = settled_sample(server, args.quiet_s, "end", seat_pids.get(2))
        emit({**end, "requests_done": finished})
        for conn in idle:
            conn.close()
        idle.clear()
        wait_for(
            lambda: len(os.listdir(f"/proc/{server.proc.pid}/fd")) <= start["fds"] - args.idle + args.fd_margin,
            T0 + args.time_limit + 30,
        )
        emit(sample(server.proc.pid, "idle connections closed"))
        _, health = server.call("GET", "/health")
        cut_short = finished < args.requests or time.monotonic() > stop_at
        keys = ("fds", "threads", "rss_mib")
        drift = {k: round(end[k] - start[k], 1) for k in keys}
        worker_drift = {k: round(end["worker"][k] - start["worker"][k], 1) for k in keys} if "worker" in end else {}
        margins = {"fds": args.fd_margin, "threads": args.thread_margin, "rss_mib": args.rss_margin}
        flat = all(abs(d[k]) <= margins[k] for d in (drift, worker_drift) for k in d) and "worker" in end
        varied = {p: len(s) for p, s in answers.items()}  # greedy: one answer per prompt, whatever the epoch
        ok = flat and not failures and not cut_short and all(n == 1 for n in varied.values())
        emit(
            {
                "verdict": "flat" if ok else "NOT flat" if not flat else "failed",
                "drift": drift,
                "worker_2_drift": worker_drift,
                "margins": margins,
                "requests": finished,
                "failed": len(failures),
                "failures": failures[:5],
                "answers_per_prompt": varied,
                "recoveries": health.get("recoveries"),
                "cut_short_by_time_limit": cut_short,
                "wall_s": round(time.monotonic() - T0, 1),
            }
        )
        return 0 if ok else 1
    finally:
        for conn in idle:
            conn.close()
        server.stop()


def settled_sample(server: Server, quiet_s: float, what: str, worker: int | None) -> dict:
    """A sample after `quiet_s` of quiet and one request. The HTTP server runs blocking work (parsing
    a request, an admin call) on anyio's worker threads, which stay for reuse while work keeps
    coming and are let go at the next call once idle for 10 s (anyio's MAX_IDLE_TIME): the start
    and the end are sampled alike, after such a call, so that neither counts the other's idle
    threads."""
    time.sleep(quiet_s)
    status, text = complete(server, 0)
    if status != 200:
        raise SystemExit(f"soak: the request before the {what} sample failed: {status} {text}")
    time.sleep(0.5)
    return sample(server.proc.pid, what, worker)


def active(server: Server) -> list[int]:
    return [w["id"] for w in server.workers() if w["state"] == "active"]


def interleave(revocations: int, kills: int) -> list[str]:
    """The events in turn, revoke first, then the rest of whichever kind has more."""
    out = []
    for k in range(max(revocations, kills)):
        out += ["revoke"] if k < revocations else []
        out += ["kill"] if k < kills else []
    return out


def wait_for(cond, deadline: float) -> None:
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.1)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model directory or GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--requests", type=int, default=300, help="completions to send (default 300)")
    p.add_argument("--clients", type=int, default=4, help="threads sending them (default 4)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per completion (default 4)")
    p.add_argument("--idle", type=int, default=500, help="idle HTTP connections held open (default 500)")
    p.add_argument("--revocations", type=int, default=3, help="workers revoked through the admin API (default 3)")
    p.add_argument("--kills", type=int, default=2, help="workers killed with SIGKILL (default 2)")
    p.add_argument("--time-limit", type=float, default=600, help="seconds the run may take (default 600)")
    p.add_argument(
        "--quiet-s",
        type=float,
        default=11,
        help="quiet before the start and end samples (default 11: see settled_sample)",
    )
    p.add_argument("--fd-margin", type=int, default=4, help="descriptors the end may differ by (default 4)")
    p.add_argument("--thread-margin", type=int, default=2, help="threads the end may differ by (default 2)")
    p.add_argument("--rss-margin", type=float, default=64, help="MiB the end's RSS may differ by (default 64)")
    a = p.parse_args()
    if min(a.requests, a.clients, a.max_tokens) < 1 or min(a.idle, a.revocations, a.kills) < 0 or a.time_limit <= 0:
        print("soak: --requests, --clients and --max-tokens must be >= 1, the counts >= 0", file=sys.stderr)
        return 2
    if a.idle > 25 * 250:
        print("soak: --idle at most 6250 (25 per loopback source address)", file=sys.stderr)
        return 2
    try:
        return run(a)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
