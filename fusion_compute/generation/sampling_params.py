"""What a request asks of sampling (temperature, top-k, top-p, seed), checked. Free of torch, so the
command line refuses a bad value before it loads torch; sampling.py's `Sampler` draws the tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


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
