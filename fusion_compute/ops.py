"""Sharded operators: one decoder layer as small explicit steps over one worker's shards.

Layout of local tensors is feature-major, (rows, T): a linear is then `W @ x` with no transposes,
and a reduce-scatter chunk is a contiguous block of rows. Names carry ownership (STYLE.md):
lowercase = this worker's shard, uppercase = full extent.

  step            input            output            placement change
  qkv             x_dT  (R shard)  qkv_aT (A shard)  S(R) -> P -> S(A)   norm fused, bias after
  rope            q, k  (A)        q, k   (A)        local
  attention       q, k, v (A)      o_aT   (A)        local (+ score sum among a split group's owners)
  o_proj          o_aT  (A)        y_dT   (R)        S(A) -> P -> S(R)
  gate_up         x_dT  (R)        gu_mT  (M)        S(R) -> P -> S(M)   norm fused
  swiglu          gu_mT (M)        h_mT   (M)        local
  down            h_mT  (M)        y_dT   (R)        S(M) -> P -> S(R)
  residual add    x_dT, y_dT       x_dT              local
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comm import Comm
from .kernels import attend
from .plan import AttnBlock


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (d/2, T) for the given absolute positions."""
    freqs = inv_freq[:, None] * positions[None, :].float()  # (d/2, T)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., 2P, T) whose rows are pairs' first halves then second halves; cos/sin (P, T).

    Same as transformers' `x * cos + rotate_half(x) * sin` restricted to the owned pairs: a pair
    (i, i + d/2) is never split across workers, so this needs nothing from anyone else.
    """
    p = x.shape[-2] // 2
    x1, x2 = x[..., :p, :], x[..., p:, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-2)


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


@dataclass
class LayerShard:
    """One worker's weights for one decoder layer (norm gains folded into the columns)."""

    qkv_w: torch.Tensor  # (Σ_q (qkv_q + 1), d_r): rows grouped by owner, a zero row per owner for Σx²
    qkv_b: torch.Tensor | None  # (qkv_me,) own rows only: added once, after the scatter
    o_w: torch.Tensor  # (H, a_r)
    gu_w: torch.Tensor  # (Σ_q (2 m_q + 1), d_r)
    down_w: torch.Tensor  # (H, m_r)
    index: LayerIndex | None = None  # what the rows/columns above stand for (audit)


@dataclass
class BlockCache:
    """KV cache of one attention block: (n_groups, S_max, dims), preallocated per session."""

    k: torch.Tensor
    v: torch.Tensor


def norm_linear_scatter(
    comm: Comm,
    x_dT: torch.Tensor,
    w_aug: torch.Tensor,
    ss_rows: torch.Tensor,
    sizes_aug: list[int],
    hidden: int,
    eps: float,
    op: str,
) -> torch.Tensor:
    """y = W · RMSNorm(x), norm fused into the scatter (DESIGN.md §4).

    W diag(g) x / s with s = sqrt(Σ_r ‖x_r‖² / H + ε): every worker appends its local Σx² (one
    scalar per token) to each chunk it sends, so the owner gets the global Σx² in the same
    collective and divides its chunk by s. Returns (sizes[me], T) without bias.
    """
    partial_NT = w_aug @ x_dT  # (Σ sizes_aug, T), full width: a pending sum (P)
    partial_NT[ss_rows] = (x_dT * x_dT).sum(0)  # local sum of squares, one row per destination
    y_aug = comm.reduce_scatter(partial_NT, sizes_aug, op)  # (n + 1, T)
    inv_s = torch.rsqrt(y_aug[-1] / hidden + eps)
    return y_aug[:-1] * inv_s


