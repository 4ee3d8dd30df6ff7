"""What the model dimensions and a worker's declared share imply, derived here, not from plan.py.

Part of the independent verifier: imports only audit/schema.py and the standard library, so a bug
in the plan, the operators or the comm layer cannot certify itself. From the dimensions and each
worker's declared share (residual range, attention blocks, MLP range) it rederives every coordinate
set the worker should hold and every transfer it should make in a step, in order, and the bytes
those transfers put on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import schema as S


@dataclass(frozen=True)
class Declared:
    """One worker's coordinate sets, derived here from its declared share and the dimensions."""

    resid: frozenset[int]
    qkv: frozenset[int]  # in the [q | k | v] space
    gate_up: frozenset[int]  # in the [gate | up] space
    mlp: frozenset[int]
    blocks: tuple[tuple[int, int, int, int], ...]  # attention blocks (g0, g1, p0, p1), as declared

    @classmethod
    def nothing(cls) -> Declared:
        """What a header without a usable share declares."""
        return cls(frozenset(), frozenset(), frozenset(), frozenset(), ())


def declare(share: dict, dims: dict) -> Declared:
    """A header's share -> its coordinate sets. Attention block (g0, g1, p0, p1): KV groups
    [g0, g1), head dims [p0, p1) and their RoPE partners [p0 + d/2, p1 + d/2), in every q head of
    those groups and in k and v."""
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
    """The coordinates tensor `name` (a schema.HOLD_NAMES entry) must stand for (in every layer but
    the last for "resid.out": `held_in_layer`)."""
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


def held_in_layer(name: str, layer: int, n_layers: int, down_to_client: bool = True) -> bool:
    """Whether a worker holds tensor `name` in `layer`: all of them in every layer, but with
    `down_to_client` (the manifest's plan.boundary) the last layer's output residual ("resid.out")
    is nobody's: its down partials go to the client, which sums them (the egress), so no worker ever
    holds a coordinate of the final residual. Without (post-norms: the last down is scattered and
    normed first), each worker holds its rows of it, as of every other layer's."""
    return not (down_to_client and name == "resid.out" and layer == n_layers - 1)


def group_owners(decls: list[Declared], n_groups: int) -> list[list[int]]:
    """KV group -> the workers holding part of it (more than one: a split group, scores summed)."""
    owners: list[list[int]] = [[] for _ in range(n_groups)]
    for w, decl in enumerate(decls):
        for g0, g1, _, _ in decl.blocks:
            for g in range(g0, g1):
                if w not in owners[g]:
                    owners[g].append(w)
    return owners


class Transfer(NamedTuple):
    """One transfer as the verifier compares it: a schema.LogEvent without its role."""

    layer: int
    op: str
    kind: str
    sent: list[int]  # elements to each world rank
    received: list[int]  # elements from each world rank
    itemsize: int

    @classmethod
    def of(cls, event: S.LogEvent) -> Transfer:
        return cls(event.layer, event.op, event.kind, list(event.sent), list(event.received), event.itemsize)


def score_elements(spans: list[tuple[int, int, int]] | None, t: int, pos: int) -> int:
    """Partial scores per (q head x 1) of a split group in one step: T x (pos + T) for one session; in
    a batched step, each session of several tokens the same, and the sessions that run one token each
    (when there are several sessions) are attended together, padded to the longest: one row of
    max(pos) + 1 scores each."""
    if spans is None or len(spans) == 1:
        return t * (pos + t)
    singles = [p for _, p, n in spans if n == 1]
    return sum(n * (p + n) for _, p, n in spans if n > 1) + (len(singles) * (max(singles) + 1) if singles else 0)


