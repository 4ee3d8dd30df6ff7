"""Never shrunk silently (issue 41 item 3): a job that runs on fewer workers than the user asked for
says so, in /health ("degraded", "running 2 of 3 workers (1 removed in this job ...)"), on the
control page and in a log line per request; and its empty seats are filled again from standbys
at the next session's start (tests/test_poisoned_partials.py, in a real job). Before, two
colluders left alone after the honest workers' removal answered 200 and /health said "ok"."""

from __future__ import annotations

from types import SimpleNamespace

from test_serve import FlakyEngine, card, chat_model, completion, run_job  # noqa: F401 - fixtures

from fusion_compute.runtime.membership import Membership


def job(order, wanted, removed=(), recoveries=()):
    return SimpleNamespace(order=list(order), wanted=wanted, removed=set(removed), recoveries=list(recoveries))


def test_the_shortfall_in_words():
    assert Membership.shortfall(job([1, 2, 3], 3)) is None
    assert Membership.shortfall(job([4, 2, 3], 3, removed={1})) is None  # a standby took the seat: full size
    said = Membership.shortfall(job([4, 2], 3, recoveries=[{"set_aside": [1, 3]}]))
    assert said == "running 2 of 3 workers (0 removed in this job, 2 set aside; add a standby to refill)"
    said = Membership.shortfall(job([3, 4], 4, removed={1, 2}, recoveries=[{"set_aside": [3]}]))
    assert said == "running 2 of 4 workers (2 removed in this job; add a standby to refill)"  # 3 is back


def test_a_short_job_serves_degraded_and_says_so_per_request(card):  # noqa: F811 - the fixture
    from fusion_compute.serving.gateway import Gateway
    from fusion_compute.serving.scheduler import Scheduler

    engine = FlakyEngine(card)
    short = ["running 1 of 2 workers (1 removed in this job; add a standby to refill)"]
    engine.shortfall = lambda: short[0]
    logged: list[str] = []
    scheduler = Scheduler(Gateway(engine, card), log=logged.append)
    try:
        req = completion({"model": "tiny", "prompt": [1, 2], "max_tokens": 3}, card)
        for _ in range(2):
            assert run_job(scheduler, req)[0] == "done"  # it serves...
        assert scheduler.health() == ("degraded", short[0])  # ...and says on what
        assert sum("request on a short job: running 1 of 2 workers" in line for line in logged) == 2, logged
        short[0] = None  # refilled
        assert run_job(scheduler, req)[0] == "done" and scheduler.health() == ("ok", None)
        assert sum("short job" in line for line in logged) == 2
    finally:
        scheduler.close(wait_s=10)
