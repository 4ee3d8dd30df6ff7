"""The options of one job (`EngineOptions`), and the checks that refuse combinations that cannot
work. Free of torch: the command line checks a run's options and refuses a bad one before it loads
torch or the model (options.py); engine.py runs the job they describe."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..comm import COMM_BACKENDS, Identity
from ..comm.liveness import DEADLINE_S
from ..errors import UsageError
from .deadline import DEFAULT_FACTOR, DEFAULT_MIN_S
from .launch import Launcher
from .placement import DEFAULT_DTYPE, check_dtype, check_gpus, gpu_count, is_cuda, parse_device
from .topology import Topology

if TYPE_CHECKING:
    from ..executor.inproc import WorkerMain

MIN_WORKERS = 2  # an epoch's default floor: one worker would hold everything
DEFAULT_CONTEXT = 4096  # KV positions preallocated per session (capped by the model's own window)
# comm backends whose worker-to-worker collectives run on a fabric (TorchFabric, MpiFabric), not the links
FABRIC_BACKENDS = ("gloo", "nccl", "mpi")
MEMORY_BACKENDS = ("nccl", "mpi")  # fabrics that move data in memory (GPU, shared memory): no --insecure needed


def effective_context(model_window: int, requested: int | None) -> int:
    """KV positions per session: the request (or DEFAULT_CONTEXT), never beyond the model's window."""
    return min(model_window, requested or DEFAULT_CONTEXT)


def warn(line: str) -> None:
    sys.stderr.write(f"fusion: {line}\n")
    sys.stderr.flush()


