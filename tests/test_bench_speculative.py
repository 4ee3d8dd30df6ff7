"""The speculative-decoding bench's pure parts (bench/speculative.py, bench/workloads.py): workload
loading, and the arithmetic behind its figures; and bench/inflight.py's. No worker process, no model
file."""

from __future__ import annotations

import random

import pytest

from fusion_compute.bench import speculative as B
from fusion_compute.bench import workloads


class ChatTokenizer:
    """Stands in for the model's tokenizer: a 'template' of a start marker, one id per character of
    the user's text, and an end marker."""

    def chat_ids(self, messages):
        (m,) = messages
        assert m["role"] == "user"
        return [1, *(ord(c) for c in m["content"]), 2]


def test_workloads_load_in_the_chat_template():
    for name in B.WORKLOAD_NAMES:
        w = workloads.load(name, ChatTokenizer())
        assert w.name == name
        assert 8 <= len(w.texts) <= 16  # the size
        assert len(w.prompts) == len(w.texts)
        for text, ids in zip(w.texts, w.prompts, strict=True):
            assert ids == (1, *(ord(c) for c in text), 2)
    assert len(workloads.load("open_chat", ChatTokenizer(), limit=3).prompts) == 3


def test_input_grounded_prompts_carry_their_material():
    # every input-grounded prompt gives the text or code the answer is drawn from, after its instruction
    for text in workloads.INPUT_GROUNDED:
        instruction, _, material = text.partition("\n\n")
        assert instruction and len(material) > 100, instruction
    assert len(set(workloads.OPEN_CHAT)) == len(workloads.OPEN_CHAT)
    assert all("\n" not in t for t in workloads.OPEN_CHAT)


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(KeyError, match="input_grounded, open_chat"):
        workloads.load("nope", ChatTokenizer())


def test_exchanges_per_forward_from_counters():
    # SmolLM2 at N = 2: 4 reduce-scatters x 30 layers among the workers but layer 0's QKV (the client
    # sends its q/k/v with the ingress) and the last layer's down (its partials go to the client with
    # the egress), + the client's ingress and egress
    assert B.exchanges_per_forward(collectives=118 * 78, forwards=78) == 120
    # Megatron-style TP: 2 all-reduces x 30 layers + the ingress all-gather, less the last down
    # all-reduce (its partials go to the client too), + the client's two
    assert B.exchanges_per_forward(collectives=60 * 8, forwards=8) == 62
    with pytest.raises(ValueError):
        B.exchanges_per_forward(10, 0)


def test_per_token_counts_the_prefill_step_and_its_token():
    # 64 tokens in 30 forwards (1 prefill + 29 verifications) at 120 exchanges each
    r = B.per_token(steps=30, tokens=64, exchanges_per_forward=120)
    assert r == {"forwards_per_token": 0.4688, "exchanges_per_token": 56.25}
    assert B.per_token(10, 10, 120)["exchanges_per_token"] == 120  # no speculation: one forward per token
    with pytest.raises(ValueError):
        B.per_token(1, 0, 120)


def test_acceptance_is_vllms_definition():
    a = B.acceptance(num_drafts=10, num_draft_tokens=40, num_accepted=25)
    assert a["mean_acceptance_length"] == 3.5  # 1 + 25 / 10
    assert a["acceptance_rate"] == 0.625
    assert B.acceptance(0, 0, 0)["mean_acceptance_length"] is None


def test_ratios_are_paired_not_divided_medians():
    pairs = [(2.0, 1.0), (3.0, 1.0), (1.0, 2.0)]  # (speculative, plain) of runs that ran back to back
    r = B.paired_ratios(pairs)
    assert r == {"median": 2.0, "min": 0.5, "max": 3.0, "n": 3, "ci95": None}  # 3 pairs: no 95 % interval
    assert B.paired_ratios([]) is None


