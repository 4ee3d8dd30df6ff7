"""The bundled SmolLM2-135M-Instruct (GGUF, Q4_1): greedy tokens identical to transformers, N = 2..4
(N = 3 through the CLI)."""

from __future__ import annotations

import json

import procs
import pytest
from smollm_greedy import greedy

from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.structural.client import Engine, EngineOptions
from fusion_compute.weights.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)

NEW_TOKENS = 20
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat_ids(smollm_path, smollm_reference, tmp_path_factory):
    tok = load_tokenizer(smollm_path)
    ids = tok.chat_ids([{"role": "user", "content": "Name three colours of the rainbow."}])
    want = greedy(smollm_reference, ids, NEW_TOKENS, tok.eos_ids, tmp_path_factory)  # transformers' (smollm_greedy.py)
    return tok, ids, want


# N = 3 is test_cli_json_answers_paris below (the CLI's tokens against transformers'). SmolLM2 has 3 KV
# groups (structural/plan.make_plan): N = 2 gives whole groups unevenly (2 and 1), N = 3 one each, N = 4
# splits every group by RoPE pairs. N = 1 is not run here: one worker holding every row is the dense
# twin's arithmetic, held to transformers on SmolLM2 by test_dense.py (and sharded N = 1 in-process by
# test_sharded_inproc.py), a one-worker job of real processes is test_cli.py's, and every tensor a
# worker loads is loaded, sliced, at N = 2..4 (test_gguf.py: sliced reads equal the whole one's slice).
@pytest.mark.parametrize("n", [2, 4])
def test_greedy_identical_to_transformers(smollm_path, chat_ids, n):
    tok, ids, want = chat_ids
    with Engine(smollm_path, EngineOptions(n_workers=n, timeout_s=120, context=256)) as eng:
        got = generate(eng, ids, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(), stop_ids=tok.eos_ids)
    first = next((i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=False)) if a != b), None)
    assert got.token_ids == want, f"N={n}: first diverging token at {first}: {tok.decode(got.token_ids)!r}"


def test_cli_json_answers_paris(smollm_path, smollm_reference, tmp_path_factory):
    """No --chat: the chat template is the default for a model that has one (as llama.cpp's and Ollama's)."""
    out = procs.run("generate", "--workers", "3", "--prompt", QUESTION, "--max-tokens", "16", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints exactly one JSON object"
    res = json.loads(lines[0])
    assert "Paris" in res["text"]
    assert res["workers"] == 3 and res["prompt_tokens"] > 0
    assert set(res["timing"]) >= {"load_s", "ttft_s", "decode_tokens_per_s"}
    tok = load_tokenizer(smollm_path)
    ids = tok.chat_ids([{"role": "user", "content": QUESTION}])
    assert res["prompt_tokens"] == len(ids)
    assert res["token_ids"] == greedy(smollm_reference, ids, 16, tok.eos_ids, tmp_path_factory)


def test_recovery_revocation_and_migration_keep_the_logits(smollm_path):
    """Real text, one session through three epoch changes: worker 1 killed (the standby takes its seat,
    the session replayed), then a migration (a worker added, worker 2 revoked, replayed again). Every
    step's logits equal the no-fault run's, not only its tokens, so a replay that drops or repeats a
    token, or runs the wrong positions, shows at the next step even where greedy would hide it."""
    import os
    import signal
    import time

    import torch

    tok = load_tokenizer(smollm_path)
    ids = tok.chat_ids([{"role": "user", "content": "Name three colours of the rainbow."}])
    steps = 12

    def session(eng, events: dict) -> tuple[list[int], list[torch.Tensor]]:
        eng.reset()
        logits, toks, seen = eng.forward(ids), [], []
        for i in range(steps):
            seen.append(logits)
            toks.append(int(logits.argmax()))
            if i in events:
                events[i]()
            logits = eng.forward([toks[-1]])
        eng.end_session()
        return toks, seen

    opts = EngineOptions(n_workers=2, standby=1, timeout_s=120, context=256, liveness_s=2.0)
    with Engine(smollm_path, opts) as eng:
        want, want_logits = session(eng, {})

        def migrate() -> None:
            new = eng.add_standby()
            deadline = time.monotonic() + 120
            while {w["id"]: w["state"] for w in eng.workers()}[new] != "standby" and time.monotonic() < deadline:
                time.sleep(0.1)
            eng.revoke(2)

        killed = eng.procs.pids[0]
        got, got_logits = session(eng, {3: lambda: os.kill(killed, signal.SIGKILL), 7: migrate})
        reasons = [r["reason"] for r in eng.recoveries]
    assert got == want, tok.decode(got)
    assert len(reasons) == 2 and reasons[1] == "worker 2 revoked by the user", reasons
    # The replay computes the session's KV as one prefill where the first run decoded token by token: the
    # same sums in another order. Measured: identical before the kill, then at most 3.4e-5 (logits up to
    # ~30). 5e-4 sits 15x above that; a token dropped, doubled or at the wrong position in the replay
    # moves the next logits by > 1e-1.
    for i, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert torch.allclose(a, b, atol=5e-4, rtol=0), (i, float((a - b).abs().max()))
