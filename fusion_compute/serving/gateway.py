"""The gateway's core, without HTTP: a checked request in, generated text out.

The gateway *is* the client role (docs/design.md, "Roles"): tokenizer, chat template, embedding, LM head and
sampling run in this process; the workers see embedding shards only, exactly as with
`fusion generate`. `fusion serve` (api_server.py) puts HTTP in front of it; `fusion chat` calls it
directly.

    validated body (openai_protocol) --chat_request / completion_request--> Request
    Request --Scheduler.submit (scheduler.py)--> the one engine thread --Gateway.run--> delta ... done | error

Requests wait in a FIFO served by a single engine thread: one at a time by default, or up to
`--max-batch` sessions decoding together, one sharded step for all of them (batching.py; each
request's tokens are the ones it gets alone). An error while serving one request fails that request
only (in a batch, a failed step fails the requests in it); only
a lost worker the engine could not replace (comm.CommError) fails it with 503, and the gateway stays up:
the next request tries again (scheduler.py).

Every answer carries a `fusion` object (Gateway.protection): workers, steps run, plan fingerprint,
and `audit`, which says `checked: false` and why.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..generation.sampling_params import SamplingParams
    from .openai_protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest

DEFAULT_MAX_TOKENS = 256  # when the request names none (capped by the context window)
DEFAULT_MAX_QUEUE = 64  # waiting requests before 429
# 0 < temperature < this samples at this (vLLM's rule): the scaled logits stay finite in float32.
TEMPERATURE_FLOOR = 0.01
# Per-request audit status. The audit (fusion_compute/audit/) verifies the hash-chained logs of a
# finished run (`fusion audit run` / `verify`): its verifier needs every log closed with an end
# record, so it cannot certify one request of a live server. We say so instead of claiming it.
AUDIT_UNCHECKED = {
    "checked": False,
    "reason": "not verified per request: the audit verifier (fusion audit verify) checks the closed logs of a "
    "finished run, not one session of a live server; `split` states the plan's layout, not an observed result",
}


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, kind="server_error")


# ---- requests ----


@dataclass(frozen=True)
class ModelCard:
    """What the gateway serves: the name callers use and the limits requests are checked against.
    `max_token_bytes`: the longest token's text in UTF-8 bytes (0: unknown), which bounds the text
    that could possibly fit the context window."""

    id: str
    tokenizer: Any
    context: int
    vocab: int
    eos_ids: tuple[int, ...]
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_token_bytes: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_text_bytes(self) -> int | None:
        """Text longer than this tokenizes to more tokens than the context holds, whatever it says:
        every token covers at most `max_token_bytes` bytes."""
        return self.context * self.max_token_bytes if self.max_token_bytes else None


def longest_token_bytes(tokenizer: Any) -> int:
    """The longest token's text in UTF-8 bytes (special tokens included: their text is matched too)."""
    return max(len(tokenizer.decode([i]).encode()) for i in range(tokenizer.vocab_size))


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def check_model(name: str, card: ModelCard) -> None:
    if name != card.id:
        raise ApiError(
            404, f"The model `{name}` does not exist (this server serves `{card.id}`)", "model", "model_not_found"
        )


def _too_long(what: str, card: ModelCard, param: str) -> ApiError:
    return ApiError(
        400, f"{what} cannot fit the context window of {card.context} tokens", param, "context_length_exceeded"
    )


