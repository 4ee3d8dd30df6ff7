"""The comm layer in any dtype: three workers' `Comm`s on plaintext links (loopback TCP, one thread
per rank) reduce-scatter bfloat16 and float16 partials as their own 2-byte words, record 2 bytes
per element, and sum each chunk's partials in a float32 accumulator before the one rounding."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from fusion_compute.comm.comm import Comm
from fusion_compute.comm.events import Event
from fusion_compute.comm.links import Link


class Events:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def record(self, event: Event) -> None:
        self.events.append(event)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected TCP sockets on loopback (links tune TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def mesh(n: int) -> list[dict[int, Link]]:
    """Plaintext links between every pair of n workers (ranks 1..n)."""
    links: list[dict[int, Link]] = [{} for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            sa, sb = tcp_pair()
            links[a][b + 1] = Link(sa, None, b + 1, f"worker {b + 1}")
            links[b][a + 1] = Link(sb, None, a + 1, f"worker {a + 1}")
    return links


def run_ranks(n: int, body) -> list:
    links = mesh(n)
    recorders = [Events() for _ in range(n)]
    comms = [Comm(w + 1, n, links[w], timeout_s=10, recorder=recorders[w]) for w in range(n)]
    out: list = [None] * n
    errors: list[BaseException] = []

    def go(w: int) -> None:
        try:
            out[w] = body(w, comms[w])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for c in comms:
        c.close()
    assert not errors, errors
    return [(out[w], recorders[w].events) for w in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduce_scatter_sums_in_float32(dtype):
    """Each owner's chunk is 1 from itself and u from each of the two others (u = the dtype's unit
    roundoff, so 1 + u is a tie that rounds back to 1): summed in the dtype, partial by partial, the
    us are lost (1); in a float32 accumulator the sum is 1 + 2u, which the dtype holds exactly."""
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    n, rows, t = 3, 2, 1
    assert float(torch.tensor(1 + u, dtype=dtype)) == 1.0 and float(torch.tensor(1 + 2 * u, dtype=dtype)) == 1 + 2 * u

    def body(w: int, comm: Comm) -> torch.Tensor:
        send = torch.full((n * rows, t), u, dtype=dtype)
        send[w * rows : (w + 1) * rows] = 1.0  # this worker's own rows: the 1 comes first in rank order for w = 0
        return comm.reduce_scatter(send, [rows] * n, "L0.o")

    for w, (out, events) in enumerate(run_ranks(n, body)):
        assert out.dtype == dtype
        assert out.tolist() == [[1 + 2 * u]] * rows, (w, out)
        (event,) = events
        assert event.itemsize == 2 and event.sent == (0, *[rows * t * (q != w) for q in range(n)])


def test_score_sum_and_bytes_of_bfloat16():
    """The split-group score sum: the same accumulator; and a (k, 1) column (a decode step's shape,
    whose stride can be anything) goes out as its bytes."""
    u = 2.0**-8

    def body(w: int, comm: Comm) -> torch.Tensor:
        comm.score_owners = {0: [1, 2, 3]}
        scores = torch.full((4, 1), 1.0 if w == 0 else u, dtype=torch.bfloat16)
        return comm.sum_scores(scores, 0, "L0.scores.g0")

    for out, _ in run_ranks(3, body):
        assert out.tolist() == [[1 + 2 * u]] * 4
