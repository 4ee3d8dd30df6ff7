"""The checks on what each rank's records claim, step by step, against what its share implies.

Part of the independent verifier: imports only audit/schema.py and the standard library, so a bug
in the plan, the operators or the comm layer cannot certify itself. Per rank and step: which
transfers it made and their element counts (closure of kinds, accounting), which coordinates each
of its tensors stood for (holding, layout closure); then across ranks: sends = peers' receives,
ingress = the first layer's residual, egress = every residual coordinate (the last layer's down
partials, summed by the client: no worker holds the final residual), and per protected role the
workers' sets are a partition with no full holder. The socket byte check is in os_bytes.py.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

from .. import schema as S
from .expectation import (
    Declared,
    Transfer,
    declare,
    expected_hold,
    expected_transfers,
    group_owners,
    held_in_layer,
    wire_bytes,
)
from .logs import RankLog, StepKey, control_received, read_event
from .result import RUN_LEVEL, Result, Violation
from .sessions import Session, spans_of

StepId = tuple[int | None, int | None]  # (session, step): how ranks name the same step


@dataclass
class Verification:
    """One directory being verified: the result being filled, the dimensions, what they imply, and
    what the per-rank passes gather for the cross-rank ones."""

    res: Result
    dims: dict
    n: int
    n_layers: int
    wire: str = "tls"  # the link backend whose wire model predicts the socket bytes (manifest "wire")
    itemsize: int = 4  # bytes per element of the state on the wire (manifest "wire_dtype")
    # the last down's partials go to the client (manifest plan.boundary "down_to_client"; not with
    # post-norms): no down scatter in the last layer and no worker holds its output residual
    down_to_client: bool = True
    decls: list[Declared] = field(default_factory=list)  # per worker
    owners: list[list[int]] = field(default_factory=list)  # per KV group
    bad_steps: set[StepId] = field(default_factory=set)
    bad_layers: dict[StepId, set[int]] = field(default_factory=lambda: defaultdict(set))
    # step -> rank -> op -> (sent, received): for cross-rank conservation
    flows: dict[StepId, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    # step -> worker -> {(layer, hold name): coordinates}
    held: dict[StepId, dict[int, dict]] = field(default_factory=lambda: defaultdict(dict))
    predicted_wire: dict[int, list[int]] = field(default_factory=dict)  # rank -> [sent, received] bytes
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

    def declare_shares(self, logs: dict[int, RankLog]) -> None:
        """Each worker's coordinate sets from the share its header declares."""
        for w in range(self.n):
            header = logs[w + 1].header
            try:
                if header.get("dims") != self.dims:
                    self.res.violations.append(
                        Violation("structure", "worker's dims differ from the manifest's", rank=w + 1)
                    )
                self.decls.append(declare(header["share"], self.dims))
            except (KeyError, TypeError, ValueError):
                self.res.violations.append(Violation("structure", "header declares no usable share", rank=w + 1))
                self.decls.append(Declared.nothing())
        self.owners = group_owners(self.decls, self.dims["kv_heads"])

    def verdicts(self, step_keys: list[StepKey], sessions: list[Session]) -> None:
        """Closed steps and per-layer closure, and in a batched run closed sessions (every step it
        ran in closed); a run-level violation voids every step's certificate."""
        res = self.res
        run_level = any(v.invariant in RUN_LEVEL for v in res.violations)
        decode_steps = {(k.session, k.step) for k in step_keys if k.decode}
        verify_steps = {(k.session, k.step) for k in step_keys if k.verify}
        res.layer_closed = [0] * self.n_layers
        res.unclosed = [(k.session, k.step) for k in step_keys] if run_level else []
        for k in step_keys if not run_level else ():
            key = (k.session, k.step)
            for layer in range(self.n_layers):
                if layer not in self.bad_layers.get(key, ()):
                    res.layer_closed[layer] += 1
            if key not in self.bad_steps:
                res.closed_steps += 1
                res.closed_decode += key in decode_steps
                res.closed_verify += key in verify_steps
            else:
                res.unclosed.append(key)
        if any(k.spans for k in step_keys):
            res.batched_sessions = len(sessions)
            res.closed_sessions = 0 if run_level else sum(not self.bad_steps.intersection(s.steps) for s in sessions)
        res.bytes_per_step = {
            str(rank): {ph: sum(v) / len(v) for ph, v in per.items() if v} for rank, per in self.sent_by_phase.items()
        }


