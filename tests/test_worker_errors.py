"""A worker's own error reaches the user (issue 35): when a worker fails, the client's error line, its
recovery record and `/health` carry what the worker itself said, not only "closed the connection".

Two ways it travels. A worker that fails for a reason of its own says it on its links as it leaves
(comm/links.py's farewell frame: on the epoch's data links, and on its pulse link when its process
ends), which reaches a client anywhere. A local worker's output also goes to a file the client reads
the tail of (runtime/launch.py). The failures are composed into the real `fusion worker`
(runtime/faults.py): `fail-hello` fails the plan handshake with an error the worker survives, as the
NCCL fabric does on a machine without CUDA; `fail@K` raises at its K-th forward and the process exits.
"""

from __future__ import annotations

import re
import socket
import tempfile
import time

import pytest
from procs import LOG_LINE, fusion, reap
from test_faults import NEW, run, structural
from test_topology import keys, topo_text, write_keys

from fusion_compute.comm import CommError, PeerLost
from fusion_compute.comm.links import MAX_FAREWELL, Link
from fusion_compute.runtime.launch import LOG_TAIL, last_words_of
from fusion_compute.runtime.membership import TooFewWorkers

HELLO_FAILS = "fault fail-hello: this worker cannot honour its setup here"


def tcp_pair() -> tuple[Link, Link]:
    """A plain (tcp backend) link pair on loopback: worker 1's end and the client's (a link's label
    names its peer)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Link(a, None, 0, "client"), Link(b, None, 1, "worker 1")


def test_a_farewell_travels_with_the_close_and_stays():
    """The frame itself, on plain links: the reason arrives as the PeerLost's `said`, cut to one line
    of at most MAX_FAREWELL bytes, and every later read of the link repeats it."""
    left, right = tcp_pair()
    try:
        left.send(memoryview(b"data"))
        left.farewell("the NCCL fabric needs CUDA\nsecond line " + "x" * 2000, time.monotonic() + 1)
        left.close()
        assert right.recv_bytes(time.monotonic() + 1, 16) == b"data"  # what came before it is delivered
        for _ in range(2):
            with pytest.raises(PeerLost, match=r"^worker 1 closed the connection: the NCCL fabric needs CUDA$") as e:
                right.recv_bytes(time.monotonic() + 1, 16)
            assert e.value.said == "the NCCL fabric needs CUDA"
    finally:
        right.close()
    left, right = tcp_pair()
    left.farewell("é" * 1000, time.monotonic() + 1)  # cut inside no character
    with pytest.raises(PeerLost) as e:
        right.recv_bytes(time.monotonic() + 1, 16)
    # whole characters, as many as fit the frame with its JSON (links.farewell_reason): 2 bytes each
    assert e.value.said == "é" * len(e.value.said) and MAX_FAREWELL // 2 - 40 <= len(e.value.said) <= MAX_FAREWELL // 2
    left.close()
    right.close()


def test_a_closed_link_without_a_farewell_says_so_as_before():
    left, right = tcp_pair()
    left.close()
    with pytest.raises(PeerLost, match=r"^worker 1 closed the connection$") as e:
        right.recv_bytes(time.monotonic() + 1, 16)
    assert e.value.said is None
    right.close()


def test_last_words_read_only_the_logs_tail():
    """A worker's output file can grow without bound (a chatty worker under a long job): the client
    reads its last LOG_TAIL bytes only, and still finds the worker's own error line there."""
    with tempfile.TemporaryFile() as log:
        log.write(b"noise line\n" * (LOG_TAIL // 4) + b"fusion worker: error: out of memory\nexit\n")
        log.flush()
        assert last_words_of(log, 1) == "fusion worker: error: out of memory"
        assert log.tell() == log.seek(0, 2)  # where the worker writes next: unmoved
    with tempfile.TemporaryFile() as log:
        assert last_words_of(log, 3) == "exit code 3"


@pytest.mark.slow
def test_a_start_up_failure_is_told_in_the_workers_words(tiny_qwen2):
    """The worker survives its own failure (it waits for the client's next word, as with the NCCL
    fabric and no CUDA): no process exit to read, yet the client's error says why."""
    with pytest.raises(CommError, match=rf"worker 2 \[.*\] closed the connection: {HELLO_FAILS}$"):
        structural(tiny_qwen2, args_for_worker={2: ("--inject-fault", "fail-hello@1")})


@pytest.mark.slow
def test_a_failure_mid_run_is_in_the_recovery_record_and_the_error(tiny_qwen2):
    with structural(tiny_qwen2, standby=1, args_for_worker={2: ("--inject-fault", "fail@5")}) as eng:
        res = run(eng)
        assert len(res.token_ids) == NEW and res.recoveries[0]["lost"] == [2]
        assert "fault fail@5: this worker's own error at its forward" in res.recoveries[0]["reason"]
    with structural(tiny_qwen2, args_for_worker={1: ("--inject-fault", "fail@5")}) as eng:
        with pytest.raises(
            TooFewWorkers, match=r"worker 1 (\[.*\] )?exited: .*RuntimeError: fault fail@5: this worker's own"
        ):
            run(eng)


@pytest.mark.slow
def test_a_failure_mid_run_that_the_worker_survives_is_in_the_record(tiny_qwen2):
    """No process exit and no closed pulse: only the farewell on its data links says why (as a
    fabric that breaks mid-run). The client reads it, or its peer's account of it, and the record
    of the recovery carries the worker's words."""
    with structural(tiny_qwen2, standby=1, args_for_worker={2: ("--inject-fault", "fail-alive@5")}) as eng:
        res = run(eng)
        assert len(res.token_ids) == NEW and res.recoveries[0]["lost"] == [2], res.recoveries
        assert "fault fail-alive@5: this worker's fabric failed at its forward" in res.recoveries[0]["reason"]


@pytest.mark.slow
def test_a_fresh_worker_process_is_heard_the_same_way(tiny_qwen2, real_workers):
    """The suite forks its workers from a fork server (tests/forkserver.py); a user's are fresh
    `python -m fusion_compute worker` processes (launch.popen_worker): the same words reach the client,
    read from its output once its process has exited, or, when the client looks first, from the
    farewell on its pulse link ("worker 2 [address, key] exited: ...")."""
    with structural(tiny_qwen2, args_for_worker={2: ("--inject-fault", "fail@2")}) as eng:
        with pytest.raises(
            TooFewWorkers, match=r"worker 2 (\[.*\] )?exited: .*RuntimeError: fault fail@2: this worker's own"
        ):
            run(eng)


def _topology_run(tmp_path, tiny, fault: str) -> tuple[int, str]:
    """`fusion generate --topology` with two hand-started workers, the second with `fault`: the
    client's exit code and stderr."""
    ids = keys(3)
    kf = write_keys(tmp_path, ids)
    topo = tmp_path / "t.toml"
    topo.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"], model=tiny))
    client = fusion(
        "generate", "--topology", str(topo), "--key", str(kf[0]), "--prompt-ids", "5,17,33",
        "--max-new-tokens", "8", "--timeout", "30", "--liveness", "2",
    )  # fmt: skip
    workers = [
        fusion("worker", "--topology", str(topo), "--key", str(k), "--threads", "1", "--timeout", "30", *extra)
        for k, extra in zip(kf[1:], [(), ("--inject-fault", fault)], strict=True)
    ]
    try:
        _, err = client.communicate(timeout=120)
        return client.returncode, err
    finally:
        reap([client, *workers])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("fail-hello@1", rf"worker 2 \[.*\] closed the connection: {HELLO_FAILS}"),
        ("fail@3", r"worker \[2\] lost \(worker 2 \[.*\] exited: RuntimeError: fault fail@3: this worker's own"),
    ],
)
def test_a_remote_workers_own_error_reaches_the_client(tiny_qwen2, tmp_path, fault, said):
    """Hand-started workers: nothing of theirs is on the client's machine but their links. At start-up
    the farewell comes on the data link; mid-run the process exits and says why on its pulse link."""
    code, err = _topology_run(tmp_path, tiny_qwen2, fault)
    assert code == 1, err
    lines = [ln for ln in err.strip().splitlines() if not LOG_LINE.match(ln)]  # (its timestamped log aside)
    assert len(lines) == 1 and lines[0].startswith("fusion generate: error: "), err
    assert re.search(said, lines[0]), lines[0]


