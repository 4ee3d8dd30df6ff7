"""The `fusion` command line's rules, in this process (nothing starts): no prefix matching, one line and
exit 2 for a wrong command line, --version, a missing subcommand shows its command's help, --help
grouped with every default, one name for the reply's limit, the same context limit as `fusion serve`,
the log formats, chat's listing and empty replies, and the bench's extra checked first."""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import time
import tomllib
from pathlib import Path

import pytest

from fusion_compute.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _refused(capsys, argv: list[str]) -> str:
    """The parser's answer to `argv`: exit 2 and exactly one line on stderr, which is returned."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "usage:" not in err, err
    return err


@pytest.mark.parametrize(
    "argv,said",
    [
        (["generate", "--worker", "2", "--prompt", "hi"], "fusion generate: error: unrecognized arguments: --worker 2"),
        (["generate", "--max-new-token", "5", "--prompt", "hi"], "unrecognized arguments: --max-new-token 5"),
        (["serve", "--max-tok", "5"], "fusion serve: error: unrecognized arguments: --max-tok 5"),
        (["chat", "--mod", "x"], "fusion chat: error: unrecognized arguments: --mod x"),
        (["audit", "verify", "d", "--jso"], "fusion audit verify: error: unrecognized arguments: --jso"),
    ],
)
def test_no_flag_is_guessed_from_a_prefix(capsys, argv, said):
    assert said in _refused(capsys, argv)


def test_a_bad_value_is_one_line(capsys):
    err = _refused(capsys, ["generate", "--workers", "two", "--prompt", "hi"])
    assert err.startswith("fusion generate: error: argument --workers: expected N or A+B"), err
    assert "invalid choice" in _refused(capsys, ["generate", "--mode", "maskd", "--prompt", "hi"])


def test_version_is_the_packages(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"fusion {version}"


@pytest.mark.parametrize("argv", [[], ["keys"], ["audit"]])
def test_a_missing_subcommand_prints_that_commands_help(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: " + " ".join(["fusion", *argv]) + " "), err
    assert "COMMAND" in err and "required" not in err


def _parsers(p: argparse.ArgumentParser, name: str = "fusion"):
    yield name, p
    if getattr(p, "commands", None) is not None:
        for sub, q in p.commands.choices.items():
            yield from _parsers(q, f"{name} {sub}")


def test_help_is_grouped_prompt_and_sampling_first():
    text = build_parser().commands.choices["generate"].format_help()
    titles = [ln[:-1] for ln in text.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert titles == [
        "options",
        "prompt and output",
        "sampling",
        "workers and model",
        "network and identity",
        "when a worker is lost or slow (docs/resilience.md)",
        "speculative decoding (docs/speculative.md)",
        "audit",
        "logging (stderr)",
    ], titles


def test_every_default_is_shown():
    """Every flag of every command whose default is a value (not None: decided at run time, which its
    help says) shows it in --help."""
    unshown = []
    for name, p in _parsers(build_parser()):
        fmt = p._get_formatter()
        for action in p._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._VersionAction):
                continue
            if "default" not in fmt._expand_help(action):
                unshown.append(f"{name} {action.option_strings[0]}")
    assert unshown == []


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["chat"], ["serve"]])
def test_one_name_for_the_replys_limit(cmd):
    """--max-tokens everywhere (OpenAI's and vLLM's request field); --max-new-tokens an alias."""
    for flag in ("--max-tokens", "--max-new-tokens"):
        assert build_parser().parse_args([*cmd, flag, "7"]).max_tokens == 7


def test_plan_defaults_workers_as_generate_does():
    assert build_parser().parse_args(["plan"]).workers == 2


def test_chat_says_what_to_do_for_the_masked_mode(capsys):
    for argv in (["chat", "--mode", "masked", "--workers", "2+2"], ["chat", "--workers", "2+2"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "fusion serve --mode masked --workers 2+2" in err[0] and "fusion chat --url" in err[0]


def test_the_limit_is_serves_rule():
    """Asked beyond the room the context leaves after the prompt: refused (serve's 400); not asked: the
    default, capped to that room with a warning."""
    from fusion_compute.cli.main import DEFAULT_NEW_TOKENS, new_tokens_limit
    from fusion_compute.errors import UsageError

    log = logging.getLogger("test")
    with pytest.raises(UsageError, match=r"--max-new-tokens 100000 does not fit: .* 4096 .* 10, which leaves 4086"):
        new_tokens_limit(100000, "--max-new-tokens", 10, 4096, 8192, log)
    assert new_tokens_limit(4086, "--max-tokens", 10, 4096, 8192, log) == 4086
    assert new_tokens_limit(None, "--max-tokens", 10, 4096, 8192, log) == DEFAULT_NEW_TOKENS
    assert new_tokens_limit(None, "--max-tokens", 4090, 4096, 8192, log) == 6


def test_log_lines_off_a_terminal_are_timestamped_and_json_parses():
    from fusion_compute.cli import logs

    out = io.StringIO()
    log = logs.setup("fusion worker", stream=out)
    log.info("joined epoch 0")
    logging.getLogger("fusion_compute.structural.worker").warning("epoch 0 ended")
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z fusion worker: joined epoch 0", lines[0]), lines
    assert lines[1].endswith(" fusion worker: warning: epoch 0 ended"), lines

    out = io.StringIO()
    log = logs.setup("fusion serve", fmt="json", stream=out)
    log.info("listening")
    logs.error_line("fusion serve", "port busy")
    recs = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert [(r["level"], r["prog"], r["message"]) for r in recs] == [
        ("info", "fusion serve", "listening"),
        ("error", "fusion serve", "port busy"),
    ]

    out = io.StringIO()
    log = logs.setup("fusion generate", quiet=True, stream=out)
    log.info("hidden")
    logs.engine_notice(log)("warning: --insecure: plaintext")
    assert (
        out.getvalue().endswith("fusion generate: warning: --insecure: plaintext\n") and "hidden" not in out.getvalue()
    )


def test_chat_lists_a_standby_that_took_a_seat_by_its_state_only():
    from fusion_compute.cli.chat import _membership

    class Backend:
        def membership(self, action, **kw):
            return {
                "epoch": 1,
                "workers": [
                    {"id": 1, "rank": None, "state": "removed", "where": "worker 1 [127.0.0.1, key fc1a]"},
                    {"id": 3, "rank": 1, "state": "active", "where": "standby 3 [127.0.0.1, key fc1b]"},
                ],
            }

    rows = _membership(Backend(), "/revoke", "1").splitlines()
    assert rows[2] == "  worker 3   rank 1   active  [127.0.0.1, key fc1b]", rows
    assert "standby" not in rows[2]


def test_empty_answers_are_said():
    import io

    from fusion_compute.cli.chat import chat_loop
    from fusion_compute.cli.main import no_text_warning

    class Silent:
        model, workers = "fake", 2

        def reply(self, body, emit, cancelled):
            return {"finish_reason": "stop"}

    out, err = io.StringIO(), io.StringIO()
    chat_loop(Silent(), {}, None, io.StringIO("hi\n"), out, err, False)
    assert "(no text: the model ended its turn at once" in err.getvalue()
    assert no_text_warning("Paris.", [1, 2], "stop", True) is None
    said = no_text_warning(" \n", [2], "stop", True)
    assert said is not None and "it ended its turn at once" in said and "--raw" in said


def test_bench_names_its_extra_before_starting(monkeypatch, capsys, tmp_path):
    from fusion_compute.bench import run

    monkeypatch.setattr(run, "BENCH_NEEDS", ("transformers", "no_such_package_38"))
    t0 = time.monotonic()
    assert main(["bench", "--repeats", "1", "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'fusion bench: error: fusion bench needs no_such_package_38 (the [bench] extra): pip install -e ".[bench]" '
        "in the project's directory"
    ]
    assert time.monotonic() - t0 < 5 and not (tmp_path / "b").exists()  # refused before anything ran
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    assert [re.split("[<>=]", x)[0] for x in extras] == ["transformers", "accelerate", "matplotlib"]


@pytest.mark.slow  # builds a model with transformers: about 4 s
def test_chat_and_serve_refuse_a_limit_beyond_the_context_before_any_worker(tmp_path, capsys):
    from test_serve import build_chat_model

    model = str(build_chat_model(tmp_path / "m"))  # context 256
    capsys.readouterr()  # (transformers' progress while the model was written)
    for cmd in (["chat"], ["serve", "--port", "0"]):
        assert main([*cmd, "--model", model, "--max-tokens", "256"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--max-tokens 256 cannot fit the context window of 256 tokens" in err[0], err
