"""The masked mode's audit: per-rank logs of every transfer, a tap of what group A received, and an
independent verifier with an exposure report (what each party saw).

Log files in the audit directory (one per rank, JSON lines):
  masked-rank{R}.jsonl   header {rank, role, group, n_a, n_b}; event {kind, op, to, from, itemsize}
                         (every comm verb, as comm.py reported it); session {index, key_id} and
                         mask {session, step, layer, op} (client: every mask drawn); step; end
  masked-rank{R}.tap     group A: the raw int64 payload of every "masked" message it received, in
                         order; each tap is indexed by a record {op, shape, offset} in the log

Rules the verifier checks (`verify`), reading only the logs and the group sizes in their headers:
  1. no worker-to-worker transfer: every worker event has the client (rank 0) as its only peer;
  2. group A receives only control words and "masked" ring elements; group B receives only control
     words and session keys; the client's own log agrees (what it sent to A and B, by kind);
  3. workers send the client only "control", "meta" (public weight metadata) and "ring_out";
     no transfer of any other kind (clear state: ingress, egress, gather, ...) exists anywhere;
  4. masks are fresh: no (session, step, layer, op) label drawn twice, no session key reused;
  5. A's tap looks uniform: every bit position is set with frequency 1/2 (6σ), and masked vectors
     are fresh (pairs of elements, within and across steps, differ by less than 2^56 no more often
     than the 2^-7 of independent uniform words, 6σ). A clear or reused-mask view fails both.

The logs are not hash-chained (the structural audit's are); the rules above are what the masked
mode adds. Negative controls (tests): masks "zero" fails rule 5, leak "a-to-b" fails rules 1-2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

A_IN = {"control", "masked"}
B_IN = {"control", "key"}
WORKER_OUT = {"control", "meta", "ring_out"}
FRESH_BITS = 56  # |a - b| < 2^56 happens with probability 2^-7 for independent uniform words
SIGMAS = 6.0


def log_path(d: str | Path, rank: int) -> Path:
    return Path(d) / f"masked-rank{rank}.jsonl"


def tap_path(d: str | Path, rank: int) -> Path:
    return Path(d) / f"masked-rank{rank}.tap"


class AuditLog:
    """One rank's masked audit log; also comm's `Recorder`."""

    def __init__(self, audit_dir: str | Path, rank: int, role: str, group: str | None, n_a: int, n_b: int):
        d = Path(audit_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f = open(log_path(d, rank), "w", buffering=1 << 20)
        self._tap = open(tap_path(d, rank), "wb") if group == "A" else None
        self._tap_at = 0
        self._write({"type": "header", "rank": rank, "role": role, "group": group, "n_a": n_a, "n_b": n_b})

    def _write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def record(self, event) -> None:
        to = {r: n for r, n in enumerate(event.sent) if n}
        frm = {r: n for r, n in enumerate(event.received) if n}
        self._write(
            {"type": "event", "kind": event.kind, "op": event.op, "to": to, "from": frm, "itemsize": event.itemsize}
        )

    def tap(self, op: str, tensor: torch.Tensor) -> None:
        if self._tap is None:
            return
        data = tensor.contiguous().numpy().astype("<i8", copy=False).tobytes()
        self._tap.write(data)
        self._write({"type": "tap", "op": op, "shape": list(tensor.shape), "offset": self._tap_at})
        self._tap_at += len(data)

    def session(self, index: int, key_id: str) -> None:
        self._write({"type": "session", "index": index, "key_id": key_id})

    def mask(self, session: int, step: int, layer: int, op: int) -> None:
        self._write({"type": "mask", "session": session, "step": step, "layer": layer, "op": op})

    def end_step(self) -> None:
        self._write({"type": "step"})

    def close(self) -> None:
        if self._f.closed:
            return
        self._write({"type": "end"})
        self._f.close()
        if self._tap is not None:
            self._tap.close()


# ---- reading ----


def read_log(d: str | Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in log_path(d, rank).read_text().splitlines() if line]


def read_tap(d: str | Path, rank: int) -> list[tuple[str, np.ndarray]]:
    """Group A's received masked messages, in order: (op name, int64 array (K, T))."""
    raw = tap_path(d, rank).read_bytes()
    out = []
    for rec in read_log(d, rank):
        if rec["type"] == "tap":
            k, t = rec["shape"]
            out.append((rec["op"], np.frombuffer(raw, dtype="<i8", count=k * t, offset=rec["offset"]).reshape(k, t)))
    return out


