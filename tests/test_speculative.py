"""Speculative decoding (issue 23): the same tokens in fewer sharded forwards.

Greedy: tokens with speculation must equal tokens without it and HF transformers' (tiny random
Qwen2 and Llama models, structural N = 2 and 3, masked 1+1, single sessions and batches), whatever
the drafter proposes: n-gram drafts (accepted and rejected), a draft model that always hits (the
target itself) and one that always misses (a model whose every proposal is token 0). Sampled: the
rejection rule keeps the target's distribution exactly (a chi-square test against the exact
distribution, with its false-failure rate stated; a wrong rule makes it fail).

Speculation is the client's logic over the protocol: its jobs' workers are threads of this process
(tests/inproc.py's `threads`; `--executor inproc` on the command line): the real workers over the
real links.
"""

from __future__ import annotations

import math
from pathlib import Path

import procs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from inproc import masked_threads, threads

from fusion_compute.bench.ops import kv_probe
from fusion_compute.generation import batching
from fusion_compute.generation import speculative as S
from fusion_compute.generation.batching import Sequence, run_batch
from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling import Sampler
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.generation.speculative import DraftLength, NgramDrafter, Speculator, verify
from fusion_compute.generation.speculative_config import SpeculativeConfig, SpeculativeError, from_flags
from fusion_compute.model import reference
from fusion_compute.model.dense import DenseModel
from fusion_compute.structural.client import Engine
from fusion_compute.weights.loader import open_weights

GREEDY = SamplingParams()
# A prompt whose n-grams recur with other continuations than the model's: drafts get rejected and accepted
PROMPTS = [[5, 17, 33, 2, 99, 5, 17, 33, 2, 99, 5, 17], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8, 60, 7, 8]]
NEW = 24
# The command line's n-gram drafts are 2-grams and longer: a prompt of repeated 2-grams, whose drafts the
# tiny Llama accepts sometimes (tiny_models.py), so that speculation saves steps there.
CLI_PROMPT = [69, 292, 33, 131, 69, 292, 33, 131]


def ngram(k: int = 4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", k, prompt_lookup_min=kw.pop("n_min", 1), **kw)


def draft_cfg(path: Path, k: int = 3, **kw) -> SpeculativeConfig:
    return SpeculativeConfig("draft_model", k, draft_model=str(path), **kw)


@pytest.fixture(scope="module")
def zero_draft(tmp_path_factory, tiny_llama) -> Path:
    """A draft model of tiny_llama's vocabulary whose final norm is all zeros: every logit is 0, so
    its proposal is always token 0 (argmax's first index), which the target never produces here."""
    from safetensors.torch import load_file, save_file
    from tiny_models import build

    path = build(tmp_path_factory.mktemp("zero-draft"), "llama", seed=9)
    f = next(path.glob("*.safetensors"))
    state = load_file(f)
    state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])
    save_file(state, f, metadata={"format": "pt"})
    return path


# ---- the parts, without processes ----


def test_ngram_drafter_proposes_what_followed_the_longest_latest_match():
    d = NgramDrafter(1, 3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # 3-gram [1,2,3]: latest copy with 2 after it
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 4) == [7, 1, 2, 3]
    assert d.propose([4, 5, 6], 3) == []  # nothing recurs
    assert d.propose([4, 5, 6, 5], 3) == [6, 5]  # a 1-gram, with what followed it
    assert NgramDrafter(2, 3).propose([4, 5, 6, 5], 3) == []  # ... unless 2-grams at least
    # the index follows a session that was rolled back and went another way
    d2 = NgramDrafter(1, 2)
    assert d2.propose([1, 2, 1], 2) == [2, 1]
    assert d2.propose([1, 2, 3, 2], 2) == [3, 2]
    assert d2.tokens == [1, 2, 3, 2] and d2.where == {1: [0], 2: [1, 3], 3: [2]}


def test_ngram_tree_branches_where_the_matches_continued_differently():
    d = NgramDrafter(1, 3)
    # [1, 2, 3] was followed by 7 twice (then 5, then 6) and by 9 once: 7 first, then the ties at 1/3
    # latest occurrence first (7 -> 6 -> 1 -> 2 -> 3), then 9 beside 7
    tree = d.propose_tree([1, 2, 3, 7, 5, 1, 2, 3, 9, 1, 2, 3, 7, 6, 1, 2, 3], 8)
    assert tree.tokens[:6] == [7, 6, 1, 2, 3, 9] and tree.parents[:6] == [-1, 0, 1, 2, 3, -1]
    assert tree.probs[:6] == pytest.approx([2 / 3] + [1 / 3] * 5)
    chain = d.propose_tree([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3], 3)  # every match went on alike: a chain
    assert chain.is_chain() and chain.tokens == [9, 1, 2] and chain.probs == [1.0, 1.0, 1.0]
    assert d.propose_tree([4, 5, 6], 3).tokens == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.integers(1, 12))
def test_ngram_tree_against_brute_force(tokens, k):
    """Each node's probability is the share of the longest n-gram's earlier matches whose
    continuation starts with the node's path; parents come first; with room, every distinct
    continuation prefix is a node; its first child is the most frequent continuation."""
    tree = NgramDrafter(1, 3).propose_tree(tokens, k)
    n_tok = len(tokens)
    follows: list[list[int]] = []
    for n in range(min(3, n_tok - 1), 0, -1):
        follows = [
            tokens[j + 1 : j + 1 + k]
            for j in range(n - 1, n_tok - 1)
            if tokens[j - n + 1 : j + 1] == tokens[n_tok - n :]
        ]
        if follows:
            break
    paths: list[tuple[int, ...]] = []
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        assert -1 <= p < i
        paths.append((paths[p] if p >= 0 else ()) + (t,))
        share = sum(tuple(f[: len(paths[i])]) == paths[i] for f in follows) / len(follows)
        assert tree.probs[i] == pytest.approx(share)
    prefixes = {tuple(f[:m]) for f in follows for m in range(1, len(f) + 1)}
    assert set(paths) <= prefixes and len(paths) == min(k, len(prefixes))
    assert len(set(paths)) == len(paths)


