"""The structural worker's step runner (structural/runner.py) without a client, a link or a process:
N runners as threads over the in-memory fabric (tests/inproc.py), fed the ingress the client would
send, their egress summed as the client sums it. The op loop that moves these bytes over the wire,
and the process shell around it, keep their tests with real workers (test_runtime.py,
test_frame_steps.py, test_worker_errors.py, test_inproc_executor.py)."""

from __future__ import annotations

import pytest
import torch
from inproc import ShardedRun, dense_model, run_ranks
from test_parity import PROMPT
from test_sharded_inproc import DENSE64_ATOL

from fusion_compute.comm import TaintedInputs
from fusion_compute.structural.client import ingress_qkv
from fusion_compute.structural.ops import Span
from fusion_compute.structural.runner import StepRunner


class Notes:
    """An audit recorder's face that writes down what the runner asks of it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args, **kw: self.calls.append((name, *args, *sorted(kw.items())))


def through_runners(run: ShardedRun, audits: list | None = None) -> list[StepRunner]:
    """`run`'s workers' steps made by a StepRunner each (begin, forward, end), not by the models."""
    runners = [StepRunner(m, run.plan, w, audits[w] if audits else None) for w, m in enumerate(run.workers)]

    def shards(x_HT: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
        ins = [x_HT[slice(*s.residual)].contiguous() for s in run.plan.workers]
        qkv = ingress_qkv(x_HT, run.qkv0, run.config.hidden, run.config.rms_eps)

        def step(w: int):
            def go() -> torch.Tensor:
                r = runners[w]
                assert (r.n_residual, r.n_qkv) == (ins[w].shape[0], qkv[w].shape[0])
                r.begin(spans)
                with torch.no_grad():
                    e_HT = r.forward(ins[w], qkv[w])
                r.end()
                return e_HT

            return go

        return run_ranks(run.board, [step(w) for w in range(run.plan.n)])

    run.shards = shards  # type: ignore[method-assign]  # the test utility's step, made by the runners
    return runners


def test_runners_give_the_dense_twins_logits_and_incremental_decode(tiny_qwen2):
    """Three runners (Qwen2's 2 KV heads over 3 workers: a split group) against the float64 dense
    twin, prefill then one token at a time."""
    run = ShardedRun(tiny_qwen2, 3, dtype=torch.float64, max_seq=64)
    through_runners(run)
    full = run.forward(PROMPT)
    dense = dense_model(tiny_qwen2).forward(PROMPT, 0)
    assert torch.allclose(full, dense, atol=DENSE64_ATOL, rtol=0), (full - dense).abs().max()
    run.reset()
    inc = torch.cat([run.forward(PROMPT[:5])] + [run.forward([t]) for t in PROMPT[5:]])
    assert torch.allclose(inc, full, atol=DENSE64_ATOL, rtol=0), (inc - full).abs().max()


def test_release_reset_wipe_and_their_records(tiny_qwen2):
    """RELEASE zeroes its slot only, measured (its record says so); a slot outside the cache is
    nothing; RESET makes a new cache and session; WIPE zeroes every shard. Each step is one record,
    opened before its ingress and closed after its egress."""
    run = ShardedRun(tiny_qwen2, 2, max_seq=32, slots=2)
    notes = [Notes(), Notes()]
    runners = through_runners(run, notes)
    run.forward_batch([(0, PROMPT[:4]), (1, PROMPT[:3])])
    r = runners[0]
    assert notes[0].calls == [("begin_step", 7, 0, ("spans", [[0, 0, 4], [1, 0, 3]])), ("end_step",)]
    assert r.model.kv_abs_max(0) > 0 and r.model.kv_abs_max(1) > 0
    r.release(1)
    assert r.model.kv_abs_max(1) == 0.0 and r.model.kv_abs_max(0) > 0
    r.release(5)  # no such slot: nothing happens, nothing is recorded
    assert notes[0].calls[-1] == ("release", 1, ("zeroed", True))
    r.reset(16, 3)
    assert (r.model.max_seq, r.model.n_slots) == (16, 3) and notes[0].calls[-1] == ("new_session",)
    runners[1].wipe()
    assert runners[1].model.kv_abs_max() == 0.0


def test_an_egress_that_the_client_would_refuse_is_not_returned(tiny_qwen2):
    """An infinity in the ingress reaches the egress: the runner refuses to hand it on
    (TaintedInputs: its inputs passed one by one, so it names nobody). The same step from finite
    inputs returns its egress (the control)."""
    run = ShardedRun(tiny_qwen2, 1, max_seq=16)
    (r,) = through_runners(run)
    plan = run.plan
    x = torch.randn(r.n_residual, 2)
    qkv = torch.randn(r.n_qkv, 2)
    r.begin([Span(0, 0, 2)])
    assert r.forward(x, qkv).shape == (plan.config.hidden, 2)
    r.reset(16, 1)
    x[0, 1] = float("inf")
    r.begin([Span(0, 0, 2)])
    with pytest.raises(TaintedInputs, match="worker 1's own egress holds"):
        r.forward(x, qkv)
