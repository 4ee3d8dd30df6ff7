"""The plan: every layout is a partition, every N from 1 to the model's maximum works, bad N fails."""

from __future__ import annotations

import json

import pytest

from fusion_compute.model.config import ModelConfig
from fusion_compute.structural.plan import PlanError, apportion, make_plan

SMOLLM = ModelConfig("llama", 576, 1536, 30, 9, 3, 64, 49152, 8192, 1e-5)
QWEN15B = ModelConfig("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, 32768, 1e-6, qkv_bias=True)
TINY = ModelConfig("qwen2", 72, 100, 3, 6, 2, 12, 256, 256, 1e-6, qkv_bias=True)


def assert_partition(index_lists: list[list[int]], total: int, what: str) -> None:
    flat = [i for idx in index_lists for i in idx]
    assert sorted(flat) == list(range(total)), f"{what}: not a partition of [0, {total})"
    assert all(idx for idx in index_lists), f"{what}: an empty shard"


def check(plan) -> None:
    c, n = plan.config, plan.n
    assert_partition([list(range(*s.residual)) for s in plan.workers], c.hidden, "residual")
    assert_partition([list(range(*s.mlp)) for s in plan.workers], c.intermediate, "mlp")
    qkv_total = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    assert_partition([plan.qkv_rows(w) for w in range(n)], qkv_total, "qkv")
    assert_partition([plan.o_cols(w) for w in range(n)], c.n_heads * c.head_dim, "o_proj input")
    assert_partition([plan.gate_up_rows(w) for w in range(n)], 2 * c.intermediate, "gate/up")
    half = c.head_dim // 2
    for _w, s in enumerate(plan.workers):
        for b in s.attention:
            dims = b.head_dims(c.head_dim)
            # RoPE pairs stay together: dim i is owned iff dim i + d/2 is.
            assert all((j + half in dims) for j in dims if j < half)
            assert b.split == (len(plan.group_owners[b.g0]) > 1)
        if n <= c.n_kv_heads:
            assert all(not b.split for b in s.attention), "N <= kv heads must give whole groups"
    if n >= 2:
        assert all(s.n_residual < c.hidden for s in plan.workers)


@pytest.mark.parametrize("config", [SMOLLM, QWEN15B, TINY], ids=["smollm", "qwen1.5b", "tiny"])
def test_every_n_is_a_partition(config):
    max_n = min(config.hidden, config.intermediate, config.n_kv_heads * config.head_dim // 2)
    ns = sorted(set(range(1, 9)) | {max_n - 1, max_n})
    for n in ns:
        check(make_plan(config, n))
    with pytest.raises(PlanError, match=f"at most {max_n}"):
        make_plan(config, max_n + 1)


def test_capacities_are_proportional_and_uneven_is_fine():
    plan = make_plan(SMOLLM, 3, (2, 1, 1))
    check(plan)
    assert [s.n_residual for s in plan.workers] == [288, 144, 144]
    assert [s.n_mlp for s in plan.workers] == [768, 384, 384]
    plan7 = make_plan(SMOLLM, 7)  # 576 and 1536 are not multiples of 7
    check(plan7)
    assert max(s.n_residual for s in plan7.workers) - min(s.n_residual for s in plan7.workers) <= 1


def test_split_groups_when_more_workers_than_kv_heads():
    plan = make_plan(QWEN15B, 4)  # 2 KV heads: each group split across 2 workers
    assert plan.group_owners == ((0, 1), (2, 3))
    assert all(b.split and b.dims == 64 for s in plan.workers for b in s.attention)


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_n(bad):
    with pytest.raises(PlanError):
        make_plan(SMOLLM, bad)


def test_bad_capacities():
    with pytest.raises(PlanError, match="capacities"):
        make_plan(SMOLLM, 2, (1, 0))
    with pytest.raises(PlanError, match="2 capacities given for 3"):
        make_plan(SMOLLM, 3, (1, 1))


def test_apportion_exact_and_min_one():
    assert apportion(10, (1, 1, 1), "x") == [4, 3, 3]
    assert apportion(5, (100, 1, 1), "x") == [3, 1, 1]
    with pytest.raises(PlanError, match="x 2 cannot be split into 3"):
        apportion(2, (1, 1, 1), "x")


def test_json_and_bytes_prediction():
    plan = make_plan(QWEN15B, 2)
    d = json.loads(plan.to_json())
    assert d["workers"] == 2 and len(d["shares"]) == 2
    # docs/design.md, "The operators": ≈ 4·(N−1)/N·(n_h·d + 2·n_kv·d + 2H + 2I) bytes (fp32) per token per layer per worker.
    c = QWEN15B
    approx = 4 * 0.5 * (c.n_heads * c.head_dim + 2 * c.n_kv_heads * c.head_dim + 2 * c.hidden + 2 * c.intermediate)
    for s in d["shares"]:
        # the formula is for an even split; the plan adds the 2 sum-of-squares scalars per token
        assert abs(s["bytes_sent_per_token_per_layer"] - approx) / approx < 0.05
    assert 1.2e6 < d["shares"][0]["bytes_sent_per_token"] < 1.4e6  # "about 1.3 MB per token per worker"


def test_one_worker_makes_no_collectives(tiny_qwen2):
    """At N = 1 nothing is scattered or summed across workers: the plan counts 0 collectives per layer
    and per forward (a forward's exchanges are the client's ingress and egress), and so does the lone
    worker's Comm over a decode step; at N = 2 the same model counts its 4 per layer, less the two the
    boundary merges (the control: the counter does count)."""
    from inproc import ShardedRun

    for config in (SMOLLM, QWEN15B, TINY):
        one = make_plan(config, 1)
        assert set(one.collectives_per_layer(0).values()) == {0}
        assert one.collectives_per_forward(0) == 0 and one.exchanges_per_forward(0) == 2
        assert make_plan(config, 2).collectives_per_layer(0)["reduce_scatter"] == 4
    assert make_plan(SMOLLM, 2).exchanges_per_forward(0) == 120
    for n in (1, 2):
        run = ShardedRun(tiny_qwen2, n)
        run.forward([1, 2, 3])
        before = [s["collectives"] for s in run.stats()]
        run.forward([4])
        counted = [s["collectives"] - b for s, b in zip(run.stats(), before, strict=True)]
        assert counted == [run.plan.collectives_per_forward(w) for w in range(n)], (n, counted)
        assert sum(counted) == (0 if n == 1 else 2 * (4 * run.config.n_layers - 2))
