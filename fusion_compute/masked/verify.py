"""Verified products: Freivalds' check of every linear the workers compute, at the client.

The client holds each linear's input in the clear, as the fixed-point integers it encodes (x_fx,
ring.py), and receives the claimed product y = y_A - Σ y_B (the integers W_fx · x_fx, |y| < 2^62,
which `ring.check_result` has already bounded). It checks, for every linear of every step and every
token column, that y is W_fx · x_fx over the integers, without the matrix:

    job start (once)    U: D = 4 secret random rows per linear, entries uniform in [0, 2^16);
                        V = U · W_fx, one streaming pass over the public weights (the client keeps
                        the vectors U and V, never the matrices)
    session start       C: 5 fresh random rows of coefficients in [0, 2^8)
    every linear        C · (U · y)  ==  C · (V · x_fx)     exactly, as integers

Why over the integers and not in the ring: in Z/2^64 an error that is a multiple of 2^63 escapes a
random check with probability 1/2. Both sides here are exact integers (limb arithmetic below), so a
wrong y (e = y - W_fx x_fx ≠ 0) passes only if U e = 0, probability ≤ 2^-16 per row of U (the
Schwartz–Zippel bound: fix every u_j but one coordinate where e_i ≠ 0), ≤ 2^-64 for the job's D = 4
rows, or else if C (U e) = 0, ≤ (2^-8)^5 = 2^-40 for the session's 5 rows of C. Per linear and token:
at most 2^-40 + 2^-64. U is never seen by a worker; C is fresh per session; a detected liar is
removed from the job (engine.revoke), so it gets one try.

Exactness of the arithmetic: every integer is split into 16-bit limbs (the top limb signed, as in
ring.py), every limb product sum stays below 2^53 (exact in float64 GEMMs), and the sums are
recombined with carries in int64 (`_equal`).

On a mismatch the client finds who lied (`blame`): it reads that linear's rows from its own copy of
the model, recomputes A's product W_fx (x_fx + Σ r) and each mask group's W_fx r_i in the ring, and
names the members whose rows differ.
"""

from __future__ import annotations

import threading
import time

import torch

from ..errors import WorkerMisbehaved
from ..weights import WeightSource
from .plan import MaskedPlan
from .ring import RingMatrix, quantize_rows, weight_bits
from .worker import read_rows

BASIS_ROWS = 4  # D: rows of U per linear (U e = 0 for a nonzero e with probability <= 2^-16 each)
CHECK_ROWS = 5  # rows of C per session (each passes a nonzero U e with probability <= 2^-8)
U_BITS, C_BITS, LIMB = 16, 8, 16


class ProductRejected(WorkerMisbehaved):
    """A product failed the check: `blamed` names the members whose rows were wrong, as (group,
    member, rank), and `pids` as participants (what the engine removes)."""

    def __init__(self, message: str, blamed: list[tuple[str, int, int]], pids: list[int]):
        super().__init__(message, pids)
        self.blamed = blamed


def _limbs(x: torch.Tensor, n: int = 4) -> torch.Tensor:
    """int64 (..., M) -> float64 (n, ..., M): x = Σ_j limb_j 2^(16 j), limbs 0..n-2 in [0, 2^16),
    the top one signed (arithmetic shift), so the identity is exact for any int64."""
    low = (1 << LIMB) - 1
    parts = [(x >> (LIMB * j)) & low for j in range(n - 1)] + [x >> (LIMB * (n - 1))]
    return torch.stack(parts).to(torch.float64)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """Σ_p a_p 2^(16 p) == Σ_p b_p 2^(16 p), elementwise, for int64 tensors whose |values| < 2^61:
    subtract position by position and carry (exact: every step stays inside int64)."""
    carry = torch.zeros_like(a[0])
    ok = torch.ones_like(a[0], dtype=torch.bool)
    for p in range(max(len(a), len(b))):
        t = (a[p] if p < len(a) else 0) - (b[p] if p < len(b) else 0) + carry
        ok &= (t & ((1 << LIMB) - 1)) == 0
        carry = t >> LIMB
    return ok & (carry == 0)


