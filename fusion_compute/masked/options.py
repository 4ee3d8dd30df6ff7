"""`--mode masked` options: the group sizes A+B from --workers or from a topology's groups."""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .client import MaskedOptions
from .plan import parse_groups


def groups_of(workers: Any) -> tuple[int, int]:
    """--workers as parsed by options.workers_arg: "2+2" arrives as (2, 2); a plain N is not a masked layout."""
    if isinstance(workers, tuple):
        n_a, n_b = workers
    elif isinstance(workers, str):
        n_a, n_b = parse_groups(workers)
    else:
        raise UsageError(f"--mode masked needs group sizes A+B, e.g. --workers 2+2 (got {workers})")
    if n_a < 1 or n_b < 1:
        raise UsageError(f"--mode masked needs at least one worker in each group, got {n_a}+{n_b}")
    return n_a, n_b


def masked_options(workers: Any, topology: Any, common: dict[str, Any]) -> MaskedOptions:
    if topology is not None:
        if not topology.masked:
            raise UsageError(f"{topology.path} names no groups: give every worker group = \"A\" or \"B\" for --mode masked")
        n_a, n_b = topology.groups
    else:
        n_a, n_b = groups_of(workers if workers is not None else (2, 2))
    return MaskedOptions(n_a=n_a, n_b=n_b, **common)
