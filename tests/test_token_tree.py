"""Token trees (issue 43 item 1), the client's side: the tree's columns, ancestor mask and depths, and
the acceptance rule. Greedy: the longest accepted path, then the target's token. Sampled: the
multi-candidate rule keeps the target's distribution exactly (a chi-square test against the exact
joint distribution of the first two tokens, with its false-failure rate stated; a rule that keeps
the first child whenever it can fails it). The jobs' workers are threads of this process
(tests/inproc.py: the real workers over the real links)."""

from __future__ import annotations

import pytest
import torch
from inproc import masked_threads, threads
from test_speculative import ALPHA, chi2, chi2_quantile

from fusion_compute.bench.ops import kv_probe
from fusion_compute.generation.sampling import Sampler
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.generation.token_tree import TokenTree, accept

# root 9 -> 4 (col 1) -> 6 (col 3), 7 (col 4); root -> 5 (col 2) -> 8 (col 5)
TREE = TokenTree((9, 4, 5, 6, 7, 8), (-1, 0, 0, 1, 1, 2))


def test_mask_and_depths_follow_the_parents():
    assert TREE.depths_T() == [0, 1, 1, 2, 2, 2]
    m = TREE.ancestor_mask_TT()
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}}
    assert {j: {i for i in range(6) if m[j, i]} for j in range(6)} == want
    chain = TokenTree.chain(9, [4, 6, 8])
    assert chain.is_chain() and not TREE.is_chain()
    assert torch.equal(chain.ancestor_mask_TT(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))  # causal
    assert chain.depths_T() == [0, 1, 2, 3]
    assert TokenTree.from_drafts(9, [4, 5, 6, 7, 8], [-1, -1, 0, 0, 1]) == TREE
    assert TREE.cut(3) == TokenTree((9, 4, 5), (-1, 0, 0))


def test_a_chains_tree_mask_is_the_causal_mask_with_or_without_a_window():
    from fusion_compute.model.kernels import causal_mask, tree_mask

    chain = (-1, 0, 1, 2)
    for pos in (0, 3, 9):
        for window in (None, 2, 5):
            assert torch.equal(tree_mask(pos, chain, window), causal_mask(pos, 4, window))
    # a tree at 5 under a window of 2 (a key is seen when it is less than 2 positions back): column 3
    # (depth 2, position 7, cache index 8) sees its parent column 1 (position 6, index 6) and itself,
    # not the root (5); column 2 (depth 1, position 6, index 7) sees the root and itself, not 4
    m = tree_mask(5, TREE.parents_T, 2)
    assert [i for i in range(11) if not m[3, i]] == [6, 8]
    assert [i for i in range(11) if not m[2, i]] == [5, 7]


@pytest.mark.parametrize(
    "tokens,parents,needle",
    [
        ((1, 2), (-1,), "one parent per column"),
        ((1, 2), (0, 0), "its parent is -1"),
        ((1, 2, 3), (-1, 2, 0), "does not come before it"),
        ((1, 2, 2), (-1, 0, 0), "two children with the same token"),
    ],
)
def test_malformed_trees_are_refused(tokens, parents, needle):
    with pytest.raises(ValueError, match=needle):
        TokenTree(tokens, parents)


def argmax_rows(*toks: int, vocab: int = 10) -> torch.Tensor:
    lg = torch.zeros(len(toks), vocab)
    for r, t in enumerate(toks):
        lg[r, t] = 1.0
    return lg


def test_greedy_acceptance_takes_the_longest_matching_path_then_the_targets_token():
    s = Sampler(SamplingParams())
    # the target after 9 says 5, after 9 5 says 8, after 9 5 8 says 3: the second branch, to its leaf, + bonus
    assert accept(s, TREE, argmax_rows(5, 0, 8, 0, 0, 3)) == ([5, 8, 3], [0, 2, 5])
    # after 9 4 the target says 7 (col 4), then 1: the first branch's second child
    assert accept(s, TREE, argmax_rows(4, 7, 0, 0, 1, 0)) == ([4, 7, 1], [0, 1, 4])
    # after 9 4 it says 2: no child carries it, the target's token ends the walk
    assert accept(s, TREE, argmax_rows(4, 2, 0, 0, 0, 0)) == ([4, 2], [0, 1])
    assert accept(s, TREE, argmax_rows(3, 0, 0, 0, 0, 0)) == ([3], [0])  # nothing accepted


# The sampled test's toy target: the next token's distribution depends on the last token only.
V = 4
NEXT = torch.tensor(
    [[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1]], dtype=torch.float64
)
# a tree over tokens 0..3, its drafts chosen to be accepted and rejected often: root -> 1, 2; 1 -> 0, 3; 2 -> 2
SHAPE = ([1, 2, 0, 3, 2], [-1, -1, 0, 0, 1])


