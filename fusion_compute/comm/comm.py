"""`Comm`: a rank's verbs, each a thin composition of point-to-point messages on its links, and
each reported to the `Recorder` (audit) as one `Event`.

Ranks: 0 is the client (user side); 1..N are workers. Verbs and what moves:

  verb             who                       on the wire
  reduce_scatter   all workers               p_r[Y_q] from every worker r to every owner q (addressed
                                             rows only), summed by the owner in rank order
  sum_scores       owners of a split group   each owner's partial scores to the other owners, summed
                                             by each in owner order (a declared exchanged intermediate)
  sum_norms        all workers               each worker's partial Σy² (one float32 scalar per token) to
                                             every other, summed by each in rank order (Gemma 3's post-
                                             norms: a declared scalar per token, like the fused Σx²)
  send / recv      client <-> worker         ingress shards, egress shards, control words
  isend / irecv    client <-> worker         the same, posted ahead (masked mode); receives complete
                                             in posting order per peer

Baselines and negative controls only: `all_gather_workers` (every worker gets every shard) and
`all_reduce_workers` (Megatron-style replicated sum).

The reduce-scatter is never an all-reduce in disguise: only addressed rows leave a worker (docs/design.md,
"The operators"). The negative control `rs_allreduce` (audit) breaks exactly that: it sends every peer the whole
partial while recording only the addressed rows, and the socket byte counters catch it.

Waiting is charged to whoever caused it (docs/resilience.md, "Blame by evidence"): a rank that needs
messages from several peers (a reduce-scatter, a score sum, the client's egress) waits on all of them
at once, and only the time after every other peer's message had arrived is charged, to the last one,
on the rank's `witness` (liveness.Witness): real durations, however short, whatever the ranks' order.

What a peer sends is checked before it is added (value_checks.py; docs/resilience.md, "Evidence at
the receiver"): every block of a reduce-scatter and of a score sum on the links, received
(PeerPoisoned, naming its sender first-hand) and, by the same rule, before it is sent (TaintedInputs:
an honest sender never sends what its receiver refuses). A fabric sums inside itself: no block is
seen there, so no sender is named.

When a worker-group `fabric` is given (torch.distributed: NCCL on GPUs, or gloo for comparison),
reduce_scatter and sum_scores run on it instead; the client's links stay what they are.

Numbered steps: every frame on the links carries this rank's (epoch, step) (links.py's header) and
every data frame received must carry the receiver's, else PeerOutOfStep names its sender. The epoch
is the plan epoch the Comm was made for; the step is a count both sides keep without a word more:
the client starts a step with each command word it sends its workers (`begin_step`, before the
word: the word itself is the step's first frame), and a worker starts one each time it receives a
command word (`recv(..., new_step=True)`: it expects the next number, so the client and every
worker count the same commands and agree). Everything until the next command word (spans,
ingress, the collectives among workers, egress, replies) belongs to that step. A fabric (gloo,
NCCL, MPI) carries no frames of ours: its collectives are matched by call order inside the
fabric, and nothing there checks the step (the client's links still do).

Tensors may live on a GPU and be float32, bfloat16 or float16 (runtime/placement.py): every message
is the tensor's bytes in its own dtype, staged through host memory on the links and on a fabric that
moves host buffers (gloo, MPI), passed as device buffers to one that moves them itself (NCCL); every
owner sums what it receives in a float32 accumulator (buffers.py). Events record the bytes per
element that travelled.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .buffers import accumulate, host, raw
from .errors import CommError, PeerPoisoned, PeerTimeout, TaintedInputs
from .events import WORKER_COLLECTIVES, Counters, Event, NullRecorder, Recorder
from .links import TICK_S, Link
from .readiness import readable
from .value_checks import block_fault


class WaitAccount(Protocol):
    """Where a rank's waits are charged (liveness.Witness)."""

    def charge(self, rank: int, seconds: float) -> None: ...
    def waiting_on(self, ranks: frozenset[int], since: float) -> None: ...


