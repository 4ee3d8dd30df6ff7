"""Ordered, framed messages to each peer over one TCP connection per pair of participants.

The `tls` comm backend wraps every connection in TLS 1.3 (Python's `ssl`, i.e. OpenSSL) with pinned
certificates on both sides: each end presents its own certificate, trusts exactly the peers it
expects, and after the handshake compares the presented certificate with the pinned one byte for
byte. Records are AEAD-encrypted (AES-GCM or ChaCha20-Poly1305, as OpenSSL negotiates). The `tcp`
backend (`--insecure`) is the same framing on plain TCP.

Why TLS over sockets and not CurveZMQ: measured on this project's 2-core machine (docs/security.md),
an all-to-all of 300 fp32 rows per peer took 20-60 µs at 2 ranks on these links against 70-90 µs
on pyzmq DEALER sockets with CURVE, and large messages encrypt at AES-GCM speed here (3.4 GB/s)
against ~0.5 GB/s for CURVE's XSalsa20-Poly1305; a closed peer is seen at once (EOF) instead of
through socket monitors; and the bytes on the wire follow an exact model (below).

Framing: a message is a 20-byte little-endian header, then the payload. The header (HEADER) is the
payload's length (u64), the sender's epoch (u32) and step (u32), a lane (u16, 0: room for several
steps in flight later) and flags (u16, 0). The receiver checks epoch and step against its own (its
Comm counts steps: comm.py, "Numbered steps"): a data frame from another epoch or step is
PeerOutOfStep, naming its sender, before a byte of its payload is read as data. A header with its top bit
(FAREWELL) set is a farewell: its low bits count the bytes of a small JSON reason that follows, the
sender's last message on the link before it closes (`Link.farewell`): `why`, one line (its own
error), and, when it leaves because of a peer, `cause` (the peer whose link failed it first-hand) or
`after` (the peer whose farewell made it leave). The receiver raises PeerLeft (a PeerLost) carrying
it, so the far end learns why, not only that, the link closed, and whom the leaver blames
(docs/resilience.md, "Blame by evidence": an announced close is no first-hand evidence); its epoch
and step are not checked (a leaver may say why at any point). With TLS, a message whose
header and payload fit one record (20 + P <= 16384) is written as one record; a larger one as a
header record then the payload in records of 16384 bytes. Every record costs 22 bytes (5 header,
1 inner content type, 16 tag), so the bytes on the wire are exactly `wire_bytes(P, tls)`.

Threads: the thread that owns a `Links` encrypts, decrypts, sends and receives. A send is tried at
once without blocking (`MSG_DONTWAIT`); whatever the kernel does not take right away goes to the
link's writer thread, which only moves already-encrypted bytes, so a process never deadlocks on a
full socket buffer while it is itself waiting to receive, and bytes keep flowing while it computes.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import cast

from ..errors import FusionError
from .errors import CommError, PeerError, PeerLeft, PeerLost, PeerOutOfStep, PeerTimeout, TaintedInputs
from .identity import Identity, PublicId
from .peer_text import printable
from .readiness import readable

HEADER = struct.Struct("<QIIHH")  # length (or FAREWELL | reason length), epoch, step, lane, flags
TLS_RECORD = 16384  # largest plaintext per TLS record
TLS_OVERHEAD = 22  # bytes per TLS 1.3 record on the wire: 5 header + 1 content type + 16 AEAD tag
TICK_S = 0.25  # a blocking receive wakes up this often to check its deadline and the liveness watch
RAW_CHUNK = 1 << 18
MAX_MESSAGE = 1 << 34  # a length above this is a corrupt or hostile header, not a tensor
FAREWELL = 1 << 63  # a header with this bit: a farewell, whose reason's length is the low bits
MAX_FAREWELL = 512  # bytes of a farewell's reason (one line; it reaches logs, errors and /health)
MAX_WHY = 300  # characters of its line kept


def farewell_reason(raw: bytes) -> dict:
    """A farewell's payload as {"why": one bounded line, "cause", "after": ranks or None}. It is the
    peer's word, checked like any input: a payload that is not such an object is taken as its line."""
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        obj = {"why": raw.decode(errors="replace")}
    out: dict = {}
    for key in ("cause", "after"):
        v = obj.get(key)
        out[key] = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 16 else None
    out["inputs"] = obj.get("inputs") is True  # its own block failed, made from inputs that passed (TaintedInputs)
    out["why"] = printable(" ".join(str(obj.get("why") or "").split()))[:MAX_WHY]  # the peer's text: data
    return out


