"""A topology file (TOML): who takes part in a multi-host run, where, and with what capacity.

    model = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"   # optional: default model path for everyone

    [client]                      # the user side (rank 0): tokenizer, embedding, LM head, sampling
    address = "10.0.0.1:29500"    # HOST:PORT it listens on for the rendezvous

    [[worker]]                    # rank 1 (workers are ranked in file order)
    address = "10.0.0.2"          # the host this worker runs on
    capacity = 2                  # relative share (default 1)

    [[worker]]                    # rank 2
    name = "gpu-box"              # optional label for logs
    address = "10.0.0.3"
    model = "/data/smollm2.gguf"  # optional: this participant's own path to the same model

The user decides who takes part: the client rendezvouses for exactly these N workers and their
capacities fix the plan (client and workers check the plan fingerprint at start-up). A participant
refuses to start on a machine that does not have its declared address, and binds gloo to the
interface holding that address (GLOO_SOCKET_IFNAME), so traffic goes where the file says.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TOP_KEYS = {"model", "client", "worker"}
_CLIENT_KEYS = {"address", "model", "name"}
_WORKER_KEYS = {"address", "capacity", "model", "name"}


class TopologyError(ValueError):
    """The topology file is missing, malformed, or does not fit this machine."""


@dataclass(frozen=True)
class Participant:
    rank: int  # 0 = client, 1..N = workers
    host: str
    capacity: float = 1.0
    name: str | None = None
    model: str | None = None

    @property
    def label(self) -> str:
        role = "client" if self.rank == 0 else f"worker {self.rank}"
        return f"{role} ({self.name})" if self.name else role


@dataclass(frozen=True)
class Topology:
    path: Path
    client: Participant
    port: int
    workers: tuple[Participant, ...]
    model: str | None = None

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

    def participant(self, rank: int) -> Participant:
        if rank == 0:
            return self.client
        if not 1 <= rank <= self.n_workers:
            raise TopologyError(f"{self.path}: rank {rank} is not in the file (workers are ranks 1..{self.n_workers})")
        return self.workers[rank - 1]

    def model_for(self, rank: int) -> str | None:
        """The model path participant `rank` should open: its own `model`, else the file's."""
        return self.participant(rank).model or self.model

    def local_worker_ranks(self) -> list[int]:
        return [w.rank for w in self.workers if is_local_address(w.host)]

    @staticmethod
    def load(path: str | Path) -> Topology:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise TopologyError("topology files need Python 3.11+ (tomllib) or the tomli package") from None
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise TopologyError(f"topology file not found: {p}") from None
        except (OSError, UnicodeDecodeError) as e:
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
        workers = []
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
            workers.append(Participant(i, addr, float(cap), name, wmodel))
        cname = client.get("name")
        cmodel = client.get("model")
        if cmodel is not None and not isinstance(cmodel, str):
            raise fail("[client]: model must be a string path")
        return Topology(
            path=path,
            client=Participant(0, host, 1.0, cname if isinstance(cname, str) else None, cmodel),
            port=port,
            workers=tuple(workers),
            model=model,
        )


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


def _resolve_ipv4(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(i[4][0] for i in infos))


def is_local_address(host: str) -> bool:
    """True when this machine holds `host` (binding a socket to it succeeds)."""
    for ip in _resolve_ipv4(host):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))
                return True
            except OSError:
                continue
    return False


def interface_for(host: str) -> str | None:
    """The name of the network interface holding `host`'s IPv4 address (Linux), or None."""
    if sys.platform != "linux":
        return None
    import fcntl
    import struct

    wanted = set(_resolve_ipv4(host))
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) in wanted:
                return name
    return None


def bind_here(participant: Participant, env: dict[str, str] | None = None) -> str | None:
    """Check that this machine is `participant`'s declared host, and bind gloo to its interface.

    Returns the interface name (or None when it could not be determined: gloo then picks its own).
    An explicit GLOO_SOCKET_IFNAME in the environment wins."""
    env = os.environ if env is None else env
    if not is_local_address(participant.host):
        raise TopologyError(
            f"{participant.label} is declared at {participant.host}, which is not an address of this machine "
            f"(run it on that host, or fix the topology file)"
        )
    iface = interface_for(participant.host)
    if iface and not env.get("GLOO_SOCKET_IFNAME"):
        env["GLOO_SOCKET_IFNAME"] = iface
    return env.get("GLOO_SOCKET_IFNAME") or iface
