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


def _capacities(text: str | None) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise CliError(f"--capacity must be comma-separated numbers, got {text!r}") from None


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


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")


def _add_engine(p: argparse.ArgumentParser) -> None:
    _add_model(p)
    p.add_argument("--workers", type=int, default=2, help="number of workers N (default 2)")
    p.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    p.add_argument("--master", help="HOST:PORT to rendezvous with separately started workers (no local spawn)")
    p.add_argument("--context", type=int, help="KV positions per session (default min(model window, 4096))")
    p.add_argument("--threads", type=int, help="torch threads per local worker")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds (default 120)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")


def _engine_options(a: argparse.Namespace):
    from .client import EngineOptions

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
    sampling = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    opts = _engine_options(a)
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
    with Engine(path, opts, source=src) as engine:
        load_s = time.perf_counter() - t_start  # file parsing, weights and worker start-up

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
    from .weights import open_weights
    from .worker import serve

    if not (1 <= a.rank <= a.workers):
        raise CliError(f"--rank must be in 1..{a.workers}, got {a.rank}")
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // a.workers))
    src = open_weights(a.model)
    plan = make_plan(src.config, a.workers, _capacities(a.capacity))
    comm = Comm(
        a.rank,
        a.workers,
        _master(a.master),
        backend=backend_for(a.device),
        timeout_s=a.timeout,
        score_groups=plan.group_owners,
    )
    try:
        serve(src, plan, a.rank - 1, comm)
    finally:
        comm.close()
    return 0


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
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="print the sharding plan as JSON")
    _add_model(pl)
    pl.add_argument("--workers", type=int, required=True)
    pl.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1")
    pl.set_defaults(func=cmd_plan)

    w = sub.add_parser("worker", help="run one worker and join a client at --master")
    _add_model(w)
    w.add_argument("--rank", type=int, required=True, help="1..N")
    w.add_argument("--workers", type=int, required=True)
    w.add_argument("--master", required=True, help="client HOST:PORT")
    w.add_argument("--capacity")
    w.add_argument("--threads", type=int)
    w.add_argument("--timeout", type=float, default=120.0)
    w.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    w.set_defaults(func=cmd_worker)
    return p


def _known_errors() -> tuple[type[BaseException], ...]:
    from .comm import CommError
    from .config import ModelError
    from .generate import InputError
    from .plan import PlanError
    from .sampling import SamplingError

    return (CliError, ModelError, PlanError, SamplingError, InputError, CommError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = a.func
    prefix = f"fusion {a.cmd}" + (f" (rank {a.rank})" if a.cmd == "worker" else "")
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
