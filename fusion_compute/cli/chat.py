"""`fusion chat`: an interactive terminal chat with history and streaming.

Local (default): this process is the client role, as in `fusion generate` (it spawns the workers,
or joins them with --topology / --master). Remote: `--url http://127.0.0.1:8000` talks to a running
`fusion serve` (the gateway is then the client role; keep it on your own machine).

Each turn sends the whole conversation through the model's chat template; when it no longer fits
the context window, the oldest turns are dropped (the system prompt stays). Ctrl-C stops a reply
(the engine finishes its current step, so the workers stay in step); at the prompt it drops the line
being typed; Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from ..runtime.progress import counted
from .options import add_api_key_args, api_key

HELP = """commands:
  /reset          start a new conversation (keeps the system prompt)
  /system TEXT    set the system prompt (and start over)
  /history        show the conversation so far
  /set KEY VALUE  max_tokens, temperature, top_p, top_k or seed for the next turns
  /workers        who holds the conversation: every worker, its rank, group and state
  /revoke ID      remove worker ID now (it wipes and leaves; a standby takes its place, if any)
  /add [KEY [HOST]] [GROUP]
                  enroll a standby: local runs spawn one; otherwise name its public key (and host);
                  masked jobs name its group (A, B or B1..Bk)
  /exit, /quit    leave (Ctrl-D too)
