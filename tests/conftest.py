from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import forkserver  # noqa: E402
import procs  # noqa: E402
from tiny_models import build  # noqa: E402

from fusion_compute.runtime import launch  # noqa: E402

# Local workers start from a fork server that has imported torch once (tests/forkserver.py says what
# differs); a test that checks how a real worker process behaves asks for `real_workers`.
launch.use_launcher(forkserver.forked_worker)
_forks = tempfile.mkdtemp(prefix="fusion-test-forks-")  # who forked what (procs.children)
forkserver.use_registry(_forks)
atexit.register(shutil.rmtree, _forks, ignore_errors=True)
os.environ[procs.RUN_TAG] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # procs.worker_pids()


@pytest.fixture
def real_workers():
    """Workers this test's engines start are fresh `python -m fusion_compute worker` processes."""
    previous = launch.use_launcher(None)
    yield
    launch.use_launcher(previous)


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
