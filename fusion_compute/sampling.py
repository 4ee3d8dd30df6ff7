"""Token sampling on the client: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UsageError


class SamplingError(UsageError, ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top-k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits_V: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits_V))
        logits = logits_V.float() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            # Drop tokens once the mass before them already reaches top_p (always keep the first).
            drop = (cum - torch.softmax(sorted_logits, -1)) >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.gen))
