"""Command-line values and their assembly into engine and worker options, shared by every subcommand
(generate, serve, chat, worker, audit, bench). Bad values raise `UsageError` with the flag's name."""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..comm import COMM_BACKENDS, Identity, PublicId
from ..errors import FusionError, UsageError
from ..executor.base import EXECUTORS
from ..runtime.deadline import DEFAULT_FACTOR, DEFAULT_MIN_S
from ..runtime.engine_options import EngineOptions, default_backend, default_threads, omp_threads, usable_cores
from ..runtime.placement import DEFAULT_DTYPE, DTYPES, check_gpus, gpu_count, is_cuda, parse_device
from ..runtime.topology import GROUP_NAME, Participant, Topology, check_here, is_local_address, sharing_this_host
from .logs import engine_notice
from .parser import StoreFlag

# ---- values ----


def capacities(text: str | None) -> tuple[float, ...] | None:
    """--capacity 2,1,1 -> (2.0, 1.0, 1.0)."""
    if not text:
        return None
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--capacity must be comma-separated numbers, got {text!r}") from None
    if any(not (0 < x < math.inf) for x in out):
        raise UsageError(f"--capacity values must be positive, got {text!r}")
    return out


def int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None


def host_port(text: str | None, flag: str = "--master") -> tuple[str, int] | None:
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
        raise UsageError(f"{flag} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def workers_arg(text: str) -> int | tuple[int, ...]:
    """--workers: N, or group sizes A+B (A+B1+...+Bk: k mask groups) for --mode masked (e.g. 2+2)."""
    parts = text.split("+")
    if len(parts) >= 2 and all(p.strip().isdigit() for p in parts):
        return tuple(int(p) for p in parts)
    if len(parts) == 1 and text.strip().lstrip("-").isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected N or A+B (masked mode: A+B1+...+Bk), got {text!r}")


def group_arg(text: str) -> str:
    if not GROUP_NAME.match(text):
        raise argparse.ArgumentTypeError(f"expected a group name A, B or B1..Bk, got {text!r}")
    return text


class DeprecatedAlias(argparse.Action):
    """An old flag kept for the scripts that use it: it stores into its successor's `dest` and says on
    stderr, in one line, which flag replaced it (argparse's own `deprecated=` arrives in Python 3.13)."""

    def __init__(self, option_strings: list[str], dest: str, successor: str, **kw: Any):
        self.successor = successor
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        sys.stderr.write(f"fusion: warning: {option_string} is deprecated: use {self.successor} (the same values)\n")
        setattr(namespace, self.dest, values)


def add_deprecated_alias(p: Any, old: str, successor: str, **kw: Any) -> None:
    """`old` as a hidden alias of the flag `successor` (already added, with the same `type`/`choices`
    in `kw`): a script that still says `old` runs as before, warned."""
    dest = successor.lstrip("-").replace("-", "_")
    p.add_argument(
        old,
        dest=dest,
        action=DeprecatedAlias,
        successor=successor,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kw,
    )


def writable_dir(path: str | None, flag: str, error: type[Exception] = UsageError) -> None:
    """Make `path` (a directory the run will write into) now, or refuse it in words: a run must not
    load a model and start workers to fail on its first write."""
    if path is None:
        return
    import os

    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise error(f"{flag} {path}: cannot create it: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise error(f"{flag} {path}: not writable by this user")


def prompt_text(text: str, flag: str = "--prompt") -> str:
    """`text` as the tokenizer can take it. A command-line argument that is not UTF-8 arrives with its
    bad bytes as lone surrogates (Python's surrogateescape), which no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise UsageError(
            f"{flag} is not UTF-8 text (byte 0x{bad.hex()} at character {e.start}); convert it, e.g. with iconv"
        ) from None
    return text


MAX_PROMPT_FILE = 16 << 20  # bytes: far beyond any context window's worth of text


def prompt_from(source: str, flag: str) -> str:
    """The prompt text of `--prompt -` (stdin) or `--prompt-file FILE`: UTF-8, one trailing newline
    (what `echo` and editors add) dropped."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read(MAX_PROMPT_FILE + 1)
        else:
            with open(source, "rb") as f:
                data = f.read(MAX_PROMPT_FILE + 1)
    except OSError as e:
        raise UsageError(f"{flag}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_PROMPT_FILE:
        raise UsageError(f"{flag}: more than {MAX_PROMPT_FILE >> 20} MiB: no context window holds that")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    return text[:-1] if text.endswith("\n") else text


def model_path(model: str | None) -> Path:
    """weights.source.resolve_model_path, with a hint when a missing model looks like a Hugging Face Hub
    id (`org/name`): this program never downloads anything."""
    from ..weights.source import resolve_model_path

    try:
        return resolve_model_path(model)
    except FusionError as e:
        if model is not None and HUB_ID.match(model) and not Path(model).expanduser().exists():
            name = model.split("/")[1]
            raise type(e)(
                f"{e}: that looks like a Hugging Face Hub id, and fusion never downloads: fetch it first "
                f"(`hf download {model} --local-dir {name}`) and give that directory"
            ) from None
        raise


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# ---- defaults from the environment ----

# The flags people repeat, once per shell (a flag on the command line always wins; README, "Usage").
ENV_MODEL, ENV_TOPOLOGY, ENV_KEY, ENV_PORT = "FUSION_MODEL", "FUSION_TOPOLOGY", "FUSION_KEY", "FUSION_PORT"
DEFAULT_PORT = 8000
_MODEL_COMMANDS = ("generate", "chat", "serve", "worker", "plan", "audit")


def apply_env_defaults(a: argparse.Namespace) -> None:
    """Fill the flags left out from $FUSION_MODEL, $FUSION_TOPOLOGY, $FUSION_KEY and $FUSION_PORT.
    A topology from the environment yields to a command line that names its workers another way
    (--workers, --master, chat's --url); the key applies where a key is needed (a topology, a worker
    joining with --master); the model yields to the topology file's `model` (`model_from_env`)."""
    import os

    env, cmd = os.environ, getattr(a, "cmd", None)
    if getattr(a, "topology", "absent") is None and env.get(ENV_TOPOLOGY):
        if getattr(a, "workers", None) is None and not getattr(a, "master", None) and not getattr(a, "url", None):
            a.topology = env[ENV_TOPOLOGY]
    if getattr(a, "key", "absent") is None and env.get(ENV_KEY):
        worker_joining = cmd == "worker" and a.master and not a.insecure
        if a.topology or worker_joining:
            a.key = env[ENV_KEY]
    if cmd in _MODEL_COMMANDS and getattr(a, "model", "absent") is None and not getattr(a, "topology", None):
        a.model = env.get(ENV_MODEL) or None
    if cmd == "serve" and a.port is None:
        text = env.get(ENV_PORT, str(DEFAULT_PORT))
        if not text.strip().isdigit():
            raise UsageError(f"${ENV_PORT} must be a port number, got {text!r}")
        a.port = int(text)


def model_from_env() -> str | None:
    import os

    return os.environ.get(ENV_MODEL) or None


def positive(value: float | int | None, flag: str, minimum: float = 0, strict: bool = True) -> None:
    if value is None:
        return
    if not (value > minimum if strict else value >= minimum) or value != value:
        raise UsageError(f"{flag} must be {'>' if strict else '>='} {minimum:g}, got {value}")


# ---- keys ----


def load_key(path: str | None, stdin: bytes | None = None) -> Identity | None:
    """--key FILE (or - for stdin, how a local client hands a spawned worker its key; `stdin`: those
    bytes, for a worker run as a thread)."""
    if path is None:
        return None
    if path == "-":
        from ..comm.identity import MAX_KEY_FILE, IdentityError

        # bounded: stdin may be /dev/zero
        data = stdin[: MAX_KEY_FILE + 1] if stdin is not None else sys.stdin.buffer.read(MAX_KEY_FILE + 1)
        if len(data) > MAX_KEY_FILE:
            raise IdentityError(f"key on stdin: more than the {MAX_KEY_FILE} bytes a key file can be: refused")
        return Identity.from_pem(data, "key on stdin")
    return Identity.load(path)


# ---- the HTTP API key (serve, chat --url) ----

API_KEY_ENV = "FUSION_API_KEY"
MAX_API_KEY_FILE = 4096  # bytes: an API key file holds one line


def add_api_key_args(p: argparse.ArgumentParser, what: str) -> None:
    """--api-key-file FILE, and --api-key VALUE (kept: it shows in `ps`); else $FUSION_API_KEY."""
    p.add_argument("--api-key-file", metavar="FILE", help=f"{what}: the key is FILE's first line (else ${API_KEY_ENV})")
    p.add_argument("--api-key", metavar="KEY", help="the same, on the command line (every local user sees it in ps)")


def api_key(a: argparse.Namespace, prog: str) -> str | None:
    """The API key from --api-key-file, --api-key or $FUSION_API_KEY (in that order; the two flags
    together are refused). --api-key still works, with a warning: any local user reads a command
    line (ps, /proc/PID/cmdline), not another user's file or environment."""
    if a.api_key is not None and a.api_key_file is not None:
        raise UsageError("give --api-key-file or --api-key, not both")
    if a.api_key_file is not None:
        from ..comm.identity import read_small_file

        data, mode = read_small_file(Path(a.api_key_file), MAX_API_KEY_FILE, "API key file", UsageError)
        key = (data.decode("utf-8", errors="replace").splitlines() or [""])[0].strip()
        if not key:
            raise UsageError(f"{a.api_key_file}: the API key file's first line is empty")
        if mode & 0o044:
            print(
                f"fusion {prog}: warning: API key file {a.api_key_file} is readable by "
                f"{'others' if mode & 0o004 else 'its group'} (mode {mode & 0o777:03o}); chmod 600 it",
                file=sys.stderr,
            )
        return key
    if a.api_key is not None:
        if not a.api_key:
            raise UsageError("--api-key is empty")
        print(
            f"fusion {prog}: warning: --api-key shows the key to every user of this machine (ps); "
            f"use --api-key-file FILE or ${API_KEY_ENV}",
            file=sys.stderr,
        )
        return a.api_key
    import os

    return os.environ.get(API_KEY_ENV) or None


# ---- engine (client side) ----


MODEL_HELP = "HF model directory or .gguf file (default: $FUSION_MODEL, else the bundled SmolLM2-135M-Instruct)"


def add_engine_args(g: dict[str, Any]) -> None:
    """The client's flags shared by generate, serve and chat, in their help groups (parser.help_groups:
    "workers", "network", "recovery", "speculative"). A new flag is one line in its group."""
    w, net, rec = g["workers"], g["network"], g["recovery"]
    w.add_argument("--model", help=MODEL_HELP)
    w.add_argument(
        "--workers",
        type=workers_arg,
        help="number of workers N (default 2); group sizes A+B or A+B1+...+Bk with --mode masked",
    )
    w.add_argument("--capacity", help="relative worker capacities, e.g. 2,1,1 (default: equal shares)")
    w.add_argument(
        "--context",
        type=int,
        help="KV positions per session (default min(model window, 4096); beyond the window: refused)",
    )
    w.add_argument("--threads", type=int, help="torch threads per local worker (default: cores / workers, >= 1)")
    w.add_argument(
        "--device",
        default="cpu",
        help="the local workers' device: cpu (default), cuda (spread over the GPUs; NCCL among workers when "
        "each has its own, else the links) or cuda:K",
    )
    w.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=DEFAULT_DTYPE,
        help="weights, activations, KV cache and the wire: float32 (default; exact), bfloat16 or float16",
    )
    w.add_argument(
        "--client-device",
        help="embedding, final norm and LM head: cpu, cuda or cuda:K (default: the local workers' device, else cpu)",
    )
    net.add_argument(
        "--topology",
        help="TOML file naming every worker: address, capacity, group and public key (default: $FUSION_TOPOLOGY "
        "unless --workers or --master)",
    )
    net.add_argument(
        "--key", help="this client's key file (a --topology run; `fusion keys new FILE` makes one; default $FUSION_KEY)"
    )
    net.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="who starts the workers (without --topology): local processes (default), ray actors "
        "(the [ray] extra), or inproc: threads of this process, for tests (docs/executors.md)",
    )
    net.add_argument(
        "--ray-address",
        help="HOST:PORT of an existing Ray cluster's GCS for --executor ray (default: a Ray instance of this "
        "machine's own, on loopback)",
    )
    net.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs Ray reserves for each worker actor (default 1)")
    net.add_argument(
        "--master", help="HOST:PORT to listen at for separately started workers (needs --insecure without a topology)"
    )
    net.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext links and unauthenticated workers: only on a network you trust",
    )
    net.add_argument(
        "--comm-backend",
        choices=COMM_BACKENDS,
        default=None,
        help="what carries the job's messages: tls (default; --device says when nccl is): authenticated, "
        "encrypted links; tcp: plaintext (--insecure); gloo / nccl: torch.distributed among local workers; mpi: "
        "MPI shared memory among local workers (the [mpi] extra)",
    )
    add_deprecated_alias(net, "--engine", "--comm-backend", choices=COMM_BACKENDS)
    net.add_argument(
        "--timeout", type=float, default=120.0, help="bound on every wait for a worker, seconds (default 120)"
    )
    net.add_argument(
        "--join-timeout",
        type=float,
        default=120.0,
        help="bound on start-up (workers joining and loading), seconds (default 120)",
    )
    rec.add_argument(
        "--standby",
        type=int,
        default=0,
        help="local spare workers that replace a lost one (masked mode: per group); default 0",
    )
    rec.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="never continue with fewer workers than this after a loss (default 2)",
    )
    rec.add_argument(
        "--liveness",
        type=float,
        default=5.0,
        help="a worker silent this long (no heartbeat) has failed, seconds (default 5)",
    )
    rec.add_argument(
        "--step-deadline-factor",
        type=float,
        default=DEFAULT_FACTOR,
        help="a step's deadline is this many times the median of healthy steps of its size; workers that "
        f"keep steps over it are judged by their accounts (default {DEFAULT_FACTOR:g}; 0: no step bound)",
    )
    rec.add_argument(
        "--step-deadline-min",
        type=float,
        default=DEFAULT_MIN_S,
        help=f"a step's deadline is never under this many seconds (default {DEFAULT_MIN_S:g})",
    )
    rec.add_argument(
        "--no-recover", action="store_true", help="on a lost worker, fail the request instead of recovering"
    )
    add_speculative_args(g["speculative"])


