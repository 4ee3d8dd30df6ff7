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
    "rollback",  # speculation: positions never attended after a rollback (sessions.py, logs.py)
    "os_bytes",
    "membership",  # across epochs: a departed worker takes no part and receives nothing after it left
)
RUN_LEVEL = ("chain", "structure", "os_bytes", "membership")  # a failure here voids every step's certificate
MAX_LISTED = 12  # violations printed by render(); to_dict() keeps 200


def _closing(notes: list[str], violations: list, summary: str) -> list[str]:
    """A report's last lines: its notes, the first MAX_LISTED violations, the summary line."""
    out = [f"  note: {note}" for note in notes]
    out += [f"  VIOLATION {v.invariant} [{v.where()}]: {v.message}" for v in violations[:MAX_LISTED]]
    if len(violations) > MAX_LISTED:
        out.append(f"  ... {len(violations) - MAX_LISTED} more")
    return [*out, summary]


def checks_table(checks: dict[str, int], counts: dict[str, int], membership: bool) -> list[str]:
    """One row per invariant: items checked and violations. The same rows for an epoch, a cold start
    (its epochs and the checks across them, summed: RunResult.checks) and report.md. `membership`:
    show its row (a cold start's; an epoch on its own has none, unless a violation says otherwise)."""
    lines = []
    for inv in INVARIANTS:
        if inv == "membership" and not (membership or checks.get(inv) or counts[inv]):
            continue
        lines.append(f"  {inv:<15} {checks.get(inv, 0):>9} checked  {counts[inv]:>6} violations")
    return lines


def verdict(ok: bool) -> str:
    """The word every verdict line uses (`fusion audit run`, `fusion audit verify`, report.md)."""
    return "PASS" if ok else "FAIL"


def verify_part(closed: int, total: int) -> str:
    """A speculative run's verification steps in a summary line (nothing without speculation)."""
    return f" (+{closed}/{total} verify)" if total else ""


def sessions_part(closed: int, total: int) -> str:
    """A batched run's sessions in a summary line (nothing for one session at a time)."""
    return f", {closed}/{total} batched sessions" if total else ""


@dataclass
class Violation:
    invariant: str
    message: str
    rank: int | None = None
    session: int | None = None
    step: int | None = None
    layer: int | None = None
    epoch: int | None = None  # the plan epoch (set when a cold start's epochs are verified together)

    def where(self) -> str:
        parts = []
        if self.epoch is not None:
            parts.append(f"epoch {self.epoch}")
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
    verify_steps: int = 0  # speculative verifications: sessions continuing with several columns
    prefill_steps: int = 0
    closed_steps: int = 0
    closed_decode: int = 0
    closed_verify: int = 0
    batched_sessions: int = 0  # a batched run's sessions (0: one session at a time)
    closed_sessions: int = 0  # those whose every step closed
    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))  # invariant -> items checked
    violations: list[Violation] = field(default_factory=list)
    layer_closed: list[int] = field(default_factory=list)  # per layer: steps where it closed
    coalition: dict[str, str] = field(default_factory=dict)  # role -> smallest covering coalition
    bytes_per_step: dict[str, dict[str, float]] = field(default_factory=dict)  # rank -> phase -> mean sent
    os: dict[str, dict] = field(default_factory=dict)
    unclosed: list[tuple[int | None, int | None]] = field(default_factory=list)  # (session, step) not closed
    notes: list[str] = field(default_factory=list)  # accepted exceptions, said out loud

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
            f"closed: {self.closed_decode}/{self.decode_steps} decode steps"
            f"{verify_part(self.closed_verify, self.verify_steps)} "
            f"(+{self.closed_steps - self.closed_decode - self.closed_verify}/{self.prefill_steps} prefill)"
            f"{sessions_part(self.closed_sessions, self.batched_sessions)}, "
            f"{self.layers} layers each, {len(self.violations)} violations"
        )

    def render(self, table: bool = True) -> str:
        """The report of one epoch. `table=False` inside a cold start's report, which prints one table
        for all its epochs and the checks across them (RunResult.render), as report.md does."""
        lines = [f"audit {self.dir}: {self.workers} workers, {self.layers} layers, variant {self.variant}"]
        if table:
            lines += checks_table(self.checks, self.counts(), membership=False)
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
        return "\n".join(lines + _closing(self.notes, self.violations, self.summary_line()))


