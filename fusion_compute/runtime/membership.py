"""Who takes part in which epoch: recovery from a lost worker, revocation, standbys, and the
removal of a worker caught lying (docs/resilience.md).

`Membership` is a component of the client's engine (`engine.EngineBase` holds one: `engine.members`)
and the one owner of the job's membership state: the roster's `seats` (`Seat`), the current epoch's
participants in rank order (`order`) and its number (`epoch`), how many workers the user asked for
(`wanted`), the epoch changes made (`recoveries`), who may never come back (`removed`), who was caught
lying (`convicted`), the job's ambiguous sets (`suspicions`, counted per worker) and those of them only
a liar makes (`liar_sets`: blame.follows' history), each step's deadline (`clock`: deadline.py) and
the client's own account of whose link it waited on (`waits`).

What it needs of the engine is declared, as `EpochHost` (a Protocol that EngineBase satisfies; mypy
checks it): the job's options, the open epoch's links (`comm`; `wire` raises when none is open), the
liveness watch, the rendezvous (`admission`), the started workers (`procs`, `executor`,
`worker_keys`), the sessions' tokens (`slot_history`, `history`; replayed by `replay_slots`), and the
mode's hooks for an epoch being opened: `plan_epoch` (its plan), `welcome_for`, `hello`,
`spawn_failure`, `group_names`. The engine runs each step through `with_recovery` and `timed_step`,
and refills a short job at a session's start (`refill`); the user's changes (`revoke`,
`add_standby`) and the listing (`workers`, `shortfall`) are reached through the engine's methods of
the same names.

Every change is a new epoch: the survivors (plus a standby in each departed seat, of its group in
masked mode), never fewer than `--min-workers` (TooFewWorkers otherwise: the invariant is not traded
for availability), fresh links, the plan handshake again, then the session's replay (a prefill over
its tokens) when there is one. A worker whose slowness the accounts pin on it (`_judge_slow`) is
handled as a lost one. When the evidence cannot tell two workers apart (blame.py), nobody is barred:
the suspects are set aside for standbys (`_set_aside`) and the job goes on, and a worker that
ambiguity follows (two ambiguous sets sharing only it, of those only a liar can make: sets judged on
waits never count, Verdict.liar_only) is removed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from ..comm import (
    Admission,
    Comm,
    CommError,
    Identity,
    Joined,
    Member,
    PeerError,
    PeerLost,
    PeerTimeout,
    PublicId,
    Recorder,
    Watch,
    Witness,
)
from ..errors import UsageError, WorkerMisbehaved, WorkersSuspected
from ..executor import Executor
from .blame import blame_link, follows
from .deadline import (
    ACCUSE_MIN_S,
    ACCUSE_SHARE,
    CLIENT,
    SlowWorker,
    StepClock,
    StepDeadline,
    StepOverrun,
    Verdict,
    judge,
)
from .engine_options import EngineOptions
from .launch import WorkerProcs

T = TypeVar("T")


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def waits_by_pid(waits: object, ranks: dict[int, int]) -> dict[int, float]:
    """An account's `waits` ({rank: seconds}, the JSON a worker answered on its pulse link, or the
    client's own) by participant id. A peer's account is its word, checked like any input: an entry
    whose rank is not an epoch rank in ASCII digits, or whose seconds are not a finite number at
    least 0, is left out, and so is a `waits` that is not a mapping (a liar's "²", "x", [1] or
    null must not crash the recovery that asked: issue 41's red team)."""
    if not isinstance(waits, dict):
        return {}
    out: dict[int, float] = {}
    for r, s in waits.items():
        if isinstance(r, str) and r.isascii() and r.isdigit():
            r = int(r)
        if type(r) is not int or r not in ranks or type(s) not in (int, float) or not 0 <= s < math.inf:
            continue
        out[ranks[r]] = float(s)
    return out


def waiting_pids(waiting: object, pid: Callable[[object], int | None]) -> list[int]:
    """An account's `waiting` (the ranks it is blocked on now) by participant id: a list of ranks,
    anything else in it (or a `waiting` that is not a list) left out."""
    return [p for p in map(pid, waiting) if p is not None] if isinstance(waiting, list) else []


_CLOSED = (PeerLost, PeerTimeout)  # a link that closed or went silent: whose fault is for the evidence


class TooFewWorkers(CommError):
    """A new epoch would have fewer workers than --min-workers: refused, never traded for availability."""


class SetAside(CommError):
    """Ambiguous evidence: the suspects were set aside for standbys and the next epoch is open (the
    step is replayed there; never seen outside the engine)."""


class UnknownWorker(UsageError):
    """A membership change names a participant the job does not have."""


@dataclass(frozen=True)
class Seat:
    """A worker of the roster, for the life of the job."""

    pid: int  # participant id: its rank in the first epoch (standbys come after the active workers)
    capacity: float = 1.0
    group: str | None = None  # "A" / "B" (masked mode)
    standby: bool = False


class EpochHost(Protocol):
    """What `Membership` needs of the engine that holds it (engine.EngineBase). The engine owns the
    links, the workers it started and the sessions; membership decides who is in each epoch."""

    opts: EngineOptions
    comm: Comm | None  # the open epoch's links; None while no epoch is open (a change failed)
    recorder: Recorder | None  # the audit's recorder, handed to each epoch's links
    worker_info: list[dict[str, Any]]  # the epoch's HELLO replies (JSON)
    watch: Watch  # liveness: every worker's pulse link, the standbys' too
    procs: WorkerProcs | None  # the workers the executor started (None: listed workers)
    executor: Executor
    worker_keys: dict[int, Identity]  # started workers' keys (a spawned standby's is added here)
    slot_history: dict[int, list[int]]  # each open session's tokens, per KV slot

    @property
    def admission(self) -> Admission: ...  # the job's rendezvous: who may join which epoch

    @property
    def history(self) -> list[int]: ...

    @property
    def wire(self) -> Comm: ...

    def group_names(self) -> tuple[str, ...] | None: ...

    def plan_epoch(self, order: list[int]) -> None: ...

    def hello(self, deadline: float, order: list[int]) -> list[dict[str, Any]]: ...

    def welcome_for(self, member: Member) -> dict[str, Any]: ...

    def spawn_failure(self) -> str | None: ...

    def replay_slots(self, new: dict[int, list[int]]) -> int: ...


class Membership:
    """Epoch changes of a job, and the membership state they change (the module docstring)."""

    def __init__(self, host: EpochHost, seats: dict[int, Seat], clock: StepClock):
        """`seats`: every worker of the roster; the first epoch is those that are not standbys."""
        self.host = host
        self.seats = seats
        self.order = [s.pid for s in seats.values() if not s.standby]  # the current epoch
        self.wanted = len(self.order)  # the workers the user asked for: a smaller job says so (shortfall)
        self.epoch = 0
        self.clock = clock  # each step's deadline
        self.waits = Witness()  # the client's own account: which worker's message it waited for
        self.recoveries: list[dict[str, Any]] = []  # one record per epoch change after start-up (JSON)
        self.removed: set[int] = set()  # revoked, or lost and replaced: never admitted again
        self.convicted: set[int] = set()  # caught returning wrong results: out at the first chance
        self.suspicions: list[frozenset[int]] = []  # the job's ambiguous verdicts (counted per worker)
        self.liar_sets: list[frozenset[int]] = []  # those only a liar makes (Verdict.liar_only): blame.follows' history

    @property
    def opts(self) -> EngineOptions:
        """The job's options (the engine's)."""
        return self.host.opts

    def with_recovery(self, step: Callable[[], T], replay: Callable[[], T] | None = None) -> T:
        """Run `step` on the open epoch; on a lost worker, a caught liar or suspects, change the epoch
        and run `replay` (or `step` again) there: as many retries as the roster has seats, then a
        CommError. A caught liar's request fails (WorkerMisbehaved) after its removal."""
        if self.host.comm is None:  # the last epoch change failed: open one over who is left before any work
            self._reopen()
            if replay is not None:
                return self.with_recovery(replay)
        if self.convicted & set(self.order):
            self._replace_convicted()  # a liar that could not be replaced before: no work until it is
        if self.host.watch.failure() is not None and set(self.host.watch.failed()) & set(self.order):
            self.recover(None)  # noticed while idle
            if replay is not None:
                return self.with_recovery(replay)
        for attempt in range(len(self.seats) + 1):
            try:
                return step() if attempt == 0 else (replay or step)()
            except SetAside:
                pass  # the next epoch is open: replay there
            except PeerError as e:
                self.recover(e)
            except WorkerMisbehaved as e:
                self._expel(e)
                raise
            except WorkersSuspected as e:
                self._suspected(e)  # set aside (then the replay) or, followed before, removed (raises)
        raise CommError("gave up after as many recoveries as there are workers")

    def _suspected(self, err: WorkersSuspected) -> None:
        """A check of the client's failed and the evidence cannot tell which worker made it
        (WorkersSuspected): the suspects are set aside for standbys and the next epoch is open (the
        step is replayed there); a suspect that ambiguity has followed before is removed as a liar
        (WorkerMisbehaved: its request fails); with no way to spare one, the request fails
        (StepDeadline), nobody removed."""
        t0, noticed = time.perf_counter(), time.time()
        suspects = tuple(p for p in err.pids if p in self.order)
        verdict = Verdict(None, suspects, _first_line(err), liar_only=True)  # values no honest epoch makes
        convicted = self._ambiguous(verdict, "the client's check failed", noticed, t0)
        if convicted is not None:
            caught = WorkerMisbehaved(
                f"{_first_line(err)}; ambiguity followed worker {convicted}",
                [convicted],
                reason="a suspect of two ambiguous verdicts that share nobody else (blame.follows)",
            )
            self._expel(caught)
            raise caught

    def _expel(self, err: WorkerMisbehaved) -> None:
        """Workers caught lying: the session is over (its request fails, nothing of it is replayed)
        and they leave the job now, replaced by standbys where there are any."""
        self.host.slot_history = {}
        self.opts.log(f"{err}: removing {'them' if len(err.pids) > 1 else 'it'} from the job")
        self.convicted |= set(err.pids) & set(self.order)
        try:
            self._replace_convicted(err.reason)
        except TooFewWorkers as e:
            raise TooFewWorkers(f"{err}; and {e}") from err

    def _replace_convicted(self, reason: str = "returned a wrong product (caught by the check)") -> None:
        """End the epoch the liars were part of and open the next one without them (refused, with
        the job waiting for a replacement, when that would leave too few)."""
        gone = self.convicted & set(self.order)
        t0, noticed = time.perf_counter(), time.time()
        if self.host.comm is not None:  # the abandoned step's epoch is over, whatever comes next
            self._retire(gone)
        for pid in gone:
            self._await_spare(self.seats[pid].group, time.monotonic() + self.opts.join_timeout_s)
        order = self._next_order(gone, why="removing the worker that lied leaves")
        self._switch_epoch(order)
        self.recoveries.append(self._record(gone, order, reason, noticed, t0, replayed_tokens=0))

    def recover(self, err: PeerError | None) -> None:
        """Open the next epoch without the failed workers (replaced by standbys where there are
        any), or raise when that would leave too few. `err`: the failure a data link reported."""
        if not self.opts.recover:
            raise err or CommError("a worker failed")
        t0, noticed = time.perf_counter(), time.time()
        # Who failed is the watch's call: when one worker dies, its peers drop the epoch and close their
        # links too, so a link error alone does not say whose fault it was. Wait for the watch to see a
        # failure (a dead pulse is seen at once, a silent one after --liveness); a link error nobody's
        # pulse explains by then is judged by the workers' own accounts (_blame), not by the link alone.
        deadline = time.monotonic() + self.opts.liveness_s + 1.0
        accounts = None  # the workers' accounts, when they named whom to remove (_blame)
        failed = {p for p in self.host.watch.failed() if p in self.order}
        while not failed and time.monotonic() < deadline and not (err is not None and err.watched):
            time.sleep(0.05)
            failed = {p for p in self.host.watch.failed() if p in self.order}
        time.sleep(0.2)  # a second process that went down with the first one shows up now
        failed |= {p for p in self.host.watch.failed() if p in self.order}
        if err is not None and err.watched:
            failed.add(err.rank)
        elif not failed and err is not None and 1 <= err.rank <= len(self.order) and not isinstance(err, _CLOSED):
            # a malformed message (wrong size, bad header) the worker itself sent the client on its own
            # authenticated link: the client's first-hand evidence, no one else's account needed
            failed.add(self.order[err.rank - 1])
            accounts = f"{_first_line(err)} (seen by the client itself)"
        elif not failed and err is not None and 1 <= err.rank <= len(self.order):
            blamed, verdict = self._blame(self.order[err.rank - 1])
            link = f"the link to worker {self.order[err.rank - 1]} failed ({_first_line(err)})"
            if blamed:
                failed |= blamed
                accounts = f"{link}; by the evidence ({verdict.said})"
                self.opts.log(f"{accounts}: blaming worker{'s' if len(blamed) > 1 else ''} {sorted(blamed)}")
            elif len(verdict.causes) >= 2:
                try:
                    convicted = self._ambiguous(verdict, link, noticed, t0)
                except StepDeadline as e:  # nobody could be spared: this epoch is over all the same
                    self._retire(set())
                    raise CommError(str(e)) from err
                if convicted is None:
                    return  # set aside: the next epoch is open
                failed.add(convicted)
                accounts = f"{link}; ambiguity followed worker {convicted} ({verdict.said})"
            else:
                self.opts.log(f"{link}; the evidence names nobody ({verdict.said}): nobody is removed")
                self._retire(set())  # this epoch is over; the next request opens one over the same workers
                raise err
        if not failed:
            raise err or CommError("a worker failed")
        reason = accounts or self._loss_reason(failed, err)
        # a local spare still starting up (a failure early in the job) is worth the wait
        if self.host.procs is not None:
            for p in sorted(failed):
                self._await_spare(self.seats[p].group, time.monotonic() + self.opts.join_timeout_s)
        lost = f"worker{'s' if len(failed) > 1 else ''} {sorted(failed)} lost ({reason})"
        try:
            order = self._next_order(failed)
        except TooFewWorkers as e:  # say why they were lost too: the usual cause is in their own error
            raise TooFewWorkers(f"{lost}; {e}") from err
        self.opts.log(f"{lost}; epoch {self.epoch + 1} over {order}")
        self._retire(failed)
        self._switch_epoch(order)
        self.recoveries.append(self._record(failed, order, reason, noticed, t0, replayed_tokens=len(self.host.history)))

    def _blame(self, suspect: int) -> tuple[set[int], Verdict]:
        """Who to remove when a data link failed (`suspect`: the worker whose link the client was
        reading) and every pulse still beats: the evidence decides, never the link alone (blame.py).
        Each worker of the epoch is asked what it saw (liveness.Witness); the client adds its own:
        what its link to each worker says (left, with the reason it gave; closed; open), whose step
        output it was still owed when the link failed, and whom alone it waited for."""
        order, window = self.order, self.opts.timeout_s
        ranks = {rank: pid for rank, pid in enumerate(order, start=1)}

        def pid(r: object) -> int | None:
            return CLIENT if r == 0 else ranks.get(r) if isinstance(r, int) else None

        def by_pid(waits: object) -> dict[int, float]:
            return waits_by_pid(waits, ranks)

        def ask() -> dict[int, dict[str, Any]]:
            return {
                q: {
                    "lost": pid(a.get("lost")),
                    "after": pid(a.get("after")),
                    "waits": by_pid(a.get("waits")),
                    "waiting": waiting_pids(a.get("waiting"), pid),
                    "working": a.get("working") is True,
                }
                for q, a in self.host.watch.ask(order, self.epoch, window).items()
                if a.get("epoch") == self.epoch
            }

        def departures() -> dict[int, tuple[str, dict[str, Any] | None]]:
            return {
                ranks[r]: (
                    state,
                    None if why is None else {**why, "cause": pid(why["cause"]), "after": pid(why["after"])},
                )
                for r, (state, why) in comm.departures().items()
                if r in ranks
            }

        comm = self.host.wire
        owed = {ranks[r] for r in comm.awaiting if r in ranks}
        answered: set[int] = set()  # delivered its step's output after all (it came since)

        def look() -> dict[int, tuple[str, dict[str, Any] | None]]:
            seen = departures()
            answered.update(p for p, (state, _) in seen.items() if state == "sent")
            return seen

        accounts, seen = ask(), look()
        # An accused worker that owes its step, stays, and says it is computing (waiting on no peer)
        # gets what any peer would give it: the per-message timeout, to finish, leave or wait on
        # someone (an honest one does one of them long before); then its silence is the evidence.
        until = time.monotonic() + self.opts.timeout_s
        while time.monotonic() < until and any(
            accounts.get(p, {}).get("working") and not accounts[p]["waiting"] and seen.get(p, ("open",))[0] == "open"
            for p in owed - answered
            if any(a.get("lost") == p for a in accounts.values())
        ):
            time.sleep(0.25)
            accounts, seen = ask(), look()
        blocked = {CLIENT: by_pid(self.waits.answer(self.epoch, window)["waits"])}
        blocked.update({q: a["waits"] for q, a in accounts.items()})
        return blame_link(accounts, seen, order, owed - answered, blocked, max(window / 4, ACCUSE_MIN_S))

    def _ambiguous(self, verdict: Verdict, what: str, noticed: float, t0: float) -> int | None:
        """Evidence that cannot tell `verdict.causes` apart. The worker ambiguity has followed before
        (blame.follows, over the `liar_only` sets alone: `liar_sets`) is returned, to be removed; else
        the suspects are set aside for standbys, none barred, and the next epoch opens (None); else (no
        way to keep the job running without them) the request fails: StepDeadline, nobody removed. A
        set judged on waits (not `liar_only`: it can be two honest workers on a loaded machine) is
        counted in `suspicions` and set aside, but neither names anyone nor is remembered for `follows`."""
        convicted = None
        if verdict.liar_only:
            convicted = follows(self.liar_sets, verdict.causes)
            self.liar_sets.append(frozenset(verdict.causes))
        self.suspicions.append(frozenset(verdict.causes))
        why = f"the evidence is ambiguous between workers {list(verdict.causes)} ({verdict.said})"
        if convicted is not None:
            self.opts.log(f"{what}; {why}; worker {convicted} was a suspect before with another: it is the cause")
            return convicted
        if self._set_aside(verdict.causes, f"{what}; {why}", noticed, t0):
            return None
        self.opts.log(f"{what}; {why}: nobody is removed on one side's word; the request fails")
        raise StepDeadline(f"{what}; {why}: nobody is removed on one side's word (add a standby to keep serving)")

    def _set_aside(self, causes: tuple[int, ...], why: str, noticed: float, t0: float) -> bool:
        """Open the next epoch without as many of `causes` as standbys (or the floor) allow, the first
        ones first: they become standbys themselves (told to wipe; none barred). False when not even
        one can be spared."""
        if self.host.procs is not None:  # a local spare still starting up is worth the wait
            for p in causes:
                self._await_spare(self.seats[p].group, time.monotonic() + self.opts.join_timeout_s)
        for k in range(len(causes), 0, -1):
            aside = set(causes[:k])
            try:
                order = self._next_order(aside, why="setting the suspects aside leaves")
            except TooFewWorkers:
                continue
            break
        else:
            return False
        self.opts.log(
            f"{why}: setting aside worker{'s' if k > 1 else ''} {sorted(aside)} (not barred); epoch {self.epoch + 1} over {order}"
        )
        self._retire(set())
        for p in aside:
            self.host.watch.tell(p, {"abort": self.epoch, "bench": True})
            self.seats[p] = replace(self.seats[p], standby=True)
        self._switch_epoch(order)
        record = self._record(set(), order, why, noticed, t0, replayed_tokens=len(self.host.history))
        record["set_aside"] = sorted(aside)
        self.recoveries.append(record)
        return True

    # ---- slow steps (deadline.py) ----

    def timed_step(self, step: Callable[[], T], tokens: int) -> T:
        """Run one step (`tokens`: its ΣT) against its deadline: a step over it earns strikes, and
        once they are due (or the step is cut at its limit) the slowness is judged (`_judge_slow`)."""
        self.clock.start(tokens)
        try:
            out = step()
        except StepOverrun:
            self.clock.stop(cut=True)
            self._judge_slow(cut=True)
            raise  # (not reached: the judgement raises)
        except BaseException:
            self.clock.abandon()
            raise
        self.clock.stop()
        if self.clock.due():
            self._judge_slow(cut=False)
        return out

    def _judge_slow(self, cut: bool) -> None:
        """Steps over their deadline: ask the workers' accounts and weigh them with the client's own
        (deadline.judge). One consistent cause: SlowWorker, which `with_recovery` treats as a lost
        worker (a new epoch without it, then the replay). Otherwise StepDeadline: the request fails
        with the accounts in one line, and nobody is removed on one side's word. Always raises."""
        clock = self.clock
        struck = clock.struck()
        slow_s = sum(s.seconds for s in struck)
        window = time.monotonic() - min(s.started for s in struck) + 0.5
        ranks = {rank: pid for rank, pid in enumerate(self.order, start=1)}

        def by_pid(waits: object) -> dict[int, float]:
            return waits_by_pid(waits, ranks)

        blocked = {CLIENT: by_pid(self.waits.answer(self.epoch, window)["waits"])}
        for pid, answer in self.host.watch.ask(self.order, self.epoch, window).items():
            if answer.get("epoch") == self.epoch:
                blocked[pid] = by_pid(answer.get("waits"))
        verdict = judge(blocked, self.order, max(ACCUSE_MIN_S, ACCUSE_SHARE * slow_s))
        what = f"{clock.summary()}{'; the last one cut at its limit' if cut else ''}"
        clock.forgive()
        if verdict.named is not None:
            self.opts.log(f"{what}; by the accounts ({verdict.said}): worker {verdict.named} is the cause")
            raise SlowWorker(verdict.named, f"made steps slow: {what}; by the accounts ({verdict.said})")
        if len(verdict.causes) >= 2:
            t0, noticed = time.perf_counter(), time.time()
            if cut:
                self._retire(set())  # the cut step's messages are still on the way: this epoch is over
            convicted = self._ambiguous(verdict, what, noticed, t0)
            if convicted is None:
                raise SetAside(what)  # the next epoch is open: the step is replayed there
            raise SlowWorker(convicted, f"made steps slow: {what}; ambiguity followed it ({verdict.said})")
        if cut:  # the cut step's messages are still on the way: this epoch is over (the next request opens one)
            self._retire(set())
        why = f"the accounts name no worker ({verdict.said}): nobody is removed"
        self.opts.log(f"{what}; {why}; the request fails")
        raise StepDeadline(f"{what}; {why}")

    # ---- the job's size: refilled, never shrunk silently ----

    def shortfall(self) -> str | None:
        """None when the current epoch has as many workers as the user asked for (--workers); else
        what the job runs on, in words: "running 2 of 3 workers (1 removed in this job, ...)", for
        /health, the control page and a log line per request (docs/resilience.md, "Never shrunk
        silently")."""
        wanted, running = self.wanted, len(self.order)
        if running >= wanted:
            return None
        aside = sorted({p for r in self.recoveries for p in r.get("set_aside", ())} - set(self.order) - self.removed)
        bits = [f"{len(self.removed)} removed in this job"] + ([f"{len(aside)} set aside"] if aside else [])
        return f"running {running} of {wanted} workers ({', '.join(bits)}; add a standby to refill)"

    def refill(self) -> None:
        """Seats left empty (set aside, removed or lost with no standby to take them) are filled again
        as soon as a standby is there (one added since, or a worker set aside, which bars nobody): at a
        session's start, with nothing to replay, the job grows back toward the workers the user
        asked for. A failed opening leaves no epoch (the step's `with_recovery` opens one)."""
        wanted = self.wanted
        if self.host.comm is None or len(self.order) >= wanted or self.host.group_names() is not None:
            return  # (masked jobs keep their groups' own standbys: `_next_order`)
        spares = self._alive_spares()
        if not spares:
            return
        take = spares[: wanted - len(self.order)]
        order = self.order + take
        t0, noticed = time.perf_counter(), time.time()
        why = f"the job ran {len(self.order)} of {wanted} workers: standby {take} take the empty seats"
        self.opts.log(f"{why}; epoch {self.epoch + 1} over {order}")
        self._retire(set())
        try:
            self._switch_epoch(order)
        except CommError:
            return  # logged by _abandon; the step opens an epoch over who is left
        record = self._record(set(), order, why, noticed, t0, replayed_tokens=0)
        record["refilled"] = take
        self.recoveries.append(record)

    # ---- membership, by the user ----

    def workers(self) -> list[dict[str, Any]]:
        """Every participant: id, rank in the current epoch (None for a spare), group, capacity, and
        state: active, standby, failed (its pulse stopped) or removed (revoked or replaced)."""
        failed, watched = self.host.watch.failed(), set(self.host.watch.ranks)
        out = []
        for pid, seat in sorted(self.seats.items()):
            rank = self.order.index(pid) + 1 if pid in self.order and pid not in self.removed else None
            if pid in self.removed:
                state = "removed"
            elif pid in failed:
                state = "failed"
            elif rank is not None:
                state = "active"
            else:
                state = "standby" if pid in watched else "standby (not joined)"
            member = self.host.admission.roster.get(pid)
            out.append(
                {
                    "id": pid,
                    "rank": rank,
                    "group": seat.group,
                    "capacity": seat.capacity,
                    "state": state,
                    "where": member.label() if member else None,
                    # ambiguous verdicts it was a suspect in (set aside, not barred): the user's cue
                    "suspected": sum(pid in s for s in self.suspicions),
                }
            )
        return out

    def _fixed_world(self, what: str) -> None:
        if self.opts.mpi_world:
            raise UnknownWorker(
                f"cannot {what}: the workers share one mpiexec world, whose members are fixed "
                "(--comm-backend mpi across hosts)"
            )

    def revoke(self, pid: int, replay: bool = True) -> None:
        """Remove a participant now: it is told to wipe and leave, it may never rejoin, and the
        session (if one is open) is replayed on the next epoch, with a standby in its place when
        there is one. Refused, session unharmed, when it would leave fewer than --min-workers.
        `replay=False`: open the next epoch only; the caller replays (the audit runner does, inside a
        recorded step: `reset()` then `forward(history)`)."""
        if pid not in self.seats or pid in self.removed:
            live = [str(p) for p in self.seats if p not in self.removed]
            raise UnknownWorker(f"no worker {pid} to revoke (workers: {', '.join(live)})")
        self._fixed_world("revoke a worker")
        if pid not in self.order:  # a standby: nothing to re-plan
            self._retire({pid}, epoch_over=False)
            return
        order, leaving = self._revocation(pid)
        t0, noticed = time.perf_counter(), time.time()
        self._retire(leaving)
        self._switch_epoch(order)
        record = self._record({pid}, order, f"worker {pid} revoked by the user", noticed, t0, replayed_tokens=0)
        record["revoked"] = [pid]
        if self.host.slot_history and replay:  # the open sessions move to the new epoch now, each in its slot
            t1 = time.perf_counter()
            record["replayed_tokens"] = self.host.replay_slots({})
            record["replay_s"] = round(time.perf_counter() - t1, 3)
        else:
            record["replayed_tokens"] = sum(len(h) for h in self.host.slot_history.values())
        self.recoveries.append(record)

    def _revocation(self, pid: int) -> tuple[list[int], set[int]]:
        """The next epoch's order without `pid` (a standby in its seat when one can join), and who
        leaves: `pid`. (The audit's keep-revoked control replaces this at start-up: audit/inject.py.)"""
        self._await_spare(self.seats[pid].group, time.monotonic() + self.opts.join_timeout_s)
        return self._next_order({pid}, why="revoking it would leave"), {pid}

    def add_standby(self, key: PublicId | None = None, host: str | None = None, group: str | None = None) -> int:
        """Enroll one more participant as a standby; returns its id. Local runs spawn it (a fresh
        key); otherwise the user names its public key (and host), and starts it there with
        `fusion worker --master ... --client-key ... --key ...`. Migration = add, then revoke."""
        self._fixed_world("add a standby")
        pid = max(self.seats) + 1
        capacity = min(s.capacity for s in self.seats.values())
        names = self.host.group_names()
        if names is not None and group not in names:
            raise UnknownWorker(f"a masked job's standby needs its group: {' or '.join(names)}")
        if names is None and group is not None:
            raise UnknownWorker("groups are for masked jobs only")
        if self.opts.is_local:
            if key is not None:
                raise UnknownWorker("a local run spawns its own workers: add takes no key")
            ident = Identity.new() if not self.opts.insecure else None
            member = Member(pid, self.host.executor.member_host, ident.public if ident else None, group, None, True)
            if ident is not None:
                self.host.worker_keys[pid] = ident
        else:
            if key is None and not self.opts.insecure:
                raise UnknownWorker("name the new worker's public key (fc1....): the user decides who takes part")
            member = Member(pid, host or "", key if not self.opts.insecure else None, group, None, True)
        self.host.admission.enroll(member)
        self.seats[pid] = Seat(pid, capacity, group, standby=True)
        if self.opts.is_local and (procs := self.host.procs) is not None:  # (a local job's always is)
            procs.spawn(pid)
        return pid

    def _await_spare(self, group: str | None, deadline: float) -> None:
        """When a standby of `group` was enrolled but has not joined yet (just added), wait for it."""

        def pending() -> set[int]:
            return {
                p
                for p, s in self.seats.items()
                if s.standby
                and s.group == group
                and p not in self.order
                and p not in self.removed
                and p not in self.host.watch.ranks
                and p not in self.host.watch.failed()
            }

        def ready() -> bool:
            return any(
                s.standby
                and s.group == group
                and p not in self.order
                and p in self.host.watch.ranks
                and p not in self.host.watch.failed()
                for p, s in self.seats.items()
            )

        while (waiting := pending()) and not ready() and time.monotonic() < deadline:
            if self.host.procs is not None and waiting <= {rank for rank, _ in self.host.procs.failures}:
                break  # the local spares that have not joined died before joining: they will not come
            time.sleep(0.1)

    def _loss_reason(self, failed: set[int], err: PeerError | None) -> str:
        """Why each failed worker was lost: a local process's own last error where it exited (what
        went wrong), else what the watch saw (its connection closed, its heartbeat stopped)."""
        seen = self.host.watch.failed()
        why = []
        for p in sorted(failed):
            exited = self.host.procs.exit_reason(p) if self.host.procs is not None else None
            if exited is not None:
                why.append(exited)
            elif p in seen:
                why.append(seen[p])
        return "; ".join(why) or str(err)

    def _alive_spares(self) -> list[int]:
        """Standbys outside the epoch that are joined, alive and not removed: who may take a seat."""
        return [
            p
            for p, s in self.seats.items()
            if s.standby
            and p not in self.order
            and p in self.host.watch.ranks
            and p not in self.host.watch.failed()
            and p not in self.removed
        ]

    def _next_order(self, failed: set[int], why: str = "refusing to continue with") -> list[int]:
        failed = set(failed) | {p for p in self.order if p in self.removed}  # a failed epoch change's leftovers
        alive_spares = self._alive_spares()
        order = []
        for p in self.order:
            if p not in failed:
                order.append(p)
                continue
            spare = next((q for q in alive_spares if self.seats[q].group == self.seats[p].group), None)
            if spare is not None:
                alive_spares.remove(spare)
                order.append(spare)
        if len(order) < self.opts.floor:
            raise TooFewWorkers(
                f"{why} {len(order)} worker{'s' if len(order) != 1 else ''}: fewer than "
                f"--min-workers {self.opts.floor} (no standby left to take its place; one worker "
                "alone would hold the whole state)"
            )
        missing = [g for g in self.host.group_names() or () if g not in {self.seats[p].group for p in order}]
        if missing:
            raise TooFewWorkers(f"{why} no worker in group {missing[0]}: a masked epoch needs every group")
        return order

    def _retire(self, gone: set[int], epoch_over: bool = True) -> None:
        """The `gone` workers may never come back (told to wipe and leave); when the epoch is over,
        the others drop its links."""
        for p in gone:
            self.host.admission.remove(p)
            self.removed.add(p)
            if self.host.procs is not None:
                self.host.procs.retired.add(p)
            self.host.watch.tell(p, {"revoke": self.epoch})
            self.host.watch.forget(p)
        if not epoch_over:
            return
        for p in self.order:
            if p not in gone:
                self.host.watch.tell(p, {"abort": self.epoch})
        if self.host.comm is not None:
            self.host.comm.close(grace_s=0)
            self.host.comm = None

    def _switch_epoch(self, order: list[int]) -> None:
        """Open the next epoch over `order` (the previous one already retired): membership, order,
        plan, comm and the watch's scope move forward together, or the engine is left with no open
        epoch (`comm` None) that the next request, revocation or addition opens anew.

        On failure the epoch number stays spent (an epoch is never reused: a late JOIN for it is
        answered as a standby's), the epoch's links are closed, every worker that joined is told to
        abort (it waits for the next word; worker.run), and a worker that was told to join but never
        did while still beating is removed from the job: it cannot hold every later epoch hostage.
        `order` becomes the attempted epoch's, so the next one keeps each seat's place (masked
        groups) and fills the vacated ones with standbys (`_next_order` skips removed workers)."""
        self.epoch += 1
        self.clock.forgive()  # the last epoch's slow steps are not this one's
        try:
            self.host.plan_epoch(order)
            self.host.worker_info = self.open_epoch(order, time.monotonic() + self.opts.join_timeout_s)
        except BaseException as e:
            self._abandon(order, e)
            raise
        self.order = order

    def _abandon(self, order: list[int], err: BaseException) -> None:
        """The epoch being opened over `order` failed (`err`): leave no half-open epoch behind."""
        if self.host.comm is not None:
            self.host.comm.close(grace_s=0)
            self.host.comm = None
        stuck = {p for p in getattr(err, "missing", ()) if p in order}
        self.order = order
        for p in order:
            if p not in stuck:
                self.host.watch.tell(p, {"abort": self.epoch})
        if stuck:
            self._retire(stuck, epoch_over=False)
        why = (
            f"; removed worker{'s' if len(stuck) > 1 else ''} {', '.join(map(str, sorted(stuck)))} from the job"
            if stuck
            else ""
        )
        self.opts.log(
            f"epoch {self.epoch} over {order} did not open ({_first_line(err)}){why}; "
            "the next request opens a new epoch"
        )
        if isinstance(err, CommError) and not isinstance(err, TooFewWorkers):
            err.args = (f"epoch {self.epoch} over {order} did not open: {_first_line(err)}{why}",)

    def _reopen(self) -> None:
        """No epoch is open (the last change failed): open one over the workers still alive, each
        departed seat taken by a standby where there is one (one added since, too)."""
        failed = self.host.watch.failed()
        gone = {p for p in self.order if p in self.removed or p in failed or p in self.convicted}
        t0, noticed = time.perf_counter(), time.time()
        for p in sorted(gone):
            self._await_spare(self.seats[p].group, time.monotonic() + self.opts.join_timeout_s)
        order = self._next_order(gone, why="reopening the job would leave")
        self._retire(gone - self.removed, epoch_over=False)
        self.opts.log(f"no open epoch: epoch {self.epoch + 1} over {order}")
        self._switch_epoch(order)
        self.recoveries.append(
            self._record(
                gone, order, "the previous epoch change failed", noticed, t0, replayed_tokens=len(self.host.history)
            )
        )

    def _record(
        self, lost: set[int], order: list[int], reason: str, noticed: float, t0: float, replayed_tokens: int
    ) -> dict[str, Any]:
        """The record of an epoch change just made (engine.recoveries, the JSON's `recoveries`)."""
        return {
            "epoch": self.epoch,
            "lost": sorted(lost),
            "order": order,
            "reason": reason,
            "noticed_unix": round(noticed, 3),
            "epoch_s": round(time.perf_counter() - t0, 3),
            "replayed_tokens": replayed_tokens,
        }

    def open_epoch(self, order: list[int], deadline: float) -> list[dict[str, Any]]:
        """Admit, link and greet the epoch's workers; returns their HELLO info."""
        adm = self.host.admission
        adm.expect(self.epoch, order)
        if self.epoch > 0:
            for p in order:
                self.host.watch.tell(p, {"join": self.epoch})
        joined = adm.collect(order, deadline, abort=self.host.spawn_failure if self.epoch == 0 else lambda: None)
        if self.opts.mpi_world and self.epoch == 0:  # the world mpiexec started: the first epoch's order
            misplaced = out_of_world_order(order, joined)
            if misplaced:
                adm.refuse(joined, misplaced)
                raise CommError(misplaced)
        links = adm.welcome(self.epoch, order, joined, deadline, self.host.welcome_for)
        self.waits.start(self.epoch)  # the client's own account: which worker alone it waited for (comm.Comm)
        self.host.comm = Comm(
            0,
            len(order),
            links,
            timeout_s=self.opts.timeout_s,
            recorder=self.host.recorder,
            backend=self.opts.comm_backend,
            witness=self.waits,
            epoch=self.epoch,
        )
        active = set(order)

        def check() -> None:  # at every receive tick: a lost worker ends any wait, so does a step's limit
            self.host.watch.check(only=active)
            self.clock.check()

        for link in links.values():
            link.check = check
        return self.host.hello(deadline, order)


def out_of_world_order(order: list[int], joined: dict[int, Joined]) -> str | None:
    """Why workers that mpiexec started together cannot be the job's first epoch, or None: the worker
    at position i of `order` (from 0; the topology's order) must be mpiexec's rank i in a world of
    len(order), and each said what mpiexec made it when it joined (rendezvous.launched_rank). Every
    misplaced worker is named, before any of them opens MPI; one that said nothing (a launcher that
    sets no rank in the environment) is left to its own check when it does (MpiFabric._world). Only
    the first epoch's order is the world's: a later, smaller one is not compared with it here."""
    wrong = []
    for i, pid in enumerate(order):
        j = joined[pid]
        if j.launched is not None and j.launched != (i, len(order)):
            rank, size = j.launched
            wrong.append(f"{j.member.label()} is rank {rank} of {size}, not {i} of {len(order)}")
    if not wrong:
        return None
    return (
        f"mpiexec started the workers in another order than the topology's: {'; '.join(wrong)}; start "
        "exactly the topology's workers, in its order (mpiexec's host file in that order)"
    )
