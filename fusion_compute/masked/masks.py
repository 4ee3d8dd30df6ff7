"""The mask stream: uniform ring elements from ChaCha20, keyed per session, shared by client and group B.

  r[step, layer, op] = ChaCha20(key, nonce = 0^8 ‖ label(step, layer, op)) keystream, 8 bytes per element

The client draws r to mask what it sends to group A (x_fx + r); group B draws the same r from the
same key and computes W_fx r, so the client never ships r and B can work ahead. Distinct labels give
independent keystreams (a fresh nonce per (step, layer, op)); distinct elements are distinct 8-byte
words of one keystream; a fresh key per session. The first 8 nonce bytes are the block counter
(OpenSSL reads 4 bytes of counter and 12 of nonce; keeping bytes 4..7 zero makes both readings
agree), so one label covers up to 2^32 blocks = 32 Gi elements.

A's view is then computationally indistinguishable from uniform (as good as ChaCha20 is a PRF), not
information-theoretically uniform: a true one-time pad would need the client to ship every r to B.
`ZeroMasks` exists only as a negative control for the tests and the audit.
"""

from __future__ import annotations

import os

import torch

KEY_BYTES = 32
STEP_BITS, LAYER_BITS, OP_BITS = 40, 16, 8


class MaskReuseError(RuntimeError):
    """A mask label was drawn twice in one session: two masked messages would share a pad."""


def new_key() -> bytes:
    """A fresh session key from the OS CSPRNG."""
    return os.urandom(KEY_BYTES)


def label(step: int, layer: int, op: int) -> int:
    if not (0 <= step < 1 << STEP_BITS and 0 <= layer < 1 << LAYER_BITS and 0 <= op < 1 << OP_BITS):
        raise ValueError(f"mask label out of range: step {step}, layer {layer}, op {op}")
    return (step << (LAYER_BITS + OP_BITS)) | (layer << OP_BITS) | op


class MaskStream:
    """Ring elements for (step, layer, op) labels. `guard=True` (the client) refuses to draw a label
    twice in a session; group B may recompute a label (a precomputed step redone for another T)."""

    kind = "chacha20"

    def __init__(self, key: bytes, *, guard: bool):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        if len(key) != KEY_BYTES:
            raise ValueError(f"mask key must be {KEY_BYTES} bytes, got {len(key)}")
        self._cipher = lambda nonce: Cipher(algorithms.ChaCha20(key, nonce), mode=None)
        self.guard = guard
        self.used: set[int] = set()
        self._zeros = bytes(0)

    def draw(self, step: int, layer: int, op: int, n: int) -> torch.Tensor:
        """n uniform ring elements (n,) int64, the same on every holder of the key."""
        lab = label(step, layer, op)
        if self.guard:
            if lab in self.used:
                raise MaskReuseError(f"mask (step {step}, layer {layer}, op {op}) drawn twice in one session")
            self.used.add(lab)
        nbytes = 8 * n
        if len(self._zeros) < nbytes:
            self._zeros = bytes(max(nbytes, 2 * len(self._zeros)))
        out = bytearray(nbytes)
        enc = self._cipher(bytes(8) + lab.to_bytes(8, "little")).encryptor()
        enc.update_into(memoryview(self._zeros)[:nbytes], out)
        return torch.frombuffer(out, dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)


class ZeroMasks:
    """NEGATIVE CONTROL ONLY: r = 0, so group A receives x_fx in the clear. Results stay exact (B
    returns W·0); the audit's statistics and the vocabulary attack must then fail."""

    kind = "zero"

    def __init__(self, key: bytes = b"", *, guard: bool = False):
        self.guard = guard
        self.used: set[int] = set()

    def draw(self, step: int, layer: int, op: int, n: int) -> torch.Tensor:
        self.used.add(label(step, layer, op))
        return torch.zeros(n, dtype=torch.int64)


MASK_KINDS = {0: ZeroMasks, 1: MaskStream}  # as sent in the HELLO control word


def make_stream(kind: int, key: bytes, *, guard: bool) -> MaskStream | ZeroMasks:
    try:
        return MASK_KINDS[kind](key, guard=guard)
    except KeyError:
        raise ValueError(f"unknown mask kind {kind}") from None