@dataclass
class EngineOptions:
    n_workers: int = 2
    capacities: tuple[float, ...] | None = None
    topology: Topology | None = None
    key: Identity | None = None  # the client's own key (topology runs); local runs make a fresh one
    insecure: bool = False  # plaintext links, unauthenticated claims: asked for by name only
    master: str | None = None  # HOST:PORT to listen at for separately started workers (insecure only)
    comm_backend: str = "tls"  # tls | tcp (insecure) | gloo, nccl (torch.distributed among workers) | mpi
    context: int | None = None
    threads: int | None = None  # torch threads per worker; None = cores // N, >= 1
    timeout_s: float = 120.0  # bound on every wait for a peer during the session
    join_timeout_s: float = 120.0  # bound on start-up: rendezvous, then the workers' loading
    device: str = "cpu"  # local workers' device: cpu, cuda (spread over the GPUs), cuda:K (placement.py)
    dtype: str = DEFAULT_DTYPE  # weights, activations, KV cache and the wire: float32, bfloat16, float16
    client_device: str | None = None  # embedding, final norm, LM head; None: the workers' (local), else cpu
    standby: int = 0  # local runs: spare workers spawned to replace a lost one (per group in masked mode)
    min_workers: int | None = None  # an epoch never has fewer workers; None: MIN_WORKERS (`floor`)
    liveness_s: float = DEADLINE_S  # a worker silent this long has failed
    # a step's deadline: max(step_deadline_min_s, factor × its healthy median); factor 0: no step bound
    step_deadline_factor: float = DEFAULT_FACTOR
    step_deadline_min_s: float = DEFAULT_MIN_S
    recover: bool = True  # on a lost worker: a new epoch and a replay (False: fail the request)
    worker_env: dict[str, str] = field(default_factory=dict)
    extra_worker_args: tuple[str, ...] = ()
    args_for_worker: dict[int, tuple[str, ...]] = field(default_factory=dict)  # more, for one local worker
    # Who starts the workers of a run without --topology/--master (executor/): "local" processes,
    # "ray" actors (on the cluster at ray_address, else on a Ray instance of this machine's own), or
    # "inproc" threads of this process (for tests), each running `fusion worker ARGS` with run_worker
    executor: str = "local"
    ray_address: str | None = None  # HOST:PORT of an existing Ray cluster's GCS
    ray_cpus: float = 1.0  # CPUs Ray reserves for each worker actor
    spawn: Launcher | None = None  # how a local worker process starts; None: runtime.launch.popen_worker
    run_worker: WorkerMain | None = None  # "inproc": a worker in a thread (cli.worker_thread.run_worker)
    # Start-up display (progress.load_monitor): called as progress(procs, plan, master) before the
    # rendezvous, closed after the handshake. None = quiet.
    progress: Callable[..., Any] | None = None
    log: Callable[[str], None] = warn  # refused connections, recoveries and other notices
    # TEST ONLY, the audit's negative control for revocation: "keep-revoked" makes `revoke` record the
    # user's revocation but keep the worker in the next epoch (a client bug that lets a revoked worker
    # keep receiving state). `fusion audit verify` must fail on it (docs/audit.md). None: no bug.

    def check(self) -> None:
        """Option combinations that cannot work; raises UsageError naming the fix (the options were
        wrong, nothing on the wire failed: the command line exits 2, a library caller can tell the two
        apart from a CommError)."""
        self.check_executor()
        if self.comm_backend not in COMM_BACKENDS:
            raise UsageError(f"unknown comm backend {self.comm_backend!r} (choose from {', '.join(COMM_BACKENDS)})")
        vouched = (self.comm_backend in MEMORY_BACKENDS and self.is_local) or self.mpi_world  # asked for by name
        if self.comm_backend != "tls" and not self.insecure and not vouched:
            raise UsageError(f"--comm-backend {self.comm_backend} is plaintext: add --insecure to ask for it by name")
        check_dtype(self.dtype)
        parse_device(self.device)
        if self.client_device is not None:
            parse_device(self.client_device, "--client-device")
        if self.comm_backend == "nccl" and not is_cuda(self.device):
            raise UsageError("--comm-backend nccl runs among GPU workers: add --device cuda (on CPUs: tls, or mpi)")
        if self.comm_backend == "nccl" and self.device != "cuda":
            raise UsageError(
                f"--comm-backend nccl needs a GPU of its own for every worker: --device cuda, not {self.device} "
                "(workers sharing one GPU: --comm-backend tls)"
            )
        if self.device != "cpu" and not self.is_local:
            raise UsageError(
                "--device places the workers this command starts; workers started on their own take "
                '`fusion worker --device` or `device = "cuda:K"` in the topology file'
            )
        if self.comm_backend in FABRIC_BACKENDS and not self.is_local:
            if not self.mpi_world:
                raise UsageError(
                    f"--comm-backend {self.comm_backend} runs on one machine only (spawned workers); across hosts, "
                    "--comm-backend mpi runs with a --topology on workers that mpiexec started"
                )
            if self.topology is not None and self.topology.standbys:  # an mpiexec world: comm/mpi_fabric.py
                raise UsageError(
                    "--comm-backend mpi across hosts: the workers share one mpiexec world, whose size is "
                    f"fixed, and it cannot take in a standby: drop the standbys of {self.topology.path}"
                )
            if self.recover:
                raise UsageError(
                    "--comm-backend mpi across hosts cannot replace a lost worker (an mpiexec world has a "
                    "fixed size): add --no-recover"
                )
        if self.master and self.topology is None and not self.insecure:
            raise UsageError(
                "--master without --topology cannot pin the workers' keys: use --topology FILE "
                "(with every participant's key) or --insecure"
            )
        if self.topology is not None and not self.insecure:
            self.topology.require_keys()
            if self.key is None:
                raise UsageError("a --topology run needs the client's key: --key FILE (its public line is in the file)")
            if self.topology.client.key is not None and self.topology.client.key != self.key.public:
                raise UsageError(
                    f"--key is not the client's key of {self.topology.path} "
                    f"(file: {self.topology.client.key.fingerprint}, --key: {self.key.public.fingerprint})"
                )
        if self.standby < 0:
            raise UsageError(f"--standby must be >= 0, got {self.standby}")
        if self.standby and not self.is_local:
            raise UsageError('--standby N spawns local spares; a topology names its standbys (role = "standby")')
        if self.capacities is not None and len(self.capacities) != self.n_workers:
            raise UsageError(f"{len(self.capacities)} capacities given for {self.n_workers} workers")
        if self.min_workers is not None and self.min_workers < 1:
            raise UsageError(f"--min-workers must be >= 1, got {self.min_workers}")
        if self.min_workers is not None and self.min_workers > self.n_workers:
            raise UsageError(
                f"--min-workers {self.min_workers} is more than the {self.n_workers} workers of this run "
                "(an epoch never has more): any lost worker would end it"
            )
        if not (self.liveness_s > 0):
            raise UsageError(f"--liveness must be > 0, got {self.liveness_s}")
        if not (self.step_deadline_factor == 0 or 1 <= self.step_deadline_factor < math.inf):
            raise UsageError(
                "--step-deadline-factor must be 0 (no step bound) or >= 1 (a multiple of the healthy "
                f"step's time), got {self.step_deadline_factor}"
            )
        if not (0 < self.step_deadline_min_s < math.inf):
            raise UsageError(f"--step-deadline-min must be > 0 seconds, got {self.step_deadline_min_s}")

    def check_executor(self) -> None:
        """An executor that cannot start this run is refused before any worker starts: Ray missing,
        or nothing answering at --ray-address (a bounded probe, executor/ray.py)."""
        from ..executor.base import EXECUTORS

        if self.executor not in EXECUTORS:
            raise UsageError(f"unknown executor {self.executor!r} (choose from {', '.join(EXECUTORS)})")
        if self.executor != "ray" and self.ray_address is not None:
            raise UsageError("--ray-address names the Ray cluster of --executor ray: add --executor ray")
        if self.executor == "inproc":
            self.check_inproc()
        if self.executor != "ray":
            return
        if not self.is_local:
            raise UsageError(
                "--executor ray starts the workers itself: drop --topology / --master (those workers start on their own)"
            )
        if self.comm_backend not in ("tls", "tcp"):
            raise UsageError(
                f"--executor ray runs over the links (tls, or tcp with --insecure), not --comm-backend {self.comm_backend}"
            )
        if self.device != "cpu":
            raise UsageError("--executor ray places CPU workers (--device cpu); GPU placement by Ray is not built yet")
        from ..executor.ray import check_ray

        check_ray(self.ray_address, self.ray_cpus)

    def check_inproc(self) -> None:
        """`--executor inproc` runs its workers as threads of this process (executor/inproc.py): on
        this machine, over the links, on the CPU, with the entry the command line (or a test) gives."""
        if not self.is_local:
            raise UsageError("--executor inproc starts the workers itself: drop --topology / --master")
        if self.comm_backend not in ("tls", "tcp"):
            raise UsageError(
                f"--executor inproc runs over the links (tls, or tcp with --insecure), not --comm-backend "
                f"{self.comm_backend} (a fabric's group is one per process)"
            )
        if self.device != "cpu":
            raise UsageError("--executor inproc runs CPU workers (--device cpu)")
        if self.run_worker is None:
            raise UsageError("--executor inproc needs the worker's entry (EngineOptions.run_worker)")

    def check_gpus(self) -> None:
        """Refuse a CUDA device this machine lacks, and NCCL with fewer GPUs than local workers, before
        any worker starts (UsageError: exit 2). Asks torch only when a CUDA device is named."""
        if not (is_cuda(self.device) or is_cuda(self.client_device)):
            return
        gpus = gpu_count()
        check_gpus([self.device], gpus)
        check_gpus([self.client_device or "cpu"], gpus, "--client-device")
        local = self.n_workers + self.standby
        if self.comm_backend == "nccl" and gpus < local:
            raise UsageError(
                f"--comm-backend nccl needs a GPU of its own for each of the {local} local workers; this machine "
                f"has {gpus} (workers sharing a GPU: --comm-backend tls)"
            )

    @property
    def placed_client_device(self) -> str:
        """Where the client's embedding, final norm and LM head live: --client-device, else the local
        workers' device (their first GPU for "cuda"), else the CPU."""
        if self.client_device is not None:
            return self.client_device
        return self.device if self.is_local else "cpu"

    @property
    def floor(self) -> int:
        """The fewest workers an epoch may have: --min-workers, else MIN_WORKERS. A run asked for with
        fewer workers than the default floor (`--workers 1`) starts, and ends at its first loss."""
        return MIN_WORKERS if self.min_workers is None else self.min_workers

    @property
    def mpi_world(self) -> bool:
        """Workers on several hosts that mpiexec started together, one MPI world as their fabric: the
        user's own cluster, a trust domain they vouch for by asking for it (the client's links stay
        TLS; the workers' collectives are MPI's, plaintext on the cluster's network)."""
        return self.comm_backend == "mpi" and self.topology is not None

    @property
    def is_local(self) -> bool:
        return self.topology is None and self.master is None


