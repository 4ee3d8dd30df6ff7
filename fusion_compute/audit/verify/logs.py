"""Reading an audit directory: the manifest, each rank's hash chain, and the records' order.

Part of the independent verifier: imports only audit/schema.py and the standard library. The
checks here are the run-level ones on the logs themselves (`chain`: hashes, `prev`, `seq`, the
manifest's final hashes; `structure`: header / sessions / steps / releases / rollbacks / end,
consecutive steps, each step's phase, the same steps and releases on every rank; `rollback`: the
same rollbacks on every rank); positions per KV slot are checked in sessions.py, what the records
claim in checks.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from .. import schema as S
from .result import Result, Violation


class AuditFormatError(ValueError):
    """The directory is not an audit directory (missing or unreadable manifest)."""


def read_manifest(d: Path) -> dict:
    """A directory's manifest: a cold start's (it lists `epochs`) or one epoch's (it lists `chains`)."""
    mpath = d / S.MANIFEST
    if not d.is_dir():
        raise AuditFormatError(f"{d}: not a directory")
    if not mpath.is_file():
        raise AuditFormatError(f"{d}: no {S.MANIFEST} (not an audit directory)")
    try:
        manifest = json.loads(mpath.read_text())
        if not isinstance(manifest, dict):
            raise TypeError("not an object")
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise AuditFormatError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    if manifest.get("schema") != S.SCHEMA_VERSION:
        raise AuditFormatError(f"{mpath}: schema {manifest.get('schema')} (this verifier reads {S.SCHEMA_VERSION})")
    try:
        if "epochs" in manifest:  # a cold start
            [(int(e["epoch"]), str(e["dir"]), str(e["manifest_sha256"])) for e in manifest["epochs"]]
        else:
            int(manifest["workers"]), int(manifest["model"]["dims"]["layers"]), dict(manifest["chains"])
    except (KeyError, TypeError, ValueError) as e:
        raise AuditFormatError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    return manifest


def load_manifest(d: Path) -> dict:
    """One epoch's manifest (AuditFormatError when `d` is not an epoch's audit directory)."""
    manifest = read_manifest(d)
    if "epochs" in manifest:
        raise AuditFormatError(f"{d / S.MANIFEST}: a cold start's manifest, not an epoch's")
    return manifest


class RankLog(NamedTuple):
    """One rank's records, split by type (empty when the log is missing or has no header)."""

    header: dict
    body: list[dict]  # session, step, release and rollback records, in order
    steps: list[dict]  # the step records
    end: dict | None  # None when missing


def read_rank_log(path: Path, rank: int, final: str | None, res: Result, left: str | None = None) -> RankLog:
    """A rank's log, its chain checked against the manifest's final hash and its records' order.
    `left`: this rank's worker left the job during the epoch (the membership record says why), so
    its log may end without an end record."""
    records = read_chain(path, rank, final, res)
    log = split_records(records, rank, res, left) if records else RankLog({}, [], [], None)
    check_order(log.body, rank, res)
    check_frame_steps(log.body, rank, res)
    return log


def read_chain(path: Path, rank: int, final: str | None, res: Result) -> list[dict]:
    """The records up to the first one that breaks the hash chain."""
    if not path.is_file():
        res.violations.append(Violation("chain", f"log {path.name} missing", rank=rank))
        return []
    records: list[dict] = []
    prev = S.GENESIS
    for i, line in enumerate(path.read_text().splitlines()):
        res.checks["chain"] += 1
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            res.violations.append(Violation("chain", f"line {i + 1} is not JSON", rank=rank))
            return records
        if rec.get("seq") != i or rec.get("prev") != prev or S.chain_hash(prev, rec) != rec.get("hash"):
            msg = f"record {i} breaks the hash chain (seq {rec.get('seq')}, prev/hash mismatch)"
            res.violations.append(Violation("chain", msg, rank=rank))
            return records
        prev = rec["hash"]
        records.append(rec)
    if final is None:
        res.violations.append(Violation("chain", "manifest records no final hash for this log", rank=rank))
    elif prev != final:
        res.violations.append(Violation("chain", f"chain ends at {prev[:12]}, manifest says {final[:12]}", rank=rank))
    return records


