"""Red team: a vocabulary-matching attack on one worker's shard of the residual (arXiv 2505.18332).

The worker holds x_L[p, S] (its residual coordinates S at layer L, for every prompt position p)
and the public weights. Position by position it tries every vocabulary token v after the prefix
it has already recovered, runs the public model up to layer L, and keeps the v whose residual
matches its shard on S. At layer 0 this is a lookup in the embedding's columns E[:, S].

The worker's view is simulated with a dense forward of the same weights (the sharded runtime
computes the same values: parity tests hold it to ~1e-5); `Dense` is a small plain decoder, so
the attack needs neither transformers nor the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import inv_freq_tensor
from ..weights import WeightSource


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _rot(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class Dense:
    """Layers [0, n) of the public model, batched: (B, T) ids -> residual entering layer n."""

    def __init__(self, src: WeightSource, n_layers: int):
        c = self.c = src.config
        self.embed = src.read("model.embed_tokens.weight")  # (V, H)
        self.inv_freq = inv_freq_tensor(c.rope, c.head_dim)
        self.layers = []
        for i in range(n_layers):
            p = f"model.layers.{i}."
            r = lambda name, p=p: src.read(p + name)  # noqa: E731
            bias = c.qkv_bias
            self.layers.append(
                {
                    "g1": r("input_layernorm.weight"),
                    "q": r("self_attn.q_proj.weight"),
                    "k": r("self_attn.k_proj.weight"),
                    "v": r("self_attn.v_proj.weight"),
                    "o": r("self_attn.o_proj.weight"),
                    "bq": r("self_attn.q_proj.bias") if bias else None,
                    "bk": r("self_attn.k_proj.bias") if bias else None,
                    "bv": r("self_attn.v_proj.bias") if bias else None,
                    "g2": r("post_attention_layernorm.weight"),
                    "gate": r("mlp.gate_proj.weight"),
                    "up": r("mlp.up_proj.weight"),
                    "down": r("mlp.down_proj.weight"),
                }
            )

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.inv_freq[None, :] * positions.float()[:, None]  # (T, d/2)
        full = torch.cat((freqs, freqs), -1)  # (T, d): transformers' rotate_half layout
        return full.cos(), full.sin()

    def _layer(self, w: dict, x: torch.Tensor, cos, sin, past=None, mask=None):
        """One decoder layer on (B, T, H); past = (k, v) of earlier positions, (1 or B, nkv, P, d).
        Returns the new residual and this call's (k, v)."""
        c = self.c
        b, t, _ = x.shape
        nh, nkv, d = c.n_heads, c.n_kv_heads, c.head_dim
        h = _rms(x, w["g1"], c.rms_eps)
        q, k, v = h @ w["q"].T, h @ w["k"].T, h @ w["v"].T
        if w["bq"] is not None:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        q = _rot(q.view(b, t, nh, d).transpose(1, 2), cos, sin)  # (B, nh, T, d)
        k = _rot(k.view(b, t, nkv, d).transpose(1, 2), cos, sin)  # (B, nkv, T, d)
        v = v.view(b, t, nkv, d).transpose(1, 2)
        kk, vv = k, v
        if past is not None:
            kk = torch.cat([past[0].expand(b, -1, -1, -1), k], 2)
            vv = torch.cat([past[1].expand(b, -1, -1, -1), v], 2)
        kk, vv = kk.repeat_interleave(nh // nkv, 1), vv.repeat_interleave(nh // nkv, 1)
        s = (q @ kk.transpose(-1, -2)) * d**-0.5  # (B, nh, T, P + T)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        o = torch.softmax(s, -1) @ vv  # (B, nh, T, d)
        x = x + o.transpose(1, 2).reshape(b, t, nh * d) @ w["o"].T
        h = _rms(x, w["g2"], c.rms_eps)
        return x + (torch.nn.functional.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T, (k, v)

    @torch.no_grad()
    def residual(self, ids: torch.Tensor, upto: int) -> torch.Tensor:
        """(B, T) ids -> (B, T, H) residual entering layer `upto` (0 = the embedding)."""
        x, _ = self._run(ids, upto)
        return x

    def _run(self, ids: torch.Tensor, upto: int):
        t = ids.shape[1]
        x = self.embed[ids]  # (B, T, H)
        cos, sin = self._cos_sin(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        cache = []
        for w in self.layers[:upto]:
            x, kv = self._layer(w, x, cos, sin, mask=mask)
            cache.append(kv)
        return x, cache

    @torch.no_grad()
    def residual_after(self, prefix: list[int], cand: torch.Tensor, upto: int) -> torch.Tensor:
        """Residual entering layer `upto` at position len(prefix), for each candidate token (B,)
        following the same prefix: the prefix runs once, candidates attend to its cached k/v."""
        p = len(prefix)
        cache = self._run(torch.tensor([prefix]), upto)[1] if p else [None] * upto
        x = self.embed[cand][:, None, :]  # (B, 1, H)
        cos, sin = self._cos_sin(torch.tensor([p]))
        for w, past in zip(self.layers[:upto], cache, strict=True):
            x, _ = self._layer(w, x, cos, sin, past=past)
        return x[:, 0]


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
    dense: Dense,
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
    vocab = torch.tensor(candidates) if candidates is not None else torch.arange(dense.c.vocab)
    guesses: list[int] = []
    for p in range(len(ids)):
        best, best_d = -1, float("inf")
        for i in range(0, len(vocab), batch):
            cand = vocab[i : i + batch]
            if layer == 0:
                got = dense.embed[cand][:, s]  # a table lookup on E[:, S]
            else:
                got = dense.residual_after(guesses, cand, layer)[:, s]  # (B, |S|)
            dist = (got - observed[p]).pow(2).sum(-1)
            j = int(dist.argmin())
            if float(dist[j]) < best_d:
                best, best_d = int(cand[j]), float(dist[j])
        guesses.append(best)
    hits = sum(int(g == t) for g, t in zip(guesses, ids, strict=True))
    return AttackResult(layer, len(coords), dense.c.hidden, hits, len(ids), mask_scale, guesses)
