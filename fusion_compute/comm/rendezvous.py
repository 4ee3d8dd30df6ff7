"""Admission and wiring: who may join, in which epoch, and the links between everyone who did.

The user's roster (from the topology, or made up by the client for the local workers it spawns)
lists every participant by id, public key, host, group, and whether it is a standby. Nobody else
gets a byte of state:

  1. The client listens on its address for the whole job. A participant connects; TLS 1.3 mutual
     authentication admits only certificates of the roster (an unlisted key fails the handshake:
     "unknown ca").
  2. It sends JOIN {kind, rank?, group?, epoch?, host, port}. The client looks its certificate up in
     the roster: a claim that does not match the roster (another participant or group), a second
     connection with an admitted key, a participant the current epoch does not expect, or a
     malformed JOIN is refused with REFUSED {reason} and a log line naming the key.
  3. kind "pulse": the participant's liveness connection (liveness.py), handed to the watch.
     kind "data" from a standby (not in the epoch): WELCOME {standby}; it then beats and waits for
     the client's word to join a later epoch.
  4. When every participant the epoch expects has joined, the client sends each WELCOME {epoch,
     rank, peers, ...}: every active worker's host, listening port and key (plus what the caller
     adds: plan parameters). Workers link up pairwise (the higher rank connects to the lower one's
     listener; each side pins the other's key), then say READY.

A new epoch (a worker lost, revoked or added: docs/resilience.md) repeats 4 with fresh data links;
ranks are positions in the epoch, participant ids are for life. On the `tcp` backend (insecure) the same
messages go over plain TCP and claims are believed: anyone who reaches the port can join, which is
why it must be asked for by name. Messages of this phase are small JSON objects on the links.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import CommError
from .identity import Identity, PublicId
from .links import Link, handshake, peer_certificate, tls_context
from .peer_text import printable

VERSION = 2
CONTROL_LIMIT = 1 << 20  # bytes of one rendezvous message
# Before authentication a connection costs a thread, a socket and a slot; these bound what a
# stranger (who needs no key to connect) can make a listener spend or wait.
# HANDSHAKE_S: a connection must finish its TLS handshake and first message (JOIN, or a peer's
# hello) in this time, or it is closed. The TLS 1.3 handshake (Ed25519) took 2.6 ms median, 26 ms
# at worst of 50, on this project's 2-core machine while other tests ran; but at 3 s a listed worker
# was refused once (its JOIN late, the 2 cores at a load of ~8: a full suite beside benchmarks), so
# 10 s: room for a starved host and a slow WAN round trip, and how long an idle stranger can hold a
# slot (MAX_PENDING of them cannot delay a listed one: tests/test_preauth.py).
HANDSHAKE_S = 10.0
# MAX_PENDING: connections handshaking at once, per listener; one more is closed at once (the
# honest side retries until its own deadline: `_open_tls`). A roster has a few dozen members at
# most, and all of them together connect to one listener only at the client's.
MAX_PENDING = 64
# BACKLOG: connections the kernel queues before we accept them. When that queue is full a new
# connection's SYN is dropped and retried by the kernel after 1 s, then 3 s: a burst of strangers
# connecting and closing (measured: 1 connect in 80 waited 1 s at 64) must not do that to a peer.
BACKLOG = 1024
LOG_FIRST = 10  # refusals logged one line each per reason; after that, a line at each power of ten
RETRY_S = 0.2
ACCEPT_TICK_S = 0.25  # how often an accept loop looks whether it should stop (its closer also wakes it)


@dataclass(frozen=True)
class Member:
    """One participant of the roster. `pid` is its id for life (rank in the first epoch, for
    active workers; standbys come after them)."""

    pid: int
    host: str  # where it listens for its peers (its topology address; 127.0.0.1 locally)
    key: PublicId | None  # None on the `tcp` backend (insecure)
    group: str | None = None  # "A" / "B" in masked mode
    name: str | None = None
    standby: bool = False

    def label(self, address: str | None = None) -> str:
        role = ("standby " if self.standby else "worker ") + str(self.pid) + (f" ({self.name})" if self.name else "")
        bits = [address or self.host] + ([f"key {self.key.fingerprint}"] if self.key else [])
        return f"{role} [{', '.join(bits)}]"


def send_json(link: Link, obj: dict) -> None:
    link.send(memoryview(json.dumps(obj).encode()))


def recv_json(link: Link, deadline: float) -> dict:
    raw = link.recv_bytes(deadline, CONTROL_LIMIT)
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, an integer past 4,300 digits, nesting too deep
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
    s.listen(BACKLOG)
    return s


def _fmt_addr(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


class Refusals:
    """Refused connections, counted by reason (a short fixed phrase, never an address), so memory
    stays bounded however many strangers come: the first LOG_FIRST of each reason are logged one line
    each, later ones at each power of ten with the count so far."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, reason: str, line: str) -> None:
        with self._lock:
            self.counts[reason] += 1
            n = self.counts[reason]
        if n <= LOG_FIRST:
            self.log(f"refused: {line}")
        elif str(n).rstrip("0") == "1":  # 100, 1000, ...
            self.log(f"refused: {line} ({n} refused so far: {reason})")

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


