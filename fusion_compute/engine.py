"""The client's side of a job, common to both modes: the model's client-side weights, who the workers
are, starting or admitting them, the links, and an orderly close (also when start-up fails).

Who the workers are, three ways:

  local      `--workers N`: the client spawns N processes on this machine. It makes a fresh key pair
             for itself and for each worker (in memory; a worker gets its secret on stdin), so even on
             one machine only the processes it started can join, over TLS on loopback.
  topology   `--topology FILE --key client.key`: the user's file lists every worker's address, share
             and public key; the client admits exactly those keys (comm/rendezvous.py).
  insecure   `--master HOST:PORT --insecure`: plaintext, and whoever claims a rank gets it. Only when
             asked for by name; a warning says so.

A mode subclasses `EngineBase` with its plan (`make_plan`), its handshake (`hello`), `forward`,
`reset`, `ping` and `shutdown`: client.Engine (structural) and masked.client.MaskedEngine.
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

from .comm import Admission, Comm, CommError, Identity, Member, Recorder, free_port
from .config import ModelError
from .launch import WorkerProcs
from .topology import Topology, check_here
from .weights import WeightSource, open_weights, resolve_model_path

DEFAULT_CONTEXT = 4096  # KV positions preallocated per session (capped by the model's own window)
ENGINES = ("tls", "tcp", "gloo", "nccl")  # tls: the secure links; the others are plaintext somewhere
FABRICS = ("gloo", "nccl")  # engines whose worker-to-worker collectives run on torch.distributed


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
    worker_env: dict[str, str] = field(default_factory=dict)
    extra_worker_args: tuple[str, ...] = ()
    # Start-up display (progress.load_monitor): called as progress(procs, plan, master) before the
    # rendezvous, closed after the handshake. None = quiet.
    progress: Callable[..., Any] | None = None
    log: Callable[[str], None] = warn  # refused connections and other start-up notices

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

    @property
    def is_local(self) -> bool:
        return self.topology is None and self.master is None


def default_threads(n_workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // n_workers)


class EngineBase:
    """Client side of one job: owns the worker processes (if local) and the links to every worker."""

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
        self.plan = self.make_plan()
        self.context = effective_context(c.max_positions, opts.context)
        self.embed = self.src.read("model.embed_tokens.weight")  # (V, H)
        if self.embed.shape != (c.vocab, c.hidden):
            raise ModelError(f"embedding shape {tuple(self.embed.shape)} != ({c.vocab}, {c.hidden})")
        self.final_norm = self.src.read("model.norm.weight")
        tied = c.tie_embeddings or not self.src.has("lm_head.weight")
        self.lm_head = self.embed if tied else self.src.read("lm_head.weight")
        recorder = self.prepare(recorder)
        self.procs: WorkerProcs | None = None
        self.comm: Comm | None = None
        self._admission: Admission | None = None
        monitor = None
        try:
            roster, me, worker_keys = self._roster()
            host, port = self._listen_address()
            self._admission = Admission(me, roster, host, port, log=opts.log)
            if opts.is_local:
                self.procs = self._spawn(me, worker_keys)
            monitor = opts.progress(self.procs, self.plan, self._admission.address) if opts.progress else None
            deadline = time.monotonic() + opts.join_timeout_s
            links = self._admission.admit(deadline, self._welcome, abort=self._spawn_failure)
            self.comm = Comm(0, self.n_workers, links, timeout_s=opts.timeout_s, recorder=recorder, engine=opts.engine)
            self.worker_info = self.hello(deadline)
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

    def make_plan(self) -> Any:
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

    @property
    def n_workers(self) -> int:
        return self.plan.n

    def group_of(self, rank: int) -> str | None:
        return None

    # ---- start-up ----

    def _roster(self) -> tuple[list[Member], Identity | None, dict[int, Identity]]:
        opts, secure = self.opts, not self.opts.insecure
        if opts.topology is not None:
            roster = [Member(p.rank, p.host, p.key if secure else None, p.group, p.name) for p in opts.topology.workers]
            return roster, opts.key if secure else None, {}
        if opts.master is not None:  # insecure, separately started: hosts come from their JOINs
            return [Member(r, "", None, self.group_of(r)) for r in range(1, self.n_workers + 1)], None, {}
        me = Identity.new() if secure else None
        keys = {r: Identity.new() for r in range(1, self.n_workers + 1)} if secure else {}
        roster = [Member(r, "127.0.0.1", keys[r].public if secure else None, self.group_of(r))
                  for r in range(1, self.n_workers + 1)]  # fmt: skip
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
            return args + ([] if me is not None else ["--rank", str(rank)])

        stdin = (lambda rank: keys[rank].pem_bundle()) if me is not None else None
        return WorkerProcs(argv, self.n_workers, env, stdin_for_rank=stdin)

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

    def close(self) -> None:
        if self.comm is not None:
            try:
                self.shutdown()
                self.comm.flush()
            except Exception:
                pass
        if self.procs is not None:
            self.procs.stop()
        if self.comm is not None:
            self.comm.close()

    def __enter__(self) -> EngineBase:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def control_word(op: int, a: int = 0, b: int = 0, c: int = 0) -> torch.Tensor:
    """[op, a, b, c] as the int64 vector every control message is."""
    return torch.tensor([int(op), a, b, c], dtype=torch.int64)
