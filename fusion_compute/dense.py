"""The dense twin: the same decoder in one process, same names, same feature-major layout, no
sharding and no communication. The only difference from the sharded model (worker.py + ops.py) is
that every "reduce-scatter" here is the identity on the full width, which makes it the yardstick
for the sharded operators and for debugging loaders without starting processes.
"""

from __future__ import annotations

import torch

from .ops import apply_rope, causal_mask, inv_freq_tensor, rope_cos_sin
from .weights import WeightSource


class DenseModel:
    def __init__(self, src: WeightSource, max_seq: int = 256):
        c = self.config = src.config
        self.embed = src.read("model.embed_tokens.weight")
        self.final_norm = src.read("model.norm.weight")
        self.lm_head = self.embed if not src.has("lm_head.weight") else src.read("lm_head.weight")
        self.layers = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            layer = {
                "g_attn": src.read(p + "input_layernorm.weight"),
                "qkv": torch.cat([src.read(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                "o": src.read(p + "self_attn.o_proj.weight"),
                "g_mlp": src.read(p + "post_attention_layernorm.weight"),
                "gu": torch.cat([src.read(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]),
                "down": src.read(p + "mlp.down_proj.weight"),
                "b": torch.cat([src.read(p + f"self_attn.{x}_proj.bias") for x in "qkv"]) if c.qkv_bias else None,
            }
            self.layers.append(layer)
        d, nkv = c.head_dim, c.n_kv_heads
        self.k_cache = [torch.zeros(nkv, max_seq, d) for _ in self.layers]  # (n_kv, S, d)
        self.v_cache = [torch.zeros(nkv, max_seq, d) for _ in self.layers]
        self.inv_freq = inv_freq_tensor(c.rope, d)

    def _norm(self, x_HT: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x_HT * torch.rsqrt(x_HT.pow(2).mean(0, keepdim=True) + self.config.rms_eps) * g[:, None]

    def forward(self, ids: list[int], pos: int) -> torch.Tensor:
        """Logits (T, V) for tokens `ids` at positions pos.. (KV cache kept across calls)."""
        c = self.config
        d, gs, nkv, t = c.head_dim, c.group_size, c.n_kv_heads, len(ids)
        half = d // 2
        # Local head-dim order is [first halves | second halves] of the pairs; for a whole head
        # that is the natural order, so apply_rope is used unchanged.
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(pos, pos + t))
        mask = causal_mask(pos, t)
        x_HT = self.embed[torch.tensor(ids)].T  # (H, T)
        for i, w in enumerate(self.layers):
            qkv = w["qkv"] @ self._norm(x_HT, w["g_attn"])  # (Q + 2K, T)
            if w["b"] is not None:
                qkv = qkv + w["b"][:, None]
            nq = c.n_heads * d
            q = apply_rope(qkv[:nq].view(nkv, gs, d, t), cos[:half], sin[:half])  # (n_kv, gs, d, T)
            k = apply_rope(qkv[nq : nq + nkv * d].view(nkv, d, t), cos[:half], sin[:half])  # (n_kv, d, T)
            v = qkv[nq + nkv * d :].view(nkv, d, t)
            self.k_cache[i][:, pos : pos + t] = k.transpose(1, 2)
            self.v_cache[i][:, pos : pos + t] = v.transpose(1, 2)
            s = pos + t
            scores = q.permute(0, 1, 3, 2).reshape(nkv, gs * t, d) @ self.k_cache[i][:, :s].transpose(1, 2)
            scores = scores * d**-0.5
            if mask is not None:
                scores = scores.view(nkv, gs, t, s).masked_fill(mask, float("-inf")).view(nkv, gs * t, s)
            o = torch.softmax(scores, -1) @ self.v_cache[i][:, :s]  # (n_kv, gs*T, d)
            x_HT = x_HT + w["o"] @ o.view(nkv, gs, t, d).permute(0, 1, 3, 2).reshape(nq, t)
            gu = w["gu"] @ self._norm(x_HT, w["g_mlp"])  # (2I, T)
            m = gu.shape[0] // 2
            x_HT = x_HT + w["down"] @ (torch.nn.functional.silu(gu[:m]) * gu[m:])
        return (self._norm(x_HT, self.final_norm).T @ self.lm_head.T).float()  # (T, V)
