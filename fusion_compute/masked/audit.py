"""The masked mode's audit: per-rank logs of every transfer, a tap of what group A received, and an
independent verifier with an exposure report (what each party saw).

Log files in the audit directory (one per rank and epoch, JSON lines; epochs after the first:
masked-epoch{E}-rank{R}.*; the client keeps one log for the whole job, and records each epoch's
group sizes in it):
  masked-rank{R}.jsonl   header {rank, role, group, groups: [n_A, n_B1, ...], verify}; event {kind,
                         op, to, from, itemsize} (every comm verb, as comm.py reported it); client
                         only: epoch {epoch, groups, order}, session {index, key_ids: one per
                         mask group}, mask {session, step, layer, op} (every mask drawn), check {session, step, layer, op, tokens, ok}
                         (every product verified) and detection {..., blamed: [[group, member,
                         rank, participant]]} (a product that failed); step; end
  masked-rank{R}.tap     group A: the raw int64 payload of every "masked" message it received, in
                         order; each tap is indexed by a record {op, shape, offset} in the log

Rules the verifier checks (`verify`), reading only the logs and the group sizes in their headers:
  1. no worker-to-worker transfer: every worker event has the client (rank 0) as its only peer;
  2. group A receives only control words and "masked" ring elements; a mask group (B, B1..Bk)
     receives only control words and session keys; the client's own log agrees (what it sent to
     each group, by kind);
  3. workers send the client only "control", "meta" (public weight metadata) and "ring_out";
     no transfer of any other kind (clear state: ingress, egress, gather, ...) exists anywhere;
  4. masks are fresh: no (session, step, layer, op) label drawn twice, no session key reused;
  5. A's tap looks uniform: every bit position is set with frequency 1/2 (6σ), and masked vectors
     are fresh: pooled over the tap, pairs of neighbouring elements and each linear's message
     against the same linear's previous one differ by less than 2^56 no more often than the 2^-7
     of independent uniform words (6σ); and no two messages of a member's whole view (every epoch
     it sat in A, whatever its rank: `verify`'s "a_views") share a pad: any pair whose words in
     pad order, past the first 32 up to the shorter one's length, are more than half that close
     fails (`pad_reuse`: buckets on top bytes find the candidate pairs in O(M log M) for M
     messages, not M^2). A clear view fails all three. A pad reused by the same linear in the next
     message fails the any-pair test, and the consecutive one too when both messages have the same
     width T (it compares in (K, T) layout; kept: pooled over every consecutive pair, it also sees
     a correlation too weak to show in any one pair); one reused across sessions (a repeated key,
     which rule 4 also names) or from any earlier step fails the any-pair test.
     Not seen: a weak key (its masks are uniform, fresh ChaCha20 output: A reads the data by
     trying every key, tests/test_redteam_masked.py); a pad reused in only some words of a pair,
     under half of them; pads shared between two members of A (each view is checked alone; every
     member receives the same message by design); messages under 64 words (counted as short).
  6. with verification on (the header says so), every product the client drew a mask for was
     checked: a check record for every mask label. Failed checks are reported as detections
     (who was blamed), not as violations: the client refused the product.

The logs are not hash-chained (the structural audit's are); the rules above are what the masked
mode adds. Negative controls (tests): masks "zero" fails rule 5, leak "a-to-b" fails rules 1-2, a
client log with its check records removed fails rule 6.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from .plan import LINEARS, mask_group_names

A_IN = {"control", "masked"}
B_IN = {"control", "key"}
WORKER_OUT = {"control", "meta", "ring_out"}
FRESH_BITS = 56  # |a - b| < 2^56 happens with probability 2^-7 for independent uniform words
SIGMAS = 6.0


def log_path(d: str | Path, rank: int, epoch: int = 0) -> Path:
    """A rank's log of one epoch (the client keeps one log for the job: rank 0, epoch 0)."""
    return Path(d) / (f"masked-rank{rank}.jsonl" if epoch == 0 else f"masked-epoch{epoch}-rank{rank}.jsonl")


def tap_path(d: str | Path, rank: int, epoch: int = 0) -> Path:
    return log_path(d, rank, epoch).with_suffix(".tap")


