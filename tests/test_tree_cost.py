"""Tree size from cost (issue 43 item 3, generation/tree_cost.py): synthetic links and trees, no
processes. A high-latency link grows the tree, a low-bandwidth link or slow compute shrinks it, a
7B-class model's ~76 KB per column stops it at a given rate; the size chosen is the brute-force best
and a tree's expected accepted length is its greedy walk's, computed another way."""

from __future__ import annotations

import itertools

import pytest

from fusion_compute.generation import speculative as S
from fusion_compute.generation.tree_cost import LinkCost, best_size, bytes_per_column, expected_accepted, path_gains

# A tree best first, as the suffix drafter lists it: two branches at the root, the likelier one deep.
PARENTS = [-1, -1, 0, 2, 1, 3, 4, 5, 6, 7, 8, 9]
ACCEPT = [0.7, 0.25, 0.9, 0.9, 0.6, 0.85, 0.5, 0.8, 0.8, 0.7, 0.7, 0.7]
SMOL_X = 122  # SmolLM2, N = 2: 4 x 30 layers + ingress + egress
SMOL_ROW = 576 * 4 * 30  # a hidden row, fp32, once per layer on the critical path (the smallest message)
B7_ROW = 76_000 * 32  # a 7B-class model's gate/up message per column, once per layer (32 layers)


def link(rtt_ms: float, mbit_s: float, row: float = SMOL_ROW, compute_ms: float = 0.05, x: int = SMOL_X) -> LinkCost:
    return LinkCost(rtt_ms / 1e3, x, row, mbit_s * 1e6 / 8, compute_ms / 1e3, compute_base_s=0.005)


def size(c: LinkCost) -> int:
    return best_size(path_gains(PARENTS, ACCEPT), c.base_s, c.per_column_s)


def test_expected_accepted_is_the_greedy_walks():
    """Σ over nodes of the path's product equals the walk's expectation computed recursively (at a
    node, child c is the target's choice with probability q(c), siblings excluding each other)."""

    def walk(node: int) -> float:
        return sum(ACCEPT[c] * (1 + walk(c)) for c, p in enumerate(PARENTS) if p == node)

    assert expected_accepted(PARENTS, ACCEPT) == pytest.approx(walk(-1))
    assert path_gains([-1, 0, 1], [0.5, 0.5, 0.5]) == [0.5, 0.25, 0.125]  # a chain: rate^j


def test_best_size_is_the_brute_force_argmax():
    gains = path_gains(PARENTS, ACCEPT)
    for c in (link(21, 1000), link(0.1, 1000), link(5, 10), link(0.1, 1000, compute_ms=20), link(21, 100, B7_ROW)):

        def rate(n: int, c: LinkCost = c) -> float:
            return (1 + sum(gains[:n])) / c.seconds(1 + n)

        n = size(c)
        assert rate(n) == max(rate(m) for m in range(len(gains) + 1)), (c, [rate(m) for m in range(len(gains) + 1)])


def test_a_high_latency_link_grows_the_tree():
    sizes = [size(link(rtt, 1000)) for rtt in (0.0, 0.1, 1, 5, 21)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] == len(PARENTS), sizes


