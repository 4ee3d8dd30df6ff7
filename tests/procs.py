"""Processes that tests start: the `fusion` command line, and stopping what a test started, by PID,
with bounded waits.

`fusion` and `run` fork the command from the suite's fork server (tests/forkserver.py says what
differs, and which tests start `python -m fusion_compute` (FUSION) as a fresh process instead)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import forkserver

from fusion_compute.runtime.launch import terminate_all

FUSION = [sys.executable, "-m", "fusion_compute"]
# A `fusion` log line off a terminal (cli/logs.py): a UTC timestamp, then the program's name.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z fusion[ a-z]*: ")


def fusion(*args: str, **kw) -> forkserver.ForkedCommand:
    """Start `fusion ARGS` with stdout/stderr piped as text (stdin closed unless given); the other
    keywords are forkserver.command's (e.g. netns, or code for `python -c CODE ARGS`)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("stdin", subprocess.DEVNULL)
    return forkserver.command(list(args), **kw)


def run(*args: str, timeout: float = 120, input: str | None = None, **kw) -> subprocess.CompletedProcess:
    """`fusion ARGS` to its end (subprocess.run's face): `input` on its stdin (else none), stdout and
    stderr as text; killed at `timeout`."""
    kw.setdefault("stdin", subprocess.DEVNULL if input is None else subprocess.PIPE)
    p = forkserver.command(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    try:
        out, err = p.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
        raise
    return subprocess.CompletedProcess([*FUSION, *args], p.wait(), out, err)


def reap(procs: list[subprocess.Popen], grace_s: float = 10) -> None:
    """Stop every process still running (SIGTERM, then SIGKILL after `grace_s`) and wait for it."""
    terminate_all(procs, grace_s)


def children(pid: int) -> set[int]:
    """The live child processes of `pid`, and those the fork server forked for it (its registry).
    For the test process itself, everything the fork server forked counts as its own, and the fork
    server and multiprocessing's resource tracker, which live as long as the test run, do not."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = {int(p) for p in out.split()} | {p for p, (_, parent) in forkserver.registered().items() if parent == pid}
    if pid == os.getpid():
        helpers = forkserver.helper_pids()
        for helper in helpers & kids:
            kids |= children(helper)
        kids -= helpers
    return kids


# Every process this test run starts inherits this variable (conftest.py sets it), workers included,
# so "the workers this run left" excludes those of other runs on the machine (helpers, benches).
RUN_TAG = "FUSION_TEST_RUN"


def worker_pids() -> set[int]:
    """The `fusion_compute worker` processes alive now that this test run started (by RUN_TAG), the
    forked ones included."""
    out = subprocess.run(["pgrep", "-f", "fusion_compute worker"], capture_output=True, text=True).stdout
    mark = f"{RUN_TAG}={os.environ[RUN_TAG]}".encode()
    real = {int(p) for p in out.split() if mark in _environ(int(p))}
    forked = {p for p, (role, _) in forkserver.registered().items() if role == "worker"}
    return {p for p in real | forked if _alive(p)}


def _environ(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:  # gone meanwhile, or not ours to read
        return []


def none_left_after(pid: int, before: set[int], timeout: float = 10) -> None:
    """Every child of `pid` (procs.children) that was not there `before` is gone within `timeout` s.
    Checked after each test in the pytest process that ran it: under xdist a module's tests run in
    several processes, so one check at the module's end would see only its own process's."""
    left = wait_gone(children(pid) - before, timeout)
    assert left == set(), f"processes left running: {sorted(left)}"


def wait_gone(pids: set[int], timeout: float = 10) -> set[int]:
    """The pids among `pids` still alive after waiting up to `timeout` s."""
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if _alive(p)}
        if alive:
            time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone before its stat was opened, or read
        return False
