"""What a generation returns, the prompt's checks and the stop rule; `generate` runs one session
through the batching loop (batching.py), the one generation loop: a prefill, then one sharded step
per new token."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .engine import EngineBase
from .errors import InputError
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .batching import StepHooks


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
    hooks: StepHooks | None = None,
) -> GenerationResult:
    """Generate after `prompt_ids` in a fresh session: the batching loop (batching.BatchRunner) with
    one sequence, in slot 0. `on_token(id)` is called for every new token; returning True stops
    early (e.g. a stop string matched). `hooks`: calls around every step (batching.StepHooks)."""
    from .batching import BatchRunner, Sequence

    check_prompt(prompt_ids, engine.config.vocab, engine.context, max_new_tokens)
    recovered_before = len(engine.recoveries)
    runner = BatchRunner(engine, 1, hooks)
    seq = Sequence(list(prompt_ids), max_new_tokens, sampling, stop_ids, on_token)
    runner.add(seq, fresh=True)  # a fresh session: every slot zeroed
    try:
        while runner.active:
            runner.step()  # the session's slot is zeroed as it finishes (hygiene: not at the next request)
    except BaseException:
        runner.abort()
        engine.end_session()  # whatever the failed step left, wiped now
        raise
    res = seq.result()
    res.recoveries = engine.recoveries[recovered_before:]
    return res
