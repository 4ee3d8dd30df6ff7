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
from ..runtime.progress import counted
from . import logs
from . import options as O
from .parser import FusionParser, flag_name, help_groups

DEBUG_ENV = "FUSION_DEBUG"  # set (to anything) to get the traceback of an unexpected error
DEFAULT_NEW_TOKENS = 64  # generate's reply limit when --max-tokens is not given (capped by the context)

# ---- generate ----


def cmd_generate(a: argparse.Namespace) -> int:
    from ..generation.sampling_params import SamplingParams
    from ..runtime.progress import is_tty, load_monitor, log_startup, startup_lines

    # Bars and the start-up table on a terminal; off one, timestamped lines (logs.py).
    tty = is_tty(sys.stderr) and a.log_format == "text"
    log = logs.setup("fusion generate", quiet=a.quiet, fmt=a.log_format, info=not tty)
    # The command line's own checks first: a bad value is refused before torch or the model loads.
    if a.prompt_file is not None:
        if a.prompt is not None:
            raise UsageError("give --prompt or --prompt-file, not both")
        a.prompt = O.prompt_from(a.prompt_file, f"--prompt-file {a.prompt_file}")
    elif a.prompt == "-":
        a.prompt = O.prompt_from("-", "--prompt - (stdin)")
    if (a.prompt is None) == (a.prompt_ids is None):
        raise UsageError("give exactly one of --prompt TEXT (- reads stdin), --prompt-file FILE or --prompt-ids 1,2,3")
    if a.chat and a.raw:
        raise UsageError("--chat and --raw are opposites: give one (the chat template is the default)")
    if a.chat and a.prompt is None:
        raise UsageError("--chat needs --prompt TEXT")
    sampling = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)
    spec = O.speculative_config(a)
    masked = a.mode == "masked"
    if a.audit_dir is not None and not masked:
        raise UsageError("--audit-dir is for --mode masked; the structural audit is `fusion audit run`")
    if a.prompt is not None:
        O.prompt_text(a.prompt)
    O.writable_dir(a.audit_dir, "--audit-dir")
    opts = O.engine_options(a, masked=masked)
    if masked:
        from ..masked.options import MaskedOptions

        if not isinstance(opts, MaskedOptions):  # engine_options(masked=True) builds them
            raise TypeError(f"--mode masked: engine options of type {type(opts).__name__}, not MaskedOptions")
        opts.audit_dir = a.audit_dir
        workers = f"{'+'.join(map(str, opts.sizes))} workers"
    else:
        workers = counted(opts.n_workers, "worker")
    if not a.quiet:
        opts.progress = load_monitor(sys.stderr)  # bars on a terminal only; stdout stays clean
    max_flag = flag_name(a, "max_tokens", "--max-tokens")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise UsageError(f"{max_flag} must be >= 1, got {a.max_tokens}")
    given_ids = None if a.prompt_ids is None else O.int_list(a.prompt_ids, "--prompt-ids")
    if not (given_ids if a.prompt is None else a.prompt.strip()):
        raise UsageError(f"empty prompt: {'--prompt' if a.prompt is not None else '--prompt-ids'} has nothing in it")
    t_start = time.perf_counter()
    path = O.model_path(a.model)

    from ..generation.generate import generate
    from ..generation.result import check_prompt
    from ..weights.loader import open_weights

    src = open_weights(path)
    tok = O.tokenizer_for(path, src, needed=a.prompt is not None)
    ids, chat = given_ids or [], False  # (--prompt-ids or --prompt: one of them, checked above)
    if a.prompt is not None:
        # The chat template unless --raw, as llama.cpp's CLI and Ollama do: an instruct model given bare
        # text often ends its turn at once (an empty answer).
        chat = not a.raw and (a.chat or tok.chat_template is not None)
        ids = tok.chat_ids([{"role": "user", "content": a.prompt}]) if chat else tok.encode(a.prompt)
        if not chat and not a.raw:
            log.info(f"{path.name} has no chat template: the prompt is continued as plain text")
    # Validate before any worker starts: bad input never costs a spawn.
    context = O.context_for(src.config.max_positions, a.context)
    check_prompt(ids, src.config.vocab, context, 1)
    speculator = O.speculator_for(spec, src.config, context)  # the draft model loads (and is checked) here
    max_tokens = new_tokens_limit(a.max_tokens, max_flag, len(ids), context, src.config.max_positions, log)
    eos = tok.eos_ids if tok else src.config.eos_ids
    stream = tok.stream() if tok else None
    engine_class: type[Engine] | type[MaskedEngine]  # the same start-up (EngineBase) and calls used here
    if masked:
        from ..masked.client import MaskedEngine

        engine_class = MaskedEngine
    else:
        from ..structural.client import Engine

        engine_class = Engine
    log.info(
        f"starting: {path.name}, {workers} ({a.mode}), prompt {counted(len(ids), 'token')}, up to "
        f"{max_tokens} new, context {context}"
    )
    engine = engine_class(path, opts, source=src)
    with engine:  # (EngineBase.__enter__ gives it back as EngineBase: keep the subclass's type)
        load_s = time.perf_counter() - t_start  # file parsing, weights and worker start-up
        if tty and not a.quiet:
            log_startup(engine, sys.stderr, opts.topology)
        else:
            log.info(f"ready in {load_s:.1f} s")
            for line in startup_lines(engine, opts.topology):
                log.info(line.removeprefix("fusion: "))
        pieces: list[str] = []
        first = FirstToken(sys.stderr if tty and not a.quiet else None, len(ids), log)

        def on_token(t: int) -> None:
            first.arrived()
            if stream is not None and t not in eos:
                pieces.append(stream.push(t))
                if not a.json:
                    sys.stdout.write(pieces[-1])
                    sys.stdout.flush()

        try:
            res = generate(
                engine,
                ids,
                max_new_tokens=max_tokens,
                sampling=sampling,
                stop_ids=eos,
                on_token=on_token,
                speculator=speculator,
            )
        finally:
            first.arrived()
        tail = stream.flush() if stream is not None else ""
        text = "".join(pieces) + tail  # what streamed: an incomplete last character is dropped, not U+FFFD
        if not a.json:
            # The answer's line ends before the next log line: with stdout and stderr in one file
            # (`> run.log 2>&1`) the "done" line would otherwise follow the answer on its line.
            sys.stdout.write((tail if stream else " ".join(map(str, res.token_ids))) + "\n")
            sys.stdout.flush()
        log.info(
            f"done: {counted(len(res.token_ids), 'token')} in {counted(res.steps, 'step')} "
            f"({res.finish_reason}), first after "
            f"{res.ttft_s:.1f} s, then {res.decode_tokens_per_s:.2f} tokens/s"
        )
        warning = no_text_warning(text, res.token_ids, res.finish_reason, chat) if tok is not None else None
        if warning is not None:
            log.warning(warning)
        if a.json:
            out = {
                "token_ids": res.token_ids,
                "text": text,
                "prompt_tokens": res.prompt_tokens,
                "workers": engine.plan.n,  # at the end: fewer than asked for after a loss without a standby
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
                from ..generation.speculative import session_report

                counts = getattr(engine.plan, "exchanges_per_forward", None)  # the masked plan does not count them
                out["speculative"] = session_report(res.speculative, counts(0) if counts is not None else None)
            if masked and isinstance(engine, MaskedEngine):  # (always both: the isinstance tells the type checker)
                v = engine.verifier
                out |= {
                    "mode": "masked",
                    "groups": list(engine.plan.sizes),
                    "verified": {"token_checks": v.checks, "failed": v.failures} if v else None,
                }
            print(json.dumps(out))
    return 0


def no_text_warning(text: str, token_ids: list[int], finish_reason: str, chat: bool) -> str | None:
    """What to say when a run's answer has no text (exit 0 all the same: the model chose it)."""
    if text.strip():
        return None
    why = "it ended its turn at once" if finish_reason == "stop" else "blank or special tokens only"
    hint = "--raw continues the prompt as plain text instead" if chat else "without --raw the chat template applies"
    return f"the model produced no text ({counted(len(token_ids), 'token')}: {why}); {hint}"


def new_tokens_limit(requested: int | None, flag: str, n_prompt: int, context: int, window: int, log) -> int:
    """The reply's limit, by `fusion serve`'s rule: one asked for beyond the room the context leaves after
    the prompt is refused (exit 2); the default is capped to that room, saying so."""
    room = context - n_prompt
    if requested is None:
        if room < DEFAULT_NEW_TOKENS:
            log.warning(
                f"at most {room} new tokens: the prompt's {n_prompt} leave {room} of the {context}-token context"
            )
        return min(DEFAULT_NEW_TOKENS, room)
    if requested > room:
        more = f" or raise --context (the model's window is {window})" if context < window else ""
        raise UsageError(
            f"{flag} {requested} does not fit: the context window is {context} tokens and the prompt has "
            f"{n_prompt}, which leaves {room}; ask for at most {room}{more}"
        )
    return requested


class FirstToken:
    """Until the first token arrives, a line on a terminal that counts the seconds of the prefill (the
    masked mode's takes tens of seconds on a laptop-class CPU); nothing off a terminal."""

    def __init__(self, stream, n_prompt: int, log):
        import threading

        self.stream, self.n_prompt, self.t0 = stream, n_prompt, time.monotonic()
        self.done = threading.Event()
        self.thread = None
        if stream is not None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="fusion-prefill-progress")
            self.thread.start()

    def _run(self) -> None:
        shown = False
        while not self.done.wait(1.0):
            elapsed = time.monotonic() - self.t0
            self.stream.write(f"\r\x1b[2Kfusion: prefill of {self.n_prompt} prompt tokens ... {elapsed:.0f} s")
            self.stream.flush()
            shown = True
        if shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()

    def arrived(self) -> None:
        if not self.done.is_set():
            self.done.set()
            if self.thread is not None:
                self.thread.join(timeout=2)


