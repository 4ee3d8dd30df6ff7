"""The socket byte check: what the kernel counted per worker process vs the predicted wire bytes.

Part of the independent verifier: imports only audit/schema.py and the standard library. The
runner writes netcount.json from the kernel's per-socket counters (audit/netcount.py); the
prediction is the sum, over a worker's expected transfers and control words, of the schema's wire
model (checks.check_worker adds it up). The file's digest must match the manifest's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import schema as S
from .result import Result, Violation


def check_os_bytes(res: Result, predicted_wire: dict[int, list[int]], d: Path, manifest: dict) -> None:
    """Kernel socket counters per worker process vs the predicted wire bytes (rank -> [sent, received])."""
    net_path = d / S.NETCOUNT
    if not net_path.is_file():
        return
    try:
        net = json.loads(net_path.read_text())
        for rank_s, m in net["ranks"].items():
            rank = int(rank_s)
            if rank == 0 or rank not in predicted_wire:
                continue
            ps, pr = predicted_wire[rank]
            ms, mr = int(m["sent"]), int(m["received"])
            tol_s = S.WIRE_REL_TOL * ps + S.WIRE_ABS_TOL
            tol_r = S.WIRE_REL_TOL * pr + S.WIRE_ABS_TOL
            ok = abs(ms - ps) <= tol_s and abs(mr - pr) <= tol_r
            res.checks["os_bytes"] += 2
            res.os[rank_s] = {
                "pid": m.get("pid"),
                "measured_sent": ms,
                "predicted_sent": ps,
                "excess_sent": ms - ps,
                "measured_received": mr,
                "predicted_received": pr,
                "excess_received": mr - pr,
                "ratio_sent": round(ms / ps, 6) if ps else None,
                "tolerance": round(tol_s),
                "ok": ok,
            }
            if not ok:
                msg = (
                    f"sockets carried {ms:,} B out / {mr:,} B in, predicted {ps:,} / {pr:,} "
                    f"(excess {ms - ps:+,} / {mr - pr:+,} B, tolerance {tol_s:,.0f})"
                )
                res.violations.append(Violation("os_bytes", msg, rank=rank))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        res.violations.append(Violation("os_bytes", f"unreadable {S.NETCOUNT} ({type(e).__name__})"))
    digest = manifest.get("netcount_sha256")
    if digest is not None and hashlib.sha256(net_path.read_bytes()).hexdigest() != digest:
        res.violations.append(Violation("chain", f"{S.NETCOUNT} differs from the digest in the manifest"))
