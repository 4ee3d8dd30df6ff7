"""A readable Markdown report of an audit run (summary.json rendered for people)."""

from __future__ import annotations

from pathlib import Path


def _rk(key: str) -> str:
    """A per-rank key of summary.json as a label: "2" -> "r2"; "e1.2" (epoch 1, rank 2) -> "e1 r2"."""
    epoch, dot, rank = key.partition(".")
    return f"{epoch} r{rank}" if dot else f"r{key}"


def _epochs_section(summary: dict) -> list[str]:
    """Per cold start: its epochs, who left and what the kernel counted for them, the replay step."""
    lines = ["## Epochs and membership", ""]
    rv = summary.get("revoke") or {}
    if rv:
        lines += [
            f"Worker {rv['worker']} is revoked before decode step {rv['before_decode_step']}, as a user would; the "
            "session moves to the next epoch by replay (its first step). Checked across epochs: every rank's worker "
            "is who the client's order says (each log header names its participant), a worker that left has no log "
            "and is never addressed afterwards, and the kernel counted no byte to or from its process after it left.",
            "",
        ]
    if summary.get("negative_control"):
        lines += [f"**Negative control `{summary['negative_control']}`: this run must fail the membership check.**", ""]
    lines += [
        "| # | epochs (workers in rank order: verdict) | departures | replay | membership |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in summary["runs"]:
        eps = "; ".join(f"{e['epoch']}: {e['order']} {'pass' if e['ok'] else 'FAIL'}" for e in r.get("epochs", []))
        m = r.get("membership") or {}
        deps = []
        for d in m.get("departures", []):
            k = d.get("kernel")
            kern = f", kernel {k['received']:,} B in / {k['sent']:,} B out after" if k else ", kernel not measured"
            deps.append(
                f"worker {d['participant']} {d['why']} before epoch {d['epoch']}"
                f"{'' if d['absent'] else ', TAKES PART after'}{kern}"
            )
        reps = "; ".join(
            f"epoch {x['epoch']} step {x['step']} ({x['tokens']} tokens): {'closed' if x['closed'] else 'NOT closed'}"
            for x in m.get("replays", [])
        )
        verdict = f"{'pass' if m.get('ok') else 'FAIL'} ({m.get('checked', 0)} checks)"
        lines.append(f"| {r['cold_start']} | {eps} | {'; '.join(deps) or 'none'} | {reps or 'none'} | {verdict} |")
    lines.append("")
    return lines


def _speculative_section(summary: dict) -> list[str]:
    """Per cold start: forwards vs tokens, the verification steps and what the drafts did."""
    sp = summary["speculative"]
    lines = [
        "## Speculative decoding",
        "",
        f"Drafts: `{sp['method']}`, at most {sp['num_speculative_tokens']} per step. A verification step runs a "
        "session's last token plus its drafts as one span of K + 1 columns and is checked like any step (holdings, "
        "positions, accounting, socket bytes); the rejected columns are rolled back: every worker zeroes those "
        "positions of the slot before the next step and records it, the client records the same rollback, and the "
        "verifier checks that no step runs where rejected positions remain (invariant `rollback`).",
        "",
        "| # | forwards (steps) | tokens generated | verify steps closed | drafts (steps with drafts) | draft tokens "
        "| accepted | mean acceptance length | rollbacks |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["runs"]:
        c = r.get("speculative") or {}
        lines.append(
            f"| {r['cold_start']} | {r['forwards']} | {r['generated_tokens']} | {r['closed_verify']}/{r['verify_steps']} "
            f"| {c.get('num_drafts')} | {c.get('num_draft_tokens')} | {c.get('num_accepted_tokens')} "
            f"| {c.get('mean_acceptance_length')} | {c.get('rollbacks')} |"
        )
    lines.append("")
    return lines


def _per_cold_start(summary: dict) -> str:
    b = summary.get("batch") or 1
    if summary.get("speculative"):
        sessions = "1 session" if b == 1 else f"{b + 1} sessions batched on {b} KV slots"
        return (
            f"- per cold start: {sessions}, each a prefill then {summary['steps']} more tokens (greedy, forced "
            "continuation), with speculative decoding: fewer forwards than tokens (decode steps of 1 column, "
            "verification steps of K + 1)"
        )
    if b == 1:
        return f"- per cold start: 1 prefill + {summary['steps']} decode steps (greedy, forced continuation)"
    closed = sum(r.get("closed_sessions", 0) for r in summary["runs"])
    total = sum(r.get("batched_sessions", 0) for r in summary["runs"])
    return (
        f"- per cold start: {b + 1} sessions batched on {b} KV slots (continuous batching: session i joins at "
        f"step i, the last one reuses the first freed slot), each 1 prefill + {summary['steps']} decode steps "
        f"(greedy, forced continuation); sessions closed (every step they ran in closed, their slot zeroed at "
        f"release on every worker): {closed}/{total}"
    )


def render(summary: dict) -> str:
    dims = summary["model"]["dims"]
    lines = [
        "# Fusion Compute ownership audit",
        "",
        f"- model: `{summary['model']['path']}` ({dims['arch']}, {dims['layers']} layers, hidden {dims['hidden']}, "
        f"intermediate {dims['intermediate']}, {dims['heads']} heads / {dims['kv_heads']} KV heads)",
        f"- workers: {summary['workers']}" + (f", capacities {summary['capacities']}" if summary["capacities"] else ""),
        f"- variant: {summary['variant']}"
        + (f", injected leak `{summary['inject_leak']}`" if summary["inject_leak"] else ""),
        _per_cold_start(summary),
        f"- verdict: **{'PASS' if summary['all_ok'] else 'FAIL'}**, decode{' and verify' * bool(summary.get('speculative'))} "
        f"steps closed {summary['closed']} over {summary['cold_starts']} cold starts",
        f"- identical tokens across cold starts: {summary['identical_tokens_across_cold_starts']}",
        "",
        *(_epochs_section(summary) if any(len(r.get("epochs", [])) > 1 for r in summary["runs"]) else []),
        *(_speculative_section(summary) if summary.get("speculative") else []),
        *_pictures_section(summary),
        "## Cold starts",
        "",
        "| # | verdict | decode closed | prefill closed | violations | bytes sent / decode step | OS bytes (sent, excess) | tok/s | recorder ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["runs"]:
        viol = sum(r["violation_counts"].values())
        dec = ", ".join(f"{_rk(k)} {v.get('decode', 0):,.0f}" for k, v in sorted(r["bytes_per_step"].items()))
        os_ = (
            ", ".join(f"{_rk(k)} {o['measured_sent']:,} ({o['excess_sent']:+,})" for k, o in sorted(r["os"].items()))
            or "not measured"
        )
        rec = ", ".join(f"{_rk(k)} {v}" for k, v in sorted(r["recorder_ms_per_step"].items()))
        lines.append(
            f"| {r['cold_start']} | {'pass' if r['ok'] else 'FAIL'} | {r['closed_decode']}/{r['decode_steps']} | "
            f"{r['closed_prefill']}/{r['prefill_steps']} | {viol} | {dec} | {os_} | "
            f"{r['timing']['decode_tokens_per_s']} | {rec} |"
        )
    lines += ["", "## Per-layer closure (steps in which the layer closed, per cold start)", ""]
    n_layers = summary["runs"][0]["layers"]
    lines.append("| layer | " + " | ".join(f"cold {r['cold_start']}" for r in summary["runs"]) + " |")
    lines.append("| --- |" + " --- |" * len(summary["runs"]))
    total = {r["cold_start"]: r["forwards"] for r in summary["runs"]}
    for layer in range(n_layers):
        cells = [f"{r['layer_closed'][layer]}/{total[r['cold_start']]}" for r in summary["runs"]]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    first = summary["runs"][0]
    lines += [
        "",
        "## Invariants checked (first cold start)",
        "",
        "Every epoch's checks and those across epochs, summed: the counts `fusion audit verify` prints for the "
        "same directory.",
        "",
        "| invariant | checked | violations |",
        "| --- | --- | --- |",
    ]
    for inv, n in first["checks"].items():
        lines.append(f"| {inv} | {n:,} | {first['violation_counts'].get(inv, 0)} |")
    lines += [
        "",
        "Smallest coalition of workers that covers each protected tensor: "
        + ", ".join(f"{k} {v}" for k, v in first["coalition"].items()),
        "",
    ]
    bad = [r for r in summary["runs"] if r["first_violations"]]
    if bad:
        lines += ["## First violations", ""]
        for r in bad:
            for v in r["first_violations"]:
                lines.append(f"- cold {r['cold_start']}: {v}")
        lines.append("")
    lines += [
        "## What this proves and what it does not",
        "",
        "The audit checks *holding*: no worker held every coordinate of any protected tensor, at any step.",
        "It does not check *knowing*. With public weights, a worker's residual shard, its q/k/v and MLP",
        "shards and the partials it receives are linear functions of the full residual, and the residual",
        "is a function of the prompt. Structural sharding is not a privacy guarantee.",
        "",
    ]
    exp = summary.get("exposure")
    if exp:
        h = exp["ranks"]["hidden"]
        lines += [
            f"Measured for this model and {summary['workers']} workers (`fusion audit exposure`; rank {h} = the",
            "worker can reconstruct the whole residual by least squares; (layer, point) pairs are the inputs of",
            "the QKV and gate/up projections of every layer):",
            "",
            "| worker | shard view: full rank at | rank range | wire view (+ peers' partials): full rank at |",
            "| --- | --- | --- | --- |",
        ]
        for w, v in exp["ranks"]["per_worker"].items():
            sv, wv = v["shard"], v["wire"]
            lines.append(
                f"| {w} | {sv['full_rank_points']}/{sv['points']} | {sv['min_rank']}..{sv['max_rank']}/{h} | "
                f"{wv['full_rank_points']}/{wv['points']} |"
            )
        if exp["ranks"].get("no_peer_partials"):
            lines += [
                "",
                f"No peer partials are sent at {', '.join(exp['ranks']['no_peer_partials'])}: the wire view is the "
                f"shard view there (the plan's boundary merges {'; '.join(exp['ranks']['boundary'])}).",
            ]
        lines += ["", "Vocabulary-matching attack on each worker's layer-0 residual shard, this run's prompt:", ""]
        for a in exp["attack"]:
            lines.append(
                f"- worker {a['worker']} ({a['coords']}/{h} coordinates): recovered {a['recovered']}/{a['positions']} prompt tokens"
            )
        lines.append("")
    return "\n".join(lines)


def _pictures_section(summary: dict) -> list[str]:
    """The ownership map of each cold start, drawn from what the verifier read in its logs."""
    shown = [(r["cold_start"], r["picture"]) for r in summary["runs"] if r.get("picture")]
    if not shown:
        return []
    lines = ["## Who held what (from the logs, as the verifier read them)", ""]
    for cold, name in shown:
        lines += [f"Cold start {cold}:", "", f"![ownership map, cold start {cold}]({name})", ""]
    return lines


def write_report(summary: dict, path: Path) -> None:
    path.write_text(render(summary))
