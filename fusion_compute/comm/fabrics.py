"""Which fabric carries one epoch's worker collectives: the one place a worker turns the client's
word (WELCOME's "fabric": {"backend": ..., "store": ...}) into a fabric, or into none (the links).

  mpi            MpiFabric (mpi_fabric.py): shared memory on one machine, or the mpiexec world
  gloo, nccl     TorchFabric (torch_fabric.py): torch.distributed, its TCPStore at "store"
  (no word)      None: the collectives run on the links (tls, or tcp when --insecure)

Each fabric module is imported only when its backend is named: mpi4py and torch.distributed load
only in the workers that use them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .comm import Fabric


def open_fabric(
    spec: Mapping[str, Any] | None,
    worker: int,
    n_workers: int,
    *,
    timeout_s: float,
    score_groups: Sequence[Sequence[int]] = (),
    device: str = "cpu",
) -> Fabric | None:
    """This worker's fabric for the epoch the client described (`spec`: WELCOME's "fabric"), or None
    when the workers' collectives run on the links. `worker` counts from 0 (participant rank - 1);
    `score_groups`: the plan's split KV groups, each a sub-group of the fabric."""
    if not spec:
        return None
    backend, store = str(spec["backend"]), str(spec["store"])
    if backend == "mpi":
        from .mpi_fabric import MpiFabric

        return MpiFabric(worker, n_workers, store, timeout_s=timeout_s, score_groups=score_groups)
    import torch

    from .torch_fabric import TorchFabric

    return TorchFabric(
        backend, worker, n_workers, store, timeout_s=timeout_s, score_groups=score_groups, device=torch.device(device)
    )


def backend_of(spec: Mapping[str, Any] | None, secure: bool) -> str:
    """The comm backend an epoch runs on (`Comm.backend`): the fabric's, else the links' own."""
    return str(spec["backend"]) if spec else ("tls" if secure else "tcp")
