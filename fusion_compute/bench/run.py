"""`fusion bench`: every system on the same machine, model, workload and thread budget, in one run.

Systems: (a) transformers, one process; (b) fusion, 1 worker; (c) megatron-tp (replicated
residual, 2 all-reduces per layer: a baseline, not a product mode), N workers; (d) fusion, N
workers. Each (system, repeat) runs in a fresh subprocess, repeats interleaved across systems; we
report medians and min..max, and speed ratios between systems as the median of per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..cli.options import add_deprecated_alias
from ..errors import FusionError, UsageError
from ..runtime.placement import DTYPES, check_gpus, gpu_count, is_cuda, parse_device


class BenchError(FusionError, RuntimeError):
    pass


def _run_one(args: list[str], timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "fusion_compute.bench.one", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"benchmark step timed out after {timeout_s:.0f} s: {' '.join(args)}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise BenchError(f"benchmark step failed ({' '.join(args)}): {last}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def systems(ns: list[int], engines: list[str], megatron: bool = True) -> list[tuple[str, int, str]]:
    """(system, N, engine) in run order, each once (`--workers 1,2` or a repeated engine would name
    some twice). N = 1 has no worker-to-worker traffic: one engine is enough."""
    out = [("transformers", 1, "-"), ("fusion", 1, engines[0])]
    for engine in engines:
        out += [("megatron-tp", n, engine) for n in ns if megatron]
        out += [("fusion", n, engine) for n in ns]
    return list(dict.fromkeys(out))


def _threads(system: str, n: int, cores: int) -> int:
    """Same thread budget for everyone: `cores` torch threads among the processes computing at any
    moment (workers split it; the client, which only runs while the workers wait, gets it all)."""
    return cores if system == "transformers" else max(1, cores // n)


def run_bench(
    model: str | None,
    ns: list[int],
    engines: list[str],
    repeats: int,
    prompts: list[int],
    decode_tokens: int,
    cores: int,
    log=lambda s: None,
    timeout_s: float = 1800,
    device: str = "cpu",
    dtype: str = "float32",
    megatron: bool = True,
) -> dict:
    """`device`, `dtype`: every system's (transformers' and the workers'; the client's follows)."""
    from ..weights.loader import open_weights, resolve_model_path

    path = resolve_model_path(model)

    cfg = open_weights(path).config
    rtt = _run_one(["--system", "tcp-rtt", "--model", str(path)], timeout_s)["rtt_us"]
    order = systems(ns, engines, megatron)
    runs: dict[tuple[str, int, str], list[dict]] = {key: [] for key in order}
    # Repeats interleaved, every system once per round: a slow stretch of this shared machine that
    # lasts a round hits every system's repeat k alike, so repeat k of two systems makes a fair pair
    # (`ratios` takes the median of the per-repeat ratios). Odd rounds run in reverse order, so that
    # a drift within rounds does not always favour the same systems.
    for rep in range(repeats):
        for system, n, engine in order if rep % 2 == 0 else order[::-1]:
            threads = _threads(system, n, cores)
            log(f"bench: {system} N={n} {engine} run {rep + 1}/{repeats}")
            args = [
                "--system",
                system,
                "--comm-backend",
                engine if engine != "-" else "tls",
                "--model",
                str(path),
                "--workers",
                str(n),
                "--threads",
                str(threads),
                "--client-threads",
                str(cores),
                "--prompts",
                ",".join(map(str, prompts)),
                "--decode-tokens",
                str(decode_tokens),
                "--device",
                device,
                "--dtype",
                dtype,
            ]
            runs[(system, n, engine)].append(_run_one(args, timeout_s))
    results = [_row(key, runs[key], cores, prompts, decode_tokens) for key in order]
    ratio, spread = ratios(results, cfg, rtt)
    return {
        "model": str(path),
        "layers": cfg.n_layers,
        "hidden": cfg.hidden,
        "cores": cores,
        "device": device,
        "dtype": dtype,
        "tcp_rtt_us": rtt,
        "decode_tokens": decode_tokens,
        "prompts": prompts,
        "results": results,
        "ratios": ratio,
        "ratio_spread": spread,
    }


def _row(key: tuple[str, int, str], runs: list[dict], cores: int, prompts: list[int], decode_tokens: int) -> dict:
    system, n, engine = key
    row: dict = {
        "system": system,
        "workers": n,
        "engine": engine,
        "comm_backend": engine,
        "threads_per_process": _threads(system, n, cores),
        "repeats": len(runs),
    }
    dec = [decode_tokens / r["decode_s"] for r in runs]
    row["decode_tokens_per_s"] = statistics.median(dec)
    row["decode_tokens_per_s_spread"] = _summary(dec)
    row["decode_tokens_per_s_runs"] = dec  # in repeat order, for the paired ratios
    for p in prompts:
        pre = [p / r[f"prefill_{p}_s"] for r in runs]
        row[f"prefill_{p}_tokens_per_s"] = statistics.median(pre)
        row[f"prefill_{p}_tokens_per_s_spread"] = _summary(pre)
        row[f"prefill_{p}_tokens_per_s_runs"] = pre
    row["prefill_tokens_per_s"] = row[f"prefill_{prompts[0]}_tokens_per_s"]
    row["prefill_tokens_per_s_runs"] = row[f"prefill_{prompts[0]}_tokens_per_s_runs"]
    row["ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
    for k in (
        "collectives_per_token",
        "bytes_per_token",
        "plan_bytes_per_token",
        "client_bytes_per_token",
        "wire_bytes_per_token",
        "collective_us",
    ):
        if k in runs[0]:
            row[k] = statistics.median(r[k] for r in runs)
    if system == "transformers":
        row["collectives_per_token"] = 0
        row["bytes_per_token"] = 0
    row["peak_rss_mb"] = {k: max(r["peak_rss_mb"][k] for r in runs) for k in runs[0]["peak_rss_mb"]}
    return row


def paired(a: dict, b: dict, what: str = "decode") -> dict:
    """Speed of row a over row b ("decode" or "prefill", the first prompt length), repeat by repeat
    (repeat k of both ran in the same round of `run_bench`): the median of the per-repeat ratios and
    their range."""
    key = f"{what}_tokens_per_s_runs"
    return _summary([x / y for x, y in zip(a[key], b[key], strict=True)])


def _find(results: list[dict], system: str, n: int, engine: str | None = None) -> dict | None:
    return next(
        (
            r
            for r in results
            if r["system"] == system and r["workers"] == n and (engine is None or r["engine"] == engine)
        ),
        None,
    )


def ratios(results: list[dict], cfg, rtt_us: float) -> tuple[dict, dict]:
    """Speed ratios between systems of one run, paired per repeat (`paired`), and the worker layer's
    counts against the plan; returns (ratios, the paired ones' min..max)."""
    out: dict = {}
    spread: dict = {}

    def pair(name: str, a: dict, b: dict) -> None:  # both speeds: name_decode and name_prefill
        for what in ("decode", "prefill"):
            s = paired(a, b, what)
            out[f"{name}_{what}"], spread[f"{name}_{what}"] = s["median"], s

    hf = _find(results, "transformers", 1)
    f1 = _find(results, "fusion", 1)
    if hf and f1:
        pair("fusion1_vs_transformers", f1, hf)
    for r in results:
        n, e = r["workers"], r["engine"]
        if r["system"] == "fusion" and n > 1:
            if f1:
                pair(f"fusion{n}_{e}_vs_fusion1", r, f1)
            mt = _find(results, "megatron-tp", n, e)
            if mt:
                pair(f"fusion{n}_vs_megatron{n}_{e}", r, mt)
            gloo = _find(results, "fusion", n, "gloo")
            if gloo and e != "gloo":
                pair(f"fusion{n}_{e}_vs_gloo", r, gloo)
            if r.get("collective_us") and rtt_us:
                out[f"fusion{n}_{e}_collective_vs_tcp_rtt"] = r["collective_us"] / rtt_us
            out[f"fusion{n}_{e}_collectives_per_layer"] = r["collectives_per_token"] / cfg.n_layers
            if r.get("plan_bytes_per_token"):
                out[f"fusion{n}_{e}_bytes_vs_plan"] = r["bytes_per_token"] / r["plan_bytes_per_token"]
    return out, spread


def table(report: dict) -> str:
    lines = [
        f"model: {report['model']} ({report['layers']} layers), {report['cores']} cores, "
        f"{report.get('device', 'cpu')} {report.get('dtype', 'float32')}, "
        f"{report['decode_tokens']} decode tokens, medians of {report['results'][0]['repeats']} runs (repeats "
        "interleaved; speed ratios between systems: median of the per-repeat ratios, min..max); "
        f"raw TCP round trip on loopback: {report['tcp_rtt_us']:.1f} µs",
        "",
        "| system | N | comm backend | decode tok/s (min..max) | prefill "
        + " | prefill ".join(f"{p} tok/s" for p in report["prompts"])
        + " | TTFT s | collectives/token | reduce-scatter µs | payload B/token/worker | wire B/token/worker "
        "| peak RSS MB |",
        "|---|---|---|---|" + "---|" * len(report["prompts"]) + "---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        s = r["decode_tokens_per_s_spread"]
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items())
        pre = " | ".join(f"{r[f'prefill_{p}_tokens_per_s']:.1f}" for p in report["prompts"])
        coll = f"{r['collective_us']:.0f}" if r.get("collective_us") else "-"
        wire = f"{r['wire_bytes_per_token']:.0f}" if r.get("wire_bytes_per_token") else "-"
        lines.append(
            f"| {r['system']} | {r['workers']} | {r['engine']} | {r['decode_tokens_per_s']:.2f} "
            f"({s['min']:.2f}..{s['max']:.2f}) | {pre} | {r['ttft_s']:.3f} | {r['collectives_per_token']:.0f} | "
            f"{coll} | {r['bytes_per_token']:.0f} | {wire} | {rss} |"
        )
    lines += ["", "| ratio | value |", "|---|---|"]
    for k, v in report["ratios"].items():
        s = report.get("ratio_spread", {}).get(k)
        lines.append(f"| {k} | {v:.3f} ({s['min']:.3f}..{s['max']:.3f}) |" if s else f"| {k} | {v:.3f} |")
    return "\n".join(lines)


def write(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "bench.json", out / "bench.md"
    j.write_text(json.dumps(report, indent=2))
    m.write_text(table(report) + "\n")
    return j, m


def plot(report: dict, out_dir: str | Path, who: str = "fusion bench") -> list[Path]:
    """PNG plots next to the JSON (bench/plots.py); without matplotlib, one line says they were
    skipped and why, and the benchmark's result stands."""
    from .plots import PlotsUnavailable, write_plots

    try:
        paths = write_plots(report, out_dir)
    except PlotsUnavailable as e:
        print(f"{who}: {e}", file=sys.stderr)
        return []
    print(f"{who}: plots {', '.join(map(str, paths))}", file=sys.stderr)
    return paths


def default_cores() -> int:
    return os.cpu_count() or 1


# ---- `fusion bench` ----


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _comm_backends(text: str) -> list[str]:
    vals = [x for x in text.split(",") if x]
    bad = [x for x in vals if x not in ("tls", "tcp", "gloo", "mpi")]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"comm backends are tls, tcp, gloo, mpi; got {text!r}")
    return vals


def _groups(text: str) -> tuple[int, ...]:
    parts = text.split("+")
    if len(parts) < 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected group sizes A+B (A+B1+...+Bk), each >= 1; got {text!r}")
    return tuple(int(p) for p in parts)


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark vs transformers and a Megatron-style baseline (ratios)")
    b.add_argument("--model", help="HF dir or .gguf (default: bundled SmolLM2-135M-Instruct)")
    b.add_argument(
        "--qwen-1.5b",
        dest="qwen_1_5b",
        action="store_true",
        help="use a Qwen2.5-1.5B-shaped random model (built once, cached)",
    )
    b.add_argument("--workers", type=_ints, default=[2, 3], help="N for megatron-tp and fusion (default 2,3)")
    b.add_argument(
        "--comm-backends",
        type=_comm_backends,
        default=["tls", "gloo"],
        help="comm backends side by side, comma-separated: tls, tcp, gloo, mpi (default tls,gloo)",
    )
    add_deprecated_alias(b, "--engines", "--comm-backends", type=_comm_backends)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--prompts", type=_ints, default=[128, 512], help="prefill prompt lengths (default 128,512)")
    b.add_argument("--decode-tokens", type=int, default=32)
    b.add_argument("--cores", type=int, default=default_cores(), help="thread budget shared by every system")
    b.add_argument(
        "--device", default="cpu", help="cpu (default), cuda or cuda:K: transformers' and the workers' device"
    )
    b.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="every system's dtype (default float32)")
    b.add_argument("--no-megatron", action="store_true", help="leave out the Megatron-style baseline")
    b.add_argument(
        "--batch",
        type=int,
        metavar="B",
        help="instead: continuous batching, one session vs B decoding together on N = the first --workers, "
        "the first --comm-backends, prompts of the first --prompts length (docs/serving.md)",
    )
    b.add_argument(
        "--masked",
        metavar="A+B",
        type=_groups,
        help="with --batch: the masked mode with these groups (e.g. 1+1, 2+2) instead of N structural workers",
    )
    b.add_argument(
        "--out",
        default="out/bench",
        help="directory for bench.json and bench.md (with --batch: batch.json), and their PNG plots when "
        "matplotlib is installed (the [plot] extra)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    b.set_defaults(func=cmd_bench)


BENCH_NEEDS = ("transformers", "accelerate")  # the [bench] extra (matplotlib, its third, is optional: plots)
INSTALL_HINT = 'pip install -e ".[bench]"'


def check_extra(needs: tuple[str, ...] | None = None) -> None:
    """Refuse at once, naming the extra, when a package the bench imports later is missing (rather than
    failing in a subprocess tens of seconds in, once per package)."""
    import importlib.util

    missing = [m for m in needs or BENCH_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise BenchError(
            f"fusion bench needs {' and '.join(missing)} (the [bench] extra): {INSTALL_HINT} in the project's directory"
        )


def cmd_bench(a) -> int:
    if a.batch is None:  # the batch comparison runs fusion only
        check_extra()
    if a.repeats < 1 or a.decode_tokens < 2 or a.cores < 1:
        raise BenchError("--repeats and --cores must be >= 1, --decode-tokens >= 2")
    if a.qwen_1_5b and a.model:
        raise BenchError("give --model or --qwen-1.5b, not both")
    model = a.model
    if a.qwen_1_5b:
        from .models import qwen2_5_1_5b_shaped

        model = str(qwen2_5_1_5b_shaped())
    log = (lambda s: None) if a.json else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.masked and a.batch is None:
        raise BenchError("--masked goes with --batch")
    if a.batch is not None and (a.device != "cpu" or a.dtype != "float32"):
        raise UsageError("--batch measures on the CPU in float32: drop --device and --dtype")
    parse_device(a.device)
    if is_cuda(a.device):
        check_gpus([a.device], gpu_count())
    if a.batch is not None:
        from .batch import measure
        from .batch import table as batch_table

        if a.batch < 2:
            raise BenchError(f"--batch must be >= 2, got {a.batch}")
        opts = None
        if a.masked:
            from ..masked.client import MaskedOptions

            n_a, *n_b = a.masked
            opts = MaskedOptions(n_a=n_a, n_b=tuple(n_b), log=lambda line: None)
        r = measure(
            model, a.workers[0], a.comm_backends[0], a.batch, a.prompts[0], a.decode_tokens, a.repeats, log, opts
        )
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "batch.json").write_text(json.dumps(r, indent=2))
        print(json.dumps(r) if a.json else batch_table(r))
        plot(r, out)
        return 0
    report = run_bench(
        model,
        a.workers,
        a.comm_backends,
        a.repeats,
        a.prompts,
        a.decode_tokens,
        a.cores,
        log=log,
        device=a.device,
        dtype=a.dtype,
        megatron=not a.no_megatron,
    )
    j, m = write(report, a.out)
    if a.json:
        print(json.dumps(report))
    else:
        print(table(report))
        print(f"\nwrote {j} and {m}")
    plot(report, a.out)
    return 0