class Greeters:
    """At most MAX_PENDING connections greeted (handshake and first message) at once, each in its
    own thread, so that no unauthenticated connection waits behind another; one over the cap is
    closed at once and counted. `close()` cuts those still in progress."""

    def __init__(self, name: str, refusals: Refusals, cap: int = MAX_PENDING):
        self.name = name
        self.refusals = refusals
        self._slots = threading.BoundedSemaphore(cap)
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False

    def start(self, conn: socket.socket, addr: Any, greet: Callable[[socket.socket, Any], None]) -> None:
        if not self._slots.acquire(blocking=False):
            conn.close()
            self.refusals.add(
                "too many unauthenticated connections",
                f"connection from {_fmt_addr(addr)} to {self.name}: {MAX_PENDING} connections are already handshaking",
            )
            return
        with self._lock:
            if self._closed:
                self._slots.release()
                conn.close()
                return
            self._socks.add(conn)

        def run() -> None:
            try:
                greet(conn, addr)
            finally:
                with self._lock:
                    self._socks.discard(conn)
                self._slots.release()

        threading.Thread(target=run, name=f"fusion-greet-{self.name}", daemon=True).start()

    def authenticated(self, conn: socket.socket) -> None:
        """`conn` proved its key and is being handed over: no longer ours to cut in `close()`."""
        with self._lock:
            self._socks.discard(conn)

    def close(self) -> None:
        """Cut every connection still being greeted (their threads end at their next read)."""
        with self._lock:
            self._closed = True
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class NotJoined(CommError):
    """Workers did not join an epoch in time; `missing`: their participant ids (whom the engine's next
    epoch leaves out)."""

    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


@dataclass
class Joined:
    """One data connection admitted for an epoch: the link, the member and what it announced."""

    link: Link
    member: Member
    host: str  # where it listens for peers
    port: int
    epoch: int  # the epoch it was admitted for
    launched: tuple[int, int] | None = None  # (rank, size) mpiexec gave it, as it says (`launched_rank`)


# ---- client side ----


def accept_until(
    sock: socket.socket, stop: threading.Event, greeters: Greeters, greet: Callable[[socket.socket, Any], None]
) -> None:
    """Hand each connection `sock` accepts to `greeters` (`greet(conn, addr)` in its own thread) until
    `stop` is set (looked at every ACCEPT_TICK_S, the socket's timeout) or the socket is shut down or
    closed (`stop_accepting`)."""
    while not stop.is_set():
        try:
            conn, addr = sock.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        greeters.start(conn, addr, greet)


