"""The suffix trie and SuffixDecoding's drafts (issue 43), against a brute-force matcher that scans
the raw sequences: every substring's count, the chain (most frequent continuation, ties to the most
recent) and the tree (the `room` likeliest continuations, their probability count(uv) / count(u)),
the match length chosen by score, after sequences were added and evicted. Random sequences over a
small alphabet (hypothesis), so that substrings recur, branch and tie."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusion_compute.generation.suffix import SuffixCache, SuffixDrafter
from fusion_compute.generation.suffix_tree import SuffixTrie


class Brute:
    """The sequences as lists, each token with the serial it was added under (its recency)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.seqs: dict[int, list[tuple[int, int]]] = {}
        self.serial = 0

    def extend(self, sid: int, toks: list[int]) -> None:
        for t in toks:
            self.serial += 1
            self.seqs.setdefault(sid, []).append((t, self.serial))

    def occurrences(self, u: tuple[int, ...]) -> list[int]:
        """The serial of the token ending each occurrence of u."""
        out = []
        for seq in self.seqs.values():
            toks = [t for t, _ in seq]
            for i in range(len(toks) - len(u) + 1):
                if tuple(toks[i : i + len(u)]) == u:
                    out.append(seq[i + len(u) - 1][1])
        return out

    def count(self, u: tuple[int, ...]) -> int:
        return len(self.occurrences(u)) if len(u) <= self.depth else 0

    def continuations(self, u: tuple[int, ...]) -> dict[tuple[int, ...], float]:
        """Every v with uv in the trie's reach: probability count(uv) / count(u)."""
        out: dict[tuple[int, ...], float] = {}
        frontier = [()]
        alphabet = {t for seq in self.seqs.values() for t, _ in seq}
        while frontier:
            v = frontier.pop()
            for t in alphabet:
                w = (*v, t)
                c = self.count(u + w)
                if c:
                    out[w] = c / self.count(u)
                    frontier.append(w)
        return out

    def path(self, u: tuple[int, ...], room: int, min_prob: float) -> list[int]:
        v: tuple[int, ...] = ()
        while len(v) < room:
            kids = [(self.count(u + v + (t,)), max(self.occurrences(u + v + (t,)), default=-1), t) for t in range(10)]
            kids = [k for k in kids if k[0]]
            if not kids:
                break
            c, _, t = max(kids)
            if c / self.count(u) < min_prob:
                break
            v = (*v, t)
        return list(v)


