"""The independent verifier: `fusion audit verify DIR`.

It reads the logs (schema.py) and the model dimensions recorded in the manifest, and nothing else:
every module of this package imports only audit/schema.py and the standard library, never the
plan, operators, comm, client or worker code, so a bug there cannot certify itself
(tests/test_audit.py parses the imports). From the dimensions and the shares each worker declares
in its log header it recomputes, on its own, every coordinate set a worker should hold and every
transfer it should make, then checks each step (docs/design.md, "The protected interval and its invariants"):

  chain           every log's hash chain is intact and ends at the hash the manifest recorded
  structure       header / sessions / steps / end in order; steps consecutive; the same steps on
                  every rank; positions advance by the tokens run
  holding         each tensor's row count equals its claimed coordinates, and the coordinates
                  equal what the declared share implies
  partition       per step, layer and protected role: the workers' sets are disjoint and cover it
  no_full_holder  no worker holds every coordinate of any protected role (N >= 2); reported with
                  the smallest coalition of workers that covers each role
  closure         inside the interval only reduce-scatters and declared score sums; every scatter's
                  output is what its owner's next operator consumes, in the same layout, through
                  every layer, from ingress to egress
  accounting      every transfer's element counts, per peer, equal the prediction; each rank's
                  sends match its peers' receives
  os_bytes        kernel socket counters per worker process (netcount.json) equal the predicted
                  bytes plus the wire model's protocol overhead
  sessions        per KV slot (a batched run has one session per slot at a time): positions
                  continue exactly where the slot's session ended; a new session starts only in a
                  free slot (holding: never on top of the previous session's KV); every worker
                  measured a released slot as all zeros; a session is closed when all its steps are
  rollback        speculative decoding: a slot goes back only by a recorded rollback (from exactly
                  what it holds, zeroed on every worker, the same on every rank as in the client's
                  log); a span that starts below what its slot holds without one is a step that
                  runs where the rejected drafts' keys and values still are

A cold start has one audit directory per plan epoch (a revoked or lost worker ends an epoch; the
next one runs over the survivors plus a standby and replays the session as its first step). Each
epoch is checked as above, the replay included: its no_full_holder check is "during the replay no
worker holds every coordinate of any protected role". Across epochs (membership.py):

  chain           each epoch's manifest, the membership record and the run-level socket counts
                  match the digests in the cold start's manifest
  membership      every epoch's workers are who the client says (each worker's log header names its
                  participant id); a worker that left (revoked by the user, or lost) has no log in
                  any later epoch, the client never addresses it again, and the kernel counted no
                  byte to or from its process after it left; no one leaves without a recorded reason

Exit status 0 only when every check passed. The package, by responsibility:

  logs.py         the manifest, each rank's hash chain, record order, the same steps on every rank
  expectation.py  what the dimensions and declared shares imply: coordinate sets, transfers, bytes
  checks.py       what each rank's records claim, per step, and the cross-rank checks on them
  sessions.py     each session's KV slot, positions, rollbacks and lifetime (single and batched runs)
  os_bytes.py     the kernel's socket counters vs the predicted wire bytes
  membership.py   the checks across epochs: who took part when, and what a departed worker received
  result.py       Violation, Result (one epoch) and RunResult (a cold start): counts, JSON, report
  picture.py      `--picture FILE`: the ownership map of what this pass read (per epoch, each worker's
                  coordinates of every protected role, from its own parsed records), with the verdict
  drawing.py      the SVG drawing it uses (also the plan's picture, structural/picture.py, imports it:
                  standard library only, so it may live here)
"""

from __future__ import annotations

from pathlib import Path

from .. import schema as S
from .checks import (
    Verification,
    check_boundary,
    check_client,
    check_conservation,
    check_partition,
    check_worker,
)
from .logs import (
    AuditFormatError,
    RankLog,
    check_same_steps,
    coordinate_map,
    load_manifest,
    read_manifest,
    read_rank_log,
)
from .membership import EpochView, check_membership, epoch_entries, read_record, replay_steps
from .os_bytes import check_os_bytes
from .result import Result, RunResult, Violation
from .sessions import check_slots

