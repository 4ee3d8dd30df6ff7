"""The independent verifier: `fusion audit verify DIR`.

It reads the logs (schema.py) and the model dimensions recorded in the manifest, and nothing else:
no plan, no operators, no worker or client code, so a bug there cannot certify itself. From the
dimensions and the shares each worker declares in its log header it recomputes, on its own,
every coordinate set a worker should hold and every transfer it should make, then checks each
step (DESIGN.md §5):

  chain           every log's hash chain is intact and ends at the hash the manifest recorded
  structure       header / sessions / steps / end in order; steps consecutive; the same steps on
                  every rank; positions advance by the tokens run
  holding         each tensor's row count equals its claimed coordinates, and the coordinates
                  equal what the declared share implies
  partition       per step, layer and protected role: the workers' sets are disjoint and cover it
  no_full_holder  no worker holds every coordinate of any protected role (N >= 2); reported with
                  the smallest coalition of workers that covers each role
  closure         inside the interval only reduce-scatters and declared score sums; every scatter's
                  output is what its owner's next operator consumes, in the same layout, through
                  every layer, from ingress to egress
  accounting      every transfer's element counts, per peer, equal the prediction; each rank's
                  sends match its peers' receives
  os_bytes        kernel socket counters per worker process (netcount.json) equal the predicted
                  bytes plus the wire model's protocol overhead

Exit status 0 only when every check passed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import schema as S

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
MAX_LISTED = 12


class AuditFormatError(ValueError):
    """The directory is not an audit directory (missing or unreadable manifest)."""


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
    checks: dict[str, int] = field(default_factory=dict)  # invariant -> items checked
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


# ---- what the dimensions and declared shares imply (independent of plan.py) ----


@dataclass(frozen=True)
class Declared:
    """One worker's coordinate sets, derived here from its declared share and the dimensions."""

    resid: frozenset[int]
    qkv: frozenset[int]  # in the [q | k | v] space
    gate_up: frozenset[int]  # in the [gate | up] space
    mlp: frozenset[int]
    blocks: tuple[tuple[int, int, int, int], ...]

    @property
    def attn(self) -> frozenset[int]:
        return self.qkv  # restricted to the q part by the caller


def declare(share: dict, dims: dict) -> Declared:
    d, half = dims["head_dim"], dims["head_dim"] // 2
    gs = dims["heads"] // dims["kv_heads"]
    q_size, kv_size, inter = dims["heads"] * d, dims["kv_heads"] * d, dims["intermediate"]
    qkv: set[int] = set()
    for g0, g1, p0, p1 in share["attention"]:
        head_dims = list(range(p0, p1)) + list(range(p0 + half, p1 + half))
        for g in range(g0, g1):
            for h in range(g * gs, (g + 1) * gs):
                qkv.update(h * d + j for j in head_dims)
            qkv.update(q_size + g * d + j for j in head_dims)
            qkv.update(q_size + kv_size + g * d + j for j in head_dims)
    m0, m1 = share["mlp"]
    a, b = share["residual"]
    return Declared(
        resid=frozenset(range(a, b)),
        qkv=frozenset(qkv),
        gate_up=frozenset(range(m0, m1)) | frozenset(range(inter + m0, inter + m1)),
        mlp=frozenset(range(m0, m1)),
        blocks=tuple(tuple(b) for b in share["attention"]),
    )


def expected_hold(decl: Declared, name: str, dims: dict) -> frozenset[int]:
    q_size = dims["heads"] * dims["head_dim"]
    if name in ("resid.in", "resid.mid", "resid.out"):
        return decl.resid
    if name == "qkv":
        return decl.qkv
    if name == "kv":
        return frozenset(c for c in decl.qkv if c >= q_size)
    if name == "attn":
        return frozenset(c for c in decl.qkv if c < q_size)
    if name == "gate_up":
        return decl.gate_up
    if name == "h":
        return decl.mlp
    raise KeyError(name)


