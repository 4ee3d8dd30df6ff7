"""The benchmark's plots (bench/plots.py) on small synthetic reports shaped like the JSON `fusion
bench`, `fusion bench --batch` and bench/rtt.py write: a valid PNG with the expected series. No
benchmark runs here. Without matplotlib the bench says in one line that plots were skipped."""

from __future__ import annotations

import builtins
import json
import struct
import subprocess
import sys
import zlib

import pytest

from fusion_compute.bench import plots
from fusion_compute.bench.run import plot

PNG = b"\x89PNG\r\n\x1a\n"


def spread(m: float, lo: float, hi: float) -> dict:
    return {"median": m, "min": lo, "max": hi, "n": 3}


def row(system: str, n: int, engine: str, tps: float) -> dict:
    return {
        "system": system,
        "workers": n,
        "engine": engine,
        "repeats": 3,
        "decode_tokens_per_s": tps,
        "decode_tokens_per_s_spread": spread(tps, tps * 0.9, tps * 1.1),
    }


BENCH = {
    "model": "/m/SmolLM2.gguf",
    "cores": 2,
    "decode_tokens": 16,
    "results": [
        row("transformers", 1, "-", 18.0),
        row("fusion", 1, "tls", 17.0),
        row("megatron-tp", 2, "tls", 12.0),
        row("megatron-tp", 3, "tls", 8.0),
        row("fusion", 2, "tls", 10.0),
        row("fusion", 3, "tls", 6.0),
        row("fusion", 2, "tcp", 13.0),
    ],
}
BATCH = {
    "workers": 2,
    "engine": "tls",
    "batch": 8,
    "repeats": 3,
    "single_decode_tokens_per_s": {"median": 9.7, "min": 8.5, "max": 10.1},
    "batch_decode_tokens_per_s": {"median": 43.9, "min": 43.1, "max": 47.5},
    "ratio": {"median": 4.71, "min": 4.38, "max": 5.13},
}
RTT = {
    "model": "/m/SmolLM2.gguf",
    "workers": 2,
    "tokens": 16,
    "batch": 8,
    "delay": "nfqueue",
    "repeats": 1,
    "table": [
        {"system": "fusion", "batch": 1, "rtt_ms": 0, "measured_rtt_ms": 0.4, "tokens_per_s": 7.9},
        {
            "system": "fusion",
            "batch": 1,
            "rtt_ms": 1,
            "measured_rtt_ms": 1.4,
            "tokens_per_s": 3.6,
            "model_tokens_per_s": 5.3,
        },
        {"system": "megatron-tp", "batch": 1, "rtt_ms": 0, "measured_rtt_ms": 0.25, "tokens_per_s": 12.2},
        {
            "system": "megatron-tp",
            "batch": 1,
            "rtt_ms": 1,
            "measured_rtt_ms": 1.5,
            "tokens_per_s": 7.4,
            "model_tokens_per_s": 8.4,
        },
    ],
}


def png_size(data: bytes) -> tuple[int, int]:
    """A valid PNG: the signature, an IHDR chunk with a correct CRC, and an IEND chunk at the end."""
    assert data[:8] == PNG
    length, tag = struct.unpack(">I4s", data[8:16])
    assert tag == b"IHDR" and length == 13
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data[-12:-8] == b"\0\0\0\0" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_series_from_a_bench_report():
    s = plots.bench_series(BENCH)
    assert set(s) == {"transformers (1 process)", "fusion (tls)", "fusion (tcp)", "megatron-tp (tls)"}
    assert [p[:2] for p in s["fusion (tls)"]] == [(1, 17.0), (2, 10.0), (3, 6.0)]  # from fusion's N = 1 on
    assert [p[:2] for p in s["fusion (tcp)"]] == [(1, 17.0), (2, 13.0)]
    assert [p[:2] for p in s["megatron-tp (tls)"]] == [(2, 12.0), (3, 8.0)]
    assert s["transformers (1 process)"] == [(1, 18.0, pytest.approx(16.2), pytest.approx(19.8))]
    r = plots.rtt_series(RTT)
    assert r["fusion, batch 1"] == [(0.4, 7.9, None), (1.4, 3.6, 5.3)]
    assert [plots.kind(x) for x in (BENCH, BATCH, RTT)] == ["bench", "batch", "rtt"]


@pytest.mark.parametrize(("report", "name"), [(BENCH, "decode_vs_workers.png"), (BATCH, "batch.png"), (RTT, "rtt.png")])
def test_writes_a_png_with_the_series(report, name, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn: dict[str, list] = {}
    import matplotlib.axes

    for method in ("errorbar", "plot", "bar"):  # record what each plot draws, then draw it
        orig = getattr(matplotlib.axes.Axes, method)

        def spy(self, *args, _orig=orig, _m=method, **kw):
            drawn.setdefault(_m, []).append((args, kw.get("label")))
            return _orig(self, *args, **kw)

        monkeypatch.setattr(matplotlib.axes.Axes, method, spy)
    paths = plots.write_plots(report, tmp_path)
    assert [p.name for p in paths] == [name]
    w, h = png_size(paths[0].read_bytes())
    assert w > 400 and h > 300
    if report is BENCH:
        labels = {label: list(args[1]) for args, label in drawn["errorbar"]}
        assert labels["fusion (tls)"] == [17.0, 10.0, 6.0] and labels["megatron-tp (tls)"] == [12.0, 8.0]
        assert len(labels) == 4
    elif report is BATCH:
        ((args, _),) = drawn["bar"]
        assert list(args[1]) == [9.7, 43.9]
    else:
        measured = {label: list(args[1]) for args, label in drawn["plot"] if label and "measured" in label}
        assert measured == {"fusion, batch 1, measured": [7.9, 3.6], "megatron-tp, batch 1, measured": [12.2, 7.4]}


def test_without_matplotlib_one_line_says_why(tmp_path, monkeypatch, capsys):
    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert plot(BENCH, tmp_path) == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plots skipped" in err and "matplotlib" in err, err
    assert not list(tmp_path.iterdir())


def test_redraw_from_a_saved_report(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "batch.json").write_text(json.dumps(BATCH))
    r = subprocess.run(
        [sys.executable, "-m", "fusion_compute.bench.plots", str(tmp_path / "batch.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "batch.png")
    bad = subprocess.run(
        [sys.executable, "-m", "fusion_compute.bench.plots", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
