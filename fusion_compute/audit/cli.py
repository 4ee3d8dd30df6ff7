"""`fusion audit run | verify | exposure`. Registered by fusion_compute.cli.main via `add_audit_parser`.

Bad input ends in one line on stderr and a non-zero exit: 2 for usage errors, 1 for a failed audit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import overload

from ..runtime.placement import DTYPES
from ..runtime.progress import counted
from ..structural.protocol import MAX_SLOTS

EXIT_FAIL = 1
EXIT_USAGE = 2


class AuditCliError(Exception):
    pass


@overload
def _ints(text: str, what: str) -> list[int]: ...
@overload
def _ints(text: None, what: str) -> None: ...
def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise AuditCliError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise AuditCliError(f"{what} is empty")
    return out


def _capacities(text: str | None) -> tuple[float, ...] | None:
    from ..cli.options import capacities
    from ..errors import UsageError

    try:
        return capacities(text)
    except UsageError as e:
        raise AuditCliError(str(e)) from None


def _guard(name: str, func):
    """Run a subcommand; expected failures become one line on stderr."""

    def run(a: argparse.Namespace) -> int:
        from ..errors import UsageError
        from ..model.config import ModelError
        from ..structural.plan import PlanError
        from .inject import LeakSpecError
        from .runner import AuditRunError
        from .verify import AuditFormatError

        try:
            return func(a)
        except (AuditCliError, AuditFormatError, LeakSpecError, UsageError) as e:
            print(f"fusion audit {name}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as e:
            # masked/audit.py imports torch: its error class is looked up only once it has been imported
            # (it must have been, to raise it), so a refusal before that costs no torch import.
            masked = sys.modules.get("fusion_compute.masked.audit")
            if masked is None or not isinstance(e, masked.MaskedAuditError):
                raise
            print(f"fusion audit {name}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except (AuditRunError, ModelError, PlanError, OSError) as e:
            print(f"fusion audit {name}: error: {e}", file=sys.stderr)
            return EXIT_FAIL

    return run


# ---- run ----


def cmd_run(a: argparse.Namespace) -> int:
    from .runner import NO_ROLLBACK_TO_IGNORE, STALE_ROLLBACK, RunConfig, run_audit
    from .verify.result import verdict

    if a.prompt is not None and a.prompt_ids is not None:
        raise AuditCliError("give at most one of --prompt and --prompt-ids")
    for flag, value in (("--workers", a.workers), ("--steps", a.steps), ("--cold-starts", a.cold_starts)):
        if value < 1:
            raise AuditCliError(f"{flag} must be >= 1, got {value}")
    if a.variant not in ("sharded", "megatron"):
        raise AuditCliError(f"--variant must be sharded or megatron, got {a.variant!r}")
    if a.threads is not None and a.threads < 1:
        raise AuditCliError(f"--threads must be >= 1, got {a.threads}")
    if not (a.timeout > 0):
        raise AuditCliError(f"--timeout must be > 0, got {a.timeout}")
    if a.revoke_at is not None and not (0 <= a.revoke_at < a.steps):
        raise AuditCliError(f"--revoke-at must be in 0..{a.steps - 1} (a decode step), got {a.revoke_at}")
    if a.standby is not None and a.standby < 0:
        raise AuditCliError(f"--standby must be >= 0, got {a.standby}")
    if a.negative_control is not None and a.revoke_at is None:
        raise AuditCliError("--negative-control keep-revoked needs --revoke-at STEP")
    if not 1 <= a.batch <= MAX_SLOTS:
        raise AuditCliError(f"--batch must be in 1..{MAX_SLOTS}, got {a.batch}")
    from ..cli.options import speculative_config

    speculative = speculative_config(a)  # a bad method or K: one line, exit 2, before anything loads
    if speculative is not None and a.revoke_at is not None:
        raise AuditCliError("--speculative and --revoke-at cannot be combined (a revocation is audited without drafts)")
    if speculative is None and (a.inject_leak or "").strip() == STALE_ROLLBACK:
        raise AuditCliError(NO_ROLLBACK_TO_IGNORE)
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise AuditCliError(f"--out {a.out}: exists and is not a directory")
    from ..cli.options import writable_dir

    writable_dir(a.out, "--out", AuditCliError)
    cfg = RunConfig(
        out=out,
        model=a.model,
        workers=a.workers,
        steps=a.steps,
        cold_starts=a.cold_starts,
        prompt=a.prompt,
        prompt_ids=_ints(a.prompt_ids, "--prompt-ids"),
        capacities=_capacities(a.capacity),
        inject_leak=a.inject_leak,
        variant=a.variant,
        threads=a.threads,
        timeout_s=a.timeout,
        device=a.device,
        dtype=a.dtype,
        netcount=not a.no_netcount,
        exposure=not a.no_exposure,
        revoke_at=a.revoke_at,
        standby=a.standby,
        negative_control=a.negative_control,
        batch=a.batch,
        speculative=speculative,
    )
    summary = run_audit(cfg, log=lambda s: print(s, file=sys.stderr))
    epochs = (
        f" (2 epochs each: worker {cfg.revoke_worker} revoked before decode step {cfg.revoke_at})"
        if cfg.revoke_at is not None
        else ""
    )
    if cfg.batch > 1:
        closed = sum(r["closed_sessions"] for r in summary["runs"])
        epochs = f" ({cfg.sessions} sessions each on {cfg.batch} KV slots; {closed} sessions closed)"
    steps = "decode steps"
    if speculative is not None:
        steps = "decode and verify steps"
        runs = summary["runs"]
        epochs += (
            f" (speculative {speculative.method}: {sum(r['generated_tokens'] for r in runs)} tokens in "
            f"{sum(r['forwards'] for r in runs)} forwards, {sum(r['speculative']['num_accepted_tokens'] for r in runs)} "
            f"drafts accepted, {sum(r['speculative']['rollbacks'] for r in runs)} rollbacks)"
        )
    print(
        f"audit {verdict(summary['all_ok'])}: {summary['closed']} {steps} closed over "
        f"{counted(summary['cold_starts'], 'cold start')}{epochs}, {counted(summary['workers'], 'worker')}; "
        f"{out / 'summary.json'}, "
        f"{out / 'report.md'}"
    )
    return 0 if summary["all_ok"] else EXIT_FAIL


# ---- verify ----


def _masked_text(d: Path, r: dict) -> str:
    v = r["verification"]
    lines = [f"masked audit {d}: {'PASS' if r['ok'] else 'FAIL'}"]
    for e in r["epochs"]:
        lines.append(f"  epoch {e['epoch']}: groups {'+'.join(map(str, e['groups']))}, participants {e.get('order')}")
    if v["on"]:
        lines.append(
            f"  product checks: {v['products_checked']:,} products ({v['token_checks']:,} token columns), "
            f"{v['failed']} failed"
        )
    else:
        lines.append("  product checks: off (the client did not verify what it unmasked)")
    for det in v["detections"]:
        who = (
            ", ".join(
                f"group {b['group']} member {b['member']} (rank {b['rank']}, participant {b['participant']})"
                for b in det["blamed"]
            )
            or "nobody (no member's rows differed)"
        )
        lines.append(f"  DETECTION session {det['session']} step {det['step']} {det['op']}: wrong product from {who}")
    lines += [f"  VIOLATION {m}" for m in r["violations"]]
    return "\n".join(lines)


def cmd_verify_masked(root: Path, as_json: bool) -> int:
    """A masked run's audit directory (`fusion generate --mode masked --audit-dir DIR`)."""
    from ..masked import audit as masked_audit

    r = masked_audit.verify(root)
    if as_json:
        print(
            json.dumps(
                {
                    "ok": r["ok"],
                    "violations": r["violations"],
                    "verification": r["verification"],
                    "epochs": r["epochs"],
                },
                indent=2,
            )
        )
    else:
        print(_masked_text(root, r))
    return 0 if r["ok"] else EXIT_FAIL


