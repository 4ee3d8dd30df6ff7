"""A worker process: who it is, joining the client, then serving in the mode the client names.

It never receives token ids or text. In the structural mode (`serve` below) it gets its ingress
shard of the embeddings, control words (operation, token count, position) and the partials
addressed to its own chunks (layer 0's q/k/v shard comes with the ingress, computed by the client),
and it returns the last layer's down partial (its egress); in the masked mode (masked/worker.py), masked ring elements or a mask
key. Every byte arrives over links that authenticated the client (and its peers) by their pinned
keys, unless the user asked for --insecure.
"""

from __future__ import annotations

import logging
import math
import queue
import resource
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import (
    Comm,
    CommError,
    Credentials,
    Identity,
    PeerError,
    PeerLeft,
    PublicId,
    Pulse,
    TaintedInputs,
    Witness,
    backend_of,
    join_epoch,
    open_fabric,
    open_pulse,
    reason_of,
    say_farewell,
)
from ..comm.value_checks import egress_fault
from ..runtime.launch import leave_now
from ..runtime.placement import DEFAULT_DTYPE, DTYPES, torch_dtype
from ..runtime.progress import CountingSource, WorkerReporter, worker_elements
from ..weights.loader import WeightSource, open_weights
from .controls import Controls, OpHandler
from .ops import Span
from .plan import Plan, make_plan
from .protocol import CONTROL_LEN, MAX_SLOTS, Op, fingerprint_int
from .sharded import ShardedModel

_log = logging.getLogger(__name__)  # what the worker says it does: cli/logs.py formats it


@dataclass
class WorkerOptions:
    master: tuple[str, int]  # the client's rendezvous address
    key: Identity | None  # this worker's key; None = insecure
    client_key: PublicId | None  # the client's pinned public key; None = insecure
    model: str | None = None
    listen_host: str | None = None  # where to listen for peers (topology address); None = as seen by the client
    rank: int | None = None  # a claim the client checks (topology, --rank); required when insecure
    group: str | None = None  # a claim (masked topology, --group)
    threads: int | None = None
    timeout_s: float = 120.0
    join_timeout_s: float = 120.0
    device: str = "cpu"  # where this worker's weights, KV cache and steps live: cpu, cuda, cuda:K
    progress: str = "auto"
    audit_dir: str | None = None  # --audit-dir: the masked mode's logs (masked/member.py) are written there
    # the structural mode's audit log of (epoch, rank, participant), handed in at start-up (the command
    # line's: audit.recorder.AuditRecorder.for_epoch over --audit-dir); None: no audit
    recorder: Callable[[int, int, int], Any] | None = None
    controls: Controls = field(default_factory=Controls)  # faults, leaks, the baseline: chosen at start-up
    ops: Mapping[int, OpHandler] = field(default_factory=dict)  # control ops beyond protocol.Op (the bench's)
    modes: Mapping[str, Callable[..., None]] = field(default_factory=dict)  # other modes' runners (masked/member.py)
    log: Callable[[str], None] = _log.warning  # refused connections, epochs that ended or did not open


