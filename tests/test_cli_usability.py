"""What trips a user in the first hours (issue 45): a hand-started worker's thread count, where a
prompt and repeated flags come from, and errors in words rather than exception names. In-process
where the behaviour allows (cli.main.main on a parsed command line), else a `fusion` process."""

from __future__ import annotations

import logging

import pytest
from test_topology import keys, topo_text, write_keys

from fusion_compute.cli import options as O
from fusion_compute.cli.main import build_parser
from fusion_compute.runtime.engine_options import usable_cores

# ---- (1) a hand-started worker does not oversubscribe its host ----


def worker_args(*argv: str):
    return build_parser().parse_args(["worker", *argv])


def test_hand_started_workers_divide_the_cores_among_the_topologys_local_participants(tmp_path, caplog):
    """Two workers and their client declared on this machine: each worker takes cores / 3 threads (at
    least 1), not torch's default of every core, and says so; --threads wins; a topology whose other
    participants are elsewhere leaves this worker every core."""
    ids = keys(3)
    paths = write_keys(tmp_path, ids)
    here = tmp_path / "here.toml"
    here.write_text(topo_text(ids, ["127.0.0.1", "127.0.0.1"]))
    with caplog.at_level(logging.INFO, logger="fusion_compute"):
        o = O.worker_options(worker_args("--topology", str(here), "--key", str(paths[1])))
    assert o.threads == max(1, usable_cores() // 3)
    assert any("shared by 3" in r.getMessage() and "--threads" in r.getMessage() for r in caplog.records)
    o = O.worker_options(worker_args("--topology", str(here), "--key", str(paths[1]), "--threads", "5"))
    assert o.threads == 5
    # The client and the other worker at addresses this machine does not hold (TEST-NET-1, RFC 5737).
    apart = tmp_path / "apart.toml"
    apart.write_text(topo_text(ids, ["127.0.0.1", "192.0.2.7"]).replace('"127.0.0.1:', '"192.0.2.1:', 1))
    o = O.worker_options(worker_args("--topology", str(apart), "--key", str(paths[1])))
    assert o.threads == usable_cores()


def test_a_worker_without_a_topology_shares_the_cores_with_a_local_client():
    a = worker_args("--master", "127.0.0.1:29999", "--insecure", "--rank", "1")
    assert O.worker_options(a).threads == max(1, usable_cores() // 2)
    a = worker_args("--master", "192.0.2.1:29999", "--insecure", "--rank", "1")
    assert O.worker_options(a).threads == usable_cores()


@pytest.mark.parametrize("n", [0, -1])
def test_threads_below_one_are_refused(n):
    from fusion_compute.errors import UsageError

    with pytest.raises(UsageError, match="--threads must be >= 1"):
        O.worker_options(worker_args("--master", "127.0.0.1:1", "--insecure", "--rank", "1", "--threads", str(n)))