def test_draft_model_tree_branches_where_it_is_unsure(tiny_llama):
    """The draft model's tree: its greedy chain (the path of first children), and beside the chain's
    token at each position whose top-1 probability is under UNSURE, the next likeliest tokens as
    leaves; every column's probability is the model's along its path, recomputed here by running
    the model on that path; best first, at most k."""
    model = DenseModel(open_weights(tiny_llama), max_seq=1)
    prompt, k = [3, 17, 42, 5, 99], 6
    chain = S.DraftModelDrafter(model, 64).propose(prompt, k)
    tree = S.DraftModelDrafter(model, 64).propose_tree(prompt, k)
    assert len(tree.tokens) == k and all(-1 <= p < i for i, p in enumerate(tree.parents))

    def softmax_after(ids: list[int]) -> torch.Tensor:
        return torch.softmax(model.forward(ids, 0, model.new_cache(len(ids)))[-1].float(), dim=-1)

    paths: list[list[int]] = []
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        paths.append((paths[p] if p >= 0 else []) + [t])
        prob = 1.0
        for j in range(len(paths[i])):
            prob *= float(softmax_after(prompt + paths[i][:j])[paths[i][j]])
        assert tree.probs[i] == pytest.approx(prob, rel=1e-4)
        on_chain = paths[i] == chain[: len(paths[i])]
        if not on_chain:  # a leaf: its parent is on the chain, and the position was unsure
            assert (paths[p] if p >= 0 else []) == chain[: len(paths[i]) - 1]
            assert float(softmax_after(prompt + paths[i][:-1]).max()) < S.UNSURE
    assert tree.probs == sorted(tree.probs, reverse=True)
    # a random tiny model is unsure everywhere: the tree does branch, and its best path is the chain
    assert not tree.is_chain() and tree.tokens[0] == chain[0]


def test_greedy_verify_keeps_the_matching_prefix_and_the_targets_next_token():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 5, 8, 2]):
        logits[row, tok] = 1.0
    s = Sampler(GREEDY)
    assert verify(s, logits, [3, 5, 8]) == ([3, 5, 8, 2], 3)  # every draft accepted, plus the bonus token
    assert verify(s, logits, [3, 6, 8]) == ([3, 5], 1)  # the first miss: the target's own token there
    assert verify(s, logits, [4, 5, 8]) == ([3], 0)


def test_draft_length_adapts_and_pauses_while_drafts_do_not_pay():
    from fusion_compute.generation import speculative as S

    n = DraftLength(6)
    assert n.next() == 6
    n.update(6, 2)  # a miss: shorter
    assert n.next() == 5
    n.update(5, 5)  # all accepted: longer, up to the most allowed
    assert n.next() == 6
    for _ in range(S.WINDOW):  # a window of verifications that gained nothing: drafting pauses
        n.update(n.next(), 0)
    assert [n.next() for _ in range(S.PAUSE_STEPS)] == [0] * S.PAUSE_STEPS
    assert n.next() == 1  # then probes with one draft
    for _ in range(S.WINDOW):  # nothing again: a pause twice as long
        n.update(n.next() or 1, 0)
    assert [n.next() for _ in range(2 * S.PAUSE_STEPS)] == [0] * (2 * S.PAUSE_STEPS) and n.next() == 1
    fixed = DraftLength(4, adaptive=False)
    for _ in range(10):
        fixed.update(4, 0)
    assert fixed.next() == 4


def test_a_priced_session_is_gated_by_the_cost_not_paused():
    """Where the job's cost model prices a greedy session's drafts (the loop says `priced`), that
    model is the gate: the pause, set by the same misses, does not stop drafting (a wide-area step,
    where a column costs nearly nothing, keeps its drafts); unpriced, the same session pauses."""
    from fusion_compute.generation import speculative as S

    n = DraftLength(32, sized_by_drafter=True)
    for _ in range(S.WINDOW):
        n.update(n.next(), 0)
    assert n.paused == S.PAUSE_STEPS
    assert [n.next(priced=True) for _ in range(3)] == [32] * 3  # priced: the budget decides, every step
    assert [n.next() for _ in range(S.PAUSE_STEPS - 3)] == [0] * (S.PAUSE_STEPS - 3)  # unpriced: paused
    assert n.next() == 32
    # a priced StepCost cuts what does not pay: at 0.1 ms a column costs as much as the step, at 21 ms
    # the same acceptance keeps its drafts
    from fusion_compute.generation.tree_cost import LinkCost

    for rtt, want in ((0.0001, 0), (0.021, 4)):
        cost = S.StepCost(LinkCost(rtt, 120, 0.0, 1e9, 0.012, 0.0))
        assert cost.allocate([4], [0.3]) == [want], rtt


def test_acceptance_by_depth_counts_each_depth_apart():
    """depth_rates: a verification that accepted a of a path d deep is a success at depths 1..a and a
    failure at a + 1; each depth after PRIOR_TRIALS trials at its prior. Where the first draft often
    misses but a hit goes on (a suffix draft: the right place to copy from, or not), depth 1's rate
    is lower than depth 2's, which one rate for every depth cannot say."""
    from fusion_compute.generation import speculative as S

    hist = [(4, 0), (4, 0), (4, 4), (3, 1), (6, 3)]  # (path depth, accepted)
    flat = [0.5] * S.DEPTHS
    q = S.depth_rates(hist, flat)
    # depth 1: 5 trials, 3 hits; depth 2: 3 trials (4/4, 3/1's miss, 6/3), 2 hits; depth 3: 2 trials,
    # 2 hits; depth 4: 2 trials (4/4's hit, 6/3's miss), 1 hit; deeper: none
    pt = S.PRIOR_TRIALS
    want = [(3 + pt / 2) / (5 + pt), (2 + pt / 2) / (3 + pt), (2 + pt / 2) / (2 + pt), (1 + pt / 2) / (2 + pt)]
    want += [0.5] * (S.DEPTHS - 4)
    assert q == pytest.approx(want)
    assert S.chain_gains(q, 3) == pytest.approx([want[0], want[0] * want[1], want[0] * want[1] * want[2]])
    assert S.depth_rates([(1, 1)] * 4, flat)[0] == pytest.approx(
        (4 + pt / 2) / (4 + pt)
    )  # a full chain of one: no miss
    job = S.JobAcceptance()
    for d, a in hist:
        job.add(d + 1, a, depth=d)
    assert job.depth_rates() == pytest.approx(S.depth_rates(hist, [job.rate()] * S.DEPTHS))
    # the budget judges a session by these: a session that misses its first draft half the time but
    # copies on once it hits; the one rate reads the same history as 0.88 for the first draft
    first_miss = [(8, 0), (8, 8)] * 3
    q = S.depth_rates(first_miss, flat)
    assert q[0] == pytest.approx(0.5) and min(q[1:]) == pytest.approx((3 + pt / 2) / (3 + pt))
    one = DraftLength(8)
    for d, a in first_miss:
        one.update(d, a)
    assert one.acceptance() == pytest.approx((24 + pt / 2) / (27 + pt)) and one.depth_rates(flat) == pytest.approx(q)


def test_a_starved_priced_session_probes_with_one_draft():
    """A priced session whose every draft the budget cut keeps learning: after PAUSE_STEPS steps cut to
    none it runs one draft, and a step the budget allowed resets the count."""
    from fusion_compute.generation import speculative as S

    n = DraftLength(32, sized_by_drafter=True)
    assert [n.probe(0) for _ in range(S.PAUSE_STEPS)] == [0] * (S.PAUSE_STEPS - 1) + [1]
    assert n.probe(0) == 0 and n.probe(5) == 5
    assert [n.probe(0) for _ in range(S.PAUSE_STEPS)][-1] == 1


