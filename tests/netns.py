"""Separate hosts on one machine: network namespaces joined by a bridge, and a packet capture on it.

    with Hosts(["10.0.0.1", "10.0.0.2", "10.0.0.3"]) as hosts:
        with hosts.capture() as cap:
            p = hosts.popen("10.0.0.2", ["fusion", "worker", ...])
            ...
        cap.payloads   # every TCP payload that crossed the bridge, one bytes object per frame

Each host is a namespace with one veth whose other end sits on a bridge in a "switch" namespace, so
nothing touches the machine's own network. The capture is an AF_PACKET socket in the switch
namespace (every frame that crosses a bridge port), run as its own bounded process; it reports the
kernel's drop count so a test can tell an empty search from a lossy capture. Needs root and
iproute2; `available()` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

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
            f.write(struct.pack("<I", len(payload)) + payload)
            n += 1
packets, drops = struct.unpack("II", s.getsockopt(263, 6, 8))  # SOL_PACKET, PACKET_STATISTICS
open(out + ".stats", "w").write(f"{n} {drops}")
"""


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    name = f"fcprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "-n", ns, *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Capture:
    def __init__(self, hosts: Hosts, limit_s: float):
        self.dir = Path(f"/tmp/fc-capture-{uuid.uuid4().hex[:8]}")
        self.dir.mkdir()
        self.out, self.stop = self.dir / "frames", self.dir / "stop"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", hosts.switch, sys.executable, "-c", CAPTURE, str(self.out), str(self.stop),
             str(limit_s)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not Path(str(self.out) + ".ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"capture did not start: {self.proc.stderr.read() if self.proc.poll() is not None else ''}")
            time.sleep(0.05)
        self.payloads: list[bytes] = []
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
        while at + 4 <= len(raw):
            (n,) = struct.unpack_from("<I", raw, at)
            self.payloads.append(raw[at + 4 : at + 4 + n])
            at += 4 + n
        stats = Path(str(self.out) + ".stats")
        if stats.exists():
            self.packets, self.drops = (int(x) for x in stats.read_text().split())
        shutil.rmtree(self.dir, ignore_errors=True)

    def find(self, needles: list[bytes]) -> int:
        """How many of `needles` occur in some captured payload."""
        return sum(any(n in p for p in self.payloads) for n in needles)

    @property
    def bytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class Hosts:
    """One namespace per address on a /24, all on one bridge in a switch namespace."""

    def __init__(self, addresses: list[str]):
        tag = uuid.uuid4().hex[:6]
        self.switch = f"fcsw{tag}"
        self.ns = {a: f"fch{i}{tag}" for i, a in enumerate(addresses)}
        self.procs: list[subprocess.Popen] = []
        self._tag = tag

    def __enter__(self) -> Hosts:
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i, (addr, ns) in enumerate(self.ns.items()):
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
                port = f"p{i}{self._tag}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("link", "set", port, "master", "br0", ns=self.switch)
                _ip("link", "set", port, "up", ns=self.switch)
                _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def popen(self, addr: str, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[addr], *argv], text=True, **kw)  # exec: same pid
        self.procs.append(p)
        return p

    def link_down(self, addr: str) -> None:
        """Cut a host off the bridge: its interface goes down, its TCP connections hang (no RST)."""
        _ip("link", "set", "eth0", "down", ns=self.ns[addr])

    def capture(self, limit_s: float = 600) -> Capture:
        return Capture(self, limit_s)

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
