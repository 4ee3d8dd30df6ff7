"""`fusion` command line. Bad input ends in one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

EXIT_USAGE = 2
EXIT_ERROR = 1


class CliError(Exception):
    pass


def _capacities(text: str | None, error: type[Exception] = CliError) -> tuple[float, ...] | None:
    """--capacity 2,1,1 -> (2.0, 1.0, 1.0); `error` lets other command groups keep their exit codes."""
    if not text:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise error(f"--capacity must be comma-separated numbers, got {text!r}") from None


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise CliError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _master(text: str | None) -> str | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise CliError(f"--master must be HOST:PORT, got {text!r}")
    return text


def _workers_arg(text: str) -> int | tuple[int, int]:
    """--workers: N, or A+B group sizes for --mode masked (e.g. 2+2)."""
    a, plus, b = text.partition("+")
    if plus and a.strip().isdigit() and b.strip().isdigit():
        return int(a), int(b)
    if not plus and text.strip().lstrip("-").isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected N or A+B (masked mode), got {text!r}")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    _add_model(p)
    p.add_argument("--workers", type=_workers_arg, help="number of workers N (default 2); A+B with --mode masked")
    p.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    p.add_argument("--master", help="HOST:PORT to rendezvous with separately started workers (no local spawn)")
    p.add_argument("--topology", help="TOML file naming the workers (address, capacity) of a multi-host run")
    p.add_argument("--context", type=int, help="KV positions per session (default min(model window, 4096))")
    p.add_argument("--threads", type=int, help="torch threads per local worker")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds (default 120)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")


def _topology(a: argparse.Namespace, rank: int):
    """The --topology file (None without one): checks this machine is participant `rank`'s host,
    binds gloo to it, and fills in --model when the file names one. Kept as `a.topology_obj`."""
    if not getattr(a, "topology", None):
        return None
    from .topology import Topology, bind_here

    if a.workers is not None or a.master or a.capacity:
        raise CliError("--topology names the workers, their capacities and the rendezvous: drop --workers/--capacity/--master")
    topo = Topology.load(a.topology)
    bind_here(topo.participant(rank))
    a.model = a.model or topo.model_for(rank)
    a.topology_obj = topo
    return topo


def _engine_options(a: argparse.Namespace):
    from .client import EngineOptions

    topo = _topology(a, 0)
    if topo is not None:
        a.workers, a.master = topo.n_workers, topo.master
        a.capacity = ",".join(str(c) for c in topo.capacities)
    if a.workers is None:
        a.workers = 2
    if isinstance(a.workers, tuple):
        raise CliError(f"--workers {a.workers[0]}+{a.workers[1]} (two groups) needs --mode masked")
    if a.workers < 1:
        raise CliError(f"--workers must be >= 1, got {a.workers}")
    if a.context is not None and a.context < 2:
        raise CliError(f"--context must be >= 2, got {a.context}")
    if a.threads is not None and a.threads < 1:
        raise CliError(f"--threads must be >= 1, got {a.threads}")
    if not (a.timeout > 0):
        raise CliError(f"--timeout must be > 0, got {a.timeout}")
    return EngineOptions(
        n_workers=a.workers,
        capacities=_capacities(a.capacity),
        master=_master(a.master),
        context=a.context,
        threads=a.threads,
        timeout_s=a.timeout,
        device=a.device,
    )


# ---- generate ----


def _tokenizer(path, src, needed: bool):
    """The model's tokenizer; a model without one can still run --prompt-ids (text is then empty)."""
    from .tokenizer import Tokenizer, load_tokenizer

    if path.is_file():
        return Tokenizer.from_gguf(src.reader)  # reuse the parsed GGUF (parsing takes seconds)
    if not (path / "tokenizer.json").is_file():
        if needed:
            raise CliError(f"{path}: no tokenizer.json, so --prompt TEXT cannot be used; pass --prompt-ids")
        return None
    return load_tokenizer(path)


