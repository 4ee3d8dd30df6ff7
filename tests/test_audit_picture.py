"""The ownership map drawn from an audit run's logs (`fusion audit verify DIR --picture FILE`), and
the masked plan's (`fusion plan --mode masked --picture FILE`).

The bars are read back from the SVG (xml.etree) and compared with the coordinate sets read here,
straight from the JSONL records (`sets`, `holds`, "same" expanded, each role's part of its hold's
space), not through the verifier's code; and with the plan's row maps (test_picture.check_drawing).
A tampered log must change the picture and fail the verdict drawn on it.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import procs
import pytest
from test_audit import _rechain, _records, _steps, broken_chain, extra_coordinates
from test_picture import check_drawing

from fusion_compute.audit import schema as S
from fusion_compute.audit.runner import RunConfig, run_cold_start
from fusion_compute.cli.main import main
from fusion_compute.masked.plan import make_masked_plan
from fusion_compute.masked.ring import DEFAULT_LIMB_BITS
from fusion_compute.structural.picture import masked_picture, render_svg
from fusion_compute.structural.plan import make_plan
from fusion_compute.weights.loader import open_weights

NS = "{http://www.w3.org/2000/svg}"
PROMPT = [5, 17, 33, 2, 99, 100, 7, 8]


@pytest.fixture(scope="module")
def run_dir(tiny_qwen2, tmp_path_factory) -> Path:
    """One audited cold start: tiny Qwen2 at N = 3 (split KV groups: q/k/v in stripes), 3 decode steps."""
    out = tmp_path_factory.mktemp("pic")
    cfg = RunConfig(out=out, model=str(tiny_qwen2), workers=3, steps=3, cold_starts=1, prompt_ids=PROMPT, timeout_s=60)
    r = run_cold_start(cfg, 0)
    assert r["ok"], r["first_violations"]
    return Path(r["dir"])


def recorded(epoch_dir: Path, n: int) -> dict[tuple[str, int], set[int]]:
    """(role, worker) -> every coordinate the worker's records claim for the role, over every step and
    layer, in the role's own space; read from the JSONL directly."""
    dims = json.loads((epoch_dir / S.MANIFEST).read_text())["model"]["dims"]
    out: dict[tuple[str, int], set[int]] = defaultdict(set)
    for w in range(n):
        sets: dict[str, list[int]] = {}
        holds = None
        for r in _records(epoch_dir / S.log_name(w + 1)):
            if r["type"] != "step":
                continue
            sets |= {k: S.from_runs(v) for k, v in (r.get("sets") or {}).items()}
            holds = holds if r["holds"] == "same" else r["holds"]
            for _, name, sid, _ in holds:
                for role, (hold, a, b) in S.role_parts(dims).items():
                    if hold == name:
                        out[(role, w)] |= {c - a for c in sets[str(sid)] if a <= c < b}
    return out


def drawn(svg: str) -> dict[tuple[str, int], set[int]]:
    out: dict[tuple[str, int], set[int]] = defaultdict(set)
    for g in ET.fromstring(svg).iter(f"{NS}g"):
        if g.get("class") == "hold":
            for r in g.iter(f"{NS}rect"):
                out[(g.get("data-role"), int(g.get("data-worker")))] |= set(
                    range(int(r.get("data-start")), int(r.get("data-stop")))
                )
    return out


def notes(svg: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(svg).iter(f"{NS}text") if t.get("class") == "note"]


def draw(d: Path, pic: Path, capsys) -> tuple[int, str]:
    rc = main(["audit", "verify", str(d), "--picture", str(pic)])
    capsys.readouterr()
    return rc, pic.read_text()


