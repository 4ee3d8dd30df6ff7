"""Verified products (masked/verify.py): the client's check of every product it unmasks.

Unit level, on the real weights of a tiny model and the client's own encoding: honest products
never fail (over >10^4 token checks), and every kind of corruption fails every trial — including
errors the ring hides from a check done modulo 2^64 (multiples of 2^63). Engine level: a member that
lies (`--inject-fault lie-*@STEP`, test-only) is caught at that step, named, removed and replaced by
a standby; the request fails before any token comes from the bad product, the next one is exact;
the masked audit records the detection. Wrong shape: a one-line error and recovery by replay.
"""

from __future__ import annotations

import pytest
import torch

from fusion_compute.masked import audit, ring
from fusion_compute.masked.client import MaskedEngine, MaskedOptions
from fusion_compute.masked.plan import make_masked_plan
from fusion_compute.masked.verify import ProductCheck, ProductRejected
from fusion_compute.runtime.membership import TooFewWorkers
from fusion_compute.weights.loader import open_weights

IDS = [1, 5, 9, 200, 3, 77, 12]


def product_check(path) -> ProductCheck:
    """The client's product check for the model at `path` (one member per group), its precomputation done."""
    src = open_weights(path)
    chk = ProductCheck(make_masked_plan(src.config, 1, (1,), ring.DEFAULT_LIMB_BITS), src)
    chk.wait()
    return chk


@pytest.fixture(scope="module")
def checker(tiny_qwen2):
    return product_check(tiny_qwen2)


def honest_product(chk: ProductCheck, layer: int, op: int, t: int, gen: torch.Generator):
    """The client's encoding of a random input, and the exact product the workers' ring gives."""
    s = chk.plan.shapes[op]
    w_fx = chk.weights(layer, op, (0, s.rows))
    x = torch.randn(s.k, t, generator=gen, dtype=torch.float64) * 3
    x_fx, _ = ring.encode(x, float(w_fx.norm(dim=1).max()))
    y = ring.RingMatrix(w_fx, chk.plan.limb_bits).matmul(x_fx)
    return x_fx, y


def test_honest_products_never_fail(checker):
    gen = torch.Generator().manual_seed(1)
    before = checker.checks
    for _ in range(4):
        for layer in range(checker.plan.config.n_layers):
            for op in range(len(checker.plan.shapes)):
                x_fx, y = honest_product(checker, layer, op, 256, gen)
                assert checker.check(layer, op, y, x_fx), (layer, op)
    assert checker.checks - before >= 10_000 and checker.failures == 0


