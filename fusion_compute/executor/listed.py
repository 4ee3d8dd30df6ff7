"""Workers the engine does not start: listed in a topology file and started by hand on their hosts
(`fusion worker --topology FILE --key K`), or started together by mpiexec (`--comm-backend mpi` with
a topology: their collectives run in its MPI world, comm/mpi_fabric.py), or, plaintext, whoever
claims a rank at `--master HOST:PORT --insecure`. The engine only listens and waits for them; a
worker that is never seen fails the start-up at --join-timeout."""

from __future__ import annotations

from collections.abc import Iterable

from ..comm import Identity, Member
from ..runtime.launch import WorkerProcs
from ..runtime.topology import Topology, check_here
from .base import Executor, WorkerJob


class ListedExecutor(Executor):
    starts_workers = False
    member_host = ""  # without a topology, a worker's own JOIN says where it listens

    def __init__(
        self, secure: bool, topology: Topology | None, key: Identity | None, master: str | None, mpi: bool = False
    ):
        super().__init__(secure)
        self.topology, self.key, self.master = topology, key, master
        self.name = "mpiexec" if mpi else "listed"  # type: ignore[misc]  # (mpiexec started them: same waiting)

    def roster(
        self, seats: Iterable[tuple[int, str | None, bool]]
    ) -> tuple[list[Member], Identity | None, dict[int, Identity]]:
        if self.topology is not None:  # the user's file names every key: nothing is made here
            members = [
                Member(p.rank, p.host, p.key if self.secure else None, p.group, p.name, p.standby)
                for p in self.topology.all_workers
            ]
            return members, self.key if self.secure else None, {}
        # insecure, separately started: hosts come from their JOINs
        return [Member(pid, "", None, group, None, standby) for pid, group, standby in seats], None, {}

    def listen_address(self) -> tuple[str, int]:
        if self.topology is not None:
            check_here(self.topology.client)
            return self.topology.client.host, self.topology.port
        assert self.master is not None
        host, _, port = self.master.rpartition(":")
        return host.strip("[]"), int(port)

    def launch(self, job: WorkerJob) -> WorkerProcs | None:
        return None
