"""On a CUDA GPU (scripts/gpu_check.sh runs these; skipped, with the reason, on a machine without one):
parity with HF transformers on the same GPU at N = 1, 2, 3, exact in float32 (greedy tokens identical,
logits within test_parity's tolerance of float64) and faithful in bfloat16 (tests/faithful.py);
workers sharing the one GPU over the links and over gloo; and every worker process holding GPU memory
(the flag is honoured, not ignored)."""

from __future__ import annotations

import pytest
import torch
from faithful import PROMPT, check_faithful, references

from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.model import reference
from fusion_compute.structural.client import Engine, EngineOptions

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs these)"),
]

LOGIT_ATOL = 1e-4  # test_parity.py's, for the same reason: fp32's own error is ~1e-6 on these models
NEW_TOKENS = 32
CASES = [(arch, n) for arch in ("qwen2", "llama") for n in (1, 2, 3)]


def gpu_engine(path, n: int, dtype: str, **kw) -> Engine:
    return Engine(path, EngineOptions(n_workers=n, device="cuda", dtype=dtype, timeout_s=60, context=128, **kw))


@pytest.fixture(scope="module")
def paths(tiny_qwen2, tiny_llama):
    return {"qwen2": tiny_qwen2, "llama": tiny_llama}


@pytest.mark.parametrize("arch,n", CASES, ids=[f"{a}-N{n}" for a, n in CASES])
def test_float32_exact_on_the_gpu(paths, arch, n):
    path = paths[arch]
    ref = reference.load_reference(path).to("cuda")  # float64 on the same GPU
    tokens, gaps = reference.greedy_with_margins(ref, PROMPT, NEW_TOKENS)
    hf32 = reference.greedy(reference.load_reference(path, torch.float32).to("cuda"), PROMPT, NEW_TOKENS)
    with gpu_engine(path, n, "float32") as eng:
        eng.reset()
        full = eng.forward(PROMPT, all_logits=True).double()
        assert torch.allclose(full, reference.logits(ref, PROMPT), atol=LOGIT_ATOL, rtol=0)
        res = generate(eng, PROMPT, max_new_tokens=NEW_TOKENS, sampling=SamplingParams())
        assert res.token_ids == tokens == hf32


@pytest.mark.parametrize("arch,n", CASES, ids=[f"{a}-N{n}" for a, n in CASES])
def test_bfloat16_faithful_on_the_gpu(paths, arch, n):
    refs = references(paths[arch], "bfloat16", "cuda")
    with gpu_engine(paths[arch], n, "bfloat16") as eng:
        check_faithful(eng, refs, "bfloat16", n)


@pytest.mark.parametrize("backend", ["tls", "gloo"])
def test_workers_share_the_gpu_and_hold_its_memory(paths, backend):
    """Two workers on the one GPU: each opens a CUDA context there (hundreds of MiB each, whoever
    counts: device-wide free memory, whatever process ids a container shows)."""
    refs = references(paths["qwen2"], "bfloat16", "cuda")
    kw = {"comm_backend": backend, "insecure": backend == "gloo"}
    free_before, _ = torch.cuda.mem_get_info()
    with gpu_engine(paths["qwen2"], 2, "bfloat16", **kw) as eng:
        check_faithful(eng, refs, "bfloat16", 2)
        free_during, _ = torch.cuda.mem_get_info()
        assert free_before - free_during >= 2 * 100 * 2**20, (free_before, free_during)
