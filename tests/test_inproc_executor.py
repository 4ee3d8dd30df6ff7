"""The in-process executor (executor/inproc.py): a job's workers as threads of this process, over the
real rendezvous and TLS links on 127.0.0.1. It gives the local processes' greedy tokens, and a job's
end leaves none of its threads behind; what a thread cannot do (os._exit, set torch's threads, a
fault that ends a process) is refused or left to the process."""

from __future__ import annotations

import json
import threading
import time

import pytest
from procs import run
from test_cli import assert_one_line_error
from test_executors import NEW, PROMPT, opts

from fusion_compute.cli.options import run_worker_in_thread
from fusion_compute.comm import CommError
from fusion_compute.errors import UsageError
from fusion_compute.executor import executor_for
from fusion_compute.executor.inproc import InprocExecutor
from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.structural.client import Engine, EngineOptions


def inproc(**kw) -> EngineOptions:
    return opts(**{"executor": "inproc", "run_worker": run_worker_in_thread, **kw})


def greedy(eng) -> list[int]:
    return generate(eng, PROMPT, max_new_tokens=NEW, sampling=SamplingParams()).token_ids


def worker_threads() -> list[threading.Thread]:
    """This process's threads other than the test's own (pytest's, the fork server's): the workers'
    and everything they started (pulse, link readers and writers, watchers)."""
    return [t for t in threading.enumerate() if t.is_alive() and t not in BEFORE]


BEFORE: set[threading.Thread] = set()


def settle(until_s: float = 5.0) -> list[threading.Thread]:
    """The threads left once a stopped job has had `until_s` to let its threads end."""
    deadline = time.monotonic() + until_s
    while (left := worker_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_chosen_by_the_options():
    assert isinstance(executor_for(inproc(n_workers=2)), InprocExecutor)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"run_worker": None}, "needs the worker's entry"),
        ({"comm_backend": "gloo", "insecure": True}, "runs over the links"),
        ({"device": "cuda"}, "runs CPU workers"),
        ({"master": "127.0.0.1:1", "insecure": True, "comm_backend": "tcp"}, "starts the workers itself"),
    ],
)
def test_refusals_before_any_worker_starts(kw, words):
    with pytest.raises(UsageError, match=words):
        inproc(n_workers=2, **kw).check()


@pytest.mark.slow
def test_inproc_gives_the_local_tokens_and_leaves_no_thread(tiny_qwen2):
    """A 3-worker job (Qwen2's 2 KV heads over 3 workers: a split group) as threads of this process
    gives the greedy tokens of the same job as local processes, over TLS with pinned keys; after
    `stop` none of its threads is alive. (The control: while the job runs, its workers' threads are
    there to be counted.)"""
    with Engine(tiny_qwen2, opts(n_workers=3)) as eng:
        local = greedy(eng)
    BEFORE.clear()
    BEFORE.update(threading.enumerate())
    eng = Engine(tiny_qwen2, inproc(n_workers=3))
    try:
        assert eng.opts.comm_backend == "tls"
        names = {t.name for t in worker_threads()}
        assert {"fusion-worker-1", "fusion-worker-2", "fusion-worker-3"} <= names, names
        assert greedy(eng) == local
    finally:
        eng.close()
    # each worker's run() returned when the client said SHUTDOWN: none was given up (-9) or failed (1)
    assert [w.returncode for w in eng.executor.workers] == [0, 0, 0]
    left = settle()
    assert left == [], f"threads alive after the job stopped: {[t.name for t in left]}"


@pytest.mark.slow
def test_a_worker_thread_told_to_leave_ends_and_the_job_recovers(tiny_qwen2):
    """`terminate` on one worker thread mid-job (what its client's link closing does to a thread:
    shards wiped, links cut, `run` returns): its thread ends on its own, without os._exit (this
    process is still here), and the job goes on over the other two by the usual replay, with the
    same greedy tokens."""
    with Engine(tiny_qwen2, inproc(n_workers=3)) as eng:
        ref = greedy(eng)
        gone = eng.executor.workers[1]
        gone.terminate()
        gone.wait(timeout=10)
        assert gone.returncode == 0 and not gone.thread.is_alive()
        assert greedy(eng) == ref
        assert [r["lost"] for r in eng.recoveries] == [[2]], eng.recoveries


@pytest.mark.slow
def test_a_refused_control_is_the_workers_last_words(tiny_qwen2):
    """A fault would end the whole process from a thread: the thread worker refuses it, and the
    client's start-up error carries that worker's one line (its last words, as a process's)."""
    o = inproc(n_workers=2, args_for_worker={2: ("--inject-fault", "fail@3")}, join_timeout_s=20)
    with pytest.raises(CommError, match="worker 2 exited before joining: fusion worker: error: --inject-fault"):
        Engine(tiny_qwen2, o)


@pytest.mark.slow
def test_cli_executor_inproc(tiny_qwen2):
    """`fusion generate --executor inproc` (its workers threads of the command's process) gives the
    tokens of the same command without it, and says where its workers are; a fabric backend with it
    is one line, exit 2."""
    base = ["generate", "--model", str(tiny_qwen2), "--prompt-ids", "5,17,33,2", "--max-new-tokens", "12", "--json"]
    local = run(*base, timeout=180)
    threaded = run(*base, "--executor", "inproc", timeout=180)
    assert local.returncode == 0, local.stderr
    assert threaded.returncode == 0, threaded.stderr
    assert json.loads(threaded.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert "workers as threads of this process" in threaded.stderr
    refused = run(*base, "--executor", "inproc", "--comm-backend", "gloo", "--insecure")
    assert_one_line_error(refused, "--executor inproc runs over the links")
