"""The weight-source protocol every model format implements (weights.py: safetensors directories and
the dispatcher; gguf.py: GGUF files): read only the slices a party needs, in HF naming and HF layout
(out, in), fp32."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .config import ModelConfig

# Input coordinates as half-open [start, stop) ranges, concatenated in order.
Ranges = Sequence[tuple[int, int]]


class WeightSource(Protocol):
    config: ModelConfig

    def has(self, name: str) -> bool: ...

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        """fp32 tensor `W[rows][:, cols]` (1-D tensors: `W[rows]`); None means all."""
        ...