def split_records(records: list[dict], rank: int, res: Result, left: str | None = None) -> RankLog:
    if not records or records[0].get("type") != "header":
        res.violations.append(Violation("structure", "log does not start with a header", rank=rank))
        return RankLog({}, [], [], None)
    end = records[-1] if records[-1].get("type") == "end" else None
    if end is None and left:
        # A revoked worker is told to wipe and leave at once, and its process may exit before the
        # end record is written; a lost one died. Its steps must still be the client's (check_same_steps).
        res.notes.append(f"rank {rank}'s log has no end record: its worker left the job ({left}) during the epoch")
    elif end is None:
        res.violations.append(Violation("structure", "log has no end record (worker died or log truncated)", rank=rank))
    body = records[1:-1] if end else records[1:]
    steps = [r for r in body if r.get("type") == "step"]
    for r in body:
        if r.get("type") not in ("session", "step", "release", "rollback"):
            res.violations.append(Violation("structure", f"unexpected record type {r.get('type')!r}", rank=rank))
    return RankLog(records[0], body, steps, end)


def check_order(body: list[dict], rank: int, res: Result) -> None:
    """Sessions numbered 1, 2, ...; in each, steps numbered 0, 1, ..., each with the phase its
    tokens imply; releases and rollbacks inside the current session. Positions are per KV slot:
    sessions.py."""
    session, step = 0, 0
    for r in body:
        res.checks["structure"] += 1
        if r.get("type") == "session":
            if r.get("session") != session + 1:
                msg = f"session {r.get('session')} follows session {session}"
                res.violations.append(Violation("structure", msg, rank=rank))
            session, step = r.get("session", session + 1), 0
            continue
        if r.get("type") in ("release", "rollback"):
            if r.get("session") != session:
                msg = f"{r.get('type')} in session {r.get('session')} during session {session}"
                res.violations.append(Violation("structure", msg, rank=rank))
            continue
        s, k, t, p = r.get("session"), r.get("step"), r.get("t"), r.get("pos")
        if (s, k) != (session, step):
            msg = f"step record (session {s}, step {k}) where (session {session}, step {step}) was due"
            res.violations.append(Violation("structure", msg, rank=rank, session=s, step=k))
        try:
            phase = S.step_phase(t or 0, p or 0, r.get("spans"))
        except (TypeError, ValueError):
            phase = None  # malformed spans: sessions.check_slots reports them
        if phase is not None and r.get("phase") != phase:
            res.violations.append(Violation("structure", f"phase {r.get('phase')!r}, expected {phase}", rank=rank))
        step += 1


def check_frame_steps(body: list[dict], rank: int, res: Result) -> None:
    """The step numbers the frames carried (schema.py: `frame_step`): in log order the events' numbers
    never go down; every event of a step record carries the record's `frame_step`, and the events
    before it (its `control`) no higher one; `frame_step` grows from step record to step record (a
    command word starts each step). A log whose messages were reordered, moved to another step or
    renumbered fails here; that the client and every worker give a step the same number is
    check_same_steps' (StepKey)."""
    seen, last_frame = 0, 0
    for r in body:
        frame = r.get("frame_step") if r.get("type") == "step" else None
        if r.get("type") == "step":
            if not isinstance(frame, int) or isinstance(frame, bool) or frame <= last_frame:
                msg = f"frame step {frame!r} after frame step {last_frame}: steps out of order"
                res.violations.append(
                    Violation("structure", msg, rank=rank, session=r.get("session"), step=r.get("step"))
                )
            else:
                last_frame = frame
        for part in ("control", "events"):
            for raw in r.get(part) or []:
                try:
                    step = read_event(raw).step
                except TypeError:
                    continue  # malformed: the checks that read events report it
                ok = isinstance(step, int) and not isinstance(step, bool) and step >= seen
                if ok and frame is not None:
                    ok = step == frame if part == "events" else step <= frame
                if not ok:
                    under = f" in a step record of frame step {frame}" if frame is not None else ""
                    msg = f"{raw[1] if len(raw) > 1 else '?'} message of step {step!r} after step {seen}{under}"
                    res.violations.append(
                        Violation("structure", msg, rank=rank, session=r.get("session"), step=r.get("step"))
                    )
                    continue
                seen = step


class StepKey(NamedTuple):
    """A step as every rank must have run it."""

    session: int | None
    step: int | None
    t: int | None  # tokens
    pos: int | None  # position of the first token
    spans: str | None = None  # a batched step's sessions, as canonical JSON (any value compares, and hashes)
    phase: str | None = None
    frame_step: int | None = None  # the step number its frames carried (check_frame_steps)

    @property
    def decode(self) -> bool:
        return self.phase == S.DECODE

    @property
    def verify(self) -> bool:
        return self.phase == S.VERIFY


def step_key(record: dict) -> StepKey:
    spans, phase = record.get("spans"), record.get("phase")
    return StepKey(
        _hashable(record.get("session")),
        _hashable(record.get("step")),
        _hashable(record.get("t")),
        _hashable(record.get("pos")),
        None if spans is None else json.dumps(spans, sort_keys=True),
        _hashable(phase),
        _hashable(record.get("frame_step")),
    )


