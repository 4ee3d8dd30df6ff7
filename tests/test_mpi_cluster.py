"""A cluster run with mpiexec: the workers on three hosts (network namespaces on a bridge), started
together by MPICH's mpiexec, share one MPI world as their fabric (`--comm-backend mpi` with a topology);
the client reaches them over its TLS links as always.

mpiexec runs on the client's host and starts each worker on its own host through `-launcher-exec`,
a stand-in for ssh that enters the host's namespace (hydra calls it as `LAUNCHER [ssh options] HOST
COMMAND`). The hosts share one kernel, so MPICH would move the workers' data through shared memory
without touching the network; `MPIR_CVAR_NOLOCAL=1` and UCX's tcp transport on eth0 make it use the
network, as on separate machines. Checked: the same greedy tokens as a local run, worker-to-worker
bytes on the bridge, and the one-line refusals of what a fixed-size world cannot do. Skipped, with
the reason, where namespaces cannot be made; CI runs as root, so there it runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import procs
import pytest
from netns import Hosts, available
from test_wire import generate_args

from fusion_compute.comm import Identity

REASON = available() or (None if shutil.which("mpiexec") else "mpiexec not installed (the mpi extra)")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"cannot run an mpiexec cluster here: {REASON}")
CLIENT, WORKERS = "10.0.0.1", ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
LAUNCHER = """#!/bin/sh
# hydra's ssh stand-in: LAUNCHER [ssh options] HOST COMMAND... -> COMMAND in HOST's namespace
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%s
*) echo "no namespace for host $host" >&2; exit 2;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""
# On one kernel MPICH would use shared memory between the hosts: force its network path.
NETWORK = ["-genv", "MPIR_CVAR_NOLOCAL", "1", "-genv", "UCX_TLS", "tcp", "-genv", "UCX_NET_DEVICES", "eth0"]


def topology(tmp: Path) -> tuple[Path, list[Path]]:
    """Keys for the client and the three workers, and the topology that pins them."""
    ids = [Identity.new() for _ in range(1 + len(WORKERS))]
    keys = []
    for i, ident in enumerate(ids):
        keys.append(tmp / f"k{i}.key")
        ident.save(keys[-1])
    topo = tmp / "t.toml"
    topo.write_text(
        f'[client]\naddress = "{CLIENT}:29500"\nkey = "{ids[0].public.line()}"\n'
        + "".join(
            f'[[worker]]\naddress = "{h}"\nkey = "{k.public.line()}"\n' for h, k in zip(WORKERS, ids[1:], strict=True)
        )
    )
    return topo, keys


def setup(hosts: Hosts, tmp: Path) -> tuple[Path, list[Path]]:
    """The topology, and the launcher that enters each worker's namespace."""
    topo, keys = topology(tmp)
    launcher = tmp / "launch.sh"
    cases = "\n".join(f"{h}) ns={hosts.ns[h]};;" for h in WORKERS)
    launcher.write_text(LAUNCHER % cases)
    launcher.chmod(0o755)
    return topo, keys


def mpi_client_args(model: Path, topo: Path, keys: list[Path]) -> list[str]:
    """The client's `fusion generate` for the workers mpiexec starts: the topology, the client's key,
    the MPI fabric, `--no-recover`, a minute to join."""
    return generate_args(
        model,
        "--topology",
        str(topo),
        "--key",
        str(keys[0]),
        "--comm-backend",
        "mpi",
        "--no-recover",
        "--join-timeout",
        "60",
    )