def _check_text_size(texts: list[str], card: ModelCard, param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit: tokenizing megabytes takes seconds."""
    limit = card.max_text_bytes
    if limit is not None:
        n = sum(len(t.encode()) for t in texts)
        if n > limit:
            raise _too_long(f"a prompt of {n} bytes (over {card.max_token_bytes} bytes per token)", card, param)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`, as tokenizer.Tokenizer computes them, but through the backend's
    `encode_batch`, which releases the GIL (`encode` holds it, so tokenizing a long prompt would
    stall every stream the server is writing meanwhile)."""
    return tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def chat_request(body: ChatCompletionRequest, card: ModelCard) -> Request:
    """A validated /v1/chat/completions body -> Request (chat template, tokenizing), or ApiError.
    Takes up to a few hundred ms for a long conversation: run it off the serving loop."""
    check_model(body.model, card)
    if len(body.messages) >= card.context:  # every message costs at least one token of template
        raise _too_long(f"{len(body.messages)} messages", card, "messages")
    chat = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    _check_text_size([m["content"] for m in chat], card, "messages")
    tok = card.tokenizer
    try:
        text = tok.render_chat(chat)
    except Exception as e:  # the template is the model's code: it may refuse roles or orders
        raise ApiError(400, f"the model's chat template rejected the messages: {e}", "messages") from None
    _check_text_size([text], card, "messages")
    # No post-processor BOS: templates write their own (as Tokenizer.chat_ids does).
    return _request(body, card, "chat", _encode(tok, text, add_special_tokens=False))


def completion_request(body: CompletionRequest, card: ModelCard) -> Request:
    """A validated /v1/completions body -> Request. prompt: text or token ids, one prompt only."""
    check_model(body.model, card)
    try:
        prompt = body.single_prompt()
    except ValueError as e:
        raise ApiError(400, str(e), "prompt") from None
    if not prompt:
        raise ApiError(400, "empty prompt", "prompt")
    if isinstance(prompt, str):
        _check_text_size([prompt], card, "prompt")
        ids = _encode(card.tokenizer, prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
    return _request(body, card, "completion", ids)


def _request(body: GenerationRequest, card: ModelCard, kind: str, prompt_ids: list[int]) -> Request:
    from ..errors import InputError
    from ..generation.result import check_prompt
    from ..generation.sampling_params import SamplingError, SamplingParams

    t = body.temperature or 0.0
    try:
        sampling = SamplingParams(
            temperature=max(t, TEMPERATURE_FLOOR) if t > 0 else 0.0,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
        )
    except SamplingError as e:
        raise ApiError(400, str(e)) from None
    key, requested = body.max_tokens_param()
    n_prompt = len(prompt_ids)
    try:
        check_prompt(prompt_ids, card.vocab, card.context, 1)
    except InputError as e:
        code = "context_length_exceeded" if "context window" in str(e) else None
        raise ApiError(400, str(e), "messages" if kind == "chat" else "prompt", code) from None
    room = card.context - n_prompt
    if requested is not None and requested > room:
        raise ApiError(
            400,
            f"this model's context window is {card.context} tokens; the prompt has {n_prompt} and "
            f"{key} = {requested} asks for more than the {room} left",
            key,
            "context_length_exceeded",
        )
    max_tokens = requested if requested is not None else min(card.default_max_tokens, room)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Request(kind, prompt_ids, max_tokens, sampling, body.stops(), bool(body.stream), include_usage)


# ---- generation ----


class StopMatcher:
    """Cuts generated text at the first stop sequence. Streaming-safe: text that could be the
    start of a stop sequence is held back until it is known not to be one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, delta: str) -> str:
        """New text in; the text now safe to emit out. After a match, `stopped` is True."""
        if self.stopped or not delta:
            return ""
        if not self.stops:
            return delta
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)]
        hold = 0  # longest suffix of text that is a proper prefix of a stop sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


@dataclass
class Outcome:
    text: str
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    steps: int
    timing: dict
    recoveries: list[dict] = field(default_factory=list)  # epochs opened while it ran (a worker lost)
    speculative: dict | None = None  # speculative decoding's counters for this request

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Answer:
    """One request's answer as its tokens arrive: `on_token(id)` (True: stop generating) streams
    the text through `emit`; `outcome(result)` closes it."""

    def __init__(self, card: ModelCard, req: Request, emit: Callable[[str], None], cancelled: Callable[[], bool]):
        self.eos = set(card.eos_ids)
        self.stream = card.tokenizer.stream(skip_special=True)
        self.matcher = StopMatcher(req.stop)
        self.emit, self.is_cancelled = emit, cancelled
        self.parts: list[str] = []
        self.cancelled = False
        self.t0 = time.perf_counter()

    def _out(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.emit(text)

    def on_token(self, tok: int) -> bool:
        if tok not in self.eos:
            self._out(self.matcher.push(self.stream.push(tok)))
        if self.is_cancelled():
            self.cancelled = True
            return True
        return self.matcher.stopped

    def outcome(self, res: Any) -> Outcome:
        """`res`: the result.GenerationResult of the session."""
        if not self.matcher.stopped:
            self._out(self.matcher.push(self.stream.flush()))
            self._out(self.matcher.flush())
        finish = "cancelled" if self.cancelled else ("stop" if self.matcher.stopped else res.finish_reason)
        return Outcome(
            text="".join(self.parts),
            finish_reason=finish,
            prompt_tokens=res.prompt_tokens,
            completion_tokens=len(res.token_ids),
            steps=res.steps,
            timing={
                "run_s": round(time.perf_counter() - self.t0, 4),
                "ttft_s": round(res.ttft_s, 4),
                "decode_tokens_per_s": round(res.decode_tokens_per_s, 3),
            },
            recoveries=res.recoveries,
            speculative=res.speculative,
        )


class Gateway:
    """The client role behind the API: one engine and its tokenizer."""

    def __init__(self, engine: Any, card: ModelCard, speculator: Any = None):
        self.engine = engine
        self.card = card
        self.speculator = speculator  # generation.speculative.Speculator, or None
        self.n_workers = engine.plan.n
        self.fingerprint = engine.plan.fingerprint()
        self.masked = engine.mode == "masked"

    def run(self, req: Request, emit: Callable[[str], None], cancelled: Callable[[], bool] = lambda: False) -> Outcome:
        """Generate for `req` in a fresh session; `emit(text)` gets each new piece of the answer."""
        from ..generation.generate import generate

        gen = self.begin(req, emit, cancelled)
        res = generate(
            self.engine,
            req.prompt_ids,
            max_new_tokens=req.max_tokens,
            sampling=req.sampling,
            stop_ids=self.card.eos_ids,
            on_token=gen.on_token,
            speculator=self.speculator,
        )
        return gen.outcome(res)

    def begin(self, req: Request, emit: Callable[[str], None], cancelled: Callable[[], bool] = lambda: False) -> Answer:
        """The text side of one request (detokenizing, stop strings, cancellation), fed token by
        token: by `run`, or by the batch loop (scheduler.py) for a session of a batch."""
        return Answer(self.card, req, emit, cancelled)

    def protection(self, outcome: Outcome | None) -> dict:
        """The `fusion` extension object: what was protected for this request."""
        n = self.engine.plan.n  # the current epoch's (a recovery may have changed it)
        common = {
            "workers": n,
            "steps": outcome.steps if outcome else 0,
            "plan": self.engine.plan.fingerprint(),
            "protected": ["residual", "qkv", "mlp_activations", "kv_cache"],
        }
        if outcome is not None and outcome.speculative is not None:
            common["speculative"] = outcome.speculative
        if outcome is not None and outcome.recoveries:
            common["recovered"] = [
                {k: r.get(k) for k in ("epoch", "lost", "order", "reason", "epoch_s", "replay_s")}
                for r in outcome.recoveries
            ]
        if self.masked:
            from ..masked.verify import ESCAPE_BOUND  # the check's bound, stated in one place

            p = self.engine.plan
            return {
                "mode": "masked",
                **common,
                "groups": list(p.sizes),
                "split": (
                    "by the protocol, group A receives only one-time-pad-masked ring elements, each mask group "
                    "only its own mask key; the client alone holds clear values (assumes A does not collude with "
                    f"a member of every mask group: {len(p.mask_groups)} here)"
                ),
                "verified": (
                    "every product the workers returned passed the client's check (Freivalds over the integers; "
                    f"a wrong one escapes with probability <= {ESCAPE_BOUND} per linear and token)"
                    if self.engine.verifier
                    else "products not checked (verification off)"
                ),
                "audit": dict(AUDIT_UNCHECKED),
            }
        return {
            "mode": "structural",
            **common,
            "split": (
                f"by the plan, each of the {n} workers holds only its own shard of these, at every layer, "
                "for prefill and every decode step"
                if n > 1
                else "one worker holds everything (N = 1: nothing is split)"
            ),
            "audit": dict(AUDIT_UNCHECKED),
        }


# ---- from the command line ----


def model_id(path: Any) -> str:
    """The served model's name: the file (without .gguf) or directory name."""
    name = path.name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def open_gateway(a: Any, stderr: Any = None, always_log: bool = True) -> tuple[Gateway, Any]:
    """Engine + tokenizer + card from `fusion serve|chat` arguments (spawns or admits workers).
    Returns (gateway, topology or None). Bad arguments raise before any worker starts."""
    from ..cli.options import (
        context_for,
        engine_options,
        model_path,
        speculative_config,
        speculator_for,
        tokenizer_for,
    )
    from ..errors import UsageError
    from ..runtime.engine import EngineBase
    from ..runtime.progress import is_tty, load_monitor, log_startup, startup_lines
    from ..weights.loader import open_weights

    stderr = stderr or sys.stderr
    masked = getattr(a, "mode", "structural") == "masked"
    opts = engine_options(a, masked=masked)
    max_tokens = getattr(a, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    spec = speculative_config(a)
    path = model_path(a.model)  # with a hint for a Hugging Face Hub id
    src = open_weights(path)
    tok = tokenizer_for(path, src, needed=True)
    if tok is None:
        raise UsageError(f"{path}: no tokenizer, which serving text needs")
    context = context_for(src.config.max_positions, a.context)  # beyond the model's window: refused
    if max_tokens is not None and max_tokens >= context:  # no prompt could leave that much room
        raise UsageError(
            f"--max-tokens {max_tokens} cannot fit the context window of {context} tokens with any prompt "
            f"(the model's window is {src.config.max_positions}; --context sets it)"
        )
    speculator = speculator_for(spec, src.config, context)  # the draft model loads before any worker starts
    engine_class: type[EngineBase]  # both clients share EngineBase's start-up
    if masked:
        from ..masked.client import MaskedEngine

        engine_class = MaskedEngine
    else:
        from ..structural.client import Engine

        engine_class = Engine
    quiet = getattr(a, "quiet", False)
    opts.progress = None if quiet else load_monitor(stderr)
    engine = engine_class(path, opts, source=src)
    if is_tty(stderr) and not quiet:
        log_startup(engine, stderr, opts.topology)  # the table, on a terminal
    elif always_log:  # a service's log (cli/logs.py: timestamped lines off a terminal)
        for line in startup_lines(engine, opts.topology):
            logging.getLogger(__name__).info(line.removeprefix("fusion: "))
    name = getattr(a, "served_model_name", None) or model_id(path)
    card = ModelCard(
        id=name,
        tokenizer=tok,
        context=context,
        vocab=src.config.vocab,
        eos_ids=tuple(tok.eos_ids),
        default_max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        max_token_bytes=longest_token_bytes(tok),
    )
    return Gateway(engine, card, speculator), opts.topology