Ctrl-C stops a reply, or drops the line being typed."""


class ChatError(Exception):
    """A turn failed; `context_full` when the conversation no longer fits the context window."""

    def __init__(self, message: str, context_full: bool = False):
        super().__init__(message)
        self.context_full = context_full


class LocalBackend:
    """Generation in this process, through the same request checks and loop as `fusion serve`
    (gateway.py), without HTTP."""

    def __init__(self, gateway: Any):
        self.gateway = gateway
        self.model = gateway.card.id
        self.workers = gateway.n_workers
        self.context: int | None = gateway.card.context

    def reply(self, body: dict, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> dict:
        from pydantic import ValidationError

        from ..serving.gateway import ApiError, chat_request
        from ..serving.openai_protocol import ChatCompletionRequest, describe_validation_error

        try:
            req = chat_request(ChatCompletionRequest.model_validate({**body, "model": self.model}), self.gateway.card)
        except ValidationError as e:
            raise ChatError(describe_validation_error(e.errors(include_url=False))[0]) from None
        except ApiError as e:
            raise ChatError(e.message, context_full=e.code == "context_length_exceeded") from None
        out = self.gateway.run(req, emit, cancelled)
        return {
            "finish_reason": out.finish_reason,
            "usage": out.usage(),
            "fusion": self.gateway.protection(out),
            "timing": out.timing,
        }

    def membership(self, action: str, **kw: Any) -> dict:
        """workers | revoke(pid) | add(key, host, group) on the engine in this process."""
        from ..comm import CommError, IdentityError, PublicId
        from ..errors import UsageError

        engine = self.gateway.engine
        try:
            if action == "revoke":
                engine.revoke(kw["pid"])
            elif action == "add":
                key = PublicId.parse(kw["key"], "key") if kw.get("key") else None
                engine.add_standby(key, kw.get("host"), kw.get("group"))
        except (CommError, IdentityError, UsageError) as e:
            raise ChatError(str(e)) from None
        return {"epoch": engine.epoch, "workers": engine.workers()}

    def close(self) -> None:
        self.gateway.engine.close()


class HttpBackend:
    """A running `fusion serve`: streamed chat completions over HTTP (standard library only)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0):
        from urllib.parse import urlsplit

        u = urlsplit(url if "://" in url else f"http://{url}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ChatError(f"--url must be http://HOST:PORT, got {url!r}")
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.base = u.path.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._conn: Any = None
        models = self._get("/models")
        try:
            self.model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ChatError(f"{url}: /v1/models lists no model") from None
        self.workers = self.context = None
        try:  # the gateway's /health names the worker count and the context window
            health = self._get("/health", root=True)
            self.workers, self.context = health.get("workers"), health.get("context")
        except (ChatError, ValueError, AttributeError):
            pass

    def _connection(self) -> Any:
        import http.client

        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def _headers(self) -> dict:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _request(self, method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One request on a fresh connection: (status, body); ChatError when the server is unreachable."""
        conn = self._connection()
        try:
            conn.request(method, url, body=body, headers=self._headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        except OSError as e:
            raise ChatError(f"cannot reach {self.host}:{self.port}: {e}") from None
        finally:
            conn.close()

    def _get(self, path: str, root: bool = False) -> dict:
        url = (self.base.removesuffix("/v1") if root else self.base) + path
        status, data = self._request("GET", url)
        if status != 200:
            raise ChatError(f"GET {url}: HTTP {status}: {_error_message(data)}")
        try:
            out = json.loads(data)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise ChatError(f"GET {url} at {self.host}:{self.port} did not answer JSON: is it a `fusion serve`?")
        return out

    def membership(self, action: str, **kw: Any) -> dict:
        """The server's /admin endpoints (it must run with --api-key)."""
        root = self.base.removesuffix("/v1")
        if action == "workers":
            method, path, body = "GET", "/admin/workers", None
        elif action == "revoke":
            method, path, body = "POST", f"/admin/workers/{kw['pid']}/revoke", b""
        else:
            body = json.dumps({k: v for k, v in kw.items() if v is not None}).encode()
            method, path = "POST", "/admin/workers"
        status, data = self._request(method, root + path, body)
        if status not in (200, 201):
            raise ChatError(f"HTTP {status}: {_error_message(data)}")
        return json.loads(data)

    def reply(self, body: dict, emit: Callable[[str], None], cancelled: Callable[[], bool]) -> dict:
        conn = self._connection()
        self._conn = conn
        info: dict = {}
        try:
            payload = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
            conn.request("POST", self.base + "/chat/completions", body=json.dumps(payload), headers=self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                data = resp.read()
                err = _error_body(data)
                raise ChatError(
                    f"HTTP {resp.status}: {_error_message(data)}",
                    context_full=err.get("code") == "context_length_exceeded",
                )
            for raw in resp:  # bounded: the server ends every stream with [DONE] (or closes it)
                if cancelled():
                    info["finish_reason"] = "cancelled"
                    break  # closing the connection tells the server to stop generating
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise ChatError(obj["error"].get("message", "error"))
                for choice in obj.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        emit(text)
                    if choice.get("finish_reason"):
                        info["finish_reason"] = choice["finish_reason"]
                if "usage" in obj and obj["usage"]:
                    info["usage"] = obj["usage"]
                if "fusion" in obj:
                    info["fusion"] = obj["fusion"]
                    info["timing"] = obj["fusion"].get("timing", {})
        except OSError as e:
            raise ChatError(f"connection to {self.host}:{self.port} failed: {e}") from None
        finally:
            conn.close()
            self._conn = None
        return info

    def close(self) -> None:
        pass


def _error_body(data: bytes) -> dict:
    try:
        err = json.loads(data).get("error") or {}
    except (ValueError, AttributeError):
        return {}
    return err if isinstance(err, dict) else {}


def _error_message(data: bytes) -> str:
    """The API's error message; for anything else (another server's HTML page), a word about it, never
    the page itself."""
    message = _error_body(data).get("message")
    if isinstance(message, str) and message:
        return message.splitlines()[0] if message.strip() else message
    return f"not an API error ({len(data)} bytes that are not this API's JSON): is it a `fusion serve`?"


class _Interrupt:
    """While a reply streams, Ctrl-C sets a flag instead of raising: the engine must finish the
    step it is in, or client and workers would fall out of step."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self._old: Any = None

    def __enter__(self) -> _Interrupt:
        self.flag.clear()
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, lambda *_: self.flag.set())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


class _SigintToMain:
    """Ctrl-C at the prompt wakes the main thread, whichever thread the kernel hands SIGINT to.

    A process-directed signal goes to any thread that does not block it, and CPython runs the handler
    only in the main thread, when it next runs bytecode; the main thread asleep in readline's select()
    for the next line is not woken by a SIGINT another thread took (this client's link, liveness and
    worker-watch threads, torch's pool), and Ctrl-C did nothing until the next key (seen on this
    project's 2-core VM: tests/test_chat.py's terminal test, and 3 of torch's threads with SIGINT
    open). Every signal with a Python handler writes its number to the wakeup fd (signal.set_wakeup_fd)
    from whichever thread takes it; a thread of ours (SIGINT and SIGUSR2 blocked) reads it and, for a
    SIGINT, sends the main thread a SIGUSR2 of its own: its select() returns EINTR, CPython runs the
    pending handlers, and the SIGINT's raises KeyboardInterrupt (SIGUSR2's does nothing, so one that
    comes after the main thread had taken the SIGINT itself changes nothing)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self._pipe: tuple[int, int] | None = None

    def __enter__(self) -> _SigintToMain:
        if not self.enabled:
            return self
        self._pipe = r, w = os.pipe()
        os.set_blocking(w, False)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._old_usr2 = signal.signal(signal.SIGUSR2, lambda *_: None)
        threading.Thread(target=self._forward, args=(r,), name="fusion-chat-sigint", daemon=True).start()
        return self

    @staticmethod
    def _forward(r: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR2})
        main = threading.main_thread().ident
        while True:
            try:
                got = os.read(r, 64)
            except OSError:
                return
            if not got:  # __exit__ closed the write end
                os.close(r)
                return
            if signal.SIGINT in got and main is not None:
                signal.pthread_kill(main, signal.SIGUSR2)

    def __exit__(self, *exc: Any) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_fd)
        signal.signal(signal.SIGUSR2, self._old_usr2)
        os.close(self._pipe[1])
        self._pipe = None