def test_median_ci_is_the_sign_tests_order_statistics():
    assert B.median_ci([1.0] * 5) is None  # P(all 5 on one side) = 1/32 > 2.5 %: no 95 % interval exists
    assert B.median_ci([float(x) for x in range(1, 7)]) == [1.0, 6.0]  # 1/64 <= 2.5 %: min..max
    assert B.median_ci([float(x) for x in range(1, 25)]) == [7.0, 18.0]  # P(Bin(24, 1/2) <= 6) = 1.1 %
    assert B.median_ci([float(x) for x in range(100, 0, -1)]) == [40.0, 61.0]  # the textbook ranks, any order
    # the interval holds the true median about 95 % of the time: draws of a known distribution
    rng = random.Random(7)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (B.median_ci([rng.gauss(0, 1) for _ in range(24)]) for _ in range(2000)))
    # exact coverage 97.7 % at n = 24 (discrete ranks): 1954 of 2000 expected, sd 6.7; both bounds are over
    # 5 sd away (a false failure well under 1e-6), and an interval one rank too narrow (95.7 %) or too wide
    # (99.5 %) would land near them
    assert 0.93 * 2000 <= hits <= 0.995 * 2000


def _job(rtt, measured, pairs_ig, pairs_oc, same=True):
    def rows(pairs):
        return [{"spec_tokens_per_s": s, "plain_tokens_per_s": p, "same_tokens": same} for s, p in pairs]

    return {
        "rtt_ms": rtt,
        "measured_rtt_ms": measured,
        "measured_rtt_after_ms": measured + 0.1,
        "workloads": {
            "input_grounded": {"single": rows(pairs_ig), "batch": rows(pairs_ig[:1])},
            "open_chat": {"single": rows(pairs_oc), "batch": []},
        },
    }


def test_rtt_table_groups_pairs_over_repeats():
    every = [
        _job(5.0, 5.8, [(2.0, 1.0)], [(1.0, 1.0)]),
        _job(5.0, 5.9, [(3.0, 1.0)], [(0.9, 1.0)], same=False),
        _job(0.0, 0.1, [(1.0, 1.0)], [(1.0, 1.0)]),
    ]
    rows = B.rtt_table(every)
    assert [(r["rtt_ms"], r["workload"], r["mode"]) for r in rows] == [
        (5.0, "input_grounded", "single"),
        (5.0, "input_grounded", "batch"),
        (5.0, "open_chat", "single"),
        (0.0, "input_grounded", "single"),
        (0.0, "input_grounded", "batch"),
        (0.0, "open_chat", "single"),
    ]
    ig5 = rows[0]
    assert ig5["pairs"] == 2 and ig5["ratio"]["median"] == 2.5
    assert ig5["measured_rtt_ms"]["median"] == pytest.approx(5.9)  # 5.8, 5.9 before each job; 5.9, 6.0 after
    assert ig5["same_tokens"] is False  # one pair differed: reported, not hidden
    assert "**2.50×**" in B.render({"batch": 8, "rtt_table": rows})


def test_side_by_side_jobs_are_summed_and_their_overlap_measured():
    from fusion_compute.bench.inflight import combine

    def job(*windows):  # (start, end, decoded) per round
        return {"runs": [{"start": s, "end": e, "decoded": n} for s, e, n in windows]}

    together = combine([job((0.0, 2.0, 20)), job((0.0, 2.0, 40))], 1)
    assert together == [{"tokens_per_s": 30.0, "side_by_side": 1.0}]  # 10 + 20 tok/s, fully overlapped
    apart = combine([job((0.0, 1.0, 10), (5.0, 6.0, 10)), job((1.0, 2.0, 10), (5.5, 6.5, 10))], 2)
    assert [r["side_by_side"] for r in apart] == [0.0, pytest.approx(1 / 3)]  # one after the other; half-overlapped


# ---- bench/replay.py: a drafter replayed over greedy outputs ----


