"""The layer's ops in the clear, token-major (`DenseOps`), and the dense twin built on them.

`DenseOps` runs layer.decoder_layer with every linear injected. Its users:

  DenseModel       the dense twin: the same model in one process, no sharding, no communication
                   (tests, loaders, and the red team's view of the public model: audit/attack.py)
  masked.client    the masked mode's client: its `linear` is a product computed by workers on
                   one-time-pad-masked inputs, its attention runs each session over its own cache;
                   everything else runs here, in the clear

The sharded model and the Megatron-style baseline run the same decoder_layer over their own ops
(structural/ops.py, structural/megatron.py): the layer is written once (layer.py).

Layout: token-major, x (B, T, H); a linear maps (..., K) -> (..., N) as W x with HF weights (N, K).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import architecture as arch
from .config import ModelConfig
from .kernels import Rotary, attend, causal_mask, gated, rms_norm, rotate, tree_depths, tree_mask
from .layer import LayerOps, decoder_layer
from .source import WeightSource

LINEARS = arch.LINEAR_NAMES  # in the order a layer uses them
# (layer, name, x (B, T, K)) -> W_name x (B, T, N), without bias
Linear = Callable[[int, str, torch.Tensor], torch.Tensor]
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
    post_norms: dict[str, torch.Tensor] | None = None  # Gemma 3: "o", "down" -> the post-norm's gain (H,)

    @staticmethod
    def read(src: WeightSource, layer: int) -> ClearParams:
        post = {n: g for n in arch.POST_NORMS if (g := arch.read_post_norm(src, layer, n)) is not None}
        return ClearParams(
            arch.read_norm(src, layer, "qkv"),
            arch.read_norm(src, layer, "gate_up"),
            arch.read_bias(src, layer, "qkv"),
            arch.read_qk_norms(src, layer),
            post or None,
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
    o = attend(q.reshape(b, nkv, gs * t, d), k_all, v_all, mask, gs, t, c.scale)  # (B, nkv, gs*T, d)
    return o.view(b, nkv, gs, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, nh * d)  # (B, T, nh d), head-major


@dataclass(frozen=True)
class DenseSpan:
    """What attention needs about one session's tokens in a dense forward: RoPE tables (T, d/2),
    the causal mask per sliding window of the model's layers (`masks[config.window(i)]`; None: one
    token inside its window, or nothing to hide), and `kv(i, k, v)`: layer i's cache update with this
    call's k, v (B, n_kv, T, d), returning every (k, v) to attend to (B or 1, n_kv, S, d)."""

    cos: torch.Tensor
    sin: torch.Tensor
    masks: dict[int | None, torch.Tensor | None]
    kv: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of the local layers' RoPE (Gemma 3)

    @staticmethod
    def at(config: ModelConfig, rotary: Rotary, pos: int, t: int, kv, local: Rotary | None = None) -> DenseSpan:
        """T tokens at positions pos..pos+T-1: their RoPE tables (`local`: the local layers' RoPE,
        config.rope_local) and a mask per window."""
        positions = torch.arange(pos, pos + t)
        cos, sin = rotary.tables(positions)
        masks = {w: causal_mask(pos, t, w) for w in config.windows}
        return DenseSpan(cos, sin, masks, kv, None if local is None else local.tables(positions))

    @staticmethod
    def tree(config: ModelConfig, rotary: Rotary, pos: int, parents, kv, local: Rotary | None = None) -> DenseSpan:
        """A token tree's columns at pos (generation/token_tree.py: `parents`): RoPE by depth, each
        column's mask its ancestors' within each window."""
        positions = pos + torch.tensor(tree_depths(parents))
        cos, sin = rotary.tables(positions)
        masks: dict[int | None, torch.Tensor | None] = {w: tree_mask(pos, parents, w) for w in config.windows}
        return DenseSpan(cos, sin, masks, kv, None if local is None else local.tables(positions))


def rotaries(config: ModelConfig) -> tuple[Rotary, Rotary | None]:
    """The model's RoPE tables, and its local layers' where they differ (Gemma 3's rope_local)."""
    local = None if config.rope_local is None else Rotary(config.rope_local, config.head_dim)
    return Rotary(config.rope, config.head_dim), local


# A dense step: its sessions' spans, their tokens consecutive along x's T (the masked client's batch)
DenseStep = tuple[DenseSpan, ...]