def draft_strings(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for t, p in zip(tokens, parents, strict=True):
        assert p < len(out)  # a parent comes before its children
        out.append((*(out[p] if p >= 0 else ()), t))
    return out


seqs_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(seqs=seqs_st, depth=st.integers(2, 6), evict=st.integers(0, 2), ctx=st.lists(st.integers(0, 3), max_size=8))
def test_trie_matches_brute_force(seqs, depth, evict, ctx):
    trie, brute = SuffixTrie(depth), Brute(depth)
    for sid, s in enumerate(seqs):
        half = len(s) // 2  # added in two pieces, as a session grows
        for piece in (s[:half], s[half:]):
            trie.extend(sid, piece)
            brute.extend(sid, piece)
    for sid in range(min(evict, len(seqs) - 1)):  # the oldest sequences evicted
        trie.remove(sid)
        del brute.seqs[sid]
    assert len(trie) == sum(len(s) for s in brute.seqs.values())
    # every substring up to the depth, and one beyond it
    for seq in brute.seqs.values():
        toks = [t for t, _ in seq]
        for i in range(len(toks)):
            for j in range(i + 1, min(len(toks), i + depth + 1) + 1):
                u = tuple(toks[i:j])
                assert trie.count(u) == brute.count(u), u
    assert trie.count((9,)) == 0
    # no node survives at count 0
    stack = [trie.root]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.count > 0
            stack.append(child)

    min_prob = 0.2
    for tree in (False, True):
        d = trie.speculate(ctx, 5, 1.0, 3.0, min_prob, tree)
        scores = {}
        for m in range(1, min(len(ctx), depth - 1) + 1):
            u = tuple(ctx[len(ctx) - m :])
            if not brute.count(u):
                break
            room = min(5, m + 3, depth - m)
            if tree:
                probs = sorted((p for p in brute.continuations(u).values() if p >= min_prob), reverse=True)
                scores[m] = sum(probs[:room])
            else:
                v = brute.path(u, room, min_prob)
                scores[m] = sum(brute.count(u + tuple(v[: i + 1])) / brute.count(u) for i in range(len(v)))
        scores = {m: s for m, s in scores.items() if s > 0}
        if not scores:
            assert d.tokens == []
            continue
        best = max(scores.values())
        assert math.isclose(d.score, best, rel_tol=1e-9)
        assert d.match_len == max(m for m, s in scores.items() if math.isclose(s, best, rel_tol=1e-9))
        u = tuple(ctx[len(ctx) - d.match_len :])
        if not tree:
            assert d.is_chain() and d.tokens == brute.path(u, min(5, d.match_len + 3, depth - d.match_len), min_prob)
        else:
            cont = brute.continuations(u)
            chosen = draft_strings(d.tokens, d.parents)
            assert len(set(chosen)) == len(chosen)
            for v, p in zip(chosen, d.probs, strict=True):
                assert math.isclose(p, cont[v], rel_tol=1e-9) and p >= min_prob
            left = [p for v, p in cont.items() if v not in chosen and p >= min_prob]
            assert not left or max(left) <= min(d.probs) + 1e-12  # best-first: nothing likelier left out


def test_unlikely_continuations_stay_out_of_the_tree():
    t = SuffixTrie(6)
    t.extend(0, [0, 1, 0, 2, 0, 3, 0, 1, 0, 1, 0, 1, 0, 1])
    d = t.speculate([0], 5, 1.0, 4.0, 0.5, tree=True)  # room for 5, but only 1 (5/7) and 1,0 (4/7) are >= 0.5
    assert (d.tokens, d.parents) == ([1, 0], [-1, 0])
    assert d.probs == pytest.approx([5 / 7, 4 / 7])


def test_a_long_match_earns_a_long_draft_and_the_cache_serves_later_sessions():
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    d = SuffixDrafter(None, max_depth=32)
    # the session's tokens: the text once, then its first three tokens again
    assert d.propose(text + [1, 10, 11, 12], 16) == [13, 14, 15]  # match of 3: 3 tokens (factor 1)
    assert d.propose(text + [1, 10, 11, 12, 13, 14, 15], 16) == [16, 17, 18, 19, 20, 1]
    cache = SuffixCache(32, cache_tokens=100)
    first = SuffixDrafter(cache, max_depth=32)
    first.propose([1, 2], 4)
    first.close([5, 6, 7, 8, 9, 5, 6])  # its output joins the cache
    assert len(cache) == 7
    later = SuffixDrafter(cache, max_depth=32)
    assert later.propose([3, 5, 6, 7], 8) == [8, 9, 5]  # from the cache: nothing in its own tokens recurs
    failed = SuffixDrafter(cache, max_depth=32)
    failed.close(None)  # a session that failed adds nothing
    assert len(cache) == 7


def test_the_cache_keeps_its_bound_oldest_out():
    cache = SuffixCache(8, cache_tokens=10)
    cache.add([1, 2, 3, 4])
    cache.add([5, 6, 7, 8])
    assert len(cache) == 8
    cache.add([9, 9, 9])  # 11 > 10: the oldest goes
    assert len(cache) == 7 and cache.trie.count([1, 2]) == 0 and cache.trie.count([5, 6]) == 1
    cache.add(list(range(30, 50)))  # longer than the cache: its last 10 tokens
    assert len(cache) == 10 and cache.trie.count([49]) == 1 and cache.trie.count([30]) == 0
    off = SuffixCache(8, cache_tokens=0)
    off.add([1, 2, 3])
    assert len(off) == 0


def test_depth_below_two_is_refused():
    with pytest.raises(ValueError, match="depth"):
        SuffixTrie(1)
