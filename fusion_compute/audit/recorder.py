"""The recorder: turns comm events and per-step holdings into one hash-chained JSONL log per rank.

It implements comm's `Recorder` protocol (`record(event)`) and the layers' `hold(...)` probe. Cost
is kept off the hot path: an event or a hold is one list append; coordinate sets are interned once
per index map (by object identity, the maps are built at load time); a step is serialized, hashed
and written once, at `end_step`. The recorder times itself (`busy_s`, written in the end record).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from .schema import (
    GENESIS,
    SCHEMA_VERSION,
    LogEvent,
    canonical,
    epoch_dir,
    log_name,
    parse_op,
    step_phase,
    to_runs,
)


def model_dims(config) -> dict:
    """The dimensions the verifier needs, from a ModelConfig (the only runtime object it sees)."""
    return config.dims()


def share_record(share) -> dict:
    """A plan WorkerShare as the worker declares it in its log header."""
    return {
        "worker": share.worker,
        "residual": list(share.residual),
        "attention": [[b.g0, b.g1, b.p0, b.p1] for b in share.attention],
        "mlp": list(share.mlp),
    }


class AuditRecorder:
    """One rank's audit log. Not thread-safe (a rank records from its main thread only)."""

    def __init__(self, audit_dir: str | Path, rank: int, role: str = "worker", header: dict | None = None):
        """`header`: more fields for the header record (an epoch's recorder: `epoch`, `participant`)."""
        self.dir = Path(audit_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / log_name(rank)
        self.rank = rank
        self.role = role
        self.header = dict(header or {})
        self._f = open(self.path, "w", buffering=1 << 20)
        self._seq = 0
        self._prev = GENESIS
        self._ops: dict[str, tuple[int, str]] = {}
        self._set_ids: dict[int, int] = {}  # id(index map) -> set id
        self._set_refs: list[object] = []  # keep interned maps alive so their ids stay unique
        self._new_sets: dict[str, list[list[int]]] = {}
        self._control: list[LogEvent] = []
        self._events: list[LogEvent] | None = None  # inside a step
        self._holds: list[list] = []
        self._last_holds: list[list] | None = None
        self._step_meta: dict = {}
        self._frame_step = 0  # the step number of the last event's frames: a step record's `frame_step`
        self.session = 0
        self.step = 0
        self.steps_total = 0
        self.busy_s = 0.0
        self.closed = False

    @classmethod
    def for_epoch(
        cls, cold_dir: str | Path, epoch: int, rank: int, participant: int | None = None, role: str = "worker"
    ) -> AuditRecorder:
        """The log of `rank` in plan epoch `epoch` of a cold start: COLD/epoch{E}/rank{R}.jsonl, its
        header naming the epoch and the participant (a worker's id for the life of the job)."""
        extra = {"epoch": int(epoch)}
        if participant is not None:
            extra["participant"] = int(participant)
        return cls(Path(cold_dir) / epoch_dir(epoch), rank, role=role, header=extra)

    # ---- hot path ----

    def record(self, event) -> None:
        t0 = time.perf_counter()
        meta = self._ops.get(event.op)
        if meta is None:
            meta = self._ops[event.op] = parse_op(event.op)
        row = LogEvent(meta[0], event.op, event.kind, meta[1], event.sent, event.received, event.itemsize, event.step)
        self._frame_step = event.step
        (self._events if self._events is not None else self._control).append(row)
        self.busy_s += time.perf_counter() - t0

    def hold(self, layer: int, name: str, index, n_rows: int) -> None:
        """At this step, tensor `name` of `layer` has n_rows rows standing for coordinates `index`."""
        t0 = time.perf_counter()
        sid = self._set_ids.get(id(index))
        if sid is None:
            sid = self._intern(index)
        self._holds.append([layer, name, sid, n_rows])
        self.busy_s += time.perf_counter() - t0

    def _intern(self, index) -> int:
        runs = to_runs(index)
        sid = len(self._set_refs)
        self._set_ids[id(index)] = sid
        self._set_refs.append(index)
        self._new_sets[str(sid)] = runs
        return sid

    # ---- records ----

    def _write(self, record: dict) -> str:
        body = canonical({"seq": self._seq, "prev": self._prev, **record})  # serialized once
        h = hashlib.sha256(self._prev.encode() + body).hexdigest()  # == schema.chain_hash
        self._f.write(body[:-1].decode() + f',"hash":"{h}"}}\n')
        self._f.flush()
        self._seq += 1
        self._prev = h
        return h

    def _take_control(self) -> list[LogEvent]:
        ctl, self._control = self._control, []
        return ctl

    def start(self, share=None, config=None, *, variant: str = "sharded", leak: str | None = None, **extra) -> None:
        """The header record: who this rank is and what it declares to own."""
        rec = {
            "type": "header",
            "schema": SCHEMA_VERSION,
            "rank": self.rank,
            "role": self.role,
            "pid": os.getpid(),
            "variant": variant,
            "leak": leak,
            "dims": model_dims(config) if config is not None else None,
            "share": share_record(share) if share is not None else None,
            "time": time.time(),
            "control": self._take_control(),
            **self.header,
            **extra,
        }
        self._write(rec)

    def new_session(self) -> None:
        t0 = time.perf_counter()
        self.session += 1
        self.step = 0
        self._write({"type": "session", "session": self.session, "control": self._take_control()})
        self.busy_s += time.perf_counter() - t0

    def begin_step(self, t: int, pos: int, spans: list[list[int]] | None = None) -> None:
        """`spans`: a batched step's sessions, [slot, pos, T] each, in column order (t = ΣT, pos =
        the first span's); each session's KV is its own slot (schema.py: release records)."""
        self._events = []
        self._holds = []
        self._step_meta = {
            "session": self.session,
            "step": self.step,
            "phase": step_phase(t, pos, spans),
            "t": t,
            "pos": pos,
            **({"spans": spans} if spans is not None else {}),
        }

    def release(self, slot: int, zeroed: bool | None = None) -> None:
        """A batched session ended: its KV slot was zeroed. A worker says whether it measured the
        slot as all zeros afterwards (`zeroed`); the client, which holds no KV, leaves it out."""
        t0 = time.perf_counter()
        rec = {"type": "release", "session": self.session, "slot": int(slot), "control": self._take_control()}
        if zeroed is not None:
            rec["zeroed"] = bool(zeroed)
        self._write(rec)
        self.busy_s += time.perf_counter() - t0

    def rollback(self, slot: int, held: int, pos: int, zeroed: bool | None = None) -> None:
        """Before a step: speculative decoding rejected positions pos..held-1 of `slot`, and the step
        starts at pos. A worker zeroed them and says whether it measured the slot as zeros from pos
        on (`zeroed`); the client, which holds no KV, leaves it out."""
        t0 = time.perf_counter()
        rec = {"type": "rollback", "session": self.session, "slot": int(slot), "from": int(held), "to": int(pos)}
        if zeroed is not None:
            rec["zeroed"] = bool(zeroed)
        self._write(rec)
        self.busy_s += time.perf_counter() - t0

    def end_step(self) -> None:
        t0 = time.perf_counter()
        holds: list[list] | str = self._holds
        if self._holds == self._last_holds and not self._new_sets:
            holds = "same"  # identical to the previous step's list (schema: the verifier expands it)
        else:
            self._last_holds = self._holds
        rec = {
            "type": "step",
            **self._step_meta,
            "frame_step": self._frame_step,
            "control": self._take_control(),
            "events": self._events or [],
            "holds": holds,
            "sets": self._new_sets,
        }
        self._new_sets = {}
        self._events = None
        self._holds = []
        self._write(rec)
        self.step += 1
        self.steps_total += 1
        self.busy_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Write out what is buffered (the process is about to exit at once: no end record)."""
        self._f.flush()

    def close(self) -> str:
        """The end record; returns the chain's final hash."""
        if self.closed:
            return self._prev
        self.closed = True
        self._write(
            {
                "type": "end",
                "steps": self.steps_total,
                "recorder_busy_s": round(self.busy_s, 6),
                "time": time.time(),
                "control": self._take_control(),
            }
        )
        self._f.close()
        return self._prev