@dataclass
class RunResult:
    """A cold start: every plan epoch's Result, plus the run-level checks across epochs (the manifest
    and membership record's digests, who took part in which epoch, what a departed worker received).
    It answers the same questions as a Result (ok, counts, checks, closed steps), summed over epochs;
    a run-level violation voids every step's certificate."""

    dir: str
    epochs: list[Result] = field(default_factory=list)
    run_violations: list[Violation] = field(default_factory=list)
    run_checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))
    orders: list[list[int]] = field(default_factory=list)  # per epoch: participants in rank order
    departures: list[dict] = field(default_factory=list)  # participant, epoch, why, findings, kernel counts
    replays: list[dict] = field(default_factory=list)  # per epoch after the first: the replay step
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.run_violations and all(e.ok for e in self.epochs) and bool(self.epochs)

    @property
    def violations(self) -> list[Violation]:
        return self.run_violations + [v for e in self.epochs for v in e.violations]

    def counts(self) -> dict[str, int]:
        c = dict.fromkeys(INVARIANTS, 0)
        for v in self.violations:
            c[v.invariant] += 1
        return c

    @property
    def checks(self) -> dict[str, int]:
        c = dict(self.run_checks)
        for e in self.epochs:
            for k, v in e.checks.items():
                c[k] = c.get(k, 0) + v
        return c

    @property
    def _void(self) -> bool:
        return any(v.invariant in RUN_LEVEL for v in self.run_violations)

    def _sum(self, name: str) -> int:
        return sum(getattr(e, name) for e in self.epochs)

    @property
    def workers(self) -> int:
        return self.epochs[0].workers if self.epochs else 0

    @property
    def layers(self) -> int:
        return self.epochs[0].layers if self.epochs else 0

    @property
    def variant(self) -> str:
        return self.epochs[0].variant if self.epochs else "?"

    @property
    def steps(self) -> int:
        return self._sum("steps")

    @property
    def decode_steps(self) -> int:
        return self._sum("decode_steps")

    @property
    def verify_steps(self) -> int:
        return self._sum("verify_steps")

    @property
    def prefill_steps(self) -> int:
        return self._sum("prefill_steps")

    @property
    def closed_steps(self) -> int:
        return 0 if self._void else self._sum("closed_steps")

    @property
    def closed_decode(self) -> int:
        return 0 if self._void else self._sum("closed_decode")

    @property
    def closed_verify(self) -> int:
        return 0 if self._void else self._sum("closed_verify")

    @property
    def layer_closed(self) -> list[int]:
        out = [0] * self.layers
        for e in self.epochs if not self._void else ():
            for i, v in enumerate(e.layer_closed[: len(out)]):
                out[i] += v
        return out

    @property
    def coalition(self) -> dict[str, str]:
        """Per role, the smallest covering coalition over every epoch ("k/N" of that epoch)."""
        best: dict[str, tuple[int, str]] = {}
        for e in self.epochs:
            for role, c in e.coalition.items():
                k = int(c.split("/")[0]) if c[:1].isdigit() else 1 << 30
                if role not in best or k < best[role][0]:
                    best[role] = (k, c)
        return {role: c for role, (_, c) in best.items()}

    def _per_epoch(self, name: str) -> dict:
        """A per-rank map of every epoch; keys "e{E}.{rank}" once there is more than one epoch."""
        if len(self.epochs) == 1:
            return dict(getattr(self.epochs[0], name))
        return {f"e{i}.{k}": v for i, e in enumerate(self.epochs) for k, v in getattr(e, name).items()}

    @property
    def bytes_per_step(self) -> dict[str, dict[str, float]]:
        return self._per_epoch("bytes_per_step")

    @property
    def os(self) -> dict[str, dict]:
        return self._per_epoch("os")

    def to_dict(self) -> dict:
        return {
            "dir": self.dir,
            "ok": self.ok,
            "epochs": [e.to_dict() for e in self.epochs],
            "orders": self.orders,
            "departures": self.departures,
            "replays": self.replays,
            "notes": self.notes,
            "checks": self.checks,
            "violation_counts": self.counts(),
            "run_violations": [asdict(v) for v in self.run_violations[:200]],
            "violations_total": len(self.violations),
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "closed_decode": self.closed_decode,
            "verify_steps": self.verify_steps,
            "closed_verify": self.closed_verify,
            "prefill_steps": self.prefill_steps,
            "closed_steps": self.closed_steps,
            "batched_sessions": self.batched_sessions,
            "closed_sessions": self.closed_sessions,
        }

    @property
    def batched_sessions(self) -> int:
        return self._sum("batched_sessions")

    @property
    def closed_sessions(self) -> int:
        return 0 if self._void else self._sum("closed_sessions")

    def summary_line(self) -> str:
        over = f" in {len(self.epochs)} epochs" if len(self.epochs) != 1 else ""
        return (
            f"closed: {self.closed_decode}/{self.decode_steps} decode steps"
            f"{verify_part(self.closed_verify, self.verify_steps)} "
            f"(+{self.closed_steps - self.closed_decode - self.closed_verify}/{self.prefill_steps} prefill)"
            f"{sessions_part(self.closed_sessions, self.batched_sessions)}{over}, "
            f"{self.layers} layers each, {len(self.violations)} violations"
        )

    def render(self) -> str:
        lines = [
            f"cold start {self.dir}: {len(self.epochs)} epoch{'s' if len(self.epochs) != 1 else ''}, "
            f"{self.workers} workers, {self.layers} layers, variant {self.variant}",
            "checks (every epoch and those across epochs, summed: the counts of summary.json and report.md)",
            *checks_table(self.checks, self.counts(), membership=True),
        ]
        for i, e in enumerate(self.epochs):
            order = self.orders[i] if i < len(self.orders) else []
            lines.append(f"epoch {i}: workers (participants in rank order) {order}")
            lines += ["  " + line for line in e.render(table=False).splitlines()]
        for d in self.departures:
            k = d.get("kernel")
            kernel = (
                f"its process (pid {k['os_pid']}) sent {k['sent']:,} B and received {k['received']:,} B "
                f"after it left (kernel, pulse excluded)"
                if k
                else "kernel bytes not measured"
            )
            lines.append(
                f"  worker {d['participant']} {d['why']} before epoch {d['epoch']}: "
                f"{'takes no part after' if d['absent'] else 'TAKES PART after'}, {kernel}"
            )
        for r in self.replays:
            state = (
                "closed by its epoch's checks (no worker held every coordinate of any protected role)"
                if r["closed"]
                else f"NOT closed ({r['violations']} violations)"
            )
            lines.append(
                f"  replay in epoch {r['epoch']}: session {r['session']} step {r['step']}, "
                f"{r['tokens']} tokens: {state}"
            )
        return "\n".join(lines + _closing(self.notes, self.run_violations, self.summary_line()))
