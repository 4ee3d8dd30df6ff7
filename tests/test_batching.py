"""Continuous batching (issue 13): several sessions in one sharded step, each in its own KV slot.

Every session must get what it gets alone: the same logits (up to float32 summation order: a
linear over 8 columns may run another BLAS kernel than over one, and a batch's decodes attend over
padded, masked keys — so logits are compared at 1e-4 relative to their scale, far below the gap
between a greedy choice and its runner-up that the token checks rely on) and the same tokens. Slots
are zeroed when their session ends; a lost worker mid-batch costs one replay of every open slot. Batching is the client's logic over the
protocol: the jobs' workers are threads of this process (tests/inproc.py), but for the lost worker,
a process killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from inproc import masked_threads, threads

from fusion_compute.bench.ops import kv_probe
from fusion_compute.generation.batching import BatchRunner, Sequence, run_batch
from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.structural.client import Engine, EngineOptions

PROMPTS = [[5, 17, 33, 2, 99], [1, 2, 3], [7] * 9, [100, 101, 102, 103, 104, 105, 106], [9, 8], [3, 4, 5, 6]]
GREEDY = SamplingParams()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-4 * b.abs().max())  # see the module docstring


def logits_alone(eng, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt followed by tokens 11, 12, run as a session of its own: every position's logits."""
    alone = []
    for p in prompts:
        eng.reset()
        alone.append(eng.forward(p + [11, 12], all_logits=True))
    return alone


# Mixed steps of several sessions, each equal to the session alone and to transformers: on the
# operators in-process, test_sharded_inproc.py::test_a_batch_step_equals_each_session_alone.


def test_batched_generation_equals_alone_and_wipes_slots(tiny_llama):
    """run_batch with more sessions than slots (newcomers join as others finish, budgets differ),
    seeded sampling: every session's tokens are its tokens alone; every slot is zero afterwards."""
    sampled = [SamplingParams(temperature=0.9, top_k=40, seed=100 + i) for i in range(len(PROMPTS))]
    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=64)) as eng:
        alone = [
            generate(eng, p, max_new_tokens=12 - i, sampling=s).token_ids
            for i, (p, s) in enumerate(zip(PROMPTS, sampled, strict=True))
        ]
        seqs = [Sequence(p, 12 - i, s) for i, (p, s) in enumerate(zip(PROMPTS, sampled, strict=True))]
        results = run_batch(eng, seqs, 4)
        assert [r.token_ids for r in results] == alone
        assert len({tuple(t) for t in alone}) > 1  # the sessions differ: mixing them up would show
        assert all(r.finish_reason == "length" and r.steps == len(r.token_ids) for r in results)
        assert kv_probe(eng) == [0.0, 0.0]  # released slots are zeroed at once
        assert eng.slot_history == {}


def test_batch_limits(tiny_llama):
    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=16)) as eng:
        runner = BatchRunner(eng, 2)
        runner.add(Sequence([1, 2, 3], 4, GREEDY))
        runner.add(Sequence([4, 5], 4, GREEDY))
        with pytest.raises(ValueError, match="full"):
            runner.add(Sequence([6], 4, GREEDY))
        with pytest.raises(ValueError, match="slot 2 outside"):
            eng.forward_batch([(2, [1])])
        with pytest.raises(ValueError, match="distinct slots"):
            eng.forward_batch([(0, [1]), (0, [2])])
        from fusion_compute.errors import InputError

        runner.abort()
        with pytest.raises(InputError, match="context window"):
            runner.add(Sequence(list(range(1, 17)), 4, GREEDY))
        with pytest.raises(ValueError, match="max batch"):
            BatchRunner(eng, 0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["structural", "masked"])
def test_a_lost_worker_mid_batch_replays_every_slot(tiny_llama, mode):
    """SIGKILL a worker (masked: group A's, 1+1 with a standby per group) after the 4th step of a
    batch of three: a standby takes its seat, every open slot is replayed in one batched prefill (the
    masked mode: on a fresh mask session), and every session's tokens equal the no-fault run."""
    from fusion_compute.masked.client import MaskedEngine, MaskedOptions

    prompts = PROMPTS[:3]
    common = dict(timeout_s=60, context=64, liveness_s=5.0, log=lambda line: None)
    # The run without the fault on threads (tests/inproc.py); the SIGKILL needs worker processes.
    if mode == "masked":

        def engine(options=MaskedOptions, **kw):
            return MaskedEngine(tiny_llama, options(n_a=1, n_b=1, **common, **kw))
    else:

        def engine(options=EngineOptions, **kw):
            return Engine(tiny_llama, options(n_workers=2, **common, **kw))

    with engine(masked_threads if mode == "masked" else threads) as eng:
        want = [r.token_ids for r in run_batch(eng, [Sequence(p, 10, GREEDY) for p in prompts], 3)]
    with engine(standby=1) as eng:
        victim = eng.procs.pids[0]  # rank 1 (masked: group A)
        seen = []

        def on_token(_tok: int) -> None:
            seen.append(1)
            if len(seen) == 4:
                os.kill(victim, signal.SIGKILL)

        seqs = [Sequence(p, 10, GREEDY, on_token=on_token if i == 0 else None) for i, p in enumerate(prompts)]
        results = run_batch(eng, seqs, 3)
        assert [r.token_ids for r in results] == want
        assert len(eng.recoveries) == 1 and eng.recoveries[0]["replayed_tokens"] > sum(map(len, prompts))
        if mode == "structural":
            assert all(r.recoveries == eng.recoveries for r in results)
        else:
            assert eng.session == 1  # sessions 0, then 1 for the replay: fresh keys, not the old stream


