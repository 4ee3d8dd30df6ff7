"""The `fusion` command: bad input gives one line and a non-zero exit; separately started workers
join a client; a dying worker ends the run cleanly; nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import LOG_LINE, children, fusion, run, worker_pids

from fusion_compute.comm import free_port


def assert_one_line_error(r: subprocess.CompletedProcess, needle: str) -> None:
    """Non-zero exit, no traceback, one error line (a warning the user asked for, e.g. --insecure's,
    may stand before it, and so may the run's timestamped log lines when it got as far as starting)."""
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("fusion: warning:") and not LOG_LINE.match(ln)]
    assert len(lines) == 1, err
    assert needle in lines[0], err


@pytest.fixture
def no_new_workers():
    before = worker_pids()
    yield
    deadline = time.monotonic() + 10
    while worker_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_pids() - before == set(), "orphaned worker processes"


@pytest.fixture(scope="module")
def unsupported_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return d


BAD = [
    (["--model", "/no/such/model", "--prompt", "hi"], "model not found"),
    (["--workers", "97", "--prompt", "hi"], "at most 96"),
    (["--workers", "0", "--prompt", "hi"], "--workers must be >= 1"),
    (["--prompt", "   "], "empty prompt"),
    (["--prompt-ids", ""], "empty prompt"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,49152"], "outside the vocabulary"),
    (["--prompt-ids", ",".join(["1"] * 40), "--context", "32"], "does not fit the context window"),
    (["--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--prompt", "hi", "--top-p", "1.5"], "top-p"),
    (["--prompt", "hi", "--top-k", "-1"], "top-k"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "100000"], "--max-new-tokens 100000 does not fit"),
    (
        ["--prompt", "hi", "--max-tokens", "20", "--context", "40"],
        "the context window is 40 tokens and the prompt has 31",
    ),
    (["--prompt", "hi", "--chat", "--raw"], "opposites"),
    (["--prompt", "hi", "--capacity", "1,a"], "--capacity"),
    (["--prompt", "hi", "--capacity", "1,1,1"], "3 capacities given for 2"),
    (["--prompt", "hi", "--master", "localhost"], "HOST:PORT"),
    (["--prompt", "a", "--prompt-ids", "1"], "exactly one of"),
    (["--prompt", "hi", "--comm-backend", "nccl"], "--comm-backend nccl runs among GPU workers: add --device cuda"),
    (["--prompt", "hi", "--min-workers", "3"], "--min-workers 3 is more than the 2 workers of this run"),
    (["--prompt", "hi", "--standby", "-1"], "--standby must be >= 0"),
    (["--prompt", "hi", "--step-deadline-factor", "0.5"], "--step-deadline-factor must be 0 (no step bound) or >= 1"),
    (["--prompt", "hi", "--step-deadline-min", "0"], "--step-deadline-min must be > 0 seconds"),
]


@pytest.fixture(scope="module")
def bad_runs():
    """Every BAD command line run as a `fusion generate` process of its own (forked, procs.run), four
    at a time (the cases are independent), and the worker processes any of them left running 10 s
    after the last one ended (there must be none). That bad input is refused before torch is even
    imported is test_structure.py's check, in a fresh interpreter."""
    before = worker_pids()
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda case: run("generate", *case[0]), BAD))
    deadline = time.monotonic() + 10
    while worker_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    return results, worker_pids() - before


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(BAD)), ids=[b[1] for b in BAD])
def test_bad_input_one_line(i, bad_runs):
    assert_one_line_error(bad_runs[0][i], BAD[i][1])


@pytest.mark.slow  # its fixture forks every BAD command line (25 processes: 3-8 s at load 5-7), as its siblings'
def test_bad_input_leaves_no_worker(bad_runs):
    assert bad_runs[1] == set(), "orphaned worker processes"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-batch", "0"], "--max-batch must be in 1..256"),
        (["--max-batch", "257", "--mode", "masked", "--workers", "1+1"], "--max-batch must be in 1..256"),
    ],
)
def test_serve_bad_batch_one_line(args, needle, no_new_workers):
    """Refused before any port is bound or worker started."""
    assert_one_line_error(run("serve", "--port", "0", *args), needle)


