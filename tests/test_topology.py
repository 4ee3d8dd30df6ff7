"""Topology files: parsing and checks, and multi-host runs on one machine (loopback) where the client
and every worker are separately started processes that take their roles from the same file."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_serve import FUSION, build_chat_model

from fusion_compute.comm import free_port
from fusion_compute.topology import Topology, TopologyError, bind_here, interface_for, is_local_address

GOOD = """
model = "/models/m.gguf"
[client]
address = "127.0.0.1:29555"
[[worker]]
address = "127.0.0.1"
capacity = 2
[[worker]]
name = "b"
address = "localhost"
model = "/elsewhere/m.gguf"
"""


def test_parse_good(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(GOOD)
    t = Topology.load(f)
    assert t.n_workers == 2 and t.master == "127.0.0.1:29555" and t.capacities == (2.0, 1.0)
    assert t.model_for(0) == t.model_for(1) == "/models/m.gguf" and t.model_for(2) == "/elsewhere/m.gguf"
    assert t.participant(2).label == "worker 2 (b)" and t.local_worker_ranks() == [1, 2]


BAD = [
    ("", "missing [client]"),
    ("[client]\naddress = '127.0.0.1'\n[[worker]]\naddress = 'a'\n", "HOST:PORT"),
    ("[client]\naddress = '127.0.0.1:70000'\n[[worker]]\naddress = 'a'\n", "HOST:PORT"),
    ("[client]\naddress = '127.0.0.1:1234'\n", "no workers"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\ncapacity = 1\n", "address"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a:99'\n", "host only"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\ncapacity = 0\n", "positive"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\ncapacity = 'x'\n", "positive"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\ncapasity = 1\n", "unknown key 'capasity'"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\nname = 'x'\n[[worker]]\naddress = 'b'\n"
     "name = 'x'\n", "duplicate name"),  # fmt: skip
    ("workers = 3\n", "unknown key 'workers'"),
    ("[client\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,needle", BAD, ids=[b[1] for b in BAD])
def test_parse_bad(tmp_path, text, needle):
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(TopologyError, match=needle.replace("[", r"\[")):
        Topology.load(f)
    with pytest.raises(TopologyError, match="not found"):
        Topology.load(tmp_path / "missing.toml")


def test_this_machine():
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.1")  # TEST-NET-1: nobody's
    assert interface_for("127.0.0.1") == "lo"
    t = Topology.from_dict({"client": {"address": "127.0.0.1:1"}, "worker": [{"address": "192.0.2.1"}]})
    env: dict[str, str] = {}
    assert bind_here(t.client, env) == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    with pytest.raises(TopologyError, match="not an address of this machine"):
        bind_here(t.workers[0], {})


def write_topology(path: Path, model: Path, caps: tuple[float, ...], hosts: tuple[str, ...] | None = None) -> Path:
    hosts = hosts or ("127.0.0.1",) * len(caps)
    text = f'model = "{model}"\n[client]\naddress = "127.0.0.1:{free_port()}"\n'
    for h, c in zip(hosts, caps, strict=True):
        text += f'[[worker]]\naddress = "{h}"\ncapacity = {c}\n'
    path.write_text(text)
    return path


def test_cli_topology_errors_one_line(tmp_path, capsys):
    from fusion_compute.cli import main

    good = write_topology(tmp_path / "t.toml", tmp_path, (1, 1))
    away = write_topology(tmp_path / "away.toml", tmp_path, (1, 1), ("192.0.2.1", "127.0.0.1"))
    cases = [
        (["worker", "--topology", str(good)], "give --rank: 2 workers of the file are on this machine"),
        (["worker", "--topology", str(away), "--rank", "1"], "not an address of this machine"),
        (["worker", "--topology", str(good), "--rank", "3"], "rank 3 is not in the file"),
        (["worker", "--rank", "1"], "give --workers, --master"),
        (["generate", "--topology", str(good), "--workers", "3", "--prompt-ids", "1"], "drop --workers"),
        (["generate", "--topology", str(tmp_path / "nope.toml"), "--prompt-ids", "1"], "not found"),
    ]
    for args, needle in cases:
        assert main(args) != 0
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (args, err)


def _workers(topo: Path, n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([*FUSION, "worker", "--topology", str(topo), "--rank", str(r), "--threads", "1",
                          "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for r in range(1, n + 1)
    ]


def _reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_generate_with_topology_and_separate_workers(tiny_qwen2, tmp_path):
    from fusion_compute.plan import make_plan
    from fusion_compute.weights import open_weights

    topo = write_topology(tmp_path / "t.toml", tiny_qwen2, (2, 1))
    ids = "5,17,33,2,99"
    client = subprocess.Popen([*FUSION, "generate", "--topology", str(topo), "--prompt-ids", ids,
                               "--max-new-tokens", "8", "--json", "--timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    workers = _workers(topo, 2)
    try:
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        assert err == ""  # stderr not a terminal: no bars, no start-up log
        for w in workers:
            w.wait(timeout=30)
            assert w.returncode == 0, w.stderr.read()
            assert w.stderr.read() == ""  # not a terminal: no progress output
    finally:
        _reap([client, *workers])
    res = json.loads(out)
    assert res["workers"] == 2 and len(res["token_ids"]) == 8
    # The file's capacities made the plan (client and workers agreed on it at the handshake). That a
    # run with separately started workers gives the local run's tokens is test_cli's check.
    assert res["plan"] == make_plan(open_weights(tiny_qwen2).config, 2, (2.0, 1.0)).fingerprint()


def test_serve_with_topology_and_separate_workers(tmp_path):
    import openai
    model = build_chat_model(tmp_path / "model")
    topo = write_topology(tmp_path / "t.toml", model, (1, 3))
    workers: list[subprocess.Popen] = []
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([*FUSION, "serve", "--topology", str(topo), "--port", "0", "--timeout", "60"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # fmt: skip
    try:
        workers = _workers(topo, 2)
        deadline = time.monotonic() + 120
        while "listening on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert "listening on" in text, text
        assert "worker 2 (127.0.0.1, capacity 3)" in text  # the start-up log names each participant's host
        url = text.split("listening on ", 1)[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=4)  # fmt: skip
        assert r.model_extra["fusion"]["workers"] == 2 and r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 0
        for w in workers:
            w.wait(timeout=30)  # the server's shutdown reaches every worker
            assert w.returncode == 0, w.stderr.read()
    finally:
        _reap([proc, *workers])

