"""`fusion chat` in a real terminal (a pty): prompt, streamed replies, history, commands, Ctrl-C
stops a reply without breaking the workers, Ctrl-D leaves; nothing is left running."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import subprocess
import termios
import time

import pytest
from procs import FUSION, children
from test_serve import alive, build_chat_model

from fusion_compute.comm.readiness import readable

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


def _controlling_tty() -> None:
    # A session of its own with the pty as its terminal, so that ^C becomes SIGINT as in a shell.
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Pty:
    def __init__(self, args: list[str]):
        self.master, slave = pty.openpty()
        env = {**os.environ, "TERM": "dumb"}
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=_controlling_tty
        )
        os.close(slave)
        self.buf = ""

    def read_until(self, needle: str, timeout_s: float = 60) -> str:
        """Output up to and including `needle` (bounded wait); consumes it from the buffer."""
        deadline = time.monotonic() + timeout_s
        while needle not in ANSI.sub("", self.buf):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not readable([self.master], 0):
                raise AssertionError(f"no {needle!r} in time; got:\n{ANSI.sub('', self.buf)[-1500:]}")
            if readable([self.master], min(left, 0.5)):
                try:
                    self.buf += os.read(self.master, 65536).decode(errors="replace")
                except OSError:
                    pass
        clean = ANSI.sub("", self.buf)
        i = clean.index(needle) + len(needle)
        self.buf = clean[i:]
        return clean[:i]

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        kids = children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self.master)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in kids if alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"workers {left} outlived fusion chat"


@pytest.fixture(scope="module")
def long_chat_model(tmp_path_factory):
    # A long window, so that a reply can run long enough to be interrupted; transformers' default init
    # (std 0.02), not tiny_models' wider one, whose reply here ends at its end-of-turn token after ~190
    # tokens, in about a second: before the test's Ctrl-C. What it tests is the terminal, not the tokens.
    return build_chat_model(
        tmp_path_factory.mktemp("chat-long"), seed=5, max_positions=4096, initializer_range=0.02, rms_norm_eps=1e-6
    )


@pytest.mark.slow
def test_chat_in_a_terminal(long_chat_model):
    t = Pty(
        [
            *FUSION,
            "chat",
            "--model",
            str(long_chat_model),
            "--workers",
            "2",
            "--threads",
            "1",
            "--max-tokens",
            "8",
            "--system",
            "be brief",
        ]
    )
    try:
        banner = t.read_until("you> ", timeout_s=120)
        assert "fusion chat:" in banner and "2 workers" in banner
        t.send("hello world\n")
        first = t.read_until("you> ")
        assert re.search(r"\[\d+ tokens .*2 workers, \d+ steps\]", first), first
        assert "audit" not in first  # nobody asked for one (issue 38)
        reply1 = first.split("hello world\n", 1)[1].split("\n[", 1)[0]
        t.send("the lazy dog\n")
        t.read_until("you> ")
        t.send("/history\n")
        hist = t.read_until("you> ")
        assert "[system] be brief" in hist and "[user] hello world" in hist and "[user] the lazy dog" in hist
        assert hist.count("[assistant]") == 2 and f"[assistant] {reply1}" in hist
        t.send("/reset\n")
        assert "(new conversation)" in t.read_until("you> ")
        t.send("/history\n")
        assert "(empty)" in t.read_until("you> ")
        # Ctrl-C stops a long reply; client and workers stay in step, so the next turn works
        t.send("/set max_tokens 3000\n")
        assert "(max_tokens = 3000)" in t.read_until("you> ")
        t.send("hello\n")
        t.read_until("hello\n")
        time.sleep(1.0)
        t.send("\x03")
        assert "(stopped)" in t.read_until("you> ", timeout_s=30)
        t.send("/set max_tokens 4\n")
        t.read_until("you> ")
        t.send("hello again\n")
        assert re.search(r"\[\d+ tokens", t.read_until("you> "))
        t.send("\x04")  # Ctrl-D leaves
        t.proc.wait(timeout=30)
        assert t.proc.returncode == 0
    finally:
        t.close()


def test_chat_bad_args_one_line(capsys):
    from fusion_compute.cli.main import main

    for args, needle in [
        (["--model", "/no/such/model", "--temperature", "-1"], "temperature"),
        (["--url", "http://127.0.0.1:9"], "cannot reach"),
        (["--url", "ftp://x"], "--url must be"),
    ]:
        assert main(["chat", *args]) != 0
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_history_trimmed_to_fit_the_context():
    """When the conversation no longer fits, the oldest turns go (the system prompt stays)."""
    import io

    from fusion_compute.cli.chat import ChatError, chat_loop

    class Backend:
        model, workers = "fake", 2
        seen: list[list[dict]] = []

        def reply(self, body, emit, cancelled):
            msgs = body["messages"]
            if len(msgs) > 4:  # system + at most 3 messages fit
                raise ChatError("too long", context_full=True)
            self.seen.append(msgs)
            emit(f"re:{msgs[-1]['content']}")
            return {"finish_reason": "stop"}

    out, err = io.StringIO(), io.StringIO()
    chat_loop(Backend(), {}, "sys", io.StringIO("a\nb\nc\n/set top_k x\n/set seed 3\n/history\n"), out, err, False)
    assert out.getvalue().splitlines()[:3] == ["re:a", "re:b", "re:c"]
    assert [m["content"] for m in Backend.seen[-1]] == ["sys", "b", "re:b", "c"]  # turn "a" was dropped
    assert "top_k takes an integer" in out.getvalue() and "(seed = 3)" in out.getvalue()
    assert "[system] sys\n[user] b\n[assistant] re:b\n[user] c\n[assistant] re:c\n" in out.getvalue()
    assert err.getvalue().count("dropped the oldest turn") == 1


def test_local_backend_reports_bad_values_and_a_full_context(tmp_path):
    """The local backend checks a turn as `fusion serve` checks a request (same models, same
    gateway), and says which parameter is wrong; a conversation too long for the window is
    reported as such, which is what lets the loop drop old turns."""
    from test_serve import FlakyEngine

    from fusion_compute.cli.chat import ChatError, LocalBackend
    from fusion_compute.serving.gateway import Gateway, ModelCard
    from fusion_compute.weights.tokenizer import load_tokenizer

    tok = load_tokenizer(build_chat_model(tmp_path / "m"))
    card = ModelCard(id="tiny", tokenizer=tok, context=64, vocab=tok.vocab_size, eos_ids=tok.eos_ids)
    backend = LocalBackend(Gateway(FlakyEngine(card), card))
    hello = [{"role": "user", "content": "hello"}]
    pieces: list[str] = []
    info = backend.reply({"messages": hello, "max_tokens": 3}, pieces.append, lambda: False)
    assert info["usage"]["completion_tokens"] == 3 and info["fusion"]["workers"] == 2
    for params, needle in [
        ({"temperature": 5.0}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
    ]:
        with pytest.raises(ChatError) as e:
            backend.reply({"messages": hello, **params}, pieces.append, lambda: False)
        assert needle in str(e.value) and not e.value.context_full, str(e.value)
    with pytest.raises(ChatError) as e:
        backend.reply({"messages": [{"role": "user", "content": "hello world " * 40}]}, pieces.append, lambda: False)
    assert e.value.context_full
