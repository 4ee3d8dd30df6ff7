"""The masked plan: group A and k mask groups, each splitting every linear's output rows among its
members, as data.

Groups: A computes on masked inputs; the mask groups (named "B" when k = 1, else "B1".."Bk") each
compute the products of their own mask stream. Ranks: 0 client; group A = 1..n_A; then each mask
group in order. Reading the client's data takes A plus a member of every mask group. Per layer four
linears, in this order (the client's dependency chain: each needs the nonlinear step after the
previous one):

  op  name     W                       in (K)      out (rows)
  0   qkv      [q; k; v]_proj          H           n_h d + 2 n_kv d
  1   o        o_proj                  n_h d       H
  2   gate_up  [gate; up]_proj         H           2 I
  3   down     down_proj               I           H

Why output rows and not input columns (the structural mode's reduce-scatter layout): there, the split
is the protection; here the masks are. A masked input is uniform noise, so every member of A may get
all of it; each member then computes whole output rows, and no partial sum ever has to travel
between workers. The group needs no collective at all (one round trip client <-> member per linear
instead of a round trip plus an all-to-all), weight memory is still ~1/n per member, and "no message
between workers" becomes a one-line audit rule. Groups are split independently (n_A != n_B is fine).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property

from ..model.config import ModelConfig
from ..structural.plan import PlanError, apportion, contiguous_ranges

LINEARS = ("qkv", "o", "gate_up", "down")
ELEMENT_BYTES = 8  # int64 ring elements on the wire


def mask_group_names(k: int) -> tuple[str, ...]:
    """ "B" for one mask group (the original two-group protocol), else "B1".."Bk"."""
    return ("B",) if k == 1 else tuple(f"B{i}" for i in range(1, k + 1))


@dataclass(frozen=True)
class LinearShape:
    op: int
    name: str
    rows: int  # output features
    k: int  # input features


def linear_shapes(c: ModelConfig) -> tuple[LinearShape, ...]:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return (
        LinearShape(0, "qkv", q + 2 * kv, c.hidden),
        LinearShape(1, "o", c.hidden, q),
        LinearShape(2, "gate_up", 2 * c.intermediate, c.hidden),
        LinearShape(3, "down", c.hidden, c.intermediate),
    )


@dataclass(frozen=True)
class MaskedPlan:
    config: ModelConfig
    n_a: int
    b_sizes: tuple[int, ...]  # members of each mask group
    limb_bits: int
    # rows[g][member][op] = (start, stop) of that linear's output rows; g indexes `groups`
    rows: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]

    @property
    def groups(self) -> tuple[str, ...]:
        return ("A", *self.mask_groups)

    @property
    def mask_groups(self) -> tuple[str, ...]:
        return mask_group_names(len(self.b_sizes))

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.n_a, *self.b_sizes)

    @property
    def n(self) -> int:
        return sum(self.sizes)

    @property
    def spec(self) -> str:
        """The group sizes as --workers writes them: 2+2, 2+2+1."""
        return "+".join(map(str, self.sizes))

    @cached_property
    def shapes(self) -> tuple[LinearShape, ...]:
        return linear_shapes(self.config)

    def ranks(self, group: str) -> list[int]:
        g = self.groups.index(group)
        first = 1 + sum(self.sizes[:g])
        return list(range(first, first + self.sizes[g]))

    def group_of(self, rank: int) -> tuple[str, int]:
        """(group, member index) of a worker rank."""
        start = 1
        for g, size in zip(self.groups, self.sizes, strict=True):
            if start <= rank < start + size:
                return g, rank - start
            start += size
        raise PlanError(f"rank {rank} is not a worker of a {self.spec} masked job")

    def member_rows(self, group: str, member: int, op: int) -> tuple[int, int]:
        return self.rows[self.groups.index(group)][member][op]

    def n_rows(self, group: str, member: int, op: int) -> int:
        a, b = self.member_rows(group, member, op)
        return b - a

    def rows_per_layer(self, group: str, member: int) -> int:
        """Rows of one layer's four linears owned by a member (the size of a mask member's per-layer
        message)."""
        return sum(self.n_rows(group, member, s.op) for s in self.shapes)

    # ---- predictions (per token, whole model) ----

    def bytes_per_token(self) -> dict[str, int]:
        c, per = self.config, ELEMENT_BYTES * self.config.n_layers
        k_sum = sum(s.k for s in self.shapes)
        out_sum = sum(s.rows for s in self.shapes)
        return {
            "client_to_A": per * k_sum * self.n_a,  # every member of A gets the whole masked input
            "A_to_client": per * out_sum,
            "B_to_client": per * out_sum * len(self.b_sizes),  # every mask group returns every row
            "client_to_B": 0,  # a control word per step and a key per session only
            "between_workers": 0,
            "layers": c.n_layers,
        }

    def weight_elements(self, group: str, member: int) -> int:
        return self.config.n_layers * sum(self.n_rows(group, member, s.op) * s.k for s in self.shapes)

    def to_dict(self) -> dict:
        c = self.config
        return {
            "mode": "masked",
            "model": {
                "arch": c.arch,
                "hidden": c.hidden,
                "intermediate": c.intermediate,
                "layers": c.n_layers,
                "heads": c.n_heads,
                "kv_heads": c.n_kv_heads,
                "head_dim": c.head_dim,
                "vocab": c.vocab,
            },
            "groups": dict(zip(self.groups, self.sizes, strict=True)),
            "limb_bits": self.limb_bits,
            "linears": [{"op": s.op, "name": s.name, "rows": s.rows, "k": s.k} for s in self.shapes],
            "members": [
                {
                    "rank": r,
                    "group": g,
                    "member": m,
                    "rows": {s.name: list(self.member_rows(g, m, s.op)) for s in self.shapes},
                    "weight_bytes_float64": self.weight_elements(g, m) * 8,
                }
                for g in self.groups
                for r in self.ranks(g)
                for m in [self.group_of(r)[1]]
            ],
            "bytes_per_token": self.bytes_per_token(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def make_masked_plan(config: ModelConfig, n_a: int, b_sizes: int | tuple[int, ...], limb_bits: int) -> MaskedPlan:
    b_sizes = (b_sizes,) if isinstance(b_sizes, int) else tuple(b_sizes)
    sizes = (n_a, *b_sizes)
    if not b_sizes or any(n < 1 for n in sizes):
        raise PlanError(f"masked mode needs at least one worker in each group, got {'+'.join(map(str, sizes))}")
    shapes = linear_shapes(config)
    rows = []
    for g, n in zip(("A", *mask_group_names(len(b_sizes))), sizes, strict=True):
        per_op = [contiguous_ranges(apportion(s.rows, (1.0,) * n, f"group {g}: {s.name} rows")) for s in shapes]
        rows.append(tuple(tuple(per_op[op][m] for op in range(len(shapes))) for m in range(n)))
    return MaskedPlan(config=config, n_a=n_a, b_sizes=b_sizes, limb_bits=limb_bits, rows=tuple(rows))


def parse_groups(text: str) -> tuple[int, ...]:
    """ "2+2" -> (2, 2); "2+2+1" -> (2, 2, 1): group A, then each mask group."""
    parts = text.split("+")
    if len(parts) < 2 or not all(p.strip().isdigit() for p in parts):
        raise PlanError(f"masked mode needs group sizes A+B (or A+B1+...+Bk), e.g. 2+2, got {text!r}")
    return tuple(int(p) for p in parts)
