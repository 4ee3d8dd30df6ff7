"""RoPE scaling (linear, llama3) against transformers, not against itself.

RopeConfig.inv_freq reimplements transformers' rules; these tests compare it with transformers' own
`ROPE_INIT_FUNCTIONS` on the numbers of real configs (Llama 3.1's llama3 parameters, linear factors),
then run a tiny Llama 3.1-style model (rope_scaling set, read back from the config.json that
transformers writes) through the dense twin and the sharded model (in-process) against transformers' logits at
positions where the scaled pairs turn by radians, so a factor multiplied instead of divided or
llama3's smoothing weights swapped move the logits by far more than the parity tolerance."""

from __future__ import annotations

import math

import pytest
import torch
from test_parity import LOGIT_ATOL
from tiny_models import SEEDS, build

from fusion_compute.model import reference
from fusion_compute.model.config import ModelConfig, RopeConfig
from fusion_compute.model.dense import DenseModel
from fusion_compute.weights.loader import open_weights

# Llama 3.1's rope_scaling, as its config.json has it.
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# The tiny model's: theta 10^4 and original_max_position_embeddings 256 put its 8 pairs (head_dim 16,
# wavelengths 6 to 19,869 positions) in all three of llama3's bands: 3 kept (< 64), 1 smoothed
# (64..256: 199), 4 divided by the factor (> 256); so positions up to 96 turn every kind by radians.
TINY_LLAMA3 = {**LLAMA31, "original_max_position_embeddings": 256}
TINY_LINEAR = {"rope_type": "linear", "factor": 4.0}
TINY_THETA = 10_000.0
PROMPT_LEN = 96


def hf_inv_freq(theta: float, head_dim: int, scaling: dict | None) -> list[float]:
    """transformers' inverse frequencies for a Llama config with this rope_scaling."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling
    )
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":  # transformers 5 computes the default inside each model's rotary class
        return [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    assert attention_factor == 1.0  # linear and llama3 leave attention unscaled: nothing else to match
    return inv_freq.double().tolist()


@pytest.mark.parametrize(
    "theta,head_dim,scaling",
    [
        (500_000.0, 128, {**LLAMA31, "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
        (500_000.0, 64, {**LLAMA31, "factor": 32.0, "original_max_position_embeddings": 8192}),  # Llama 3.2 1B
        (TINY_THETA, 16, TINY_LLAMA3),
        (10_000.0, 128, {"rope_type": "linear", "factor": 2.0}),
        (TINY_THETA, 16, TINY_LINEAR),
        (TINY_THETA, 16, None),
    ],
    ids=["llama3.1-8b", "llama3.2-1b", "tiny-llama3", "linear-2", "tiny-linear", "default"],
)
def test_inv_freq_equals_transformers(theta, head_dim, scaling):
    want = hf_inv_freq(theta, head_dim, scaling)
    config = {"rope_theta": theta, **({"rope_scaling": scaling} if scaling else {})}
    got = RopeConfig.from_hf(config).inv_freq(head_dim)
    # transformers computes in float32 (its base frequencies are float32 powers): 1e-6 relative covers
    # that rounding; a wrong band or weight is off by a factor >= 1.1 (the smallest llama3 blend here).
    assert len(got) == len(want) == head_dim // 2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=1e-6), (i, g, w)
    if scaling and scaling["rope_type"] == "llama3":  # the case exercises every band, the smoothed one too
        base = RopeConfig(theta=theta).inv_freq(head_dim)
        ratios = [b / w for b, w in zip(base, want, strict=True)]
        assert min(ratios) == pytest.approx(1) and max(ratios) == pytest.approx(scaling["factor"])
        assert any(1.05 < r < scaling["factor"] / 1.05 for r in ratios)


@pytest.fixture(scope="module", params=["llama3", "linear"])
def scaled_llama(request, tmp_path_factory):
    scaling = TINY_LLAMA3 if request.param == "llama3" else TINY_LINEAR
    tiny = dict(seed=SEEDS["llama"], rope_theta=TINY_THETA)
    path = build(tmp_path_factory.mktemp(f"rope-{request.param}"), "llama", **tiny, rope_scaling=scaling)
    unscaled = build(tmp_path_factory.mktemp(f"rope-{request.param}-none"), "llama", **tiny)
    return request.param, path, unscaled


def prompt() -> list[int]:
    return torch.randint(1, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()


def test_dense_twin_equals_transformers_with_rope_scaling(scaled_llama):
    """The config.json transformers writes (rope_parameters) is read as the scaling it names, and the
    twin's logits over 96 positions equal transformers'; the same weights without scaling differ by
    far more than the tolerance (the scaled pairs matter at these positions)."""
    kind, path, unscaled = scaled_llama
    config = ModelConfig.from_hf_dir(path)
    assert config.rope.kind == kind and config.rope.theta == TINY_THETA
    ids = prompt()
    want = reference.logits(reference.load_reference(path), ids)
    got = DenseModel(open_weights(path), max_seq=PROMPT_LEN).forward(ids, 0).double()
    assert torch.allclose(got, want, atol=LOGIT_ATOL, rtol=0), (got - want).abs().max()
    plain = reference.logits(reference.load_reference(unscaled), ids)
    assert (plain - want).abs().max() > 100 * LOGIT_ATOL  # the check can fail: scaling moves these logits


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_model_equals_transformers_with_rope_scaling(scaled_llama, n):
    """The workers build their RoPE tables from the same config: the sharded model in-process
    (tests/inproc.py: workers as threads, each its own ShardedModel read from the model folder), at
    N = 2 (whole KV heads per worker) and 3 (Llama's 4 KV heads spread unevenly), against
    transformers' logits, prefill then decode, llama3 and linear scaling.

    Replaces the slow test_sharded_engine_equals_transformers_with_llama3_scaling (an engine of two
    worker processes at N = 2, llama3 only): the same prompt, split and comparison, on the same
    ShardedModel code and tables (ShardedModel.inv_freq, ops.make_step); what a process adds, the
    config read by another process from the same folder, is the loader's, the same code here."""
    from inproc import ShardedRun

    _, path, _ = scaled_llama
    ids = prompt()
    want = reference.logits(reference.load_reference(path), ids)
    run = ShardedRun(path, n, max_seq=PROMPT_LEN)
    head = run.forward(ids[:-8])
    tail = [run.forward([t]) for t in ids[-8:]]
    got = torch.cat([head, *tail])
    assert torch.allclose(got, want, atol=LOGIT_ATOL, rtol=0), (got - want).abs().max()