def stop_accepting(sock: socket.socket) -> None:
    """Shut a listening socket down: a thread blocked in its `accept` returns at once (Linux: EINVAL),
    where closing it alone leaves that thread blocked until its tick, which whoever joins it waits for."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Admission:
    """The client's listener and roster, for the whole job. Its own thread greets every connection,
    refuses strangers, routes pulse links to `on_pulse` and answers standbys; the engine collects
    the data links an epoch expects with `collect()` and wires them with `welcome()`."""

    def __init__(
        self,
        me: Identity | None,
        roster: list[Member],
        host: str,
        port: int = 0,
        log: Callable[[str], None] = lambda line: None,
        on_pulse: Callable[[Member, Link], None] | None = None,
        first_epoch: list[int] | None = None,
    ):
        """`first_epoch`: the pids epoch 0 expects (default: every non-standby member)."""
        self.me = me
        self.roster = {m.pid: m for m in roster}
        self.by_cert = {m.key.cert_der: m for m in roster if m.key is not None}
        if me is not None and len(self.by_cert) != len(roster):
            raise CommError("the tls backend needs every worker's public key")
        self.log = log
        self.on_pulse = on_pulse
        self.sock = _listen(host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.ctx = (
            tls_context(me, [m.key for m in roster if m.key is not None], server=True) if me is not None else None
        )
        self.refusals = Refusals(log)  # refused connections, counted by reason (tests read them)
        self.greeters = Greeters("the client", self.refusals)
        self._lock = threading.Lock()
        first = first_epoch if first_epoch is not None else [m.pid for m in roster if not m.standby]
        self._expect: tuple[int, set[int]] = (0, set(first))  # (epoch, pids) whose data JOIN is wanted now
        self._gone: set[int] = set()  # revoked or failed for good: refused from now on
        self._arrived: queue.Queue[Joined] = queue.Queue()
        self._stop = threading.Event()
        self.sock.settimeout(ACCEPT_TICK_S)  # the accept loop checks `_stop` this often
        self._thread = threading.Thread(
            target=accept_until,
            args=(self.sock, self._stop, self.greeters, self._greet),
            name="fusion-admission",
            daemon=True,
        )
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def refuse(self, joined: dict[int, Joined], line: str) -> None:
        """Send every one of an epoch's admitted workers `line` as its refusal and close its link: the
        epoch cannot start (the worker leaves with the line as its error, not a lost connection)."""
        for j in joined.values():
            _tell_refused(j.link, line)

    def _refuse(self, reason: str, line: str, link: Link | None = None) -> None:
        self.refusals.add(reason, line)
        if link is not None:
            _tell_refused(link, line)

    # ---- the admission thread ----

    def _greet(self, conn: socket.socket, addr: Any) -> None:
        """Handshake, JOIN and verdict of one connection, in its own thread (Greeters)."""
        where = _fmt_addr(addr)
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            tls = handshake(conn, self.ctx, server=True, deadline=deadline)
        except Exception as e:  # ssl.SSLError, OSError, TimeoutError
            reason = getattr(e, "reason", None) or str(e) or type(e).__name__
            conn.close()
            self._refuse(
                "TLS handshake failed",
                f"connection from {where}: TLS handshake failed ({reason}): key not in the roster?",
            )
            return
        member = None
        if tls is not None:
            member = self.by_cert.get(peer_certificate(tls) or b"")
            if member is None:  # chained to a listed certificate but not itself listed
                conn.close()
                self._refuse(
                    "certificate not in the roster",
                    f"connection from {where}: its certificate is not one of the roster's",
                )
                return
        link = Link(conn, tls, -1, f"connection from {where}")
        try:
            join = recv_json(link, deadline)
        except CommError as e:
            self._refuse("no valid JOIN", f"{where}: no valid JOIN ({e})", link)
            return
        member, reason, why = self._check(member, join, where)
        if member is None:
            self._refuse(reason, why, link)
            return
        link.label = member.label(where)
        self.greeters.authenticated(conn)
        if join.get("kind") == "pulse":
            link.rank = member.pid
            if self.on_pulse is not None:
                self.on_pulse(member, link)
            else:
                link.close()
            return
        host = member.host or printable(str(join.get("host") or where.rsplit(":", 1)[0])[:255])  # its claim: data
        with self._lock:  # queued under the lock: `expect()` sorts the queue against one expectation
            epoch, wanted = self._expect
            if member.pid in wanted and join.get("epoch") in (None, epoch):
                self._arrived.put(Joined(link, member, host, int(join["port"]), epoch, _launched(join.get("launched"))))
                return
        if member.standby or join.get("epoch") is None:  # a standby, or an early or spare worker
            try:
                send_json(link, {"standby": True, "pid": member.pid, "group": member.group})
                link.flush(time.monotonic() + 2)
            except CommError:
                pass
            link.close()
        else:
            self._refuse(
                "unexpected epoch",
                f"{member.label(where)} asked to join epoch {join.get('epoch')}, which does not expect it",
                link,
            )

    def _check(self, member: Member | None, join: dict, where: str) -> tuple[Member | None, str, str]:
        """(member, "", "") when the JOIN is admissible, else (None, reason, log line)."""
        claim_pid, claim_group = join.get("rank"), join.get("group")
        if (
            join.get("v") != VERSION
            or join.get("kind") not in ("data", "pulse")
            or not isinstance(join.get("port"), int)
        ):
            return None, "malformed JOIN", f"{where}: malformed JOIN {json.dumps(join)[:200]}"
        if member is None:  # insecure: the claim is all there is
            if not isinstance(claim_pid, int) or claim_pid not in self.roster:
                return (
                    None,
                    "no valid rank",
                    f"{where}: JOIN without a valid rank (insecure links: workers must give --rank)",
                )
            member = self.roster[claim_pid]
        who = member.label(where)
        if claim_pid is not None and claim_pid != member.pid:
            return (
                None,
                "claimed another rank",
                (f"{who} presented itself as rank {claim_pid}, but the roster lists its key as rank {member.pid}"),
            )
        if claim_group is not None and claim_group != member.group:
            return (
                None,
                "claimed another group",
                (f"{who} presented itself for group {claim_group}, but the roster lists it in group {member.group}"),
            )
        if member.pid in self._gone:
            return None, "removed from the job", f"{who} was removed from this job (revoked, or failed and replaced)"
        return member, "", ""

    def enroll(self, member: Member) -> None:
        """Add a participant to the roster while the job runs (the user adding a worker); it is
        trusted from now on and joins as a standby."""
        with self._lock:
            if member.pid in self.roster or (member.key is not None and member.key.cert_der in self.by_cert):
                raise CommError(f"{member.label()} is already in the roster")
            self.roster[member.pid] = member
            if member.key is not None:
                self.by_cert[member.key.cert_der] = member
                if self.ctx is not None:  # a secure job (an insecure one enrolls no keys)
                    self.ctx.load_verify_locations(cadata=member.key.pem())

    # ---- epochs (the engine's thread) ----

    def expect(self, epoch: int, pids: list[int]) -> None:
        """From now on, data JOINs of `pids` for `epoch` are collected (others get standby answers)."""
        stale: list[Joined] = []
        with self._lock:
            self._expect = (epoch, set(pids))
            keep: list[Joined] = []
            while True:  # drop arrivals of an abandoned epoch; keep those this one wants (a worker
                try:  # that started fast joins epoch 0 before the engine gets here)
                    j = self._arrived.get_nowait()
                except queue.Empty:
                    break
                (keep if j.epoch == epoch and j.member.pid in pids else stale).append(j)
            for j in keep:
                self._arrived.put(j)
        for j in stale:
            j.link.close()

    def remove(self, pid: int) -> None:
        """`pid` may never join again (revoked, or failed and replaced)."""
        with self._lock:
            self._gone.add(pid)

    def collect(
        self, pids: list[int], deadline: float, abort: Callable[[], str | None] = lambda: None
    ) -> dict[int, Joined]:
        """Wait until every pid of the epoch has its data link here. Raises CommError naming the
        missing ones at the deadline, or at once when `abort()` gives a reason."""
        got: dict[int, Joined] = {}
        try:
            while len(got) < len(pids):
                reason = abort()
                if reason:
                    raise CommError(reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [self.roster[p].label() for p in pids if p not in got]
                    raise NotJoined(
                        f"rendezvous at {self.address}: {len(missing)} of {len(pids)} workers did not join in time: "
                        f"{'; '.join(missing)}" + (f" (refused: {n})" if (n := self.refusals.total()) else ""),
                        [p for p in pids if p not in got],
                    )
                try:
                    j = self._arrived.get(timeout=min(left, 0.25))
                except queue.Empty:
                    continue
                if j.member.pid in got:  # a second connection with an admitted key
                    self._refuse(
                        "second connection",
                        f"{j.link.label}: rank {j.member.pid} has already joined (a second connection with "
                        "the same key)",
                        j.link,
                    )
                    continue
                got[j.member.pid] = j
        except BaseException:
            for j in got.values():
                j.link.close()
            raise
        return got

    def welcome(
        self, epoch: int, order: list[int], joined: dict[int, Joined], deadline: float, extra: Callable[[Member], dict]
    ) -> dict[int, Link]:
        """WELCOME the epoch's workers (rank = 1 + position in `order`), wait for their READY.
        Returns the data links by rank."""
        links = {r: joined[pid].link for r, pid in enumerate(order, start=1)}
        peers = {
            str(r): {
                "host": joined[pid].host,
                "port": joined[pid].port,
                "key": k.line() if (k := self.roster[pid].key) else None,
            }
            for r, pid in enumerate(order, start=1)
        }
        try:
            for r, pid in enumerate(order, start=1):
                links[r].rank = r
                m = self.roster[pid]
                send_json(
                    links[r], {"epoch": epoch, "rank": r, "pid": pid, "group": m.group, "peers": peers, **extra(m)}
                )
            for link in links.values():
                ready = recv_json(link, deadline)
                if ready.get("ready") is not True:
                    raise CommError(
                        f"{link.label} could not link up with its peers: {printable(str(ready.get('error', ready))[:300])}"
                    )
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    def close(self) -> None:
        self._stop.set()
        stop_accepting(self.sock)
        try:
            self.sock.close()
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)
        self.greeters.close()


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
    return str(getattr(e, "reason", None) or e)


def _tell_refused(link: Link, line: str) -> None:
    """A connection's refusal, `line`, sent (its reader's error) and the link closed."""
    try:
        send_json(link, {"refused": line})
        link.flush(time.monotonic() + 1)
    except CommError:
        pass
    link.close()


def launched_rank(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, size) of this process in the world mpiexec started it in, from the launcher's environment
    (MPICH's Hydra: PMI_RANK, PMI_SIZE; Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE), before
    MPI itself is loaded; None outside mpiexec. A worker announces it when it joins, so that the client
    can refuse workers started in another order than the topology's, naming each, before any of them
    opens MPI (mpi_fabric.py checks the world again when it does)."""
    env = os.environ if environ is None else environ
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in env and size in env:
            words = env[rank], env[size]
            if all(w.isdecimal() and len(w) <= 9 for w in words):
                return _launched([int(w) for w in words])
            return None
    return None


