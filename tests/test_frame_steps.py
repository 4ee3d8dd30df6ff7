"""Numbered frames (comm/links.py's header, comm/comm.py "Numbered steps"): every frame carries the
sender's (epoch, step), and a data frame of another epoch or step reaching a real Link over loopback
is PeerOutOfStep naming its sender, before any of its payload is read as data; the client and a
worker count the same command words and so agree on the step without a word more."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from fusion_compute.audit import schema as S
from fusion_compute.comm import Comm, PeerError, PeerOutOfStep
from fusion_compute.comm.links import HEADER, Link, frame_header, wire_bytes


def tcp() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback TCP sockets (a Link tunes TCP options, so not a socketpair)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    return ours, theirs


def receiving(raw: bytes, epoch: int = 3, step: int = 7) -> tuple[Link, socket.socket]:
    """A Link of rank 0 in (epoch, step) whose peer, worker 2, has sent `raw` by hand."""
    a, b = tcp()
    link = Link(a, None, 2, "worker 2")
    link.epoch, link.step = epoch, step
    b.sendall(raw)
    return link, b


PAYLOAD = torch.arange(4, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize(
    "epoch, step",
    [(3, 6), (3, 8), (2, 7), (4, 7), (0, 0)],
    ids=["previous-step", "next-step", "previous-epoch", "next-epoch", "unnumbered"],
)
def test_a_frame_of_another_step_or_epoch_names_its_sender(epoch, step):
    link, b = receiving(frame_header(len(PAYLOAD), epoch, step) + PAYLOAD)
    out = bytearray(len(PAYLOAD))
    try:
        with pytest.raises(PeerOutOfStep) as e:
            link.recv_into(memoryview(out), time.monotonic() + 2, "L0.qkv")
    finally:
        link.close()
        b.close()
    assert e.value.rank == 2 and not e.value.watched  # first-hand evidence against the sender (blame)
    assert isinstance(e.value, PeerError)
    assert (e.value.expected, e.value.got) == ((3, 7), (epoch, step))
    assert str(e.value) == (
        f"worker 2 sent a frame of epoch {epoch} step {step} where epoch 3 step 7 was expected: out of step"
    )
    assert out == bytearray(len(PAYLOAD))  # nothing of it was read as data


def test_a_frame_of_this_step_is_read_as_data():
    """The negative control: the same hand-built frame, stamped with the receiver's (epoch, step)."""
    link, b = receiving(frame_header(len(PAYLOAD), 3, 7) + PAYLOAD)
    out = bytearray(len(PAYLOAD))
    try:
        link.recv_into(memoryview(out), time.monotonic() + 2, "L0.qkv")
    finally:
        link.close()
        b.close()
    assert bytes(out) == PAYLOAD


@pytest.mark.parametrize("lane, flags", [(1, 0), (0, 1)])
def test_a_frame_of_an_unknown_lane_or_flag_is_malformed(lane, flags):
    """Lanes and flags are reserved (0): a frame using them is a malformed header, not data."""
    link, b = receiving(frame_header(len(PAYLOAD), 3, 7, lane, flags) + PAYLOAD)
    try:
        with pytest.raises(PeerError, match="malformed message header") as e:
            link.recv_size(time.monotonic() + 2)
    finally:
        link.close()
        b.close()
    assert not isinstance(e.value, PeerOutOfStep)


def test_a_stale_frame_between_two_good_ones_is_caught_at_the_stale_one():
    """A frame of the previous step, re-sent after a good one (a replayed or late message): the good
    one is read, the stale one refused (the size check alone would let it through: same length)."""
    good = frame_header(len(PAYLOAD), 3, 7) + PAYLOAD
    stale = frame_header(len(PAYLOAD), 3, 6) + PAYLOAD
    link, b = receiving(good + stale)
    out = bytearray(len(PAYLOAD))
    try:
        link.recv_into(memoryview(out), time.monotonic() + 2)
        with pytest.raises(PeerOutOfStep):
            link.recv_into(memoryview(out), time.monotonic() + 2)
    finally:
        link.close()
        b.close()