class ShardedLayer:
    """One decoder layer on one worker."""

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
    ):
        self.i = index
        self.w = weights
        self.blocks = blocks
        self.comm = comm
        self.me = me
        self.qkv_sizes_aug = qkv_sizes_aug
        self.gu_sizes_aug = gu_sizes_aug
        self.res_sizes = res_sizes
        self.hidden = hidden
        self.head_dim = head_dim
        self.gs = group_size
        self.eps = eps
        self.scale = head_dim**-0.5
        self.qkv_ss_rows = torch.tensor([sum(qkv_sizes_aug[: q + 1]) - 1 for q in range(len(qkv_sizes_aug))])
        self.gu_ss_rows = torch.tensor([sum(gu_sizes_aug[: q + 1]) - 1 for q in range(len(gu_sizes_aug))])
        self.caches: list[BlockCache] = []
        self.audit = None  # audit.recorder.AuditRecorder when recording: `hold` per protected tensor

    def alloc_cache(self, max_seq: int, dtype: torch.dtype, device: torch.device) -> None:
        self.caches = [
            BlockCache(
                torch.zeros(b.n_groups, max_seq, b.dims, dtype=dtype, device=device),
                torch.zeros(b.n_groups, max_seq, b.dims, dtype=dtype, device=device),
            )
            for b in self.blocks
        ]

    def attention(
        self, qkv_aT: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Local attention over the worker's KV shard; returns o_aT (a_r, T) in q-row order."""
        t = qkv_aT.shape[1]
        outs, row = [], 0
        for b, cache in zip(self.blocks, self.caches, strict=False):
            ng, dl, gs = b.n_groups, b.dims, self.gs
            nq, nk = ng * gs * dl, ng * dl
            q = qkv_aT[row : row + nq].view(ng, gs, dl, t)
            k = qkv_aT[row + nq : row + nq + nk].view(ng, dl, t)
            v = qkv_aT[row + nq + nk : row + nq + 2 * nk].view(ng, dl, t)
            row += nq + 2 * nk
            p0, p1 = b.p0, b.p1
            q = apply_rope(q, cos[p0:p1], sin[p0:p1])  # (ng, gs, dl, T)
            k = apply_rope(k, cos[p0:p1], sin[p0:p1])  # (ng, dl, T)
            cache.k[:, pos : pos + t] = k.transpose(1, 2)
            cache.v[:, pos : pos + t] = v.transpose(1, 2)
            s_len = pos + t
            q_g = q.permute(0, 1, 3, 2).reshape(ng, gs * t, dl)  # (ng, gs*T, dl)
            # q·k summed over a split group's dims = Σ over its owners of their partial dot products.
            reduce = (lambda sc, g=b.g0: self.comm.sum_scores(sc, g, f"L{self.i}.scores.g{g}")) if b.split else None
            o = attend(q_g, cache.k[:, :s_len], cache.v[:, :s_len], mask, gs, t, self.scale, reduce)  # (ng, gs*T, dl)
            outs.append(o.view(ng, gs, t, dl).permute(0, 1, 3, 2).reshape(nq, t))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def forward(self, x_dT: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        L, w, c, a = self.i, self.w, self.comm, self.audit
        qkv_aT = norm_linear_scatter(
            c, x_dT, w.qkv_w, self.qkv_ss_rows, self.qkv_sizes_aug, self.hidden, self.eps, f"L{L}.qkv"
        )
        if w.qkv_b is not None:
            # Bias once, by the owner, after the scatter: added to partials it would count N times.
            qkv_aT = qkv_aT + w.qkv_b[:, None]
        o_aT = self.attention(qkv_aT, pos, cos, sin, mask)
        y_dT = c.reduce_scatter(w.o_w @ o_aT, self.res_sizes, f"L{L}.o")
        if a is not None:  # holdings at this step, from the index maps the tensors were built with
            ix = w.index
            a.hold(L, "resid.in", ix.resid_in, x_dT.shape[0])
            a.hold(L, "qkv", ix.qkv_out, qkv_aT.shape[0])
            a.hold(L, "kv", ix.qkv_out, sum(2 * ch.k.shape[0] * ch.k.shape[2] for ch in self.caches))
            a.hold(L, "attn", ix.attn_in, o_aT.shape[0])
            a.hold(L, "resid.mid", ix.resid_out, y_dT.shape[0])
        x_dT = x_dT + y_dT
        gu_mT = norm_linear_scatter(
            c, x_dT, w.gu_w, self.gu_ss_rows, self.gu_sizes_aug, self.hidden, self.eps, f"L{L}.gate_up"
        )
        m = gu_mT.shape[0] // 2
        h_mT = torch.nn.functional.silu(gu_mT[:m]) * gu_mT[m:]
        y_dT = c.reduce_scatter(w.down_w @ h_mT, self.res_sizes, f"L{L}.down")
        if a is not None:
            ix = w.index
            a.hold(L, "gate_up", ix.gu_out, gu_mT.shape[0])
            a.hold(L, "h", ix.h_in, h_mT.shape[0])
            a.hold(L, "resid.out", ix.resid_out, y_dT.shape[0])
        return x_dT + y_dT
