"""The wire's newest guards at their boundaries (issue 47), with hand-built frames on loopback TCP and no
processes: a 2-byte column of any stride goes out as its own bytes; the farewell frame's 512-byte
cap, at the sender (a reason that just fits, one byte over) and at the receiver (exactly 512, just
over, a header announcing a huge one); and a knock-on close says `after`, never `cause`."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from fusion_compute.comm.buffers import raw, words
from fusion_compute.comm.comm import Comm
from fusion_compute.comm.errors import PeerError, PeerLeft, PeerLost, PeerTimeout
from fusion_compute.comm.links import FAREWELL, HEADER, MAX_FAREWELL, MAX_WHY, Link, frame_header, say_farewell


def envelope(cause: int | None = None, after: int | None = None) -> int:
    """Bytes of the JSON a farewell carries around its line: '{"why": "", "cause": null, "after": null}'."""
    return len(json.dumps({"why": "", "cause": cause, "after": after}))


def tcp() -> tuple[socket.socket, socket.socket]:
    """Two connected loopback TCP sockets (a Link tunes TCP options, so not a socketpair)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
    theirs.settimeout(5)
    return ours, theirs


def read_exact(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, "closed early"
        got += chunk
    return got


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """One frame as the far end sees it: its header word and payload (a farewell's: the low bits)."""
    header = HEADER.unpack(read_exact(sock, HEADER.size))[0]  # (length, epoch, step, lane, flags)
    return header, read_exact(sock, header & ~FAREWELL)


# ---- a 2-byte column of any stride ----


def columns(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """(k, 1) columns as the code meets them: a row of a wider tensor turned on its side (contiguous
    to torch, its one column striding by the row's width), a column sliced out of one (not
    contiguous), a broadcast one (stride 0), an ordinary one."""
    g = torch.Generator().manual_seed(47)
    big = torch.randn(5, 7, generator=g).to(dtype)
    return {
        "row-turned": big[2:3].T,
        "sliced": big[:, 3:4],
        "broadcast": big[1, 4].reshape(1, 1).expand(5, 1),
        "ordinary": big[:, 0].clone().reshape(5, 1),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_column_of_any_stride_goes_out_as_its_bytes(dtype):
    """What `raw` hands the link, and what the other end receives, is the column's values in order,
    whatever its strides (a (k, 1) column whose size-1 dimension strides by 7 is contiguous to
    torch, and a bfloat16 view as bytes needs a last stride of 1)."""
    for name, col in columns(dtype).items():
        want = col.flatten().clone()
        assert bytes(raw(col.contiguous())) == want.view(torch.uint8).numpy().tobytes(), name
        if dtype.itemsize == 2:  # MPI's view: the 2-byte words, one per element
            assert words(col.contiguous()).tolist() == want.view(torch.int16).tolist(), name
    a, b = tcp()
    sender = Comm(1, 1, {0: Link(a, None, 0, "the client")}, timeout_s=5)
    receiver = Comm(0, 1, {1: Link(b, None, 1, "worker 1")}, timeout_s=5)
    try:
        for name, col in columns(dtype).items():
            sender.send(col, 0, "egress", "final")
            got = receiver.recv(torch.empty(col.shape, dtype=dtype), 1, "egress", "final")
            assert torch.equal(got, col), name
    finally:
        sender.close()
        receiver.close()


# ---- the farewell's cap: the sender's cut ----


def said_by(reason: str, cause: int | None = None) -> tuple[int, bytes]:
    """What a Link's farewell puts on the wire for `reason`: (header, payload)."""
    a, b = tcp()
    link = Link(a, None, 1, "worker 1")
    try:
        link.farewell(reason, time.monotonic() + 5, cause=cause)
        return read_frame(b)
    finally:
        link.close()
        b.close()


def line(total: int, cause: int | None = None) -> str:
    """A one-line reason of at most MAX_WHY characters whose farewell JSON is `total` bytes: 2-byte
    characters ("é") make up what the character cap leaves."""
    two = total - envelope(cause) - MAX_WHY
    assert 0 < two <= MAX_WHY
    return "é" * two + "a" * (MAX_WHY - two)


def test_a_farewell_of_exactly_512_bytes_goes_out_whole():
    reason = line(MAX_FAREWELL)
    header, payload = said_by(reason)
    assert header == FAREWELL | MAX_FAREWELL and len(payload) == MAX_FAREWELL
    assert json.loads(payload) == {"why": reason, "cause": None, "after": None}  # nothing cut


def test_a_farewell_one_byte_over_is_cut_by_whole_characters_to_fit():
    reason = line(MAX_FAREWELL + 1, cause=3)
    header, payload = said_by(reason, cause=3)
    assert header & FAREWELL and header & ~FAREWELL == len(payload) <= MAX_FAREWELL
    sent = json.loads(payload)  # valid UTF-8 and JSON: cut between characters, not bytes
    assert sent["cause"] == 3 and sent["after"] is None
    assert reason.startswith(sent["why"]) and len(sent["why"]) < len(reason)
    # the cut is close to the cap, not everything: 512 bytes hold well over half the line
    assert len(sent["why"]) > MAX_WHY // 2


def test_a_long_wide_reason_is_bounded_and_its_other_lines_dropped():
    """300 three-byte characters (900 bytes) on the first line, more lines after it."""
    header, payload = said_by("€" * 1000 + "\nsecond line")
    assert len(payload) <= MAX_FAREWELL and header == FAREWELL | len(payload)
    why = json.loads(payload)["why"]
    assert set(why) == {"€"} and len(why) > 100


# ---- the farewell's cap: the receiver's bound ----


def received(frame: bytes, close: bool = False) -> BaseException:
    """The error a Link raises reading `frame` (hand-built bytes from the far end)."""
    a, b = tcp()
    link = Link(a, None, 2, "worker 2")
    try:
        b.sendall(frame)
        if close:
            b.shutdown(socket.SHUT_WR)
        with pytest.raises(PeerError) as e:
            link.recv_size(time.monotonic() + 2)
        return e.value
    finally:
        link.close()
        b.close()


def farewell_json(total: int) -> bytes:
    payload = json.dumps({"why": "x" * (total - envelope(after=3)), "cause": None, "after": 3}).encode()
    assert len(payload) == total
    return payload


def test_the_receiver_reads_a_farewell_of_exactly_512_bytes():
    err = received(frame_header(FAREWELL | MAX_FAREWELL) + farewell_json(MAX_FAREWELL))
    assert isinstance(err, PeerLeft)
    assert err.reason == {"why": "x" * MAX_WHY, "cause": None, "after": 3, "inputs": False}  # the peer's line, bounded
    assert str(err) == "worker 2 closed the connection: " + "x" * MAX_WHY


def test_the_receiver_refuses_a_farewell_one_byte_over():
    """513 bytes announced (and sent): no farewell, a malformed header, whoever the peer blames."""
    err = received(frame_header(FAREWELL | (MAX_FAREWELL + 1)) + farewell_json(MAX_FAREWELL + 1), close=True)
    assert not isinstance(err, PeerLost) and "malformed message header" in str(err)


def test_the_receiver_refuses_a_header_announcing_a_huge_farewell():
    """A header announcing a farewell of 2^40 bytes (and nothing after it): refused at once, nothing
    allocated for it, nothing waited for."""
    t0 = time.monotonic()
    err = received(frame_header(FAREWELL | (1 << 40)))
    assert not isinstance(err, (PeerLost, PeerTimeout)) and "malformed message header" in str(err)
    assert time.monotonic() - t0 < 1.5  # measured: ~1 ms (a wait for the announced bytes would time out at 2 s)


def test_an_empty_farewell_is_a_farewell_without_a_reason():
    err = received(frame_header(FAREWELL | 0))
    assert isinstance(err, PeerLeft) and err.said == "(no reason given)"
    assert err.reason == {"why": "", "cause": None, "after": None, "inputs": False}


# ---- a knock-on close says `after`, never `cause` ----


def leaving(err: BaseException) -> dict:
    """The farewell a participant leaving because of `err` says on its links (links.say_farewell),
    as its peer reads it."""
    a, b = tcp()
    mine, theirs = Link(a, None, 2, "worker 2"), Link(b, None, 1, "worker 1")
    try:
        say_farewell({2: mine}, err, grace_s=2)
        with pytest.raises(PeerLeft) as e:
            theirs.recv_size(time.monotonic() + 2)
        return e.value.reason
    finally:
        mine.close()
        theirs.close()


def test_a_knock_on_close_says_after_and_accuses_nobody():
    """Worker 3 said farewell to this worker, which leaves because of it: it says `after: 3`, not
    `cause: 3` (an announced close is no first-hand evidence), and the reason line is 3's."""
    heard = PeerLeft(3, "worker 3 closed the connection: out of memory", {"why": "out of memory"})
    assert leaving(heard) == {
        "cause": None,
        "after": 3,
        "inputs": False,
        "why": "worker 3 closed the connection: out of memory",
    }


def test_a_first_hand_failure_says_cause():
    """A link that closed without a word, or a peer silent past the deadline: `cause`."""
    assert leaving(PeerLost(3, "worker 3 closed the connection"))["cause"] == 3
    assert leaving(PeerTimeout(1, "worker 1 did not answer within the deadline")) == {
        "cause": 1,
        "after": None,
        "inputs": False,
        "why": "worker 1 did not answer within the deadline",
    }


def test_a_watched_failure_or_its_own_accuses_nobody():
    """The liveness watch's verdict (the client's word, relayed) and this worker's own error name
    nobody: neither `cause` nor `after`."""
    watched = PeerTimeout(4, "worker 4 sent no heartbeat for 5.1 s", watched=True)
    assert leaving(watched) == {
        "cause": None,
        "after": None,
        "inputs": False,
        "why": "worker 4 sent no heartbeat for 5.1 s",
    }
    assert leaving(MemoryError("out of memory")) == {
        "cause": None,
        "after": None,
        "inputs": False,
        "why": "MemoryError: out of memory",
    }
