"""What this process holds: its peak resident set (what a worker reports at HELLO and PING) and
handing freed heap pages back to the OS; and the CPU other processes (a job's local workers) have
spent, for the benches.

Per process, not per worker: workers run as threads of one process (executor/inproc.py) share one
figure, the whole process's."""

from __future__ import annotations

import os
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


def processes_cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes `pids` have spent so far, all their threads (Linux
    /proc, counted in clock ticks, 10 ms: a bench reads it around many steps, or averages)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")