class Worker:
    """One worker process for the life of the job: its weights, its pulse, and one epoch at a time
    (docs/resilience.md). Between epochs it waits for the client's word on the pulse link."""

    def __init__(self, o: WorkerOptions, src: WeightSource, report: WorkerReporter):
        self.o, self.src, self.report = o, src, report
        self.model: ShardedModel | None = None
        self.model_key: tuple | None = None  # (plan fingerprint, rank, variant) the weights were cut for
        self.links: dict = {}
        self.words: queue.Queue[dict] = queue.Queue()
        self._links_lock = threading.Lock()
        self.witness = Witness()  # what this worker saw of its peers, for the client's questions
        self.fabric = None  # this epoch's worker fabric: an abort word ends its waits
        self._aborted = False  # the client ended the epoch (abort, revoke, stop): no farewell owed
        self.audit_logs: list = []  # open audit logs (flush()): written out if the process must exit at once

    # ---- words from the client (the pulse thread) ----

    def on_word(self, word: dict) -> None:
        if "abort" in word or "stop" in word or "revoke" in word:
            self._cut()  # a wait on a peer that will never answer ends now
        if "revoke" in word or "bench" in word:  # bench: set aside (a suspect, not barred): no state kept
            self.wipe()
            _log.info(f"{'revoked' if 'revoke' in word else 'set aside as a suspect'} by the client: shards wiped")
        self.words.put(word)

    def on_client_gone(self) -> None:
        """The client's pulse link closed: the job is over for this worker, whatever it was doing."""
        self.wipe()
        _log.info("the client's link closed: shards wiped, leaving")
        for log in self.audit_logs:  # what it recorded so far is the audit's (a revoked worker's too)
            try:
                log.flush()
            except (OSError, ValueError):  # closed meanwhile by the main thread: already written
                pass
        leave_now(0)

    def _cut(self) -> None:
        self._aborted = True
        fabric = self.fabric
        if fabric is not None:
            fabric.abort()
        with self._links_lock:
            links = list(self.links.values())
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def wipe(self) -> None:
        if self.model is not None:
            self.model.wipe()

    # ---- epochs ----

    def serve_epoch(self, welcome: dict, links: dict) -> bool:
        """Serve one epoch; True when the client ended the job (SHUTDOWN)."""
        o, rank, n = self.o, int(welcome["rank"]), int(welcome["n_workers"])
        with self._links_lock:
            self.links = links
        self.witness.start(welcome.get("epoch"))
        self._aborted = False
        try:
            mode = welcome.get("mode") or "structural"
            if mode in o.modes:  # another mode's member (the masked one's, run_member): handed in at start-up
                o.modes[mode](self.src, welcome, rank, links, o, keep=self.audit_logs.append, counting=self.counting)
                return True
            if mode != "structural":
                raise RuntimeError(f"the client asked for the {mode} mode, which this worker was not started with")
            plan = make_plan(self.src.config, n, tuple(float(x) for x in welcome["capacities"]))
            dtype = welcome.get("dtype", DEFAULT_DTYPE)  # the client's: the wire carries it
            if dtype not in DTYPES:
                raise RuntimeError(f"the client asked for dtype {dtype!r}, not one of {', '.join(DTYPES)}")
            audit = None
            if o.recorder is not None:
                audit = o.recorder(int(welcome.get("epoch") or 0), rank, int(welcome["pid"]))
                self.audit_logs.append(audit)
            fabric = open_fabric(  # the client's word: MPI, torch.distributed, or none (the links)
                welcome.get("fabric"),
                rank - 1,
                n,
                timeout_s=o.timeout_s,
                score_groups=plan.group_owners,
                device=o.device,
            )
            self.fabric = fabric  # an abort word ends its waits
            backend = backend_of(welcome.get("fabric"), secure=o.key is not None)
            comm = Comm(
                rank,
                n,
                links,
                timeout_s=o.timeout_s,
                score_groups=plan.group_owners,
                recorder=audit,
                fabric=fabric,
                backend=backend,
                witness=self.witness,
                epoch=int(welcome.get("epoch") or 0),
            )
            comm = o.controls.comm(comm)  # as is, or a test's faulty or the audit's leaky one's
            try:
                serve(self, plan, rank - 1, comm, audit=audit, dtype=dtype)
                return True
            except BaseException as e:  # its own failure or a peer's: said on every link, before they close
                self._leaving(links, e)
                raise
            finally:
                comm.close()
                if audit is not None:
                    audit.close()
        except BaseException as e:  # (also a failure of its own before the epoch's comm: its fabric)
            self._leaving(links, e)
            raise
        finally:
            self.fabric = None
            with self._links_lock:
                self.links = {}

    def counting(self, src: WeightSource, total: int) -> CountingSource:
        """`src`, counting what this worker reads of its `total` elements for its load progress."""
        return CountingSource(
            src, total, lambda done, total: self.report.phase("ready" if done >= total else "load", done, total)
        )

    def _leaving(self, links: dict, err: BaseException) -> None:
        """The epoch ends here because of `err`: note what it says about the peers (this worker's
        evidence, if the client asks), then tell every peer why, on its link, before it closes."""
        if isinstance(err, PeerError) and not err.watched:
            if isinstance(err, PeerLeft):
                self.witness.left_after(err.rank)  # a knock-on: the peer said why it left
            else:
                self.witness.lost_peer(err.rank)  # first-hand: closed without a word, or silent
        if not self._aborted:  # (the client's word ended the epoch: it knows why)
            say_farewell(links, err)  # the cause travels with the close (links.say_farewell)

    def model_for(self, plan: Plan, w: int, comm: Comm, variant: str, dtype: str = DEFAULT_DTYPE) -> ShardedModel:
        """This epoch's model: the loaded one when plan, rank and dtype are unchanged (a replaced peer,
        a new session), else its new slices read from the weights file onto this worker's device."""
        key = (plan.fingerprint(), w, variant, dtype)
        if self.model is not None and self.model_key == key:
            self.model.rebind(comm)
            return self.model
        if self.model is not None:
            self.model.wipe()
        self.model = self.model_key = None
        src = self.counting(self.src, worker_elements(plan, w))
        model = self.o.controls.model_class()(src, plan, w, comm, torch.device(self.o.device), torch_dtype(dtype))
        release_freed_memory()  # the load's transient copies (measured ~25 MiB per worker) go back now
        self.model, self.model_key = model, key
        return model


