"""One decoder layer in the clear, with every linear injected, and the dense twin built from it.

`decoder_layer` is the single copy of the layer's math outside the sharded runtime. Its callers:

  DenseModel       the dense twin: the same model in one process, no sharding, no communication
                   (tests, loaders, and the red team's view of the public model: audit/attack.py)
  masked.client    the masked mode's client: its `linear` is a product computed by workers on
                   one-time-pad-masked inputs; everything else runs here, in the clear

The sharded model (sharded.py + ops.py) computes the same layer on shards, by design a separate
implementation (its shards and collectives are the point); it shares the kernels (kernels.py).

Layout: token-major, x (B, T, H); a linear maps (..., K) -> (..., N) as W x with HF weights (N, K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..weights.loader import WeightSource
from . import architecture as arch
from .config import ModelConfig
from .kernels import Rotary, attend, causal_mask, rms_norm, rotate

LINEARS = arch.LINEAR_NAMES  # in the order a layer uses them
# (name, x (B, T, K)) -> W_name x (B, T, N), without bias
Linear = Callable[[str, torch.Tensor], torch.Tensor]
# (k, v) of this call, (B, n_kv, T, d) -> every (k, v) to attend to, (B or 1, n_kv, S, d)
KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ClearParams:
    """What the clear layer applies itself: the norm gains, the q/k/v bias (Qwen2) and the per-head
    q/k norm gains (Qwen3)."""

    g_attn: torch.Tensor
    g_mlp: torch.Tensor
    qkv_bias: torch.Tensor | None
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # (d,) gains of q_norm, k_norm

    @staticmethod
    def read(src: WeightSource, layer: int) -> ClearParams:
        return ClearParams(
            arch.read_norm(src, layer, "qkv"),
            arch.read_norm(src, layer, "gate_up"),
            arch.read_bias(src, layer, "qkv"),
            arch.read_qk_norms(src, layer),
        )


def self_attention(c: ModelConfig, qkv: torch.Tensor, kv: KV, cos, sin, mask, qk_norms=None) -> torch.Tensor:
    """qkv (B, T, (nh + 2 nkv) d), bias added -> o (B, T, nh d): the per-head q/k RMSNorm when the
    family has one (`qk_norms`: gains (d,) of q and k; Qwen3), RoPE, the KV cache, attention."""
    b, t, _ = qkv.shape
    nh, nkv, d, gs = c.n_heads, c.n_kv_heads, c.head_dim, c.group_size
    q = qkv[..., : nh * d].view(b, t, nh, d)
    k = qkv[..., nh * d : (nh + nkv) * d].view(b, t, nkv, d)
    if qk_norms is not None:
        q, k = rms_norm(q, qk_norms[0], c.rms_eps), rms_norm(k, qk_norms[1], c.rms_eps)
    q = rotate(q.transpose(1, 2), cos, sin)  # (B, nh, T, d)
    k = rotate(k.transpose(1, 2), cos, sin)  # (B, nkv, T, d)
    v = qkv[..., (nh + nkv) * d :].view(b, t, nkv, d).transpose(1, 2)  # (B, nkv, T, d)
    k_all, v_all = kv(k, v)
    o = attend(q.reshape(b, nkv, gs * t, d), k_all, v_all, mask, gs, t, d**-0.5)  # (B, nkv, gs*T, d)
    return o.view(b, nkv, gs, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, nh * d)  # (B, T, nh d), head-major


def decoder_layer(
    c: ModelConfig,
    p: ClearParams,
    x: torch.Tensor,
    linear: Linear,
    kv: KV | None,
    cos,
    sin,
    mask,
    attention: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x (B, T, H) -> x (B, T, H): RMSNorm, qkv (+ bias), RoPE, attention, o, RMSNorm, SwiGLU MLP.
    `mask` is this layer's (its sliding window's, when it has one: kernels.causal_mask).
    `attention(qkv) -> o`, when given, replaces `self_attention` over (kv, cos, sin, mask): the
    masked client's batch of sessions, each at its own position with its own cache."""
    qkv = linear("qkv", rms_norm(x, p.g_attn, c.rms_eps))  # (B, T, (nh + 2 nkv) d)
    if p.qkv_bias is not None:
        qkv = qkv + p.qkv_bias
    o = attention(qkv) if attention is not None else self_attention(c, qkv, kv, cos, sin, mask, p.qk_norms)
    x = x + linear("o", o)
    gu = linear("gate_up", rms_norm(x, p.g_mlp, c.rms_eps))  # (B, T, 2I)
    inter = gu.shape[-1] // 2
    return x + linear("down", torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:])