def chat_loop(
    backend: Any,
    params: dict,
    system: str | None,
    stdin: IO[str],
    stdout: IO[str],
    stderr: IO[str],
    interactive: bool,
) -> int:
    """Read a line, answer it with the whole conversation as context, print the reply as it streams."""
    with _SigintToMain(interactive and stdin is sys.stdin):
        return _converse(backend, params, system, stdin, stdout, stderr, interactive)


def _converse(
    backend: Any,
    params: dict,
    system: str | None,
    stdin: IO[str],
    stdout: IO[str],
    stderr: IO[str],
    interactive: bool,
) -> int:
    history: list[dict] = []
    prompt = "you> " if interactive else ""
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and up-arrow history for input()
        except ImportError:
            pass
        stderr.write(
            f"fusion chat: {backend.model}"
            + (f" on {counted(backend.workers, 'worker')}" if backend.workers else "")
            + ". /help for commands, Ctrl-D to leave.\n"
        )
        stderr.flush()
    while True:
        try:
            if interactive and stdin is sys.stdin:
                line = input(prompt)
            else:
                stdout.write(prompt)
                stdout.flush()
                line = stdin.readline()
                if not line:
                    raise EOFError
        except EOFError:
            stdout.write("\n")
            return 0
        except UnicodeDecodeError:  # a strict UTF-8 stdin; the line is lost either way
            line = "\udcff"  # said below, as for a line read with its bad bytes escaped
        except KeyboardInterrupt:
            stdout.write("\n")
            if not interactive:  # a script's chat: Ctrl-C ends it
                return 0
            # As Ollama and Python's REPL: Ctrl-C drops the line being typed, never the conversation.
            stderr.write("(Ctrl-D or /quit leaves)\n")
            stderr.flush()
            continue
        text = line.strip()
        if not text:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that are not UTF-8 (stdin escapes them): no tokenizer takes them
            stderr.write("(that line is not UTF-8 text: not sent; convert it, e.g. with iconv)\n")
            stderr.flush()
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/help":
                stdout.write(HELP + "\n")
            elif cmd == "/reset":
                history.clear()
                stdout.write("(new conversation)\n")
            elif cmd == "/system":
                system = arg.strip() or None
                history.clear()
                stdout.write(f"(system prompt {'set' if system else 'cleared'}; new conversation)\n")
            elif cmd == "/set":
                stdout.write(_set_param(params, arg, getattr(backend, "context", None)) + "\n")
            elif cmd in ("/workers", "/revoke", "/add"):
                stdout.write(_membership(backend, cmd, arg) + "\n")
            elif cmd == "/history":
                if system:
                    stdout.write(f"[system] {system}\n")
                for m in history:
                    stdout.write(f"[{m['role']}] {m['content']}\n")
                if not history:
                    stdout.write("(empty)\n")
            else:
                stdout.write(f"unknown command {cmd}; /help lists them\n")
            stdout.flush()
            continue
        history.append({"role": "user", "content": text})
        reply = _turn(backend, params, system, history, stdout, stderr, interactive)
        if reply is None:
            history.pop()  # the turn failed: forget the question too
        else:
            history.append({"role": "assistant", "content": reply})


