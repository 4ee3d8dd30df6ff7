"""The ownership map of a plan: which worker holds which coordinates of every protected tensor, and
the transfers of one step, as an SVG (`fusion plan --picture`, the control page). Also the masked
plan's picture: what group A and each mask group receive and compute (`fusion plan --mode masked`).

The drawing is audit/verify/drawing.py (standard library only), shared with the picture the
verifier draws from an audit run's logs (audit/verify/picture.py: what was checked, not what was
planned); this module only turns a plan into its lanes, so the two pictures of one run compare lane
by lane.
"""

from __future__ import annotations

from ..audit.verify.drawing import (
    COLOURS,
    LANE_W,
    LEFT,
    ROLE_LABELS,
    ROLES,
    Holding,
    Picture,
    render_svg,
    runs,
    scatter_matrix,
    write_svg,
)

__all__ = [
    "COLOURS",
    "LANE_W",
    "LEFT",
    "ROLES",
    "ROLE_LABELS",
    "Holding",
    "Picture",
    "masked_picture",
    "plan_holdings",
    "plan_picture",
    "render_svg",
    "runs",
    "write_svg",
]


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


def plan_picture(plan, title: str = "") -> Picture:
    c = plan.config
    caps = ", ".join(f"{s.capacity:g}" for s in plan.workers)
    resid = list(plan.residual_sizes)
    return Picture(
        title=title or f"Ownership plan: {plan.n} workers (capacities {caps})",
        subtitle=f"{c.arch}, hidden {c.hidden}, intermediate {c.intermediate}, {c.n_heads} heads / "
        f"{c.n_kv_heads} KV groups x {c.head_dim // 2} RoPE pairs; the same in each of the {c.n_layers} layers; "
        + "".join(f"{f}; " for f in c.features())
        + f"plan {plan.fingerprint()}",
        # numbered from 1, as the logs, the audit's pictures and `fusion chat`'s /workers number them
        workers=tuple(f"worker {s.rank} (rank {s.rank})" for s in plan.workers),
        rows=plan_holdings(plan),
        ingress=tuple(resid),
        egress=tuple(resid),
        scatter=scatter_matrix(list(plan.qkv_sizes), resid, list(plan.gate_up_sizes)),
    )


# ---- the masked plan ----

MASKED_INPUTS = {  # linear -> what its input is (the client sends it to group A, masked by the sum of the masks)
    "qkv": "normed x",
    "o": "attention out",
    "gate_up": "normed x",
    "down": "SiLU(gate)*up",
}


def _member(group: str, m: int, size: int) -> str:
    """A member's short name: its group's name (A, B, or B1..Bk when there are k mask groups), then
    "." and its number in the group when the group has more than one: "A.2" and "B.2" at 2+2,
    "B1.2" in mask group B1 at 1+2+1, "B2" for the one member of mask group B2 at 1+1+1. A digit
    right after the letter always names a mask group, never a member."""
    return group if size == 1 else f"{group}.{m + 1}"


def masked_picture(plan, title: str = "") -> Picture:
    """What every member of group A and of each mask group receives and computes, per layer.

    Per linear, one lane for the input group A receives (every member of A gets all of it, masked by
    the sum of the mask groups' r_i: drawn hatched, one band per member; a mask group's member
    receives no data, it draws r_i from its session key), then one lane per group for the output rows
    its members compute (W_fx m in A, W_fx r_i in mask group i; each group splits the rows on its
    own). Nothing flows between workers."""
    c = plan.config
    members = [(g, m, r) for g in plan.groups for r in plan.ranks(g) for m in [plan.group_of(r)[1]]]
    labels = tuple(f"{_member(g, m, plan.sizes[plan.groups.index(g)])} (rank {r})" for g, m, r in members)
    colours = tuple(plan.groups.index(g) * 3 + m for g, m, _ in members)  # each group from its own colour on
    rows = []
    for s in plan.shapes:
        rows.append(
            Holding(
                f"{s.name}.in",
                s.k,
                tuple(((0, s.k),) if g == "A" else () for g, _, _ in members),
                label=f"{s.name}: in ({MASKED_INPUTS[s.name]})",
                hatched=tuple(g == "A" for g, _, _ in members),
                stacked=True,
            )
        )
        for group in plan.groups:
            rows.append(
                Holding(
                    f"{s.name}.out.{group}",
                    s.rows,
                    tuple((plan.member_rows(g, m, s.op),) if g == group else () for g, m, _ in members),
                    label=f"{s.name}: rows of {group}",
                )
            )
    k_sum = sum(s.k for s in plan.shapes)
    ingress = tuple(k_sum if g == "A" else 0 for g, _, _ in members)
    egress = tuple(plan.rows_per_layer(g, m) for g, m, _ in members)
    groups = ", ".join(f"{g}: {n}" for g, n in zip(plan.groups, plan.sizes, strict=True))
    return Picture(
        title=title or f"Masked plan {plan.spec}: what each group receives and computes",
        subtitle=f"{c.arch}, hidden {c.hidden}, intermediate {c.intermediate}; groups {groups}; the same in each "
        f"of the {c.n_layers} layers; " + "".join(f"{f}; " for f in c.features()) + f"plan {plan.fingerprint()}",
        notes=(
            "Hatched: every member of group A receives each linear's whole input, masked in Z/2^64 by the sum of "
            "the mask groups' r_i;",
            "a mask group's member receives no data (a control word per step, a key per session): it draws r_i "
            "itself and returns W_fx r_i.",
            "Names: a group (A; B, or B1..Bk for k mask groups), then .m for its m-th member when it has several "
            "(B.2: member 2 of group B; B2: mask group B2).",
        ),
        workers=labels,
        colours=colours,
        rows=tuple(rows),
        ingress=ingress,
        egress=egress,
        scatter=None,
        lanes_title="Per linear: the input group A receives (hatched: masked), then each group's output rows",
        transfers_title="The transfers of one layer (ring elements per token; int64 on the wire)",
        client_in="client: x + sum r_i",
        client_out="client: unmask",
        ingress_label="to A: every input, masked",
        egress_label="back: each member's rows",
        scatter_label=("between workers: nothing", "(no message between any two workers, in any group)"),
    )
