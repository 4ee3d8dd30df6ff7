"""A topology file (TOML): who takes part in a multi-host run, where, with what share, and under
which public key. The user decides who holds their conversation by listing keys here.

    model = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"   # optional: default model path for everyone

    [client]                      # the user side (rank 0): tokenizer, embedding, LM head, sampling
    address = "10.0.0.1:29500"    # HOST:PORT it listens on for the rendezvous
    key = "fc1.MIHQ..."           # its public key (`fusion keys new client.key` prints it)

    [[worker]]                    # rank 1 (workers are ranked in file order)
    name = "alpha"                # optional label for logs
    address = "10.0.0.2"          # the host this worker runs on (it listens there for its peers)
    capacity = 2                  # relative share (default 1)
    key = "fc1.MIHQ..."           # its public key

    [[worker]]                    # rank 2
    address = "10.0.0.3"
    key = "fc1.MIHQ..."
    model = "/data/smollm2.gguf"  # optional: this participant's own path to the same model
    device = "cuda:1"             # optional: where this worker computes (default cpu)

Masked mode: give every worker `group = "A"` or `group = "B"`; group A members take ranks 1..n_A in
file order, then group B (`fusion generate --mode masked --topology FILE`).

Standbys: `role = "standby"` on a [[worker]] makes it a spare (ranked after every worker): it joins
at start, beats, and computes only after replacing a lost or revoked worker (in masked mode, one of
its own group). docs/resilience.md.

Every link is TLS 1.3 with the keys of this file pinned on both ends (comm/links.py); a worker
started with a key that is not listed, or listed for another rank or group, is refused before it
receives anything. A participant refuses to start on a machine that does not hold its declared
address. Keys may be left out only for a plaintext run the user asks for by name (`--insecure`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..comm import IdentityError, PublicId
from ..comm.identity import read_small_file
from ..errors import UsageError
from .placement import parse_device

_TOP_KEYS = {"model", "client", "worker"}
_CLIENT_KEYS = {"address", "model", "name", "key"}
_WORKER_KEYS = {"address", "capacity", "model", "name", "key", "group", "role", "device"}
ROLES = ("worker", "standby")
MAX_TOPOLOGY_FILE = 1 << 20  # bytes: a worker's table is ~500 bytes with its key, so room for ~2,000 workers
GROUP_NAME = re.compile(r"^(A|B|B[1-9][0-9]*)$")  # A, and the mask groups: B, or B1..Bk


class TopologyError(UsageError, ValueError):
    """The topology file is missing, malformed, or does not fit this machine."""


@dataclass(frozen=True)
class Participant:
    rank: int  # 0 = client, 1..N = workers
    host: str
    key: PublicId | None = None
    capacity: float = 1.0
    name: str | None = None
    model: str | None = None
    group: str | None = None  # "A" / "B": masked mode
    standby: bool = False  # a spare: joins at start, computes only after replacing a lost worker
    device: str | None = None  # where this worker computes: cpu, cuda, cuda:K (its `fusion worker --device` wins)

    @property
    def label(self) -> str:
        role = "client" if self.rank == 0 else f"{'standby' if self.standby else 'worker'} {self.rank}"
        if self.group:
            role += f" (group {self.group})"
        return f"{role} ({self.name})" if self.name else role


@dataclass(frozen=True)
class Topology:
    path: Path
    client: Participant
    port: int
    workers: tuple[Participant, ...]  # the first epoch's workers, by rank
    model: str | None = None
    standbys: tuple[Participant, ...] = ()  # ranks after the workers'

    @property
    def all_workers(self) -> tuple[Participant, ...]:
        return self.workers + self.standbys

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def master(self) -> str:
        """HOST:PORT of the rendezvous (the client's address)."""
        return f"{self.client.host}:{self.port}"

    @property
    def capacities(self) -> tuple[float, ...]:
        return tuple(w.capacity for w in self.workers)

    @property
    def masked(self) -> bool:
        return any(w.group for w in self.workers)

    @property
    def group_names(self) -> tuple[str, ...]:
        """ "A" then the mask groups ("B", or "B1".."Bk") of a masked topology."""
        masks = sorted({w.group for w in self.all_workers if w.group and w.group != "A"}, key=lambda g: int(g[1:] or 0))
        return ("A", *masks)

    @property
    def groups(self) -> tuple[int, ...]:
        """Sizes of group A and of each mask group, in order (the first epoch's workers)."""
        return tuple(sum(w.group == g for w in self.workers) for g in self.group_names)

    def participant(self, rank: int) -> Participant:
        if rank == 0:
            return self.client
        everyone = self.all_workers
        if not 1 <= rank <= len(everyone):
            raise TopologyError(f"{self.path}: rank {rank} is not in the file (workers are ranks 1..{len(everyone)})")
        return everyone[rank - 1]

    def model_for(self, rank: int) -> str | None:
        """The model path participant `rank` should open: its own `model`, else the file's."""
        return self.participant(rank).model or self.model

    def by_key(self, key: PublicId) -> Participant | None:
        for p in (self.client, *self.all_workers):
            if p.key is not None and p.key.cert_der == key.cert_der:
                return p
        return None

    def require_keys(self) -> None:
        """Every participant must be named by its key for the tls backend."""
        for p in (self.client, *self.all_workers):
            if p.key is None:
                raise TopologyError(
                    f'{self.path}: {p.label} has no key: add key = "fc1...." (`fusion keys new FILE` prints one), '
                    "or run with --insecure"
                )

    @staticmethod
    def load(path: str | Path) -> Topology:
        import tomllib

        p = Path(path)
        raw, _ = read_small_file(p, MAX_TOPOLOGY_FILE, "topology file", TopologyError)  # regular, bounded
        try:
            data = tomllib.loads(raw.decode())
        except UnicodeDecodeError as e:
            raise TopologyError(f"{p}: cannot read ({e})") from None
        except tomllib.TOMLDecodeError as e:
            raise TopologyError(f"{p}: not valid TOML ({e})") from None
        return Topology.from_dict(data, p)

    @staticmethod
    def from_dict(data: dict[str, Any], path: Path = Path("<topology>")) -> Topology:
        def fail(msg: str) -> TopologyError:
            return TopologyError(f"{path}: {msg}")

        _unknown(data, _TOP_KEYS, "top level", fail)
        model = data.get("model")
        if model is not None and not isinstance(model, str):
            raise fail("model must be a string path")
        client = data.get("client")
        if not isinstance(client, dict):
            raise fail('missing [client] table with address = "HOST:PORT"')
        _unknown(client, _CLIENT_KEYS, "[client]", fail)
        host, port = _host_port(client.get("address"), fail)
        workers_raw = data.get("worker")
        if not isinstance(workers_raw, list) or not workers_raw:
            raise fail('no workers: add one [[worker]] table per worker, each with address = "HOST"')
        keys: dict[bytes, str] = {}
        client_key = _key(client, "[client]", fail, keys)
        entries = []
        names: set[str] = set()
        for i, w in enumerate(workers_raw, start=1):
            where = f"[[worker]] #{i}"
            if not isinstance(w, dict):
                raise fail(f"{where} must be a table")
            _unknown(w, _WORKER_KEYS, where, fail)
            addr = w.get("address")
            if not isinstance(addr, str) or not addr.strip():
                raise fail(f'{where}: address = "HOST" is required')
            addr = addr.strip()
            if ":" in addr and not _is_ipv6(addr):
                raise fail(f"{where}: address is a host only (workers pick their own ports), got {addr!r}")
            cap = w.get("capacity", 1.0)
            if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap > 0) or cap == float("inf"):
                raise fail(f"{where}: capacity must be a positive number, got {cap!r}")
            name = w.get("name")
            if name is not None:
                if not isinstance(name, str) or not name:
                    raise fail(f"{where}: name must be a non-empty string")
                if name in names:
                    raise fail(f"{where}: duplicate name {name!r}")
                names.add(name)
            wmodel = w.get("model")
            if wmodel is not None and not isinstance(wmodel, str):
                raise fail(f"{where}: model must be a string path")
            group = w.get("group")
            if group is not None and (not isinstance(group, str) or not GROUP_NAME.match(group)):
                raise fail(f'{where}: group must be "A", "B" or "B1".."Bk" (masked mode), got {group!r}')
            key = _key(w, where, fail, keys)
            role = w.get("role", "worker")
            if role not in ROLES:
                raise fail(f'{where}: role must be "worker" or "standby", got {role!r}')
            device = w.get("device")
            if device is not None:
                if not isinstance(device, str):
                    raise fail(f'{where}: device must be "cpu", "cuda" or "cuda:K"')
                try:
                    parse_device(device)
                except UsageError as e:
                    raise fail(f"{where}: {str(e).replace('--device', 'device')}") from None
            entries.append((addr, key, float(cap), name, wmodel, group, role == "standby", device))
        grouped = [e[5] is not None for e in entries]
        if any(grouped):
            if not all(grouped):
                raise fail("either every worker has a group (masked mode) or none does")
            names = {e[5] for e in entries if e[5] is not None}  # all of them: checked just above
            masks = sorted(names - {"A"}, key=lambda g: int(g[1:] or 0))
            k = len(masks)
            want = ["B"] if k == 1 else [f"B{i}" for i in range(1, k + 1)]
            if "A" not in names or not masks or masks != want:
                raise fail(
                    f"a masked topology needs group A and one mask group B, or mask groups B1..Bk (got {sorted(names)})"
                )
            active = {e[5] for e in entries if not e[6]}
            if active != names:
                raise fail(f"group {sorted(names - active)[0]} has only standbys: every group needs a worker")
            if any(e[2] != 1.0 for e in entries):
                raise fail("capacity is not supported in masked mode (each group splits its rows evenly)")
            entries = [e for g in ("A", *masks) for e in entries if e[5] == g]
        entries = [e for e in entries if not e[6]] + [e for e in entries if e[6]]  # standbys rank last
        if all(e[6] for e in entries):
            raise fail('every worker is a standby: at least one needs role = "worker"')
        everyone = tuple(Participant(r, *e) for r, e in enumerate(entries, start=1))
        cname = client.get("name")
        cmodel = client.get("model")
        if cmodel is not None and not isinstance(cmodel, str):
            raise fail("[client]: model must be a string path")
        return Topology(
            path=path,
            client=Participant(0, host, client_key, 1.0, cname if isinstance(cname, str) else None, cmodel),
            port=port,
            workers=tuple(p for p in everyone if not p.standby),
            model=model,
            standbys=tuple(p for p in everyone if p.standby),
        )


