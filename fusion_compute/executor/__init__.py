"""Who starts a job's workers, where, and who watches them: the executor seam (docs/executors.md).

`executor_for(opts)` is the one place a job's executor is chosen; the engine (runtime/engine.py)
asks it for the roster, the address to listen at, and to launch and stop the workers. The TLS links
(comm/) stay the data path whatever the executor: an executor only places and supervises."""

from .base import EXECUTORS, Executor, WorkerJob
from .choose import executor_for

__all__ = ["EXECUTORS", "Executor", "WorkerJob", "executor_for"]
