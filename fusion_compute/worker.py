"""A worker process: who it is, joining the client, then serving in the mode the client names.

It never receives token ids or text. In the structural mode (`serve` below) it gets its ingress
shard of the embeddings, control words (operation, token count, position) and the partials
addressed to its own chunks; in the masked mode (masked/worker.py), masked ring elements or a mask
key. Every byte arrives over links that authenticated the client (and its peers) by their pinned
keys, unless the user asked for --insecure.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .comm import Comm, Identity, PublicId, join
from .plan import Plan, make_plan
from .progress import CountingSource, WorkerReporter, worker_elements
from .protocol import CONTROL_LEN, Op, fingerprint_int
from .sharded import ShardedModel
from .weights import WeightSource, open_weights


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
    device: str = "cpu"
    progress: str = "auto"
    audit_dir: str | None = None
    inject_leak: str | None = None
    variant: str = "sharded"
    log: Callable[[str], None] = lambda line: sys.stderr.write(f"fusion worker: {line}\n")


def run(o: WorkerOptions) -> None:
    """Open the model, join, serve until SHUTDOWN (or until the client goes away)."""
    if o.threads:
        torch.set_num_threads(o.threads)
    report = WorkerReporter(o.progress, label="fusion worker")
    report.phase("open")
    src = open_weights(o.model)
    if o.inject_leak and o.inject_leak != "a-to-b":  # a-to-b: the masked mode's own (masked/worker.py)
        from .audit.inject import parse_leak

        parse_leak(o.inject_leak, src.config.n_layers)  # a bad spec fails before joining
    report.phase("join")
    deadline = time.monotonic() + o.join_timeout_s
    joined = join(o.key, o.client_key, o.master, listen_host=o.listen_host, claim_rank=o.rank,
                  claim_group=o.group, deadline=deadline, log=o.log)  # fmt: skip
    welcome, rank = joined.welcome, joined.rank
    n = int(welcome["n_workers"])
    if welcome.get("mode") == "masked":
        from .masked.worker import run_member

        run_member(src, welcome, rank, joined.links, o)
        return
    plan = make_plan(src.config, n, tuple(float(x) for x in welcome["capacities"]))
    # Count the elements of this worker's slices as they are read: the load progress.
    src = CountingSource(src, worker_elements(plan, rank - 1),
                         lambda done, total: report.phase("ready" if done >= total else "load", done, total))  # fmt: skip
    audit = None
    if o.audit_dir:
        from .audit.recorder import AuditRecorder

        audit = AuditRecorder(o.audit_dir, rank)
    fabric = None
    if welcome.get("fabric"):
        from .comm.torch_fabric import TorchFabric

        f = welcome["fabric"]
        fabric = TorchFabric(f["backend"], rank - 1, n, f["store"], timeout_s=o.timeout_s, score_groups=plan.group_owners)
    comm = Comm(rank, n, joined.links, timeout_s=o.timeout_s, score_groups=plan.group_owners, recorder=audit,
                fabric=fabric, device=fabric.device if fabric else None,
                engine=fabric and welcome["fabric"]["backend"] or ("tls" if o.key else "tcp"))  # fmt: skip
    try:
        serve(src, plan, rank - 1, comm, audit=audit, leak=o.inject_leak, variant=o.variant)
    finally:
        comm.close()
        if audit is not None:
            audit.close()


def serve(
    src: WeightSource, plan: Plan, w: int, comm: Comm, *, audit=None, leak: str | None = None, variant: str = "sharded"
) -> None:
    """The structural command loop: HELLO (handshake + KV allocation), FORWARD, RESET, SHUTDOWN.

    audit: an `audit.recorder.AuditRecorder` (also the comm's recorder) that closes one log record
    per step; leak: a negative-control spec (`audit.inject`); variant: "sharded" or "megatron"
    (the replicated-residual baseline of megatron.py, same protocol)."""
    rank = w + 1
    ctrl = torch.zeros(CONTROL_LEN, dtype=torch.int64)
    comm.recv(ctrl, 0, "control", "hello")
    op, context, fp, _ = (int(v) for v in ctrl)
    mine = fingerprint_int(plan)
    if op != Op.HELLO or fp != mine:
        comm.send(torch.tensor([0, mine, 0, 0]), 0, "control", "hello")
        comm.flush()
        raise RuntimeError(f"plan mismatch with the client (worker {mine:x}, client {fp:x}): same model file?")
    t0 = time.perf_counter()
    if variant == "megatron":
        from .megatron import MegatronModel

        model = MegatronModel(src, plan, w, comm)
    else:
        model = ShardedModel(src, plan, w, comm)
    model.reset(context)
    if leak:
        from .audit.inject import install_leak

        install_leak(model, leak)
    if audit is not None:
        model.attach_audit(audit)
        audit.start(plan.workers[w], plan.config, variant=variant, leak=leak)
    load_ms = int((time.perf_counter() - t0) * 1000)
    comm.send(torch.tensor([1, mine, load_ms, rss_kb()]), 0, "control", "hello")
    n_res = plan.workers[w].n_residual
    while True:
        comm.recv(ctrl, 0, "control", "cmd", wait_s=math.inf)  # idle is normal; a gone client is not
        op, t, pos, arg = (int(v) for v in ctrl)
        if op == Op.FORWARD:
            if audit is not None:
                audit.begin_step(t, pos)
            x_dT = comm.recv(torch.empty(n_res, t), 0, "ingress", "embed")
            x_dT = model.forward(x_dT.to(comm.device), pos)
            comm.send(x_dT, 0, "egress", "final")
            if audit is not None:
                audit.end_step()
        elif op == Op.RESET:
            model.reset(arg or model.max_seq)
            if audit is not None:
                audit.new_session()
        elif op == Op.PING:
            comm.send(torch.tensor([1, rank, 0, rss_kb()]), 0, "control", "pong")
        elif op == Op.BENCH_RS:
            comm.send(bench_reduce_scatter(comm, plan.n, t, pos), 0, "control", "bench")
        elif op == Op.STATS:
            k = comm.counters
            comm.send(torch.tensor([k.collectives, k.peer_bytes_sent, k.client_bytes, rss_kb()]), 0, "control", "stats")
        elif op == Op.SHUTDOWN:
            if audit is not None:
                audit.close()
            return
        else:
            raise RuntimeError(f"unknown control op {op}")


def bench_reduce_scatter(comm: Comm, n: int, rows: int, iters: int) -> torch.Tensor:
    """Latency of the reduce-scatter verb alone: `iters` of them on random (rows * n, 1) partials
    (no state involved), timed back to back after one warm-up; [median, min, max] in ns."""
    partial = torch.randn(rows * n, 1)
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter_ns()
        comm.reduce_scatter(partial, [rows] * n, "bench")
        if i:
            times.append(time.perf_counter_ns() - t0)
    times.sort()
    return torch.tensor([times[len(times) // 2], times[0], times[-1], 0], dtype=torch.int64)


def rss_kb() -> int:
    """Peak resident set size of this process, kB (Linux ru_maxrss)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
