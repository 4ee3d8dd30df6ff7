"""What a worker reads from the weights file after the boundary merges (issue 43 item 4): the client
computes layer 0's q/k/v, so no worker reads layer 0's q/k/v weights, bias or input norm, and the
load's count (runtime/progress.worker_elements, the progress bars' and start-up log's total) is the
elements the worker's slices actually read. The last layer's down is read whole in its rows: its
partial, full-width (H, T), is the worker's egress (ops.ShardedLayer.to_client).
"""

from __future__ import annotations

import pytest
import torch

from fusion_compute.model import architecture as arch
from fusion_compute.runtime.progress import worker_elements
from fusion_compute.structural.megatron import MegatronModel
from fusion_compute.structural.plan import Plan, make_plan
from fusion_compute.structural.sharded import ShardedModel
from fusion_compute.weights.loader import open_weights

LAYER0_QKV = {
    arch.layer_tensor(0, f"{part}.{kind}")
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj")
    for kind in ("weight", "bias")
} | {arch.layer_tensor(0, "input_layernorm.weight")}


class ReadLog:
    """A weight source that passes every read through and keeps (name, shape) of each."""

    def __init__(self, src) -> None:
        self._src = src
        self.config = src.config
        self.reads: list[tuple[str, tuple[int, ...]]] = []

    def has(self, name: str) -> bool:
        return self._src.has(name)

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor:
        t = self._src.read(name, rows=rows, cols=cols)
        self.reads.append((name, tuple(t.shape)))
        return t


def loaded(path, n: int, w: int, model_class: type[ShardedModel] = ShardedModel) -> tuple[ReadLog, ShardedModel, Plan]:
    """Worker w of N's model, built over a logging source (the comm is never used at load)."""
    src = ReadLog(open_weights(path))
    plan = make_plan(src.config, n)
    return src, model_class(src, plan, w, comm=None), plan  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_workers_never_read_layer0_qkv(tiny_qwen2, n):
    """Every worker of N (Qwen2: q/k/v with a bias; N = 3 splits its KV groups): no read of layer 0's
    q/k/v weight, bias or input norm; layer 1's are read (the log sees reads); layer 0's slice is empty;
    the matrices read add up to worker_elements exactly."""
    for w in range(n):
        src, model, plan = loaded(tiny_qwen2, n, w)
        names = {name for name, _ in src.reads}
        assert not names & LAYER0_QKV, sorted(names & LAYER0_QKV)
        assert arch.layer_tensor(1, "self_attn.q_proj.weight") in names
        assert arch.layer_tensor(1, "self_attn.q_proj.bias") in names
        assert model.layers[0].w.qkv_w.numel() == 0 and model.layers[0].w.qkv_b is None
        assert sum(torch.Size(s).numel() for _, s in src.reads if len(s) == 2) == worker_elements(plan, w)
        # the last layer's down is read for all H output rows: its full-width partial is the egress
        assert model.layers[-1].w.down_w.shape == (src.config.hidden, plan.workers[w].n_mlp)


def test_megatron_baseline_never_reads_layer0_qkv(tiny_llama):
    """The Megatron-style baseline takes the given q/k/v too: its layer 0 reads none of them either."""
    src, model, _ = loaded(tiny_llama, 2, 1, MegatronModel)
    assert not {name for name, _ in src.reads} & LAYER0_QKV
    assert model.layers[0].w.qkv_w.numel() == 0


def test_negative_control_a_load_that_reads_layer0_qkv_is_caught(tiny_qwen2, monkeypatch):
    """The checks above fail on the load before this change (layer 0's q/k/v read, then dropped): with
    the plan saying no linear is given, the log shows layer 0's q/k/v and the count passes the total."""
    monkeypatch.setattr(Plan, "given", staticmethod(lambda layer, name: False))
    src, model, plan = loaded(tiny_qwen2, 2, 0)
    assert {name for name, _ in src.reads} & LAYER0_QKV
    assert model.layers[0].w.qkv_w.numel() > 0
    monkeypatch.undo()
    assert sum(torch.Size(s).numel() for _, s in src.reads if len(s) == 2) > worker_elements(plan, 0)
