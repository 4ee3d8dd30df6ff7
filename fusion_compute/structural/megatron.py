"""Megatron-style tensor parallelism: the baseline this project's design forbids (worker flag
`--variant megatron`). Benchmark and audit negative control, not a product mode.

Every worker holds the *full* residual (replicated) and computes its heads / MLP columns from it:

  step           input        output          placement change
  ingress        x_dT (R)     x_HT            S(R) -> all-gather -> R     (the client is unchanged)
  norm + qkv     x_HT (R)     qkv_aT (A)      local: column-parallel, no collective
  attention      A            o_aT (A)        local (+ score sums of split groups, as sharded)
  o_proj         o_aT (A)     x_HT            P -> all-reduce -> R       (every worker: full sum)
  norm + gate/up x_HT (R)     gu_mT (M)       local
  down           h_mT (M)     x_HT            P -> all-reduce -> R
  down (last)    h_mT (M)     e_HT            local partial + the worker's rows R_w of x: the egress,
                                              summed by the client (as the sharded mode's, ops.py)

Two all-reduces per layer instead of four reduce-scatters, and every worker holds the complete
residual at every layer: the audit verifier must (and does) reject it. Weights: the same row /
column slices as the sharded plan but with all H input columns (no norm fusion needed:
sharded.load_layer with `replicated`). The layer is model/layer.decoder_layer, as everywhere; only
its norm + linear and linear back differ (MegatronLayer).
"""

from __future__ import annotations

import torch

from ..model.kernels import linear_fm
from .ops import ShardedLayer, Span
from .sharded import ShardedModel


def norm(x_HT: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the full residual (feature-major, gain folded into the weights), in float32."""
    xf = x_HT.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(0) + eps)).to(x_HT.dtype)


class MegatronLayer(ShardedLayer):
    """The sharded layer's ops (attention, activation, audit holds) with the residual replicated:
    norm + linear local, linear back an all-reduce. decoder_layer (model/layer.py) runs it."""

    def norm_linear(self, i: int, name: str, x_HT: torch.Tensor) -> torch.Tensor:
        """Column-parallel, no collective: this worker's rows of W · RMSNorm(x), the bias (qkv) added."""
        if name == "qkv" and self.given_qkv is not None:  # layer 0: from the client (ShardedLayer.norm_linear)
            qkv_aT, self.given_qkv = self.given_qkv, None
            return qkv_aT
        h_HT = norm(x_HT, self.eps)  # full residual: norm is local
        if name == "qkv":
            qkv_aT = linear_fm(self.w.qkv_w, h_HT)
            return qkv_aT if self.w.qkv_b is None else qkv_aT + self.w.qkv_b[:, None]
        return linear_fm(self.w.gu_w, h_HT)

    def post_norm(self, i: int, name: str, y_HT: torch.Tensor) -> torch.Tensor:
        """Gemma 3's post-norm on the replicated y (H, T): local, no collective."""
        if self.w.post_w is None:
            return y_HT
        return self.w.post_w[0 if name == "o" else 1][:, None] * norm(y_HT, self.eps)

    def linear_back(self, i: int, name: str, y: torch.Tensor) -> torch.Tensor:
        """Row-parallel: every worker gets the full sum W y (H, T)."""
        w_back = self.w.o_w if name == "o" else self.w.down_w
        if name == "down" and self.to_client:  # the client sums the partials (ShardedLayer.linear_back)
            return linear_fm(w_back, y)
        return self.comm.all_reduce_workers(linear_fm(w_back, y), f"L{i}.{name}")

    def residual_add(self, i: int, x_HT: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """As the sharded layer's, x replicated: the last layer adds only this worker's rows R_w of x
        to its partial, so the client's sum over the workers counts x once (with post-norms, y is
        the all-reduced full sum: only its rows R_w too)."""
        if not self.egress:
            return x_HT + y
        a, b = self.res_starts[self.me], self.res_starts[self.me + 1]
        return super().residual_add(i, x_HT[a:b], y if self.to_client else y[a:b])


class MegatronModel(ShardedModel):
    """Drop-in for worker.ShardedModel (whose session plumbing it inherits: reset, attach_audit,
    RoPE and mask per step, make_layer with load_layer's replicated slicing): forward(x_dT, pos)
    maps the ingress shard to the egress (the last layer's partial, as the sharded model's: the
    client runs unchanged), replicating the residual in between."""

    layer_class = MegatronLayer
    replicated = True

    @property
    def res_sizes(self) -> list[int]:
        return list(self.plan.residual_sizes)

    def forward(self, x_dT: torch.Tensor, spans: list[Span], qkv_aT: torch.Tensor) -> torch.Tensor:
        steps = self._layer_steps(spans)
        self.layers[0].given_qkv = qkv_aT
        x_HT = self.comm.all_gather_workers(x_dT, self.res_sizes, "ingress.gather")  # (H, T), replicated
        for layer, step in zip(self.layers, steps, strict=True):
            x_HT = layer.forward(x_HT, step)
        return x_HT  # the egress e_HT (the last layer's residual_add)