class DenseModel:
    """The public model in one process: layers [0, n_layers) with their full weights.

    forward(ids, pos)            logits (T, V), with a KV cache kept across calls (the twin)
    residual(ids_BT, upto)       the residual entering layer `upto`, for a batch of sequences
    residual_after(prefix, cand, upto)
                                 the same at position len(prefix) for each candidate next token,
                                 the prefix run once (the vocabulary-matching attack)
    """

    def __init__(self, src: WeightSource, n_layers: int | None = None, max_seq: int = 256):
        c = self.config = src.config
        self.n_layers = c.n_layers if n_layers is None else n_layers
        self.embed = src.read(arch.EMBED)  # (V, H)
        self.final_norm = src.read(arch.FINAL_NORM)
        self.lm_head = arch.read_lm_head(src, self.embed)
        self.clear = [ClearParams.read(src, i) for i in range(self.n_layers)]
        self.weights = [{name: arch.read_weight(src, i, name) for name in LINEARS} for i in range(self.n_layers)]
        shape = (self.n_layers, c.n_kv_heads, max_seq, c.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)  # (L, n_kv, S, d)
        self.rotary = Rotary(c.rope, c.head_dim)

    def _linear(self, i: int) -> Linear:
        w = self.weights[i]
        return lambda name, x: x @ w[name].T

    def new_cache(self, max_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed (K, V) cache of `max_seq` positions, (L, n_kv, S, d) each: one per session when
        several share the weights (speculative.DraftModelDrafter)."""
        c = self.config
        shape = (self.n_layers, c.n_kv_heads, max_seq, c.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    @torch.no_grad()
    def forward(self, ids: list[int], pos: int, cache: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits (T, V) for tokens `ids` at positions pos.. (KV cache kept across calls: the model's
        own, or `cache` from new_cache)."""
        k_cache, v_cache = cache if cache is not None else (self.k_cache, self.v_cache)
        t = len(ids)
        cos, sin = self.rotary.tables(torch.arange(pos, pos + t))
        masks = {w: causal_mask(pos, t, w) for w in self.config.windows}  # one per distinct window
        x = self.embed[torch.tensor(ids)][None]  # (1, T, H)
        for i in range(self.n_layers):

            def kv(k, v, i=i):
                k_cache[i][:, pos : pos + t] = k[0]
                v_cache[i][:, pos : pos + t] = v[0]
                return k_cache[i][None, :, : pos + t], v_cache[i][None, :, : pos + t]

            mask = masks[self.config.window(i)]
            x = decoder_layer(self.config, self.clear[i], x, self._linear(i), kv, cos, sin, mask)
        return rms_norm(x[0], self.final_norm, self.config.rms_eps) @ self.lm_head.T  # (T, V)

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, upto: int) -> tuple[torch.Tensor, list]:
        t = ids.shape[1]
        x = self.embed[ids]  # (B, T, H)
        cos, sin = self.rotary.tables(torch.arange(t))
        masks = {w: causal_mask(0, t, w) for w in self.config.windows}
        cache = []
        for i in range(upto):
            kept: list = []

            def kv(k, v, kept=kept):
                kept.append((k, v))
                return k, v

            x = decoder_layer(
                self.config, self.clear[i], x, self._linear(i), kv, cos, sin, masks[self.config.window(i)]
            )
            cache.append(kept[0])
        return x, cache

    @torch.no_grad()
    def residual(self, ids: torch.Tensor, upto: int) -> torch.Tensor:
        """(B, T) ids -> (B, T, H) residual entering layer `upto` (0 = the embedding)."""
        return self._run(ids, upto)[0]

    @torch.no_grad()
    def residual_after(self, prefix: list[int], cand: torch.Tensor, upto: int) -> torch.Tensor:
        """Residual entering layer `upto` at position len(prefix), for each candidate token (B,)
        following the same prefix: the prefix runs once, candidates attend to its cached k/v."""
        p, b = len(prefix), cand.shape[0]
        cache = self._run(torch.tensor([prefix]), upto)[1] if p else [None] * upto
        x = self.embed[cand][:, None, :]  # (B, 1, H)
        cos, sin = self.rotary.tables(torch.tensor([p]))
        masks = {w: causal_mask(p, 1, w) for w in self.config.windows}
        for i in range(upto):

            def kv(k, v, past=cache[i]):
                if past is None:
                    return k, v
                return torch.cat([past[0].expand(b, -1, -1, -1), k], 2), torch.cat(
                    [past[1].expand(b, -1, -1, -1), v], 2
                )

            x = decoder_layer(
                self.config, self.clear[i], x, self._linear(i), kv, cos, sin, masks[self.config.window(i)]
            )
        return x[:, 0]
