"""The sharded operators and a whole ShardedModel against the dense layer and transformers, in this
process: N workers as threads over the in-memory fabric (tests/inproc.py), no process started.

Both families (Qwen2 with its q/k/v bias, Llama), N = 1..4, even and uneven capacities, split KV
groups (Qwen2's 2 KV heads over N = 3, 4 workers: each split group's owners sum partial scores),
prefill, one-token decodes, and batched steps of several sessions (prefills beside decodes, slots
out of order and with a gap). What these replace and why they cover it: each test's docstring.
The engine, its wire and its processes keep their own tests (test_parity.py's process cases,
test_runtime.py, test_batching.py, test_faults.py, ...).
"""

from __future__ import annotations

import pytest
import torch
from inproc import Board, MemoryFabric, ShardedRun, dense_model, run_ranks
from test_parity import LOGIT_ATOL, NEW_TOKENS, PROMPT

from fusion_compute.comm import Comm
from fusion_compute.comm.errors import CommError
from fusion_compute.model import reference
from fusion_compute.structural.megatron import MegatronModel

# float64 sharded against the float64 dense twin: both normalise in float32 (kernels.rms_norm, and the
# fused norm's Σx² and rsqrt in ops.norm_linear_scatter, as transformers' RMSNorm does in any dtype), the
# dense one on the float32-rounded residual, the sharded one on the exact one (its norm is fused into
# the linear). Measured on these models, N = 1..4: max |diff| 3e-6 .. 7e-6 over logits up to ~8.
# 5e-5 sits 7x above that and 2000x below what a dropped eps (0.14 .. 0.31) or a wrong bias, RoPE pair
# or mask (> 1e-1) moves them.
DENSE64_ATOL = 5e-5

# (arch, N, capacities): every N of both families, and uneven shares (every reduce-scatter's split
# sizes differ between the workers), with and without split KV groups.
CASES = [
    ("qwen2", 1, None),
    ("qwen2", 2, None),
    ("qwen2", 3, None),
    ("qwen2", 4, None),
    ("qwen2", 3, (2.0, 1.0, 1.0)),
    ("qwen2", 4, (1.0, 3.0, 1.0, 2.0)),
    ("llama", 1, None),
    ("llama", 2, None),
    ("llama", 3, None),
    ("llama", 4, None),
    ("llama", 2, (2.0, 1.0)),
    ("llama", 3, (1.0, 1.0, 3.0)),
]


def case_id(arch, n, caps) -> str:
    return f"{arch}-N{n}{'-cap' if caps else ''}"


# The quick loop (-m "not slow") runs one case per family with every feature at once (split groups or
# not, uneven shares, N > 2); the others (~0.5 s each, 32 greedy steps the most of it) run in the suite.
QUICK = {("qwen2", 4, (1.0, 3.0, 1.0, 2.0)), ("llama", 3, (1.0, 1.0, 3.0))}
PARAMS = [pytest.param(*c, id=case_id(*c), marks=() if c in QUICK else pytest.mark.slow) for c in CASES]


@pytest.fixture(scope="module")
def models(tiny_qwen2, tiny_llama):
    return {"qwen2": tiny_qwen2, "llama": tiny_llama}


@pytest.fixture(scope="module")
def refs(models):
    """Per family: transformers' float64 logits of PROMPT and greedy continuation; the float64 dense
    twin's logits of PROMPT."""
    out = {}
    for arch, path in models.items():
        ref = reference.load_reference(path)
        tokens, gaps = reference.greedy_with_margins(ref, PROMPT, NEW_TOKENS)
        out[arch] = (reference.logits(ref, PROMPT), tokens, gaps, dense_model(path).forward(PROMPT, 0))
    return out


def describe(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.double() - b.double()).abs()
    return f"max |diff| {d.max().item():.3g}, mean {d.mean().item():.3g}"


def splits_groups(run: ShardedRun) -> bool:
    return any(len(owners) > 1 for owners in run.plan.group_owners)


@pytest.mark.parametrize("arch,n,caps", PARAMS)
def test_sharded_model_matches_dense_and_transformers(models, refs, arch, n, caps):
    """What test_parity.py's structural cases check of the arithmetic, without processes: prefill
    logits against transformers (float64) at LOGIT_ATOL, incremental decode (prefill 5, then one token
    at a time) equal to the full forward, 32 greedy tokens identical to transformers'. And, in float64,
    against the dense twin at DENSE64_ATOL."""
    ref_logits, ref_tokens, gaps, dense64 = refs[arch]
    run = ShardedRun(models[arch], n, caps, max_seq=128)
    if arch == "qwen2" and n >= 3:
        assert splits_groups(run)  # what these cases are for: partial scores summed among a group's owners

    full = run.forward(PROMPT)
    assert torch.allclose(full, ref_logits, atol=LOGIT_ATOL, rtol=0), describe(full, ref_logits)

    run.reset()
    inc = torch.cat([run.forward(PROMPT[:5])] + [run.forward([t]) for t in PROMPT[5:]])
    assert torch.allclose(inc, full, atol=LOGIT_ATOL, rtol=0), describe(inc, full)

    run.reset()
    tokens = run.greedy(PROMPT, NEW_TOKENS)
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), None)
    assert tokens == ref_tokens, f"first diverging token at {first} (reference top-2 gap there: {gaps[first]:.3g})"

    run64 = ShardedRun(models[arch], n, caps, dtype=torch.float64)
    got64 = run64.forward(PROMPT)
    assert torch.allclose(got64, dense64, atol=DENSE64_ATOL, rtol=0), describe(got64, dense64)


