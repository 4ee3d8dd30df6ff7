"""The ownership map of an audit run, drawn from its logs as the verifier reads them: what was
checked, not what was planned (`fusion audit verify DIR --picture FILE`).

Part of the independent verifier: imports only audit/schema.py, its siblings and the standard
library. Each epoch's worker logs are read and parsed by the verifier's own per-rank pass
(logs.read_rank_log, checks.check_worker: the hash chain, the `sets` and `holds` records, "same"
expanded), and the lanes are the coordinate sets that pass produced, the ones the partition and
"no full holder" checks run on: per protected role (schema.role_parts), per worker, the
coordinates its tensors stood for. A role's lane is the same in every step and layer of an honest
run; where a worker's sets differ between steps or layers, the bar is their union and a note says
how many distinct sets there were. The transfers are one recorded step's (the first decode step):
the client's ingress and egress events, and each worker's layer-0 transfers to each peer, per
token. The verifier's verdict on the same directory heads each epoch's picture.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

from .. import schema as S
from .checks import Verification, check_worker
from .drawing import Holding, Picture, runs
from .logs import RankLog, load_manifest, read_event, read_manifest, read_rank_log
from .membership import epoch_entries
from .result import Result, RunResult

MAX_NOTES = 6  # variations listed per epoch; the rest are counted


def audit_pictures(path: str | Path, verdict: Result | RunResult) -> list[Picture]:
    """One picture per epoch of a cold start (or of one epoch's directory), each headed by the
    verifier's `verdict` on that directory (verify_dir's answer)."""
    d = Path(path)
    manifest = read_manifest(d)
    if "epochs" not in manifest:
        assert isinstance(verdict, Result)
        return [epoch_picture(d, manifest, verdict, None)]
    assert isinstance(verdict, RunResult)
    by_dir = {e.dir: e for e in verdict.epochs}
    scratch = RunResult(dir=str(d))  # epoch_entries reports missing epochs here; the verdict has them already
    pictures = []
    for e, sub in epoch_entries(d, manifest, scratch):
        res = by_dir.get(str(sub))
        if res is None:  # the verifier could not read this epoch (its violation is in the verdict)
            continue
        pictures.append(epoch_picture(sub, load_manifest(sub), res, e))
    for i, pic in enumerate(pictures):  # who left before the epoch, as the membership check found it
        left = [
            f"worker {x['participant']} {x['why']} before this epoch: "
            + ("takes no part from here on (checked)" if x["absent"] else "TAKES PART after it left")
            + (
                f", its process sent {x['kernel']['sent']:,} B and received {x['kernel']['received']:,} B after (kernel)"
                if x.get("kernel")
                else ""
            )
            for x in verdict.departures
            if x.get("epoch") == pic.epoch
        ]
        left += [
            f"its first step replays {x['tokens']} tokens: {'closed' if x['closed'] else 'NOT closed'}"
            for x in verdict.replays
            if x.get("epoch") == pic.epoch
        ]
        if left:
            pictures[i] = replace(pic, notes=(*pic.notes, "; ".join(left)))
    if pictures:
        head = f"cold start {'PASS' if verdict.ok else 'FAIL'}: {verdict.summary_line()}"
        run_level = verdict.run_violations
        if run_level:
            head += f"; across epochs: {_counts(run_level)}"
        pictures[0] = replace(pictures[0], notes=(head, *pictures[0].notes))
    return pictures


def parsed_holdings(d: Path, manifest: dict) -> tuple[dict[int, RankLog], Verification]:
    """Every worker's log of one epoch through the verifier's own per-rank pass: `ctx.held` is
    step -> worker -> {(layer, hold name): coordinates}, as the cross-rank checks read it."""
    dims, n = manifest["model"]["dims"], int(manifest["workers"])
    res = Result(dir=str(d), workers=n, layers=int(dims["layers"]), variant=manifest.get("variant", "sharded"))
    wire = str(manifest.get("wire"))
    ctx = Verification(res, dims, n, res.layers, wire=wire if wire in S.LINK_BACKENDS else "tls")
    logs = {
        rank: read_rank_log(d / S.log_name(rank), rank, manifest["chains"].get(str(rank)), res) for rank in range(n + 1)
    }
    ctx.declare_shares(logs)
    for w in range(n):
        check_worker(ctx, w, logs[w + 1].body)
    return logs, ctx


def role_sets(ctx: Verification) -> dict[tuple[int, str], Counter]:
    """(worker, role) -> Counter of the coordinate sets (in the role's own space) it held, one count
    per (step, layer) record."""
    parts = S.role_parts(ctx.dims)
    by_hold: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for role, (name, a, b) in parts.items():
        by_hold[name].append((role, a, b))
    out: dict[tuple[int, str], Counter] = defaultdict(Counter)
    memo: dict[tuple[int, str], frozenset[int]] = {}  # the verifier interns equal sets: slice each once
    for per_worker in ctx.held.values():
        for w, held in per_worker.items():
            for (_, name), coords in held.items():
                for role, a, b in by_hold.get(name, ()):
                    key = (id(coords), role)
                    part = memo.get(key)
                    if part is None:
                        part = memo[key] = frozenset(c - a for c in coords if a <= c < b)
                    out[(w, role)][part] += 1
    return out


def epoch_picture(d: Path, manifest: dict, verdict: Result, epoch: int | None) -> Picture:
    logs, ctx = parsed_holdings(d, manifest)
    dims, n = ctx.dims, ctx.n
    parts = S.role_parts(dims)
    hd, group = dims["head_dim"], dims["heads"] // max(1, dims["kv_heads"])
    q_ticks = tuple(range(group * hd, dims["heads"] * hd, group * hd))
    kv_ticks = tuple(range(hd, dims["kv_heads"] * hd, hd))
    ticks = {"q": q_ticks, "attn": q_ticks, "k": kv_ticks, "v": kv_ticks, "kcache": kv_ticks, "vcache": kv_ticks}
    sets = role_sets(ctx)
    records = len(ctx.held) * ctx.n_layers  # (step, layer) pairs every worker should have a record for
    rows, varied = [], []
    for role, (_, a, b) in parts.items():
        held = []
        for w in range(n):
            seen = sets.get((w, role), Counter())
            union = frozenset().union(*seen) if seen else frozenset()
            held.append(runs(union))
            if len(seen) > 1:
                varied.append(f"worker rank {w + 1}, {role}: {len(seen)} different sets over {records} records")
            elif sum(seen.values()) < records:
                varied.append(f"worker rank {w + 1}, {role}: recorded in {sum(seen.values())} of {records} records")
        rows.append(Holding(role, b - a, tuple(held), ticks.get(role, ())))
    participants = [logs[w + 1].header.get("participant") for w in range(n)]
    labels = tuple(
        f"worker {p} (rank {w + 1})" if isinstance(p, int) else f"rank {w + 1}" for w, p in enumerate(participants)
    )
    colours = tuple(p - 1 if isinstance(p, int) and p >= 1 else w for w, p in enumerate(participants))
    notes = [f"verifier: {'PASS' if verdict.ok else 'FAIL'}, {verdict.summary_line()}"]
    if verdict.violations:
        notes[0] += f" ({_counts(verdict.violations)})"
    if varied:
        notes.append(
            "not the same in every step and layer (drawn: the union): "
            + "; ".join(varied[:MAX_NOTES])
            + (f"; {len(varied) - MAX_NOTES} more" if len(varied) > MAX_NOTES else "")
        )
    ingress, egress, scatter, which = step_transfers(logs, n)
    where = "" if epoch is None else f", epoch {epoch}"
    return Picture(
        title=f"Audited holdings{where}: {n} workers, as the verifier read the logs",
        subtitle=f"{dims.get('arch', '?')}, hidden {dims['hidden']}, intermediate {dims['intermediate']}, "
        f"{dims['heads']} heads / {dims['kv_heads']} KV groups; {len(ctx.held)} steps x {ctx.n_layers} layers "
        f"of holds records; {d}",
        notes=tuple(notes),
        workers=labels,
        colours=colours,
        epoch=epoch,
        rows=tuple(rows),
        ingress=ingress,
        egress=egress,
        scatter=scatter,
        transfers_title=f"The transfers of one recorded step ({which}; elements per token, as logged)",
        scatter_label=(
            "layer 0, every transfer between workers:",
            "sender (row) sends each peer (column), per token",
        ),
    )


def step_transfers(
    logs: dict[int, RankLog], n: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...], str]:
    """Per token of the client's first decode step (else its first step): what the client's ingress
    sent each worker, what its egress received from each, and what each worker sent each peer in
    layer 0 (every kind but control), from the logged events; and which step that was."""
    steps = logs[0].steps
    if not steps:
        return (0,) * n, (0,) * n, tuple((0,) * n for _ in range(n)), "no step recorded"
    step = next((r for r in steps if r.get("phase") == "decode"), steps[0])
    key, t = (step.get("session"), step.get("step")), max(1, int(step.get("t") or 1))
    ingress, egress = [0] * n, [0] * n
    for raw in step.get("events") or []:
        e = read_event(raw)
        for w in range(n):
            if e.kind == S.INGRESS and w + 1 < len(e.sent):
                ingress[w] += e.sent[w + 1]
            if e.kind == S.EGRESS and w + 1 < len(e.received):
                egress[w] += e.received[w + 1]
    scatter = []
    for w in range(n):
        row = [0] * n
        mine = next((r for r in logs[w + 1].steps if (r.get("session"), r.get("step")) == key), None)
        for raw in (mine or {}).get("events") or []:
            e = read_event(raw)
            if e.layer != 0 or e.kind in (S.CONTROL, S.INGRESS, S.EGRESS):
                continue
            for q in range(n):
                if q != w and q + 1 < len(e.sent):
                    row[q] += e.sent[q + 1]
        scatter.append(tuple(v // t for v in row))
    which = f"session {key[0]} step {key[1]}, {step.get('phase')}, {t} token{'s' if t != 1 else ''}"
    return tuple(v // t for v in ingress), tuple(v // t for v in egress), tuple(scatter), which


def _counts(violations) -> str:
    c = Counter(v.invariant for v in violations)
    return ", ".join(f"{k} {v}" for k, v in c.items())
