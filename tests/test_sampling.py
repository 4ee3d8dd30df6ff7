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


# ---- against transformers' logits warpers ----


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' sampling distribution: TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    (generate's order), then softmax; in float64 like ours."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.double()[None, :]
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    for w in warpers:
        scores = w(None, scores)
    return torch.softmax(scores[0], -1)


def assert_same_distribution(logits: torch.Tensor, ours: torch.Tensor, hf: torch.Tensor, case) -> None:
    """Token for token where a token's logit is its own; where logits tie, tied tokens are
    interchangeable (either sort may put either first at the top-p boundary), so the sorted
    probabilities must match and each tie class must carry the same mass."""
    assert (ours > 0).sum() == (hf > 0).sum(), (case, int((ours > 0).sum()), int((hf > 0).sum()))
    assert torch.allclose(ours.sort().values, hf.sort().values, rtol=1e-9, atol=1e-12), case
    _, inverse, counts = logits.unique(return_inverse=True, return_counts=True)
    alone = counts[inverse] == 1  # tokens whose logit no other token has
    assert torch.allclose(ours[alone], hf[alone], rtol=1e-9, atol=1e-12), case


def test_top_k_top_p_equal_transformers_warpers():
    """600 random logit vectors (sizes 2 to 400, scales 0.1 to 30, a third rounded to a coarse grid so
    that ties are common, at the k-th value and at the top-p boundary), random temperature, top-k
    and top-p: Sampler.probs equals transformers' warpers. Dropping the token whose mass crosses
    top-p, or the tokens tied with the k-th, fails it."""
    g = torch.Generator().manual_seed(37)
    for case in range(600):
        size = int(torch.randint(2, 400, (), generator=g))
        scale = 10 ** float(torch.empty(()).uniform_(-1, 1.5, generator=g))
        logits = torch.randn(size, generator=g, dtype=torch.float64) * scale
        if case % 3 == 0:
            logits = (logits * 2).round() / 2  # ties
        temperature = float(torch.empty(()).uniform_(0.2, 2.0, generator=g))
        top_k = int(torch.randint(0, size + 2, (), generator=g)) if case % 4 else 0
        top_p = float(torch.rand((), generator=g, dtype=torch.float64)) if case % 5 else 1.0
        top_p = max(top_p, 1e-3)
        ours = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)).probs(logits)
        hf = hf_probs(logits, temperature, top_k, top_p)
        assert_same_distribution(logits, ours, hf, (case, size, temperature, top_k, top_p))


@pytest.mark.parametrize(
    "probs,top_p,kept",
    [
        ([0.5, 0.3, 0.2], 0.6, 2),  # 0.5 before the second token < 0.6: it crosses the mass and stays
        ([0.5, 0.3, 0.2], 0.5, 1),  # the first token's mass reaches 0.5 exactly: it alone
        ([0.5, 0.3, 0.2], 0.81, 3),
        ([0.4, 0.3, 0.3], 0.5, 2),  # a tie at the boundary: one of the two 0.3 crosses, the other goes
        ([0.25, 0.25, 0.25, 0.25], 0.3, 2),
        ([0.9, 0.05, 0.05], 0.96, 3),
    ],
)
def test_top_p_keeps_the_token_that_crosses_the_mass(probs, top_p, kept):
    """Designed distributions (logits = log p, temperature 1): the nucleus is the smallest set whose
    mass reaches top_p, as transformers' TopPLogitsWarper keeps it."""
    logits = torch.tensor(probs, dtype=torch.float64).log()
    ours = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=0)).probs(logits)
    hf = hf_probs(logits, 1.0, 0, top_p)
    assert int((ours > 0).sum()) == kept == int((hf > 0).sum())
    assert_same_distribution(logits, ours, hf, (probs, top_p))
