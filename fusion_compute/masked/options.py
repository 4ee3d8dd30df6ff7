"""`--mode masked` options (`MaskedOptions`), and the group sizes A+B (or A+B1+...+Bk) from --workers
or a topology's groups. Free of torch, like engine_options.py: a bad value is refused before the
masked client (and torch) loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..runtime.engine_options import EngineOptions
from . import protocol as P
from .plan import parse_groups

MASK_KINDS = {"chacha20": P.MASK_CHACHA20, "zero": P.MASK_ZERO}  # --masks: the HELLO word's mask kind


@dataclass
class MaskedOptions(EngineOptions):
    n_a: int = 2
    n_b: int | tuple[int, ...] = 2  # members of the mask group, or of each of k mask groups
    limb_bits: int | None = None  # None: ring.DEFAULT_LIMB_BITS (ring.py and docs/masked.md say why)
    masks: str = "chacha20"  # "zero" = NEGATIVE CONTROL (A receives x_fx in the clear)
    verify: bool = True  # check every product the workers return (verify.py); off only to measure its cost
    audit_dir: str | None = None  # every rank writes its masked audit log (and A its tap) here
    leak: str | None = None  # worker-side negative control: "a-to-b"

    def __post_init__(self) -> None:
        self.b_sizes = (self.n_b,) if isinstance(self.n_b, int) else tuple(self.n_b)
        self.n_workers = self.n_a + sum(self.b_sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.n_a, *self.b_sizes)

    def check(self) -> None:
        if not self.b_sizes or min(self.sizes) < 1:
            raise UsageError(
                f"--mode masked needs at least one worker in each group, got {'+'.join(map(str, self.sizes))}"
            )
        if self.masks not in MASK_KINDS:
            raise UsageError(f"unknown mask source {self.masks!r} ({', '.join(MASK_KINDS)})")
        if self.capacities:
            raise UsageError("--capacity is not supported with --mode masked (groups split rows evenly)")
        if self.comm_backend not in ("tls", "tcp") or self.device != "cpu":
            raise UsageError(
                "--mode masked runs on CPU links only (no worker-to-worker collectives to put on a fabric)"
            )
        if self.dtype != "float32" or (self.client_device or "cpu") != "cpu":
            raise UsageError(
                "--mode masked computes in exact integer ring products and float64 on the CPU: drop --dtype "
                "and --client-device"
            )
        super().check()


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
            raise UsageError(
                f'{topology.path} names no groups: give every worker a group ("A", and "B" or "B1".."Bk") for --mode masked'
            )
        n_a, b_sizes = topology.groups[0], topology.groups[1:]
    else:
        n_a, b_sizes = groups_of(workers if workers is not None else (2, 2))
    return MaskedOptions(n_a=n_a, n_b=b_sizes, **common)