def run(o: WorkerOptions) -> None:
    """Open the model, join, serve epoch after epoch until the client ends the job."""
    if o.threads:
        torch.set_num_threads(o.threads)
    report = WorkerReporter(o.progress, label="fusion worker")
    report.phase("open")
    src = open_weights(o.model)
    o.controls.opened(src.config)  # a control's spec that does not fit the model fails before joining
    report.phase("join")
    cred = Credentials(o.key, o.client_key, o.master, o.rank, o.group, o.listen_host)
    report.end_line()
    _log.info(
        f"{src.config.arch} model opened; waiting for the client at {o.master[0]}:{o.master[1]} "
        f"(gives up after {o.join_timeout_s:g} s, --join-timeout)"
    )
    welcome, links = join_epoch(cred, None, time.monotonic() + o.join_timeout_s, o.log)
    report.end_line()
    _joined(welcome)
    me = Worker(o, src, report)
    join = o.controls.join(join_epoch)  # later epochs' joins (a test's faulty worker ignores them)
    pulse = Pulse(
        open_pulse(cred, int(welcome["pid"]), time.monotonic() + o.join_timeout_s),
        me.on_word,
        me.on_client_gone,
        witness=me.witness,
    )
    leaving: str | None = None  # why this process ends, when by a failure of its own: the client hears it
    try:
        while True:
            if welcome is not None and not welcome.get("standby"):
                try:
                    if me.serve_epoch(welcome, links):
                        _log.info("the client ended the job: shards wiped, leaving")
                        return
                except CommError as e:  # a peer died or the client aborted the epoch: wait for its word
                    o.log(f"epoch {welcome.get('epoch')} ended: {e}")
                finally:
                    for link in links.values():
                        link.close()
            word = me.words.get()
            while "abort" in word:  # already acted on (links cut); the next word says what comes next
                word = me.words.get()
            if "join" not in word:  # stop, or revoke: the job is over for this worker
                _log.info("revoked: leaving" if "revoke" in word else "the client ended the job: leaving")
                return
            try:
                welcome, links = join(cred, int(word["join"]), time.monotonic() + o.join_timeout_s, o.log)
                report.end_line()
                _joined(welcome)
            except CommError as e:  # the client abandoned that epoch (another worker never came): not our end
                o.log(f"epoch {word['join']} did not open: {e}; waiting for the client's next word")
                welcome, links = None, {}
    except Exception as e:
        leaving = reason_of(e)
        raise
    finally:
        me.wipe()
        pulse.close(leaving)