class ProductCheck:
    """The client's Freivalds state: U and V per (layer, op), C per session; counts its checks."""

    def __init__(self, plan: MaskedPlan, src: WeightSource, seed: int | None = None):
        """`plan`: any epoch's plan (the linears' shapes and the quantization are the job's)."""
        self.plan, self.src = plan, src
        self.gen = torch.Generator()
        self.gen.manual_seed(seed if seed is not None else int.from_bytes(_urandom(8), "little") >> 1)
        self.U: dict[tuple[int, int], torch.Tensor] = {}  # (D, N) int64
        self.V: dict[tuple[int, int], torch.Tensor] = {}  # (D, K) int64
        self.C: torch.Tensor | None = None
        self.checks = 0  # (linear, token) pairs verified
        self.failures = 0
        self.precompute_s = 0.0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._precompute, name="fusion-freivalds", daemon=True)
        self._thread.start()  # overlaps the workers' own loading

    def _precompute(self) -> None:
        t0 = time.perf_counter()
        try:
            for layer in range(self.plan.config.n_layers):
                for s in self.plan.shapes:
                    w_fx = self.weights(layer, s.op, (0, s.rows))  # (N, K) float64 integers, |.| <= 2^27
                    u = torch.randint(0, 1 << U_BITS, (BASIS_ROWS, s.rows), generator=self.gen, dtype=torch.int64)
                    # U · W_fx exactly: 8-bit halves of U keep every float64 sum below 2^53.
                    hi, lo = (u >> 8).to(torch.float64), (u & 255).to(torch.float64)
                    v = (hi @ w_fx).to(torch.int64) * 256 + (lo @ w_fx).to(torch.int64)  # |.| < 2^58
                    self.U[(layer, s.op)], self.V[(layer, s.op)] = u, v
        except BaseException as e:  # surfaced by wait()
            self._error = e
        self.precompute_s = time.perf_counter() - t0
        self._ready.set()

    def weights(self, layer: int, op: int, rows: tuple[int, int]) -> torch.Tensor:
        """Rows of one linear as the workers quantize them (bit-identical W_fx), float64."""
        s = self.plan.shapes[op]
        w = read_rows(self.src, layer, s.name, rows)
        return quantize_rows(w, weight_bits(s.k, self.plan.limb_bits))[0]

    def wait(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def new_session(self) -> None:
        self.C = torch.randint(0, 1 << C_BITS, (CHECK_ROWS, BASIS_ROWS), generator=self.gen, dtype=torch.int64)

    def check(self, layer: int, op: int, y_NT: torch.Tensor, x_KT: torch.Tensor) -> bool:
        """True when C·U·y == C·V·x for every token column (exact integers)."""
        self.wait()
        u, v, c = self.U[(layer, op)], self.V[(layer, op)], self.C
        t = y_NT.shape[1]
        # U · y over y's 16-bit limbs: every float64 sum < 2^16 · 2^16 · N < 2^53, so exact.
        uy = u.to(torch.float64) @ _limbs(y_NT).permute(1, 0, 2).reshape(y_NT.shape[0], 4 * t)  # (D, 4T)
        uy = uy.to(torch.int64).view(BASIS_ROWS, 4, t).permute(1, 0, 2)  # (4 positions, D, T)
        lhs = [c @ uy[p] for p in range(4)]  # int64 (CHECK, T), each < 2^8 · D · 2^47
        # V · x over both limb sets: positions a + b = 0..6; every float64 sum < 2^16 · 2^16 · K.
        vl = _limbs(v).reshape(4 * BASIS_ROWS, -1)  # (4D, K)
        xl = _limbs(x_KT).permute(1, 0, 2).reshape(x_KT.shape[0], 4 * t)  # (K, 4T)
        vx = (vl @ xl).to(torch.int64).view(4, BASIS_ROWS, 4, t)
        rhs = [torch.zeros(CHECK_ROWS, t, dtype=torch.int64) for _ in range(7)]
        for a in range(4):
            for b in range(4):
                rhs[a + b] += c @ vx[a, :, b]  # each < 2^8 · D · 2^46; at most 4 terms per position
        ok = bool(_equal(lhs, rhs).all())
        self.checks += t
        self.failures += not ok
        return ok

    def blame(self, plan: MaskedPlan, layer: int, op: int, y_a: dict[int, torch.Tensor],
              y_b: dict[int, torch.Tensor], m_KT: torch.Tensor, r_KT: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:  # fmt: skip
        """Recompute the linear's products from the public weights and name every member of the
        epoch's `plan` whose rows differ: A's W_fx m (m = x_fx + Σ r), and each mask group's
        W_fx r_g. `y_a` / `y_b` map a rank to the rows it returned (mask ranks: this op's rows)."""
        out = []
        s = plan.shapes[op]
        mat = RingMatrix(self.weights(layer, op, (0, s.rows)), plan.limb_bits)
        want = {"A": mat.matmul(m_KT)}
        for g, r in r_KT.items():
            want[g] = mat.matmul(r)
        for rank, got in {**y_a, **y_b}.items():
            g, member = plan.group_of(rank)
            a, b = plan.member_rows(g, member, op)
            if not torch.equal(got, want[g][a:b]):
                out.append((g, member, rank))
        return out


def _urandom(n: int) -> bytes:
    import os

    return os.urandom(n)