def two_tokens(sampler: Sampler, root: int, rule) -> tuple[int, int]:
    out: list[int] = []
    last = root
    while len(out) < 2:
        tree = TokenTree.from_drafts(last, *SHAPE)
        logits = torch.stack([NEXT[t].log() for t in tree.tokens_T])  # column c: after the path to c
        toks, _ = rule(sampler, tree, logits)
        out += toks
        last = out[-1]
    return out[0], out[1]


def first_child_whenever_possible(sampler: Sampler, tree: TokenTree, logits: torch.Tensor):
    """A wrong rule (a control): the first child with any mass is kept, without the coin."""
    path, out = [0], []
    while True:
        kids = tree.children(path[-1])
        if not kids:
            return out + [sampler(logits[path[-1]])], path
        out.append(tree.tokens_T[kids[0]])
        path.append(kids[0])


@pytest.mark.slow
def test_sampled_tree_acceptance_keeps_the_target_distribution():
    """10,000 pairs of first tokens after root 3, against NEXT[3][x] · NEXT[x][y] over 16 cells: the
    chi-square statistic stays under its 1 - ALPHA quantile (a correct rule fails 1 in 10,000 runs),
    and the wrong rule lands far above it."""
    runs, root = 10_000, 3
    exact = (NEXT[root][:, None] * NEXT).reshape(-1)
    bound = chi2_quantile(V * V - 1, ALPHA)

    def tally(rule) -> torch.Tensor:
        s = Sampler(SamplingParams(temperature=1.0, seed=11))
        counts = torch.zeros(V * V, dtype=torch.float64)
        for _ in range(runs):
            a, b = two_tokens(s, root, rule)
            counts[a * V + b] += 1
        return counts

    assert chi2(tally(accept), exact) < bound
    assert chi2(tally(first_child_whenever_possible), exact) > 10 * bound  # the test can fail


# ---- against the workers ----

LOGIT_ATOL = 3e-4  # test_parity.py's: float32 shards against transformers in float64 on these tiny models


@pytest.mark.parametrize(  # about a second each on threads (was 2-4 s on processes): in the quick loop
    "arch,n",
    [
        ("llama", 2),
        ("qwen2", 3),
        ("qwen2", "masked 1+1"),
        ("mistral", 2),
        ("gemma3_text", 3),
        ("gemma3_text", "masked 1+1"),
    ],
)
def test_a_tree_step_gives_every_path_its_own_logits_and_keeps_the_accepted_one(
    arch, n, tiny_llama, tiny_qwen2, tmp_path
):
    """One sharded forward over a token tree: each column's logits are transformers' after the path to
    it (the ancestor mask and RoPE by depth); keeping a path that is not a prefix of the columns (the
    second branch) moves its KV entries into place, and the next steps (one token, then another tree,
    then a chain) are transformers' after the kept path; the dropped columns are zeroed. qwen2 at N = 3
    splits a KV group across workers (its scores are summed between them); masked 1+1 attends on the
    client, in the clear, with the same mask and depths and compacts its own cache; mistral's sliding
    window of 2 is shorter than the paths here (a key is seen within 2 positions of its column's
    depth, not of its cache index); gemma3_text the same on its local layers, whose RoPE (by depth) has
    its own base, and its post-norms' sums at N = 3."""
    from tiny_models import build

    from fusion_compute.masked.client import MaskedEngine
    from fusion_compute.model import reference
    from fusion_compute.structural.client import Engine

    # mistral with a window of 2: column 5 (depth 3) must not see its grandparent column 2 (depth 1, two
    # positions back), whose cache index (pos + 2) is only one back
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}.get(arch) or build(tmp_path, arch, sliding_window=2)
    ref = reference.load_reference(model)
    prompt = [5, 17, 33, 2, 99, 5]
    # columns: 0 root (the prompt's next token 40), 1: 41, 2: 42, 3: 43 (child of 1), 4: 44 (child of 2), 5: 45 (child of 4)
    tree = TokenTree((40, 41, 42, 43, 44, 45), (-1, 0, 0, 1, 2, 4))

    def path_tokens(c: int) -> list[int]:
        out = []
        while c >= 0:
            out.append(tree.tokens_T[c])
            c = tree.parents_T[c]
        return out[::-1]

    masked = n == "masked 1+1"
    engine = (
        MaskedEngine(model, masked_threads(n_a=1, n_b=1, timeout_s=60, context=64))
        if masked
        else Engine(model, threads(n_workers=int(n), timeout_s=60, context=64))
    )
    with engine as eng:
        eng.reset()
        eng.forward_batch([(0, prompt)])
        got = eng.forward_batch([(0, list(tree.tokens_T))], all_logits={0}, trees={0: tree.parents_T})[0]
        for c in range(len(tree)):
            want = reference.logits(ref, prompt + path_tokens(c))[-1]
            assert torch.allclose(got[c].double(), want, atol=LOGIT_ATOL, rtol=0), (c, (got[c] - want).abs().max())
        eng.keep_path(0, [0, 2, 4, 5])  # 40 42 44 45: columns 2, 4, 5 move down to 1, 2, 3
        kept = prompt + [40, 42, 44, 45]
        assert eng.slot_history[0] == kept
        nxt = eng.forward_batch([(0, [7])])[0]  # the next step names the kept columns
        assert torch.allclose(nxt.double(), reference.logits(ref, kept + [7])[-1], atol=LOGIT_ATOL, rtol=0)
        kept.append(7)
        # another tree, its first branch kept this time, then a chain after it
        tree2 = TokenTree((8, 9, 10, 11), (-1, 0, 0, 1))
        eng.forward_batch([(0, list(tree2.tokens_T))], all_logits={0}, trees={0: tree2.parents_T})
        eng.keep_path(0, [0, 1, 3])
        kept += [8, 9, 11]
        out = eng.forward_batch([(0, [12, 13])], all_logits={0})[0]
        want = reference.logits(ref, kept + [12, 13])[-2:]
        assert torch.allclose(out.double(), want, atol=LOGIT_ATOL, rtol=0), (out.double() - want).abs().max()
        eng.release(0)
        assert eng.kv_abs_max() == 0.0 if masked else kv_probe(eng) == [0.0] * int(n)


