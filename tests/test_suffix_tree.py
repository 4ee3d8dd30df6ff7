"""The suffix trie and SuffixDecoding's drafts (issue 43), against a brute-force matcher that scans
the raw sequences: every substring's count, the chain (most frequent continuation, ties to the most
recent) and the tree (the `room` likeliest continuations, their probability count(uv) / count(u)),
the match length chosen by score, after sequences were added and evicted. Random sequences over a
small alphabet (hypothesis), so that substrings recur, branch and tie."""

from __future__ import annotations

import math
import threading

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

    def continuations(self, u: tuple[int, ...], less: int = 0) -> dict[tuple[int, ...], float]:
        """Every v with uv in the trie's reach: probability count(uv) / (count(u) - less) (less = 1:
        u's last occurrence, the session's own end, left out)."""
        out: dict[tuple[int, ...], float] = {}
        frontier = [()]
        alphabet = {t for seq in self.seqs.values() for t, _ in seq}
        while frontier:
            v = frontier.pop()
            for t in alphabet:
                w = (*v, t)
                c = self.count(u + w)
                if c:
                    out[w] = c / max(1, self.count(u) - less)
                    frontier.append(w)
        return out

    def path(self, u: tuple[int, ...], room: int, min_prob: float, less: int = 0) -> list[int]:
        v: tuple[int, ...] = ()
        while len(v) < room:
            kids = [(self.count(u + v + (t,)), max(self.occurrences(u + v + (t,)), default=-1), t) for t in range(10)]
            kids = [k for k in kids if k[0]]
            if not kids:
                break
            c, _, t = max(kids)
            if c / max(1, self.count(u) - less) < min_prob:
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


def brute_check(
    brute: Brute, ctx: list[int], d, depth: int, k: int, min_prob: float, tree: bool, less: int = 0
) -> None:
    """Draft d, grown from the match of length d.match_len, is the brute-force matcher's: a chain the
    most frequent path, a tree the likeliest continuations best first (nothing likelier left out)."""
    u = tuple(ctx[len(ctx) - d.match_len :])
    room = min(k, d.match_len + 3, depth - d.match_len)
    if not tree:
        assert d.is_chain() and d.tokens == brute.path(u, room, min_prob, less)
        return
    cont = brute.continuations(u, less)
    chosen = draft_strings(d.tokens, d.parents)
    assert len(set(chosen)) == len(chosen) and len(chosen) <= room
    for v, p in zip(chosen, d.probs, strict=True):
        assert math.isclose(p, cont[v], rel_tol=1e-9) and p >= min_prob
    left = [p for v, p in cont.items() if v not in chosen and p >= min_prob]
    assert not left or (len(chosen) == room and max(left) <= min(d.probs) + 1e-12)


@settings(max_examples=80, deadline=None)
@given(
    seqs=seqs_st,
    depth=st.integers(2, 6),
    ctx=st.lists(st.integers(0, 3), max_size=8),
    tree=st.booleans(),
    own=st.booleans(),
)
def test_every_match_length_drafts_as_brute_force(seqs, depth, ctx, tree, own):
    """`SuffixTrie.drafts`: one draft per match length m whose last m context tokens occur and that has
    a continuation of probability >= min_prob, shortest match first, each the brute-force one. `own`:
    the context is the last sequence's end (a session drafting from its own trie), and that
    occurrence of every match, which has no continuation yet, is left out of the frequencies."""
    trie, brute = SuffixTrie(depth), Brute(depth)
    for sid, s in enumerate(seqs):
        trie.extend(sid, s)
        brute.extend(sid, s)
    if own:
        ctx = seqs[-1][-8:]
    drafts = trie.drafts(ctx, 5, 1.0, 3.0, 0.2, tree, own)
    if own:  # the session's own suffixes' nodes, as extend keeps them, draft the same as the lookups
        ends = trie.suffix_nodes(len(seqs) - 1)
        assert [ends[m - 1] is trie.node(seqs[-1][len(seqs[-1]) - m :]) for m in range(1, len(ends) + 1)] == [
            True
        ] * len(ends)
        assert len(ends) == min(len(seqs[-1]), depth - 1)
        assert trie.drafts(ctx, 5, 1.0, 3.0, 0.2, tree, own, ends=ends) == drafts
    want = []
    for m in range(1, min(len(ctx), depth - 1) + 1):
        u = tuple(ctx[len(ctx) - m :])
        if not brute.count(u):
            break
        if any(len(v) == 1 and p >= 0.2 for v, p in brute.continuations(u, int(own)).items()):
            want.append(m)
    assert [d.match_len for d in drafts] == want
    for d in drafts:
        brute_check(brute, ctx, d, depth, 5, 0.2, tree, int(own))


