"""Benchmark models built locally, never downloaded.

`qwen2_5_1_5b_shaped()`: a Qwen2.5-1.5B-shaped model with random weights (same shapes, same cost,
meaningless output), written once as a sharded safetensors directory (bf16 on disk, read as fp32)
and cached. Sharded on purpose: it exercises the safetensors index path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

QWEN2_5_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


def cache_dir() -> Path:
    return Path(os.environ.get("FUSION_CACHE", Path.home() / ".cache" / "fusion_compute"))


def _tensors(cfg: dict, layer: int | None, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def gain() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=gen)).to(torch.bfloat16)

    if layer is None:
        return {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h), "model.norm.weight": gain()}
    p = f"model.layers.{layer}."
    return {
        p + "input_layernorm.weight": gain(),
        p + "self_attn.q_proj.weight": rnd(q, h),
        p + "self_attn.q_proj.bias": rnd(q, std=0.1),
        p + "self_attn.k_proj.weight": rnd(kv, h),
        p + "self_attn.k_proj.bias": rnd(kv, std=0.1),
        p + "self_attn.v_proj.weight": rnd(kv, h),
        p + "self_attn.v_proj.bias": rnd(kv, std=0.1),
        p + "self_attn.o_proj.weight": rnd(h, q),
        p + "post_attention_layernorm.weight": gain(),
        p + "mlp.gate_proj.weight": rnd(i, h),
        p + "mlp.up_proj.weight": rnd(i, h),
        p + "mlp.down_proj.weight": rnd(h, i),
    }


def build_random(path: Path, cfg: dict, seed: int = 0, shards: int = 4) -> Path:
    """Write config.json + `shards` safetensors files + index, one layer at a time (low memory)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    n = cfg["num_hidden_layers"]
    # shard 0: what no layer owns (layer None: embedding, final norm, head); then the layers, round robin
    groups: list[list[int | None]] = [[None]]
    groups += ([i for i in range(k, n, shards)] for k in range(shards))
    weight_map: dict[str, str] = {}
    for k, layers in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for layer in layers:
            tensors.update(_tensors(cfg, layer, gen))
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))  # last: marks the cache complete
    return path


def qwen2_5_1_5b_shaped() -> Path:
    path = cache_dir() / "qwen2.5-1.5b-shaped-random"
    if not (path / "config.json").is_file():
        build_random(path, QWEN2_5_1_5B)
    return path
