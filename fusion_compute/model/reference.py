"""HF transformers as the reference, on the same weights, in float64 (tests, benchmark, verify).

Why float64: the runtime computes in fp32 with its own summation order (per-worker partials, the
reduce-scatter's sum, the norm after the matmul). Against an fp32 reference the comparison measures
two fp32 roundings against each other, so a new transformers release moving its order can cross a
tolerance. Against float64 (~exact here) it measures only the runtime's own fp32 error, and every
tolerance can sit orders of magnitude below what it guards (the tests say by how much).

transformers is a test/benchmark dependency only: imported here, lazily, never by the runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def load_reference(path: str | Path, dtype: torch.dtype = torch.float64):
    """transformers' model for an HF directory or a GGUF file (dequantized), eval mode. `path` is
    resolved by the caller (weights.source.resolve_model_path: the model knows no model paths)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.is_file():  # GGUF: transformers dequantizes and un-permutes Q/K itself
        with gguf_parsed_once():
            m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return m.eval()


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While transformers loads one GGUF file, its two pure helpers from the `gguf` package answer
    each distinct call once: `GGUFReader(path)` (transformers 5.24 parses the file's metadata twice,
    for the config and for the weights) and `get_tensor_name_map(arch, n_blocks)` (rebuilt for each of
    the 397 names it maps on SmolLM2). They made ~2/3 of the load's time (profiled: 16 s and 13 s of
    43 s); the reader is only read and the name map only looked up, so the model loaded is the same
    (its state dict compared equal, tensor by tensor, when this was written). Without the `gguf`
    package, or where a later release renames them, nothing is patched."""
    try:
        import gguf
    except ImportError:
        yield
        return
    saved = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map") if hasattr(gguf, name)}
    for name, fn in saved.items():
        setattr(gguf, name, functools.lru_cache(maxsize=None)(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(gguf, name, fn)


@torch.no_grad()
def logits(ref, ids: list[int]) -> torch.Tensor:
    """(T, V) logits of a full forward over ids, in the reference's dtype, on the host (the model
    may be on a GPU: the ids go to its device)."""
    return ref(torch.tensor([ids], device=ref.device)).logits[0].cpu()


@torch.no_grad()
def greedy(ref, ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation with transformers' own KV cache; stops after a token in stop_ids."""
    return greedy_with_margins(ref, ids, max_new_tokens, stop_ids)[0]


@torch.no_grad()
def greedy_with_margins(
    ref, ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()
) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the gap between the best and second-best logit: where a gap is
    below the runtime's fp32 error, a different greedy choice would not be a bug."""
    out: list[int] = []
    gaps: list[float] = []
    res = ref(torch.tensor([ids], device=ref.device), use_cache=True)
    while True:
        top = res.logits[0, -1].topk(2)
        tok = int(top.indices[0])
        out.append(tok)
        gaps.append(float(top.values[0] - top.values[1]))
        if tok in stop_ids or len(out) >= max_new_tokens:
            return out, gaps
        res = ref(torch.tensor([[tok]], device=ref.device), cache=res.cache, use_cache=True)
