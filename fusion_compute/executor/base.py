"""The executor's interface: what the engine asks of whoever starts its workers.

An executor answers three questions for one job, and nothing about the model or the plan:

  roster      who may join (every seat's id, host, group and pinned public key) and the client's
              own identity; for workers it starts itself, it makes a fresh key pair per seat
  listen      where the client listens for the rendezvous (comm/rendezvous.py)
  launch      start the workers of seats 1..N (and later one more, a standby: `WorkerProcs.spawn`),
              and watch them: `WorkerProcs` reports a worker that exits, with its last words

The engine builds the workers' command line (`WorkerJob`); an executor decides where it runs. The
links between the client and the workers, and among the workers, are comm/'s whichever executor
placed them: an executor never carries a job's data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from ..comm import Identity, Member
from ..runtime.launch import WorkerProcs

EXECUTORS = ("local", "ray", "inproc")  # what `--executor` names; listed workers follow from --topology / --master


@dataclass(frozen=True)
class WorkerJob:
    """How every started worker of one job runs: `fusion worker ARGS(seat)`, with `env` added to its
    environment and `secret(seat)` (its key bundle) on its standard input, never on a command line."""

    args: Callable[[int], list[str]]
    seats: int  # seats 1..seats start now; a standby enrolled later is started by WorkerProcs.spawn
    env: dict[str, str] = field(default_factory=dict)
    secret: Callable[[int], bytes] | None = None  # None: --insecure (no keys)


class Executor:
    """One job's executor. Subclasses: local.LocalExecutor (processes on this machine), listed.
    ListedExecutor (workers started by the user or by mpiexec: the engine only waits), ray.RayExecutor
    (one Ray actor per worker), inproc.InprocExecutor (threads of the client's process, for tests)."""

    name: ClassVar[str]
    starts_workers: ClassVar[bool] = True  # False: the workers start on their own (listed)
    member_host: ClassVar[str] = "127.0.0.1"  # where a started worker listens for its peers ("": its JOIN says)

    def __init__(self, secure: bool):
        self.secure = secure

    def roster(
        self, seats: Iterable[tuple[int, str | None, bool]]
    ) -> tuple[list[Member], Identity | None, dict[int, Identity]]:
        """(members, the client's identity, each started worker's identity) for `seats`, given as
        (id, group, standby). Workers this executor starts get fresh key pairs, made here in memory:
        only the processes it starts can join."""
        seats = list(seats)
        me = Identity.new() if self.secure else None
        keys = {pid: Identity.new() for pid, _, _ in seats} if self.secure else {}
        members = [
            Member(pid, self.member_host, keys[pid].public if self.secure else None, group, None, standby)
            for pid, group, standby in seats
        ]
        return members, me, keys

    def listen_address(self) -> tuple[str, int]:
        """HOST, PORT the client listens at for the rendezvous (port 0: any free one)."""
        return "127.0.0.1", 0

    def launch(self, job: WorkerJob) -> WorkerProcs | None:
        """Start seats 1..job.seats; returns their supervisor, or None when the workers start on
        their own (listed workers)."""
        raise NotImplementedError

    def where(self) -> str | None:
        """A line for the start-up log saying where the workers were placed, when that is news."""
        return None

    def stop(self) -> None:
        """After the workers have stopped (WorkerProcs.stop): release what the executor itself holds."""
