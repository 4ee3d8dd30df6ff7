"""The one door to the wire. Nothing outside this package opens a socket to a peer or imports a
transport (ssl sockets here, torch.distributed in torch_fabric.py, mpi4py in mpi_fabric.py); a test
enforces it.

Words, as torch.distributed and vLLM use them. The *comm backend* (`--comm-backend`,
`EngineOptions.comm_backend`, `Comm.backend`, one of `COMM_BACKENDS`) is what carries a job's
messages: `tls` (the default) or `tcp` are the *links* (links.py), framed messages per pair of
participants; `gloo`, `nccl` and `mpi` keep the client's links but run the workers' collectives on a
*fabric*, the object that implements collectives among workers on a backend other than the links
(`TorchFabric`, `MpiFabric`). The *engine* is never the wire: it is the client-side job object that
schedules and runs steps (runtime/engine.py's `Engine`, as vLLM's LLMEngine).

  identity.py      participant key pairs and the one-line public keys the topology pins
  links.py         framed messages per peer over TCP: TLS 1.3 with pinned certificates, or plaintext;
                   a farewell frame tells the peer why this end leaves
  rendezvous.py    admission against the roster, epochs, then wiring every pair of workers
  liveness.py      heartbeats: a worker that dies or freezes is named within seconds
  readiness.py     waiting for sockets to have something to read (poll: no descriptor ceiling)
  comm.py          `Comm`: the verbs (reduce_scatter, sum_scores, send, recv, ...) and their events
  events.py        `Event`, `Counters`, `Recorder`: what the audit and the benchmark read
  buffers.py       tensors of any dtype and device as the bytes a backend moves; the fp32 sum of partials
  torch_fabric.py  torch.distributed among workers: NCCL on GPUs, gloo for comparison
  mpi_fabric.py    MPI among workers: shared memory on one machine, or an mpiexec world
  fabrics.py       `open_fabric`: the fabric the client's WELCOME names (or none: the links)
  errors.py        `CommError` and the per-peer errors that name who failed
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from .errors import CommError, PeerError, PeerLeft, PeerLost, PeerOutOfStep, PeerPoisoned, PeerTimeout, TaintedInputs
from .events import WORKER_COLLECTIVES, Counters, Event, NullRecorder, Recorder
from .fabrics import backend_of, open_fabric
from .identity import Identity, IdentityError, PublicId
from .links import farewell_all, farewell_on_failure, reason_of, say_farewell, wire_bytes
from .liveness import Pulse, Watch, Witness
from .rendezvous import Admission, Credentials, Joined, Member, join_epoch, launched_rank, open_pulse

if TYPE_CHECKING:
    from .comm import Comm

COMM_BACKENDS = ("tls", "tcp", "gloo", "nccl", "mpi")  # tls: the secure links; the others are plaintext somewhere

__all__ = [
    "Admission",
    "COMM_BACKENDS",
    "Comm",
    "CommError",
    "Counters",
    "Credentials",
    "Event",
    "Identity",
    "IdentityError",
    "Joined",
    "Member",
    "NullRecorder",
    "PeerError",
    "PeerLeft",
    "PeerLost",
    "PeerOutOfStep",
    "PeerPoisoned",
    "PeerTimeout",
    "PublicId",
    "Pulse",
    "Recorder",
    "TaintedInputs",
    "WORKER_COLLECTIVES",
    "Watch",
    "Witness",
    "backend_of",
    "farewell_all",
    "farewell_on_failure",
    "free_port",
    "join_epoch",
    "launched_rank",
    "open_fabric",
    "open_pulse",
    "reason_of",
    "say_farewell",
    "unreachable",
    "wire_bytes",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for a rendezvous or a store to bind next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def unreachable(host: str, port: int, timeout_s: float) -> str | None:
    """Why nothing accepts a TCP connection at host:port within `timeout_s` ("connection refused",
    "timed out"), or None when something does (the connection is closed at once, nothing sent): a
    bounded look before handing an address to a client library whose own wait is long (Ray's)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except TimeoutError:
        return "timed out"
    except OSError as e:
        return (e.strerror or str(e)).lower()
    return None


if not TYPE_CHECKING:  # type checkers see the import above, and no catch-all attribute

    def __getattr__(name: str):
        """`Comm` (comm.py) needs torch: it is imported when first asked for, so that the commands that
        never open a link (`fusion keys`, `--help`, a refused argument) start without loading torch."""
        if name == "Comm":
            from .comm import Comm

            return Comm
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
