"""Tiny random models of every supported family (Llama, Mistral, Qwen2, Qwen3) saved as HF
directories (safetensors), built locally from transformers' own config classes.

A reference is only as good as its variety. At transformers' default init (std 0.02) these models'
greedy continuations were flat: token 99 forty-eight times on Qwen2, for every test prompt, so a
replay that dropped a token or a speculation that kept a rejected draft produced the same tokens and
passed. With std 0.2 (`initializer_range`) and the seeds below, every prompt the suite runs continues
with 13 to 24 distinct tokens in 24 (measured), the top-2 logit gap stays above 1.5e-3 over 48 tokens
(the dense twin's fp32 error against float64 measured ~1.5e-5 here), and n-gram drafts are both accepted and
rejected. `check_varied` asserts the first property in the fixtures (conftest.py), so a change that
makes a reference flat again fails loudly instead of quietly weakening every test built on it.

rms_norm_eps is 1e-3, not transformers' 1e-6: with 1e-6 a dropped or wrong eps moved the logits by
less than the parity tolerance's margin; at 1e-3 (embeddings of mean square ~0.04) it moves them by
~1e-1.
"""

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
    rms_norm_eps=1e-3,
    tie_word_embeddings=False,
    initializer_range=0.2,
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
    rms_norm_eps=1e-3,
    tie_word_embeddings=True,
    rope_theta=50000.0,
    initializer_range=0.2,
)
# Mistral: llama's shapes with GQA (2 KV heads, so N = 3, 4 split them) and a sliding window of 5,
# shorter than every prompt the family tests give it, so the window masks keys in prefill and decode.
MISTRAL_TINY = {**LLAMA_TINY, "num_key_value_heads": 2, "sliding_window": 5, "tie_word_embeddings": False}
# Qwen3: Qwen2's odd widths (72 / 100) and 2 KV groups of 3 heads, per-head q/k norms, tied head.
QWEN3_TINY = {**QWEN2_TINY, "tie_word_embeddings": True}
# Phi-3: fused q/k/v and gate/up in the checkpoint, GQA, LongRoPE with distinct short and long factors
# and L₀ = 16, so a prompt of 13 runs on the short set and its continuation crosses to the long one.
PHI3_TINY = {
    **{k: v for k, v in LLAMA_TINY.items() if k != "head_dim"},  # Phi-3 configs have none: H / heads
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "original_max_position_embeddings": 16,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.25, 1.5, 2.0, 1.1, 3.0, 1.0, 1.7],
        "long_factor": [2.0, 2.5, 4.0, 6.0, 3.0, 8.0, 5.0, 9.0],
    },
}
# Gemma 3 (text): Qwen2's odd widths and 2 KV groups, 4 layers of which the 3rd is global (the others
# local, window 5, shorter than the test prompts), the local and global RoPE bases apart, an attention
# scale query_pre_attn_scalar^-1/2 that is not head_dim^-1/2, tied head (Gemma's default). Init std
# 0.02, not 0.2: the embedding is scaled by √H and every block's output is normalized (post-norms), so
# at 0.2 the tied head reads back the input token (the same token 24 times); at 0.02, 8 distinct in 24.
GEMMA3_TINY = {
    **QWEN2_TINY,
    "initializer_range": 0.02,
    "num_hidden_layers": 4,
    "tie_word_embeddings": True,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 7,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    },
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
TINY = {
    "llama": LLAMA_TINY,
    "qwen2": QWEN2_TINY,
    "mistral": MISTRAL_TINY,
    "qwen3": QWEN3_TINY,
    "phi3": PHI3_TINY,
    "gemma3_text": GEMMA3_TINY,
}
SEEDS = {"qwen2": 3, "llama": 3}  # the fixtures' models (conftest.py); chosen by the sweep above
# Reduce-scatter calls per step of the tiny Qwen2 on its workers, at any N (the faults aimed at a step
# count them: `drag-rs@K`, `close-link@K`, ...): 4 per layer (QKV, O, gate/up, down) less layer 0's QKV
# and the last layer's down, which the client does (structural/plan.py's boundary).
STEP_RS = 4 * QWEN2_TINY["num_hidden_layers"] - 2

# Every prompt the suite's tests give the tiny models (each test file keeps its own copy, by name):
# check_varied asserts each one's reference continuation is varied. A new test prompt belongs here.
PROMPTS = (
    [5, 17, 33, 2, 99, 100, 7, 8],  # test_faults, test_membership, test_audit*, test_wire
    [5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11, 200, 3],  # test_parity, test_runtime
    [5, 17, 33, 2, 99, 100, 7, 8, 9, 10],  # test_exposure
    [237, 30, 118, 230, 237, 30, 118, 230],  # test_audit_speculative
    [5, 17, 33, 2, 99],  # test_admission, test_preauth, test_batching
    [5, 17, 33, 2],  # test_speculative (sampled)
    [1, 2, 3],  # test_batching
    [7] * 9,
    [100, 101, 102, 103, 104, 105, 106],
    [9, 8],
    [3, 4, 5, 6],
    [5, 17, 33, 2, 99, 5, 17, 33, 2, 99, 5, 17],  # test_speculative
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    [7, 8, 9, 7, 8, 60, 7, 8],
    [40, 41, 42, 40, 41],
    [9] * 6,
)
LLAMA_PROMPTS = ([69, 292, 33, 131, 69, 292, 33, 131],)  # test_speculative (the command line; ids past Qwen2's 256)
MIN_DISTINCT, OF = 8, 24  # at least 8 distinct tokens in the first 24 of every continuation


def classes(arch: str):
    """transformers' (config class, model class) of a family."""
    import transformers as tf

    if arch == "gemma3_text":  # transformers 5.24: Gemma3TextConfig, the text-only Gemma3ForCausalLM
        return tf.Gemma3TextConfig, tf.Gemma3ForCausalLM
    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "phi3": "Phi3"}[arch]
    return getattr(tf, f"{name}Config"), getattr(tf, f"{name}ForCausalLM")


def build(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A random `arch` model (TINY[arch] with `overrides`) saved under `path`."""
    config_class, model_class = classes(arch)
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY[arch], **overrides}))
    if arch == "qwen2":
        # HF initialises biases to zero; random biases make the bias-after-scatter rule testable.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    with torch.no_grad():  # non-trivial norm gains, so folding them into the weights is tested
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms multiply by 1 + w: the same gains 0.5..1.5
                p.uniform_(-0.5, 0.5) if arch == "gemma3_text" else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def check_varied(path: Path, prompts=PROMPTS) -> None:
    """transformers' greedy continuation of every prompt has at least MIN_DISTINCT distinct tokens in
    its first OF: a flat reference would let a test pass whatever the runtime replays or keeps."""
    from fusion_compute.model import reference

    ref = reference.load_reference(path)
    flat = {}
    for p in prompts:
        got = reference.greedy(ref, list(p), OF)
        if len(set(got)) < MIN_DISTINCT:
            flat[tuple(p)] = got
    assert not flat, f"{path}: flat reference continuations (fewer than {MIN_DISTINCT} distinct in {OF}): {flat}"
