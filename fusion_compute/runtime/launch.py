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
from typing import IO, NoReturn, Protocol

from ..comm.peer_text import printable


class Proc(Protocol):
    """What WorkerProcs needs of a started worker: subprocess.Popen's face."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def terminate_all(procs: Sequence[Proc], grace_s: float) -> None:
    """Stop every process still running: SIGTERM to all first (politely: an mpiexec then stops the
    processes it started), then SIGKILL to any still there when `grace_s` has passed; waits for each."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


_LEAVING = threading.Lock()


def leave_now(code: int) -> NoReturn:
    """End this worker process at once (os._exit: no interpreter teardown). Two threads can decide to
    leave together (the main thread at the job's end, the pulse thread when the client's link closes):
    the first one exits and the other waits here, so what runs inside os._exit runs once. (Under
    scripts/coverage.sh, coverage.py saves its data there; two saves at once crashed a worker with
    SIGSEGV.)"""
    _LEAVING.acquire()
    os._exit(code)


def die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the worker if the client dies, even by SIGKILL.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def popen_worker(args: list[str], env: dict[str, str], log: IO[bytes], stdin: bytes | None) -> Proc:
    """Start `fusion worker ARGS` as a fresh Python process, its output into `log`, `stdin` (its
    secret key) written to its standard input and closed."""
    cmd = [sys.executable, "-m", "fusion_compute", "worker", *args]
    # Own session: a Ctrl-C at the terminal is the client's to handle (`fusion chat` stops a
    # reply with it); the workers still die with the client (PDEATHSIG) or are stopped by it.
    p = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        env=env,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )
    if stdin is not None:
        assert p.stdin is not None
        try:
            p.stdin.write(stdin)
            p.stdin.close()
        except OSError:
            pass  # it died at once; the watchdog reports its last words
    return p


Launcher = Callable[[list[str], dict[str, str], IO[bytes], "bytes | None"], Proc]
_launcher: Launcher = popen_worker


def use_launcher(launcher: Launcher | None) -> Launcher:
    """Start local workers with `launcher` from now on (None: `popen_worker`, the default); returns
    the one it replaces. The seam is for the test suite, which starts workers from a fork server
    that has already imported torch (tests/forkserver.py); a worker is the same program either way."""
    global _launcher
    previous, _launcher = _launcher, launcher or popen_worker
    return previous


MAX_WORDS = 300  # characters of a worker's last words kept in errors, logs and the gateway's /health
LOG_TAIL = 1 << 16  # bytes of a worker's output read to find its last words (the file itself may grow)


def last_words_of(log: IO[bytes], returncode: int | None) -> str:
    """`last_words` of the last LOG_TAIL bytes of a worker's output file: a worker that logged for
    hours costs the client no more to read than one that logged nothing. Read with pread, so the
    file offset the worker writes at (shared with this descriptor) does not move."""
    fd = log.fileno()
    size = os.fstat(fd).st_size
    tail = os.pread(fd, LOG_TAIL, max(0, size - LOG_TAIL))
    if size > LOG_TAIL:  # the first line read is likely a piece of one
        tail = tail.partition(b"\n")[2]
    return last_words(tail.decode(errors="replace"), returncode)


def last_words(log: str, returncode: int | None) -> str:
    """What a worker's output says went wrong: its own one-line error (cli.main's) if it printed
    one, though a native library may print more after it (MPICH: "terminate called ..." at exit),
    else its last line, else its exit code."""
    lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("@fusion-progress ")]
    own = [ln for ln in lines if ln.startswith("fusion worker") and ": error: " in ln]
    words = printable((own or lines or [f"exit code {returncode}"])[-1].strip())  # a process's text: data
    return words if len(words) <= MAX_WORDS else words[: MAX_WORDS - 3] + "..."  # it may reach /health


class WorkerProcs:
    """N local worker processes plus a watchdog that reports one that dies unexpectedly."""

    def __init__(
        self,
        args_for_rank: Callable[[int], Sequence[str]],
        n_workers: int,
        env: dict[str, str] | None = None,
        stdin_for_rank: Callable[[int], bytes] | None = None,
    ):
        """`stdin_for_rank(rank)`: bytes written to the worker's stdin, then closed (its secret key:
        never on a command line or in the environment, which other local users can read)."""
        self.procs: list[Proc] = []
        self.logs: list[IO[bytes]] = []
        self.closing = False
        self.failures: list[tuple[int, str]] = []
        self.quiet = True  # during start-up the client's own error says it; afterwards the watchdog does
        self.retired: set[int] = set()  # ranks told to leave (revoked): their exit is expected
        self._args, self._stdin = args_for_rank, stdin_for_rank
        self._env = {**os.environ, **(env or {})}
        for rank in range(1, n_workers + 1):
            self.spawn(rank)
        atexit.register(self.stop)
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()

    def spawn(self, rank: int) -> Proc:
        """Start the worker process for participant `rank` (ranks are consecutive from 1)."""
        log = tempfile.TemporaryFile(mode="w+b")
        stdin = self._stdin(rank) if self._stdin is not None else None
        p = _launcher(list(self._args(rank)), self._env, log, stdin)
        self.procs.append(p)
        self.logs.append(log)
        return p

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def last_error(self, i: int) -> str:
        return last_words_of(self.logs[i], self.procs[i].returncode)

    def exit_reason(self, rank: int) -> str | None:
        """ "worker RANK exited: <its last words>" if participant `rank`'s process has ended, else None."""
        i = rank - 1
        if not 0 <= i < len(self.procs) or self.procs[i].poll() is None:
            return None
        return f"worker {rank} exited: {self.last_error(i)}"

    def _watchdog(self) -> None:
        """Notice a worker that exits unexpectedly and say which, with its last words. The client
        itself learns it from its links (the connection closes) or from `failure()` at start-up;
        this thread never kills the process it runs in (a gateway or a test may host the client)."""
        reported: set[int] = set()
        while not self.closing:
            for i, p in enumerate(self.procs):
                if i not in reported and p.poll() is not None and not self.closing and i + 1 not in self.retired:
                    reported.add(i)
                    self.failures.append((i + 1, self.last_error(i)))
                    if not self.quiet:
                        sys.stderr.write(
                            f"fusion: worker {i + 1} (pid {p.pid}) exited unexpectedly: {self.failures[-1][1]}\n"
                        )
                        sys.stderr.flush()
            time.sleep(0.2)

    def failure(self) -> tuple[int, str] | None:
        """(rank, last error line) of the first worker that exited unexpectedly, if any."""
        return self.failures[0] if self.failures else None

    def stop(self, grace_s: float = 3.0) -> None:
        self.closing = True
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        terminate_all(self.procs, 2.0)
