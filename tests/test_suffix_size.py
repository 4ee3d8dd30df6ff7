"""The suffix drafts' size cap per match length (issue 43, generation/suffix_size.py): chosen from the
job's step cost and what matches of that length earned. Real StepCosts fed the step times of
bench/replay.py's table (one session's step on loopback, measured) with 120 exchanges of 0.1, 5 or
21 ms added; the cap is checked against a brute-force argmax of tokens per second over the prior's
gains written out in closed form, and end to end through the drafter and the loop. In-process, no
workers; about a second."""

from __future__ import annotations

import pytest

from fusion_compute.bench.replay import interpolate
from fusion_compute.generation.speculative import Speculator, StepCost
from fusion_compute.generation.speculative_config import SpeculativeConfig
from fusion_compute.generation.suffix import SuffixDrafter
from fusion_compute.generation.suffix_size import MatchSizing
from fusion_compute.generation.tree_cost import best_size

# bench/replay.py --step-ms 1:139,2:165,3:163,5:288,9:307,17:338,33:460 (s by columns)
TABLE = ((1, 0.139), (2, 0.165), (3, 0.163), (5, 0.288), (9, 0.307), (17, 0.338), (33, 0.460))
K = 32


def job_cost(rtt_ms: float, plain_steps: int = 1) -> StepCost:
    """A fresh job's StepCost after its prefill (40 columns) and `plain_steps` plain decode steps: its
    prior prices the drafts, as at a job's first drafting step."""
    cost = StepCost()

    def seconds(w: int) -> float:
        return 120 * rtt_ms / 1e3 + interpolate(TABLE, w)

    cost.observe(40, 0, seconds(40), prefill=True)
    for _ in range(plain_steps):
        cost.observe(1, 0, seconds(1))
    return cost


def prior_gains(m: int, n: int) -> list[float]:
    """g_j = m / (m + 2) · (m + 1) / (m + j): the prior's product in closed form (suffix_size's docstring)."""
    return [m / (m + 2) * (m + 1) / (m + j) for j in range(1, n + 1)]


def brute_cap(gains: list[float], base: float, per_column: float, span: float) -> int:
    def rate(n: int) -> float:
        return (1 + sum(gains[:n])) / (base + (1 + n) * per_column + (span if n else 0.0))

    best = max(rate(n) for n in range(len(gains) + 1))
    return min(n for n in range(len(gains) + 1) if rate(n) == best)


def test_the_prior_is_the_closed_form():
    s = MatchSizing(job_cost(0.1), K)
    for m in (1, 2, 3, 8):
        assert s.gains(m, K) == pytest.approx(prior_gains(m, K))


@pytest.mark.parametrize("rtt_ms", [0.1, 5.0, 21.0])
def test_the_cap_is_the_brute_force_best_size_at_the_jobs_cost(rtt_ms):
    cost = job_cost(rtt_ms)
    base, per_column, span = cost.costs()
    cap = MatchSizing(cost, K).caps()
    for m in range(1, 10):
        assert cap(m) == brute_cap(prior_gains(m, K), base, per_column, span), (rtt_ms, m)


def test_the_cap_follows_the_cost():
    """One machine: a one-token match drafts nothing, a longer one drafts; across 5-21 ms of round
    trips every match drafts at least its factor's 16 per matched token. A cap that ignored the cost
    (the factor alone, or one size for every link) fails one side."""
    local, wan5, wan21 = (MatchSizing(job_cost(r), K).caps() for r in (0.1, 5.0, 21.0))
    assert local(1) == 0
    assert 0 < local(2) < local(3) < K
    assert wan5(1) >= 16 and wan21(1) >= 16
    assert all(wan5(m) == wan21(m) == K for m in range(2, 9))


def test_one_sizing_follows_its_jobs_cost_as_it_changes():
    """The caps are kept while the cost and the history stay the same (MatchSizing._memo); a job whose
    steps' cost changes (here its round trips grow from 0.1 to 21 ms, the same StepCost observing them)
    gets the new cost's caps from the same MatchSizing, each equal to a fresh one's at that cost."""
    cost = job_cost(0.1)
    s = MatchSizing(cost, K)
    local = [s.caps()(m) for m in range(1, 10)]
    assert local == [MatchSizing(job_cost(0.1), K).caps()(m) for m in range(1, 10)]
    for _ in range(40):  # the same job, now across a wide-area link
        cost.observe(1, 0, 120 * 0.021 + interpolate(TABLE, 1))
    wide = [s.caps()(m) for m in range(1, 10)]
    assert wide != local and wide == [MatchSizing(cost, K).caps()(m) for m in range(1, 10)]
    assert wide[0] >= 16 > local[0]


