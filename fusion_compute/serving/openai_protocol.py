"""The OpenAI API's bodies as pydantic models: what `fusion serve` accepts, and what /openapi.json
publishes (request and response shapes, and the error object).

Requests are checked strictly, before any tokenizing: no bool or float where an integer is meant
(`"max_tokens": true` is refused, not read as 1), no NaN or infinity, integers within 64 bits, text
that is valid Unicode (no lone surrogates, which no tokenizer can encode). Parameters that the
engine cannot honour are refused by name rather than silently ignored; other unknown fields are
ignored, as OpenAI's own server does. (Named after vLLM's `entrypoints/openai/protocol.py`;
`fusion_compute/structural/protocol.py` is the workers' wire protocol.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch.Generator takes 64-bit seeds; other counts fit too
MAX_STOP = 4  # stop sequences per request, as OpenAI


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "fusion_unicode", "text must be valid Unicode: a lone surrogate at character {pos}", {"pos": e.start}
        ) from None
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[StrictStr, Field(min_length=1), AfterValidator(_valid_unicode)]
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveCount = Annotated[StrictInt, Field(ge=1, le=INT64_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("fusion_unsupported", message)


class Strict(BaseModel):
    """Strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: StrictBool | None = None


class ResponseFormat(Strict):
    type: Text


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    # `developer` is OpenAI's newer name for system instructions; it is read as `system`.
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None  # accepted and not used

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class GenerationRequest(Strict):
    """The parameters both completion endpoints share."""

    model: Text
    max_tokens: PositiveCount | None = None
    max_completion_tokens: PositiveCount | None = None
    # Default greedy (like `fusion generate`), not OpenAI's 1.0: the same question gets the same answer.
    temperature: Annotated[Finite, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Finite, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=INT64_MAX)] | None = None  # extension (vLLM, llama.cpp): 0 = off
    seed: Int64 | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and not used
    # Refused unless they ask for nothing (one answer, no penalties, no logprobs, ...).
    n: Int64 | None = None
    best_of: Int64 | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    logit_bias: dict[str, Finite] | None = None
    logprobs: StrictBool | Int64 | None = None
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: ResponseFormat | None = None
    echo: StrictBool | None = None
    suffix: Text | None = None

    @field_validator("n", "best_of")
    @classmethod
    def _only_one(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v not in (None, 1):
            raise _unsupported(f"only {info.field_name} = 1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v not in (None, 0.0):
            raise _unsupported(f"{info.field_name} is not supported (only 0)")
        return v

    @field_validator("logit_bias", "tools", "functions")
    @classmethod
    def _empty(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            what = "function calling" if info.field_name in ("tools", "functions") else "only empty"
            raise _unsupported(f"{info.field_name} is not supported ({what})")
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, False, 0) or (info.field_name == "top_logprobs" and v is not None):
            raise _unsupported("logprobs are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type != "text":
            raise _unsupported("only response_format {type: text} is supported")
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _not_echo(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise _unsupported(f"{info.field_name} is not supported")
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise _unsupported("stream_options needs stream = true")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def max_tokens_param(self) -> tuple[str, int | None]:
        """(the parameter's name, its value): max_completion_tokens wins when both are given."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    # One prompt per request: a string or token ids, optionally wrapped in a one-element list.
    prompt: Text | list[Int64] | list[Text] | list[list[Int64]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (unwrapping ["text"] and [[1, 2, 3]]); ValueError when there are several."""
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0] if p else None
        if isinstance(first, (str, list)):  # ["text", ...] or [[1, 2, 3], ...]
            if len(p) != 1:
                raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")
            return first
        # pydantic matched one of the four shapes: a list whose first item is neither text nor a list
        # is list[Int64] (or empty), which mypy cannot tell from the union of list types
        return cast(list[int], p)


# ---- responses (documentation in /openapi.json; the routes build these bodies as plain dicts) ----


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(Open):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Open):
    error: ErrorDetail


class ModelObject(Open):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(Open):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(Open):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Open):
    index: int
    message: AssistantMessage
    finish_reason: str


class CompletionChoice(Open):
    index: int
    text: str
    finish_reason: str


class ChatCompletionResponse(Open):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    fusion: dict[str, Any]


class CompletionResponse(Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
    fusion: dict[str, Any]


class HealthResponse(Open):
    status: Literal["ok", "degraded"]
    model: str
    workers: int
    workers_wanted: int = 0
    removed: int = 0
    plan: str
    context: int
    running: bool
    waiting: int
    served: int
    recoveries: int = 0
    error: str | None = None


# ---- validation errors in OpenAI's words ----

REQUEST_MODELS = (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat)
_FIELD_NAMES = frozenset(name for m in REQUEST_MODELS for name in m.model_fields)


def _without_body(loc: Sequence[Any]) -> tuple[Any, ...]:
    """FastAPI prefixes a body's error locations with "body"."""
    loc = tuple(loc)
    return loc[1:] if loc[:1] == ("body",) else loc


def _named(loc: Sequence[Any]) -> list[Any]:
    """The parts of an error location that are field names or indices, without pydantic's labels
    for the branches of a union (`function-after[...]`, `list[TextPart]`)."""
    return [p for p in loc if isinstance(p, int) or p in _FIELD_NAMES]


def _param(loc: Sequence[Any]) -> str | None:
    """`("messages", 0, "role")` -> `messages[0].role`."""
    out = ""
    for part in _named(loc):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or None


def describe_validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """pydantic's (or FastAPI's) error list -> (message, param) for OpenAI's error object. The
    input is never echoed: it may be large, or text the caller would rather not see in a log."""
    if not errors:
        return "invalid request", None
    # A union reports one error per branch; the deepest one names the part that is wrong.
    first = max(errors, key=lambda e: len(_named(_without_body(e.get("loc", ())))))
    loc = _without_body(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        at = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return f"the body is not valid JSON: {detail}{at}".rstrip(), None
    param = _param(loc)
    if param is None and kind in ("missing", "model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    if kind == "missing":
        return f"{param} is required", param
    if kind.startswith("fusion_"):
        return first.get("msg", "invalid request"), param
    same = [e.get("msg", "") for e in errors if _param(_without_body(e.get("loc", ()))) == param]
    msgs = list(dict.fromkeys(m for m in same if m))
    text = "; or ".join(msgs) if msgs else first.get("msg", "invalid value")
    return (f"{param}: {text}" if param else text), param
