"""Drawing an ownership map as SVG text: lanes of coordinate ranges, one bar per worker, and the
transfers of one step. Standard library only, and nothing about where the ranges come from.

It lives in the verifier's package because the verifier may import only its siblings, audit/schema.py
and the standard library (tests/test_audit.py parses the imports): the picture of an audit run's logs
(picture.py here) is drawn from the verifier's own parsed records with it, and the picture of a plan
(structural/picture.py; of audit/, structural may import only this leaf, tests/test_structure.py) with the same code, so the two can be compared
lane by lane. Neither drawing decides anything: the data in a `Picture` is all there is.

One picture has two parts:
  rows       one lane per protected role (schema.role_parts' names: resid.in, q, k, v, kcache, ...),
             each lane the role's coordinate space [0, size) drawn left to right, every worker's
             coordinates a bar (one <rect> per [start, stop) run) in that worker's colour; KV group
             boundaries are ticks on the attention lanes
  transfers  ingress (client -> each worker), a sender x receiver table of elements per token and
             layer between workers, egress (each worker -> client); left out when `scatter` is None

Every bar is a <g class="hold" data-role=... data-worker=...> (plus data-epoch when the picture is
one epoch of several) whose <rect>s carry data-start and data-stop; x and width are the runs'
coordinates scaled by LANE_W / size, which tests check. Several pictures (a run's epochs) stack
into one SVG: `render_svg(*pictures)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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


def escape(text: str) -> str:
    """Text for SVG content and double-quoted attributes (xml.sax.saxutils' escape, plus quotes; the
    verifier's import rule admits a short list of standard modules, tests/test_audit.py)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


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
    """One lane: a role, its space size and, per worker (in rank order), the runs it holds."""

    role: str
    size: int
    held: tuple[tuple[tuple[int, int], ...], ...]
    ticks: tuple[int, ...] = ()  # coordinates where a KV group (or head) boundary falls
    label: str = ""  # the lane's name (default: ROLE_LABELS[role], else the role)
    hatched: tuple[bool, ...] = ()  # per worker: drawn hatched (masked data: held, but uniform noise)
    stacked: bool = False  # the workers' bars may overlap (each gets the same data): one band each


@dataclass(frozen=True)
class Picture:
    title: str
    subtitle: str
    workers: tuple[str, ...]  # a label per worker, rank order
    rows: tuple[Holding, ...]
    ingress: tuple[int, ...]  # elements per token the client sends each worker
    egress: tuple[int, ...]  # elements per token each worker returns to the client
    scatter: tuple[tuple[int, ...], ...] | None  # [sender][receiver] elements per token per layer; None: no table
    notes: tuple[str, ...] = ()  # lines under the subtitle (a verdict, what varied)
    colours: tuple[int, ...] = ()  # per worker, an index into COLOURS (default: its rank order)
    epoch: int | None = None  # set on the bars as data-epoch (several epochs in one SVG)
    lanes_title: str = "Who holds which coordinates (one lane per protected tensor, [0, size) left to right)"
    transfers_title: str = "The transfers of one step (elements per token; fp32 on the wire)"
    client_in: str = "client: embed"
    client_out: str = "client: norm, LM head"
    ingress_label: str = "ingress: x[:, R_w], layer-0 qkv"
    egress_label: str = "egress: last down partial (H), summed"
    scatter_label: tuple[str, str] = (
        "per layer, 4 reduce-scatters (QKV, o_proj, gate/up, down):",
        "sender (row) sends each owner (column) the rows it owns",
    )

    def colour(self, w: int) -> str:
        return COLOURS[(self.colours[w] if self.colours else w) % len(COLOURS)]


def scatter_matrix(qkv: list[int], resid: list[int], gate_up: list[int]) -> tuple[tuple[int, ...], ...]:
    """Elements per token per layer that sender w sends owner q in the four reduce-scatters (QKV and
    gate/up are norm-fused: one extra element, the sender's local sum of squares)."""
    n = len(resid)
    return tuple(
        tuple(0 if q == w else (qkv[q] + 1) + resid[q] + (gate_up[q] + 1) + resid[q] for q in range(n))
        for w in range(n)
    )


def _x(coord: int, size: int) -> float:
    return round(LEFT + LANE_W * coord / size, 3)


def short_name(label: str, w: int) -> str:
    """ "worker 3 (rank 1)" -> "w3": the bars and arrows name a worker as its legend does; "A.1 (rank 1)" -> "A.1"."""
    parts = label.split()
    if len(parts) > 1 and parts[0] == "worker":
        return f"w{parts[1]}"
    return parts[0] if parts and len(parts[0]) <= 4 else f"w{w}"


def render_svg(*pictures: Picture) -> str:
    """One SVG of the pictures stacked top to bottom (a rule between two)."""
    out: list[str] = [
        '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="3" orient="auto">'
        '<path d="M0,0 L7,3 L0,6 z" fill="#333"/></marker>'
        '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="white" fill-opacity="0.0"/><line x1="0" y1="0" x2="0" y2="6" '
        'stroke="white" stroke-width="2.5"/></pattern></defs>'
    ]
    y = 0.0
    for i, pic in enumerate(pictures):
        if i:
            out.append(f'<line x1="10" y1="{y + 4}" x2="{WIDTH - 10}" y2="{y + 4}" stroke="#999" stroke-width="2"/>')
            y += 8
        lines, y = _draw(pic, y)
        out += lines
    body = "\n".join(out)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y}" viewBox="0 0 {WIDTH} {y}" '
        f'font-family="DejaVu Sans, Arial, sans-serif">\n<rect x="0" y="0" width="{WIDTH}" height="{y}" '
        f'fill="white"/>\n{body}\n</svg>\n'
    )