# ---- per rank ----


def check_worker(ctx: Verification, w: int, body: list[dict]) -> None:
    """Per step of one worker: transfers (closure of kinds, accounting) and holdings (holding,
    layout closure); also sums the predicted wire bytes for the socket check."""
    res, dims, rank = ctx.res, ctx.dims, w + 1
    sets: dict[str, frozenset[int]] = {}
    sets_version = 0
    hold_memo: dict[tuple, tuple] = {}  # a worker holds the same sets step after step: check once
    kv_parts: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
    last_holds = None
    wire_sent = wire_recv = 0
    for r in body:
        n_ctl = control_received(r)
        if r.get("type") in ("session", "release", "rollback"):  # a rollback moves no byte: no message
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
            spans = spans_of(r) if r.get("spans") is not None else None
            expect = expected_transfers(w, ctx.decls, ctx.owners, dims, t, pos, spans, ctx.itemsize, ctx.down_to_client)
            check_spans_message(r, spans, where, res, ctx.violate)
            s, rr = wire_bytes(expect, n_ctl, ctx.wire)
            wire_sent, wire_recv = wire_sent + s, wire_recv + rr
            events = [read_event(e) for e in r.get("events") or []]
            check_transfers(events, expect, where, res, ctx.violate)
            ctx.sent_by_phase[rank][r.get("phase", "?")].append(
                sum(sum(e.sent) * e.itemsize for e in events if e.kind != S.CONTROL)
            )
            ctx.flows[key][rank] = {e.op: (e.sent, e.received) for e in events if e.kind != S.CONTROL}
            holds = r.get("holds")
            if holds == "same":
                holds = last_holds
            last_holds = holds
            hkey = (sets_version, tuple(tuple(x) for x in holds or []))
            if hkey not in hold_memo:
                hold_memo[hkey] = check_holds(
                    hkey[1], sets, ctx.decls[w], dims, ctx.n_layers, kv_parts, ctx.down_to_client
                )
            h, findings, (n_holding, n_closure) = hold_memo[hkey]
            res.checks["holding"] += n_holding
            res.checks["closure"] += n_closure
            for inv, msg, layer in findings:
                ctx.violate(Violation(inv, msg, layer=layer, **where))
            ctx.held[key][w] = h
        except (KeyError, TypeError, ValueError, IndexError) as e:
            ctx.violate(Violation("structure", f"malformed step record ({type(e).__name__}: {e})", **where))
    ctx.predicted_wire[rank] = [wire_sent, wire_recv]


def check_spans_message(record: dict, spans: list | None, where: dict, res: Result, violate) -> None:
    """A step's spans arrive as one control message of 3 int64 per session, before the step (a
    record without spans: one session, slot 0)."""
    got = [sum(e.received) for e in map(read_event, record.get("control") or []) if e.op == S.SPANS_OP]
    want = [S.SPANS_WORDS * (len(spans) if spans else 1)]
    res.checks["accounting"] += 1
    if got != want:
        violate(Violation("accounting", f"spans control messages of {got} words, expected {want}", **where))


def check_transfers(events: list[S.LogEvent], expect: list[Transfer], where: dict, res: Result, violate) -> None:
    """Closure (kinds) and accounting (per-peer counts, in order) of one worker step."""
    for e in events:
        res.checks["closure"] += 1
        if e.kind not in S.ALLOWED_IN_INTERVAL and e.kind not in (S.INGRESS, S.EGRESS):
            violate(Violation("closure", f"{e.op}: {e.kind} inside the protected interval", layer=e.layer, **where))
    made = [Transfer.of(e) for e in events]
    res.checks["accounting"] += len(expect)
    if made == expect:
        return
    for i in range(max(len(made), len(expect))):
        got = made[i] if i < len(made) else None
        want = expect[i] if i < len(expect) else None
        if got == want:
            continue
        either = got if got is not None else want
        if either is None:  # both missing compare equal above: unreachable
            continue
        layer = either.layer
        if got is None or want is None or (got.layer, got.op, got.kind) != (want.layer, want.op, want.kind):
            got_s = (got.op, got.kind) if got else "nothing"
            want_s = (want.op, want.kind) if want else "nothing"
            violate(Violation("accounting", f"transfer #{i}: got {got_s}, expected {want_s}", layer=layer, **where))
            return  # the rest is shifted; one report is enough
        msg = f"{got.op}: sent {got.sent} received {got.received}, expected {want.sent} / {want.received}"
        if got.itemsize != want.itemsize:
            msg += f"; {got.itemsize} bytes per element, expected {want.itemsize} (the manifest's wire dtype)"
        violate(Violation("accounting", msg, layer=layer, **where))


