"""The sampler at the edges of what SamplingParams accepts (issue 26): no value that passes the
check can make NaN, for any finite logits; non-finite logits are refused by name."""

from __future__ import annotations

import pytest
import torch

from fusion_compute.generation.sampling import NonFiniteLogits, Sampler
from fusion_compute.generation.sampling_params import SamplingParams

TINY = 5e-324  # the smallest positive double


def logits_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(320, generator=g) * 10
    huge = spread * 1e36  # finite float32, near its limit (3.4e38)
    flat = torch.zeros(320)  # every token equally likely
    spike = torch.full((320,), -3e38)
    spike[17] = 3e38
    return [spread, huge, flat, spike]


@pytest.mark.parametrize("temperature", [TINY, 1e-300, 1e-30, 0.01, 1.0, 100.0])
@pytest.mark.parametrize("top_p", [TINY, 1e-46, 1e-30, 0.5, 1.0])
@pytest.mark.parametrize("top_k", [0, 1, 5, 10**9])
def test_every_accepted_value_samples_a_valid_token(temperature, top_p, top_k):
    for logits in logits_cases():
        sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1))
        for _ in range(3):
            tok = sampler(logits)
            assert 0 <= tok < logits.numel()
            assert logits[tok] == logits.max() or (temperature >= 0.01 and top_p >= 0.5 and top_k != 1)


def test_underflowing_top_p_keeps_the_most_likely_token():
    """top_p 1e-46 (the red team's value): float32 rounded it to 0 and dropped every token ("probability
    tensor contains nan"); the top token's mass reaches it, so the nucleus is that token alone."""
    logits = logits_cases()[0]
    for top_p in (1e-46, TINY):
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=3))
        assert {sampler(logits) for _ in range(20)} == {int(torch.argmax(logits))}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_non_finite_logits_are_refused_not_sampled(bad, temperature):
    """Greedy used to return the NaN's index (or 0), sampling a torch error; now one named error."""
    logits = torch.zeros(320)
    logits[5] = bad
    with pytest.raises(NonFiniteLogits, match="1 NaN or infinite value"):
        Sampler(SamplingParams(temperature=temperature, seed=1))(logits)
