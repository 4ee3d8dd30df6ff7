"""The client's side of a job, common to both modes: the model's client-side weights, who the workers
are, starting or admitting them, the links, epochs and recovery, and an orderly close (also when
start-up fails).

Who the workers are, three ways:

  local      `--workers N`: the client spawns N processes on this machine. It makes a fresh key pair
             for itself and for each worker (in memory; a worker gets its secret on stdin), so even on
             one machine only the processes it started can join, over TLS on loopback.
  topology   `--topology FILE --key client.key`: the user's file lists every worker's address, share
             and public key; the client admits exactly those keys (comm/rendezvous.py).
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

A mode subclasses `EngineBase` with its plan (`plan_for`), its handshake (`hello`), `_forward`,
`_reset`, `_wipe`, `ping` and `shutdown`: client.Engine (structural) and masked.client.MaskedEngine.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .comm import Admission, Comm, CommError, Identity, Member, PeerError, PublicId, Recorder, Watch, free_port
from .comm.liveness import DEADLINE_S
from .config import ModelError
from .errors import UsageError, WorkerMisbehaved
from .launch import WorkerProcs
from .topology import Topology, check_here
from .weights import WeightSource, open_weights, resolve_model_path

DEFAULT_CONTEXT = 4096  # KV positions preallocated per session (capped by the model's own window)
ENGINES = ("tls", "tcp", "gloo", "nccl")  # tls: the secure links; the others are plaintext somewhere
FABRICS = ("gloo", "nccl")  # engines whose worker-to-worker collectives run on torch.distributed


class TooFewWorkers(CommError):
    """A new epoch would have fewer workers than --min-workers: refused, never traded for availability."""


class UnknownWorker(UsageError):
    """A membership change names a participant the job does not have."""


def effective_context(model_window: int, requested: int | None) -> int:
    """KV positions per session: the request (or DEFAULT_CONTEXT), never beyond the model's window."""
    return min(model_window, requested or DEFAULT_CONTEXT)


def warn(line: str) -> None:
    sys.stderr.write(f"fusion: {line}\n")
    sys.stderr.flush()


@dataclass
class EngineOptions:
    n_workers: int = 2
    capacities: tuple[float, ...] | None = None
    topology: Topology | None = None
    key: Identity | None = None  # the client's own key (topology runs); local runs make a fresh one
    insecure: bool = False  # plaintext links, unauthenticated claims: asked for by name only
    master: str | None = None  # HOST:PORT to listen at for separately started workers (insecure only)
    engine: str = "tls"  # tls | tcp (insecure) | gloo, nccl (torch.distributed among workers)
    context: int | None = None
    threads: int | None = None  # torch threads per worker; None = cores // N, >= 1
    timeout_s: float = 120.0  # bound on every wait for a peer during the session
    join_timeout_s: float = 120.0  # bound on start-up: rendezvous, then the workers' loading
    device: str = "cpu"
    standby: int = 0  # local runs: spare workers spawned to replace a lost one (per group in masked mode)
    min_workers: int = 2  # an epoch never has fewer workers (one would hold everything)
    liveness_s: float = DEADLINE_S  # a worker silent this long has failed
    recover: bool = True  # on a lost worker: a new epoch and a replay (False: fail the request)
    worker_env: dict[str, str] = field(default_factory=dict)
    extra_worker_args: tuple[str, ...] = ()
    args_for_worker: dict[int, tuple[str, ...]] = field(default_factory=dict)  # more, for one local worker
    # Start-up display (progress.load_monitor): called as progress(procs, plan, master) before the
    # rendezvous, closed after the handshake. None = quiet.
    progress: Callable[..., Any] | None = None
    log: Callable[[str], None] = warn  # refused connections, recoveries and other notices
    # TEST ONLY, the audit's negative control for revocation: "keep-revoked" makes `revoke` record the
    # user's revocation but keep the worker in the next epoch (a client bug that lets a revoked worker
    # keep receiving state). `fusion audit verify` must fail on it (docs/audit.md). None: no bug.
    audit_negative_control: str | None = None

    def check(self) -> None:
        """Option combinations that cannot work; raises CommError naming the fix."""
        if self.engine not in ENGINES:
            raise CommError(f"unknown engine {self.engine!r} (choose from {', '.join(ENGINES)})")
        if self.engine != "tls" and not self.insecure and not (self.engine == "nccl" and self.is_local):
            raise CommError(f"--engine {self.engine} is plaintext: add --insecure to ask for it by name")
        if self.engine in FABRICS and not self.is_local:
            raise CommError(f"--engine {self.engine} runs on one machine only (spawned workers)")
        if self.master and self.topology is None and not self.insecure:
            raise CommError("--master without --topology cannot pin the workers' keys: use --topology FILE "
                            "(with every participant's key) or --insecure")  # fmt: skip
        if self.topology is not None and not self.insecure:
            self.topology.require_keys()
            if self.key is None:
                raise CommError("a --topology run needs the client's key: --key FILE (its public line is in the file)")
            if self.topology.client.key is not None and self.topology.client.key != self.key.public:
                raise CommError(f"--key is not the client's key of {self.topology.path} "
                                f"(file: {self.topology.client.key.fingerprint}, --key: {self.key.public.fingerprint})")  # fmt: skip
        if self.standby < 0 or (self.standby and not self.is_local):
            raise CommError("--standby N spawns local spares; a topology names its standbys (role = \"standby\")")
        if self.capacities is not None and len(self.capacities) != self.n_workers:
            raise CommError(f"{len(self.capacities)} capacities given for {self.n_workers} workers")
        if self.min_workers < 1:
            raise CommError(f"--min-workers must be >= 1, got {self.min_workers}")
        if not (self.liveness_s > 0):
            raise CommError(f"--liveness must be > 0, got {self.liveness_s}")

    @property
    def is_local(self) -> bool:
        return self.topology is None and self.master is None