def test_a_probe_that_misses_waits_twice_as_long_for_the_next():
    """A probe is a column the budget judged not worth its cost: each that accepts nothing doubles
    the starved steps before the next (to PAUSE_MAX), so an open-chat session whose probes keep missing
    pays for ever fewer; one that accepts (a copied passage began) brings back PAUSE_STEPS."""
    from fusion_compute.generation import speculative as S

    def starved_until_probe(n: DraftLength) -> int:
        for i in range(1, 2 * S.PAUSE_MAX + 1):
            if n.probe(0):
                return i
        raise AssertionError("no probe")

    n = DraftLength(32, sized_by_drafter=True)
    gaps = []
    for _ in range(6):
        gaps.append(starved_until_probe(n))
        n.update(1, 0, 1)  # the probe's one draft missed
    assert gaps == [S.PAUSE_STEPS * 2**i for i in range(5)] + [S.PAUSE_MAX] == [8, 16, 32, 64, 128, 128]
    assert starved_until_probe(n) == S.PAUSE_MAX
    n.update(1, 1, 1)  # this probe was accepted
    assert starved_until_probe(n) == S.PAUSE_STEPS
    n.update(1, 0, 1)
    n.update(5, 2, 5)  # a verification the budget gave drafts (no probe) leaves the wait as it is
    assert starved_until_probe(n) == 2 * S.PAUSE_STEPS


def test_a_sessions_own_first_miss_outweighs_the_jobs_prior():
    """The job's pooled rate is a session's prior, not its evidence: one verification of its own that
    accepted nothing takes its first draft's rate to at most half the job's (PRIOR_TRIALS = 1), so an
    open-chat session on a job whose grounded sessions filled the pool stops being priced at their
    rate after its first miss."""
    from fusion_compute.generation import speculative as S

    job = [0.6] * S.DEPTHS  # the grounded sessions' rate
    n = DraftLength(32, sized_by_drafter=True)
    assert n.depth_rates(job)[0] == pytest.approx(0.6)  # nothing of its own: the job's
    n.update(4, 0, 4)
    assert n.depth_rates(job)[0] <= 0.3
    # 100 ms a step, 30 ms a column, 20 ms a drafting session: one draft pays above 0.05 / 0.13 = 0.385,
    # so the job's 0.6 drafts and the session's own rate after its miss does not (with two pseudo-trials
    # at 0.6 it read 0.4 and drafted on)
    cost = _fitted(0.03, 0.1, 0.02)
    assert cost.allocate([1], [0.6]) == [1] and cost.allocate([1], [n.depth_rates(job)[0]]) == [0]


def test_acceptance_rate_counts_prefixes():
    n = DraftLength(8)
    assert n.acceptance() == 0.5  # the prior alone
    n.update(4, 4)  # four hits, no miss
    n.update(4, 1)  # one hit, then a miss
    assert n.acceptance() == pytest.approx((5 + S.PRIOR_TRIALS / 2) / (5 + 1 + S.PRIOR_TRIALS))


def test_a_new_session_starts_from_the_jobs_acceptance():
    pool = S.JobAcceptance()
    assert pool.rate() == S.EMPTY_JOB_RATE == 1.0  # nothing seen: the drafter's own frequencies
    for _ in range(20):
        pool.add(4, 0)  # every session's drafts missed at once
    pool.add(0, 0)  # a step without drafts is no verification
    low = pool.rate()
    assert low == pytest.approx(S.PRIOR_TRIALS / (20 + S.PRIOR_TRIALS)) and len(pool.history) == 20
    fresh = DraftLength(8)
    assert fresh.acceptance() == 0.5 and fresh.acceptance(low) == pytest.approx(low)
    fresh.update(4, 4)  # its own hits outweigh the prior as they come
    assert fresh.acceptance(low) == pytest.approx((4 + S.PRIOR_TRIALS * low) / (4 + S.PRIOR_TRIALS))
    # The budget (3 ms a column, 6 ms a drafting session, 100 ms base): a fresh session at even odds
    # drafts; at the rate this job's drafts really earn, it does not.
    cost = _fitted(0.003, 0.1, 0.006)
    assert cost.allocate([4], [DraftLength(8).acceptance()])[0] > 0
    assert cost.allocate([4], [DraftLength(8).acceptance(low)]) == [0]


def test_drafts_are_priced_from_the_first_step():
    """Before its first fit (COST_MIN_STEPS decode steps of spread widths) a job's StepCost prices drafts
    by its prior, not at all: a column at what one more prompt token cost the prefill's step beyond a
    plain decode step, a drafting session at PRIOR_SPAN_COLUMNS columns, the base the decode steps'
    time less their columns. At 100 ms a step, 5 ms a column and 80 ms a drafting session (one
    session on loopback, docs/speculative.md), a draft accepted 30 % of the time does not pay and
    one accepted 95 % does; at the job's first decode step, with only the prefill timed, none does
    (the prefill cannot tell its base from its columns). Without the prior (the control: drafts
    unpriced until the fit) both run at their caps, as a session that accepted nothing drafted 49
    columns in its job's first steps (issue 43)."""
    from fusion_compute.generation.tree_cost import LinkCost

    def job(prior: bool, link=None) -> S.StepCost:
        cost = S.StepCost(link, prior=prior)
        cost.observe(41, 0, 0.1 + 41 * 0.005, prefill=True)  # a prompt of 41 tokens
        return cost

    assert S.StepCost().costs() is None and S.StepCost().allocate([8], [0.3]) == [8]  # nothing timed yet
    low, high = [0.3, 0.1, 0.05, 0.02], [0.95**j for j in range(1, 9)]
    first = job(True)  # the prefill alone: a column at t_p / w_p and no base left for the step
    t_p = 0.1 + 41 * 0.005
    assert first.costs() == pytest.approx((0.0, t_p / 41, S.PRIOR_SPAN_COLUMNS * t_p / 41))
    assert first.allocate([4], [0.3], gains=[low]) == [0] and first.allocate([8], [0.95], gains=[high]) == [0]
    cost = job(True)
    for _ in range(2):
        cost.observe(1, 0, 0.105)  # plain decode steps: 100 ms + its column
    assert cost.fit() is None  # too few steps for a fit
    assert cost.costs() == pytest.approx((0.1, 0.005, S.PRIOR_SPAN_COLUMNS * 0.005))
    assert cost.allocate([4], [0.3], gains=[low]) == [0]
    assert cost.allocate([8], [0.95], gains=[high]) == [8]
    cost.observe(9, 1, 0.1 + 9 * 0.005 + 0.08)  # a step with 8 drafts: its base is still 100 ms
    assert cost.costs() == pytest.approx((0.1, 0.005, S.PRIOR_SPAN_COLUMNS * 0.005))
    unpriced = job(False)
    for _ in range(2):
        unpriced.observe(1, 0, 0.105)
    assert unpriced.costs() is None and unpriced.allocate([4], [0.3], gains=[low]) == [4]
    # with a link's model the prior is the workers' compute, the link's round trips and bytes added
    link = LinkCost(0.021, 120, 2300.0, 1.25e8, 0.0)
    linked = job(True, link)
    linked.observe(1, 0, 0.105)
    base, per_column, per_span = linked.costs()
    assert base == pytest.approx(120 * 0.021 + 0.1) and per_column == pytest.approx(2300 / 1.25e8 + 0.005)
    assert per_span == pytest.approx(S.PRIOR_SPAN_COLUMNS * 0.005)
    # the fit replaces it once the steps can tell a column's cost
    fitted = job(True)
    for i in range(S.COST_MIN_STEPS * 2):
        k = 0 if i % 3 == 0 else 2 + 3 * (i % 4)
        fitted.observe(1 + k, int(k > 0), 0.06 + 0.001 * (1 + k) + 0.01 * (k > 0))
    assert fitted.costs() == pytest.approx((0.06, 0.001, 0.01), abs=1e-9)