def check_holds(holds, sets, decl: Declared, dims: dict, n_layers: int, kv_parts: dict, down_to_client: bool = True):
    """Holding (rows vs claimed coordinates vs declared share) and layout closure of one step.
    `kv_parts` caches the k/v part of each claimed set, so equal claims yield the same objects.

    Returns ({(layer, name): coords}, [(invariant, message, layer)], (holding checks, closure checks))."""
    findings: list[tuple[str, str, int]] = []
    n_hold = n_closure = 0
    h: dict[tuple[int, str], frozenset[int]] = {}
    space = S.spaces(dims)
    q_size = dims["heads"] * dims["head_dim"]
    inter = dims["intermediate"]
    for layer, name, sid, rows in holds:
        n_hold += 1
        coords = sets.get(str(sid))
        if coords is None:
            findings.append(("holding", f"{name}: undefined coordinate set {sid}", layer))
            continue
        if name == "kv":  # the cache is named by [q | k | v] rows: only its k and v parts are held
            hit = kv_parts.get(id(coords))
            if hit is None or hit[0] is not coords:
                hit = kv_parts[id(coords)] = (coords, frozenset(c for c in coords if c >= q_size))
            coords = hit[1]
        want_rows = len(coords)
        if rows != want_rows:
            findings.append(("holding", f"{name}: tensor has {rows} rows for {want_rows} claimed coordinates", layer))
        if any(c < 0 or c >= space.get(name, 0) for c in coords):
            findings.append(("holding", f"{name}: coordinates outside its space", layer))
        prev = h.get((layer, name))
        h[(layer, name)] = coords if prev is None else prev | coords
    expected = {name: expected_hold(decl, name, dims) for name in S.HOLD_NAMES}
    empty: frozenset[int] = frozenset()
    for layer in range(n_layers):
        for name in S.HOLD_NAMES:
            n_hold += 1
            got = h.get((layer, name))
            if not held_in_layer(name, layer, n_layers, down_to_client):
                if got is not None:
                    msg = f"{name}: holds {len(got)} coordinates of the final residual, the client's alone"
                    findings.append(("holding", msg, layer))
                continue
            if got is None:
                findings.append(("closure", f"no record of what {name} held", layer))
            elif got != expected[name]:
                msg = f"{name}: holds {len(got)} coordinates, its declared share implies {len(expected[name])}"
                findings.append(("holding", msg + ("" if got >= expected[name] else " (different ones)"), layer))
        # layout closure: each scatter's output is exactly what the next operator consumes
        qkv, gate_up = h.get((layer, "qkv"), empty), h.get((layer, "gate_up"), empty)
        kv, attn, mlp = h.get((layer, "kv"), empty), h.get((layer, "attn"), empty), h.get((layer, "h"), empty)
        resid_in, resid_mid = h.get((layer, "resid.in"), empty), h.get((layer, "resid.mid"), empty)
        resid_out = h.get((layer, "resid.out"), empty)
        layout = [
            (kv == frozenset(c for c in qkv if c >= q_size), "KV cache shard is not the scattered k/v"),
            (
                attn == frozenset(c for c in qkv if c < q_size),
                "o_proj consumes other q coordinates than attention produced",
            ),
            (resid_mid == resid_in, "o_proj scatter delivers other residual coordinates than the worker holds"),
            (
                mlp == frozenset(c for c in gate_up if c < inter),
                "down_proj consumes other MLP coordinates than gate produced",
            ),
            (
                mlp == frozenset(c - inter for c in gate_up if c >= inter),
                "SwiGLU pairs gate and up from different coordinates",
            ),
        ]
        if layer + 1 < n_layers:  # (the last layer's down goes to the client: no scatter, no resid.out)
            layout.append(
                (resid_out == resid_in, "down scatter delivers other residual coordinates than the worker holds")
            )
            next_in = h.get((layer + 1, "resid.in"), empty)
            layout.append((next_in == resid_out, "next layer consumes other residual coordinates"))
        for ok, msg in layout:
            n_closure += 1
            if not ok:
                findings.append(("closure", msg, layer))
    return h, findings, (n_hold, n_closure)