def paths_of(d) -> list[tuple[int, ...]]:
    return draft_strings(d.tokens, d.parents)


@settings(max_examples=60, deadline=None)
@given(
    session=st.lists(st.integers(0, 3), min_size=1, max_size=24),
    cached=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=16), max_size=2),
    depth=st.integers(3, 7),
    k=st.integers(1, 12),
)
def test_the_tree_merges_every_match_length_and_both_tries(session, cached, depth, k):
    """`propose_tree`: the draft `propose`'s rule picks (the best match, session or cache) as its first
    columns, then every other match length's and the other trie's paths, by score, until k columns;
    each path one that some match's brute-force continuations hold with its probability or less."""
    cache = SuffixCache(depth, cache_tokens=1000)
    sessions, caches = Brute(depth), Brute(depth)
    for i, out in enumerate(cached):
        cache.add(out)
        caches.extend(i, out)
    sessions.extend(0, session)
    args = dict(max_depth=depth, factor=1.0, offset=3.0, min_prob=0.2)
    merged = SuffixDrafter(cache, **args).propose_tree(session, k)
    single = SuffixDrafter(cache, merge=False, **args).propose_tree(session, k)
    # the first columns: the single best draft, as it was
    assert merged.tokens[: len(single.tokens)] == single.tokens
    assert merged.parents[: len(single.parents)] == single.parents
    assert (merged.match_len, merged.from_cache) == (single.match_len, single.from_cache)
    # the union of every match length's paths, in both tries, up to k
    ctx = session[-(depth - 1) :]
    own = SuffixTrie(depth)
    own.extend(0, session)
    every = own.drafts(ctx, k, 1.0, 3.0, 0.2, True, own=True) + cache.trie.drafts(ctx, k, 1.0, 3.0, 0.2, True)
    union = {v for d in every for v in paths_of(d)}
    got = paths_of(merged)
    assert len(set(got)) == len(got) == min(k, len(union)) and set(got) <= union
    # each path's probability: at most what any match gives it, and what one match gives it exactly
    # when it came from that match (never above its parent's)
    for v, p, parent in zip(got, merged.probs, merged.parents, strict=True):
        ests = [  # the session's own trie leaves its last occurrence of the match out
            b.count(tuple(ctx[len(ctx) - m :]) + v) / max(1, b.count(tuple(ctx[len(ctx) - m :])) - (b is sessions))
            for b in (sessions, caches)
            for m in range(1, min(len(ctx), depth - 1) + 1)
            if b.count(tuple(ctx[len(ctx) - m :])) and len(v) <= min(k, m + 3, depth - m)
        ]
        assert p >= 0.2 - 1e-12 and any(p <= e + 1e-12 for e in ests)
        assert parent < 0 or p <= merged.probs[parent] + 1e-12


def test_a_tree_verifies_a_shorter_match_and_the_cache_beside_the_best():
    """Where the longest match continues one way (1 2 -> 3 5) and the shorter match (2 -> 4, three
    times) or the global cache (2 -> 8) another, the tree carries all three at its root, the best
    match's path first; the single-match tree (merge=False, as before) carried the best alone."""
    cache = SuffixCache(16, cache_tokens=100)
    cache.add([2, 8, 9])
    session = [1, 2, 3, 5, 6, 2, 4, 7, 2, 4, 9, 2, 4, 1, 2]
    args = dict(max_depth=16, factor=1.0, offset=0.0, min_prob=0.1)
    merged = SuffixDrafter(cache, **args).propose_tree(session, 8)
    single = SuffixDrafter(cache, merge=False, **args).propose_tree(session, 8)
    assert (single.tokens, single.parents, single.match_len) == ([3, 5], [-1, 0], 2)
    assert merged.tokens[:2] == [3, 5] and merged.parents[:2] == [-1, 0]
    roots = {t for t, p in zip(merged.tokens, merged.parents, strict=True) if p < 0}
    assert roots == {3, 4, 8}
    # 3 of the session's 4 earlier 2s went on with 4 (its fifth, the session's end, has not gone on yet)
    assert merged.probs[merged.tokens.index(4)] == pytest.approx(3 / 4)
    # a chain stays the single best path
    assert SuffixDrafter(cache, **args).propose(session, 8) == [3, 5]


