"""`fusion serve`'s control page: the participants, the epoch, the ownership map and live counters in
a browser, with buttons for the membership operations of /admin/workers.

    GET /control              the page: one HTML file, inline CSS and JS, no CDN, no build step
    GET /admin/picture.svg    the ownership map of the current epoch's plan (picture.py; masked: what each group receives)

The page itself holds no data and no secret: it is the same bytes for everyone (403 without
--api-key, like /admin/workers). Everything it shows comes from the guarded endpoints: the key is
typed into the page, kept in the tab's sessionStorage and sent as `Authorization: Bearer KEY` on
every fetch, so the server checks it exactly as for curl (http_limits.ApiKey), and a wrong key
gets the API's own one-line reason on the page and "key refused" beside the key. Without an accepted
key the page shows the public counters of /health only, and says so. No other page may frame it.
The buttons call the existing endpoints (POST /admin/workers/{id}/revoke, POST /admin/workers), so
a revoke from the page is the same operation, with the same checks, as one from the terminal.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from .gateway import ApiError, Gateway
from .scheduler import Scheduler


def add_control_routes(app: FastAPI, gateway: Gateway, scheduler: Scheduler, enabled: bool) -> None:
    engine = gateway.engine

    def need_admin() -> None:
        if not enabled:
            raise ApiError(403, "the control page needs the server started with --api-key", code="admin_disabled")

    @app.get("/control", include_in_schema=False)
    async def control() -> HTMLResponse:
        need_admin()
        return HTMLResponse(
            PAGE, headers={"Cache-Control": "no-store", "Content-Security-Policy": CSP, "X-Frame-Options": "DENY"}
        )

    @app.get("/admin/picture.svg", include_in_schema=False)
    async def picture() -> Response:
        need_admin()
        from starlette.concurrency import run_in_threadpool

        from ..structural.picture import masked_picture, plan_picture, render_svg
        from ..structural.plan import Plan

        # the plan and the participants of one epoch, read together on the engine thread (waited for
        # off the event loop, like every admin call: a long request ahead of it blocks nothing else)
        plan, listing, epoch = await run_in_threadpool(
            scheduler.call, lambda: (engine.plan, engine.workers(), engine.epoch)
        )
        if not isinstance(plan, Plan):  # the masked mode: what group A and each mask group receive
            svg = render_svg(masked_picture(plan, title=f"Epoch {epoch}: groups {'+'.join(map(str, plan.sizes))}"))
            return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-store"})
        by_rank = {w["rank"]: w["id"] for w in listing if w["rank"] is not None}
        pic = plan_picture(plan, title=f"Epoch {epoch}: {plan.n} workers")
        labels = tuple(f"worker {by_rank.get(s.rank, '?')} (rank {s.rank})" for s in plan.workers)
        svg = render_svg(replace(pic, workers=labels))
        return Response(svg, media_type="image/svg+xml", headers={"Cache-Control": "no-store"})


# Inline script and style only; nothing is loaded from anywhere else (the page works offline). No
# other page may frame it (frame-ancestors, and X-Frame-Options for older browsers): its buttons
# revoke workers, so a page that framed it could trick a click (clickjacking).
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; frame-ancestors 'none'"
)

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fusion serve: control</title>
<link rel="icon" href="data:,">
<style>
body { font-family: DejaVu Sans, Arial, sans-serif; margin: 1.2em; color: #222; max-width: 1000px; }
h1 { font-size: 1.3em; margin: 0 0 .4em; } h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: .25em .6em; text-align: left; }
#error { color: #a00; min-height: 1.2em; font-weight: bold; } #counters span { margin-right: 1.4em; }
.state-active { color: #060; } .state-removed, .state-failed { color: #888; } button { cursor: pointer; }
#map svg { max-width: 100%; height: auto; border: 1px solid #ddd; }
</style></head>
<body>
<h1>fusion serve &mdash; control</h1>
<form id="keyform"><label>API key <input id="key" type="password" autocomplete="off" size="30"></label>
 <button type="submit">Use key</button> <span id="keystate">no key given: only the public counters (/health) are shown</span></form>
<p id="error" role="alert"></p>
<div id="counters"><span>epoch <b id="epoch">-</b></span><span>status <b id="status">-</b></span><span>workers <b id="size">-</b></span>
<span>served <b id="served">-</b></span><span>running <b id="running">-</b></span>
<span>waiting <b id="waiting">-</b></span><span>recoveries <b id="recoveries">-</b></span>
<span>plan <b id="plan">-</b></span></div>
<h2>Participants</h2>
<table id="workers"><thead><tr><th>id</th><th>rank</th><th>group</th><th>capacity</th><th>state</th>
<th>where</th><th></th></tr></thead><tbody></tbody></table>
<p><button id="add" type="button">Add a standby</button> <span id="last"></span></p>
<h2>Ownership map (this epoch's plan)</h2>
<div id="map"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let key = sessionStorage.getItem("fusion-key") || "";
let shownPlan = null;

async function call(method, path, body, k = key) {
  const headers = {"Authorization": "Bearer " + k};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const text = await r.text();
  let data = null;
  try { data = JSON.parse(text); } catch (e) { data = null; }
  if (!r.ok) {
    const err = new Error((data && data.error && data.error.message) || ("HTTP " + r.status));
    err.status = r.status;
    throw err;
  }
  return data === null ? text : data;
}

function cell(row, text) { const td = document.createElement("td"); td.textContent = text; row.appendChild(td); return td; }

function showWorkers(listing) {
  $("epoch").textContent = listing.epoch;
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of listing.workers) {
    const tr = document.createElement("tr");
    tr.dataset.id = w.id; tr.dataset.state = w.state; tr.dataset.rank = w.rank === null ? "" : w.rank;
    cell(tr, w.id); cell(tr, w.rank === null ? "-" : w.rank); cell(tr, w.group || "-"); cell(tr, w.capacity);
    // suspected: ambiguous verdicts it was a suspect in (set aside, not barred: docs/resilience.md)
    const suspect = w.suspected ? " (suspect in " + w.suspected + ")" : "";
    cell(tr, w.state + suspect).className = "state-" + w.state.split(" ")[0]; cell(tr, w.where || "local");
    const td = cell(tr, "");
    if (w.state !== "removed") {
      const b = document.createElement("button");
      b.type = "button"; b.textContent = "Revoke"; b.className = "revoke"; b.dataset.id = w.id;
      b.addEventListener("click", () => act("revoke worker " + w.id, "POST", "/admin/workers/" + w.id + "/revoke"));
      td.appendChild(b);
    }
    body.appendChild(tr);
  }
}

async function refresh() {
  const k = key;
  try {
    const h = await (await fetch("/health")).json();
    for (const n of ["status", "served", "running", "waiting", "recoveries", "plan"]) $(n).textContent = h[n];
    // never shrunk silently: "2 of 3, 1 removed in this job", and why when degraded
    $("size").textContent = h.workers + " of " + h.workers_wanted + (h.removed ? ", " + h.removed + " removed in this job" : "");
    $("status").title = h.error || "";
    if (!k) return;  // (k: a refresh that began before a new key was typed shows nothing)
    const listing = await call("GET", "/admin/workers", undefined, k);
    if (k !== key) return;
    showWorkers(listing);
    // an epoch over the same shape keeps the plan's fingerprint but has other participants
    const shown = h.plan + "/" + listing.epoch;
    if (shown !== shownPlan) {
      const svg = await call("GET", "/admin/picture.svg", undefined, k);
      if (k !== key) return;
      $("map").innerHTML = svg; shownPlan = shown;
    }
    $("keystate").textContent = "key accepted";
  } catch (e) {
    if (k !== key) return;
    $("error").textContent = e.message;
    if (k) $("keystate").textContent = e.status === 401
      ? "key refused: only the public counters (/health) are shown" : "the key could not be checked (below)";
  }
}

async function act(what, method, path, body) {
  $("error").textContent = "";
  $("last").textContent = what + " ...";
  try {
    const r = await call(method, path, body);
    $("last").textContent = what + ": done, epoch " + r.epoch;
    showWorkers(r);
  } catch (e) {
    $("last").textContent = what + ": refused";
    $("error").textContent = e.message;
  }
  await refresh();
}

$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  key = $("key").value; sessionStorage.setItem("fusion-key", key); shownPlan = null;
  $("workers").tBodies[0].replaceChildren(); $("map").replaceChildren(); $("epoch").textContent = "-";
  $("error").textContent = ""; $("keystate").textContent = "checking ...";
  refresh();
});
$("add").addEventListener("click", () => act("add a standby", "POST", "/admin/workers", {}));
refresh();
setInterval(refresh, 3000);
</script>
</body></html>
"""
