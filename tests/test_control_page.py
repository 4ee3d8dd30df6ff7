"""The control page of `fusion serve` (control_page.py), in a real headless browser where Debian's
chromium is installed (scripts/setup.sh installs it), else at the HTTP level only.

The browser test clicks the page's own buttons: a refused revoke shows the API's one-line reason,
an added standby appears, a revoke opens epoch 1, the next request runs on the new epoch's workers,
and a wrong key is refused on the page, which says so beside the key; without a key it shows only
/health's public counters, and says that. The HTTP test checks what a client without the key gets.
"""

from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cdp import CHROMIUM, Browser
from procs import reap
from test_membership import _admin, _serve

pytestmark = pytest.mark.slow  # every test here starts workers or loads SmolLM2 (the quick loop skips them)

NS = "{http://www.w3.org/2000/svg}"


def _get(url: str, key: str | None = None) -> tuple[int, str, str]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def test_control_page_over_http(tmp_path):
    from test_serve import build_chat_model

    model = build_chat_model(tmp_path / "m")
    proc, url = _serve(model, tmp_path / "serve.log", "--api-key", "k")
    try:
        status, ctype, page = _get(url + "/control")  # the page: the same bytes for anyone, no data in it
        assert status == 200 and ctype.startswith("text/html") and "/admin/workers" in page
        assert "<script src" not in page and "http://" not in page and "https://" not in page  # offline: nothing loaded
        status, _, body = _get(url + "/admin/picture.svg")  # what the page shows needs the key
        assert status == 401 and "missing or wrong API key" in body
        status, ctype, svg = _get(url + "/admin/picture.svg", "k")
        assert status == 200 and ctype.startswith("image/svg+xml")
        root = ET.fromstring(svg)
        legend = [t.text for t in root.iter(f"{NS}text") if t.text and t.text.startswith("worker ")]
        assert legend == ["worker 1 (rank 1)", "worker 2 (rank 2)"]  # participant ids, in rank order
    finally:
        reap([proc], grace_s=30)
    proc, url = _serve(model, tmp_path / "serve2.log")  # no --api-key: no page, as for /admin/workers
    try:
        status, _, body = _get(url + "/control")
        assert status == 403 and "admin_disabled" in body
        assert _get(url + "/admin/picture.svg")[0] == 403
    finally:
        reap([proc], grace_s=30)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install -y chromium)")
def test_control_page_in_a_browser(tmp_path):
    from test_serve import build_chat_model

    proc, url = _serve(build_chat_model(tmp_path / "m"), tmp_path / "serve.log", "--api-key", "k")
    profile = tmp_path / "profile"
    profile.mkdir()
    b = None
    try:
        b = Browser(profile)
        b.open(url + "/control")
        assert b.js("document.querySelectorAll('#workers tbody tr').length") == 0  # no key: nothing shown
        # but /health's public counters, and the line beside the key says exactly that
        b.wait_for("document.getElementById('status').textContent === 'ok'")
        assert b.js("document.getElementById('keystate').textContent") == (
            "no key given: only the public counters (/health) are shown"
        )
        b.js("document.getElementById('key').value = 'k'; document.getElementById('keyform').requestSubmit(); 1")
        b.wait_for("document.querySelectorAll('#workers tbody tr').length === 2")
        b.wait_for("document.getElementById('keystate').textContent === 'key accepted'")
        rows = "[...document.querySelectorAll('#workers tbody tr')].map(r => [r.dataset.id, r.dataset.state])"
        assert b.js(rows) == [["1", "active"], ["2", "active"]]
        assert b.js("document.getElementById('epoch').textContent") == "0"
        assert b.js("document.getElementById('size').textContent") == "2 of 2"  # the job's size (issue 41)
        b.wait_for("document.querySelectorAll('#map svg g.hold').length === 24")  # 12 roles x 2 workers
        assert b.errors() == [], b.errors()  # loaded with no console error

        # refused: revoking one of 2 workers would leave too few; the page shows the API's own line
        api_status, api_body = _admin(url, "POST", "/admin/workers/2/revoke", "k")
        assert api_status == 409
        b.js("document.querySelector('button.revoke[data-id=\"2\"]').click(); 1")
        shown = b.wait_for("document.getElementById('error').textContent")
        assert shown == api_body["error"]["message"]

        # add a standby from the page, wait for it to join, then revoke worker 1 from the page
        b.js("document.getElementById('add').click(); 1")
        b.wait_for("document.querySelectorAll('#workers tbody tr').length === 3")
        b.wait_for("document.querySelector('#workers tr[data-id=\"3\"]').dataset.state === 'standby'", timeout_s=90)
        b.js("document.querySelector('button.revoke[data-id=\"1\"]').click(); 1")
        b.wait_for("document.getElementById('epoch').textContent === '1'", timeout_s=120)
        assert b.js(rows) == [["1", "removed"], ["2", "active"], ["3", "active"]]
        b.wait_for("document.getElementById('size').textContent === '2 of 2, 1 removed in this job'")
        legend = "[...document.querySelectorAll('#map svg text')].map(t => t.textContent).filter(t => t.startsWith('worker '))"
        # the new epoch's order, as the API gives it (the standby takes the revoked worker's place)
        listing = _admin(url, "GET", "/admin/workers", "k")[1]
        by_rank = sorted((w["rank"], w["id"]) for w in listing["workers"] if w["rank"] is not None)
        assert sorted(i for _, i in by_rank) == [2, 3]
        want = [f"worker {i} (rank {r})" for r, i in by_rank]
        try:
            b.wait_for(f"JSON.stringify({legend}) === '{json.dumps(want, separators=(',', ':'))}'")
        except AssertionError:
            assert b.js(legend) == want, b.js("document.getElementById('error').textContent")
        assert b.errors(network_too=False) == [], b.errors()  # only the refused fetch's network line

        # the next request runs on the new epoch
        status, health = _admin(url, "GET", "/health", None)
        assert status == 200 and health["recoveries"] == 1
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        status, body = _admin(url, "POST", "/v1/chat/completions", "k", chat)
        assert status == 200 and body["fusion"]["workers"] == 2
        if os.environ.get("FUSION_SCREENSHOT"):  # docs/serving.md's picture
            time.sleep(1)
            b.screenshot(Path(os.environ["FUSION_SCREENSHOT"]))

        # a wrong key: refused on the page, nothing shown
        b.js("document.getElementById('key').value = 'wrong'; document.getElementById('keyform').requestSubmit(); 1")
        assert "missing or wrong API key" in b.wait_for("document.getElementById('error').textContent")
        assert b.js("document.querySelectorAll('#workers tbody tr').length") == 0
        # the line beside the key says so (it stayed "checking ..." before)
        refused = "key refused: only the public counters (/health) are shown"
        b.wait_for(f"document.getElementById('keystate').textContent === {json.dumps(refused)}")
        assert proc.poll() is None  # the server keeps serving
    finally:
        if b is not None:
            b.close()
        reap([proc], grace_s=30)
