"""The sessions of a log: each one's KV slot, positions and lifetime, and a verdict per session.

Part of the independent verifier: imports only audit/schema.py and the standard library. A single
session runs in slot 0 from a RESET (session record) to the next; a batched run (continuous
batching) runs several sessions at once, each in its own KV slot, and a step carries every running
session's tokens (its `spans`, schema.py). Per rank, the slots are replayed record by record:

  structure  a span at position p > 0 continues its slot's session where it ended (no gap); a
             release names a slot that holds a session; a step's spans are well formed (distinct
             slots, T >= 1, t = ΣT, pos = the first span's)
  holding    a slot holds one session's KV from its first token to its release: a new session
             (a span at position 0) starts only in a free slot, never on top of the previous
             session's KV; and every worker measured the released slot as all zeros
  rollback   positions are never attended after a rollback (speculative decoding: a step runs the
             last token plus K drafts, and the rejected drafts' positions are rolled back): a slot
             goes back only by a rollback record, from exactly what it holds to a position
             1 <= to < from, and every worker measured positions to.. of the slot as zeros after it;
             a span that starts below what its slot holds without one runs where the rejected
             drafts' keys and values still are (a worker that attends them, or keeps them)

A session's verdict: closed when every step it took part in is closed (checks.py marks the steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard

from .result import Violation

Span = tuple[int, int, int]  # slot, pos, T


@dataclass
class Session:
    """One session of a log: its slot, the (session, step) of every step it ran in, its tokens."""

    slot: int
    steps: list[tuple[int | None, int | None]] = field(default_factory=list)
    tokens: int = 0


def spans_of(record: dict) -> list[Span]:
    """A step's sessions: its spans, or slot 0 for a single session's step. ValueError when the
    spans are malformed or disagree with the step's t and pos."""
    t, pos, raw = record.get("t"), record.get("pos"), record.get("spans")
    if raw is None:
        if not (_int(pos) and _int(t) and pos >= 0 and t >= 1):
            raise ValueError(f"position {pos!r} and {t!r} tokens out of range")
        return [(0, pos, t)]
    if not isinstance(raw, list) or not all(isinstance(x, list) and len(x) == 3 and all(map(_int, x)) for x in raw):
        raise ValueError(f"spans {raw!r:.80} are not [slot, pos, T] integers")
    spans = [(s, p, n) for s, p, n in raw]
    if not spans or len({s for s, _, _ in spans}) != len(spans):
        raise ValueError("a batched step needs distinct slots")
    if any(s < 0 or p < 0 or n < 1 for s, p, n in spans):
        raise ValueError(f"spans {raw} out of range")
    if sum(n for _, _, n in spans) != t or spans[0][1] != pos:
        raise ValueError(f"spans {raw} disagree with t {t}, pos {pos}")
    return spans