def test_a_batchs_sessions_are_priced_apart_from_its_draft_columns():
    """A batch whose sessions finish narrows by a session's own column, which costs its attention and
    bookkeeping beyond a draft column's: with the sessions in each step told to it, StepCost fits the
    two apart (250 ms base, 24 ms a session, 5 ms a draft column, 30 ms a drafting session, as 8
    sessions on loopback measured) and prices a step of 3 sessions at its own base; without them (the
    control: every step one session, as before) the fit reads a column at twice its cost."""

    def batch(told: bool) -> S.StepCost:
        cost = S.StepCost()
        for i in range(S.COST_WINDOW):
            sessions = 8 - (i * 6) // S.COST_WINDOW  # 8 down to 3 as they finish
            drafts, spans = (i * 7) % 11, i % 3 if (i * 7) % 11 else 0
            width = sessions + drafts
            seconds = 0.25 + 0.024 * sessions + 0.005 * width + 0.03 * spans
            cost.observe(width, spans, seconds, sessions=sessions if told else 1)
        return cost

    told = batch(True)
    assert told.fit() == pytest.approx((0.25, 0.005, 0.03), abs=1e-9) and told.per_session == pytest.approx(0.024)
    assert told.costs(3) == pytest.approx((0.25 + 3 * 0.024, 0.005, 0.03))
    assert told.costs() == pytest.approx((0.25 + told.sessions[-1] * 0.024, 0.005, 0.03))
    blind = batch(False)
    assert blind.per_session == 0.0 and blind.fit()[1] > 1.8 * 0.005  # twice a draft column's cost
    # one session's steps (all of one count) fit as before: per_session stays 0
    single = _fitted(0.003, 0.1, 0.006)
    assert single.per_session == 0.0 and single.costs(5) == single.fit()


def _fitted(per_column: float, base: float, per_span: float = 0.0) -> S.StepCost:
    cost = S.StepCost()
    for i in range(S.COST_MIN_STEPS * 2):
        width, spans = 8 + 8 * (i % 4), i % 3  # widths 8..32, 0..2 drafting sessions: enough to fit
        cost.observe(width, spans, base + per_column * width + per_span * spans)
    return cost


def test_step_cost_fits_columns_and_spans():
    base, per_column, per_span = _fitted(0.003, 0.1, 0.006).fit()
    assert (base, per_column, per_span) == pytest.approx((0.1, 0.003, 0.006), abs=1e-9)
    assert S.StepCost().fit() is None  # nothing seen
    flat = S.StepCost()
    for _ in range(S.COST_MIN_STEPS * 2):
        flat.observe(8, 0, 0.1)  # one width only: a column's cost cannot be told from the base
    # no prefill timed either (the loop times each one first): no prior, the caps
    assert flat.fit() is None and flat.costs() is None and flat.allocate([4, 4], [0.9, 0.1]) == [4, 4]
    flat.observe(40, 0, 0.1 + 32 * 0.002, prefill=True)  # a prefill 2 ms a column dearer than the plain steps
    assert flat.costs() == pytest.approx((0.1 - 8 * 0.002, 0.002, S.PRIOR_SPAN_COLUMNS * 0.002))
    assert flat.allocate([4, 4], [0.9, 0.1]) == [4, 0]  # the prior prices them (test_drafts_are_priced_...)


def test_a_single_sessions_span_cost_is_fitted():
    """One session: each step carries its drafts or not (0 or 1 drafting session, a spread of 0.5 at
    most). The span's cost is still told apart from the base and the columns once there are
    SPAN_MIN_STEPS steps of each, and the budget then charges a first draft with it: at 60 ms a
    step, 1 ms a column and 10 ms a span, a draft accepted 10 % of the time does not pay, which a
    budget pricing only the column (1 ms) would keep."""
    cost = S.StepCost()
    for i in range(S.COST_MIN_STEPS * 2):
        k = 0 if i % 3 == 0 else 2 + 3 * (i % 4)  # a third of the steps without drafts, widths to 12
        cost.observe(1 + k, int(k > 0), 0.06 + 0.001 * (1 + k) + 0.01 * (k > 0))
    assert cost.fit() == pytest.approx((0.06, 0.001, 0.01), abs=1e-9)
    assert cost.allocate([4], [0.1]) == [0]
    too_few = S.StepCost()  # fewer than SPAN_MIN_STEPS plain steps: the span folds into the rest
    for i in range(S.COST_MIN_STEPS * 2):
        k = 0 if i < S.SPAN_MIN_STEPS - 1 else 2 + 3 * (i % 4)
        too_few.observe(1 + k, int(k > 0), 0.06 + 0.001 * (1 + k) + 0.01 * (k > 0))
    assert too_few.fit()[2] == 0.0


def test_step_cost_remembers_a_columns_cost_once_every_draft_is_cut():
    """A budget that cut every draft sees only plain steps, all of one width: it keeps what a column
    and a drafting session cost (and refits the base, which follows the network), instead of letting
    every draft back in to learn it again."""
    cost = _fitted(0.003, 0.1, 0.006)
    for _ in range(S.COST_WINDOW):
        cost.observe(8, 0, 0.25 + 0.003 * 8)  # plain steps only; the base moved (a slower network)
    assert cost.fit() == pytest.approx((0.25, 0.003, 0.006), abs=1e-9)
    assert cost.allocate([4] * 8, [0.05] * 8) == [0] * 8  # still cut: 5 % drafts do not pay for 3 ms columns
    assert cost.allocate([4] * 8, [0.9] + [0.05] * 7)[0] > 0  # a session whose drafts pay keeps them


