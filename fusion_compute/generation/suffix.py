"""SuffixDecoding's drafter (`--speculative suffix`): drafts from suffix tries over the session's own
tokens (prompt and output so far) and over earlier outputs of the same job (a bounded global cache,
shared by the sessions of one engine: a `fusion serve` keeps it from request to request).

Each step both tries answer `SuffixTrie.speculate` for the session's tokens (the longest useful
match, draft size min(K, factor · match length + offset), tokens kept while their estimated
probability, a product of frequencies, is at least min_prob) and the higher-scoring draft is
proposed (ties: the session's own). `propose` gives the best path (a chain, what the linear verify
step checks); `propose_tree` the token tree (parents per token).

The global cache holds finished sessions' outputs (never prompts), at most `cache_tokens` tokens:
the oldest outputs are evicted first. Its drafts are the user's own earlier outputs, computed on the
client like every draft; what a worker can see is the step's width and, from the next step's
position, how many were accepted: a request that repeats an earlier output is accepted in long runs
(docs/speculative.md). `cache_tokens=0` keeps no cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .suffix_tree import Draft, SuffixTrie

SESSION = 0  # the session trie's one sequence


class SuffixCache:
    """The global trie over finished outputs, bounded in tokens (oldest out first)."""

    def __init__(self, max_depth: int, cache_tokens: int):
        self.trie = SuffixTrie(max_depth)
        self.cache_tokens = cache_tokens
        self._order: deque[int] = deque()
        self._next_id = 0

    def add(self, output: Sequence[int]) -> None:
        if self.cache_tokens <= 0 or not output:
            return
        output = list(output)[-self.cache_tokens :]  # one output longer than the cache: its end
        while self._order and len(self.trie) + len(output) > self.cache_tokens:
            self.trie.remove(self._order.popleft())
        self.trie.extend(self._next_id, output)
        self._order.append(self._next_id)
        self._next_id += 1

    def __len__(self) -> int:
        return len(self.trie)


class SuffixDrafter:
    """One session's suffix drafts (module docstring); `close` hands its output to the global cache
    when the session ended well."""

    def __init__(
        self,
        cache: SuffixCache | None,
        max_depth: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
    ):
        self.cache = cache
        self.factor, self.offset, self.min_prob = factor, offset, min_prob
        self.trie = SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self.last: Draft | None = None  # the last draft proposed (for the counters: its match length)

    def _sync(self, tokens: Sequence[int]) -> None:
        n = len(self.tokens)
        if len(tokens) >= n and list(tokens[:n]) == self.tokens:
            self.trie.extend(SESSION, tokens[n:])  # the usual case: the session grew
        else:  # anything else (not reached by the loop, whose sessions only grow): start over
            self.trie = SuffixTrie(self.trie.max_depth)
            self.trie.extend(SESSION, tokens)
        self.tokens = list(tokens)

    def draft(self, tokens: Sequence[int], k: int, tree: bool) -> Draft:
        self._sync(tokens)
        if k < 1:
            return Draft()
        context = tokens[-(self.trie.max_depth - 1) :]
        args = (k, self.factor, self.offset, self.min_prob, tree)
        best = self.trie.speculate(context, *args)
        if self.cache is not None and len(self.cache):
            other = self.cache.trie.speculate(context, *args)
            if other.score > best.score:
                best = other
        self.last = best
        return best

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The best path of at most k tokens (a chain)."""
        return self.draft(tokens, k, tree=False).tokens

    def propose_tree(self, tokens: list[int], k: int) -> Draft:
        """A token tree of at most k tokens."""
        return self.draft(tokens, k, tree=True)

    def close(self, output: Sequence[int] | None = None) -> None:
        """The session is over; `output` (its generated tokens, when it ended well) joins the global cache."""
        if output is not None and self.cache is not None:
            self.cache.add(output)
        self.trie = SuffixTrie(self.trie.max_depth)
        self.tokens = []