@settings(max_examples=60, deadline=None)
@given(
    seqs=seqs_st,
    depth=st.integers(2, 6),
    ctx=st.lists(st.integers(0, 3), max_size=8),
    run=st.lists(st.integers(0, 3), max_size=6),
)
def test_reach_matches_brute_force(seqs, depth, ctx, run):
    """bench.replay.reach: per match length m, the longest prefix of `run` that follows the context's
    last m tokens somewhere in the sequences (at most depth - m), by brute force."""
    from fusion_compute.bench.replay import reach

    trie, brute = SuffixTrie(depth), Brute(depth)
    for sid, s in enumerate(seqs):
        trie.extend(sid, s)
        brute.extend(sid, s)
    want = []
    for m in range(1, min(len(ctx), depth - 1) + 1):
        u = tuple(ctx[len(ctx) - m :])
        if not brute.count(u):
            break
        j = 0
        while j < min(len(run), depth - m) and brute.count(u + tuple(run[: j + 1])):
            j += 1
        want.append(j)
    assert reach(trie, ctx, run) == want


def test_a_merged_path_is_never_likelier_than_its_prefix():
    """A path another match added below a column keeps at most that column's probability: after
    1 3 1 3 1 3 3 1 the best draft (the match of 1: one of its three earlier occurrences went on 3 3)
    puts in 3 3 at 1/3, and the match 3 1 (one of its two earlier occurrences went on 3 3 1) gives
    3 3 1 below it 1/2: it gets 1/3 (the budget divides a column's probability by its parent's for a
    frequency, which must stay <= 1)."""
    d = SuffixDrafter(None, max_depth=6, factor=1.0, offset=3.0, min_prob=0.2).propose_tree([1, 3, 1, 3, 1, 3, 3, 1], 8)
    assert (d.tokens, d.parents) == ([3, 1, 3, 3, 1], [-1, 0, 1, 0, 3])
    assert d.probs == pytest.approx([1, 2 / 3, 2 / 3, 1 / 3, 1 / 3])


def test_replay_names_why_a_step_fell_short():
    """bench.replay.loss, one hand-made step per cause: after 1 2 3 9 2 4 1 2 the match 1 2 goes on
    with 3, the shorter match 2 with 3 or 4; the target's next token is 4."""
    from fusion_compute.bench.replay import loss
    from fusion_compute.generation.suffix_tree import Draft

    prompt, out = [1, 2, 3, 9, 2, 4], [1, 2]
    d = SuffixDrafter(None, max_depth=8)
    d.draft(prompt + out, 0, tree=True)  # the session's trie up to its last token

    def draft(tokens: list[int], m: int) -> Draft:
        x = Draft(match_len=m)
        for i, t in enumerate(tokens):
            x.add(t, i - 1, 1.0)
        return x

    assert loss(d, draft([4], 1), 1, 1, prompt, out, [4]) == ("ok", 0)
    assert loss(d, draft([4], 1), 1, 0, prompt, out, [4]) == ("budget", 1)  # the cut draft had it
    assert loss(d, draft([3], 2), 0, 0, prompt, out, [4]) == ("other m", 1)  # the match 2 held 4
    assert loss(d, draft([3], 1), 0, 0, prompt, out, [4]) == ("cut", 1)  # its own match held it
    assert loss(d, Draft(), 0, 0, prompt, out, [4]) == ("empty", 1)
    # 9 2 is in the session, but never after the session's last tokens (1 2, 2): the copy oracle's only
    assert loss(d, draft([3], 2), 0, 0, prompt, out, [9, 2]) == ("jump", 2)
    assert loss(d, Draft(), 0, 0, prompt, out, [7]) == ("ok", 0)  # nowhere: nothing was lost


