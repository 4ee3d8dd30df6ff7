"""Verified products: Freivalds' check of every linear the workers compute, at the client.

The client holds each linear's input in the clear, as the fixed-point integers it encodes (x_fx,
ring.py), and receives the claimed product y = y_A - Σ y_B (mod 2^64; honest, it is the integer
W_fx · x_fx, |.| < 2^62). It checks, for every linear of every step and every token column, that y
is W_fx · x_fx over the integers, without the matrix:

    job start (once)    U: D = 4 secret random rows per linear, entries uniform in [0, 2^16),
                        every one read from os.urandom (no seed: `secret_rows` says why);
                        V = U · W_fx, one streaming pass over the public weights, in a background
                        thread while the workers load (the client keeps U and V, never the matrices)
    every linear        U · y  ==  V · x_fx      exactly, as integers, every row and token column

Why over the integers and not in the ring: in Z/2^64 an error that is a multiple of 2^63 escapes a
random check with probability 1/2 (and one that is a multiple of 2^(64-j) with probability 2^-j).
Over the integers a wrong y (e = y - W_fx x_fx ≠ 0, as int64 values) passes one row u only if
u · e = 0: fix every entry of u but one where e_i ≠ 0; at most one of its 2^16 values solves the
equation, so the row passes with probability ≤ 2^-16 (Schwartz–Zippel), and all D = 4 independent
rows with probability ≤ 2^-64, per linear and token column, whatever the lie. The workers never see
U or anything computed from it; the only thing a liar learns is whether it was caught, and the
first detection removes it from the job (Membership._expel). U is drawn once per job rather than per
session: a fresh U needs a fresh pass over every weight (measured in docs/masked.md), and a per-job
U already bounds every wrong product's chance of passing by 2^-64.

Exactness of the arithmetic, without big integers in the hot path: y and x are offset by 2^63 (the
sign bit flipped) so that their four 16-bit limbs are all unsigned (a free view of the int64 as
uint16); U · limbs(y) and limbs(V) · limbs(x) are float64 GEMMs whose every partial sum is below
2^16 · 2^16 · max(N, K) ≤ 2^53 for up to 2^21 rows or columns (exact); the few sums per row and
column are recombined, offsets removed, in Python integers.

On a mismatch the client finds who lied (`blame`): it reads that linear's rows from its own copy of
the model, recomputes A's product W_fx (x_fx + Σ r) and each mask group's W_fx r_i in the ring, and
names the members whose rows differ.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import torch

from ..errors import WorkerMisbehaved
from ..model.config import ModelError
from ..weights.loader import WeightSource
from .plan import MaskedPlan
from .ring import RingMatrix, quantize_rows, weight_bits
from .worker import read_rows

BASIS_ROWS = 4  # D: rows of U per linear (a wrong product passes each with probability <= 2^-16)
U_BITS, LIMB, N_LIMBS = 16, 16, 4
# The check's bound, stated once (the gateway's `fusion.verified` text and the docs quote it): a wrong
# product passes all D rows with probability <= 2^-(U_BITS * D) = 2^-64, per linear and token column.
ESCAPE_BITS = U_BITS * BASIS_ROWS
ESCAPE_BOUND = f"2^-{ESCAPE_BITS}"
SIGN = np.int64(-(1 << 63))  # x ^ SIGN, read as unsigned, is x + 2^63
OFFSET = 1 << 63
SHIFTS = [1 << (LIMB * p) for p in range(2 * N_LIMBS - 1)]  # 2^(16 p), limb positions 0..6
POSITIONS = np.array(
    [[float(a + b == p) for p in range(2 * N_LIMBS - 1)] for a in range(N_LIMBS) for b in range(N_LIMBS)]
)  # (16, 7) float64: limb pair (a, b) -> position a + b


class ProductRejected(WorkerMisbehaved):
    """A product failed the check: `blamed` names the members whose rows were wrong, as (group,
    member, rank), and `pids` as participants (what the engine removes)."""

    def __init__(self, message: str, blamed: list[tuple[str, int, int]], pids: list[int]):
        super().__init__(message, pids)
        self.blamed = blamed


def unsigned_limbs(x: torch.Tensor) -> np.ndarray:
    """int64 (M, T) -> float64 (M, 4 T): the limbs of x + 2^63, column 4 t + j = limb j of column t,
    each in [0, 2^16), so that x + 2^63 = Σ_j limb_j 2^(16 j) exactly. numpy, not torch: a check
    is a dozen tiny operations, and numpy's per-call overhead is a third of torch's (measured)."""
    m, t = x.shape
    flat = np.ascontiguousarray(x.numpy()).reshape(-1) ^ SIGN
    return flat.view(np.uint16).reshape(m, N_LIMBS * t).astype(np.float64)


def signed_limbs(x: torch.Tensor) -> torch.Tensor:
    """int64 (..., M) -> float64 (4, ..., M): x = Σ_j limb_j 2^(16 j), limbs 0..2 in [0, 2^16), the
    top one signed (arithmetic shift), for any int64 (precompute only)."""
    low = (1 << LIMB) - 1
    parts = [(x >> (LIMB * j)) & low for j in range(N_LIMBS - 1)] + [x >> (LIMB * (N_LIMBS - 1))]
    return torch.stack(parts).to(torch.float64)


class _Linear:
    """One linear's check state: U (D, N) float64; V's limbs (4 D, K), row a D + d = limb a of row d;
    and, per row, 2^63 (Σ_n U[d, n] - Σ_k V[d, k]) as a Python integer (the offsets' difference)."""

    __slots__ = ("u", "v_limbs", "target")

    def __init__(self, u: torch.Tensor, v: torch.Tensor):
        self.u = u.to(torch.float64).numpy()
        limbs = signed_limbs(v)  # (4, D, K)
        self.v_limbs = np.ascontiguousarray(limbs.reshape(N_LIMBS * u.shape[0], -1).numpy())
        u_off = [OFFSET * int(r) for r in u.sum(1).tolist()]  # Σ u < 2^16 N: exact in int64
        col = limbs.sum(2).to(torch.int64).tolist()  # (4, D): each < 2^16 K, exact
        v_off = [OFFSET * sum(col[a][d] << (LIMB * a) for a in range(N_LIMBS)) for d in range(u.shape[0])]
        # U (y + 2^63) - V (x + 2^63) = U y - V x + 2^63 (Σ U - Σ V): what it must equal, per row
        self.target = [a - b for a, b in zip(u_off, v_off, strict=True)]


if sys.byteorder != "little":  # unsigned_limbs reads an int64's 16-bit words in memory order
    raise ImportError("masked/verify.py assumes a little-endian machine")


class ProductCheck:
    """The client's Freivalds state: U and V per (layer, op), drawn once per job; counts its checks."""

    def __init__(self, plan: MaskedPlan, src: WeightSource):
        """`plan`: any epoch's plan (the linears' shapes and the quantization are the job's)."""
        self.plan, self.src = plan, src
        self.lin: dict[tuple[int, int], _Linear] = {}
        self.meta: dict[tuple[int, int], torch.Tensor] = {}  # (2, N): e_i, ‖W_fx[i]‖₂ (check_metadata)
        self.checks = 0  # (linear, token) pairs verified
        self.failures = 0
        self.precompute_s = 0.0
        self.check_s = 0.0  # CPU time of the calling thread inside check() (after the precompute)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._precompute, name="fusion-freivalds", daemon=True)
        self._thread.start()  # overlaps the workers' own loading

    def _precompute(self) -> None:
        t0 = time.perf_counter()
        try:
            for layer in range(self.plan.config.n_layers):
                for s in self.plan.shapes:
                    w_fx, e = self.quantized(layer, s.op, (0, s.rows))  # (N, K) float64 integers, |.| <= 2^27
                    # what every worker must report for these rows at the handshake (worker.load_member)
                    self.meta[(layer, s.op)] = torch.stack([e.to(torch.float64), w_fx.norm(dim=1)])
                    u = secret_rows(BASIS_ROWS, s.rows)
                    # U · W_fx exactly: 8-bit halves of U keep every float64 sum below 2^53.
                    hi, lo = (u >> 8).to(torch.float64), (u & 255).to(torch.float64)
                    v = (hi @ w_fx).to(torch.int64) * 256 + (lo @ w_fx).to(torch.int64)  # |.| < 2^58
                    self.lin[(layer, s.op)] = _Linear(u, v)
        except BaseException as e:  # surfaced by wait()
            self._error = e
        self.precompute_s = time.perf_counter() - t0
        self._ready.set()

    def weights(self, layer: int, op: int, rows: tuple[int, int]) -> torch.Tensor:
        """Rows of one linear as the workers quantize them (bit-identical W_fx), float64."""
        return self.quantized(layer, op, rows)[0]

    def quantized(self, layer: int, op: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_fx, e): the rows as the workers quantize them, and their exponents."""
        s = self.plan.shapes[op]
        w = read_rows(self.src, layer, s.name, rows)
        return quantize_rows(w, weight_bits(s.k, self.plan.limb_bits))

    def check_metadata(self, reported: list[torch.Tensor]) -> None:
        """The handshake's metadata, per (layer, op) in that order ((2, rows): e_i and ‖W_fx[i]‖₂, as
        every group agreed on it), must be the client's own, bit for bit. The products are checked
        against the client's weights, but the client rescales each row by 2^-e_i and picks its input
        scale from the norms: a coalition with a member in every group reporting other exponents
        (or inflated norms) would change outputs (or their precision) with every product passing."""
        self.wait()
        n_ops = len(self.plan.shapes)
        for i, got in enumerate(reported):
            layer, op = divmod(i, n_ops)
            if not torch.equal(got, self.meta[(layer, op)]):
                raise ModelError(
                    f"the workers' quantization metadata of L{layer}.{self.plan.shapes[op].name} (agreed by every "
                    "group) differs from the client's own copy of the weights: the same model file everywhere?"
                )

    def wait(self) -> None:
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def check(self, layer: int, op: int, y_NT: torch.Tensor, x_KT: torch.Tensor) -> bool:
        """True when U · y == V · x over the integers, for every row of U and token column."""
        self.wait()
        t0 = time.thread_time()
        lin, t, d = self.lin[(layer, op)], y_NT.shape[1], BASIS_ROWS
        uy = (lin.u @ unsigned_limbs(y_NT)).reshape(d, t, N_LIMBS)  # U (y + 2^63) by limb: exact, < 2^46
        vx = (lin.v_limbs @ unsigned_limbs(x_KT)).reshape(N_LIMBS, d, t, N_LIMBS)  # by (limb of V, limb of x)
        # Limb position p = a + b: sums of at most 4 terms < 2^48, and the difference < 2^49: exact.
        diff = -(vx.transpose(1, 2, 0, 3).reshape(d, t, N_LIMBS * N_LIMBS) @ POSITIONS)
        diff[:, :, :N_LIMBS] += uy
        ok = True
        for want, rows in zip(lin.target, diff.tolist(), strict=True):
            for col in rows:  # Σ_p diff_p 2^(16 p) = U y - V x + the offsets' difference
                ok &= sum(int(v) * SHIFTS[p] for p, v in enumerate(col)) == want
        self.check_s += time.thread_time() - t0
        self.checks += t
        self.failures += not ok
        return ok

    def blame(
        self,
        plan: MaskedPlan,
        layer: int,
        op: int,
        y_a: dict[int, torch.Tensor],
        y_b: dict[int, torch.Tensor],
        m_KT: torch.Tensor,
        r_KT: dict[str, torch.Tensor],
    ) -> list[tuple[str, int, int]]:
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


def secret_rows(d: int, n: int) -> torch.Tensor:
    """U (d, n) int64, entries uniform in [0, 2^U_BITS), every one read from the OS CSPRNG.

    Not from a seeded generator: U expanded from a seed is no more secret than the seed, and the
    bound needs all of U's 16 bits per entry. With U a function of a 63-bit seed (as it once was:
    torch's Mersenne Twister seeded from 8 bytes of os.urandom), a liar picks any seed, computes
    its U and returns an error in U's null space (an integer lattice vector with entries of a few
    units, found by LLL in well under a second): it passes whenever the job drew that seed, with
    probability 2^-63 > 2^-64, and one error in the common null space of m seeds' U (4 m < N
    equations) passes with probability m 2^-63 (tests/test_redteam_masked.py)."""
    raw = np.frombuffer(_urandom(2 * d * n), dtype="<u2").astype(np.int64)
    return torch.from_numpy(raw & ((1 << U_BITS) - 1)).reshape(d, n)


def _urandom(n: int) -> bytes:
    import os

    return os.urandom(n)
