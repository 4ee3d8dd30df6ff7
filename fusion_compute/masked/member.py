"""A masked worker process after it joined: which member it plays (the honest one, or a test's
dishonest one from controls.py, chosen once here), its audit log and its comm, then its loop
(worker.MaskedWorker)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm import Comm, farewell_on_failure
from ..errors import UsageError
from ..runtime.faults import Fault, parse_fault
from ..weights.loader import WeightSource
from .controls import member_class
from .plan import make_masked_plan


def run_member(
    src: WeightSource,
    welcome: dict,
    rank: int,
    links: dict,
    o: Any,
    keep: Callable[[Any], None] = lambda log: None,
    counting: Callable[[WeightSource, int], WeightSource] = lambda src, total: src,
) -> None:
    """A masked worker process after joining: `welcome` names the group sizes; `o` is
    worker.WorkerOptions; `keep` is handed the audit log (the process flushes it if it must exit);
    `counting(src, total)` wraps the weight source to report load progress (progress.CountingSource)."""
    from .audit import AuditLog
    from .ring import limit_blas_threads

    if o.device != "cpu":
        raise RuntimeError(f"the masked mode runs on the CPU; this worker was started on {o.device}")
    sizes = tuple(int(x) for x in welcome["groups"])
    fault = parse_fault(o.controls.fault) if o.controls.fault else None
    if fault is not None and not fault.lie:
        raise UsageError(f"--inject-fault {o.controls.fault}: a masked worker knows only the lie-* faults")
    if o.own_process:  # process-wide: a worker run as a thread (executor/inproc.py) leaves it to its process
        limit_blas_threads(o.threads or torch.get_num_threads())  # the ring product's BLAS (numpy's OpenBLAS) too
    plan = make_masked_plan(src.config, sizes[0], sizes[1:], 8)  # the limb width changes no row counts
    group = plan.group_of(rank)[0] if rank <= sum(sizes) else None
    if group is not None:
        src = counting(src, plan.weight_elements(*plan.group_of(rank)))
    epoch = int(welcome.get("epoch") or 0)
    audit = AuditLog(o.audit_dir, rank, "worker", group, sizes, epoch=epoch) if o.audit_dir else None
    if audit is not None:
        keep(audit)
    comm = Comm(
        rank, sum(sizes), links, timeout_s=o.timeout_s, recorder=audit, backend="tls" if o.key else "tcp", epoch=epoch
    )
    try:
        with farewell_on_failure(links):  # a failure of its own is said before the links close
            run(src, sizes, rank, comm, audit=audit, leak=o.controls.leak, fault=fault)
    finally:
        if audit is not None:
            audit.close()
        comm.close()


def run(
    src: WeightSource,
    sizes: tuple[int, ...],
    rank: int,
    comm: Comm,
    *,
    audit=None,
    leak: str | None = None,
    fault: Fault | None = None,
) -> None:
    if leak not in (None, "a-to-b"):
        raise ValueError(f"masked workers know one negative control, a-to-b (no-mask is the client's); got {leak!r}")
    if rank < 1 or rank > sum(sizes):
        raise ValueError(f"rank {rank} is not a worker of a {'+'.join(map(str, sizes))} job")
    cls, extra = member_class(leak, fault)  # the honest member, or a test's dishonest one (controls.py)
    cls(src, sizes, rank, comm, audit=audit, **extra).serve()