@pytest.mark.slow
def test_unsupported_architecture(unsupported_model, no_new_workers):
    assert_one_line_error(
        run("generate", "--model", str(unsupported_model), "--prompt-ids", "1"), "unsupported architecture"
    )
    assert_one_line_error(run("plan", "--model", str(unsupported_model), "--workers", "2"), "unsupported architecture")


@pytest.mark.slow
def test_plan_command(tiny_qwen2):
    r = run("plan", "--model", str(tiny_qwen2), "--workers", "3", "--capacity", "2,1,1")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [s["residual"] for s in plan["shares"]] == [[0, 36], [36, 54], [54, 72]]
    assert_one_line_error(run("plan", "--model", str(tiny_qwen2), "--workers", "37"), "at most 12")


@pytest.mark.slow
def test_the_chat_template_is_the_default_and_raw_continues(tmp_path, no_new_workers):
    """`--prompt` goes through the model's chat template unless --raw (then the text as it is; --chat,
    the old way to ask for the template, still works): the prompt's token count says which ran."""
    from test_serve import build_chat_model

    from fusion_compute.weights.tokenizer import load_tokenizer

    model = build_chat_model(tmp_path / "chat")
    tok = load_tokenizer(model)
    base = ["generate", "--model", str(model), "--prompt", "hello world", "--max-tokens", "2", "--json"]
    base += ["--executor", "inproc"]  # the workers as threads of the command: the prompt is what is tested
    runs = {flag: run(*base, *([flag] if flag else []), "--threads", "1") for flag in ("", "--raw", "--chat")}
    for flag, r in runs.items():
        assert r.returncode == 0, (flag, r.stderr)
    prompt = {flag: json.loads(r.stdout)["prompt_tokens"] for flag, r in runs.items()}
    chat_ids = tok.chat_ids([{"role": "user", "content": "hello world"}])
    assert prompt == {"": len(chat_ids), "--raw": len(tok.encode("hello world")), "--chat": len(chat_ids)}
    assert prompt[""] != prompt["--raw"]


def test_master_needs_keys_or_insecure(tiny_qwen2, no_new_workers):
    r = run("generate", "--model", str(tiny_qwen2), "--prompt-ids", "1,2", "--master", f"127.0.0.1:{free_port()}")
    assert_one_line_error(r, "--master without --topology cannot pin the workers' keys")


@pytest.mark.slow
def test_rendezvous_times_out_without_workers(tiny_qwen2, no_new_workers):
    port = free_port()
    t0 = time.monotonic()
    r = run(
        "generate",
        "--model",
        str(tiny_qwen2),
        "--prompt-ids",
        "1,2",
        "--master",
        f"127.0.0.1:{port}",
        "--insecure",
        "--join-timeout",
        "3",
        timeout=60,
    )
    assert_one_line_error(r, "workers did not join in time")
    assert "rendezvous" in r.stderr and time.monotonic() - t0 < 30
    assert "warning: --insecure" in r.stderr  # plaintext is never silent


@pytest.mark.slow
def test_worker_with_unreachable_client_fails_in_time(tiny_qwen2, no_new_workers):
    t0 = time.monotonic()
    r = run(
        "worker",
        "--model",
        str(tiny_qwen2),
        "--master",
        f"127.0.0.1:{free_port()}",
        "--rank",
        "1",
        "--insecure",
        "--join-timeout",
        "2",
        timeout=60,
    )
    assert_one_line_error(r, "could not reach the client")
    assert time.monotonic() - t0 < 20
    # off a terminal it said what it waited for, and for how long, in a timestamped line
    assert re.search(r"Z fusion worker: .*waiting for the client at 127\.0\.0\.1:\d+ \(gives up after 2 s", r.stderr)


