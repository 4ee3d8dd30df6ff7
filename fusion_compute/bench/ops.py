"""The benchmark's control ops: counters, a collective's latency and the KV probe, which the
production protocol (structural/protocol.Op) does not have. `fusion worker` adds WORKER_OPS to its
op table at start-up (cli/options.worker_options); the client side asks them through the engine
(structural/client.Engine.ask).

  STATS     [STATS, ...] -> [collectives, peer_bytes_sent, client_bytes, rss_kb]: what the worker's
            comm layer counted since it started
  BENCH_RS  [BENCH_RS, rows, iters, 0]: time `iters` reduce-scatters of `rows` per peer among the
            workers (random data, not state) -> [median ns, min ns, max ns, 0]
  PROBE     [PROBE, ...] -> [1, max |KV| * 1e6 as int, 0, rss_kb]: the hygiene tests read the buffers
"""

from __future__ import annotations

import time
from enum import IntEnum
from typing import Any

import torch

from ..comm import Comm
from ..runtime.resources import rss_kb
from ..structural.controls import OpHandler
from ..structural.plan import Plan
from ..structural.sharded import ShardedModel


class BenchOp(IntEnum):  # numbers the production protocol leaves free (protocol.Op)
    STATS = 6
    BENCH_RS = 7
    PROBE = 9


# ---- the worker's side ----


def _stats(model: ShardedModel, comm: Comm, plan: Plan, t: int, pos: int, arg: int) -> None:
    k = comm.counters
    comm.send(torch.tensor([k.collectives, k.peer_bytes_sent, k.client_bytes, rss_kb()]), 0, "control", "stats")


def _bench_rs(model: ShardedModel, comm: Comm, plan: Plan, t: int, pos: int, arg: int) -> None:
    comm.send(bench_reduce_scatter(comm, plan.n, t, pos), 0, "control", "bench")


def _probe(model: ShardedModel, comm: Comm, plan: Plan, t: int, pos: int, arg: int) -> None:
    comm.send(torch.tensor([1, int(model.kv_abs_max() * 1e6), 0, rss_kb()]), 0, "control", "probe")


WORKER_OPS: dict[int, OpHandler] = {BenchOp.STATS: _stats, BenchOp.BENCH_RS: _bench_rs, BenchOp.PROBE: _probe}


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


# ---- the client's side (engine: a structural_client.Engine) ----


def stats(engine: Any) -> list[dict]:
    """Per worker: collectives among workers, payload bytes sent to other workers, bytes to and
    from the client, peak RSS (MB). Counted by each worker's comm layer since it started."""
    out = []
    for s, r in zip(engine.plan.workers, engine.ask(BenchOp.STATS, "stats"), strict=True):
        coll, peer, client, rss = (int(v) for v in r)
        out.append(
            {
                "rank": s.rank,
                "collectives": coll,
                "peer_bytes_sent": peer,
                "client_bytes": client,
                "peak_rss_mb": rss / 1024,
            }
        )
    return out


def bench_collective(engine: Any, rows: int = 300, iters: int = 1000) -> list[dict]:
    """Per worker: median / min / max µs of one reduce-scatter of `rows` fp32 per peer (T = 1)."""
    wait = engine.wire.timeout_s + iters  # the workers run them all before answering
    replies = engine.ask(BenchOp.BENCH_RS, "bench", rows, iters, wait_s=wait)
    return [
        {"rank": s.rank, "median_us": int(r[0]) / 1000, "min_us": int(r[1]) / 1000, "max_us": int(r[2]) / 1000}
        for s, r in zip(engine.plan.workers, replies, strict=True)
    ]


def kv_probe(engine: Any) -> list[float]:
    """Per worker, the largest |value| left in its KV shards (0 after a wipe): hygiene tests."""
    return [int(r[1]) / 1e6 for r in engine.ask(BenchOp.PROBE, "probe")]