def test_a_pulse_farewell_is_the_watchs_reason():
    """What `/health` and the recovery record read for a remote worker that left (Watch.failed): the
    reason it gave on its pulse link as its process ended, not only that the connection closed."""
    from fusion_compute.comm import Pulse, Watch

    worker_end, client_end = tcp_pair()
    watch = Watch(deadline_s=30)
    pulse = Pulse(worker_end, lambda word: None, lambda: None, interval_s=0.1)
    try:
        watch.add(1, client_end)
        pulse.close("RuntimeError: CUDA out of memory")
        deadline = time.monotonic() + 10
        while not watch.failed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.failed() == {1: "worker 1 exited: RuntimeError: CUDA out of memory"}
    finally:
        watch.close()


def test_the_watch_stops_reading_a_pulse_link_that_failed(monkeypatch):
    """A worker's pulse link that closed stays readable (at its end): the watch records the failure
    once and reads it no more, instead of polling it again and again (a whole core, until the rank is
    forgotten: every job's close spent 0.18 s of CPU so); a new link for the rank is watched again."""
    from fusion_compute.comm import Pulse, Watch, liveness

    reads: list[Link] = []
    recv = liveness._recv

    def counted(link, timeout_s):
        reads.append(link)
        return recv(link, timeout_s)

    monkeypatch.setattr(liveness, "_recv", counted)
    worker_end, client_end = tcp_pair()
    watch = Watch(deadline_s=30)
    try:
        watch.add(1, client_end)
        worker_end.close()  # gone without a word
        deadline = time.monotonic() + 10
        while not watch.failed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "exited: its connection closed" in watch.failed()[1]
        time.sleep(0.5)  # five of the watch's 0.1 s polls
        assert reads.count(client_end) == 1
        # the rank rejoins on a new link: watched again, its beats read
        worker_end, client_end = tcp_pair()
        pulse = Pulse(worker_end, lambda word: None, lambda: None, interval_s=0.05)
        watch.add(1, client_end)
        deadline = time.monotonic() + 10
        while reads.count(client_end) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reads.count(client_end) >= 2 and watch.failed() == {}
        pulse.close()
    finally:
        watch.close()