@pytest.mark.slow
def test_suffix_trees_keep_greedy_tokens(tiny_llama):
    """`--speculative suffix` on an engine that verifies trees: the drafts are trees (some step ran a
    tree that is not a chain), and the greedy tokens are transformers'."""
    from fusion_compute.generation import batching
    from fusion_compute.generation.generate import generate
    from fusion_compute.generation.speculative import Speculator
    from fusion_compute.generation.speculative_config import SpeculativeConfig
    from fusion_compute.model import reference
    from fusion_compute.structural.client import Engine

    ref = reference.load_reference(tiny_llama)
    # prompts whose n-grams recur with several continuations: the suffix trie branches
    prompts = [[5, 17, 33, 2, 5, 17, 40, 2, 5, 17, 33, 9, 5, 17], [1, 2, 3, 4, 1, 2, 5, 4, 1, 2, 3, 6, 1, 2]]
    want = [reference.greedy(ref, p, 24) for p in prompts]
    ran: list[bool] = []
    real_accept = batching.accept

    def spy(sampler, tree, logits):
        ran.append(not tree.is_chain())
        return real_accept(sampler, tree, logits)

    batching.accept = spy
    try:
        with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=96)) as eng:
            # not adaptive: the drafter's trees as drawn. The budget would price each column by this
            # machine's measured compute, so whether a branch is kept would depend on the load (CI saw
            # only chains once); the budget's choices are tested apart (test_tree_cost, test_speculative)
            spec = Speculator(SpeculativeConfig("suffix", 8, adaptive=False), eng.config.vocab, eng.context)
            got = [generate(eng, p, max_new_tokens=24, sampling=SamplingParams(), speculator=spec) for p in prompts]
            alone = len(ran)
            # batched: tree spans beside other sessions' single tokens and chains in one step, kept paths
            # named for several slots at once
            seqs = [batching.Sequence(p, 24, SamplingParams()) for p in prompts + [[7, 8, 9]]]
            batched = batching.run_batch(eng, seqs, 3, speculator=spec)
            assert kv_probe(eng) == [0.0, 0.0]
    finally:
        batching.accept = real_accept
    assert [r.token_ids for r in batched[:2]] == want
    assert batched[2].token_ids == reference.greedy(ref, [7, 8, 9], 24)
    assert any(ran[alone:]), "no tree was verified in the batch"
    assert [r.token_ids for r in got] == want
    assert any(ran[:alone]), "no tree that is not a chain was verified"


def test_workers_read_tree_words_and_refuse_malformed_ones():
    """The FORWARD exchange's tree words (structural/protocol.py): per span [n_parents, n_keep,
    parents, kept columns]; a worker refuses words that do not describe a tree or a path."""
    from fusion_compute.structural.op_loop import with_trees
    from fusion_compute.structural.ops import Span

    spans = [Span(0, 10, 3), Span(1, 4, 1)]
    got = with_trees(spans, [3, 0, -1, 0, 0, 0, 2, 0, 2])
    assert got == [Span(0, 10, 3, (-1, 0, 0), None), Span(1, 4, 1, None, (0, 2))]
    for words, needle in [
        ([3, 0, -1, 0, 2, 0, 0], "parents"),  # column 2's parent is itself
        ([3, 0, 0, 0, 0, 0, 0], "parents"),  # column 0 is not the root
        ([2, 0, -1, 0, 0, 0], "malformed tree words for span"),  # 2 parents for 3 columns
        ([0, 0, 0, 2, 1, 1], "kept columns"),  # a path not from 0
        ([0, 0, 0, 2, 0, 0], "kept columns"),  # not increasing
        ([0, 0, 0, 0, 7], "left over"),
        ([0, 0], "malformed tree words for"),  # the second span's words missing
        ([0, 0, 0, 5, 0, 1, 2, 3, 4], "malformed tree words for span"),  # more kept than the slot held
    ]:
        with pytest.raises(RuntimeError, match=needle):
            with_trees(spans, words)
