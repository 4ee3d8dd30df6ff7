"""bfloat16 and float16 on the CPU: faithful to HF transformers in the same dtype on the same device
(tests/faithful.py states the criterion and its reason; tests/test_gpu.py runs it on a GPU), on the
tiny random Qwen2 (q/k/v bias) and Llama models, N = 1, 2, 3 (N = 3 splits Qwen2's KV groups by
RoPE pairs: score sums among owners), in-process (tests/inproc.py), and one case through the real
workers and links (threads of this process, tests/inproc.py's `threads`: the wire in bfloat16).
float32 stays exact: test_parity.py."""

from __future__ import annotations

import pytest
import torch
from faithful import check_faithful, references
from inproc import threads
from tiny_models import build

from fusion_compute.structural.client import Engine

pytestmark = pytest.mark.slow  # the references (HF in each dtype) cost seconds; one case starts workers

CASES = [(arch, n, "bfloat16") for arch in ("qwen2", "llama") for n in (1, 2, 3)] + [("qwen2", 2, "float16")]
# Over worker processes: the engine's client in the dtype and the wire's bytes per element (Engine.stats).
# The other cases are the sharded arithmetic's, in-process (test_faithful_in_process below).
PROCESS_CASES = [("qwen2", 2, "bfloat16")]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    # transformers' default init (std 0.02, eps 1e-6), not tiny_models' wider one (std 0.2): the bound
    # grows with the logits' norm (2u‖z‖), and the wider init's logits are ~10x larger, so too few of
    # HF's top-2 margins exceed it for (C) to say anything. The variety tiny_models asserts matters for
    # greedy continuations; here the logits are compared at every position of the reference's ids.
    paths = {
        arch: build(tmp_path_factory.mktemp(arch), arch, seed=seed, initializer_range=0.02, rms_norm_eps=1e-6)
        for arch, seed in (("qwen2", 0), ("llama", 1))
    }
    return {(a, d): (paths[a], references(paths[a], d)) for a, d in {(a, d) for a, _, d in CASES}}


@pytest.mark.parametrize("arch,n,dtype", PROCESS_CASES, ids=[f"{a}-N{n}-{d}" for a, n, d in PROCESS_CASES])
def test_faithful_to_transformers(refs, arch, n, dtype):
    path, ref = refs[arch, dtype]
    with Engine(path, threads(n_workers=n, dtype=dtype, timeout_s=60, context=64)) as eng:
        check_faithful(eng, ref, dtype, n)


@pytest.mark.parametrize("arch,n,dtype", CASES, ids=[f"{a}-N{n}-{d}" for a, n, d in CASES])
def test_faithful_in_process(refs, arch, n, dtype):
    """The same criterion (faithful.py) on the sharded model in-process (tests/inproc.py): its
    numbers are those of a job over links (each owner sums its partials in a float32 accumulator in
    rank order, in the dtype on either transport), the bytes per element at N = 2 counted by the
    same Comm counters Engine.stats reads from the workers, the greedy continuation one token per step.
    Replaces the process cases other than PROCESS_CASES (an engine of worker processes each), which
    checked the same things."""
    from inproc import ShardedRun

    path, ref = refs[arch, dtype]
    run = ShardedRun(path, n, dtype=getattr(torch, dtype))
    check_faithful(run, ref, dtype, n, greedy=run.greedy)