def test_copy_oracle_takes_the_longest_run_seen_before():
    from fusion_compute.bench.replay import copy_oracle

    # the prefill emits 9; then 1 2 3 4 is the prompt's, and the last token is always the target's own
    assert copy_oracle([1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 7]) == (2, 6)
    assert copy_oracle([1], [5, 6, 7]) == (3, 3)  # nothing recurs: one token a forward
    assert copy_oracle([5, 6, 5, 6], [5, 6, 5, 6, 5]) == (2, 5)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=80, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
    output=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    k=st.integers(1, 8),
    chain=st.booleans(),
)
def test_replayed_suffix_drafts_never_beat_the_copy_oracle(prompt, output, k, chain):
    """Every path of the session's suffix trie is a run of the session's tokens, so no draft is
    accepted further than the longest run of the next tokens seen before: the replay's forwards are
    at least the oracle's (greedy parsing into runs seen before is the shortest), and its counters
    add up (every token emitted once, one prefill)."""
    from fusion_compute.bench.replay import copy_oracle, replay
    from fusion_compute.generation.speculative_config import SpeculativeConfig

    cfg = SpeculativeConfig("suffix", k, suffix_cache_tokens=0)
    stats = replay(cfg, [{"prompt": prompt, "output": output}], tree=not chain, max_new=len(output))
    forwards, tokens = copy_oracle(prompt, output)
    assert stats.tokens == tokens == len(output)
    assert stats.forwards >= forwards
    assert stats.num_accepted_tokens == len(output) - stats.forwards


def test_replay_in_one_job_shares_the_pool_and_counts_the_probes():
    """`job`: several replays through one Speculator and StepCost (--one-job), as the bench's runs share
    a job: the second starts from the first's pooled acceptance. Where a column costs ten seconds over
    the link (more than a whole step, so no acceptance pays for it) the budget cuts every draft, so
    each verification is a probe (DraftLength.probe): one after PAUSE_STEPS starved steps, and as each
    is accepted (the output repeats the prompt) the next comes PAUSE_STEPS later again. The job starts
    from one missed verification: with no miss in the pool its rate is EMPTY_JOB_RATE = 1, and with the
    drafter's own estimate of 1 (every earlier "4" was followed by "1") a column is certain, and a certain
    column pays at any price ((1 + 1) / (b + 2c) > 1 / (b + c) for every base b > 0)."""
    from fusion_compute.bench.replay import Detail, replay
    from fusion_compute.generation.speculative import PAUSE_STEPS, Speculator, StepCost
    from fusion_compute.generation.speculative_config import SpeculativeConfig
    from fusion_compute.generation.tree_cost import LinkCost

    cfg = SpeculativeConfig("suffix", 8)
    # 1e10 bytes a column at 1e9 bytes/s: at one second (1e9) a column whose acceptance neared 1 paid
    # for itself once the session's own frequencies were estimated without its end (suffix_tree.py)
    link = LinkCost(0.0001, 120, 1e10, 1e9, 0.0, 0.0)
    job = Speculator(cfg, 1 << 20, 256), StepCost(link)
    job[0].pool.add(4, 0, 1)  # one verification: 4 drafts, none accepted
    det = Detail()
    rows = [{"prompt": [1, 2, 3, 4], "output": [1, 2, 3, 4] * 10}]
    stats = replay(cfg, rows, link=link, detail=det, job=job)
    assert det.probes == det.probes_accepted == stats.num_drafts == 39 // PAUSE_STEPS  # 39 decode steps
    assert len(job[0].pool.history) == 1 + det.probes
    replay(cfg, rows, link=link, job=job)
    assert len(job[0].pool.history) > det.probes  # the same job's pool, carried


