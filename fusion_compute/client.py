"""The client (rank 0, user side, trusted): embedding, ingress split, egress reconstruction, final
norm, LM head. Text and token ids never leave this process; workers get embedding shards only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .comm import Comm, Recorder, backend_for, free_port
from .config import ModelError
from .launch import WorkerProcs
from .plan import Plan, make_plan
from .protocol import CONTROL_LEN, Op, fingerprint_int
from .weights import WeightSource, open_weights, resolve_model_path

DEFAULT_CONTEXT = 4096  # KV positions preallocated per session (capped by the model's own window)


@dataclass
class EngineOptions:
    n_workers: int = 2
    capacities: tuple[float, ...] | None = None
    master: str | None = None  # HOST:PORT; None = spawn local workers on loopback
    context: int | None = None
    threads: int | None = None  # torch threads per worker; None = cores // (N + 1), >= 1
    timeout_s: float = 120.0
    device: str = "cpu"
    worker_env: dict[str, str] = field(default_factory=dict)
    extra_worker_args: tuple[str, ...] = ()
    # Start-up display (progress.load_monitor): called as progress(procs, plan, master) before the
    # rendezvous, closed after the handshake. None = quiet.
    progress: Callable[..., Any] | None = None


def effective_context(model_window: int, requested: int | None) -> int:
    """KV positions per session: the request (or DEFAULT_CONTEXT), never beyond the model's window."""
    return min(model_window, requested or DEFAULT_CONTEXT)


def _default_threads(n_workers: int) -> int:
    import os

    return max(1, (os.cpu_count() or 1) // n_workers)


class Engine:
    """Client side of one job: owns the worker processes (if local) and the session state."""

    def __init__(
        self,
        model: str | Path | None,
        opts: EngineOptions,
        recorder: Recorder | None = None,
        source: WeightSource | None = None,
    ):
        """`source`: an already opened `open_weights(model)`, to avoid parsing the file twice."""
        t0 = time.perf_counter()
        self.model_path = resolve_model_path(model)
        self.src: WeightSource = source or open_weights(self.model_path)
        self.config = c = self.src.config
        self.plan: Plan = make_plan(c, opts.n_workers, opts.capacities)
        self.context = effective_context(c.max_positions, opts.context)
        self.opts = opts
        self.embed = self.src.read("model.embed_tokens.weight")  # (V, H)
        if self.embed.shape != (c.vocab, c.hidden):
            raise ModelError(f"embedding shape {tuple(self.embed.shape)} != ({c.vocab}, {c.hidden})")
        self.final_norm = self.src.read("model.norm.weight")
        self.lm_head = self.embed if c.tie_embeddings or not self.src.has("lm_head.weight") else self.src.read("lm_head.weight")
        self.procs: WorkerProcs | None = None
        master = opts.master
        if master is None:
            master = f"127.0.0.1:{free_port()}"
            threads = opts.threads or _default_threads(opts.n_workers)
            args = [
                "--workers", str(opts.n_workers), "--master", master, "--model", str(self.model_path),
                "--threads", str(threads), "--timeout", str(opts.timeout_s), "--device", opts.device,
            ]  # fmt: skip
            if opts.capacities:
                args += ["--capacity", ",".join(str(x) for x in opts.capacities)]
            args += list(opts.extra_worker_args)
            if opts.progress is not None:
                args += ["--progress", "lines"]  # workers report load progress into their logs
            self.procs = WorkerProcs(lambda r: ["--rank", str(r), *args], opts.n_workers, opts.worker_env)
        monitor = opts.progress(self.procs, self.plan, master) if opts.progress is not None else None
        try:
            self.comm = Comm(
                0,
                opts.n_workers,
                master,
                backend=backend_for(opts.device),
                timeout_s=opts.timeout_s,
                score_groups=self.plan.group_owners,
                recorder=recorder,
            )
            self.worker_info = self._hello()
        finally:
            if monitor is not None:
                monitor.close(ok=hasattr(self, "worker_info"))
        self.pos = 0
        self.load_s = time.perf_counter() - t0

    # ---- protocol ----

    def _control(self, op: Op, t: int = 0, pos: int = 0, arg: int = 0) -> None:
        msg = torch.tensor([int(op), t, pos, arg], dtype=torch.int64)
        for s in self.plan.workers:
            self.comm.send(msg, s.rank, "control", op.name.lower())

    def _hello(self) -> list[dict]:
        fp = fingerprint_int(self.plan)
        self._control(Op.HELLO, self.context, fp)
        info = []
        for s in self.plan.workers:
            reply = self.comm.recv(torch.zeros(CONTROL_LEN, dtype=torch.int64), s.rank, "control", "hello")
            ok, wfp, load_ms, rss_kb = (int(v) for v in reply)
            if not ok:
                raise ModelError(f"worker {s.rank} computed a different plan ({wfp:x} vs {fp:x}): same model and capacities?")
            info.append({"rank": s.rank, "load_s": load_ms / 1000, "peak_rss_mb": rss_kb / 1024})
        return info

    def ping(self) -> list[dict]:
        self._control(Op.PING)
        out = []
        for s in self.plan.workers:
            r = self.comm.recv(torch.zeros(CONTROL_LEN, dtype=torch.int64), s.rank, "control", "pong")
            out.append({"rank": s.rank, "peak_rss_mb": int(r[3]) / 1024})
        return out

    def stats(self) -> list[dict]:
        """Per worker: collectives among workers, payload bytes sent to other workers, bytes to and
        from the client, peak RSS (MB). Counted by each worker's comm layer since it started."""
        self._control(Op.STATS)
        out = []
        for s in self.plan.workers:
            r = self.comm.recv(torch.zeros(CONTROL_LEN, dtype=torch.int64), s.rank, "control", "stats")
            coll, peer, client, rss = (int(v) for v in r)
            out.append({"rank": s.rank, "collectives": coll, "peer_bytes_sent": peer, "client_bytes": client,
                        "peak_rss_mb": rss / 1024})  # fmt: skip
        return out

    def reset(self) -> None:
        """Start a new session: workers drop and re-zero their KV shards."""
        self._control(Op.RESET, arg=self.context)
        self.pos = 0

    def forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` at the session's current position; returns logits (V,) of the last
        token, or (T, V) with all_logits. Ingress: x[:, R_w] to worker w; egress: shards back."""
        t = len(ids)
        if t == 0:
            raise ValueError("no tokens to run")
        if self.pos + t > self.context:
            raise ValueError(f"{self.pos + t} tokens exceed the context window of {self.context}")
        x_HT = self.embed[torch.tensor(ids)].T.contiguous()  # (H, T), full: fine, this is the client
        self._control(Op.FORWARD, t, self.pos)
        for s in self.plan.workers:
            a, b = s.residual
            self.comm.send(x_HT[a:b], s.rank, "ingress", "embed")
        shards = [
            self.comm.recv(torch.empty(s.n_residual, t), s.rank, "egress", "final") for s in self.plan.workers
        ]
        self.pos += t
        x_TH = torch.cat(shards).T  # (T, H): reconstructed on the user side only
        if not all_logits:
            x_TH = x_TH[-1:]
        h = x_TH * torch.rsqrt(x_TH.pow(2).mean(-1, keepdim=True) + self.config.rms_eps) * self.final_norm
        logits = h @ self.lm_head.T  # (T, V)
        return logits if all_logits else logits[0]

    def close(self) -> None:
        try:
            self._control(Op.SHUTDOWN)
        except Exception:
            pass
        if self.procs is not None:
            self.procs.stop()
        self.comm.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
