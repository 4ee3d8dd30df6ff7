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
from pathlib import Path

import pytest
from procs import FUSION, children
from test_serve import alive, build_chat_model

from fusion_compute.comm.readiness import readable

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")


def _controlling_tty() -> None:
    # A session of its own with the pty as its terminal, so that ^C becomes SIGINT as in a shell; and a
    # shell's signal state: nothing blocked, SIGINT not ignored (a blocked mask and an ignored SIGINT
    # survive exec, and the pytest process forking this may hold either after earlier tests' servers)
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Pty:
    def __init__(self, args: list[str]):
        self.master, slave = pty.openpty()
        env = {**os.environ, "TERM": "dumb"}
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=_controlling_tty
        )
        os.close(slave)
        self.buf = ""

    def _signals(self) -> str:
        """The child's signal state and threads, for a failure's message (where a Ctrl-C went)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
            tasks = sorted(os.listdir(f"/proc/{self.proc.pid}/task"))
        except OSError:
            return "(the process is gone)"
        return " ".join(
            line for line in status if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
        ) + (f" threads {len(tasks)}")

    def read_until(self, needle: str, timeout_s: float = 60) -> str:
        """Output up to and including `needle` (bounded wait); consumes it from the buffer."""
        deadline = time.monotonic() + timeout_s
        while needle not in ANSI.sub("", self.buf):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not readable([self.master], 0):
                raise AssertionError(
                    f"no {needle!r} in time; got:\n{ANSI.sub('', self.buf)[-1500:]}\n{self._signals()}"
                )
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
        # Ctrl-C at the prompt drops the line, not the conversation (issue 45); sent once the line's echo
        # shows the chat is reading it, as a person's Ctrl-C comes after their typing
        t.send("half a line")
        t.read_until("half a line")
        t.send("\x03")
        assert "(Ctrl-D or /quit leaves)" in t.read_until("you> ")
        t.send("/history\n")
        hist = t.read_until("you> ")
        assert "half a line" not in hist
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


class EchoBackend:
    model, workers, context = "fake", 2, 64

    def reply(self, body, emit, cancelled):
        emit(f"re:{body['messages'][-1]['content']}")
        return {"finish_reason": "stop"}


class Typed:
    """A terminal's lines, with Ctrl-C (SIGINT's KeyboardInterrupt) where a line is None."""

    def __init__(self, *lines):
        self.lines = list(lines)

    def readline(self) -> str:
        if not self.lines:
            return ""
        line = self.lines.pop(0)
        if line is None:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_at_the_prompt_keeps_the_conversation():
    """Issue 45: Ctrl-C at the prompt used to leave, losing the history. It drops the line being
    typed and says how to leave, as Ollama and Python's REPL do; Ctrl-D (end of input) leaves."""
    import io

    from fusion_compute.cli.chat import chat_loop

    out, err = io.StringIO(), io.StringIO()
    code = chat_loop(EchoBackend(), {}, None, Typed("hello\n", None, "/history\n"), out, err, True)
    assert code == 0 and "(Ctrl-D or /quit leaves)" in err.getvalue()
    assert "[user] hello\n[assistant] re:hello\n" in out.getvalue()  # /history after the Ctrl-C


def test_a_line_that_is_not_utf8_is_not_sent():
    """Piped stdin escapes bytes that are not UTF-8 (surrogateescape); such a line used to reach the
    tokenizer ("TypeError: TextInputSequence must be str"). It is refused in words; the chat goes on."""
    import io

    from fusion_compute.cli.chat import chat_loop

    out, err = io.StringIO(), io.StringIO()
    chat_loop(EchoBackend(), {}, None, io.StringIO("caf\udce9\nhello\n"), out, err, False)
    assert "(that line is not UTF-8 text: not sent" in err.getvalue()
    assert out.getvalue().strip().splitlines() == ["re:hello"]


@pytest.mark.parametrize(
    "line,refused",
    [
        ("temperature -1", "temperature"),
        ("temperature nan", "temperature"),
        ("temperature 500", "temperature"),
        ("top_p 0", "top_p"),
        ("top_k -2", "top_k"),
        ("max_tokens 0", "max_tokens"),
        ("max_tokens 99999999", "at most 63"),
        ("max_tokens 64", "at most 63"),
        ("seed 18446744073709551616", "seed"),
    ],
)
def test_set_refuses_what_every_turn_would_refuse(line, refused):
    """Issue 45: `/set temperature -1` was taken, then every turn failed. A value the request checks
    refuse (or a max_tokens no prompt leaves room for in the context) is refused by /set, naming it,
    and the old value stays; a good value is taken and sent."""
    import io

    from fusion_compute.cli.chat import chat_loop

    class Seen(EchoBackend):
        bodies: list[dict] = []

        def reply(self, body, emit, cancelled):
            self.bodies.append(body)
            return super().reply(body, emit, cancelled)

    out, err = io.StringIO(), io.StringIO()
    params = {"temperature": 0.0}
    chat_loop(Seen(), params, None, io.StringIO(f"/set {line}\n/set max_tokens 63\nhi\n"), out, err, False)
    said = out.getvalue().splitlines()[0]
    assert said.startswith(f"({line.split()[0]} not set:") and refused in said, said
    assert Seen.bodies[-1] == {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "max_tokens": 63}


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


@pytest.mark.parametrize("status", [200, 404])
def test_chat_url_at_another_server_says_so_in_one_line(capsys, status):
    """Issue 45: `fusion chat --url` at a server that is not a fusion serve dumped its HTML page. One
    line now, naming what it asked and what it got, without the page."""
    import http.server
    import threading

    from fusion_compute.cli.main import main

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<!DOCTYPE html>\n<html><body><h1>It works</h1>\n</body></html>\n"
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert main(["chat", "--url", f"http://127.0.0.1:{server.server_address[1]}"]) == 2
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "<" not in err and "Traceback" not in err, err
    assert "/v1/models" in err and "is it a `fusion serve`?" in err, err
