"""Admission and wiring: who may join, and the links between everyone who did.

The user's roster (from the topology, or made up by the client for local workers it spawns) lists
every worker by rank, public key, host and group. Nobody else gets a byte of state:

  1. The client listens on its address. A worker connects; TLS 1.3 mutual authentication admits
     only certificates of the roster (an unlisted key fails the handshake: "unknown ca").
  2. The worker sends JOIN {rank?, group?, port}. The client looks its certificate up in the
     roster; a claim that does not match the roster (another rank or group), a second connection
     with an already admitted key, or a malformed JOIN is refused with REFUSED {reason} and a log
     line naming the key. The slot stays open for the real worker until the join deadline.
  3. When every rank is admitted, the client sends each worker WELCOME {rank, peers, ...}: every
     worker's host, listening port and key (plus what the caller adds: plan parameters).
  4. Workers link up pairwise, the higher rank connecting to the lower one's listener; each side
     pins the other's certificate and the connector sends LINK {rank}. Then READY to the client.

Only then does anything else travel (the plan handshake, then state). On the insecure engine the
same messages go over plain TCP and claims are believed: anyone who reaches the port can join,
which is why it must be asked for by name.

Messages of this phase are small JSON objects over the same framed links as everything else.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CommError
from .identity import Identity, PublicId
from .links import Link, handshake, peer_certificate, tls_context

VERSION = 1
CONTROL_LIMIT = 1 << 20  # bytes of one rendezvous message
PER_CONNECTION_S = 10.0  # a connection must finish its handshake and JOIN in this time
RETRY_S = 0.2


@dataclass(frozen=True)
class Member:
    """One expected worker."""

    rank: int
    host: str  # where it listens for its peers (its topology address; 127.0.0.1 locally)
    key: PublicId | None  # None on the insecure engine
    group: str | None = None  # "A" / "B" in masked mode
    name: str | None = None

    def label(self, address: str | None = None) -> str:
        role = f"worker {self.rank}" + (f" ({self.name})" if self.name else "")
        bits = [address or self.host] + ([f"key {self.key.fingerprint}"] if self.key else [])
        return f"{role} [{', '.join(bits)}]"


def _send_json(link: Link, obj: dict) -> None:
    link.send(memoryview(json.dumps(obj).encode()))


def _recv_json(link: Link, deadline: float) -> dict:
    raw = link.recv_bytes(deadline, CONTROL_LIMIT)
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CommError(f"{link.label} sent a malformed rendezvous message") from None
    if not isinstance(obj, dict):
        raise CommError(f"{link.label} sent a malformed rendezvous message")
    return obj


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise CommError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    s.listen(64)
    return s


def _fmt_addr(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


# ---- client side ----


class Admission:
    """The client's listener and roster. Create it first (its port is known at once, so local
    workers can be told where to join), then `admit()`."""

    def __init__(
        self,
        me: Identity | None,
        roster: list[Member],
        host: str,
        port: int = 0,
        log: Callable[[str], None] = lambda line: None,
    ):
        self.me = me
        self.roster = {m.rank: m for m in roster}
        self.by_cert = {m.key.cert_der: m for m in roster if m.key is not None}
        if me is not None and len(self.by_cert) != len(roster):
            raise CommError("the secure engine needs every worker's public key")
        self.log = log
        self.sock = _listen(host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.ctx = tls_context(me, [m.key for m in roster], server=True) if me is not None else None
        self.refused: list[str] = []  # log lines of refused connections (tests read them)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _refuse(self, line: str) -> None:
        self.refused.append(line)
        self.log(f"refused: {line}")

    def _greet(self, conn: socket.socket, addr: Any, out: queue.Queue) -> None:
        """Handshake + JOIN of one connection, in its own thread; the verdict goes to `out`."""
        where = _fmt_addr(addr)
        deadline = time.monotonic() + PER_CONNECTION_S
        try:
            tls = handshake(conn, self.ctx, server=True, deadline=deadline)
        except Exception as e:  # ssl.SSLError, OSError, TimeoutError
            reason = getattr(e, "reason", None) or str(e) or type(e).__name__
            conn.close()
            out.put(("refused", f"connection from {where}: TLS handshake failed ({reason}): key not in the roster?"))
            return
        member = None
        if tls is not None:
            member = self.by_cert.get(peer_certificate(tls))
            if member is None:  # chained to a listed certificate but not itself listed
                conn.close()
                out.put(("refused", f"connection from {where}: its certificate is not one of the roster's"))
                return
        link = Link(conn, tls, -1, f"connection from {where}")
        try:
            join = _recv_json(link, deadline)
        except CommError as e:
            link.close()
            out.put(("refused", f"{where}: no valid JOIN ({e})"))
            return
        out.put(("join", (link, member, join, where)))

    def _check(self, member: Member | None, join: dict, where: str, admitted: dict) -> tuple[Member | None, str]:
        claim_rank, claim_group = join.get("rank"), join.get("group")
        if join.get("v") != VERSION or not isinstance(join.get("port"), int):
            return None, f"{where}: malformed JOIN {json.dumps(join)[:200]}"
        if member is None:  # insecure: the claim is all there is
            if not isinstance(claim_rank, int) or claim_rank not in self.roster:
                return None, f"{where}: JOIN without a valid rank (insecure engine: workers must give --rank)"
            member = self.roster[claim_rank]
        who = member.label(where)
        if claim_rank is not None and claim_rank != member.rank:
            return None, f"{who} presented itself as rank {claim_rank}, but the roster lists its key as rank {member.rank}"
        if claim_group is not None and claim_group != member.group:
            return None, f"{who} presented itself for group {claim_group}, but the roster lists it in group {member.group}"
        if member.rank in admitted:
            return None, f"{who}: rank {member.rank} has already joined (a second connection with the same key)"
        return member, ""

    def admit(
        self, deadline: float, welcome: Callable[[Member], dict], abort: Callable[[], str | None] = lambda: None
    ) -> dict[int, Link]:
        """Accept until every rank of the roster has joined, then wire them up. Returns the links to
        every worker, by rank. Raises CommError naming the missing workers when the deadline passes,
        or at once when `abort()` returns a reason (a spawned worker died)."""
        verdicts: queue.Queue = queue.Queue()
        stop = threading.Event()

        self.sock.settimeout(0.25)  # the accept loop checks `stop` this often

        def accept_loop() -> None:
            while not stop.is_set():
                try:
                    conn, addr = self.sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                if stop.is_set():
                    conn.close()
                    return
                threading.Thread(target=self._greet, args=(conn, addr, verdicts), daemon=True).start()

        acceptor = threading.Thread(target=accept_loop, name="fusion-admission", daemon=True)
        acceptor.start()
        admitted: dict[int, tuple[Link, dict, str]] = {}
        try:
            while len(admitted) < len(self.roster):
                reason = abort()
                if reason:
                    raise CommError(reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [self.roster[r].label() for r in sorted(self.roster) if r not in admitted]
                    raise CommError(
                        f"rendezvous at {self.address}: {len(missing)} of {len(self.roster)} workers did not join in "
                        f"time: {'; '.join(missing)}" + (f" (refused: {len(self.refused)})" if self.refused else "")
                    )
                try:
                    kind, value = verdicts.get(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                if kind == "refused":
                    self._refuse(value)
                    continue
                link, member, join, where = value
                member, why = self._check(member, join, where, admitted)
                if member is None:
                    self._refuse(why)
                    try:
                        _send_json(link, {"refused": why})
                        link.flush(time.monotonic() + 1)
                    except CommError:
                        pass
                    link.close()
                    continue
                link.rank, link.label = member.rank, member.label(where)
                admitted[member.rank] = (link, join, where)
        except BaseException:
            for link, _, _ in admitted.values():
                link.close()
            raise
        finally:
            stop.set()
            self.close()
        links = {r: admitted[r][0] for r in sorted(admitted)}
        # Where each worker listens: the roster's host, else (insecure, no topology) what it announced.
        peers = {
            str(r): {"host": self.roster[r].host or str(admitted[r][1].get("host") or admitted[r][2].rsplit(":", 1)[0]),
                     "port": admitted[r][1]["port"], "key": self.roster[r].key.line() if self.roster[r].key else None}
            for r in links
        }  # fmt: skip
        try:
            for r, link in links.items():
                _send_json(link, {"rank": r, "group": self.roster[r].group, "peers": peers, **welcome(self.roster[r])})
            for link in links.values():
                ready = _recv_json(link, deadline)
                if ready.get("ready") is not True:
                    raise CommError(f"{link.label} could not link up with its peers: {ready.get('error', ready)}")
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ---- worker side ----


def _connect(host: str, port: int, deadline: float, what: str) -> socket.socket:
    """Connect, retrying refused or unreachable attempts until the deadline."""
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            detail = f" ({getattr(last, 'strerror', None) or last})" if last else ""
            raise CommError(f"could not reach {what} at {host}:{port} in time{detail}")
        try:
            return socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:
            last = e
            time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))


def _tls_refusal(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or str(e)
    return str(reason)


@dataclass
class Joined:
    rank: int
    group: str | None
    welcome: dict
    links: dict[int, Link]


def join(
    me: Identity | None,
    client_key: PublicId | None,
    master: tuple[str, int],
    *,
    listen_host: str | None,
    claim_rank: int | None,
    claim_group: str | None,
    deadline: float,
    log: Callable[[str], None] = lambda line: None,
) -> Joined:
    """A worker's side of the rendezvous. Returns its rank, the client's WELCOME and its links."""
    if (me is None) != (client_key is None):
        raise CommError("a worker needs both its own key and the client's public key (or --insecure)")
    host, port = master
    sock = _connect(host, port, deadline, "the client")
    # Listen for peers on the declared host, else on the address this machine reaches the client from.
    try:
        listener = _listen(listen_host or sock.getsockname()[0], 0)
    except CommError:
        sock.close()
        raise
    try:
        try:
            ctx = tls_context(me, [client_key], server=False) if me is not None else None
            tls = handshake(sock, ctx, server=False, deadline=deadline)
        except Exception as e:
            sock.close()
            raise CommError(f"TLS handshake with the client at {host}:{port} failed ({_tls_refusal(e)}): "
                            "is this the client's public key?") from None  # fmt: skip
        if tls is not None and peer_certificate(tls) != client_key.cert_der:
            sock.close()
            raise CommError(f"the client at {host}:{port} presented another key than the one pinned")
        client = Link(sock, tls, 0, f"the client [{host}:{port}]")
        lhost, lport = listener.getsockname()[:2]
        _send_json(client, {"v": VERSION, "rank": claim_rank, "group": claim_group, "host": lhost, "port": lport})
        try:
            welcome = _recv_json(client, deadline)
        except CommError as e:
            client.close()
            raise CommError(f"the client at {host}:{port} did not admit this worker ({e}): is its key listed?") from None
        if "refused" in welcome:
            client.close()
            raise CommError(f"the client refused this worker: {welcome['refused']}")
        rank = welcome.get("rank")
        peers = welcome.get("peers")
        if not isinstance(rank, int) or not isinstance(peers, dict) or str(rank) not in peers:
            client.close()
            raise CommError("the client sent a malformed WELCOME")
        try:
            links = _link_peers(me, rank, peers, listener, deadline, log)
        except CommError as e:
            _send_json(client, {"ready": False, "error": str(e)})
            client.flush(time.monotonic() + 1)
            client.close()
            raise
        _send_json(client, {"ready": True})
        links[0] = client
        return Joined(rank, welcome.get("group"), welcome, links)
    finally:
        listener.close()


def _link_peers(
    me: Identity | None, rank: int, peers: dict, listener: socket.socket, deadline: float, log: Callable[[str], None]
) -> dict[int, Link]:
    """Connect to every lower-ranked worker, accept every higher-ranked one. Both ends pin keys."""
    table = {}
    for r, p in peers.items():
        key = PublicId.parse(p["key"], f"worker {r}'s key") if p.get("key") else None
        table[int(r)] = (p["host"], int(p["port"]), key)
    links: dict[int, Link] = {}
    try:
        for q in sorted(r for r in table if r < rank):
            host, port, key = table[q]
            sock = _connect(host, port, deadline, f"worker {q}")
            label = f"worker {q} [{host}:{port}" + (f", key {key.fingerprint}]" if key else "]")
            try:
                ctx = tls_context(me, [key], server=False) if me is not None else None
                tls = handshake(sock, ctx, server=False, deadline=deadline)
            except Exception as e:
                sock.close()
                raise CommError(f"TLS handshake with {label} failed ({_tls_refusal(e)})") from None
            if tls is not None and peer_certificate(tls) != key.cert_der:
                sock.close()
                raise CommError(f"{label} presented another key than the one pinned")
            link = Link(sock, tls, q, label)
            _send_json(link, {"link": rank})
            links[q] = link
        higher = {r: table[r] for r in table if r > rank}
        ctx = tls_context(me, [t[2] for t in higher.values()], server=True) if me is not None and higher else None
        by_cert = {t[2].cert_der: r for r, t in higher.items() if t[2] is not None}
        listener.settimeout(1.0)
        while len(links) < len(table) - 1:
            if time.monotonic() >= deadline:
                missing = sorted(set(higher) - set(links))
                raise CommError(f"workers {missing} did not link up with worker {rank} in time")
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            where = _fmt_addr(addr)
            try:
                tls = handshake(conn, ctx, server=True, deadline=min(deadline, time.monotonic() + PER_CONNECTION_S))
                link = Link(conn, tls, -1, f"connection from {where}")
                hello = _recv_json(link, min(deadline, time.monotonic() + PER_CONNECTION_S))
            except Exception as e:
                conn.close()
                log(f"refused: connection from {where} to worker {rank}: {_tls_refusal(e)}")
                continue
            q = hello.get("link")
            expected = by_cert.get(peer_certificate(tls)) if tls is not None else q
            if not isinstance(q, int) or q not in higher or q != expected or q in links:
                link.close()
                log(f"refused: connection from {where} to worker {rank}: presented as worker {q}, key is worker {expected}")
                continue
            host, port, key = higher[q]
            link.rank, link.label = q, f"worker {q} [{where}" + (f", key {key.fingerprint}]" if key else "]")
            links[q] = link
    except BaseException:
        for link in links.values():
            link.close()
        raise
    return links
