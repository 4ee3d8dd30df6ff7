"""Sharded operators: the decoder layer's ops (model/layer.py `LayerOps`) over one worker's shards.

The layer itself is `layer.decoder_layer`, written once for every execution; `ShardedLayer` gives it
these steps, each with its collective, and records the audit's holdings when asked.

Layout of local tensors is feature-major, (rows, T): a linear is then `W @ x` with no transposes,
and a reduce-scatter chunk is a contiguous block of rows. Names carry ownership (docs/design.md, "Code habits"):
lowercase = this worker's shard, uppercase = full extent.

  step            input            output            placement change
  qkv             x_dT  (R shard)  qkv_aT (A shard)  S(R) -> P -> S(A)   norm fused, bias after
  q/k norm        q, k  (A)        q, k   (A)        local (a split group's Σq², Σk² ride on its score sum)
  rope            q, k  (A)        q, k   (A)        local
  attention       q, k, v (A)      o_aT   (A)        local (+ score sum among a split group's owners)
  o_proj          o_aT  (A)        y_dT   (R)        S(A) -> P -> S(R)
  gate_up         x_dT  (R)        gu_mT  (M)        S(R) -> P -> S(M)   norm fused
  swiglu          gu_mT (M)        h_mT   (M)        local
  down            h_mT  (M)        y_dT   (R)        S(M) -> P -> S(R)
  post-norm       y_dT  (R)        y_dT   (R)        local + Σy² summed over all workers (Gemma 3: after
                                                     o and after down; one scalar per token, one round)
  residual add    x_dT, y_dT       x_dT              local

Layer 0's qkv has no scatter either (`ShardedLayer.given_qkv`): the client holds x (the embedding),
computes layer 0's normalised q/k/v with its own copy of that layer's q/k/v weights, and sends each
worker its rows with the ingress, beside x_dT (the residual add still needs x_dT).

The last layer's down has no scatter (`ShardedLayer.to_client`): its output goes to the client, not
to the workers, so each worker keeps its full-width partial y_HT = W_down[:, M_w] h_mT, adds its own
residual rows x_dT into rows R_w, and that (H, T) is its egress: Σ_w egress_w = x + W_down h, summed
by the client (one exchange fewer per forward; no worker holds any of the final residual).

  down (last)     h_mT  (M)        y_HT   (P)        local: full-width partial, no collective
  residual add    x_dT, y_HT       e_HT   (P)        local: e_HT = y_HT + x_dT in rows R_w (egress)

Gemma 3's post-norms (model/layer.py) cost 2 rounds per layer more than the Llama layer: y is known
only after its scatter, so its Σy² cannot ride in that scatter, and the next norm's scatter needs the
normalized y already (`post_norm`). (Folding it into the next norm's scatter, sending W x and W g⊙y
apart and the three sums Σx², Σx·g⊙y, Σ(g⊙y)², would save the rounds at twice the bytes: not done.)
They also keep the last layer's down scatter (`to_client` is off, and `Plan.boundary` says so): its
post-norm needs Σy² of the summed y, which no worker has before the scatter. That layer's egress is then the worker's own rows of x + RMSNorm(y) · g placed in an (H, ΣT)
of zeros (`residual_add`), so the client's sum over the workers is unchanged, and exact.

A step may carry several sessions (continuous batching, batching.py): their tokens are consecutive
columns (`Step.spans`), every linear and collective runs once over all of them, and attention runs
per session against that session's KV slot.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..comm import Comm
from ..model.kernels import (
    Rotary,
    attend_scored,
    causal_mask,
    gated,
    linear_fm,
    outside_windows,
    rotate,
    softmax32,
    tree_depths,
    tree_mask,
)
from ..model.layer import LayerOps, decoder_layer
from .plan import AttnBlock


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., 2P, T), feature-major: rows are the owned pairs' first halves then second halves,
    cos/sin (P, T) (kernels.rotate along the feature dim)."""
    return rotate(x, cos, sin, dim=-2)