# ---- plan ----


def cmd_plan(a: argparse.Namespace) -> int:

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
    # Bad paths are refused here, before torch loads (seconds) with the weights' reader.
    path = O.model_path(a.model)
    if a.picture and not os.path.isdir(os.path.dirname(os.path.abspath(a.picture))):
        raise InputError(f"--picture {a.picture}: no such directory")
    from ..weights.loader import open_weights

    config = open_weights(path).config
    if masked:
        from ..masked.plan import make_masked_plan
        from ..masked.ring import DEFAULT_LIMB_BITS
        from ..structural.picture import masked_picture

        masked_plan = make_masked_plan(config, a.workers[0], a.workers[1:], DEFAULT_LIMB_BITS)
        plan_json, draw = masked_plan.to_json(), lambda: masked_picture(masked_plan)
    else:
        from ..structural.picture import plan_picture
        from ..structural.plan import make_plan

        plan = make_plan(config, a.workers, O.capacities(a.capacity))
        plan_json, draw = plan.to_json(), lambda: plan_picture(plan)
    if a.picture:
        from ..structural.picture import write_svg

        try:
            write_svg(draw(), a.picture)
        except OSError as e:
            raise InputError(f"--picture {a.picture}: {e.strerror or e}") from None
        what = "what group A and each mask group receive" if masked else "which worker owns which coordinates"
        print(f"fusion plan: wrote {a.picture}: {what} (SVG)", file=sys.stderr)
    print(plan_json)
    return 0


