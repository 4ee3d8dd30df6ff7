"""Fault injection: workers die, freeze, drop a message halfway, lose their network; the client dies.

Each test runs a reference generation first, then the same one with a fault, and checks that the
run recovers to the same greedy tokens (a new epoch over the survivors plus a standby, or over the
survivors alone), that the recovery is recorded, and that nothing is left running. Every wait is
bounded; timings are reported by the measurement script (docs/resilience.md), not asserted here."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from netns import Hosts, available
from procs import children, fusion, none_left_after, reap, wait_gone
from test_topology import keys, write_keys

from fusion_compute.bench.ops import kv_probe
from fusion_compute.comm import CommError
from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.masked.client import MaskedEngine, MaskedOptions
from fusion_compute.structural.client import Engine, EngineOptions

PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]
# The fault fires after the 10th token (run below), so 14 tokens after it are compared with the run
# without it: a replay that drops, repeats or loses tokens fails them (scripts/mutants.sh: replay).
NEW = 24
LIVENESS_S = 2.0


@pytest.fixture(autouse=True)
def no_stray_processes():
    """Everything each test here started is gone after it (the engine stops its own workers by PID)."""
    before = children(os.getpid())
    yield
    none_left_after(os.getpid(), before)


def run(eng, fault=None, at: str = "decode"):
    """Generate NEW greedy tokens; `fault()` fires before the request ("prefill": the session's
    reset and prefill meet it) or right after the 10th new token ("decode")."""
    count = [0]

    def on_token(_tok: int) -> None:
        count[0] += 1
        if fault is not None and at == "decode" and count[0] == 10:
            fault()

    if fault is not None and at == "prefill":
        fault()
    return generate(eng, PROMPT, max_new_tokens=NEW, sampling=SamplingParams(), on_token=on_token)


def structural(tiny, **kw) -> Engine:
    opts = EngineOptions(n_workers=kw.pop("n", 2), context=128, timeout_s=30, liveness_s=LIVENESS_S, **kw)
    return Engine(tiny, opts)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_lost_worker_replaced_by_standby(tiny_qwen2, sig, when):
    with structural(tiny_qwen2, standby=1) as eng:
        ref = run(eng).token_ids
        victim = eng.procs.pids[0]
        res = run(eng, lambda: os.kill(victim, getattr(signal, sig)), when)
        assert res.token_ids == ref
        assert len(res.recoveries) == 1 and res.recoveries[0]["lost"] == [1] and 3 in res.recoveries[0]["order"]
        assert len(run(eng).token_ids) == NEW  # the next request runs on the new epoch
        if sig == "SIGSTOP":
            os.kill(victim, signal.SIGCONT)  # it finds itself removed and leaves
            assert wait_gone({victim}) == set()


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_lost_worker_on_the_mpi_fabric(tiny_qwen2, sig):
    """The survivors' MPI waits end when the epoch is aborted (no busy wait on a dead peer), and the
    next epoch joins a fresh communicator with the standby: same tokens."""
    with structural(tiny_qwen2, standby=1, comm_backend="mpi") as eng:
        ref = run(eng).token_ids
        victim = eng.procs.pids[0]
        res = run(eng, lambda: os.kill(victim, getattr(signal, sig)), "decode")
        assert res.token_ids == ref and len(res.recoveries) == 1 and eng.opts.comm_backend == "mpi"
        if sig == "SIGSTOP":
            os.kill(victim, signal.SIGCONT)
            assert wait_gone({victim}) == set()


@pytest.mark.slow
def test_lost_worker_without_standby_replans_over_the_rest(tiny_qwen2):
    with structural(tiny_qwen2, n=3) as eng:
        ref = run(eng).token_ids
        victim = eng.procs.pids[1]
        res = run(eng, lambda: os.kill(victim, signal.SIGKILL))
        assert res.token_ids == ref and res.recoveries[0]["order"] == [1, 3] and eng.plan.n == 2


@pytest.mark.usefixtures("real_workers")  # the last words of a real `python -m fusion_compute worker` process
def test_recovery_never_leaves_one_worker_holding_everything(tiny_qwen2):
    with structural(tiny_qwen2, n=2) as eng:
        victim = eng.procs.pids[0]
        with open(f"/proc/{victim}/cmdline", "rb") as f:
            assert b"fusion_compute\0worker" in f.read()  # a real worker process, not a fork server's child
        with pytest.raises(CommError, match="fewer than --min-workers 2") as e:
            run(eng, lambda: os.kill(victim, signal.SIGKILL))
        assert "worker 1 exited: exit code -9" in str(e.value)  # why it was lost, not only what is refused


@pytest.mark.slow
def test_dead_standby_is_skipped(tiny_qwen2):
    with structural(tiny_qwen2, n=3, standby=1) as eng:
        ref = run(eng).token_ids
        spare, victim = eng.procs.pids[3], eng.procs.pids[0]
        os.kill(spare, signal.SIGKILL)  # the standby dies first, while idle
        time.sleep(LIVENESS_S / 2)
        res = run(eng, lambda: os.kill(victim, signal.SIGKILL))
        assert res.token_ids == ref and res.recoveries[0]["order"] == [2, 3]  # no spare left: N - 1


@pytest.mark.slow
def test_worker_closing_mid_message(tiny_qwen2):
    with structural(tiny_qwen2, standby=1, args_for_worker={2: ("--inject-fault", "close-mid-message@12")}) as eng:
        res = run(eng)  # worker 2's 12th forward sends half its egress shard, then exits
        assert len(res.recoveries) == 1 and res.recoveries[0]["lost"] == [2], res.recoveries
        assert res.token_ids == run(eng).token_ids  # the same as a run with no fault at all


@pytest.mark.slow
@pytest.mark.parametrize("victim_rank", [1, 3], ids=["group-A", "group-B"])
def test_masked_member_replaced_within_its_group(tiny_qwen2, victim_rank):
    opts = MaskedOptions(n_a=2, n_b=2, standby=1, context=128, timeout_s=30, liveness_s=LIVENESS_S)
    with MaskedEngine(tiny_qwen2, opts) as eng:
        ref = run(eng).token_ids
        victim = eng.procs.pids[victim_rank - 1]
        res = run(eng, lambda: os.kill(victim, signal.SIGKILL))
        assert res.token_ids == ref
        new = res.recoveries[0]["order"]
        assert victim_rank not in new and eng.seats[new[victim_rank - 1]].group == ("A" if victim_rank == 1 else "B")


@pytest.mark.slow
def test_hygiene_kv_zeroed_at_session_end(tiny_qwen2):
    with structural(tiny_qwen2) as eng:
        eng.reset()
        eng.forward(PROMPT)
        assert min(kv_probe(eng)) > 0  # the session's keys and values are there...
        eng.end_session()
        assert kv_probe(eng) == [0.0, 0.0]  # ...and gone when it ends
        run(eng)  # generate() ends its session itself
        assert kv_probe(eng) == [0.0, 0.0]
    opts = MaskedOptions(n_a=1, n_b=1, context=64, timeout_s=30)
    with MaskedEngine(tiny_qwen2, opts) as eng:
        run(eng)
        assert eng.kv_abs_max() == 0.0  # the masked client's own KV cache, the only clear state


@pytest.mark.slow
def test_workers_leave_when_the_client_dies(tiny_qwen2, tmp_path):
    """Separately started workers (no parent-death signal): the pulse link closing ends them."""
    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    from test_topology import topo_text

    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"], model=tiny_qwen2))
    client = fusion(
        "generate",
        "--topology",
        str(topo),
        "--key",
        str(kf[0]),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "200",
        "--context",
        "256",
    )
    workers = [fusion("worker", "--topology", str(topo), "--key", str(k), "--threads", "1") for k in kf[1:]]
    try:
        deadline = time.monotonic() + 60
        while client.poll() is None and time.monotonic() < deadline:
            line = client.stdout.readline()  # tokens stream once the run is going
            if line.strip():
                break
        client.kill()
        t0 = time.monotonic()
        gone = wait_gone({w.pid for w in workers}, timeout=10)
        assert gone == set(), "workers outlived their client"
        assert time.monotonic() - t0 < 5.0
    finally:
        reap([client, *workers])


NS = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]


CUT_CLIENT = r"""
import json, sys
from fusion_compute.structural.client import Engine, EngineOptions
from fusion_compute.comm import Identity
from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.runtime.topology import Topology
topo, key, prompt, cut = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")], sys.argv[4] == "cut"
t = Topology.load(topo)
opts = EngineOptions(topology=t, key=Identity.load(key), context=1024, liveness_s=2.0, timeout_s=30)
with Engine(t.model_for(0), opts) as eng:
    seen = []

    def on_token(tok):
        seen.append(tok)
        if cut and len(seen) == 20:
            print("decoding", flush=True)  # the test cuts worker 1's network now
            sys.stdin.readline()  # ...and says when it is done

    res = generate(eng, prompt, max_new_tokens=60, sampling=SamplingParams(), on_token=on_token)
    print(json.dumps({"token_ids": res.token_ids, "recoveries": res.recoveries}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(available() is not None, reason=f"network namespaces unavailable: {available()}")
def test_link_cut_in_a_namespace(tmp_path):
    """A worker's network goes down mid-decode: no heartbeat, so the client names it and replaces it
    with the standby on another host; the tokens are those of a run without the cut."""
    import subprocess

    from tiny_models import build

    model = build(tmp_path / "long", "qwen2", max_position_embeddings=2048)
    ids = keys(4)
    kf = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    text = f'model = "{model}"\n[client]\naddress = "{NS[0]}:29500"\nkey = "{ids[0].public.line()}"\n'
    for host, ident, role in ((NS[1], ids[1], "worker"), (NS[2], ids[2], "worker"), (NS[3], ids[3], "standby")):
        text += f'[[worker]]\naddress = "{host}"\nrole = "{role}"\nkey = "{ident.public.line()}"\n'
    topo.write_text(text)
    outs = []
    with Hosts(NS) as hosts:
        for mode in ("plain", "cut"):
            workers = [
                hosts.fusion(h, "worker", "--topology", str(topo), "--key", str(k), "--threads", "1")
                for h, k in zip(NS[1:], kf[1:], strict=True)
            ]
            client = hosts.python(
                NS[0], CUT_CLIENT, str(topo), str(kf[0]), ",".join(map(str, PROMPT)), mode, stdin=subprocess.PIPE
            )
            if mode == "cut":
                assert client.stdout.readline().strip() == "decoding", client.stderr.read()
                hosts.link_down(NS[1])
                client.stdin.write("\n")
                client.stdin.flush()
            out, err = client.communicate(timeout=120)
            assert client.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
            for w in workers:
                if w.poll() is None:
                    w.kill()
                w.wait()
    plain, cut_run = outs
    # 60 tokens: 20 before the cut, 40 after the recovery's replay to compare (200 before: 140 more in
    # each of the two runs, ~20 ms each, after the point where a wrong replay shows)
    assert cut_run["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 60
    rec = cut_run["recoveries"]
    assert len(rec) == 1 and rec[0]["lost"] == [1] and rec[0]["order"] == [3, 2] and "heartbeat" in rec[0]["reason"]
