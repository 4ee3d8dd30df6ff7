"""The masked plan: two groups, each splitting every linear's output rows among its members, as data.

Ranks: 0 client; group A = 1..n_A; group B = n_A+1..n_A+n_B. Per layer four linears, in this order
(the client's dependency chain: each needs the nonlinear step after the previous one):

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

from ..config import ModelConfig
from ..plan import PlanError, apportion, contiguous_ranges

LINEARS = ("qkv", "o", "gate_up", "down")
GROUPS = ("A", "B")
ELEMENT_BYTES = 8  # int64 ring elements on the wire


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
    n_b: int
    limb_bits: int
    # rows[g][member][op] = (start, stop) of that linear's output rows
    rows: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]

    @property
    def n(self) -> int:
        return self.n_a + self.n_b

    @cached_property
    def shapes(self) -> tuple[LinearShape, ...]:
        return linear_shapes(self.config)

    def ranks(self, group: str) -> list[int]:
        return list(range(1, self.n_a + 1)) if group == "A" else list(range(self.n_a + 1, self.n + 1))

    def group_of(self, rank: int) -> tuple[str, int]:
        """(group, member index) of a worker rank."""
        if 1 <= rank <= self.n_a:
            return "A", rank - 1
        if self.n_a < rank <= self.n:
            return "B", rank - self.n_a - 1
        raise PlanError(f"rank {rank} is not a worker of a {self.n_a}+{self.n_b} masked job")

    def member_rows(self, group: str, member: int, op: int) -> tuple[int, int]:
        return self.rows[GROUPS.index(group)][member][op]

    def n_rows(self, group: str, member: int, op: int) -> int:
        a, b = self.member_rows(group, member, op)
        return b - a

    def rows_per_layer(self, group: str, member: int) -> int:
        """Rows of one layer's four linears owned by a member (the size of B's per-layer message)."""
        return sum(self.n_rows(group, member, s.op) for s in self.shapes)

    # ---- predictions (per token, whole model) ----

    def bytes_per_token(self) -> dict[str, int]:
        c, per = self.config, ELEMENT_BYTES * self.config.n_layers
        k_sum = sum(s.k for s in self.shapes)
        out_sum = sum(s.rows for s in self.shapes)
        return {
            "client_to_A": per * k_sum * self.n_a,  # every member of A gets the whole masked input
            "A_to_client": per * out_sum,
            "B_to_client": per * out_sum,
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
            "model": {"arch": c.arch, "hidden": c.hidden, "intermediate": c.intermediate, "layers": c.n_layers,
                      "heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "vocab": c.vocab},
            "groups": {"A": self.n_a, "B": self.n_b},
            "limb_bits": self.limb_bits,
            "linears": [{"op": s.op, "name": s.name, "rows": s.rows, "k": s.k} for s in self.shapes],
            "members": [
                {"rank": r, "group": g, "member": m,
                 "rows": {s.name: list(self.member_rows(g, m, s.op)) for s in self.shapes},
                 "weight_bytes_float64": self.weight_elements(g, m) * 8}
                for g in GROUPS for r in self.ranks(g) for m in [self.group_of(r)[1]]
            ],
            "bytes_per_token": self.bytes_per_token(),
        }  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def make_masked_plan(config: ModelConfig, n_a: int, n_b: int, limb_bits: int) -> MaskedPlan:
    if n_a < 1 or n_b < 1:
        raise PlanError(f"masked mode needs at least one worker in each group, got {n_a}+{n_b}")
    shapes = linear_shapes(config)
    rows = []
    for g, n in (("A", n_a), ("B", n_b)):
        per_op = [contiguous_ranges(apportion(s.rows, (1.0,) * n, f"group {g}: {s.name} rows")) for s in shapes]
        rows.append(tuple(tuple(per_op[op][m] for op in range(len(shapes))) for m in range(n)))
    return MaskedPlan(config=config, n_a=n_a, n_b=n_b, limb_bits=limb_bits, rows=tuple(rows))


def parse_groups(text: str) -> tuple[int, int]:
    """ "2+2" -> (2, 2)."""
    a, sep, b = text.partition("+")
    if not sep or not a.strip().isdigit() or not b.strip().isdigit():
        raise PlanError(f"masked mode needs group sizes A+B, e.g. 2+2, got {text!r}")
    return int(a), int(b)