def group_owners(decls: list[Declared], n_groups: int) -> list[list[int]]:
    owners: list[list[int]] = [[] for _ in range(n_groups)]
    for w, decl in enumerate(decls):
        for g0, g1, _, _ in decl.blocks:
            for g in range(g0, g1):
                if w not in owners[g]:
                    owners[g].append(w)
    return owners


def expected_events(w: int, decls: list[Declared], owners: list[list[int]], dims: dict, t: int, pos: int) -> list:
    """The transfers worker w must make in one step, in order: (layer, op, kind, to, from, itemsize)."""
    n = len(decls)
    gs = dims["heads"] // dims["kv_heads"]
    me = decls[w]
    others = [q for q in range(n) if q != w]
    qkv_n = [len(x.qkv) + 1 for x in decls]  # +1: the fused Σx² row
    gu_n = [len(x.gate_up) + 1 for x in decls]
    res_n = [len(x.resid) for x in decls]

    world = n + 1

    def per_rank(counts: dict[int, int]) -> list[int]:
        return [counts.get(r, 0) for r in range(world)]

    def rs(layer: int, name: str, sizes: list[int]) -> tuple:
        to = per_rank({q + 1: sizes[q] * t for q in others})
        frm = per_rank({q + 1: sizes[w] * t for q in others})
        return (layer, f"L{layer}.{name}", S.REDUCE_SCATTER, to, frm, 4)

    ev: list[tuple] = [(-1, "embed", S.INGRESS, per_rank({}), per_rank({0: res_n[w] * t}), 4)]
    for layer in range(dims["layers"]):
        if n > 1:
            ev.append(rs(layer, "qkv", qkv_n))
        for g0, g1, _, _ in me.blocks:
            peers = [o for o in owners[g0] if o != w]
            if peers:  # a split group: partial scores summed among its owners
                elems = (g1 - g0) * gs * t * (pos + t)
                cnt = per_rank({o + 1: elems for o in peers})
                ev.append((layer, f"L{layer}.scores.g{g0}", S.SCORE_SUM, cnt, list(cnt), 4))
        if n > 1:
            ev.append(rs(layer, "o", res_n))
            ev.append(rs(layer, "gate_up", gu_n))
            ev.append(rs(layer, "down", res_n))
    ev.append((-1, "final", S.EGRESS, per_rank({0: res_n[w] * t}), per_rank({}), 4))
    return ev


def wire_bytes(events: list[tuple], n_controls: int, engine: str) -> tuple[int, int]:
    """(sent, received) bytes on the wire for a worker, from predicted events (schema wire model):
    one message per peer with a non-zero count, plus the control words it received."""
    sent, recv = 0, n_controls * S.message_bytes(S.CONTROL_BYTES, engine)
    for _layer, _op, _kind, to, frm, isz in events:
        sent += sum(S.message_bytes(v * isz, engine) for v in to if v)
        recv += sum(S.message_bytes(v * isz, engine) for v in frm if v)
    return sent, recv


# ---- reading logs ----


def _read_log(path: Path, rank: int, final: str | None, res: Result) -> list[dict]:
    if not path.is_file():
        res.violations.append(Violation("chain", f"log {path.name} missing", rank=rank))
        return []
    records, prev = [], S.GENESIS
    res.checks["chain"] = res.checks.get("chain", 0)
    for i, line in enumerate(path.read_text().splitlines()):
        res.checks["chain"] += 1
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            res.violations.append(Violation("chain", f"line {i + 1} is not JSON", rank=rank))
            return records
        if rec.get("seq") != i or rec.get("prev") != prev or S.chain_hash(prev, rec) != rec.get("hash"):
            res.violations.append(
                Violation(
                    "chain", f"record {i} breaks the hash chain (seq {rec.get('seq')}, prev/hash mismatch)", rank=rank
                )
            )
            return records
        prev = rec["hash"]
        records.append(rec)
    if final is None:
        res.violations.append(Violation("chain", "manifest records no final hash for this log", rank=rank))
    elif prev != final:
        res.violations.append(Violation("chain", f"chain ends at {prev[:12]}, manifest says {final[:12]}", rank=rank))
    return records


