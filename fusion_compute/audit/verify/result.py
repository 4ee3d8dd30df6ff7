"""What the verifier found: violations, per-invariant counts, and the report it prints.

Part of the independent verifier: imports the standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

INVARIANTS = (
    "chain",
    "structure",
    "holding",
    "partition",
    "no_full_holder",
    "closure",
    "accounting",
    "os_bytes",
)
RUN_LEVEL = ("chain", "structure", "os_bytes")  # a failure here voids every step's certificate
MAX_LISTED = 12  # violations printed by render(); to_dict() keeps 200


@dataclass
class Violation:
    invariant: str
    message: str
    rank: int | None = None
    session: int | None = None
    step: int | None = None
    layer: int | None = None

    def where(self) -> str:
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.step is not None:
            parts.append(f"session {self.session} step {self.step}")
        if self.layer is not None and self.layer >= 0:
            parts.append(f"layer {self.layer}")
        return ", ".join(parts)


@dataclass
class Result:
    dir: str
    workers: int
    layers: int
    variant: str
    steps: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    closed_steps: int = 0
    closed_decode: int = 0
    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))  # invariant -> items checked
    violations: list[Violation] = field(default_factory=list)
    layer_closed: list[int] = field(default_factory=list)  # per layer: steps where it closed
    coalition: dict[str, str] = field(default_factory=dict)  # role -> smallest covering coalition
    bytes_per_step: dict[str, dict[str, float]] = field(default_factory=dict)  # rank -> phase -> mean sent
    os: dict[str, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def counts(self) -> dict[str, int]:
        c = dict.fromkeys(INVARIANTS, 0)
        for v in self.violations:
            c[v.invariant] += 1
        return c

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["violation_counts"] = self.counts()
        d["violations"] = [asdict(v) for v in self.violations[:200]]
        d["violations_total"] = len(self.violations)
        return d

    def summary_line(self) -> str:
        return (
            f"closed: {self.closed_decode}/{self.decode_steps} decode steps "
            f"(+{self.closed_steps - self.closed_decode}/{self.prefill_steps} prefill), "
            f"{self.layers} layers each, {len(self.violations)} violations"
        )

    def render(self) -> str:
        counts = self.counts()
        lines = [f"audit {self.dir}: {self.workers} workers, {self.layers} layers, variant {self.variant}"]
        for inv in INVARIANTS:
            lines.append(f"  {inv:<15} {self.checks.get(inv, 0):>9} checked  {counts[inv]:>6} violations")
        if self.coalition:
            roles = ", ".join(f"{r} {c}" for r, c in self.coalition.items())
            lines.append(f"  smallest coalition covering each role: {roles}")
        for rank, per in sorted(self.bytes_per_step.items()):
            parts = ", ".join(f"{ph} {b:,.0f} B" for ph, b in per.items())
            lines.append(f"  rank {rank} sends per step (mean): {parts}")
        for rank, o in sorted(self.os.items()):
            lines.append(
                f"  rank {rank} sockets: sent {o['measured_sent']:,} B vs predicted {o['predicted_sent']:,} "
                f"({o['excess_sent']:+,} B), received {o['measured_received']:,} vs {o['predicted_received']:,} "
                f"({o['excess_received']:+,} B) {'ok' if o['ok'] else 'MISMATCH'}"
            )
        for v in self.violations[:MAX_LISTED]:
            lines.append(f"  VIOLATION {v.invariant} [{v.where()}]: {v.message}")
        if len(self.violations) > MAX_LISTED:
            lines.append(f"  ... {len(self.violations) - MAX_LISTED} more")
        lines.append(self.summary_line())
        return "\n".join(lines)
