"""Waiting until sockets have something to read, at any descriptor number.

`select.select` takes an fd_set, a bitmap of FD_SETSIZE (1,024) bits: a descriptor numbered 1,024
or above raises ValueError ("filedescriptor out of range in select()"). A server that holds a
thousand HTTP connections gives its links such numbers, and every wait on them would fail. poll(2)
takes a list of descriptors instead, with no ceiling; `selectors.PollSelector` is its face in the
standard library. It is made for each wait: a poll selector holds no descriptor of its own (an
epoll selector would open one per wait, or keep one per link and outlive closed sockets), and its
cost is one poll(2) call, as select's was.

A descriptor in error or hung up counts as readable, as with select: the read that follows raises
what went wrong (a closed peer, a reset).
"""

from __future__ import annotations

import selectors
from collections.abc import Iterable
from typing import Protocol, TypeVar


class HasFileno(Protocol):
    def fileno(self) -> int: ...


T = TypeVar("T", bound="HasFileno | int")


def readable(objs: Iterable[T], timeout_s: float | None) -> list[T]:
    """Those of `objs` (sockets, files: anything with `fileno()`, or descriptors) that have something to read, or an
    error or end to report, within `timeout_s` seconds (None: wait until one has; 0 or less: look
    once; none given: [] at once). Raises ValueError for a closed one (fileno -1), as select did."""
    with selectors.PollSelector() as sel:
        for obj in objs:
            sel.register(obj, selectors.EVENT_READ)
        if not sel.get_map():
            return []
        wait = None if timeout_s is None else max(0.0, timeout_s)
        return [key.fileobj for key, _ in sel.select(wait)]  # type: ignore[misc]
