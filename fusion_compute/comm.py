"""The one door to torch.distributed. Every transfer of the runtime goes through a verb here, and
every verb reports an event to the `Recorder` (audit). No other module imports torch.distributed
(a test enforces it).

Ranks: 0 is the client (user side); 1..N are workers. Intra-layer collectives run in a worker-only
group; partial-score sums of a split KV group run in a group of just that group's owners.

Why `all_to_all_single` and not `reduce_scatter_tensor`: gloo implements reduce-scatter as an
all-reduce followed by keeping one chunk, so every rank briefly holds the complete sum (a hidden
gather). all-to-all with per-peer split sizes moves exactly the addressed pieces, p_r[Y_q] from r
to q, and the owner sums them locally.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    """A peer vanished, a collective timed out, or the rendezvous failed."""


@dataclass(frozen=True)
class Event:
    """One transfer, as the comm layer saw it (sender-side element counts)."""

    kind: str  # reduce_scatter | score_sum | ingress | egress | control | gather | all_reduce (controls)
    op: str  # operator name, e.g. "L3.qkv"
    sent: tuple[int, ...]  # elements this rank sent to each world rank (index = rank)
    received: tuple[int, ...]  # elements this rank received from each world rank
    itemsize: int = 4  # bytes per element (fp32 state; int64 control words are 8)


# Transfers among workers (everything else is client <-> worker: ingress, egress, control).
WORKER_COLLECTIVES = frozenset({"reduce_scatter", "score_sum", "gather", "all_reduce"})


@dataclass
class Counters:
    """Always-on totals for the benchmark (three integer additions per transfer)."""

    collectives: int = 0  # collectives this rank took part in among workers
    peer_bytes_sent: int = 0  # bytes it addressed to other workers (sender-side, payload only)
    client_bytes: int = 0  # bytes to and from the client (rank 0)


class Recorder(Protocol):
    def record(self, event: Event) -> None: ...


class NullRecorder:
    def record(self, event: Event) -> None:
        pass


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Comm:
    """A rank's view of the job: world group, worker group, score groups; verbs that record."""

    def __init__(
        self,
        rank: int,
        n_workers: int,
        master: str,
        *,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        score_groups: Sequence[Sequence[int]] = (),
        recorder: Recorder | None = None,
        reduce_scatter_impl: str = "all_to_all",
    ):
        host, _, port = master.rpartition(":")
        self.rank = rank
        self.world = n_workers + 1
        self.recorder: Recorder = recorder or NullRecorder()
        self.counters = Counters()
        if reduce_scatter_impl not in ("all_to_all", "gloo"):
            raise CommError(f"unknown reduce-scatter implementation {reduce_scatter_impl!r} (all_to_all | gloo)")
        # "gloo" exists only as an audit negative control: gloo's reduce_scatter is an all-reduce in
        # disguise. The events below are identical either way; only the OS socket counters differ.
        self.reduce_scatter_impl = reduce_scatter_impl
        self.device = torch.device("cpu")
        if backend == "nccl":
            self.device = torch.device("cuda", (rank - 1) % max(1, torch.cuda.device_count()) if rank else 0)
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{host}:{port}",
                rank=rank,
                world_size=self.world,
                timeout=_timeout(timeout_s),
            )
            # new_group must be called by every rank, in the same order, even non-members.
            self.workers_pg = dist.new_group(list(range(1, self.world)), timeout=_timeout(timeout_s))
            self.score_pgs: dict[int, object] = {}
            for g, owners in enumerate(score_groups):
                if len(owners) > 1:
                    ranks = [w + 1 for w in owners]
                    pg = dist.new_group(ranks, timeout=_timeout(timeout_s))
                    if rank in ranks:
                        self.score_pgs[g] = pg
        except Exception as e:  # rendezvous failure: wrong address, peer missing, timeout
            raise CommError(f"rendezvous at {master} failed: {e}".splitlines()[0]) from None

    # ---- helpers ----

    def _counts(self, peer_elems: dict[int, int]) -> tuple[int, ...]:
        return tuple(peer_elems.get(r, 0) for r in range(self.world))

    def _emit(self, kind: str, op: str, sent: dict[int, int], received: dict[int, int], itemsize: int = 4) -> None:
        c = self.counters
        if kind in WORKER_COLLECTIVES:
            c.collectives += 1
            c.peer_bytes_sent += sum(n for r, n in sent.items() if r != 0) * itemsize
        else:
            c.client_bytes += (sent.get(0, 0) + received.get(0, 0)) * itemsize
        self.recorder.record(Event(kind, op, self._counts(sent), self._counts(received), itemsize))

    # ---- verbs ----

    def reduce_scatter(self, send: torch.Tensor, sizes: Sequence[int], op: str) -> torch.Tensor:
        """Sum of every worker's partial, delivered chunk by chunk to its owner.

        send: (Σ_q sizes[q], T) partial, rows grouped by owner (P, full width); returns this worker's
        chunk (sizes[me], T) summed over workers (S). Only addressed rows move.
        """
        me = self.rank - 1
        n = len(sizes)
        t = send.shape[1]
        recv = torch.empty((n * sizes[me], t), dtype=send.dtype, device=send.device)
        if n == 1:
            return send
        sent = {q + 1: sizes[q] * t for q in range(n) if q != me}
        received = {q + 1: sizes[me] * t for q in range(n) if q != me}
        if self.reduce_scatter_impl == "gloo":  # negative control only (see __init__)
            out = torch.empty((sizes[me], t), dtype=send.dtype, device=send.device)
            dist.reduce_scatter(out, list(send.split(list(sizes))), group=self.workers_pg)
            self._emit("reduce_scatter", op, sent, received)
            return out
        dist.all_to_all_single(
            recv, send, output_split_sizes=[sizes[me]] * n, input_split_sizes=list(sizes), group=self.workers_pg
        )
        self._emit("reduce_scatter", op, sent, received)
        return recv.view(n, sizes[me], t).sum(0)

    def sum_scores(self, scores: torch.Tensor, group: int, op: str) -> torch.Tensor:
        """In-place sum of partial attention scores among the owners of one split KV group."""
        pg = self.score_pgs[group]
        dist.all_reduce(scores, group=pg)
        peers = [r for r in dist.get_process_group_ranks(pg) if r != self.rank]
        n = scores.numel()
        self._emit("score_sum", op, {r: n for r in peers}, {r: n for r in peers})
        return scores

    def send(self, tensor: torch.Tensor, dst: int, kind: str, op: str) -> None:
        """Point-to-point: ingress (client -> worker shard), egress (worker shard -> client), control."""
        dist.send(tensor.contiguous(), dst)
        self._emit(kind, op, {dst: tensor.numel()}, {}, tensor.element_size())

    def recv(self, tensor: torch.Tensor, src: int, kind: str, op: str) -> torch.Tensor:
        dist.recv(tensor, src)
        self._emit(kind, op, {}, {src: tensor.numel()}, tensor.element_size())
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, kind: str, op: str):
        """Non-blocking `send` (masked mode: a linear's round trips to several workers overlap, and
        group B streams its layers ahead of the client). Returns a handle; call `.wait()` on it, and
        keep `tensor` (contiguous) alive and unmodified until then."""
        if not tensor.is_contiguous():
            raise ValueError("isend needs a contiguous tensor (it must outlive the transfer)")
        work = dist.isend(tensor, dst)
        self._emit(kind, op, {dst: tensor.numel()}, {}, tensor.element_size())
        return work

    def irecv(self, tensor: torch.Tensor, src: int, kind: str, op: str):
        """Non-blocking `recv` into `tensor`; valid after `.wait()` on the returned handle."""
        work = dist.irecv(tensor, src)
        self._emit(kind, op, {}, {src: tensor.numel()}, tensor.element_size())
        return work

    def all_gather_workers(self, shard: torch.Tensor, sizes: Sequence[int], op: str) -> torch.Tensor:
        """A deliberate leak, for negative controls and the Megatron-style baseline only: every
        worker gets every worker's shard. (n_rows_q, T) chunks -> (Σ sizes, T)."""
        me = self.rank - 1
        n = len(sizes)
        t = shard.shape[1]
        send = shard.repeat(n, 1)
        recv = torch.empty((sum(sizes), t), dtype=shard.dtype, device=shard.device)
        dist.all_to_all_single(
            recv, send, output_split_sizes=list(sizes), input_split_sizes=[sizes[me]] * n, group=self.workers_pg
        )
        self._emit(
            "gather",
            op,
            {q + 1: sizes[me] * t for q in range(n) if q != me},
            {q + 1: sizes[q] * t for q in range(n) if q != me},
        )
        return recv

    def all_reduce_workers(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Megatron-style baseline only: full-width sum replicated on every worker."""
        dist.all_reduce(tensor, group=self.workers_pg)
        n = tensor.numel()
        peers = [r for r in range(1, self.world) if r != self.rank]
        self._emit("all_reduce", op, {r: n for r in peers}, {r: n for r in peers})
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    """gloo on CPU; NCCL when asked for CUDA and it exists."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise CommError("--device cuda requested but CUDA is not available")
        return "nccl"
    return "gloo"


def env_master() -> str | None:
    """torchrun-style MASTER_ADDR/MASTER_PORT, when set."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else None
