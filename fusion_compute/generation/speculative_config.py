"""What speculative decoding is asked to do, checked. Free of torch (like sampling_params.py), so the
command line refuses a bad value before torch or any worker loads; speculative.py runs it.

Speculative decoding on the user's side (docs/speculative.md): the client proposes up to K tokens
at no network cost, and one sharded forward over the last token plus the K proposals verifies them
all, at the same number of exchanges as one token. Names follow vLLM's speculative config:

    method                  "ngram" (prompt lookup: no model, drafts from the session's own
                            tokens, prompt included) or "draft_model" (a small model on the client)
    num_speculative_tokens  K, the most tokens proposed per step (the adaptive length stays at or
                            under it)
    prompt_lookup_max/min   the longest and shortest n-gram the n-gram drafter matches
    draft_model             the draft model's path (HF directory or GGUF), run in the clear on the
                            client: it is the user's own machine
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 64  # more proposals than this never pay: every one must be accepted in turn


class SpeculativeError(UsageError, ValueError):
    pass


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_model: str | None = None
    adaptive: bool = True  # the draft length follows acceptance (speculative.DraftLength); False: always K

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeError(f"unknown speculative method {self.method!r}: choose one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpeculativeError(
                f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, got min {self.prompt_lookup_min}, "
                f"max {self.prompt_lookup_max}"
            )
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise SpeculativeError(
                "the draft_model method needs --draft-model PATH"
                if self.method == "draft_model"
                else f"--draft-model is for the draft_model method, not {self.method}"
            )

    def check_context(self, context: int) -> None:
        """K plus the token it rides with must fit the session's KV context."""
        if self.num_speculative_tokens + 1 > context:
            raise SpeculativeError(
                f"--num-speculative-tokens {self.num_speculative_tokens} does not fit the context of {context} positions"
            )

    def describe(self) -> dict:
        out: dict = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out |= {"prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        else:
            out["draft_model"] = self.draft_model
        return out


def from_flags(method: str | None, draft_model: str | None, num_tokens: int | None) -> SpeculativeConfig | None:
    """The command line's `--speculative METHOD`, `--draft-model PATH` and `--num-speculative-tokens K`:
    None when speculation is off. `--draft-model` alone means the draft_model method."""
    if method is None and draft_model is None:
        if num_tokens is not None:
            raise SpeculativeError("--num-speculative-tokens needs --speculative ngram or --draft-model PATH")
        return None
    method = method or "draft_model"
    if method == "draft_model" and draft_model is None:
        raise SpeculativeError("--speculative draft_model needs --draft-model PATH")
    kw = {} if num_tokens is None else {"num_speculative_tokens": num_tokens}
    return SpeculativeConfig(method=method, draft_model=draft_model, **kw)
