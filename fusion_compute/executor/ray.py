"""Workers as Ray actors (`--executor ray`; the optional `[ray]` extra): Ray places and supervises,
the links stay comm/'s.

Each worker seat gets one actor (`--ray-cpus` CPUs reserved for it, 1 by default), which starts
`fusion worker ARGS` on its node as its own child process (PR_SET_PDEATHSIG: the worker ends when
its actor does, killed or not). The worker then joins the client at the rendezvous over TLS, pinned
by its key, exactly as a local one: Ray carries only the command line, the key bundle (on the
worker's stdin), the exit status and the worker's last words, never a job's data.

Where: with `--ray-address HOST:PORT` an existing cluster (its GCS address, `ray start --head`
prints it); without it a Ray instance of this machine's own, started for the job and stopped with
it. (Ray 2.60 will not bind to loopback only: it replaces a loopback node address by the machine's
own and its servers listen on every interface, guarded by its token authentication.) The client
listens on loopback when every node of the cluster is this machine, else on the address Ray knows
this node by; decided at the job's start. A worker's host is taken from its JOIN (where it reached
the client from).

Bad input never reaches a worker: without Ray installed, or with an address where nothing answers,
`check` refuses the run in one line (exit 2) before any worker starts, within CONNECT_S seconds.

The key bundle crosses Ray's own channels (Ray's RPC, plaintext unless the cluster runs with
Ray's TLS, RAY_USE_TLS=1): on a cluster, that network must be one you trust as the hosts.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import os
import subprocess
import tempfile
import time
from typing import IO, Any

from ..comm import unreachable
from ..errors import UsageError
from ..runtime.launch import MAX_WORDS, Proc, WorkerProcs, last_words_of, popen_worker, terminate_all
from ..runtime.topology import is_local_address
from .base import Executor, WorkerJob

CONNECT_S = 3.0  # the bound on probing --ray-address before anything starts
POLL_S = 2.0  # the bound on one status call to a worker's actor
INSTALL = "pip install 'fusion-compute[ray]'"


def check_ray(address: str | None, cpus: float) -> None:
    """Refuse `--executor ray` that cannot start, before any worker does (UsageError: exit 2)."""
    if importlib.util.find_spec("ray") is None:
        raise UsageError(f"--executor ray needs Ray, which is not installed: {INSTALL}")
    if not (0 < cpus < float("inf")):
        raise UsageError(f"--ray-cpus must be a positive number of CPUs per worker, got {cpus}")
    if address is None:
        return
    host, port = parse_address(address)
    why = unreachable(host, port, CONNECT_S)  # bounded: ray.init's own wait is much longer
    if why is not None:
        raise UsageError(f"--ray-address {address}: no Ray cluster answers there ({why})")


def parse_address(address: str) -> tuple[str, int]:
    """HOST:PORT of a Ray cluster's GCS (what `ray start --head` prints)."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--ray-address must be HOST:PORT (the cluster's GCS address), got {address!r}")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class WorkerActor:
    """Runs in a Ray actor on the node Ray chose: starts the worker there and answers for it."""

    def start(self, args: list[str], env: dict[str, str], secret: bytes | None) -> int:
        self.log = tempfile.TemporaryFile(mode="w+b")
        self.proc = popen_worker(args, {**os.environ, **env}, self.log, secret)
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def last_words(self) -> str:
        return last_words_of(self.log, self.proc.returncode)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, grace_s: float) -> None:
        terminate_all([self.proc], grace_s)


class RayProc:
    """runtime.launch.Proc's face over one worker's actor. Its exit, once known, is written into
    the local `log` with its last words, so WorkerProcs reports it as it does a local worker's."""

    def __init__(self, ray: Any, actor: Any, started: Any, log: IO[bytes]):
        self._ray, self.actor, self._started, self._log = ray, actor, started, log
        self.returncode: int | None = None
        self.pid = -1  # the worker's pid on its node, once its actor has started it

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ray = self._ray
        try:
            ready, _ = ray.wait([self._started], timeout=0)
            if not ready:
                return None  # not placed yet: the engine's join timeout bounds the wait
            self.pid = int(ray.get(self._started))
            code = ray.get(self.actor.poll.remote(), timeout=POLL_S)
            if code is None:
                return None
            words = ray.get(self.actor.last_words.remote(), timeout=POLL_S)
        except ray.exceptions.GetTimeoutError:
            return None  # a busy node: asked again at the next poll
        except ray.exceptions.RayError as e:  # the actor itself is gone (killed, its node lost)
            code, words = -9, f"its Ray actor died ({_first_line(e)})"
        self._log.write(words.encode() + b"\n")
        self._log.flush()
        self.returncode = code
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0)
            time.sleep(0.05)
        return code

    def terminate(self) -> None:
        if self.returncode is None:
            self.actor.terminate.remote()

    def kill(self) -> None:
        """The actor goes, and its worker with it (Ray ends an actor's children; PR_SET_PDEATHSIG
        too). Its end is taken as known, so a wait after it never outlasts an unreachable node."""
        self._ray.kill(self.actor, no_restart=True)
        if self.returncode is None:
            self._log.write(b"killed with its Ray actor\n")
            self._log.flush()
            self.returncode = -9


def _first_line(e: BaseException) -> str:
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return line if len(line) <= MAX_WORDS // 2 else line[: MAX_WORDS // 2 - 3] + "..."


class RayExecutor(Executor):
    name = "ray"
    member_host = ""  # wherever Ray placed it: its JOIN says (the key still pins who it is)

    def __init__(self, secure: bool, address: str | None, cpus: float = 1.0, join_timeout_s: float = 120.0):
        super().__init__(secure)
        check_ray(address, cpus)
        import ray

        self.ray, self.cpus, self.address = ray, cpus, address
        self.owned = not ray.is_initialized()  # a caller (a test, a notebook) may have started it
        if self.owned:
            quiet: dict[str, Any] = dict(log_to_driver=False, logging_level=logging.WARNING)
            if address is not None:
                ray.init(address=address, **quiet)
            else:  # this machine's own instance
                ray.init(include_dashboard=False, **quiet)
        nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
        here = all(_is_loopback(a) or is_local_address(a) for a in nodes)  # a one-machine cluster
        self.host = "127.0.0.1" if here else ray.util.get_node_ip_address()
        self._actor: Any = ray.remote(WorkerActor)
        self.actors: list[Any] = []
        self._env: dict[str, str] = {}

    def listen_address(self) -> tuple[str, int]:
        return self.host, 0

    def launch(self, job: WorkerJob) -> WorkerProcs:
        self._env = dict(job.env)  # only the job's own variables: the node's environment is its own
        return WorkerProcs(job.args, job.seats, job.env, stdin_for_rank=job.secret, launcher=self._spawn)

    def _spawn(self, args: list[str], env: dict[str, str], log: IO[bytes], stdin: bytes | None) -> Proc:
        actor = self._actor.options(num_cpus=self.cpus, max_restarts=0).remote()
        self.actors.append(actor)
        return RayProc(self.ray, actor, actor.start.remote(args, self._env, stdin), log)

    def where(self) -> str | None:
        cluster = (
            "a Ray instance of its own" if self.owned and self.address is None else f"the Ray cluster at {self.address}"
        )
        links = "on loopback" if self.host == "127.0.0.1" else f"to {self.host}"
        return f"workers placed by {cluster}: one actor each ({self.cpus:g} CPU), their links {links}"

    def stop(self) -> None:
        for actor in self.actors:  # their workers have stopped (WorkerProcs.stop); any left go with them
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if self.owned:
            self.ray.shutdown()
