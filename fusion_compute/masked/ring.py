"""Fixed point in the ring Z/2^64 (int64 with wrap-around) and the exact ring matrix product.

Encoding (both scales are powers of two, so scaling by them is exact in floating point):

  W_fx[i, :] = round(W[i, :] · 2^e_i)   per output row i; public (derived from public weights);
                                        |W_fx| ≤ 2^b_w, b_w set by the limb width (below)
  x_fx[:, t] = round(x[:, t] · 2^s_t)   per token t; the client's alone; chosen so that
                                        max_i ‖W_fx[i]‖₂ · ‖x_fx[:, t]‖₂ < 2^62 (checked, `check_bound`)
  y = W_fx · x_fx                       an integer with |y| < 2^62 (Cauchy–Schwarz), so it survives
                                        the trip through Z/2^64 and comes back as a signed int64
  y · 2^-(e_i + s_t)                    the float result (`decode`)

Exact product of the public W_fx with an arbitrary ring element m (a masked input: every bit random),
by float64 limbs. Split m = Σ_j m_j 2^(βj): m_0..m_{L-2} unsigned β-bit limbs, the top limb signed
(m >> β(L-1), arithmetic), so the identity holds over the integers, and

  W_fx · m ≡ Σ_j (W_fx · m_j) · 2^(βj)   (mod 2^64)

Each W_fx · m_j is one float64 GEMM (all L limbs in one call, L·T columns) whose every partial sum
is an integer of magnitude < K · 2^b_w · 2^β ≤ 2^53, hence exact. The limb products come back as
int64 and are shifted and summed with wrap-around. Why floats: CPU BLAS has no integer GEMM, and
torch's int64 matmul is 3-9x slower than the L float64 GEMVs at decode (T = 1); it only wins for
long prefills (T ≥ 32), where `matmul` switches to it (measured: docs/masked.md). torch int64
add/mul/shift wrap modulo 2^64 (two's complement, as CrypTen relies on); tests check every path
against Python integers on wrap-around data.
"""

from __future__ import annotations

import math

import torch

RING_BITS = 64
FLOAT64_EXACT_BITS = 53  # integers up to 2^53 are exact in float64, and so is any sum staying below it
BOUND_BITS = 62  # |W_fx · x_fx| < 2^62: a factor 2 of margin under 2^63 for the float64 bound arithmetic
X_MAX_BITS = 52  # |x_fx| ≤ 2^52, so the float64 → int64 conversion of x_fx is exact
DEFAULT_LIMB_BITS = 16  # β: 4 limbs; b_w = 27 for K ≤ 1024, 26 for K ≤ 2048 (chosen in docs/masked.md)
INT64_MIN_T = 32  # from this many tokens on, torch's int64 matmul beats the limbs (docs/masked.md)


class RingOverflowError(ArithmeticError):
    """A fixed-point product could exceed the ring's signed range: the result would be wrong."""


