"""Who starts a job's workers, where, and who watches them: the executor seam (docs/executors.md).

`executor_for(opts)` is the one place a job's executor is chosen (local processes, listed workers,
Ray actors, or threads of this process: inproc.py, for tests); the engine (runtime/engine.py)
asks it for the roster, the address to listen at, and to launch and stop the workers. The TLS links
(comm/) stay the data path whatever the executor: an executor only places and supervises.

May import: comm, errors, and of runtime only the process mechanics (runtime.launch) and the
topology file (runtime.topology), which the engine above it shares. Never model, weights,
structural, masked, generation, serving or cli."""

from .base import EXECUTORS, Executor, WorkerJob
from .choose import executor_for

__all__ = ["EXECUTORS", "Executor", "WorkerJob", "executor_for"]