@dataclass(frozen=True)
class LayerIndex:
    """The coordinates this worker's tensors stand for, as the index maps its weights were cut with.

    Inputs are the columns a weight was sliced by; outputs the rows of the fused output space that
    the scatter delivers to this worker. The audit records these (not the plan) at every step.
    """

    resid_in: list[int]  # residual coords of x_dT: columns of qkv_w / gu_w, in [0, H)
    qkv_out: list[int]  # rows of [q; k; v] in this worker's qkv chunk, in [0, n_h d + 2 n_kv d)
    attn_in: list[int]  # columns of o_proj = q coords of o_aT, in [0, n_h d)
    resid_out: list[int]  # rows of the o / down scatter chunk delivered here, in [0, H)
    gu_out: list[int]  # rows of [gate; up] in this worker's chunk, in [0, 2I)
    h_in: list[int]  # columns of down_proj = MLP coords of h_mT, in [0, I)


# model/layer.HOLDS -> the LayerIndex field with the coordinates that tensor stands for
HOLD_INDEX = {
    "resid.in": "resid_in",
    "qkv": "qkv_out",
    "kv": "qkv_out",
    "attn": "attn_in",
    "resid.mid": "resid_out",
    "gate_up": "gu_out",
    "h": "h_in",
    "resid.out": "resid_out",
}


@dataclass
class LayerShard:
    """One worker's weights for one decoder layer (norm gains folded into the columns)."""

    qkv_w: torch.Tensor  # (Σ_q (qkv_q + 1), d_r): rows grouped by owner, a zero row per owner for Σx²
    qkv_b: torch.Tensor | None  # (qkv_me,) own rows only: added once, after the scatter
    o_w: torch.Tensor  # (H, a_r)
    gu_w: torch.Tensor  # (Σ_q (2 m_q + 1), d_r)
    down_w: torch.Tensor  # (H, m_r)
    index: LayerIndex | None = None  # what the rows/columns above stand for (audit)
    qk_w: tuple[torch.Tensor, ...] | None = None  # per attention block: (2, dl) q_norm, k_norm gains (Qwen3)
    post_w: torch.Tensor | None = None  # (2, d_r): the post-norm gains after o, after down, own rows (Gemma 3)

    def to(self, device: torch.device, dtype: torch.dtype) -> LayerShard:
        """These slices on `device` in `dtype`, placed once at load (a no-op for float32 on the CPU);
        the float32 slices just read are dropped, so no float32 copy of a bfloat16 model stays."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype)

        b = None if self.qkv_b is None else move(self.qkv_b)
        qk = None if self.qk_w is None else tuple(move(g) for g in self.qk_w)
        post = None if self.post_w is None else move(self.post_w)
        return LayerShard(move(self.qkv_w), b, move(self.o_w), move(self.gu_w), move(self.down_w), self.index, qk, post)


@dataclass
class BlockCache:
    """KV cache of one attention block: (slots, n_groups, S_max, dims), preallocated per job; a slot
    per session of a batch (one for a single session)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def rows(self) -> int:
        """k and v coordinates held per token position: 2 · n_groups · dims."""
        return 2 * self.k.shape[1] * self.k.shape[3]


@dataclass(frozen=True)
class Span:
    """One session's tokens in a step: its KV slot, the position of its first token, how many.
    `parents`: a token tree's (speculative decoding, generation/token_tree.py), column j's parent
    column (-1 for column 0): column j is written at pos + j, placed by RoPE at pos + its depth and
    attends its ancestors only; None for a sequence. `keep`: the columns of the slot's previous
    step (a tree) that stay, 0 first; they are moved to the positions just before `pos` before
    this step runs (ShardedModel.roll_back), the rest dropped."""

    slot: int
    pos: int
    t: int
    parents: tuple[int, ...] | None = None
    keep: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Decodes:
    """The single-token spans of a batched step, attended together (ShardedLayer.attention): their
    columns, slots and positions, the RoPE tables of their columns, the range of slots they fall in,
    and the mask of positions past each one's own (they are padded to the longest), per sliding
    window of the model's layers (`pads`, keyed like Step.masks)."""

    cols: torch.Tensor  # (B,) their columns
    slots: torch.Tensor  # (B,)
    pos: torch.Tensor  # (B,)
    cos: torch.Tensor  # (d/2, B)
    sin: torch.Tensor
    lo: int  # they lie in slots lo..hi-1
    hi: int
    rows: torch.Tensor | None  # slot - lo of each; None when they are exactly lo..hi-1 in order
    pad: torch.Tensor  # (B, 1, 1, S) True past each one's own position; S = max(pos) + 1
    pads: dict[int | None, torch.Tensor]  # window -> `pad` with keys before the window masked too


