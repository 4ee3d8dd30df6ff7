"""Workers as threads of the client's own process (`--executor inproc`), for tests: no process is
started, nothing is imported twice, and the job is otherwise the real one.

Each seat's worker runs `fusion worker ARGS` (the same command line, the same options and the same
shell, structural/worker.py) in a thread of this process, through the entry the command line hands
the options (`EngineOptions.run_worker`: cli/worker_thread.py; this package may not import the
worker). It joins the client over the real rendezvous, on 127.0.0.1, with its own fresh key over
TLS (or plaintext with --insecure), so the protocol's bytes, the links, the epochs and the audit are
those of a job of processes.

What a thread cannot do, and what it does instead (the rest of the process is shared):
- leave with os._exit: its shell runs with `own_process=False`, so when the client's link closes it
  cuts its own links and returns; an error ends the thread, its one line written to its log as a
  process's last words are;
- set torch's thread count (process-wide): the process's own count is left as it is;
- keep its own resources: the peak RSS a worker reports (HELLO, PING) is the whole process's;
  the environment the engine gives its workers (thread counts) is not applied;
- be killed: `terminate` asks the worker to leave (as its client's link closing would), and `kill`,
  when that was not enough, gives the thread up (a daemon, it ends with the process).
The controls that end or patch a process (`--inject-fault`, `--inject-leak`) are refused in a
thread; the tests of faults keep real processes.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from typing import IO

from ..comm import reason_of
from ..runtime.launch import MAX_WORDS, WorkerProcs
from .base import Executor, WorkerJob

# run_worker(args, secret, on_leave): run `fusion worker ARGS` in the calling thread, its key bundle
# `secret` given as bytes (a process reads it on stdin); `on_leave(leave)` is handed, once the worker
# has joined, the callable that makes it leave (the thread's terminate).
WorkerMain = Callable[[list[str], "bytes | None", Callable[[Callable[[], None]], None]], None]


class ThreadWorker:
    """runtime.launch.Proc's face over one worker thread. It has no pid of its own (-1: nothing to
    signal); its exit status is 0 when `run_worker` returned, 1 when it raised (the error's line
    written to `log` first, as `fusion worker: error: ...`), -9 once given up by `kill`."""

    def __init__(self, run_worker: WorkerMain, args: list[str], log: IO[bytes], stdin: bytes | None, name: str):
        self.pid = -1
        self.returncode: int | None = None
        self._log = log
        self._leave: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, args=(run_worker, args, stdin), name=name, daemon=True)
        self._thread.start()

    def _run(self, run_worker: WorkerMain, args: list[str], stdin: bytes | None) -> None:
        code = 0
        try:
            run_worker(args, stdin, self._on_leave)
        except SystemExit as e:  # argparse's refusal of a bad command line
            code = e.code if isinstance(e.code, int) else 1
            if code:
                self._say(f"fusion worker: error: exit status {code}")
        except BaseException as e:
            code = 1
            self._say(f"fusion worker: error: {reason_of(e)}")
        self.returncode = code if self.returncode is None else self.returncode

    def _say(self, line: str) -> None:
        try:
            self._log.write(line[:MAX_WORDS].encode(errors="replace") + b"\n")
            self._log.flush()
        except (OSError, ValueError):  # its supervisor closed the log meanwhile (gave it up)
            pass

    def _on_leave(self, leave: Callable[[], None]) -> None:
        self._leave = leave

    def poll(self) -> int | None:
        return None if self._thread.is_alive() and self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._thread.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"worker thread {self._thread.name}", timeout or 0)
        return code

    def terminate(self) -> None:
        """Ask the worker to leave, as its client's link closing would: its shards wiped, its links
        cut, its `run` returning. Before it has joined there is nothing to cut: `kill` gives it up."""
        leave = self._leave
        if leave is not None and self._thread.is_alive():
            leave()

    def kill(self) -> None:
        """A thread cannot be killed: it is given up (its end taken as known, -9); a daemon, it does
        not keep the process alive."""
        if self._thread.is_alive() and self.returncode is None:
            self._say("given up: its thread did not end when asked")
            self.returncode = -9

    @property
    def thread(self) -> threading.Thread:
        return self._thread


class InprocExecutor(Executor):
    name = "inproc"

    def __init__(self, secure: bool, run_worker: WorkerMain):
        super().__init__(secure)
        self.run_worker = run_worker
        self.workers: list[ThreadWorker] = []

    def launch(self, job: WorkerJob) -> WorkerProcs:
        return WorkerProcs(job.args, job.seats, job.env, stdin_for_rank=job.secret, launcher=self._spawn)

    def _spawn(self, args: list[str], env: dict[str, str], log: IO[bytes], stdin: bytes | None) -> ThreadWorker:
        w = ThreadWorker(self.run_worker, args, log, stdin, name=f"fusion-worker-{len(self.workers) + 1}")
        self.workers.append(w)
        return w

    def where(self) -> str | None:
        return "workers as threads of this process (--executor inproc: for tests), their links on loopback"