# The reply's length limit has one name in generate, chat and serve: --max-tokens, after the request
# field of OpenAI's API and vLLM (max_tokens), which `fusion serve` takes and `fusion chat` sends;
# --max-new-tokens (transformers' generate() name, and this command's until now) stays an alias.
MAX_TOKENS_FLAGS = ("--max-tokens", "--max-new-tokens")


def add_sampling_args(s: Any, max_tokens_help: str) -> None:
    """--max-tokens and the sampling parameters (generate and chat), in the "sampling" group."""
    s.add_argument(*MAX_TOKENS_FLAGS, dest="max_tokens", type=int, metavar="K", action=StoreFlag, help=max_tokens_help)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    s.add_argument("--top-k", type=int, default=0, help="keep the K likeliest tokens (default 0: all)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: all)")
    s.add_argument("--seed", type=int, help="sampling seed (default: a fresh one each run)")


def add_logging_args(g: Any) -> None:
    """--quiet and --log-format (worker, serve, generate): what they write on stderr (cli/logs.py)."""
    g.add_argument(
        "--quiet",
        action="store_true",
        help="no progress and no log lines on stderr, only warnings and errors",
    )
    g.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text: one line per event, timestamped off a terminal; json: one JSON object per line, for "
        "log collectors (default text)",
    )


