"""The ownership map as an SVG picture: which worker holds which coordinates of every protected
tensor, and the transfers of one step. Standard library only (plain SVG text), so `fusion plan
--picture` and the audit report draw it without any plotting dependency.

One picture has two parts:
  rows       one lane per protected role (schema.role_parts' names: resid.in, q, k, v, kcache, ...),
             each lane the role's coordinate space [0, size) drawn left to right, every worker's
             coordinates a bar (one <rect> per [start, stop) run) in that worker's colour; KV group
             boundaries are ticks on the attention lanes
  transfers  ingress (client -> each worker: its residual rows), the four reduce-scatters of every
             layer as a sender x receiver table of elements per token, egress (each worker -> client)

The holdings come from a plan (`plan_picture`: what was planned) or from an audit epoch's worker
logs (`audit_picture`: what the verifier read in the `holds` records, i.e. what was checked). Both
give the same `Holding` rows, so the two pictures of one run can be compared lane by lane.

Every bar is a <g class="hold" data-role=... data-worker=...> whose <rect>s carry data-start and
data-stop; x and width are the runs' coordinates scaled by LANE_W / size, which tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

# Okabe-Ito (colour-blind safe), then a few more; workers beyond cycle.
COLOURS = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#999999",
    "#332288",
    "#88CCEE",
    "#117733",
    "#AA4499",
)

LEFT = 170  # label column
LANE_W = 760  # width of a coordinate space
LANE_H = 18
ROW_H = 34
WIDTH = LEFT + LANE_W + 40

ROLE_LABELS = {
    "resid.in": "R residual (layer in)",
    "q": "q (heads x dims)",
    "k": "k (KV groups x dims)",
    "v": "v (KV groups x dims)",
    "kcache": "KV cache: k",
    "vcache": "KV cache: v",
    "attn": "attention out (q space)",
    "resid.mid": "R residual (after attn)",
    "gate": "M gate",
    "up": "M up",
    "h": "M activations h",
    "resid.out": "R residual (layer out)",
}
ROLES = tuple(ROLE_LABELS)


def runs(indices) -> tuple[tuple[int, int], ...]:
    """Sorted maximal [start, stop) runs of a set of coordinates."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


@dataclass(frozen=True)
class Holding:
    """One protected role: its space size and, per worker (in rank order), the runs it holds."""

    role: str
    size: int
    held: tuple[tuple[tuple[int, int], ...], ...]
    ticks: tuple[int, ...] = ()  # coordinates where a KV group (or head) boundary falls


@dataclass(frozen=True)
class Picture:
    title: str
    subtitle: str
    workers: tuple[str, ...]  # a label per worker, rank order
    rows: tuple[Holding, ...]
    ingress: tuple[int, ...]  # elements per token the client sends each worker
    egress: tuple[int, ...]  # elements per token each worker returns to the client
    scatter: tuple[tuple[int, ...], ...]  # [sender][receiver] elements per token per layer, 4 scatters


# ---- from a plan ----


def plan_holdings(plan) -> tuple[Holding, ...]:
    """The roles' coordinates every worker of `plan` owns (the same in every layer)."""
    c = plan.config
    d = c.head_dim
    q_size, kv_size = c.n_heads * d, c.n_kv_heads * d
    n = plan.n

    def kv_coords(w: int) -> list[int]:
        return [g * d + j for b in plan.workers[w].attention for g in range(b.g0, b.g1) for j in b.head_dims(d)]

    resid = tuple(((s.residual[0], s.residual[1]),) for s in plan.workers)
    mlp = tuple(((s.mlp[0], s.mlp[1]),) for s in plan.workers)
    q = tuple(runs(plan.o_cols(w)) for w in range(n))
    kv = tuple(runs(kv_coords(w)) for w in range(n))
    q_ticks = tuple(range(c.group_size * d, q_size, c.group_size * d))
    kv_ticks = tuple(range(d, kv_size, d))
    by_role = {
        "resid.in": (c.hidden, resid, ()),
        "q": (q_size, q, q_ticks),
        "k": (kv_size, kv, kv_ticks),
        "v": (kv_size, kv, kv_ticks),
        "kcache": (kv_size, kv, kv_ticks),
        "vcache": (kv_size, kv, kv_ticks),
        "attn": (q_size, q, q_ticks),
        "resid.mid": (c.hidden, resid, ()),
        "gate": (c.intermediate, mlp, ()),
        "up": (c.intermediate, mlp, ()),
        "h": (c.intermediate, mlp, ()),
        "resid.out": (c.hidden, resid, ()),
    }
    return tuple(Holding(role, size, held, ticks) for role, (size, held, ticks) in by_role.items())