def _draw(pic: Picture, y0: float) -> tuple[list[str], float]:
    n = len(pic.workers)
    names = [short_name(label, w) for w, label in enumerate(pic.workers)]
    out: list[str] = []
    y = y0 + 30
    out.append(f'<text x="10" y="{y}" font-size="18" font-weight="bold">{escape(pic.title)}</text>')
    y += 20
    out.append(f'<text x="10" y="{y}" font-size="12" fill="#444">{escape(pic.subtitle)}</text>')
    for note in pic.notes:
        y += 16
        out.append(f'<text class="note" x="10" y="{y}" font-size="12" fill="#222">{escape(note)}</text>')
    # legend
    y += 24
    x = 10
    for w, label in enumerate(pic.workers):
        out.append(
            f'<rect class="legend" data-worker="{w}" x="{x}" y="{y - 11}" width="14" height="14" fill="{pic.colour(w)}"/>'
        )
        out.append(f'<text x="{x + 19}" y="{y + 1}" font-size="12">{escape(label)}</text>')
        x += 30 + 7 * len(label)
        if x > WIDTH - 160:
            x, y = 10, y + 20
    y += 30
    out.append(f'<text x="10" y="{y}" font-size="13" font-weight="bold">{escape(pic.lanes_title)}</text>')
    y += 10
    for h in pic.rows:
        out += _lane(pic, h, y, names)
        y += ROW_H
    if pic.scatter is None and not pic.ingress:
        return out, y + 10
    y += 16
    out += _transfers(pic, y, names)
    y += 70 + 22 * (n + 1) + 12
    return out, y


def _lane(pic: Picture, h: Holding, y: float, names: list[str]) -> list[str]:
    label = h.label or ROLE_LABELS.get(h.role, h.role)
    out = [
        f'<text x="10" y="{y + 13}" font-size="12">{escape(label)}</text>',
        f'<text x="{LEFT + LANE_W + 4}" y="{y + 13}" font-size="10" fill="#666">{h.size}</text>',
        f'<rect x="{LEFT}" y="{y}" width="{LANE_W}" height="{LANE_H}" fill="#eee" stroke="#bbb"/>',
    ]
    epoch = "" if pic.epoch is None else f' data-epoch="{pic.epoch}"'
    holders = [w for w, held in enumerate(h.held) if held]
    for w, held in enumerate(h.held):
        y_w, h_w = y, float(LANE_H)
        if h.stacked and held:  # a band of the lane per worker that holds anything
            h_w = LANE_H / len(holders)
            y_w = round(y + holders.index(w) * h_w, 3)
        col = pic.colour(w)
        n_coords = sum(b - a for a, b in held)
        hatched = bool(h.hatched and h.hatched[w])
        masked = ' data-masked="1"' if hatched else ""
        out.append(
            f'<g class="hold" data-role="{escape(h.role)}" data-worker="{w}"{epoch} data-count="{n_coords}"{masked}>'
        )
        for a, b in held:
            x0, x1 = _x(a, h.size), _x(b, h.size)
            out.append(
                f'<rect data-start="{a}" data-stop="{b}" x="{x0}" y="{y_w}" width="{round(x1 - x0, 3)}" '
                f'height="{round(h_w, 3)}" fill="{col}"><title>{escape(names[w])}: [{a}, {b})</title></rect>'
            )
        out.append("</g>")
        for a, b in held if hatched else ():
            x0, x1 = _x(a, h.size), _x(b, h.size)
            out.append(
                f'<rect x="{x0}" y="{y_w}" width="{round(x1 - x0, 3)}" height="{round(h_w, 3)}" fill="url(#hatch)" '
                f'pointer-events="none"/>'
            )
        # the worker's name on its widest run, when there is room
        if held:
            a, b = max(held, key=lambda r: r[1] - r[0])
            if _x(b, h.size) - _x(a, h.size) > 24 and h_w >= 14:
                cx = (_x(a, h.size) + _x(b, h.size)) / 2
                out.append(
                    f'<text x="{round(cx, 1)}" y="{round(y_w + h_w / 2 + 4, 1)}" font-size="11" fill="white" '
                    f'text-anchor="middle">{escape(names[w])}</text>'
                )
    for t in h.ticks:
        xt = _x(t, h.size)
        out.append(f'<line x1="{xt}" y1="{y - 2}" x2="{xt}" y2="{y + LANE_H + 2}" stroke="black" stroke-width="1"/>')
    return out


