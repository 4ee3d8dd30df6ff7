"""Device and dtype placement (runtime/placement.py): the names and their checks, where local workers
go, which comm backend a `--device cuda` run gets, and the refusals, each one line with exit 2 before
any worker starts. This machine has no GPU: `--device cuda` itself is the refusal tested end to end;
the GPU counts of other machines are the pure functions' arguments."""

from __future__ import annotations

import subprocess
import time

import pytest
from procs import run, worker_pids

from fusion_compute.errors import UsageError
from fusion_compute.runtime import engine_options
from fusion_compute.runtime.engine_options import EngineOptions, default_backend
from fusion_compute.runtime.placement import check_gpus, local_devices, parse_device


def test_device_names():
    assert parse_device("cpu") == ("cpu", None)
    assert parse_device("cuda") == ("cuda", None)
    assert parse_device("cuda:3") == ("cuda", 3)
    for bad in ("gpu", "cpu:0", "cuda:", "cuda:x", "CUDA", "", "cuda:1:2"):
        with pytest.raises(UsageError, match="must be cpu, cuda or cuda:K"):
            parse_device(bad)


def test_gpu_refusals():
    check_gpus(["cpu", "cuda", "cuda:0"], 1)
    with pytest.raises(UsageError, match="torch sees no GPU"):
        check_gpus(["cuda"], 0)
    with pytest.raises(UsageError, match=r"--device cuda:7: this machine has 1 GPU\(s\), cuda:0..cuda:0"):
        check_gpus(["cuda:7"], 1)
    with pytest.raises(UsageError, match="--client-device cuda:2"):
        check_gpus(["cuda:2"], 2, "--client-device")


def test_local_workers_spread_over_gpus():
    assert local_devices("cpu", 3, 0) == ["cpu"] * 3
    assert local_devices("cuda", 3, 2) == ["cuda:0", "cuda:1", "cuda:0"]  # two share GPU 0
    assert local_devices("cuda:1", 2, 2) == ["cuda:1", "cuda:1"]


def test_default_backend_of_a_cuda_run():
    """NCCL only where every local worker has a GPU of its own; else the links (workers share)."""
    assert default_backend("cuda", 2, 2, insecure=False) == "nccl"
    assert default_backend("cuda", 3, 2, insecure=False) == "tls"
    assert default_backend("cuda", 3, 1, insecure=True) == "tcp"
    assert default_backend("cuda:0", 2, 2, insecure=False) == "tls"  # all on one GPU
    assert default_backend("cuda", 1, 1, insecure=False) == "tls"  # one worker: no collectives


def test_option_refusals():
    with pytest.raises(UsageError, match="a GPU of its own for every worker"):
        EngineOptions(comm_backend="nccl", device="cuda:0").check()
    with pytest.raises(UsageError, match="add --device cuda"):
        EngineOptions(comm_backend="nccl").check()
    with pytest.raises(UsageError, match="--dtype must be one of"):
        EngineOptions(dtype="float64").check()
    with pytest.raises(UsageError, match="workers started on their own"):
        EngineOptions(device="cuda", master="127.0.0.1:1", insecure=True, comm_backend="tcp").check()
    from fusion_compute.masked.options import MaskedOptions

    for kw in ({"dtype": "bfloat16"}, {"client_device": "cuda"}):
        with pytest.raises(UsageError, match="--mode masked computes in exact integer ring products"):
            MaskedOptions(n_a=1, n_b=(1,), **kw).check()


def test_nccl_with_fewer_gpus_than_workers(monkeypatch):
    """The count is this machine's (none here): another machine's is what gpu_count would say."""
    monkeypatch.setattr(engine_options, "gpu_count", lambda: 1)
    opts = EngineOptions(n_workers=2, comm_backend="nccl", device="cuda")
    opts.check()
    with pytest.raises(UsageError, match="GPU of its own for each of the 2 local workers; this machine has 1"):
        opts.check_gpus()
    monkeypatch.setattr(engine_options, "gpu_count", lambda: 2)
    opts.check_gpus()
    with pytest.raises(UsageError, match="each of the 3 local workers"):
        EngineOptions(n_workers=2, standby=1, comm_backend="nccl", device="cuda").check_gpus()


REFUSED = [
    (["generate", "--device", "cuda"], "--device cuda: torch sees no GPU on this machine"),
    (["generate", "--device", "cuda:7"], "--device cuda:7: torch sees no GPU on this machine"),
    (["generate", "--device", "gpu"], "--device must be cpu, cuda or cuda:K, got 'gpu'"),
    (["generate", "--comm-backend", "nccl", "--device", "cuda"], "--device cuda: torch sees no GPU"),
    (["generate", "--client-device", "cuda"], "--client-device cuda: torch sees no GPU"),
    (["generate", "--mode", "masked", "--workers", "1+1", "--dtype", "bfloat16"], "drop --dtype"),
    (["generate", "--mode", "masked", "--workers", "1+1", "--device", "cuda"], "--mode masked runs on CPU links"),
    (["worker", "--master", "127.0.0.1:1", "--insecure", "--rank", "1", "--device", "cuda"], "torch sees no GPU"),
]


@pytest.mark.slow
def test_refused_in_one_line_before_any_worker(tiny_qwen2):
    """Exit 2, one line, no traceback, and no worker process started."""
    before = worker_pids()
    for args, needle in REFUSED:
        extra = ["--model", str(tiny_qwen2)] + (["--prompt-ids", "1,2"] if args[0] == "generate" else [])
        r: subprocess.CompletedProcess = run(*args, *extra, timeout=60)
        err = r.stderr.strip()
        assert r.returncode == 2, (args, r.returncode, err)
        assert "Traceback" not in err and len(err.splitlines()) == 1, (args, err)
        assert needle in err, (args, err)
    time.sleep(0.5)
    assert worker_pids() - before == set(), "a refused command started a worker"


def test_topology_device_per_worker(tmp_path):
    """`device = "cuda:1"` in a worker's table is where that worker computes (its own --device wins);
    a bad name is refused with the table named; on this machine (no GPU) the worker refuses it."""
    from fusion_compute.cli.main import build_parser
    from fusion_compute.cli.options import worker_options
    from fusion_compute.comm import Identity, free_port
    from fusion_compute.runtime.topology import Topology, TopologyError

    ids = [Identity.new() for _ in range(3)]
    paths = []
    for i, ident in enumerate(ids):
        paths.append(tmp_path / f"p{i}.key")
        ident.save(paths[-1])

    def topology(device: str) -> str:
        text = f'[client]\naddress = "127.0.0.1:{free_port()}"\nkey = "{ids[0].public.line()}"\n'
        text += f'[[worker]]\naddress = "127.0.0.1"\nkey = "{ids[1].public.line()}"\ndevice = "{device}"\n'
        return text + f'[[worker]]\naddress = "127.0.0.1"\nkey = "{ids[2].public.line()}"\n'

    f = tmp_path / "t.toml"
    f.write_text(topology("cuda:1"))
    t = Topology.load(f)
    assert [w.device for w in t.workers] == ["cuda:1", None]

    def worker(key: int, *flags: str):
        return worker_options(
            build_parser().parse_args(["worker", "--topology", str(f), "--key", str(paths[key]), *flags])
        )

    assert worker(2).device == "cpu"
    assert worker(1, "--device", "cpu").device == "cpu"
    with pytest.raises(UsageError, match="--device cuda:1: torch sees no GPU"):
        worker(1)
    f.write_text(topology("gpu"))
    with pytest.raises(TopologyError, match=r"\[\[worker\]\] #1: device must be cpu, cuda or cuda:K"):
        Topology.load(f)
