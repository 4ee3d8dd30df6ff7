"""The masked mode's part of the `fusion` command: options for `generate --mode masked --workers A+B`
and the worker entry `fusion worker --mode masked --group A|B --rank R --workers A+B --master H:P`.

fusion_compute/cli.py parses the flags and calls in here, so the structural paths stay untouched.
"""

from __future__ import annotations

import argparse
import os

from ..plan import PlanError
from .client import MaskedOptions
from .plan import parse_groups


def groups_of(workers) -> tuple[int, int]:
    """--workers as parsed by cli.py: "2+2" arrives as (2, 2); a plain N is not a masked layout."""
    if isinstance(workers, tuple):
        n_a, n_b = workers
    elif isinstance(workers, str):
        n_a, n_b = parse_groups(workers)
    else:
        raise PlanError(f"--mode masked needs group sizes A+B, e.g. --workers 2+2 (got {workers})")
    if n_a < 1 or n_b < 1:
        raise PlanError(f"--mode masked needs at least one worker in each group, got {n_a}+{n_b}")
    return n_a, n_b


def _check_master(master: str | None, error: type[Exception]) -> None:
    if master is None:
        return
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise error(f"--master must be HOST:PORT, got {master!r}")


def masked_options(a: argparse.Namespace, error: type[Exception]) -> MaskedOptions:
    """MaskedOptions from `fusion generate --mode masked ...`; bad values raise `error` (CliError)."""
    try:
        n_a, n_b = groups_of(a.workers if a.workers is not None else (2, 2))
    except PlanError as e:
        raise error(str(e)) from None
    for flag in ("capacity", "topology"):
        if getattr(a, flag, None):
            raise error(f"--{flag} is not supported with --mode masked (groups split rows evenly)")
    if getattr(a, "device", "cpu") != "cpu":
        raise error("--mode masked runs on CPU (gloo) only")
    _check_master(a.master, error)
    if a.context is not None and a.context < 2:
        raise error(f"--context must be >= 2, got {a.context}")
    if a.threads is not None and a.threads < 1:
        raise error(f"--threads must be >= 1, got {a.threads}")
    if not (a.timeout > 0):
        raise error(f"--timeout must be > 0, got {a.timeout}")
    return MaskedOptions(n_a=n_a, n_b=n_b, master=a.master, context=a.context, threads=a.threads, timeout_s=a.timeout)


def cmd_worker(a: argparse.Namespace, error: type[Exception]) -> int:
    """One masked worker: join the client at --master and serve until SHUTDOWN."""
    import torch

    from ..comm import Comm
    from ..weights import open_weights
    from .audit import AuditLog
    from .ring import limit_blas_threads
    from .worker import run

    try:
        n_a, n_b = groups_of(a.workers)
    except PlanError as e:
        raise error(str(e)) from None
    n = n_a + n_b
    if a.rank is None or not (1 <= a.rank <= n):
        raise error(f"--rank must be in 1..{n} for --workers {n_a}+{n_b}, got {a.rank}")
    group = "A" if a.rank <= n_a else "B"
    if getattr(a, "group", None) not in (None, group):
        raise error(f"rank {a.rank} of a {n_a}+{n_b} job is in group {group}, not {a.group}")
    if getattr(a, "topology", None):
        raise error("--topology is not supported with --mode masked yet: give --rank, --workers A+B, --master")
    if not a.master:
        raise error("--master HOST:PORT is required")
    _check_master(a.master, error)
    threads = a.threads or max(1, (os.cpu_count() or 1) // n)
    torch.set_num_threads(threads)
    limit_blas_threads(threads)  # the ring product's BLAS (numpy's OpenBLAS) too
    src = open_weights(a.model)
    audit_dir = getattr(a, "audit_dir", None)
    audit = AuditLog(audit_dir, a.rank, "worker", group, n_a, n_b) if audit_dir else None
    comm = Comm(a.rank, n, a.master, backend="gloo", timeout_s=a.timeout, recorder=audit)
    try:
        run(src, n_a, n_b, a.rank, comm, audit=audit, leak=getattr(a, "inject_leak", None))
    finally:
        if audit is not None:
            audit.close()
        comm.close()
    return 0