def _split(records: list[dict], rank: int, res: Result) -> tuple[dict, list[dict], list[dict], dict | None]:
    """header, session/step records in order, step records, end record (None when missing)."""
    if not records or records[0].get("type") != "header":
        res.violations.append(Violation("structure", "log does not start with a header", rank=rank))
        return {}, [], [], None
    end = records[-1] if records[-1].get("type") == "end" else None
    if end is None:
        res.violations.append(Violation("structure", "log has no end record (worker died or log truncated)", rank=rank))
    body = records[1:-1] if end else records[1:]
    steps = [r for r in body if r.get("type") == "step"]
    for r in body:
        if r.get("type") not in ("session", "step"):
            res.violations.append(Violation("structure", f"unexpected record type {r.get('type')!r}", rank=rank))
    return records[0], body, steps, end


def _check_order(body: list[dict], rank: int, res: Result) -> None:
    session, step, pos = 0, 0, 0
    for r in body:
        res.checks["structure"] = res.checks.get("structure", 0) + 1
        if r.get("type") == "session":
            if r.get("session") != session + 1:
                res.violations.append(
                    Violation("structure", f"session {r.get('session')} follows session {session}", rank=rank)
                )
            session, step, pos = r.get("session", session + 1), 0, 0
            continue
        s, k, t, p = r.get("session"), r.get("step"), r.get("t"), r.get("pos")
        if (s, k) != (session, step):
            res.violations.append(
                Violation(
                    "structure",
                    f"step record (session {s}, step {k}) where (session {session}, step {step}) was due",
                    rank=rank,
                    session=s,
                    step=k,
                )
            )
        if p != pos:
            res.violations.append(
                Violation(
                    "structure", f"position {p}, expected {pos} (steps out of order?)", rank=rank, session=s, step=k
                )
            )
        phase = "decode" if t == 1 and p and p > 0 else "prefill"
        if r.get("phase") != phase:
            res.violations.append(Violation("structure", f"phase {r.get('phase')!r}, expected {phase}", rank=rank))
        step += 1
        pos = (p or 0) + (t or 0)


# ---- the checks ----


def _smallest_cover(sets: list[frozenset[int]], universe: frozenset[int]) -> int | None:
    n = len(sets)
    if n > 12:  # brute force is 2^n; beyond that report the greedy bound
        covered, used = set(), 0
        for s in sorted(sets, key=len, reverse=True):
            if universe <= covered:
                break
            covered |= s
            used += 1
        return used if universe <= covered else None
    for k in range(1, n + 1):
        for combo in itertools.combinations(sets, k):
            if universe <= frozenset().union(*combo):
                return k
    return None


