"""Start the suite's local workers from a fork server that has already imported torch.

A worker started by `subprocess.Popen` spends 2-3 s of CPU importing torch and the package before
it does anything; the suite starts several hundred. `runtime.launch.use_launcher` lets the tests
hand WorkerProcs this launcher instead: multiprocessing's forkserver (the standard library's)
imports torch and the worker's modules once, then forks a child per worker, which runs the very
`fusion worker ARGS` entry point with the worker's environment, log and stdin (its secret key).

What differs from a Popen'd worker, and why the tests that check it keep real processes (the
`real_workers` fixture in conftest.py; `fusion` command-line tests start their own anyway):
- its parent is the fork server, not the client: PR_SET_PDEATHSIG fires when the fork server
  exits, which it does when the test process does (its alive pipe closes), so a worker still dies
  with the test run, one step removed;
- its command line is the fork server's, so `pgrep -f "fusion_compute worker"` misses it
  (procs.children() counts the fork server's children as the test process's own);
- torch was imported under the fork server's environment: a variable read only at import time
  (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS) is not re-read; the workers set their thread counts
  at run time (torch.set_num_threads; masked/ring.py's limit_blas_threads for OpenBLAS).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.reduction
import os
import subprocess
import sys
from typing import IO

# What a worker imports before it serves, so that no forked child imports it again: the profile of
# a suite run (py-spy) showed cryptography's serialization, imported lazily by the key file's
# loader, costing ~0.25 s of CPU in each of ~300 forked workers.
PRELOAD = [
    "torch",
    "numpy",
    "cryptography.hazmat.primitives.asymmetric.ed25519",
    "cryptography.hazmat.primitives.serialization",
    "cryptography.x509",
    "fusion_compute.cli.main",
    "fusion_compute.cli.serve",
    "fusion_compute.cli.chat",
    "fusion_compute.audit.cli",
    "fusion_compute.bench.run",
    "fusion_compute.structural.worker",
    "fusion_compute.masked.member",
    "fusion_compute.masked.worker",
    "fusion_compute.weights.gguf",
]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload([*PRELOAD, __name__])


class _Fd:
    """A file descriptor handed to the child over the fork server's socket (SCM_RIGHTS), as
    multiprocessing hands a Connection: duplicated while the Process is pickled."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _rebuild_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _rebuild_fd(dup) -> int:
    return dup.detach()


def _worker(args: list[str], env: dict[str, str], log_fd: int, stdin: bytes | None) -> None:
    """The child: the worker's session, environment, output and stdin, then `fusion worker ARGS`."""
    os.setsid()
    from fusion_compute.runtime.launch import die_with_parent

    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    if stdin is not None:  # small (a PEM bundle): it fits the pipe's buffer before anyone reads
        r, w = os.pipe()
        os.write(w, stdin)
        os.close(w)
        os.dup2(r, 0)
        os.close(r)
    sys.stdin = open(0, closefd=False) if stdin is not None else open(os.devnull)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    from fusion_compute.cli.main import main

    sys.exit(main(["worker", *args]))


class ForkedWorker:
    """subprocess.Popen's face (runtime.launch.Proc) over a forked multiprocessing.Process."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._p = process
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return None if self._p.is_alive() else self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0)
        return self._p.exitcode

    def terminate(self) -> None:
        if self._p.exitcode is None:
            self._p.terminate()

    def kill(self) -> None:
        if self._p.exitcode is None:
            self._p.kill()


def forked_worker(args: list[str], env: dict[str, str], log: IO[bytes], stdin: bytes | None) -> ForkedWorker:
    """runtime.launch's Launcher: `fusion worker ARGS`, forked from the fork server."""
    p = _context.Process(target=_worker, args=(args, env, _Fd(log.fileno()), stdin), daemon=True)
    p.start()
    return ForkedWorker(p)


def helper_pids() -> set[int]:
    """The fork server's and multiprocessing's resource tracker's pids, those started so far: the
    test process's own children for the whole run (the forked workers are the fork server's)."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None)}
    pids.add(getattr(resource_tracker._resource_tracker, "_pid", None))
    return {p for p in pids if p is not None}