def default_backend(device: str, local_workers: int, gpus: int, insecure: bool) -> str:
    """The comm backend when none is named: NCCL among local workers on `--device cuda` when each can
    have a GPU of its own, else the links (several workers then share a GPU)."""
    if device == "cuda" and 1 < local_workers <= gpus:
        return "nccl"
    return "tcp" if insecure else "tls"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's limit), else
    the machine's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads(n_processes: int) -> int:
    """Torch threads for each of `n_processes` busy processes sharing this host: its cores divided
    among them, at least 1, and at most $OMP_NUM_THREADS where that is set (omp_threads). Torch's own
    default (every core, in every process) oversubscribes a host that runs several workers: their
    OpenMP threads spin against each other (README, "Threads": two hand-started workers and their
    client on 2 loaded cores decoded 0.37-1.34 tokens/s with two threads each, 3.5-18.7 with one)."""
    share = max(1, usable_cores() // max(1, n_processes))
    cap = omp_threads()
    return share if cap is None else min(share, cap)


def omp_threads() -> int | None:
    """$OMP_NUM_THREADS as a positive integer, else None: the thread budget OpenMP's convention gives
    each process of a tree (a job scheduler's, a container's, a test runner's that starts several
    processes on the same cores). The default thread count never exceeds it; an explicit --threads
    does. A value that is not a positive integer is OpenMP's to refuse, not a cap."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else None
