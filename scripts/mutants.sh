#!/usr/bin/env bash
# A mutation check: plausible bugs, each applied to a throwaway copy of this tree, and the tests that
# claim to guard it run against that copy. Prints a table: mutant, killed by which test (quick ones,
# not marked slow, first; the slow ones only if no quick one kills it), or SURVIVED.
#
#   bash scripts/mutants.sh                 # every mutant
#   bash scripts/mutants.sh top-p rope      # those whose name contains one of the words
#   ALL=1 bash scripts/mutants.sh replay    # run every listed test (quick and slow), each verdict shown
#
# Each mutant is an exact string replacement in one file: if the string is not there exactly once
# (the code moved on), the mutant is reported STALE and the script exits 1, so the list is updated
# rather than silently testing nothing. A tool for contributors (docs/testing.md), not part of .ci/run.
# Rerun it after changing a guarded module; add a mutant when you add a guard.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python - "$@" <<'PY'
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

R = "fusion_compute/"
# (name, file, old, new, tests): tests in the order to try them (node ids under tests/). `old` may be a
# list of (old, new) spellings (new then None) where the code is spelled differently across branches.
MUTANTS = [
    (
        "replay-drops-last-token",
        R + "runtime/engine.py",
        "runs = {slot: hist + new.get(slot, []) for slot, hist in self.slot_history.items()}",
        "runs = {slot: hist[:-1] + new.get(slot, []) for slot, hist in self.slot_history.items()}",
        [
            "test_membership.py::test_revocation_mid_session_replays_every_token",
            "test_faults.py::test_lost_worker_replaced_by_standby",
            "test_batching.py::test_a_lost_worker_mid_batch_replays_every_slot",
            "test_membership.py::test_migrate_mid_session_by_add_then_revoke",
            "test_audit_epochs.py::test_revocation_at_a_decode_step_passes_over_two_epochs",
        ],
    ),
    (
        "replay-only-last-token",
        R + "runtime/engine.py",
        "runs = {slot: hist + new.get(slot, []) for slot, hist in self.slot_history.items()}",
        "runs = {slot: hist[-1:] + new.get(slot, []) for slot, hist in self.slot_history.items()}",
        [
            "test_membership.py::test_revocation_mid_session_replays_every_token",
            "test_faults.py::test_lost_worker_replaced_by_standby",
            "test_batching.py::test_a_lost_worker_mid_batch_replays_every_slot",
        ],
    ),
    (
        "rollback-keeps-a-rejected-token",
        R + "runtime/engine.py",
        "        del hist[keep:]\n",
        "        del hist[keep + 1 :]\n",
        [
            "test_speculative.py::test_batched_sessions_with_speculation_equal_each_alone",
            "test_speculative.py::test_masked_mode_speculation_equals_greedy",
            "test_speculative.py::test_greedy_tokens_equal_without_speculation_and_transformers",
        ],
    ),
    (
        "speculation-keeps-a-rejected-draft",
        R + "generation/batching.py",
        "len(self.engine.slot_history[seq.slot]) - (len(proposed) - accepted))",
        "len(self.engine.slot_history[seq.slot]) - (len(proposed) - (accepted + 1)))",
        [
            "test_speculative.py::test_batched_sessions_with_speculation_equal_each_alone",
            "test_speculative.py::test_masked_mode_speculation_equals_greedy",
            "test_speculative.py::test_greedy_tokens_equal_without_speculation_and_transformers",
        ],
    ),
    (
        "rope-linear-multiplies",
        R + "model/config.py",
        "return [f / self.factor for f in base]",
        "return [f * self.factor for f in base]",
        ["test_rope.py", "test_gguf.py::test_llama_unpermute_and_linear_rope"],
    ),
    (
        "rope-llama3-smoothing-swapped",
        R + "model/config.py",
        "out.append((1 - smooth) * f / self.factor + smooth * f)",
        "out.append(smooth * f / self.factor + (1 - smooth) * f)",
        ["test_rope.py", "test_gguf.py::test_llama3_rope_freqs"],
    ),
    (
        "top-p-drops-the-crossing-token",
        R + "generation/sampling.py",
        "drop = (probs.cumsum(-1) - probs) >= p.top_p",
        "drop = probs.cumsum(-1) >= p.top_p",
        ["test_sampling.py"],
    ),
    (
        "top-k-drops-ties-with-the-kth",
        R + "generation/sampling.py",
        "            logits = logits.masked_fill(logits < kth, float(\"-inf\"))\n",
        "            keep = torch.topk(logits, min(p.top_k, logits.numel())).indices  # exactly k, ties cut\n"
        "            logits = torch.full_like(logits, float(\"-inf\")).scatter(0, keep, logits[keep])\n",
        ["test_sampling.py"],
    ),
    (
        "sampler-ignores-temperature",
        R + "generation/sampling.py",
        "logits = (x - x.max()) / p.temperature",
        "logits = x - x.max()",
        ["test_sampling.py"],
    ),
    (
        "masked-audit-label-reuse-rule-off",
        R + "masked/audit.py",
        "if len(set(labels)) != len(labels):",
        "if False:",
        ["test_masked_runtime.py::test_audit_negative_controls_reused_keys_labels_and_masks"],
    ),
    (
        "masked-audit-key-reuse-rule-off",
        R + "masked/audit.py",
        "if len(set(keys)) != len(keys):",
        "if False:",
        ["test_masked_runtime.py::test_audit_negative_controls_reused_keys_labels_and_masks"],
    ),
    (
        "masked-audit-freshness-rule-off",
        R + "masked/audit.py",
        '"ok": frac <= limit}',
        '"ok": True}',
        [
            "test_masked_runtime.py::test_audit_negative_controls_reused_keys_labels_and_masks",
            "test_masked_runtime.py::test_audit_negative_control_no_masks",
        ],
    ),
    (
        "verified-bound-one-basis-row",
        R + "masked/verify.py",
        "BASIS_ROWS = 4 ",
        "BASIS_ROWS = 1 ",
        ["test_masked_verify.py::test_the_stated_escape_bound_is_computed_from_the_check"],
    ),
    (
        "rmsnorm-eps-dropped-in-the-scatter",
        R + "structural/ops.py",
        [  # (old, new) alternatives: the first spelling found is the one mutated
            ("inv_s = torch.rsqrt(y_aug[-1] / hidden + eps)", "inv_s = torch.rsqrt(y_aug[-1] / hidden)"),
            ("inv_s = torch.rsqrt(y_aug[-1].float() / hidden + eps)", "inv_s = torch.rsqrt(y_aug[-1].float() / hidden)"),
        ],
        None,
        [
            "test_runtime.py",
            "test_sharded_inproc.py::test_a_batch_step_equals_each_session_alone",
            "test_sharded_inproc.py::test_sharded_model_matches_dense_and_transformers",
            "test_parity.py::test_matches_transformers[structural-qwen2-N3-cap]",
        ],
    ),
    (
        "plan-apportion-tie-break-flipped",
        R + "structural/plan.py",
        "i = max(range(n), key=lambda k: (ideal[k] - counts[k], -k))",
        "i = max(range(n), key=lambda k: (ideal[k] - counts[k], k))",
        ["test_plan.py"],
    ),
    (
        "reduce-scatter-qkv-sizes-reversed",
        R + "structural/sharded.py",
        [
            ("qkv_aug = [s + 1 for s in plan.qkv_sizes]", "qkv_aug = [s + 1 for s in reversed(plan.qkv_sizes)]"),
            ("qkv_sizes_aug=[s + 1 for s in plan.qkv_sizes],", "qkv_sizes_aug=[s + 1 for s in reversed(plan.qkv_sizes)],"),
        ],
        None,
        [
            "test_sharded_inproc.py::test_a_batch_step_equals_each_session_alone",
            "test_sharded_inproc.py::test_sharded_model_matches_dense_and_transformers",
            "test_parity.py::test_matches_transformers[structural-qwen2-N3-cap]",
        ],
    ),
    (
        "egress-finiteness-check-off",
        R + "structural/client.py",
        "if not bool(torch.isfinite(shard).all()):",
        "if False:",
        ["test_egress_checks.py::test_nan_egress_names_the_worker_and_a_standby_takes_its_seat"],
    ),
]