def default_threads(n_workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // n_workers)


@dataclass(frozen=True)
class Seat:
    """A worker of the roster, for the life of the job."""

    pid: int  # participant id: its rank in the first epoch (standbys come after the active workers)
    capacity: float = 1.0
    group: str | None = None  # "A" / "B" (masked mode)
    standby: bool = False


class EngineBase:
    """Client side of one job: owns the worker processes (if local), the roster, the links of the
    current epoch, and the session's tokens (for replay)."""

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
        self.opts = opts
        self.model_path = resolve_model_path(model)
        self.src: WeightSource = source or open_weights(self.model_path)
        self.config = c = self.src.config
        self.seats = self.make_seats()
        self.order = [s.pid for s in self.seats.values() if not s.standby]  # the current epoch
        self.epoch = 0
        self.plan = self.plan_for(self.order)
        self.context = effective_context(c.max_positions, opts.context)
        self.embed = self.src.read("model.embed_tokens.weight")  # (V, H)
        if self.embed.shape != (c.vocab, c.hidden):
            raise ModelError(f"embedding shape {tuple(self.embed.shape)} != ({c.vocab}, {c.hidden})")
        self.final_norm = self.src.read("model.norm.weight")
        tied = c.tie_embeddings or not self.src.has("lm_head.weight")
        self.lm_head = self.embed if tied else self.src.read("lm_head.weight")
        self.recorder = self.prepare(recorder)
        self.history: list[int] = []  # the session's tokens so far: what a replay runs again
        self.recoveries: list[dict] = []  # one record per epoch change after start-up
        self.removed: set[int] = set()  # revoked, or lost and replaced: never admitted again
        self.convicted: set[int] = set()  # caught returning wrong results: out at the first chance
        self.opening: list[int] = []  # the order of the epoch being opened (hello() sees it)
        self._keys: dict[int, Identity] = {}  # local workers' keys (handed to them on stdin)
        self.procs: WorkerProcs | None = None
        self.comm: Comm | None = None
        self._admission: Admission | None = None
        self.watch = Watch(opts.liveness_s)
        monitor = None
        try:
            roster, me, worker_keys = self._roster()
            host, port = self._listen_address()
            self._admission = Admission(me, roster, host, port, log=opts.log, first_epoch=self.order,
                                        on_pulse=lambda m, link: self.watch.add(m.pid, link))  # fmt: skip
            if opts.is_local:
                self.procs = self._spawn(me, worker_keys)
            monitor = opts.progress(self.procs, self.plan, self._admission.address) if opts.progress else None
            self.worker_info = self._open_epoch(self.order, time.monotonic() + opts.join_timeout_s)
            if self.procs is not None:
                self.procs.quiet = False
        except BaseException:
            if monitor is not None:
                monitor.close(ok=False)
                monitor = None
            self._abort()
            raise
        finally:
            if monitor is not None:
                monitor.close(ok=True)
        self.load_s = time.perf_counter() - t0

    # ---- what a mode provides ----

    def plan_for(self, order: list[int]) -> Any:
        """The plan of an epoch whose workers are the seats `order` (rank = position + 1)."""
        raise NotImplementedError

    def hello(self, deadline: float) -> list[dict]:
        """The plan handshake with every worker, after the links are up; returns per-worker info."""
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

    def _forward(self, ids: list[int], all_logits: bool) -> torch.Tensor:
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def _wipe(self) -> None:
        """Zero what the session left in the workers' (and the client's) buffers."""
        raise NotImplementedError

    @property
    def n_workers(self) -> int:
        return self.plan.n

    def group_names(self) -> tuple[str, ...] | None:
        """The groups every epoch must have a worker in (masked mode), or None."""
        return None

    def group_of(self, rank: int) -> str | None:
        return self.seats[self.order[rank - 1]].group

    # ---- the session, with recovery ----

    def reset(self) -> None:
        """Start a new session (workers zero their KV shards)."""
        self.history = []
        self._with_recovery(self._reset)

    def forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` at the session's position; logits (V,) of the last token, or (T, V).
        A lost worker costs a new epoch and a replay of the session, not the request."""
        if not ids:
            raise ValueError("no tokens to run")

        def replay() -> torch.Tensor:
            t0 = time.perf_counter()
            self._reset()
            logits = self._forward(self.history + list(ids), all_logits)
            if self.recoveries:
                self.recoveries[-1]["replay_s"] = round(time.perf_counter() - t0, 3)
            return logits[-len(ids) :] if all_logits else logits

        out = self._with_recovery(lambda: self._forward(list(ids), all_logits), replay)
        self.history += list(ids)
        return out

    def end_session(self) -> None:
        """The session is over: wipe its state everywhere now (not at the next session's start)."""
        self.history = []
        try:
            self._wipe()
        except PeerError:
            pass  # a lost worker's memory is its process's; the next request recovers

    def _with_recovery(self, step: Callable[[], Any], replay: Callable[[], Any] | None = None) -> Any:
        if self.convicted & set(self.order):
            self._replace_convicted()  # a liar that could not be replaced before: no work until it is
        if self.watch.failure() is not None and set(self.watch.failed()) & set(self.order):
            self.recover(None)  # noticed while idle
            if replay is not None:
                return self._with_recovery(replay)
        for attempt in range(len(self.seats) + 1):
            try:
                return step() if attempt == 0 else (replay or step)()
            except PeerError as e:
                self.recover(e)
            except WorkerMisbehaved as e:
                self._expel(e)
                raise
        raise CommError("gave up after as many recoveries as there are workers")

    def _expel(self, err: WorkerMisbehaved) -> None:
        """Workers caught lying: the session is over (its request fails, nothing of it is replayed)
        and they leave the job now, replaced by standbys where there are any."""
        self.history = []
        self.opts.log(f"{err}: removing {'them' if len(err.pids) > 1 else 'it'} from the job")
        self.convicted |= set(err.pids) & set(self.order)
        try:
            self._replace_convicted()
        except TooFewWorkers as e:
            raise TooFewWorkers(f"{err}; and {e}") from err

    def _replace_convicted(self) -> None:
        """End the epoch the liars were part of and open the next one without them (refused, with
        the job waiting for a replacement, when that would leave too few)."""
        gone = self.convicted & set(self.order)
        t0, noticed = time.perf_counter(), time.time()
        if self.comm is not None:  # the abandoned step's epoch is over, whatever comes next
            self._retire(gone)
        for pid in gone:
            self._await_spare(self.seats[pid].group, time.monotonic() + self.opts.join_timeout_s)
        order = self._next_order(gone, why="removing the worker that lied leaves")
        self.epoch += 1
        self.plan = self.plan_for(order)
        self.worker_info = self._open_epoch(order, time.monotonic() + self.opts.join_timeout_s)
        self.order = order
        self.recoveries.append({"epoch": self.epoch, "lost": sorted(gone), "order": order,
                                "reason": "returned a wrong product (caught by the check)",
                                "noticed_unix": round(noticed, 3), "epoch_s": round(time.perf_counter() - t0, 3),
                                "replayed_tokens": 0})  # fmt: skip

    def recover(self, err: PeerError | None) -> None:
        """Open the next epoch without the failed workers (replaced by standbys where there are
        any), or raise when that would leave too few. `err`: the failure a data link reported."""
        if not self.opts.recover:
            raise err or CommError("a worker failed")
        t0, noticed = time.perf_counter(), time.time()
        # Who failed is the watch's call: when one worker dies, its peers drop the epoch and close their
        # links too, so a link error alone does not say whose fault it was. Wait for the watch to see a
        # failure (a dead pulse is seen at once, a silent one after --liveness); a link error nobody's
        # pulse explains by then counts against that link's worker.
        deadline = time.monotonic() + self.opts.liveness_s + 1.0
        failed = {p for p in self.watch.failed() if p in self.order}
        while not failed and time.monotonic() < deadline and not (err is not None and err.watched):
            time.sleep(0.05)
            failed = {p for p in self.watch.failed() if p in self.order}
        time.sleep(0.2)  # a second process that went down with the first one shows up now
        failed |= {p for p in self.watch.failed() if p in self.order}
        if err is not None and err.watched:
            failed.add(err.rank)
        elif not failed and err is not None and 1 <= err.rank <= len(self.order):
            failed.add(self.order[err.rank - 1])
        if not failed:
            raise err or CommError("a worker failed")
        seen = self.watch.failed()
        reason = "; ".join(seen[p] for p in sorted(failed) if p in seen) or str(err)
        order = self._next_order(failed)
        self.opts.log(f"worker{'s' if len(failed) > 1 else ''} {sorted(failed)} lost ({reason}); "
                      f"epoch {self.epoch + 1} over {order}")  # fmt: skip
        self._retire(failed)
        self.epoch += 1
        self.plan = self.plan_for(order)
        self.worker_info = self._open_epoch(order, time.monotonic() + self.opts.join_timeout_s)
        self.order = order
        self.recoveries.append({"epoch": self.epoch, "lost": sorted(failed), "order": order, "reason": reason,
                                "noticed_unix": round(noticed, 3), "epoch_s": round(time.perf_counter() - t0, 3),
                                "replayed_tokens": len(self.history)})  # fmt: skip

    # ---- membership, by the user ----

    def workers(self) -> list[dict]:
        """Every participant: id, rank in the current epoch (None for a spare), group, capacity, and
        state: active, standby, failed (its pulse stopped) or removed (revoked or replaced)."""
        failed, watched = self.watch.failed(), set(self.watch.ranks)
        out = []
        for pid, seat in sorted(self.seats.items()):
            rank = self.order.index(pid) + 1 if pid in self.order else None
            if pid in self.removed:
                state = "removed"
            elif pid in failed:
                state = "failed"
            elif rank is not None:
                state = "active"
            else:
                state = "standby" if pid in watched else "standby (not joined)"
            member = self._admission.roster.get(pid)
            out.append({"id": pid, "rank": rank, "group": seat.group, "capacity": seat.capacity, "state": state,
                        "where": member.label() if member else None})  # fmt: skip
        return out

    def revoke(self, pid: int, replay: bool = True) -> None:
        """Remove a participant now: it is told to wipe and leave, it may never rejoin, and the
        session (if one is open) is replayed on the next epoch, with a standby in its place when
        there is one. Refused, session unharmed, when it would leave fewer than --min-workers.
        `replay=False`: open the next epoch only; the caller replays (the audit runner does, inside a
        recorded step: `reset()` then `forward(history)`)."""
        if pid not in self.seats or pid in self.removed:
            live = [str(p) for p in self.seats if p not in self.removed]
            raise UnknownWorker(f"no worker {pid} to revoke (workers: {', '.join(live)})")
        if pid not in self.order:  # a standby: nothing to re-plan
            self._retire({pid}, epoch_over=False)
            return
        keep = self.opts.audit_negative_control == "keep-revoked"
        if self.opts.audit_negative_control not in (None, "keep-revoked"):
            raise ValueError(f"unknown audit negative control {self.opts.audit_negative_control!r}")
        if keep:  # NEGATIVE CONTROL (tests only): the revocation is recorded, the worker stays
            self.opts.log(f"audit negative control keep-revoked: worker {pid} stays in epoch {self.epoch + 1}")
            order = list(self.order)
        else:
            self._await_spare(self.seats[pid].group, time.monotonic() + self.opts.join_timeout_s)
            order = self._next_order({pid}, why="revoking it would leave")
        t0, noticed = time.perf_counter(), time.time()
        self._retire(set() if keep else {pid})
        self.epoch += 1
        self.plan = self.plan_for(order)
        self.worker_info = self._open_epoch(order, time.monotonic() + self.opts.join_timeout_s)
        self.order = order
        record = {"epoch": self.epoch, "lost": [pid], "revoked": [pid], "order": order,
                  "reason": f"worker {pid} revoked by the user", "noticed_unix": round(noticed, 3),
                  "epoch_s": round(time.perf_counter() - t0, 3), "replayed_tokens": len(self.history)}  # fmt: skip
        if self.history and replay:  # the open session moves to the new epoch now
            t1 = time.perf_counter()
            self._reset()
            self._forward(list(self.history), False)
            record["replay_s"] = round(time.perf_counter() - t1, 3)
        self.recoveries.append(record)

    def add_standby(self, key: PublicId | None = None, host: str | None = None, group: str | None = None) -> int:
        """Enroll one more participant as a standby; returns its id. Local runs spawn it (a fresh
        key); otherwise the user names its public key (and host), and starts it there with
        `fusion worker --master ... --client-key ... --key ...`. Migration = add, then revoke."""
        pid = max(self.seats) + 1
        capacity = min(s.capacity for s in self.seats.values())
        names = self.group_names()
        if names is not None and group not in names:
            raise UnknownWorker(f"a masked job's standby needs its group: {' or '.join(names)}")
        if names is None and group is not None:
            raise UnknownWorker("groups are for masked jobs only")
        if self.opts.is_local:
            if key is not None:
                raise UnknownWorker("a local run spawns its own workers: add takes no key")
            ident = Identity.new() if not self.opts.insecure else None
            member = Member(pid, "127.0.0.1", ident.public if ident else None, group, None, True)
            if ident is not None:
                self._keys[pid] = ident
        else:
            if key is None and not self.opts.insecure:
                raise UnknownWorker("name the new worker's public key (fc1....): the user decides who takes part")
            member = Member(pid, host or "", key if not self.opts.insecure else None, group, None, True)
        self._admission.enroll(member)
        self.seats[pid] = Seat(pid, capacity, group, standby=True)
        if self.opts.is_local:
            self.procs.spawn(pid)
        return pid

    def _await_spare(self, group: str | None, deadline: float) -> None:
        """When a standby of `group` was enrolled but has not joined yet (just added), wait for it."""
        def pending() -> bool:
            return any(s.standby and s.group == group and p not in self.order and p not in self.removed
                       and p not in self.watch.ranks and p not in self.watch.failed() for p, s in self.seats.items())  # fmt: skip

        def ready() -> bool:
            return any(s.standby and s.group == group and p not in self.order and p in self.watch.ranks
                       and p not in self.watch.failed() for p, s in self.seats.items())  # fmt: skip

        while pending() and not ready() and time.monotonic() < deadline:
            if self.procs is not None and self.procs.failure():
                break  # a local spare that died before joining will not come
            time.sleep(0.1)

    def _next_order(self, failed: set[int], why: str = "refusing to continue with") -> list[int]:
        alive_spares = [p for p, s in self.seats.items() if s.standby and p not in self.order and p in self.watch.ranks
                        and p not in self.watch.failed()]  # fmt: skip
        order = []
        for p in self.order:
            if p not in failed:
                order.append(p)
                continue
            spare = next((q for q in alive_spares if self.seats[q].group == self.seats[p].group), None)
            if spare is not None:
                alive_spares.remove(spare)
                order.append(spare)
        if len(order) < self.opts.min_workers:
            raise TooFewWorkers(f"{why} {len(order)} worker{'s' if len(order) != 1 else ''}: fewer than "
                            f"--min-workers {self.opts.min_workers} (no standby left to take its place; one worker "
                            "alone would hold the whole state)")  # fmt: skip
        missing = [g for g in self.group_names() or () if g not in {self.seats[p].group for p in order}]
        if missing:
            raise TooFewWorkers(f"{why} no worker in group {missing[0]}: a masked epoch needs every group")
        return order

    def _retire(self, gone: set[int], epoch_over: bool = True) -> None:
        """The `gone` workers may never come back (told to wipe and leave); when the epoch is over,
        the others drop its links."""
        for p in gone:
            self._admission.remove(p)
            self.removed.add(p)
            if self.procs is not None:
                self.procs.retired.add(p)
            self.watch.tell(p, {"revoke": self.epoch})
            self.watch.forget(p)
        if not epoch_over:
            return
        for p in self.order:
            if p not in gone:
                self.watch.tell(p, {"abort": self.epoch})
        if self.comm is not None:
            self.comm.close(grace_s=0)
            self.comm = None

    def _open_epoch(self, order: list[int], deadline: float) -> list[dict]:
        """Admit, link and greet the epoch's workers; returns their HELLO info."""
        adm = self._admission
        adm.expect(self.epoch, order)
        if self.epoch > 0:
            for p in order:
                self.watch.tell(p, {"join": self.epoch})
        joined = adm.collect(order, deadline, abort=self._spawn_failure if self.epoch == 0 else lambda: None)
        links = adm.welcome(self.epoch, order, joined, deadline, self._welcome)
        self.comm = Comm(0, len(order), links, timeout_s=self.opts.timeout_s, recorder=self.recorder,
                         engine=self.opts.engine)  # fmt: skip
        active = set(order)
        for link in links.values():
            link.check = lambda: self.watch.check(only=active)
        self.opening = list(order)  # hello() runs before `self.order` becomes this epoch's
        return self.hello(deadline)

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

    def _roster(self) -> tuple[list[Member], Identity | None, dict[int, Identity]]:
        opts, secure = self.opts, not self.opts.insecure
        if opts.topology is not None:
            roster = [Member(p.rank, p.host, p.key if secure else None, p.group, p.name, p.standby)
                      for p in opts.topology.all_workers]  # fmt: skip
            return roster, opts.key if secure else None, {}
        seats = self.seats.values()
        if opts.master is not None:  # insecure, separately started: hosts come from their JOINs
            return [Member(s.pid, "", None, s.group, None, s.standby) for s in seats], None, {}
        me = Identity.new() if secure else None
        keys = {s.pid: Identity.new() for s in seats} if secure else {}
        roster = [Member(s.pid, "127.0.0.1", keys[s.pid].public if secure else None, s.group, None, s.standby)
                  for s in seats]  # fmt: skip
        return roster, me, keys

    def _listen_address(self) -> tuple[str, int]:
        opts = self.opts
        if opts.topology is not None:
            check_here(opts.topology.client)
            return opts.topology.client.host, opts.topology.port
        if opts.master is not None:
            host, _, port = opts.master.rpartition(":")
            return host.strip("[]"), int(port)
        return "127.0.0.1", 0

    def _welcome(self, member: Member) -> dict:
        out = {"mode": self.mode, "n_workers": self.n_workers, "timeout_s": self.opts.timeout_s, **self.welcome()}
        if self.opts.engine in FABRICS:
            out["fabric"] = {"backend": self.opts.engine, "store": self._store}
        return out

    def _spawn(self, me: Identity | None, keys: dict[int, Identity]) -> WorkerProcs:
        opts = self.opts
        threads = opts.threads or default_threads(self.n_workers)
        if opts.engine in FABRICS:
            self._store = f"127.0.0.1:{free_port()}"
        args = [
            "--master", self._admission.address, "--model", str(self.model_path), "--threads", str(threads),
            "--timeout", str(opts.timeout_s), "--join-timeout", str(opts.join_timeout_s), "--device", opts.device,
        ]  # fmt: skip
        args += ["--client-key", me.public.line(), "--key", "-"] if me is not None else ["--insecure"]
        if opts.progress is not None:
            args += ["--progress", "lines"]  # workers report load progress into their logs
        args += self.worker_args()
        env = self.worker_env(threads)

        def argv(rank: int) -> list[str]:
            return args + list(opts.args_for_worker.get(rank, ())) + ([] if me is not None else ["--rank", str(rank)])

        self._keys = dict(keys)
        stdin = (lambda rank: self._keys[rank].pem_bundle()) if me is not None else None
        return WorkerProcs(argv, len(self.seats), env, stdin_for_rank=stdin)

    def _spawn_failure(self) -> str | None:
        dead = self.procs.failure() if self.procs is not None else None
        return f"worker {dead[0]} exited before joining: {dead[1]}" if dead else None

    def worker_env(self, threads: int) -> dict[str, str]:
        return dict(self.opts.worker_env)

    # ---- lifetime ----

    def _abort(self) -> None:
        """Start-up failed: stop whatever was started, then let the error through."""
        if self.procs is not None:
            self.procs.stop(grace_s=0)
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
        if self.comm is not None:
            self.comm.close()
        if self._admission is not None:
            self._admission.close()
        self.watch.close()

    def __enter__(self) -> EngineBase:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def control_word(op: int, a: int = 0, b: int = 0, c: int = 0) -> torch.Tensor:
    """[op, a, b, c] as the int64 vector every control message is."""
    return torch.tensor([int(op), a, b, c], dtype=torch.int64)