def scatter_matrix(qkv: list[int], resid: list[int], gate_up: list[int]) -> tuple[tuple[int, ...], ...]:
    """Elements per token per layer that sender w sends owner q in the four reduce-scatters (QKV and
    gate/up are norm-fused: one extra element, the sender's local sum of squares)."""
    n = len(resid)
    return tuple(
        tuple(0 if q == w else (qkv[q] + 1) + resid[q] + (gate_up[q] + 1) + resid[q] for q in range(n))
        for w in range(n)
    )


def plan_picture(plan, title: str = "") -> Picture:
    c = plan.config
    caps = ", ".join(f"{s.capacity:g}" for s in plan.workers)
    resid = list(plan.residual_sizes)
    return Picture(
        title=title or f"Ownership plan: {plan.n} workers (capacities {caps})",
        subtitle=f"{c.arch}, hidden {c.hidden}, intermediate {c.intermediate}, {c.n_heads} heads / "
        f"{c.n_kv_heads} KV groups x {c.head_dim // 2} RoPE pairs; the same in each of the {c.n_layers} layers; "
        f"plan {plan.fingerprint()}",
        workers=tuple(f"worker {s.worker} (rank {s.rank})" for s in plan.workers),
        rows=plan_holdings(plan),
        ingress=tuple(resid),
        egress=tuple(resid),
        scatter=scatter_matrix(list(plan.qkv_sizes), resid, list(plan.gate_up_sizes)),
    )


# ---- drawing ----


def _x(coord: int, size: int) -> float:
    return round(LEFT + LANE_W * coord / size, 3)


def short_name(label: str, w: int) -> str:
    """ "worker 3 (rank 1)" -> "w3": the bars and arrows name a worker as its legend does."""
    parts = label.split()
    return f"w{parts[1]}" if len(parts) > 1 and parts[0] == "worker" else f"w{w}"


def render_svg(pic: Picture) -> str:
    n = len(pic.workers)
    names = [short_name(label, w) for w, label in enumerate(pic.workers)]
    out: list[str] = []
    y = 30
    out.append(f'<text x="10" y="{y}" font-size="18" font-weight="bold">{escape(pic.title)}</text>')
    y += 20
    out.append(f'<text x="10" y="{y}" font-size="12" fill="#444">{escape(pic.subtitle)}</text>')
    # legend
    y += 24
    x = 10
    for w, label in enumerate(pic.workers):
        col = COLOURS[w % len(COLOURS)]
        out.append(f'<rect class="legend" data-worker="{w}" x="{x}" y="{y - 11}" width="14" height="14" fill="{col}"/>')
        out.append(f'<text x="{x + 19}" y="{y + 1}" font-size="12">{escape(label)}</text>')
        x += 30 + 7 * len(label)
        if x > WIDTH - 160:
            x, y = 10, y + 20
    y += 30
    out.append(
        f'<text x="10" y="{y}" font-size="13" font-weight="bold">Who holds which coordinates '
        f"(one lane per protected tensor, [0, size) left to right)</text>"
    )
    y += 10
    for h in pic.rows:
        out += _lane(h, y, names)
        y += ROW_H
    y += 16
    out += _transfers(pic, y, names)
    y += 70 + 22 * (n + 1) + 12
    body = "\n".join(out)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" viewBox="0 0 {WIDTH} {y}" '
        f'font-family="DejaVu Sans, Arial, sans-serif">\n<rect x="0" y="0" width="{WIDTH}" height="{y}" '
        f'fill="white"/>\n{body}\n</svg>\n'
    )


def _lane(h: Holding, y: float, names: list[str]) -> list[str]:
    out = [
        f'<text x="10" y="{y + 13}" font-size="12">{escape(ROLE_LABELS.get(h.role, h.role))}</text>',
        f'<text x="{LEFT + LANE_W + 4}" y="{y + 13}" font-size="10" fill="#666">{h.size}</text>',
        f'<rect x="{LEFT}" y="{y}" width="{LANE_W}" height="{LANE_H}" fill="#eee" stroke="#bbb"/>',
    ]
    for w, held in enumerate(h.held):
        col = COLOURS[w % len(COLOURS)]
        n_coords = sum(b - a for a, b in held)
        out.append(f'<g class="hold" data-role="{escape(h.role)}" data-worker="{w}" data-count="{n_coords}">')
        for a, b in held:
            x0, x1 = _x(a, h.size), _x(b, h.size)
            out.append(
                f'<rect data-start="{a}" data-stop="{b}" x="{x0}" y="{y}" width="{round(x1 - x0, 3)}" '
                f'height="{LANE_H}" fill="{col}"><title>worker {w}: [{a}, {b})</title></rect>'
            )
        out.append("</g>")
        # the worker's number on its widest run, when there is room
        if held:
            a, b = max(held, key=lambda r: r[1] - r[0])
            if _x(b, h.size) - _x(a, h.size) > 24:
                cx = (_x(a, h.size) + _x(b, h.size)) / 2
                out.append(
                    f'<text x="{round(cx, 1)}" y="{y + 13}" font-size="11" fill="white" '
                    f'text-anchor="middle">{names[w]}</text>'
                )
    for t in h.ticks:
        xt = _x(t, h.size)
        out.append(f'<line x1="{xt}" y1="{y - 2}" x2="{xt}" y2="{y + LANE_H + 2}" stroke="black" stroke-width="1"/>')
    return out


