"""The bundled SmolLM2-135M-Instruct (GGUF, Q4_1): greedy tokens identical to transformers, N = 1..4
(N = 3 through the CLI)."""

from __future__ import annotations

import json

import procs
import pytest

from fusion_compute.generation.generate import generate
from fusion_compute.generation.sampling_params import SamplingParams
from fusion_compute.model import reference
from fusion_compute.structural.client import Engine, EngineOptions
from fusion_compute.weights.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)

NEW_TOKENS = 20
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat_ids(smollm_path, smollm_ref):
    tok = load_tokenizer(smollm_path)
    ids = tok.chat_ids([{"role": "user", "content": "Name three colours of the rainbow."}])
    return tok, ids, reference.greedy(smollm_ref, ids, NEW_TOKENS, stop_ids=tok.eos_ids)


# N = 3 is test_cli_json_answers_paris below (the CLI's tokens against transformers'). N = 2 and 4 split
# a KV group across workers (3 KV heads), N = 3 does not.
@pytest.mark.parametrize("n", [1, 2, 4])
def test_greedy_identical_to_transformers(smollm_path, chat_ids, n):
    tok, ids, want = chat_ids
    with Engine(smollm_path, EngineOptions(n_workers=n, timeout_s=120, context=256)) as eng:
        got = generate(eng, ids, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(), stop_ids=tok.eos_ids)
    first = next((i for i, (a, b) in enumerate(zip(got.token_ids, want, strict=False)) if a != b), None)
    assert got.token_ids == want, f"N={n}: first diverging token at {first}: {tok.decode(got.token_ids)!r}"


def test_cli_json_answers_paris(smollm_path, smollm_ref):
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
    assert res["token_ids"] == reference.greedy(smollm_ref, ids, 16, stop_ids=tok.eos_ids)
