"""The plan: which worker owns which coordinates of every protected tensor, as data.

One function, `make_plan(config, n_workers, capacities)`, fixes a layout for every role
(docs/design.md, "The plan"). Workers, the client, tests, the benchmark and the audit all read the same frozen
object; `plan.to_json()` prints it.

Layouts (worker w = rank w + 1):
  R  residual      [0, H)  split into N contiguous ranges, proportional to capacity
  A  attention     KV groups x RoPE pairs. N <= n_kv: whole groups per worker. N > n_kv: a
                   group's pairs (i, i + d/2) are split across workers, a pair never split, so
                   rotary embedding stays local. A worker's share is a few `AttnBlock`s.
  M  MLP           [0, I)  split into N contiguous ranges

Fused output spaces, each permuted so that every owner's coordinates are one contiguous chunk
(so a reduce-scatter is a plain, possibly uneven, split):
  QKV  [q (n_h*d) | k (n_kv*d) | v (n_kv*d)]  -> per owner, per block: q rows, k rows, v rows
  GU   [gate (I) | up (I)]                     -> per owner: gate M_w, up M_w

The boundary (`Plan.boundary`): the client's ingress sends worker w its residual shard x[:, R_w]
and its rows of layer 0's q/k/v (the client computes them: layer 0 has no QKV reduce-scatter); the
last layer's down has no reduce-scatter: each worker's egress is its full-width down partial, its
residual rows added (H per token), and the client sums them. A forward is then 4 reduce-scatters
per layer less those two, plus the score sums, plus the ingress and the egress. With post-norms
(Gemma 3) the last down keeps its scatter (its post-norm needs the summed y): the egress is the
worker's final residual rows in zeros (still H per token), and one scatter more.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from ..errors import FusionError
from ..model.config import ModelConfig

BYTES_PER_ELEMENT = 4  # float32's; a job on another dtype passes its own (runtime/placement.DTYPES)


class PlanError(FusionError, ValueError):
    """An impossible plan (too many workers for a dimension, bad capacities)."""


def apportion(n_units: int, capacities: tuple[float, ...], what: str) -> list[int]:
    """Split `n_units` into len(capacities) counts proportional to capacity, each >= 1
    (largest-remainder rounding, deterministic)."""
    n = len(capacities)
    if n_units < n:
        raise PlanError(f"{what} {n_units} cannot be split into {n} shards of >= 1")
    total = sum(capacities)
    ideal = [n_units * c / total for c in capacities]
    counts = [max(1, int(x)) for x in ideal]
    # Fix the sum: add to the largest remainders, take from the largest surpluses (keeping >= 1).
    while sum(counts) < n_units:
        i = max(range(n), key=lambda k: (ideal[k] - counts[k], -k))
        counts[i] += 1
    while sum(counts) > n_units:
        i = max((k for k in range(n) if counts[k] > 1), key=lambda k: (counts[k] - ideal[k], k))
        counts[i] -= 1
    return counts


def contiguous_ranges(counts: list[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


def runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """Compress sorted-or-not indices into maximal consecutive [start, stop) runs, in order."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


@dataclass(frozen=True)
class AttnBlock:
    """KV groups [g0, g1) x RoPE pairs [p0, p1) of each group, owned by one worker.

    Its head dims, in local order, are the first halves then the second halves of the pairs:
    [p0, p1) ++ [p0 + d/2, p1 + d/2), so rotate_half works on the local slice unchanged.
    """

    g0: int
    g1: int
    p0: int
    p1: int
    split: bool  # True when other workers own the group's remaining pairs

    @property
    def n_groups(self) -> int:
        return self.g1 - self.g0

    @property
    def dims(self) -> int:
        return 2 * (self.p1 - self.p0)

    def head_dims(self, head_dim: int) -> list[int]:
        half = head_dim // 2
        return list(range(self.p0, self.p1)) + list(range(self.p0 + half, self.p1 + half))


@dataclass(frozen=True)
class WorkerShare:
    worker: int  # 0-based; torch.distributed rank = worker + 1
    capacity: float
    residual: tuple[int, int]  # R_w
    attention: tuple[AttnBlock, ...]  # A_w
    mlp: tuple[int, int]  # M_w

    @property
    def rank(self) -> int:
        return self.worker + 1

    @property
    def n_residual(self) -> int:
        return self.residual[1] - self.residual[0]

    @property
    def n_mlp(self) -> int:
        return self.mlp[1] - self.mlp[0]


