"""Tensors as the bytes a backend moves, and the sum of the partials a rank receives.

Whatever the compute dtype (float32, bfloat16, float16) and device, a message is the tensor's raw
bytes: a tensor on a GPU is staged through host memory for the links and MPI (`host`), and bfloat16,
which numpy and MPI have no type for, travels as its 2-byte words (`raw`, `words`). The owner of a
chunk sums the N partials it holds in a float32 accumulator and rounds once to the compute dtype
(`accumulate`): in bfloat16 that is one rounding per reduce-scatter instead of one per partial added,
and the sum does not depend on how many workers there are beyond their own partials' rounding
(docs/performance.md, "GPUs and dtypes"). In float32 it is the plain sum, unchanged.
"""

from __future__ import annotations

import torch

# dtypes numpy has: their bytes are read through numpy directly (the float32 path, as fast as ever)
_NUMPY = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8})


def host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, contiguous (itself when it already is)."""
    return t.contiguous() if not t.is_cuda else t.contiguous().cpu()


def raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor (no autograd history), as a flat memoryview (sent from, or
    received into). bfloat16 goes through its bytes: numpy has no such type."""
    if t.dtype in _NUMPY:
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data  # flat first: a (k, 1) column may stride by anything


def words(t: torch.Tensor):
    """A numpy view of a contiguous host tensor that MPI can move: 2-byte floats as int16 words (MPI
    and numpy have no bfloat16), others as themselves. Counts in elements stay the same."""
    if t.element_size() == 2 and t.is_floating_point():
        return t.reshape(-1).view(torch.int16).numpy()
    return t.numpy()


def accumulate(stack: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in a float32 accumulator, rounded once to the stack's dtype. (torch's own sum of
    a bfloat16 tensor accumulates in float32 on the CPU and CUDA today; this says so rather than rely
    on a reduction kernel: adding the partials one by one in the dtype would round after each.)"""
    if stack.dtype == torch.float32:
        return stack.sum(0)  # the same sum, without the no-op conversions' cost per collective
    return stack.sum(0, dtype=torch.float32).to(stack.dtype)
