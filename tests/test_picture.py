"""The ownership map (picture.py): every bar drawn is the plan's coordinates, at the plan's place.

The drawn ranges are read back from the SVG (xml.etree) and compared with coordinates computed here
from the plan's own row maps (qkv_rows, o_cols, residual, mlp), not from picture.py's code path;
a tampered picture (one bar shifted) must fail the same comparison.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import procs
import pytest

from fusion_compute.model.config import ModelConfig
from fusion_compute.structural.picture import LANE_W, LEFT, ROLES, plan_picture, render_svg
from fusion_compute.structural.plan import make_plan

SMOLLM = ModelConfig("llama", 576, 1536, 30, 9, 3, 64, 49152, 8192, 1e-5)
NS = "{http://www.w3.org/2000/svg}"


def expected(plan) -> dict[tuple[str, int], set[int]]:
    """Role -> worker -> coordinates in the role's own space, from the plan's row maps."""
    c = plan.config
    q_size, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = {}
    for w, s in enumerate(plan.workers):
        rows = plan.qkv_rows(w)
        q = {r for r in rows if r < q_size}
        k = {r - q_size for r in rows if q_size <= r < q_size + kv}
        v = {r - q_size - kv for r in rows if r >= q_size + kv}
        resid, mlp = set(range(*s.residual)), set(range(*s.mlp))
        per = {
            "resid.in": resid,
            "q": q,
            "k": k,
            "v": v,
            "kcache": k,
            "vcache": v,
            "attn": set(plan.o_cols(w)),
            "resid.mid": resid,
            "gate": mlp,
            "up": mlp,
            "h": mlp,
            "resid.out": resid,
        }
        for role, coords in per.items():
            out[(role, w)] = coords
    return out


def sizes(c: ModelConfig) -> dict[str, int]:
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return {
        "resid.in": c.hidden,
        "q": q,
        "k": kv,
        "v": kv,
        "kcache": kv,
        "vcache": kv,
        "attn": q,
        "resid.mid": c.hidden,
        "gate": c.intermediate,
        "up": c.intermediate,
        "h": c.intermediate,
        "resid.out": c.hidden,
    }


def check_drawing(svg: str, plan) -> None:
    """Every (role, worker) is one bar; its rects cover exactly the plan's coordinates, each drawn at
    x = LEFT + LANE_W * start / size with width LANE_W * (stop - start) / size."""
    root = ET.fromstring(svg)
    want, size = expected(plan), sizes(plan.config)
    bars = [g for g in root.iter(f"{NS}g") if g.get("class") == "hold"]
    keys = [(g.get("data-role"), int(g.get("data-worker"))) for g in bars]
    assert sorted(keys) == sorted(want), "not one bar per (tensor, worker)"
    for g in bars:
        role, w = g.get("data-role"), int(g.get("data-worker"))
        drawn: set[int] = set()
        width = 0.0
        for r in g.iter(f"{NS}rect"):
            a, b = int(r.get("data-start")), int(r.get("data-stop"))
            x, wd = float(r.get("x")), float(r.get("width"))
            # the place drawn is the place the numbers say
            assert abs(x - (LEFT + LANE_W * a / size[role])) < 0.01, f"{role} w{w}: [{a}, {b}) drawn at x={x}"
            assert abs(wd - LANE_W * (b - a) / size[role]) < 0.01, f"{role} w{w}: [{a}, {b}) drawn {wd} wide"
            drawn |= set(range(a, b))
            width += wd
        assert drawn == want[(role, w)], f"{role} w{w}: drawn coordinates differ from the plan"
        share = len(want[(role, w)]) / size[role]
        assert abs(width / LANE_W - share) < 1e-3, f"{role} w{w}: bar width is not its share"


@pytest.mark.parametrize(("n", "caps"), [(3, (2, 1, 1)), (4, None), (7, None), (1, None)])
def test_plan_picture_draws_the_plan(n, caps):
    plan = make_plan(SMOLLM, n, caps)
    svg = render_svg(plan_picture(plan))
    check_drawing(svg, plan)
    root = ET.fromstring(svg)
    legend = [r for r in root.iter(f"{NS}rect") if r.get("class") == "legend"]
    assert [int(r.get("data-worker")) for r in legend] == list(range(n))
    assert len({r.get("fill") for r in legend}) == n  # one colour per worker
    # workers are numbered from 1 in what it says, as everywhere else (issue 45)
    said = " ".join(t.text or "" for t in root.iter(f"{NS}text"))
    assert all(f"worker {k} (rank {k})" in said for k in range(1, n + 1)) and "worker 0" not in said, said
    # the transfers: ingress and egress carry the residual rows; the scatters add up to the plan's bytes
    ingress = {
        int(e.get("data-worker")): int(e.get("data-elements"))
        for e in root.iter(f"{NS}line")
        if e.get("class") == "ingress"
    }
    assert ingress == {s.worker: s.n_residual for s in plan.workers}
    cells = [r for r in root.iter(f"{NS}rect") if r.get("class") == "scatter"]
    assert len(cells) == n * n
    for w in range(n):
        sent = sum(int(r.get("data-elements")) for r in cells if int(r.get("data-from")) == w)
        assert sent * 4 == plan.bytes_per_token_layer(w)


def test_uneven_capacities_give_uneven_bars():
    plan = make_plan(SMOLLM, 3, (2, 1, 1))
    root = ET.fromstring(render_svg(plan_picture(plan)))
    widths = {}
    for g in root.iter(f"{NS}g"):
        if g.get("class") == "hold" and g.get("data-role") == "resid.in":
            widths[int(g.get("data-worker"))] = sum(float(r.get("width")) for r in g.iter(f"{NS}rect"))
    # 288, 144, 144 of 576 coordinates
    assert widths == pytest.approx({0: LANE_W / 2, 1: LANE_W / 4, 2: LANE_W / 4})


def test_a_wrongly_drawn_range_is_caught():
    """The check can fail: shift one worker's residual bar, or give it another worker's range."""
    plan = make_plan(SMOLLM, 3, (2, 1, 1))
    svg = render_svg(plan_picture(plan))
    check_drawing(svg, plan)

    def at(coord: int) -> str:
        return f'x="{round(LEFT + LANE_W * coord / 576, 3)}"'

    x0 = at(288)  # worker 1's residual bar starts at coordinate 288
    assert x0 in svg
    with pytest.raises(AssertionError, match="drawn at"):
        check_drawing(svg.replace(x0, at(290), 1), plan)
    with pytest.raises(AssertionError, match="differ from the plan"):
        check_drawing(
            svg.replace('data-start="288" data-stop="432"', 'data-start="289" data-stop="433"', 1).replace(
                x0, at(289), 1
            ),
            plan,
        )
    with pytest.raises(AssertionError, match="differ from the plan"):  # a plan with other shares
        check_drawing(svg, make_plan(SMOLLM, 3, (1, 2, 1)))


def test_roles_are_the_audit_schema_roles():
    from fusion_compute.audit.schema import role_parts

    dims = {"hidden": 576, "intermediate": 1536, "head_dim": 64, "heads": 9, "kv_heads": 3}
    assert set(ROLES) == set(role_parts(dims))


@pytest.mark.slow
def test_fusion_plan_picture_command(tiny_qwen2, tmp_path):
    out = tmp_path / "plan.svg"
    r = procs.run("plan", "--model", str(tiny_qwen2), "--workers", "3", "--capacity", "2,1,1", "--picture", str(out))
    assert r.returncode == 0, r.stderr
    plan_json = json.loads(r.stdout)  # the JSON is still printed
    assert [s["residual"] for s in plan_json["shares"]] == [[0, 36], [36, 54], [54, 72]]
    root = ET.fromstring(out.read_text())
    resid = {
        int(g.get("data-worker")): [(int(x.get("data-start")), int(x.get("data-stop"))) for x in g]
        for g in root.iter(f"{NS}g")
        if g.get("class") == "hold" and g.get("data-role") == "resid.in"
    }
    assert resid == {0: [(0, 36)], 1: [(36, 54)], 2: [(54, 72)]}
    bad = procs.run("plan", "--model", str(tiny_qwen2), "--workers", "2", "--picture", str(tmp_path / "no" / "dir.svg"))
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--picture" in bad.stderr, bad.stderr


def test_plan_picture_says_what_it_wrote(tiny_qwen2, tmp_path, capsys):
    from fusion_compute.cli.main import main

    out = tmp_path / "plan.svg"
    assert main(["plan", "--model", str(tiny_qwen2), "--workers", "2", "--picture", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"fusion plan: wrote {out}: which worker owns which coordinates (SVG)\n"
    assert out.read_text().startswith("<svg") and json.loads(captured.out)["workers"] == 2