def cmd_verify(a: argparse.Namespace) -> int:
    """One cold-start directory, or a run's OUT directory (every cold*/ in it), or a masked run's."""
    root = Path(a.dir)
    if not root.is_dir():  # answered before torch loads (masked/audit.py imports it)
        raise AuditCliError(f"{a.dir}: {'not a directory' if root.exists() else 'no such directory'}")
    from ..masked.audit import log_path
    from .schema import MANIFEST
    from .verify import verify_dir

    if log_path(root, 0).is_file():
        if a.picture:
            raise AuditCliError(
                "--picture draws a structural run's logs; a masked run's groups are drawn from its plan: "
                "fusion plan --mode masked --workers A+B --picture FILE"
            )
        return cmd_verify_masked(root, a.json)
    dirs = [root]
    if root.is_dir() and not (root / MANIFEST).exists():
        dirs = sorted(p.parent for p in root.glob(f"cold*/{MANIFEST}")) or [root]
    results = [verify_dir(d) for d in dirs]
    if a.picture:
        _pictures(dirs, results, Path(a.picture), per_cold_start=dirs != [root])
    if a.json:
        out = [r.to_dict() for r in results]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print("\n\n".join(r.render() for r in results))
        print(_verdict(root, dirs != [root], results))
    return 0 if all(r.ok for r in results) else EXIT_FAIL


