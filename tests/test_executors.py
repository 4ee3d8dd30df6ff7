"""Executors (fusion_compute/executor/): who starts a job's workers. The local executor's processes are
every other test's; here: the one place that chooses, the refusals of `--executor ray` before any
worker starts, and Ray itself (slow: a Ray instance of the test's own, 2 CPUs, on this machine),
which must give a local job's tokens and recover from a killed actor by the usual replay."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time

import pytest
from procs import children, run, wait_gone, worker_pids
from test_cli import assert_one_line_error

from fusion_compute.executor import executor_for
from fusion_compute.executor.listed import ListedExecutor
from fusion_compute.executor.local import LocalExecutor
from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.runtime.launch import popen_worker
from fusion_compute.structural.client import Engine, EngineOptions

HAS_RAY = importlib.util.find_spec("ray") is not None
PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]
NEW = 24


def test_one_place_chooses():
    """Local processes by default, with the spawn function the options name; listed workers when a
    --master names them (nothing is started); Ray only when asked for."""
    local = executor_for(EngineOptions(n_workers=2))
    assert isinstance(local, LocalExecutor) and local.starts_workers
    assert local.spawn is not popen_worker  # this suite's default: the fork server's (conftest.py)
    assert executor_for(EngineOptions(n_workers=2, spawn=popen_worker)).spawn is popen_worker
    listed = executor_for(EngineOptions(n_workers=2, master="127.0.0.1:1", insecure=True, comm_backend="tcp"))
    assert isinstance(listed, ListedExecutor) and not listed.starts_workers and listed.launch(None) is None


def _closed_port() -> int:
    """A loopback port with nothing listening (bound, then released: refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_RAY = [
    (["--ray-address", "127.0.0.1:1"], "--ray-address names the Ray cluster of --executor ray: add --executor ray"),
    (["--executor", "ray", "--master", "127.0.0.1:1", "--insecure"], "--executor ray starts the workers itself"),
    (["--executor", "ray", "--comm-backend", "gloo", "--insecure"], "--executor ray runs over the links"),
    (["--executor", "ray", "--ray-address", "nowhere"], "--ray-address must be HOST:PORT"),
    (["--executor", "ray", "--ray-cpus", "0"], "--ray-cpus must be a positive number"),
]


@pytest.mark.skipif(not HAS_RAY, reason="the [ray] extra is not installed")
@pytest.mark.parametrize("args,needle", BAD_RAY, ids=[b[1][:40] for b in BAD_RAY])
def test_bad_ray_options_one_line(tiny_qwen2, args, needle):
    r = run("generate", "--model", str(tiny_qwen2), "--prompt-ids", "1,2", *args)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r, needle)


def test_ray_not_installed_one_line(tiny_qwen2):
    """Without Ray (its import fails, as on a machine without the extra): exit 2, one line naming the
    extra, and no worker started."""
    before = worker_pids()
    code = (
        "import sys; sys.modules['ray'] = None; from fusion_compute.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["generate", "--model", str(tiny_qwen2), "--prompt-ids", "1,2", "--executor", "ray"]
    r = run(*args, code=code)
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r, "--executor ray needs Ray, which is not installed: pip install 'fusion-compute[ray]'")
    assert worker_pids() - before == set()


@pytest.mark.skipif(not HAS_RAY, reason="the [ray] extra is not installed")
def test_unreachable_ray_address_one_line(tiny_qwen2):
    """Nothing listening at --ray-address: exit 2 in one line within the probe's bound, no worker."""
    before = worker_pids()
    port = _closed_port()
    t0 = time.monotonic()
    r = run(
        "generate",
        "--model",
        str(tiny_qwen2),
        "--prompt-ids",
        "1,2",
        "--executor",
        "ray",
        "--ray-address",
        f"127.0.0.1:{port}",
    )
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r, f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there")
    assert took < 30, took  # the probe is bounded (CONNECT_S); ray.init alone would wait minutes
    assert worker_pids() - before == set()


# ---- Ray itself (slow) ----


