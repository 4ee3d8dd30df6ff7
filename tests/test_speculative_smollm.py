"""Speculative decoding on the bundled SmolLM2-135M-Instruct (issue 23): greedy tokens with n-gram
drafts identical to transformers' (and so to decoding without speculation: check() says why it is not
run again), on several prompts, for N = 2, in fewer sharded forwards. Masked, the first prompt alone
(the masked client does every nonlinear step) is checked by test_masked_smollm.py on its 2+2 job."""

from __future__ import annotations

import pytest
from smollm_greedy import greedy

from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.generation.speculative import Speculator
from fusion_compute.generation.speculative_config import SpeculativeConfig
from fusion_compute.structural.client import Engine, EngineOptions
from fusion_compute.weights.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)

# test_smollm.py's 20 too: its "Name three colours" reference (smollm_greedy.py) serves both files.
NEW_TOKENS = 20
PROMPTS = [
    # input-grounded: the answer copies from the prompt, so drafts are accepted
    "Repeat this sentence exactly: The committee will meet on Tuesday at nine in the main hall.",
    "Fix the bug and return the whole function:\ndef area(w, h):\n    return w + h",
    # open: drafts mostly miss (rolled back), and the adaptive length stops proposing them
    "Name three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def cases(smollm_path, smollm_reference, tmp_path_factory):
    tok = load_tokenizer(smollm_path)
    out = []
    for text in PROMPTS:
        ids = tok.chat_ids([{"role": "user", "content": text}])
        out.append((ids, greedy(smollm_reference, ids, NEW_TOKENS, tok.eos_ids, tmp_path_factory)))  # transformers'
    return tok, out


def check(eng, tok, cases) -> None:
    """Speculative greedy tokens equal transformers', in fewer sharded forwards than decoding without
    speculation takes. That decoding is not run again here: it takes one forward per token
    (test_speculative.py asserts it, `r.steps == NEW`) and its tokens equal transformers' on SmolLM2
    (test_smollm.py at N = 1, 2, 4 and through the CLI at N = 3, test_masked_smollm.py masked), so
    equal to `want` is equal to it; running it cost about a third of this file's CPU."""
    spec = Speculator(SpeculativeConfig("ngram", 4), eng.config.vocab, eng.context)
    steps = plain_steps = 0
    for ids, want in cases:
        got = generate(
            eng, ids, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(), stop_ids=tok.eos_ids, speculator=spec
        )
        assert got.token_ids == want, f"{tok.decode(got.token_ids)!r} vs {tok.decode(want)!r}"
        steps, plain_steps = steps + got.steps, plain_steps + len(want)
    t = spec.totals
    assert t.num_accepted_tokens > 0 and steps < plain_steps, (t, steps, plain_steps)


# N = 2 alone: on SmolLM2 (3 KV groups) N = 2 and 3 both give each worker whole KV groups, so a rollback
# truncates the same kind of cache at both; N = 2's shares are uneven (2 groups and 1), which N = 3's are
# not. N = 3 cost as much again and checked nothing N = 2 does not (its three-worker ring is
# test_smollm.py's CLI test). Split groups are N = 4 (test_smollm.py) and test_speculative.py's tiny models.
def test_speculative_greedy_identical_to_transformers(smollm_path, cases):
    tok, cs = cases
    with Engine(smollm_path, EngineOptions(n_workers=2, timeout_s=120, context=256)) as eng:
        check(eng, tok, cs)