def mpiexec(
    topo: Path, keys: list[Path], launcher: Path, model: Path, network: bool = True, order: tuple[int, ...] = (1, 2, 3)
) -> list[str]:
    """One mpiexec for the three workers: a host file with one slot per host, so rank i runs on the
    host of topology worker order[i] (the topology's order: 1, 2, 3), with that worker's key (MPMD,
    ':' — on real machines every host keeps its key at the same path and one command serves all)."""
    hostfile = launcher.parent / "hosts"
    hostfile.write_text("".join(f"{WORKERS[w - 1]}:1\n" for w in order))
    cmd = [
        shutil.which("mpiexec"),
        "-f",
        str(hostfile),
        "-launcher",
        "ssh",
        "-launcher-exec",
        str(launcher),
        "-iface",
        "eth0",
        *(NETWORK if network else []),
    ]
    for i, w in enumerate(order):
        cmd += [
            *([":"] if i else []),
            "-n",
            "1",
            *procs.FUSION,
            "worker",
            "--topology",
            str(topo),
            "--key",
            str(keys[w]),
            "--model",
            str(model),
            "--threads",
            "1",
            "--timeout",
            "60",
        ]
    return cmd


@pytest.fixture(scope="module")
def local_tokens(tiny_qwen2) -> list[int]:
    """The reference: three local workers on TLS."""
    local = procs.run(*generate_args(tiny_qwen2, "--workers", "3"), timeout=300)
    assert local.returncode == 0, local.stderr
    return json.loads(local.stdout.strip().splitlines()[-1])["token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("network", [True, False], ids=["network", "shared-memory"])
def test_mpiexec_cluster_across_namespaces(tiny_qwen2, tmp_path, network, local_tokens):
    """`network`: MPICH forced onto eth0. Without it (the negative control of the bridge check) the
    same run is as exact, but the workers' data goes through shared memory: measured 8.6 KB between
    workers on the bridge (MPI's connection set-up) against 355 KB with it."""
    want = local_tokens
    with Hosts([CLIENT, *WORKERS]) as hosts:
        topo, keys = setup(hosts, tmp_path)
        with hosts.capture() as cap:
            launch = hosts.popen(CLIENT, mpiexec(topo, keys, tmp_path / "launch.sh", tiny_qwen2, network))
            client = hosts.fusion(  # forked from the suite's fork server: torch is imported already
                CLIENT,
                *mpi_client_args(tiny_qwen2, topo, keys),
            )
            out, err = client.communicate(timeout=300)
            w_out, w_err = launch.communicate(timeout=120)
    assert client.returncode == 0, err + w_err[-3000:]
    assert launch.returncode == 0, w_err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["token_ids"] == want  # exact: the same greedy tokens as three local workers on TLS
    between_workers = sum(v for (a, b), v in cap.flows.items() if a in WORKERS and b in WORKERS)
    assert cap.drops == 0
    assert (between_workers > 100_000) == network, cap.flows  # the fabric's traffic crossed the bridge (or not)


@pytest.mark.parametrize(
    ("standby", "extra", "message"),
    [
        (False, [], "cannot replace a lost worker (an mpiexec world has a fixed size): add --no-recover"),
        (True, ["--no-recover"], "cannot take in a standby"),
        (False, ["--comm-backend", "gloo", "--insecure"], "--comm-backend gloo runs on one machine only"),
    ],
)
def test_cluster_refusals(tiny_qwen2, tmp_path, standby, extra, message):
    """What a fixed-size MPI world cannot do is refused at once, in one line, before any network is
    touched (so no namespace is needed)."""
    topo, keys = topology(tmp_path)
    if standby:
        topo.write_text(
            topo.read_text() + f'[[worker]]\naddress = "{WORKERS[0]}"\nrole = "standby"\n'
            f'key = "{Identity.new().public.line()}"\n'
        )
    p = subprocess.run(
        [
            *procs.FUSION,
            *generate_args(
                tiny_qwen2,
                "--topology",
                str(topo),
                "--key",
                str(keys[0]),
                *(extra if "--comm-backend" in extra else ["--comm-backend", "mpi", *extra]),
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


@pytest.mark.slow
def test_rank_order_must_be_the_topology_order(tiny_qwen2, tmp_path):
    """Each worker on its own host with its own key, but mpiexec's ranks in another order than the
    topology's: the client refuses the epoch in one line naming both misplaced workers (each said its
    rank when it joined: rendezvous.launched_rank), every worker leaves with that line, nothing hangs.
    (Before, each misplaced worker found out only once it had opened MPI, and the first to end its
    epoch could end the job before the other had said so: a race the suite lost once under load.)"""
    with Hosts([CLIENT, *WORKERS]) as hosts:
        topo, keys = setup(hosts, tmp_path)
        launch = hosts.popen(CLIENT, mpiexec(topo, keys, tmp_path / "launch.sh", tiny_qwen2, order=(3, 2, 1)))
        client = hosts.fusion(  # forked from the suite's fork server: torch is imported already
            CLIENT,
            *mpi_client_args(tiny_qwen2, topo, keys),
        )
        out, err = client.communicate(timeout=300)
        w_out, w_err = launch.communicate(timeout=120)
    lines = [line for line in err.splitlines() if "mpiexec started the workers in another order" in line]
    assert client.returncode != 0 and len(lines) == 1, err
    assert "worker 1 [" in lines[0] and "is rank 2 of 3, not 0 of 3" in lines[0], lines[0]
    assert "worker 3 [" in lines[0] and "is rank 0 of 3, not 2 of 3" in lines[0], lines[0]
    assert "worker 2 [" not in lines[0], lines[0]  # rank 1, in its place
    said = w_out + w_err  # every worker leaves with the client's refusal, none after opening MPI
    assert said.count("the client refused this worker: mpiexec started the workers in another order") == 3, said
    assert "mpiexec started this worker as rank" not in said, said


def test_membership_changes_are_refused(tmp_path):
    """Revoking or adding a worker would need a new MPI world: refused in one line, nothing changed."""
    from types import SimpleNamespace

    from fusion_compute.runtime.deadline import StepClock
    from fusion_compute.runtime.membership import Membership, Seat, UnknownWorker
    from fusion_compute.runtime.topology import Topology
    from fusion_compute.structural.client import EngineOptions

    topo, _ = topology(tmp_path)
    opts = EngineOptions(n_workers=2, topology=Topology.load(str(topo)), comm_backend="mpi", recover=False)
    # the refusal comes before any worker is touched: an engine with nothing but its options
    m = Membership(SimpleNamespace(opts=opts), {1: Seat(1), 2: Seat(2)}, StepClock())
    with pytest.raises(UnknownWorker, match="cannot revoke a worker: the workers share one mpiexec world"):
        m.revoke(1)
    with pytest.raises(UnknownWorker, match="cannot add a standby"):
        m.add_standby()


def test_a_worker_says_the_rank_mpiexec_gave_it():
    """rendezvous.launched_rank: MPICH's PMI_RANK/PMI_SIZE or Open MPI's OMPI_COMM_WORLD_RANK/SIZE, read
    before MPI loads; nothing outside mpiexec, nor from words that are not a rank inside its world."""
    from fusion_compute.comm.rendezvous import launched_rank

    assert launched_rank({"PMI_RANK": "2", "PMI_SIZE": "3"}) == (2, 3)
    assert launched_rank({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}) == (0, 4)
    assert launched_rank({}) is None
    assert launched_rank({"PMI_RANK": "3", "PMI_SIZE": "3"}) is None  # outside its world
    assert launched_rank({"PMI_RANK": "x", "PMI_SIZE": "3"}) is None
    assert launched_rank({"PMI_RANK": "1"}) is None
    assert launched_rank({"PMI_RANK": "1", "PMI_SIZE": "9" * 5000}) is None  # no 5,000-digit parse


@pytest.mark.parametrize(
    "claim",
    [[1e400, 3], [1.0, 3], [True, 3], [0, 2**70], [-1, 3], [3, 3], [0, 1, 2], {"0": 0, "1": 3}, "03", None, [[0], 3]],
)
def test_a_claimed_rank_that_is_not_two_integers_in_a_world_is_no_claim(claim):
    """What a worker's JOIN says mpiexec made it, as any JSON a liar can send: only [rank, size], two
    integers with 0 <= rank < size <= MAX_WORLD, is a claim; nothing else raises (an infinity made
    int() raise OverflowError in the client's greeter thread: the red team's find) or counts."""
    from fusion_compute.comm.rendezvous import _launched

    assert _launched(claim) is None
    assert _launched([2, 3]) == (2, 3)


@pytest.mark.parametrize(
    "text",
    ["[" * 200_000 + "]" * 200_000, '{"n": ' + "9" * 5000 + "}", '{"a": "\\ud800', "\xff"],
    ids=["nested-200000-deep", "a-5000-digit-integer", "unterminated", "not-utf8"],
)
def test_a_rendezvous_message_json_cannot_read_is_malformed(text):
    """recv_json: nesting too deep (RecursionError), an integer past Python's 4,300 digits (ValueError),
    bad JSON or bytes that are not UTF-8: one CommError naming the sender, never another exception
    (either escaped the client's greeter thread with a traceback, and the join then waited out its
    deadline)."""
    from test_boundaries_wire import tcp

    from fusion_compute.comm.errors import CommError
    from fusion_compute.comm.links import Link
    from fusion_compute.comm.rendezvous import recv_json

    ours, theirs = tcp()
    sender, receiver = Link(ours, None, 0, "the client"), Link(theirs, None, 1, "worker 1")  # each names its peer
    try:
        payload = text.encode("latin-1") if text == "\xff" else text.encode()
        sender.send(memoryview(payload))
        sender.flush(time.monotonic() + 5)
        with pytest.raises(CommError, match="^worker 1 sent a malformed rendezvous message$"):
            recv_json(receiver, time.monotonic() + 5)
    finally:
        sender.close()
        receiver.close()


def test_the_client_names_every_worker_out_of_the_worlds_order():
    """membership.out_of_world_order: nothing to say when every worker is mpiexec's rank of its place
    (or said nothing: its own check runs when it opens MPI); else one line naming each misplaced one."""
    from types import SimpleNamespace

    from fusion_compute.runtime.membership import out_of_world_order

    def joined(*launched):
        return {
            pid: SimpleNamespace(launched=lw, member=SimpleNamespace(label=lambda p=pid: f"worker {p} [h{p}]"))
            for pid, lw in enumerate(launched, start=1)
        }

    assert out_of_world_order([1, 2, 3], joined((0, 3), (1, 3), (2, 3))) is None
    assert out_of_world_order([1, 2, 3], joined((0, 3), None, (2, 3))) is None
    why = out_of_world_order([1, 2, 3], joined((2, 3), (1, 3), (0, 3)))
    assert why is not None and "\n" not in why
    assert "worker 1 [h1] is rank 2 of 3, not 0 of 3" in why and "worker 3 [h3] is rank 0 of 3, not 2 of 3" in why
    assert "worker 2" not in why
    why = out_of_world_order([1, 2], joined((0, 3), (1, 3)))  # a world of another size
    assert why is not None and "worker 1 [h1] is rank 0 of 3, not 0 of 2" in why


def test_a_worker_whose_launcher_said_nothing_checks_its_rank_when_it_opens_mpi():
    """MpiFabric._world, the backstop for a launcher that sets no rank in the environment (the client
    then has nothing to compare): the world mpiexec made must have the epoch's size and this worker at
    its place, else one line saying both; in place, the world is duplicated. (mpi4py's world stands in
    for MPI here: what is checked is the worker's comparison, not MPI.)"""
    from types import SimpleNamespace

    from fusion_compute.comm.errors import CommError
    from fusion_compute.comm.mpi_fabric import MpiFabric

    def world(rank, size):
        return SimpleNamespace(
            COMM_WORLD=SimpleNamespace(Get_rank=lambda: rank, Get_size=lambda: size, Dup=lambda: "dup")
        )

    assert MpiFabric._world(world(2, 3), 2, 3) == "dup"
    with pytest.raises(
        CommError, match="^mpiexec started this worker as rank 0 of 3, but it is worker 3 of 3 in the topology"
    ):
        MpiFabric._world(world(0, 3), 2, 3)
    with pytest.raises(CommError, match="as rank 1 of 3, but it is worker 2 of 2"):
        MpiFabric._world(world(1, 3), 1, 2)  # a smaller epoch than the world
