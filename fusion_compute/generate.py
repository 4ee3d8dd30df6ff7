"""The generation loop on the client: prefill, then one sharded forward per new token."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .engine import EngineBase
from .errors import InputError
from .sampling import Sampler
from .sampling_params import SamplingParams


@dataclass
class GenerationResult:
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop sequence) | "length"
    ttft_s: float
    decode_s: float
    steps: int  # sharded forward passes run (1 prefill + decode steps)
    text: str = ""
    timing: dict = field(default_factory=dict)
    recoveries: list[dict] = field(default_factory=list)  # epochs opened during this request (a lost worker)

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


def generate(
    engine: EngineBase,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: Iterable[int] = (),
    on_token: Callable[[int], bool | None] | None = None,
) -> GenerationResult:
    """Generate after `prompt_ids` in a fresh session. `on_token(id)` is called for every new token;
    returning True stops early (e.g. a stop string matched)."""
    check_prompt(prompt_ids, engine.config.vocab, engine.context, max_new_tokens)
    stop = set(stop_ids)
    budget = min(max_new_tokens, engine.context - len(prompt_ids))
    sampler = Sampler(sampling)
    recovered_before = len(engine.recoveries)
    engine.reset()
    t0 = time.perf_counter()
    out: list[int] = []
    finish = "length"
    t_first = t0
    steps = 1
    try:
        logits = engine.forward(prompt_ids)
        while True:
            tok = sampler(logits)
            out.append(tok)
            if len(out) == 1:
                t_first = time.perf_counter()
            why = next_finish(tok, out, stop, on_token, budget)
            if why is not None:
                finish = why
                break
            logits = engine.forward([tok])
            steps += 1
    finally:
        engine.end_session()  # hygiene: the session's KV shards are zeroed now, not at the next request
    t_end = time.perf_counter()
    return GenerationResult(
        token_ids=out,
        prompt_tokens=len(prompt_ids),
        finish_reason=finish,
        ttft_s=t_first - t0,
        decode_s=t_end - t_first,
        steps=steps,
        recoveries=engine.recoveries[recovered_before:],
    )
