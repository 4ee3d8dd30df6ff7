"""What trips a user in the first hours (issue 45): a hand-started worker's thread count, where a
prompt and repeated flags come from, and errors in words rather than exception names. In-process
where the behaviour allows (cli.main.main on a parsed command line), else a `fusion` process."""

from __future__ import annotations

import logging

import pytest
from test_topology import keys, topo_text, write_keys

from fusion_compute.cli import options as O
from fusion_compute.cli.main import build_parser
from fusion_compute.runtime.engine_options import usable_cores

# ---- (1) a hand-started worker does not oversubscribe its host ----


def worker_args(*argv: str):
    return build_parser().parse_args(["worker", *argv])


def test_hand_started_workers_divide_the_cores_among_the_topologys_local_participants(tmp_path, caplog, monkeypatch):
    """Two workers and their client declared on this machine: each worker takes cores / 3 threads (at
    least 1), not torch's default of every core, and says so; --threads wins; a topology whose other
    participants are elsewhere leaves this worker every core."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's cap (conftest.py): below, uncapped
    ids = keys(3)
    paths = write_keys(tmp_path, ids)
    here = tmp_path / "here.toml"
    here.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"]))
    with caplog.at_level(logging.INFO, logger="fusion_compute"):
        o = O.worker_options(worker_args("--topology", str(here), "--key", str(paths[1])))
    assert o.threads == max(1, usable_cores() // 3)
    assert any("shared by 3" in r.getMessage() and "--threads" in r.getMessage() for r in caplog.records)
    o = O.worker_options(worker_args("--topology", str(here), "--key", str(paths[1]), "--threads", "5"))
    assert o.threads == 5
    # The client and the other worker at addresses this machine does not hold (TEST-NET-1, RFC 5737).
    apart = tmp_path / "apart.toml"
    apart.write_text(topo_text(ids, ["127.0.0.1", "192.0.2.7"]).replace('"127.0.0.1:', '"192.0.2.1:', 1))
    o = O.worker_options(worker_args("--topology", str(apart), "--key", str(paths[1])))
    assert o.threads == usable_cores()


def test_a_worker_without_a_topology_shares_the_cores_with_a_local_client(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    a = worker_args("--master", "127.0.0.1:29999", "--insecure", "--rank", "1")
    assert O.worker_options(a).threads == max(1, usable_cores() // 2)
    a = worker_args("--master", "192.0.2.1:29999", "--insecure", "--rank", "1")
    assert O.worker_options(a).threads == usable_cores()


def test_omp_num_threads_caps_the_default_thread_count_not_an_explicit_one(monkeypatch, caplog):
    """$OMP_NUM_THREADS is the thread budget of each process of a tree (a scheduler's, a test
    runner's): the default never exceeds it, for a hand-started worker and for the workers an engine
    starts (default_threads); --threads still wins; a value that is not a positive count caps nothing."""
    from fusion_compute.runtime import engine_options

    monkeypatch.setattr(engine_options, "usable_cores", lambda: 8)
    monkeypatch.setattr(O, "usable_cores", lambda: 8)
    far = ("--master", "192.0.2.1:29999", "--insecure", "--rank", "1")  # alone on this host: every core
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert O.worker_options(worker_args(*far)).threads == 8  # the control: uncapped
    assert engine_options.default_threads(2) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with caplog.at_level(logging.INFO, logger="fusion_compute"):
        assert O.worker_options(worker_args(*far)).threads == 3
    assert any("at most $OMP_NUM_THREADS = 3" in r.getMessage() for r in caplog.records)
    assert engine_options.default_threads(2) == 3
    assert engine_options.default_threads(4) == 2  # under the cap: the share
    assert O.worker_options(worker_args(*far, "--threads", "6")).threads == 6
    for junk in ("0", "-2", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert engine_options.default_threads(1) == 8, junk


@pytest.mark.parametrize("n", [0, -1])
def test_threads_below_one_are_refused(n):
    from fusion_compute.errors import UsageError

    with pytest.raises(UsageError, match="--threads must be >= 1"):
        O.worker_options(worker_args("--master", "127.0.0.1:1", "--insecure", "--rank", "1", "--threads", str(n)))


def test_a_worker_is_honest_unless_a_control_flag_names_one():
    """`fusion worker` chooses its controls once, from its flags: the honest ones (every hook the
    identity, the sharded model) without any, a fault, a leak or the baseline's model with one, and a
    bad spec refused at start-up in one line; the bench's ops are added to its op table, not protocol.Op."""
    from fusion_compute.controls.worker import Chosen
    from fusion_compute.errors import UsageError
    from fusion_compute.structural.controls import Controls
    from fusion_compute.structural.megatron import MegatronModel
    from fusion_compute.structural.protocol import Op
    from fusion_compute.structural.sharded import ShardedModel

    base = ("--master", "127.0.0.1:1", "--insecure", "--rank", "1")
    honest = O.worker_options(worker_args(*base)).controls
    sentinel = object()
    assert type(honest) is Controls and honest.comm(sentinel) is sentinel and honest.join(sentinel) is sentinel
    assert honest.model_class() is ShardedModel and (honest.variant, honest.leak, honest.fault) == (
        "sharded",
        None,
        None,
    )
    faulty = O.worker_options(worker_args(*base, "--inject-fault", "never-join@2")).controls
    assert type(faulty) is Chosen and faulty.join(sentinel) is not sentinel and faulty.fault == "never-join@2"
    assert O.worker_options(worker_args(*base, "--variant", "megatron")).controls.model_class() is MegatronModel
    assert O.worker_options(worker_args(*base, "--inject-leak", "gather@1")).controls.leak == "gather@1"
    with pytest.raises(UsageError, match="expected KIND@STEP"):
        O.worker_options(worker_args(*base, "--inject-fault", "teleport@1"))
    with pytest.raises(UsageError, match="expected gather@LAYER"):
        O.worker_options(worker_args(*base, "--inject-leak", "teleport@1"))
    ops = O.worker_options(worker_args(*base)).ops
    assert set(ops) == {6, 7, 9} and not set(ops) & {int(op) for op in Op}


# ---- (3) errors a user can cause: one line in words ----


def one_line(capsys, argv: list[str], code: int = 2, bug: bool = False) -> str:
    """Run `fusion ARGV` in this process; it must fail with `code` and one stderr line, without an
    exception's name unless it is a `bug`."""
    from fusion_compute.cli.main import main

    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    named = any(name in err for name in ("TypeError", "FileNotFoundError", "PermissionError", "OSError"))
    assert named == bug, err
    return err


def test_a_prompt_that_is_not_utf8_is_refused_in_words(capsys):
    # What a shell hands Python for the byte 0xff in an argument (surrogateescape).
    err = one_line(capsys, ["generate", "--prompt", "caf\udcff"])
    assert "--prompt is not UTF-8 text (byte 0xff at character 3)" in err


@pytest.mark.parametrize("where", ["/proc/nope/run", "/dev/null/run"])
def test_an_audit_dir_that_cannot_be_made_is_refused_before_anything_loads(capsys, where):
    err = one_line(capsys, ["generate", "--mode", "masked", "--workers", "1+1", "--prompt", "hi", "--audit-dir", where])
    assert f"--audit-dir {where}: cannot create it:" in err
    err = one_line(capsys, ["audit", "run", "--out", where])
    assert f"--out {where}: cannot create it:" in err


def test_an_unexpected_error_names_the_debug_variable(capsys, monkeypatch):
    """A bug still ends in one line, which says how to see the traceback (README documents it)."""
    from fusion_compute.cli import main as cli_main

    def broken(a):
        raise TypeError("TextInputSequence must be str")

    monkeypatch.setattr(cli_main, "cmd_plan", broken)
    err = one_line(capsys, ["plan"], code=1, bug=True)
    assert "TypeError: TextInputSequence must be str (unexpected: rerun with FUSION_DEBUG=1" in err
    monkeypatch.setenv("FUSION_DEBUG", "1")
    with pytest.raises(TypeError):
        cli_main.main(["plan"])


@pytest.mark.slow
def test_output_piped_into_a_reader_that_left_ends_quietly(tiny_qwen2):
    """`fusion generate ... | head -c 10`: the reader closes the pipe; the run stops with the shell's
    SIGPIPE status and nothing on stderr but its log lines (no BrokenPipeError, no "Exception ignored")."""
    import os
    import subprocess

    from procs import FUSION, LOG_LINE

    read, write = os.pipe()
    os.close(read)  # the reader left before the answer
    try:
        p = subprocess.Popen(
            [*FUSION, "generate", "--model", str(tiny_qwen2), "--workers", "1", "--prompt-ids", "1,2,3",
             "--max-tokens", "2", "--json"],
            stdin=subprocess.DEVNULL, stdout=write, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    finally:
        os.close(write)
    _, err = p.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if not LOG_LINE.match(ln)]
    assert p.returncode == 141 and lines == [], err


# ---- (6) the silences ----


@pytest.mark.slow
def test_a_client_whose_workers_never_join_says_it_is_waiting(tiny_qwen2, tmp_path, capsys, monkeypatch):
    """Off a terminal, a topology client used to print nothing until --join-timeout ran out (120 s by
    default). It notes the wait, where, and how long it will go on; the first note comes sooner here."""
    from fusion_compute.cli.main import main
    from fusion_compute.runtime import engine

    monkeypatch.setattr(engine, "WAIT_NOTE_S", (0.5, 60.0))
    ids = keys(3)
    paths = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"]))
    argv = ["generate", "--model", str(tiny_qwen2), "--topology", str(topo), "--key", str(paths[0])]
    assert main([*argv, "--prompt-ids", "1,2", "--join-timeout", "2"]) == 1
    err = capsys.readouterr().err
    waiting = [ln for ln in err.splitlines() if "waiting for 2 workers to join at 127.0.0.1:" in ln]
    assert len(waiting) == 1 and "giving up after 2 s (--join-timeout)" in waiting[0], err
    assert "fusion worker --topology FILE --key" in waiting[0], err
    assert "did not join in time" in err.splitlines()[-1], err


# ---- (7) the smaller things ----


@pytest.mark.slow
def test_the_json_names_the_workers_a_run_finished_on(tiny_qwen2, capsys, monkeypatch):
    """--workers 3, one lost mid-run without a standby: the run finishes on 2, and "workers" says 2
    (it said 3, the number asked for). The loss is the test fault that closes a link mid-message."""
    import json

    from fusion_compute.cli import main as cli_main

    made = O.engine_options

    def with_fault(a, masked=False):
        opts = made(a, masked)
        opts.args_for_worker = {3: ("--inject-fault", "close-mid-message@4")}
        return opts

    monkeypatch.setattr(O, "engine_options", with_fault)
    argv = ["generate", "--model", str(tiny_qwen2), "--workers", "3", "--threads", "1", "--prompt-ids", "1,2,3"]
    assert cli_main.main([*argv, "--max-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["recoveries"]) == 1 and out["recoveries"][0]["lost"] == [3], out["recoveries"]
    assert out["workers"] == 2


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from test_serve import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("text-model"))


@pytest.mark.slow
def test_the_answer_and_the_log_never_share_a_line(text_model):
    """`fusion generate ... > run.log 2>&1`: the streamed answer used to end without its newline until
    after the "done" log line, which then followed the answer on its line."""
    import subprocess

    from procs import LOG_LINE, fusion

    p = fusion(
        "generate", "--model", str(text_model), "--workers", "1", "--threads", "1", "--raw", "--prompt",
        "hello world", "--max-tokens", "6", stderr=subprocess.STDOUT,
    )  # fmt: skip
    out, _ = p.communicate(timeout=120)
    assert p.wait() == 0, out
    lines = out.splitlines()
    answer = [ln for ln in lines if not LOG_LINE.match(ln)]
    assert len(answer) == 1 and answer[0].strip(), out  # the answer, on a line of its own
    assert all(LOG_LINE.match(ln) for ln in lines if "fusion generate: " in ln), out
    assert ", 1 worker (structural), prompt " in out and "1 workers" not in out  # plurals (issue 45)


def test_an_empty_prompt_is_a_wrong_command_line(capsys):
    assert "empty prompt" in one_line(capsys, ["generate", "--prompt", ""])
    assert "empty prompt" in one_line(capsys, ["generate", "--prompt-ids", ""])


def test_a_context_beyond_the_models_window_is_refused(tiny_qwen2, capsys):
    """--context 100000 on an 8192-token model silently ran with 8192; now it is refused, naming the
    window (tiny_qwen2's is 256)."""
    err = one_line(capsys, ["generate", "--model", str(tiny_qwen2), "--prompt-ids", "1,2", "--context", "1000"])
    assert "--context 1000 is beyond the model's window of 256 tokens" in err


def test_a_hub_id_gets_a_hint_to_download_it_first(capsys):
    err = one_line(capsys, ["plan", "--model", "HuggingFaceTB/SmolLM2-360M-Instruct"], code=1)
    assert "model not found" in err and "hf download HuggingFaceTB/SmolLM2-360M-Instruct --local-dir" in err
    err = one_line(capsys, ["plan", "--model", "/no/such/model"], code=1)  # a path: no hint
    assert "model not found" in err and "Hub" not in err


# ---- prompts from a file or stdin ----


def test_the_prompt_from_stdin_or_a_file(tmp_path, monkeypatch, capsys):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Grüße\nzwei Zeilen\n".encode())))
    assert O.prompt_from("-", "--prompt -") == "Grüße\nzwei Zeilen"  # echo's newline dropped, the inner kept
    f = tmp_path / "p.txt"
    f.write_bytes(b"from a file\n\n")
    assert O.prompt_from(str(f), "--prompt-file") == "from a file\n"
    f.write_bytes(b"caf\xe9\n")  # Latin-1
    assert "is not UTF-8 text (byte 0xe9 at offset 3)" in one_line(capsys, ["generate", "--prompt-file", str(f)])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff")))
    assert "--prompt - (stdin) is not UTF-8" in one_line(capsys, ["generate", "--prompt", "-"])
    err = one_line(capsys, ["generate", "--prompt-file", str(tmp_path / "none.txt")])
    assert "cannot read it: No such file or directory" in err
    assert "not both" in one_line(capsys, ["generate", "--prompt", "x", "--prompt-file", str(f)])


# ---- defaults from the environment ----


def test_repeated_flags_come_from_the_environment(tmp_path, monkeypatch, capsys):
    """$FUSION_MODEL, $FUSION_TOPOLOGY, $FUSION_KEY and $FUSION_PORT fill the flags left out; a flag
    given wins, and a topology from the environment yields to --workers."""
    monkeypatch.setenv("FUSION_MODEL", "/no/such/env-model")
    assert "model not found: /no/such/env-model" in one_line(capsys, ["plan"], code=1)
    assert "model not found: /no/such/flag" in one_line(capsys, ["plan", "--model", "/no/such/flag"], code=1)
    monkeypatch.delenv("FUSION_MODEL")

    ids = keys(3)
    paths = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"]))
    monkeypatch.setenv("FUSION_TOPOLOGY", str(topo))
    monkeypatch.setenv("FUSION_KEY", str(paths[2]))
    a = worker_args()
    O.apply_env_defaults(a)
    assert O.worker_options(a).rank == 2  # found itself in the file by the key
    a = build_parser().parse_args(["generate", "--workers", "3", "--prompt", "hi"])
    O.apply_env_defaults(a)
    assert a.topology is None and a.key is None  # a local run: neither applies

    monkeypatch.setenv("FUSION_PORT", "80x")
    assert "$FUSION_PORT must be a port number, got '80x'" in one_line(capsys, ["serve"])
    monkeypatch.setenv("FUSION_PORT", "8123")
    a = build_parser().parse_args(["serve"])
    O.apply_env_defaults(a)
    assert a.port == 8123
    a = build_parser().parse_args(["serve", "--port", "9000"])
    O.apply_env_defaults(a)
    assert a.port == 9000


def test_counts_take_their_nouns_number():
    from fusion_compute.runtime.progress import counted

    assert [counted(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert counted(1, "cold start") == "1 cold start" and counted(5, "cold start") == "5 cold starts"


def test_the_readme_module_table_names_every_module():
    """README's "How it works" table is a newcomer's map of the code: every module has its row."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    package = root / "fusion_compute"
    missing = [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if f"| `{p.relative_to(package)}` |" not in readme
    ]
    assert missing == [], f"README's module table lacks {missing}"