class Fabric(Protocol):
    """Collectives among the workers on a comm backend other than the links (torch_fabric.py, mpi_fabric.py)."""

    def reduce_scatter(self, send: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor: ...
    # optional: def reduce_scatter_from(self, chunk, sizes) -> torch.Tensor (made block by block, overlapped)
    def sum_among(self, tensor: torch.Tensor, group: int) -> None: ...
    def all_reduce(self, tensor: torch.Tensor) -> None: ...
    def all_gather(self, shard: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor: ...
    def abort(self) -> None: ...  # end the waits in progress: the epoch is over (called from another thread)
    def close(self) -> None: ...

    # a fabric takes tensors on the workers' GPU as they are (NCCL: `device_buffers = True`), or host
    # tensors, which Comm stages for it (gloo, MPI)
    device_buffers: bool


class _Sent:
    """Handle of an `isend`: the message is already encrypted and queued; waiting pushes it into
    the kernel."""

    def __init__(self, link: Link, deadline: float):
        self.link, self.deadline = link, deadline

    def wait(self) -> None:
        self.link.flush(self.deadline)


class _Posted:
    """Handle of an `irecv`: filled, in posting order per peer, when waited on."""

    def __init__(self, comm: Comm, src: int, tensor: torch.Tensor, what: str):
        self.comm, self.src, self.tensor, self.what = comm, src, tensor, what
        self.done = False

    def wait(self) -> torch.Tensor:
        self.comm._complete(self)
        return self.tensor


class Comm:
    """A rank's view of the job: its links (and optional fabric), the verbs, the recorder."""

    def __init__(
        self,
        rank: int,
        n_workers: int,
        links: dict[int, Link],
        *,
        timeout_s: float = 120.0,
        score_groups: Sequence[Sequence[int]] = (),
        recorder: Recorder | None = None,
        fabric: Fabric | None = None,
        backend: str = "tls",
        witness: WaitAccount | None = None,
        epoch: int = 0,
    ):
        self.rank = rank
        self.world = n_workers + 1
        self.links = links
        self.timeout_s = timeout_s
        self.recorder: Recorder = recorder or NullRecorder()
        self.counters = Counters()
        self.fabric = fabric
        self.backend = backend  # comm backend: "tls" | "tcp" (insecure) | "gloo" / "nccl" / "mpi" (a fabric)
        # owner ranks of each split KV group this rank belongs to
        self.score_owners: dict[int, list[int]] = {
            g: [w + 1 for w in owners]
            for g, owners in enumerate(score_groups)
            if len(owners) > 1 and rank - 1 in owners
        }
        self._posted: dict[int, collections.deque[_Posted]] = collections.defaultdict(collections.deque)
        self.witness = witness  # charged with each wait's last peer (see the module docstring)
        self.awaiting: frozenset[int] = frozenset()  # the peers a receive from several waits on (or failed on)
        self.epoch = epoch
        self.step = 0  # commands since the epoch began (module docstring, "Numbered steps")
        self._stamp()

    # ---- numbered steps ----

    def _stamp(self) -> None:
        for link in self.links.values():
            link.epoch, link.step = self.epoch, self.step

    def begin_step(self) -> int:
        """The next step starts here: what this rank sends from now on is stamped with it, and what
        it receives must be. The client calls it before each command word; a worker's receive of a
        command word does (`recv(new_step=True)`). Returns the step's number."""
        self.step += 1
        self._stamp()
        return self.step

    # ---- wire ----

    def _deadline(self, wait_s: float | None = None) -> float:
        return time.monotonic() + (self.timeout_s if wait_s is None else wait_s)

    def _link(self, peer: int) -> Link:
        try:
            return self.links[peer]
        except KeyError:
            raise CommError(f"rank {self.rank} has no link to rank {peer}") from None

    def _put(self, peer: int, t: torch.Tensor) -> None:
        self._link(peer).send(raw(host(t)))

    def _get(self, peer: int, out: torch.Tensor, what: str, wait_s: float | None = None) -> torch.Tensor:
        """Receive the next message from `peer` into `out` (contiguous, host), after any posted receives."""
        pending = self._posted.get(peer)
        while pending:
            self._complete(pending[-1])
        self._link(peer).recv_into(raw(out), self._deadline(wait_s), what)
        return out

    def _get_all(self, outs: dict[int, torch.Tensor], what: str, wait_s: float | None = None) -> None:
        """Receive the next message of every peer in `outs` into its tensor, waiting on all of them at
        once (the first to arrive is read first), and charge the witness the last peer's share: the
        time after every other one had arrived (all of it with one peer)."""
        deadline = self._deadline(wait_s)
        pending = dict(outs)
        for peer in [p for p in pending if self._posted.get(p)]:  # posted receives come first (isend/irecv)
            self._get(peer, pending.pop(peer), what, wait_s)
        last = time.monotonic()
        self._awaiting(pending, last)
        links = {p: self._link(p) for p in pending}
        while len(pending) > 1:
            ready = [p for p in pending if links[p].has_buffered()]
            if not ready:
                socks = {links[p].sock: p for p in pending}
                left = deadline - time.monotonic()
                got = readable(socks, min(TICK_S, left))
                ready = sorted(socks[s] for s in got)
            if not ready:  # a tick: the links' check (a lost worker, a step's limit), then the deadline
                check = next((links[p].check for p in pending if links[p].check is not None), None)
                if check is not None:
                    check()
                if time.monotonic() >= deadline:
                    first = min(pending)
                    raise PeerTimeout(first, f"{links[first].label} did not answer within the deadline")
                continue
            for p in ready[: len(pending) - 1]:  # the last one is read below, charged
                links[p].recv_into(raw(pending.pop(p)), deadline, what)
                last = time.monotonic()
            self._awaiting(pending, last)
        for p, out in pending.items():  # the last: a plain blocking read (one syscall), all of it charged
            links[p].recv_into(raw(out), deadline, what)
            if self.witness is not None:
                self.witness.charge(p, time.monotonic() - last)
        self._awaiting({}, last)

    def _awaiting(self, pending: dict[int, torch.Tensor], since: float) -> None:
        self.awaiting = frozenset(pending)
        if self.witness is not None:
            self.witness.waiting_on(self.awaiting, since)

    def _complete(self, handle: _Posted) -> None:
        pending = self._posted[handle.src]
        while not handle.done:
            first = pending.popleft()
            self._link(first.src).recv_into(raw(first.tensor), self._deadline(), first.what)
            first.done = True

    # ---- what a peer may send (value_checks.py; docs/resilience.md, "Evidence at the receiver") ----

    def _check_own(self, block: torch.Tensor, dst: int, op: str) -> None:
        """Before this rank sends `block` to `dst`: refuse to send one its receiver would refuse. The
        inputs it was made from passed one by one (or this rank erred): TaintedInputs, naming nobody."""
        fault = block_fault(block)
        if fault is not None:
            raise TaintedInputs(
                f"worker {self.rank}'s own {op} block for rank {dst} holds {fault}: made from inputs that "
                "passed their checks one by one (or by this worker itself); not sent"
            )

    def _check_received(self, blocks: dict[int, torch.Tensor], op: str) -> None:
        """Every block received from a peer, before it is added to anything: a NaN, an infinity or a
        value over the bound is one its sender's own check refuses to send (`_check_own`), so an honest
        sender never sent it: PeerPoisoned, first-hand, naming the sender (the lowest rank of several)."""
        for src in sorted(blocks):
            fault = block_fault(blocks[src])
            if fault is not None:
                raise PeerPoisoned(
                    src, f"{self._link(src).label} sent a {op} block holding {fault}: no honest sender sends it"
                )

    # ---- events ----

    def _counts(self, peer_elems: dict[int, int]) -> tuple[int, ...]:
        return tuple(peer_elems.get(r, 0) for r in range(self.world))

    def _emit(self, kind: str, op: str, sent: dict[int, int], received: dict[int, int], itemsize: int = 4) -> None:
        c = self.counters
        if kind in WORKER_COLLECTIVES:
            c.collectives += 1
            c.peer_bytes_sent += sum(n for r, n in sent.items() if r != 0) * itemsize
        else:
            c.client_bytes += (sent.get(0, 0) + received.get(0, 0)) * itemsize
        self.recorder.record(Event(kind, op, self._counts(sent), self._counts(received), itemsize, self.step))

    # ---- verbs among workers ----

    def _rs_counts(self, sizes: Sequence[int], t: int) -> tuple[dict[int, int], dict[int, int]]:
        """A reduce-scatter's elements sent to and received from each peer rank: only addressed rows."""
        me, n = self.rank - 1, len(sizes)
        sent = {q + 1: sizes[q] * t for q in range(n) if q != me and sizes[q]}
        return sent, {q + 1: sizes[me] * t for q in range(n) if q != me and sizes[me]}

    def reduce_scatter(self, send: torch.Tensor, sizes: Sequence[int], op: str) -> torch.Tensor:
        """Sum of every worker's partial, delivered chunk by chunk to its owner.

        send: (Σ_q sizes[q], T) partial, rows grouped by owner (P, full width); returns this worker's
        chunk (sizes[me], T) summed over workers in rank order (S). Only addressed rows move.
        """
        if len(sizes) == 1:
            return send
        sent, received = self._rs_counts(sizes, send.shape[1])
        fabric = self.fabric
        if fabric is not None:
            out = self._staged(send, lambda buf: fabric.reduce_scatter(buf, sizes))
            self._emit("reduce_scatter", op, sent, received, send.element_size())
            return out
        chunks = send.split(list(sizes))  # contiguous row blocks of a row-major (R, T) partial
        return self._scatter_blocks(lambda q: chunks[q], sizes, op)

    def reduce_scatter_from(self, chunk: Callable[[int], torch.Tensor], sizes: Sequence[int], op: str) -> torch.Tensor:
        """`reduce_scatter` of a partial made block by block: `chunk(q)` is the (sizes[q], T) block of
        rows addressed to worker q (0-based). On the links each peer's block is sent as soon as it is
        computed, starting with the next rank's, and this worker's own block is computed while they
        travel: the exchange overlaps the product (measured: docs/performance.md). A fabric that has its
        own `reduce_scatter_from` (MPI) does the same on its point-to-point messages; on the others the
        whole partial is made first."""
        fabric_from = getattr(self.fabric, "reduce_scatter_from", None)
        if len(sizes) == 1 or (self.fabric is not None and not fabric_from):
            return self.reduce_scatter(torch.cat([chunk(q) for q in range(len(sizes))]), sizes, op)
        if fabric_from is None:
            return self._scatter_blocks(chunk, sizes, op)
        if self.fabric is not None and self.fabric.device_buffers:
            out = fabric_from(chunk, sizes)
        else:  # host buffers for the fabric, each block staged as it is made
            device = None

            def staged(q: int) -> torch.Tensor:
                nonlocal device
                block = chunk(q)
                device = block.device
                return host(block)

            out = fabric_from(staged, sizes)
            out = out.to(device)
        self._emit("reduce_scatter", op, *self._rs_counts(sizes, out.shape[1]), out.element_size())
        return out

    def _staged(self, t: torch.Tensor, collective: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A fabric collective on `t`: as it is for a fabric of device buffers, else through host memory
        and back to t's device (a no-op copy on the CPU)."""
        if self.fabric is not None and self.fabric.device_buffers:
            return collective(t)
        return collective(host(t)).to(t.device)

    def _scatter_blocks(self, chunk: Callable[[int], torch.Tensor], sizes: Sequence[int], op: str) -> torch.Tensor:
        """The links' reduce-scatter: every peer's block sent as it is made (the next rank's first), then
        this worker's own, then the peers' blocks of it received and summed in rank order."""
        me, n = self.rank - 1, len(sizes)
        mine = None
        for q in [(me + i) % n for i in range(1, n)] + [me]:
            if q == me:
                mine = chunk(q)
            elif sizes[q]:
                block = chunk(q)
                self._check_own(block, q + 1, op)
                self._put(q + 1, block)
        assert mine is not None  # the loop's last rank is this worker's
        t = mine.shape[1]
        sent, received = self._rs_counts(sizes, t)
        stack = torch.empty((n, sizes[me], t), dtype=mine.dtype)  # (n, s_me, T) in host memory: one slot per worker
        self._get_all({q: stack[q - 1] for q in received}, op)
        self._check_received({q: stack[q - 1] for q in received}, op)
        stack = stack.to(mine.device)  # the received partials join this worker's on its device
        stack[me] = mine
        self._emit("reduce_scatter", op, sent, received, mine.element_size())
        return accumulate(stack)

    def sum_scores(self, scores: torch.Tensor, group: int, op: str) -> torch.Tensor:
        """In-place sum of partial attention scores among the owners of one split KV group."""
        owners = self.score_owners[group]
        peers = [r for r in owners if r != self.rank]
        n, itemsize = scores.numel(), scores.element_size()
        if self.fabric is not None:
            # A fabric sums in place; a 2-byte dtype is summed as float32 (its accumulator: MPI has no
            # bfloat16 sum), so 4 bytes per element travel.
            acc = scores.float()
            summed = self._staged(acc, lambda buf: self._sum_among(buf, group))
            scores.copy_(summed)
            itemsize = acc.element_size()
        else:
            mine = scores.contiguous()
            for r in peers:
                self._check_own(mine, r, op)
                self._put(r, mine)
            stack = torch.empty((len(owners), *scores.shape), dtype=scores.dtype)  # host
            theirs = {r: stack[i] for i, r in enumerate(owners) if r != self.rank}
            self._get_all(theirs, op)
            self._check_received(theirs, op)
            stack = stack.to(scores.device)
            stack[owners.index(self.rank)] = mine
            scores.copy_(accumulate(stack))
        self._emit("score_sum", op, {r: n for r in peers}, {r: n for r in peers}, itemsize)
        return scores

    def sum_norms(self, ss: torch.Tensor, op: str) -> torch.Tensor:
        """The post-norm's Σy² per token (T,) float32, summed over every worker (each holds some
        residual rows of y): each sends its partial sums to every other and adds theirs in rank order,
        so every worker gets the same sum. One round, N-1 messages of T scalars each way; nothing with
        one worker (no event). Checked at both ends like a score sum (value_checks), and a sum of
        squares below zero is one no honest worker sends either (it would make every worker's norm NaN)."""
        peers = [r for r in range(1, self.world) if r != self.rank]
        if not peers:
            return ss
        n = ss.numel()
        if self.fabric is not None:
            ss.copy_(self._staged(ss.float(), lambda buf: self._all_reduce(buf)))
        else:
            mine = ss.contiguous()
            for r in peers:
                self._check_own(mine, r, op)
                if bool((mine < 0).any()):
                    raise TaintedInputs(
                        f"worker {self.rank}'s own {op} sums of squares for rank {r} are negative: not sent"
                    )
                self._put(r, mine)
            stack = torch.empty((self.world - 1, *ss.shape), dtype=ss.dtype)  # host, rank order
            theirs = {r: stack[r - 1] for r in peers}
            self._get_all(theirs, op)
            self._check_received(theirs, op)
            for src in sorted(theirs):
                if bool((theirs[src] < 0).any()):
                    label = self._link(src).label
                    raise PeerPoisoned(
                        src, f"{label} sent {op} sums of squares below zero: no honest sender sends them"
                    )
            stack = stack.to(ss.device)
            stack[self.rank - 1] = mine
            ss.copy_(accumulate(stack))
        self._emit("norm_sum", op, {r: n for r in peers}, {r: n for r in peers}, ss.element_size())
        return ss

    def _sum_among(self, buf: torch.Tensor, group: int) -> torch.Tensor:
        assert self.fabric is not None
        self.fabric.sum_among(buf, group)
        return buf

    # ---- client <-> worker ----

    def send(self, tensor: torch.Tensor, dst: int, kind: str, op: str) -> None:
        """Point-to-point: ingress (client -> worker shard), egress (worker shard -> client), control."""
        self._put(dst, tensor)
        self._emit(kind, op, {dst: tensor.numel()}, {}, tensor.element_size())

    def recv(
        self,
        tensor: torch.Tensor,
        src: int,
        kind: str,
        op: str,
        wait_s: float | None = None,
        new_step: bool = False,
    ) -> torch.Tensor:
        """Receive into `tensor` (CPU, contiguous) and return it. `wait_s`: this wait's bound instead
        of the session timeout (math.inf for a worker idling between requests). `new_step`: a command
        word, which starts the next step (begin_step first: it must carry the next number)."""
        if new_step:
            self.begin_step()
        self._get(src, tensor, op, wait_s)
        self._emit(kind, op, {}, {src: tensor.numel()}, tensor.element_size())
        return tensor

    def recv_all(self, tensors: dict[int, torch.Tensor], kind: str, op: str) -> dict[int, torch.Tensor]:
        """`recv` from several peers (`tensors` by source rank), waiting on all of them at once: the
        client's egress. The wait after all but the last had arrived is charged to the last one."""
        self._get_all(tensors, op)
        for src in sorted(tensors):
            self._emit(kind, op, {}, {src: tensors[src].numel()}, tensors[src].element_size())
        return tensors

    def isend(self, tensor: torch.Tensor, dst: int, kind: str, op: str) -> _Sent:
        """Send without waiting (the bytes are encrypted and queued at once); `.wait()` on the handle
        blocks until they are in the kernel."""
        if not tensor.is_contiguous():
            raise ValueError("isend needs a contiguous tensor")
        self._put(dst, tensor)
        self._emit(kind, op, {dst: tensor.numel()}, {}, tensor.element_size())
        return _Sent(self._link(dst), self._deadline())

    def irecv(self, tensor: torch.Tensor, src: int, kind: str, op: str) -> _Posted:
        """Post a receive into `tensor`; valid after `.wait()`. Posted receives of one peer complete
        in posting order (its messages arrive in that order)."""
        handle = _Posted(self, src, tensor, op)
        self._posted[src].append(handle)
        self._emit(kind, op, {}, {src: tensor.numel()}, tensor.element_size())
        return handle

    def send_truncated(self, tensor: torch.Tensor, dst: int, keep: float) -> None:
        """FAULT INJECTION ONLY (faults.py): part of a message, then the connection closes."""
        self._link(dst).send_truncated(raw(host(tensor)), keep)

    # ---- baselines and negative controls ----

    def all_gather_workers(self, shard: torch.Tensor, sizes: Sequence[int], op: str) -> torch.Tensor:
        """A deliberate leak, for negative controls and the Megatron-style baseline only: every
        worker gets every worker's shard. (n_rows_q, T) chunks -> (Σ sizes, T)."""
        me, n, t = self.rank - 1, len(sizes), shard.shape[1]
        fabric = self.fabric
        if fabric is not None:
            out = self._staged(shard, lambda buf: fabric.all_gather(buf, sizes))
        else:
            for q in range(n):
                if q != me:
                    self._check_own(shard, q + 1, op)
                    self._put(q + 1, shard)
            out = torch.empty((sum(sizes), t), dtype=shard.dtype)
            gathered = {q + 1: rows for q, rows in enumerate(out.split(list(sizes))) if q != me}
            for r, rows in gathered.items():
                self._get(r, rows, op)
            self._check_received(gathered, op)  # the baseline's blocks too: a liar's NaN names it
            out = out.to(shard.device)
            out.split(list(sizes))[me].copy_(shard)
        self._emit(
            "gather",
            op,
            {q + 1: sizes[me] * t for q in range(n) if q != me},
            {q + 1: sizes[q] * t for q in range(n) if q != me},
            shard.element_size(),
        )
        return out

    def all_reduce_workers(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Megatron-style baseline only: full-width sum replicated on every worker (each worker sends
        its whole tensor to every other: one round, (N-1)x the bytes of the tensor)."""
        peers = [r for r in range(1, self.world) if r != self.rank]
        itemsize = tensor.element_size()
        if self.fabric is not None:
            acc = tensor.float()  # summed as float32, as sum_scores on a fabric
            tensor.copy_(self._staged(acc, lambda buf: self._all_reduce(buf)))
            itemsize = acc.element_size()
        else:
            mine = tensor.contiguous().clone()
            for r in peers:
                self._check_own(mine, r, op)
                self._put(r, mine)
            stack = torch.empty((self.world - 1, *tensor.shape), dtype=tensor.dtype)
            for r in peers:
                self._get(r, stack[r - 1], op)
            self._check_received({r: stack[r - 1] for r in peers}, op)
            stack = stack.to(tensor.device)
            stack[self.rank - 1] = mine
            tensor.copy_(accumulate(stack))
        n = tensor.numel()
        self._emit("all_reduce", op, {r: n for r in peers}, {r: n for r in peers}, itemsize)
        return tensor

    def _all_reduce(self, buf: torch.Tensor) -> torch.Tensor:
        assert self.fabric is not None
        self.fabric.all_reduce(buf)
        return buf

    # ---- leaving ----

    def departures(self, wait_s: float = 0.05) -> dict[int, tuple[str, dict | None]]:
        """For each peer: ("left", its farewell's reason), ("closed", None: its end closed without
        one) or ("open", None), as this end can tell now (links.Link.departure)."""
        return {r: (link.departure(wait_s), link.left) for r, link in sorted(self.links.items())}

    # ---- lifetime ----

    def flush(self) -> None:
        deadline = self._deadline()
        for link in self.links.values():
            link.flush(deadline)

    def close(self, grace_s: float = 2.0) -> None:
        deadline = time.monotonic() + grace_s
        for link in self.links.values():
            link.close(deadline)
        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None

    @property
    def tls(self) -> bool:
        return any(link.tls is not None for link in self.links.values())