def _transfers(pic: Picture, y: float, names: list[str]) -> list[str]:
    n = len(pic.workers)
    out = [f'<text x="10" y="{y}" font-size="13" font-weight="bold">{escape(pic.transfers_title)}</text>']
    y += 16
    box_w, box_h, gap = 120, 18, 4
    top = y + 24
    cx_client_in, cx_workers, cx_client_out = 10, 200, 420
    mid = top + (n * (box_h + gap)) / 2
    out.append(f'<rect x="{cx_client_in}" y="{mid - 14}" width="110" height="28" fill="#fff" stroke="#000"/>')
    out.append(
        f'<text x="{cx_client_in + 55}" y="{mid + 4}" font-size="11" text-anchor="middle">{escape(pic.client_in)}</text>'
    )
    out.append(f'<rect x="{cx_client_out}" y="{mid - 14}" width="140" height="28" fill="#fff" stroke="#000"/>')
    out.append(
        f'<text x="{cx_client_out + 70}" y="{mid + 4}" font-size="11" text-anchor="middle">{escape(pic.client_out)}</text>'
    )
    out.append(f'<text x="{cx_client_in}" y="{y + 8}" font-size="11" fill="#444">{escape(pic.ingress_label)}</text>')
    out.append(
        f'<text x="{cx_client_out - 60}" y="{y + 8}" font-size="11" fill="#444">{escape(pic.egress_label)}</text>'
    )
    for w in range(n):
        by = top + w * (box_h + gap)
        out.append(f'<rect x="{cx_workers}" y="{by}" width="{box_w}" height="{box_h}" fill="{pic.colour(w)}"/>')
        out.append(f'<text x="{cx_workers + 6}" y="{by + 13}" font-size="11" fill="white">{escape(names[w])}</text>')
        if pic.ingress[w]:
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
    tx, cell = 600, 56
    if pic.scatter is None:
        out.append(f'<text x="{tx}" y="{y + 8}" font-size="11" fill="#444">{escape(pic.scatter_label[0])}</text>')
        out.append(f'<text x="{tx}" y="{y + 22}" font-size="11" fill="#444">{escape(pic.scatter_label[1])}</text>')
        return out
    # the table of transfers between workers: row = sender, column = receiver
    out.append(f'<text x="{tx}" y="{y + 8}" font-size="11" fill="#444">{escape(pic.scatter_label[0])}</text>')
    out.append(f'<text x="{tx}" y="{y + 22}" font-size="11" fill="#444">{escape(pic.scatter_label[1])}</text>')
    ty = y + 40
    for q in range(n):
        out.append(
            f'<text x="{tx + 40 + q * cell + cell / 2}" y="{ty}" font-size="11" text-anchor="middle">'
            f"to {escape(names[q])}</text>"
        )
    for w in range(n):
        ry = ty + 6 + w * 22
        out.append(f'<text x="{tx}" y="{ry + 14}" font-size="11">{escape(names[w])}</text>')
        for q in range(n):
            v = pic.scatter[w][q]
            fill = "#f4f4f4" if v == 0 else pic.colour(q)
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


def write_svg(pictures: Picture | Sequence[Picture], path: str | Path) -> None:
    """Write one picture, or several stacked, to `path`."""
    Path(path).write_text(render_svg(*([pictures] if isinstance(pictures, Picture) else pictures)))