MAX_WORLD = 1 << 20  # more ranks than any mpiexec world of workers: a claim past it is not one


def _launched(value: Any) -> tuple[int, int] | None:
    """A (rank, size) pair, two integers with 0 <= rank < size <= MAX_WORLD, from the launcher's
    environment or a worker's JOIN (any JSON: anything else, floats and booleans included, is None)."""
    if not isinstance(value, list) or len(value) != 2 or any(type(v) is not int for v in value):
        return None
    rank, size = value
    return (rank, size) if 0 <= rank < size <= MAX_WORLD else None


@dataclass
class Credentials:
    """How a worker reaches and proves itself to the client."""

    me: Identity | None
    client_key: PublicId | None
    master: tuple[str, int]
    claim_pid: int | None = None
    claim_group: str | None = None
    listen_host: str | None = None
    launched: tuple[int, int] | None = None  # mpiexec's rank and world size for it (`launched_rank`)
    listen_ip: str = field(default="", init=False)  # learned from the first connection when not given

    def __post_init__(self) -> None:
        if (self.me is None) != (self.client_key is None):
            raise CommError("a worker needs both its own key and the client's public key (or --insecure)")


def _open_tls(host: str, port: int, ctx: ssl.SSLContext | None, deadline: float, what: str):
    """Connect and run the TLS handshake as the connecting side; returns (socket, TLS object or None).
    A listener at its cap of unauthenticated connections (Greeters) closes a new one before it answers:
    that (closed or reset during the handshake) is retried until the deadline; a TLS refusal is not."""
    while True:
        sock = _connect(host, port, deadline, what)
        try:
            return sock, handshake(sock, ctx, server=False, deadline=deadline)
        except ConnectionError:
            sock.close()
            if time.monotonic() + RETRY_S >= deadline:
                raise
            time.sleep(RETRY_S)
        except BaseException:
            sock.close()
            raise


