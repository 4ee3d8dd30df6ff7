"""A fixed one-way delay without `tc netem`: every packet a host sends waits D ms in a netfilter queue.

    ip netns exec NS python -m fusion_compute.bench.nfq_delay --ms 0.5 [--queue 0]

For kernels without `sch_netem` (this project's VM has none). Run in a host's network namespace, it
binds netfilter queue Q (libnetfilter_queue through the NetfilterQueue package), prints "ready", and
then accepts each queued packet D ms after the kernel queued it, in arrival order (a constant delay
keeps the order, as netem's does). bench/netns.py then sends everything leaving the host's eth0 to
that queue (`iptables -t mangle -A POSTROUTING -o eth0 -j NFQUEUE --queue-num Q`), so a packet
between two hosts waits once, at its sender. Unlike netem it costs CPU per packet (a Python
callback, then a verdict) and it wakes late (measured on this VM: 80-150 µs per wait, and a packet
waits twice, once to be noticed and once to leave), so a round trip comes out 0.1-0.5 ms longer
than asked; bench/rtt.py measures the round trip it really got (a TCP ping) and uses that. It stops
on SIGTERM/SIGINT and when its parent (the bench) dies; without it the rule drops every packet (no
silent undelayed path).
Needs root, iptables and `pip install NetfilterQueue` (which builds against libnetfilter-queue-dev).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29


def serve(queue: int, delay_s: float) -> None:
    from netfilterqueue import COPY_META, NetfilterQueue

    held: collections.deque = collections.deque()  # (due, packet), due non-decreasing
    clock = time.monotonic

    def on_packet(pkt) -> None:
        if delay_s <= 0:
            pkt.accept()
        else:
            held.append((clock() + delay_s, pkt))

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # a killed bench leaves no real-time reader behind
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake on time, not 50 µs late
    try:  # run before the busy workers when a packet is due (a little CPU per packet, so no starvation)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        pass  # not root or no real-time class: ordinary scheduling, later wake-ups under load
    nfq = NetfilterQueue()
    nfq.bind(queue, on_packet, max_len=65536, mode=COPY_META)  # metadata only: the payload stays in the kernel
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    fd = nfq.get_fd()
    print("ready", flush=True)
    try:
        while not stop:
            wait = max(0.0, held[0][0] - clock()) if held else 0.5
            if select.select([fd], [], [], wait)[0]:
                nfq.run(block=False)
            now = clock()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
    finally:
        while held:
            held.popleft()[1].accept()
        nfq.unbind()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.nfq_delay", description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=float, required=True, help="one-way delay added to every packet, milliseconds")
    p.add_argument("--queue", type=int, default=0, help="netfilter queue number (default 0)")
    a = p.parse_args(argv)
    if a.ms < 0 or not 0 <= a.queue < 65536:
        print("nfq_delay: --ms must be >= 0 and --queue in 0..65535", file=sys.stderr)
        return 2
    try:
        serve(a.queue, a.ms / 1000)
    except ImportError:
        print("nfq_delay: needs the NetfilterQueue package (pip install NetfilterQueue)", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"nfq_delay: cannot bind queue {a.queue}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
