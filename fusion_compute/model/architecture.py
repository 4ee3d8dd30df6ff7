"""The one description of the decoder architecture that every consumer reads (every family of
config.FAMILIES).

What it fixes, once: the Hugging Face tensor names; which HF linears are stacked by rows into one
fused linear (q/k/v -> `qkv`, gate/up -> `gate_up`); which RMSNorm sits in front of which fused linear
(its gain folds into that linear's input columns); which linear has a bias and when (Qwen2's q/k/v);
and when the LM head is the embedding (tied: `lm_head_tied`). The sharded model, the Megatron-style baseline, the dense
twin, the masked worker and client, the exposure analysis and the attacks all read their weights
through these names, so they cannot drift apart. GGUF's own names are mapped onto these in gguf.py.

    fused linear   HF parts (stacked by rows, in order)           norm in front                bias
    qkv            self_attn.{q,k,v}_proj   rows nh·d, nkv·d, nkv·d  input_layernorm            config.qkv_bias
    o              self_attn.o_proj         rows H                   -                          no
    gate_up        mlp.{gate,up}_proj       rows I, I                post_attention_layernorm   no
    down           mlp.down_proj            rows H                   -                          no

Phi-3 checkpoints store the stacks already fused (`self_attn.qkv_proj`, `mlp.gate_up_proj`, the same
row order): `read_weight` then reads the rows asked for from the one tensor (`FusedLinear.fused`).
Qwen3 adds an RMSNorm on each head of q and of k (`self_attn.q_norm`, `self_attn.k_norm`, gains (d,)):
`read_qk_norms`.

Gemma 3 renames and adds norms: the MLP's pre-norm is `pre_feedforward_layernorm`, and its
`post_attention_layernorm` / `post_feedforward_layernorm` normalize the o / down outputs before the
residual adds (`read_post_norm`). Every Gemma gain is stored as w with the norm multiplying by 1 + w:
every reader here returns the gain the norm multiplies by (config.gain_offset + w), so no consumer
needs to know. The embedding's √H scale is `embed_rows`.

RoPE variants live in config.py (RopeConfig: default, linear, llama3, longrope) and kernels.py (the one
rotary implementation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .source import Ranges, WeightSource

EMBED = "model.embed_tokens.weight"  # (V, H)
FINAL_NORM = "model.norm.weight"  # (H,)
LM_HEAD = "lm_head.weight"  # (V, H); absent when tied


@dataclass(frozen=True)
class FusedLinear:
    """One linear of a decoder layer as the runtime computes it: HF linears stacked by rows."""

    name: str
    parts: tuple[str, ...]  # HF module names under model.layers.N., stacked in this order
    norm: str | None  # the RMSNorm whose output this linear reads (its gain folds into the weight)
    biased: bool  # has a bias when the config says so (Qwen2's q/k/v)
    fused: str | None = None  # the checkpoint's own fused module, where a family stores one (Phi-3)

    def part_rows(self, c: ModelConfig) -> tuple[int, ...]:
        """Output rows of each part, in stacking order."""
        q, kv, inter = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate
        return {"qkv": (q, kv, kv), "o": (c.hidden,), "gate_up": (inter, inter), "down": (c.hidden,)}[self.name]

    def has_bias(self, c: ModelConfig) -> bool:
        return self.biased and c.qkv_bias


LINEARS: tuple[FusedLinear, ...] = (  # in the order a layer uses them
    FusedLinear(
        "qkv",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "input_layernorm",
        True,
        "self_attn.qkv_proj",
    ),
    FusedLinear("o", ("self_attn.o_proj",), None, False),
    FusedLinear("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", False, "mlp.gate_up_proj"),
    FusedLinear("down", ("mlp.down_proj",), None, False),
)
LINEAR_NAMES = tuple(linear.name for linear in LINEARS)
BY_NAME = {linear.name: linear for linear in LINEARS}


def layer_tensor(layer: int, suffix: str) -> str:
    """The HF name of a layer's tensor: `model.layers.{layer}.{suffix}`."""
    return f"model.layers.{layer}.{suffix}"