def test_step_cost_keeps_drafts_that_pay_and_cuts_the_rest():
    assert _fitted(0.0, 0.45).allocate([4, 4, 0], [0.9, 0.05, 0.5]) == [4, 4, 0]  # free columns: all kept
    # A compute-bound batch of 8 (3 ms a column, 6 ms a drafting session, 100 ms base): the session
    # accepting 90 % drafts, those accepting 5 % do not; a sampled (fixed) one keeps its drafts.
    ks = _fitted(0.003, 0.1, 0.006).allocate([4] * 8, [0.9] + [0.05] * 7, fixed=[False] * 7 + [True])
    assert ks[0] > 0 and ks[1:7] == [0] * 6 and ks[7] == 4, ks
    # The rule itself: the number of drafts that makes expected tokens per second highest.
    k = _fitted(0.01, 0.1).allocate([8], [0.5])[0]

    def rate(m: int) -> float:
        return (1 + sum(0.5**j for j in range(1, m + 1))) / (0.1 + 0.01 * (1 + m))

    assert k == 2 and rate(2) == max(rate(m) for m in range(9)), [rate(m) for m in range(9)]
    # A costly span: one draft of a session at 60 % does not pay for it, where a free span would.
    assert _fitted(0.001, 0.1, 0.2).allocate([1], [0.6]) == [0] and _fitted(0.001, 0.1).allocate([1], [0.6]) == [1]


def test_config_refuses_bad_values():
    for kw, needle in [
        ({"method": "eagle"}, "unknown speculative method"),
        ({"num_speculative_tokens": 0}, r"\[1, 64\]"),
        ({"method": "draft_model"}, "needs --draft-model"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "min <= max"),
    ]:
        with pytest.raises(SpeculativeError, match=needle):
            SpeculativeConfig(**kw)
    with pytest.raises(SpeculativeError, match="does not fit the context"):
        SpeculativeConfig(num_speculative_tokens=8).check_context(8)
    with pytest.raises(SpeculativeError, match="needs --speculative"):
        from_flags(None, None, 3)
    assert from_flags(None, None, None) is None
    assert from_flags(None, "/x", None) == SpeculativeConfig("draft_model", draft_model="/x")
    # suffix: its own default cap and cache flag; another method's flags refused, and its flag elsewhere
    assert from_flags("suffix", None, None).num_speculative_tokens == 32
    assert from_flags("suffix", None, 5, suffix_cache_tokens=0).suffix_cache_tokens == 0
    for args, needle in [
        (("suffix", "/x", None), "--draft-model is for the draft_model method, not suffix"),
        (("ngram", None, None, 64), "--suffix-cache-tokens is for --speculative suffix, not ngram"),
        ((None, None, None, 64), "needs --speculative suffix"),
        (("suffix", None, None, -1), "must be >= 0"),
        (("tree", None, None), "unknown speculative method"),
        ((None, None, None, None, (5.0, 100.0)), "they need --speculative"),
        (("suffix", None, None, None, (5.0, None)), "go together"),
        (("suffix", None, None, None, (None, 100.0)), "go together"),
        (("suffix", None, None, None, (-1.0, 100.0)), "must be in"),
        (("suffix", None, None, None, (5.0, 0.0)), "must be in"),
    ]:
        with pytest.raises(SpeculativeError, match=needle):
            from_flags(*args)
    link = from_flags("suffix", None, None, None, (5.0, 100.0))
    assert (link.link_rtt_ms, link.link_mbps) == (5.0, 100.0) and link.describe()["link_mbps"] == 100.0


# Exactness of the rejection rule: the chi-square statistic of N draws against the exact
# distribution over C cells is below the 1 - ALPHA quantile with probability 1 - ALPHA when the rule is
# right. ALPHA = 1e-4: a correct rule fails this test once in 10,000 runs.
ALPHA = 1e-4