def add_speculative_args(p: Any) -> None:
    """Speculative decoding on the client (generation/speculative.py), in vLLM's words."""
    from ..generation.speculative_config import METHODS

    p.add_argument(
        "--speculative",
        metavar="METHOD",
        help=f"speculative decoding: {' or '.join(METHODS)} (drafts proposed on this machine, verified by one "
        "sharded forward: the same tokens in fewer rounds; default: off)",
    )
    p.add_argument(
        "--draft-model",
        help="a small model of the same vocabulary that proposes drafts (HF dir or GGUF; default: none)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        help="most tokens proposed per step (default 4, suffix 32; the draft length adapts below it)",
    )
    p.add_argument(
        "--suffix-cache-tokens",
        type=int,
        help="--speculative suffix: tokens of earlier outputs kept to draft from (default 8192; 0: none)",
    )
    p.add_argument(
        "--link-rtt-ms",
        type=float,
        help="with --link-mbps: the round trip (ms) of the link the workers are reached over, when this "
        "job's own steps do not show it; draft trees are sized by it (default: measured from the steps)",
    )
    p.add_argument("--link-mbps", type=float, help="with --link-rtt-ms: that link's rate, Mbit/s")


def speculative_config(a: argparse.Namespace) -> Any:
    """The checked SpeculativeConfig of `--speculative/--draft-model/--num-speculative-tokens`, or None.
    Torch-free: a bad value is refused before anything loads."""
    from ..generation.speculative_config import from_flags

    cfg = from_flags(
        getattr(a, "speculative", None),
        getattr(a, "draft_model", None),
        getattr(a, "num_speculative_tokens", None),
        getattr(a, "suffix_cache_tokens", None),
        (getattr(a, "link_rtt_ms", None), getattr(a, "link_mbps", None)),
    )
    if cfg is not None and cfg.draft_model is not None:
        from ..weights.source import resolve_model_path

        try:
            resolve_model_path(cfg.draft_model)
        except FusionError as e:
            raise UsageError(f"--draft-model: {e}") from None
    return cfg


