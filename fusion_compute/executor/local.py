"""Workers as processes on this machine (`fusion generate --workers N`, the default executor).

Each worker is `fusion worker ARGS` started by a spawn function: `popen_worker` (a fresh Python
process) unless the caller passes another one. The test suite passes its fork server's
(tests/forkserver.py: a child forked from a process that has already imported torch); a worker is
the same program either way. Every worker listens on loopback and is pinned by a fresh key."""

from __future__ import annotations

from ..runtime.launch import Launcher, WorkerProcs, popen_worker
from .base import Executor, WorkerJob


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, secure: bool, spawn: Launcher | None = None):
        super().__init__(secure)
        self.spawn = spawn or popen_worker

    def launch(self, job: WorkerJob) -> WorkerProcs:
        return WorkerProcs(job.args, job.seats, job.env, stdin_for_rank=job.secret, launcher=self.spawn)
