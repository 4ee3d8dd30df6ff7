"""What the model reads its weights through: the WeightSource protocol every format implements
(weights/: safetensors directories, GGUF files), in HF naming and HF layout (out, in), fp32, only the
slices a party needs. Here, under the model, so the model's readers (architecture.py, dense.py) need
nothing from weights/: the formats import the protocol, not the other way round."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from .config import ModelConfig

if TYPE_CHECKING:
    import torch

# Input coordinates as half-open [start, stop) ranges, concatenated in order.
Ranges = Sequence[tuple[int, int]]


class WeightSource(Protocol):
    config: ModelConfig

    def has(self, name: str) -> bool: ...

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        """fp32 tensor `W[rows][:, cols]` (1-D tensors: `W[rows]`); None means all."""
        ...