class DenseOps(LayerOps[DenseStep]):
    """layer.LayerOps in the clear, token-major: the norms (post-norms too: Gemma 3), the q/k/v bias,
    attention and the gated activation here; each linear `linear(i, name, x)` (the twin's matmul, or the masked client's product)."""

    def __init__(self, config: ModelConfig, clear: list[ClearParams], linear: Linear):
        self.config, self.clear, self.linear = config, clear, linear

    def norm_linear(self, i: int, name: str, x: torch.Tensor) -> torch.Tensor:
        p = self.clear[i]
        y = self.linear(i, name, rms_norm(x, p.g_attn if name == "qkv" else p.g_mlp, self.config.rms_eps))
        if name == "qkv" and p.qkv_bias is not None:
            y = y + p.qkv_bias
        return y

    def attention(self, i: int, qkv: torch.Tensor, step: DenseStep) -> torch.Tensor:
        """Each span over its own cache: qkv (B, ΣT, ·) -> o (B, ΣT, nh d)."""
        out, row = [], 0
        for s in step:
            t = s.cos.shape[0]
            part = qkv if len(step) == 1 else qkv[:, row : row + t]
            kv, mask = (lambda k, v, s=s: s.kv(i, k, v)), s.masks[self.config.window(i)]
            cos, sin = s.local if s.local is not None and self.config.local_rope(i) else (s.cos, s.sin)
            out.append(self_attention(self.config, part, kv, cos, sin, mask, self.clear[i].qk_norms))
            row += t
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def linear_back(self, i: int, name: str, y: torch.Tensor) -> torch.Tensor:
        return self.linear(i, name, y)

    def activation(self, i: int, gu: torch.Tensor) -> torch.Tensor:
        return gated(gu, self.config.activation)

    def post_norm(self, i: int, name: str, y: torch.Tensor) -> torch.Tensor:
        post = self.clear[i].post_norms
        return y if post is None else rms_norm(y, post[name], self.config.rms_eps)


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
        self.final_norm = arch.read_final_norm(src)
        self.lm_head = arch.read_lm_head(src, self.embed)
        self.clear = [ClearParams.read(src, i) for i in range(self.n_layers)]
        self.weights = [{name: arch.read_weight(src, i, name) for name in LINEARS} for i in range(self.n_layers)]
        shape = (self.n_layers, c.n_kv_heads, max_seq, c.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)  # (L, n_kv, S, d)
        self.rotary, self.rotary_local = rotaries(c)
        self.ops = DenseOps(c, self.clear, lambda i, name, x: x @ self.weights[i][name].T)

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
        x = arch.embed_rows(self.config, self.embed, torch.tensor(ids))[None]  # (1, T, H)

        def kv(i, k, v):
            k_cache[i][:, pos : pos + t] = k[0]
            v_cache[i][:, pos : pos + t] = v[0]
            return k_cache[i][None, :, : pos + t], v_cache[i][None, :, : pos + t]

        step = (DenseSpan.at(self.config, self.rotary, pos, t, kv, self.rotary_local),)
        for i in range(self.n_layers):
            x = decoder_layer(self.ops, i, x, step)
        return rms_norm(x[0], self.final_norm, self.config.rms_eps) @ self.lm_head.T  # (T, V)

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, upto: int) -> tuple[torch.Tensor, list]:
        t = ids.shape[1]
        x = arch.embed_rows(self.config, self.embed, ids)  # (B, T, H)
        cache: list = []  # layer i's (k, v)

        def kv(i, k, v):
            cache.append((k, v))
            return k, v

        step = (DenseSpan.at(self.config, self.rotary, 0, t, kv, self.rotary_local),)
        for i in range(upto):
            x = decoder_layer(self.ops, i, x, step)
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
        x = arch.embed_rows(self.config, self.embed, cand)[:, None, :]  # (B, 1, H)

        def kv(i, k, v):
            past = cache[i]
            if past is None:
                return k, v
            return torch.cat([past[0].expand(b, -1, -1, -1), k], 2), torch.cat([past[1].expand(b, -1, -1, -1), v], 2)

        step = (DenseSpan.at(self.config, self.rotary, p, 1, kv, self.rotary_local),)
        for i in range(upto):
            x = decoder_layer(self.ops, i, x, step)
        return x[:, 0]