def chi2_quantile(dof: int, alpha: float) -> float:
    """The upper alpha quantile of chi-square(dof), by Wilson-Hilferty (within 1 % for dof >= 3)."""
    z = -_norm_ppf(alpha)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _norm_ppf(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            lo = mid
        else:
            hi = mid
    return lo


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.slow
def test_sampled_verify_keeps_the_target_distribution():
    """Verifications of drafts [d1, d2] against fixed target distributions (p1 for the first token,
    p2 for every later one): the first two tokens are distributed as p1 x p2 (draws from a seeded
    generator); a rule that keeps every draft is far off. 20,000 draws over 12 cells."""
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p2 = torch.tensor([0.2, 0.6, 0.2])
    logits = torch.full((3, 4), -1e4)  # exp(-1e4) underflows to 0: a token the target never draws
    logits[0] = p1.log()
    logits[1, :3] = p2.log()
    logits[2, :3] = p2.log()
    exact = (p1[:, None] * p2[None, :]).reshape(-1)
    runs = 20_000

    def tally(rule) -> torch.Tensor:
        s = Sampler(SamplingParams(temperature=1.0, seed=7))
        counts = torch.zeros(12, dtype=torch.float64)
        for _ in range(runs):
            out, _ = rule(s, logits, [1, 1])
            if len(out) == 1:  # d1 rejected: the next step draws the second token (from p2 here too)
                out.append(s(logits[1]))
            counts[out[0] * 3 + out[1]] += 1
        return counts

    bound = chi2_quantile(11, ALPHA)
    assert chi2(tally(verify), exact) < bound

    def keep_every_draft(s, lg, drafts):
        return drafts + [s(lg[len(drafts)])], len(drafts)

    assert chi2(tally(keep_every_draft), exact) > 10 * bound  # the test can fail


# ---- against the workers ----


def runs(eng, prompts, spec: Speculator | None, sampling=GREEDY, new=NEW):
    return [generate(eng, p, max_new_tokens=new, sampling=sampling, speculator=spec) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("arch,n", [("qwen2", 3), ("llama", 2)])
def test_greedy_tokens_equal_without_speculation_and_transformers(arch, n, tiny_qwen2, tiny_llama, zero_draft):
    """n-gram drafts (accepted and rejected: rollbacks), the target itself as draft model (every
    draft accepted) and, on llama, a draft model that always misses: every session's tokens equal
    greedy decoding's and transformers'. qwen2 at N = 3 splits a KV group across workers."""
    model = tiny_qwen2 if arch == "qwen2" else tiny_llama
    ref = reference.load_reference(model)
    want = [reference.greedy(ref, p, NEW) for p in PROMPTS]
    with Engine(model, threads(n_workers=n, timeout_s=60, context=96)) as eng:
        plain = runs(eng, PROMPTS, None)
        assert [r.token_ids for r in plain] == want
        assert all(r.steps == NEW and r.speculative is None for r in plain)
        v = eng.config.vocab
        # every draft verified (no budget): the budget prices columns by this machine's step times, and
        # under load it cut every n-gram draft (CI: 0 accepted of 8 and of 5 drafted)
        ng = Speculator(ngram(adaptive=False), v, eng.context)
        with_ngram = runs(eng, PROMPTS, ng)
        assert [r.token_ids for r in with_ngram] == want
        t = ng.totals
        assert 0 < t.num_accepted_tokens < t.num_draft_tokens, t  # both paths ran: accepted and rolled back
        assert sum(r.steps for r in with_ngram) < sum(r.steps for r in plain)
        for r in with_ngram:  # vLLM's definition, per request
            s = r.speculative
            assert s["method"] == "ngram" and r.steps + s["num_accepted_tokens"] == len(r.token_ids)
        # not adaptive either: the steps-halved check below is about the drafts, not the budget, which on a
        # loaded run may cut some (a helper saw this test fail once, in one process beside another's tests)
        hit = Speculator(
            draft_cfg(model, adaptive=False), v, eng.context, draft_model=DenseModel(open_weights(model), max_seq=1)
        )
        with_hit = runs(eng, PROMPTS, hit)
        assert [r.token_ids for r in with_hit] == want
        assert hit.totals.num_accepted_tokens == hit.totals.num_draft_tokens > 0  # the target drafting itself
        assert sum(r.steps for r in with_hit) <= sum(r.steps for r in plain) // 2
        if arch == "llama":
            # every step drafts (no budget): the pooled rate after n misses is 1 / (n + 1) (one pseudo-trial
            # at EMPTY_JOB_RATE 1), and under load the budget cut the misses to 8 (0.11)
            miss = Speculator(
                SpeculativeConfig("draft_model", 3, draft_model=str(zero_draft), adaptive=False), v, eng.context
            )
            assert 0 not in {t for w in want for t in w}
            with_miss = runs(eng, PROMPTS, miss)
            assert [r.token_ids for r in with_miss] == want
            assert miss.totals.num_accepted_tokens == 0 < miss.totals.num_drafts
            assert miss.pool.rate() < 0.1 < hit.pool.rate()  # the job's pooled rate: the next session's prior
        assert eng.slot_history == {} and kv_probe(eng) == [0.0] * n  # released and zeroed


@pytest.mark.slow
def test_suffix_drafts_keep_greedy_tokens_and_the_cache_pays(tiny_llama):
    """`--speculative suffix` (issue 43): greedy tokens equal transformers' with drafts from the
    session's suffix trie; run again, the same prompts draft from the job's global cache of earlier
    outputs and need fewer forwards than with no cache (0 tokens); the counters add up."""
    ref = reference.load_reference(tiny_llama)
    want = [reference.greedy(ref, p, NEW) for p in PROMPTS]
    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=96)) as eng:
        v = eng.config.vocab
        # Not adaptive: every step drafts what the tries offer. The budget and the pause follow this
        # machine's measured step times and acceptance, so on a loaded run they may rightly draft
        # nothing here (CI saw 72 = 3 · 24 forwards once); they are tested apart.
        cached = Speculator(SpeculativeConfig("suffix", 16, adaptive=False), v, eng.context)
        uncached = Speculator(SpeculativeConfig("suffix", 16, suffix_cache_tokens=0, adaptive=False), v, eng.context)
        first = runs(eng, PROMPTS, cached)
        assert [r.token_ids for r in first] == want
        assert cached.suffix_cache is not None and len(cached.suffix_cache) == NEW * len(PROMPTS)
        again = runs(eng, PROMPTS, cached)
        alone = runs(eng, PROMPTS, uncached)
        assert [r.token_ids for r in again] == [r.token_ids for r in alone] == want
        assert uncached.suffix_cache is not None and len(uncached.suffix_cache) == 0
        assert sum(r.steps for r in again) < sum(r.steps for r in alone) < len(PROMPTS) * NEW
        for r in first + again + alone:
            s = r.speculative
            assert s["method"] == "suffix" and s["forwards"] == r.steps
            assert r.steps + s["num_accepted_tokens"] == len(r.token_ids)
            assert s["columns"] == r.steps - 1 + s["num_draft_tokens"]  # decode steps: 1 + their drafts
            assert sum(s["accepted_by_depth"]) == s["num_accepted_tokens"]
            assert s["tokens_per_forward"] == round(len(r.token_ids) / r.steps, 4)
        assert eng.slot_history == {} and kv_probe(eng) == [0.0, 0.0]


def test_batched_sessions_with_speculation_equal_each_alone(tiny_llama):
    """Sessions decoding together, each with its own drafter, verification columns of different
    widths in one step, newcomers joining: every session's tokens are its tokens alone; sampled
    sessions keep their own seeded generators (their tokens alone with speculation)."""
    prompts = PROMPTS + [[40, 41, 42, 40, 41], [9] * 6]
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.8, top_k=20, seed=5 + i) for i in range(2)]
    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=96)) as eng:
        # every draft verified (no budget): what the budget keeps follows this machine's step times
        spec = Speculator(ngram(adaptive=False), eng.config.vocab, eng.context)
        alone = [
            generate(eng, p, max_new_tokens=NEW, sampling=s).token_ids for p, s in zip(prompts, params, strict=True)
        ]
        alone_spec = [
            generate(eng, p, max_new_tokens=NEW, sampling=s, speculator=spec).token_ids
            for p, s in zip(prompts, params, strict=True)
        ]
        assert alone_spec[:3] == alone[:3]  # greedy: the same tokens
        # with the budget, the loop times the prefill's step for its prior (StepCost.prior)
        priced = Speculator(ngram(), eng.config.vocab, eng.context)
        assert generate(eng, prompts[0], max_new_tokens=NEW, sampling=GREEDY, speculator=priced).token_ids == alone[0]
        assert priced.cost is not None and priced.cost.prefill_s is not None
        assert priced.cost.prefill_s[0] == len(prompts[0])
        # and tells it each decode step's sessions (StepCost.per_session): 3 together, then fewer
        trio = run_batch(eng, [Sequence(p, NEW, GREEDY) for p in prompts[:3]], 3, speculator=priced)
        assert [r.token_ids for r in trio] == alone[:3] and max(priced.cost.sessions) == 3
        seqs = [Sequence(p, NEW, s) for p, s in zip(prompts, params, strict=True)]
        batched = run_batch(eng, seqs, 3, speculator=spec)
        assert [r.token_ids for r in batched] == alone_spec
        assert sum(r.speculative["num_accepted_tokens"] for r in batched) > 0
        assert eng.slot_history == {} and kv_probe(eng) == [0.0, 0.0]


def test_masked_mode_speculation_equals_greedy(tiny_qwen2):
    """Masked 1+1: the client rolls its own KV cache back (zeroed) and the products of a
    verification step are checked like any other; tokens equal greedy decoding's."""
    from fusion_compute.masked.client import MaskedEngine

    with MaskedEngine(tiny_qwen2, masked_threads(n_a=1, n_b=1, timeout_s=60, context=96)) as eng:
        plain = runs(eng, PROMPTS[:2], None)
        # every draft verified (no budget): what the budget keeps follows this machine's step times
        spec = Speculator(ngram(adaptive=False), eng.config.vocab, eng.context)
        got = runs(eng, PROMPTS[:2], spec)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
        assert 0 < spec.totals.num_accepted_tokens < spec.totals.num_draft_tokens
        assert eng.verifier.failures == 0 and eng.kv_abs_max() == 0.0


