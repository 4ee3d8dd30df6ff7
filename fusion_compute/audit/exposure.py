"""Exposure analysis: holding is not knowing (`fusion audit exposure`).

With public weights, most of what a worker observes is a *linear function of the full residual*:

  point "attn" (x: the residual entering layer L, input of the QKV projection)
    own     x[R_w]                                       its residual shard
    shard   (W_qkv diag(g))[QKV_w] x / s                 its q/k/v rows after the reduce-scatter
    wire    (W_qkv diag(g))[QKV_w, R_r] x[R_r], r != w   each peer's partial, received separately
  point "mlp" (x': the residual after attention, input of gate/up): the same with W_gate|up

The wire rows exist only where the plan scatters that linear (`Plan.scattered`, the boundary as data:
`Plan.boundary`): layer 0's q/k/v are computed by the client and arrive with the ingress, already
summed and normalised, so at layer 0's "attn" point a worker receives no peer partials and its wire
view is its shard view (`peer_partials`). (The last layer's down partials go to the client, not to
peers; like every o/down partial they are not counted here, see below.)

s = sqrt(Σx²/H + ε) is known to the worker (the fused norm delivers Σx² to every owner), so the
shard rows are linear in x. (Layer 0's q/k/v come without Σx²: they are linear in x / s, and the
worker's own coordinates x[R_w] fix the scale, so the rank counts the same directions.) The rank of
the stacked map (per layer, point, party, view) says how many directions of the residual the party
can pin down; rank H means the party can reconstruct the whole residual by least squares.
(Attention outputs, o/down partials, Σx² per worker and Gemma 3's post-norm Σy² sums are nonlinear
in x and not counted: the ranks here are lower bounds on what a party learns.)
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from ..model import architecture as arch
from ..structural.plan import Plan
from ..weights.loader import WeightSource

POINTS = {
    # point -> (the fused linear read there: architecture.py, plan row map)
    "attn": ("qkv", "qkv_rows"),
    "mlp": ("gate_up", "gate_up_rows"),
}
VIEWS = ("shard", "wire")


@dataclass
class Exposure:
    layer: int
    point: str  # attn | mlp
    party: tuple[int, ...]  # 0-based workers
    view: str  # shard | wire
    rank: int
    hidden: int
    rows: int  # observed linear functions
    sigma_ratio: float  # smallest / largest nonzero singular value of the part beyond own coords

    @property
    def full(self) -> bool:
        return self.rank == self.hidden


def fused_weight(src: WeightSource, layer: int, point: str) -> torch.Tensor:
    """(out, H) projection rows of a point with the norm gain folded in, float64."""
    name = POINTS[point][0]
    return arch.read_weight(src, layer, name).double() * arch.read_norm(src, layer, name).double()


def peer_partials(plan: Plan, layer: int, point: str) -> bool:
    """Whether a worker receives its peers' partials at this layer and point: the plan scatters the
    point's linear there (`Plan.scattered`; not layer 0's q/k/v, which the client sends summed)."""
    return plan.scattered(layer, POINTS[point][0])


def partial_rows(plan: Plan, w: int, layer: int, point: str) -> int:
    """Per token, the peer-partial rows worker w receives at this layer and point (wire view): its
    shard's rows from each of the N - 1 others, or none where `peer_partials` says none are sent."""
    if not peer_partials(plan, layer, point):
        return 0
    return len(getattr(plan, POINTS[point][1])(w)) * (plan.n - 1)


def observation_matrix(
    plan: Plan, w_full: torch.Tensor, party: tuple[int, ...], view: str, point: str, layer: int
) -> torch.Tensor:
    """(rows, H): every linear function of the residual the party observes at this layer and point."""
    h = plan.config.hidden
    blocks = []
    for w in party:
        a, b = plan.workers[w].residual
        own = torch.zeros(b - a, h, dtype=torch.float64)
        own[:, a:b] = torch.eye(b - a, dtype=torch.float64)
        rows = torch.tensor(getattr(plan, POINTS[point][1])(w))
        shard = w_full[rows]
        blocks += [own, shard]
        if view == "wire" and peer_partials(plan, layer, point):
            for r, s in enumerate(plan.workers):
                if r == w:
                    continue
                part = torch.zeros_like(shard)
                part[:, s.residual[0] : s.residual[1]] = shard[:, s.residual[0] : s.residual[1]]
                blocks.append(part)
    return torch.cat(blocks)


# Numerical rank at a relative tolerance of 1e-6 on singular values: the observations are fp32
# (rounding ~1e-7 relative), so a direction weaker than 1e-6 of the strongest is lost in rounding
# and cannot be reconstructed; exactly dependent directions sit at ~1e-8 (float64 Gram), far below.
RANK_RTOL = 1e-6


def _rank(m: torch.Tensor) -> tuple[int, float]:
    """(numerical rank, smallest kept / largest singular value) via the smaller Gram matrix."""
    if m.numel() == 0:
        return 0, 1.0
    g = m.T @ m if m.shape[0] >= m.shape[1] else m @ m.T
    sv = torch.linalg.eigvalsh(g).clamp(min=0).sqrt()
    top = float(sv.max())
    if top == 0.0:
        return 0, 0.0
    kept = sv[sv > RANK_RTOL * top]
    return len(kept), float(kept.min()) / top


def _own_mask(plan: Plan, party: tuple[int, ...]) -> torch.Tensor:
    own = torch.zeros(plan.config.hidden, dtype=torch.bool)
    for w in party:
        own[plan.workers[w].residual[0] : plan.workers[w].residual[1]] = True
    return own