def cmd_generate(a: argparse.Namespace) -> int:
    from .client import Engine, effective_context
    from .generate import InputError, check_prompt, generate
    from .sampling import SamplingParams
    from .weights import open_weights, resolve_model_path

    if (a.prompt is None) == (a.prompt_ids is None):
        raise CliError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if a.chat and a.prompt is None:
        raise CliError("--chat needs --prompt TEXT")
    from .progress import is_tty, load_monitor, log_startup

    sampling = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    masked = a.mode == "masked"
    if masked:  # fusion_compute/masked: two groups compute on one-time-pad-masked data
        from .masked.cli import masked_options

        opts = masked_options(a, CliError)
    else:
        opts = _engine_options(a)
        opts.progress = load_monitor(sys.stderr)  # bars on a terminal only; stdout stays clean
    if a.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    t_start = time.perf_counter()
    path = resolve_model_path(a.model)
    src = open_weights(path)
    tok = _tokenizer(path, src, needed=a.prompt is not None)
    if a.prompt is not None:
        if not a.prompt.strip():
            raise InputError("empty prompt")
        ids = tok.chat_ids([{"role": "user", "content": a.prompt}]) if a.chat else tok.encode(a.prompt)
    else:
        ids = _prompt_ids(a.prompt_ids)
    # Validate before any worker starts: bad input never costs a spawn.
    check_prompt(ids, src.config.vocab, effective_context(src.config.max_positions, a.context), a.max_new_tokens)
    eos = tok.eos_ids if tok else src.config.eos_ids
    stream = tok.stream() if tok else None
    if masked:
        from .masked.client import MaskedEngine as Engine  # same interface as the structural Engine
    with Engine(path, opts, source=src) as engine:
        load_s = time.perf_counter() - t_start  # file parsing, weights and worker start-up
        if is_tty(sys.stderr) and not masked:
            log_startup(engine, sys.stderr, getattr(a, "topology_obj", None))

        def on_token(t: int) -> None:
            if not a.json and stream is not None and t not in eos:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()

        res = generate(
            engine, ids, max_new_tokens=a.max_new_tokens, sampling=sampling, stop_ids=eos, on_token=on_token
        )
        text = tok.decode([t for t in res.token_ids if t not in eos]) if tok else ""
        if a.json:
            out = {
                "token_ids": res.token_ids,
                "text": text,
                "prompt_tokens": res.prompt_tokens,
                "workers": opts.n_workers,
                "finish_reason": res.finish_reason,
                "steps": res.steps,
                "timing": {
                    "load_s": round(load_s, 4),
                    "ttft_s": round(res.ttft_s, 4),
                    "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
                },
                "model": str(engine.model_path),
                "plan": engine.plan.fingerprint(),
                "worker_peak_rss_mb": [round(i["peak_rss_mb"], 1) for i in engine.ping()],
            }
            if masked:
                out |= {"mode": "masked", "groups": [opts.n_a, opts.n_b]}
            print(json.dumps(out))
        else:
            sys.stdout.write((stream.flush() if stream else " ".join(map(str, res.token_ids))) + "\n")
            sys.stdout.flush()
    return 0


# ---- plan ----


def cmd_plan(a: argparse.Namespace) -> int:
    from .plan import make_plan
    from .weights import open_weights

    if a.workers < 1:
        raise CliError(f"--workers must be >= 1, got {a.workers}")
    plan = make_plan(open_weights(a.model).config, a.workers, _capacities(a.capacity))
    print(plan.to_json())
    return 0


# ---- worker ----


def cmd_worker(a: argparse.Namespace) -> int:
    import torch

    from .comm import Comm, backend_for
    from .plan import make_plan
    from .progress import CountingSource, WorkerReporter, worker_elements
    from .weights import open_weights
    from .worker import serve

    if a.mode == "masked":
        from .masked.cli import cmd_worker as masked_worker

        return masked_worker(a, CliError)
    _worker_topology(a)
    if isinstance(a.workers, tuple):
        raise CliError("--workers A+B (two groups) needs --mode masked")
    if not (1 <= a.rank <= a.workers):
        raise CliError(f"--rank must be in 1..{a.workers}, got {a.rank}")
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // a.workers))
    report = WorkerReporter(a.progress, label=f"fusion worker {a.rank}")
    report.phase("open")
    src = open_weights(a.model)
    plan = make_plan(src.config, a.workers, _capacities(a.capacity))
    # Count the elements of this worker's slices as they are read: the load progress.
    src = CountingSource(src, worker_elements(plan, a.rank - 1),
                         lambda done, total: report.phase("ready" if done >= total else "load", done, total))  # fmt: skip
    report.phase("join")
    audit = None
    if a.inject_leak:
        from .audit.inject import LeakSpecError, parse_leak

        try:
            parse_leak(a.inject_leak, src.config.n_layers)
        except LeakSpecError as e:
            raise CliError(str(e)) from None
    if a.audit_dir:
        from .audit.recorder import AuditRecorder

        audit = AuditRecorder(a.audit_dir, a.rank)
    comm = Comm(
        a.rank,
        a.workers,
        _master(a.master),
        backend=backend_for(a.device),
        timeout_s=a.timeout,
        score_groups=plan.group_owners,
        recorder=audit,
    )
    try:
        serve(src, plan, a.rank - 1, comm, audit=audit, leak=a.inject_leak, variant=a.variant)
    finally:
        comm.close()
        if audit is not None:
            audit.close()
    return 0