def _transfers(pic: Picture, y: float, names: list[str]) -> list[str]:
    n = len(pic.workers)
    out = [
        f'<text x="10" y="{y}" font-size="13" font-weight="bold">The transfers of one step '
        f"(elements per token; fp32 on the wire)</text>"
    ]
    y += 16
    box_w, box_h, gap = 120, 18, 4
    top = y + 24
    cx_client_in, cx_workers, cx_client_out = 10, 200, 420
    mid = top + (n * (box_h + gap)) / 2
    out.append(
        '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="3" orient="auto">'
        '<path d="M0,0 L7,3 L0,6 z" fill="#333"/></marker></defs>'
    )
    out.append(f'<rect x="{cx_client_in}" y="{mid - 14}" width="110" height="28" fill="#fff" stroke="#000"/>')
    out.append(f'<text x="{cx_client_in + 55}" y="{mid + 4}" font-size="11" text-anchor="middle">client: embed</text>')
    out.append(f'<rect x="{cx_client_out}" y="{mid - 14}" width="140" height="28" fill="#fff" stroke="#000"/>')
    out.append(
        f'<text x="{cx_client_out + 70}" y="{mid + 4}" font-size="11" text-anchor="middle">client: norm, LM head</text>'
    )
    out.append(f'<text x="{cx_client_in}" y="{y + 8}" font-size="11" fill="#444">ingress: x[:, R_w]</text>')
    out.append(f'<text x="{cx_client_out - 60}" y="{y + 8}" font-size="11" fill="#444">egress: final x[:, R_w]</text>')
    for w in range(n):
        col = COLOURS[w % len(COLOURS)]
        by = top + w * (box_h + gap)
        out.append(f'<rect x="{cx_workers}" y="{by}" width="{box_w}" height="{box_h}" fill="{col}"/>')
        out.append(f'<text x="{cx_workers + 6}" y="{by + 13}" font-size="11" fill="white">{names[w]}</text>')
        out.append(
            f'<line class="ingress" data-worker="{w}" data-elements="{pic.ingress[w]}" x1="{cx_client_in + 110}" '
            f'y1="{mid}" x2="{cx_workers - 2}" y2="{by + box_h / 2}" stroke="#333" marker-end="url(#arr)"/>'
        )
        out.append(
            f'<text x="{cx_workers + box_w - 4}" y="{by + 13}" font-size="10" fill="white" '
            f'text-anchor="end">in {pic.ingress[w]} / out {pic.egress[w]}</text>'
        )
        out.append(
            f'<line class="egress" data-worker="{w}" data-elements="{pic.egress[w]}" x1="{cx_workers + box_w}" '
            f'y1="{by + box_h / 2}" x2="{cx_client_out - 2}" y2="{mid}" stroke="#333" marker-end="url(#arr)"/>'
        )
    # the reduce-scatter table: row = sender, column = owner (receiver)
    tx, cell = 600, 56
    out.append(
        f'<text x="{tx}" y="{y + 8}" font-size="11" fill="#444">per layer, 4 reduce-scatters '
        f"(QKV, o_proj, gate/up, down):</text>"
    )
    out.append(
        f'<text x="{tx}" y="{y + 22}" font-size="11" fill="#444">sender (row) sends each owner (column) '
        f"the rows it owns</text>"
    )
    ty = y + 40
    for q in range(n):
        out.append(
            f'<text x="{tx + 40 + q * cell + cell / 2}" y="{ty}" font-size="11" text-anchor="middle">'
            f"to {names[q]}</text>"
        )
    for w in range(n):
        ry = ty + 6 + w * 22
        out.append(f'<text x="{tx}" y="{ry + 14}" font-size="11">{names[w]}</text>')
        for q in range(n):
            v = pic.scatter[w][q]
            fill = "#f4f4f4" if v == 0 else COLOURS[q % len(COLOURS)]
            out.append(
                f'<rect class="scatter" data-from="{w}" data-to="{q}" data-elements="{v}" '
                f'x="{tx + 40 + q * cell}" y="{ry}" width="{cell - 2}" height="20" fill="{fill}" '
                f'fill-opacity="{0.15 if v == 0 else 0.35}"/>'
            )
            out.append(
                f'<text x="{tx + 40 + q * cell + cell / 2}" y="{ry + 14}" font-size="11" '
                f'text-anchor="middle">{"-" if v == 0 else v}</text>'
            )
    return out


def write_svg(pic: Picture, path) -> None:
    from pathlib import Path

    Path(path).write_text(render_svg(pic))