def _client_link(cred: Credentials, deadline: float) -> Link:
    host, port = cred.master
    try:
        ctx = (
            tls_context(cred.me, [k for k in (cred.client_key,) if k is not None], server=False)
            if cred.me is not None
            else None
        )
        sock, tls = _open_tls(host, port, ctx, deadline, "the client")
    except CommError:
        raise
    except Exception as e:
        raise CommError(
            f"TLS handshake with the client at {host}:{port} failed ({_tls_refusal(e)}): "
            "is this the client's public key?"
        ) from None
    if not cred.listen_ip:
        cred.listen_ip = cred.listen_host or sock.getsockname()[0]
    if tls is not None and (cred.client_key is None or peer_certificate(tls) != cred.client_key.cert_der):
        sock.close()
        raise CommError(f"the client at {host}:{port} presented another key than the one pinned")
    return Link(sock, tls, 0, f"the client [{host}:{port}]")


def open_pulse(cred: Credentials, pid: int, deadline: float) -> Link:
    """The worker's liveness connection to the client (liveness.Pulse runs on it)."""
    link = _client_link(cred, deadline)
    send_json(link, {"v": VERSION, "kind": "pulse", "rank": pid, "group": cred.claim_group, "port": 0})
    return link


def join_epoch(cred: Credentials, epoch: int | None, deadline: float, log: Callable[[str], None] = lambda s: None):
    """A worker's side of one epoch's rendezvous. Returns (welcome, links by rank, 0 = the client),
    or (welcome with "standby", {}) when the client keeps it in reserve."""
    client = _client_link(cred, deadline)
    try:
        listener = _listen(cred.listen_ip, 0)
    except CommError:
        client.close()
        raise
    try:
        lhost, lport = listener.getsockname()[:2]
        send_json(
            client,
            {
                "v": VERSION,
                "kind": "data",
                "rank": cred.claim_pid,
                "group": cred.claim_group,
                "epoch": epoch,
                "host": lhost,
                "port": lport,
                **({"launched": list(cred.launched)} if cred.launched is not None else {}),
            },
        )
        try:
            welcome = recv_json(client, deadline)
        except CommError as e:
            client.close()
            where = f"{cred.master[0]}:{cred.master[1]}"
            raise CommError(f"the client at {where} did not admit this worker ({e}): is its key listed?") from None
        if "refused" in welcome:
            client.close()
            raise CommError(f"the client refused this worker: {welcome['refused']}")
        if welcome.get("standby"):
            client.close()
            return welcome, {}
        rank, peers = welcome.get("rank"), welcome.get("peers")
        if not isinstance(rank, int) or not isinstance(peers, dict) or str(rank) not in peers:
            client.close()
            raise CommError("the client sent a malformed WELCOME")
        try:
            links = _link_peers(cred.me, rank, peers, listener, deadline, log)
        except CommError as e:
            send_json(client, {"ready": False, "error": str(e)})
            client.flush(time.monotonic() + 1)
            client.close()
            raise
        send_json(client, {"ready": True})
        links[0] = client
        return welcome, links
    finally:
        listener.close()


