from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

# Several pytest processes (xdist) share the machine's cores with the workers they start. torch's
# default, an OpenMP thread per core in every process, then oversubscribes the cores, and OpenMP's
# waiting threads spin on them. Set before anything imports torch: it reaches this process, the fork
# server (tests/forkserver.py) and every process a test starts. The workers set the thread count the
# client gives them (--threads, runtime/engine_options.py's default_threads), which this variable caps:
# a job of one worker would otherwise take every core the suite shares, and its OpenMP threads wait on
# each other at every operator (SmolLM2's 20 greedy tokens at N = 1, load average 3-13: 9.6-27.7 s
# with 2 threads, 1.7 s with 1). The README's hosts (test_wire.py) inherit it too. Measured on the 2-core
# machine, the SmolLM2 tests (-n 2, interleaved): 126-137 s and 227-248 busy core-s without it,
# 103-105 s and 179-181 core-s with it.
_processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _processes > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _processes)))
assert "torch" not in sys.modules, "conftest must set the thread count before torch is imported"

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

import forkserver  # noqa: E402
import procs  # noqa: E402

# tiny_models (torch) is imported by the fixtures that build a model, not here: pytest-xdist's
# controller imports this file and runs no test, and it starts its pytest processes only after
# (importing this file took 1.2 s of CPU with torch, 0.13 s without: load ~6, the 2-core machine).

# Local workers start from a fork server that has imported torch once (tests/forkserver.py says what
# differs); a test that checks how a real worker process behaves asks for `real_workers`.
forkserver.fork_workers()
_forks = tempfile.mkdtemp(prefix="fusion-test-forks-")  # who forked what (procs.children)
forkserver.use_registry(_forks)
atexit.register(shutil.rmtree, _forks, ignore_errors=True)
os.environ[procs.RUN_TAG] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # procs.worker_pids()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Let pytest keep the test modules it rewrote (assertion rewriting) in tests/__pycache__ while it
    collects, where PYTHONDONTWRITEBYTECODE is set, as on this project's machines: otherwise every
    pytest process parses and rewrites every test module again, ~2 s of CPU in each (the quick loop's
    pytest processes; measured on the 2-core machine at load average ~5: `--collect-only` 6.1 s of user
    CPU without the cached files, 4.0-4.2 s with them). Only while collecting: the fork server and what the tests start
    keep the setting they were given. pytest writes each file atomically (a temporary file renamed),
    so two xdist processes may write the same one; scripts/test.sh compiles the package itself."""
    previous, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = previous


@pytest.fixture(autouse=True)
def _package_logging_reset():
    """A command run in this process (cli.main.main) configures the package's logger (cli/logs.py):
    put it back after each test, so that no later test inherits its handler or level."""
    yield
    import logging

    log = logging.getLogger("fusion_compute")
    log.handlers.clear()
    log.setLevel(logging.NOTSET)
    log.propagate = True


@pytest.fixture
def real_workers():
    """Workers this test's engines start are fresh `python -m fusion_compute worker` processes."""
    previous, forkserver.default_spawn[0] = forkserver.default_spawn[0], None
    yield
    forkserver.default_spawn[0] = previous


def checked_varied(config: pytest.Config, arch: str, path: Path, prompts) -> None:
    """tiny_models.check_varied(path, prompts), unless the same check passed in an earlier run: pytest's
    cache (.pytest_cache) keeps the digest of what decides its verdict, the model's files byte for
    byte, the prompts, the check's code (tiny_models.py, the package's model/reference.py) and the
    torch and transformers versions. Greedy decoding on the CPU is deterministic, so the same digest
    means the same continuations; any change to one of them checks again. Every pytest process waits
    for it (transformers' greedy decoding over every prompt): 0.4-0.5 s of CPU per tiny model with one
    torch thread, as each of the suite's processes has (OMP_NUM_THREADS above), and 4-7 s with torch's
    default two threads in one pytest process (-n 0) on the loaded 2-core machine, where the 11-14 s
    once written here were measured. Without the cache plugin (`-p no:cacheprovider`) it always runs."""
    import hashlib

    import torch
    import transformers
    from tiny_models import check_varied

    from fusion_compute.model import reference

    digest = hashlib.sha256(repr((prompts, torch.__version__, transformers.__version__)).encode())
    for f in [*sorted(path.iterdir()), Path(__file__).with_name("tiny_models.py"), Path(reference.__file__)]:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    key, cache = f"fusion/varied/{arch}", getattr(config, "cache", None)
    if cache is not None and cache.get(key, None) == digest.hexdigest():
        return
    check_varied(path, prompts)
    if cache is not None:
        cache.set(key, digest.hexdigest())