def test_simulated_replay_prices_a_jobs_first_drafts():
    """bench/replay.py --simulate: the steps timed by a model (100 ms a step, 5 ms a column, 80 ms more
    for a step with drafts: one session on loopback) and the loop's StepCost fitted from those times.
    A session whose every draft misses (each other output token is a prompt token, the next is new)
    drafts 53 columns in 24 steps when its drafts go unpriced until the fit and reads 0.84x the plain
    steps' time; priced from its first step, one draft (16 columns), then one probe. A session that copies
    its prompt drafts as much and in as few forwards either way (priced, its first decode step is plain
    and its second carries the whole copy). All that with each match's draft size by the factor alone
    (`capped=False`); with the cost's cap (suffix_size.py) the missing session drafts less again, and
    the copying one's first long draft is cut at 20 of its 21 tokens, which costs it a fourth forward
    (docs/speculative.md, "The first tree sized from the cost")."""
    from fusion_compute.bench.replay import Clock, replay
    from fusion_compute.generation.speculative_config import SpeculativeConfig
    from fusion_compute.generation.tree_cost import LinkCost

    cfg = SpeculativeConfig("suffix", 32, suffix_cache_tokens=0)
    true = LinkCost(0.0001, 120, 0.0, 1e9, 0.005, 0.1)
    prompt = [5, 6, 7, 8, 20, 21, 22, 23, 24, 25] * 3
    miss = {"prompt": prompt, "output": [t for i, t in enumerate(prompt[:12]) for t in (t, 40 + i)]}
    copy = {"prompt": prompt, "output": prompt[:24]}
    got = {}
    for capped in (False, True):
        for name, row in (("miss", miss), ("copy", copy)):
            for prior in (True, False):
                clock = Clock(true, 0.08, prior=prior)
                stats = replay(cfg, [row], clock=clock, capped=capped)
                assert stats.tokens == 24 and clock.plain_s == pytest.approx(true.seconds(30) + 23 * true.seconds(1))
                got[name, prior, capped] = clock.plain_s / clock.spec_s, stats.num_draft_tokens, stats.forwards
    assert got["miss", False, False][1] == 53 and got["miss", False, False][0] < 0.85
    assert got["miss", True, False][1] == 16 + 1 and got["miss", False, False][0] < got["miss", True, False][0] < 1
    assert got["copy", True, False][1:] == got["copy", False, False][1:] == (21, 3)  # every draft accepted
    assert got["copy", True, False][0] >= got["copy", False, False][0] > 3
    # the cap: the missing session's one-token trees cut (13 drafts against 17), so it loses less
    assert got["miss", True, True][1] < got["miss", True, False][1]
    assert got["miss", True, False][0] < got["miss", True, True][0] < 1
    assert got["copy", True, True][1:] == (20, 4) and got["copy", True, True][0] > 3  # its cost, named above


def test_a_measured_step_table_times_the_replay():
    """bench/replay.py --step-ms: a step's compute read off a measured table (linear between its
    points, along its last two beyond them), the link's round trips added; a table timing a draft's
    step at twice a plain one's makes a session whose drafts all miss slower than one where they
    cost little (the same replay, the same drafts: only the clock differs)."""
    from fusion_compute.bench.replay import Clock, interpolate, replay
    from fusion_compute.generation.speculative_config import SpeculativeConfig
    from fusion_compute.generation.tree_cost import LinkCost

    table = ((1, 0.1), (2, 0.2), (4, 0.25))
    assert [interpolate(table, w) for w in (1, 2, 3, 4, 8)] == pytest.approx([0.1, 0.2, 0.225, 0.25, 0.35])
    link = LinkCost(0.001, 120, 0.0, 1e9, 0.0)
    assert Clock(link, table=table).seconds(3, 1) == pytest.approx(0.12 + 0.225)
    prompt = [5, 6, 7, 8, 20, 21, 22, 23, 24, 25] * 3
    miss = {"prompt": prompt, "output": [t for i, t in enumerate(prompt[:12]) for t in (t, 40 + i)]}
    cfg = SpeculativeConfig("suffix", 32, suffix_cache_tokens=0, adaptive=False)
    ratios = []
    for second in (0.2, 0.101):
        clock = Clock(link, table=((1, 0.1), (2, second), (33, second + 0.001)))
        replay(cfg, [miss], clock=clock)
        ratios.append(clock.plain_s / clock.spec_s)
    assert ratios[0] < 0.96 and 0.99 < ratios[1] <= 1