def check_client(ctx: Verification, steps: list[dict], ingress: dict, egress: dict) -> None:
    """The client's side of the boundary: ingress element counts per worker (its residual shard, and
    its layer-0 q/k/v shard: "qkv0") and egress (its full-width partial of the final residual: H per
    token)."""
    n = ctx.n
    for r in steps:
        key = (r.get("session"), r.get("step"))
        t = r.get("t") or 0
        where = dict(rank=0, session=key[0], step=key[1])
        ctx.flows[key][0] = {}
        for raw in r.get("events") or []:
            try:
                e = read_event(raw)
                ctx.res.checks["accounting"] += 1
                if e.kind == S.CONTROL:
                    continue
                if e.kind not in (S.INGRESS, S.EGRESS):
                    ctx.violate(Violation("closure", f"client transfer of kind {e.kind!r} inside a step", **where))
                counts = e.sent if e.kind == S.INGRESS else e.received
                for q, v in enumerate(counts):
                    if not v:
                        continue
                    if e.op == "qkv0":  # layer 0's q/k/v shard: the worker's declared q/k/v coordinates
                        want = declared = len(ctx.decls[q - 1].qkv) * t if 1 <= q <= n else None
                    else:
                        want = len((ingress if e.kind == S.INGRESS else egress).get(q, ())) * t
                        declared = (
                            (len(ctx.decls[q - 1].resid) if e.kind == S.INGRESS else ctx.dims["hidden"]) * t
                            if 1 <= q <= n
                            else None
                        )
                    if v != want or v != declared:
                        msg = f"{e.kind} rank {q}: {v} elements, expected {want}"
                        ctx.violate(Violation("accounting", msg, **where))
                prev_sent, prev_received = ctx.flows[key][0].get(e.op, ([0] * (n + 1), [0] * (n + 1)))
                ctx.flows[key][0][e.op] = (
                    [a + b for a, b in zip(prev_sent, e.sent, strict=False)],
                    [a + b for a, b in zip(prev_received, e.received, strict=False)],
                )
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                ctx.violate(Violation("structure", f"malformed client event ({type(exc).__name__})", **where))


# ---- across ranks ----


def check_conservation(ctx: Verification) -> None:
    """What rank r sent to q in operator X is what q received from r in X."""
    for key, per_rank in ctx.flows.items():
        for r, ops in per_rank.items():
            for op, (sent, _received) in ops.items():
                for q, v in enumerate(sent):
                    if not v or q not in per_rank:
                        continue
                    ctx.res.checks["accounting"] += 1
                    peer_received = per_rank[q].get(op, ((), ()))[1]
                    got = peer_received[r] if r < len(peer_received) else None
                    if got != v:
                        msg = f"{op}: rank {r} sent {v} elements to rank {q}, which received {got}"
                        ctx.violate(Violation("accounting", msg, rank=r, session=key[0], step=key[1]))


def check_boundary(ctx: Verification, ingress: dict, egress: dict) -> None:
    """Ingress coordinates = the residual layer 0 consumes; egress = every residual coordinate (each
    worker's last down partial, summed by the client; check_holds: no worker holds the final residual)."""
    everything = frozenset(range(ctx.dims["hidden"]))
    for key, per_w in ctx.held.items():
        for w, h in per_w.items():
            where = dict(rank=w + 1, session=key[0], step=key[1])
            ctx.res.checks["closure"] += 2
            if ingress and h.get((0, "resid.in")) != ingress.get(w + 1):
                msg = "ingress coordinates differ from the residual layer 0 consumes"
                ctx.violate(Violation("closure", msg, layer=0, **where))
            if egress and egress.get(w + 1) != everything:
                msg = "egress coordinates are not the whole residual the client sums the partials over"
                ctx.violate(Violation("closure", msg, layer=ctx.n_layers - 1, **where))


def check_partition(ctx: Verification) -> None:
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
                if not held_in_layer(name, layer, ctx.n_layers, ctx.down_to_client):
                    continue  # nobody's (check_holds: a worker claiming it is a violation)
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
                    k = smallest_cover(role_sets, universe)
                    hit = cover_cache[ck] = (disjoint and union == universe, disjoint, full, objs)  # objs: ids alive
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


def smallest_cover(sets: list[frozenset[int]], universe: frozenset[int]) -> int | None:
    """The fewest sets whose union covers the universe (None: even all of them do not)."""
    n = len(sets)
    if n > 12:  # brute force is 2^n; beyond that report the greedy bound
        covered: set[int] = set()
        used = 0
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