def _verdict(root: Path, run_out: bool, results: list) -> str:
    """The last line of a structural verify, in the words of `fusion audit run`'s: PASS or FAIL, the
    steps after each prefill that closed (decode, and with speculation verification steps), over what."""
    from .verify.result import verdict

    closed = sum(r.closed_decode + r.closed_verify for r in results)
    total = sum(r.decode_steps + r.verify_steps for r in results)
    steps = "decode and verify steps" if any(r.verify_steps for r in results) else "decode steps"
    over = f" over {len(results)} cold start{'s' if len(results) != 1 else ''}" if run_out else ""
    violations = sum(len(r.violations) for r in results)
    return (
        f"audit {verdict(all(r.ok for r in results))}: {closed}/{total} {steps} closed{over}, "
        f"{violations} violation{'s' if violations != 1 else ''}; {root}"
    )


def _pictures(dirs: list[Path], results: list, path: Path, per_cold_start: bool) -> None:
    """The ownership map of what the verifier read, one SVG per cold start (its epochs stacked):
    `path` itself for a cold start's (or an epoch's) directory; for a run's --out, `path`'s stem +
    "-" + each cold start's directory name (FILE-cold0.svg, ...), however many cold starts it has."""
    from .verify.drawing import write_svg
    from .verify.picture import audit_pictures

    for d, res in zip(dirs, results, strict=True):
        out = path.with_name(f"{path.stem}-{d.name}{path.suffix}") if per_cold_start else path
        try:
            write_svg(audit_pictures(d, res), out)
        except OSError as e:
            raise OSError(f"--picture {out}: {e.strerror or e}") from None
        print(f"fusion audit verify: wrote {out} (the holdings the verifier read in {d})", file=sys.stderr)


# ---- exposure ----


