"""Masked-mode messages. Control words are the structural mode's int64 [op, a, b, c] (`Op`); a worker
gets only what it needs, so A never learns positions, steps or sessions.

  HELLO     client -> all   [HELLO, limb_bits, plan fingerprint, mask kind]
            worker -> client [ok, fingerprint, load_ms, rss_kb], then its quantization metadata:
                            float64 (2, rows): per owned row, in (layer, op) order, e_i and ‖W_fx[i]‖₂
  RESET     client -> B     [RESET, 0, 0, 0], then the session key: uint8 (32,)    (A: nothing)
  FORWARD   client -> A     [FORWARD, T, 0, 0]; then per layer, per op:
                              client -> A member   x_fx + r        int64 (K, T)    kind "masked"
                              A member -> client   W_fx (x_fx + r) int64 (rows, T) kind "ring_out"
            client -> B     [FORWARD, T, T_next, step] (T_next: the next decode step's T, one token per
                            session of this step, which B works ahead for); then per layer:
                              B member -> client   W_fx r, the layer's four ops stacked
                                                   int64 (rows_per_layer, T)       kind "ring_out"
  PING      client -> all   -> [1, rank, 0, rss_kb]
  SHUTDOWN  client -> all

Nothing flows between workers. Event kinds: "control", "key" (client -> B), "masked" (client -> A),
"ring_out" (worker -> client), "meta" (HELLO metadata: public, derived from public weights).
"""

from __future__ import annotations

from ..structural.protocol import CONTROL_LEN, Op, fingerprint_int

__all__ = [
    "CONTROL_LEN",
    "Op",
    "fingerprint_int",
    "KIND_CONTROL",
    "KIND_KEY",
    "KIND_MASKED",
    "KIND_OUT",
    "KIND_META",
    "MASK_CHACHA20",
    "MASK_ZERO",
    "op_name",
]

KIND_CONTROL = "control"
KIND_KEY = "key"
KIND_MASKED = "masked"
KIND_OUT = "ring_out"
KIND_META = "meta"

MASK_ZERO = 0  # negative control only
MASK_CHACHA20 = 1


def op_name(layer: int, op: str) -> str:
    return f"L{layer}.{op}"