def _hashable(value):
    """A record's value as written, or its JSON when it is a list or an object (malformed records
    still compare and hash, and the check reports them)."""
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def _between_steps(body: list[dict], kind: str, fields: tuple[str, ...]) -> list[tuple]:
    """A log's records of `kind` (release, rollback), each with the number of steps before it (where
    in the run it came) and its `fields`."""
    out, steps = [], 0
    for r in body:
        steps += r.get("type") == "step"
        if r.get("type") == kind:
            out.append((steps, *(_hashable(r.get(f)) for f in fields)))
    return out


def _releases(body: list[dict]) -> list[tuple]:
    return _between_steps(body, "release", ("session", "slot"))


def _rollbacks(body: list[dict]) -> list[tuple]:
    return _between_steps(body, "rollback", ("session", "slot", "from", "to"))


def check_same_steps(logs: dict[int, RankLog], n: int, res: Result, violate=None) -> list[StepKey]:
    """Every worker ran the same steps as the client, released the same slots between the same
    steps, and rolled back the same slots from and to the same positions (a rollback the client
    made that a worker did not is a worker that kept attending the rejected drafts' positions);
    returns the client's steps. `violate(Violation)` records a finding that names a step (and voids
    it: checks.Verification.violate)."""
    violate = violate or res.violations.append
    step_keys = [step_key(r) for r in logs[0].steps]
    releases, rollbacks = _releases(logs[0].body), _rollbacks(logs[0].body)
    for rank in range(1, n + 1):
        keys = [step_key(r) for r in logs[rank].steps]
        if keys != step_keys:
            differ = len(set(step_keys) ^ set(keys))
            msg = f"{len(keys)} steps vs the client's {len(step_keys)} ({differ} differ)"
            res.violations.append(Violation("structure", msg, rank=rank))
        mine = _releases(logs[rank].body)
        if mine != releases:
            msg = f"{len(mine)} slot releases vs the client's {len(releases)} ({len(set(mine) ^ set(releases))} differ)"
            res.violations.append(Violation("structure", msg, rank=rank))
        mine = _rollbacks(logs[rank].body)
        res.checks["rollback"] += max(len(mine), len(rollbacks))
        for at, session, slot, held, to in sorted(set(mine) ^ set(rollbacks), key=lambda x: x[0]):
            # the step the rollback precedes is the one that runs on the slot's positions
            key = step_keys[at] if at < len(step_keys) else step_keys[-1] if step_keys else None
            who = (
                "the client's log has it, this worker's not"
                if (at, session, slot, held, to) in rollbacks
                else "this worker's log has it, the client's not"
            )
            msg = f"rollback of slot {slot} from {held} to {to}: {who}"
            where = dict(session=key.session, step=key.step) if key else {}
            violate(Violation("rollback", msg, rank=rank, **where))
    res.steps = len(step_keys)
    res.decode_steps = sum(1 for k in step_keys if k.decode)
    res.verify_steps = sum(1 for k in step_keys if k.verify)
    res.prefill_steps = res.steps - res.decode_steps - res.verify_steps
    return step_keys


def read_event(raw) -> S.LogEvent:
    """A log's event array -> LogEvent; fields after the known ones are ignored. TypeError when it
    is not an array of at least that many fields (the caller reports the record as malformed)."""
    n = len(S.LogEvent._fields)
    if not isinstance(raw, list) or len(raw) < n:
        raise TypeError(f"an event is an array of {n} fields, got {raw!r:.60}")
    return S.LogEvent(*raw[:n])


_OP, _RECEIVED = S.LogEvent._fields.index("op"), S.LogEvent._fields.index("received")


def control_received(record: dict) -> list[int]:
    """Payload bytes of each control message a rank received since the previous record (they travel
    outside any step): a control word, or a step's spans, 3 int64 per session of the step (predicted
    from the step's own spans, not from the event; a record without spans: one session, slot 0)."""
    spans = record.get("spans")
    spans = S.SPANS_WORDS * 8 * (len(spans) if isinstance(spans, list) else 1)
    return [
        spans if e[_OP] == S.SPANS_OP else S.CONTROL_BYTES
        for e in record.get("control") or []
        if len(e) > _RECEIVED and any(e[_RECEIVED])
    ]


def coordinate_map(header: dict, key: str) -> dict[int, frozenset[int]]:
    """The client header's ingress / egress map: worker rank -> the residual coordinates it gets / returns."""
    return {int(k): frozenset(S.from_runs(v)) for k, v in (header.get(key) or {}).items()}