def n_limbs(limb_bits: int) -> int:
    return -(-RING_BITS // limb_bits)


def weight_bits(k: int, limb_bits: int) -> int:
    """b_w: the largest |W_fx| exponent such that K · 2^b_w · 2^β ≤ 2^53 (every limb GEMM exact)."""
    b = FLOAT64_EXACT_BITS - limb_bits - math.ceil(math.log2(max(k, 1)))
    if b < 8:
        raise ValueError(f"inner dimension {k} with {limb_bits}-bit limbs leaves only {b} bits for weights")
    return b


def quantize_rows(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W (n, K) float -> (W_fx (n, K) float64 holding integers with |W_fx| ≤ 2^bits, e (n,) int64).

    e_i puts row i's largest |W| just below 2^bits (per-row scales cost nothing: the client rescales
    each output row anyway). An all-zero row gets e = 0."""
    w64 = w.to(torch.float64)
    row_max = w64.abs().amax(1)
    _, ex = torch.frexp(row_max)  # row_max < 2^ex
    e = torch.where(row_max > 0, bits - ex.to(torch.int64), torch.zeros_like(ex, dtype=torch.int64))
    w_fx = torch.round(torch.ldexp(w64, e[:, None].to(torch.float64)))
    return w_fx, e


class RingMatrix:
    """A public weight block W_fx (n, K), ready for exact products with ring elements."""

    def __init__(self, w_fx: torch.Tensor, limb_bits: int = DEFAULT_LIMB_BITS):
        n, k = w_fx.shape
        self.k = k
        self.limb_bits = limb_bits
        self.n_limbs = n_limbs(limb_bits)
        bits = weight_bits(k, limb_bits)
        if w_fx.numel() and float(w_fx.abs().max()) > 2.0**bits:
            raise RingOverflowError(f"weights exceed 2^{bits}: limb products would not be exact in float64")
        self.w = w_fx.to(torch.float64).contiguous()  # (n, K)
        self.w_np = self.w.numpy()  # shares memory
        self.shifts = torch.tensor([limb_bits * j for j in range(self.n_limbs)], dtype=torch.int64)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.w.shape  # (n, K)
        return n, k

    def limbs(self, m_KT: torch.Tensor) -> torch.Tensor:
        """m (K, T) int64 -> (L·T, K) float64: limb j of token t in row j·T + t."""
        beta, low = self.limb_bits, (1 << self.limb_bits) - 1
        parts = [(m_KT >> (beta * j)) & low for j in range(self.n_limbs - 1)]
        parts.append(m_KT >> (beta * (self.n_limbs - 1)))  # signed top limb: the identity is exact
        return torch.cat([p.T for p in parts]).to(torch.float64)  # (L·T, K)

    def matmul(self, m_KT: torch.Tensor) -> torch.Tensor:
        """W_fx · m mod 2^64 for m (K, T) int64; returns (n, T) int64. Exact for any m.

        Float64 limbs below INT64_MIN_T tokens (decode: 3-9x faster than torch's int64 kernel),
        torch's int64 matmul from there on (long prefills: it amortizes over T, the limb GEMMs do
        not). Both measured in docs/masked.md; both exact, tested against Python integers."""
        if m_KT.dtype != torch.int64 or m_KT.dim() != 2 or m_KT.shape[0] != self.k:
            raise ValueError(f"expected int64 ({self.k}, T), got {m_KT.dtype} {tuple(m_KT.shape)}")
        return self.matmul_int64(m_KT) if m_KT.shape[1] >= INT64_MIN_T else self.matmul_limbs(m_KT)

    def matmul_limbs(self, m_KT: torch.Tensor) -> torch.Tensor:
        t = m_KT.shape[1]
        # (L·T, K) @ (K, n) through numpy's BLAS (OpenBLAS in the numpy wheels): on this CPU it
        # beats torch's MKL by ~1.3x at T = 1 and ~2x at T = 32 for these skinny shapes.
        p = torch.from_numpy(self.limbs(m_KT).numpy() @ self.w_np.T).to(torch.int64)  # (L·T, n), exact, < 2^53
        p = p.view(self.n_limbs, t, -1) << self.shifts[:, None, None]  # wraps mod 2^64
        return p.sum(0).T.contiguous()  # (n, T); int64 sum wraps mod 2^64

    def matmul_int64(self, m_KT: torch.Tensor) -> torch.Tensor:
        """torch's int64 matmul (wraps mod 2^64), W converted per call: no second copy of the
        weights is kept (the conversion is counted in the measurement)."""
        return self.w.to(torch.int64) @ m_KT


def encode(x_KT: torch.Tensor, w_norm_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (K, T) float -> (x_fx (K, T) int64, s (T,) int64) with w_norm_max · ‖x_fx[:, t]‖₂ < 2^62.

    s_t is the largest power of two that keeps the Cauchy–Schwarz bound under 2^62 after rounding
    (‖x_fx‖ ≤ ‖x‖ 2^s + √K/2) and every |x_fx| ≤ 2^52. The per-token arithmetic is on Python
    floats: at decode T = 1, and a dozen tensor ops per linear would cost more than the linear."""
    k = x_KT.shape[0]
    x64 = x_KT.to(torch.float64)
    room = 2.0**BOUND_BITS / w_norm_max - math.sqrt(k) / 2 if w_norm_max > 0 else math.inf
    if not room > 0:
        raise RingOverflowError(f"row norm {w_norm_max:.3g} leaves no room under 2^{BOUND_BITS}")
    s = []
    for norm, amax in zip(x64.norm(dim=0).tolist(), x64.abs().amax(0).tolist(), strict=True):
        if not math.isfinite(norm):
            raise RingOverflowError(f"cannot encode a non-finite value (norm {norm})")
        if norm == 0:
            s.append(0)
            continue
        s_cap = X_MAX_BITS - math.frexp(amax)[1]  # amax < 2^e  ->  |x 2^s| < 2^52
        s.append(min(math.floor(math.log2(room / norm)), s_cap) if math.isfinite(room) else s_cap)
    scaled = torch.round(x64 * torch.tensor([2.0**v for v in s], dtype=torch.float64))  # exact: powers of 2
    check_bound(scaled, w_norm_max)
    return scaled.to(torch.int64), torch.tensor(s, dtype=torch.int64)


def check_bound(x_fx: torch.Tensor, w_norm_max: float) -> None:
    """x_fx: int64, or float64 holding the same integers. Raise unless w_norm_max · ‖x_fx[:, t]‖₂ < 2^62 for every t: then |W_fx x_fx| < 2^62 · (1 + 1e-12)
    < 2^63 for every row (the float64 evaluation of the bound is good to ~K · 2^-53 relative)."""
    if not x_fx.numel() or w_norm_max == 0:
        return
    worst = float(x_fx.to(torch.float64).norm(dim=0).max()) * w_norm_max
    if not worst < 2.0**BOUND_BITS:
        raise RingOverflowError(f"|W x| bound 2^{math.log2(worst):.2f} is not below 2^{BOUND_BITS}")


def check_result(y_NT: torch.Tensor, what: str = "product") -> None:
    """The unmasked product must lie in (-2^62, 2^62), where encode() put it. Outside, A and B did
    not compute with the same masks or weights (a wrong key, another model file, a lost message):
    uniform garbage lands outside with probability 1/2 per element. A consistency check, not
    integrity: a deliberately small error from a malicious worker would pass."""
    lim = 1 << BOUND_BITS
    if y_NT.numel() and bool(((y_NT >= lim) | (y_NT <= -lim)).any()):
        raise RingOverflowError(f"{what}: unmasked result outside ±2^{BOUND_BITS}: groups A and B disagree")


def decode(y_NT: torch.Tensor, inv_w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Signed ring result y (N, T) int64 -> float64 y · 2^-e_i · 2^-s_t (inv_w = 2^-e, see `inverse_scales`).
    Both factors are powers of two: exact, barring the int64 -> float64 rounding of |y| > 2^53."""
    inv_s = torch.tensor([2.0 ** -int(v) for v in s.tolist()], dtype=torch.float64)
    return y_NT.to(torch.float64) * inv_w[:, None] * inv_s[None, :]


def inverse_scales(e: torch.Tensor) -> torch.Tensor:
    """2^-e_i as float64 (exact), once per linear."""
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float64), -e.to(torch.float64))


def limit_blas_threads(n: int) -> bool:
    """Best effort: cap numpy's OpenBLAS pool (which `matmul` uses) at n threads, after import. The
    wheels' OpenBLAS reads OPENBLAS_NUM_THREADS only when loaded; workers sharing cores otherwise
    spin against each other (measured: 13x the worker CPU per token, 5.5 s vs 0.42 s, 4 workers on 2 cores)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and line.rstrip().endswith(".so")}
        for path in libs:
            lib = ctypes.CDLL(path)
            for name in (
                "scipy_openblas_set_num_threads64_",
                "openblas_set_num_threads64_",
                "openblas_set_num_threads",
            ):
                if hasattr(lib, name):
                    getattr(lib, name)(int(n))
                    return True
    except OSError:
        pass
    return False
