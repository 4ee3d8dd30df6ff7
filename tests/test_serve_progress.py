"""Start-up progress and log: bars per worker and the share/memory table on a terminal, nothing on a
pipe, and stdout clean for --json either way."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from procs import FUSION

from fusion_compute.comm.readiness import readable
from fusion_compute.model import architecture as arch
from fusion_compute.runtime.progress import MIB, PREFIX, CountingSource, WorkerReporter, parse_progress, startup_lines
from fusion_compute.structural.client import layer0_qkv
from fusion_compute.structural.plan import make_plan
from fusion_compute.weights.loader import open_weights


def test_worker_reporter_modes():
    buf = io.StringIO()
    r = WorkerReporter("lines", buf)
    r.phase("open")
    for done in (0, 10, 10, 55, 100):
        r.phase("load", done, 100)
    r.phase("ready", 100, 100)
    lines = buf.getvalue().splitlines()
    assert lines[0] == f"{PREFIX} open 0 0" and lines[-1] == f"{PREFIX} ready 100 100"
    assert len(lines) == 6  # the repeated 10% is not written twice
    assert parse_progress("junk\n" + buf.getvalue() + "Traceback: x\n") == ("ready", 100, 100)
    assert parse_progress("@fusion-progress load x y\n") is None
    off = io.StringIO()
    WorkerReporter("auto", off).phase("load", 1, 2)  # StringIO is not a terminal: auto = off
    assert off.getvalue() == ""
    bar = io.StringIO()
    WorkerReporter("bar", bar, label="w1").phase("load", 50, 100)
    assert bar.getvalue().startswith("\r") and "50%" in bar.getvalue()


def test_counting_source_clamps():
    class Src:
        config = "cfg"

        def read(self, name, rows=None, cols=None):
            return torch.zeros(6 if name == "big" else 2)

    seen = []
    src = CountingSource(Src(), 10, lambda d, t: seen.append((d, t)))
    assert src.config == "cfg"
    src.read("small")
    src.read("big")
    src.read("big")
    assert seen == [(2, 10), (8, 10), (10, 10)]


def test_startup_log_counts_what_each_side_holds(smollm_path):
    """The start-up log's weights, from what each side reads: a worker's (plan.loaded_elements, without
    layer 0's q/k/v, which it never reads) and the client's (its LM head and embedding, and its copy of
    layer 0's q/k/v, every worker's rows: structural.client.layer0_qkv, as the engine holds it). The
    engine here is its attributes that startup_lines reads, each the real thing for SmolLM2 at N = 2."""
    src = open_weights(smollm_path)
    c = src.config
    plan = make_plan(c, 2)
    embed = src.read(arch.EMBED)
    engine = SimpleNamespace(
        plan=plan,
        config=c,
        model_path=smollm_path,
        context=64,
        embed=embed,
        lm_head=arch.read_lm_head(src, embed),
        qkv0=layer0_qkv(src, plan, torch.device("cpu"), torch.float32),
    )
    lines = startup_lines(engine)
    qkv0 = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim * c.hidden * 4  # all of layer 0's W_qkv, float32
    assert f"layer 0's q/k/v {qkv0 / MIB:.1f} MiB" in lines[-1], lines[-1]
    for s, line in zip(plan.workers, lines[2:4], strict=True):
        read = (plan.weight_elements(s.worker) * c.n_layers - plan.linear_elements(s.worker)["qkv"]) * 4
        assert f"weights {read / MIB:.1f} MiB" in line, line
    # negative control: an engine without the copy (the log before it counted it) says 0.0
    assert "layer 0's q/k/v 0.0 MiB" in startup_lines(SimpleNamespace(**{**vars(engine), "qkv0": []}))[-1]


def _run_with_stderr_pty(args: list[str], timeout_s: float = 120) -> tuple[subprocess.CompletedProcess, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if readable([master], 0.2):
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break  # the other side is closed: the process is gone
            if not chunk:
                break
            err += chunk
        elif proc.poll() is not None:
            break
    out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    os.close(master)
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), ""), err.decode(errors="replace")


@pytest.mark.slow
def test_generate_progress_on_a_terminal_only(tiny_qwen2):
    args = [
        *FUSION,
        "generate",
        "--model",
        str(tiny_qwen2),
        "--workers",
        "2",
        "--capacity",
        "2,1",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "3",
        "--json",
        "--threads",
        "1",
    ]
    r, err = _run_with_stderr_pty(args)
    assert r.returncode == 0, err
    assert json.loads(r.stdout)["workers"] == 2  # stdout: exactly the JSON object
    assert "worker 1" in err and "worker 2" in err and "100%" in err and "ready" in err
    assert "residual [0, 48) 67%" in err and "residual [48, 72) 33%" in err  # who holds what share
    assert "peak RSS" in err and "KV cache" in err and "weights" in err  # memory per worker
    assert "layer 0's q/k/v" in err  # the client's copy, which the workers no longer read
    assert PREFIX not in err  # the workers' progress lines stay in their logs
    # Not a terminal: quiet (test_topology's generate run checks its client's stderr is empty).