def test_a_session_does_not_count_its_own_end_against_a_match():
    """After 5 6 7 5 the one earlier 5 went on with 6 7 5: probability 1, not 1/2 (the session's last 5
    has not gone on yet; counting it halved the estimates of every draft from the session's own trie
    against the cache's). A cached output's last 5 ended that output, and counts."""
    d = SuffixDrafter(None, max_depth=8, factor=4.0, min_prob=0.6).propose_tree([5, 6, 7, 5], 3)
    assert d.tokens == [6, 7, 5] and d.probs == pytest.approx([1, 1, 1]) and not d.from_cache
    cache = SuffixCache(8, cache_tokens=100)
    cache.add([5, 6, 7, 5])
    d = SuffixDrafter(cache, max_depth=8, factor=4.0, min_prob=0.4).propose_tree([9, 5], 3)
    assert d.tokens == [6, 7, 5] and d.probs == pytest.approx([1 / 2] * 3) and d.from_cache


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=16), st.lists(st.integers(0, 3), min_size=1, max_size=24)
        ),
        min_size=1,
        max_size=3,
    ),
    k=st.integers(1, 8),
    cache=st.booleans(),
    merge=st.booleans(),
)
def test_replayed_suffix_drafts_never_beat_the_trie_oracle(rows, k, cache, merge):
    """bench.replay.trie_oracle bounds every suffix draft: each is a path after a match of the
    session's last tokens in the session's trie or the cache's, so the replay's forwards are at least
    the oracle's, merged or not, with the global cache filling from session to session or without it;
    and the trie oracle needs at least the copy oracle's forwards without the cache."""
    from fusion_compute.bench.replay import copy_oracle, replay, trie_oracle
    from fusion_compute.generation.speculative_config import SpeculativeConfig

    rows_ = [{"prompt": p, "output": o} for p, o in rows]
    cfg = SpeculativeConfig("suffix", k, suffix_cache_tokens=8192 if cache else 0, suffix_max_depth=6)
    stats = replay(cfg, rows_, max_new=max(len(o) for _, o in rows), merge=merge)
    forwards, tokens = trie_oracle(rows_, 6, cfg.suffix_cache_tokens, k)
    assert tokens == stats.tokens and stats.forwards >= forwards
    if not cache:
        assert forwards >= sum(copy_oracle(p, o)[0] for p, o in rows)


def test_a_trie_started_on_the_prompt_drafts_as_one_built_at_the_first_draft():
    """SuffixDrafter.start: the session's trie over its prompt, built on a thread during the prefill,
    drafts exactly as the trie the first draft would have built (the same tokens in the same order);
    a build that failed is raised at the next draft, and dropped with the session at close."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6] * 4
    out = [7, 8, 5, 6, 7]
    started, lazy = SuffixDrafter(None, 16, 4.0), SuffixDrafter(None, 16, 4.0)
    started.start(prompt)
    started._join()  # what the first draft does first: the prompt is in the trie before it
    assert started.tokens == prompt and len(started.trie) == len(prompt) and len(lazy.trie) == 0
    for i in range(1, len(out) + 1):
        a, b = started.propose_tree(prompt + out[:i], 8), lazy.propose_tree(prompt + out[:i], 8)
        assert (a.tokens, a.parents, a.probs) == (b.tokens, b.parents, b.probs) and a.tokens
    assert started.trie._serial == lazy.trie._serial and started._building is None

    broken = SuffixDrafter(None, 16, 4.0)
    broken.start([[1]])  # an unhashable token: the build fails on its thread
    with pytest.raises(TypeError):
        broken.propose_tree(prompt, 8)
    again = SuffixDrafter(None, 16, 4.0)
    again.start([[1]])
    again.close()  # the failure goes with the session
    assert again._failed is None and again._building is None


def test_a_trie_whose_thread_cannot_start_is_built_at_the_first_draft(monkeypatch):
    """A process at its thread limit (threading.Thread.start raises RuntimeError, "can't start new
    thread"): SuffixDrafter.start leaves the trie to the first draft instead of failing the session's
    admission, and that draft proposes what a drafter whose thread ran proposes."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6] * 4
    started = SuffixDrafter(None, 16, 4.0)
    started.start(prompt)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    starved = SuffixDrafter(None, 16, 4.0)
    starved.start(prompt)  # no error: nothing is built yet
    assert starved._building is None and len(starved.trie) == 0
    a, b = started.propose_tree(prompt + [7], 8), starved.propose_tree(prompt + [7], 8)
    assert (a.tokens, a.parents, a.probs) == (b.tokens, b.parents, b.probs) and a.tokens
    starved.close()
