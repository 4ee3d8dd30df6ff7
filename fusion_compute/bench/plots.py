"""PNG plots of the benchmark's JSON, next to it: matplotlib, an optional extra (`pip install
'fusion-compute[plot]'`), imported only here and only when a plot is drawn; nothing in the runtime
imports this module (tests/test_structure.py).

  bench.json  (`fusion bench`)              decode_vs_workers.png: decode tokens/s against N, one line
                                            per (system, engine), min..max as error bars
  batch.json  (`fusion bench --batch B`)    batch.png: one session vs B decoding together, per repeat
  rtt.json    (`python -m fusion_compute.bench.rtt --out DIR`)
                                            rtt.png: decode tokens/s against the measured round trip,
                                            per (system, batch), with the latency model's prediction

`write_plots(report, out_dir)` picks the plots by the report's keys and returns the files written,
or raises PlotsUnavailable (one line: why) when matplotlib is missing; `python -m
fusion_compute.bench.plots FILE.json [OUT_DIR]` redraws them from a saved JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class PlotsUnavailable(RuntimeError):
    """No plots: the one-line reason (matplotlib not installed)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(
            "plots skipped: matplotlib is not installed (optional: pip install 'fusion-compute[plot]')"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def kind(report: dict) -> str:
    """Which benchmark wrote the report: "bench", "batch" or "rtt"."""
    if "table" in report and "delay" in report:
        return "rtt"
    if "batch_decode_tokens_per_s" in report:
        return "batch"
    if "results" in report:
        return "bench"
    raise ValueError("not a fusion bench, bench --batch or bench.rtt report")


def write_plots(report: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    draw = {"bench": decode_vs_workers, "batch": batch_plot, "rtt": rtt_plot}[kind(report)]
    plt = _pyplot()
    return draw(plt, report, out)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_series(report: dict) -> dict[str, list[tuple[int, float, float, float]]]:
    """(label -> [(N, median, min, max)]) of decode tokens/s: one series per system and engine;
    transformers (one process) and fusion N = 1 (no traffic between workers) are points at N = 1."""
    series: dict[str, list[tuple[int, float, float, float]]] = {}
    for r in report["results"]:
        s = r["decode_tokens_per_s_spread"]
        if r["system"] == "transformers":
            label = "transformers (1 process)"
        elif r["workers"] == 1:
            label = f"{r['system']} N = 1"
        else:
            label = f"{r['system']} ({r['engine']})"
        series.setdefault(label, []).append((r["workers"], r["decode_tokens_per_s"], s["min"], s["max"]))
    # fusion's lines start at its own N = 1 point, so the cost of every added worker shows
    one = series.pop("fusion N = 1", None)
    for label in series:
        if one and label.startswith("fusion ("):
            series[label] = one + series[label]
    if one and not any(label.startswith("fusion (") for label in series):
        series["fusion N = 1"] = one
    return {k: sorted(v) for k, v in series.items()}


def decode_vs_workers(plt, report: dict, out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, pts in bench_series(report).items():
        ns = [p[0] for p in pts]
        med = [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        style = "s" if label.startswith("transformers") else ("o-" if label.startswith("fusion") else "^--")
        ax.errorbar(ns, med, yerr=err, fmt=style, capsize=3, label=label)
    ns = sorted({r["workers"] for r in report["results"]})
    ax.set_xticks(ns)
    ax.set_xlabel("workers N")
    ax.set_ylabel("decode tokens/s (median, min..max)")
    ax.set_ylim(bottom=0)
    model = Path(report["model"]).name
    ax.set_title(
        f"fusion bench: {model}, {report['cores']} cores, {report['decode_tokens']} tokens, "
        f"{report['results'][0]['repeats']} repeats",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(plt, fig, out / "decode_vs_workers.png")]


def batch_plot(plt, report: dict, out: Path) -> list[Path]:
    s, b = report["single_decode_tokens_per_s"], report["batch_decode_tokens_per_s"]
    q = report["ratio"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    labels = ["1 session", f"{report['batch']} sessions (aggregate)"]
    med = [s["median"], b["median"]]
    err = [[s["median"] - s["min"], b["median"] - b["min"]], [s["max"] - s["median"], b["max"] - b["median"]]]
    ax.bar(labels, med, yerr=err, capsize=4, color=["#0072B2", "#E69F00"])
    for i, v in enumerate(med):
        ax.text(i, v / 2, f"{v:.1f}", ha="center", color="white", fontsize=10)
    ax.set_ylabel("decode tokens/s (median, min..max)")
    ax.set_title(
        f"N = {report['workers']} ({report['engine']}): {q['median']:.2f}x per repeat ({q['min']:.2f}..{q['max']:.2f}), "
        f"{report['repeats']} repeats",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    return [_save(plt, fig, out / "batch.png")]


def rtt_series(report: dict) -> dict[str, list[tuple[float, float, float | None]]]:
    """(label -> [(measured RTT ms, tokens/s, model tokens/s or None)]) per system and batch."""
    out: dict[str, list[tuple[float, float, float | None]]] = {}
    for r in report["table"]:
        label = f"{r['system']}, batch {r['batch']}"
        out.setdefault(label, []).append((r["measured_rtt_ms"], r["tokens_per_s"], r.get("model_tokens_per_s")))
    return {k: sorted(v) for k, v in out.items()}


def rtt_plot(plt, report: dict, out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (label, pts) in enumerate(rtt_series(report).items()):
        colour = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=f"{label}, measured")
        model = [(p[0], p[2]) for p in pts if p[2] is not None]
        if model:  # the model from the smallest-RTT point on: that point is its `compute`
            model = [(pts[0][0], pts[0][1]), *model]
            ax.plot([p[0] for p in model], [p[1] for p in model], ":", color=colour, alpha=0.8)
    ax.plot([], [], "k:", label="model: t_round = RTT / 2")
    ax.set_xlabel("round trip measured (ms)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"bench.rtt: N = {report['workers']}, {report['tokens']} tokens, delay {report['delay']}, "
        f"medians of {report['repeats']} sweeps",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(plt, fig, out / "rtt.png")]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m fusion_compute.bench.plots REPORT.json [OUT_DIR]", file=sys.stderr)
        return 2
    src = Path(args[0])
    try:
        paths = write_plots(json.loads(src.read_text()), args[1] if len(args) > 1 else src.parent)
    except (OSError, ValueError, KeyError, PlotsUnavailable) as e:
        print(f"bench.plots: {e}", file=sys.stderr)
        return 1
    print("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
