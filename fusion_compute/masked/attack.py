"""The vocabulary-matching attack (arXiv 2505.18332), run on a view a worker actually received.

A worker that receives the layer-0 input of each prompt position tries every vocabulary token v,
computes what it would have received for v (public weights: a table lookup), and keeps the most
similar candidate. Similarity is cosine, so an unknown positive scale (the client's fixed-point
2^s) does not hide anything. The same function attacks both modes:

  structural  worker w's ingress shard x[:, R_w] (T, |R_w|)   vs  E[v, R_w]
  masked      A's first message of a prefill, the layer-0 qkv
              input x_fx + r read as signed int64  (T, H)   vs  RMSNorm(E[v]) · g   (what the client
              encodes for token v before masking)

In the structural mode this recovers the prompt (the shard is E[v, R_w] itself); in the masked mode
every candidate is equally (un)likely, and recovery is chance: T / V.
"""

from __future__ import annotations

import torch

from ..model import architecture as arch
from ..model.kernels import rms_norm
from ..weights.loader import WeightSource


def vocab_match(view_TK: torch.Tensor, table_VK: torch.Tensor, batch: int = 8192) -> list[int]:
    """For each received row, the vocabulary id whose candidate row is most similar (cosine)."""
    v = view_TK.to(torch.float64)
    v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-300)
    best_s = torch.full((v.shape[0],), -2.0, dtype=torch.float64)
    best_i = torch.zeros(v.shape[0], dtype=torch.int64)
    for at in range(0, table_VK.shape[0], batch):
        tab = table_VK[at : at + batch].to(torch.float64)
        sim = v @ (tab / tab.norm(dim=1, keepdim=True).clamp_min(1e-300)).T  # (T, batch)
        s, i = sim.max(1)
        better = s > best_s
        best_s, best_i = torch.where(better, s, best_s), torch.where(better, i + at, best_i)
    return best_i.tolist()


def structural_table(src: WeightSource, coords: tuple[int, int]) -> torch.Tensor:
    """What a structural worker receives at ingress for each token: E[:, R_w]. (V, |R_w|)"""
    a, b = coords
    return src.read(arch.EMBED, cols=[(a, b)])


def masked_table(src: WeightSource) -> torch.Tensor:
    """What the masked client encodes (before masking) as layer 0's qkv input for each token:
    RMSNorm(E[v]) · g, up to the positive scale 2^s. (V, H)"""
    e = src.read(arch.EMBED)
    g = arch.read_norm(src, 0, "qkv")
    return rms_norm(e, g, src.config.rms_eps)


def recovered(guesses: list[int], ids: list[int]) -> int:
    return sum(int(g == t) for g, t in zip(guesses, ids, strict=True))
