"""Topology files with pinned keys: parsing and checks, and multi-host runs on one machine (loopback)
where the client and every worker are separately started processes that take their roles from the
same file and their identities from their own key files."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from procs import LOG_LINE, fusion, reap, run
from test_serve import build_chat_model

from fusion_compute.comm import Identity, free_port
from fusion_compute.runtime.topology import Topology, TopologyError, check_here, is_local_address


def keys(n: int) -> list[Identity]:
    return [Identity.new() for _ in range(n)]


def topo_text(ids: list[Identity], hosts: list[str], caps=None, groups=None, model=None, port=None) -> str:
    """ids[0] is the client's; ids[1:] the workers'."""
    text = f'model = "{model}"\n' if model else ""
    text += f'[client]\naddress = "127.0.0.1:{port or free_port()}"\nkey = "{ids[0].public.line()}"\n'
    for i, (ident, host) in enumerate(zip(ids[1:], hosts, strict=True)):
        text += f'[[worker]]\naddress = "{host}"\nkey = "{ident.public.line()}"\n'
        if caps:
            text += f"capacity = {caps[i]}\n"
        if groups:
            text += f'group = "{groups[i]}"\n'
    return text


def write_keys(d: Path, ids: list[Identity]) -> list[Path]:
    paths = []
    for i, ident in enumerate(ids):
        p = d / f"p{i}.key"
        p.unlink(missing_ok=True)
        ident.save(p)
        paths.append(p)
    return paths


def test_parse_good(tmp_path):
    ids = keys(3)
    f = tmp_path / "t.toml"
    f.write_text(topo_text(ids, ["127.0.0.1", "localhost"], caps=[2, 1], model="/models/m.gguf"))
    t = Topology.load(f)
    assert t.n_workers == 2 and t.capacities == (2.0, 1.0) and t.model_for(2) == "/models/m.gguf"
    assert t.by_key(ids[2].public).rank == 2 and t.by_key(ids[0].public).rank == 0
    assert t.by_key(Identity.new().public) is None
    t.require_keys()


def test_masked_groups_rank_a_first(tmp_path):
    ids = keys(4)
    f = tmp_path / "t.toml"
    f.write_text(topo_text(ids, ["127.0.0.1"] * 3, groups=["B", "A", "B"]))
    t = Topology.load(f)
    assert t.masked and t.groups == (1, 2)
    assert [w.group for w in t.workers] == ["A", "B", "B"] and t.by_key(ids[2].public).rank == 1


A_KEY = Identity.new().public.line()
B_KEY = Identity.new().public.line()
BAD = [
    ("", "missing [client]"),
    ("[client]\naddress = '127.0.0.1'\n[[worker]]\naddress = 'a'\n", "HOST:PORT"),
    ("[client]\naddress = '127.0.0.1:70000'\n[[worker]]\naddress = 'a'\n", "HOST:PORT"),
    ("[client]\naddress = '127.0.0.1:1234'\n", "no workers"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\ncapacity = 1\n", "address"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a:99'\n", "host only"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\ncapacity = 0\n", "positive"),
    ("[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\ncapasity = 1\n", "unknown key 'capasity'"),
    (
        "[client]\naddress = '127.0.0.1:1234'\n[[worker]]\naddress = 'a'\nname = 'x'\n[[worker]]\naddress = 'b'\n"
        "name = 'x'\n",
        "duplicate name",
    ),
    ("workers = 3\n", "unknown key 'workers'"),
    ("[client\n", "not valid TOML"),
    ("[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\nkey = 'abc'\n", "not a Fusion public key"),
    ("[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\nkey = 'fc1.AAAA'\n", "not a certificate"),
    (
        f"[client]\naddress = '127.0.0.1:1'\nkey = '{A_KEY}'\n[[worker]]\naddress = 'a'\nkey = '{A_KEY}'\n",
        "duplicate key",
    ),
    (f"[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\nkey = '{A_KEY[:-8]}'\n", "not a certificate"),
    ("[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\ngroup = 'C'\n", 'group must be "A", "B"'),
    (
        "[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\ngroup = 'A'\n[[worker]]\naddress = 'b'\n",
        "either every worker has a group",
    ),
    ("[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\ngroup = 'A'\n", "one mask group B"),
    (
        "[client]\naddress = '127.0.0.1:1'\n[[worker]]\naddress = 'a'\ngroup = 'A'\n[[worker]]\naddress = 'b'\n"
        "group = 'B2'\n",
        "mask groups B1..Bk",
    ),
]


@pytest.mark.parametrize("text,needle", BAD, ids=[b[1] for b in BAD])
def test_parse_bad(tmp_path, text, needle):
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(TopologyError, match=needle.replace("[", r"\[")):
        Topology.load(f)


def test_missing_file_and_missing_keys(tmp_path):
    with pytest.raises(TopologyError, match="not found"):
        Topology.load(tmp_path / "missing.toml")
    f = tmp_path / "t.toml"
    f.write_text(f"[client]\naddress = '127.0.0.1:1'\nkey = '{B_KEY}'\n[[worker]]\naddress = 'a'\n")
    with pytest.raises(TopologyError, match="worker 1 has no key"):
        Topology.load(f).require_keys()


def test_this_machine():
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.1")  # TEST-NET-1: nobody's
    t = Topology.from_dict({"client": {"address": "127.0.0.1:1"}, "worker": [{"address": "192.0.2.1"}]})
    check_here(t.client)
    with pytest.raises(TopologyError, match="not an address of this machine"):
        check_here(t.workers[0])


def test_keys_command(tmp_path, capsys):
    """`fusion keys new` as a user runs it (a process: the key line alone on stdout); the rest through
    the same `main` in this process (each `fusion` process costs a Python start-up)."""
    from fusion_compute.cli.main import main

    r = run("keys", "new", str(tmp_path / "w.key"))
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith("fc1.") and len(line.splitlines()) == 1
    assert (tmp_path / "w.key").stat().st_mode & 0o777 == 0o600
    assert main(["keys", "show", str(tmp_path / "w.key")]) == 0
    assert capsys.readouterr().out.strip() == line
    (tmp_path / "junk.key").write_text("hello\n")
    for args, needle in (
        (["new", str(tmp_path / "w.key")], "refusing to overwrite"),  # never overwrites a key
        (["show", str(tmp_path / "junk.key")], "not a Fusion key file"),
        (["show", str(tmp_path / "none.key")], "key file not found"),
    ):
        assert main(["keys", *args]) != 0
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (args, err)


def test_cli_topology_errors_one_line(tmp_path, capsys):
    from fusion_compute.cli.main import main

    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    good = tmp_path / "t.toml"
    good.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"]))
    away = tmp_path / "away.toml"
    away.write_text(topo_text(ids, ["192.0.2.1", "127.0.0.1"]))
    stranger = tmp_path / "stranger.key"
    Identity.new().save(stranger)
    cases = [
        (["worker", "--topology", str(good)], "give --key FILE"),
        (["worker", "--topology", str(good), "--key", str(stranger)], "is not one of"),
        (["worker", "--topology", str(good), "--key", str(kf[0])], "is not one of"),  # the client's key
        (["worker", "--topology", str(away), "--key", str(kf[1])], "not an address of this machine"),
        (["worker", "--topology", str(good), "--key", str(tmp_path / "none.key")], "key file not found"),
        (["worker", "--master", "127.0.0.1:9"], "give --key FILE and --client-key"),
        (["worker", "--master", "127.0.0.1:9", "--key", str(kf[1]), "--client-key", "fc1.xyz"], "--client-key"),
        (["worker", "--rank", "1"], "give --master"),
        (["generate", "--topology", str(good), "--workers", "3", "--prompt-ids", "1"], "drop --workers"),
        (["generate", "--topology", str(tmp_path / "nope.toml"), "--prompt-ids", "1"], "not found"),
        (["generate", "--topology", str(good), "--prompt-ids", "1"], "needs the client's key"),
        (["generate", "--topology", str(good), "--key", str(kf[1]), "--prompt-ids", "1"], "not the client's key"),
        (
            ["generate", "--topology", str(good), "--mode", "masked", "--key", str(kf[0]), "--prompt-ids", "1"],
            "names no groups",
        ),
    ]
    for args, needle in cases:
        assert main(args) != 0
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (args, err)


def _workers(topo: Path, key_files: list[Path]) -> list:
    return [
        fusion("worker", "--topology", str(topo), "--key", str(k), "--threads", "1", "--timeout", "60")
        for k in key_files
    ]


@pytest.mark.slow
def test_generate_with_topology_and_separate_workers(tiny_qwen2, tmp_path):
    from fusion_compute.structural.plan import make_plan
    from fusion_compute.weights.loader import open_weights

    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"], caps=[2, 1], model=tiny_qwen2))
    prompt = "5,17,33,2,99"
    client = fusion(
        "generate",
        "--topology",
        str(topo),
        "--key",
        str(kf[0]),
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        "8",
        "--json",
        "--timeout",
        "60",
    )
    workers = _workers(topo, kf[1:])
    try:
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        # stderr not a terminal: no bars, no control codes, only timestamped log lines (cli/logs.py)
        assert err and "\x1b" not in err and all(LOG_LINE.match(ln) for ln in err.splitlines()), err
        for w in workers:
            w.wait(timeout=30)
            said = w.stderr.read()
            assert w.returncode == 0, said
            assert "\x1b" not in said and all(LOG_LINE.match(ln) for ln in said.splitlines()), said
    finally:
        reap([client, *workers])
    res = json.loads(out)
    assert res["workers"] == 2 and len(res["token_ids"]) == 8 and res["comm_backend"] == "tls"
    assert res["engine"] == "tls"  # the old key, kept for scripts that read it
    # The file's capacities made the plan (client and workers agreed on it at the handshake).
    assert res["plan"] == make_plan(open_weights(tiny_qwen2).config, 2, (2.0, 1.0)).fingerprint()
    # The same tokens as a local run: separately started, keyed workers change nothing but who joins.
    local = json.loads(
        run(
            "generate",
            "--model",
            str(tiny_qwen2),
            "--capacity",
            "2,1",
            "--prompt-ids",
            prompt,
            "--max-new-tokens",
            "8",
            "--json",
        ).stdout
    )
    assert res["token_ids"] == local["token_ids"]


@pytest.mark.slow
def test_masked_run_with_topology_groups(tiny_qwen2, tmp_path):
    ids = keys(4)
    kf = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1"] * 3, groups=["A", "B", "A"], model=tiny_qwen2))
    # --join-timeout below the test's own bound: a worker that never joins makes the client say why
    client = fusion(
        "generate",
        "--mode",
        "masked",
        "--topology",
        str(topo),
        "--key",
        str(kf[0]),
        "--prompt-ids",
        "5,17,33",
        "--max-new-tokens",
        "6",
        "--json",
        "--timeout",
        "60",
        "--join-timeout",
        "60",
    )
    workers = _workers(topo, kf[1:])
    out = err = ""
    try:
        out, err = client.communicate(timeout=120)
        for w in workers:
            w.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reap([client, *workers])
        out, err = client.communicate()  # what it had said by then
    finally:
        reap([client, *workers])
    said = [w.stderr.read() for w in workers]  # one failed run (CI, once) left no trace: now it does
    assert client.returncode == 0, (err, said)
    assert [w.returncode for w in workers] == [0] * len(workers), said
    res = json.loads(out)
    assert res["mode"] == "masked" and res["groups"] == [2, 1]
    local = json.loads(
        run(
            "generate",
            "--model",
            str(tiny_qwen2),
            "--mode",
            "masked",
            "--workers",
            "2+1",
            "--prompt-ids",
            "5,17,33",
            "--max-new-tokens",
            "6",
            "--json",
        ).stdout
    )
    assert res["token_ids"] == local["token_ids"]


@pytest.mark.slow
def test_serve_with_topology_and_separate_workers(tmp_path):
    import openai

    model = build_chat_model(tmp_path / "model")
    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"], caps=[1, 3], model=model))
    workers: list = []
    log = tmp_path / "serve.log"
    proc = fusion(
        "serve",
        "--topology",
        str(topo),
        "--key",
        str(kf[0]),
        "--port",
        "0",
        "--timeout",
        "60",
        stdout=None,
        stderr=open(log, "w"),
    )
    try:
        workers = _workers(topo, kf[1:])
        deadline = time.monotonic() + 120
        while "listening on" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text()
        assert "listening on" in text, text
        # the start-up log names each participant's host and key
        assert f"worker 2 (127.0.0.1, key {ids[2].public.fingerprint}, capacity 3)" in text, text
        url = text.split("listening on ", 1)[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(
            model=c.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r.model_extra["fusion"]["workers"] == 2 and r.usage.completion_tokens >= 1
        reap([proc], grace_s=30)
        assert proc.returncode == 0
        for w in workers:
            w.wait(timeout=30)  # the server's shutdown reaches every worker
            assert w.returncode == 0, w.stderr.read()
    finally:
        reap([proc, *workers])


@pytest.mark.slow
def test_hostile_input_files_refused_in_one_line(tmp_path, capsys):
    """Issue 26: `--topology /dev/zero` and `--key /dev/zero` read until MemoryError, a FIFO topology
    waited for a writer for ever, and a key file a megabyte long was read whole. Now a topology or
    key file must be a regular file within its bound (MAX_TOPOLOGY_FILE, MAX_KEY_FILE): one line,
    exit 2 (the command line names something that cannot work), nothing read beyond the bound."""
    import os

    from fusion_compute.cli.main import main
    from fusion_compute.comm.identity import MAX_KEY_FILE
    from fusion_compute.runtime.topology import MAX_TOPOLOGY_FILE

    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    good = tmp_path / "t.toml"
    good.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"]))
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    big_topo = tmp_path / "big.toml"
    big_topo.write_text(good.read_text() + "#" * MAX_TOPOLOGY_FILE + "\n")
    big_key = tmp_path / "big.key"
    big_key.write_bytes(kf[1].read_bytes() + b"\n" * MAX_KEY_FILE)
    big_key.chmod(0o600)
    cases = [
        (["generate", "--topology", "/dev/zero", "--prompt-ids", "1"], "not a regular file"),
        (["generate", "--topology", str(fifo), "--prompt-ids", "1"], "not a regular file"),
        (["generate", "--topology", str(tmp_path), "--prompt-ids", "1"], "is a directory"),
        (["generate", "--topology", str(big_topo), "--prompt-ids", "1"], f"more than the {MAX_TOPOLOGY_FILE}"),
        (["worker", "--topology", str(good), "--key", "/dev/zero"], "not a regular file"),
        (["worker", "--topology", str(good), "--key", str(big_key)], f"more than the {MAX_KEY_FILE}"),
        (["keys", "show", "/dev/zero"], "not a regular file"),
    ]
    for args, needle in cases:
        t0 = time.monotonic()
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (args, err)
        assert time.monotonic() - t0 < 10, args
    assert Topology.load(good).n_workers == 2  # the bound leaves an ordinary file alone
    with open("/dev/zero", "rb") as zero:  # --key - (how a local client hands a worker its key) is bounded too
        r = run("worker", "--topology", str(good), "--key", "-", stdin=zero, timeout=60)
    assert r.returncode == 2 and f"key on stdin: more than the {MAX_KEY_FILE} bytes" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_key_lines_are_strict_base64url(tmp_path):
    """Issue 26: base64's decoder skipped characters outside its alphabet, so `$$$$` inside a line
    (or a line with other trailing bits) named the same key. Now only the exact line is accepted."""
    from fusion_compute.comm import IdentityError, PublicId

    line = Identity.new().public.line()
    assert PublicId.parse(line).line() == line
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = line[:-1] + alphabet[alphabet.index(line[-1]) ^ 1]  # the last character's unused low bit set
    assert _same_bytes(twin, line)  # what the lenient decoder read as the same key
    for bad in (line[:40] + "$$$$" + line[40:], line[:40] + " " + line[40:], line + "=", line + "==", twin):
        with pytest.raises(IdentityError, match="not valid base64url"):
            PublicId.parse(bad)
    f = tmp_path / "t.toml"
    f.write_text(topo_text(keys(3), ["127.0.0.1", "127.0.0.1"]).replace('key = "fc1.', 'key = "fc1.$$$$', 1))
    with pytest.raises(TopologyError, match="not valid base64url"):
        Topology.load(f)


def _same_bytes(a: str, b: str) -> bool:
    """Two fc1. lines that the lenient decoder reads as the same bytes."""
    import base64

    def dec(s: str) -> bytes:
        raw = s[4:]
        return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4))

    try:
        return dec(a) == dec(b)
    except ValueError:
        return False


def test_a_key_file_others_can_read_is_warned_about(tmp_path, capsys):
    from fusion_compute.cli.main import main

    path = write_keys(tmp_path, keys(1))[0]
    line = Identity.load(path).public.line()
    capsys.readouterr()
    for mode, warning in [
        (0o600, None),
        (0o400, None),
        (0o640, "readable by its group"),
        (0o644, "readable by others"),
        (0o604, "readable by others"),
    ]:
        path.chmod(mode)
        assert main(["keys", "show", str(path)]) == 0
        out, err = capsys.readouterr()
        assert out.strip() == line  # the key still loads: a warning, not a refusal
        if warning is None:
            assert err == "", (oct(mode), err)
        else:
            assert warning in err and f"mode {mode:03o}" in err and "chmod 600" in err and len(err.splitlines()) == 1, (
                err
            )