def cmd_exposure(a: argparse.Namespace) -> int:
    from ..structural.plan import make_plan
    from ..weights.loader import open_weights
    from .exposure import analyse, summarize, to_rows

    if a.workers < 1:
        raise AuditCliError(f"--workers must be >= 1, got {a.workers}")
    src = open_weights(a.model)
    c = src.config
    plan = make_plan(c, a.workers, _capacities(a.capacity))
    layers = _ints(a.layers, "--layers")
    if layers is not None and any(not (0 <= x < c.n_layers) for x in layers):
        raise AuditCliError(f"--layers must be in 0..{c.n_layers - 1}, got {a.layers}")
    results = analyse(src, plan, layers)
    summary = summarize(results, plan)
    attacks = []
    if a.attack_layers is not None:
        attacks = _attack(a, src, plan)
    if a.json:
        print(json.dumps({"summary": summary, "ranks": to_rows(results), "attacks": attacks}, indent=2))
        return 0
    h = c.hidden
    print(
        f"exposure: {c.arch}, hidden {h}, {c.n_layers} layers, {counted(plan.n, 'worker')} "
        f"(rank of the linear map from the residual to what a party observes; {h} = can reconstruct it)"
    )
    print("  views: shard = own residual coords + own q/k/v or gate/up shard; wire = shard + each peer's partial")
    if summary["no_peer_partials"]:
        print(
            f"  no peer partials at {', '.join(summary['no_peer_partials'])} (wire = shard there): the plan's "
            f"boundary merges {'; '.join(summary['boundary'])}"
        )
    for w, views in summary["per_worker"].items():
        parts = []
        for view, s in views.items():
            parts.append(
                f"{view}: full rank at {s['full_rank_points']}/{s['points']} (layer, point) pairs, "
                f"rank {s['min_rank']}..{s['max_rank']}/{h}"
            )
        print(f"  worker {w} (rank {w + 1}): " + "; ".join(parts))
    for key, k in summary["smallest_full_coalition"].items():
        who = "no coalition" if k is None else ("every single worker" if k == 1 else f"coalitions of {k}")
        print(f"  {key}: {who} can reconstruct the residual at every layer")
    if a.verbose:
        print("  layer point  party     view   rank")
        for e in results:
            print(f"  {e.layer:>5} {e.point:<6} {str(e.party):<9} {e.view:<6} {e.rank}/{e.hidden}")
    for r in attacks:
        print(
            f"  vocabulary attack, layer {r['layer']}, worker {r['worker']} ({r['coords']}/{h} coords"
            f"{', mask x' + str(r['mask_scale']) if r['mask_scale'] else ''}): recovered {r['recovered']}/{r['positions']} prompt tokens"
        )
    return 0


def _attack(a: argparse.Namespace, src, plan) -> list[dict]:
    from ..model.dense import DenseModel
    from .attack import vocab_match

    c = src.config
    layers = _ints(a.attack_layers, "--attack-layers") or []
    if any(not (0 <= x < c.n_layers) for x in layers):
        raise AuditCliError(f"--attack-layers must be in 0..{c.n_layers - 1}")
    if a.attack_prompt_ids:
        ids = _ints(a.attack_prompt_ids, "--attack-prompt-ids")
    else:
        from ..weights.loader import resolve_model_path
        from ..weights.tokenizer import load_tokenizer

        try:
            ids = load_tokenizer(resolve_model_path(a.model)).encode(a.attack_prompt)
        except Exception:
            raise AuditCliError("cannot tokenize --attack-prompt for this model: give --attack-prompt-ids") from None
    if any(not (0 <= i < c.vocab) for i in ids):
        raise AuditCliError(f"--attack-prompt-ids must be in [0, {c.vocab})")
    workers = _ints(a.attack_workers, "--attack-workers") if a.attack_workers else [0]
    if any(not (0 <= w < plan.n) for w in workers):
        raise AuditCliError(f"--attack-workers must be in 0..{plan.n - 1}")
    dense = DenseModel(src, max(layers) if layers else 0)
    out = []
    for layer in layers:
        for w in workers:
            coords = list(range(*plan.workers[w].residual))
            r = vocab_match(dense, ids, layer, coords, mask_scale=a.mask_scale)
            out.append(
                {
                    "layer": layer,
                    "worker": w,
                    "coords": r.coords,
                    "recovered": r.recovered,
                    "positions": r.positions,
                    "mask_scale": r.mask_scale,
                }
            )
    return out