@pytest.mark.slow
def test_sampled_speculation_keeps_the_output_distribution(tiny_llama):
    """Temperature 1, top-k 3 on the tiny Llama: the first three tokens of 480 seeded sessions
    with speculation (the target as draft model: its argmax proposals are accepted with p(d) and
    resampled from (p - q)+ otherwise, both paths) follow the exact joint distribution of the three
    tokens computed from the dense twin (27 cells); so do sessions without speculation. A rule
    that keeps every draft fails. False-failure rate: ALPHA = 1e-4 per chi-square check."""
    params = lambda i: SamplingParams(temperature=1.0, top_k=3, seed=1000 + i)  # noqa: E731
    prompt = [5, 17, 33, 2]
    dense = DenseModel(open_weights(tiny_llama), max_seq=16)
    sampler = Sampler(params(0))

    def dist(prefix: list[int]) -> torch.Tensor:
        return sampler.probs(dense.forward(prefix, 0)[-1])

    exact: dict[tuple[int, ...], float] = {}
    p1 = dist(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            p3 = dist(prompt + [a, b])
            for c in p3.nonzero().flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    assert len(exact) == 27 and abs(sum(exact.values()) - 1) < 1e-9
    cells = sorted(exact)
    probs = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    n_runs = 480

    def sample(spec, runs: int = n_runs) -> torch.Tensor:
        seqs = [Sequence(prompt, 3, params(i)) for i in range(runs)]
        results = run_batch(eng, seqs, 16, speculator=spec)
        counts = torch.zeros(len(cells), dtype=torch.float64)
        for r in results:
            counts[cells.index(tuple(r.token_ids))] += 1
        return counts

    bound = chi2_quantile(len(cells) - 1, ALPHA)
    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=32)) as eng:
        target = DenseModel(open_weights(tiny_llama), max_seq=1)
        spec = Speculator(draft_cfg(tiny_llama, k=2), eng.config.vocab, eng.context, draft_model=target)
        assert chi2(sample(None), probs) < bound
        assert chi2(sample(spec), probs) < bound
        t = spec.totals
        assert 0 < t.num_accepted_tokens < t.num_draft_tokens  # accepted and resampled, both
        real = batching.accept
        # a wrong rule: keep every draft (of a chain: every column, then a token after the last)
        batching.accept = lambda s, tree, lg: (
            [*tree.tokens_T[1:], s(lg[len(tree) - 1])],
            list(range(len(tree))),
        )
        try:
            wrong = sample(
                Speculator(draft_cfg(tiny_llama, k=2), eng.config.vocab, eng.context, draft_model=target), 160
            )
        finally:
            batching.accept = real
        assert chi2(wrong, probs) > bound  # the test can fail


# ---- the command line ----


