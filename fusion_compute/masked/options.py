"""`--mode masked` options: the group sizes A+B (or A+B1+...+Bk) from --workers or a topology's groups."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .client import MaskedOptions
from .plan import parse_groups


def groups_of(workers: Any) -> tuple[int, tuple[int, ...]]:
    """--workers as parsed by options.workers_arg: "2+2" arrives as (2, 2), "2+2+1" as (2, 2, 1);
    returns (n_A, sizes of the mask groups). A plain N is not a masked layout."""
    if isinstance(workers, tuple):
        sizes = workers
    elif isinstance(workers, str):
        sizes = parse_groups(workers)
    else:
        raise UsageError(f"--mode masked needs group sizes A+B or A+B1+...+Bk, e.g. --workers 2+2 (got {workers})")
    if len(sizes) < 2 or any(n < 1 for n in sizes):
        raise UsageError(f"--mode masked needs at least one worker in each group, got {'+'.join(map(str, sizes))}")
    return sizes[0], tuple(sizes[1:])


def masked_options(workers: Any, topology: Any, common: dict[str, Any]) -> MaskedOptions:
    if topology is not None:
        if not topology.masked:
            raise UsageError(f"{topology.path} names no groups: give every worker a group (\"A\", and \"B\" or \"B1\"..\"Bk\") for --mode masked")
        n_a, b_sizes = topology.groups[0], topology.groups[1:]
    else:
        n_a, b_sizes = groups_of(workers if workers is not None else (2, 2))
    return MaskedOptions(n_a=n_a, n_b=b_sizes, **common)
