"""The real thing, end to end: the bundled SmolLM2-135M-Instruct behind `fusion serve` on 2 workers,
asked through the official `openai` client (streamed and not, 8 at once) and through `fusion chat`."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import FUSION, start_server, stop_server

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]


@pytest.fixture(scope="module")
def smollm_server(smollm_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-smollm") / "serve.log"
    live = start_server(["--model", str(smollm_path), "--workers", "2", "--api-key", "test-key"], log, timeout_s=180)
    yield live
    stop_server(live.proc)


def test_paris_streamed_and_not(smollm_server):
    c = smollm_server.client()
    model = c.models.list().data[0].id
    r = c.chat.completions.create(model=model, messages=FRANCE, max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    assert r.model_extra["fusion"]["workers"] == 2 and r.model_extra["fusion"]["steps"] == r.usage.completion_tokens
    stream = c.chat.completions.create(model=model, messages=FRANCE, max_tokens=16, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == r.choices[0].message.content


def test_eight_concurrent_requests(smollm_server):
    c = smollm_server.client()
    model = c.models.list().data[0].id
    asks = [(FRANCE, "Paris") if i % 2 == 0 else (GERMANY, "Berlin") for i in range(8)]

    def ask(item):
        messages, _ = item
        t0 = time.perf_counter()
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=12)
        return r, time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        done = list(ex.map(ask, asks))
    wall = time.perf_counter() - t0
    for (r, _), (_, city) in zip(done, asks, strict=True):
        assert city in r.choices[0].message.content, r.choices[0].message.content
    lat = sorted(t for _, t in done)
    print(f"8 concurrent: wall {wall:.1f} s, latency min {lat[0]:.1f} / median {lat[4]:.1f} / max {lat[-1]:.1f} s")


def test_chat_url_keeps_history(smollm_server):
    """`fusion chat --url` against the server: the second question only makes sense with the first."""
    r = subprocess.run(
        [*FUSION, "chat", "--url", smollm_server.url.removesuffix("/v1"), "--api-key", "test-key",
         "--max-tokens", "16"],
        input="What is the capital of France?\nWhat about Germany?\n/history\n",
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "Paris" in lines[0] and "Berlin" in lines[1], r.stdout
    assert "[user] What about Germany?" in r.stdout