def test_client_and_worker_count_the_same_steps():
    """The client starts a step before each command word; the worker starts one as it receives one
    (recv(new_step=True)): they agree on every step's number with no word more, data flows in both
    directions stamped with it, and each event records it."""
    a, b = tcp()
    events: list = []

    class Keep:
        def record(self, event) -> None:
            events.append(event)

    client = Comm(0, 1, {1: Link(a, None, 1, "worker 1")}, timeout_s=5, epoch=4)
    worker = Comm(1, 1, {0: Link(b, None, 0, "the client")}, timeout_s=5, epoch=4, recorder=Keep())
    try:
        for k in range(1, 4):
            assert client.begin_step() == k
            client.send(torch.tensor([k, 0, 0, 0]), 1, "control", "cmd")
            word = worker.recv(torch.zeros(4, dtype=torch.int64), 0, "control", "cmd", new_step=True)
            assert int(word[0]) == k and worker.step == k
            worker.send(torch.full((3,), float(k)), 0, "egress", "final")
            assert client.recv(torch.zeros(3), 1, "egress", "final").tolist() == [k] * 3
        assert [e.step for e in events] == [1, 1, 2, 2, 3, 3]
        # a worker that missed a command (or the client that sent one twice) is out of step at once:
        client.send(torch.tensor([9, 0, 0, 0]), 1, "control", "cmd")  # no begin_step: step 3 again
        with pytest.raises(PeerOutOfStep) as e:
            worker.recv(torch.zeros(4, dtype=torch.int64), 0, "control", "cmd", new_step=True)
        assert e.value.rank == 0 and (e.value.expected, e.value.got) == ((4, 4), (4, 3))
    finally:
        client.close(0.5)
        worker.close(0.5)


def test_the_header_and_the_audit_wire_model_agree():
    """The verifier restates the framing (schema.message_bytes) rather than importing it: both
    count the same header, at every size around the TLS record boundary."""
    assert HEADER.size == S.FRAME_HEADER == 20
    for p in (0, 1, 32, 16384 - 20, 16384 - 19, 16384, 3 * 16384 + 5):
        assert wire_bytes(p, True) == S.message_bytes(p, "tls")
        assert wire_bytes(p, False) == S.message_bytes(p, "tcp")


# ---- a worker that sends a stale frame (the fault stale-rs, runtime/faults.py) ----


@pytest.mark.parametrize("liar", [1, 3])
def test_a_stale_block_in_a_reduce_scatter_names_its_sender(liar):
    """Three workers' reduce-scatter in step 5; the liar's block for its victim (the lowest other
    rank) carries step 4, the right size: the victim refuses it, naming the liar first-hand, and the
    third worker's sum is the honest one. Without the fault, the same exchange sums right."""
    from test_poisoned_partials import _close, _mesh, _run_all

    from fusion_compute.runtime.faults import comm_fault, parse_fault

    ranks = [1, 2, 3]
    partial = {r: torch.full((6, 2), float(r)) for r in ranks}  # rows 2 per owner; the sum is 1 + 2 + 3
    for fault in (None, "stale-rs@1"):
        links = _mesh(ranks)
        comms = {r: Comm(r, 3, links[r], timeout_s=10, epoch=2) for r in ranks}
        for c in comms.values():
            for _ in range(5):
                c.begin_step()
        if fault is not None:
            comms[liar] = comm_fault(parse_fault(fault))(comms[liar])
        got = _run_all(
            comms, lambda c: c.reduce_scatter_from(lambda q: partial[c.rank][2 * q : 2 * q + 2], [2] * 3, "o")
        )
        _close(comms)
        if fault is None:
            assert all(torch.equal(got[r], torch.full((2, 2), 6.0)) for r in ranks), got
            continue
        victim = 2 if liar == 1 else 1
        err = got[victim]
        assert isinstance(err, PeerOutOfStep) and err.rank == liar and err.got == (2, 4), got
        third = next(r for r in ranks if r not in (liar, victim))
        assert torch.equal(got[third], torch.full((2, 2), 6.0)), got


@pytest.mark.slow
def test_a_worker_sending_a_stale_frame_is_named_and_the_job_recovers(tiny_qwen2):
    """A real job, three workers and a standby: worker 3 sends its victim (worker 1) a block stamped
    with the previous step at the 6th step. The victim refuses it (PeerOutOfStep) and leaves naming
    worker 3; the request completes with the tokens of the run without the fault, nobody removed."""
    from test_hostile_blame import reference
    from test_poisoned_partials import three_and_a_standby
    from test_slow_steps import run
    from tiny_models import STEP_RS

    from fusion_compute.structural.client import Engine

    want = reference(tiny_qwen2, 3)
    with Engine(tiny_qwen2, three_and_a_standby(3, f"stale-rs@{STEP_RS * 5 + 2}")) as eng:
        res = run(eng)
        assert res.token_ids == want
        states = {w["id"]: w["state"] for w in eng.workers()}
        assert "removed" not in states.values(), states
        aside = [r for r in res.recoveries if r.get("set_aside")]
        assert aside and 3 in aside[0]["set_aside"], res.recoveries
        assert "worker 1 left naming worker 3" in aside[0]["reason"], aside[0]