def _membership(backend: Any, cmd: str, arg: str) -> str:
    """/workers, /revoke ID, /add [KEY [HOST]] [GROUP]: the answer to print (errors included)."""
    from ..runtime.topology import GROUP_NAME

    words = arg.split()
    try:
        if cmd == "/workers":
            state = backend.membership("workers")
        elif cmd == "/revoke":
            if len(words) != 1 or not words[0].isdigit():
                return "/revoke takes a worker id (/workers lists them)"
            state = backend.membership("revoke", pid=int(words[0]))
        else:
            group = words.pop() if words and GROUP_NAME.match(words[-1]) else None
            if len(words) > 2:
                return "/add takes [KEY [HOST]] [GROUP: A, B or B1..Bk]"
            key, host = (words + [None, None])[:2]
            state = backend.membership("add", key=key, host=host, group=group)
    except ChatError as e:
        return f"({e})"
    rows = [f"epoch {state['epoch']}:"]
    for w in state["workers"]:
        rank = f"rank {w['rank']}" if w["rank"] else "-"
        group = f" group {w['group']}" if w.get("group") else ""
        rows.append(f"  worker {w['id']:<3} {rank:<8}{group} {w['state']}  {_address(w.get('where'))}".rstrip())
    return "\n".join(rows)


def _address(where: str | None) -> str:
    """Where a worker is, without the role it was enrolled in: the roster's label reads "standby 3
    [127.0.0.1, key ...]" even once that standby holds a rank ("rank 1 active standby 3" read as two
    states), so the listing keeps the bracketed address and key only."""
    if not where:
        return ""
    return where[where.index("[") :] if "[" in where else where


_PARAMS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


def _set_param(params: dict, arg: str, context: int | None = None) -> str:
    """`/set KEY VALUE`: checked now as every request will check it (the API's request model, then the
    sampling values; max_tokens against the context window), so that a value the engine would refuse
    is refused here, not by every turn after it."""
    key, _, value = arg.strip().partition(" ")
    if key not in _PARAMS:
        return f"/set takes one of {', '.join(_PARAMS)}"
    try:
        parsed = _PARAMS[key](value.strip())
    except ValueError:
        return f"{key} takes a{'n integer' if _PARAMS[key] is int else ' number'}, got {value.strip()!r}"
    why = _refused({**params, key: parsed}, context)
    if why is not None:
        return f"({key} not set: {why}; it stays {params.get(key, 'the default')})"
    params[key] = parsed
    return f"({key} = {params[key]})"


def _refused(params: dict, context: int | None) -> str | None:
    """Why a request with these parameters would be refused whatever its messages, else None."""
    from pydantic import ValidationError

    from ..generation.sampling_params import SamplingError, SamplingParams
    from ..serving.openai_protocol import ChatCompletionRequest, describe_validation_error

    try:
        body = ChatCompletionRequest.model_validate(
            {"model": "-", "messages": [{"role": "user", "content": "-"}], **params}
        )
    except ValidationError as e:
        return describe_validation_error(e.errors(include_url=False))[0]
    try:  # gateway._request's values
        SamplingParams(
            temperature=body.temperature or 0.0,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
        )
    except SamplingError as e:
        return str(e)
    n = params.get("max_tokens")
    if context is not None and n is not None and n >= context:
        return f"max_tokens {n} leaves no room for any prompt in the {context}-token context; at most {context - 1}"
    return None


