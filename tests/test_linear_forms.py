"""model/kernels.linear_fm: a worker's W · x for a feature-major x, token-major at the widths where
MKL's product of a few columns is slow (TOKEN_MAJOR_COLUMNS), W @ x elsewhere. Both forms must be the
same product: checked against float64 at every width around the switch, in the layout the workers keep
(contiguous (M, T)), for a row block of a larger matrix (the scatter's chunks are row slices of W)."""

import pytest
import torch

from fusion_compute.bench import linear_forms
from fusion_compute.model.kernels import TOKEN_MAJOR_COLUMNS, linear_fm


@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 9])
def test_linear_fm_is_w_times_x_at_every_width(t):
    g = torch.Generator().manual_seed(t)
    w_full = torch.randn(300, 96, generator=g)
    w = w_full[37:190]  # a row block, as norm_linear_scatter's chunks and linear_back's are
    x = torch.randn(96, t, generator=g)
    got = linear_fm(w, x)
    assert got.shape == (153, t) and got.is_contiguous()
    exact = w.double() @ x.double()
    # fp32 products of 96 terms of unit-variance values: each sum's rounding is ~1e-6 of its terms'
    # magnitude (sqrt(96) ~ 10), whatever the kernel's order: 1e-4 absolute is 10x that
    assert torch.allclose(got.double(), exact, rtol=0, atol=1e-4), (got.double() - exact).abs().max()


def test_the_token_major_widths_are_a_verifications_few_columns():
    """The switch covers 2 and 3 columns (a verification of one or two drafts) and not 1 (the plain
    decode's matrix-vector product) or a prefill's many."""
    assert 1 not in TOKEN_MAJOR_COLUMNS and {2, 3} <= set(TOKEN_MAJOR_COLUMNS) and max(TOKEN_MAJOR_COLUMNS) < 8


def test_the_bench_refuses_bad_input_in_one_line(capsys):
    assert linear_forms.main(["--columns", "1,x"]) == 2
    assert linear_forms.main(["--repeats", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench.linear_forms: --repeats, --layers and every --columns width must be positive integers"] * 2
