"""Separate hosts on one machine: network namespaces joined by a bridge, optionally with a delay.

    with Hosts(["10.0.0.1", "10.0.0.2", "10.0.0.3"], one_way_ms=0.5) as hosts:
        p = hosts.popen("10.0.0.2", ["fusion", "worker", ...])

Each host is a namespace with one veth (`eth0`) whose other end sits on a bridge in a "switch"
namespace, so nothing touches the machine's own network. `one_way_ms` delays every packet once, on
its way into the host it is addressed to, so the round trip between any two hosts is 2 ×
one_way_ms. The delay is `tc netem` on the switch's port towards the host (`delay="netem"`, needs
the sch_netem module) or, where the kernel has no netem, a netfilter queue in the host whose reader
holds each arriving packet that long (`delay="nfqueue"`: bench/nfq_delay.py, one process per host;
needs iptables and libnetfilter_queue).

RECEIVER_SIDE: why not on the sender's eth0, as this tool first did. A packet held on its
sender's own egress has not left the sending socket's accounts: TCP Small Queues lets a socket
keep only about a millisecond of its pacing rate (a few KB) in the qdisc and device queues, so
the next bytes of a message waited for the held ones, a one-way delay per few KB, which no real
network does (a NIC frees a packet once it is on the wire). Measured with bench/exchange.py at a
5 ms round trip (docs/performance.md): a 128 KB exchange took 1.04-8.3 round trips with the delay
at the sender and 0.78-0.90 with it at the receiver (the host's BBR; cubic 1.07-1.08 and 0.78).
Needs root and iproute2; `available()` says why not otherwise. Used by tests/test_wire.py and
bench/rtt.py.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from typing import IO

from ..comm.readiness import readable
from ..runtime.launch import terminate_all

DELAYS = ("netem", "nfqueue")
TCP_COUNTERS = (
    "TcpOutSegs",
    "TcpRetransSegs",
    "TcpExtTCPTimeouts",
    "TcpExtTCPLossProbes",
    "TcpExtTCPSpuriousRTOs",
    "TcpExtDelayedACKs",
)
# What docs/performance.md ("Placing workers") asks of a host whose workers talk across a wide area:
# keep the congestion window across the compute between steps, and start a connection (or a route's
# first burst) with room for a batch's partial products.
TUNED_SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}
TUNED_ROUTE = ("initcwnd", "64", "initrwnd", "64")
NFQ_RULE = ["iptables", "-t", "mangle", "-A", "PREROUTING", "-i", "eth0", "-j", "NFQUEUE", "--queue-num", "0"]


def available(netem: bool = False, delay: str = "netem") -> str | None:
    """None when namespaces (and, with `netem`, delays of kind `delay`) can be made here, else the
    reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    if netem and delay == "netem" and shutil.which("tc") is None:
        return "needs iproute2's `tc` (netem delays)"
    if netem and delay == "nfqueue":
        if shutil.which("iptables") is None:
            return "needs iptables (nfqueue delays)"
        if ctypes.util.find_library("netfilter_queue") is None:
            return "needs libnetfilter_queue (nfqueue delays): apt install libnetfilter-queue1"
    name = f"fcprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        if netem and delay == "netem":
            r = subprocess.run(
                ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                return f"cannot add a netem delay: {r.stderr.strip()}"
        elif netem:
            rule = [x if x != "eth0" else "lo" for x in NFQ_RULE]
            r = subprocess.run(["ip", "netns", "exec", name, *rule], capture_output=True, text=True)
            if r.returncode != 0:
                return f"cannot queue packets to a netfilter queue: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def ip(*args: str, ns: str | None = None) -> None:
    _run(["ip", "-n", ns, *args] if ns else ["ip", *args])


def pipe(stream: IO[str] | None) -> IO[str]:
    """A pipe of a process started here (Hosts.popen opens stdout and stderr, stdin when asked):
    subprocess types each as optional, None when the process was started without it."""
    if stream is None:
        raise RuntimeError("a bench process was started without the pipe it is read or written through")
    return stream


class Hosts:
    """One namespace per address on a /24, all on one bridge in a switch namespace."""

    def __init__(self, addresses: list[str], one_way_ms: float = 0.0, delay: str | None = "netem", tuned: bool = False):
        """`delay`: how `one_way_ms` is applied ("netem" or "nfqueue", DELAYS); "nfqueue" queues every
        packet even at 0 ms (its cost then stays in the baseline); None: no delay at all. `tuned`:
        every host gets the deployment settings docs/performance.md recommends for workers across a
        wide area (TUNED_SYSCTLS, and the route's initial windows TUNED_ROUTE), as a user would set
        them on their own hosts."""
        if delay not in (None, *DELAYS):
            raise ValueError(f"delay must be one of {DELAYS} or None, got {delay!r}")
        tag = uuid.uuid4().hex[:6]
        self.switch = f"fcsw{tag}"
        self.ns = {a: f"fch{i}{tag}" for i, a in enumerate(addresses)}
        self.one_way_ms = one_way_ms
        self.delay = delay
        self.tuned = tuned
        self.procs: list[subprocess.Popen] = []
        self.delayers: list[subprocess.Popen] = []
        self._tag = tag

    def __enter__(self) -> Hosts:
        try:
            ip("netns", "add", self.switch)
            ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            ip("link", "set", "br0", "up", ns=self.switch)
            for i, (addr, ns) in enumerate(self.ns.items()):
                ip("netns", "add", ns)
                ip("link", "set", "lo", "up", ns=ns)
                port = f"p{i}{self._tag}"
                ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                ip("link", "set", port, "master", "br0", ns=self.switch)
                ip("link", "set", port, "up", ns=self.switch)
                ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
                ip("link", "set", "eth0", "up", ns=ns)
                if self.tuned:
                    prefix = addr.rsplit(".", 1)[0] + ".0/24"
                    ip("route", "change", prefix, "dev", "eth0", "proto", "kernel", "src", addr, *TUNED_ROUTE, ns=ns)
                    for key, value in TUNED_SYSCTLS.items():
                        _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])
                if self.delay == "netem" and self.one_way_ms > 0:  # limit: well above a bulk transfer's packets
                    _run(  # on the switch's port towards the host: the packets arriving there (RECEIVER_SIDE)
                        [
                            "tc",
                            "-n",
                            self.switch,
                            "qdisc",
                            "add",
                            "dev",
                            port,
                            "root",
                            "netem",
                            "delay",
                            f"{self.one_way_ms}ms",
                            "limit",
                            "100000",
                        ]
                    )
                elif self.delay == "nfqueue":
                    self._queue_delay(ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _queue_delay(self, ns: str) -> None:
        """Start the host's delay reader (it must be bound first: a queue nobody reads drops), then
        send everything arriving on eth0 to it (RECEIVER_SIDE)."""
        p = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "fusion_compute.bench.nfq_delay",
                "--ms",
                str(self.one_way_ms),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.delayers.append(p)
        out = pipe(p.stdout)
        ready = readable([out], 30) and out.readline().strip() == "ready"
        if not ready:
            p.kill()
            p.wait()
            raise RuntimeError(f"nfq_delay in {ns}: {pipe(p.stderr).read().strip() or 'not ready within 30 s'}")
        _run(["ip", "netns", "exec", ns, *NFQ_RULE])

    def popen(self, addr: str, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[addr], *argv], text=True, **kw)  # exec: same pid
        self.procs.append(p)
        return p

    def tcp_counters(self, addr: str) -> dict:
        """The host's TCP counters since its namespace was made (`nstat`; a fresh namespace starts at
        zero): retransmits, loss probes, timeouts, delayed ACKs (TCP_COUNTERS), {} without nstat."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns[addr], "nstat", "-az", "--json"], capture_output=True, text=True
        )
        try:
            counters = next(iter(json.loads(r.stdout).values()))
        except (ValueError, StopIteration):
            return {}
        return {k: counters.get(k, 0) for k in TCP_COUNTERS}

    def link_down(self, addr: str) -> None:
        """Cut a host off the bridge: its interface goes down, its TCP connections hang (no RST)."""
        ip("link", "set", "eth0", "down", ns=self.ns[addr])

    def __exit__(self, *exc) -> None:
        for group in (self.procs, self.delayers):  # the delayers last: the others' packets still flow
            terminate_all(group, 5.0)
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
