"""A bounded suffix trie with occurrence counts: SuffixDecoding's data structure (Oliaro et al. 2024,
arXiv 2411.04975; Snowflake's arctic-inference, vLLM's `method: "suffix"`), written here in Python.

For sequences s_1, s_2, ... the trie holds every substring of length <= D (`max_depth`) as a path
from the root; a node u, the substring spelled on its path, carries

    count(u) = #{(k, i) : s_k[i : i + |u|] == u}      its occurrences, over all sequences
    last(u)  = the serial of the latest token that ended an occurrence of u (recency, for ties)

so the frequency of continuation t after u is count(ut) / count(u) (less than 1 in sum where u
also ends a sequence). When the context is the end of one of the trie's own sequences (a session
drafting from its own tokens, `own`), every match u counts that last occurrence too, which has not
gone on yet: it is left out, count(ut) / (count(u) - 1), the frequency among the occurrences that
went on (counted in, a phrase seen once before read 1/2, and the session's drafts lost to the
global cache's, whose sequences have ended, on the estimates alone: docs/speculative.md).
Appending a token to a sequence touches the <= D nodes of its last suffixes (`_active`), so building
costs O(D) per token; removing a sequence walks the same paths down.

`speculate(context)` is SuffixDecoding's lookup: for every match length m (1..D-1) whose last m
context tokens form a node u, a draft grows from u with the estimated probability of each token
the product of the frequencies on its path (p(u→v) = count(v) / count(u)), keeping tokens while
that product (it telescopes to count(uv) / count(u), computed so) is at least `min_prob`, at most
min(max_tokens, factor · m + offset) of them: a long match earns a long draft. As a chain it follows the most frequent child (ties: the most recent);
as a tree it takes tokens best-first by probability (a child's own parent first). The score of a
draft is the sum of its tokens' probabilities (its expected accepted length, if the frequencies
were the target's), and the match length with the highest score wins (ties: the longer match).
`drafts(context)` gives every match length's draft, for a tree that merges them (suffix.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Scores are sums of count ratios: two equal ones may differ in their last bits, and a tie goes to the longer match
TIE = 1e-9


class _Node:
    __slots__ = ("count", "last", "children")

    def __init__(self) -> None:
        self.count = 0
        self.last = -1
        self.children: dict[int, _Node] = {}


@dataclass
class Draft:
    """A proposal: tokens in an order where each one's parent comes before it (parents[i] = -1: the
    child of the session's last token), each token's estimated probability, their sum and the
    context match it came from."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    from_cache: bool = False  # drafted from the global cache's trie, not the session's (suffix.py)

    def add(self, token: int, parent: int, prob: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        self.score += prob
        return len(self.tokens) - 1

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


class SuffixTrie:
    """Substrings of length <= max_depth of the sequences added, with counts (module docstring).
    Sequences are named by an id; `extend` appends tokens to one, `remove` takes one out."""

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2 (one token matched, one proposed), got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # per sequence: the nodes of its last suffixes (< D long)
        self._serial = 0

    def __len__(self) -> int:
        """Tokens held, over every sequence."""
        return self.root.count

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        d = self.max_depth
        for t in tokens:
            self._serial += 1
            seq.append(t)
            self.root.count += 1
            nxt = []
            for node in (self.root, *active):  # every suffix shorter than D grows by t
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                child.last = self._serial
                nxt.append(child)
            # a suffix of length D cannot grow; the nodes are ordered by length, shortest first
            self._active[seq_id] = active = nxt[: d - 1]

    def remove(self, seq_id: int) -> None:
        """Take a sequence out: every occurrence it added is uncounted, nodes left at 0 go."""
        seq = self.seqs.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if seq is None:
            return
        for i in range(len(seq)):
            self.root.count -= 1
            node = self.root
            for t in seq[i : i + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]  # its subtree held only this occurrence's continuation
                    break
                node = child

    def suffix_nodes(self, seq_id: int) -> list[_Node]:
        """The nodes of a sequence's last suffixes, shortest first (lengths 1 to max_depth - 1, as
        many as it has tokens): what `node` finds for them, kept by `extend`."""
        return self._active.get(seq_id, [])

    def node(self, pattern: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for t in pattern:
            node = node.children.get(t) if node is not None else None
            if node is None:
                return None
        return node

    def count(self, pattern: Sequence[int]) -> int:
        node = self.node(pattern)
        return 0 if node is None else node.count

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
        tree: bool = False,
        own: bool = False,
        cap: Callable[[int], int] | None = None,
        ends: Sequence[_Node] | None = None,
    ) -> Draft:
        """The best-scoring draft over every match length (module docstring); empty when nothing matches."""
        best = Draft()
        for draft in self.drafts(context, max_tokens, factor, offset, min_prob, tree, own, cap, ends):
            if draft.score >= best.score - TIE:
                best = draft
        return best

    def drafts(
        self,
        context: Sequence[int],
        max_tokens: int,
        factor: float = 1.0,
        offset: float = 0.0,
        min_prob: float = 0.1,
        tree: bool = False,
        own: bool = False,
        cap: Callable[[int], int] | None = None,
        ends: Sequence[_Node] | None = None,
    ) -> list[Draft]:
        """The non-empty draft of every match length m = 1, 2, ... (shortest first), each with its
        match_len: what `speculate` chooses among. `own`: the context is the end of one of the trie's
        sequences (a session's trie and its own tokens), so every match u counts that occurrence,
        which has no continuation yet: it is left out, count(uv) / (count(u) - 1), the frequency
        among the occurrences that went on (module docstring). `cap(m)`: the most tokens a match of m
        may draft besides the factor's (suffix_size.MatchSizing.cap: what pays at the step's cost).
        `ends`: the nodes of the context's suffixes, shortest first, where the context is the end of
        one of the trie's sequences (`suffix_nodes`): the same nodes the lookups from the root find,
        without a walk of m tokens for every m (a long copy's 63 lengths: ~2,000 steps a draft)."""
        out = []
        for m in range(1, min(len(context), self.max_depth - 1) + 1):
            node = ends[m - 1] if ends is not None and m <= len(ends) else self.node(context[len(context) - m :])
            if node is None:
                break  # a longer suffix of the context cannot occur either
            room = min(max_tokens, int(m * factor + offset + 1e-6), self.max_depth - m)
            if cap is not None and room > 0:
                room = min(room, cap(m))
            base = max(1, node.count - own)
            draft = self._grow_tree(node, base, room, min_prob) if tree else self._grow_path(node, base, room, min_prob)
            if draft.tokens:
                draft.match_len = m
                out.append(draft)
        return out

    @staticmethod
    def _children(node: _Node) -> list[tuple[int, _Node]]:
        """Most frequent first, ties to the most recent."""
        return sorted(node.children.items(), key=lambda kv: (-kv[1].count, -kv[1].last))

    def _grow_path(self, node: _Node, base: int, room: int, min_prob: float) -> Draft:
        """`base`: the occurrences of `node` the frequencies divide by (`drafts`)."""
        draft = Draft()  # the product of frequencies on a path telescopes: count(uv) / base
        while len(draft.tokens) < room and node.children:
            t, child = self._children(node)[0]
            prob = child.count / base
            if prob < min_prob:
                break
            draft.add(t, len(draft.tokens) - 1, prob)
            node = child
        return draft

    def _grow_tree(self, node: _Node, base: int, room: int, min_prob: float) -> Draft:
        draft = Draft()
        # (-prob, tie, token, node, its parent's index); tie keeps the heap's order deterministic: the
        # order pushed, which lists a node's children most frequent first
        heap: list[tuple[float, int, int, _Node, int]] = []
        tie = 0

        def push(parent_node: _Node, parent: int) -> None:
            nonlocal tie
            for t, child in self._children(parent_node):
                p = child.count / base  # the product of frequencies on its path, telescoped
                if p < min_prob:
                    break  # the rest are rarer
                heapq.heappush(heap, (-p, tie, t, child, parent))
                tie += 1

        push(node, -1)
        while heap and len(draft.tokens) < room:
            neg_p, _, t, child, parent = heapq.heappop(heap)
            push(child, draft.add(t, parent, -neg_p))
        return draft