def _joined(welcome: dict) -> None:
    if welcome.get("standby"):
        _log.info(f"admitted as a standby (participant {welcome.get('pid')}): waiting to be called in")
    else:
        _log.info(
            f"joined epoch {welcome.get('epoch') or 0} as rank {welcome.get('rank')} of {welcome.get('n_workers')} "
            f"({welcome.get('mode') or 'structural'} mode, participant {welcome.get('pid')})"
        )


def serve(me: Worker, plan: Plan, w: int, comm: Comm, *, audit=None, dtype: str = DEFAULT_DTYPE) -> None:
    """The structural command loop of one epoch: HELLO (handshake, weights, KV allocation), FORWARD
    (one or several sessions, each in its KV slot), RELEASE (zero one slot), RESET, WIPE, SHUTDOWN
    (protocol.Op).

    audit: an `audit.recorder.AuditRecorder` (also the comm's recorder) that closes one log record
    per step; the worker's controls (controls.Controls) arm the audit's negative control and name
    the variant: "sharded" or "megatron" (the replicated-residual baseline, same protocol). An op
    not in protocol.Op is looked up in the options' table (`ops`: the bench's, bench/ops.py)."""
    rank, controls = w + 1, me.o.controls
    ctrl = torch.zeros(CONTROL_LEN, dtype=torch.int64)
    comm.recv(ctrl, 0, "control", "hello", new_step=True)  # a command word: step 1 (comm.py, "Numbered steps")
    op, context, fp, _ = (int(v) for v in ctrl)
    mine = fingerprint_int(plan)
    if op != Op.HELLO or fp != mine:
        comm.send(torch.tensor([0, mine, 0, 0]), 0, "control", "hello")
        comm.flush()
        raise RuntimeError(f"plan mismatch with the client (worker {mine:x}, client {fp:x}): same model file?")
    t0 = time.perf_counter()
    model = me.model_for(plan, w, comm, controls.variant, dtype)
    model.reset(context)
    controls.arm(model)
    if audit is not None:
        model.attach_audit(audit)
        audit.start(plan.workers[w], plan.config, variant=controls.variant, leak=controls.leak)
    load_ms = int((time.perf_counter() - t0) * 1000)
    comm.send(torch.tensor([1, mine, load_ms, rss_kb()]), 0, "control", "hello")
    _log.info(
        f"ready: plan {plan.fingerprint()}, its share loaded in {load_ms / 1000:.1f} s, RSS {rss_kb() / 1024:.0f} MiB"
    )
    n_res, n_qkv = plan.workers[w].n_residual, plan.qkv_sizes[w]
    while True:
        comm.recv(ctrl, 0, "control", "cmd", wait_s=math.inf, new_step=True)  # idle is normal; a gone client is not
        op, t, pos, arg = (int(v) for v in ctrl)
        if op == Op.FORWARD:  # one session's tokens, or several sessions' (continuous batching): [op, n, ΣT, W]
            words = comm.recv(torch.empty(t * 3, dtype=torch.int64), 0, "control", "spans").view(t, 3).tolist()
            spans = [Span(*w) for w in words]
            if sum(s.t for s in spans) != pos or any(
                s.t < 1 or s.pos < 0 or not 0 <= s.slot < MAX_SLOTS for s in spans
            ):
                raise RuntimeError(f"malformed step: {spans} for {pos} tokens")
            if arg:  # token trees and kept paths ride with the spans (speculative decoding): no extra round
                tree = comm.recv(torch.empty(arg, dtype=torch.int64), 0, "control", "tree").tolist()
                spans = with_trees(spans, tree)
            t, pos = pos, spans[0].pos  # T = ΣT; the record's pos: the first span's
            for slot, held, to, zeroed in model.roll_back(
                spans, measure=audit is not None
            ):  # speculation's rejected positions
                if audit is not None:
                    audit.rollback(slot, held, to, zeroed)
            # the record names the spans when the KV holds several sessions; one slot holds one session,
            # slot 0, from a RESET to the next (audit/verify/sessions.py)
            batch = words if model.n_slots > 1 else None
            if audit is not None:
                audit.begin_step(t, pos, spans=batch)
            x_dT = comm.recv(torch.empty(n_res, t, dtype=model.dtype), 0, "ingress", "embed")
            # layer 0's q/k/v rows, computed by the client (no layer-0 QKV scatter)
            qkv_aT = comm.recv(torch.empty(n_qkv, t, dtype=model.dtype), 0, "ingress", "qkv0")
            me.witness.step(True)  # its account: a step is in progress here (until its egress leaves)
            # the egress: the last layer's down partial, its residual rows added; the client sums them
            e_HT = model.forward(x_dT.to(model.device), spans, qkv_aT.to(model.device))
            fault = egress_fault(e_HT, plan.n)  # what the client's checks would name this worker for
            if fault is not None:  # its inputs passed one by one (comm's checks): it names nobody (TaintedInputs)
                raise TaintedInputs(f"worker {rank}'s own egress holds {fault}: not sent")
            comm.send(e_HT, 0, "egress", "final")
            me.witness.step(False)
            if audit is not None:
                audit.end_step()
        elif op == Op.RELEASE:
            if 0 <= t < model.n_slots:
                model.wipe(t)
                if audit is not None:  # measured, not assumed: the slot reads all zeros now
                    audit.release(t, zeroed=model.kv_abs_max(t) == 0.0)
        elif op == Op.RESET:
            model.reset(arg or model.max_seq, min(max(1, t), MAX_SLOTS))
            if audit is not None:
                audit.new_session()
        elif op == Op.WIPE:
            model.wipe()
        elif op == Op.PING:
            comm.send(torch.tensor([1, rank, 0, rss_kb()]), 0, "control", "pong")
        elif op == Op.SHUTDOWN:
            model.wipe()
            if audit is not None:
                audit.close()
            return
        elif op in me.o.ops:  # an op the start-up added (the bench's: bench/ops.py)
            me.o.ops[op](model, comm, plan, t, pos, arg)
        else:
            raise RuntimeError(f"unknown control op {op}")