def _int(x: object) -> TypeGuard[int]:
    """An int of the log (JSON): not a bool, which Python counts as one."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_slots(body: list[dict], rank: int, worker: bool, violate, checks: dict | None = None) -> list[Session]:
    """Replay one rank's slots (see the module docstring); returns its sessions in order of start.
    `violate(Violation)` records a finding and voids the step it names; `checks` counts the
    rollback checks made (per invariant, as Result.checks)."""
    checks = checks if checks is not None else {}
    sessions: list[Session] = []
    open_: dict[int, tuple[int, Session]] = {}  # slot -> (position reached, its session)
    batched: set[int] = set()  # open slots whose session ran in batched steps (they must be released)
    for r in body:
        kind = r.get("type")
        if kind == "session":
            open_, batched = {}, set()  # a RESET: every slot zeroed
            continue
        if kind == "release":
            slot = r.get("slot")
            held = open_.pop(slot, None) if _int(slot) else None
            if held is not None:
                batched.discard(slot)
            last = held[1].steps[-1] if held else (r.get("session"), None)
            where = dict(rank=rank, session=last[0], step=last[1])
            if held is None:
                violate(Violation("structure", f"release of slot {slot!r:.20}, which holds no session", **where))
            elif worker and r.get("zeroed") is not True:
                violate(Violation("holding", f"slot {slot} still held KV after its session's release", **where))
            continue
        if kind == "rollback":
            checks["rollback"] = checks.get("rollback", 0) + 1
            check_rollback(r, open_, rank, worker, violate)
            continue
        key = (r.get("session"), r.get("step"))
        where = dict(rank=rank, session=key[0], step=key[1])
        try:
            spans = spans_of(r)
        except (TypeError, ValueError) as e:
            violate(Violation("structure", f"malformed step ({e})", **where))
            continue
        for slot, pos, t in spans:
            held = open_.get(slot)
            if pos == 0 and held is not None and "spans" not in r:
                violate(Violation("structure", "position 0 again without a RESET (steps out of order?)", **where))
            elif pos == 0 and held is not None:
                msg = f"slot {slot}: a new session starts on top of the previous one's KV (never released)"
                violate(Violation("holding", msg, **where))
            elif pos > 0 and held is not None and pos < held[0]:
                msg = (
                    f"slot {slot}: the step starts at position {pos}, below the {held[0]} positions the slot "
                    f"holds, with no rollback recorded: positions {pos}..{held[0] - 1} were never zeroed, "
                    "and this step runs where they are"
                )
                violate(Violation("rollback", msg, **where))
            elif pos > 0 and (held is None or held[0] != pos):
                msg = f"slot {slot}: position {pos}, expected {held[0] if held else 'a new session at 0'}"
                violate(Violation("structure", msg, **where))
            if pos > 0:
                checks["rollback"] = checks.get("rollback", 0) + 1
            if pos == 0 or held is None:
                held = (0, Session(slot))
                sessions.append(held[1])
            s = held[1]
            s.steps.append(key)
            s.tokens += t
            open_[slot] = (pos + t, s)
            if "spans" in r:
                batched.add(slot)
    for slot in sorted(batched):  # the log ended with these sessions' KV still held
        last = open_[slot][1].steps[-1]
        msg = f"slot {slot}: its batched session was never released (its KV held to the end of the log)"
        violate(Violation("holding", msg, rank=rank, session=last[0], step=last[1]))
    return sessions


def check_rollback(r: dict, open_: dict[int, tuple[int, Session]], rank: int, worker: bool, violate) -> None:
    """One rollback record against the slots replayed so far: the slot holds a session, `from` is
    what it holds, 1 <= `to` < `from`, and a worker measured the slot as zeros from `to` on. Puts
    the slot back to `to` (when `to` is a position it holds)."""
    slot, frm, to = r.get("slot"), r.get("from"), r.get("to")
    held = open_.get(slot) if _int(slot) else None
    last = held[1].steps[-1] if held else (r.get("session"), None)  # the step whose drafts were rejected
    where = dict(rank=rank, session=last[0], step=last[1])
    if held is None:
        violate(Violation("rollback", f"rollback of slot {slot!r:.20}, which holds no session", **where))
        return
    if not (_int(frm) and _int(to) and frm == held[0] and 1 <= to < frm):
        msg = (
            f"slot {slot}: rollback from {frm!r:.20} to {to!r:.20}, but the slot holds {held[0]} positions "
            "(a rollback goes from what the slot holds back to a position 1..held-1)"
        )
        violate(Violation("rollback", msg, **where))
    if worker and r.get("zeroed") is not True:
        msg = f"slot {slot}: positions {to!r:.20}.. not zeroed at the rollback (the rejected drafts' KV kept)"
        violate(Violation("rollback", msg, **where))
    if _int(slot) and _int(to) and 1 <= to < held[0]:  # (slot is an int: it found `held` above)
        held[1].tokens -= held[0] - to  # the session's positions: the rejected ones are gone
        open_[slot] = (to, held[1])
