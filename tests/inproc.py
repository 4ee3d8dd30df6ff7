"""A sharded job in one process, for tests of the operators' math: N worker ranks as threads, each
with its own `ShardedModel` and its own `Comm`, whose worker collectives run on an in-memory fabric.

What runs is the package's own code, unchanged: `ShardedModel` / `ShardedLayer` (or any subclass,
e.g. megatron.MegatronModel), `layer.decoder_layer`, and `Comm`'s verbs (reduce_scatter_from,
sum_scores, all_reduce_workers, all_gather_workers) on their fabric path, as with MPI or gloo.
Only the bytes' transport differs: `MemoryFabric` (comm.Fabric) hands tensors between the threads
through a shared board, and each owner sums what it gets in rank order with comm.buffers.accumulate,
as the links do (Comm._scatter_blocks), so a step's numbers are those of a job over links.

What does not run here: processes, links, TLS, the client's engine (runtime/engine.py,
structural/client.py), the worker's op loop. `ShardedRun` does the client's arithmetic itself
(embedding, ingress split by the plan's residual ranges with layer 0's q/k/v rows (the client's
own structural.client.ingress_qkv), egress summed, final norm, LM head: what
structural.client.Engine._forward_batch computes), so a test of the operators needs no
process; the tests of the protocol, TLS, faults and recovery keep real ones.

Any model directory works (`model`: an HF folder, e.g. one saved from a tiny transformers config by
tests/tiny_models.build, or a GGUF file): whatever family the loader reads, a test can run it sharded
over N = 1.. workers, at any capacities, in any dtype (float64 included, for tight comparisons with
`dense_model(model, torch.float64)`).

    run = ShardedRun(path, n=3, capacities=(2.0, 1.0, 1.0), dtype=torch.float64)
    run.reset(max_seq=64, slots=4)
    a, b = run.forward_batch([(2, prompt_a), (0, prompt_b)])   # every position's logits, per span
    (c,) = run.forward_batch([(2, [token])])                   # slot 2's next position

A whole job (the client's engine, the protocol, TLS links, epochs, audit) without worker processes:
`threads(**kw)` / `masked_threads(**kw)` are EngineOptions / MaskedOptions whose workers are
threads of this process (`--executor inproc`, executor/inproc.py: the real `fusion worker` over the
real rendezvous on 127.0.0.1). The tests of parity, batching, speculation, blame and membership
logic use them; what a thread cannot show (a process's exit, its signals, its own memory and
threads, the faults that end or patch it) keeps processes (executor/inproc.py's list).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from fusion_compute.cli.options import run_worker_in_thread
from fusion_compute.comm import Comm
from fusion_compute.comm.buffers import accumulate
from fusion_compute.comm.errors import CommError
from fusion_compute.masked.options import MaskedOptions
from fusion_compute.model import architecture as arch
from fusion_compute.model.dense import ClearParams, DenseModel
from fusion_compute.model.kernels import rms_norm
from fusion_compute.runtime.engine_options import EngineOptions
from fusion_compute.structural.client import ingress_qkv, layer0_qkv
from fusion_compute.structural.ops import Span
from fusion_compute.structural.plan import Plan, make_plan
from fusion_compute.structural.sharded import ShardedModel
from fusion_compute.weights.loader import WeightSource, open_weights

T = TypeVar("T")
TIMEOUT_S = 60.0  # a rank that waits this long for the others: a bug (a rank skipped a collective), not load


class Board:
    """What the ranks of one job share: a slot per rank for the tensor it contributes to the
    collective in progress, and a barrier per group of ranks that meets (all workers; each split
    KV group's owners). Every collective is two meetings: after every contribution is posted (then
    each rank reads the others'), and after every rank has read (then the slots may be reused)."""

    def __init__(self, n: int, score_groups: Sequence[Sequence[int]] = (), timeout_s: float = TIMEOUT_S):
        self.n = n
        self.posted: list[torch.Tensor | None] = [None] * n
        self.barriers: dict[int | None, threading.Barrier] = {None: threading.Barrier(n, timeout=timeout_s)}
        for g, owners in enumerate(score_groups):
            if len(owners) > 1:
                self.barriers[g] = threading.Barrier(len(owners), timeout=timeout_s)
        self._ranks: dict[int, RankThreads] = {}

    def rank_threads(self, n: int) -> RankThreads:
        """The board's n long-lived rank threads (run_ranks), started at the first step; they end when
        the board is collected (its job dropped)."""
        if n not in self._ranks:
            self._ranks[n] = ranks = RankThreads(n)
            weakref.finalize(self, ranks.stop)
        return self._ranks[n]

    def meet(self, group: int | None = None) -> None:
        try:
            self.barriers[group].wait()
        except threading.BrokenBarrierError:
            raise CommError("in-process fabric: another rank failed or stopped waiting") from None

    def abort(self) -> None:
        """End every wait in progress (a rank failed): the others raise CommError instead of hanging."""
        for b in self.barriers.values():
            b.abort()


class MemoryFabric:
    """comm.Fabric for worker `me` (0-based) of a `Board`: the collectives among workers, in memory.

    Sums are in rank order over a stack of the partials (buffers.accumulate), as the links'
    reduce-scatter and score sum make them; a split KV group's owners meet on their own barrier,
    so the other workers are not held (their attention runs meanwhile, as over links)."""

    device_buffers = True  # tensors are handed over as they are: no staging through host memory

    def __init__(self, board: Board, me: int, score_groups: Sequence[Sequence[int]] = ()):
        self.board, self.me = board, me
        self.groups = {g: list(o) for g, o in enumerate(score_groups) if len(o) > 1}

    def _exchange(self, mine: torch.Tensor, read: Callable[[list[torch.Tensor]], T], group: int | None = None) -> T:
        b = self.board
        b.posted[self.me] = mine
        b.meet(group)
        ranks = range(b.n) if group is None else self.groups[group]
        got = read([b.posted[r] for r in ranks])  # type: ignore[misc]
        b.meet(group)
        return got

    def reduce_scatter(self, send: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """send (Σ sizes, T) rows grouped by owner -> this rank's (sizes[me], T), Σ over ranks."""
        a = sum(sizes[: self.me])
        rows = slice(a, a + sizes[self.me])
        return self._exchange(send, lambda parts: accumulate(torch.stack([p[rows] for p in parts])))

    def sum_among(self, tensor: torch.Tensor, group: int) -> None:
        summed = self._exchange(tensor.clone(), lambda parts: accumulate(torch.stack(parts)), group)
        tensor.copy_(summed)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        summed = self._exchange(tensor.clone(), lambda parts: accumulate(torch.stack(parts)))
        tensor.copy_(summed)

    def all_gather(self, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        return self._exchange(shard, lambda parts: torch.cat(parts))

    def abort(self) -> None:
        self.board.abort()

    def close(self) -> None:
        pass


class RankThreads:
    """One thread per rank that runs that rank's part of every step (run_ranks), as a worker process
    runs every step of its job. A thread started per rank per step cost more CPU than the tiny
    models' steps themselves (test_families' in-process cases: 2-4x the CPU at N = 2..4, measured
    on the 2-core machine), each new thread's first calls into torch and the allocator paying again.
    The threads hold no reference to the board: a step's closure only while it runs."""

    def __init__(self, n: int):
        self.inbox: list[queue.SimpleQueue[Callable[[], None] | None]] = [queue.SimpleQueue() for _ in range(n)]
        for w in range(n):
            threading.Thread(
                target=self._serve, args=(self.inbox[w],), name=f"inproc-worker-{w + 1}", daemon=True
            ).start()

    @staticmethod
    def _serve(inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (job := inbox.get()) is not None:
            job()
            del job  # nothing of a finished step kept alive by an idle thread

    def stop(self) -> None:
        for inbox in self.inbox:
            inbox.put(None)


def run_ranks(board: Board, work: Sequence[Callable[[], T]]) -> list[T]:
    """Run work[w] on rank w's thread (the board's RankThreads); their results in rank order. A rank's
    exception aborts the board (the others' waits end) and is raised here, the first one's in rank
    order."""
    results: list = [None] * len(work)
    errors: list[BaseException | None] = [None] * len(work)
    finished = threading.Semaphore(0)

    def rank(w: int) -> None:
        try:
            results[w] = work[w]()
        except BaseException as e:
            errors[w] = e
            board.abort()
        finally:
            finished.release()

    ranks = board.rank_threads(len(work))
    for w in range(len(work)):
        ranks.inbox[w].put(lambda w=w: rank(w))
    deadline = time.monotonic() + TIMEOUT_S * 2
    for _ in work:
        if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
            board.abort()
            raise TimeoutError("in-process ranks did not finish")
    first = next((e for e in errors if e is not None and not isinstance(e, CommError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class ShardedRun:
    """A sharded job of N workers in this process (module doc), with the client's arithmetic.

    `forward_batch(items)` is one step over several sessions, each (slot, ids) continuing its slot
    at the position it has reached (`rewind` sets it back, as speculation's rejection does): the
    workers roll back what they held past it (ShardedModel.roll_back), then run the step, as the
    worker's FORWARD does. Returns every position's logits (T, V) of each span, float64 on the CPU."""

    def __init__(
        self,
        model: str | Path | WeightSource,
        n: int,
        capacities: tuple[float, ...] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        model_class: type[ShardedModel] = ShardedModel,
        max_seq: int = 64,
        slots: int = 1,
    ):
        self.src = open_weights(model) if isinstance(model, (str, Path)) else model
        self.config = c = self.src.config
        self.plan: Plan = make_plan(c, n, capacities)
        self.dtype = dtype
        self.board = Board(n, self.plan.group_owners)
        self.comms = [
            Comm(
                w + 1,
                n,
                {},
                score_groups=self.plan.group_owners,
                fabric=MemoryFabric(self.board, w, self.plan.group_owners),
                backend="memory",
            )
            for w in range(n)
        ]
        self.workers = [model_class(self.src, self.plan, w, self.comms[w], dtype=dtype) for w in range(n)]
        embed = self.src.read(arch.EMBED)
        self.embed = embed.to(dtype)
        self.lm_head = arch.read_lm_head(self.src, embed).to(dtype)
        self.final_norm = arch.read_final_norm(self.src).to(dtype)  # Gemma's 1 + w, as the engine reads it
        self.qkv0 = layer0_qkv(self.src, self.plan, torch.device("cpu"), dtype)  # the client's layer-0 q/k/v
        self.reset(max_seq, slots)

    def reset(self, max_seq: int | None = None, slots: int | None = None) -> None:
        """Every worker's KV zeroed (ShardedModel.reset), every slot back at position 0."""
        max_seq = self.workers[0].max_seq if max_seq is None else max_seq
        slots = self.workers[0].n_slots if slots is None else slots
        for m in self.workers:
            m.reset(max_seq, slots)
        self.pos = [0] * slots

    def rewind(self, slot: int, pos: int) -> None:
        """Slot `slot`'s next step starts at `pos` (below what it holds: those positions are redone)."""
        self.pos[slot] = pos

    def release(self, slot: int) -> None:
        """The slot's session ended: every worker zeroes it (the worker's RELEASE)."""
        for m in self.workers:
            m.wipe(slot)
        self.pos[slot] = 0

    def shards(self, x_HT: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
        """One step on every worker, from the full ingress (H, ΣT): each worker's egress (H, ΣT), its
        partial of the final residual."""
        ins = [x_HT[slice(*s.residual)].contiguous() for s in self.plan.workers]
        qkv = ingress_qkv(x_HT, self.qkv0, self.config.hidden, self.config.rms_eps)

        def step(w: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                m = self.workers[w]
                m.roll_back(spans)
                with torch.no_grad():
                    return m.forward(ins[w], spans, qkv[w])

            return run

        return run_ranks(self.board, [step(w) for w in range(self.plan.n)])

    def forward_batch(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        spans = [Span(slot, self.pos[slot], len(ids)) for slot, ids in items]
        ids = [i for _, seq in items for i in seq]
        x_HT = arch.embed_rows(self.config, self.embed, torch.tensor(ids)).T.contiguous()  # (Gemma: √H)
        out = accumulate(torch.stack(self.shards(x_HT, spans)))  # (H, ΣT): the residual, the client's alone
        x_TH = rms_norm(out.T, self.final_norm, self.config.rms_eps)
        logits = (x_TH @ self.lm_head.T).double()
        for s in spans:
            self.pos[s.slot] = s.pos + s.t
        return list(logits.split([s.t for s in spans]))

    def forward(self, ids: list[int], slot: int = 0, all_logits: bool = True) -> torch.Tensor:
        """One session's step in `slot`: every position's logits (T, V), or the last one's (V,)."""
        logits = self.forward_batch([(slot, ids)])[0]
        return logits if all_logits else logits[-1]

    def stats(self) -> list[dict]:
        """Per worker, what its Comm counted (as bench/ops.stats reports it from the worker processes):
        collectives among workers and the payload bytes it addressed to the other workers."""
        return [
            {"collectives": c.counters.collectives, "peer_bytes_sent": c.counters.peer_bytes_sent} for c in self.comms
        ]

    def greedy(self, prompt: list[int], new_tokens: int, slot: int = 0, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy continuation of `prompt` from position 0 of `slot`, one token per step after the
        prompt; ends after `new_tokens` or a token of `stop_ids` (kept), as reference.greedy does."""
        self.rewind(slot, 0)
        logits = self.forward(prompt, slot)[-1]
        out: list[int] = []
        while True:
            out.append(int(logits.argmax()))
            if len(out) == new_tokens or out[-1] in stop_ids:
                return out
            logits = self.forward([out[-1]], slot)[-1]

    def kv_abs_max(self) -> float:
        return max(m.kv_abs_max() for m in self.workers)


def threads(**kw) -> EngineOptions:
    """EngineOptions of a job whose workers are threads of this process (module doc)."""
    return EngineOptions(**{"executor": "inproc", "run_worker": run_worker_in_thread, **kw})


def masked_threads(**kw) -> MaskedOptions:
    """MaskedOptions of a masked job whose members are threads of this process (module doc)."""
    return MaskedOptions(**{"executor": "inproc", "run_worker": run_worker_in_thread, **kw})


def dense_model(model: str | Path | WeightSource, dtype: torch.dtype = torch.float64, max_seq: int = 256) -> DenseModel:
    """model.dense.DenseModel (the layer in one process, no sharding) with every tensor in `dtype`.
    (Its norms and softmax run in float32 whatever the dtype, as transformers' do and as the
    sharded layer's do: kernels.rms_norm, kernels.softmax32.)"""
    src = open_weights(model) if isinstance(model, (str, Path)) else model
    d = DenseModel(src, max_seq=max_seq)
    d.embed, d.final_norm, d.lm_head = d.embed.to(dtype), d.final_norm.to(dtype), d.lm_head.to(dtype)
    d.clear = [
        ClearParams(p.g_attn.to(dtype), p.g_mlp.to(dtype), None if p.qkv_bias is None else p.qkv_bias.to(dtype))
        for p in d.clear
    ]
    d.ops.clear = d.clear
    d.weights = [{k: w.to(dtype) for k, w in layer.items()} for layer in d.weights]
    d.k_cache, d.v_cache = d.k_cache.to(dtype), d.v_cache.to(dtype)
    return d
