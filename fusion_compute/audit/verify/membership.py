"""The checks across a cold start's plan epochs: who took part in which, and what a departed worker got.

Part of the independent verifier: imports only audit/schema.py and the standard library. Inputs: the
cold start's manifest (the epochs, with digests), the client's membership record (membership.json:
each epoch's participants in rank order, who left before it and why), every epoch's manifest and
logs (each worker's header names its participant id and its OS process id: the workers' own word,
not only the client's), and the kernel's socket counts of each departed worker's process from the
moment it left (the run-level netcount.json). Violations are run-level (`chain` for the digests,
`structure` for malformed or inconsistent records, `membership` for the invariant itself):

  - in every epoch, each rank's worker is the participant the client's order names;
  - nobody leaves without a recorded reason (revoked by the user, or lost);
  - a participant that left before epoch e has no log in epoch e or any later one, is in no later
    epoch's order, is never addressed by the client's transfers there, and its process sent and
    received no byte on its sockets (heartbeats excluded) from its departure to the last step.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple

from .. import schema as S
from .logs import RankLog, read_event
from .result import RunResult, Violation

WHY = {S.REVOKED: "revoked by the user", S.LOST: "lost"}


class EpochView(NamedTuple):
    """One verified epoch, as the checks across epochs see it."""

    epoch: int
    dir: Path
    manifest: dict
    logs: dict[int, RankLog]  # rank -> its log (ranks 0..N of the epoch's manifest, chains checked)


class Record(NamedTuple):
    """The client's membership record (membership.json), parsed."""

    epochs: list[dict]  # per epoch: {"epoch", "order", "left": {participant: why}, "replayed_tokens"}

    def left_at(self, epoch: int) -> dict[int, str]:
        """Participants that left before `epoch` -> why."""
        return self.epochs[epoch]["left"] if 0 <= epoch < len(self.epochs) else {}

    def departing(self, epoch: int, order) -> dict[int, str]:
        """Ranks of `epoch` (per its `order`) whose worker left before the next epoch -> why."""
        nxt = self.left_at(epoch + 1)
        if not isinstance(order, list):
            return {}
        return {r + 1: WHY[nxt[p]] for r, p in enumerate(order) if p in nxt}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest(run: RunResult, path: Path, want, what: str) -> bool:
    """`path` matches the digest the cold start's manifest recorded; a violation otherwise."""
    run.run_checks["chain"] += 1
    if want is None and not path.is_file():
        return False
    if want is None:
        run.run_violations.append(Violation("chain", f"{what} is not in the cold start's manifest"))
    elif not path.is_file():
        run.run_violations.append(Violation("chain", f"{what} missing (the manifest records its digest)"))
    elif _sha256(path) != want:
        run.run_violations.append(Violation("chain", f"{what} differs from the digest in the manifest"))
    else:
        return True
    return False


def epoch_entries(d: Path, manifest: dict, run: RunResult) -> list[tuple[int, Path]]:
    """The cold start's epochs, numbered 0, 1, ..., each in its own directory, each manifest's digest
    checked against the cold start's manifest."""
    out = []
    for i, entry in enumerate(manifest["epochs"]):
        e, name = int(entry["epoch"]), str(entry["dir"])
        run.run_checks["structure"] += 1
        if e != i or name != S.epoch_dir(e):
            run.run_violations.append(Violation("structure", f"epoch entry #{i} is epoch {e} in {name!r}", epoch=i))
            continue
        sub = d / name
        run.run_checks["chain"] += 1
        mpath = sub / S.MANIFEST
        if mpath.is_file() and _sha256(mpath) != entry["manifest_sha256"]:
            run.run_violations.append(Violation("chain", f"{name}/{S.MANIFEST} differs from its digest", epoch=e))
        out.append((e, sub))
    if not out:
        run.run_violations.append(Violation("structure", "the cold start lists no epoch"))
    return out


