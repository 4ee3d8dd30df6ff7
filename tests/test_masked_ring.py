"""Ring arithmetic of the masked mode: exact against Python integers, wrap-around included; overflow
bounds checked, not hoped; fixed-point error far below the fp32 rounding of the same product."""

from __future__ import annotations

import random

import pytest
import torch

from fusion_compute.masked import ring

MOD = 1 << 64


def signed(v: int) -> int:
    v %= MOD
    return v - MOD if v >= 1 << 63 else v


def bigint_matmul(w: torch.Tensor, m: torch.Tensor) -> list[list[int]]:
    """W m mod 2^64 with Python integers (the reference: no floating point, no wrap-around bugs)."""
    wl, ml = w.to(torch.int64).tolist(), m.tolist()
    n, k, t = len(wl), len(ml), len(ml[0])
    return [[signed(sum(wl[i][j] * ml[j][c] for j in range(k))) for c in range(t)] for i in range(n)]


def extreme_ring(k: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform ring elements plus the corners: 0, ±1, -2^63, 2^63 - 1, limb boundaries."""
    m = torch.randint(-(2**63), 2**63 - 1, (k, t), dtype=torch.int64, generator=gen)
    corners = [0, 1, -1, -(2**63), 2**63 - 1, (1 << 16) - 1, 1 << 48, -(1 << 52)]
    for i, v in enumerate(corners[: k * t]):
        m.view(-1)[i] = v
    return m


@pytest.mark.parametrize("limb_bits", [13, 16, 22])
@pytest.mark.parametrize("k", [7, 576, 1536])
def test_ring_matmul_exact_vs_python_integers(limb_bits, k):
    gen = torch.Generator().manual_seed(k + limb_bits)
    bits = ring.weight_bits(k, limb_bits)
    n, t = 5, 3
    # Weights at the extremes of their range: every limb product's partial sums near 2^53.
    w = torch.randint(-(2**bits), 2**bits + 1, (n, k), generator=gen).to(torch.float64)
    w[0] = 2.0**bits
    w[1] = -(2.0**bits)
    m = extreme_ring(k, t, gen)
    m[:, 0] = 2**63 - 1  # every element at the top: the largest limbs everywhere
    mat = ring.RingMatrix(w, limb_bits)
    want = bigint_matmul(w, m)
    assert mat.matmul_limbs(m).tolist() == want
    assert mat.matmul_int64(m).tolist() == want  # torch's int64 matmul wraps too


def test_long_prefills_take_the_int64_path_exactly():
    gen = torch.Generator().manual_seed(9)
    k, t = 9, ring.INT64_MIN_T
    bits = ring.weight_bits(k, 16)
    w = torch.randint(-(2**bits), 2**bits + 1, (4, k), generator=gen).to(torch.float64)
    m = extreme_ring(k, t, gen)
    mat = ring.RingMatrix(w, 16)
    want = bigint_matmul(w, m)
    assert mat.matmul(m).tolist() == want  # T = INT64_MIN_T: int64 path
    assert mat.matmul(m[:, : t - 1]).tolist() == [row[: t - 1] for row in want]  # limbs


def test_masked_product_recovers_the_clear_product():
    """W(x + r) - W r == W x in the ring, for r uniform: the protocol's identity."""
    gen = torch.Generator().manual_seed(0)
    k, t = 64, 4
    w = torch.randn(9, k, generator=gen)
    w_fx, e = ring.quantize_rows(w, ring.weight_bits(k, 16))
    mat = ring.RingMatrix(w_fx, 16)
    norm_max = float(w_fx.norm(dim=1).max())
    x = torch.randn(k, t, generator=gen) * 30
    x_fx, s = ring.encode(x, norm_max)
    r = extreme_ring(k, t, gen)
    y = mat.matmul(x_fx + r) - mat.matmul(r)
    assert y.tolist() == bigint_matmul(w_fx, x_fx)
    got = ring.decode(y, ring.inverse_scales(e), s)
    exact = w.double() @ x.double()
    # Relative to the Cauchy-Schwarz scale of each entry, the fixed-point error is ~2^-27: far
    # below fp32's 2^-24 rounding of a single product.
    scale = w.double().norm(dim=1)[:, None] * x.double().norm(dim=0)[None, :]
    assert float(((got - exact).abs() / scale).max()) < 2**-24


def test_quantize_rows_bounds_and_zero_rows():
    w = torch.tensor([[0.5, -0.25, 0.0], [0.0, 0.0, 0.0], [3e-8, -1e-9, 2e-8], [-7.0, 1e-30, 6.99]])
    w_fx, e = ring.quantize_rows(w, 20)
    assert float(w_fx.abs().max()) <= 2**20
    assert float(w_fx[1].abs().max()) == 0 and int(e[1]) == 0
    for i in (0, 2, 3):  # each row's largest entry lands in [2^19, 2^20]
        assert 2**19 <= float(w_fx[i].abs().max()) <= 2**20
    assert torch.equal(
        ring.decode(w_fx.to(torch.int64)[:, :1], ring.inverse_scales(e), torch.zeros(1, dtype=torch.int64))[0],
        w_fx[0, :1] * 2.0 ** -int(e[0]),
    )


def test_encode_respects_the_bound_and_decode_inverts():
    gen = torch.Generator().manual_seed(1)
    for norm_max in (1.0, 2.0**31.5, 2.0**40):
        x = torch.randn(100, 3, generator=gen) * torch.tensor([1e-6, 1.0, 1e4])
        x[:, 1] = 0  # an all-zero token
        x_fx, s = ring.encode(x, norm_max)
        assert float(x_fx.to(torch.float64).norm(dim=0).max()) * norm_max < 2.0**ring.BOUND_BITS
        assert int(x_fx.abs().max()) <= 2**ring.X_MAX_BITS
        back = x_fx.to(torch.float64) * (2.0 ** -s.to(torch.float64))[None, :]
        assert torch.allclose(back, x.double(), rtol=0, atol=float(x.abs().max()) * 2**-20)


def test_overflow_is_checked():
    x_fx = torch.full((4, 1), 2**40, dtype=torch.int64)
    with pytest.raises(ring.RingOverflowError):
        ring.check_bound(x_fx, 2.0**23)  # 2^41 * 2^23 = 2^64 > 2^62
    ring.check_bound(x_fx, 2.0**20)  # 2^41 * 2^20 = 2^61: fine
    with pytest.raises(ring.RingOverflowError):
        ring.encode(torch.tensor([[float("inf")]]), 1.0)
    with pytest.raises(ring.RingOverflowError):  # weights beyond the exact-limb range are refused
        ring.RingMatrix(torch.full((1, 576), 2.0**40), 16)


def test_ring_wraps_like_python():
    """The primitive the protocol relies on: torch int64 add/sub/shift wrap modulo 2^64."""
    rnd = random.Random(3)
    a = [rnd.randrange(-(2**63), 2**63) for _ in range(1000)]
    b = [rnd.randrange(-(2**63), 2**63) for _ in range(1000)]
    ta, tb = torch.tensor(a), torch.tensor(b)
    assert (ta + tb).tolist() == [signed(x + y) for x, y in zip(a, b, strict=True)]
    assert (ta - tb).tolist() == [signed(x - y) for x, y in zip(a, b, strict=True)]
    assert (ta << 48).tolist() == [signed(x << 48) for x in a]


def test_disagreeing_groups_are_detected():
    """A and B with different masks (a wrong key): the 'unmasked' result is uniform garbage, and
    garbage lands outside the encoded range ±2^62 with probability 1/2 per element."""
    gen = torch.Generator().manual_seed(4)
    y_ok = torch.randint(-(2**61), 2**61, (64, 2), dtype=torch.int64, generator=gen)
    ring.check_result(y_ok)
    with pytest.raises(ring.RingOverflowError):
        ring.check_result(y_ok + torch.randint(-(2**63), 2**63 - 1, (64, 2), dtype=torch.int64, generator=gen))