words = sys.argv[1:]
run_all = os.environ.get("ALL") == "1"
chosen = [m for m in MUTANTS if not words or any(w in m[0] for w in words)]
tree = Path.cwd()
files = subprocess.run(
    ["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True
).stdout.split(b"\0")
root = Path(tempfile.mkdtemp(prefix="fusion-mutants-"))


def copy_tree(dst: Path) -> None:
    for f in files:
        if not f:
            continue
        src = tree / f.decode()
        if src.is_file():
            (dst / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f.decode())


def pytest(copy: Path, nodes: list[str], marker: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "FUSION_TEST_PROCESSES": "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-rfE", "-p", "no:cacheprovider", "-m", marker]
    out = subprocess.run(
        cmd + ["tests/" + n for n in nodes], cwd=copy, env=env, capture_output=True, text=True, timeout=3600
    )
    return out.returncode, out.stdout + out.stderr


def first_failure(text: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) tests/(\S+)", text, re.M)
    return m.group(1) if m else "(collection or start-up error)"


rows, stale = [], False
for name, path, old, new, nodes in chosen:
    t0 = time.monotonic()
    copy = root / name
    copy_tree(copy)
    target = copy / path
    text = target.read_text()
    spellings = old if isinstance(old, list) else [(old, new)]
    found = [(o, n) for o, n in spellings if text.count(o) == 1]
    if not found:
        counts = ", ".join(str(text.count(o)) for o, _ in spellings)
        rows.append((name, f"STALE: the string to replace occurs {counts} times in {path}", 0.0))
        stale = True
        continue
    target.write_text(text.replace(*found[0]))
    verdicts = []
    for marker, kind in (("not slow", "quick"), ("slow", "slow")):
        if run_all:
            for node in nodes:
                rc, out = pytest(copy, [node], marker)
                if rc == 4:  # pytest's usage error: a listed test that does not exist
                    verdicts.append(f"ERROR: no test {node}")
                elif rc not in (0, 5):
                    verdicts.append(f"killed ({kind}) by {first_failure(out)}")
                elif rc == 0:
                    verdicts.append(f"passed ({kind}): {node}")
            continue
        rc, out = pytest(copy, nodes, marker)
        if rc == 4:  # pytest's usage error: a listed test that does not exist (the list is out of date)
            verdicts.append("ERROR: " + (re.findall(r"ERROR: (.*)", out) or ["pytest usage error"])[0])
            break
        if rc not in (0, 5):  # 5: nothing of this kind among the nodes
            verdicts.append(f"killed ({kind}) by {first_failure(out)}")
            break
    rows.append((name, "; ".join(verdicts) or "SURVIVED", time.monotonic() - t0))
    shutil.rmtree(copy, ignore_errors=True)
    print(f"{name}: {rows[-1][1]} ({rows[-1][2]:.0f} s)", file=sys.stderr, flush=True)

shutil.rmtree(root, ignore_errors=True)
width = max(len(r[0]) for r in rows)
print(f"| {'mutant':<{width}} | verdict | s |")
print(f"| {'-' * width} | --- | --- |")
for name, verdict, secs in rows:
    print(f"| {name:<{width}} | {verdict} | {secs:.0f} |")
sys.exit(1 if stale or any(r[1] == "SURVIVED" or r[1].startswith("ERROR") for r in rows) else 0)
PY
