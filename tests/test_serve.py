"""`fusion serve`: the OpenAI-compatible gateway, driven by the official `openai` client against a
live server on 127.0.0.1 (a tiny random Qwen2 with a small ChatML tokenizer, and the bundled
SmolLM2 for one real end-to-end check), plus the request checks and stop matching on their own.

Every server is started as a separate process and stopped by PID; the workers it spawned are
checked gone afterwards. Every wait is bounded."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai  # a test dependency: missing must fail, not skip
import pytest

from fusion_compute.serve import ApiError, ModelCard, StopMatcher, parse_chat, parse_completion

FUSION = [sys.executable, "-m", "fusion_compute.cli"]
API_KEY = "test-key"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_model(path: Path, seed: int = 3, max_positions: int = 256) -> Path:
    """A tiny random Qwen2 (context 256) with a byte-level BPE tokenizer and a ChatML template."""
    from tiny_models import build
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. Paris!"] * 20, trainer)
    build(path, "qwen2", seed=seed, vocab_size=backend.get_vocab_size(), max_position_embeddings=max_positions)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return path


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat-qwen2"))


# ---- a live server ----


class Live:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log
        self.host, self.port = re.match(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", API_KEY), max_retries=0, timeout=120, **kw)

    def raw(self, method: str, path: str, body: bytes | str | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
        try:
            h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


def child_pids(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def start_server(args: list[str], log: Path, timeout_s: float = 120) -> Live:
    f = open(log, "w")
    proc = subprocess.Popen([*FUSION, "serve", "--port", "0", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=f)  # fmt: skip
    f.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://\S+/v1)", log.read_text())
        if m:
            return Live(proc, m.group(1), log)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop_server(proc)
    raise AssertionError(f"server did not come up:\n{log.read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then check the server and every worker it spawned are gone (kill by PID if not)."""
    kids = child_pids(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in kids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"worker processes {left} outlived the server"


@pytest.fixture(scope="module")
def tiny_server(chat_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    live = start_server(["--model", str(chat_model), "--workers", "2", "--threads", "1", "--api-key", API_KEY,
                         "--served-model-name", "tiny", "--max-tokens", "12"], log)  # fmt: skip
    yield live
    stop_server(live.proc)
    assert live.proc.returncode == 0, log.read_text()[-2000:]


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def test_chat_streamed_equals_non_streamed(tiny_server):
    c = tiny_server.client()
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10)
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    fusion = r.model_extra["fusion"]
    assert fusion["workers"] == 2 and fusion["steps"] == r.usage.completion_tokens
    assert fusion["audit"]["checked"] is False and fusion["audit"]["reason"]  # honest: not verified per request
    assert r.system_fingerprint == "fusion-" + fusion["plan"]

    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert finals[0].model_extra["fusion"]["steps"] == fusion["steps"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_sse_wire_format_ends_with_done(tiny_server):
    body = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 3, "stream": True})
    status, raw = tiny_server.raw("POST", "/v1/chat/completions", body)
    assert status == 200
    events = [ln[len("data: "):] for ln in raw.decode().split("\n") if ln.startswith("data: ")]  # fmt: skip
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_completions_text_ids_and_stop(tiny_server):
    c = tiny_server.client()
    r = c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=12)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="the quick brown fox", max_tokens=12, stream=True) if ch.choices)  # fmt: skip
    assert streamed == text
    assert text.strip(), "the tiny model should say something in 12 tokens"
    # stop: cut at the first occurrence of a piece of the answer, streamed or not
    cut = text.strip()[len(text.strip()) // 2 :][:3]
    want = text[: text.find(cut)]
    r2 = c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=12, stop=[cut, "\x00never"])
    assert r2.choices[0].text == want and r2.choices[0].finish_reason == "stop"
    s2 = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="the quick brown fox", max_tokens=12, stop=cut, stream=True) if ch.choices)  # fmt: skip
    assert s2 == want


def test_token_id_prompt(tiny_server, chat_model):
    from fusion_compute.tokenizer import load_tokenizer

    ids = load_tokenizer(chat_model).encode("the quick brown fox")
    c = tiny_server.client()
    by_text = c.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=6)
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_models_health_and_auth(tiny_server):
    c = tiny_server.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    status, body = tiny_server.raw("GET", "/health", headers={"Authorization": ""})
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["workers"] == 2
    with pytest.raises(openai.AuthenticationError):
        tiny_server.client(api_key="wrong").models.list()