@dataclass(frozen=True)
class Step:
    """What every layer needs about one forward step: the sessions' spans, in column order (their
    tokens are consecutive columns of the step's (rows, ΣT) tensors), RoPE tables for every column,
    each span's causal mask per sliding window of the model's layers (`masks[window][i]`; None where
    nothing is masked, as for a single token inside its window), and, when several spans decode one token
    each, those spans together (`decodes`; the others are `singles`, attended one by one)."""

    spans: tuple[Span, ...]
    offsets: tuple[int, ...]  # each span's first column
    cos: torch.Tensor  # (d/2, ΣT)
    sin: torch.Tensor
    masks: dict[int | None, tuple[torch.Tensor | None, ...]]
    singles: tuple[int, ...]
    decodes: Decodes | None


def make_step(
    spans: list[Span],
    rotary: Rotary,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    windows: tuple[int | None, ...] = (None,),
) -> Step:
    """The step's tables on the worker's device: RoPE in float32 (each span's own, as transformers
    computes one sequence's: LongRoPE picks its factors by the span's last position), then in the
    compute dtype (as transformers casts cos and sin to the activations' dtype), masks for each of
    the model's sliding `windows` (None: full causal) and indices there too."""
    offsets = (0, *itertools.accumulate(s.t for s in spans[:-1]))
    # a tree's columns by depth (RoPE), its mask the ancestors' within each window
    tables = [
        rotary.tables(
            torch.arange(s.pos, s.pos + s.t) if s.parents is None else s.pos + torch.tensor(tree_depths(s.parents))
        )
        for s in spans
    ]
    cos = torch.cat([c for c, _ in tables]).T.to(device=device, dtype=dtype)  # (d/2, T): feature-major
    sin = torch.cat([s for _, s in tables]).T.to(device=device, dtype=dtype)

    def on_device(m: torch.Tensor | None) -> torch.Tensor | None:
        return None if m is None else m.to(device=device)

    masks = {
        w: tuple(
            on_device(causal_mask(s.pos, s.t, w) if s.parents is None else tree_mask(s.pos, s.parents, w))
            for s in spans
        )
        for w in windows
    }
    index = tuple(i for i, s in enumerate(spans) if s.t == 1) if len(spans) > 1 else ()
    decodes = None
    if index:
        cols = torch.tensor([offsets[i] for i in index])
        slots = torch.tensor([spans[i].slot for i in index])
        pos = torch.tensor([spans[i].pos for i in index])
        lo, hi = int(slots.min()), int(slots.max()) + 1
        dense = slots.tolist() == list(range(lo, hi))
        pads = {w: outside_windows(pos, w)[:, None, None, :].to(device=device) for w in (None, *windows)}
        cols, slots, pos = (x.to(device=device) for x in (cols, slots, pos))
        decodes = Decodes(
            cols, slots, pos, cos[:, cols], sin[:, cols], lo, hi, None if dense else slots - lo, pads[None], pads
        )
    singles = tuple(i for i in range(len(spans)) if i not in index)
    return Step(tuple(spans), offsets, cos, sin, masks, singles, decodes)


def norm_linear_scatter(
    comm: Comm,
    x_dT: torch.Tensor,
    w_aug: torch.Tensor,
    sizes_aug: list[int],
    hidden: int,
    eps: float,
    op: str,
) -> torch.Tensor:
    """y = W · RMSNorm(x), norm fused into the scatter (docs/design.md, "The operators").

    W diag(g) x / s with s = sqrt(Σ_r ‖x_r‖² / H + ε): every worker appends its local Σx² (one
    scalar per token) to each chunk it sends, so the owner gets the global Σx² in the same
    collective and divides its chunk by s. Returns (sizes[me], T) without bias.
    """
    xf = x_dT.float()  # Σx² in float32 whatever the dtype (transformers' RMSNorm: the same)
    ss = (xf * xf).sum(0)  # local sum of squares, one row per destination
    starts = [0, *itertools.accumulate(sizes_aug)]

    def chunk(q: int) -> torch.Tensor:  # the rows addressed to worker q: a pending sum (P)
        part = linear_fm(w_aug[starts[q] : starts[q + 1]], x_dT)
        part[-1] = ss
        return part

    y_aug = comm.reduce_scatter_from(chunk, sizes_aug, op)  # (n + 1, T)
    inv_s = torch.rsqrt(y_aug[-1].float() / hidden + eps)
    return (y_aug[:-1] * inv_s).to(x_dT.dtype)


