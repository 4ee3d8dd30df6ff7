"""`fusion serve`'s membership endpoints: the user lists, revokes and adds workers while it serves.

    GET  /admin/workers               every participant: id, rank in the epoch, group, state
    POST /admin/workers/{id}/revoke   remove a worker now (it wipes and leaves; the open session
                                      moves to the next epoch); 404 unknown, 409 too few left
    POST /admin/workers               {"key": "fc1...", "host": "...", "group": "A"}: enroll a standby
                                      (a local run spawns it; no key then); migration = add + revoke

They exist only with --api-key (the same Bearer key as /v1; without one they answer 403: anyone who
reaches the port would decide who holds the conversation), and they run on the engine thread between
requests (scheduler.call), so a revocation never cuts a token in half. The route waits for that on a
worker thread, not on the event loop: an admin call queued behind a long request must not hold up
/health or the other streams meanwhile.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ..comm import CommError, IdentityError, PublicId
from ..runtime.membership import TooFewWorkers, UnknownWorker
from ..runtime.topology import GROUP_NAME
from .gateway import ApiError, Gateway
from .scheduler import Scheduler


class AddWorker(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    key: str | None = Field(default=None, description="the new worker's public key line (fc1...); none for a local run")
    host: str | None = Field(default=None, max_length=253, description="where it listens for its peers")
    group: str | None = Field(
        default=None, pattern=GROUP_NAME.pattern, description="its group (masked mode): A, B or B1..Bk"
    )


def _listing(engine: Any) -> dict:
    return {"epoch": engine.epoch, "min_workers": engine.opts.floor, "workers": engine.workers()}


def add_admin_routes(app: FastAPI, gateway: Gateway, scheduler: Scheduler, enabled: bool) -> None:
    engine = gateway.engine

    async def guarded(work):  # runs on the engine thread; engine errors become the API's
        if not enabled:
            raise ApiError(403, "membership endpoints need the server started with --api-key", code="admin_disabled")
        try:  # scheduler.call blocks until the engine thread gets to it: wait off the event loop
            return await run_in_threadpool(scheduler.call, work)
        except UnknownWorker as e:
            raise ApiError(404 if "no worker" in str(e) else 400, str(e), code="unknown_worker") from None
        except TooFewWorkers as e:
            raise ApiError(409, str(e), code="too_few_workers") from None
        except CommError as e:
            raise ApiError(503, f"the engine could not change its workers: {e}", kind="server_error") from None

    @app.get("/admin/workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse(await guarded(lambda: _listing(engine)))

    @app.post("/admin/workers/{pid}/revoke")
    async def revoke(pid: int) -> JSONResponse:
        def work() -> dict:
            engine.revoke(pid)
            return _listing(engine)

        return JSONResponse(await guarded(work))

    @app.post("/admin/workers", status_code=201)
    async def add(body: AddWorker) -> JSONResponse:
        try:
            key = PublicId.parse(body.key, "key") if body.key else None
        except IdentityError as e:
            raise ApiError(400, str(e), "key") from None

        def work() -> dict:
            pid = engine.add_standby(key, body.host, body.group)
            return {"id": pid, **_listing(engine)}

        return JSONResponse(await guarded(work), status_code=201)