def test_low_bandwidth_or_slow_compute_shrinks_it():
    fast = size(link(5, 1000))
    assert fast == len(PARENTS)
    sizes = [size(link(5, mbit)) for mbit in (1000, 100, 10, 1)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < fast, sizes
    slow = [size(link(5, 1000, compute_ms=ms)) for ms in (0.05, 1, 5, 50)]
    assert slow == sorted(slow, reverse=True) and slow[-1] < fast, slow


def test_a_7b_models_columns_stop_the_tree_at_a_given_rate():
    """76 KB per column per layer: at 21 ms a round trip and 1 Gbit/s a column costs 19.5 ms, and a
    32-column draft accepted at 0.8 per node stops where its next node's gain no longer pays for
    that; SmolLM2's rows on the same link and the 7B model's on a 10x faster link go deeper, on a 10x
    slower one less deep."""
    gains = [0.8**j for j in range(1, 33)]
    c7 = link(21, 1000, B7_ROW, x=130)
    assert c7.per_column_s == pytest.approx(B7_ROW / 125e6 + 50e-6)
    n = best_size(gains, c7.base_s, c7.per_column_s)
    assert 0 < n < len(gains), n
    tokens = 1 + sum(gains[:n])
    assert gains[n] * c7.seconds(1 + n) < c7.per_column_s * tokens  # the next node costs more than it adds
    smol, fast, slow = (link(21, 1000, SMOL_ROW), link(21, 10_000, B7_ROW, x=130), link(21, 100, B7_ROW, x=130))
    sizes = [best_size(gains, c.base_s, c.per_column_s) for c in (smol, fast, c7, slow)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, sizes  # 30, 25, 15, 7 today


def test_step_cost_takes_a_links_model_and_a_trees_gains():
    """StepCost with a link allocates by the link's costs and a tree's per-node gains: one session
    gets best_size's answer; without gains a chain's rate^j is used."""
    gains = path_gains(PARENTS, ACCEPT)
    for c in (link(21, 1000), link(0.1, 1000, compute_ms=5), link(21, 1000, B7_ROW, x=130)):
        cost = S.StepCost(link=c)
        assert cost.allocate([len(gains)], [0.5], gains=[gains]) == [best_size(gains, c.base_s, c.per_column_s)]
        chain = [0.5**j for j in range(1, 9)]
        assert cost.allocate([8], [0.5]) == [best_size(chain, c.base_s, c.per_column_s)]
    assert S.StepCost().allocate([4], [0.5], gains=[[0.1] * 4]) == [4]  # unfitted, no link: the cap


def test_bytes_per_column_from_the_counters():
    assert bytes_per_column([100, 200], [100 + 3 * 2300, 200 + 3 * 2000], 3) == 2300  # the busiest worker
    with pytest.raises(ValueError):
        bytes_per_column([0], [1], 0)
    with pytest.raises(ValueError):
        LinkCost(0.001, 10, 100, 0, 0)


def test_sizes_grow_monotonically_with_latency_for_random_trees():
    """Over every small tree shape (parents before children) and two acceptance levels, raising the
    round trip never shrinks the size chosen."""
    for parents in itertools.product(*[range(-1, i) for i in range(4)]):
        for q in (0.3, 0.8):
            gains = path_gains(list(parents), [q] * 4)
            sizes = [best_size(gains, link(r, 1000, compute_ms=1).base_s, 1e-3) for r in (0, 0.1, 1, 10)]
            assert sizes == sorted(sizes), (parents, q, sizes)


def test_link_flags_build_the_plans_link_and_add_the_measured_compute():
    """--link-rtt-ms/--link-mbps (SpeculativeConfig) become a LinkCost from the engine's plan: its
    exchanges per forward and the busiest worker's bytes per column; once the steps are fitted, the
    fit is the compute and the link's round trips and bytes are added to it. A plan without those
    counts (the masked mode's) and a config without a link leave the cost fitted."""
    from fusion_compute.generation.speculative_config import SpeculativeConfig
    from fusion_compute.model.config import ModelConfig
    from fusion_compute.structural.plan import make_plan

    cfg = ModelConfig(
        arch="llama",
        vocab=300,
        hidden=64,
        intermediate=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        max_positions=256,
        rms_eps=1e-6,
    )
    plan = make_plan(cfg, 2)
    sp = S.Speculator(SpeculativeConfig("suffix", 32, link_rtt_ms=20.0, link_mbps=80.0), 300, 256)
    sp.bind(plan)
    c = sp.cost.link
    assert c is not None and c.exchanges == plan.exchanges_per_forward(0) and c.round_trip_s == 0.02
    assert c.bytes_per_column == max(plan.bytes_sent_per_token(w) for w in range(2)) and c.link_bytes_per_s == 1e7
    assert sp.cost.costs() == (c.base_s, c.per_column_s, 0.0)  # unfitted: the link alone
    for w in range(2, 12):  # steps of 2..11 columns, 10 ms + 1 ms a column: the workers' compute here
        sp.cost.observe(w, 1, 0.010 + 0.001 * w)
    base, per_column, _ = sp.cost.costs()
    assert base == pytest.approx(c.exchanges * 0.02 + 0.010, rel=1e-6)
    assert per_column == pytest.approx(c.bytes_per_column / 1e7 + 0.001, rel=1e-6)
    plain = S.Speculator(SpeculativeConfig("suffix", 32), 300, 256)
    plain.bind(plan)
    masked = S.Speculator(SpeculativeConfig("suffix", 32, link_rtt_ms=20.0, link_mbps=80.0), 300, 256)
    masked.bind(object())
    assert plain.cost.link is None and masked.cost.link is None