def frame_header(length: int, epoch: int = 0, step: int = 0, lane: int = 0, flags: int = 0) -> bytes:
    """A frame's header: `length` payload bytes (or FAREWELL | a reason's length) of step `step` of
    epoch `epoch`, on `lane` (0: one step in flight)."""
    return HEADER.pack(length, epoch, step, lane, flags)


def wire_bytes(payload: int, tls: bool) -> int:
    """Bytes one message of `payload` bytes puts on the TCP stream (what the kernel counts)."""
    if not tls:
        return HEADER.size + payload
    if HEADER.size + payload <= TLS_RECORD:
        return HEADER.size + payload + TLS_OVERHEAD
    return HEADER.size + TLS_OVERHEAD + payload + TLS_OVERHEAD * -(-payload // TLS_RECORD)


# ---- TLS ----


def tls_context(me: Identity, trusted: Iterable[PublicId], server: bool) -> ssl.SSLContext:
    """TLS 1.3 only, mutual authentication against `trusted` (pinned certificates), no tickets."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # a participant is its pinned certificate, not a host name
    ctx.verify_mode = ssl.CERT_REQUIRED
    # ssl loads private keys from files only: a private temporary file, removed at once.
    fd, path = tempfile.mkstemp(prefix="fusion-key-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(me.pem_bundle())
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    pems = "".join(p.pem() for p in trusted)
    if pems:
        ctx.load_verify_locations(cadata=pems)
    if server:
        ctx.num_tickets = 0  # no session tickets: after the handshake, only our records travel
    return ctx


# Congestion control, per socket. A job's links carry bursts (one message per collective, a few KB to
# a few hundred KB) with compute between them, and each burst's latency is what a step pays. BBR (the
# default on some hosts, this project's VM among them) paces every burst at its estimate of the
# bandwidth, and from such bursty, application-limited traffic its estimate stays low: measured with
# bench/exchange.py at a 5 ms round trip, <FIGURES>. A loss-based algorithm sends a burst up to the
# congestion window at once, and recovers losses the same way (RACK, loss probes). So: cubic where
# the host allows it, else reno (which Linux always allows); FUSION_TCP_CONGESTION=NAME asks for
# another, FUSION_TCP_CONGESTION= (empty) keeps the host's default.
TCP_CONGESTION = ("cubic", "reno")

KEEPALIVE = (10, 5, 3)  # idle s, interval s, probes: a vanished host is noticed within ~25 s even when idle


def congestion_control(sock: socket.socket) -> str | None:
    """Set the first congestion control of TCP_CONGESTION (or FUSION_TCP_CONGESTION) the host allows
    this process; returns the one in force, None where the platform has no such option."""
    if not hasattr(socket, "TCP_CONGESTION"):
        return None
    wanted = os.environ.get("FUSION_TCP_CONGESTION")
    for name in TCP_CONGESTION if wanted is None else (wanted,) if wanted else ():
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            break
        except OSError:  # not loaded, or not in net.ipv4.tcp_allowed_congestion_control
            continue
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    congestion_control(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        idle, interval, count = KEEPALIVE
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
    sock.setblocking(True)
    # A kernel receive timeout: a blocking recv returns EAGAIN after TICK_S, so waits stay bounded
    # without a select() per message (measured: one syscall per receive instead of two).
    sec = int(TICK_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((TICK_S - sec) * 1e6)))


class Link:
    """One connected peer. `tls` is None on the `tcp` backend."""

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject | None, rank: int, label: str):
        self.sock = sock
        self.tls = tls
        self.rank = rank
        self.label = label  # "worker 2 (10.0.0.3, key 3f2a9c0d1e4b)", for errors
        # the TLS object's memory BIOs (handshake() makes them); a plaintext link never touches them
        self._inc: ssl.MemoryBIO = getattr(tls, "_fusion_inc", None) or ssl.MemoryBIO()
        self._out: ssl.MemoryBIO = getattr(tls, "_fusion_out", None) or ssl.MemoryBIO()
        self._raw = bytearray(RAW_CHUNK)
        self._hdr = bytearray(HEADER.size)
        # the (epoch, step) this end is in: stamped on every frame it sends, and expected on every data
        # frame it receives (its Comm sets them: comm.Comm.begin_step)
        self.epoch = 0
        self.step = 0
        self._lock = threading.Lock()
        self._queue: collections.deque[memoryview] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closing = False
        self.closed = False
        self.said: str | None = None  # the peer's farewell reason, once received
        self.left: dict | None = None  # ... all of it (farewell_reason): whom it blamed, if anyone
        # Called at every receive tick: raises when the job must stop waiting (a peer found dead by
        # the liveness watch, or an abort), whoever this link's own peer is.
        self.check: Callable[[], None] | None = None
        _tune(sock)

    # ---- sending ----

    def send(self, payload: memoryview) -> None:
        self._send_framed(len(payload), payload)

    def _send_framed(self, header: int, payload: memoryview) -> None:
        n = len(payload)
        if self.tls is not None:
            if HEADER.size + n <= TLS_RECORD:
                self.tls.write(frame_header(header, self.epoch, self.step) + payload)
            else:
                self.tls.write(frame_header(header, self.epoch, self.step))
                self.tls.write(payload)
            parts = [memoryview(self._out.read())]
        else:
            parts = [memoryview(frame_header(header, self.epoch, self.step)), payload]
        with self._lock:
            self._raise_writer_error()
            if not self._queue:
                parts = self._send_now(parts)
            if parts:  # the kernel is full: the writer thread takes the rest (own copies of the bytes)
                self._queue.extend(memoryview(bytes(p)) if self.tls is None else p for p in parts)
                self._start_writer()
                self._wake.notify()

    def send_truncated(self, payload: memoryview, keep: float) -> None:
        """FAULT INJECTION ONLY (faults.py): announce the whole message, deliver `keep` of it, then
        close the connection, as a worker dying mid-message would."""
        head = memoryview(frame_header(len(payload), self.epoch, self.step) + payload[: int(len(payload) * keep)])
        if self.tls is not None:
            self.tls.write(head)
            head = memoryview(self._out.read())
        self.sock.sendall(head)
        self.close()

    def farewell(
        self, reason: str, deadline: float, cause: int | None = None, after: int | None = None, inputs: bool = False
    ) -> None:
        """Tell the peer why this end is leaving, as the link's last message (one line, cut to fit
        MAX_FAREWELL bytes with `cause` and `after`: farewell_reason), and push it out until
        `deadline`. Best effort: a peer already gone hears nothing. The caller closes the link."""
        why = " ".join((reason.splitlines() or [""])[0].split())[:MAX_WHY]
        while True:  # (cut whole characters until the JSON fits)
            said = {"why": why, "cause": cause, "after": after, **({"inputs": True} if inputs else {})}
            payload = json.dumps(said, ensure_ascii=False).encode()
            if len(payload) <= MAX_FAREWELL:
                break
            why = why[: len(why) * MAX_FAREWELL // len(payload) - 1]
        try:
            self._send_framed(FAREWELL | len(payload), memoryview(payload))
            self.flush(deadline)
        except (CommError, OSError, ssl.SSLError):
            pass

    def _lost(self, detail: str = "") -> PeerLost:
        """The error of a link whose peer closed it: with the peer's farewell reason when it gave one."""
        if self.said is not None:
            return PeerLeft(self.rank, f"{self.label} closed the connection: {self.said}", self.left or {})
        return PeerLost(self.rank, f"{self.label} closed the connection{detail}")

    def _gone(self, detail: str = "") -> PeerLost:
        """A send failed: the peer closed. If it said farewell first (unread yet), that is the error."""
        if self.said is None:
            self.departure()
        return self._lost(detail)

    def _send_now(self, parts: list[memoryview]) -> list[memoryview]:
        try:
            sent = self.sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return parts
        except OSError as e:
            raise self._gone(f" ({e.strerror or e})") from None
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]
        return parts

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name=f"fusion-link-{self.rank}", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    return
                part = self._queue[0]
            try:
                self.sock.sendall(part)  # blocking: this thread only moves bytes
            except OSError as e:
                with self._lock:
                    self._error = e
                    self._queue.clear()
                    self._wake.notify_all()
                return
            with self._lock:
                self._queue.popleft()
                if not self._queue:
                    self._wake.notify_all()

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            e = self._error
            raise self._gone(f" ({getattr(e, 'strerror', None) or e})")

    def flush(self, deadline: float) -> None:
        """Block until every queued byte is in the kernel (or the deadline passes)."""
        with self._lock:
            while self._queue and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(self.rank, f"{self.label} stopped reading: could not deliver within the deadline")
                self._wake.wait(min(left, TICK_S))
                if self.check is not None:
                    self.check()
            self._raise_writer_error()

    # ---- receiving ----

    def has_buffered(self) -> bool:
        """Received bytes not handed out yet (TLS keeps a record's plaintext, or ciphertext, in memory):
        a reader that selects on the socket must look here first."""
        return self.tls is not None and (self.tls.pending() > 0 or self._inc.pending > 0)

    def _read_raw(self, view: memoryview, deadline: float) -> int:
        while True:
            try:
                n = self.sock.recv_into(view)
            except BlockingIOError:  # SO_RCVTIMEO tick
                if self.check is not None:
                    self.check()
                if time.monotonic() >= deadline:
                    raise PeerTimeout(self.rank, f"{self.label} did not answer within the deadline") from None
                continue
            except OSError as e:
                raise self._lost(f" ({e.strerror or e})") from None
            if n == 0:
                raise self._lost()
            return n

    def _read_exact(self, view: memoryview, deadline: float) -> None:
        got, want = 0, len(view)
        if self.tls is None:
            while got < want:
                got += self._read_raw(view[got:], deadline)
            return
        while got < want:
            try:
                k = cast(int, self.tls.read(want - got, view[got:]))  # with a buffer: the count read
            except ssl.SSLWantReadError:
                k = -1
            except ssl.SSLError as e:
                raise PeerLost(self.rank, f"{self.label}: TLS error ({e.reason or e})") from None
            if k == 0:
                raise self._lost()
            if k > 0:
                got += k
                continue
            n = self._read_raw(memoryview(self._raw), deadline)
            self._inc.write(memoryview(self._raw)[:n])

    def recv_size(self, deadline: float, numbered: bool = True) -> int:
        """The next frame's payload length, its header read and checked: a farewell raises PeerLeft, a
        data frame of another (epoch, step) than this end's PeerOutOfStep (unless not `numbered`: a
        departing peer's leftovers, read only to be dropped)."""
        if self.said is not None:  # the peer said goodbye: nothing comes after it
            raise self._lost()
        self._read_exact(memoryview(self._hdr), deadline)
        n, epoch, step, lane, flags = HEADER.unpack(self._hdr)
        if n & FAREWELL and n & ~FAREWELL <= MAX_FAREWELL:
            raw = bytearray(n & ~FAREWELL)
            self._read_exact(memoryview(raw), deadline)
            self.left = farewell_reason(bytes(raw))
            self.said = self.left["why"] or "(no reason given)"
            raise self._lost()
        if n > MAX_MESSAGE or lane or flags:
            raise PeerError(
                self.rank, f"{self.label} sent a malformed message header (length {n}, lane {lane}, flags {flags})"
            )
        if numbered and (epoch, step) != (self.epoch, self.step):
            raise PeerOutOfStep(self.rank, self.label, (self.epoch, self.step), (epoch, step))
        return n

    def recv_into(self, out: memoryview, deadline: float, what: str = "") -> None:
        n = self.recv_size(deadline)
        if n != len(out):
            raise PeerError(
                self.rank,
                f"{self.label} sent {n} bytes{' for ' + what if what else ''} where "
                f"{len(out)} were expected (wrong shape or dtype)",
            )
        self._read_exact(out, deadline)

    def recv_bytes(self, deadline: float, limit: int) -> bytes:
        n = self.recv_size(deadline)
        if n > limit:
            raise PeerError(self.rank, f"{self.label} sent a {n}-byte control message (limit {limit})")
        buf = bytearray(n)
        self._read_exact(memoryview(buf), deadline)
        return bytes(buf)

    def departure(self, wait_s: float = 0.05) -> str:
        """What became of the peer, as far as this end can tell now: "left" (it said farewell:
        `self.left`), "closed" (its end closed without one), "sent" (whole messages came, and
        nothing after them), or "open" (nothing new). Reads and drops whatever messages come (the
        epoch they belong to is over)."""
        if self.said is not None:
            return "left"
        if self.closed:
            return "open"  # closed by this end: nothing more to read
        deadline = time.monotonic() + wait_s
        check, self.check = self.check, None  # a liveness verdict about someone else is not this link's news
        sent = False
        try:
            while self.has_buffered() or readable([self.sock], 0):
                n = self.recv_size(deadline, numbered=False)  # raises PeerLeft at a farewell
                junk = memoryview(bytearray(1 << 16))
                while n > 0:
                    k = min(n, len(junk))
                    self._read_exact(junk[:k], deadline)
                    n -= k
                sent = True
        except PeerLeft:
            return "left"
        except PeerTimeout:
            return "open"  # part of a message, and no more yet
        except (CommError, OSError, ValueError):
            return "closed"
        finally:
            self.check = check
        return "sent" if sent else "open"

    def close(self, deadline: float | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        if deadline is not None:
            try:
                self.flush(deadline)
            except CommError:
                pass
        with self._lock:
            self._closing = True
            self._queue.clear()
            self._wake.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def farewell_all(
    links: Iterable[Link],
    reason: str,
    grace_s: float = 1.0,
    cause: int | None = None,
    after: int | None = None,
    inputs: bool = False,
) -> None:
    """Say `reason` (and whom it blames: `cause`, `after`, or its inputs as a whole: `inputs`) on
    every open link of `links` (Link.farewell), within `grace_s` in all: the last word of a
    participant leaving. The caller closes them."""
    deadline = time.monotonic() + grace_s
    for link in links:
        if not link.closed:
            link.farewell(reason, deadline, cause, after, inputs)


def say_farewell(links: dict[int, Link], err: BaseException, grace_s: float = 1.0) -> None:
    """This participant drops the epoch because of `err`: tell every peer why (farewell_all). The
    reason names the peer whose link failed it first-hand (`cause`: closed without a farewell, or
    silent past the deadline), or the peer whose own farewell made it leave (`after`: a knock-on, no
    evidence against anyone), or that its own block failed though its inputs passed (`inputs`:
    TaintedInputs, no single peer to name), or none of these (its own failure), with the error's line."""
    first_hand = isinstance(err, PeerError) and not err.watched and not isinstance(err, PeerLeft)
    cause = err.rank if first_hand and isinstance(err, PeerError) else None
    after = err.rank if isinstance(err, PeerLeft) else None
    inputs = isinstance(err, TaintedInputs)
    farewell_all(links.values(), reason_of(err), grace_s, cause, after, inputs)


@contextmanager
def farewell_on_failure(links: dict[int, Link]) -> Iterator[None]:
    """A failure of this participant's own inside the block (not a PeerError: a peer's failure or
    the client's abort) is said on every link of `links` before it propagates, so that the other
    end reports this participant's own words, not only that a connection closed."""
    try:
        yield
    except PeerError:
        raise
    except Exception as e:
        farewell_all(links.values(), reason_of(e))
        raise


def reason_of(e: BaseException) -> str:
    """A failure in one line, as the `fusion` command prints it (cli.main): what a farewell says."""
    first = (str(e).splitlines() or [""])[0]
    return first if isinstance(e, FusionError) else f"{type(e).__name__}: {first}"


# ---- establishing a link ----


def handshake(sock: socket.socket, ctx: ssl.SSLContext | None, server: bool, deadline: float) -> ssl.SSLObject | None:
    """Run the TLS 1.3 handshake over a connected socket (memory BIOs, so that afterwards every
    record passes through our own send/receive path). None when `ctx` is None (insecure)."""
    if ctx is None:
        return None
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(inc, out, server_side=server)
    tls._fusion_inc, tls._fusion_out = inc, out  # type: ignore[attr-defined]
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("TLS handshake did not finish in time")
        sock.settimeout(left)
        try:
            tls.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        except ssl.SSLError:
            _send_pending_alert(sock, out)  # tell the peer why (e.g. "unknown ca": its key is not listed)
            raise
        data = out.read()
        if data:
            sock.sendall(data)
        if done:
            return tls
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the peer closed the connection during the TLS handshake")
        inc.write(chunk)


def _send_pending_alert(sock: socket.socket, out: ssl.MemoryBIO) -> None:
    data = out.read()
    if data:
        try:
            sock.sendall(data)
        except OSError:
            pass


def peer_certificate(tls: ssl.SSLObject | None) -> bytes | None:
    return None if tls is None else tls.getpeercert(binary_form=True)