def read_record(d: Path, manifest: dict, run: RunResult) -> Record | None:
    """membership.json, its digest checked; None (with a violation) when it is missing or malformed."""
    path = d / S.MEMBERSHIP
    if not path.is_file():
        run.run_violations.append(Violation("chain", f"{S.MEMBERSHIP} missing"))
        return None
    _digest(run, path, manifest.get("membership_sha256"), S.MEMBERSHIP)
    try:
        raw = json.loads(path.read_text())
        epochs = []
        for i, ep in enumerate(raw["epochs"]):
            left = {}
            for x in ep.get("left") or []:
                p, why = int(x["participant"]), x["why"]
                if why not in S.DEPARTURES:
                    raise ValueError(f"epoch {i}: why {why!r} (expected one of {', '.join(S.DEPARTURES)})")
                left[p] = why
            order = ep["order"]
            if int(ep["epoch"]) != i or not isinstance(order, list) or not all(isinstance(p, int) for p in order):
                raise ValueError(f"epoch entry #{i} is malformed")
            epochs.append({"order": order, "left": left, "replayed_tokens": int(ep.get("replayed_tokens") or 0)})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        run.run_violations.append(Violation("structure", f"malformed {S.MEMBERSHIP} ({type(e).__name__}: {e})"))
        return None
    return Record(epochs)


