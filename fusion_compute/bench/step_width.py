"""What a wider decode step costs on this machine: the step's time against its columns, measured.

    python -m fusion_compute.bench.step_width [--workers 2] [--repeats 8] [--model PATH] [--cpu | --split]

The speculative budget (generation/speculative.py, StepCost) prices a draft column and a drafting
session from the job's own steps; its prior before the first fit (StepCost.prior, PRIOR_SPAN_COLUMNS)
needs to know how the two compare where a column is dearest: one machine, loopback links, the small
bundled model. This runs one job (N workers on 127.0.0.1, TLS), prefills 8 slots with a 60-token
prompt and times single steps of each shape, every shape once per repeat in a shuffled order (the
repeats interleaved, so that the machine's load falls on every shape alike), rolling each step back
so that every one runs at the same position: one session with 1, 2, 3, 5, 9, 17 and 33 columns (a
drafting session's columns after the first), and 8 sessions with one column each, one of them with
2 or 9, all of them with 2 or 5; 2 and 4 sessions with one column each, 4 with 2 each (a batch whose
sessions finish); and 8 sessions with 60 columns each, only the last column's logits asked for: a
batch's prefill of 8 × 60 prompt tokens (run at position 60, after the first prefill; a prefill's
cost, for bench/replay_batch.py, whose steps start with one). Prints one JSON line: each shape's median step time in ms, and the
repeats. Greedy ids do not enter (the drafts are fixed tokens): this is timing only. `--cpu`: the
workers run as threads of this process (`--executor inproc`) and each step is timed in this process's
CPU seconds (client and workers together, the TLS links on loopback included), which a shared machine's
load moves far less than wall time: what a step's arithmetic costs, not what it waits for. `--split`
(Linux, local worker processes): beside each shape's wall time, the CPU seconds the client process and
the worker processes (together) spent on it, read from /proc: whether a step waits or computes, and who
computes (where they share the cores, a step whose processes keep them busy has no idle time to hide a
column's work in).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace

SHAPES = {
    "1x1": [1],
    "1x2": [2],
    "1x3": [3],
    "1x5": [5],
    "1x9": [9],
    "1x17": [17],
    "1x33": [33],
    "8x1": [1] * 8,
    "8: one x2": [2] + [1] * 7,
    "8: one x9": [9] + [1] * 7,
    "8: all x2": [2] * 8,
    "8: all x5": [5] * 8,
    "2x1": [1] * 2,
    "4x1": [1] * 4,
    "4: all x2": [2] * 4,
    "8: all x60 (a prefill's columns)": [60] * 8,
}
# shapes timed as a prefill is run: the last column's logits only (a verification wants every column's)
LAST_LOGITS_ONLY = {"8: all x60 (a prefill's columns)"}


def main(argv: list[str] | None = None) -> int:
    from ..runtime.engine_options import EngineOptions
    from ..runtime.resources import processes_cpu_s
    from ..structural.client import Engine
    from ..weights.loader import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.step_width", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--cpu", action="store_true", help="workers as threads; each step's CPU seconds, not wall")
    p.add_argument("--split", action="store_true", help="also each step's CPU in the client and in the workers (Linux)")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.workers < 1:
        print("bench.step_width: --repeats and --workers must be >= 1", file=sys.stderr)
        return 2
    if a.split and (a.cpu or not os.path.exists("/proc/self/stat")):
        print("bench.step_width: --split reads worker processes' /proc (Linux), without --cpu", file=sys.stderr)
        return 2
    prompt = list(range(1000, 1060))
    times: dict[str, list[float]] = {k: [] for k in SHAPES}
    client_cpu: dict[str, list[float]] = {k: [] for k in SHAPES}
    worker_cpu: dict[str, list[float]] = {k: [] for k in SHAPES}
    clock, options = time.perf_counter, EngineOptions(n_workers=a.workers, context=256)
    if a.cpu:
        from ..cli.options import run_worker_in_thread

        clock, options = time.process_time, replace(options, executor="inproc", run_worker=run_worker_in_thread)
    with Engine(str(resolve_model_path(a.model)), options) as eng:
        eng.batch_slots = 8
        eng.reset()
        for slot in range(8):
            eng.forward_batch([(slot, prompt)])
        pids = eng.procs.pids if a.split and eng.procs is not None else []
        for r in range(a.repeats):
            order = list(SHAPES)
            random.Random(r).shuffle(order)
            for name in order:
                widths = SHAPES[name]
                items = [(slot, [2000 + j for j in range(w)]) for slot, w in enumerate(widths)]
                full = set() if name in LAST_LOGITS_ONLY else {slot for slot, w in enumerate(widths) if w > 1}
                w0, c0, t0 = processes_cpu_s(pids), time.process_time(), clock()
                eng.forward_batch(items, all_logits=full)
                times[name].append(clock() - t0)
                client_cpu[name].append(time.process_time() - c0)
                worker_cpu[name].append(processes_cpu_s(pids) - w0)
                for slot, _ in items:
                    eng.rollback(slot, len(prompt))
    # CPU as means over the repeats: /proc counts in clock ticks (10 ms), which a median would keep
    split = {"client_cpu_mean_ms": means(client_cpu), "workers_cpu_mean_ms": means(worker_cpu)} if pids else {}
    print(
        json.dumps(
            {
                "median_ms": {k: round(statistics.median(v) * 1e3, 1) for k, v in times.items()},
                **split,
                "ms": {k: [round(x * 1e3, 1) for x in v] for k, v in times.items()},
                "clock": "process CPU" if a.cpu else "wall",
                "load_average_1min": os.getloadavg()[0],
            }
        )
    )
    return 0


def means(ms: dict[str, list[float]]) -> dict[str, float]:
    return {k: round(statistics.fmean(v) * 1e3, 1) for k, v in ms.items()}


if __name__ == "__main__":
    sys.exit(main())
