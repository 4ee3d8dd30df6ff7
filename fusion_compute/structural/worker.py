"""A worker's shell: who it is, joining the client, its pulse, and one epoch after another, serving
in the mode the client names; how it leaves.

It never receives token ids or text. In the structural mode it gets its ingress shard of the
embeddings, control words (operation, token count, position) and the partials addressed to its own
chunks (layer 0's q/k/v shard comes with the ingress, computed by the client), and it returns the
last layer's down partial (its egress); in the masked mode (masked/worker.py), masked ring elements
or a mask key. Every byte arrives over links that authenticated the client (and its peers) by their
pinned keys, unless the user asked for --insecure.

Three layers, one file each:
  runner.py   the structural step, transport-free: spans and ingress in, egress out; RELEASE,
              RESET, WIPE (StepRunner)
  op_loop.py  one epoch's control words read from the client over its Comm, handed to the runner,
              the results sent back (serve)
  worker.py   this shell: the join, the pulse (the client's words between epochs), each epoch's
              fabric, Comm and audit log, the loaded share kept across epochs, and leaving

The shell runs as a whole process (`fusion worker`: `own_process`, the default) or as a thread of
another one (executor/inproc.py, for tests). A process leaves at once when its client's link closes
(os._exit, runtime.launch.leave_now) and sets torch's thread count; a thread does neither: its links
are cut and `run` returns, and the process's threads and resources (peak RSS, runtime/resources.py)
are everyone's.
"""

from __future__ import annotations

import logging
import queue
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
    Witness,
    backend_of,
    join_epoch,
    launched_rank,
    open_fabric,
    open_pulse,
    reason_of,
    say_farewell,
)
from ..comm.comm import Fabric
from ..runtime.launch import leave_now
from ..runtime.placement import DEFAULT_DTYPE, DTYPES, torch_dtype
from ..runtime.progress import CountingSource, WorkerReporter, worker_elements
from ..runtime.resources import release_freed_memory
from ..weights.loader import WeightSource, open_weights
from .controls import Controls, OpHandler
from .op_loop import serve
from .plan import Plan, make_plan
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
    # True: this worker is its whole process (`fusion worker`): it leaves with os._exit when the client's
    # link closes and sets torch's threads. False: a thread of another process (executor/inproc.py):
    # its links are cut and run() returns instead, and the process's thread count is left alone.
    own_process: bool = True
    # handed, once the worker has joined, what makes it leave (its executor's terminate: inproc's)
    on_leave: Callable[[Callable[[], None]], None] | None = None


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
        self.fabric: Fabric | None = None  # this epoch's worker fabric: an abort word ends its waits
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
        """The client's pulse link closed: the job is over for this worker, whatever it was doing.
        A process leaves at once; a thread-run worker cuts its links and lets `run` return."""
        self.wipe()
        _log.info("the client's link closed: shards wiped, leaving")
        for log in self.audit_logs:  # what it recorded so far is the audit's (a revoked worker's too)
            try:
                log.flush()
            except (OSError, ValueError):  # closed meanwhile by the main thread: already written
                pass
        if self.o.own_process:
            leave_now(0)
        self._cut()  # a wait on the client or a peer ends now (CommError), then the word below ends run()
        self.words.put({"stop": True})

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
                w = rank - 1
                serve(
                    comm,
                    plan,
                    w,
                    lambda: self.model_for(plan, w, comm, o.controls.variant, dtype),
                    controls=o.controls,
                    ops=o.ops,
                    witness=self.witness,
                    audit=audit,
                )
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
    if o.threads and o.own_process:  # process-wide: a thread-run worker leaves it to its process
        torch.set_num_threads(o.threads)
    report = WorkerReporter(o.progress, label="fusion worker")
    report.phase("open")
    src = open_weights(o.model)
    o.controls.opened(src.config)  # a control's spec that does not fit the model fails before joining
    report.phase("join")
    cred = Credentials(o.key, o.client_key, o.master, o.rank, o.group, o.listen_host, launched_rank())
    report.end_line()
    _log.info(
        f"{src.config.arch} model opened; waiting for the client at {o.master[0]}:{o.master[1]} "
        f"(gives up after {o.join_timeout_s:g} s, --join-timeout)"
    )
    welcome, links = join_epoch(cred, None, time.monotonic() + o.join_timeout_s, o.log)
    report.end_line()
    _joined(welcome)
    me = Worker(o, src, report)
    if o.on_leave is not None:
        o.on_leave(me.on_client_gone)
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
