"""The test process's open file descriptors and threads: counted around what a test does (an engine's
life, rounds of revocations), and many held open at once (a busy server's, past select's 1,024)."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

SELECT_CEILING = 1024  # FD_SETSIZE: select.select refuses a descriptor numbered this or above


def open_descriptors(pid: int | str = "self") -> dict[int, str]:
    """Every open descriptor of process `pid` (this one by default): number -> what it is (a file's
    path, "socket:[inode]", "pipe:[inode]", ...)."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor among them)
    return out


def threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def settled(before: dict[int, str], timeout_s: float = 5.0) -> dict[int, str]:
    """The open descriptors once none is open that `before` lacks, or after `timeout_s`. Some close a
    moment after the call that ends their use: a retired worker's output file when the watchdog sees
    its exit (launch.WATCH_S), a closed link when its peer's end is gone. A leak never settles."""
    deadline = time.monotonic() + timeout_s
    while new_since(before, now := open_descriptors()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def new_since(before: dict[int, str], now: dict[int, str]) -> list[str]:
    """What is open now and was not (by number and kind): what a test left open. (Measured against
    what was open, not only counted: under pytest an earlier test's leftovers may close meanwhile.)"""
    return [f"{fd}: {what}" for fd, what in sorted(now.items()) if before.get(fd) != what]


def kind(what: str) -> str:
    """What a descriptor is, without its identity: "socket", "pipe", "deleted file", or its path."""
    if what.endswith(" (deleted)"):
        return "deleted file"
    return what.split(":[", 1)[0] if what.endswith("]") and ":[" in what else what


def more_of_a_kind(before: dict[int, str], timeout_s: float = 5.0) -> dict[str, int]:
    """How many more descriptors of each kind (`kind`) are open now than `before`, once none is or
    after `timeout_s`: for a job whose links are replaced (each epoch's sockets are new ones, and
    may take other numbers), where what counts is that no kind grows."""
    deadline = time.monotonic() + timeout_s
    was = Counter(kind(w) for w in before.values())
    while (extra := Counter(kind(w) for w in open_descriptors().values()) - was) and time.monotonic() < deadline:
        time.sleep(0.05)
    return dict(extra)


def new_threads(before: list[str], timeout_s: float = 5.0) -> list[str]:
    """The names of the threads running now that were not `before`, once there are none or after
    `timeout_s` (a closed link's writer thread ends a moment after the close)."""
    deadline = time.monotonic() + timeout_s
    while (extra := list((Counter(threads()) - Counter(before)).elements())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def raise_limit(n: int) -> bool:
    """Let this process open at least `n` descriptors (the soft limit raised up to the hard one);
    False if the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            return False
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return True


@contextmanager
def holding(n: int) -> Iterator[list[int]]:
    """`n` descriptors open (on /dev/null) for the block's length, so that whatever opens next is
    numbered above them; closed after."""
    held: list[int] = []
    try:
        for _ in range(n):
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield held
    finally:
        for fd in held:
            os.close(fd)