@pytest.mark.slow
def test_separately_started_workers_join(tiny_qwen2, no_new_workers):
    """Multi-host shape on one machine, plaintext (--insecure): the client and each worker are
    independent processes; the workers claim their ranks. (The keyed way: test_topology.py.)"""
    port = free_port()
    master = f"127.0.0.1:{port}"
    ids = "5,17,33,2,99"
    client = fusion(
        "generate",
        "--model",
        str(tiny_qwen2),
        "--workers",
        "2",
        "--master",
        master,
        "--insecure",
        "--prompt-ids",
        ids,
        "--max-new-tokens",
        "8",
        "--json",
        "--timeout",
        "60",
    )
    workers = [
        fusion(
            "worker",
            "--model",
            str(tiny_qwen2),
            "--rank",
            str(r),
            "--insecure",
            "--master",
            master,
            "--threads",
            "1",
            "--timeout",
            "60",
            *(["--log-format", "json"] if r == 2 else []),
        )
        for r in (1, 2)
    ]
    try:
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        logs = []
        for w in workers:
            w.wait(timeout=30)
            logs.append(w.stderr.read())
            assert w.returncode == 0, logs[-1]
    finally:
        for p in [client, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    # What a service's log needs, off a terminal: timestamped lines (worker 1), JSON objects (worker 2).
    said = [LOG_LINE.sub("", ln) for ln in logs[0].splitlines() if LOG_LINE.match(ln)]
    assert any(ln.startswith("joined epoch 0 as rank 1 of 2") for ln in said), logs[0]
    assert any(ln.startswith("ready: plan ") for ln in said) and said[-1].startswith("the client ended the job"), said
    records = [json.loads(ln) for ln in logs[1].splitlines() if not ln.startswith("fusion: warning:")]
    assert {r["prog"] for r in records} == {"fusion worker"}
    assert any(r["message"].startswith("joined epoch 0 as rank 2 of 2") for r in records), records
    # the client's own log: started, ready, the plan's lines, done
    assert (
        re.search(r"Z fusion generate: starting: .*2 workers \(structural\)", err)
        and "fusion generate: done: 8 tokens" in err
    )
    res = json.loads(out)
    # Same answer as the default local spawn.
    local = json.loads(
        run("generate", "--model", str(tiny_qwen2), "--prompt-ids", ids, "--max-new-tokens", "8", "--json").stdout
    )
    assert res["token_ids"] == local["token_ids"] and len(res["token_ids"]) == 8


@pytest.mark.slow
def test_worker_death_ends_run_cleanly(tmp_path, no_new_workers):
    """Kill a worker once the run is under way: the client exits non-zero with one line naming why, nothing
    hangs. On a loaded machine the worker may still be joining when it is killed (start-up's path, "exited
    before joining"); either way the line carries the process's exit status. Mid-decode recovery itself is
    tests/test_faults.py's."""
    from tiny_models import build

    long_model = build(tmp_path / "long", "qwen2", max_position_embeddings=8192)  # minutes of decoding
    client = fusion(
        "generate",
        "--model",
        str(long_model),
        "--workers",
        "2",
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "8000",
        "--context",
        "8192",
        "--timeout",
        "30",
    )
    try:
        deadline = time.monotonic() + 60
        mine: set[int] = set()
        while not mine and time.monotonic() < deadline:
            time.sleep(0.2)
            mine = children(client.pid)
        assert mine, "no workers spawned"
        time.sleep(3)  # usually reaches the decode loop by then (see the docstring when it does not)
        os.kill(min(mine), signal.SIGKILL)
        _, err = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode not in (0, None)
    assert "Traceback" not in err
    assert "worker" in err and "error" in err, err
    assert re.search(r"worker \d exited( before joining)?: exit code -9", err), err  # the process's exit status


@pytest.mark.slow
def test_a_worker_failing_at_start_up_says_why(tiny_qwen2, tmp_path, no_new_workers):
    """A worker that fails while loading its share (a layer tensor only workers read has a dtype we do
    not take): the client's error carries the worker's own reason, not only its closed connection."""
    import json
    import shutil
    import struct

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    f = model / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    name = "model.layers.0.mlp.down_proj.weight"
    assert json.loads(raw[8 : 8 + n])[name]["dtype"] == "F32"
    old = f'"{name}":{{"dtype":"F32"'.encode()
    assert old in raw[8 : 8 + n]
    raw[8 : 8 + n] = raw[8 : 8 + n].replace(old, old.replace(b"F32", b"I32"))  # same length: offsets hold
    f.write_bytes(bytes(raw))
    r = run("generate", "--model", str(model), "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    # said on its link as it left (its farewell: comm/links.py), before its process exited
    assert f"closed the connection: model.safetensors: {name} has unsupported dtype I32" in r.stderr, r.stderr


def test_a_workers_own_error_line_is_its_last_words():
    """What the client reports of a worker that exited: its own error line even when a native library
    printed after it (MPICH's C++ runtime does at exit), else its last line, else its exit code."""
    from fusion_compute.runtime.launch import last_words

    log = "@fusion-progress 3/9\nfusion worker: error: RuntimeError: out of memory\nterminate called without an active exception\n"
    assert last_words(log, -6) == "fusion worker: error: RuntimeError: out of memory"
    assert last_words("loading\nSegmentation fault\n", -11) == "Segmentation fault"
    assert last_words("@fusion-progress 1/9\n", -9) == "exit code -9"
    long = last_words("fusion worker: error: " + "x" * 1000, 1)  # kept short: it can reach /health
    assert len(long) == 300 and long.endswith("...")


def test_min_workers_above_the_run_is_refused_by_the_library_too():
    """`EngineOptions.check` refuses it, so a library user gets the command line's refusal (a usage
    error, exit code 2: the options were wrong, nothing on the wire failed); the default floor (2)
    still lets a one-worker run start."""
    from fusion_compute.errors import UsageError
    from fusion_compute.masked.options import MaskedOptions
    from fusion_compute.runtime.engine_options import EngineOptions

    for opts in (EngineOptions(n_workers=2, min_workers=3), MaskedOptions(n_a=1, n_b=1, min_workers=3)):
        with pytest.raises(UsageError, match="--min-workers 3 is more than the 2 workers of this run"):
            opts.check()
    EngineOptions(n_workers=1).check()
    assert EngineOptions(n_workers=1).floor == 2 and EngineOptions(n_workers=3, min_workers=3).floor == 3


def test_option_checks_are_usage_errors_not_comm_errors():
    """Every refusal of `EngineOptions.check` is about the options (exit code 2), never a CommError,
    which means a peer or the wire failed."""
    from fusion_compute.comm import CommError
    from fusion_compute.errors import UsageError
    from fusion_compute.runtime.engine_options import EngineOptions

    bad = [
        dict(comm_backend="carrier-pigeon"),
        dict(comm_backend="tcp"),
        dict(comm_backend="nccl", insecure=True),
        dict(comm_backend="gloo", insecure=True, master="127.0.0.1:29500"),
        dict(master="127.0.0.1:29500"),
        dict(standby=-1),
        dict(capacities=(1.0,)),
        dict(min_workers=0),
        dict(liveness_s=0),
    ]
    for kw in bad:
        with pytest.raises(UsageError) as e:
            EngineOptions(n_workers=2, **kw).check()
        assert not isinstance(e.value, CommError) and e.value.exit_code == 2, kw


def test_old_flag_names_still_work_and_warn(capsys):
    """`--engine` (now `--comm-backend`) and `fusion bench --engines` (now `--comm-backends`) are kept
    for the scripts that use them: the same values, and one line on stderr naming the new flag."""
    from fusion_compute.cli import options as O
    from fusion_compute.cli.main import build_parser

    a = build_parser().parse_args(["generate", "--prompt-ids", "1", "--engine", "tcp", "--insecure"])
    assert O.engine_options(a).comm_backend == "tcp"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "fusion: warning: --engine is deprecated: use --comm-backend (the same values)", err
    a = build_parser().parse_args(["generate", "--prompt-ids", "1", "--comm-backend", "tcp", "--insecure"])
    assert O.engine_options(a).comm_backend == "tcp"
    assert "deprecated" not in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--prompt-ids", "1"]).comm_backend is None  # default: tls/nccl

    b = build_parser().parse_args(["bench", "--engines", "tls,mpi"])
    assert b.comm_backends == ["tls", "mpi"]
    assert (
        capsys.readouterr().err == "fusion: warning: --engines is deprecated: use --comm-backends (the same values)\n"
    )
    assert build_parser().parse_args(["bench"]).comm_backends == ["tls", "gloo"]
    with pytest.raises(SystemExit):  # the old name still checks its values
        build_parser().parse_args(["generate", "--prompt-ids", "1", "--engine", "carrier-pigeon"])
