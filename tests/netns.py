"""Separate hosts on one machine: network namespaces joined by a bridge, and a packet capture on it.

    with Hosts(["10.0.0.1", "10.0.0.2", "10.0.0.3"]) as hosts:
        with hosts.capture() as cap:
            p = hosts.popen("10.0.0.2", ["fusion", "worker", ...])
            ...
        cap.payloads   # every TCP payload that crossed the bridge, one bytes object per frame
        cap.flows      # payload bytes per (source, destination) address

The namespaces and the bridge are fusion_compute/bench/netns.py's (the RTT benchmark uses them too);
this module adds the capture. The capture is an AF_PACKET socket in the switch
namespace (every frame that crosses a bridge port), run as its own bounded process; it reports the
kernel's drop count so a test can tell an empty search from a lossy capture. Needs root and
iproute2; `available()` says why not otherwise.
"""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import forkserver
import procs

from fusion_compute.bench.netns import Hosts as _Hosts
from fusion_compute.bench.netns import available

__all__ = ["Capture", "Hosts", "available"]

CAPTURE = r"""
import os, socket, struct, sys, time
out, stop, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL, every interface
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: room for bursts
s.settimeout(0.2)
open(out + ".ready", "w").close()
n = 0
deadline = time.monotonic() + limit
with open(out, "wb") as f:
    while time.monotonic() < deadline and not os.path.exists(stop):
        try:
            frame = s.recv(1 << 16)
        except TimeoutError:
            continue
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4 / TCP only
            continue
        ihl = (frame[14] & 0x0F) * 4
        tcp = 14 + ihl
        payload = frame[tcp + (frame[tcp + 12] >> 4) * 4 :]
        if payload:
            f.write(struct.pack("<I4s4s", len(payload), frame[26:30], frame[30:34]) + payload)  # IPv4 src, dst
            n += 1
packets, drops = struct.unpack("II", s.getsockopt(263, 6, 8))  # SOL_PACKET, PACKET_STATISTICS
open(out + ".stats", "w").write(f"{n} {drops}")
"""


class Capture:
    def __init__(self, hosts: Hosts, limit_s: float):
        self.dir = Path(f"/tmp/fc-capture-{uuid.uuid4().hex[:8]}")
        self.dir.mkdir()
        self.out, self.stop = self.dir / "frames", self.dir / "stop"
        self.proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                hosts.switch,
                sys.executable,
                "-c",
                CAPTURE,
                str(self.out),
                str(self.stop),
                str(limit_s),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 10
        while not Path(str(self.out) + ".ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"capture did not start: {self.proc.stderr.read() if self.proc.poll() is not None else ''}"
                )
            time.sleep(0.05)
        self.payloads: list[bytes] = []
        self.flows: dict[tuple[str, str], int] = {}  # (source, destination) address -> payload bytes
        self.drops = self.packets = -1

    def __enter__(self) -> Capture:
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)  # the last frames land
        self.stop.touch()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        raw = self.out.read_bytes() if self.out.exists() else b""
        at = 0
        while at + 12 <= len(raw):
            n, src, dst = struct.unpack_from("<I4s4s", raw, at)
            self.payloads.append(raw[at + 12 : at + 12 + n])
            pair = (socket.inet_ntoa(src), socket.inet_ntoa(dst))
            self.flows[pair] = self.flows.get(pair, 0) + n
            at += 12 + n
        stats = Path(str(self.out) + ".stats")
        if stats.exists():
            self.packets, self.drops = (int(x) for x in stats.read_text().split())
        shutil.rmtree(self.dir, ignore_errors=True)

    def find(self, needles: list[bytes]) -> int:
        """How many of `needles` (4 bytes or longer) occur in the captured payloads, joined in capture
        order (so also one that straddles two consecutive frames).

        Searching 55 MB for 1,332 needles one by one took 17 s; this looks at every offset once: an
        offset is a candidate when its first 3 bytes start some needle (a 2^24-entry table: in random
        bytes, such as TLS records, at most one offset in 12,600 is, 2^24 / 1,332), and each candidate
        is compared with the needles that start with its 4 bytes."""
        import numpy as np

        if any(len(n) < 4 for n in needles):
            raise ValueError("find: every needle must be 4 bytes or longer")
        blob = b"".join(self.payloads)
        if len(blob) < 4:
            return 0
        starts: dict[bytes, list[bytes]] = {}
        for n in set(needles):
            starts.setdefault(n[:4], []).append(n)
        table = np.zeros(1 << 24, dtype=bool)
        table[np.frombuffer(b"".join(starts), dtype="<u4") & 0xFFFFFF] = True
        seen: set[bytes] = set()
        for k in range(4):  # each alignment of a 4-byte word
            words = np.frombuffer(blob, dtype="<u4", count=(len(blob) - k) // 4, offset=k)
            for i in np.flatnonzero(table[words & 0xFFFFFF]):
                at = k + 4 * int(i)
                seen.update(n for n in starts.get(blob[at : at + 4], ()) if blob.startswith(n, at))
        return sum(n in seen for n in needles)

    @property
    def bytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class Hosts(_Hosts):
    """The runtime's hosts (fusion_compute/bench/netns.py) plus a capture on the bridge, and commands
    forked into a host from the suite's fork server (tests/forkserver.py) rather than started with
    `ip netns exec` (popen): the same entry points without importing torch again in each."""

    def capture(self, limit_s: float = 600) -> Capture:
        return Capture(self, limit_s)

    def fusion(self, addr: str, *args: str, **kw) -> forkserver.ForkedCommand:
        """`fusion ARGS` on host `addr` (stdout and stderr piped as text, stdin closed unless given);
        stopped with the hosts, as popen's are."""
        return self._fork(addr, list(args), None, kw)

    def python(self, addr: str, code: str, *args: str, **kw) -> forkserver.ForkedCommand:
        """`python -c CODE ARGS` on host `addr`, as `fusion` above."""
        return self._fork(addr, list(args), code, kw)

    def _fork(self, addr: str, args: list[str], code: str | None, kw: dict) -> forkserver.ForkedCommand:
        p = procs.fusion(*args, netns=self.ns[addr], code=code, **kw)
        self.procs.append(p)  # Popen's face: terminate, kill, wait, poll
        return p
