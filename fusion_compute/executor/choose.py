"""The one place a job's executor is chosen, from its options (vLLM's `Executor.get_class` does the
same for uni-process, multiprocess and Ray)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Executor
from .inproc import InprocExecutor
from .listed import ListedExecutor
from .local import LocalExecutor

if TYPE_CHECKING:
    from ..runtime.engine_options import EngineOptions


def executor_for(opts: EngineOptions) -> Executor:
    """Listed workers when the options name them (--topology, --master), else `--executor`'s: local
    processes (default), Ray actors, or threads of this process. `opts.check()` has refused the
    combinations that cannot work."""
    secure = not opts.insecure
    if opts.topology is not None or opts.master is not None:
        return ListedExecutor(secure, opts.topology, opts.key, opts.master, mpi=opts.mpi_world)
    if opts.executor == "ray":
        from .ray import RayExecutor  # Ray is an optional extra: imported only when asked for

        return RayExecutor(secure, opts.ray_address, opts.ray_cpus, opts.join_timeout_s)
    if opts.executor == "inproc":
        assert opts.run_worker is not None  # (check_inproc)
        return InprocExecutor(secure, opts.run_worker)
    return LocalExecutor(secure, opts.spawn)