def test_the_picture_is_what_the_logs_record(run_dir, tiny_qwen2, tmp_path, capsys):
    rc, svg = draw(run_dir, tmp_path / "a.svg", capsys)
    assert rc == 0
    assert drawn(svg) == recorded(run_dir / "epoch0", 3)
    # an honest run holds what was planned, drawn where the plan picture draws it
    plan = make_plan(open_weights(str(tiny_qwen2)).config, 3)
    check_drawing(svg, plan)
    assert any(n.startswith("verifier: PASS") for n in notes(svg)), notes(svg)
    assert {g.get("data-epoch") for g in ET.fromstring(svg).iter(f"{NS}g") if g.get("class") == "hold"} == {"0"}
    # the transfers of the first decode step, as logged: ingress = each worker's residual rows and its
    # rows of layer 0's q/k/v (the client computes them); egress = the full width, summed by the client
    root = ET.fromstring(svg)
    ingress = [int(e.get("data-elements")) for e in root.iter(f"{NS}line") if e.get("class") == "ingress"]
    assert ingress == [24 + q for q in plan.qkv_sizes]  # hidden 72 over 3 workers, + q/k/v rows
    egress = [int(e.get("data-elements")) for e in root.iter(f"{NS}line") if e.get("class") == "egress"]
    assert egress == [72, 72, 72]
    cells = [r for r in root.iter(f"{NS}rect") if r.get("class") == "scatter"]
    assert len(cells) == 9 and all(
        int(c.get("data-elements")) == 0 for c in cells if c.get("data-from") == c.get("data-to")
    )


def test_a_tampered_log_changes_the_picture_and_fails(run_dir, tmp_path, capsys):
    """A worker that claims 5 of its neighbour's residual coordinates in one step (re-chained, so the
    chain holds): its bar grows by exactly those 5, the picture says its sets varied, and the verdict
    drawn on it is FAIL."""
    good = drawn(draw(run_dir, tmp_path / "good.svg", capsys)[1])
    d = tmp_path / "forged"
    shutil.copytree(run_dir, d)
    extra_coordinates(d / "epoch0")
    rc, svg = draw(d, tmp_path / "forged.svg", capsys)
    assert rc == 1
    bad = drawn(svg)
    assert bad == recorded(d / "epoch0", 3)
    assert bad[("resid.in", 0)] - good[("resid.in", 0)] == set(range(24, 29))
    assert {k for k in bad if bad[k] != good[k]} == {("resid.in", 0)}
    text = " ".join(notes(svg))
    assert "verifier: FAIL" in text and "holding" in text and "partition" in text, text
    assert "worker rank 1, resid.in: 2 different sets" in text, text


def test_a_broken_chain_shows_in_the_picture(run_dir, tmp_path, capsys):
    """A step edited without re-hashing: the verifier stops reading that log at the break, so the
    picture has fewer of its records and says so, under a FAIL."""
    d = tmp_path / "broken"
    shutil.copytree(run_dir, d)
    broken_chain(d / "epoch0")  # rank 2's second step
    rc, svg = draw(d, tmp_path / "broken.svg", capsys)
    assert rc == 1
    text = " ".join(notes(svg))
    assert "verifier: FAIL" in text and "chain" in text, text
    assert "worker rank 2, resid.in: recorded in 3 of 12 records" in text, text  # 4 steps x 3 layers; 1 step read


def test_a_dropped_layer_is_drawn_as_recorded(run_dir, tmp_path, capsys):
    """A worker whose step records lose layer 2's MLP holds (re-chained): the union it claims is
    unchanged, but the picture says in how many records the role appears."""
    d = tmp_path / "nolayer"
    shutil.copytree(run_dir, d)
    recs = _records(d / "epoch0" / "rank3.jsonl")
    first = recs[_steps(recs)[0]]
    first["holds"] = [h for h in first["holds"] if not (h[0] == 2 and h[1] == "h")]
    _rechain(d / "epoch0", 3, recs)
    rc, svg = draw(d, tmp_path / "nolayer.svg", capsys)
    assert rc == 1
    # 8 of 12: the later steps' holds are "same" as the first's, so they lose layer 2's too
    assert "worker rank 3, h: recorded in 8 of 12 records" in " ".join(notes(svg))


