"""Red team: a vocabulary-matching attack on one worker's shard of the residual (arXiv 2505.18332).

The worker holds x_L[p, S] (its residual coordinates S at layer L, for every prompt position p)
and the public weights. Position by position it tries every vocabulary token v after the prefix
it has already recovered, runs the public model up to layer L, and keeps the v whose residual
matches its shard on S. At layer 0 this is a lookup in the embedding's columns E[:, S].

The worker's view is simulated with a dense forward of the same weights (the sharded runtime
computes the same values: parity tests hold it to ~1e-5): the dense twin (dense.py), so the attack
needs neither transformers nor the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import architecture as arch
from ..model.dense import DenseModel


@dataclass
class AttackResult:
    layer: int
    coords: int  # |S|
    hidden: int
    recovered: int  # prompt positions where the best candidate is the true token
    positions: int
    mask_scale: float
    guesses: list[int]


@torch.no_grad()
def vocab_match(
    dense: DenseModel,
    ids: list[int],
    layer: int,
    coords: list[int],
    *,
    mask_scale: float = 0.0,
    batch: int = 4096,
    seed: int = 0,
    candidates: list[int] | None = None,
) -> AttackResult:
    """Recover `ids` from the shard x_layer[:, coords] alone (plus public weights).

    mask_scale > 0 adds Gaussian noise of that many times the shard's RMS to what the worker sees
    (a stand-in for additive masking): recovery should collapse."""
    truth = torch.tensor([ids])
    s = torch.tensor(coords)
    observed = dense.residual(truth, layer)[0][:, s]  # (T, |S|): the worker's view
    if mask_scale > 0:
        gen = torch.Generator().manual_seed(seed)
        observed = observed + mask_scale * observed.pow(2).mean().sqrt() * torch.randn(observed.shape, generator=gen)
    vocab = torch.tensor(candidates) if candidates is not None else torch.arange(dense.config.vocab)
    guesses: list[int] = []
    for p in range(len(ids)):
        best, best_d = -1, float("inf")
        for i in range(0, len(vocab), batch):
            cand = vocab[i : i + batch]
            if layer == 0:
                got = arch.embed_rows(dense.config, dense.embed, cand)[:, s]  # a table lookup on E[:, S] (× √H: Gemma)
            else:
                got = dense.residual_after(guesses, cand, layer)[:, s]  # (B, |S|)
            dist = (got - observed[p]).pow(2).sum(-1)
            j = int(dist.argmin())
            if float(dist[j]) < best_d:
                best, best_d = int(cand[j]), float(dist[j])
        guesses.append(best)
    hits = sum(int(g == t) for g, t in zip(guesses, ids, strict=True))
    return AttackResult(layer, len(coords), dense.config.hidden, hits, len(ids), mask_scale, guesses)