def with_trees(spans: list[Span], words: list[int]) -> list[Span]:
    """The spans with their trees and kept paths (protocol.Op.FORWARD): per span, in order, [number of
    parents (0 or T), number of kept columns, the parents, the kept columns]. Checked: a parent
    comes before its column, column 0 is the root, kept columns start at 0 and increase."""
    out, at = [], 0
    for s in spans:
        if at + 2 > len(words):
            raise RuntimeError(f"malformed tree words for {spans}")
        n_par, n_keep = words[at], words[at + 1]
        parents, keep = words[at + 2 : at + 2 + n_par], words[at + 2 + n_par : at + 2 + n_par + n_keep]
        at += 2 + n_par + n_keep
        if n_par not in (0, s.t) or len(parents) != n_par or len(keep) != n_keep or n_keep > s.pos:
            raise RuntimeError(f"malformed tree words for span {s}")
        if n_par and (parents[0] != -1 or any(not 0 <= p < j for j, p in enumerate(parents) if j)):
            raise RuntimeError(f"malformed tree for span {s}: parents {parents}")
        if n_keep and (keep[0] != 0 or any(b <= a for a, b in zip(keep, keep[1:], strict=False))):
            raise RuntimeError(f"malformed kept columns for span {s}: {keep}")
        out.append(Span(s.slot, s.pos, s.t, tuple(parents) if n_par else None, tuple(keep) if n_keep else None))
    if at != len(words):
        raise RuntimeError(f"malformed tree words: {len(words) - at} left over")
    return out


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere), so peak RSS
    reflects what the worker holds, not the transients of cutting its slices."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_kb() -> int:
    """Peak resident set size of this process, kB (Linux ru_maxrss)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
