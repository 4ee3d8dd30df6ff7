"""The math every decoder layer shares, whoever runs it (dense.py in the clear, ops.py on shards):
RMSNorm, rotary tables, the causal mask, the attention core and the gated activation. Each computes exactly what
transformers computes, in the same operation order, so fp32 results differ only by reassociation.
"""

from __future__ import annotations

import torch

from .config import RopeConfig


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, transformers' order: g * (x * rsqrt(mean(x²) + ε)), the
    normalization in float32 and rounded to x's dtype before the gain (no-ops in float32)."""
    xf = x.float()
    return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# linear_fm's token-major range: on this project's CPUs (MKL, AVX-512) W @ x for a row-major x of T
# columns costs about twice the T = 1 matrix-vector product for any T from 2 to 8, while (xᵀ Wᵀ)ᵀ
# grows from it with T: one worker's SmolLM2 shares at N = 2, 30 layers, one thread, medians of 15
# interleaved runs (ms): T = 1 15.6 either way; T = 2 30.6 against 20.2; T = 3 31.9 against 21.9;
# T = 4 30.3 against 30.9; T = 6 30.8 against 34.2; T = 8 32.0 against 39.2 (docs/performance.md, "A
# verification's second column": bench/linear_forms.py)
TOKEN_MAJOR_COLUMNS = (2, 3)


def linear_fm(w: torch.Tensor, x_KT: torch.Tensor) -> torch.Tensor:
    """W · x for a feature-major x (K, T): (M, T), contiguous, the layout the workers keep.

    A CPU step of 2 or 3 columns (TOKEN_MAJOR_COLUMNS: a speculative verification of one or two
    drafts) is computed token-major, (xᵀ · Wᵀ)ᵀ with xᵀ made contiguous first, where MKL's product
    of W with a row-major (K, T) costs about twice the T = 1 one: a verification's second column cost
    the workers about half a plain step through it. Other widths, and a GPU (cuBLAS has no such cliff,
    and each copy would be a kernel launch), keep W @ x. The sums' order differs from W @ x in the
    last bits, as any two BLAS kernels' do (transformers itself computes x · Wᵀ)."""
    if x_KT.shape[1] in TOKEN_MAJOR_COLUMNS and x_KT.device.type == "cpu":
        return token_major(w, x_KT)
    return w @ x_KT


def token_major(w: torch.Tensor, x_KT: torch.Tensor) -> torch.Tensor:
    """W · x computed as (xᵀ · Wᵀ)ᵀ, xᵀ made contiguous first; the result (M, T) contiguous."""
    return (x_KT.T.contiguous() @ w.T).T.contiguous()


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, d/2) for the given absolute positions, times `scale` (LongRoPE's
    attention factor; transformers multiplies in float32, as here)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, d/2)
    if scale == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * scale, freqs.sin() * scale


class Rotary:
    """A model's RoPE tables for any positions: `tables(positions)` -> cos, sin (T, d/2).

    LongRoPE keeps two sets of frequencies and picks, like transformers, by the largest position of
    the call: the long set once it is past original_max_position (each session's own positions here,
    one call per session, as transformers sees one sequence per forward)."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.short = inv_freq_tensor(rope, head_dim)
        self.long = inv_freq_tensor(rope, head_dim, long=True) if rope.kind == "longrope" else None
        self.switch = rope.original_max_position
        self.scale = rope.attention_factor

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.short
        if self.long is not None and positions.numel() and int(positions.max()) + 1 > self.switch:
            inv_freq = self.long
        return rope_tables(inv_freq, positions, self.scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Rotary embedding with transformers' rotate_half pairing (i, i + d/2) along `dim` of x, whose
    first half holds the pairs' first elements and second half their partners; cos and sin broadcast
    against one half. Token-major (..., T, d) with (T, d/2) tables: the dense layer; feature-major
    (..., 2P, T) with (P, T) tables (dim=-2): a worker's owned pairs (ops.py), which need nothing from
    anyone else because a pair is never split across workers."""
    x1, x2 = x.chunk(2, dim=dim)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=dim)


