"""The engine's queue: callers submit, one engine thread runs jobs in order and reports each job's
events. Up to `max_batch` requests (`fusion serve --max-batch B`) decode together, joining and
leaving the batch between steps (batching.BatchRunner); `max_batch` 1 is the same loop with room for
one, so a request runs alone from start to end. Membership changes (the admin endpoint) run on the
same thread, between requests (after a running batch drains), through `call`.

Errors: a request that fails for its own reasons (a bad value that got past the checks: 400; anything
else: 500) fails alone; in a batch, an error during a step fails every request of that step. A
worker caught returning a wrong product (masked mode's check) fails the request with 502 before any token comes from it; the engine removes the worker (a standby takes its
seat) and the next request runs without it. A lost worker the engine could not replace (comm.CommError: too few workers
left, no standby) fails the request with 503 and marks the engine *degraded*; the gateway stays up
and the next request tries again (the engine recovers as soon as it can: a standby joined, a
worker added). `/health` says `ok` or `degraded` (with the reason).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .gateway import DEFAULT_MAX_QUEUE, ApiError, Gateway, Request, unavailable

JobEvent = tuple[str, Any]  # ("delta", str) | ("done", Outcome) | ("error", ApiError)


@dataclass
class Job:
    req: Request | None
    on_event: Callable[[JobEvent], object]  # called on the engine thread; must not block; its result is ignored
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_enqueued: float = field(default_factory=time.perf_counter)
    t_started: float | None = None
    ahead: int = 0  # requests ahead of it when it arrived (waiting, plus the running one)
    work: Callable[[], Any] | None = None  # an engine call instead of a request (Scheduler.call)

    @property
    def request(self) -> Request:
        """The request of a request job (submit); a membership call's job (Scheduler.call) has none."""
        if self.req is None:
            raise RuntimeError("a membership call's job (Scheduler.call) carries no request")
        return self.req


def one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0]


