"""Liveness: every worker beats on a connection of its own to the client; the client notices a worker
that stops (dead, frozen, cut off) within a deadline, names it, and tells the others what to do.

  worker  `Pulse`: a thread that sends a beat every `interval_s` on the pulse link and obeys the
          client's words on it: `ask` (what did you see: answered by its `Witness`), `abort` (give up the current epoch: every data link is shut down at
          once, so a wait on a vanished peer ends now), `stop` (the job is over), `revoke` (wipe and
          leave). A client that goes away closes the pulse link: the worker leaves at once. A worker
          that leaves for a failure of its own says why on the pulse link as it closes it
          (`close(reason)`), and the watch records that reason as the failure.
  client  `Watch`: a thread that reads every worker's pulse link. A worker has failed when its
          pulse link closes (its process died: seen at once) or when no beat came for `deadline_s`
          (frozen, or its network cut). `check()` raises the failure as a `PeerError` naming the
          worker; the client's data links call it at every receive tick, so a wait on anyone ends.

Why a separate connection: a data link belongs to one thread (its TLS state is not shared between
threads) and a worker's main thread may compute for seconds between messages; a beat must wait for
neither. A frozen process sends no beats at all (every thread stops); a computing one keeps beating.
Cost on the data path: none (measured in docs/resilience.md).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable

from .errors import CommError, PeerLost, PeerTimeout
from .links import Link
from .readiness import readable

BEAT_S = 0.5  # a worker's beat interval
DEADLINE_S = 5.0  # no beat for this long: the worker has failed (configurable per job)


def _send(link: Link, obj: dict) -> None:
    link.send(memoryview(json.dumps(obj).encode()))


def _recv(link: Link, wait_s: float) -> dict:
    data = link.recv_bytes(time.monotonic() + wait_s, 1 << 16)
    try:
        return json.loads(data)
    except RecursionError:  # e.g. 60,000 "[": json's decoder recurses per level; malformed as any other
        raise ValueError("a pulse message nested too deep") from None


class Pulse:
    """A worker's beat, and its ear for the client's words about epochs."""

    def __init__(
        self,
        link: Link,
        on_word: Callable[[dict], None],
        on_client_gone: Callable[[], None],
        interval_s: float = BEAT_S,
        witness: Witness | None = None,
    ):
        self.link, self.on_word, self.on_client_gone, self.interval_s = link, on_word, on_client_gone, interval_s
        self.witness = witness  # answers the client's `ask` (this thread sends it: no lock with the beats)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fusion-pulse", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat = 0
        try:
            while not self._stop.is_set():
                _send(self.link, {"beat": beat})
                beat += 1
                deadline = time.monotonic() + self.interval_s
                while not self._stop.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if not self.link.has_buffered():
                        if not readable([self.link.sock], left):
                            break
                    word = _recv(self.link, 5.0)
                    if "ask" in word:
                        if self.witness is not None:
                            _send(self.link, {"saw": self.witness.answer(word["ask"], float(word.get("window", 10)))})
                    else:
                        self.on_word(word)
        except (CommError, OSError, ValueError):
            if not self._stop.is_set():
                self.on_client_gone()

    def close(self, reason: str | None = None) -> None:
        """Stop beating and close the pulse link; `reason`: why this worker is leaving (its own
        failure), said to the client as the link's last message (Link.farewell) once the beating
        thread has stopped (a link is used by one thread at a time)."""
        self._stop.set()
        if reason is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            if not self._thread.is_alive():
                self.link.farewell(reason, time.monotonic() + 1.0)
        self.link.close()


class Witness:
    """What a worker saw of its peers in its current epoch, for the client to ask before it blames
    anyone (docs/resilience.md, "Blame by evidence"): the peer whose link failed it first-hand
    (`lost`: closed without a farewell, or silent past the deadline), the peer whose farewell made it
    leave (`after`: a knock-on close, no evidence against anyone), how long each peer alone kept it
    waiting lately: the real duration of every exchange's wait after all its other peers' messages
    had arrived (comm.Comm charges it), however short, and where it is now: `working` (between a
    step's input and its output) and `waiting` (the peers whose messages it is blocked on). It is the
    worker's own account, sent on its pulse link; the client weighs it against the others' and its
    own (the client keeps one too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch: int | None = None
        self.lost: int | None = None
        self.after: int | None = None
        self._waits: deque[tuple[float, int, float]] = deque(maxlen=8192)  # (when, rank, seconds)
        self._waiting: tuple[frozenset[int], float] = (frozenset(), 0.0)  # blocked on, since (monotonic)
        self.working = False

    def start(self, epoch: int | None) -> None:
        """A new epoch: forget the last one's account."""
        with self._lock:
            self.epoch, self.lost, self.after = epoch, None, None
            self._waits.clear()
            self._waiting, self.working = (frozenset(), 0.0), False

    def waiting_on(self, ranks: frozenset[int], since: float) -> None:
        """Blocked on `ranks`' messages since `since` (empty: not blocked on any peer)."""
        self._waiting = (frozenset(r for r in ranks if r != 0), since)

    def step(self, working: bool) -> None:
        """A step's input arrived (True), or its output left (False)."""
        self.working = working

    def charge(self, rank: int, seconds: float) -> None:
        """`rank` alone kept this participant waiting `seconds` (waiting for the client is what an
        idle worker does: not counted)."""
        if rank != 0 and seconds > 0:
            self._waits.append((time.monotonic(), rank, seconds))

    def lost_peer(self, rank: int) -> None:
        with self._lock:
            if rank != 0 and self.lost is None and self.after is None:
                self.lost = rank

    def left_after(self, rank: int) -> None:
        """`rank` said farewell (it left the epoch) before anything failed here first-hand."""
        with self._lock:
            if self.lost is None and self.after is None:
                self.after = rank

    def answer(self, epoch: int, window_s: float) -> dict:
        """{"epoch", "lost", "after" (ranks, or None), "waits": {rank: seconds it alone kept this one
        waiting in the last `window_s`, the wait in progress included}, "waiting": [ranks it is
        blocked on now], "working"} for `epoch` (another epoch's question gets an empty account)."""
        now = time.monotonic()
        with self._lock:
            if epoch != self.epoch:
                return {"epoch": epoch, "lost": None, "after": None, "waits": {}, "waiting": [], "working": False}
            waits: dict[str, float] = {}
            for t, rank, seconds in list(self._waits):
                if t >= now - window_s:
                    waits[str(rank)] = waits.get(str(rank), 0.0) + seconds
            blocked, since = self._waiting
            if len(blocked) == 1:  # the wait in progress, on one peer alone
                (rank,) = blocked
                waits[str(rank)] = waits.get(str(rank), 0.0) + now - max(since, now - window_s)
            return {
                "epoch": epoch,
                "lost": self.lost,
                "after": self.after,
                "waits": {r: round(s, 4) for r, s in waits.items()},  # rounded once: sub-0.1 ms waits add up
                "waiting": sorted(blocked),
                "working": self.working,
            }


class Watch:
    """The client's view of every worker's pulse."""

    def __init__(self, deadline_s: float = DEADLINE_S):
        self.deadline_s = deadline_s
        self._links: dict[int, Link] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._seen: dict[int, float] = {}
        self._failed: dict[int, str] = {}
        self._ignored: set[int] = set()
        self._saw: dict[int, dict] = {}  # each worker's last answer to `ask`
        # a link whose receive failed (closed, cut, garbled): nothing more can be read from it, and its
        # socket stays readable (at its end), so polling it again would spin this thread at a whole core
        # until the rank is forgotten or rejoins (0.18 s of CPU in every job's close, measured)
        self._broken: dict[int, Link] = {}
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fusion-watch", daemon=True)
        self._thread.start()

    # ---- membership ----

    def add(self, rank: int, link: Link) -> None:
        """Watch `rank`'s pulse on `link` (a rejoining worker's new link replaces its old one)."""
        with self._guard:
            old = self._links.get(rank)
            self._links[rank] = link
            self._locks[rank] = threading.Lock()
            self._seen[rank] = time.monotonic()
            self._failed.pop(rank, None)
            self._broken.pop(rank, None)
            self._ignored.discard(rank)
        if old is not None and old is not link:
            old.close()

    def forget(self, rank: int) -> None:
        """Stop watching `rank` (revoked, or its failure is handled): its silence is no news."""
        with self._guard:
            link = self._links.pop(rank, None)
            self._broken.pop(rank, None)
            self._ignored.add(rank)
            self._failed.pop(rank, None)
        if link is not None:
            link.close()

    def endpoints(self) -> frozenset[str]:
        """The workers' ends of their pulse connections, as HOST:PORT (byte counts leave them out:
        heartbeats carry no state and their number depends on time, not on the computation)."""
        out = set()
        with self._guard:
            links = list(self._links.values())
        for link in links:
            try:
                host, port = link.sock.getpeername()[:2]
                out.add(f"{host}:{port}")
            except OSError:
                pass
        return frozenset(out)

    @property
    def ranks(self) -> list[int]:
        with self._guard:
            return sorted(self._links)

    # ---- failures ----

    def failure(self) -> tuple[int, str] | None:
        with self._guard:
            for rank in sorted(self._failed):
                return rank, self._failed[rank]
        return None

    def failed(self) -> dict[int, str]:
        with self._guard:
            return dict(self._failed)

    def check(self, only: set[int] | None = None) -> None:
        """Raise the first recorded failure among `only` (default: any) as a PeerError whose rank is
        the failed worker's id (the data links call this at every receive tick)."""
        for pid, why in sorted(self.failed().items()):
            if only is None or pid in only:
                raise (PeerLost if "exited" in why else PeerTimeout)(pid, why, watched=True)

    def _fail(self, rank: int, why: str) -> None:
        with self._guard:
            if rank in self._links and rank not in self._ignored and rank not in self._failed:
                self._failed[rank] = why

    # ---- words to a worker ----

    def tell(self, rank: int, word: dict) -> bool:
        """Send `word` on `rank`'s pulse link; False when it cannot be delivered (gone)."""
        with self._guard:
            link, lock = self._links.get(rank), self._locks.get(rank)
        if link is None or lock is None:
            return False
        try:
            with lock:
                _send(link, word)
                link.flush(time.monotonic() + 2.0)
            return True
        except CommError:
            return False

    def ask(self, pids: list[int], epoch: int, window_s: float, wait_s: float = 2.0) -> dict[int, dict]:
        """Ask `pids` what they saw in `epoch` (Witness.answer); returns the answers that came within
        `wait_s`, by participant id. A worker that does not answer is left out (silence is not an
        accusation of anyone)."""
        with self._guard:
            for p in pids:
                self._saw.pop(p, None)
        asked = [p for p in pids if self.tell(p, {"ask": epoch, "window": window_s})]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._guard:
                if all(p in self._saw for p in asked):
                    break
            time.sleep(0.05)
        with self._guard:
            return {p: self._saw[p] for p in asked if p in self._saw}

    # ---- the thread ----

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._guard:
                links = dict(self._links)
                broken = dict(self._broken)
            by_sock = {
                link.sock: (rank, link)
                for rank, link in links.items()
                if not link.closed and broken.get(rank) is not link
            }
            ready = [by_sock[s] for s in by_sock if by_sock[s][1].has_buffered()]
            if not ready and by_sock:
                try:
                    socks = readable(by_sock, 0.1)
                except (OSError, ValueError):  # a link closed under us: look again
                    continue
                ready = [by_sock[s] for s in socks]
            elif not by_sock:
                self._stop.wait(0.1)
            now = time.monotonic()
            for rank, link in ready:
                with self._guard:  # replaced or forgotten meanwhile: its closing is no news (poll reports it)
                    lock = self._locks.get(rank) if self._links.get(rank) is link else None
                if lock is None:
                    continue
                try:
                    with lock:
                        msg = _recv(link, 2.0)
                    self._seen[rank] = now
                    if isinstance(msg, dict) and isinstance(msg.get("saw"), dict):
                        with self._guard:
                            self._saw[rank] = msg["saw"]
                except Exception as e:  # whatever a peer sends, this thread goes on watching the others
                    with self._guard:
                        current = self._links.get(rank) is link
                        if current:
                            self._broken[rank] = link
                    if not current:  # replaced (its rank rejoined) or forgotten while this read was on
                        continue
                    if link.said is not None:  # it said why as it left
                        self._fail(rank, f"{link.label} exited: {link.said}")
                    else:
                        self._fail(rank, f"{link.label} exited: its connection closed ({e})")
            for rank, link in links.items():
                silent = now - self._seen.get(rank, now)
                if silent > self.deadline_s:
                    self._fail(rank, f"{link.label} sent no heartbeat for {silent:.1f} s: frozen or cut off")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._guard:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