class ShardedLayer(LayerOps[Step]):
    """One decoder layer on one worker: layer.LayerOps, feature-major (rows, ΣT), each linear a
    reduce-scatter (the norm fused into the scatter), attention over the worker's KV shards."""

    def __init__(
        self,
        index: int,
        weights: LayerShard,
        blocks: tuple[AttnBlock, ...],
        *,
        comm: Comm,
        me: int,
        qkv_sizes_aug: list[int],
        gu_sizes_aug: list[int],
        res_sizes: list[int],
        hidden: int,
        head_dim: int,
        group_size: int,
        eps: float,
        window: int | None = None,
        scale: float | None = None,
        activation: str = "silu",
    ):
        """`window`: this layer's sliding window (None: full causal; config.window); `scale`: the
        scores' (config.scale; None: head_dim^-1/2); `activation`: config.activation."""
        self.i = index
        self.w = weights
        self.blocks = blocks
        self.comm = comm
        self.me = me
        self.qkv_sizes_aug = qkv_sizes_aug
        self.gu_sizes_aug = gu_sizes_aug
        self.res_sizes = res_sizes
        self.res_starts = [0, *itertools.accumulate(res_sizes)]
        self.hidden = hidden
        self.head_dim = head_dim
        self.gs = group_size
        self.eps = eps
        self.scale = head_dim**-0.5 if scale is None else scale
        self.act = activation
        self.window = window
        self.caches: list[BlockCache] = []  # per attention block: every slot's KV
        self.audit = None  # audit.recorder.AuditRecorder when recording: `hold` per protected tensor
        self.egress = False  # the last layer: its output is this worker's egress e_HT (H, ΣT) (module doc)
        self.to_client = False  # the last layer without post-norms: its down partials go to the client
        self.given_qkv: torch.Tensor | None = None  # layer 0: q/k/v from the client's ingress (module doc)

    def alloc_cache(self, max_seq: int, dtype: torch.dtype, device: torch.device, slots: int = 1) -> None:
        self.caches = [
            BlockCache(
                torch.zeros(slots, b.n_groups, max_seq, b.dims, dtype=dtype, device=device),
                torch.zeros(slots, b.n_groups, max_seq, b.dims, dtype=dtype, device=device),
            )
            for b in self.blocks
        ]

    def attention(self, i: int, qkv_aT: torch.Tensor, step: Step) -> torch.Tensor:
        """Local attention over the worker's KV shards, each span against its own slot; returns o_aT
        (a_r, ΣT) in q-row order. A split group's partial scores are completed in one exchange for
        every span of the step (one round per split block, whatever the batch). Single-token spans
        (decodes) are computed together, padded to the longest and masked; prefill spans one by one."""
        outs: list[torch.Tensor] = []
        row = 0
        spans, offsets, dec = step.spans, step.offsets, step.decodes
        for b, cache in zip(self.blocks, self.caches, strict=True):
            ng, dl, gs = b.n_groups, b.dims, self.gs
            nq, nk = ng * gs * dl, ng * dl
            p0, p1 = b.p0, b.p1
            cos, sin = step.cos[p0:p1], step.sin[p0:p1]
            q_all = qkv_aT[row : row + nq]
            k_all = qkv_aT[row + nq : row + nq + nk]
            v_all = qkv_aT[row + nq + nk : row + nq + 2 * nk]
            row += nq + 2 * nk
            # Qwen3's per-head q/k norms: local on a whole group; on a split group the gains now, the
            # division by each head's norm once its owners' Σx² arrive with the score sum (_qk_finish)
            ss = None
            if self.w.qk_w is not None:
                q_all, k_all, ss = self._qk_norm(q_all, k_all, b, self.w.qk_w[len(outs)])
            scores, values = [], []
            for i in step.singles:
                span, cols = spans[i], slice(offsets[i], offsets[i] + spans[i].t)
                t, pos, sl = span.t, span.pos, span.slot
                q = apply_rope(q_all[:, cols].reshape(ng, gs, dl, t), cos[:, cols], sin[:, cols])  # (ng, gs, dl, T)
                k = apply_rope(k_all[:, cols].reshape(ng, dl, t), cos[:, cols], sin[:, cols])  # (ng, dl, T)
                cache.k[sl, :, pos : pos + t] = k.transpose(1, 2)
                cache.v[sl, :, pos : pos + t] = v_all[:, cols].reshape(ng, dl, t).transpose(1, 2)
                q_g = q.permute(0, 1, 3, 2).reshape(ng, gs * t, dl)  # (ng, gs*T, dl)
                scores.append(q_g @ cache.k[sl, :, : pos + t].transpose(-1, -2))  # (ng, gs*T, S)
                values.append(cache.v[sl, :, : pos + t])
            if dec is not None:
                scores.append(self._decode_scores(cache, dec, q_all, k_all, v_all, (p0, p1), ng, gs, dl))
            if b.split:
                # q·k summed over a split group's dims = Σ over its owners of their partial dot products.
                scores, ss = self._sum_scores(scores, b.g0, ss)
            if ss is not None:
                self._qk_finish(scores, ss, cache, step, ng, gs)
            o_aT = qkv_aT.new_empty(nq, qkv_aT.shape[1])
            for i, sc, v in zip(step.singles, scores, values, strict=False):
                t = spans[i].t
                o = attend_scored(sc, v, step.masks[self.window][i], gs, t, self.scale)  # (ng, gs*T, dl)
                o_aT[:, offsets[i] : offsets[i] + t] = o.view(ng, gs, t, dl).permute(0, 1, 3, 2).reshape(nq, t)
            if dec is not None:
                o_aT[:, dec.cols] = self._decode_finish(cache, dec, scores[-1], ng, gs, dl)
            outs.append(o_aT)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def _decode_scores(
        self, cache: BlockCache, dec: Decodes, q_all, k_all, v_all, pairs: tuple[int, int], ng: int, gs: int, dl: int
    ) -> torch.Tensor:
        """Several sessions' single new tokens: rope, KV writes and q·k for all of them at once, over
        the cache's slots lo..hi-1 (a view, no copy) and their first max(pos)+1 positions (positions
        past a session's own are masked in _decode_finish). Returns scores (B, ng, gs, S)."""
        c, s = dec.cos[pairs[0] : pairs[1]], dec.sin[pairs[0] : pairs[1]]
        q = apply_rope(q_all[:, dec.cols].reshape(ng, gs, dl, -1), c, s).permute(3, 0, 1, 2)  # (B, ng, gs, dl)
        k = apply_rope(k_all[:, dec.cols].reshape(ng, dl, -1), c, s)  # (ng, dl, B)
        cache.k[dec.slots, :, dec.pos] = k.permute(2, 0, 1)  # (B, ng, dl) into each slot's own position
        cache.v[dec.slots, :, dec.pos] = v_all[:, dec.cols].reshape(ng, dl, -1).permute(2, 0, 1)
        keys = cache.k[dec.lo : dec.hi, :, : dec.pad.shape[-1]].transpose(-1, -2)
        if dec.rows is None:
            return q @ keys
        q_r = q.new_zeros(dec.hi - dec.lo, ng, gs, dl)  # rows of slots not in this step stay zero, dropped
        q_r[dec.rows] = q
        return (q_r @ keys)[dec.rows]

    def _decode_finish(
        self, cache: BlockCache, dec: Decodes, scores: torch.Tensor, ng: int, gs: int, dl: int
    ) -> torch.Tensor:
        """softmax and · v for the decodes' complete scores (B, ng, gs, S); returns (ng·gs·dl, B)."""
        p = softmax32((scores * self.scale).masked_fill(dec.pads[self.window], float("-inf")))
        values = cache.v[dec.lo : dec.hi, :, : dec.pad.shape[-1]]
        if dec.rows is None:
            o = p @ values
        else:
            p_r = p.new_zeros(dec.hi - dec.lo, *p.shape[1:])
            p_r[dec.rows] = p
            o = (p_r @ values)[dec.rows]  # (B, ng, gs, dl)
        return o.permute(1, 2, 3, 0).reshape(ng * gs * dl, -1)

    def _qk_norm(
        self, q_all: torch.Tensor, k_all: torch.Tensor, b: AttnBlock, gains: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The per-head RMSNorm of q and k (Qwen3) on this block's rows (ng·gs·dl, ΣT), (ng·dl, ΣT):
        g ⊙ x / r, r = sqrt(Σ_d x² / d + ε) per head and token, `gains` (2, dl) the q and k gains of
        the block's dims, before RoPE as in transformers' q_norm / k_norm. A whole head is local:
        returns the normalized q, k and None. A split group's Σx² is the sum of its owners' partial
        sums, and r is a scalar per head and token, so RoPE (a rotation) and the dot product commute
        with it: q̂·k̂ = (R(g_q⊙q)·R(g_k⊙k)) / (r_q r_k). So g ⊙ x is returned unnormalized with the
        partial sums (ng·gs·ΣT for q, then ng·ΣT for k, float32), which travel in the score sum's
        message; _qk_finish divides once they are complete. No round of its own."""
        ng, gs, dl, d = b.n_groups, self.gs, b.dims, self.head_dim
        t = q_all.shape[1]
        q = q_all.reshape(ng, gs, dl, t)
        k = k_all.reshape(ng, dl, t)
        ss = torch.cat([q.float().pow(2).sum(2).reshape(-1), k.float().pow(2).sum(1).reshape(-1)])
        if b.split:
            q_g, k_g = gains[0][:, None] * q, gains[1][:, None] * k
            return q_g.reshape(q_all.shape), k_g.reshape(k_all.shape), ss
        inv = torch.rsqrt(ss / d + self.eps)
        inv_q, inv_k = inv[: ng * gs * t].view(ng, gs, 1, t), inv[ng * gs * t :].view(ng, 1, t)
        q_n = gains[0][:, None] * (q.float() * inv_q).to(q.dtype)
        k_n = gains[1][:, None] * (k.float() * inv_k).to(k.dtype)
        return q_n.reshape(q_all.shape), k_n.reshape(k_all.shape), None

    def _qk_finish(
        self, scores: list[torch.Tensor], ss: torch.Tensor, cache: BlockCache, step: Step, ng: int, gs: int
    ) -> None:
        """A split group's q/k norms, completed (`ss`: every owner's Σx² summed, _qk_norm's layout):
        every score row divided by its query head's r_q, every score against a key of this step by
        that key's r_k, and those keys, cached unnormalized, divided by their r_k in the cache (the
        positions of earlier steps were normalized when they were new)."""
        t = ss.numel() // (ng * (gs + 1))
        inv = torch.rsqrt(ss / self.head_dim + self.eps)
        inv_q, inv_k = inv[: ng * gs * t].view(ng, gs, t), inv[ng * gs * t :].view(ng, t)
        spans, offsets, dec = step.spans, step.offsets, step.decodes
        for j, i in enumerate(step.singles):
            span, cols = spans[i], slice(offsets[i], offsets[i] + spans[i].t)
            n, pos, sl = span.t, span.pos, span.slot
            sc = scores[j].view(ng, gs, n, -1)  # (ng, gs, T, S): rows head-major, token-minor
            sc.mul_(inv_q[:, :, cols, None].to(sc.dtype))
            sc[..., pos : pos + n].mul_(inv_k[:, None, None, cols].to(sc.dtype))  # keys of this span
            cache.k[sl, :, pos : pos + n].mul_(inv_k[:, cols, None].to(cache.k.dtype))
        if dec is not None:
            sc = scores[-1]  # (B, ng, gs, S)
            sc.mul_(inv_q[:, :, dec.cols].permute(2, 0, 1)[..., None].to(sc.dtype))
            b = torch.arange(sc.shape[0], device=sc.device)
            sc[b, :, :, dec.pos] *= inv_k[:, dec.cols].T[:, :, None].to(sc.dtype)
            cache.k[dec.slots, :, dec.pos] *= inv_k[:, dec.cols].T[:, :, None].to(cache.k.dtype)

    def _sum_scores(
        self, scores: list[torch.Tensor], g: int, extra: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The partial scores of a split group summed among its owners in one exchange; `extra`
        (Qwen3's partial Σq², Σk², float32) rides in the same message, which is then float32."""
        op = f"L{self.i}.scores.g{g}"
        if len(scores) == 1 and extra is None:
            return [self.comm.sum_scores(scores[0], g, op)], None
        parts = [s.reshape(-1) for s in scores] + ([] if extra is None else [extra])
        flat = torch.cat([p.float() for p in parts] if extra is not None else parts)
        flat = self.comm.sum_scores(flat, g, op)
        sizes = [s.numel() for s in scores] + ([] if extra is None else [extra.numel()])
        split = flat.split(sizes)
        out = [part.view(s.shape).to(s.dtype) for part, s in zip(split, scores, strict=False)]
        return out, (None if extra is None else split[-1])

    def norm_linear(self, i: int, name: str, x_dT: torch.Tensor) -> torch.Tensor:
        """S(R) -> P -> S(A or M): qkv_aT or gu_mT, this worker's rows, the bias (qkv) added."""
        w = self.w
        if name == "qkv" and self.given_qkv is not None:  # layer 0: the client computed it (module doc)
            qkv_aT, self.given_qkv = self.given_qkv, None
            return qkv_aT
        if name == "qkv":
            qkv_aT = norm_linear_scatter(
                self.comm, x_dT, w.qkv_w, self.qkv_sizes_aug, self.hidden, self.eps, f"L{i}.qkv"
            )
            # Bias once, by the owner, after the scatter: added to partials it would count N times.
            return qkv_aT if w.qkv_b is None else qkv_aT + w.qkv_b[:, None]
        return norm_linear_scatter(self.comm, x_dT, w.gu_w, self.gu_sizes_aug, self.hidden, self.eps, f"L{i}.{name}")

    def linear_back(self, i: int, name: str, y: torch.Tensor) -> torch.Tensor:
        """S(A or M) -> P -> S(R): this worker's residual rows of W_o o or W_down h."""
        w_back = self.w.o_w if name == "o" else self.w.down_w
        if name == "down" and self.to_client:  # the client sums the partials: no scatter (module doc)
            return linear_fm(w_back, y)  # y_HT (H, ΣT): this worker's MLP rows' contribution to every coordinate
        starts = self.res_starts
        return self.comm.reduce_scatter_from(
            lambda q: linear_fm(w_back[starts[q] : starts[q + 1]], y), self.res_sizes, f"L{i}.{name}"
        )

    def residual_add(self, i: int, x_dT: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x_dT + y_dT; the last layer (`egress`): the egress e_HT (H, ΣT), whose sum over the workers
        the client takes as the final residual. With `to_client`: y_HT (the down partial) with x_dT
        added into this worker's rows R_w; without (post-norms: the down was scattered and normed),
        x_dT + y_dT in rows R_w and zeros elsewhere."""
        if not self.egress:
            return x_dT + y
        a, b = self.res_starts[self.me], self.res_starts[self.me + 1]
        if not self.to_client:
            e_HT = y.new_zeros(self.hidden, y.shape[1])
            e_HT[a:b] = x_dT + y
            return e_HT
        y[a:b] += x_dT  # (one rounding, as x + y: in-place add computes in float32 for a 2-byte dtype)
        return y

    def activation(self, i: int, gu_mT: torch.Tensor) -> torch.Tensor:
        """SwiGLU (GeGLU: Gemma) on the worker's MLP rows: gate rows then the same coordinates' up rows."""
        return gated(gu_mT, self.act, dim=0)

    def post_norm(self, i: int, name: str, y_dT: torch.Tensor) -> torch.Tensor:
        """Gemma 3's post-norm on this worker's residual rows of y (d_r, ΣT): g ⊙ y / s with
        s = sqrt(Σ_all rows y² / H + ε) per token. The Σy² of the other rows is on the other workers:
        each adds its partial sums, one float32 scalar per token, in one all-worker exchange
        (comm.sum_norms, op "L{i}.post_{name}"). The identity for the families without post-norms."""
        if self.w.post_w is None:
            return y_dT
        yf = y_dT.float()
        ss = self.comm.sum_norms((yf * yf).sum(0), f"L{i}.post_{name}")
        inv_s = torch.rsqrt(ss / self.hidden + self.eps)
        g = self.w.post_w[0 if name == "o" else 1]
        return g[:, None] * (yf * inv_s).to(y_dT.dtype)

    def hold(self, i: int, name: str, t: torch.Tensor) -> None:
        """The audit's record: the coordinates `t` stands for, from the index maps the weights were
        cut with (not the plan), and its row count; "kv": the cache's rows."""
        a = self.audit
        if a is None or (name == "resid.out" and self.to_client):  # the last layer's: only the client's
            return
        index = getattr(self.w.index, HOLD_INDEX[name])
        a.hold(i, name, index, sum(ch.rows for ch in self.caches) if name == "kv" else t.shape[0])

    def forward(self, x_dT: torch.Tensor, step: Step) -> torch.Tensor:
        """x_dT (rows, ΣT) at layer input -> at layer output (model/layer.py; the audit's leak
        control composes onto this method)."""
        return decoder_layer(self, self.i, x_dT, step)
