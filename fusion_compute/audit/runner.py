"""The experiment runner: `fusion audit run --workers N --steps 250 --cold-starts 5 --out DIR`.

Each cold start is fresh processes: a client (this process, rank 0) and N spawned workers, each
recording its own hash-chained log into OUT/coldK/. One session: a prefill of the prompt, then
`steps` decode steps with greedy sampling and forced continuation (EOS does not stop it, so every
decode step really runs). Before and after the steps the runner samples the kernel's per-socket
byte counters of the worker processes (netcount.py). Then it writes the manifest, runs the
independent verifier, and finally OUT/summary.json and OUT/report.md across all cold starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import netcount
from . import schema as S
from .recorder import AuditRecorder, model_dims
from .verify import verify_dir

DEFAULT_PROMPT = "The history of the printing press begins in"
FALLBACK_PROMPT_IDS = (5, 17, 33, 2, 99, 100, 7, 8)


class AuditRunError(RuntimeError):
    pass


@dataclass
class RunConfig:
    out: Path
    model: str | None = None
    workers: int = 2
    steps: int = 250
    cold_starts: int = 5
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    capacities: tuple[float, ...] | None = None
    inject_leak: str | None = None
    variant: str = "sharded"
    threads: int | None = None
    timeout_s: float = 120.0
    netcount: bool = True
    exposure: bool = True  # add the exposure ranks and the layer-0 vocabulary attack to the report


def resolve_prompt(cfg: RunConfig, model_path: Path, vocab: int) -> tuple[list[int], str]:
    """Prompt ids and where they came from. Text goes through the model's tokenizer, on this (client)
    side only; models without one (tiny test models) fall back to fixed ids."""
    if cfg.prompt_ids:
        bad = [i for i in cfg.prompt_ids if not (0 <= i < vocab)]
        if bad:
            raise AuditRunError(f"prompt id {bad[0]} outside the vocabulary [0, {vocab})")
        return list(cfg.prompt_ids), "ids"
    text = cfg.prompt or DEFAULT_PROMPT
    try:
        from ..tokenizer import load_tokenizer

        ids = load_tokenizer(model_path).encode(text)
        if ids:
            return ids, f"text: {text!r}"
    except Exception:
        if cfg.prompt:
            raise AuditRunError(f"cannot tokenize --prompt for {model_path}: use --prompt-ids") from None
    return [i % vocab for i in FALLBACK_PROMPT_IDS], "fixed ids (model has no tokenizer)"


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fusion-compute")
    except PackageNotFoundError:
        return "unknown"


def _final_hash(path: Path) -> str | None:
    last = None
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                last = line
    return json.loads(last)["hash"] if last else None


def _end_record(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            lines = [ln for ln in f if ln.strip()]
        rec = json.loads(lines[-1])
        return rec if rec.get("type") == "end" else {}
    except (OSError, IndexError, json.JSONDecodeError):
        return {}


@dataclass(frozen=True)
class Prepared:
    model_path: Path
    config: object  # ModelConfig
    src: object  # the client's WeightSource, opened once and reused by every cold start's Engine
    prompt: list[int]
    prompt_src: str


def prepare(cfg: RunConfig) -> Prepared:
    """Resolve the model and the prompt once per run (opening a GGUF takes seconds)."""
    from ..weights import open_weights, resolve_model_path

    if cfg.workers < 1:
        raise AuditRunError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.steps < 1:
        raise AuditRunError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.cold_starts < 1:
        raise AuditRunError(f"--cold-starts must be >= 1, got {cfg.cold_starts}")
    if cfg.variant not in ("sharded", "megatron"):
        raise AuditRunError(f"--variant must be sharded or megatron, got {cfg.variant!r}")
    model_path = resolve_model_path(cfg.model)
    src = open_weights(model_path)
    config = src.config
    if cfg.inject_leak:
        from .inject import parse_leak

        parse_leak(cfg.inject_leak, config.n_layers)
    from ..plan import make_plan

    make_plan(config, cfg.workers, cfg.capacities)  # fail here, with the plan's message, not in a worker
    prompt, prompt_src = resolve_prompt(cfg, model_path, config.vocab)
    if len(prompt) + cfg.steps + 1 > config.max_positions:
        raise AuditRunError(
            f"prompt {len(prompt)} + {cfg.steps} steps exceed the model's window {config.max_positions}"
        )
    return Prepared(model_path, config, src, prompt, prompt_src)


def run_cold_start(cfg: RunConfig, index: int, prep: Prepared | None = None) -> dict:
    import torch

    from ..client import Engine, EngineOptions

    d = cfg.out / f"cold{index}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    rec0 = AuditRecorder(d, 0, role="client")
    extra = ["--audit-dir", str(d.resolve())]
    if cfg.inject_leak:
        extra += ["--inject-leak", cfg.inject_leak]
    if cfg.variant != "sharded":
        extra += ["--variant", cfg.variant]
    started = time.time()
    t0 = time.perf_counter()
    opts = EngineOptions(
        n_workers=cfg.workers,
        capacities=cfg.capacities,
        context=None,
        threads=cfg.threads,
        timeout_s=cfg.timeout_s,
        extra_worker_args=tuple(extra),
    )
    prep = prep or prepare(cfg)
    model_path, prompt, prompt_src = prep.model_path, prep.prompt, prep.prompt_src
    opts.context = len(prompt) + cfg.steps + 1  # KV shards sized to the session, not the 4096 default
    engine = Engine(model_path, opts, recorder=rec0, source=prep.src)
    tokens: list[int] = []
    net = None
    try:
        plan = engine.plan
        ingress = {str(s.rank): S.to_runs(range(*s.residual)) for s in plan.workers}
        rec0.start(None, engine.config, variant=cfg.variant, leak=cfg.inject_leak, ingress=ingress, egress=ingress)
        load_s = time.perf_counter() - t0
        pids = engine.procs.pids if engine.procs is not None else []
        measure = cfg.netcount and bool(pids) and netcount.available()
        if measure:
            netcount.settle()
            before = netcount.sample(pids, engine.watch.endpoints())
        engine.reset()
        rec0.new_session()
        t1 = time.perf_counter()
        rec0.begin_step(len(prompt), engine.pos)
        logits = engine.forward(prompt)
        rec0.end_step()
        ttft = time.perf_counter() - t1
        tokens.append(int(torch.argmax(logits)))
        t2 = time.perf_counter()
        for _ in range(cfg.steps):  # forced continuation: EOS does not stop an audit run
            rec0.begin_step(1, engine.pos)
            logits = engine.forward([tokens[-1]])
            rec0.end_step()
            tokens.append(int(torch.argmax(logits)))
        decode_s = time.perf_counter() - t2
        if measure:
            netcount.settle()
            after = netcount.sample(pids, engine.watch.endpoints())
            moved = netcount.delta(before, after)
            net = {
                "tool": "ss -tinpH (kernel tcp_info bytes_sent / bytes_received per socket)",
                "interval": "after the HELLO handshake, before SHUTDOWN: the session and all its steps",
                "excluded": "each worker's pulse connection (heartbeats: no state; their count depends on time)",
                "ranks": {str(r + 1): {"pid": pid, **moved[pid]} for r, pid in enumerate(pids)},
            }
    finally:
        engine.close()
        rec0.close()
    ended = time.time()
    if net is not None:
        (d / S.NETCOUNT).write_text(json.dumps(net, indent=2))
    chains = {}
    for rank in range(cfg.workers + 1):
        p = d / S.log_name(rank)
        chains[str(rank)] = _final_hash(p) if p.is_file() else None
    manifest = {
        "schema": S.SCHEMA_VERSION,
        "model": {"path": str(model_path), "dims": model_dims(engine.config)},
        "workers": cfg.workers,
        "capacities": list(cfg.capacities) if cfg.capacities else None,
        "variant": cfg.variant,
        "inject_leak": cfg.inject_leak,
        "plan": engine.plan.to_dict(),
        "plan_fingerprint": engine.plan.fingerprint(),
        "wire": engine.opts.engine,  # the verifier's wire model for the socket byte check
        "prompt": {"tokens": len(prompt), "source": prompt_src},
        "steps": {"prefill": 1, "decode": cfg.steps},
        "versions": {
            "fusion_compute": _package_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "started": started,
        "ended": ended,
        "chains": chains,
        "netcount_sha256": hashlib.sha256((d / S.NETCOUNT).read_bytes()).hexdigest() if net is not None else None,
    }
    (d / S.MANIFEST).write_text(json.dumps(manifest, indent=2))
    result = verify_dir(d)
    busy = {}
    for rank in range(cfg.workers + 1):
        end = _end_record(d / S.log_name(rank))
        if end and end.get("steps"):
            busy[str(rank)] = round(1000 * end["recorder_busy_s"] / end["steps"], 4)
    return {
        "cold_start": index,
        "dir": str(d),
        "ok": result.ok,
        "summary": result.summary_line(),
        "decode_steps": result.decode_steps,
        "closed_decode": result.closed_decode,
        "prefill_steps": result.prefill_steps,
        "closed_prefill": result.closed_steps - result.closed_decode,
        "layers": result.layers,
        "layer_closed": result.layer_closed,
        "violation_counts": result.counts(),
        "first_violations": [f"{v.invariant} [{v.where()}]: {v.message}" for v in result.violations[:5]],
        "checks": result.checks,
        "coalition": result.coalition,
        "bytes_per_step": result.bytes_per_step,
        "os": result.os,
        "timing": {
            "load_s": round(load_s, 3),
            "ttft_s": round(ttft, 4),
            "decode_s": round(decode_s, 3),
            "decode_tokens_per_s": round(cfg.steps / decode_s, 3) if decode_s > 0 else None,
            "wall_s": round(ended - started, 3),
        },
        "recorder_ms_per_step": busy,
        "prompt_tokens": len(prompt),
        "generated_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16],
        "eos_in_continuation": any(t in engine.config.eos_ids for t in tokens),
    }


def exposure_section(cfg: RunConfig, prep: Prepared) -> dict:
    """What holding does not prove, for this model and N: the rank of what each worker observes
    (exposure.py) and the vocabulary-matching attack on each worker's layer-0 residual shard,
    run on this audit's own prompt (attack.py)."""
    from ..dense import DenseModel
    from ..plan import make_plan
    from .attack import vocab_match
    from .exposure import analyse, summarize

    plan = make_plan(prep.config, cfg.workers, cfg.capacities)
    ranks = summarize(analyse(prep.src, plan), plan)
    dense = DenseModel(prep.src, 0)
    attacks = []
    for share in plan.workers:
        r = vocab_match(dense, prep.prompt, 0, list(range(*share.residual)))
        attacks.append({"worker": share.worker, "layer": 0, "coords": r.coords, "recovered": r.recovered,
                        "positions": r.positions})  # fmt: skip
    return {"ranks": ranks, "attack": attacks}


def run_audit(cfg: RunConfig, log=print) -> dict:
    from .report import write_report

    prep = prepare(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for c in range(cfg.cold_starts):
        r = run_cold_start(cfg, c, prep)
        log(
            f"cold start {c}: {r['summary']}  ({r['timing']['wall_s']:.1f} s, "
            f"{r['timing']['decode_tokens_per_s']} tok/s)"
        )
        runs.append(r)
    summary = {
        "model": runs[0]["dir"] and json.loads((Path(runs[0]["dir"]) / S.MANIFEST).read_text())["model"],
        "workers": cfg.workers,
        "capacities": list(cfg.capacities) if cfg.capacities else None,
        "variant": cfg.variant,
        "inject_leak": cfg.inject_leak,
        "steps": cfg.steps,
        "cold_starts": cfg.cold_starts,
        "all_ok": all(r["ok"] for r in runs),
        "closed": f"{sum(r['closed_decode'] for r in runs)}/{sum(r['decode_steps'] for r in runs)}",
        "identical_tokens_across_cold_starts": len({r["generated_sha256"] for r in runs}) == 1,
        "runs": runs,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    if cfg.exposure:
        summary["exposure"] = exposure_section(cfg, prep)
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(summary, cfg.out / "report.md")
    return summary
