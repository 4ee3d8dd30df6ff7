"""Collectives among the workers on MPI (mpi4py over the MPICH wheel): the trusted fabric for runs on
one machine, where it moves a worker's chunks through shared memory instead of sockets.

    fusion generate --workers 2 --comm-backend mpi ...      (pip install 'fusion-compute[mpi]')

Like torch_fabric.py, the fabric carries only worker-to-worker collectives; the client keeps its TLS
links. Its traffic is neither encrypted nor authenticated (shared memory among processes of one
user), so it runs on one machine only, among workers the client spawned (`EngineOptions.check`).

Joining without mpiexec: the workers are ordinary processes (the client spawned them), each an MPI
singleton. Worker 0 opens an MPI port and writes its name into the epoch's rendezvous directory (a
0700 directory the client made); worker k connects after worker k-1 has joined (a marker file), and
every member already in accepts it collectively, so the merged communicator's ranks are the workers'
indices. (MPICH 5.0.x breaks connect/accept between singletons — pmodels/mpich#7805 — so the extra
pins mpich 4.3.)

Joining as mpiexec started them (a cluster the user controls, docs/performance.md): workers launched
together by `mpiexec` (a host file, or one `-host` per worker) already share `MPI_COMM_WORLD`; with
the rendezvous `WORLD` the fabric is a duplicate of it, and mpiexec's rank i must be the plan's worker
i (the topology's order). A world has a fixed size, so it serves one plan epoch: the client refuses
standbys and recovery with it (`EngineOptions.check`).

Waiting: MPICH busy-polls inside a blocking call, and on an oversubscribed machine (more processes
than cores, the usual local run) a waiting worker then steals the core a computing one needs. Every
collective here is non-blocking (`Ialltoallv`, `Iallreduce`) and waited for by `wait`: it polls,
calling `sched_yield` between polls so that any runnable process gets the core first, and after
10 ms sleeps in growing steps (a long wait: a peer still computing a prefill). An abort (the epoch
is over) or the timeout ends a wait. Measured (docs/performance.md, bench/busy_poll.py): three ranks
waiting with MPI's blocking Wait slowed a computing process on the same 2 cores 2.25x; with `wait`,
not at all.

The reduce-scatter is an all-to-all with per-peer counts plus a local sum, never a reduce-scatter
primitive (docs/design.md, "The operators"), exactly as on the other backends. The layers' reduce-scatters use
`reduce_scatter_from`: the same rows as point-to-point `Isend`/`Irecv`, each peer's block sent as soon
as it is made, so that the exchange overlaps the product (as the links do, comm.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .buffers import accumulate, words
from .errors import CommError

WORLD = "world"  # the rendezvous of workers that mpiexec started together
YIELD_S = 0.01  # poll (yielding the core between polls) this long before sleeping
MAX_SLEEP_S = 1e-3
_RS_TAG = 7  # the point-to-point reduce-scatter's messages (collectives have their own context)


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise CommError("--comm-backend mpi needs mpi4py and MPICH: pip install 'fusion-compute[mpi]'") from None
    return MPI


def _wait_file(path: Path, deadline: float, what: str) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise CommError(f"mpi fabric: {what} did not appear within the timeout ({path})")
        time.sleep(0.005)


class _All:
    """Several point-to-point requests waited for as one (`MpiFabric.wait` polls `Test`)."""

    def __init__(self, mpi, reqs: list):
        self.mpi, self.reqs = mpi, reqs

    def Test(self) -> bool:  # noqa: N802 (mpi4py's spelling, which `wait` calls)
        return self.mpi.Request.Testall(self.reqs)


class MpiFabric:
    def __init__(
        self,
        worker: int,
        n_workers: int,
        rendezvous: str,
        *,
        timeout_s: float,
        score_groups: Sequence[Sequence[int]] = (),
    ):
        mpi = _mpi()
        self.mpi, self.me, self.timeout_s = mpi, worker, timeout_s
        self.device_buffers = False  # host buffers: Comm stages a GPU worker's tensors
        self.aborted = threading.Event()
        self._abandoned: list = []  # requests and buffers of a reduce-scatter given up on (reduce_scatter_from)
        try:
            if rendezvous == WORLD:
                comm = self._world(mpi, worker, n_workers)
            else:
                comm = self._join(mpi, worker, n_workers, Path(rendezvous), time.monotonic() + timeout_s)
            if comm.Get_size() != n_workers or comm.Get_rank() != worker:
                raise CommError(
                    f"mpi fabric: joined as {comm.Get_rank()} of {comm.Get_size()}, expected {worker} of {n_workers}"
                )
            self.comm = comm
            self.groups: dict[int, Any] = {}  # mpi4py communicators
            for g, owners in enumerate(score_groups):  # every member creates its groups in the same order
                if len(owners) > 1 and worker in owners:
                    self.groups[g] = comm.Create_group(comm.Get_group().Incl(list(owners)))
        except mpi.Exception as e:
            raise CommError(f"mpi fabric: {str(e).splitlines()[0]}") from None

    @staticmethod
    def _join(mpi, worker: int, n_workers: int, d: Path, deadline: float):
        """Singletons into one communicator by connect/accept (the module docstring)."""
        if worker == 0:
            d.mkdir(mode=0o700, exist_ok=True)
            port = mpi.Open_port()
            (d / "port.tmp").write_text(port)
            os.replace(d / "port.tmp", d / "port")
            (d / "joined0").touch()
            comm = mpi.COMM_SELF
        else:
            _wait_file(d / f"joined{worker - 1}", deadline, f"worker {worker - 1}'s join")
            port = (d / "port").read_text()
            inter = mpi.COMM_SELF.Connect(port, root=0)
            comm = inter.Merge(high=True)
            inter.Free()
            (d / f"joined{worker}").touch()
        for _ in range(worker + 1, n_workers):  # everyone already in accepts each later worker
            inter = comm.Accept(port, root=0)
            merged = inter.Merge(high=False)
            inter.Free()
            if comm is not mpi.COMM_SELF:
                comm.Free()
            comm = merged
        if worker == 0 and n_workers > 1:
            mpi.Close_port(port)
        return comm

    @staticmethod
    def _world(mpi, worker: int, n_workers: int):
        world = mpi.COMM_WORLD
        if world.Get_size() != n_workers or world.Get_rank() != worker:
            raise CommError(
                f"mpiexec started this worker as rank {world.Get_rank()} of {world.Get_size()}, but it is "
                f"worker {worker + 1} of {n_workers} in the topology, which must be rank {worker}: start "
                "exactly the topology's workers, in its order (mpiexec's host file in that order)"
            )
        return world.Dup()

    def wait(self, req) -> None:
        """Drive MPI's progress (it moves data only inside its calls) until `req` completes, giving the
        core away between polls: `sched_yield` lets any runnable process (a computing worker, the
        client) go first at no timer cost; after YIELD_S of waiting, it sleeps in growing steps."""
        t0 = time.monotonic()
        deadline, sleep = t0 + self.timeout_s, 5e-5
        while not req.Test():
            now = time.monotonic()
            if now - t0 < YIELD_S:
                os.sched_yield()
                continue
            if self.aborted.is_set():  # the request is abandoned with the epoch (MPI cannot cancel a collective)
                raise CommError("mpi fabric: the epoch was aborted while waiting for a peer")
            if now > deadline:
                raise CommError(f"mpi fabric: no peer answered within {self.timeout_s:g} s")
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)

    def reduce_scatter(self, send: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        n, me, t = len(sizes), self.me, send.shape[1]
        send = send.contiguous()
        recv = torch.empty((n * sizes[me], t), dtype=send.dtype)
        counts_out = [s * t for s in sizes]
        displs_out = [sum(counts_out[:i]) for i in range(n)]
        counts_in = [sizes[me] * t] * n
        displs_in = [i * sizes[me] * t for i in range(n)]
        self.wait(self.comm.Ialltoallv([words(send), (counts_out, displs_out)], [words(recv), (counts_in, displs_in)]))
        return accumulate(recv.view(n, sizes[me], t))

    def reduce_scatter_from(self, chunk: Callable[[int], torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
        """The same reduce-scatter as a composition of point-to-point messages that overlaps the
        product: the peers' blocks of this worker's rows are posted as receives first, each peer's
        block is sent as soon as `chunk(q)` has made it (the next rank's first), and this worker's own
        block is computed while they travel. The sum is in rank order, as `reduce_scatter`'s."""
        n, me = len(sizes), self.me
        recvs, sends, keep, stack = [], [], [], None
        order = [(me + i) % n for i in range(1, n)]
        try:
            for q in order:
                block = chunk(q).contiguous()
                if stack is None:  # the first block tells T and the dtype
                    stack = torch.empty((n, sizes[me], block.shape[1]), dtype=block.dtype)
                    recvs = [self.comm.Irecv(words(stack[p]), source=p, tag=_RS_TAG) for p in order if sizes[me]]
                if sizes[q]:
                    keep.append(block)  # the buffer must live until its send completes
                    sends.append(self.comm.Isend(words(block), dest=q, tag=_RS_TAG))
            own = chunk(me)
            if stack is None:  # no peer (one worker): its own block is the whole sum
                return own
            stack[me] = own
            self.wait(_All(self.mpi, recvs + sends))
        except BaseException:
            # Abandoned (an abort, a timeout, an error in the product): a live peer's block may still
            # arrive, so the buffers stay referenced as long as the fabric (never freed under MPI).
            for req in recvs:
                try:
                    req.Cancel()
                except Exception:
                    pass
            self._abandoned.append((recvs, sends, stack, keep))
            raise
        return accumulate(stack)

    def sum_among(self, tensor: torch.Tensor, group: int) -> None:
        buf = tensor.numpy()  # the caller's tensor is contiguous (a score block it owns)
        self.wait(self.groups[group].Iallreduce(self.mpi.IN_PLACE, buf))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Megatron-style baseline only (a replicated sum)."""
        self.wait(self.comm.Iallreduce(self.mpi.IN_PLACE, tensor.numpy()))

    def all_gather(self, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Baseline and negative controls only: every worker's shard, concatenated in worker order."""
        n, t = len(sizes), shard.shape[1]
        shard = shard.contiguous()
        recv = torch.empty((sum(sizes), t), dtype=shard.dtype)
        counts = [s * t for s in sizes]
        displs = [sum(counts[:i]) for i in range(n)]
        self.wait(self.comm.Iallgatherv(words(shard), [words(recv), (counts, displs)]))
        return recv

    def abort(self) -> None:
        self.aborted.set()

    def close(self) -> None:
        for g in self.groups.values():
            try:
                g.Free()
            except Exception:
                pass
        self.groups = {}
        if getattr(self, "comm", None) is not None:
            try:
                self.comm.Free()
            except Exception:
                pass
            self.comm = None
