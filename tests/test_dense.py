"""The dense twin equals transformers in float64 (no processes): loaders and the clear layer's math."""

from __future__ import annotations

import pytest
import torch

from fusion_compute.model import reference
from fusion_compute.model.dense import DenseModel
from fusion_compute.weights.loader import open_weights

# Against float64 the twin's fp32 error on these 3-layer models measured 5e-6 (IDS; 2e-5 on a
# 13-token prompt; logits up to ~8); 3e-4 is 15x the larger, and 450x below what a dropped RMSNorm
# eps does here (0.14); a wrong bias, RoPE pair or mask moves logits by > 1e-1.
LOGIT_ATOL = 3e-4
# 30 layers on real weights, logits up to ~31: the twin's fp32 error measured 7.8e-4 (transformers'
# own fp32 forward: 4.8e-4). 1e-2 is 13x that; a wrong dequantised block or an unpermuted Q/K head
# moves logits by O(1).
SMOLLM_ATOL = 1e-2
IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def check(path):
    ref = reference.logits(reference.load_reference(path), IDS)
    model = DenseModel(open_weights(path))
    full = model.forward(IDS, 0)
    assert torch.allclose(full.double(), ref, atol=LOGIT_ATOL, rtol=0), (full.double() - ref).abs().max()
    step = torch.cat([model.forward(IDS[:4], 0)] + [model.forward([t], 4 + i) for i, t in enumerate(IDS[4:])])
    assert torch.allclose(step, full, atol=LOGIT_ATOL, rtol=0), (step - full).abs().max()


def test_dense_qwen2(tiny_qwen2):
    check(tiny_qwen2)


def test_dense_llama(tiny_llama):
    check(tiny_llama)


@pytest.mark.slow
def test_dense_smollm_gguf(smollm_path, smollm_ref):
    """GGUF loading (Q4_1 dequantisation, Q/K un-permutation) end to end, in one process."""
    ref = reference.logits(smollm_ref, IDS)
    got = DenseModel(open_weights(smollm_path), max_seq=16).forward(IDS, 0).double()
    assert torch.allclose(got, ref, atol=SMOLLM_ATOL, rtol=0), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_stored_lm_head_wins_over_a_tied_config(tmp_path):
    """tie_word_embeddings = true with a different lm_head.weight in the file anyway: transformers 5.24
    does not tie them (it says so and uses the stored head), and every consumer must do the same through
    architecture.py's one rule. The copies had drifted: the client tied on the config's word, the dense
    twin only when the tensor was missing; this test fails on the client's old rule."""
    from safetensors.torch import load_file, save_file
    from tiny_models import build

    from fusion_compute.model import architecture as arch

    path = build(tmp_path / "tied", "llama")  # LLAMA_TINY ties its embeddings
    weights = load_file(path / "model.safetensors")
    assert arch.LM_HEAD not in weights
    weights[arch.LM_HEAD] = torch.randn_like(weights[arch.EMBED])  # a head that differs from the embedding
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    src = open_weights(path)
    assert src.config.tie_embeddings and not arch.lm_head_tied(src)
    check(path)  # the twin against transformers: logits off by O(10) if it ties instead
