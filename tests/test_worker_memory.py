"""Workers on the bundled GGUF model stay at their share (issue 10, item 7): every worker's peak RSS
within 1.2 × its fp32 weights + its KV cache + 300 MB (interpreter, torch, transients)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fusion_compute.runtime.engine_options import effective_context
from fusion_compute.runtime.progress import worker_elements
from fusion_compute.structural.plan import make_plan
from fusion_compute.weights.loader import open_weights

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)

MIB = 1 << 20
ALLOWANCE = 300_000_000  # bytes: the interpreter and torch (~220 MiB measured) plus transients


@pytest.mark.parametrize("n", [3])
def test_worker_peak_rss_within_share(smollm_path, n):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusion_compute",
            "generate",
            "--model",
            str(smollm_path),
            "--workers",
            str(n),
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    peaks = json.loads(out.stdout)["worker_peak_rss_mb"]  # ru_maxrss: MiB
    c = open_weights(smollm_path).config
    plan = make_plan(c, n)
    context = effective_context(c.max_positions, None)  # what `fusion generate` preallocates by default
    assert len(peaks) == n
    for share, peak in zip(plan.workers, peaks, strict=True):
        weights = worker_elements(plan, share.worker) * 4
        kv = 2 * c.n_layers * context * sum(b.n_groups * b.dims for b in share.attention) * 4
        target = 1.2 * weights + kv + ALLOWANCE
        assert peak * MIB <= target, (
            f"worker {share.rank}: peak RSS {peak:.0f} MiB > {target / MIB:.0f} MiB "
            f"(weights {weights / MIB:.0f} MiB, KV {kv / MIB:.0f} MiB)"
        )
