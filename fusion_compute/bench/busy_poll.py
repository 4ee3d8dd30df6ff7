"""What a waiting MPI rank costs a computing process on an oversubscribed machine.

    python -m fusion_compute.bench.busy_poll [--ranks 4] [--wait block|fabric|both]

`--ranks` MPI processes join one communicator (comm/mpi_fabric.py); all but the last post an
all-to-all and wait for the last, which sleeps; meanwhile a separate process runs a fixed,
single-threaded torch workload. Reported: that workload's wall time alone, and next to the waiting
ranks when they wait with MPI's blocking `Wait` (MPICH busy-polls) or with the fabric's own wait
(`MpiFabric._wait`: yield between polls, then sleep). Needs the [mpi] extra.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANK = r"""
import sys, time
import numpy as np
from fusion_compute.comm.mpi_fabric import MpiFabric
rank, n, where, mode, sleep_s = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
f = MpiFabric(rank, n, where, timeout_s=120)
send = np.ones(n * 300, dtype=np.float32)
recv = np.empty_like(send)
f.comm.Barrier()
if rank == n - 1:
    time.sleep(sleep_s)
req = f.comm.Ialltoall(send, recv)
req.Wait() if mode == "block" else f.wait(req)
f.close()
"""

WORK = r"""
import time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
t0 = time.perf_counter()
for _ in range(3000):
    a = torch.tanh(a @ a * 0.01)
print(time.perf_counter() - t0)
"""


def workload() -> float:
    out = subprocess.run([sys.executable, "-c", WORK], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def next_to_waiting(ranks: int, mode: str, sleep_s: float) -> float:
    top = Path(tempfile.mkdtemp(prefix="fusion-busy-"))
    where = top / "epoch0"
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), str(ranks), str(where), mode, str(sleep_s)])
        for r in range(ranks)
    ]
    try:
        time.sleep(1.5)  # joined, and all but the last are waiting
        return workload()
    finally:
        for p in procs:
            try:
                p.wait(timeout=sleep_s + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(top, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusion_compute.bench.busy_poll", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--wait", choices=("block", "fabric", "both"), default="both")
    p.add_argument("--sleep", type=float, default=6.0, help="how long the last rank keeps the others waiting, s")
    a = p.parse_args(argv)
    if a.ranks < 2:
        print("busy_poll: --ranks must be >= 2", file=sys.stderr)
        return 2
    alone = workload()
    out = {"ranks": a.ranks, "waiting": a.ranks - 1, "workload_alone_s": round(alone, 3)}
    for mode in ("block", "fabric") if a.wait == "both" else (a.wait,):
        t = next_to_waiting(a.ranks, mode, a.sleep)
        out[f"with_{mode}_wait_s"] = round(t, 3)
        out[f"slowdown_{mode}"] = round(t / alone, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