def _turn(
    backend: Any,
    params: dict,
    system: str | None,
    history: list[dict],
    stdout: IO[str],
    stderr: IO[str],
    interactive: bool,
) -> str | None:
    parts: list[str] = []

    def emit(text: str) -> None:
        parts.append(text)
        stdout.write(text)
        stdout.flush()

    while True:
        messages = ([{"role": "system", "content": system}] if system else []) + history
        try:
            with _Interrupt() as stop:
                info = backend.reply({"messages": messages, **params}, emit, stop.flag.is_set)
            break
        except ChatError as e:
            if e.context_full and len(history) > 1 and not parts:
                del history[: 2 if len(history) > 2 else 1]  # the oldest user/assistant pair
                stderr.write("(dropped the oldest turn to fit the context window)\n")
                continue
            stdout.write("\n" if parts else "")
            stderr.write(f"fusion chat: error: {e}\n")
            stderr.flush()
            return None
    stdout.write("\n")
    stdout.flush()
    if info.get("finish_reason") == "cancelled":
        stderr.write("(stopped)\n")
    elif info.get("finish_reason") == "abort":  # the server cut it (fusion serve stopping)
        stderr.write("(the server stopped this reply before its end)\n")
    elif not "".join(parts).strip():
        stderr.write("(no text: the model ended its turn at once; /reset or rephrase)\n")
    elif interactive:
        usage = info.get("usage") or {}
        timing = info.get("timing") or {}
        fusion = info.get("fusion") or {}
        audit = (fusion.get("audit") or {}).get("checked")
        n = usage.get("completion_tokens")
        bits = [counted(n, "token") if isinstance(n, int) else "? tokens"]
        if timing.get("decode_tokens_per_s"):
            bits.append(f"{timing['decode_tokens_per_s']:.1f} tok/s")
        if fusion.get("workers"):
            steps = fusion.get("steps")
            bits.append(
                f"{counted(fusion['workers'], 'worker')}, "
                + (counted(steps, "step") if isinstance(steps, int) else "? steps")
            )
        if audit:  # a live reply is never audited (serving/gateway.py); say nothing unless one was
            bits.append("audit checked")
        stderr.write("\x1b[2m[" + " · ".join(bits) + "]\x1b[0m\n" if stderr.isatty() else "[" + ", ".join(bits) + "]\n")
        stderr.flush()
    return "".join(parts)


def add_parser(sub: Any, add_engine: Callable[[Any], None]) -> None:
    from .options import add_sampling_args
    from .parser import help_groups

    c = sub.add_parser("chat", help="interactive chat in the terminal (local engine, or --url of a fusion serve)")
    g = help_groups(c, "chat", "sampling", "workers", "network", "recovery", "speculative")
    ch = g["chat"]
    ch.add_argument("--url", help="talk to a running `fusion serve` (http://HOST:PORT) instead of starting workers")
    add_api_key_args(ch, "API key for --url")
    ch.add_argument("--system", help="system prompt (default: none)")
    add_sampling_args(g["sampling"], "reply length limit per turn (default 256, capped by the context)")
    g["workers"].add_argument(
        "--mode",
        choices=("structural", "masked"),
        default="structural",
        help="structural only here: for the masked mode, `fusion serve --mode masked` and `fusion chat --url`",
    )
    add_engine(g)
    c.set_defaults(func=cmd_chat)


def cmd_chat(a: Any) -> int:
    from ..errors import UsageError
    from ..generation.sampling_params import SamplingParams
    from ..runtime.progress import is_tty
    from . import logs
    from .parser import flag_name

    logs.setup("fusion chat", info=False)  # the engine's warnings (a recovery) on stderr; the chat on stdout
    if not a.url and (a.mode == "masked" or isinstance(a.workers, tuple)):
        groups = "+".join(map(str, a.workers)) if isinstance(a.workers, tuple) else "2+2"
        raise UsageError(
            "fusion chat runs the structural mode on its own workers; for the masked mode start "
            f"`fusion serve --mode masked --workers {groups}` and chat with it: `fusion chat --url http://127.0.0.1:8000`"
        )
    SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed)  # fail before spawning
    if a.max_tokens is not None and a.max_tokens < 1:
        raise UsageError(f"{flag_name(a, 'max_tokens', '--max-tokens')} must be >= 1, got {a.max_tokens}")
    params: dict = {"temperature": a.temperature, "top_p": a.top_p}
    if a.top_k:
        params["top_k"] = a.top_k
    if a.seed is not None:
        params["seed"] = a.seed
    if a.max_tokens is not None:
        params["max_tokens"] = a.max_tokens
    interactive = is_tty(sys.stdin)
    if a.url and (a.speculative or a.draft_model or a.num_speculative_tokens is not None):
        raise UsageError(
            "--speculative and --draft-model are the local engine's: with --url the server's own flags decide"
        )
    try:
        if a.url:
            backend: Any = HttpBackend(a.url, api_key(a, "chat"))
        else:
            from ..serving.gateway import open_gateway

            gateway, _ = open_gateway(a, always_log=False)
            backend = LocalBackend(gateway)
    except ChatError as e:
        raise UsageError(str(e)) from None
    try:
        return chat_loop(backend, params, a.system, sys.stdin, sys.stdout, sys.stderr, interactive)
    finally:
        backend.close()
