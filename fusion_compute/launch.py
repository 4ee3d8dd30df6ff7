"""Start and stop local worker processes (loopback). Every PID we start, we stop."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the worker if the client dies, even by SIGKILL.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class WorkerProcs:
    """N local worker processes plus a watchdog that fails fast if one dies unexpectedly."""

    def __init__(self, args_for_rank: Callable[[int], Sequence[str]], n_workers: int, env: dict[str, str] | None = None):
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.closing = False
        child_env = {**os.environ, **(env or {})}
        for rank in range(1, n_workers + 1):
            log = tempfile.TemporaryFile(mode="w+b")
            cmd = [sys.executable, "-m", "fusion_compute.worker", *args_for_rank(rank)]
            # Own session: a Ctrl-C at the terminal is the client's to handle (`fusion chat` stops a
            # reply with it); the workers still die with the client (PDEATHSIG) or are stopped by it.
            p = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=child_env, preexec_fn=_die_with_parent,
                start_new_session=True,
            )  # fmt: skip
            self.procs.append(p)
            self.logs.append(log)
        atexit.register(self.stop)
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def last_error(self, i: int) -> str:
        log = self.logs[i]
        log.seek(0)
        text = log.read().decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("@fusion-progress ")]
        return lines[-1] if lines else f"exit code {self.procs[i].returncode}"

    def _watchdog(self) -> None:
        while not self.closing:
            for i, p in enumerate(self.procs):
                if p.poll() is not None and not self.closing:
                    msg = self.last_error(i)
                    sys.stderr.write(f"error: worker {i + 1} exited unexpectedly: {msg}\n")
                    sys.stderr.flush()
                    self.stop(grace_s=0)
                    os._exit(1)  # the client cannot continue without a shard; never hang
            time.sleep(0.2)

    def stop(self, grace_s: float = 3.0) -> None:
        self.closing = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