def speculator_for(cfg: Any, config: Any, context: int) -> Any:
    """The job's speculative.Speculator (its draft model loaded and its vocabulary checked against
    the target's `config`), before any worker starts; None without speculation."""
    if cfg is None:
        return None
    from ..generation.speculative import Speculator

    try:
        return Speculator(cfg, config.vocab, context)
    except UsageError:
        raise
    except FusionError as e:  # the draft model's own file is bad: the command line named it
        raise UsageError(f"--draft-model {cfg.draft_model}: {e}") from None


def _comm_backend(a: argparse.Namespace) -> str:
    if a.comm_backend is not None:
        return a.comm_backend
    return "tcp" if a.insecure else "tls"  # a local --device cuda run may get nccl: engine_options


def _topology(a: argparse.Namespace) -> Topology | None:
    if not getattr(a, "topology", None):
        return None
    if a.workers is not None or a.master or a.capacity:
        raise UsageError(
            "--topology names the workers, their capacities and the rendezvous: drop --workers/--capacity/--master"
        )
    topo = Topology.load(a.topology)
    a.model = a.model or topo.model_for(0) or model_from_env()
    return topo


def check_common(a: argparse.Namespace) -> None:
    if a.context is not None and a.context < 2:
        raise UsageError(f"--context must be >= 2, got {a.context}")
    if a.threads is not None and a.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {a.threads}")
    positive(a.timeout, "--timeout")
    positive(a.join_timeout, "--join-timeout")