# The sessions of the batched steps (test_batching.py's), each followed by tokens 11, 12
BATCH_PROMPTS = [[5, 17, 33, 2, 99], [1, 2, 3], [7] * 9, [100, 101, 102, 103, 104, 105, 106]]
BATCH_CASES = [
    ("qwen2", 3, None),  # split KV groups: every session's partial scores completed in one exchange
    ("llama", 2, (2.0, 1.0)),  # uneven shares
    ("qwen2", 4, (1.0, 3.0, 1.0, 2.0)),  # both
    ("llama", 1, None),  # no collective at all
]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """test_batching.py's comparison: 1e-4 relative to the logits' scale (its docstring says why)."""
    return bool((a - b).abs().max() <= 1e-4 * b.abs().max())


@pytest.mark.parametrize("arch,n,caps", BATCH_CASES, ids=[case_id(*c) for c in BATCH_CASES])
def test_a_batch_step_equals_each_session_alone(models, arch, n, caps):
    """Mixed steps (a newcomer's prefill beside ongoing decodes, slots out of order and with a gap)
    give each session the logits it gets alone, and those equal transformers'.

    Replaces test_batching.py's test of the same name (two engines of worker processes, qwen2 N = 3
    and llama N = 2 at capacities 2:1): the same prompts, steps, slots, comparisons and negative
    control, on the same ShardedModel code, with the client's arithmetic done here (inproc.py). What
    it checked of the engine's own batching (spans of several slots in one ingress, each span's last
    column picked) stays checked over processes by test_batching.py's
    test_one_session_path_every_column_per_span_and_step_hooks and
    test_batched_generation_equals_alone_and_wipes_slots."""
    model = models[arch]
    run = ShardedRun(model, n, caps, slots=1)
    alone = []
    ref = reference.load_reference(model)
    for p in BATCH_PROMPTS:
        run.reset()
        alone.append(run.forward(p + [11, 12]))
        want = reference.logits(ref, p + [11, 12])
        assert torch.allclose(alone[-1], want, atol=LOGIT_ATOL, rtol=0), (p, describe(alone[-1], want))
    run.reset(slots=6)
    # step 1: sessions 0 and 1 prefill (slots 5 and 0); step 2: 0 and 1 decode, 2 prefills in slot 3;
    # step 3: all three decode, 3 prefills in slot 1
    step1 = [x[-1] for x in run.forward_batch([(5, BATCH_PROMPTS[0]), (0, BATCH_PROMPTS[1])])]
    step2 = [x[-1] for x in run.forward_batch([(3, BATCH_PROMPTS[2]), (5, [11]), (0, [11])])]
    step3 = [x[-1] for x in run.forward_batch([(0, [12]), (1, BATCH_PROMPTS[3]), (5, [12]), (3, [11])])]
    step4 = [x[-1] for x in run.forward_batch([(3, [12])])]
    checks = [
        (step1[0], alone[0][len(BATCH_PROMPTS[0]) - 1]),
        (step1[1], alone[1][len(BATCH_PROMPTS[1]) - 1]),
        (step2[0], alone[2][len(BATCH_PROMPTS[2]) - 1]),
        (step2[1], alone[0][-2]),
        (step2[2], alone[1][-2]),
        (step3[0], alone[1][-1]),
        (step3[1], alone[3][len(BATCH_PROMPTS[3]) - 1]),
        (step3[2], alone[0][-1]),
        (step3[3], alone[2][-2]),
        (step4[0], alone[2][-1]),
    ]
    for i, (a, b) in enumerate(checks):
        assert close(a, b), (i, (a - b).abs().max())
    # a negative control for the comparison itself: another session's logits are not "close"
    assert not close(step3[0], alone[0][-1])


