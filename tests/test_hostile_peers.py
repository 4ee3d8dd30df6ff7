"""Blame the right participant (issue 26, item 2): a listed worker that disrupts its peer while it
keeps beating is the one removed, named by its peer's account, never the honest worker whose link
the client happened to be reading (it reads worker 1's egress first; worker 2 is the liar). Each liar is the real worker with one fault composed in at
start-up (faults.py): `cut-peer` shuts its links to its peer mid-step and stalls; `slow-rs` waits
2 s before each reduce-scatter (under the per-message timeout, the step far over it). Both runs
finish on the honest worker plus the standby with the tokens of a run with no fault."""

from __future__ import annotations

import os

import pytest
from procs import children
from test_faults import LIVENESS_S, run

from fusion_compute.structural.client import Engine, EngineOptions

TIMEOUT_S = 5.0  # the per-message timeout: the slow liar's 2 s stays under it, its step does not
STEP_RS = 6  # reduce-scatters per step on the tiny Qwen2 (3 layers: attention out, MLP down)


@pytest.fixture(scope="module")
def reference(tiny_qwen2):
    with Engine(tiny_qwen2, EngineOptions(n_workers=2, context=128, timeout_s=30)) as eng:
        return run(eng).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["cut-peer", "slow-rs"])
def test_disruptive_peer_is_named_and_removed(tiny_qwen2, reference, fault, capfd):
    opts = EngineOptions(
        n_workers=2,
        standby=1,
        context=128,
        timeout_s=TIMEOUT_S,
        liveness_s=LIVENESS_S,
        args_for_worker={2: ("--inject-fault", f"{fault}@{STEP_RS * 10 + 1}")},
    )
    with Engine(tiny_qwen2, opts) as eng:
        res = run(eng)  # worker 2 turns on its peer at the 11th step; the client reads worker 1 first
        assert res.token_ids == reference
        assert [r["lost"] for r in res.recoveries] == [[2]], res.recoveries
        assert "named by its peers' accounts (worker 1 names worker 2)" in res.recoveries[0]["reason"]
        assert eng.order == [1, 3] and {w["id"]: w["state"] for w in eng.workers()}[1] == "active"
    err = capfd.readouterr().err
    assert "worker 1 names worker 2" in err and "blaming worker [2]" in err, err[-3000:]


def test_no_stray_processes():
    assert children(os.getpid()) == set()
