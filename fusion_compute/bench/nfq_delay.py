"""A fixed one-way delay without `tc netem`: every packet a host sends waits D ms in a netfilter queue.

    ip netns exec NS python -m fusion_compute.bench.nfq_delay --ms 0.5 [--queue 0]

For kernels without `sch_netem` (this project's VM has none). Run in a host's network namespace, it
binds netfilter queue Q through libnetfilter_queue (the C library, called with ctypes), prints
"ready", and then accepts each queued packet D ms after the kernel queued it, in arrival order (a
constant delay keeps the order, as netem's does). bench/netns.py then sends everything arriving on
the host's eth0 to that queue (`iptables -t mangle -A PREROUTING -i eth0 -j NFQUEUE --queue-num Q`),
so a packet between two hosts waits once, at its receiver (why not at its sender: netns.py).

What it costs, and what keeps that small: the queue takes packets whole as TCP built them
(`NFQA_CFG_F_GSO`: a 64 KB segmentation-offload packet is one entry, not 45 wire-sized ones; it is
cut into MTU-sized frames after the verdict, as a NIC would), copies metadata only, and accepts
every packet that is due with one batch verdict (`nfq_set_verdict_batch`: all ids up to the last
due one). The NetfilterQueue package it used before queued every 1,448-byte segment on its own: a
128 KB exchange took 1.3 ms longer at 0 ms added (bench/exchange.py). It still wakes late: a round
trip comes out 0.1-0.5 ms longer than asked, so bench/rtt.py and bench/exchange.py measure the
round trip they really got. It stops on SIGTERM/SIGINT and when its parent (the bench) dies; without
it the rule drops every packet (no silent undelayed path).
Needs root, iptables and libnetfilter-queue (Debian: libnetfilter-queue1).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import os
import selectors
import signal
import socket
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 1 << 2
NF_ACCEPT = 1
RCVBUF = 8 << 20  # the netlink socket's buffer: a queued packet it cannot hold would wait forever

CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def library() -> ctypes.CDLL | None:
    """libnetfilter_queue, or None where it is not installed."""
    name = ctypes.util.find_library("netfilter_queue")
    if name is None:
        return None
    lib = ctypes.CDLL(name, use_errno=True)
    lib.nfq_open.restype = ctypes.c_void_p
    lib.nfq_create_queue.restype = ctypes.c_void_p
    lib.nfq_create_queue.argtypes = [ctypes.c_void_p, ctypes.c_uint16, CALLBACK, ctypes.c_void_p]
    lib.nfq_set_mode.argtypes = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_uint32]
    lib.nfq_set_queue_maxlen.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.nfq_set_queue_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32]
    lib.nfq_fd.argtypes = [ctypes.c_void_p]
    lib.nfq_handle_packet.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.nfq_get_msg_packet_hdr.restype = ctypes.POINTER(ctypes.c_uint8)
    lib.nfq_get_msg_packet_hdr.argtypes = [ctypes.c_void_p]
    lib.nfq_set_verdict_batch.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32]
    lib.nfq_destroy_queue.argtypes = [ctypes.c_void_p]
    lib.nfq_close.argtypes = [ctypes.c_void_p]
    return lib


def serve(queue: int, delay_s: float) -> None:
    lib = library()
    if lib is None:
        raise ImportError("libnetfilter_queue")
    held: collections.deque = collections.deque()  # (due, packet id), both non-decreasing
    clock = time.monotonic

    @CALLBACK
    def on_packet(qh, nfmsg, nfad, data):  # the packet id: a big-endian u32 at the header's start
        hdr = lib.nfq_get_msg_packet_hdr(nfad)
        held.append((clock() + delay_s, int.from_bytes(bytes(hdr[0:4]), "big")))
        return 0

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # a killed bench leaves no real-time reader behind
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake on time, not 50 µs late
    try:  # run before the busy workers when a packet is due (a little CPU per packet, so no starvation)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        pass  # not root or no real-time class: ordinary scheduling, later wake-ups under load
    h = lib.nfq_open()
    qh = lib.nfq_create_queue(h, queue, on_packet, None) if h else None
    if not qh:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()) or "nfq_create_queue failed")
    lib.nfq_set_mode(qh, NFQNL_COPY_META, 0)  # metadata only: the payload stays in the kernel
    lib.nfq_set_queue_maxlen(qh, 65536)
    if lib.nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0:
        print("nfq_delay: this kernel queues segmented packets (no NFQA_CFG_F_GSO)", file=sys.stderr)
    fd = lib.nfq_fd(h)
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE (root)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    buf = ctypes.create_string_buffer(1 << 16)
    view = memoryview(buf).cast("B")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))

    def accept_due(now: float) -> None:
        last = None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            lib.nfq_set_verdict_batch(qh, last, NF_ACCEPT)

    waiting = selectors.PollSelector()  # poll(2): no ceiling on the descriptor's number (select's is 1,024)
    waiting.register(sock, selectors.EVENT_READ)
    print("ready", flush=True)
    try:
        while not stop:
            wait = max(0.0, held[0][0] - clock()) if held else 0.5
            if waiting.select(wait):
                while True:  # every message waiting now, then the verdicts that are due
                    try:
                        n = sock.recv_into(view, len(view), socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    except OSError as e:  # ENOBUFS: the kernel dropped queue messages; those packets are lost
                        print(f"nfq_delay: {e.strerror or e}", file=sys.stderr)
                        break
                    lib.nfq_handle_packet(h, buf, n)
            accept_due(clock())
    finally:
        accept_due(float("inf"))
        lib.nfq_destroy_queue(qh)
        lib.nfq_close(h)
        waiting.close()
        sock.close()


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
        print("nfq_delay: needs libnetfilter_queue (apt install libnetfilter-queue1)", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"nfq_delay: cannot bind queue {a.queue}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
