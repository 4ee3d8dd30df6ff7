"""OS-level byte accounting: what each process actually sent and received on its TCP sockets.

The comm layer's own bookkeeping cannot catch a primitive that moves more than it reports (a
reduce-scatter done as an all-reduce in disguise, as gloo's own is: `--inject-leak rs-allreduce`)
or a transfer that bypasses the recorder. The kernel can: `ss -tinpH` lists every TCP socket with its owning pid and the kernel's per-socket counters
`bytes_sent` / `bytes_received` (tcp_info, Linux >= 4.19). The runner samples them for the worker
pids before and after the audited steps (workers idle, blocked on the next command) and writes
the per-process differences to netcount.json; the verifier compares them with the bytes it
predicts from the model dimensions plus the wire model in schema.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

_PID = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_retrans|bytes_received):(\d+)")

# pid -> socket key -> (bytes_sent, bytes_retrans, bytes_received)
Sample = dict[int, dict[str, tuple[int, int, int]]]


class NetcountUnavailable(RuntimeError):
    pass


def available() -> bool:
    return shutil.which("ss") is not None


def parse_ss(text: str, pids: set[int], exclude_local: frozenset[str] = frozenset()) -> Sample:
    """Parse `ss -tinpH` output: a socket line (state, queues, local, peer, users) followed by
    indented tcp_info lines. Sockets owned by several pids count for each; sockets whose local
    address is in `exclude_local` (HOST:PORT) are left out."""
    out: Sample = {p: {} for p in pids}
    owners: list[int] = []
    key = ""
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            cols = line.split()
            key = " ".join(cols[3:5]) if len(cols) >= 5 else line
            owners = [int(p) for p in _PID.findall(line) if int(p) in pids]
            if len(cols) >= 5 and cols[3] in exclude_local:
                owners = []
            continue
        if owners:
            found = dict((k, int(v)) for k, v in _COUNTER.findall(line))
            if found:
                for p in owners:
                    s, x, r = out[p].get(key, (0, 0, 0))
                    out[p][key] = (
                        s + found.get("bytes_sent", 0),
                        x + found.get("bytes_retrans", 0),
                        r + found.get("bytes_received", 0),
                    )
                owners = []
    return out


def sample(pids: list[int], exclude_local: frozenset[str] = frozenset()) -> Sample:
    if not available():
        raise NetcountUnavailable("`ss` (iproute2) not found: OS-level byte accounting unavailable")
    res = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise NetcountUnavailable(f"ss failed: {res.stderr.strip()[:200]}")
    return parse_ss(res.stdout, set(pids), exclude_local)


def delta(before: Sample, after: Sample) -> dict[int, dict[str, int]]:
    """Per pid: bytes between two samples, summed over its sockets. `sent` counts each payload byte
    once (the kernel's bytes_sent includes TCP retransmissions, reported apart as `retrans`:
    a loaded host's loopback does retransmit, e.g. tail-loss probes). A socket opened in between
    counts from zero; one closed in between is lost: an epoch's links stay open until its
    last sample, but a departed worker's process that has exited shows no socket at all (its
    absence from the client's log is the stronger evidence, docs/audit.md)."""
    out = {}
    for pid, socks in after.items():
        sent = retrans = recv = 0
        for key, (s, x, r) in socks.items():
            s0, x0, r0 = before.get(pid, {}).get(key, (0, 0, 0))
            sent += s - s0
            retrans += x - x0
            recv += r - r0
        out[pid] = {"sent": sent - retrans, "retrans": retrans, "received": recv, "sockets": len(socks)}
    return out


def settle(seconds: float = 0.3) -> None:
    """Let in-flight bytes land in the counters before sampling (loopback: microseconds)."""
    time.sleep(seconds)
