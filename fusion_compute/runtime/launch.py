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


# How a local worker is started: `popen_worker`, or a caller's own (executor/local.py; the test
# suite forks its workers from a server that has already imported torch, tests/forkserver.py).
Launcher = Callable[[list[str], dict[str, str], IO[bytes], "bytes | None"], Proc]


MAX_WORDS = 300  # characters of a worker's last words kept in errors, logs and the gateway's /health
WATCH_S = 0.2  # how often the watchdog looks at the workers
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
    """N workers started by an executor's launcher (executor/), plus a watchdog that reports one that
    dies unexpectedly.

    Each worker's output goes to an unlinked temporary file that only this object holds open: the
    client reads its last words from it. A server lives for weeks and replaces workers (revoked,
    lost, added), so a worker's file is closed as soon as its exit is seen (the watchdog looks every
    WATCH_S), its last words kept as text first; `stop` closes the rest. Open files are then bounded
    by the live workers, and a deleted file's disk space is returned when its worker is gone."""

    def __init__(
        self,
        args_for_rank: Callable[[int], Sequence[str]],
        n_workers: int,
        env: dict[str, str] | None = None,
        stdin_for_rank: Callable[[int], bytes] | None = None,
        launcher: Launcher = popen_worker,
    ):
        """`stdin_for_rank(rank)`: bytes written to the worker's stdin, then closed (its secret key:
        never on a command line or in the environment, which other local users can read).
        `launcher`: what starts one worker (the executor's: a local process, a Ray actor)."""
        self.procs: list[Proc] = []
        self.logs: list[IO[bytes]] = []  # a finished worker's is closed (its fileno() raises ValueError)
        self.closing = False
        self._stopping = threading.Event()  # `stop` wakes the watchdog at once (its join waited up to WATCH_S)
        self.failures: list[tuple[int, str]] = []
        self.quiet = True  # during start-up the client's own error says it; afterwards the watchdog does
        self.retired: set[int] = set()  # ranks told to leave (revoked): their exit is expected
        self._args, self._stdin, self._launcher = args_for_rank, stdin_for_rank, launcher
        self._env = {**os.environ, **(env or {})}
        self._final: dict[int, str] = {}  # index -> last words of a worker whose file is closed
        self._files = threading.Lock()  # a file is read or closed by one thread at a time
        try:
            for rank in range(1, n_workers + 1):
                self.spawn(rank)
        except BaseException:  # one could not start: those that did go too, with their files
            terminate_all(self.procs, 0.0)
            for log in self.logs:
                log.close()
            raise
        atexit.register(self.stop)
        self._watch = threading.Thread(target=self._watchdog, name="fusion-worker-watch", daemon=True)
        self._watch.start()

    def spawn(self, rank: int) -> Proc:
        """Start the worker process for participant `rank` (ranks are consecutive from 1)."""
        log = tempfile.TemporaryFile(mode="w+b")
        try:
            stdin = self._stdin(rank) if self._stdin is not None else None
            p = self._launcher(list(self._args(rank)), self._env, log, stdin)
        except BaseException:
            log.close()
            raise
        self.procs.append(p)
        self.logs.append(log)
        return p

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def last_error(self, i: int) -> str:
        with self._files:
            if i in self._final:
                return self._final[i]
            return last_words_of(self.logs[i], self.procs[i].returncode)

    def output_tail(self, i: int, size: int) -> str:
        """The last `size` bytes of worker index `i`'s output ("" once its file is closed), read with
        pread under the files' lock: never from a descriptor closed, and its number reused, meanwhile."""
        with self._files:
            if i in self._final:
                return ""
            fd = self.logs[i].fileno()
            end = os.fstat(fd).st_size
            return os.pread(fd, min(size, end), max(0, end - size)).decode(errors="replace")

    def _settle(self, i: int) -> None:
        """Worker index `i` has exited: keep its last words, close its output file."""
        with self._files:
            if i not in self._final:
                self._final[i] = last_words_of(self.logs[i], self.procs[i].returncode)
                self.logs[i].close()

    def exit_reason(self, rank: int) -> str | None:
        """ "worker RANK exited: <its last words>" if participant `rank`'s process has ended, else None."""
        i = rank - 1
        if not 0 <= i < len(self.procs) or self.procs[i].poll() is None:
            return None
        return f"worker {rank} exited: {self.last_error(i)}"

    def _watchdog(self) -> None:
        """Notice a worker that exits unexpectedly and say which, with its last words; close the
        output file of every worker that exited (expectedly or not). The client itself learns of a
        loss from its links (the connection closes) or from `failure()` at start-up; this thread
        never kills the process it runs in (a gateway or a test may host the client)."""
        reported: set[int] = set()
        while not self.closing:
            for i, p in enumerate(list(self.procs)):
                if i in self._final or p.poll() is None or self.closing:
                    continue
                if i not in reported and i + 1 not in self.retired:
                    reported.add(i)
                    self.failures.append((i + 1, self.last_error(i)))
                    if not self.quiet:
                        sys.stderr.write(
                            f"fusion: worker {i + 1} (pid {p.pid}) exited unexpectedly: {self.failures[-1][1]}\n"
                        )
                        sys.stderr.flush()
                self._settle(i)
            self._stopping.wait(WATCH_S)

    def failure(self) -> tuple[int, str] | None:
        """(rank, last error line) of the first worker that exited unexpectedly, if any."""
        return self.failures[0] if self.failures else None

    def stop(self, grace_s: float = 3.0) -> None:
        """Wait up to `grace_s` for the workers to leave (they were told to), stop any still there,
        and close every output file: afterwards this object holds no process, thread or descriptor."""
        self.closing = True
        self._stopping.set()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        terminate_all(self.procs, 2.0)
        if threading.current_thread() is not self._watch:
            self._watch.join(timeout=2 * WATCH_S + 1.0)
        for i in range(len(self.procs)):
            self._settle(i)
        atexit.unregister(self.stop)  # (else the registry would keep this object, and its files, for life)
