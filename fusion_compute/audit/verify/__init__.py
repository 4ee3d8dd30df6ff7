"""The independent verifier: `fusion audit verify DIR`.

It reads the logs (schema.py) and the model dimensions recorded in the manifest, and nothing else:
every module of this package imports only audit/schema.py and the standard library, never the
plan, operators, comm, client or worker code, so a bug there cannot certify itself
(tests/test_audit.py parses the imports). From the dimensions and the shares each worker declares
in its log header it recomputes, on its own, every coordinate set a worker should hold and every
transfer it should make, then checks each step (DESIGN.md §5):

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

Exit status 0 only when every check passed. The package, by responsibility:

  logs.py         the manifest, each rank's hash chain, record order, the same steps on every rank
  expectation.py  what the dimensions and declared shares imply: coordinate sets, transfers, bytes
  checks.py       what each rank's records claim, per step, and the cross-rank checks on them
  os_bytes.py     the kernel's socket counters vs the predicted wire bytes
  result.py       Violation and Result: counts, JSON, the printed report
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
from .logs import AuditFormatError, check_same_steps, coordinate_map, load_manifest, read_rank_log
from .os_bytes import check_os_bytes
from .result import Result, Violation

__all__ = ["AuditFormatError", "Result", "Violation", "verify_dir"]


def verify_dir(path: str | Path) -> Result:
    """Check one audit directory (one cold start). Raises AuditFormatError when it is not one."""
    d = Path(path)
    manifest = load_manifest(d)
    dims, n = manifest["model"]["dims"], int(manifest["workers"])
    res = Result(dir=str(d), workers=n, layers=int(dims["layers"]), variant=manifest.get("variant", "sharded"))
    ctx = Verification(res, dims, n, res.layers, wire=str(manifest.get("wire")))
    if ctx.wire not in S.WIRE_ENGINES:
        res.violations.append(Violation("os_bytes", f"manifest names no known wire engine ({ctx.wire!r})"))
        ctx.wire = "tls"

    logs = {}
    for rank in range(n + 1):
        logs[rank] = read_rank_log(d / S.log_name(rank), rank, manifest["chains"].get(str(rank)), res)
    ctx.declare_shares(logs)
    step_keys = check_same_steps(logs, n, res)
    ingress, egress = coordinate_map(logs[0].header, "ingress"), coordinate_map(logs[0].header, "egress")
    for w in range(n):
        check_worker(ctx, w, logs[w + 1].body)
    check_client(ctx, logs[0].steps, ingress, egress)
    check_conservation(ctx)
    check_boundary(ctx, ingress, egress)
    check_partition(ctx)
    check_os_bytes(res, ctx.predicted_wire, d, manifest)
    ctx.verdicts(step_keys)
    return res
