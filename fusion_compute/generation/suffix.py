"""SuffixDecoding's drafter (`--speculative suffix`): drafts from suffix tries over the session's own
tokens (prompt and output so far) and over earlier outputs of the same job (a bounded global cache,
shared by the sessions of one engine: a `fusion serve` keeps it from request to request).

Each step both tries grow a draft from every match length m (the session's last m tokens a node of
the trie: `SuffixTrie.drafts`; draft size min(K, factor · m + offset), for a greedy session also at
most what pays at the job's step cost for a match of m (`sizing`, suffix_size.py), tokens kept while their
estimated probability, a product of frequencies, is at least min_prob; in the session's own trie
the frequencies leave out the match's last occurrence, the session's end, which has not gone on).
`propose` gives the chain with the highest score over both tries (ties: the session's own).
`propose_tree` merges them all into one token tree of at most K tokens: the draft `propose` would
choose, whole, then the others by score (ties: the session's trie, then the longer match), each
adding the paths not in the tree yet under the paths they extend, until K. Where the longest match
goes one way and a shorter match, or the other trie, another, both are verified in the same
forward; the best draft comes first, so a cost budget that keeps the tree's first columns (the
loop's) keeps it before the alternatives. Replayed over the bench's grounded outputs
(docs/speculative.md, "Where the suffix drafter loses"), the merged tree took τ from 2.46 to 2.61
at a 21 ms link, almost all of it from verifying the global cache's draft beside the session's
where one of them alone was before, and leaving the session's end out of its frequencies took it
to 2.62 (1.59 to 1.70 at 0.1 ms, where the budget reads the estimates).

The global cache holds finished sessions' outputs (never prompts), at most `cache_tokens` tokens:
the oldest outputs are evicted first. Its drafts are the user's own earlier outputs, computed on the
client like every draft; what a worker can see is the step's width and, from the next step's
position, how many were accepted: a request that repeats an earlier output is accepted in long runs
(docs/speculative.md). `cache_tokens=0` keeps no cache.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from .suffix_size import MatchSizing
from .suffix_tree import TIE, Draft, SuffixTrie

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
        merge: bool = True,
        sizing: MatchSizing | None = None,
    ):
        self.cache = cache
        # the most tokens a match of m may draft beside factor · m: what pays at the job's step cost
        # (suffix_size.MatchSizing; None: the factor alone, as for a sampled session)
        self.sizing = sizing
        self.merge = merge  # trees: every match length's draft from both tries, merged (False: the best one)
        self.factor, self.offset, self.min_prob = factor, offset, min_prob
        self.trie = SuffixTrie(max_depth)
        self.tokens: list[int] = []
        self.last: Draft | None = None  # the last draft proposed (for the counters: its match length)
        self._building: threading.Thread | None = None  # `start`'s trie over the prompt, until joined
        self._failed: BaseException | None = None  # what stopped it, raised where the trie is next read

    def start(self, prompt: Sequence[int]) -> None:
        """Build the session's trie over its prompt on a thread while the prompt's prefill runs (the
        client mostly waits on the workers then). Built at the first draft instead, it added ~0.1 s to
        the first decode step of a batch of 8 prompts of ~150 tokens (depth 64: ~60,000 nodes; profiled
        on this project's 2-core machine), serial with the workers. The trie is the one `_sync` would
        build: the same tokens extended in the same order. Every reader joins it first (`_join`). Where
        no thread can be started, nothing is built here, and the first draft builds it."""
        tokens = list(prompt)

        def build() -> None:
            try:
                self._sync(tokens)
            except BaseException as e:  # re-raised where the session next reads its trie
                self._failed = e

        thread = threading.Thread(target=build, name="fusion-suffix-trie", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (the process at its limit): the first draft builds it
            return  # (`draft` syncs the trie with the session's tokens, the prompt included, as before)
        self._building = thread  # (kept only once started: no close waits on a thread never started)

    def _join(self, raise_failed: bool = True) -> None:
        if self._building is not None:
            self._building.join()
            self._building = None
        failed, self._failed = self._failed, None
        if failed is not None and raise_failed:
            raise failed

    def _sync(self, tokens: Sequence[int]) -> None:
        n = len(self.tokens)
        if len(tokens) >= n and list(tokens[:n]) == self.tokens:
            self.trie.extend(SESSION, tokens[n:])  # the usual case: the session grew
        else:  # anything else (not reached by the loop, whose sessions only grow): start over
            self.trie = SuffixTrie(self.trie.max_depth)
            self.trie.extend(SESSION, tokens)
        self.tokens = list(tokens)

    def draft(self, tokens: Sequence[int], k: int, tree: bool) -> Draft:
        self._join()
        self._sync(tokens)
        if k < 1:
            return Draft()
        context = tokens[-(self.trie.max_depth - 1) :]
        args = (k, self.factor, self.offset, self.min_prob, tree)
        cap = self.sizing.caps() if self.sizing is not None else None
        if tree and self.merge:
            best = self._merged(context, k, args, cap)
        else:
            best = self.trie.speculate(context, *args, own=True, cap=cap, ends=self.trie.suffix_nodes(SESSION))
            if self.cache is not None and len(self.cache):
                other = self.cache.trie.speculate(context, *args, cap=cap)
                if other.score > best.score:
                    best = other
                    best.from_cache = True
        self.last = best
        return best

    def _merged(
        self,
        context: Sequence[int],
        k: int,
        args: tuple[int, float, float, float, bool],
        cap: Callable[[int], int] | None = None,
    ) -> Draft:
        """Every match length's draft from both tries, as one tree of at most k tokens: the draft
        `propose` would choose first, then each other one by its score (ties: the session's trie, then
        the longer match), its paths not yet in the tree added below the paths they extend."""
        drafts = self.trie.drafts(context, *args, own=True, cap=cap, ends=self.trie.suffix_nodes(SESSION))
        if self.cache is not None and len(self.cache):
            for d in self.cache.trie.drafts(context, *args, cap=cap):
                d.from_cache = True
                drafts.append(d)
        if not drafts:
            return Draft()
        # the first: the draft `propose` would choose (each trie's best as `speculate` picks it, the
        # session's unless the cache's scores higher); the drafts are the session's, then the cache's,
        # each by match length, shortest first
        best = {False: -1, True: -1}
        for i, d in enumerate(drafts):
            b = best[d.from_cache]
            if b < 0 or d.score >= drafts[b].score - TIE:
                best[d.from_cache] = i
        own, cached = best[False], best[True]
        first = cached if own < 0 or (cached >= 0 and drafts[cached].score > drafts[own].score) else own
        rest = sorted(drafts[:first] + drafts[first + 1 :], key=lambda d: (-d.score, d.from_cache, -d.match_len))
        drafts = [drafts[first], *rest]
        out = Draft(match_len=drafts[0].match_len, from_cache=drafts[0].from_cache)
        index: dict[tuple[int, ...], int] = {}  # a path below the session's last token -> its column in out
        for d in drafts:
            paths: list[tuple[int, ...]] = []  # d's own, by d's index (its parents come first)
            for t, parent, prob in zip(d.tokens, d.parents, d.probs, strict=True):
                path = (*(paths[parent] if parent >= 0 else ()), t)
                paths.append(path)
                if path in index:
                    continue  # an earlier draft proposed it already
                if len(out.tokens) >= k:
                    return out
                above = index[path[:-1]] if len(path) > 1 else -1
                # the estimate another match gave the parent may be lower: a path is never likelier than its prefix
                index[path] = out.add(t, above, min(prob, out.probs[above]) if above >= 0 else prob)
        return out

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The best path of at most k tokens (a chain)."""
        return self.draft(tokens, k, tree=False).tokens

    def propose_tree(self, tokens: list[int], k: int) -> Draft:
        """A token tree of at most k tokens."""
        return self.draft(tokens, k, tree=True)

    def verified(self, depth: int, accepted: int) -> None:
        """The loop verified this session's last draft (cut to a tree `depth` deep) and accepted
        `accepted` of its drafts: what its match length earned, for the job's caps."""
        if self.sizing is not None and self.last is not None:
            self.sizing.add(self.last.match_len, depth, accepted)

    def close(self, output: Sequence[int] | None = None) -> None:
        """The session is over; `output` (its generated tokens, when it ended well) joins the global cache."""
        self._join(raise_failed=False)  # a trie that failed to build goes with the session
        if output is not None and self.cache is not None:
            self.cache.add(output)
        self.trie = SuffixTrie(self.trie.max_depth)
        self.tokens = []