def inv_freq_tensor(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies (d/2,), computed in fp32 exactly as transformers does (`long`:
    LongRoPE's long factors)."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.kind == "default":
        return 1.0 / (rope.theta**shape)
    if rope.kind == "longrope":  # 1 / (ext · θ^(2i/d)), in float32 like transformers
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        if ext.shape != shape.shape:
            raise ValueError(f"longrope has {ext.numel()} factors for {shape.numel()} rotary pairs")
        return 1.0 / (ext * rope.theta**shape)
    return torch.tensor(rope.inv_freq(head_dim), dtype=torch.float32)


def causal_mask(pos: int, t: int, window: int | None = None) -> torch.Tensor | None:
    """(T, pos+T) True where query i (at pos+i) must not see key j: j > pos+i, and with a sliding
    window W also j <= pos+i - W (transformers' sliding_window_overlay: kv_idx > q_idx - W). None
    when nothing is masked (one token, inside its window)."""
    if t == 1 and (window is None or pos < window):
        return None
    q = torch.arange(pos, pos + t)[:, None]
    k = torch.arange(pos + t)[None, :]
    return (k > q) if window is None else (k > q) | (k <= q - window)


def outside_windows(pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, max(pos)+1) True where a single token at pos[b] must not see key j: j > pos[b] (the batch's
    decodes are padded to the longest), and with a sliding window W also j <= pos[b] - W."""
    k = torch.arange(int(pos.max()) + 1)[None, :]
    out = k > pos[:, None]
    return out if window is None else out | (k <= pos[:, None] - window)


def tree_depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """A token tree's column depths (parents[j] < j, -1 for column 0): column j sits at pos + depth,
    where RoPE places it (its position on the path from the step's first column)."""
    d = [0] * len(parents)
    for j in range(1, len(parents)):
        d[j] = d[parents[j]] + 1
    return d


def tree_mask(pos: int, parents: tuple[int, ...] | list[int], window: int | None = None) -> torch.Tensor:
    """(T, pos+T) True where column j must not see key i: the step's columns that are not j or one of
    its ancestors (a tree's columns sit at cache positions pos..pos+T-1 in column order; everything
    before pos is the session's own, seen by all), and with a sliding window W every key W or more
    positions before j's own (pos + its depth; an ancestor at depth d sits at pos + d). A chain
    (parents j - 1) gives causal_mask(pos, T, W)."""
    t = len(parents)
    depth = tree_depths(parents)
    sees = torch.zeros(t, t, dtype=torch.bool)
    for j in range(t):
        i = j
        while i >= 0:
            sees[j, i] = True
            i = parents[i]
    out = torch.cat([torch.zeros(t, pos, dtype=torch.bool), ~sees], 1)
    if window is not None:
        q = pos + torch.tensor(depth)[:, None]  # each column's position
        k = torch.cat([torch.arange(pos), pos + torch.tensor(depth)])[None, :]  # each key's
        out |= k <= q - window
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    gs: int,
    t: int,
    scale: float,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale, causal) · v for grouped-query attention.

    q (..., G, gs*T, dq): the gs query heads of each of G KV groups, token-minor; k, v (..., G, S, dq).
    Returns (..., G, gs*T, dv). (A group split by head dims across workers sums its partial scores
    between the owners first, then calls `attend_scored`: ops.py.)"""
    scores = q @ k.transpose(-1, -2)  # (..., G, gs*T, S)
    return attend_scored(scores, v, mask, gs, t, scale)


def attend_scored(
    scores: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, gs: int, t: int, scale: float
) -> torch.Tensor:
    """The rest of `attend` once the scores q·kᵀ (..., G, gs*T, S) are complete: scale, causal mask,
    softmax, times v. (A batch of sessions completes every session's partial scores in one exchange,
    then finishes each here.)"""
    scores = scores * scale
    if mask is not None:
        shape = scores.shape
        scores = scores.view(*shape[:-2], gs, t, shape[-1]).masked_fill(mask, float("-inf")).view(shape)
    return softmax32(scores) @ v


def swiglu(gu: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: silu(gate) ⊙ up, gu = [gate; up] along `dim` (the last for token-major, 0 for a
    worker's feature-major (2m, T): its gate rows then the same MLP coordinates' up rows)."""
    gate, up = gu.chunk(2, dim=dim)
    return torch.nn.functional.silu(gate) * up


def gated(gu: torch.Tensor, activation: str = "silu", dim: int = -1) -> torch.Tensor:
    """The MLP's gated activation on gu = [gate; up] along `dim` (as swiglu): SwiGLU silu(gate) ⊙ up,
    or GeGLU gelu_tanh(gate) ⊙ up (Gemma: transformers' gelu_pytorch_tanh, torch's tanh GELU)."""
    if activation == "silu":
        return swiglu(gu, dim)
    gate, up = gu.chunk(2, dim=dim)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def softmax32(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in float32, in the scores' dtype (transformers' eager attention)."""
    if scores.dtype == torch.float32:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