def engine_options(a: argparse.Namespace, masked: bool = False) -> EngineOptions:
    """EngineOptions (or masked.MaskedOptions) from `fusion generate|serve|chat` arguments."""
    check_common(a)
    topo = _topology(a)
    common: dict[str, Any] = dict(
        topology=topo,
        key=load_key(a.key),
        insecure=a.insecure,
        master=None,
        comm_backend=_comm_backend(a),
        context=a.context,
        threads=a.threads,
        timeout_s=a.timeout,
        join_timeout_s=a.join_timeout,
        device=a.device,
        dtype=a.dtype,
        client_device=a.client_device,
        standby=a.standby,
        min_workers=a.min_workers,
        liveness_s=a.liveness,
        step_deadline_factor=a.step_deadline_factor,
        step_deadline_min_s=a.step_deadline_min,
        recover=not a.no_recover,
        executor=a.executor,
        ray_address=a.ray_address,
        ray_cpus=a.ray_cpus,
        run_worker=run_worker_in_thread if a.executor == "inproc" else None,  # workers as threads (tests)
    )
    if a.master is not None:
        host_port(a.master)
        common["master"] = a.master
    opts: EngineOptions  # masked.options.MaskedOptions in masked mode
    if masked:
        from ..masked.options import masked_options

        opts = masked_options(a.workers, topo, {**common, "capacities": capacities(a.capacity)})
    else:
        caps: tuple[float, ...] | None
        if topo is not None:
            if topo.masked:
                raise UsageError(f"{topo.path} names masked groups A and B: add --mode masked")
            n, caps = topo.n_workers, topo.capacities
        else:
            n = 2 if a.workers is None else a.workers
            if isinstance(n, tuple):
                raise UsageError(f"--workers {'+'.join(map(str, n))} (groups) needs --mode masked")
            if n < 1:
                raise UsageError(f"--workers must be >= 1, got {n}")
            caps = capacities(a.capacity)
        opts = EngineOptions(n_workers=n, capacities=caps, **common)
        if a.comm_backend is None and is_cuda(a.device) and opts.is_local:
            parse_device(a.device)
            opts.comm_backend = default_backend(a.device, n + a.standby, gpu_count(), a.insecure)
    opts.check()  # UsageError (exit 2) naming the flag to change
    opts.check_gpus()  # a GPU this machine lacks: before anything loads
    opts.log = engine_notice(logging.getLogger("fusion_compute.engine"))  # logs.py: timestamped off a terminal
    if opts.insecure:
        opts.log(
            "warning: --insecure: links are plaintext and workers are not authenticated: anyone on the "
            "path reads the shards, anyone who reaches the port can join"
        )
    elif opts.mpi_world:
        opts.log(
            "note: --comm-backend mpi across hosts: the workers' collectives are MPI's, plaintext on your "
            "cluster's network; the client's links stay TLS"
        )
    return opts