def test_budget_benches_refuse_bad_input_in_one_line(capsys):
    """bench/spec_pairs.py and bench/step_width.py: a bad prompt list or count is one line and exit 2,
    before any worker starts (no engine is made: these return at once)."""
    from fusion_compute.bench import replay, spec_pairs, step_width

    assert spec_pairs.main(["single", "open_chat", "1,x"]) == 2
    assert step_width.main(["--repeats", "0"]) == 2
    assert step_width.main(["--split", "--cpu"]) == 2  # workers as threads: no worker process to read
    assert replay.main(["--rtt-ms", "1", "--simulate", "--step-ms", "1:100"]) == 2
    assert replay.main(["--rtt-ms", "1", "--simulate", "--step-ms", "1:100,2:x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "bench.spec_pairs: prompts must be comma-separated indices, got '1,x'",
        "bench.step_width: --repeats and --workers must be >= 1",
        "bench.step_width: --split reads worker processes' /proc (Linux), without --cpu",
        "bench.replay: --step-ms needs two or more distinct 'columns:ms' points, got '1:100'",
        "bench.replay: --step-ms needs two or more distinct 'columns:ms' points, got '1:100,2:x'",
    ]


MEDIANS = {"1x1": 117.0, "1x2": 153.0, "1x5": 326.0, "1x33": 479.0, "2x1": 198.0, "4x1": 300.0, "8x1": 345.0}
MEDIANS |= {"8: one x2": 355.0, "8: one x9": 420.0, "8: all x2": 420.0, "8: all x5": 650.0, "4: all x2": 340.0}
MEDIANS |= {"8: all x60 (a prefill's columns)": 2961.0}


def test_batch_steps_model_the_measured_shapes():
    """bench/replay_batch's step model reproduces bench/step_width's one-session and one-column points
    exactly, fits a drafting session's and a draft column's cost by least squares to the batch shapes
    (by hand: synthetic medians made from 2 ms a span and 9 ms a column are read back), and prices a
    prefill along the 8 x 60 point."""
    from fusion_compute.bench.replay_batch import BatchSteps

    ms = dict(MEDIANS)
    for name, (n, s, e) in {
        "8: one x2": (8, 1, 1),
        "8: one x9": (8, 1, 8),
        "8: all x2": (8, 8, 8),
        "8: all x5": (8, 8, 32),
        "4: all x2": (4, 4, 4),
    }.items():
        ms[name] = ms[f"{n}x1"] + 2.0 * s + 9.0 * e
    steps = BatchSteps.from_medians(ms)
    assert (steps.per_span, steps.per_column) == pytest.approx((0.002, 0.009), abs=1e-9)
    assert steps.seconds(1, 5, 1) == pytest.approx(0.326) and steps.seconds(4, 4, 0) == pytest.approx(0.300)
    assert steps.seconds(3, 3, 0) == pytest.approx((0.198 + 0.300) / 2)  # linear between 2 and 4 sessions
    assert steps.seconds(8, 12, 2) == pytest.approx(0.345 + 2 * 0.002 + 4 * 0.009)
    assert steps.seconds(8, 480, 0, prefill=True) == pytest.approx(2.961)
    assert all(abs(r) < 1e-6 for r in steps.residuals(ms).values())


def test_batch_replay_refuses_bad_input(tmp_path, capsys):
    """One line and exit 2: a table that is missing or lacks a shape, a negative round trip."""
    import json

    from fusion_compute.bench import replay_batch

    assert replay_batch.main(["--step-width", str(tmp_path / "none.json"), "--rtt-ms", "1"]) == 2
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"median_ms": {"1x1": 117.0}}))
    assert replay_batch.main(["--step-width", str(short), "--rtt-ms", "1"]) == 2
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"median_ms": MEDIANS}))
    assert replay_batch.main(["--step-width", str(table), "--rtt-ms", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("bench.replay_batch: ") for line in err), err
