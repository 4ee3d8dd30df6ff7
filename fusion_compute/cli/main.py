"""`fusion` command line: the top of the import graph (nothing imports it). Bad input ends in one line
on stderr and a non-zero exit, never a traceback: 2 for a wrong command line, 1 for a failed run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from ..errors import FusionError, InputError, UsageError
from . import options as O

# ---- generate ----


def cmd_generate(a: argparse.Namespace) -> int:
    from ..generation.sampling_params import SamplingParams
    from ..runtime.progress import is_tty, load_monitor, log_startup
    from ..weights.source import resolve_model_path

    # The command line's own checks first: a bad value is refused before torch or the model loads.
    if (a.prompt is None) == (a.prompt_ids is None):
        raise UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if a.chat and a.prompt is None:
        raise UsageError("--chat needs --prompt TEXT")
    sampling = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    spec = O.speculative_config(a)
    masked = a.mode == "masked"
    if a.audit_dir is not None and not masked:
        raise UsageError("--audit-dir is for --mode masked; the structural audit is `fusion audit run`")
    opts = O.engine_options(a, masked=masked)
    if masked:
        opts.audit_dir = a.audit_dir
    else:
        opts.progress = load_monitor(sys.stderr)  # bars on a terminal only; stdout stays clean
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    given_ids = None if a.prompt_ids is None else O.int_list(a.prompt_ids, "--prompt-ids")
    if not (given_ids if a.prompt is None else a.prompt.strip()):
        raise InputError("empty prompt")
    t_start = time.perf_counter()
    path = resolve_model_path(a.model)

    from ..generation.generate import generate
    from ..generation.result import check_prompt
    from ..runtime.engine_options import effective_context
    from ..weights.loader import open_weights

    src = open_weights(path)
    tok = O.tokenizer_for(path, src, needed=a.prompt is not None)
    if a.prompt is not None:
        ids = tok.chat_ids([{"role": "user", "content": a.prompt}]) if a.chat else tok.encode(a.prompt)
    else:
        ids = given_ids
    # Validate before any worker starts: bad input never costs a spawn.
    context = effective_context(src.config.max_positions, a.context)
    check_prompt(ids, src.config.vocab, context, a.max_new_tokens)
    speculator = O.speculator_for(spec, src.config, context)  # the draft model loads (and is checked) here
    eos = tok.eos_ids if tok else src.config.eos_ids
    stream = tok.stream() if tok else None
    if masked:
        from ..masked.client import MaskedEngine as Engine  # same interface as the structural Engine
    else:
        from ..structural.client import Engine
    with Engine(path, opts, source=src) as engine:
        load_s = time.perf_counter() - t_start  # file parsing, weights and worker start-up
        if is_tty(sys.stderr) and not masked:
            log_startup(engine, sys.stderr, opts.topology)

        def on_token(t: int) -> None:
            if not a.json and stream is not None and t not in eos:
                sys.stdout.write(stream.push(t))
                sys.stdout.flush()

        res = generate(
            engine,
            ids,
            max_new_tokens=a.max_new_tokens,
            sampling=sampling,
            stop_ids=eos,
            on_token=on_token,
            speculator=speculator,
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
                "comm_backend": opts.comm_backend,
                "engine": opts.comm_backend,  # the old name of comm_backend, kept for scripts that read it
                "recoveries": res.recoveries,
                "worker_peak_rss_mb": [round(i["peak_rss_mb"], 1) for i in engine.ping()],
            }
            if res.speculative is not None:
                out["speculative"] = res.speculative
            if masked:
                v = engine.verifier
                out |= {
                    "mode": "masked",
                    "groups": list(engine.plan.sizes),
                    "verified": {"token_checks": v.checks, "failed": v.failures} if v else None,
                }
            print(json.dumps(out))
        else:
            sys.stdout.write((stream.flush() if stream else " ".join(map(str, res.token_ids))) + "\n")
            sys.stdout.flush()
    return 0


# ---- plan ----


def cmd_plan(a: argparse.Namespace) -> int:
    from ..weights.loader import open_weights

    masked = a.mode == "masked"
    if masked != isinstance(a.workers, tuple):
        raise UsageError(
            "--mode masked needs group sizes --workers A+B (or A+B1+...+Bk)"
            if masked
            else f"--workers {'+'.join(map(str, a.workers))} are masked group sizes: add --mode masked"
        )
    if masked and (a.capacity or any(n < 1 for n in a.workers)):
        raise UsageError("--mode masked: every group needs >= 1 worker, and --capacity does not apply")
    if not masked and a.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {a.workers}")
    config = open_weights(a.model).config
    if masked:
        from ..masked.plan import make_masked_plan
        from ..masked.ring import DEFAULT_LIMB_BITS
        from ..structural.picture import masked_picture

        plan = make_masked_plan(config, a.workers[0], a.workers[1:], DEFAULT_LIMB_BITS)
        picture = masked_picture
    else:
        from ..structural.picture import plan_picture
        from ..structural.plan import make_plan

        plan = make_plan(config, a.workers, O.capacities(a.capacity))
        picture = plan_picture
    if a.picture:
        from ..structural.picture import write_svg

        try:
            write_svg(picture(plan), a.picture)
        except OSError as e:
            raise InputError(f"--picture {a.picture}: {e.strerror or e}") from None
    print(plan.to_json())
    return 0


# ---- worker ----


def cmd_worker(a: argparse.Namespace) -> int:
    from ..runtime.launch import leave_now
    from ..structural.worker import run

    run(O.worker_options(a))
    # The job is over and everything is wiped: leave now, without the interpreter's teardown, which
    # can abort ("terminate called without an active exception") while daemon threads still sit in
    # the links' system calls (seen about once in ten plaintext runs).
    sys.stdout.flush()
    sys.stderr.flush()
    leave_now(0)


# ---- keys ----


def cmd_keys(a: argparse.Namespace) -> int:
    from ..comm import Identity

    if a.keys_cmd == "new":
        ident = Identity.new()
        ident.save(a.path)
        print(ident.public.line())
        print(
            f"fusion keys: wrote {a.path} (secret: keep it on this machine); the line above is its public key "
            f"(fingerprint {ident.public.fingerprint}) for the topology file",
            file=sys.stderr,
        )
    else:
        print(Identity.load(a.path).public.line())
    return 0


# ---- entry ----


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusion", description="Exact LLM inference with the state sharded across workers.")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text (spawns local workers unless --topology)")
    O.add_engine_args(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--mode",
        choices=("structural", "masked"),
        default="structural",
        help="masked: workers see only one-time-pad-masked data (--workers A+B or A+B1+...+Bk; docs/masked.md)",
    )
    g.add_argument(
        "--audit-dir",
        metavar="DIR",
        help="masked mode: every rank logs its transfers, the client every product check, into DIR "
        "(then `fusion audit verify DIR`)",
    )
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="print the sharding plan as JSON")
    pl.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    pl.add_argument("--workers", type=O.workers_arg, required=True, help="N, or A+B (A+B1+...+Bk) with --mode masked")
    pl.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    pl.add_argument(
        "--mode", choices=("structural", "masked"), default="structural", help="whose plan (default structural)"
    )
    pl.add_argument(
        "--picture",
        metavar="FILE",
        help="also write the ownership map as SVG to FILE (masked: what group A and each mask group receive)",
    )
    pl.set_defaults(func=cmd_plan)

    w = sub.add_parser("worker", help="run one worker: join a client (--topology FILE --key FILE, or --master)")
    O.add_worker_args(w)
    w.set_defaults(func=cmd_worker)

    k = sub.add_parser("keys", help="participant key pairs: `keys new FILE`, `keys show FILE`")
    ksub = k.add_subparsers(dest="keys_cmd", required=True)
    kn = ksub.add_parser("new", help="write a new key file (mode 0600) and print its public line")
    kn.add_argument("path")
    ks = ksub.add_parser("show", help="print a key file's public line")
    ks.add_argument("path")
    k.set_defaults(func=cmd_keys)

    from ..audit.cli import add_audit_parser
    from ..bench.run import add_parser as add_bench_parser
    from .chat import add_parser as add_chat_parser
    from .serve import add_parser as add_serve_parser

    add_serve_parser(sub, O.add_engine_args)
    add_chat_parser(sub, O.add_engine_args)
    add_audit_parser(sub)
    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = a.func
    prefix = f"fusion {a.cmd}" + (f" (rank {a.rank})" if a.cmd == "worker" and getattr(a, "rank", None) else "")
    try:
        return func(a)
    except FusionError as e:
        print(f"{prefix}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else still gets one line; FUSION_DEBUG=1 shows the traceback
        if os.environ.get("FUSION_DEBUG"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{prefix}: error: {type(e).__name__}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
