"""A token tree verified in one sharded forward (issue 43 item 1; SpecInfer, Miao et al. 2024; Sequoia,
Chen et al. 2024): the step's columns, their ancestor mask and depths, and which columns the target
accepts.

Column 0 is the session's last token (the root, already emitted); columns 1..n are the drafts, each
after its parent column (parents_T[j] < j, -1 for the root). Every column c sits at position
pos + depth(c) and attends to its ancestors and itself only (the ancestor mask), so the logits of
column c are the target's after the path root → c, as if that path alone had run: a chain is the
tree whose parents are j - 1, and then mask and depths are the causal ones.

Acceptance walks down from the root. At column c with children d_1..d_m (distinct tokens, in the
drafter's order of preference):
  greedy   t = argmax p_c; the child whose token is t is accepted and the walk goes on from it; if
           none is t, t is emitted (the target's own token) and the walk ends. After an accepted
           leaf, its argmax is the bonus token. Exactly the tokens greedy decoding gives.
  sampled  the children are tried in order with p = p_c: child d_k is accepted with probability
           p(d_k); if it is not, d_k is removed from p and p renormalised, and the next child is
           tried with that p; when every child was rejected the token is drawn from what is left.
           Each child's proposal is a point mass (the drafters are deterministic), so this is
           SpecInfer's multi-candidate rule with q_k = δ(d_k), and it keeps p exactly:
             P(emit d_k) = Π_{i<k} (1 - p(d_i) / (1 - Σ_{l<i} p(d_l))) · p(d_k) / (1 - Σ_{i<k} p(d_i))
                         = (1 - Σ_{i<k} p(d_i)) · p(d_k) / (1 - Σ_{i<k} p(d_i)) = p(d_k)
           (each factor telescopes: 1 - p(d_i)/(1 - S_i) = (1 - S_{i+1})/(1 - S_i), S_i = Σ_{l<i}
           p(d_l)), and a token x no child carries is drawn from p restricted to the non-children
           after all m were rejected: P = (1 - S_{m+1}) · p(x) / (1 - S_{m+1}) = p(x). So every
           emitted token is distributed as p given the tokens before it, as without speculation;
           the walk then goes on from the accepted child with that child's column, whose logits
           are the target's after the accepted path. (A child with p(d_k) = 0 is never accepted.)

The accepted path's columns (0 first) are the ones whose KV entries stay: the workers move column
c_i's entries to position pos + i and drop the rest (compaction), told by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.kernels import tree_depths, tree_mask
from .sampling import Sampler


@dataclass(frozen=True)
class TokenTree:
    """A step's columns for one session: `tokens_T[0]` the session's last token, `parents_T[j]` the
    column before column j (-1 for column 0), every parent before its children."""

    tokens_T: tuple[int, ...]
    parents_T: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens_T) != len(self.parents_T) or not self.tokens_T:
            raise ValueError("a token tree needs one parent per column, and at least the root")
        if self.parents_T[0] != -1:
            raise ValueError("column 0 is the root: its parent is -1")
        for j, p in enumerate(self.parents_T[1:], start=1):
            if not 0 <= p < j:
                raise ValueError(f"column {j}'s parent {p} does not come before it")
        for j in range(len(self.tokens_T)):  # siblings carry distinct tokens: acceptance picks one by token
            kids = [self.tokens_T[c] for c in self.children(j)]
            if len(set(kids)) != len(kids):
                raise ValueError(f"column {j} has two children with the same token")

    @classmethod
    def chain(cls, last: int, drafts: list[int]) -> TokenTree:
        return cls((last, *drafts), tuple(range(-1, len(drafts))))

    @classmethod
    def from_drafts(cls, last: int, drafts: list[int], parents: list[int]) -> TokenTree:
        """From a drafter's tokens with parents indexed among the drafts (-1: the last token's child)."""
        return cls((last, *drafts), (-1, *(p + 1 for p in parents)))

    def __len__(self) -> int:
        return len(self.tokens_T)

    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents_T))

    def children(self, c: int) -> list[int]:
        return [j for j, p in enumerate(self.parents_T) if p == c]

    def depths_T(self) -> list[int]:
        """Each column's depth: its position is the step's position plus this (RoPE by depth)."""
        return tree_depths(self.parents_T)

    def ancestor_mask_TT(self) -> torch.Tensor:
        """(T, T) bool: [j, i] is True when column i is column j or one of its ancestors, the
        columns j attends to among the step's (it attends every earlier position of the session too;
        kernels.tree_mask is the workers' form, True where masked)."""
        return ~tree_mask(0, self.parents_T)

    def cut(self, columns: int) -> TokenTree:
        """The first `columns` columns (a prefix keeps every parent before its child): a tree cut to
        what a session's KV slot has room for."""
        return TokenTree(self.tokens_T[:columns], self.parents_T[:columns])


def accept(sampler: Sampler, tree: TokenTree, logits_TV: torch.Tensor) -> tuple[list[int], list[int]]:
    """The tokens the step emits and the accepted path's columns (0 first, then each accepted draft's):
    the module docstring's rule. logits_TV: the target's logits at every column, (T, V)."""
    greedy = sampler.params.greedy
    path = [0]
    out: list[int] = []
    while True:
        c = path[-1]
        kids = tree.children(c)
        if greedy:
            t = sampler(logits_TV[c])
            nxt = next((k for k in kids if tree.tokens_T[k] == t), None)
            if nxt is None:
                return out + [t], path
        else:
            p = sampler.probs(logits_TV[c])
            nxt = None
            for k in kids:
                d = tree.tokens_T[k]
                if sampler.uniform() < float(p[d]):
                    nxt = k
                    break
                rest = p.clone()
                rest[d] = 0.0
                total = float(rest.sum())
                if total <= 0:  # p(d) was 1 up to rounding, and the uniform draw fell in the rounding
                    nxt = k
                    break
                p = rest / total
            if nxt is None:
                return out + [sampler.draw(p)], path
        out.append(tree.tokens_T[nxt])
        path.append(nxt)