def _link_peers(
    me: Identity | None, rank: int, peers: dict, listener: socket.socket, deadline: float, log: Callable[[str], None]
) -> dict[int, Link]:
    """Connect to every lower-ranked worker, accept every higher-ranked one. Both ends pin keys.
    Incoming connections are greeted concurrently (Greeters: HANDSHAKE_S each, at most MAX_PENDING
    at once), so a stranger's idle connection never makes a peer wait behind it."""
    table = {}
    for r, p in peers.items():
        key = PublicId.parse(p["key"], f"worker {r}'s key") if p.get("key") else None
        table[int(r)] = (p["host"], int(p["port"]), key)
    higher = {r: table[r] for r in table if r > rank}
    ctx = (
        tls_context(me, [t[2] for t in higher.values() if t[2] is not None], server=True)
        if me is not None and higher
        else None
    )
    by_cert = {t[2].cert_der: r for r, t in higher.items() if t[2] is not None}
    refusals = Refusals(log)
    greeters = Greeters(f"worker {rank}", refusals)
    arrived: queue.Queue[tuple[int, str, Link]] = queue.Queue()
    finished = threading.Event()
    hand_over = threading.Lock()  # a late greeting either reaches `arrived` before the drain or closes its link

    def greet(conn: socket.socket, addr: Any) -> None:
        where = _fmt_addr(addr)
        if me is not None and not higher:  # the highest rank accepts nobody: whoever connects is a stranger
            conn.close()
            refusals.add("no peer expected", f"connection from {where} to worker {rank}: no worker links to it")
            return
        until = min(deadline, time.monotonic() + HANDSHAKE_S)
        try:
            tls = handshake(conn, ctx, server=True, deadline=until)
            link = Link(conn, tls, -1, f"connection from {where}")
            hello = recv_json(link, until)
        except Exception as e:
            conn.close()
            refusals.add("no valid hello", f"connection from {where} to worker {rank}: {_tls_refusal(e)}")
            return
        q = hello.get("link")
        expected = by_cert.get(peer_certificate(tls) or b"") if tls is not None else q
        if not isinstance(q, int) or q not in higher or q != expected:
            link.close()
            refusals.add(
                "claimed another worker",
                f"connection from {where} to worker {rank}: presented as worker {q}, key is worker {expected}",
            )
            return
        with hand_over:
            if finished.is_set():
                link.close()
            else:
                greeters.authenticated(conn)
                arrived.put((q, where, link))

    links: dict[int, Link] = {}
    listener.settimeout(ACCEPT_TICK_S)  # the accept loop checks `finished` this often
    acceptor = threading.Thread(
        target=accept_until, args=(listener, finished, greeters, greet), name=f"fusion-accept-{rank}", daemon=True
    )
    acceptor.start()
    try:
        for q in sorted(r for r in table if r < rank):
            host, port, key = table[q]
            label = f"worker {q} [{host}:{port}" + (f", key {key.fingerprint}]" if key else "]")
            try:
                cctx = tls_context(me, [key] if key is not None else [], server=False) if me is not None else None
                sock, tls = _open_tls(host, port, cctx, deadline, f"worker {q}")
            except CommError:
                raise
            except Exception as e:
                raise CommError(f"TLS handshake with {label} failed ({_tls_refusal(e)})") from None
            if tls is not None and (key is None or peer_certificate(tls) != key.cert_der):
                sock.close()
                raise CommError(f"{label} presented another key than the one pinned")
            link = Link(sock, tls, q, label)
            send_json(link, {"link": rank})
            links[q] = link
        while len(links) < len(table) - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(higher) - set(links))
                n = refusals.total()
                raise CommError(
                    f"workers {missing} did not link up with worker {rank} in time"
                    + (f" (refused: {n} other connections)" if n else "")
                )
            try:
                q, where, link = arrived.get(timeout=min(left, 0.25))
            except queue.Empty:
                continue
            if q in links:
                link.close()
                refusals.add(
                    "second connection", f"connection from {where} to worker {rank}: worker {q} has already linked"
                )
                continue
            key = higher[q][2]
            link.rank, link.label = q, f"worker {q} [{where}" + (f", key {key.fingerprint}]" if key else "]")
            links[q] = link
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        with hand_over:
            finished.set()
        greeters.close()
        while True:  # greeted after the last one was needed (or after giving up)
            try:
                arrived.get_nowait()[2].close()
            except queue.Empty:
                break
        stop_accepting(listener)  # every epoch's link-up waited for the accept's tick here
        acceptor.join(timeout=1.0)
    return links