def context_for(model_window: int, requested: int | None) -> int:
    """KV positions per session for `--context` (engine_options.effective_context), refusing a value
    beyond the model's window rather than quietly running with less."""
    from ..runtime.engine_options import DEFAULT_CONTEXT, effective_context

    if requested is not None and requested > model_window:
        raise UsageError(
            f"--context {requested} is beyond the model's window of {model_window} tokens: give at most "
            f"{model_window} (without it: {min(model_window, DEFAULT_CONTEXT)})"
        )
    return effective_context(model_window, requested)


def tokenizer_for(path: Path, src: Any, needed: bool) -> Any:
    """The model's tokenizer; a model without one can still run --prompt-ids (text is then empty)."""
    from ..weights.tokenizer import Tokenizer, load_tokenizer

    if path.is_file():
        # Reuse the opened index (header and tensor table already parsed); the tokenizer reads its arrays.
        index = getattr(src, "index", None)
        return Tokenizer.from_gguf(path if index is None else index)
    if not (path / "tokenizer.json").is_file():
        if needed:
            raise UsageError(f"{path}: no tokenizer.json, so --prompt TEXT cannot be used; pass --prompt-ids")
        return None
    return load_tokenizer(path)


# ---- worker ----


def add_worker_args(g: dict[str, Any]) -> None:
    """`fusion worker`'s flags in their help groups ("workers", "network", "audit", "logging", "testing")."""
    w, net = g["workers"], g["network"]
    w.add_argument("--model", help=MODEL_HELP)
    w.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: this machine's cores divided among the topology's participants declared "
        "on it, client included; without a topology, among this worker and a client on the same machine)",
    )
    w.add_argument(
        "--device",
        help="cpu, cuda or cuda:K: where this worker computes (default: its topology entry's `device`, else cpu)",
    )
    net.add_argument(
        "--topology", help="TOML topology file: this worker finds itself in it by its --key (default $FUSION_TOPOLOGY)"
    )
    net.add_argument("--key", help="this worker's key file (- reads it from stdin; default $FUSION_KEY)")
    net.add_argument("--master", help="the client's HOST:PORT (without a topology)")
    net.add_argument("--client-key", help="the client's public key line (without a topology)")
    net.add_argument("--insecure", action="store_true", help="plaintext, unauthenticated (the client must say so too)")
    net.add_argument("--rank", type=int, help="claim this rank (checked by the client; required with --insecure)")
    net.add_argument(
        "--group", type=group_arg, help="masked mode: claim this group, A, B or B1..Bk (checked by the client)"
    )
    net.add_argument(
        "--timeout", type=float, default=120.0, help="bound on every wait for a peer, seconds (default 120)"
    )
    net.add_argument(
        "--join-timeout",
        type=float,
        default=120.0,
        help="bound on reaching and joining the client, seconds: then it gives up (default 120)",
    )
    g["audit"].add_argument("--audit-dir", help="record this worker's audit log into DIR (default: none)")
    log = g["logging"]
    log.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "off"),
        default="auto",
        help="load progress on stderr: auto = a bar on a terminal, else nothing (default auto)",
    )
    add_logging_args(log)
    t = g["testing"]
    t.add_argument(
        "--inject-leak",
        help="audit negative control: gather@LAYER | silent-gather@LAYER | rs-allreduce | keep-slots | stale-rollback (masked: a-to-b)",
    )
    t.add_argument(
        "--inject-fault",
        help="tests only: KIND@STEP, KIND one of runtime/faults.py's (an unknown one is refused with the list); masked: lie-one, lie-bias, lie-stale, lie-zeros or lie-shape@STEP",
    )
    t.add_argument(
        "--variant",
        choices=("sharded", "megatron"),
        default="sharded",
        help="megatron: replicated-residual baseline (benchmark / negative control)",
    )


