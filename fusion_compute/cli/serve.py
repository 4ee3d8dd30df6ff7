"""`fusion serve`: the OpenAI-compatible HTTP gateway, on the user side, from the command line.

The gateway *is* the client role (docs/design.md, "Roles"): text and token ids never leave this machine except
in the HTTP answer to the caller, which is why it binds 127.0.0.1 unless told otherwise. This file
is the command: its flags, binding the port, starting the workers, and an orderly stop. The core
is gateway.py (transport-free), the HTTP side api_server.py and http_limits.py; the HTTP stack is
imported only when `fusion serve` runs, not by every `fusion` command.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from ..serving.gateway import DEFAULT_MAX_QUEUE, DEFAULT_MAX_TOKENS
from .options import add_api_key_args, api_key

# Continuous batching by default, as an inference server's users expect: 8 sessions decoding together
# gave 4.6-4.7x one session's aggregate decode tokens/s at N = 2 (docs/serving.md, measured), a lone
# request decodes as fast (~0.1 s more to its first token: zeroing idle slots), and the KV slots cost 94 MB each per worker on SmolLM2 at N = 2 and the
# default 4096 positions (750 MB for 8). --max-batch 1 keeps the old one-at-a-time queue.
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_REQUEST_TIMEOUT_S = 30.0
LISTEN_BACKLOG = 128


def add_parser(sub: Any, add_engine: Callable[[Any], None]) -> None:
    from .options import MAX_TOKENS_FLAGS, add_logging_args
    from .parser import help_groups

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP gateway (the client role) over sharded workers")
    g = help_groups(p, "serving", "workers", "network", "recovery", "speculative", "logging")
    s = g["serving"]
    g["workers"].add_argument(
        "--mode",
        choices=("structural", "masked"),
        default="structural",
        help="masked: --workers A+B (or A+B1+...+Bk) compute on one-time-pad-masked data (docs/masked.md)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, help="port (default $FUSION_PORT, else 8000; 0 = any free port)")
    s.add_argument("--served-model-name", help="model id for the API (default: the model file or directory name)")
    s.add_argument(
        *MAX_TOKENS_FLAGS,
        dest="max_tokens",
        type=int,
        metavar="K",
        help=f"max_tokens of a request that names none (default {DEFAULT_MAX_TOKENS}, capped by the room its "
        "prompt leaves in the context)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help=f"waiting requests before 429 (default {DEFAULT_MAX_QUEUE})",
    )
    s.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"sessions decoded together, one sharded step for all (continuous batching; default "
        f"{DEFAULT_MAX_BATCH}; 1: one request at a time; both modes; docs/serving.md)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections before 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds for a request's headers to arrive, then for its body (default %(default)g)",
    )
    add_api_key_args(
        s, "require Authorization: Bearer KEY on /v1, /admin and /metrics (default: none, as befits 127.0.0.1)"
    )
    add_engine(g)
    add_logging_args(g["logging"])
    p.set_defaults(func=cmd_serve)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket for HOST:PORT: IPv4 (a name resolves to its IPv4 address), IPv6 for a literal such as ::1."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=LISTEN_BACKLOG)


def cmd_serve(a: Any) -> int:
    from ..errors import UsageError
    from ..serving.gateway import open_gateway
    from ..serving.scheduler import Scheduler

    key = api_key(a, "serve")  # first: its warning shows even when another value is refused
    if not (0 <= a.port < 65536):
        raise UsageError(f"--port must be in 0..65535, got {a.port}")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {a.max_queue}")
    from ..structural.protocol import MAX_SLOTS

    if not (1 <= a.max_batch <= MAX_SLOTS):
        raise UsageError(f"--max-batch must be in 1..{MAX_SLOTS}, got {a.max_batch}")
    if a.max_connections < 1:
        raise UsageError(f"--max-connections must be >= 1, got {a.max_connections}")
    if not (0 < a.request_timeout < float("inf")):
        raise UsageError(f"--request-timeout must be > 0, got {a.request_timeout}")

    from ..runtime.progress import counted
    from ..serving.api_server import create_app, run_http, wrap
    from ..serving.http_limits import printable
    from . import logs

    logger = logs.setup("fusion serve", quiet=a.quiet, fmt=a.log_format)  # timestamped off a terminal

    def log(line: str) -> None:
        # The serving modules name the program in their lines; the log's format names it now.
        text = printable(line).removeprefix("fusion serve: ")
        if text.startswith("warning: "):
            logger.warning(text.removeprefix("warning: "))
        else:
            logger.info(text)

    # Bind first: a busy port fails in a second, not after the workers have loaded.
    try:
        sock = bind(a.host, a.port)
    except OSError as e:
        raise UsageError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    try:
        gateway, _ = open_gateway(a)
    except BaseException:
        sock.close()
        raise
    scheduler = Scheduler(gateway, a.max_queue, log, max_batch=a.max_batch)
    try:
        app = wrap(create_app(gateway, scheduler, admin=key is not None), key, log, a.request_timeout)
        host, port = sock.getsockname()[:2]
        if a.host not in ("127.0.0.1", "localhost", "::1"):
            log(
                f"fusion serve: warning: listening on {a.host}: anyone who can reach it reads the answers "
                "(no TLS" + ("" if key else ", no API key") + ")"
            )
        shown = f"[{host}]" if ":" in host else host
        batch = f", up to {a.max_batch} requests at once" if a.max_batch > 1 else ""
        log(
            f"fusion serve: listening on http://{shown}:{port}/v1 "
            f"(model {gateway.card.id}, {counted(gateway.n_workers, 'worker')}{batch})"
        )
        if key is not None:  # the page exists only with a key (control_page.py)
            log(f"fusion serve: control page: http://{shown}:{port}/control")
        run_http(sock, app, a.max_connections, scheduler.stop, log, a.request_timeout, key)
    finally:
        sock.close()
        procs = gateway.engine.procs
        if procs is not None:
            procs.closing = True  # Ctrl-C reached the workers too: their exit is expected now
        scheduler.close()
        gateway.engine.close()
    return 0