@pytest.mark.parametrize("arch,n,caps", [("qwen2", 3, None), ("llama", 2, (2.0, 1.0))])
def test_a_rolled_back_slot_equals_a_fresh_session_and_its_neighbours_keep_theirs(models, arch, n, caps):
    """Speculation's rejection on the workers: a slot set back to an earlier position and given other
    tokens continues exactly as a session that never saw the rejected ones, what it held past there
    is zeroed on every worker (ShardedModel.roll_back), and another slot of the same steps is untouched."""
    run = ShardedRun(models[arch], n, caps, slots=3)
    a, b = BATCH_PROMPTS[0], BATCH_PROMPTS[3]
    want_a = run.forward(a + [11, 12], slot=0)
    run.reset()
    want_b = run.forward(b + [40, 41, 42], slot=2)
    run.reset()
    run.forward_batch([(2, b), (0, a)])
    run.forward_batch([(0, [60, 61, 62]), (2, [40])])  # slot 0: three tokens that will be rejected
    held = run.workers[0].lengths[0]
    assert held == len(a) + 3
    run.rewind(0, len(a))
    got_a, got_b = run.forward_batch([(0, [11, 12]), (2, [41, 42])])
    assert close(got_a, want_a[len(a) :]), describe(got_a, want_a[len(a) :])
    assert close(got_b, want_b[len(b) + 1 :]), describe(got_b, want_b[len(b) + 1 :])
    assert all(m.lengths[0] == len(a) + 2 for m in run.workers)
    # nothing of the rejected tokens stays: positions past the slot's length are zero on every worker
    for m in run.workers:
        for layer in m.layers:
            for cache in layer.caches:
                assert not cache.k[0, :, len(a) + 2 :].any() and not cache.v[0, :, len(a) + 2 :].any()
    # negative controls: before the rollback the rejected positions do hold keys (the zero check can
    # fail), and the same tokens without the rewind (after the rejected ones) give other logits
    run.reset()
    run.forward_batch([(2, b), (0, a)])
    run.forward_batch([(0, [60, 61, 62]), (2, [40])])
    assert run.workers[0].layers[0].caches[0].k[0, :, len(a) + 2].any()
    got_kept = run.forward_batch([(0, [11, 12])])[0]
    assert not close(got_kept, want_a[len(a) :])


@pytest.mark.parametrize("n", [2, 3])
def test_megatron_baseline_matches_the_dense_twin(models, refs, n):
    """The Megatron-style baseline (replicated residual, all-gather and all-reduces) runs the same
    decoder_layer over its own ops and gives the same logits."""
    run = ShardedRun(models["qwen2"], n, model_class=MegatronModel, dtype=torch.float64)
    got = run.forward(PROMPT)
    assert torch.allclose(got, refs["qwen2"][3], atol=DENSE64_ATOL, rtol=0), describe(got, refs["qwen2"][3])


def test_the_fabric_sums_in_rank_order_and_a_failing_rank_ends_the_others_waits():
    """The in-memory fabric's collectives (what every test above relies on), and its failure path: a
    rank that raises ends the others' waits (CommError) instead of leaving them blocked, and its own
    error is the one raised."""
    n, sizes = 3, [2, 1, 3]
    board = Board(n, score_groups=[(0, 2), (1,)])
    comms = [
        Comm(w + 1, n, {}, score_groups=[(0, 2), (1,)], fabric=MemoryFabric(board, w, [(0, 2), (1,)])) for w in range(n)
    ]
    sends = [torch.arange(6 * 2, dtype=torch.float64).view(6, 2) * (w + 1) for w in range(n)]

    def rank(w: int):
        def go():
            chunk = comms[w].reduce_scatter(sends[w], sizes, "t")
            total = comms[w].all_reduce_workers(torch.full((2,), float(w + 1)), "t")
            gathered = comms[w].all_gather_workers(torch.full((sizes[w], 1), float(w)), sizes, "t")
            scores = comms[w].sum_scores(torch.full((3,), float(w + 1)), 0, "t") if w in (0, 2) else None
            return chunk, total, gathered, scores

        return go

    out = run_ranks(board, [rank(w) for w in range(n)])
    full = sum(sends)
    for w, (chunk, total, gathered, scores) in enumerate(out):
        a = sum(sizes[:w])
        assert torch.equal(chunk, full[a : a + sizes[w]])
        assert torch.equal(total, torch.full((2,), 6.0))
        assert gathered.flatten().tolist() == [0.0, 0.0, 1.0, 2.0, 2.0, 2.0]
        assert scores is None if w == 1 else torch.equal(scores, torch.full((3,), 4.0))  # ranks 0 and 2 only

    def fails():
        raise ValueError("rank 2's own failure")

    def waits(w: int):
        return lambda: comms[w].reduce_scatter(sends[w], sizes, "t")

    board = Board(n)
    comms = [Comm(w + 1, n, {}, fabric=MemoryFabric(board, w)) for w in range(n)]
    with pytest.raises(ValueError, match="rank 2's own failure"):
        run_ranks(board, [waits(0), fails, waits(2)])
    with pytest.raises(CommError, match="another rank failed"):
        run_ranks(board, [waits(0), waits(1), waits(2)])  # the board stays broken: nobody waits forever
