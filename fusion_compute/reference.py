"""HF transformers as the reference, on the same weights in fp32 (tests, benchmark, verify).

transformers is a test/benchmark dependency only: imported here, lazily, never by the runtime.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .weights import resolve_model_path


def load_reference(model: str | Path | None):
    """transformers' model for an HF directory or a GGUF file (dequantized to fp32), eval mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    if path.is_file():  # GGUF: transformers dequantizes and un-permutes Q/K itself
        m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()


@torch.no_grad()
def logits(ref, ids: list[int]) -> torch.Tensor:
    """(T, V) logits of a full forward over ids."""
    return ref(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def greedy(ref, ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation with transformers' own KV cache; stops after a token in stop_ids."""
    out: list[int] = []
    res = ref(torch.tensor([ids]), use_cache=True)
    while True:
        tok = int(res.logits[0, -1].argmax())
        out.append(tok)
        if tok in stop_ids or len(out) >= max_new_tokens:
            return out
        res = ref(torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True)