def shared_tiny(config: pytest.Config, tmp_path_factory, arch: str, prompts) -> Path:
    """The fixture's tiny `arch` model (tiny_models.build, its seed SEEDS[arch]), built and checked
    once per run: every test prompt's reference varies (tiny_models.check_varied says why; a check
    that passed before on the same files is not run again: checked_varied). The check runs
    transformers' greedy decoding over every prompt (~3-30 s of CPU, by load), and each
    pytest process (xdist) needs the model: the first one to ask builds and checks it in the run's
    shared temporary folder, the others wait for it and use that folder. (The same seed and config
    give the same weights in every process: the folder is what each would have built.)"""
    import fcntl

    from tiny_models import SEEDS, build

    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing to share
        path = build(tmp_path_factory.mktemp(arch), arch, seed=SEEDS[arch])
        checked_varied(config, arch, path, prompts)
        return path
    shared = tmp_path_factory.getbasetemp().parent / f"tiny-{arch}"  # this run's, for every process
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = shared / "model"
        if not (shared / "checked").exists():
            shutil.rmtree(path, ignore_errors=True)  # a process that failed midway: build afresh
            build(path, arch, seed=SEEDS[arch])
            checked_varied(config, arch, path, prompts)
            (shared / "checked").touch()
        return path


@pytest.fixture(scope="session")
def tiny_qwen2(pytestconfig, tmp_path_factory) -> Path:
    from tiny_models import PROMPTS

    return shared_tiny(pytestconfig, tmp_path_factory, "qwen2", PROMPTS)


@pytest.fixture(scope="session")
def tiny_llama(pytestconfig, tmp_path_factory) -> Path:
    from tiny_models import LLAMA_PROMPTS, PROMPTS

    return shared_tiny(pytestconfig, tmp_path_factory, "llama", PROMPTS + LLAMA_PROMPTS)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from fusion_compute.weights.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_reference(smollm_path, tmp_path_factory):
    """A loader of transformers' SmolLM2 in float64 (model/reference.py): the model is loaded on the
    first call, once per pytest process, and never where no call comes. smollm_greedy.greedy takes it,
    so a process whose greedy references were all computed by another one (its shared store) loads
    nothing (~3 s of CPU each).

    transformers' GGUF path costs ~20 s of CPU, most of it parsing the file's metadata, and each
    pytest process (xdist) that calls this needs the model. The first one to ask loads it so and leaves
    its weights in the run's shared temporary folder with its config, as float32 (exact: asserted, they
    are dequantized from 4-bit blocks with float16 scales); the others load that folder (~3 s). Weights
    and logits are bit-identical either way (checked when this was written)."""
    import functools

    return functools.cache(lambda: _load_smollm_reference(smollm_path, tmp_path_factory))


@pytest.fixture(scope="session")
def smollm_ref(smollm_reference):
    """transformers' SmolLM2 in float64, loaded now (smollm_reference): for tests that read its logits."""
    return smollm_reference()


def _load_smollm_reference(smollm_path, tmp_path_factory):
    import fcntl

    import torch
    from safetensors.torch import save_file

    from fusion_compute.model.reference import load_reference

    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing to share
        return load_reference(smollm_path)
    shared = tmp_path_factory.getbasetemp().parent / "smollm-reference"  # this run's, for every process
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (shared / "model.safetensors").exists():
            return load_reference(shared)  # an HF folder now: from_pretrained, float64
        ref = load_reference(smollm_path)
        exact = ref.state_dict()
        weights = {k: v.float() for k, v in exact.items()}
        assert all(torch.equal(weights[k].double(), v) for k, v in exact.items()), "not float32-exact"
        ref.config.save_pretrained(shared)
        save_file(weights, shared / "model.safetensors.part")
        (shared / "model.safetensors.part").rename(shared / "model.safetensors")
        return ref