def add_audit_parser(sub) -> None:
    """Register `fusion audit {run,verify,exposure}` on the main CLI's subparsers."""
    from ..cli.options import add_speculative_args

    p = sub.add_parser("audit", help="ownership audit: run the experiment, verify logs, exposure analysis")
    asub = p.add_subparsers(dest="audit_cmd", required=True)

    r = asub.add_parser("run", help="audited generation: N workers, cold starts, verifier, summary.json + report.md")
    r.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    r.add_argument("--steps", type=int, default=250, help="decode steps per cold start (default 250)")
    r.add_argument("--cold-starts", type=int, default=5, help="fresh worker processes this many times (default 5)")
    r.add_argument("--out", required=True, help="output directory (one subdirectory per cold start)")
    r.add_argument("--prompt", help="prompt text (tokenized on the client)")
    r.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    r.add_argument(
        "--inject-leak",
        help="negative control: gather@LAYER | silent-gather@LAYER | rs-allreduce | keep-slots | stale-rollback",
    )
    r.add_argument("--variant", default="sharded", help="sharded (default) | megatron (negative control / baseline)")
    r.add_argument("--threads", type=int, help="torch threads per worker")
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--device", default="cpu", help="the workers' device: cpu (default), cuda or cuda:K (the links)")
    r.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="compute and wire dtype (default float32)")
    r.add_argument("--no-netcount", action="store_true", help="skip the OS socket byte accounting")
    r.add_argument("--no-exposure", action="store_true", help="skip the exposure ranks and attack in the report")
    r.add_argument(
        "--revoke-at",
        type=int,
        metavar="STEP",
        help="revoke worker 1 before decode step STEP (0-based), as a user would: the session moves to "
        "a second epoch by replay, and the audit checks both and that worker 1 receives nothing more",
    )
    r.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="B",
        help="continuous batching: B + 1 sessions share every step on B KV slots (joining, leaving, "
        "a slot reused); the audit checks each session's slot, positions and release (default 1)",
    )
    r.add_argument("--standby", type=int, help="local standby workers (default: 1 with --revoke-at, else 0)")
    add_speculative_args(r)  # --speculative ngram | --draft-model PATH, --num-speculative-tokens K
    r.add_argument(
        "--negative-control",
        choices=["keep-revoked"],
        help="with --revoke-at: a client bug that keeps the revoked worker in the next epoch (must FAIL)",
    )
    r.set_defaults(func=_guard("run", cmd_run))

    v = asub.add_parser("verify", help="independent verifier of an audit directory (exit 0 only if every check passes)")
    v.add_argument("dir", help="an audit directory (manifest.json + rank*.jsonl), or a run's --out (every cold start)")
    v.add_argument("--json", action="store_true", help="print the full result as JSON")
    v.add_argument(
        "--picture",
        metavar="FILE",
        help="also write an SVG of what was checked: per epoch, each worker's coordinates of every protected "
        "tensor as the verifier read them in the logs, with its verdict (FILE for a cold start's directory; "
        "a run's --out: one FILE-coldK.svg per cold start)",
    )
    v.set_defaults(func=_guard("verify", cmd_verify))

    e = asub.add_parser("exposure", help="what a worker could reconstruct: ranks per layer/worker/coalition, attacks")
    e.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    e.add_argument("--workers", type=int, required=True)
    e.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    e.add_argument("--layers", help="comma-separated layers (default: all)")
    e.add_argument("--attack-layers", help="also run the vocabulary-matching attack at these layers, e.g. 0,2")
    e.add_argument(
        "--attack-prompt", default="My password is hunter2 and my bank is", help="prompt the attack recovers"
    )
    e.add_argument("--attack-prompt-ids", help="attack prompt as token ids (models without a tokenizer)")
    e.add_argument("--attack-workers", help="workers whose residual shard the attacker holds (default 0)")
    e.add_argument("--mask-scale", type=float, default=0.0, help="additive Gaussian mask on the shard, x its RMS")
    e.add_argument("--json", action="store_true")
    e.add_argument("--verbose", action="store_true", help="print every rank")
    e.set_defaults(func=_guard("exposure", cmd_exposure))