class Scheduler:
    """FIFO: callers submit, one engine thread runs jobs in order and reports each job's events."""

    def __init__(
        self,
        gateway: Gateway,
        max_queue: int = DEFAULT_MAX_QUEUE,
        log: Callable[[str], None] = print,
        max_batch: int = 1,
    ):
        self.gateway = gateway
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.log = log
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = False  # a job (a membership call, or at least one request) is on the engine
        self.batch: dict[int, tuple[Job, Any]] = {}  # slot -> (job, its Answer)
        self.degraded: str | None = None  # why the last request could not run (a lost worker not replaced)
        self.stopping = False
        self.served = 0
        from ..generation.batching import BatchRunner

        # refused here, not in the engine thread
        self.runner = BatchRunner(gateway.engine, max_batch, speculator=gateway.speculator)
        self._logged_epochs: set[int] = set()
        self._thread = threading.Thread(target=self._loop, name="fusion-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request, on_event: Callable[[JobEvent], object]) -> Job:
        with self._lock:
            if self.stopping:
                raise unavailable("the engine is unavailable: shutting down")
            if self.waiting >= self.max_queue:
                raise ApiError(
                    429,
                    f"{self.waiting} requests are already waiting; retry later",
                    code="queue_full",
                    kind="rate_limit_error",
                )
            job = Job(req, on_event, ahead=self.waiting + max(int(self.running), len(self.batch)))
            self.waiting += 1
            self._q.put(job)
        return job

    def _send(self, job: Job, event: JobEvent) -> None:
        try:
            job.on_event(event)
        except Exception:  # the caller's side is gone (e.g. its event loop closed): stop generating for it
            job.cancelled.set()

    def _failure(self, e: Exception) -> ApiError:
        """The answer for a request that failed with `e` (logged; a lost worker also marks the engine degraded)."""
        from ..comm import CommError
        from ..errors import InputError, UsageError, WorkerMisbehaved
        from ..runtime.deadline import StepDeadline

        if isinstance(e, StepDeadline):  # steps over their bound that no one's evidence pins on one worker
            self.log(f"fusion serve: request failed: {one_line(e)}")
            return unavailable(f"the request's steps overran their deadline: {one_line(e)}")
        # a lost worker the engine could not replace: this request fails, the gateway stays
        if isinstance(e, CommError):
            self.degraded = one_line(e)
            self.log(f"fusion serve: degraded: {self.degraded}")
            return unavailable(f"the engine lost a worker it could not replace: {self.degraded}")
        if isinstance(e, WorkerMisbehaved):  # caught lying and removed (replaced by a standby): retrying is safe
            self.log(f"fusion serve: request failed: {one_line(e)}")
            return ApiError(
                502,
                f"a worker returned a wrong result and was removed from the job; "
                f"nothing was generated from it, retry: {one_line(e)}",
                kind="server_error",
                code="worker_misbehaved",
            )
        if isinstance(e, (UsageError, InputError)):  # a bad value that got past the request checks
            return ApiError(400, str(e))
        # this request failed; the engine did not (the next one starts a new session)
        self.log(f"fusion serve: request failed: {one_line(e)}")
        return ApiError(500, f"the request failed: {one_line(e)}", kind="server_error")

    def _done(self, job: Job, out: Any) -> None:
        self.degraded = None
        if job.t_started is None:
            raise RuntimeError("a request finished that was never admitted (Scheduler._admit sets t_started)")
        out.timing = {"queued_behind": job.ahead, "queue_s": round(job.t_started - job.t_enqueued, 4), **out.timing}
        for r in out.recoveries:
            if r["epoch"] in self._logged_epochs:  # a batch's requests share their recoveries
                continue
            self._logged_epochs.add(r["epoch"])
            self.log(
                f"fusion serve: recovered: epoch {r['epoch']} without worker(s) {r['lost']} "
                f"({r['epoch_s']} s + replay {r.get('replay_s')} s): {r['reason']}"
            )
        if out.finish_reason == "cancelled":
            why = "the server is stopping" if self.stopping else "its caller hung up"
            self.log(
                f"fusion serve: request stopped after {out.completion_tokens} of {job.request.max_tokens} tokens: {why}"
            )
        self.served += 1
        self._send(job, ("done", out))

    # ---- the loop: continuous batching (a single request is a batch of one) ----

    def _loop(self) -> None:
        """Requests join the running batch between steps while it has room (their prefill joins the
        next step), leave it when they finish; a membership call waits for the batch to drain (it
        may replay or change the epoch), and requests behind it wait for it (FIFO)."""
        runner = self.runner
        held: Job | None = None  # a membership call waiting for the batch to drain
        while True:
            while held is None and runner.room > 0:
                try:
                    job = self._q.get(block=not runner.active)
                except queue.Empty:
                    break
                if job is None:
                    self._finish_batch()
                    return
                with self._lock:
                    self.waiting -= 1
                    self.running = True
                if self.stopping:
                    self._send(job, ("error", unavailable("the server is shutting down")))
                elif job.work is not None:
                    held = job
                elif not job.cancelled.is_set():
                    self._admit(job)
            if held is not None and not runner.active:
                if self.stopping:
                    self._send(held, ("error", unavailable("the server is shutting down")))
                else:
                    self._call(held)
                held = None
            if runner.active:
                self._step()
            with self._lock:
                self.running = bool(runner.active)

    def _admit(self, job: Job) -> None:
        from ..generation.batching import Sequence

        job.t_started = time.perf_counter()
        short = self._shortfall()
        if short:
            self.log(f"fusion serve: request on a short job: {short}")
        req = job.request
        answer = self.gateway.begin(
            req, lambda text: self._send(job, ("delta", text)), lambda: job.cancelled.is_set() or self.stopping
        )
        try:
            seq = Sequence(req.prompt_ids, req.max_tokens, req.sampling, self.gateway.card.eos_ids, answer.on_token)
            self.runner.add(seq)
        except Exception as e:
            self._send(job, ("error", self._failure(e)))
            return
        self.batch[seq.slot] = (job, answer)

    def _step(self) -> None:
        runner = self.runner
        runner.waiting = self.waiting  # requests queued: a finished session's slot is filled at once
        try:
            finished = runner.step()
        except Exception as e:  # every session of the step fails with it; the next request starts afresh
            err = self._failure(e)
            try:
                runner.abort()
            except Exception as e2:  # the engine is beyond telling its workers anything: they are gone
                self.log(f"fusion serve: could not release the batch's slots: {one_line(e2)}")
                runner.active.clear()
            for job, _ in self.batch.values():
                self._send(job, ("error", err))
            self.batch.clear()
            return
        for seq in finished:
            job, answer = self.batch.pop(seq.slot)
            try:
                out = answer.outcome(seq.result())
            except Exception as e:
                self._send(job, ("error", self._failure(e)))
                continue
            self._done(job, out)

    def _finish_batch(self) -> None:
        """Stopping: the running sessions end at their next token (cancelled), then the loop ends."""
        for _ in range(10_000):  # bounded: each session stops at its next step (cancelled() is True)
            if not self.runner.active:
                return
            self._step()

    def call(self, work: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """Run `work()` on the engine thread between requests and return its result (or raise its
        error). Membership changes go through here: the engine is not shared between threads."""
        done: queue.Queue = queue.Queue()
        with self._lock:
            if self.stopping:
                raise unavailable("the engine is unavailable: shutting down")
            job = Job(None, done.put, ahead=self.waiting + int(self.running), work=work)
            self.waiting += 1
            self._q.put(job)
        try:
            kind, value = done.get(timeout=timeout_s)
        except queue.Empty:
            raise unavailable(f"the engine did not get to it in {timeout_s:.0f} s") from None
        if kind == "error":
            raise value
        return value

    def _call(self, job: Job) -> None:
        if job.work is None:
            raise RuntimeError("a request job reached Scheduler._call (only membership calls carry work)")
        try:
            result = job.work()
        except BaseException as e:  # handed to the caller, who answers for it
            self._send(job, ("error", e))
            return
        self._send(job, ("done", result))

    @property
    def running_requests(self) -> int:
        """Requests on the engine now (the batch's sessions)."""
        return len(self.batch)

    def health(self) -> tuple[str, str | None]:
        """("ok" | "degraded", why): degraded when the last request could not run, or when the
        liveness watch reports an active worker failed (noticed while idle)."""
        if self.degraded:
            return "degraded", self.degraded
        engine = self.gateway.engine
        failed = {p: why for p, why in engine.watch.failed().items() if p in engine.order}
        if failed:
            return "degraded", "; ".join(failed.values())
        short = self._shortfall()
        if short:  # serving, on fewer workers than asked for: never silently (colluders left alone show here)
            return "degraded", short
        return "ok", None

    def _shortfall(self) -> str | None:
        shortfall = getattr(self.gateway.engine, "shortfall", None)  # (a test's stand-in engine has none)
        return shortfall() if shortfall is not None else None

    def stop(self) -> None:
        """Begin stopping, without blocking: the running request ends at its next token, waiting
        ones get 503, new ones are refused."""
        self.stopping = True
        self._q.put(None)

    def close(self, wait_s: float = 30.0) -> None:
        self.stop()
        self._thread.join(timeout=wait_s)
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._send(job, ("error", unavailable("the server is shutting down")))