def test_masked_batch_step_equals_each_session_alone(tiny_qwen2, tmp_path):
    """The masked mode (groups 2+1): mixed steps (a prefill beside decodes, slots out of order) give
    each session the logits it gets alone; every product of the batch is checked, A's view passes
    the masked audit, and the mask groups see keys only. The workers never learn the sessions: a
    step is one wider masked product per linear."""
    from fusion_compute.masked import audit
    from fusion_compute.masked.client import MaskedEngine

    d = tmp_path / "audit"
    with MaskedEngine(tiny_qwen2, masked_threads(n_a=2, n_b=1, timeout_s=60, context=64, audit_dir=str(d))) as eng:
        alone = logits_alone(eng, PROMPTS[:3])
        eng.batch_slots = 4
        eng.reset()
        step1 = eng.forward_batch([(3, PROMPTS[0]), (0, PROMPTS[1])])
        step2 = eng.forward_batch([(0, [11]), (1, PROMPTS[2]), (3, [11])])
        step3 = eng.forward_batch([(3, [12]), (1, [11]), (0, [12])])
        checks = [
            (step1[0], alone[0][len(PROMPTS[0]) - 1]),
            (step1[1], alone[1][len(PROMPTS[1]) - 1]),
            (step2[0], alone[1][-2]),
            (step2[1], alone[2][len(PROMPTS[2]) - 1]),
            (step2[2], alone[0][-2]),
            (step3[0], alone[0][-1]),
            (step3[1], alone[2][-2]),
            (step3[2], alone[1][-1]),
        ]
        for i, (a, b) in enumerate(checks):
            assert close(a, b), (i, (a - b).abs().max())
        assert not close(step3[0], alone[1][-1])  # the comparison can fail: another session's logits
        eng.release(3)
        assert eng.kv_abs_max(3) == 0.0 and eng.kv_abs_max(0) > 0  # only the released slot is wiped
        with pytest.raises(ValueError, match="slot 4 outside"):
            eng.forward_batch([(4, [1])])
        layers = eng.config.n_layers
    report = audit.verify(d)
    assert report["ok"], report["violations"]
    checked = report["verification"]["products_checked"]
    assert report["verification"]["failed"] == 0 and checked == 6 * layers * 4  # 6 steps, 4 linears a layer
    assert set(report["parties"]["rank3"]["received"]) == {"control@0", "key@0"}  # the mask group: keys only


def test_masked_batched_generation_equals_alone_and_wipes_slots(tiny_llama):
    """run_batch on the masked mode (1+1+1: two mask groups) with more sessions than slots and seeded
    sampling: every session's tokens are its tokens alone; the client's caches are zero afterwards."""
    from fusion_compute.masked.client import MaskedEngine

    sampled = [SamplingParams(temperature=0.9, top_k=40, seed=200 + i) for i in range(4)]
    with MaskedEngine(tiny_llama, masked_threads(n_a=1, n_b=(1, 1), timeout_s=60, context=64)) as eng:
        alone = [
            generate(eng, p, max_new_tokens=8 - i, sampling=s).token_ids
            for i, (p, s) in enumerate(zip(PROMPTS, sampled, strict=False))
        ]
        seqs = [Sequence(p, 8 - i, s) for i, (p, s) in enumerate(zip(PROMPTS, sampled, strict=False))]
        results = run_batch(eng, seqs, 3)
        assert [r.token_ids for r in results] == alone
        assert len({tuple(t) for t in alone}) > 1
        assert eng.kv_abs_max() == 0.0 and eng.slot_history == {}


def test_one_session_path_every_column_per_span_and_step_hooks(tiny_llama):
    """A single session is slot 0 of the batch path: every column's logits is a per-span option of a
    mixed step (the others get their last token's), and generate() is the batching loop with one
    sequence, whose hooks see every step's spans and the slot's release."""
    from fusion_compute.generation.batching import StepHooks

    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=64)) as eng:
        alone = logits_alone(eng, PROMPTS[:2])
        eng.batch_slots = 2
        eng.reset()
        full, last = eng.forward_batch([(1, PROMPTS[0] + [11, 12]), (0, PROMPTS[1] + [11, 12])], all_logits={1})
        assert full.shape == alone[0].shape and last.shape == alone[1][-1].shape
        assert close(full, alone[0]) and close(last, alone[1][-1])
        eng.reset()
        assert torch.equal(eng.forward(PROMPTS[1] + [11, 12], all_logits=True), alone[1])  # slot 0, every column
        assert eng.history == PROMPTS[1] + [11, 12] == eng.slot_history[0]
        seen: list = []
        res = generate(
            eng,
            PROMPTS[0],
            max_new_tokens=4,
            sampling=GREEDY,
            hooks=StepHooks(seen.append, lambda: seen.append("end"), lambda s: seen.append(("rel", s))),
        )
        n = len(PROMPTS[0])
        assert seen == [[(0, 0, n)], "end"] + [x for i in range(3) for x in ([(0, n + i, 1)], "end")] + [("rel", 0)]
        assert res.steps == 4 and len(res.token_ids) == 4
        assert eng.slot_history == {} and kv_probe(eng) == [0.0, 0.0]  # released at the end: zeroed
