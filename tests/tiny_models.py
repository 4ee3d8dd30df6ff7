"""Tiny random Qwen2 / Llama models saved as HF directories (safetensors), built locally."""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes chosen to exercise uneven splits: hidden 72 and intermediate 100 divide by neither 3 nor 7;
# 2 KV heads so N = 3, 4 split groups by RoPE pairs (head_dim 16 -> 8 pairs per group).
QWEN2_TINY = dict(
    vocab_size=256,
    hidden_size=72,
    intermediate_size=100,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
LLAMA_TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=120,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=50000.0,
)


def build(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if arch == "qwen2":
        cfg = Qwen2Config(**{**QWEN2_TINY, **overrides})
        model = Qwen2ForCausalLM(cfg)
        # HF initialises biases to zero; random biases make the bias-after-scatter rule testable.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        cfg = LlamaConfig(**{**LLAMA_TINY, **overrides})
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm gains, so folding them into the weights is tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path
