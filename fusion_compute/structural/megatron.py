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
  egress         x_HT         x_dT            local slice of the replicated residual

Two all-reduces per layer instead of four reduce-scatters, and every worker holds the complete
residual at every layer: the audit verifier must (and does) reject it. Weights: the same row /
column slices as the sharded plan but with all H input columns (no norm fusion needed).
"""

from __future__ import annotations

import torch

from ..model import architecture as arch
from ..weights.loader import WeightSource
from .ops import LayerIndex, LayerShard, ShardedLayer, Span, Step
from .plan import Plan, runs
from .sharded import ShardedModel, qk_gains


def load_layer(src: WeightSource, plan: Plan, w: int, layer: int) -> LayerShard:
    """Column-parallel qkv / gate-up rows (all input columns, norm gain folded), row-parallel o / down."""
    c = plan.config
    qkv_rows, gu_rows, o_cols = plan.qkv_rows(w), plan.gate_up_rows(w), plan.o_cols(w)
    everything = list(range(c.hidden))
    index = LayerIndex(
        resid_in=everything,
        qkv_out=qkv_rows,
        attn_in=o_cols,
        resid_out=everything,
        gu_out=gu_rows,
        h_in=list(range(*plan.workers[w].mlp)),
    )
    qkv = arch.read_weight(src, layer, "qkv")
    qkv_w = (qkv[torch.tensor(qkv_rows)] * arch.read_norm(src, layer, "qkv")).contiguous()
    del qkv
    bias = arch.read_bias(src, layer, "qkv")
    qkv_b = None if bias is None else bias[torch.tensor(qkv_rows)].contiguous()
    o_w = arch.read_weight(src, layer, "o", cols=runs(o_cols))  # (H, a_r)
    gu = arch.read_weight(src, layer, "gate_up")
    gu_w = (gu[torch.tensor(gu_rows)] * arch.read_norm(src, layer, "gate_up")).contiguous()
    del gu
    down_w = arch.read_weight(src, layer, "down", cols=[plan.workers[w].mlp])
    return LayerShard(
        qkv_w=qkv_w, qkv_b=qkv_b, o_w=o_w, gu_w=gu_w, down_w=down_w, index=index, qk_w=qk_gains(src, plan, w, layer)
    )


def norm(x_HT: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the full residual (feature-major, gain folded into the weights), in float32."""
    xf = x_HT.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(0) + eps)).to(x_HT.dtype)


class MegatronLayer(ShardedLayer):
    """Same attention code as the sharded layer; the residual around it is replicated."""

    def forward(self, x_HT: torch.Tensor, step: Step) -> torch.Tensor:
        L, w, c, a = self.i, self.w, self.comm, self.audit
        h_HT = norm(x_HT, self.eps)  # full residual: norm is local
        qkv_aT = w.qkv_w @ h_HT
        if w.qkv_b is not None:
            qkv_aT = qkv_aT + w.qkv_b[:, None]
        o_aT = self.attention(qkv_aT, step)
        y_HT = c.all_reduce_workers(w.o_w @ o_aT, f"L{L}.o")  # every worker gets the full sum
        if a is not None:
            ix = w.index
            a.hold(L, "resid.in", ix.resid_in, x_HT.shape[0])
            a.hold(L, "qkv", ix.qkv_out, qkv_aT.shape[0])
            a.hold(L, "kv", ix.qkv_out, sum(ch.rows for ch in self.caches))
            a.hold(L, "attn", ix.attn_in, o_aT.shape[0])
            a.hold(L, "resid.mid", ix.resid_out, y_HT.shape[0])
        x_HT = x_HT + y_HT
        h_HT = norm(x_HT, self.eps)
        gu_mT = w.gu_w @ h_HT
        m = gu_mT.shape[0] // 2
        h_mT = torch.nn.functional.silu(gu_mT[:m]) * gu_mT[m:]
        y_HT = c.all_reduce_workers(w.down_w @ h_mT, f"L{L}.down")
        if a is not None:
            ix = w.index
            a.hold(L, "gate_up", ix.gu_out, gu_mT.shape[0])
            a.hold(L, "h", ix.h_in, h_mT.shape[0])
            a.hold(L, "resid.out", ix.resid_out, y_HT.shape[0])
        return x_HT + y_HT


class MegatronModel(ShardedModel):
    """Drop-in for worker.ShardedModel (whose session plumbing it inherits: reset, attach_audit,
    RoPE and mask per step): forward(x_dT, pos) maps the ingress shard to the egress shard (so the
    client runs unchanged), replicating the residual in between."""

    @property
    def res_sizes(self) -> list[int]:
        return list(self.plan.residual_sizes)

    def make_layer(self, src: WeightSource, i: int) -> ShardedLayer:
        plan, w, c = self.plan, self.w, self.plan.config
        return MegatronLayer(
            i,
            load_layer(src, plan, w, i).to(self.device, self.dtype),
            plan.workers[w].attention,
            comm=self.comm,
            me=w,
            qkv_sizes_aug=[],
            gu_sizes_aug=[],
            res_sizes=self.res_sizes,
            hidden=c.hidden,
            head_dim=c.head_dim,
            group_size=c.group_size,
            eps=c.rms_eps,
            window=c.window(i),
        )

    def forward(self, x_dT: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        step = self._step(spans)
        x_HT = self.comm.all_gather_workers(x_dT, self.res_sizes, "ingress.gather")  # (H, T), replicated
        for layer in self.layers:
            x_HT = layer.forward(x_HT, step)
        a = sum(self.res_sizes[: self.w])
        return x_HT[a : a + self.res_sizes[self.w]].contiguous()