def expected_transfers(
    w: int,
    decls: list[Declared],
    owners: list[list[int]],
    dims: dict,
    t: int,
    pos: int,
    spans: list[tuple[int, int, int]] | None = None,
    itemsize: int = 4,
    down_to_client: bool = True,
) -> list[Transfer]:
    """The transfers worker w must make in one step of t tokens at position pos, in order
    (`spans`: a batched step's sessions, sessions.spans_of), each element `itemsize` bytes (the
    manifest's wire dtype: 4 for float32, 2 for bfloat16 and float16). The ingress carries the
    worker's residual shard and its layer-0 q/k/v ("qkv0", computed by the client: layer 0 has no QKV
    scatter); with `down_to_client` (the manifest's plan.boundary: not with post-norms) the last
    layer has no down scatter: each worker's egress is its full-width down partial; without, the
    down scatter stays and the egress is its final residual rows in zeros: H elements per token
    either way."""
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

    def rs(layer: int, name: str, sizes: list[int]) -> Transfer:
        sent = per_rank({q + 1: sizes[q] * t for q in others})
        received = per_rank({q + 1: sizes[w] * t for q in others})
        return Transfer(layer, f"L{layer}.{name}", S.REDUCE_SCATTER, sent, received, itemsize)

    def norm_sum(layer: int, name: str) -> Transfer:
        # Gemma 3's post-norm: this worker's Σy² over its residual rows, one float32 scalar per token,
        # to every other worker and theirs back (ops.post_norm)
        cnt = per_rank({q + 1: t for q in others})
        return Transfer(layer, f"L{layer}.{name}", S.NORM_SUM, cnt, list(cnt), 4)

    out = [
        Transfer(-1, "embed", S.INGRESS, per_rank({}), per_rank({0: res_n[w] * t}), itemsize),
        Transfer(-1, "qkv0", S.INGRESS, per_rank({}), per_rank({0: (qkv_n[w] - 1) * t}), itemsize),
    ]
    for layer in range(dims["layers"]):
        if n > 1 and layer > 0:  # layer 0's q/k/v come with the ingress
            out.append(rs(layer, "qkv", qkv_n))
        for g0, g1, _, _ in me.blocks:
            peers = [o for o in owners[g0] if o != w]
            if peers:  # a split group: partial scores summed among its owners
                elems = (g1 - g0) * gs * score_elements(spans, t, pos)
                size = itemsize
                if dims.get("qk_norm"):
                    # Qwen3: the per-head Σq², Σk² of the step's columns (gs q heads and 1 k head per
                    # group) ride in the same message, which is then float32 (ops._qk_norm)
                    elems, size = elems + (g1 - g0) * (gs + 1) * t, 4
                cnt = per_rank({o + 1: elems for o in peers})
                out.append(Transfer(layer, f"L{layer}.scores.g{g0}", S.SCORE_SUM, cnt, list(cnt), size))
        if n > 1:
            out.append(rs(layer, "o", res_n))
            if dims.get("post_norms"):
                out.append(norm_sum(layer, "post_o"))
            out.append(rs(layer, "gate_up", gu_n))
            if down_to_client and layer == dims["layers"] - 1:
                continue  # the last down partial goes to the client: the egress
            out.append(rs(layer, "down", res_n))
            if dims.get("post_norms"):
                out.append(norm_sum(layer, "post_down"))
    out.append(Transfer(-1, "final", S.EGRESS, per_rank({0: dims["hidden"] * t}), per_rank({}), itemsize))
    return out


def wire_bytes(transfers: list[Transfer], controls: list[int], backend: str) -> tuple[int, int]:
    """(sent, received) bytes on the wire for a worker, from predicted transfers (schema wire model):
    one message per peer with a non-zero count, plus the control messages it received (`controls`:
    their payload bytes)."""
    sent, received = 0, sum(S.message_bytes(c, backend) for c in controls)
    for tr in transfers:
        sent += sum(S.message_bytes(v * tr.itemsize, backend) for v in tr.sent if v)
        received += sum(S.message_bytes(v * tr.itemsize, backend) for v in tr.received if v)
    return sent, received