# The documented list of invalid requests (docs/serving.md): each gets a 4xx in OpenAI's format.
LONG = "hello world " * 200  # > 256 tokens: the tiny model's context window
INVALID = [
    ("bad json", "/v1/chat/completions", "{not json", 400, None),
    ("body not an object", "/v1/chat/completions", "[1, 2]", 400, None),
    ("missing model", "/v1/chat/completions", {"messages": CHAT}, 400, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "model_not_found"),
    ("empty messages", "/v1/chat/completions", {"model": "tiny", "messages": []}, 400, None),
    ("messages not a list", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, None),
    ("bad role", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("image content", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, None),
    ("max_tokens 0", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 0}, 400, None),
    ("max_tokens -5", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": -5}, 400, None),
    ("max_tokens not int", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": "9"}, 400, None),
    ("temperature 2.5", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": 2.5}, 400, None),
    ("temperature -1", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": -1}, 400, None),
    ("top_p 0", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_p": 0}, 400, None),
    ("top_p 1.5", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "top_p": 1.5}, 400, None),
    ("seed not int", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "seed": "x"}, 400, None),
    ("stop not strings", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": [1]}, 400, None),
    ("five stops", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": list("abcde")}, 400, None),
    ("n 2", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 2}, 400, None),
    ("tools", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}, 400, None),
    ("prompt too long", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
    ("max_tokens beyond context", "/v1/chat/completions",
     {"model": "tiny", "messages": CHAT, "max_tokens": 1000}, 400, "context_length_exceeded"),
    ("empty prompt", "/v1/completions", {"model": "tiny", "prompt": ""}, 400, None),
    ("token id out of vocab", "/v1/completions", {"model": "tiny", "prompt": [1, 99999]}, 400, None),
    ("two prompts", "/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, None),
    ("unknown route", "/v1/embeddings", {"model": "tiny", "input": "x"}, 404, "not_found"),
]  # fmt: skip


def test_invalid_requests_get_4xx_and_server_keeps_serving(tiny_server):
    for name, path, body, status, code in INVALID:
        raw = body if isinstance(body, str) else json.dumps(body)
        got, data = tiny_server.raw("POST", path, raw)
        err = json.loads(data)["error"]
        assert got == status, (name, got, err)
        assert err["message"] and err["type"] and "param" in err and err["code"] == code, (name, err)
    assert tiny_server.raw("GET", "/v1/chat/completions")[0] == 405
    assert tiny_server.raw("POST", "/v1/chat/completions", "{}", {"Authorization": "Bearer wrong"})[0] == 401
    with pytest.raises(openai.BadRequestError):  # the same through the official client
        tiny_server.client().chat.completions.create(model="tiny", messages=CHAT, temperature=3)
    # still serving, and still correct
    status, _ = tiny_server.raw("GET", "/health")
    assert status == 200
    r = tiny_server.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=4)
    assert r.usage.completion_tokens >= 1
    assert tiny_server.proc.poll() is None


def test_concurrent_requests_queue_and_match_sequential(tiny_server):
    c = tiny_server.client()
    asks = [dict(messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8, temperature=0.8, seed=i)
            for i in range(8)]  # fmt: skip
    want = [c.chat.completions.create(model="tiny", **kw).choices[0].message.content for kw in asks]
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda kw: c.chat.completions.create(model="tiny", **kw), asks))
    assert [r.choices[0].message.content for r in got] == want  # one session at a time: no cross-talk
    waits = sorted(r.model_extra["fusion"]["timing"]["queue_s"] for r in got)
    assert waits[-1] > 0  # the engine runs one at a time, so someone waited


def test_disconnect_mid_stream_cancels(tiny_server):
    conn = http.client.HTTPConnection(tiny_server.host, int(tiny_server.port), timeout=30)
    body = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 200, "stream": True})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()
    conn.close()  # hang up
    r = tiny_server.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    assert r.usage.completion_tokens >= 1


# ---- request checks and stop matching, without a server ----


@pytest.fixture(scope="module")
def card(chat_model):
    from fusion_compute.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_model)
    return ModelCard(id="tiny", tokenizer=tok, context=256, vocab=tok.vocab_size, eos_ids=tok.eos_ids)


def test_parse_defaults_and_aliases(card):
    req = parse_chat({"model": "tiny", "messages": [{"role": "developer", "content": [{"type": "text", "text": "x"}]},
                                                     {"role": "user", "content": "hi"}]}, card)  # fmt: skip
    assert req.sampling.temperature == 0.0 and req.max_tokens > 0 and not req.stream and req.stop == ()
    assert card.tokenizer.decode(req.prompt_ids).startswith("<|im_start|>system\nx<|im_end|>")
    req = parse_completion({"model": "tiny", "prompt": ["hello"], "max_completion_tokens": 5, "stop": "x"}, card)
    assert req.max_tokens == 5 and req.stop == ("x",)
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, card)
    assert e.value.status == 400 and e.value.param == "stream_options"


@pytest.mark.parametrize(
    "stops,pieces,want",
    [
        (("END",), ["abc", "E", "N", "Dxyz"], "abc"),
        (("END",), ["abEN", "x", "END"], "abENx"),
        (("a", "bc"), ["xxb", "c"], "xx"),
        (("\n\n",), ["one\n", "\ntwo"], "one"),
        (("zz",), ["no", " stop", " here"], "no stop here"),
    ],
)
def test_stop_matcher_streaming(stops, pieces, want):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces) + m.flush()
    assert out == want


def test_kept_alive_connection_survives_errors(tiny_server):
    """Errors answered before the body is parsed still consume it, so the next request on the same
    connection is read correctly."""
    conn = http.client.HTTPConnection(tiny_server.host, int(tiny_server.port), timeout=60)
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": "tiny", "messages": CHAT, "max_tokens": 2, "pad": "x" * 5000})
    try:
        for path, headers, status in [("/v1/nothing", auth, 404), ("/v1/chat/completions", {**auth, "Authorization": "Bearer no"}, 401),
                                      ("/v1/chat/completions", auth, 200)]:  # fmt: skip
            conn.request("POST", path, body=body, headers=headers)
            r = conn.getresponse()
            data = json.loads(r.read())
            assert r.status == status and ("error" in data) == (status != 200), data
    finally:
        conn.close()


def test_serve_bad_args_one_line(capsys):
    import socket

    from fusion_compute.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        for args, needle in [(["--port", str(busy.getsockname()[1])], "cannot listen"), (["--port", "70000"], "--port"),
                             (["--workers", "0"], "--workers")]:  # fmt: skip
            assert main(["serve", *args]) != 0
            err = capsys.readouterr().err.strip()
            assert needle in err and len(err.splitlines()) == 1, err
