"""`generate`: one session through the one generation loop (batching.BatchRunner): a prefill, then one
sharded step per new token. What it returns and the prompt's checks are result.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..runtime.engine import EngineBase
from .batching import BatchRunner, Sequence, StepHooks
from .result import GenerationResult, check_prompt
from .sampling_params import SamplingParams
from .speculative import Speculator


def generate(
    engine: EngineBase,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_ids: Iterable[int] = (),
    on_token: Callable[[int], bool | None] | None = None,
    hooks: StepHooks | None = None,
    speculator: Speculator | None = None,
) -> GenerationResult:
    """Generate after `prompt_ids` in a fresh session: the batching loop (batching.BatchRunner) with
    one sequence, in slot 0. `on_token(id)` is called for every new token; returning True stops
    early (e.g. a stop string matched). `hooks`: calls around every step (batching.StepHooks).
    `speculator`: speculative decoding (speculative.py), the same tokens in fewer steps."""
    check_prompt(prompt_ids, engine.config.vocab, engine.context, max_new_tokens)
    recovered_before = len(engine.recoveries)
    runner = BatchRunner(engine, 1, hooks, speculator)
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
