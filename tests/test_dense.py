"""The dense twin equals transformers (no processes): loaders and operator math in isolation."""

from __future__ import annotations

import torch

from fusion_compute import reference
from fusion_compute.dense import DenseModel
from fusion_compute.weights import open_weights

# Same fp32 reassociation argument as tests/test_runtime.py; here only the norm/matmul order differs.
LOGIT_ATOL = 1e-4
IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def check(path):
    ref = reference.logits(reference.load_reference(path), IDS)
    model = DenseModel(open_weights(path))
    full = model.forward(IDS, 0)
    assert torch.allclose(full, ref, atol=LOGIT_ATOL, rtol=0), (full - ref).abs().max()
    step = torch.cat([model.forward(IDS[:4], 0)] + [model.forward([t], 4 + i) for i, t in enumerate(IDS[4:])])
    assert torch.allclose(step, full, atol=LOGIT_ATOL, rtol=0), (step - full).abs().max()


def test_dense_qwen2(tiny_qwen2):
    check(tiny_qwen2)


def test_dense_llama(tiny_llama):
    check(tiny_llama)


def test_dense_smollm_gguf(smollm_path, smollm_ref):
    """GGUF loading (Q4_1 dequantisation, Q/K un-permutation) end to end, in one process."""
    ref = reference.logits(smollm_ref, IDS)
    got = DenseModel(open_weights(smollm_path), max_seq=16).forward(IDS, 0)
    # 30 layers of fp32 reassociation on real weights with logits ~±30: a few 1e-4 at most.
    assert torch.allclose(got, ref, atol=1e-3, rtol=0), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