def _header(path: Path) -> dict:
    """The first record of a log not listed in any manifest (no chain to check it against)."""
    try:
        with open(path) as f:
            rec = json.loads(f.readline())
        return rec if isinstance(rec, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _client_addresses(log: RankLog, ranks: set[int], n: int) -> tuple[int, int, list[str], set[int]]:
    """Elements the client's log sent to and received from `ranks`, the operators involved, and any
    rank beyond the epoch's n workers it addressed."""
    sent = received = 0
    ops: list[str] = []
    beyond: set[int] = set()
    records = [log.header, *log.body] + ([log.end] if log.end else [])
    for r in records:
        for raw in (r.get("control") or []) + (r.get("events") or []):
            try:
                e = read_event(raw)
                for q, (s, v) in enumerate(zip(e.sent, e.received, strict=False)):
                    if not (s or v):
                        continue
                    if q > n:
                        beyond.add(q)
                    if q in ranks:
                        sent, received = sent + s, received + v
                        if e.op not in ops:
                            ops.append(e.op)
            except (TypeError, ValueError):
                continue  # malformed events are the epoch's own checks' findings
    return sent, received, ops, beyond


def check_membership(run: RunResult, views: list[EpochView], record: Record | None, d: Path, manifest: dict) -> None:
    """Who took part in which epoch, against the client's record; what a departed worker got."""
    viol = run.run_violations
    if record is not None and len(record.epochs) != len(manifest["epochs"]):
        viol.append(
            Violation(
                "structure",
                f"{S.MEMBERSHIP} records {len(record.epochs)} epochs, the manifest {len(manifest['epochs'])}",
            )
        )
    present: dict[int, dict[int, list[str]]] = {}  # epoch -> participant -> where it shows up
    os_pid: dict[int, int] = {}  # participant -> OS process id, from its own log headers
    for v in views:
        e, n = v.epoch, int(v.manifest["workers"])
        here: dict[int, list[str]] = {}
        order = v.manifest.get("order")
        run.run_checks["structure"] += 1
        if not isinstance(order, list) or len(order) != n or not all(isinstance(p, int) for p in order):
            viol.append(Violation("structure", f"the epoch's manifest gives no order of its {n} workers", epoch=e))
            order = []
        if record is not None and e < len(record.epochs) and record.epochs[e]["order"] != order:
            viol.append(
                Violation(
                    "structure",
                    f"{S.MEMBERSHIP} says epoch {e}'s workers are {record.epochs[e]['order']}, its manifest {order}",
                    epoch=e,
                )
            )
        for r, p in enumerate(order, 1):
            here.setdefault(p, []).append(f"rank {r} in the client's order")
        if v.logs.get(0) and v.logs[0].header.get("epoch") != e:
            viol.append(
                Violation("structure", f"the client's log says epoch {v.logs[0].header.get('epoch')}", rank=0, epoch=e)
            )
        for r in range(1, n + 1):
            h = v.logs[r].header if r in v.logs else {}
            if not h:
                continue  # a missing or headless log: the epoch's own checks report it
            run.run_checks["membership"] += 1
            p = h.get("participant")
            if h.get("epoch") != e:
                viol.append(Violation("structure", f"the log says epoch {h.get('epoch')}", rank=r, epoch=e))
            if not isinstance(p, int):
                viol.append(Violation("structure", "the log's header names no participant", rank=r, epoch=e))
                continue
            here.setdefault(p, []).append(f"its own log {v.dir.name}/{S.log_name(r)}")
            if isinstance(h.get("pid"), int):
                os_pid.setdefault(p, h["pid"])
            if r <= len(order) and order[r - 1] != p:
                msg = f"the worker at rank {r} says it is worker {p}, the client's order says worker {order[r - 1]}"
                viol.append(Violation("membership", msg, rank=r, epoch=e))
        for path in sorted(v.dir.glob("rank*.jsonl")):
            stem = path.stem[4:]
            if stem.isdigit() and 0 <= int(stem) <= n:
                continue
            h = _header(path)
            viol.append(Violation("structure", f"{v.dir.name}/{path.name} is not in the epoch's manifest", epoch=e))
            if isinstance(h.get("participant"), int):
                here.setdefault(h["participant"], []).append(f"a log {v.dir.name}/{path.name}")
        present[e] = here
        check_measured_processes(run, v)

    # departures: every one recorded, every recorded one real
    departed: dict[int, tuple[int, str]] = {}  # participant -> (epoch it left before, why)
    for v in views:
        e = v.epoch
        left = record.left_at(e) if record is not None else {}
        if e == 0:
            if left:
                viol.append(Violation("structure", f"{S.MEMBERSHIP} has workers leave before epoch 0", epoch=0))
            continue
        before, now = present.get(e - 1, {}), present.get(e, {})
        for p, why in left.items():
            run.run_checks["membership"] += 1
            if p in departed:
                viol.append(Violation("structure", f"worker {p} is recorded to leave twice", epoch=e))
            elif p not in before:
                viol.append(
                    Violation(
                        "structure",
                        f"worker {p} is recorded to leave before epoch {e}, but did not take part in epoch {e - 1}",
                        epoch=e,
                    )
                )
            departed.setdefault(p, (e, why))
        for p in sorted(set(before) - set(now) - set(left)):
            run.run_checks["membership"] += 1
            msg = (
                f"worker {p} took part in epoch {e - 1} and not in epoch {e}, and {S.MEMBERSHIP} does not say why "
                "(revoked or lost)"
            )
            viol.append(Violation("membership", msg, epoch=e))

    net = _departed_counts(run, d, manifest)
    for p, (e0, why) in sorted(departed.items()):
        who = f"worker {p} ({WHY[why]} before epoch {e0})"
        findings = []
        for v in views:
            if v.epoch < e0:
                continue
            n = int(v.manifest["workers"])
            run.run_checks["membership"] += 2
            for where in present.get(v.epoch, {}).get(p, []):
                findings.append(f"{who} takes part in epoch {v.epoch}: {where}")
            listed = v.manifest.get("order")
            order = listed if isinstance(listed, list) else []
            ranks = {r for r, q in enumerate(order, 1) if q == p}
            ranks |= {r for r in range(1, n + 1) if r in v.logs and v.logs[r].header.get("participant") == p}
            if 0 in v.logs:
                s, rcv, ops, beyond = _client_addresses(v.logs[0], ranks, n)
                if s or rcv:
                    findings.append(
                        f"the client sent {s:,} elements to and received {rcv:,} from {who} in epoch "
                        f"{v.epoch} ({', '.join(ops[:4])}{', ...' if len(ops) > 4 else ''})"
                    )
                if beyond:
                    findings.append(
                        f"the client addressed rank(s) {sorted(beyond)}, which epoch {v.epoch} does not have"
                    )
        kernel = None
        if net is not None:
            run.run_checks["membership"] += 1
            m = net.get(str(p))
            if not isinstance(m, dict):
                findings.append(f"{who}: the run's socket counts do not cover its process")
            else:
                try:
                    kernel = {
                        "os_pid": int(m["os_pid"]),
                        "sent": int(m["sent"]),
                        "received": int(m["received"]),
                        "sockets": int(m.get("sockets", 0)),
                    }
                except (KeyError, TypeError, ValueError):
                    findings.append(f"{who}: unreadable socket counts")
                if kernel is not None and p in os_pid and kernel["os_pid"] != os_pid[p]:
                    findings.append(
                        f"{who}: the socket counts are of process {kernel['os_pid']}, its own logs "
                        f"say it ran as process {os_pid[p]}"
                    )
                if kernel is not None and (kernel["sent"] or kernel["received"]):
                    findings.append(
                        f"{who}: its process (pid {kernel['os_pid']}) received {kernel['received']:,} B "
                        f"and sent {kernel['sent']:,} B on its sockets after it left (kernel counters, "
                        "heartbeats excluded)"
                    )
        for f in findings:
            viol.append(Violation("membership", f, epoch=e0))
        run.departures.append(
            {
                "participant": p,
                "epoch": e0,
                "why": WHY[why],
                "absent": not findings,
                "kernel": kernel,
                "findings": len(findings),
            }
        )
    if departed and net is None:
        run.notes.append("the departed workers' socket bytes were not measured (no run-level netcount.json)")


def _departed_counts(run: RunResult, d: Path, manifest: dict) -> dict | None:
    """The run-level netcount.json's `departed` map (participant -> counts), digest checked."""
    path = d / S.NETCOUNT
    if not _digest(run, path, manifest.get("netcount_sha256"), f"run-level {S.NETCOUNT}") and not path.is_file():
        return None
    try:
        departed = json.loads(path.read_text())["departed"]
        if not isinstance(departed, dict):
            raise TypeError("departed is not an object")
        return departed
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        run.run_violations.append(Violation("structure", f"unreadable run-level {S.NETCOUNT} ({type(e).__name__})"))
        return {}


def check_measured_processes(run: RunResult, v: EpochView) -> None:
    """The epoch's socket counts are of the processes whose logs they are checked against."""
    path = v.dir / S.NETCOUNT
    if not path.is_file():
        return
    try:
        ranks = json.loads(path.read_text())["ranks"]
        items = [(int(r), m.get("pid")) for r, m in ranks.items()]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return  # the epoch's os_bytes check reports an unreadable file
    for r, pid in items:
        h = v.logs[r].header if r in v.logs else {}
        if not h:
            continue
        run.run_checks["os_bytes"] += 1
        if pid != h.get("pid"):
            msg = f"{S.NETCOUNT} counted process {pid} for rank {r}, whose log says it is process {h.get('pid')}"
            run.run_violations.append(Violation("os_bytes", msg, rank=r, epoch=v.epoch))


def replay_steps(run: RunResult, views: list[EpochView], record: Record | None) -> None:
    """Each later epoch starts with the replay of the session's tokens (when one was open): its first
    step is a prefill of exactly those tokens, checked like any step (no worker holds every
    coordinate of a protected role during it)."""
    if record is None:
        return
    by_epoch = {v.epoch: (v, res) for v, res in zip(views, run.epochs, strict=False)}
    for e in range(1, len(record.epochs)):
        tokens = record.epochs[e]["replayed_tokens"]
        if not tokens or e not in by_epoch:
            continue
        v, res = by_epoch[e]
        steps = v.logs[0].steps if 0 in v.logs else []
        run.run_checks["structure"] += 1
        first = steps[0] if steps else {}
        if first.get("t") != tokens or first.get("pos") != 0:
            msg = (
                f"the epoch's first step runs {first.get('t')} tokens at position {first.get('pos')}, not the "
                f"replay of the session's {tokens} tokens"
            )
            run.run_violations.append(Violation("structure", msg, rank=0, epoch=e))
            continue
        key = (first.get("session"), first.get("step"))
        in_step = [x for x in res.violations if (x.session, x.step) == key]
        run.replays.append(
            {
                "epoch": e,
                "session": key[0],
                "step": key[1],
                "tokens": tokens,
                "closed": key not in res.unclosed,
                "violations": len(in_step),
                "no_full_holder_violations": sum(x.invariant == "no_full_holder" for x in in_step),
            }
        )