# ---- worker ----


def cmd_worker(a: argparse.Namespace) -> int:
    from ..runtime.launch import leave_now
    from ..structural.worker import run

    logs.setup("fusion worker", quiet=a.quiet, fmt=a.log_format)  # a service's lines, timestamped off a terminal
    if a.quiet and a.progress == "auto":
        a.progress = "off"
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
    from .. import __version__

    p = FusionParser(prog="fusion", description="Exact LLM inference with the state sharded across workers.")
    p.add_argument("--version", action="version", version=f"fusion {__version__}")
    sub = p.add_subparsers(dest="cmd")

    g = sub.add_parser("generate", help="generate text (spawns local workers unless --topology)")
    gs = help_groups(g, "prompt", "sampling", "workers", "network", "recovery", "speculative", "audit", "logging")
    pr = gs["prompt"]
    pr.add_argument("--prompt", help="prompt text, sent through the model's chat template (see --raw); - reads stdin")
    pr.add_argument("--prompt-file", metavar="FILE", help="the prompt text from FILE (UTF-8)")
    pr.add_argument("--prompt-ids", help="prompt as comma-separated token ids, as they are")
    pr.add_argument(
        "--raw",
        action="store_true",
        help="plain continuation: the prompt text as it is, without the chat template (the default for a model "
        "that has none)",
    )
    pr.add_argument("--chat", action="store_true", help="the chat template (the default now; kept for scripts)")
    pr.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    O.add_sampling_args(
        gs["sampling"], f"most new tokens (default {DEFAULT_NEW_TOKENS}); refused beyond the room the context leaves"
    )
    gs["workers"].add_argument(
        "--mode",
        choices=("structural", "masked"),
        default="structural",
        help="masked: workers see only one-time-pad-masked data (--workers A+B or A+B1+...+Bk; docs/masked.md)",
    )
    O.add_engine_args(gs)
    gs["audit"].add_argument(
        "--audit-dir",
        metavar="DIR",
        help="masked mode: every rank logs its transfers, the client every product check, into DIR "
        "(then `fusion audit verify DIR`; default: no log)",
    )
    O.add_logging_args(gs["logging"])
    g.set_defaults(func=cmd_generate)

    pl = sub.add_parser("plan", help="print the sharding plan as JSON")
    pl.add_argument("--model", help=O.MODEL_HELP)
    pl.add_argument(
        "--workers",
        type=O.workers_arg,
        default=2,
        help="N, or A+B (A+B1+...+Bk) with --mode masked (default 2, as generate)",
    )
    pl.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1 (default: equal shares)")
    pl.add_argument("--mode", choices=("structural", "masked"), default="structural", help="whose plan")
    pl.add_argument(
        "--picture",
        metavar="FILE",
        help="also write the ownership map as SVG to FILE (masked: what group A and each mask group receive)",
    )
    pl.set_defaults(func=cmd_plan)

    w = sub.add_parser("worker", help="run one worker: join a client (--topology FILE --key FILE, or --master)")
    O.add_worker_args(help_groups(w, "workers", "network", "audit", "logging", "testing"))
    w.set_defaults(func=cmd_worker)

    k = sub.add_parser("keys", help="participant key pairs: `keys new FILE`, `keys show FILE`")
    ksub = k.add_subparsers(dest="keys_cmd")
    kn = ksub.add_parser("new", help="write a new key file (mode 0600) and print its public line")
    kn.add_argument("path")
    kn.set_defaults(func=cmd_keys)
    ks = ksub.add_parser("show", help="print a key file's public line")
    ks.add_argument("path")
    ks.set_defaults(func=cmd_keys)

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
    prefix = "fusion" + (f" {a.cmd}" if a.cmd else "")
    prefix += f" (rank {a.rank})" if a.cmd == "worker" and getattr(a, "rank", None) else ""
    try:
        O.apply_env_defaults(a)
        code = func(a)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except FusionError as e:
        logs.error_line(prefix, str(e))
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read our output left (`| head`): stop quietly, as coreutils do, with the shell's
        # status for SIGPIPE. Python would report the same error again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    except Exception as e:  # a bug: still one line, and how to see more (FUSION_DEBUG=1: the traceback)
        if os.environ.get(DEBUG_ENV):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        # "Name: message" first: a worker's line is its last words, which its client reads and relays.
        logs.error_line(prefix, f"{type(e).__name__}: {first} (unexpected: rerun with {DEBUG_ENV}=1 for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
