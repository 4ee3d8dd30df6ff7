"""Both modes vs HF transformers in float64, on tiny random Qwen2 (with q/k/v bias) and Llama models.

Per engine: prefill logits vs the reference, incremental decode == full forward, and greedy tokens
identical for 32 new tokens. Structural through the real workers: Qwen2 at N = 3 by capacity (split KV
groups: score sums among owners over the links, uneven shares) and Llama at N = 2, on the links (the
workers threads of this process, tests/inproc.py) and on the MPI fabric (`--comm-backend mpi`, worker
processes); the sharded arithmetic at every N = 1..4 of both families, even and uneven, is
test_sharded_inproc.py's, in-process. Masked (members as threads): group sizes 1..3 each, with one mask
group (A+B) and with k = 2, 3 (A+B1+...+Bk).
"""

from __future__ import annotations

import pytest
import torch
from inproc import masked_threads, threads

from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.masked.client import MaskedEngine
from fusion_compute.model import reference
from fusion_compute.structural.client import Engine, EngineOptions

# The runtime's own fp32 error against float64: sums in another order (per-worker partials, then
# the reduce-scatter), the norm after the matmul, and in masked mode fixed-point ring products
# (~1e-8 relative). Measured on these 3-layer models (tests/tiny_models.py, logits up to ~8): max
# |diff| 7e-6 (Qwen2) and 1.3e-5 (Llama) structural at N = 3, 4e-6 and 9e-6 masked 2+2. 3e-4 sits
# 20x above that and far below what a real error does: a dropped RMSNorm eps moves these logits by
# 0.14 to 0.31 (the models' eps is 1e-3 for that reason), a wrong bias, RoPE pair or mask by > 1e-1.
LOGIT_ATOL = 3e-4
PROMPT = [5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11, 200, 3]
NEW_TOKENS = 32

# The structural cases at N = 1, 2, 4 (Qwen2) and 1, 3, 4 (Llama) run in-process now: their checks
# (the same three) are test_sharded_inproc.py::test_sharded_model_matches_dense_and_transformers, on the
# same ShardedModel; what the runtime adds (the client's engine, the wire) these two cases keep checking.
CASES = [
    ("structural", "qwen2", 3, (2.0, 1.0, 1.0)),
    ("structural", "llama", 2, None),
    ("masked", "qwen2", (1, 1), None),
    ("masked", "qwen2", (3, 2), None),
    ("masked", "llama", (2, 2), None),
    ("masked", "llama", (1, 3), None),
    ("masked", "qwen2", (2, 1, 2), None),  # k = 2 mask groups
    ("masked", "llama", (1, 1, 1, 1), None),  # k = 3
    ("structural-mpi", "qwen2", 3, None),  # the MPI fabric, split KV groups (score sums among owners)
    ("structural-mpi", "llama", 2, None),
]


def case_id(mode, arch, n, caps) -> str:
    size = "+".join(map(str, n)) if isinstance(n, tuple) else f"N{n}"
    return f"{mode}-{arch}-{size}{'-cap' if caps else ''}"


@pytest.fixture(scope="module")
def refs(tiny_qwen2, tiny_llama):
    out = {}
    for arch, path in (("qwen2", tiny_qwen2), ("llama", tiny_llama)):
        ref = reference.load_reference(path)
        tokens, gaps = reference.greedy_with_margins(ref, PROMPT, NEW_TOKENS)
        out[arch] = (path, reference.logits(ref, PROMPT), tokens, gaps)
    return out


def engine(mode: str, path, n, caps):
    """The job: its workers threads of this process (tests/inproc.py: the real workers over the real
    links), except on the MPI fabric, which runs between processes (mpi4py's own transport)."""
    if mode == "masked":
        return MaskedEngine(path, masked_threads(n_a=n[0], n_b=n[1:], timeout_s=60, context=128))
    if mode == "structural-mpi":
        return Engine(path, EngineOptions(n_workers=n, timeout_s=60, context=128, comm_backend="mpi"))
    return Engine(path, threads(n_workers=n, capacities=caps, timeout_s=60, context=128))


def describe(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.double() - b.double()).abs()
    return f"max |diff| {d.max().item():.3g}, mean {d.mean().item():.3g}"


# The structural cases on threads take about a second: the quick loop runs them (with the dense
# references, shared); the masked ones (more members, their ring products checked) and the MPI ones
# (processes) are slow.
PARAMS = [pytest.param(*c, id=case_id(*c), marks=[] if c[0] == "structural" else [pytest.mark.slow]) for c in CASES]


@pytest.mark.parametrize("mode,arch,n,caps", PARAMS)
def test_matches_transformers(refs, mode, arch, n, caps):
    path, ref_logits, ref_tokens, gaps = refs[arch]
    with engine(mode, path, n, caps) as eng:
        # 1. prefill logits, every position
        eng.reset()
        full = eng.forward(PROMPT, all_logits=True)
        assert torch.allclose(full.double(), ref_logits, atol=LOGIT_ATOL, rtol=0), describe(full, ref_logits)

        # 2. incremental decode (prefill 5, then one token at a time) == full forward
        eng.reset()
        steps = [eng.forward(PROMPT[:5], all_logits=True)] + [eng.forward([t], all_logits=True) for t in PROMPT[5:]]
        inc = torch.cat(steps)
        assert torch.allclose(inc, full, atol=LOGIT_ATOL, rtol=0), describe(inc, full)

        # 3. greedy generation
        res = generate(eng, PROMPT, max_new_tokens=NEW_TOKENS, sampling=SamplingParams())
        first = next((i for i, (a, b) in enumerate(zip(res.token_ids, ref_tokens, strict=False)) if a != b), None)
        assert res.token_ids == ref_tokens, (
            f"first diverging token at {first} (reference top-2 gap there: {gaps[first]:.3g})"
        )
        assert res.steps == NEW_TOKENS
        if mode == "masked":
            # The mask groups worked ahead: every decode step found its masks' products ready, and
            # the client's traffic is what the plan predicts (8-byte ring elements, nothing to a mask
            # group but control words). Every product was checked, none failed.
            cost, per = eng.costs[-1], eng.plan.bytes_per_token()
            assert cost["to_A"] == per["client_to_A"] + 32 * n[0]  # + one control word per member
            assert cost["from_A"] == per["A_to_client"] and cost["from_B"] == per["B_to_client"]
            assert cost["to_B"] == 32 * sum(n[1:])
            linears = 4 * eng.config.n_layers
            assert eng.verifier.failures == 0
            assert eng.verifier.checks == linears * (2 * len(PROMPT) + len(PROMPT) + NEW_TOKENS - 1)
