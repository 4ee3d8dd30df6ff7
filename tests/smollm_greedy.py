"""SmolLM2's greedy references (transformers, float64), each computed once per test run for every
pytest process.

Several modules ask transformers for the same continuation: "What is the capital of France?" for 16
tokens (test_masked_smollm, test_smollm's CLI test), "Name three colours of the rainbow." for 20
(test_smollm) and 24 (test_speculative_smollm). Each costs 2-5 s of CPU in float64. Greedy decoding
with transformers' KV cache computes token t the same way however many tokens follow, so the first n
tokens of a longer run are the n-token run (or the whole run, where it stopped at an end token
first): a request is answered from the longest run of its prompt stored so far, else computed and
stored. The store is the run's shared temporary folder (under xdist, every process's; as conftest.py's
smollm_reference), a JSON file per prompt, written whole under a lock: nothing outlives the run, and
nothing is recorded in the tests. transformers' model is asked for (`load_ref()`, conftest.py's
smollm_reference) only to compute a run, so a process answered from the store never loads it.

    want = greedy(smollm_reference, ids, 16, tok.eos_ids, tmp_path_factory)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fusion_compute.model import reference


def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's folder for the references: the folder every xdist process shares (the parent of
    its own), or, in one process, its own (whose parent holds other runs' folders)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "smollm-greedy"
    shared.mkdir(exist_ok=True)
    return shared


def greedy(
    load_ref: Callable[[], Any],
    ids: list[int],
    n: int,
    stop_ids: tuple[int, ...],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[int]:
    """reference.greedy(load_ref(), ids, n, stop_ids), answered from this run's longest stored run of
    `ids` when it covers n tokens (then load_ref is not called)."""
    key = hashlib.sha256(json.dumps([list(ids), sorted(stop_ids)]).encode()).hexdigest()[:24]
    path = store(tmp_path_factory) / f"{key}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process computing this prompt: its answer serves here too
        if path.exists():
            run = json.loads(path.read_text())
            tokens, asked = run["tokens"], run["max_new_tokens"]
            if asked >= n or len(tokens) < asked:  # long enough, or it stopped at an end token
                return tokens[:n]
        tokens = reference.greedy(load_ref(), ids, n, stop_ids=stop_ids)
        path.with_suffix(".part").write_text(json.dumps({"max_new_tokens": n, "tokens": tokens}))
        path.with_suffix(".part").rename(path)
        return tokens