# ---- statistics of a view ----


def bit_balance(words: np.ndarray) -> np.ndarray:
    """Fraction of ones at each of the 64 bit positions (uniform words: 0.5 each)."""
    u = np.ascontiguousarray(words, dtype="<i8").view("<u8").ravel()
    return np.array([float(((u >> np.uint64(b)) & np.uint64(1)).mean()) for b in range(64)])


def byte_chi2(words: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic of the byte histogram against uniform, and its degrees of freedom (255)."""
    counts = np.bincount(np.ascontiguousarray(words, dtype="<i8").view(np.uint8).ravel(), minlength=256)
    expected = counts.sum() / 256
    return float(((counts - expected) ** 2 / expected).sum()), 255


def close_fraction(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Fraction of element pairs with |a - b mod 2^64| < 2^56 (signed): 2^-7 if independent uniform,
    ~1 if they share a mask (a - b is then a difference of small fixed-point values)."""
    d = (a.astype("<i8").view("<u8") - b.astype("<i8").view("<u8")).view("<i8")
    lim = 1 << FRESH_BITS
    return float(((d > -lim) & (d < lim)).mean()), d.size


def freshness(tapped: list[tuple[str, np.ndarray]]) -> dict:
    """Masks fresh per element and per step: close-pair rates within vectors (neighbouring elements)
    and across steps (the same op's vectors of consecutive messages), with their 6σ limits."""
    p = 2.0**-7
    within_a, within_b, across_a, across_b = [], [], [], []
    last: dict[str, np.ndarray] = {}
    for op, m in tapped:
        within_a.append(m[:-1].ravel())
        within_b.append(m[1:].ravel())
        if op in last:
            prev = last[op]
            k, t = min(prev.shape[0], m.shape[0]), min(prev.shape[1], m.shape[1])
            across_a.append(prev[:k, :t].ravel())
            across_b.append(m[:k, :t].ravel())
        last[op] = m
    out = {}
    for name, xa, xb in (("within", within_a, within_b), ("across_steps", across_a, across_b)):
        if not xa:
            out[name] = {"pairs": 0, "close_fraction": None, "limit": None, "ok": True}
            continue
        frac, n = close_fraction(np.concatenate(xa), np.concatenate(xb))
        limit = p + SIGMAS * math.sqrt(p * (1 - p) / n)
        out[name] = {"pairs": n, "close_fraction": frac, "limit": limit, "ok": frac <= limit}
    return out


def uniformity(words: np.ndarray) -> dict:
    n = words.size
    bal = bit_balance(words)
    dev = float(np.abs(bal - 0.5).max())
    limit = SIGMAS * 0.5 / math.sqrt(max(n, 1))
    chi2, dof = byte_chi2(words)
    chi_limit = dof + SIGMAS * math.sqrt(2 * dof)
    return {
        "words": int(n),
        "bit_frequency_min": float(bal.min()),
        "bit_frequency_max": float(bal.max()),
        "max_deviation": dev,
        "limit": limit,
        "byte_chi2": chi2,
        "byte_chi2_limit": chi_limit,
        "ok": dev <= limit and chi2 <= chi_limit,
    }


# ---- the verifier ----


def _peers(rec: dict) -> set[int]:
    return {int(r) for r in rec["to"]} | {int(r) for r in rec["from"]}


def verify(audit_dir: str | Path) -> dict:
    """Check the rules of the module docstring; returns {"ok", "violations", "parties"}."""
    d = Path(audit_dir)
    client = read_log(d, 0)
    head = client[0]
    n_a, n_b = head["n_a"], head["n_b"]
    a_ranks, b_ranks = set(range(1, n_a + 1)), set(range(n_a + 1, n_a + n_b + 1))
    violations: list[str] = []
    parties: dict[str, dict] = {}

    def tally(events: list[dict], field: str) -> dict:
        out: dict[str, dict] = {}
        for e in events:
            for r, n in e[field].items():
                key = f"{e['kind']}@{r}"
                slot = out.setdefault(key, {"messages": 0, "bytes": 0})
                slot["messages"] += 1
                slot["bytes"] += n * e["itemsize"]
        return out

    for rank in sorted(a_ranks | b_ranks):
        recs = read_log(d, rank)
        group = "A" if rank in a_ranks else "B"
        if recs[0].get("group") != group:
            violations.append(f"rank {rank}: log says group {recs[0].get('group')}, sizes {n_a}+{n_b} say {group}")
        events = [r for r in recs if r["type"] == "event"]
        allowed_in = A_IN if group == "A" else B_IN
        for e in events:
            if _peers(e) - {0}:
                violations.append(
                    f"rank {rank} ({group}): {e['kind']} {e['op']} with worker(s) {sorted(_peers(e) - {0})}"
                )
            if e["from"] and e["kind"] not in allowed_in:
                violations.append(
                    f"rank {rank} ({group}) received {e['kind']} {e['op']} (allowed: {sorted(allowed_in)})"
                )
            if e["to"] and e["kind"] not in WORKER_OUT:
                violations.append(f"rank {rank} ({group}) sent {e['kind']} {e['op']} (allowed: {sorted(WORKER_OUT)})")
        party = {"group": group, "received": tally(events, "from"), "sent": tally(events, "to"),
                 "steps": sum(r["type"] == "step" for r in recs)}  # fmt: skip
        if group == "A":
            tapped = read_tap(d, rank)
            if tapped:
                words = np.concatenate([m.ravel() for _, m in tapped])
                party["uniformity"] = uni = uniformity(words)
                party["freshness"] = fresh = freshness(tapped)
                if not uni["ok"]:
                    violations.append(f"rank {rank} (A): received data is not uniform ({uni})")
                for name, f in fresh.items():
                    if not f["ok"]:
                        violations.append(f"rank {rank} (A): masks not fresh {name} ({f})")
            party["saw"] = "ring elements x_fx + r (uniform); control words with T"
        else:
            party["saw"] = "session keys and step numbers: the masks, never data"
        parties[f"rank{rank}"] = party

    events = [r for r in client if r["type"] == "event"]
    for e in events:
        for r in map(int, e["to"]):
            ok = A_IN if r in a_ranks else B_IN
            if e["kind"] not in ok:
                violations.append(f"client sent {e['kind']} {e['op']} to rank {r} (allowed: {sorted(ok)})")
    labels = [(r["session"], r["step"], r["layer"], r["op"]) for r in client if r["type"] == "mask"]
    if len(set(labels)) != len(labels):
        violations.append(f"mask labels reused: {len(labels) - len(set(labels))} of {len(labels)}")
    keys = [r["key_id"] for r in client if r["type"] == "session"]
    if len(set(keys)) != len(keys):
        violations.append("a session key was reused")
    parties["rank0"] = {"group": None, "received": tally(events, "from"), "sent": tally(events, "to"),
                        "sessions": len(keys), "masks_drawn": len(labels),
                        "saw": "everything, in the clear: tokens, residual, q/k/v, KV cache, activations, logits"}  # fmt: skip
    return {"ok": not violations, "violations": violations, "parties": parties}
