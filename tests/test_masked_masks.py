"""The mask stream: shared by client and B, fresh per element and per step, uniform; and the
detectors the audit uses, which must fail on a reused or missing mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion_compute.masked import audit, masks, ring


def test_client_and_b_draw_the_same_masks_from_the_key():
    key = masks.new_key()
    client, b = masks.MaskStream(key, guard=True), masks.MaskStream(key, guard=False)
    assert torch.equal(client.draw(3, 7, 2, 1000), b.draw(3, 7, 2, 1000))
    assert torch.equal(b.draw(3, 7, 2, 10), b.draw(3, 7, 2, 1000)[:10])  # B may recompute; a prefix is a prefix
    other = masks.MaskStream(masks.new_key(), guard=False)
    assert not torch.equal(other.draw(3, 7, 2, 1000), b.draw(3, 7, 2, 1000))  # a new session, new masks


def test_labels_are_independent_streams():
    s = masks.MaskStream(masks.new_key(), guard=False)
    draws = [s.draw(step, layer, op, 4096) for step in (0, 1) for layer in (0, 1) for op in (0, 3)]
    words = torch.cat(draws)
    assert words.unique().numel() == words.numel()  # no repeated 64-bit word anywhere (2^-40 odds)
    for i in range(len(draws)):
        for j in range(i):
            frac, _ = audit.close_fraction(draws[i].numpy(), draws[j].numpy())
            assert frac < 0.02  # 2^-7 ≈ 0.008 expected for independent uniform words


def test_client_stream_refuses_to_reuse_a_label():
    s = masks.MaskStream(masks.new_key(), guard=True)
    s.draw(0, 0, 0, 8)
    s.draw(1, 0, 0, 8)
    with pytest.raises(masks.MaskReuseError):
        s.draw(0, 0, 0, 8)
    with pytest.raises(ValueError):
        masks.label(1 << 40, 0, 0)


def test_stream_output_is_uniform():
    words = masks.MaskStream(masks.new_key(), guard=False).draw(0, 0, 0, 1 << 18).numpy()
    u = audit.uniformity(words)
    assert u["ok"], u
    assert abs(u["bit_frequency_min"] - 0.5) < 0.01 and abs(u["bit_frequency_max"] - 0.5) < 0.01


def _encoded_inputs(n_steps: int, k: int = 256) -> list[torch.Tensor]:
    """Realistic clear inputs: the same token's normalized embedding at every step (the worst case:
    identical x_fx each step, so a reused mask gives identical messages)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(k, 1, generator=gen)
    return [ring.encode(x, 2.0**31)[0] for _ in range(n_steps)]


def test_freshness_detector_passes_fresh_masks_and_fails_reused_ones():
    key = masks.new_key()
    xs = _encoded_inputs(6)
    s = masks.MaskStream(key, guard=True)
    fresh = [("L0.qkv", (x + s.draw(step, 0, 0, x.numel()).view_as(x)).numpy()) for step, x in enumerate(xs)]
    report = audit.freshness(fresh)
    assert report["within"]["ok"] and report["across_steps"]["ok"], report

    # Per-step reuse: the step left out of the label (every step gets step 0's pad).
    s = masks.MaskStream(key, guard=False)
    reused = [("L0.qkv", (x + s.draw(0, 0, 0, x.numel()).view_as(x)).numpy()) for x in xs]
    assert not audit.freshness(reused)["across_steps"]["ok"]

    # Per-element reuse: one pad word for the whole vector.
    s = masks.MaskStream(key, guard=False)
    scalar = [("L0.qkv", (x + s.draw(step, 0, 0, 1)).numpy()) for step, x in enumerate(xs)]
    assert not audit.freshness(scalar)["within"]["ok"]


def test_uniformity_fails_without_masks():
    words = np.concatenate([x.numpy().ravel() for x in _encoded_inputs(200)])
    assert not audit.uniformity(words)["ok"]
