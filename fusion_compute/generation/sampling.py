"""Token sampling on the client: greedy, temperature, top-k, top-p (nucleus), seeded.

Every value SamplingParams accepts samples without NaN, for any finite logits: the arithmetic is in
float64 with the largest logit shifted to 0 before dividing by the temperature (so that entry stays
0 and the softmax's sum is at least 1, down to the smallest positive temperature), and top-p always
keeps the most likely token (its mass reaches any top-p in (0, 1]; float32 would have rounded a
top-p under 1.4e-45 to 0 and dropped every token: issue 26). Logits holding NaN or infinity are
refused by name rather than turned into a token."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


class NonFiniteLogits(RuntimeError):
    """The model's output holds NaN or infinity: no token can honestly come of it."""


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits_V: torch.Tensor) -> int:
        if self.params.greedy:
            self.check(logits_V)
            return int(torch.argmax(logits_V))
        return int(torch.multinomial(self.probs(logits_V), 1, generator=self.gen))

    def check(self, logits_V: torch.Tensor) -> None:
        if not bool(torch.isfinite(logits_V).all()):
            bad = int((~torch.isfinite(logits_V)).sum())
            raise NonFiniteLogits(
                f"the logits hold {bad} NaN or infinite value(s) of {logits_V.numel()}: no token is drawn from them"
            )

    def probs(self, logits_V: torch.Tensor) -> torch.Tensor:
        """The distribution a sampled token is drawn from (temperature, top-k, top-p applied), float64:
        what speculative decoding's rejection rule compares a draft against (speculative.py)."""
        self.check(logits_V)
        p = self.params
        x = logits_V.double()
        logits = (x - x.max()) / p.temperature  # the top entry stays 0, the rest <= 0 (or -inf)
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            # Drop tokens once the mass before them already reaches top_p; the first always stays.
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False
            logits = logits.scatter(0, order[drop], float("-inf"))
        return torch.softmax(logits, -1)

    def uniform(self) -> float:
        """One draw from U[0, 1) off this session's generator (the rejection rule's coin)."""
        return float(torch.rand((), generator=self.gen, dtype=torch.float64))

    def draw(self, probs_V: torch.Tensor) -> int:
        """One token from a distribution (float64, summing to 1), off this session's generator."""
        return int(torch.multinomial(probs_V, 1, generator=self.gen))