@dataclass
class _Ctx:
    """What every pass needs: the result being filled, the dimensions, and what they imply."""

    res: Result
    dims: dict
    n: int
    n_layers: int
    decls: list[Declared] = field(default_factory=list)
    owners: list[list[int]] = field(default_factory=list)
    bad_steps: set[tuple] = field(default_factory=set)
    bad_layers: dict[tuple, set[int]] = field(default_factory=lambda: defaultdict(set))
    # (session, step) -> rank -> op -> (to, from): for cross-rank conservation
    flows: dict[tuple, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    # (session, step) -> worker -> {(layer, hold name): coordinates}
    held: dict[tuple, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    predicted_wire: dict[int, list[int]] = field(default_factory=dict)
    wire: str = "tls"  # the engine whose wire model predicts the socket bytes (manifest "wire")
    sent_by_phase: dict[int, dict[str, list[int]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )

    def violate(self, v: Violation) -> None:
        """Record a violation and mark the step (and layer, or every layer) it voids."""
        self.res.violations.append(v)
        if v.step is not None:
            key = (v.session, v.step)
            self.bad_steps.add(key)
            if v.layer is not None and v.layer >= 0:
                self.bad_layers[key].add(v.layer)
            else:
                self.bad_layers[key].update(range(self.n_layers))


def _load_manifest(d: Path) -> dict:
    mpath = d / S.MANIFEST
    if not d.is_dir():
        raise AuditFormatError(f"{d}: not a directory")
    if not mpath.is_file():
        raise AuditFormatError(f"{d}: no {S.MANIFEST} (not an audit directory)")
    try:
        manifest = json.loads(mpath.read_text())
        int(manifest["workers"]), int(manifest["model"]["dims"]["layers"]), dict(manifest["chains"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise AuditFormatError(f"{mpath}: malformed manifest ({type(e).__name__}: {e})") from None
    if manifest.get("schema") != S.SCHEMA_VERSION:
        raise AuditFormatError(f"{mpath}: schema {manifest.get('schema')} (this verifier reads {S.SCHEMA_VERSION})")
    return manifest


def verify_dir(path: str | Path) -> Result:
    """Check one audit directory (one cold start). Raises AuditFormatError when it is not one."""
    d = Path(path)
    manifest = _load_manifest(d)
    dims, n = manifest["model"]["dims"], int(manifest["workers"])
    res = Result(dir=str(d), workers=n, layers=int(dims["layers"]), variant=manifest.get("variant", "sharded"))
    res.checks = dict.fromkeys(INVARIANTS, 0)
    ctx = _Ctx(res, dims, n, res.layers, wire=str(manifest.get("wire")))
    if ctx.wire not in S.WIRE_ENGINES:
        res.violations.append(Violation("os_bytes", f"manifest names no known wire engine ({ctx.wire!r})"))
        ctx.wire = "tls"

    logs = {}
    for rank in range(n + 1):
        records = _read_log(d / S.log_name(rank), rank, manifest["chains"].get(str(rank)), res)
        logs[rank] = _split(records, rank, res) if records else ({}, [], [], None)
        _check_order(logs[rank][1], rank, res)
    _declare_shares(ctx, logs)
    step_keys = _check_same_steps(ctx, logs)
    c_header = logs[0][0]
    ingress = {int(k): frozenset(S.from_runs(v)) for k, v in (c_header.get("ingress") or {}).items()}
    egress = {int(k): frozenset(S.from_runs(v)) for k, v in (c_header.get("egress") or {}).items()}
    for w in range(n):
        _check_worker(ctx, w, logs[w + 1][1])
    _check_client(ctx, logs[0][2], ingress, egress)
    _check_conservation(ctx)
    _check_boundary(ctx, ingress, egress)
    _check_partition(ctx)
    _check_os(ctx, d, manifest)
    _verdicts(ctx, step_keys)
    return res


def _declare_shares(ctx: _Ctx, logs: dict) -> None:
    for w in range(ctx.n):
        header = logs[w + 1][0]
        try:
            if header.get("dims") != ctx.dims:
                ctx.res.violations.append(
                    Violation("structure", "worker's dims differ from the manifest's", rank=w + 1)
                )
            ctx.decls.append(declare(header["share"], ctx.dims))
        except (KeyError, TypeError, ValueError):
            ctx.res.violations.append(Violation("structure", "header declares no usable share", rank=w + 1))
            ctx.decls.append(Declared(frozenset(), frozenset(), frozenset(), frozenset(), ()))
    ctx.owners = group_owners(ctx.decls, ctx.dims["kv_heads"])


def _check_same_steps(ctx: _Ctx, logs: dict) -> list[tuple]:
    """Every rank ran the same steps as the client: (session, step, T, pos)."""
    step_keys = [(r.get("session"), r.get("step"), r.get("t"), r.get("pos")) for r in logs[0][2]]
    for rank in range(1, ctx.n + 1):
        keys = [(r.get("session"), r.get("step"), r.get("t"), r.get("pos")) for r in logs[rank][2]]
        if keys != step_keys:
            differ = len(set(step_keys) ^ set(keys))
            ctx.res.violations.append(
                Violation(
                    "structure", f"{len(keys)} steps vs the client's {len(step_keys)} ({differ} differ)", rank=rank
                )
            )
    ctx.res.steps = len(step_keys)
    ctx.res.decode_steps = sum(1 for k in step_keys if k[2] == 1 and (k[3] or 0) > 0)
    ctx.res.prefill_steps = ctx.res.steps - ctx.res.decode_steps
    return step_keys


def _check_worker(ctx: _Ctx, w: int, body: list[dict]) -> None:
    """Per step of one worker: transfers (closure of kinds, accounting) and holdings (holding,
    layout closure); also sums the predicted wire bytes for the OS check."""
    res, dims, rank = ctx.res, ctx.dims, w + 1
    space = S.spaces(dims)
    sets: dict[str, frozenset[int]] = {}
    sets_version = 0
    hold_memo: dict[tuple, tuple] = {}  # a worker holds the same sets step after step: check once
    last_holds = None
    wire_sent = wire_recv = 0
    for r in body:
        n_ctl = sum(1 for e in r.get("control") or [] if len(e) > 5 and any(e[5]))  # control words received
        if r.get("type") == "session":
            s, rr = wire_bytes([], n_ctl, ctx.wire)
            wire_sent, wire_recv = wire_sent + s, wire_recv + rr
            continue
        key = (r.get("session"), r.get("step"))
        t, pos = r.get("t") or 0, r.get("pos") or 0
        where = dict(rank=rank, session=key[0], step=key[1])
        try:
            for k, runs in (r.get("sets") or {}).items():
                sets[k] = frozenset(S.from_runs(runs))
                sets_version += 1
            events = r.get("events") or []
            expect = expected_events(w, ctx.decls, ctx.owners, dims, t, pos)
            s, rr = wire_bytes(expect, n_ctl, ctx.wire)
            wire_sent, wire_recv = wire_sent + s, wire_recv + rr
            _check_events(events, expect, where, res, ctx.violate)
            ctx.sent_by_phase[rank][r.get("phase", "?")].append(
                sum(sum(e[4]) * e[6] for e in events if e[2] != S.CONTROL)
            )
            ctx.flows[key][rank] = {e[1]: (e[4], e[5]) for e in events if e[2] != S.CONTROL}
            holds = r.get("holds")
            if holds == "same":
                holds = last_holds
            last_holds = holds
            hkey = (sets_version, tuple(tuple(x) for x in holds or []))
            if hkey not in hold_memo:
                hold_memo[hkey] = _check_holds(hkey[1], sets, ctx.decls[w], dims, space, ctx.n_layers)
            h, findings, n_checked = hold_memo[hkey]
            res.checks["holding"] += n_checked[0]
            res.checks["closure"] += n_checked[1]
            for inv, msg, layer in findings:
                ctx.violate(Violation(inv, msg, layer=layer, **where))
            ctx.held[key][w] = h
        except (KeyError, TypeError, ValueError, IndexError) as e:
            ctx.violate(Violation("structure", f"malformed step record ({type(e).__name__}: {e})", **where))
    ctx.predicted_wire[rank] = [wire_sent, wire_recv]


def _check_client(ctx: _Ctx, steps: list[dict], ingress: dict, egress: dict) -> None:
    """The client's side of the boundary: ingress and egress element counts per worker."""
    n = ctx.n
    for r in steps:
        key = (r.get("session"), r.get("step"))
        t = r.get("t") or 0
        where = dict(rank=0, session=key[0], step=key[1])
        ctx.flows[key][0] = {}
        for e in r.get("events") or []:
            try:
                kind, to, frm = e[2], e[4], e[5]
                ctx.res.checks["accounting"] += 1
                if kind == S.CONTROL:
                    continue
                if kind not in (S.INGRESS, S.EGRESS):
                    ctx.violate(Violation("closure", f"client transfer of kind {kind!r} inside a step", **where))
                counts = to if kind == S.INGRESS else frm
                for q, v in enumerate(counts):
                    if not v:
                        continue
                    want = len((ingress if kind == S.INGRESS else egress).get(q, ())) * t
                    declared = len(ctx.decls[q - 1].resid) * t if 1 <= q <= n else None
                    if v != want or v != declared:
                        ctx.violate(Violation("accounting", f"{kind} rank {q}: {v} elements, expected {want}", **where))
                prev_to, prev_from = ctx.flows[key][0].get(e[1], ([0] * (n + 1), [0] * (n + 1)))
                ctx.flows[key][0][e[1]] = (
                    [a + b for a, b in zip(prev_to, to, strict=False)],
                    [a + b for a, b in zip(prev_from, frm, strict=False)],
                )
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                ctx.violate(Violation("structure", f"malformed client event ({type(exc).__name__})", **where))


def _check_conservation(ctx: _Ctx) -> None:
    """What rank r sent to q in operator X is what q received from r in X."""
    for key, per_rank in ctx.flows.items():
        for r, ops in per_rank.items():
            for op, (to, _frm) in ops.items():
                for q, v in enumerate(to):
                    if not v or q not in per_rank:
                        continue
                    ctx.res.checks["accounting"] += 1
                    peer_from = per_rank[q].get(op, ((), ()))[1]
                    got = peer_from[r] if r < len(peer_from) else None
                    if got != v:
                        msg = f"{op}: rank {r} sent {v} elements to rank {q}, which received {got}"
                        ctx.violate(Violation("accounting", msg, rank=r, session=key[0], step=key[1]))


def _check_boundary(ctx: _Ctx, ingress: dict, egress: dict) -> None:
    """Ingress coordinates = the residual layer 0 consumes; the last layer's output = egress."""
    last = ctx.n_layers - 1
    for key, per_w in ctx.held.items():
        for w, h in per_w.items():
            where = dict(rank=w + 1, session=key[0], step=key[1])
            ctx.res.checks["closure"] += 2
            if ingress and h.get((0, "resid.in")) != ingress.get(w + 1):
                msg = "ingress coordinates differ from the residual layer 0 consumes"
                ctx.violate(Violation("closure", msg, layer=0, **where))
            if egress and h.get((last, "resid.out")) != egress.get(w + 1):
                msg = "egress coordinates differ from the last layer's residual"
                ctx.violate(Violation("closure", msg, layer=last, **where))


def _check_partition(ctx: _Ctx) -> None:
    """Partition and no full holder, per step, layer and protected role. Sets are shared objects
    (one per interned index map), so a (role, owners' sets) combination is evaluated once."""
    res, n = ctx.res, ctx.n
    parts = S.role_parts(ctx.dims)
    universes = {role: frozenset(range(a, b)) for role, (_, a, b) in parts.items()}
    cover_cache: dict[tuple, tuple] = {}
    restrict_cache: dict[tuple, frozenset[int]] = {}
    best_cover: dict[str, int] = {}
    empty: frozenset[int] = frozenset()
    for key, per_w in ctx.held.items():
        for layer in range(ctx.n_layers):
            for role, (name, a, b) in parts.items():
                res.checks["partition"] += 1
                res.checks["no_full_holder"] += 1
                objs = tuple(per_w.get(w, {}).get((layer, name), empty) for w in range(n))
                ck = (role, tuple(id(o) for o in objs))
                hit = cover_cache.get(ck)
                if hit is None:
                    role_sets = []
                    for o in objs:
                        rk = (id(o), a, b)
                        if rk not in restrict_cache:
                            restrict_cache[rk] = frozenset(c for c in o if a <= c < b)
                        role_sets.append(restrict_cache[rk])
                    universe = universes[role]
                    union = frozenset().union(*role_sets)
                    disjoint = sum(len(x) for x in role_sets) == len(union)
                    full = [w for w, x in enumerate(role_sets) if x >= universe]
                    k = _smallest_cover(role_sets, universe)
                    hit = cover_cache[ck] = (
                        disjoint and union == universe,
                        disjoint,
                        full,
                        objs,
                    )  # objs: keep ids alive
                    if k is not None:
                        best_cover[role] = min(best_cover.get(role, k), k)
                ok, disjoint, full, _ = hit
                where = dict(session=key[0], step=key[1], layer=layer)
                if not ok:
                    msg = "sets overlap" if not disjoint else "sets do not cover the space"
                    ctx.violate(Violation("partition", f"{role}: {msg}", **where))
                for w in full:
                    msg = f"{role}: one worker holds all {len(universes[role])} coordinates"
                    ctx.violate(Violation("no_full_holder", msg, rank=w + 1, **where))
    res.coalition = {role: (f"{best_cover[role]}/{n}" if role in best_cover else "none") for role in parts}


def _check_os(ctx: _Ctx, d: Path, manifest: dict) -> None:
    """Kernel socket counters per worker process vs the predicted wire bytes."""
    res = ctx.res
    net_path = d / S.NETCOUNT
    if not net_path.is_file():
        return
    try:
        net = json.loads(net_path.read_text())
        for rank_s, m in net["ranks"].items():
            rank = int(rank_s)
            if rank == 0 or rank not in ctx.predicted_wire:
                continue
            ps, pr = ctx.predicted_wire[rank]
            ms, mr = int(m["sent"]), int(m["received"])
            tol_s = S.WIRE_REL_TOL * ps + S.WIRE_ABS_TOL
            tol_r = S.WIRE_REL_TOL * pr + S.WIRE_ABS_TOL
            ok = abs(ms - ps) <= tol_s and abs(mr - pr) <= tol_r
            res.checks["os_bytes"] += 2
            res.os[rank_s] = {
                "pid": m.get("pid"),
                "measured_sent": ms,
                "predicted_sent": ps,
                "excess_sent": ms - ps,
                "measured_received": mr,
                "predicted_received": pr,
                "excess_received": mr - pr,
                "ratio_sent": round(ms / ps, 6) if ps else None,
                "tolerance": round(tol_s),
                "ok": ok,
            }
            if not ok:
                msg = (
                    f"sockets carried {ms:,} B out / {mr:,} B in, predicted {ps:,} / {pr:,} "
                    f"(excess {ms - ps:+,} / {mr - pr:+,} B, tolerance {tol_s:,.0f})"
                )
                res.violations.append(Violation("os_bytes", msg, rank=rank))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        res.violations.append(Violation("os_bytes", f"unreadable {S.NETCOUNT} ({type(e).__name__})"))
    digest = manifest.get("netcount_sha256")
    if digest is not None and hashlib.sha256(net_path.read_bytes()).hexdigest() != digest:
        res.violations.append(Violation("chain", f"{S.NETCOUNT} differs from the digest in the manifest"))


def _verdicts(ctx: _Ctx, step_keys: list[tuple]) -> None:
    """Closed steps and per-layer closure; a run-level violation voids every step's certificate."""
    res = ctx.res
    run_level = any(v.invariant in RUN_LEVEL for v in res.violations)
    decode_keys = {(k[0], k[1]) for k in step_keys if k[2] == 1 and (k[3] or 0) > 0}
    res.layer_closed = [0] * ctx.n_layers
    for k in step_keys if not run_level else ():
        key = (k[0], k[1])
        for layer in range(ctx.n_layers):
            if layer not in ctx.bad_layers.get(key, ()):
                res.layer_closed[layer] += 1
        if key not in ctx.bad_steps:
            res.closed_steps += 1
            res.closed_decode += key in decode_keys
    res.bytes_per_step = {
        str(rank): {ph: sum(v) / len(v) for ph, v in per.items() if v} for rank, per in ctx.sent_by_phase.items()
    }


def _check_events(events: list, expect: list, where: dict, res: Result, violate) -> None:
    """Closure (kinds) and accounting (per-peer counts, in order) of one worker step."""
    for e in events:
        res.checks["closure"] += 1
        if e[2] not in S.ALLOWED_IN_INTERVAL and e[2] not in (S.INGRESS, S.EGRESS):
            violate(Violation("closure", f"{e[1]}: {e[2]} inside the protected interval", layer=e[0], **where))
    rec = [(e[0], e[1], e[2], e[4], e[5], e[6]) for e in events]
    res.checks["accounting"] += len(expect)
    if rec == expect:
        return
    for i in range(max(len(rec), len(expect))):
        got = rec[i] if i < len(rec) else None
        want = expect[i] if i < len(expect) else None
        if got != want:
            layer = (got or want)[0]
            if got is None or want is None or got[:3] != want[:3]:
                msg = (
                    f"transfer #{i}: got {got[1:3] if got else 'nothing'}, expected {want[1:3] if want else 'nothing'}"
                )
            else:
                msg = f"{got[1]}: sent {got[3]} received {got[4]}, expected {want[3]} / {want[4]}"
            violate(Violation("accounting", msg, layer=layer, **where))
            if got is None or want is None or got[:3] != want[:3]:
                return  # the rest is shifted; one report is enough


_KV_PARTS: dict[int, tuple[frozenset[int], frozenset[int]]] = {}


def kv_part(coords: frozenset[int], q_size: int) -> frozenset[int]:
    hit = _KV_PARTS.get(id(coords))
    if hit is None or hit[0] is not coords:
        hit = _KV_PARTS[id(coords)] = (coords, frozenset(c for c in coords if c >= q_size))
    return hit[1]


def _check_holds(holds, sets, decl, dims, space, n_layers):
    """Holding (rows vs claimed coordinates vs declared share) and layout closure of one step.

    Returns ({(layer, name): coords}, [(invariant, message, layer)], (holding checks, closure checks))."""
    findings: list[tuple[str, str, int]] = []
    n_hold = n_closure = 0
    h: dict[tuple[int, str], frozenset[int]] = {}
    q_size = dims["heads"] * dims["head_dim"]
    inter = dims["intermediate"]
    for layer, name, sid, rows in holds:
        n_hold += 1
        coords = sets.get(str(sid))
        if coords is None:
            findings.append(("holding", f"{name}: undefined coordinate set {sid}", layer))
            continue
        if name == "kv":  # the cache is named by [q | k | v] rows: only its k and v parts are held
            coords = kv_part(coords, q_size)
        want_rows = len(coords)
        if rows != want_rows:
            findings.append(("holding", f"{name}: tensor has {rows} rows for {want_rows} claimed coordinates", layer))
        if any(c < 0 or c >= space.get(name, 0) for c in coords):
            findings.append(("holding", f"{name}: coordinates outside its space", layer))
        prev = h.get((layer, name))
        h[(layer, name)] = coords if prev is None else prev | coords
    expected = {name: expected_hold(decl, name, dims) for name in S.HOLD_NAMES}
    for layer in range(n_layers):
        for name in S.HOLD_NAMES:
            n_hold += 1
            got = h.get((layer, name))
            if got is None:
                findings.append(("closure", f"no record of what {name} held", layer))
            elif got != expected[name]:
                findings.append(
                    (
                        "holding",
                        f"{name}: holds {len(got)} coordinates, its declared share implies {len(expected[name])}"
                        + ("" if got >= expected[name] else " (different ones)"),
                        layer,
                    )
                )
        # layout closure: each scatter's output is exactly what the next operator consumes
        g = lambda name, layer=layer: h.get((layer, name), frozenset())  # noqa: E731
        qkv = g("qkv")
        checks = [
            (g("kv") == frozenset(c for c in qkv if c >= q_size), "KV cache shard is not the scattered k/v"),
            (
                g("attn") == frozenset(c for c in qkv if c < q_size),
                "o_proj consumes other q coordinates than attention produced",
            ),
            (
                g("resid.mid") == g("resid.in"),
                "o_proj scatter delivers other residual coordinates than the worker holds",
            ),
            (g("resid.out") == g("resid.in"), "down scatter delivers other residual coordinates than the worker holds"),
            (
                g("h") == frozenset(c for c in g("gate_up") if c < inter),
                "down_proj consumes other MLP coordinates than gate produced",
            ),
            (
                g("h") == frozenset(c - inter for c in g("gate_up") if c >= inter),
                "SwiGLU pairs gate and up from different coordinates",
            ),
        ]
        if layer + 1 < n_layers:
            checks.append(
                (
                    h.get((layer + 1, "resid.in"), frozenset()) == g("resid.out"),
                    "next layer consumes other residual coordinates",
                )
            )
        for ok, msg in checks:
            n_closure += 1
            if not ok:
                findings.append(("closure", msg, layer))
    return h, findings, (n_hold, n_closure)