def rank_of(plan: Plan, a: torch.Tensor, party: tuple[int, ...]) -> tuple[int, float]:
    """Rank of an explicit observation matrix (observation_matrix). Own coordinates are identity
    rows, so rank = |own| + rank of the rest restricted to the other columns."""
    own = _own_mask(plan, party)
    r, ratio = _rank(a[:, ~own])
    return int(own.sum()) + r, ratio


def party_rank(
    plan: Plan, w_full: torch.Tensor, party: tuple[int, ...], view: str, point: str, layer: int
) -> tuple[int, float]:
    """Same number as rank_of(observation_matrix(...)), computed on the structure: the wire view's
    partials from a non-member r act on x[R_r] alone, so the map is block-diagonal over r and its
    rank is |own| + Σ_r rank(stacked partial blocks); the shard rows are implied by the partials.
    Where no partials are sent (`peer_partials`), the wire view is the shard view."""
    own = _own_mask(plan, party)
    rows = torch.tensor([i for w in party for i in getattr(plan, POINTS[point][1])(w)])
    shard = w_full[rows]
    if view == "shard" or not peer_partials(plan, layer, point):
        r, ratio = _rank(shard[:, ~own])
        return int(own.sum()) + r, ratio
    total, ratio = int(own.sum()), 1.0
    for r_w, s in enumerate(plan.workers):
        if r_w in party:
            continue
        rr, rat = _rank(shard[:, s.residual[0] : s.residual[1]])
        total += rr
        ratio = min(ratio, rat)
    return total, ratio


def _n_rows(plan: Plan, party: tuple[int, ...], view: str, point: str, layer: int) -> int:
    """How many linear functions the party observes (own coords + shard rows [+ partials])."""
    n = 0
    for w in party:
        n += plan.workers[w].n_residual + len(getattr(plan, POINTS[point][1])(w))
        n += partial_rows(plan, w, layer, point) if view == "wire" else 0
    return n


def analyse(src: WeightSource, plan: Plan, layers: list[int] | None = None, coalitions: bool = True) -> list[Exposure]:
    """Ranks per layer, point, single worker and view; for a (point, view) where no single worker
    reaches full rank, also the coalitions of increasing size until one does."""
    c = plan.config
    out: list[Exposure] = []
    for layer in layers if layers is not None else range(c.n_layers):
        for point in POINTS:
            w_full = fused_weight(src, layer, point)
            for view in VIEWS:
                singles = []
                for w in range(plan.n):
                    r, ratio = party_rank(plan, w_full, (w,), view, point, layer)
                    rows = _n_rows(plan, (w,), view, point, layer)
                    singles.append(Exposure(layer, point, (w,), view, r, c.hidden, rows, ratio))
                out += singles
                if not coalitions or any(e.full for e in singles):
                    continue
                for k in range(2, plan.n + 1):
                    found = False
                    for party in itertools.combinations(range(plan.n), k):
                        r, ratio = party_rank(plan, w_full, party, view, point, layer)
                        rows = _n_rows(plan, party, view, point, layer)
                        e = Exposure(layer, point, party, view, r, c.hidden, rows, ratio)
                        out.append(e)
                        found |= e.full
                    if found:
                        break
    return out


def reconstruct(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least-squares estimate of the residual x from observations y = A x (float64)."""
    return torch.linalg.lstsq(a, y.double().reshape(a.shape[0], -1)).solution.reshape(a.shape[1], *y.shape[1:])


def smallest_full_party(results: list[Exposure], layer: int, point: str, view: str) -> int | None:
    sizes = [len(e.party) for e in results if e.layer == layer and e.point == point and e.view == view and e.full]
    return min(sizes) if sizes else None


def summarize(results: list[Exposure], plan: Plan) -> dict:
    """Per worker and view: at how many (layer, point) pairs it alone has full rank; per (point, view):
    the smallest coalition reaching full rank at every layer."""
    layers = sorted({e.layer for e in results})
    per_worker: dict[int, dict[str, dict[str, int | None]]] = {}  # worker -> view -> counts
    for w in range(plan.n):
        per_worker[w] = {}
        for view in VIEWS:
            mine = [e for e in results if e.party == (w,) and e.view == view]
            per_worker[w][view] = {
                "full_rank_points": sum(e.full for e in mine),
                "points": len(mine),
                "min_rank": min(e.rank for e in mine) if mine else None,
                "max_rank": max(e.rank for e in mine) if mine else None,
            }
    coalition = {}
    for point in POINTS:
        for view in VIEWS:
            ks = [smallest_full_party(results, L, point, view) for L in layers]
            reached = [k for k in ks if k is not None]  # None: a layer no coalition reaches
            coalition[f"{point}/{view}"] = max(reached) if len(reached) == len(ks) else None
    return {
        "hidden": plan.config.hidden,
        "workers": plan.n,
        "layers": layers,
        "per_worker": per_worker,
        "smallest_full_coalition": coalition,
        # the analysed (layer, point) pairs where the wire view adds nothing (no peer partials are
        # sent: `peer_partials`), and the scatters the plan's boundary merged into ingress / egress
        "no_peer_partials": [
            f"L{layer}.{point}" for layer in layers for point in POINTS if not peer_partials(plan, layer, point)
        ],
        "boundary": plan.boundary["merged"],
    }


def to_rows(results: list[Exposure]) -> list[dict]:
    return [asdict(e) | {"full": e.full} for e in results]