def test_no_pulse_message_stops_the_watch():
    """A worker that sends 60,000 "[" on its pulse link (json's decoder recurses per level: a
    RecursionError, not a ValueError) is failed for it, and the watch goes on: another worker's
    closed link is still noticed. The thread used to die there, and no failure was recorded again."""
    from fusion_compute.comm import Watch

    liar_end, liar_client = tcp_pair()
    honest_end, honest_client = tcp_pair()
    watch = Watch(deadline_s=30)
    try:
        watch.add(1, liar_client)
        watch.add(2, honest_client)
        liar_end.send(memoryview(b"[" * 60000))
        liar_end.flush(time.monotonic() + 5)
        deadline = time.monotonic() + 10
        while 1 not in watch.failed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "nested too deep" in watch.failed()[1]
        honest_end.close()
        while 2 not in watch.failed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "exited: its connection closed" in watch.failed().get(2, "")
    finally:
        watch.close()
        liar_end.close()


def test_a_read_cut_by_the_ranks_rejoining_fails_nobody():
    """The watch is in the middle of reading a worker's pulse message (half a frame header sent) when
    the worker rejoins on a new link (`add` closes the old one): the failed read is the old link's,
    not news about the worker now beating on the new one."""
    from fusion_compute.comm import Pulse, Watch

    old_end, old_client = tcp_pair()
    watch = Watch(deadline_s=30)
    pulse = None
    try:
        watch.add(1, old_client)
        old_end.sock.sendall(b"\x00\x00")  # a frame header's first bytes: the watch waits for the rest
        time.sleep(0.3)
        new_end, new_client = tcp_pair()
        pulse = Pulse(new_end, lambda word: None, lambda: None, interval_s=0.05)
        watch.add(1, new_client)
        time.sleep(0.5)
        assert watch.failed() == {}
    finally:
        if pulse is not None:
            pulse.close()
        watch.close()
        old_end.close()


@pytest.mark.slow
def test_health_of_a_served_job_says_the_workers_own_words(tmp_path):
    """`fusion serve`'s path: the request that lost the worker gets 503 with its words, `/health`
    (Scheduler.health) says degraded with them, and the serve log has them."""
    from test_serve import build_chat_model, completion, run_job

    from fusion_compute.serving.gateway import Gateway, ModelCard
    from fusion_compute.weights.tokenizer import load_tokenizer

    # transformers' default init (std 0.02), not tiny_models' wider one: with it this prompt's reply ends
    # at its end-of-turn token before the faulty forward (fail@3), and the request would not fail.
    chat_model = build_chat_model(tmp_path / "m", initializer_range=0.02, rms_norm_eps=1e-6)
    tok = load_tokenizer(chat_model)
    card = ModelCard(id="tiny", tokenizer=tok, context=128, vocab=tok.vocab_size, eos_ids=tok.eos_ids)
    from fusion_compute.serving.scheduler import Scheduler
    from fusion_compute.structural.client import Engine, EngineOptions

    faulty = {2: ("--inject-fault", "fail@3")}
    opts = EngineOptions(n_workers=2, context=128, timeout_s=30, liveness_s=2.0, args_for_worker=faulty)
    logged: list[str] = []
    scheduler = Scheduler(Gateway(Engine(chat_model, opts), card), log=logged.append)
    try:
        kind, error = run_job(scheduler, completion({"model": "tiny", "prompt": [1, 2], "max_tokens": 8}, card), 60)
        said = "RuntimeError: fault fail@3: this worker's own error at its forward"
        assert (kind, error.status) == ("error", 503) and said in error.message, error.message
        status, why = scheduler.health()
        assert status == "degraded" and said in why, why
        assert any(said in line for line in logged), logged
    finally:
        scheduler.close(wait_s=10)
        scheduler.gateway.engine.close()