class AuditLog:
    """One rank's masked audit log; also comm's `Recorder`."""

    def __init__(
        self,
        audit_dir: str | Path,
        rank: int,
        role: str,
        group: str | None,
        sizes: tuple[int, ...],
        verify: bool | None = None,
        epoch: int = 0,
    ):
        d = Path(audit_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f = open(log_path(d, rank, epoch), "w", buffering=1 << 20)
        # Unbuffered: each tap's bytes reach the file before its index record is even written to the
        # log's buffer, so a log that a killed worker left behind never points past its tap's end.
        self._tap = open(tap_path(d, rank, epoch), "wb", buffering=0) if group == "A" else None
        self._tap_at = 0
        self._write(
            {"type": "header", "rank": rank, "role": role, "group": group, "groups": list(sizes), "verify": verify}
        )

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

    def epoch(self, epoch: int, sizes: tuple[int, ...], order: list[int]) -> None:
        """The client opened an epoch: its group sizes (ranks follow them) and participants."""
        self._write({"type": "epoch", "epoch": epoch, "groups": list(sizes), "order": order})

    def session(self, index: int, key_ids: list[str]) -> None:
        self._write({"type": "session", "index": index, "key_ids": key_ids})

    def mask(self, session: int, step: int, layer: int, op: int) -> None:
        self._write({"type": "mask", "session": session, "step": step, "layer": layer, "op": op})

    def check(self, session: int, step: int, layer: int, op: int, tokens: int, ok: bool) -> None:
        self._write(
            {"type": "check", "session": session, "step": step, "layer": layer, "op": op, "tokens": tokens, "ok": ok}
        )

    def detection(self, session: int, step: int, layer: int, op: int, blamed: list[list]) -> None:
        self._write({"type": "detection", "session": session, "step": step, "layer": layer, "op": op, "blamed": blamed})
        self._f.flush()  # the job may end here: what was caught must reach the disk

    def end_step(self) -> None:
        self._write({"type": "step"})

    def flush(self) -> None:
        """Write out what is buffered (a process about to exit at once)."""
        self._f.flush()
        if self._tap is not None:
            self._tap.flush()

    def close(self) -> None:
        if self._f.closed:
            return
        self._write({"type": "end"})
        self._f.close()
        if self._tap is not None:
            self._tap.close()


# ---- reading ----


class MaskedAuditError(ValueError):
    """A log that cannot be read at all (not JSON records): no verdict can be given."""


def read_log(d: str | Path, rank: int, epoch: int = 0) -> list[dict]:
    path = log_path(d, rank, epoch)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise MaskedAuditError(f"{path}: line {n} is not a JSON record ({e.msg})") from None
        if not isinstance(rec, dict) or "type" not in rec:
            raise MaskedAuditError(f"{path}: line {n} is not a log record")
        out.append(rec)
    return out


def read_tap(d: str | Path, rank: int, epoch: int = 0) -> list[tuple[str, np.ndarray]]:
    """Group A's received masked messages, in order: (op name, int64 array (K, T))."""
    path = tap_path(d, rank, epoch)
    raw = path.read_bytes()
    out = []
    for rec in read_log(d, rank, epoch):
        if rec["type"] == "tap":
            k, t = rec["shape"]
            if rec["offset"] + 8 * k * t > len(raw):
                raise MaskedAuditError(f"{path}: the log indexes bytes past the tap's end ({len(raw)} bytes)")
            out.append((rec["op"], np.frombuffer(raw, dtype="<i8", count=k * t, offset=rec["offset"]).reshape(k, t)))
    return out


# ---- statistics of a view ----


BYTE_CHUNK = 1 << 16  # words per pass of byte_counts: its int16 copy (1 MiB) stays in cache


def byte_counts(words: np.ndarray) -> np.ndarray:
    """(8, 256) int64: how often each byte value occurs at each byte position j of the little-endian
    words (byte j holds bits 8j..8j+7). One histogram of (position, value) per chunk of words: both
    statistics below are sums of it, so the view is read once, not 64 + 1 times (on the taps of a
    masked SmolLM2 run, 4.3 M words, loaded machine: 7-9 s a view that way, 0.4 s this way)."""
    b = np.ascontiguousarray(words, dtype="<i8").view(np.uint8).reshape(-1, 8)
    offset = np.arange(8, dtype=np.int16) * 256  # position j's values are bins 256j .. 256j + 255
    counts = np.zeros(8 * 256, dtype=np.int64)
    for start in range(0, len(b), BYTE_CHUNK):
        counts += np.bincount((b[start : start + BYTE_CHUNK] + offset).ravel(), minlength=8 * 256)
    return counts.reshape(8, 256)


# BITS[v, k]: bit k of the byte value v.
BITS = (np.arange(256)[:, None] >> np.arange(8)) & 1


def bit_balance(words: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
    """Fraction of ones at each of the 64 bit positions (uniform words: 0.5 each): bit 8j + k is set
    in every word whose byte j has bit k, so its count is byte position j's histogram summed over
    the values with bit k. `counts`: byte_counts(words), where the caller has it already."""
    counts = byte_counts(words) if counts is None else counts
    ones = (counts @ BITS).ravel()  # (8 byte positions, 8 bits) -> bit 8j + k
    return ones / max(np.asarray(words).size, 1)


def byte_chi2(words: np.ndarray, counts: np.ndarray | None = None) -> tuple[float, int]:
    """Chi-square statistic of the byte histogram against uniform, and its degrees of freedom (255)."""
    counts = (byte_counts(words) if counts is None else counts).sum(axis=0)
    expected = counts.sum() / 256
    return float(((counts - expected) ** 2 / expected).sum()), 255


def close_fraction(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Fraction of element pairs with |a - b mod 2^64| < 2^56 (signed): 2^-7 if independent uniform,
    ~1 if they share a mask (a - b is then a difference of small fixed-point values)."""
    u = np.asarray(a, dtype="<i8").view("<u8") - np.asarray(b, dtype="<i8").view("<u8")  # a - b mod 2^64
    lim = 1 << FRESH_BITS
    u += np.uint64(lim - 1)  # -lim < a - b < lim (signed) is a - b + lim - 1 < 2 lim - 1 (unsigned): one test
    return float(np.count_nonzero(u < np.uint64(2 * lim - 1)) / max(u.size, 1)), u.size


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
    out: dict[str, dict[str, float | bool | None]] = {}
    for name, xa, xb in (("within", within_a, within_b), ("across_steps", across_a, across_b)):
        if not xa:
            out[name] = {"pairs": 0, "close_fraction": None, "limit": None, "ok": True}
            continue
        frac, n = close_fraction(np.concatenate(xa), np.concatenate(xb))
        limit = p + SIGMAS * math.sqrt(p * (1 - p) / n)
        out[name] = {"pairs": n, "close_fraction": frac, "limit": limit, "ok": frac <= limit}
    return out


# ---- rule 5, any pair: one pad under two messages anywhere in a member's view ----

KEY_GROUPS = 4  # top bytes of KEY_GROUPS consecutive pad words make one bucket key
KEY_SETS = 8  # independent keys per message: words 0..31 in pad order, 8 groups of 4
KEY_WORDS = KEY_GROUPS * KEY_SETS
MIN_WORDS = 2 * KEY_WORDS  # a message keys on its first 32 pad words and is confirmed on the rest
REUSED_FRACTION = 0.5  # a candidate pair is one pad when more than half its confirming words are close


def pad_reuse(view: list[np.ndarray], max_candidates: int | None = None) -> dict:
    """Whether any two messages of one member's view share a pad, at near-linear cost in their number.

    A message (K, T) carries pad word k T + t at element [k, t] (row-major: pad order, whatever T),
    so two messages under one pad have, word for word in pad order, a - b = x - x' mod 2^64 with
    |x|, |x'| < 2^52: |a - b| < 2^56 in every word; independent pads: in 2^-7 of words. Comparing
    all pairs is quadratic; instead, |a - b| < 2^56 means the two words' top bytes are equal or
    adjacent mod 256, so each message is keyed, for each of KEY_SETS sets s, by the top bytes of
    its pad words 4s..4s+3, and probes the 3^4 keys next to its own (each byte -1, 0 or +1): a pair
    under one pad is a candidate in every set (every word close), and a pair close in only some
    words still in any set whose four words are. Each candidate is then confirmed on its words past
    KEY_WORDS (independent of the keys that chose it), up to the shorter message's length: the pair
    shares a pad when more than REUSED_FRACTION of them are close (a reused pad: all of them).

    Cost and false alarms, for M messages under independent uniform pads: a pair lands in a probed
    bucket of one set with chance (3/256)^4 = 1.9e-8 (four top bytes, each within ±1 of the
    other's), so over KEY_SETS sets and M^2 / 2 pairs the expected candidates are at most
    8 (3/256)^4 M^2 / 2 = 7.5e-8 M^2 (750 for M = 100,000), each confirmed in O(its words);
    sorting and probing the keys is O(M log M). A candidate is falsely confirmed when more than
    half of its n >= 32 confirming words are close: chance at most C(n, n/2) (2^-7)^(n/2) <=
    2^n 2^(-3.5 n) = 2^(-2.5 n) <= 2^-80 each, so 7.5e-8 M^2 2^-80: no false alarm at any M an
    audit meets. Rule 5's pooled 6σ limit (FRESH_BITS, SIGMAS), applied to one pair's n words,
    would not do here: Binomial(n, 2^-7) passes it with chance 2.7e-4 at n = 40 and 2.0e-4 at
    n = 68, so a view of 100,000 messages (~750 candidates) would fail at random; a reused pad is
    close in every word, so the half-way limit loses nothing against it. A view far from uniform
    (no masks) puts its messages in a few buckets: past 2 `max_candidates` probe hits (default
    max_candidates 4 M + 1024; uniform pads give ~1.5e-7 M^2 hits) the pairs are not confirmed and
    the view fails as not fresh. Messages shorter than MIN_WORDS pad words are not keyed (counted as
    `short`; a linear's input has K >= the hidden size words, so none in a real run)."""
    flat = [np.ascontiguousarray(m).reshape(-1).view("<u8") for m in view]
    idx = np.array([i for i, w in enumerate(flat) if w.size >= MIN_WORDS], dtype=np.int64)
    m = len(idx)
    out: dict = {"messages": len(flat), "short": len(flat) - m, "probe_hits": 0, "candidates": 0, "reused": []}
    if m < 2:
        out["ok"] = True
        return out
    cap = 4 * m + 1024 if max_candidates is None else max_candidates
    top_bytes = np.stack([flat[i][:KEY_WORDS] for i in idx]) >> np.uint64(56)  # (m, 32)
    top = top_bytes.astype(np.int64).reshape(m, KEY_SETS, KEY_GROUPS)
    pairs = []
    total = 0
    for s in range(KEY_SETS):
        # the 3 neighbouring values of each top byte, in its place of the packed key: (m, 4, 3)
        near = (((top[:, s, :, None] + np.array([-1, 0, 1])) % 256) << (8 * np.arange(KEY_GROUPS))[:, None]).astype(
            np.uint32
        )  # 32-bit keys: half the memory traffic of the probes
        keys = near[:, :, 1].sum(axis=1, dtype=np.uint32)  # (m,) the message's own key
        probes = near[:, 0, :, None, None, None]  # every sum of one neighbour per byte: (m, 3, 3, 3, 3)
        for g in range(1, KEY_GROUPS):
            probes = probes + near[:, g, :].reshape((m,) + (1,) * g + (3,) + (1,) * (KEY_GROUPS - 1 - g))
        probes = probes.reshape(-1)  # (m 3^4,): message i's probes at i 3^4 .. i 3^4 + 80
        order = np.argsort(keys, kind="stable")
        bucket, start, size = np.unique(keys[order], return_index=True, return_counts=True)
        at = np.minimum(np.searchsorted(bucket, probes), len(bucket) - 1)
        n = np.where(bucket[at] == probes, size[at], 0)
        total += int(n.sum()) - m  # every message finds itself once
        if total > 2 * cap:  # both orders of each pair: the view is far from uniform
            break
        hit = np.flatnonzero(n)
        counts = n[hit]
        first = np.repeat(hit // 3**KEY_GROUPS, counts)
        starts = np.repeat(start[at[hit]] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        second = order[starts + np.arange(int(counts.sum()))]
        keep = first < second
        pairs.append(first[keep] * m + second[keep])
    out["probe_hits"] = total  # each candidate pair once per order and per set it matched in
    if total > 2 * cap:
        out["ok"] = False
        out["note"] = f"over {cap} candidate pairs: the view's top bytes are far from uniform"
        return out
    codes = np.unique(np.concatenate(pairs)) if pairs else np.empty(0, dtype=np.int64)
    out["candidates"] = len(codes)
    for code in codes.tolist():
        i, j = int(idx[code // m]), int(idx[code % m])
        n_words = min(flat[i].size, flat[j].size)
        frac, words = close_fraction(flat[i][KEY_WORDS:n_words].view("<i8"), flat[j][KEY_WORDS:n_words].view("<i8"))
        if frac > REUSED_FRACTION:
            out["reused"].append({"messages": [i, j], "close_fraction": frac, "words": words})
    out["ok"] = not out["reused"]
    return out


def uniformity(words: np.ndarray) -> dict:
    n = words.size
    counts = byte_counts(words)
    bal = bit_balance(words, counts)
    dev = float(np.abs(bal - 0.5).max())
    limit = SIGMAS * 0.5 / math.sqrt(max(n, 1))
    chi2, dof = byte_chi2(words, counts)
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


def _tally(events: list[dict], field: str) -> dict:
    out: dict[str, dict] = {}
    for e in events:
        for r, n in e[field].items():
            key = f"{e['kind']}@{r}"
            slot = out.setdefault(key, {"messages": 0, "bytes": 0})
            slot["messages"] += 1
            slot["bytes"] += n * e["itemsize"]
    return out


def groups_by_rank(sizes: list[int]) -> dict[int, str]:
    """{rank: group} of an epoch whose group sizes are `sizes` (A first, then the mask groups)."""
    out, first = {}, 1
    for g, n in zip(("A", *mask_group_names(len(sizes) - 1)), sizes, strict=True):
        out.update({r: g for r in range(first, first + n)})
        first += n
    return out


def _verify_worker(
    d: Path, epoch: int, rank: int, group: str, spec: str, violations: list[str], view: list | None = None
) -> dict:
    """Rules 1-3 and 5 on one worker's log of one epoch; returns its party entry. A member of A's
    messages, each with where it was received (epoch, rank, op), are appended to `view`: its view
    across epochs, for rule 5's any-pair check."""
    who = f"rank {rank} ({group})" if epoch == 0 else f"epoch {epoch} rank {rank} ({group})"
    if not log_path(d, rank, epoch).is_file():
        violations.append(f"{who}: no log")
        return {"group": group}
    recs = read_log(d, rank, epoch)
    if not recs or recs[0].get("type") != "header":
        violations.append(f"{who}: its log is empty or starts without a header")
        return {"group": group}
    if recs[0].get("group") != group:
        violations.append(f"{who}: log says group {recs[0].get('group')}, sizes {spec} say {group}")
    events = [r for r in recs if r["type"] == "event"]
    allowed_in = A_IN if group == "A" else B_IN
    for e in events:
        if _peers(e) - {0}:
            violations.append(f"{who}: {e['kind']} {e['op']} with worker(s) {sorted(_peers(e) - {0})}")
        if e["from"] and e["kind"] not in allowed_in:
            violations.append(f"{who} received {e['kind']} {e['op']} (allowed: {sorted(allowed_in)})")
        if e["to"] and e["kind"] not in WORKER_OUT:
            violations.append(f"{who} sent {e['kind']} {e['op']} (allowed: {sorted(WORKER_OUT)})")
    party = {
        "group": group,
        "received": _tally(events, "from"),
        "sent": _tally(events, "to"),
        "steps": sum(r["type"] == "step" for r in recs),
    }
    if group == "A":
        tapped = read_tap(d, rank, epoch)
        if view is not None:
            view.extend((epoch, rank, op, m) for op, m in tapped)
        if tapped:
            words = np.concatenate([m.ravel() for _, m in tapped])
            party["uniformity"] = uni = uniformity(words)
            party["freshness"] = fresh = freshness(tapped)
            if not uni["ok"]:
                violations.append(f"{who}: received data is not uniform ({uni})")
            for name, f in fresh.items():
                if not f["ok"]:
                    violations.append(f"{who}: masks not fresh {name} ({f})")
        party["saw"] = "ring elements x_fx + r (uniform); control words with T"
    else:
        party["saw"] = "its group's session keys and step numbers: its masks, never data"
    return party


def _verify_view(who: int, view: list, violations: list[str]) -> dict:
    """Rule 5's any-pair check on one member of A's whole view (every epoch it sat in A)."""
    seats = sorted({(e, r) for e, r, _, _ in view})
    where = ", ".join(f"rank {r}" if e == 0 else f"epoch {e} rank {r}" for e, r in seats)
    out = pad_reuse([m for _, _, _, m in view])
    out["ranks"] = [list(s) for s in seats]
    if not out["ok"]:
        if out["reused"]:
            first = out["reused"][0]
            i, j = (view[k] for k in first["messages"])
            said = (
                f"{len(out['reused'])} pair(s) of its messages share a pad (first: {i[2]} of epoch {i[0]} rank"
                f" {i[1]} and {j[2]} of epoch {j[0]} rank {j[1]}, close in {first['close_fraction']:.3f} of"
                f" {first['words']} words)"
            )
        else:
            said = out["note"]
        violations.append(f"participant {who} (A; {where}): masks not fresh any_pair: {said}")
    return out


def verify(audit_dir: str | Path) -> dict:
    """Check the rules of the module docstring, epoch by epoch (the client's log says which group
    sizes each epoch had); returns {"ok", "violations", "parties", "epochs", "verification",
    "a_views"} (a_views: rule 5's any-pair check per participant that sat in A)."""
    d = Path(audit_dir)
    client = read_log(d, 0)
    head = client[0]
    violations: list[str] = []
    parties: dict[str, dict] = {}
    epochs = [r for r in client if r["type"] == "epoch"] or [{"epoch": 0, "groups": head["groups"]}]
    views: dict[int, list] = {}  # participant -> [(epoch, rank, op, message)]: a member keeps its view
    for ep in epochs:
        group_of, spec = groups_by_rank(ep["groups"]), "+".join(map(str, ep["groups"]))
        for rank, group in sorted(group_of.items()):
            key = f"rank{rank}" if ep["epoch"] == 0 else f"epoch{ep['epoch']}.rank{rank}"
            who = ep["order"][rank - 1] if ep.get("order") else rank  # the participant seated at rank
            view = views.setdefault(who, []) if group == "A" else None
            parties[key] = _verify_worker(d, ep["epoch"], rank, group, spec, violations, view)
    a_views = {f"participant{who}": _verify_view(who, view, violations) for who, view in sorted(views.items())}

    group_of = groups_by_rank(head["groups"])
    events = []
    for rec in client:  # the client's side of rule 2, with each epoch's groups
        if rec["type"] == "epoch":
            group_of = groups_by_rank(rec["groups"])
        elif rec["type"] == "event":
            events.append(rec)
            for r in map(int, rec["to"]):
                ok = A_IN if group_of.get(r) == "A" else B_IN
                if rec["kind"] not in ok:
                    violations.append(f"client sent {rec['kind']} {rec['op']} to rank {r} (allowed: {sorted(ok)})")
    labels = [(r["session"], r["step"], r["layer"], r["op"]) for r in client if r["type"] == "mask"]
    if len(set(labels)) != len(labels):
        violations.append(f"mask labels reused: {len(labels) - len(set(labels))} of {len(labels)}")
    sessions = [r["key_ids"] for r in client if r["type"] == "session"]
    keys = [k for ids in sessions for k in ids]
    if len(set(keys)) != len(keys):
        violations.append("a session key was reused")
    checks = [r for r in client if r["type"] == "check"]
    detections = [r for r in client if r["type"] == "detection"]
    if head.get("verify"):
        unchecked = set(labels) - {(r["session"], r["step"], r["layer"], r["op"]) for r in checks}
        if unchecked:
            violations.append(f"{len(unchecked)} of {len(labels)} products were never checked (verification on)")
    parties["rank0"] = {
        "group": None,
        "received": _tally(events, "from"),
        "sent": _tally(events, "to"),
        "sessions": len(sessions),
        "masks_drawn": len(labels),
        "saw": "everything, in the clear: tokens, residual, q/k/v, KV cache, activations, logits",
    }
    verification = {
        "on": bool(head.get("verify")),
        "products_checked": len(checks),
        "token_checks": sum(r["tokens"] for r in checks),
        "failed": sum(not r["ok"] for r in checks),
        "detections": [
            {
                "session": r["session"],
                "step": r["step"],
                "op": f"L{r['layer']}.{LINEARS[r['op']]}",
                "blamed": [{"group": g, "member": m, "rank": rk, "participant": p} for g, m, rk, p in r["blamed"]],
            }
            for r in detections
        ],
    }
    return {
        "ok": not violations,
        "violations": violations,
        "parties": parties,
        "verification": verification,
        "epochs": [{"epoch": e["epoch"], "groups": e["groups"], "order": e.get("order")} for e in epochs],
        "a_views": a_views,
    }