def test_no_step_timed_no_cap():
    assert MatchSizing(StepCost(), K).caps()(1) == K  # nothing to price drafts by yet (the budget's rule too)


def test_what_a_match_length_earned_moves_its_cap():
    """One machine: one-token matches whose drafts were accepted deep earn drafts; their misses take
    them away again; other match lengths keep their prior."""
    cost = job_cost(0.1)
    s = MatchSizing(cost, K)
    before = [s.caps()(m) for m in (1, 3)]
    for _ in range(3):
        s.add(1, 12, 12)  # a 12-deep tree from a one-token match, all accepted
    earned = [s.caps()(m) for m in (1, 3)]
    assert before[0] == 0 < earned[0]
    assert earned[1] == before[1]
    for _ in range(40):
        s.add(1, 12, 0)  # then many first-draft misses: the deep rates stand, the first falls
    assert s.caps()(1) == 0
    s.add(20, 5, 5)  # longer matches share the last bucket
    assert s.history.keys() == {1, 8}


def test_the_drafter_grows_no_short_match_where_a_column_costs_but_keeps_a_copy():
    """Through SuffixDrafter: the session's last token occurred once before (a one-token match with a
    16-token continuation, frequency 1): uncapped it drafts 16, capped on one machine nothing, capped
    across 21 ms the 16 again; a five-token match still drafts its copy on one machine."""
    text = list(range(100, 140))
    tokens = [*text, 7, *range(200, 220), 100]  # ends with text's first token: a one-token match
    k = 24
    uncapped = SuffixDrafter(None, 64, 16.0, 0.0, 0.02)
    local = SuffixDrafter(None, 64, 16.0, 0.0, 0.02, sizing=MatchSizing(job_cost(0.1), k))
    wan = SuffixDrafter(None, 64, 16.0, 0.0, 0.02, sizing=MatchSizing(job_cost(21.0), k))
    assert len(uncapped.propose_tree(tokens, k).tokens) == 16
    assert local.propose_tree(tokens, k).tokens == []
    assert wan.propose_tree(tokens, k).tokens == uncapped.propose_tree(tokens, k).tokens
    copy = [*tokens, 101, 102, 103, 104]  # now a five-token match
    d = local.propose_tree(copy, k)
    assert d.match_len == 5 and d.tokens == text[5:][: len(d.tokens)] and len(d.tokens) >= 10


def test_only_a_greedy_sessions_drafter_is_capped():
    """A sampled session's drafts must not depend on the clock: its drafter has no cap."""
    sp = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=K), 1000, 512)
    assert isinstance(d := sp.drafter(), SuffixDrafter) and d.sizing is sp.sizing is not None
    assert isinstance(d := sp.drafter(greedy=False), SuffixDrafter) and d.sizing is None
    fixed = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=K, adaptive=False), 1000, 512)
    assert fixed.sizing is None  # a fixed draft length: nothing priced, nothing capped


def test_best_size_prices_a_drafting_step():
    """tree_cost.best_size's span: what a step with drafts costs beyond its columns."""
    assert best_size([0.5], 1.0, 0.1) == 1
    assert best_size([0.5], 1.0, 0.1, span_s=1.0) == 0


@pytest.mark.slow
def test_the_loop_tells_the_caps_every_verification_and_keeps_greedy_tokens(tiny_llama):
    """Through the sharded loop (workers in threads, tiny Llama, N = 2), adaptive (the budget and the
    caps at this machine's step times): greedy tokens equal transformers', and every verification of a
    suffix draft reached the job's MatchSizing under its match length (however many the cost let run)."""
    from inproc import threads

    from fusion_compute.generation.generate import generate
    from fusion_compute.generation.sampling_params import SamplingParams
    from fusion_compute.model import reference
    from fusion_compute.structural.client import Engine

    prompts = [[5, 17, 33, 2, 99, 5, 17, 33, 2, 99, 5, 17], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]
    ref = reference.load_reference(tiny_llama)
    want = [reference.greedy(ref, p, 16) for p in prompts]
    with Engine(tiny_llama, threads(n_workers=2, timeout_s=60, context=96)) as eng:
        sp = Speculator(SpeculativeConfig("suffix", 16), eng.config.vocab, eng.context)
        got = [generate(eng, p, max_new_tokens=16, sampling=SamplingParams(), speculator=sp).token_ids for p in prompts]
    assert got == want
    assert sp.sizing is not None
    assert sum(len(h) for h in sp.sizing.history.values()) == sp.totals.num_drafts
