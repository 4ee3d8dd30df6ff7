"""What speculative decoding is asked to do, checked. Free of torch (like sampling_params.py), so the
command line refuses a bad value before torch or any worker loads; speculative.py runs it.

Speculative decoding on the user's side (docs/speculative.md): the client proposes up to K tokens
at no network cost, and one sharded forward over the last token plus the K proposals verifies them
all, at the same number of exchanges as one token. Names follow vLLM's speculative config:

    method                  "ngram" (prompt lookup: no model, drafts from the session's own
                            tokens, prompt included), "suffix" (SuffixDecoding: suffix tries over
                            the session's tokens and over earlier outputs of the job, drafts
                            scored by frequency, as long as the match earns) or "draft_model" (a
                            small model on the client)
    num_speculative_tokens  K, the most tokens proposed per step (the adaptive length stays at or
                            under it)
    prompt_lookup_max/min   the longest and shortest n-gram the n-gram drafter matches
    draft_model             the draft model's path (HF directory or GGUF), run in the clear on the
                            client: it is the user's own machine
    suffix_*                vLLM's suffix_decoding_* options: the tries' depth, draft size per matched
                            token (factor) plus offset, the least estimated probability a draft
                            token keeps, and the global cache's size (here in tokens, not requests:
                            what it holds is what it costs; 0: no global cache)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 64  # more proposals than this never pay: every one must be accepted in turn
# --speculative suffix without --num-speculative-tokens: its drafts are sized by the match length
# (factor 1: as many tokens as matched), so the cap is only a cap
SUFFIX_DEFAULT_TOKENS = 32
SUFFIX_CACHE_TOKENS = 8192  # the global cache's default size; a trie costs up to max_depth nodes per token


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
    suffix_max_depth: int = 64  # the longest substring a trie holds: a match of m proposes <= depth - m
    # vLLM's defaults are factor 1 (as many tokens as matched) and 0.1. Replayed offline over both bench
    # workloads' greedy outputs (bench/replay.py, docs/speculative.md), a larger tree of likelier-than-2 %
    # tokens raised tokens per forward (grounded 2.30 -> 2.42 at 21 ms with the cost budget): where a
    # column is cheap, the cost budget (StepCost), not the match length, is what should size the tree
    suffix_max_spec_factor: float = 16.0
    suffix_max_spec_offset: float = 0.0
    suffix_min_token_prob: float = 0.02
    suffix_cache_tokens: int = SUFFIX_CACHE_TOKENS
    # the link the workers are reached over, when the job's own steps do not show it (a plan made on
    # loopback for a wide-area deployment): its round trip (ms) and rate (Mbit/s), both or neither
    # (tree_cost.LinkCost; the loop adds them to the compute it measures)
    link_rtt_ms: float | None = None
    link_mbps: float | None = None

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
        if not 2 <= self.suffix_max_depth <= 4096:
            raise SpeculativeError(f"the suffix trie's depth must be in [2, 4096], got {self.suffix_max_depth}")
        if not (self.suffix_max_spec_factor >= 0 and self.suffix_max_spec_offset > -1e6):
            raise SpeculativeError("the suffix draft size's factor must be >= 0")
        if not 0 <= self.suffix_min_token_prob <= 1:
            raise SpeculativeError(
                f"the suffix drafts' least probability must be in [0, 1], got {self.suffix_min_token_prob}"
            )
        if self.suffix_cache_tokens < 0:
            raise SpeculativeError(f"--suffix-cache-tokens must be >= 0, got {self.suffix_cache_tokens}")
        if (self.link_rtt_ms is None) != (self.link_mbps is None):
            raise SpeculativeError("--link-rtt-ms and --link-mbps go together (a link has a round trip and a rate)")
        if self.link_rtt_ms is not None and not (0 <= self.link_rtt_ms < 1e5 and 0 < self.link_mbps < 1e7):  # type: ignore[operator]
            raise SpeculativeError(
                f"--link-rtt-ms must be in [0, 1e5) and --link-mbps in (0, 1e7), got {self.link_rtt_ms}, {self.link_mbps}"
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
        elif self.method == "suffix":
            out |= {
                "suffix_max_depth": self.suffix_max_depth,
                "suffix_max_spec_factor": self.suffix_max_spec_factor,
                "suffix_max_spec_offset": self.suffix_max_spec_offset,
                "suffix_min_token_prob": self.suffix_min_token_prob,
                "suffix_cache_tokens": self.suffix_cache_tokens,
            }
        else:
            out["draft_model"] = self.draft_model
        if self.link_rtt_ms is not None:
            out |= {"link_rtt_ms": self.link_rtt_ms, "link_mbps": self.link_mbps}
        return out


def from_flags(
    method: str | None,
    draft_model: str | None,
    num_tokens: int | None,
    suffix_cache_tokens: int | None = None,
    link: tuple[float | None, float | None] = (None, None),
) -> SpeculativeConfig | None:
    """The command line's `--speculative METHOD`, `--draft-model PATH`, `--num-speculative-tokens K` and
    `--suffix-cache-tokens N`: None when speculation is off. `--draft-model` alone means the
    draft_model method; a flag another method's (e.g. `--draft-model` with suffix) is refused."""
    if method is None and draft_model is None:
        if num_tokens is not None:
            raise SpeculativeError("--num-speculative-tokens needs --speculative ngram|suffix or --draft-model PATH")
        if suffix_cache_tokens is not None:
            raise SpeculativeError("--suffix-cache-tokens needs --speculative suffix")
        if link != (None, None):
            raise SpeculativeError("--link-rtt-ms and --link-mbps size speculative drafts: they need --speculative")
        return None
    method = method or "draft_model"
    if method not in METHODS:
        raise SpeculativeError(f"unknown speculative method {method!r}: choose one of {', '.join(METHODS)}")
    if method == "draft_model" and draft_model is None:
        raise SpeculativeError("--speculative draft_model needs --draft-model PATH")
    if suffix_cache_tokens is not None and method != "suffix":
        raise SpeculativeError(f"--suffix-cache-tokens is for --speculative suffix, not {method}")
    kw: dict = {} if num_tokens is None else {"num_speculative_tokens": num_tokens}
    kw["link_rtt_ms"], kw["link_mbps"] = link
    if method == "suffix":
        kw.setdefault("num_speculative_tokens", SUFFIX_DEFAULT_TOKENS)
        if suffix_cache_tokens is not None:
            kw["suffix_cache_tokens"] = suffix_cache_tokens
    return SpeculativeConfig(method=method, draft_model=draft_model, **kw)
