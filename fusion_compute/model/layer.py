"""The decoder layer, written once: `decoder_layer(ops, i, x, step)` over a small `LayerOps` protocol.

How a layer runs (dense in one process, the masked client, sharded over workers, the Megatron-style
baseline) is the ops; what it computes is here, for every one of them:

  h   = RMSNorm(x) · g_attn
  qkv = W_qkv h + b_qkv                       ops.norm_linear(i, "qkv", x)      into the attention layout
  o   = attention(qkv)                        ops.attention(i, qkv, step)       RoPE, KV cache, softmax
  x  += W_o o                                 ops.linear_back(i, "o", o)        back to the residual layout
  gu  = W_gate_up (RMSNorm(x) · g_mlp)        ops.norm_linear(i, "gate_up", x)  into the MLP layout
  x  += W_down (silu(gate) ⊙ up)              ops.activation(i, gu), ops.linear_back(i, "down", h),
                                              ops.residual_add(i, x, y)

Gemma 3 normalizes each block's output before its residual add (a post-norm): x += RMSNorm(W_o o) ·
g_post_attn, x += RMSNorm(W_down h) · g_post_ff, `ops.post_norm(i, "o" / "down", y)` (the identity for
the families without: `post_norm` below). Sharded, y is split by residual rows across the workers, so
its Σy² per token is summed over all of them first: one all-worker scalar per token (structural/ops.py).

`x` is opaque here except for `+`: each implementation keeps its own layout (dense: token-major
(B, T, H); sharded and Megatron: feature-major (rows, T)) and its own `step` (what attention needs
about the tokens of this forward: positions, RoPE tables, masks, KV slots). The audit's hold
records (which coordinates each tensor of the layer stands for) are made here, in one place, by
`ops.hold`: a no-op unless the implementation records.

A model family changes the layer at the ops level: per-head q/k norms (Qwen3) and a sliding window
(Mistral) live in `attention` (which gets the step: token trees bring their masks and depths
there), another gated activation (GeGLU) in `activation`, another norm in `norm_linear`.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

S = TypeVar("S", contravariant=True)

# The tensors whose holdings the audit records, in the order decoder_layer records them.
HOLDS = ("resid.in", "qkv", "kv", "attn", "resid.mid", "gate_up", "h", "resid.out")


class LayerOps(Protocol[S]):
    """The ops one decoder layer is made of, in the layout of whoever implements them."""

    def norm_linear(self, i: int, name: str, x: torch.Tensor) -> torch.Tensor:
        """W_name · RMSNorm(x) · g of layer i, from the residual layout into the `name` layout
        ("qkv": attention, bias added once after any reduction; "gate_up": MLP)."""
        ...

    def attention(self, i: int, qkv: torch.Tensor, step: S) -> torch.Tensor:
        """qkv (attention layout, bias added) -> o (attention layout, q rows): RoPE, the KV cache
        of this step's sessions, masked softmax · v."""
        ...

    def linear_back(self, i: int, name: str, y: torch.Tensor) -> torch.Tensor:
        """W_name y of layer i ("o": from attention, "down": from the MLP) into the residual layout."""
        ...

    def activation(self, i: int, gu: torch.Tensor) -> torch.Tensor:
        """The MLP's gated activation, gu (MLP layout, [gate; up]) -> h: SwiGLU silu(gate) ⊙ up."""
        ...

    def residual_add(self, i: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Layer i's output x + W_down h (y: what linear_back(i, "down", ·) returned). The sharded
        modes' last layer returns the worker's egress here instead (structural/ops.py: the down
        partials go straight to the client, which sums them; with post-norms the worker's rows). x + y by default."""
        return x + y

    def post_norm(self, i: int, name: str, y: torch.Tensor) -> torch.Tensor:
        """The post-norm of layer i's linear back `name` ("o", "down") on y (residual layout):
        RMSNorm(y) · g (Gemma 3). The identity by default: the families without post-norms."""
        return y

    def hold(self, i: int, name: str, t: torch.Tensor) -> None:
        """Audit hook: at this step, layer i's tensor `name` (one of HOLDS) is `t` ("kv": t is the
        qkv whose k, v went into the cache: the record is the cache's). No-op by default."""
        return None


def decoder_layer(ops: LayerOps[S], i: int, x: torch.Tensor, step: S) -> torch.Tensor:
    """Layer i on the residual x, in ops' layout: x + attention block, then + MLP block (module doc)."""
    qkv = ops.norm_linear(i, "qkv", x)
    o = ops.attention(i, qkv, step)
    y = ops.post_norm(i, "o", ops.linear_back(i, "o", o))
    # holdings at this step (recorded after the o linear, as every worker has then held them)
    ops.hold(i, "resid.in", x)
    ops.hold(i, "qkv", qkv)
    ops.hold(i, "kv", qkv)
    ops.hold(i, "attn", o)
    ops.hold(i, "resid.mid", y)
    x = x + y
    gu = ops.norm_linear(i, "gate_up", x)
    h = ops.activation(i, gu)
    y = ops.post_norm(i, "down", ops.linear_back(i, "down", h))
    ops.hold(i, "gate_up", gu)
    ops.hold(i, "h", h)
    ops.hold(i, "resid.out", y)
    return ops.residual_add(i, x, y)