@dataclass(frozen=True)
class Plan:
    config: ModelConfig
    workers: tuple[WorkerShare, ...]
    # For every KV group, the workers owning some of its pairs (more than one = split group).
    group_owners: tuple[tuple[int, ...], ...]

    @property
    def n(self) -> int:
        return len(self.workers)

    # ---- fused-space row maps (index lists in the unpermuted HF spaces) ----

    def qkv_rows(self, w: int) -> list[int]:
        """Rows of [q; k; v] owned by worker w, in its chunk order: per block, q then k then v."""
        c = self.config
        d, gs = c.head_dim, c.group_size
        q_size, k_size = c.n_heads * d, c.n_kv_heads * d
        rows: list[int] = []
        for b in self.workers[w].attention:
            dims = b.head_dims(d)
            groups = range(b.g0, b.g1)
            rows += [h * d + j for g in groups for h in range(g * gs, (g + 1) * gs) for j in dims]
            rows += [q_size + g * d + j for g in groups for j in dims]
            rows += [q_size + k_size + g * d + j for g in groups for j in dims]
        return rows

    def o_cols(self, w: int) -> list[int]:
        """Columns of o_proj (= q-space coordinates) owned by worker w, in its local order."""
        c = self.config
        d, gs = c.head_dim, c.group_size
        cols: list[int] = []
        for b in self.workers[w].attention:
            dims = b.head_dims(d)
            cols += [h * d + j for g in range(b.g0, b.g1) for h in range(g * gs, (g + 1) * gs) for j in dims]
        return cols

    def gate_up_rows(self, w: int) -> list[int]:
        a, b = self.workers[w].mlp
        inter = self.config.intermediate
        return list(range(a, b)) + list(range(inter + a, inter + b))

    # ---- chunk sizes of the four reduce-scatters (rows per owner) ----

    @cached_property
    def qkv_sizes(self) -> tuple[int, ...]:
        return tuple(len(self.qkv_rows(w)) for w in range(self.n))

    @cached_property
    def gate_up_sizes(self) -> tuple[int, ...]:
        return tuple(2 * s.n_mlp for s in self.workers)

    @cached_property
    def residual_sizes(self) -> tuple[int, ...]:
        return tuple(s.n_residual for s in self.workers)

    # ---- predictions ----

    def collectives_per_layer(self, w: int) -> dict[str, int]:
        """Worker w's sequential exchanges in one layer's forward: the four reduce-scatters and one
        score sum per split attention block, and with post-norms (Gemma 3) two all-worker Σy² sums
        (ops.ShardedLayer.post_norm: y is known only after its scatter). Per-head q/k norms ride in
        the score sum (ops.ShardedLayer._qk_norm), sliding windows are masks: neither costs a round.
        The first layer's q/k/v and the last layer's down may come without their scatter (`boundary`:
        `collectives_per_forward`). One worker alone makes none of them: every count is 0 at N = 1."""
        split = sum(1 for b in self.workers[w].attention if b.split)
        out = {"reduce_scatter": 4, "score_sum": split}
        if self.config.post_norms:
            out["norm_sum"] = 2
        if self.n == 1:  # nothing is scattered or summed across workers (`scattered`)
            out = dict.fromkeys(out, 0)
        return out

    @staticmethod
    def given(layer: int, name: str) -> bool:
        """Whether layer `layer`'s fused linear `name` comes from the client with the ingress: layer 0's
        qkv, at every N (the client holds x and computes W_qkv RMSNorm(x) + b itself, `boundary`). No
        worker reads those weights, computes or scatters that linear (sharded.load_layer)."""
        return layer == 0 and name == "qkv"

    def to_client(self, layer: int, name: str) -> bool:
        """Whether layer `layer`'s linear `name` sends its partials to the client instead of scattering
        them among the workers: the last layer's down when `down_to_client`."""
        return self.down_to_client and layer == self.config.n_layers - 1 and name == "down"

    def scattered(self, layer: int, name: str) -> bool:
        """Whether the workers reduce-scatter layer `layer`'s linear `name` (every worker receives each
        peer's partial of its own rows): every linear of every layer at N >= 2, less those the
        boundary merges (`given`, `to_client`). The exposure analysis reads it (audit/exposure.py)."""
        return self.n > 1 and not self.given(layer, name) and not self.to_client(layer, name)

    @property
    def down_to_client(self) -> bool:
        """Whether the last layer's down partials go straight to the client (its scatter merged into
        the egress): not with post-norms (Gemma 3), whose last post-norm needs Σy² of the summed y,
        which no worker has before the scatter (structural/ops.py)."""
        return not self.config.post_norms

    def collectives_per_forward(self, w: int) -> int:
        """Worker w's collectives in one forward: every layer's, less those `boundary` merges (layer 0's
        QKV scatter into the ingress; the last layer's down scatter into the egress, unless post-norms
        keep it); none at N = 1, where nothing is scattered."""
        if self.n == 1:  # the boundary merges no scatter: there was none
            return 0
        per_layer = self.collectives_per_layer(w)
        return sum(per_layer.values()) * self.config.n_layers - len(self.boundary["merged"])

    def exchanges_per_forward(self, w: int) -> int:
        """Sequential exchanges of one forward as worker w counts them: its collectives plus the
        client's ingress and egress (SmolLM2 at N = 2: 4 x 30 - 2 + 2 = 120; with post-norms the last
        down scatter stays: one more)."""
        return self.collectives_per_forward(w) + 2

    @property
    def boundary(self) -> dict[str, Any]:
        """What crosses the client's boundary each forward, per worker and token, as data; "merged": the
        scatters it replaces, "down_to_client": whether the egress is the last down's partial."""
        last = self.config.n_layers - 1
        merged = ["L0.qkv reduce-scatter into the ingress"] if self.given(0, "qkv") else []
        if self.to_client(last, "down"):
            merged.append(f"L{last}.down reduce-scatter into the egress")
            egress = "W_down[:, M_w] h_w of the last layer, x[R_w] added in its rows; the client sums them"
        else:
            egress = "the worker's rows R_w of the final residual (its last down scattered and post-normed), "
            egress += "zeros elsewhere; the client sums them"
        return {
            "ingress": {
                "carries": "x[:, R_w], the embedding's rows of the worker's residual range, and the worker's "
                "rows of layer 0's q/k/v, W_qkv RMSNorm(x) + b, computed by the client",
                "elements_per_token": [r + q for r, q in zip(self.residual_sizes, self.qkv_sizes, strict=True)],
            },
            "egress": {
                "carries": egress,
                "elements_per_token": [self.config.hidden] * self.n,
            },
            "down_to_client": self.down_to_client,
            "merged": merged if self.n > 1 else [],
        }

    def bytes_per_token_layer(self, w: int, itemsize: int = BYTES_PER_ELEMENT) -> int:
        """Bytes worker w sends per token per layer in the four reduce-scatters (score sums excluded:
        they grow with sequence length; see `score_bytes`). Norm-fused scatters carry one extra
        element per destination (the sender's local sum of squares). `itemsize`: the wire dtype's
        bytes per element (the job's compute dtype)."""
        others = [q for q in range(self.n) if q != w]
        elems = sum(self.qkv_sizes[q] + 1 for q in others)
        elems += sum(self.residual_sizes[q] for q in others)  # o_proj
        elems += sum(self.gate_up_sizes[q] + 1 for q in others)
        elems += sum(self.residual_sizes[q] for q in others)  # down_proj
        return elems * itemsize

    def bytes_sent_per_token(self, w: int, itemsize: int = BYTES_PER_ELEMENT) -> int:
        """Bytes worker w sends to other workers per token in one forward (score sums excluded): every
        layer's scatters less layer 0's QKV (the client sends the q/k/v) and the last layer's down (its
        partial goes to the client, unless post-norms keep that scatter): `boundary`."""
        others = [q for q in range(self.n) if q != w]
        down = sum(self.residual_sizes[q] for q in others) if self.down_to_client else 0
        qkv = sum(self.qkv_sizes[q] + 1 for q in others)
        return self.bytes_per_token_layer(w, itemsize) * self.config.n_layers - (down + qkv) * itemsize

    def score_elements(self, w: int, n_queries: int, n_keys: int) -> int:
        """Elements in worker w's partial-score sums for one layer (split groups only)."""
        gs = self.config.group_size
        return sum(b.n_groups * gs * n_queries * n_keys for b in self.workers[w].attention if b.split)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        c = self.config
        out: dict[str, Any] = {
            "model": c.dims(),
            "workers": self.n,
            "group_owners": [list(o) for o in self.group_owners],
            "boundary": self.boundary,
            "shares": [],
        }
        for s in self.workers:
            w = s.worker
            weight_elems = self.weight_elements(w)
            out["shares"].append(
                {
                    "worker": w,
                    "rank": s.rank,
                    "capacity": s.capacity,
                    "residual": list(s.residual),
                    "attention": [asdict(b) | {"dims": b.dims} for b in s.attention],
                    "qkv_rows": self.qkv_sizes[w],
                    "mlp": list(s.mlp),
                    "weights": {
                        "qkv": [sum(self.qkv_sizes), s.n_residual],
                        "o": [c.hidden, len(self.o_cols(w))],
                        "gate_up": [2 * c.intermediate, s.n_residual],
                        "down": [c.hidden, s.n_mlp],
                        "elements_per_layer": weight_elems,
                        "not_read": [f"L{i}.{name}" for i, name in self.given_linears()],
                        "bytes_total_fp32": self.loaded_elements(w) * 4,
                    },
                    "collectives_per_layer": self.collectives_per_layer(w),
                    "collectives_per_forward": self.collectives_per_forward(w),
                    "bytes_sent_per_token_per_layer": self.bytes_per_token_layer(w),
                    "bytes_sent_per_token": self.bytes_sent_per_token(w),
                }
            )
        return out

    def linear_elements(self, w: int) -> dict[str, int]:
        """Worker w's weight elements per fused linear of one layer (norm-fused: the zero rows for Σx²
        are made, not read)."""
        c, s = self.config, self.workers[w]
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        return {
            "qkv": qkv_out * s.n_residual,  # all output rows, own input columns
            "o": c.hidden * len(self.o_cols(w)),  # all output rows, own attention columns
            "gate_up": 2 * c.intermediate * s.n_residual,
            "down": c.hidden * s.n_mlp,  # all output rows (the last layer's partial is full-width too)
        }

    def weight_elements(self, w: int) -> int:
        """Worker w's weight elements in a layer that reads all four linears (every layer but 0)."""
        return sum(self.linear_elements(w).values())

    def given_linears(self) -> list[tuple[int, str]]:
        """(layer, linear) the client computes and no worker reads (`given`)."""
        return [
            (i, name)
            for i in range(self.config.n_layers)
            for name in ("qkv", "o", "gate_up", "down")
            if self.given(i, name)
        ]

    def loaded_elements(self, w: int) -> int:
        """Worker w's weight elements read from the file over all layers: every layer's linears less
        the `given` ones (layer 0's q/k/v: sharded.load_layer reads none of it). Norm gains, biases
        and Qwen3's q/k norm gains (vectors) are not counted. The load's progress total
        (runtime/progress.worker_elements) and the start-up log's weights."""
        per = self.linear_elements(w)
        return self.weight_elements(w) * self.config.n_layers - sum(per[name] for _, name in self.given_linears())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def make_plan(config: ModelConfig, n_workers: int, capacities: tuple[float, ...] | None = None) -> Plan:
    c = config
    if n_workers < 1:
        raise PlanError(f"need at least 1 worker, got {n_workers}")
    caps = tuple(float(x) for x in capacities) if capacities else (1.0,) * n_workers
    if len(caps) != n_workers:
        raise PlanError(f"{len(caps)} capacities given for {n_workers} workers")
    if any(not (x > 0) for x in caps):
        raise PlanError(f"capacities must be positive, got {list(caps)}")
    half = c.head_dim // 2
    max_n = min(c.hidden, c.intermediate, c.n_kv_heads * half)
    if n_workers > max_n:
        raise PlanError(
            f"{n_workers} workers is too many for this model: at most {max_n} "
            f"(hidden {c.hidden}, intermediate {c.intermediate}, {c.n_kv_heads} KV heads x {half} RoPE pairs)"
        )
    residual = contiguous_ranges(apportion(c.hidden, caps, "hidden"))
    mlp = contiguous_ranges(apportion(c.intermediate, caps, "intermediate"))
    if n_workers <= c.n_kv_heads:
        # Whole KV groups per worker: attention needs no cross-worker traffic at all.
        units = contiguous_ranges(apportion(c.n_kv_heads, caps, "KV heads"))
        attention: tuple[tuple[AttnBlock, ...], ...] = tuple((AttnBlock(g0, g1, 0, half, False),) for g0, g1 in units)
        owners: tuple[tuple[int, ...], ...] = tuple((w,) for w, (g0, g1) in enumerate(units) for _ in range(g0, g1))
    else:
        # Split groups by RoPE pairs; a worker's contiguous pair range may straddle groups.
        units = contiguous_ranges(apportion(c.n_kv_heads * half, caps, "attention RoPE pairs"))
        group_owner_lists: list[list[int]] = [[] for _ in range(c.n_kv_heads)]
        blocks_per_worker = []
        for w, (u0, u1) in enumerate(units):
            blocks: list[list[int]] = []
            u = u0
            while u < u1:
                g, p0 = divmod(u, half)
                p1 = min(half, p0 + (u1 - u))
                if p0 == 0 and p1 == half and blocks and blocks[-1][2:] == [0, half]:
                    blocks[-1][1] = g + 1  # extend a run of whole groups
                else:
                    blocks.append([g, g + 1, p0, p1])
                group_owner_lists[g].append(w)
                u += p1 - p0
            blocks_per_worker.append(blocks)
        owners = tuple(tuple(o) for o in group_owner_lists)
        attention = tuple(
            tuple(AttnBlock(g0, g1, p0, p1, split=len(owners[g0]) > 1) for g0, g1, p0, p1 in blocks)
            for blocks in blocks_per_worker
        )
    workers = tuple(
        WorkerShare(worker=w, capacity=caps[w], residual=residual[w], attention=attention[w], mlp=mlp[w])
        for w in range(n_workers)
    )
    return Plan(config=c, workers=workers, group_owners=owners)
