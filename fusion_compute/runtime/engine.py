"""The client's side of a job, common to both modes: the model's client-side weights, who the workers
are, starting or admitting them, the links, epochs and recovery, and an orderly close (also when
start-up fails).

Who the workers are, three ways; who starts them is the job's executor (executor/, chosen once by
`executor_for`):

  local      `--workers N`: the client starts N workers: processes on this machine (the default), or
             Ray actors (`--executor ray`). It makes a fresh key pair for itself and for each worker
             (in memory; a worker gets its secret on stdin), so only the workers it started can join,
             over TLS (on loopback, for processes on this machine).
  topology   `--topology FILE --key client.key`: the user's file lists every worker's address, share
             and public key; the client admits exactly those keys (comm/rendezvous.py). With
             `--comm-backend mpi` the workers are a cluster that mpiexec started: their collectives run
             in its MPI world (comm/mpi_fabric.py), one epoch only, and the links to the client
             stay TLS.
  insecure   `--master HOST:PORT --insecure`: plaintext, and whoever claims a rank gets it. Only when
             asked for by name; a warning says so.

Seats and epochs (docs/resilience.md). Every worker of the roster has a seat: a participant id for
life, a capacity, a group (masked mode), and whether it is a standby. An epoch is an ordered list of
seats; its plan is made from their capacities (or groups). When a worker dies, freezes (the liveness
watch names it within `--liveness` seconds) or is revoked, the client opens the next epoch over the
survivors plus a standby (same group in masked mode), or over the survivors alone, but never with
fewer than `--min-workers` (default 2: one worker would hold everything). It then replays the
session's tokens as a prefill: every worker's state is a function of those tokens and the plan, so
nothing has to leave a worker and nothing is gathered. Greedy output continues as if nothing happened.

Epoch changes (recovery, revocation, standbys, expelling a liar) are membership.py's `Membership`: a
component the engine holds (`self.members`), the owner of the seats, the epoch and its order, and the
job's record of removals and suspicions. What it needs of the engine is declared (`EpochHost`: the
options, the links, the watch, the started workers, the sessions, the mode's hooks for an epoch
being opened); the engine reads the membership's state through properties (`order`, `epoch`,
`seats`, `recoveries`, ...) and hands the user's changes to it (`revoke`, `add_standby`, `workers`,
`shortfall`). A mode subclasses `EngineBase` with its plan (`plan_for`), its handshake (`hello`), `_forward_batch`,
`_release`, `_reset`, `_wipe`, `ping` and `shutdown`: client.Engine (structural) and masked.client.MaskedEngine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol, Self

import torch

from ..comm import (
    Admission,
    Comm,
    CommError,
    Identity,
    Member,
    PeerError,
    PeerLost,
    PublicId,
    Recorder,
    Watch,
    free_port,
)
from ..comm.mpi_fabric import WORLD as MPI_WORLD
from ..executor import Executor, WorkerJob, executor_for
from ..model import architecture as arch
from ..model.config import ModelError
from ..weights.loader import WeightSource, open_weights, resolve_model_path
from .deadline import StepClock
from .engine_options import FABRIC_BACKENDS, EngineOptions, default_threads, effective_context
from .launch import WorkerProcs
from .membership import Membership, Seat
from .placement import gpu_count, is_cuda, local_devices, torch_dtype

WAIT_NOTE_S = (5.0, 15.0)  # separately started workers not all joined: the first note, then one every ...
EXIT_WAIT_S = 5.0  # start-up failed on a closed link: how long to wait for that worker's process to end


class EpochPlan(Protocol):
    """What the engine itself reads of a mode's plan (structural.plan.Plan, masked.plan.MaskedPlan):
    how many workers the epoch has. The mode reads the rest (its subclass names its plan's type)."""

    @property
    def n(self) -> int: ...


class EngineBase:
    """Client side of one job: owns its executor and the workers it started (if any), the roster, the
    links of the current epoch, and the session's tokens (for replay)."""

    mode = "structural"

    def __init__(
        self,
        model: str | Path | None,
        opts: EngineOptions,
        recorder: Recorder | None = None,
        source: WeightSource | None = None,
    ):
        """`source`: an already opened `open_weights(model)`, to avoid parsing the file twice."""
        t0 = time.perf_counter()
        opts.check()
        opts.check_gpus()  # a GPU this machine lacks is refused before any worker starts
        self.opts = opts
        self.model_path = resolve_model_path(model)
        self.src: WeightSource = source or open_weights(self.model_path)
        self.config = c = self.src.config
        # who is in which epoch: the seats, the epoch's order, recoveries, removals, suspicions
        self.members = Membership(
            self, self.make_seats(), StepClock(opts.step_deadline_factor, opts.step_deadline_min_s)
        )
        self.plan: EpochPlan = self.plan_for(self.order)
        self.context = effective_context(c.max_positions, opts.context)
        # the user's side on --client-device, in the job's dtype, placed once (placement.py)
        self.client_device, self.dtype = torch.device(opts.placed_client_device), torch_dtype(opts.dtype)
        embed = self.src.read(arch.EMBED)  # (V, H)
        if embed.shape != (c.vocab, c.hidden):
            raise ModelError(f"embedding shape {tuple(embed.shape)} != ({c.vocab}, {c.hidden})")
        head = arch.read_lm_head(self.src, embed)
        self.embed = embed.to(device=self.client_device, dtype=self.dtype)
        self.lm_head = self.embed if head is embed else head.to(device=self.client_device, dtype=self.dtype)
        del embed, head
        self.final_norm = arch.read_final_norm(self.src).to(device=self.client_device, dtype=self.dtype)
        self.recorder = self.prepare(recorder)
        self.slot_history: dict[
            int, list[int]
        ] = {}  # each open session's tokens, per KV slot: what a replay runs again
        self._trees: dict[int, tuple[int, ...]] = {}  # the step being run's token trees, by slot (forward_batch)
        self._widths: dict[int, int] = {}  # per slot: its last step's columns when that step was a tree
        self.worker_keys: dict[int, Identity] = {}  # started workers' keys (handed to them on stdin)
        self.executor: Executor = executor_for(opts)  # who starts the workers, and where (executor/)
        self.procs: WorkerProcs | None = None  # the started workers' supervisor (None: listed workers)
        self._wait_t0: float | None = None  # when the wait for separately started workers began
        self._wait_next = 0.0  # when to say again that it goes on (spawn_failure)
        self.comm: Comm | None = None
        self._admission: Admission | None = None
        self.watch = Watch(opts.liveness_s)
        self.worker_info: list[dict[str, Any]] = []  # the open epoch's HELLO replies
        monitor = None
        try:
            roster, me, keys = self.executor.roster((s.pid, s.group, s.standby) for s in self.seats.values())
            host, port = self.executor.listen_address()
            self._admission = Admission(
                me,
                roster,
                host,
                port,
                log=opts.log,
                first_epoch=self.order,
                on_pulse=lambda m, link: self.watch.add(m.pid, link),
            )
            if self.executor.starts_workers:
                self.procs = self.executor.launch(self._worker_job(me, keys))
                if (where := self.executor.where()) is not None:
                    opts.log(f"note: {where}")
            monitor = opts.progress(self.procs, self.plan, self._admission.address) if opts.progress else None
            self.worker_info = self.members.open_epoch(self.order, time.monotonic() + opts.join_timeout_s)
            if self.procs is not None:
                self.procs.quiet = False
        except BaseException as e:
            try:  # (a timeout is not looked into: the worker is still running)
                # a worker that said why as it left (its farewell) is in the error already
                why = self._exit_words(e) if isinstance(e, PeerLost) and e.said is None else None
                if why is not None:  # the link only saw the connection close; the process said why
                    e.args = (f"{e} ({why})",)
            finally:
                if monitor is not None:
                    monitor.close(ok=False)
                    monitor = None
                self._abort()
            raise
        finally:
            if monitor is not None:
                monitor.close(ok=True)
        self.load_s = time.perf_counter() - t0

    # ---- membership (membership.py): its state, read here; the user's changes, handed to it ----

    @property
    def seats(self) -> dict[int, Seat]:
        """Every worker of the roster, by participant id."""
        return self.members.seats

    @property
    def order(self) -> list[int]:
        """The current epoch's participants in rank order (rank = position + 1)."""
        return self.members.order

    @property
    def epoch(self) -> int:
        return self.members.epoch

    @property
    def wanted(self) -> int:
        """The workers the user asked for (--workers): a smaller job says so (`shortfall`)."""
        return self.members.wanted

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """One record per epoch change after start-up (the run's JSON `recoveries`)."""
        return self.members.recoveries

    @property
    def removed(self) -> set[int]:
        """Revoked, or lost and replaced: never admitted again."""
        return self.members.removed

    @property
    def clock(self) -> StepClock:
        """Each step's deadline (deadline.py)."""
        return self.members.clock

    def workers(self) -> list[dict[str, Any]]:
        return self.members.workers()

    def shortfall(self) -> str | None:
        return self.members.shortfall()

    def revoke(self, pid: int, replay: bool = True) -> None:
        self.members.revoke(pid, replay)

    def add_standby(self, key: PublicId | None = None, host: str | None = None, group: str | None = None) -> int:
        return self.members.add_standby(key, host, group)

    # ---- what the membership needs of the engine (membership.EpochHost) ----

    @property
    def admission(self) -> Admission:
        """The job's rendezvous: who may join which epoch (made at start-up, before any epoch)."""
        if self._admission is None:
            raise CommError("the job's rendezvous is not open")
        return self._admission

    def plan_epoch(self, order: list[int]) -> None:
        """The plan of the epoch being opened over `order` becomes the engine's (`hello` sends it)."""
        self.plan = self.plan_for(order)

    # ---- what a mode provides ----

    def plan_for(self, order: list[int]) -> EpochPlan:
        """The plan of an epoch whose workers are the seats `order` (rank = position + 1)."""
        raise NotImplementedError

    def hello(self, deadline: float, order: list[int]) -> list[dict]:
        """The plan handshake with every worker of the epoch being opened (`order`: its participants in
        rank order; `self.order` is still the previous epoch's), after the links are up; returns
        per-worker info."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Tell every worker to stop (best effort)."""
        raise NotImplementedError

    def welcome(self) -> dict:
        """Mode-specific WELCOME fields (the plan's parameters), beyond rank and peers."""
        return {}

    def prepare(self, recorder: Recorder | None) -> Recorder | None:
        """Mode-specific client state, made before any worker starts; returns the comm's recorder."""
        return recorder

    def worker_args(self) -> list[str]:
        """Extra command-line arguments for spawned workers."""
        return list(self.opts.extra_worker_args)

    def _reset(self) -> None:
        raise NotImplementedError

    def _wipe(self) -> None:
        """Zero what the session left in the workers' (and the client's) buffers."""
        raise NotImplementedError

    @property
    def wire(self) -> Comm:
        """The open epoch's comm. With none open (an epoch change failed and nothing has reopened one
        yet) a step gets a CommError saying so, never an AttributeError on None."""
        if self.comm is None:
            raise CommError("no epoch is open: the last change of workers failed (the next request opens one)")
        return self.comm

    @property
    def n_workers(self) -> int:
        return self.plan.n

    def group_names(self) -> tuple[str, ...] | None:
        """The groups every epoch must have a worker in (masked mode), or None."""
        return None

    def group_of(self, rank: int) -> str | None:
        return self.seats[self.order[rank - 1]].group

    # ---- sessions, with recovery: a single session is a batch of one, in slot 0 ----

    # KV slots the workers make at a session's start: BatchRunner sets its max batch, and it stays (a
    # later run then zeroes that many slots at its start)
    batch_slots = 1
    # drafts a speculating session will likely carry at its next step (BatchRunner sets it; 0 without
    # speculation): a mode may prepare for that width (the masked mask groups work ahead for it)
    draft_hint = 0
    # whether the mode verifies a token tree in one step (speculative decoding, generation/token_tree.py:
    # the ancestor mask, RoPE by depth, the accepted path's KV kept); without it the loop sends chains
    verifies_trees = False
    slot_pos: dict[int, int]  # each open slot's position of its next token (set by the mode)

    @property
    def history(self) -> list[int]:
        """Slot 0's tokens so far: a single session's (the one `forward` runs)."""
        return list(self.slot_history.get(0, ()))

    def reset(self) -> None:
        """Start afresh: workers zero their KV shards, every slot of them."""
        self.slot_history = {}
        self.members.refill()  # a session's start, nothing to replay: empty seats are filled from standbys
        self.members.with_recovery(self._reset)

    def forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """One session's step: `forward_batch` with slot 0 alone. Logits (V,) of the last token, or
        (T, V) of every one with all_logits."""
        return self.forward_batch([(0, list(ids))], all_logits={0} if all_logits else ())[0]

    def forward_batch(
        self,
        items: list[tuple[int, list[int]]],
        all_logits: Collection[int] = (),
        trees: dict[int, tuple[int, ...]] | None = None,
    ) -> list[torch.Tensor]:
        """One step for one or several sessions, each in its own KV slot: `items` are (slot, ids), the
        ids run at that slot's position (a new slot starts at 0: its prefill). Returns each item's
        last-token logits (V,), or (T, V) for every token of a slot in `all_logits` (parity tests,
        a prompt's logprobs). A lost worker costs a new epoch and one replay of every open slot. A
        step over its deadline earns strikes; persistent slowness is judged by the workers' accounts
        (deadline.py), and its cause is treated as a lost worker."""
        if not items or any(not ids for _, ids in items) or len({s for s, _ in items}) != len(items):
            raise ValueError("a step needs distinct slots, each with tokens to run")
        if trees and not self.verifies_trees:
            raise ValueError("this mode verifies chains only: a token tree cannot run here")
        trees = dict(trees or {})
        for slot, ids in items:
            if slot in trees and (len(trees[slot]) != len(ids) or slot not in self.slot_history):
                raise ValueError(f"slot {slot}: a tree needs one parent per column, after the session's prefill")
        self._trees = trees  # the mode's _forward_batch reads the step's trees here
        full = frozenset(all_logits) & {s for s, _ in items}

        def replay() -> list[torch.Tensor]:
            t0 = time.perf_counter()
            logits: dict[int, torch.Tensor] = {}
            replayed = self.replay_slots(dict(items), logits, full)
            if self.recoveries:
                self.recoveries[-1].update(replay_s=round(time.perf_counter() - t0, 3), replayed_tokens=replayed)
            return [logits[slot] for slot, _ in items]

        tokens = sum(len(ids) for _, ids in items)
        try:
            out = self.members.with_recovery(
                lambda: self.members.timed_step(lambda: self._forward_batch(items, full), tokens), replay
            )
        finally:
            self._trees = {}
        for slot, ids in items:
            self.slot_history.setdefault(slot, []).extend(ids)
            self._widths[slot] = len(ids) if slot in trees else 0  # keep_path's: the tree step's columns
        return out

    def replay_slots(
        self,
        new: dict[int, list[int]],
        logits: dict[int, torch.Tensor] | None = None,
        full: frozenset[int] = frozenset(),
    ) -> int:
        """A fresh epoch's batch: every slot zeroed, then each open session's tokens (plus `new`, the
        step being retried) run again as a prefill in its own slot, one session per step (a step's
        size stays what one session's replay would be). `logits` gets each retried slot's result:
        of its `new` tokens only (all of them for a slot in `full`). Returns the tokens replayed."""
        trees, self._trees = self._trees, {}
        self._reset()
        runs = {slot: hist + new.get(slot, []) for slot, hist in self.slot_history.items() if slot not in trees}
        runs.update({slot: ids for slot, ids in new.items() if slot not in runs and slot not in trees})
        for slot, ids in runs.items():
            out = self._forward_batch([(slot, ids)], full & {slot})[0]
            if logits is not None and slot in new:
                logits[slot] = out[-len(new[slot]) :] if slot in full else out
        for slot, parents in trees.items():  # a tree step retried: its session's tokens, then the tree
            self._forward_batch([(slot, self.slot_history[slot])])
            self._trees = {slot: parents}
            out = self._forward_batch([(slot, new[slot])], full & {slot})[0]
            self._trees = {}
            if logits is not None:
                logits[slot] = out
        self._trees = trees
        return sum(len(h) for h in self.slot_history.values())

    def rollback(self, slot: int, keep: int) -> None:
        """A session keeps only its first `keep` tokens (speculative decoding rejected the rest of its
        last step's columns): its history and position go back to `keep`, so its next step runs at
        that position. The rejected positions' KV entries are never attended: the attention of a step
        at position p reads positions < p + T only, and the mode zeroes them (`_rollback`: the
        structural workers when the next step's span starts below what they hold, the masked client
        in its own cache now)."""
        hist = self.slot_history.get(slot)
        if hist is None or not 0 < keep <= len(hist):
            raise ValueError(f"cannot roll slot {slot} back to {keep} tokens (it holds {len(hist or ())})")
        if keep == len(hist):
            return
        del hist[keep:]
        self._rollback(slot, keep)

    def keep_path(self, slot: int, path: list[int]) -> None:
        """After a token-tree step: the session keeps the columns `path` of its last step (0 first,
        each the parent of the next), the rest are dropped: its history holds the path's tokens and
        its next step starts after them; the mode moves the kept KV entries there and drops the
        others (`_keep`: the structural workers when the next step names the kept columns)."""
        hist, width = self.slot_history.get(slot), self._widths.get(slot, 0)
        if (
            hist is None
            or not width
            or not path
            or path[0] != 0
            or any(b <= a for a, b in zip(path, path[1:], strict=False))
        ):
            raise ValueError(f"slot {slot}: no tree step to keep columns {path} of")
        if path[-1] >= width:
            raise ValueError(f"slot {slot}: column {path[-1]} beyond its last step's {width}")
        base = len(hist) - width
        hist[base:] = [hist[base + c] for c in path]
        self._widths[slot] = 0
        self._keep(slot, base, path)

    def _keep(self, slot: int, base: int, path: list[int]) -> None:
        raise NotImplementedError("this mode verifies chains only")

    def _rollback(self, slot: int, keep: int) -> None:
        self.slot_pos[slot] = keep

    def release(self, slot: int) -> None:
        """One session is over: its KV slot is zeroed on every worker now. Best effort: a worker that
        cannot be told (lost, or the epoch being replaced) zeroes its memory when the next epoch
        resets it or its process ends."""
        self.slot_history.pop(slot, None)
        try:
            self._release(slot)  # also without an epoch: the client's own memory (masked mode) is wiped
        except CommError:
            pass

    def _forward_batch(
        self, items: list[tuple[int, list[int]]], full: frozenset[int] = frozenset()
    ) -> list[torch.Tensor]:
        """The mode's step: each item's last-token logits (V,), or (T, V) for a slot in `full`."""
        raise NotImplementedError

    def _batch_spans(self, items: list[tuple[int, list[int]]]) -> list[tuple[int, int, int]]:
        """(slot, position, T) of each item of a step, checked: the slot is one of the batch's and
        its tokens fit the context. A mode's `slot_pos` holds each slot's next position."""
        spans = []
        for slot, ids in items:
            if not 0 <= slot < self.batch_slots:
                raise ValueError(f"slot {slot} outside the batch's 0..{self.batch_slots - 1}")
            pos = self.slot_pos.get(slot, 0)
            if pos + len(ids) > self.context:
                raise ValueError(f"{pos + len(ids)} tokens exceed the context window of {self.context}")
            spans.append((slot, pos, len(ids)))
        return spans

    def _release(self, slot: int) -> None:
        raise NotImplementedError

    def end_session(self) -> None:
        """The session is over: wipe its state everywhere now (not at the next session's start)."""
        self.slot_history = {}
        try:
            self._wipe()
        except PeerError:
            pass  # a lost worker's memory is its process's; the next request recovers

    # ---- start-up ----

    def make_seats(self) -> dict[int, Seat]:
        """Every worker of the roster: the topology's, or N local ones plus --standby spares."""
        opts = self.opts
        if opts.topology is not None:
            return {p.rank: Seat(p.rank, p.capacity, p.group, p.standby) for p in opts.topology.all_workers}
        caps = opts.capacities or (1.0,) * opts.n_workers
        seats = {r: Seat(r, caps[r - 1], self.initial_group(r)) for r in range(1, opts.n_workers + 1)}
        spare_groups = self.spare_groups()
        for i, g in enumerate(spare_groups * opts.standby):
            pid = opts.n_workers + 1 + i
            seats[pid] = Seat(pid, min(caps), g, standby=True)
        return seats

    def initial_group(self, pid: int) -> str | None:
        """A local worker's group (masked mode)."""
        return None

    def spare_groups(self) -> list[str | None]:
        """One local standby per entry, for each --standby (masked mode: one per group)."""
        return [None]

    def welcome_for(self, member: Member) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "n_workers": self.n_workers,
            "timeout_s": self.opts.timeout_s,
            "dtype": self.opts.dtype,  # the workers compute in it, and the wire carries it
            **self.welcome(),
        }
        if self.opts.mpi_world:  # workers that mpiexec started together
            out["fabric"] = {"backend": "mpi", "store": MPI_WORLD}
        elif self.opts.comm_backend == "mpi":  # one rendezvous directory per epoch (ports are not reused)
            out["fabric"] = {"backend": "mpi", "store": os.path.join(self._store, f"epoch{self.epoch}")}
        elif self.opts.comm_backend in FABRIC_BACKENDS:
            out["fabric"] = {"backend": self.opts.comm_backend, "store": self._store}
        return out

    def _worker_job(self, me: Identity | None, keys: dict[int, Identity]) -> WorkerJob:
        """How the workers the executor starts run: `fusion worker` pointed at this client's
        rendezvous, with this job's model, threads, devices and mode arguments."""
        opts = self.opts
        threads = opts.threads or default_threads(self.n_workers)
        if opts.comm_backend == "mpi":  # the fabric's rendezvous: a directory only this user can enter
            self._store = tempfile.mkdtemp(prefix="fusion-mpi-")
        elif opts.comm_backend in FABRIC_BACKENDS:
            self._store = f"127.0.0.1:{free_port()}"
        args = [
            "--master",
            self.admission.address,
            "--model",
            str(self.model_path),
            "--threads",
            str(threads),
            "--timeout",
            str(opts.timeout_s),
            "--join-timeout",
            str(opts.join_timeout_s),
        ]
        gpus = gpu_count() if is_cuda(opts.device) else 0
        args += ["--client-key", me.public.line(), "--key", "-"] if me is not None else ["--insecure"]
        args += ["--quiet"]  # this client logs for its workers; their log files keep their errors and warnings
        if opts.progress is not None:
            args += ["--progress", "lines"]  # workers report load progress into their logs
        args += self.worker_args()
        env = self.worker_env(threads)

        def argv(rank: int) -> list[str]:
            return (
                args
                + ["--device", local_devices(opts.device, rank, gpus)[rank - 1]]  # "cuda": the GPUs in turn
                + list(opts.args_for_worker.get(rank, ()))
                + ([] if me is not None else ["--rank", str(rank)])
            )

        self.worker_keys = dict(keys)
        secret = (lambda rank: self.worker_keys[rank].pem_bundle()) if me is not None else None
        return WorkerJob(argv, len(self.seats), env, secret)

    def _exit_words(self, err: PeerLost) -> str | None:
        """Why a start-up link closed when a local worker's process ended: "worker K exited: <its own
        last words>", for the link's worker if it exited, else for the first local worker that did (a
        worker whose peer died closes its links and stays up). Waits up to EXIT_WAIT_S: a process
        exits after its connections close. None for a remote worker, or when none exited."""
        if self.procs is None or not 1 <= err.rank <= len(self.order):
            return None
        seat = err.rank if err.watched else self.order[err.rank - 1]
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline:
            if (exited := self.procs.exit_reason(seat)) is not None:
                return exited
            if (dead := self.procs.failure()) is not None:
                return self.procs.exit_reason(dead[0])
            time.sleep(0.05)
        return None

    def spawn_failure(self) -> str | None:
        """Polled while the first epoch's workers join: why to stop waiting (a local worker died), else
        None. Workers started elsewhere may never come, and off a terminal nothing else shows the wait:
        a note after WAIT_NOTE_S[0] seconds, then every WAIT_NOTE_S[1]."""
        if self.procs is None:
            now = time.monotonic()
            if self._wait_t0 is None:
                self._wait_t0, self._wait_next = now, now + WAIT_NOTE_S[0]
            elif now >= self._wait_next:
                self._wait_next = now + WAIT_NOTE_S[1]
                address = self._admission.address if self._admission is not None else "?"
                n = len(self.order)
                self.opts.log(
                    f"note: waiting for {n} worker{'s' if n != 1 else ''} to join at {address}: "
                    f"{now - self._wait_t0:.0f} s so far, giving up after {self.opts.join_timeout_s:g} s "
                    "(--join-timeout)"
                    + (
                        "; on each worker's machine: `fusion worker --topology FILE --key ITS.key`"
                        if self.opts.topology
                        else ""
                    )
                )
            return None
        dead = self.procs.failure()
        return f"worker {dead[0]} exited before joining: {dead[1]}" if dead else None

    def worker_env(self, threads: int) -> dict[str, str]:
        return dict(self.opts.worker_env)

    # ---- lifetime ----

    def _abort(self) -> None:
        """Start-up failed: stop whatever was started, then let the error through."""
        if self.procs is not None:
            self.procs.stop(grace_s=0)
        self.executor.stop()
        if self._admission is not None:
            self._admission.close()
        if self.comm is not None:
            self.comm.close(grace_s=0)
        self.watch.close()

    def close(self) -> None:
        """Wipe, shut every worker down (standbys too), stop what we started."""
        if self.procs is not None:
            self.procs.closing = True  # from here on a worker's exit is expected, not a failure to report
        if self.comm is not None:
            try:
                self._wipe()
                self.shutdown()
                self.comm.flush()
            except Exception:
                pass
        for p in self.watch.ranks:  # standbys, and anyone an abandoned epoch left waiting
            self.watch.tell(p, {"stop": True})
        if self.procs is not None:
            self.procs.stop()
        self.executor.stop()
        if self.opts.comm_backend == "mpi" and getattr(self, "_store", None):  # the fabric's rendezvous directory
            shutil.rmtree(self._store, ignore_errors=True)
        if self.comm is not None:
            self.comm.close()
        if self._admission is not None:
            self._admission.close()
        self.watch.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def control_word(op: int, a: int = 0, b: int = 0, c: int = 0) -> torch.Tensor:
    """[op, a, b, c] as the int64 vector every control message is."""
    return torch.tensor([int(op), a, b, c], dtype=torch.int64)
