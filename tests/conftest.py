from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build  # noqa: E402


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from fusion_compute.weights.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_ref(smollm_path):
    from fusion_compute.model.reference import load_reference

    return load_reference(smollm_path)
