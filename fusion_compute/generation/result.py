"""What a generation returns, the prompt's checks and the stop rule: shared by the one generation loop
(batching.py) and `generate` (generate.py), which runs one session through it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import InputError


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop sequence) | "length"
    ttft_s: float
    decode_s: float
    steps: int  # sharded forward passes run (1 prefill + decode steps; with speculation, fewer than tokens)
    text: str = ""
    timing: dict = field(default_factory=dict)
    recoveries: list[dict] = field(default_factory=list)  # epochs opened during this request (a lost worker)
    speculative: dict | None = None  # speculative.SpecStats.as_dict() when speculating

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1  # tokens after the first, over the time after the first
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def check_prompt(prompt_ids: list[int], vocab: int, context: int, max_new_tokens: int) -> None:
    if not prompt_ids:
        raise InputError("empty prompt")
    bad = [i for i in prompt_ids if not (0 <= i < vocab)]
    if bad:
        raise InputError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
    if len(prompt_ids) >= context:
        raise InputError(f"prompt of {len(prompt_ids)} tokens does not fit the context window of {context}")
    if max_new_tokens < 1:
        raise InputError(f"max new tokens must be >= 1, got {max_new_tokens}")


def next_finish(
    tok: int, out: list[int], stop: set[int], on_token: Callable[[int], bool | None] | None, budget: int
) -> str | None:
    """After token `tok` (already appended to `out`): why generation ends here ("stop" at an end
    token or when `on_token` says so, "length" at the budget), or None to go on."""
    if tok in stop:
        return "stop"
    if on_token is not None and on_token(tok):
        return "stop"
    if len(out) >= budget:
        return "length"
    return None