def test_several_cold_starts_and_bad_input(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(run_dir, out / "cold0")
    shutil.copytree(run_dir, out / "cold1")
    assert main(["audit", "verify", str(out), "--picture", str(tmp_path / "m.svg")]) == 0
    assert "m-cold0.svg" in capsys.readouterr().err
    assert drawn((tmp_path / "m-cold1.svg").read_text()) == recorded(run_dir / "epoch0", 3)
    # a run's --out with one cold start: still FILE-coldK.svg, as --help says (issue 38)
    one = tmp_path / "one"
    shutil.copytree(run_dir, one / "cold0")
    assert main(["audit", "verify", str(one), "--picture", str(tmp_path / "o.svg")]) == 0
    assert (tmp_path / "o-cold0.svg").is_file() and not (tmp_path / "o.svg").exists()
    capsys.readouterr()
    # an unwritable picture path: one line, exit 1
    assert main(["audit", "verify", str(run_dir), "--picture", str(tmp_path / "no" / "x.svg")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--picture" in err, err


def test_masked_audit_dir_is_refused_for_a_picture(tmp_path, capsys):
    from fusion_compute.masked.audit import log_path

    log_path(tmp_path, 0).parent.mkdir(parents=True, exist_ok=True)
    log_path(tmp_path, 0).write_text("")
    assert main(["audit", "verify", str(tmp_path), "--picture", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fusion plan --mode masked" in err, err


# ---- the masked plan: what group A and each mask group receive ----


@pytest.mark.slow
@pytest.mark.parametrize("groups", ["2+2", "1+2+1"])
def test_masked_plan_picture(tiny_qwen2, tmp_path, groups):
    pic = tmp_path / "m.svg"
    r = procs.run("plan", "--model", str(tiny_qwen2), "--mode", "masked", "--workers", groups, "--picture", str(pic))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["mode"] == "masked"
    sizes = tuple(int(x) for x in groups.split("+"))
    plan = make_masked_plan(open_weights(str(tiny_qwen2)).config, sizes[0], sizes[1:], DEFAULT_LIMB_BITS)
    members = [(g, plan.group_of(r)[1]) for g in plan.groups for r in plan.ranks(g)]
    root = ET.fromstring(pic.read_text())
    bars = drawn(pic.read_text())
    masked = {
        (g.get("data-role"), int(g.get("data-worker")))
        for g in root.iter(f"{NS}g")
        if g.get("class") == "hold" and g.get("data-masked") == "1"
    }
    for s in plan.shapes:
        for w, (g, m) in enumerate(members):
            # the input: all of it to every member of A, masked; nothing to a mask group's member
            assert bars.get((f"{s.name}.in", w), set()) == (set(range(s.k)) if g == "A" else set())
            assert ((f"{s.name}.in", w) in masked) == (g == "A")
            # the output rows: each member's own rows, in its group's lane only
            for group in plan.groups:
                want = set(range(*plan.member_rows(g, m, s.op))) if group == g else set()
                assert bars.get((f"{s.name}.out.{group}", w), set()) == want
    ingress = {
        int(e.get("data-worker")): int(e.get("data-elements"))
        for e in root.iter(f"{NS}line")
        if e.get("class") == "ingress"
    }
    assert ingress == {w: sum(s.k for s in plan.shapes) for w, (g, _) in enumerate(members) if g == "A"}
    egress = [int(e.get("data-elements")) for e in root.iter(f"{NS}line") if e.get("class") == "egress"]
    assert egress == [plan.rows_per_layer(g, m) for g, m in members]
    assert not [r for r in root.iter(f"{NS}rect") if r.get("class") == "scatter"]  # nothing between workers


@pytest.mark.parametrize(
    "groups, names",
    [
        ("2+2", ["A.1", "A.2", "B.1", "B.2"]),  # two members of group B
        ("1+1+1", ["A", "B1", "B2"]),  # two mask groups of one member each
        ("1+2+1", ["A", "B1.1", "B1.2", "B2"]),
    ],
)
def test_masked_picture_names_groups_and_members_apart(tiny_qwen2, groups, names):
    """Issue 38: "B1/B2" named two members of B at 2+2 and two mask groups at 1+1+1. A member's name
    is its group's, then ".m" when the group has several; the legend and the bars use it."""
    sizes = tuple(int(x) for x in groups.split("+"))
    plan = make_masked_plan(open_weights(str(tiny_qwen2)).config, sizes[0], sizes[1:], DEFAULT_LIMB_BITS)
    pic = masked_picture(plan)
    ranks = [r for g in plan.groups for r in plan.ranks(g)]
    assert list(pic.workers) == [f"{n} (rank {r})" for n, r in zip(names, ranks, strict=True)]
    svg = ET.fromstring(render_svg(pic))
    legend = [t.text for t in svg.iter(f"{NS}text") if (t.text or "").endswith(")") and "(rank" in (t.text or "")]
    assert legend == list(pic.workers)


def test_plan_mode_and_workers_must_agree(capsys):
    assert main(["plan", "--workers", "2+2"]) == 2
    assert "add --mode masked" in capsys.readouterr().err
    assert main(["plan", "--mode", "masked", "--workers", "3"]) == 2
    assert "needs group sizes" in capsys.readouterr().err