@pytest.fixture(scope="module")
def ray_head():
    """A Ray instance of this test process's own, 2 CPUs, its files in a folder of its own; shut down
    after the module, and every process it started gone (checked by pid). Ray 2.60 cannot be bound
    to loopback (it advertises the machine's own address, and its servers listen on every interface,
    token-authenticated); the job's links are on loopback all the same (RayExecutor.host)."""
    ray = pytest.importorskip("ray")
    before = children(os.getpid())
    folder = tempfile.mkdtemp(prefix="fusion-ray-")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=folder)
    started = children(os.getpid()) - before
    try:
        yield ray
    finally:
        ray.shutdown()
        left = wait_gone(started | (children(os.getpid()) - before), timeout=20)
        shutil.rmtree(folder, ignore_errors=True)
        assert left == set(), f"Ray processes left running: {sorted(left)}"


def greedy(eng) -> list[int]:
    return generate(eng, PROMPT, max_new_tokens=NEW, sampling=SamplingParams()).token_ids


def opts(**kw) -> EngineOptions:
    return EngineOptions(context=128, timeout_s=60, liveness_s=2.0, **kw)


@pytest.mark.slow
def test_ray_gives_the_local_tokens(tiny_qwen2, ray_head):
    """A job whose workers Ray placed (one actor each, on the loopback head) gives a local job's
    greedy tokens; the workers joined over the links (TLS, pinned keys) as local ones do."""
    with Engine(tiny_qwen2, opts(n_workers=2)) as eng:
        local = greedy(eng)
    with Engine(tiny_qwen2, opts(n_workers=2, executor="ray", ray_cpus=0.5)) as eng:
        assert eng.executor.name == "ray" and len(eng.executor.actors) == 2
        assert eng.executor.listen_address() == ("127.0.0.1", 0)  # a one-machine cluster: links on loopback
        assert all(p > 0 for p in eng.procs.pids)  # started by their actors, not by this process
        assert not set(eng.procs.pids) & children(os.getpid())
        placed = greedy(eng)
        assert eng.recoveries == []
    assert placed == local


@pytest.mark.slow
def test_killed_actor_recovered_by_replay(tiny_qwen2, ray_head):
    """One worker's actor killed mid-decode (ray.kill: the actor's process, and the worker with it):
    the next epoch goes on over the survivors, the session replayed, with the same greedy tokens."""
    with Engine(tiny_qwen2, opts(n_workers=3, executor="ray", ray_cpus=0.5)) as eng:
        ref = greedy(eng)
        count = [0]

        def on_token(_tok: int) -> None:
            count[0] += 1
            if count[0] == 8:
                ray_head.kill(eng.executor.actors[1], no_restart=True)

        res = generate(eng, PROMPT, max_new_tokens=NEW, sampling=SamplingParams(), on_token=on_token)
        assert res.token_ids == ref
        assert [r["lost"] for r in eng.recoveries] == [[2]], eng.recoveries
        assert "worker 2 exited: its Ray actor died" in eng.recoveries[0]["reason"], eng.recoveries  # its supervisor
        assert eng.recoveries[0]["replayed_tokens"] > 0


@pytest.mark.slow
def test_cli_executor_ray(tiny_qwen2, ray_head):
    """`fusion generate --executor ray --ray-address` on an existing cluster (this test's head) gives
    the tokens of the same command without it."""
    gcs = ray_head.get_runtime_context().gcs_address
    base = ["generate", "--model", str(tiny_qwen2), "--prompt-ids", "5,17,33,2", "--max-new-tokens", "12", "--json"]
    local = run(*base, timeout=180)
    placed = run(*base, "--executor", "ray", "--ray-address", gcs, "--ray-cpus", "0.5", timeout=180)
    assert local.returncode == 0, local.stderr
    assert placed.returncode == 0, placed.stderr
    assert json.loads(placed.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert (
        f"workers placed by the Ray cluster at {gcs}: one actor each (0.5 CPU), their links on loopback"
        in placed.stderr
    )
    assert "placed by" not in local.stderr
