"""The audit log format: files, record kinds, hash chain, coordinate spaces, wire model.

Pure Python (no torch, no runtime imports): the recorder writes it, the independent verifier
reads it. Everything the verifier needs to interpret a log is defined here or in the log itself.

A cold start's directory holds one subdirectory per plan epoch (docs/resilience.md: a revoked or
lost worker ends an epoch; the next one runs over the survivors plus a standby, with new ranks):
  manifest.json   the cold start's manifest: model dimensions, versions, start/end, and the list of
                  epochs with the sha256 of each epoch's manifest.json, of membership.json and of the
                  run-level netcount.json
  membership.json the client's record of the epochs: each epoch's participants in rank order, and
                  who left before it and why (revoked by the user / lost)
  netcount.json   kernel socket counters of every departed participant's process, from its
                  departure to the last step (optional: needs local workers and `ss`)
  epoch{E}/       one epoch's audit directory:
    manifest.json   the epoch, its participants in rank order, the plan (for humans), workers, and
                    the final hash of every rank's chain (plus the sha256 of its netcount.json)
    rank{R}.jsonl   one hash-chained log per rank of the epoch (0 = client, 1..N = workers)
    netcount.json   OS-level socket byte counters per worker process over the epoch's steps
A participant ("pid" in the runtime, `participant` here) is a worker's id for the life of the job;
its rank is its position in the epoch's order (+1), and changes from epoch to epoch.

Each log line is one JSON record with `seq` (0, 1, ...), `prev` (hash of the previous record,
GENESIS for the first) and `hash` = sha256(prev + canonical JSON of the record without `hash`).
Record types, in order:
  header   rank, role (client|worker), epoch, participant (workers), dims, share (worker: declared
           residual / attention blocks / MLP ranges), variant, leak, pid (the OS process id);
           `control`: events before it (the HELLO handshake)
  session  a RESET: fresh KV shards; `control`: the events since the previous record
  step     one forward: session, step, phase, t (tokens), pos; `events` (transfers inside the step),
           `holds` (coordinates held per protected tensor, per layer), `sets` (new coordinate sets),
           `control` (transfers since the previous record that were outside any step). A batched
           step (several sessions at once, each in its own KV slot) adds `spans`: [slot, pos, T]
           per session in column order; then t = ΣT and pos = the first span's. `frame_step`: the
           step number the step's frames carried on the wire (the comm's count of command words in
           the epoch; comm/comm.py, "Numbered steps"): every event of the step carries it, the events
           before it a lower or equal one, it grows from step record to step record, and the client
           and every worker log the same one for the same step
  release  one batched session is over: session (the RESET's), slot; a worker adds `zeroed`, whether
           it measured that slot's KV as all zeros after wiping it
  rollback speculative decoding rejected the last columns of a slot's previous step: session, slot,
           `from` (the positions the slot held), `to` (where its next span starts, 1 <= to < from);
           a worker adds `zeroed`, whether it measured the slot as all zeros from `to` on after
           zeroing positions to..from-1. Written before the step whose span starts at `to`
  end      steps, recorder self-timing; `control`: the SHUTDOWN word
A slot holds one batched session's KV from its first span (pos 0) to its release (or the next
session record): a span at pos 0 may only start in a free slot, and a span at pos p > 0 continues
its slot's session exactly where the previous one ended, or where a rollback record put it back.
A step's phase: "prefill" when a session starts in it (a span at pos 0), "decode" when every
session runs one token past its prompt, "verify" otherwise: every session continues its KV and some
run several columns (a speculative verification: the last token plus its drafts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import NamedTuple

SCHEMA_VERSION = (
    6  # 3: epochs, membership, participants; 4: batched steps, releases; 5: rollbacks, "verify"; 6: frame steps
)
GENESIS = "0" * 64
MANIFEST = "manifest.json"
NETCOUNT = "netcount.json"
MEMBERSHIP = "membership.json"
# Why a participant left before an epoch (membership.json): the user revoked it, or it was lost
# (died, froze, cut off). Either way it may receive nothing more.
REVOKED = "revoked"
LOST = "lost"
DEPARTURES = (REVOKED, LOST)


def log_name(rank: int) -> str:
    return f"rank{rank}.jsonl"


def epoch_dir(epoch: int) -> str:
    """An epoch's audit directory, inside the cold start's."""
    return f"epoch{epoch}"


# ---- events: one transfer as the comm layer saw it ----


class LogEvent(NamedTuple):
    """One transfer in a log: a JSON array in this field order (compact: a step has ~5 per layer)."""

    layer: int  # -1 outside the layers (ingress, egress, control)
    op: str  # operator name, "L3.qkv"
    kind: str  # one of the kinds below, or a baseline's / leak's "gather" or "all_reduce"
    role: str  # tensor role the transfer carries (see OP_ROLES)
    sent: Sequence[int]  # elements sent to each world rank (index = rank)
    received: Sequence[int]  # elements received from each world rank
    itemsize: int  # bytes per element
    step: int  # the step number its frames carried (comm/links.py's header; comm/comm.py, "Numbered steps")


REDUCE_SCATTER = "reduce_scatter"
SCORE_SUM = "score_sum"
NORM_SUM = "norm_sum"  # Gemma 3's post-norms: every worker's partial Σy², one float32 scalar per token
INGRESS = "ingress"
EGRESS = "egress"
CONTROL = "control"
# Inside the protected interval (between ingress and egress) only these may touch protected data:
# reduce-scatters of partials (with the fused Σx² scalars), declared score sums, and the post-norms'
# all-worker Σy² sums (a scalar per token, like the fused Σx²; their counts predicted exactly).
ALLOWED_IN_INTERVAL = (REDUCE_SCATTER, SCORE_SUM, NORM_SUM)

# Operator name (after "L{i}.") -> the tensor role its transfer carries.
OP_ROLES = {
    "qkv": "qkv_partial",
    "o": "resid_partial",
    "gate_up": "gate_up_partial",
    "down": "resid_partial",
    "scores": "scores",
    "post_o": "resid_sumsq",  # Gemma 3: Σy² of the o output's residual rows, per token
    "post_down": "resid_sumsq",
    "embed": "resid",
    "qkv0": "qkv",  # layer 0's q/k/v shard, computed by the client, with the ingress
    "final": "resid_partial",  # the last layer's down partial, the worker's residual rows added
}


def parse_op(op: str) -> tuple[int, str]:
    """ "L3.qkv" -> (3, "qkv_partial"); "L3.scores.g0" -> (3, "scores"); "embed" -> (-1, "resid")."""
    layer, name = -1, op
    if op.startswith("L") and "." in op:
        head, _, rest = op.partition(".")
        if head[1:].isdigit():
            layer, name = int(head[1:]), rest
    return layer, OP_ROLES.get(name.split(".")[0], name.split(".")[0])


PREFILL, DECODE, VERIFY = "prefill", "decode", "verify"


def step_phase(t: int, pos: int, spans: list[list[int]] | None = None) -> str:
    """ "prefill" when a session starts in the step (position 0), "decode" when every session runs
    one token past its prompt, else "verify": every session continues, some with several columns
    (speculative decoding's last token plus drafts)."""
    sessions = [(pos, t)] if spans is None else [(p, n) for _, p, n in spans]
    if any(p == 0 for p, _ in sessions):
        return PREFILL
    return DECODE if all(n == 1 for _, n in sessions) else VERIFY


SPANS_OP = "spans"  # the control message that carries a batched step's spans
SPANS_WORDS = 3  # int64 words per session in it: slot, pos, T


# ---- holdings: which coordinates a worker's tensors stand for ----

# A hold is a JSON array [layer, name, set_id, n_rows]: at this step, in this layer, the tensor
# `name` had n_rows rows standing for the coordinate set `set_id` (defined once, in a `sets` map
# {set_id: [[start, stop), ...]} of the header or a step record) of the space named below.
# A step's `holds` is the list of holds, or the string "same": identical to the previous step's.
HOLD_NAMES = ("resid.in", "qkv", "kv", "attn", "resid.mid", "gate_up", "h", "resid.out")


def spaces(dims: dict) -> dict[str, int]:
    """Size of the coordinate space of each hold name, from model dimensions."""
    h, i, d = dims["hidden"], dims["intermediate"], dims["head_dim"]
    q, kv = dims["heads"] * d, dims["kv_heads"] * d
    return {
        "resid.in": h,
        "resid.mid": h,
        "resid.out": h,
        "qkv": q + 2 * kv,  # [q | k | v]
        "kv": q + 2 * kv,  # the KV cache, named by the same [q | k | v] rows (k and v parts only)
        "attn": q,
        "gate_up": 2 * i,  # [gate | up]
        "h": i,
    }


def role_parts(dims: dict) -> dict[str, tuple[str, int, int]]:
    """The protected roles: role -> (hold name, start, stop), the part of the hold's space the role
    occupies. The verifier checks partition and "no full holder" on every role, step and layer."""
    i, d = dims["intermediate"], dims["head_dim"]
    q, kv = dims["heads"] * d, dims["kv_heads"] * d
    return {
        "resid.in": ("resid.in", 0, dims["hidden"]),
        "q": ("qkv", 0, q),
        "k": ("qkv", q, q + kv),
        "v": ("qkv", q + kv, q + 2 * kv),
        "kcache": ("kv", q, q + kv),
        "vcache": ("kv", q + kv, q + 2 * kv),
        "attn": ("attn", 0, q),
        "resid.mid": ("resid.mid", 0, dims["hidden"]),
        "gate": ("gate_up", 0, i),
        "up": ("gate_up", i, 2 * i),
        "h": ("h", 0, i),
        "resid.out": ("resid.out", 0, dims["hidden"]),
    }


def to_runs(indices: Iterable[int]) -> list[list[int]]:
    """Indices (any order) -> maximal [start, stop) runs, in the given order."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def from_runs(runs: Iterable[Iterable[int]]) -> list[int]:
    return [i for a, b in runs for i in range(a, b)]


# ---- hash chain ----


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def chain_hash(prev: str, record: dict) -> str:
    """Hash of a record (without its `hash` field) chained to the previous record's hash."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(prev.encode() + canonical(body)).hexdigest()


# ---- wire model: bytes on the TCP sockets for each message (comm/links.py's framing) ----
# A message is a 20-byte header (length, epoch, step, lane, flags), then the payload. On the `tls` comm backend (TLS 1.3, the default) a message
# whose header and payload fit one record (<= 16384 bytes) is written as one record, a larger one as
# a header record then payload records of 16384 bytes; every record adds 22 bytes (5 header, 1 inner
# content type, 16 AEAD tag). The plaintext backend ("tcp") adds only the header. A transfer is one
# message to (or from) each peer with a non-zero element count. The model is restated here rather
# than imported from comm, so the verifier checks the links instead of trusting them.
LINK_BACKENDS = ("tls", "tcp")  # the comm backends this model predicts (the manifest's "wire")
# bytes per element of the state on the wire, by the manifest's "wire_dtype" (absent: float32, the
# only dtype before it was recorded); control words are int64 whatever it is
WIRE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
FRAME_HEADER = 20  # length u64, epoch u32, step u32, lane u16, flags u16 (comm/links.py)
TLS_RECORD = 16384
TLS_RECORD_OVERHEAD = 22
CONTROL_BYTES = 32  # a control word: 4 int64


def message_bytes(payload: int, backend: str) -> int:
    """Bytes one message of `payload` bytes puts on the TCP stream of a `backend` link."""
    if backend == "tcp":
        return FRAME_HEADER + payload
    if FRAME_HEADER + payload <= TLS_RECORD:
        return FRAME_HEADER + payload + TLS_RECORD_OVERHEAD
    return FRAME_HEADER + TLS_RECORD_OVERHEAD + payload + TLS_RECORD_OVERHEAD * -(-payload // TLS_RECORD)


# Tolerance for |measured - predicted| on one process. The model is exact (measured: 0 B of excess
# over 250-step runs); the slack only absorbs a sampling race at the interval's edges, and is far
# below one leaked residual shard per step over a run (see docs/audit.md).
WIRE_REL_TOL = 0.0
WIRE_ABS_TOL = 256