def worker_options(a: argparse.Namespace, stdin: bytes | None = None) -> Any:
    """`fusion worker`'s options from its flags (`stdin`: its key bundle, when --key - and the worker
    is a thread that has no standard input of its own)."""
    from ..audit.recorder import AuditRecorder
    from ..bench.ops import WORKER_OPS
    from ..controls.worker import worker_controls
    from ..masked.member import run_member
    from ..structural.worker import WorkerOptions

    if a.threads is not None and a.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {a.threads}")
    positive(a.timeout, "--timeout")
    positive(a.join_timeout, "--join-timeout")
    writable_dir(a.audit_dir, "--audit-dir")
    key = None if a.insecure else load_key(a.key, stdin)
    listen_host, rank, group, model, device = None, a.rank, a.group, a.model, a.device
    if a.topology:
        if a.master or a.client_key:
            raise UsageError("--topology names the client and its key: drop --master/--client-key")
        topo = Topology.load(a.topology)
        me: Participant | None
        if a.insecure:
            if rank is None:
                raise UsageError("an --insecure worker must give --rank (there is no key to find it by)")
            me = topo.participant(rank)
        else:
            if key is None:
                raise UsageError("give --key FILE: the worker finds itself in the topology by its public key")
            topo.require_keys()
            me = topo.by_key(key.public)
            if me is None or me.rank == 0:
                raise UsageError(f"this worker's key ({key.public.fingerprint}) is not one of {topo.path}'s workers")
        check_here(me)
        sharing, among = sharing_this_host(topo), f"the {Path(a.topology).name} participants on this machine"
        master = (topo.client.host, topo.port)
        client_key = None if a.insecure else topo.client.key
        listen_host, model = me.host, model or topo.model_for(me.rank) or model_from_env()
        rank = rank if rank is not None else me.rank
        group = group or me.group
        device = device or me.device
    else:
        given = host_port(a.master)
        if given is None:
            raise UsageError("give --master HOST:PORT and --client-key (or --topology FILE)")
        master = given
        if a.insecure:
            if rank is None:
                raise UsageError("an --insecure worker must give --rank")
            client_key = None
        else:
            if key is None or a.client_key is None:
                raise UsageError("give --key FILE and --client-key LINE (or --insecure)")
            client_key = PublicId.parse(a.client_key, "--client-key")
        # Without a topology a worker cannot know its neighbours; a client at an address of this
        # machine shares its cores at least.
        client_here = is_local_address(master[0])
        sharing, among = 1 + client_here, "this worker and its client" if client_here else "this worker"
    if rank is not None and rank < 1:
        raise UsageError(f"--rank must be >= 1, got {rank}")
    device = device or "cpu"
    if is_cuda(device):
        check_gpus([device], gpu_count())  # one line, exit 2, before it joins
    threads = a.threads
    if threads is None:
        # Torch's default (every core) in each of several processes on one host oversubscribes it:
        # their OpenMP threads spin against each other (engine_options.default_threads).
        threads = default_threads(sharing)
        cap = omp_threads()
        capped = f", at most $OMP_NUM_THREADS = {cap}" if cap is not None and cap < usable_cores() // sharing else ""
        logging.getLogger("fusion_compute.worker").info(
            f"{threads} torch thread{'s' if threads != 1 else ''}: {usable_cores()} cores shared by {sharing} "
            f"({among}){capped}; --threads N sets it"
        )
    return WorkerOptions(
        master=master,
        key=key,
        client_key=client_key,
        model=model,
        listen_host=listen_host,
        rank=rank,
        group=group,
        threads=threads,
        timeout_s=a.timeout,
        join_timeout_s=a.join_timeout,
        device=device,
        progress=a.progress,
        audit_dir=a.audit_dir,
        recorder=partial(AuditRecorder.for_epoch, a.audit_dir) if a.audit_dir else None,  # the audit's, handed in
        controls=worker_controls(a.inject_fault, a.inject_leak, a.variant),  # chosen once, here
        ops=WORKER_OPS,  # the bench's control ops (stats, a collective's latency, the KV probe)
        modes={"masked": run_member},  # the worker serves the mode the client names
    )


def run_worker_in_thread(args: list[str], secret: bytes | None, on_leave: Callable[[Callable[[], None]], None]) -> None:
    """`fusion worker ARGS` in the calling thread (executor/inproc.py's entry, EngineOptions.run_worker):
    the same flags and options as a process's, its key bundle `secret` given as bytes, and a shell
    that leaves by returning (`own_process=False`: no os._exit, torch's thread count left to the
    process). No logging set-up (the process's own) and no progress lines. The controls that end or
    patch a process are refused: a thread shares both."""
    from dataclasses import replace

    from ..structural.worker import run
    from .parser import FusionParser, help_groups

    p = FusionParser(prog="fusion worker")
    add_worker_args(help_groups(p, "workers", "network", "audit", "logging", "testing"))
    a = p.parse_args(args)
    if a.inject_fault or a.inject_leak:
        raise UsageError("--inject-fault / --inject-leak end or patch a process: they need worker processes")
    run(replace(worker_options(a, secret), own_process=False, progress="off", on_leave=on_leave))