@pytest.mark.slow
def test_bad_speculative_flags_are_refused_before_any_worker(tiny_qwen2, tiny_llama, tmp_path):
    """One line on stderr and exit 2, in about the time it takes to read the model's header."""
    base = ["generate", "--prompt-ids", "1,2,3", "--workers", "2"]
    cases = [
        (["--model", str(tiny_qwen2), "--speculative", "ngram", "--num-speculative-tokens", "0"], r"\[1, 64\]"),
        (["--model", str(tiny_qwen2), "--speculative", "medusa"], "unknown speculative method"),
        (["--model", str(tiny_qwen2), "--num-speculative-tokens", "3"], "needs --speculative"),
        (["--model", str(tiny_qwen2), "--speculative", "suffix", "--draft-model", str(tiny_llama)], "not suffix"),
        (["--model", str(tiny_qwen2), "--speculative", "ngram", "--suffix-cache-tokens", "9"], "not ngram"),
        (["--model", str(tiny_qwen2), "--speculative", "suffix", "--link-rtt-ms", "5"], "go together"),
        (["--model", str(tiny_qwen2), "--link-rtt-ms", "5", "--link-mbps", "100"], "they need --speculative"),
        (
            ["--model", str(tiny_qwen2), "--context", "16", "--speculative", "suffix"],
            "--num-speculative-tokens 32 does not fit the context of 16",
        ),
        (["--model", str(tiny_qwen2), "--draft-model", str(tmp_path / "nope")], "--draft-model: model not found"),
        (["--model", str(tiny_qwen2), "--draft-model", str(tiny_llama)], "vocabulary .300 tokens. differs"),
        (
            ["--model", str(tiny_qwen2), "--context", "8", "--speculative", "ngram", "--num-speculative-tokens", "8"],
            "does not fit the context of 8",
        ),
    ]
    import re

    for args, needle in cases:
        out = procs.run(*base, *args, timeout=120)
        assert out.returncode == 2, (args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and re.search(needle, lines[0]), (args, out.stderr)
        assert "worker" not in out.stderr.lower(), out.stderr  # refused before any worker started


def test_session_report_prices_a_forward_in_exchanges():
    """`fusion generate --json`'s speculative object: exchanges per token = the plan's exchanges per
    forward / τ (SmolLM2 at N = 2: 120), columns per decode step over the forwards after the prefill;
    none where the plan does not count exchanges (masked) or nothing was decoded."""
    stats = S.SpecStats("suffix")
    stats.step(40, 1, decode=False)  # the prefill: its token, its columns not counted
    for columns, tokens in ((5, 3), (1, 1), (9, 4)):
        stats.step(columns, tokens, decode=True)
    stats.add(4, 2)
    stats.add(8, 3)
    r = S.session_report(stats.as_dict(), 120)
    assert r["tokens_per_forward"] == 9 / 4 and r["exchanges_per_token"] == round(120 / (9 / 4), 2) == 53.33
    assert r["columns_per_step"] == 5.0 and r["exchanges_per_forward"] == 120
    assert r["accepted_by_depth"] == [2, 2, 1] and r["num_accepted_tokens"] == 5
    masked = S.session_report(stats.as_dict(), None)
    assert masked["exchanges_per_token"] is None and masked["columns_per_step"] == 5.0
    only_prefill = S.SpecStats("suffix")
    only_prefill.step(40, 1, decode=False)
    assert S.session_report(only_prefill.as_dict(), 120)["columns_per_step"] is None


@pytest.mark.slow
def test_cli_json_reports_the_speculative_counters(tiny_llama):
    import json

    args = ["--model", str(tiny_llama), "--prompt-ids", ",".join(map(str, CLI_PROMPT)), "--max-new-tokens", "16"]
    cmd = ["generate", "--workers", "2", "--executor", "inproc", "--json", *args]  # workers: threads of the command
    # the budget told of a 50 ms link (120 exchanges' worth of round trips on this model's 8): a step then
    # costs far more than a column, so the drafts pay whatever this machine's step times (without it, CI
    # under load once kept no draft: 16 forwards for 16 tokens)
    spec = ["--speculative", "ngram", "--num-speculative-tokens", "3", "--link-rtt-ms", "50", "--link-mbps", "1000"]
    runs = [procs.run(*cmd, timeout=180), procs.run(*cmd, *spec)]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    plain, spec = (json.loads(r.stdout) for r in runs)
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["speculative"]
    assert set(s) == {
        "method",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "mean_acceptance_length",
        "forwards",
        "columns",
        "tokens_per_forward",
        "accepted_by_depth",
        "columns_per_step",
        "exchanges_per_forward",
        "exchanges_per_token",
    }
    assert s["forwards"] == spec["steps"] and s["columns"] == spec["steps"] - 1 + s["num_draft_tokens"]
    # the tiny Llama at N = 2: 4 scatters per layer, less the 2 the boundary merges, plus ingress and egress
    x = 4 * json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"] - 2 + 2
    assert s["exchanges_per_forward"] == x
    assert s["exchanges_per_token"] == pytest.approx(x * spec["steps"] / len(spec["token_ids"]), abs=0.01)
    assert s["columns_per_step"] == round(s["columns"] / (spec["steps"] - 1), 4)
    assert s["method"] == "ngram" and s["num_draft_tokens"] <= 3 * s["num_drafts"]
    assert spec["steps"] + s["num_accepted_tokens"] == len(spec["token_ids"]) and spec["steps"] < plain["steps"]
    assert s["mean_acceptance_length"] == round(1 + s["num_accepted_tokens"] / s["num_drafts"], 4)
    assert "speculative" not in plain


def test_a_fixed_batch_prices_a_token_by_the_time_it_saves():
    """StepCost.allocate_worth (a fixed batch, batching.BatchRunner._worth): a session's m drafts are
    kept where shared · min(G_m, limit) + own · G_m exceeds the seconds they add (per_span + m ·
    per_column). By hand, at 9 ms a column and 0.3 ms a span: a session whose tokens save only its own
    place in the steps (10 ms) drafts nothing at 30 % per column, which the step's tokens per second
    (allocate, 8 sessions) keeps; the session that ends last (the plain step's 0.36 s for at most 3
    tokens) drafts until its expected tokens reach 3 (m = 4), not the 5 that the limit would allow
    without it (its fifth column's 0.5 token is worth only its own place)."""
    cost = _fitted(0.009, 0.28, 0.0003)
    assert cost.costs(8)[1:] == pytest.approx((0.009, 0.0003), abs=1e-9)
    low = [0.3] * 4
    assert cost.allocate([4] * 8, [0.3] * 8, gains=[low] * 8)[0] > 0  # the step's share keeps them
    assert cost.allocate_worth([4], [low], [(0.0, 0.0, 0.01)]) == [0]
    last = [0.9, 0.8, 0.7, 0.6, 0.5]
    assert cost.allocate_worth([5], [last], [(0.36, 3.0, 0.01)]) == [4]
    assert cost.allocate_worth([5], [last], [(0.36, 9.0, 0.01)]) == [5]  # the limit is what stops it
    # a sampled (fixed) session keeps its cap; one without drafts gets none; no cost known: the caps
    assert cost.allocate_worth([3, 0], [low, None], [(0.0, 0.0, 0.0)] * 2, fixed=[True, False]) == [3, 0]
    assert S.StepCost().allocate_worth([4], [low], [(0.0, 0.0, 0.0)]) == [4]


def test_a_session_in_its_prefill_outlasts_the_decoding_ones():
    """BatchRunner._worth counts a session admitted this step (in its prefill: its whole budget to go,
    no drafts) among those a decoding session must outlast: B, 19 tokens to go, would end last beside
    A alone and earns the plain step for its tokens; beside a newcomer with 200 to go it earns only its
    own place (the newcomer outlasts it, and gains no token this step)."""
    from types import SimpleNamespace

    class Cost:
        per_session = 0.001

        def costs(self, sessions=None):
            return (0.1, 0.009, 0.0003)

    r = batching.BatchRunner.__new__(batching.BatchRunner)
    r._cost, r.engine = Cost(), SimpleNamespace(context=1000)
    a, b, c = Sequence([1] * 10, 24, GREEDY), Sequence([1] * 10, 24, GREEDY), Sequence([1] * 10, 200, GREEDY)
    a.out, a.steps, b.out, b.steps = [0] * 20, 20, [0] * 5, 5
    gains = [[0.5, 0.4], [0.5, 0.4]]
    alone = r._worth([a, b], [a, b], gains)
    assert alone is not None and alone[1][0] > 0.1  # B ends last: its tokens save a plain step
    beside = r._worth([a, b, c], [a, b], gains)
    assert beside is not None and beside[1][:2] == (0.0, 0.0) and beside[1][2] == pytest.approx(0.01)


def _fixed_batch(waiting: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """8 sessions replayed through BatchRunner on bench/replay_batch's ReplayEngine (a step-time table,
    no workers): 4 copy a passage of their prompt, 4 write tokens of a small alphabet their prompt
    also uses (short suffix matches that mostly miss). Returns the outputs, the ids and each session's
    draft columns."""
    import random

    from fusion_compute.bench.replay_batch import BatchSteps, ReplayEngine

    rng = random.Random(7)
    rows = []
    for i in range(8):
        if i < 4:
            prompt = [100 + 40 * i + j for j in range(40)]
            out = prompt[5:29]
        else:
            prompt = [rng.randrange(20) for _ in range(40)]
            out = [rng.randrange(20) for _ in range(24)]
        rows.append((prompt, out))
    steps = BatchSteps(((1, 0.12), (2, 0.15), (5, 0.33), (33, 0.48)), ((1, 0.12), (8, 0.35)), 0.0003, 0.009, 3.0)
    eng = ReplayEngine({tuple(p): o for p, o in rows}, 500, 200, steps, 0.0001)
    sp = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=32), 500, 200)
    runner = batching.BatchRunner(eng, 8, speculator=sp, clock=lambda: eng.now)  # type: ignore[arg-type]
    seqs = [Sequence(p, len(o), GREEDY) for p, o in rows]
    for s in seqs:
        runner.add(s)
    while runner.active:
        runner.waiting = waiting
        runner.step()
    return [o for _, o in rows], [s.out for s in seqs], [s.spec.num_draft_tokens for s in seqs]


def test_a_fixed_batch_drafts_only_what_shortens_it():
    """A batch that no session waits to join steps until its last session ends, so the drafts of a
    session that would end with or before others save only that session's place in the steps, not a
    step's share (BatchRunner._worth). Replayed (bench/replay_batch.py's engine, a step-time table):
    with nobody waiting, the 4 sessions whose drafts mostly miss draft under half the columns they
    draft under the step's tokens per second (a session waiting: every token a step's share), the
    copying ones still draft, and the ids are the outputs either way. Negative control: the same
    batch with a session waiting."""
    want, ids_fixed, drafts_fixed = _fixed_batch(0)
    _, ids_queue, drafts_queue = _fixed_batch(1)
    assert ids_fixed == ids_queue == want
    assert 2 * sum(drafts_fixed[4:]) < sum(drafts_queue[4:]), (drafts_fixed, drafts_queue)
    assert min(drafts_fixed[:4]) > 0, drafts_fixed