def read_weight(
    src: WeightSource, layer: int, name: str, rows: tuple[int, int] | None = None, cols: Ranges | None = None
) -> torch.Tensor:
    """The fused linear `name`'s weight (out, in), fp32, HF layout: rows [a, b) of the stack (None: all),
    columns `cols` (None: all). Only the parts and rows asked for are read (for GGUF: dequantized)."""
    linear = BY_NAME[name]
    if linear.fused is not None and src.has(layer_tensor(layer, f"{linear.fused}.weight")):
        sel = None if rows is None else torch.arange(*rows)
        return src.read(layer_tensor(layer, f"{linear.fused}.weight"), rows=sel, cols=cols)
    parts, at = [], 0
    for module, n in zip(linear.parts, linear.part_rows(src.config), strict=True):
        lo, hi = (at, at + n) if rows is None else (max(rows[0], at), min(rows[1], at + n))
        if lo < hi:
            sel = None if (lo, hi) == (at, at + n) else torch.arange(lo - at, hi - at)
            parts.append(src.read(layer_tensor(layer, f"{module}.weight"), rows=sel, cols=cols))
        at += n
    return torch.cat(parts)


def read_bias(src: WeightSource, layer: int, name: str) -> torch.Tensor | None:
    """The fused linear's bias (out,), or None when it has none."""
    linear = BY_NAME[name]
    if not linear.has_bias(src.config):
        return None
    return torch.cat([src.read(layer_tensor(layer, f"{module}.bias")) for module in linear.parts])


# the norms a family names its own way (Gemma 3: its post_attention_layernorm is a post-norm)
_PRE_NORMS = {"gemma3_text": {"gate_up": "pre_feedforward_layernorm"}}
# the post-norm after the linear back `o` / `down`, for a family with post_norms
POST_NORMS = {"o": "post_attention_layernorm", "down": "post_feedforward_layernorm"}


def _gain(src: WeightSource, name: str) -> torch.Tensor:
    """A stored RMSNorm gain as the norm multiplies by it: config.gain_offset + w (Gemma's 1 + w,
    added in float32 as transformers does)."""
    g = src.read(name)
    offset = src.config.gain_offset
    return g if not offset else offset + g.float()


def read_norm(src: WeightSource, layer: int, name: str) -> torch.Tensor:
    """The gain (H,) of the RMSNorm in front of the fused linear `name`."""
    norm = _PRE_NORMS.get(src.config.arch, {}).get(name, BY_NAME[name].norm)
    if norm is None:
        raise ValueError(f"no norm in front of {name}")
    return _gain(src, layer_tensor(layer, f"{norm}.weight"))


def read_post_norm(src: WeightSource, layer: int, name: str) -> torch.Tensor | None:
    """The gain (H,) of the post-norm after the linear back `name` ("o", "down"; Gemma 3), or None
    when the family has none."""
    if not src.config.post_norms:
        return None
    return _gain(src, layer_tensor(layer, f"{POST_NORMS[name]}.weight"))


def read_final_norm(src: WeightSource) -> torch.Tensor:
    """The final RMSNorm's gain (H,)."""
    return _gain(src, FINAL_NORM)


def read_qk_norms(src: WeightSource, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The per-head RMSNorm gains (d,) of q and of k (Qwen3, Gemma 3), or None when the family has none."""
    if not src.config.qk_norm:
        return None
    return _gain(src, layer_tensor(layer, "self_attn.q_norm.weight")), _gain(
        src, layer_tensor(layer, "self_attn.k_norm.weight")
    )


def embed_rows(config: ModelConfig, embed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The embedding of `ids`: rows of `embed` (V, H), times config.embed_scale where the family
    scales them (Gemma: √H, as a tensor of the embedding's dtype, as transformers multiplies)."""
    rows = embed[ids]
    if config.embed_scale == 1.0:
        return rows
    return rows * torch.tensor(config.embed_scale, dtype=embed.dtype, device=embed.device)


def lm_head_tied(src: WeightSource) -> bool:
    """The LM head is the embedding exactly when the file has no LM head of its own. A stored
    lm_head.weight is used even under `tie_word_embeddings: true`: transformers (5.24, the reference)
    does the same when the two differ ("both are present in the checkpoints with different values, so
    we will NOT tie them"; tests/test_dense.py), and when they are equal either reading gives the same."""
    return not src.has(LM_HEAD)


def read_lm_head(src: WeightSource, embed: torch.Tensor) -> torch.Tensor:
    """The LM head (V, H): `embed` itself when tied."""
    return embed if lm_head_tied(src) else src.read(LM_HEAD)
