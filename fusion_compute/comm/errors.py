"""The comm layer's errors. Every one names the peer it is about, so a user reads *which* participant
failed (rank, address, key) instead of a socket error."""

from __future__ import annotations

from ..errors import FusionError


class CommError(FusionError, RuntimeError):
    """A peer vanished, refused us, sent something malformed, or a deadline passed."""


class PeerError(CommError):
    """Something went wrong with one identified peer: `rank` on a link, or, when `watched` (the
    liveness watch saw it), the worker's participant id."""

    def __init__(self, rank: int, message: str, watched: bool = False):
        super().__init__(message)
        self.rank = rank
        self.watched = watched


class PeerLost(PeerError):
    """The peer closed its connection or its process died. `said`: the reason the peer gave as it
    left (its farewell on the link, links.Link.farewell), when it gave one."""

    def __init__(self, rank: int, message: str, watched: bool = False, said: str | None = None):
        super().__init__(rank, message, watched)
        self.said = said


class PeerPoisoned(PeerError):
    """The peer sent a block no honest sender sends: a NaN, an infinity or a value over the bound
    (value_checks.block_fault), which its own check would have refused to send. First-hand evidence
    against the peer: a worker leaves the epoch on it naming the peer (`cause`, links.say_farewell)."""


class PeerOutOfStep(PeerError):
    """The peer sent a data frame stamped with another (epoch, step) than the one this end is in
    (links.py's header; comm.py, "Numbered steps"): a stale or early message, refused before it is
    read as data. Honest ranks count steps alike, so it is first-hand evidence against the sender."""

    def __init__(self, rank: int, label: str, expected: tuple[int, int], got: tuple[int, int]):
        super().__init__(
            rank,
            f"{label} sent a frame of epoch {got[0]} step {got[1]} where epoch {expected[0]} "
            f"step {expected[1]} was expected: out of step",
        )
        self.expected = expected
        self.got = got


class TaintedInputs(CommError):
    """This participant's own block failed the check it is about to send it under (value_checks):
    the inputs it received passed one by one, yet together made it (or it erred itself). Not sent;
    it leaves the epoch saying so (`inputs` in its farewell), which names nobody: runtime/blame.py
    then holds every contributor a suspect."""


class PeerTimeout(PeerError):
    """The peer did not answer within the deadline (frozen, overloaded, or cut off)."""


class PeerLeft(PeerLost):
    """The peer said why before it closed (a farewell frame, links.Link.farewell): an announced close,
    no first-hand evidence against anyone (only the leaver's word). `reason`: what it announced,
    {"why": its error's line (also `said`), "cause": the rank whose link failed it first-hand or None,
    "after": the rank whose own farewell made it leave or None}."""

    def __init__(self, rank: int, message: str, reason: dict):
        super().__init__(rank, message, said=reason.get("why") or "(no reason given)")
        self.reason = reason
