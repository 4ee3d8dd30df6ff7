"""Waiting until sockets have something to read, at any descriptor number.

`select.select` takes an fd_set, a bitmap of FD_SETSIZE (1,024) bits: a descriptor numbered 1,024
or above raises ValueError ("filedescriptor out of range in select()"). A server that holds a
thousand HTTP connections gives its links such numbers, and every wait on them would fail. poll(2)
takes a list of descriptors instead, with no ceiling. A poll object is made for each wait: it holds
no descriptor of its own (an epoll selector would open one per wait, or keep one per link and
outlive closed sockets), and a wait is one poll(2) call, as it was one select(2).

`select.poll` itself, not the `selectors` module's PollSelector, which wraps the same call in
Python bookkeeping that costs more than the call: a wait on 3 sockets, one of them ready, took a
median 1.7 and 5.4 µs with `select.poll`, 6.0 and 3.3 µs with `select.select`, and 18.8 and 15.5
µs through PollSelector (two runs of 7 interleaved rounds of 2,000 waits each on this project's
2-core machine, loaded, 2026-12-05). A rank that waits on several peers' messages (a reduce-scatter
at N > 2, the client's egress) makes such a wait per arrival, on the data path.

A descriptor in error or hung up, or closed, counts as readable: the read that follows raises
what went wrong (a closed peer, a reset), as after select.
"""

from __future__ import annotations

import math
import select
from collections.abc import Iterable
from typing import Protocol, TypeVar


class HasFileno(Protocol):
    def fileno(self) -> int: ...


T = TypeVar("T", bound="HasFileno | int")


def readable(objs: Iterable[T], timeout_s: float | None) -> list[T]:
    """Those of `objs` (sockets, files: anything with `fileno()`, or descriptors) that have something
    to read, or an error or end to report, within `timeout_s` seconds (None: wait until one has; 0
    or less: look once; none given: [] at once). Raises ValueError for a closed one (fileno -1), as
    select did."""
    poller = select.poll()
    by_fd: dict[int, T] = {}
    for obj in objs:
        fd = obj if isinstance(obj, int) else obj.fileno()
        if fd < 0:
            raise ValueError(f"file descriptor cannot be a negative integer ({fd})")
        by_fd[fd] = obj
        poller.register(fd, select.POLLIN)
    if not by_fd:
        return []
    ms = None if timeout_s is None else math.ceil(max(0.0, timeout_s) * 1000)  # (never 0 for a wait > 0)
    return [by_fd[fd] for fd, _ in poller.poll(ms)]
