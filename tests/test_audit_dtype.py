"""The audit in bfloat16: the wire carries 2 bytes per element, the manifest says so (`wire_dtype`),
and the independent verifier's byte-exact accounting (per transfer, and the kernel's socket counts)
follows it; read as float32, the same logs fail the accounting."""

from __future__ import annotations

import json

import pytest

from fusion_compute.audit import schema as S
from fusion_compute.audit.runner import RunConfig, run_cold_start
from fusion_compute.audit.verify import verify_epoch
from fusion_compute.audit.verify.logs import load_manifest


@pytest.mark.slow
def test_bfloat16_run_closes_and_its_bytes_are_the_dtypes(tiny_qwen2, tmp_path):
    cfg = RunConfig(
        out=tmp_path,
        model=str(tiny_qwen2),
        workers=3,  # split KV groups: score sums among owners, in the dtype too
        steps=3,
        cold_starts=1,
        prompt_ids=[5, 17, 33, 2, 99],
        timeout_s=60,
        dtype="bfloat16",
        exposure=False,
    )
    run = run_cold_start(cfg, 0)
    assert run["ok"], run["first_violations"]
    epoch = tmp_path / "cold0" / S.epoch_dir(0)
    manifest = load_manifest(epoch)
    assert manifest["wire_dtype"] == "bfloat16"
    events = [json.loads(line) for line in (epoch / S.log_name(1)).read_text().splitlines()]
    sizes = {e[6] for r in events for e in r.get("events") or []}  # LogEvent.itemsize
    assert sizes == {2}, sizes  # every state transfer of worker 1 moved 2-byte elements

    assert verify_epoch(epoch, manifest).ok
    wrong = verify_epoch(epoch, {**manifest, "wire_dtype": "float32"})
    assert not wrong.ok and wrong.counts()["accounting"] > 0
    assert "2 bytes per element, expected 4" in " ".join(v.message for v in wrong.violations)