def _corrupt(kind: str, y: torch.Tensor, stale: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    y = y.clone()
    i = int(torch.randint(0, y.shape[0], (1,), generator=gen))
    j = int(torch.randint(0, y.shape[1], (1,), generator=gen))
    if kind == "zeros":
        return torch.zeros_like(y)
    if kind == "stale":  # another input's product, same shape
        return stale.clone()
    if kind == "row-swap":
        k = (i + 1) % y.shape[0]
        y[[i, k]] = y[[k, i]]
        return y
    delta = {"+1": 1, "-1": -1, "+2^40": 1 << 40, "+2^61": 1 << 61, "+2^63 (wraps)": -(1 << 63)}[kind]
    y[i, j] = y[i, j] + delta  # int64 wrap-around: the ring's own arithmetic
    return y


KINDS = ["+1", "-1", "+2^40", "+2^61", "+2^63 (wraps)", "zeros", "stale", "row-swap"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_corruption_is_caught_in_every_trial(checker, kind):
    """+2^63 is the error a check modulo 2^64 would miss half the time; the integer check does not."""
    gen = torch.Generator().manual_seed(hash(kind) & 0xFFFF)
    trials = 0
    for trial in range(40):
        layer, op = trial % checker.plan.config.n_layers, trial % len(checker.plan.shapes)
        x_fx, y = honest_product(checker, layer, op, 3, gen)
        _, other = honest_product(checker, layer, op, 3, gen)
        bad = _corrupt(kind, y, other, gen)
        if torch.equal(bad, y):
            continue  # a row swap of equal rows: nothing changed
        assert not checker.check(layer, op, bad, x_fx), (kind, trial)
        trials += 1
    assert trials >= 35


def _opts(**kw) -> MaskedOptions:
    base = {"n_a": 1, "n_b": (1, 1), "timeout_s": 60, "context": 64, "liveness_s": 2}
    return MaskedOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def clean(tiny_qwen2):
    with MaskedEngine(tiny_qwen2, _opts()) as eng:
        eng.reset()
        logits = eng.forward(IDS, all_logits=True)
        assert eng.verifier.checks > 0 and eng.verifier.failures == 0
        return logits


# (kind, the rank that lies): ranks of 1+1+1 are A=1, B1=2, B2=3
LIARS = [("lie-one", 1, "A"), ("lie-bias", 2, "B1"), ("lie-stale", 3, "B2"), ("lie-zeros", 1, "A")]


@pytest.mark.slow
@pytest.mark.parametrize("kind,rank,group", LIARS)
def test_a_lying_member_is_caught_named_and_replaced(tiny_qwen2, tmp_path, clean, kind, rank, group):
    d = tmp_path / "audit"
    opts = _opts(standby=1, audit_dir=str(d))
    opts.args_for_worker = {rank: ["--inject-fault", f"{kind}@3"]}  # its third forward
    with MaskedEngine(tiny_qwen2, opts) as eng:
        eng.reset()
        eng.forward(IDS)
        eng.forward([7])
        with pytest.raises(ProductRejected) as ei:
            eng.forward([8])
        e = ei.value
        assert e.pids == [rank] and [(g, r) for g, _, r in e.blamed] == [(group, rank)], (e.blamed, e.pids)
        assert f"group {group}" in str(e) and "\n" not in str(e)
        states = {w["id"]: (w["group"], w["state"]) for w in eng.workers()}
        assert states[rank][1] == "removed", states
        assert eng.epoch == 1 and rank not in eng.order and len(eng.order) == 3
        assert eng.recoveries[-1]["lost"] == [rank] and "wrong product" in eng.recoveries[-1]["reason"]
        eng.reset()  # the next request: exact, without the liar
        assert torch.equal(eng.forward(IDS, all_logits=True), clean)
    report = audit.verify(d)
    assert report["ok"], report["violations"]
    v = report["verification"]
    assert v["on"] and v["failed"] == 1 and v["products_checked"] > 0
    (det,) = v["detections"]
    assert [(b["group"], b["rank"]) for b in det["blamed"]] == [(group, rank)]
    assert len(report["epochs"]) == 2


@pytest.mark.slow
def test_a_liar_without_a_standby_leaves_the_job_waiting_for_one(tiny_qwen2, clean):
    opts = _opts()
    opts.args_for_worker = {2: ["--inject-fault", "lie-bias@2"]}
    with MaskedEngine(tiny_qwen2, opts) as eng:
        eng.reset()
        eng.forward(IDS)
        with pytest.raises(TooFewWorkers) as ei:  # B1's only member lied: no epoch without it
            eng.forward([7])
        assert "group B1" in str(ei.value) and "\n" not in str(ei.value)
        with pytest.raises(TooFewWorkers):  # still no replacement: refused again, nothing runs
            eng.reset()
            eng.forward(IDS)
        eng.add_standby(group="B1")
        eng.reset()
        assert torch.equal(eng.forward(IDS, all_logits=True), clean)
        assert 2 not in eng.order


@pytest.mark.slow
def test_a_wrong_shape_is_a_one_line_error_and_the_step_recovers(tiny_qwen2, clean):
    opts = _opts(standby=1)
    opts.args_for_worker = {1: ["--inject-fault", "lie-shape@1"]}
    logs = []
    opts.log = logs.append
    with MaskedEngine(tiny_qwen2, opts) as eng:
        eng.reset()
        assert torch.equal(eng.forward(IDS, all_logits=True), clean)  # recovered by replay, exact
        assert eng.epoch == 1 and 1 not in eng.order
    assert any("wrong shape or dtype" in line and "\n" not in line for line in logs), logs


def test_verification_off_lets_a_lie_through(tiny_qwen2, clean):
    """The control for the tests above: with the check off, a biased B1 goes unnoticed and the output
    is wrong (the ±2^62 consistency bound catches only gross garbage, not a bias of 2^40)."""
    opts = _opts(verify=False)
    opts.args_for_worker = {2: ["--inject-fault", "lie-bias@1"]}
    with MaskedEngine(tiny_qwen2, opts) as eng:
        eng.reset()
        out = eng.forward(IDS, all_logits=True)
        assert eng.verifier is None and eng.epoch == 0
    assert not torch.equal(out, clean)


def test_the_stated_escape_bound_is_computed_from_the_check(checker):
    """The bound README, docs/masked.md and the gateway state (a wrong product passes with probability
    <= 2^-b, per linear and token column) is computed here from the check the client runs: every
    linear's U has D rows of entries drawn from [0, 2^u); the worst lie (an error of 2^(64-u) on one
    element: row d passes iff u_d = 0 there) passes each row with probability 2^-u, all D with
    2^-(u D). Fewer rows or narrower entries make the stated text wrong, and this test fail."""
    from pathlib import Path

    from fusion_compute.masked import verify

    rows = {lin.u.shape[0] for lin in checker.lin.values()}
    assert len(checker.lin) == checker.plan.config.n_layers * len(checker.plan.shapes) and len(rows) == 1
    d = rows.pop()
    u_all = torch.cat([torch.from_numpy(lin.u).flatten() for lin in checker.lin.values()])  # float64 integers
    u_bits = int(u_all.max()).bit_length()
    top_half = float((u_all >= 2 ** (u_bits - 1)).double().mean())
    assert int(u_all.min()) >= 0 and 0.45 < top_half < 0.55, top_half  # uniform on [0, 2^u): ~half in the top half
    computed = f"2^-{u_bits * d}"
    assert verify.ESCAPE_BOUND == computed
    # The worst lie is caught unless U's column is zero there (every row rejects an error u_d 2^(64-u) ≠ 0).
    s = checker.plan.shapes[0]
    x_fx, y = honest_product(checker, 0, 0, 4, torch.Generator().manual_seed(3))
    lie = y.clone()
    lie[0, 0] += 1 << (64 - u_bits)
    assert bool((checker.lin[(0, 0)].u[:, 0] != 0).any()) and s.rows > 0  # not the 2^-64 case
    assert not checker.check(0, 0, lie, x_fx)
    root = Path(__file__).resolve().parent.parent
    stated = {
        "README.md": f"≤ {computed} to pass per product",
        "docs/masked.md": f"≤ {computed} for the {d} rows",
        "docs/serving.md": f"probability ≤ {computed}",
    }
    for doc, text in stated.items():
        assert text in (root / doc).read_text(), (doc, text)
