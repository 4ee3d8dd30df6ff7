"""Collectives among the workers on torch.distributed: NCCL on GPUs (the trusted GPU fabric), or gloo
(plaintext TCP; kept to compare with the links it replaced: `fusion bench --comm-backends tls,gloo`,
or `--comm-backend gloo --insecure` on a local run).

The client is not part of this group: it talks to the workers over its links (links.py), so its
traffic is TLS whatever the fabric. The fabric's own traffic is NOT encrypted or authenticated
(torch.distributed has neither), so it runs on one machine only: `EngineOptions.check` (engine_options.py)
refuses `--comm-backend gloo` / `nccl` for a `--topology` or `--master` run, with or without --insecure.
gloo is asked for by name (`--insecure`); nccl is the default of a local `--device cuda` run.
Rendezvous: worker 1 hosts a TCPStore at the address the client names in WELCOME; every worker
joins it.

The reduce-scatter is `all_to_all_single` with per-peer split sizes plus a local sum, never
`reduce_scatter`: gloo implements that as an all-reduce followed by keeping one chunk, so every
rank would briefly hold the complete sum (docs/design.md, "The operators"). This is the only module that imports
torch.distributed.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .buffers import accumulate
from .errors import CommError


class TorchFabric:
    def __init__(
        self,
        backend: str,
        worker: int,
        n_workers: int,
        store: str,
        *,
        timeout_s: float,
        score_groups: Sequence[Sequence[int]] = (),
        device: torch.device | None = None,
    ):
        host, _, port = store.rpartition(":")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.me = worker
        # NCCL moves the tensors on this worker's own GPU (`device`, placed at load); gloo moves host
        # tensors (Comm stages a GPU worker's through host memory)
        self.device_buffers = backend == "nccl"
        if backend == "nccl":
            if device is None or device.type != "cuda" or not torch.cuda.is_available():
                raise CommError("the NCCL fabric needs this worker on a GPU of its own (--device cuda)")
            torch.cuda.set_device(device)
        try:
            tcp_store = dist.TCPStore(host, int(port), n_workers, is_master=worker == 0, timeout=timeout)
            dist.init_process_group(backend, store=tcp_store, rank=worker, world_size=n_workers, timeout=timeout)
            self.groups: dict[int, object] = {}
            for g, owners in enumerate(score_groups):  # every rank creates every group, in order
                if len(owners) > 1:
                    pg = dist.new_group(list(owners), timeout=timeout)
                    if worker in owners:
                        self.groups[g] = pg
        except Exception as e:
            raise CommError(f"{backend} fabric at {store} failed: {str(e).splitlines()[0] if str(e) else e}") from None

    def reduce_scatter(self, send: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        n, me, t = len(sizes), self.me, send.shape[1]
        recv = torch.empty((n * sizes[me], t), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(recv, send, output_split_sizes=[sizes[me]] * n, input_split_sizes=list(sizes))
        return accumulate(recv.view(n, sizes[me], t))

    def sum_among(self, tensor: torch.Tensor, group: int) -> None:
        dist.all_reduce(tensor, group=self.groups[group])

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Megatron-style baseline only (a replicated sum)."""
        dist.all_reduce(tensor)

    def all_gather(self, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Baseline and negative controls only: every worker's shard, concatenated in worker order."""
        n, t = len(sizes), shard.shape[1]
        send = shard.contiguous().repeat(n, 1)
        recv = torch.empty((sum(sizes), t), dtype=shard.dtype, device=shard.device)
        dist.all_to_all_single(recv, send, output_split_sizes=list(sizes), input_split_sizes=[sizes[self.me]] * n)
        return recv

    def abort(self) -> None:
        """torch.distributed cannot interrupt a collective from another thread: its waits end at the
        process group's timeout (the worker's --timeout)."""

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