__all__ = ["AuditFormatError", "Result", "RunResult", "Violation", "verify_dir", "verify_epoch"]


def verify_dir(path: str | Path) -> Result | RunResult:
    """Check an audit directory: a cold start (every epoch, and across them: a RunResult) or one
    epoch's directory (a Result). Raises AuditFormatError when it is neither."""
    d = Path(path)
    manifest = read_manifest(d)
    if "epochs" in manifest:
        return verify_cold_start(d, manifest)
    return verify_epoch(d, manifest)


def verify_cold_start(d: Path, manifest: dict) -> RunResult:
    """Every epoch with the per-epoch checks, then the checks across epochs (membership.py)."""
    run = RunResult(dir=str(d))
    record = read_record(d, manifest, run)
    views = []
    for e, sub in epoch_entries(d, manifest, run):
        try:
            em = load_manifest(sub)
        except AuditFormatError as exc:
            run.run_violations.append(Violation("structure", str(exc), epoch=e))
            continue
        departing = record.departing(e, em.get("order")) if record else {}
        res, logs = _verify_epoch(sub, em, departing)
        for v in res.violations:
            v.epoch = e
        run.epochs.append(res)
        run.orders.append(list(em.get("order") or []))
        views.append(EpochView(e, sub, em, logs))
    check_membership(run, views, record, d, manifest)
    replay_steps(run, views, record)
    return run


def verify_epoch(path: str | Path, manifest: dict | None = None) -> Result:
    """Check one epoch's audit directory on its own (without the membership record)."""
    d = Path(path)
    return _verify_epoch(d, manifest or load_manifest(d), {})[0]


def _verify_epoch(d: Path, manifest: dict, departing: dict[int, str]) -> tuple[Result, dict[int, RankLog]]:
    """`departing`: rank -> why its worker left during this epoch (its log may lack an end record)."""
    dims, n = manifest["model"]["dims"], int(manifest["workers"])
    res = Result(dir=str(d), workers=n, layers=int(dims["layers"]), variant=manifest.get("variant", "sharded"))
    wire_dtype = manifest.get("wire_dtype", "float32")  # absent: a log from before it was recorded
    ctx = Verification(
        res, dims, n, res.layers, wire=str(manifest.get("wire")), itemsize=S.WIRE_ITEMSIZE.get(wire_dtype, 4)
    )
    # whether the last down's partials went to the client (the plan the run logged: not with
    # post-norms); absent in a log from before the plan said so: they did
    ctx.down_to_client = bool(((manifest.get("plan") or {}).get("boundary") or {}).get("down_to_client", True))
    if wire_dtype not in S.WIRE_ITEMSIZE:
        res.violations.append(
            Violation("structure", f"manifest's wire dtype is none the verifier knows ({wire_dtype!r})")
        )
    if ctx.wire not in S.LINK_BACKENDS:
        res.violations.append(
            Violation("os_bytes", f"manifest's wire is no link backend the model knows ({ctx.wire!r})")
        )
        ctx.wire = "tls"

    logs = {}
    for rank in range(n + 1):
        final = manifest["chains"].get(str(rank))
        logs[rank] = read_rank_log(d / S.log_name(rank), rank, final, res, departing.get(rank))
    ctx.declare_shares(logs)
    step_keys = check_same_steps(logs, n, res, ctx.violate)
    ingress, egress = coordinate_map(logs[0].header, "ingress"), coordinate_map(logs[0].header, "egress")
    sessions = check_slots(logs[0].body, 0, False, ctx.violate, res.checks)
    for w in range(n):
        check_slots(logs[w + 1].body, w + 1, True, ctx.violate, res.checks)
        check_worker(ctx, w, logs[w + 1].body)
    check_client(ctx, logs[0].steps, ingress, egress)
    check_conservation(ctx)
    check_boundary(ctx, ingress, egress)
    check_partition(ctx)
    check_os_bytes(res, ctx.predicted_wire, d, manifest)
    ctx.verdicts(step_keys, sessions)
    return res, logs