def _worker_topology(a: argparse.Namespace) -> None:
    """Fill --rank/--workers/--master/--capacity/--model from --topology (rank: --rank, or the one
    worker of the file whose address is this machine's)."""
    if not a.topology:
        missing = [f"--{k}" for k in ("rank", "workers", "master") if getattr(a, k) is None]
        if missing:
            raise CliError(f"give {', '.join(missing)} (or --topology FILE)")
        return
    from .topology import Topology

    if a.rank is None:
        topo = Topology.load(a.topology)
        here = topo.local_worker_ranks()
        if len(here) != 1:
            which = f"{len(here)} workers of the file are on this machine" if here else "no worker of the file is on this machine"
            raise CliError(f"give --rank: {which}")
        a.rank = here[0]
    topo = _topology(a, a.rank)
    a.workers, a.master = topo.n_workers, topo.master
    a.capacity = ",".join(str(c) for c in topo.capacities)


def worker_main(argv: list[str]) -> int:
    return main(["worker", *argv])


# ---- entry ----


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusion", description="Exact LLM inference with the state sharded across workers.")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (spawns local workers unless --master)")
    _add_engine(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--mode", choices=("structural", "masked"), default="structural",
                   help="masked: workers see only one-time-pad-masked data (--workers A+B; docs/masked.md)")  # fmt: skip
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="print the sharding plan as JSON")
    _add_model(pl)
    pl.add_argument("--workers", type=int, required=True)
    pl.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    pl.set_defaults(func=cmd_plan)

    w = sub.add_parser("worker", help="run one worker and join a client at --master (or per --topology)")
    _add_model(w)
    w.add_argument("--rank", type=int, help="1..N")
    w.add_argument("--workers", type=_workers_arg, help="N, or A+B with --mode masked")
    w.add_argument("--mode", choices=("structural", "masked"), default="structural")
    w.add_argument("--group", choices=("A", "B"), help="masked mode: this worker's group (checked against --rank)")
    w.add_argument("--master", help="client HOST:PORT")
    w.add_argument("--topology", help="TOML topology file: sets --workers, --master, --capacity (and --model)")
    w.add_argument("--progress", choices=("auto", "bar", "lines", "off"), default="auto",
                   help="load progress on stderr: auto = a bar on a terminal, else nothing")  # fmt: skip
    w.add_argument("--capacity")
    w.add_argument("--threads", type=int)
    w.add_argument("--timeout", type=float, default=120.0)
    w.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    w.add_argument("--audit-dir", help="record this worker's hash-chained audit log into DIR")
    w.add_argument("--inject-leak", help="audit negative control: gather@LAYER | silent-gather@LAYER | gloo-rs")
    w.add_argument("--variant", choices=("sharded", "megatron"), default="sharded",
                   help="megatron: replicated-residual baseline (benchmark / negative control)")  # fmt: skip
    w.set_defaults(func=cmd_worker)

    from .chat import add_parser as add_chat_parser
    from .serve import add_parser as add_serve_parser

    add_serve_parser(sub, _add_engine)
    add_chat_parser(sub, _add_engine)

    from .audit.cli import add_audit_parser

    add_audit_parser(sub)

    from .bench.run import add_parser as add_bench_parser

    add_bench_parser(sub)
    return p


def _known_errors() -> tuple[type[BaseException], ...]:
    from .bench.run import BenchError
    from .comm import CommError
    from .config import ModelError
    from .generate import InputError
    from .plan import PlanError
    from .sampling import SamplingError
    from .topology import TopologyError

    return (CliError, ModelError, PlanError, SamplingError, InputError, CommError, TopologyError, BenchError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = a.func
    prefix = f"fusion {a.cmd}" + (f" (rank {a.rank})" if a.cmd == "worker" and a.rank else "")
    try:
        return func(a)
    except _known_errors() as e:
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, CliError) else EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else still gets one line; FUSION_DEBUG=1 shows the traceback
        if os.environ.get("FUSION_DEBUG"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{prefix}: error: {type(e).__name__}: {first}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