def _key(table: dict, where: str, fail, seen: dict[bytes, str]) -> PublicId | None:
    text = table.get("key")
    if text is None:
        return None
    try:
        key = PublicId.parse(text, f"{where} key")
    except IdentityError as e:
        raise fail(str(e)) from None
    if key.cert_der in seen:
        raise fail(f"{where}: duplicate key (also the key of {seen[key.cert_der]}): every participant needs its own")
    seen[key.cert_der] = where
    return key


def _unknown(table: dict, allowed: set[str], where: str, fail) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise fail(f"{where}: unknown key {extra[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def _host_port(text: Any, fail) -> tuple[str, int]:
    if not isinstance(text, str):
        raise fail('[client] address = "HOST:PORT" is required')
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise fail(f"[client] address must be HOST:PORT, got {text!r}")
    return host, int(port)


# ---- this machine ----


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    # An IPv4/IPv6 sockaddr starts with the address text; the stubs also allow other families' tuples.
    return list(dict.fromkeys(a for i in infos if isinstance(a := i[4][0], str)))


def is_local_address(host: str) -> bool:
    """True when this machine holds `host` (binding a socket to it succeeds)."""
    for ip in _resolve(host):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))
                return True
            except OSError:
                continue
    return False


def sharing_this_host(topo: Topology) -> int:
    """How many of the topology's participants (the client, workers and standbys) are declared at an
    address of this machine: the processes that will share its cores (at least 1, the caller)."""
    local: dict[str, bool] = {}
    n = 0
    for p in (topo.client, *topo.all_workers):
        if p.host not in local:
            local[p.host] = is_local_address(p.host)
        n += local[p.host]
    return max(1, n)


def check_here(participant: Participant) -> None:
    """Refuse to run `participant` on a machine that does not hold its declared address."""
    if not is_local_address(participant.host):
        raise TopologyError(
            f"{participant.label} is declared at {participant.host}, which is not an address of this machine "
            f"(run it on that host, or fix the topology file)"
        )
