"""What this process holds: its peak resident set (what a worker reports at HELLO and PING) and
handing freed heap pages back to the OS.

Per process, not per worker: workers run as threads of one process (executor/inproc.py) share one
figure, the whole process's."""

from __future__ import annotations

import resource


def rss_kb() -> int:
    """Peak resident set size of this process, kB (Linux ru_maxrss)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere), so peak RSS
    reflects what the worker holds, not the transients of cutting its slices."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
