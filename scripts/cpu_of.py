"""The CPU a command takes, its descendants' included, even those it never reaps.

    OMP_NUM_THREADS=1 python3 scripts/cpu_of.py python -m pytest -q -n 0 tests/test_x.py

`/usr/bin/time` counts the children a process reaps. The suite's forked workers are children of the
fork server (tests/forkserver.py), which the test process never reaps, so their CPU is missing
there. This wrapper makes itself the child subreaper (prctl PR_SET_CHILD_SUBREAPER): every orphaned
descendant becomes its child, it reaps them all, and getrusage(RUSAGE_CHILDREN) then holds the
whole tree's CPU. Prints one line on stderr and exits with the command's status. Linux only.
(docs/testing.md, "What the tests cost".)
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: cpu_of.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"cpu_of.py: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"cpu_of.py: {argv[0]}: {e.strerror}", file=sys.stderr)
        os._exit(127)  # exec failed
    code = 0
    while True:  # the command, then every orphan handed to this process, until none is left
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"cpu_of.py: {r.ru_utime + r.ru_stime:.1f} s of CPU ({r.ru_utime:.1f} user + {r.ru_stime:.1f} system), "
        f"{time.monotonic() - t0:.1f} s wall, exit {code}",
        file=sys.stderr,
    )
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
