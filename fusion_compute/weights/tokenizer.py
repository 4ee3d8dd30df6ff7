"""Tokenizer and chat template: text <-> token ids, on the client only (ids never leave it).

A thin layer over a `tokenizers.Tokenizer`, built either from a Hugging Face directory
(tokenizer.json + tokenizer_config.json) or from the vocabulary llama.cpp stores in a GGUF file.
The chat template is rendered with a sandboxed jinja2 environment set up like transformers'
`apply_chat_template`, so the same template gives the same prompt text.

End of generation (`eos_ids`), in this order, deduplicated:
  1. the model's eos token (tokenizer_config `eos_token` / GGUF `tokenizer.ggml.eos_token_id`);
  2. explicit extra stop ids: GGUF eot/eom ids, generation_config.json `eos_token_id`;
  3. the template's turn terminator: the special token written right after an assistant message's
     content when a probe conversation is rendered (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3);
  4. `<|endoftext|>` when it is a special token: the document end of GPT-style vocabularies, which
     chat models sometimes emit instead of the turn end (Qwen2.5 lists it in generation_config).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from ..model.config import ModelError

if TYPE_CHECKING:
    from .gguf_index import GGUFIndex

# llama.cpp `tokenizer.ggml.token_type` values.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits by llama.cpp `tokenizer.ggml.pre`, as in the models' own tokenizer.json.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_REGEX_SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
_TURN_PROBE = "\x00fusion-compute-probe\x00"


def _byte_level_pre(pre: str) -> Any:
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit its own pre-token, then GPT-2's byte-level regex.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = ", ".join(["smollm", "gpt2", "default", *_REGEX_SPLITS])
    raise ModelError(f"unsupported GGUF tokenizer pre-tokenizer {pre!r} (supported: {supported})")


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a piece into two known pieces,
    best piece score first (transformers' `generate_merges`, so both give the same tokenization)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for tok, score, kind in zip(tokens, scores, types, strict=True):
        if kind not in (_NORMAL, _USER_DEFINED):
            continue
        local = [(tok[:i], tok[i:], score) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


class Tokenizer:
    """Encode/decode plus the chat template. Build with `from_hf_dir`, `from_gguf` or `load_tokenizer`."""

    def __init__(
        self,
        backend: Backend,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,  # None values (a GGUF without the token) are dropped
        extra_eos_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        # bos_token / eos_token / unk_token / pad_token, as transformers passes them to templates.
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template: Any = None
        self.eos_ids = self._eos_ids(extra_eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; adds BOS only where the model's tokenizer says so (its post-processor).
        Special-token text such as `<|im_start|>` becomes the single special token, as in transformers."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        if self._template is None:
            if not self.chat_template:
                raise ModelError("this model has no chat template; pass plain text instead of messages")
            self._template = _compile_template(self.chat_template)
        context = {"tools": None, "documents": None, **self.special_tokens, **extra}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # No post-processor BOS: templates write their own, as transformers' apply_chat_template assumes.
        text = self.render_chat(messages, add_generation_prompt)
        return self.backend.encode(text, add_special_tokens=False).ids

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def _eos_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        ids = [self.token_id(self.special_tokens.get("eos_token", ""))]
        ids += list(extra)
        ids.append(self._turn_terminator())
        specials = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        if "<|endoftext|>" in specials:
            ids.append(self.token_id("<|endoftext|>"))
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def _turn_terminator(self) -> int | None:
        if not self.chat_template:
            return None
        try:
            chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_PROBE}]
            text = self.render_chat(chat, add_generation_prompt=False)
        except Exception:  # a template may reject the probe (roles, tool schemas); then rules 1, 2, 4 apply
            return None
        after = text.rpartition(_TURN_PROBE)[2]
        specials = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        first = max((s for s in specials if after.lstrip(" ").startswith(s)), key=len, default=None)
        return None if first is None else self.token_id(first)

    @staticmethod
    def from_hf_dir(path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelError(f"{path}: no tokenizer.json")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
        return Tokenizer(backend, _hf_chat_template(path, cfg), specials, extra)

    @staticmethod
    def from_gguf(source: str | Path | GGUFIndex) -> Tokenizer:
        """From llama.cpp's tokenizer metadata; pass a `GGUFIndex` (e.g. `GGUFWeights.index`) to reuse
        an opened file: its arrays (tokens, merges, ...) are read from the file here, once each."""
        from .gguf_index import GGUFIndex

        index = GGUFIndex.open(source) if isinstance(source, (str, Path)) else source

        def meta(key: str, default: Any = None) -> Any:
            return index.get(f"tokenizer.{key}", default)

        model = meta("ggml.model")
        tokens: list[str] = meta("ggml.tokens")
        if model is None or tokens is None:
            raise ModelError(f"{index.path}: GGUF has no tokenizer (tokenizer.ggml.model / tokens missing)")
        types: list[int] = meta("ggml.token_type") or [_NORMAL] * len(tokens)
        if model == "gpt2":
            merges = [tuple(m.split(" ", 1)) for m in meta("ggml.merges", [])]
            backend = Backend(BPE({t: i for i, t in enumerate(tokens)}, merges))
            backend.pre_tokenizer = _byte_level_pre(meta("ggml.pre", "default"))
            backend.decoder = decoders.ByteLevel()
        elif model == "llama":
            backend = _sentencepiece_backend(
                tokens,
                meta("ggml.scores"),
                types,
                meta("ggml.unknown_token_id"),
                bool(meta("ggml.add_space_prefix", True)),
            )
        else:
            raise ModelError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")
        # Control tokens are special (skippable on decode); user-defined ones are plain added tokens.
        # Both must be added, or text like "<|im_start|>" would be cut into pieces.
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            i = meta(f"ggml.{key}")
            return None if i is None or not 0 <= i < len(tokens) else tokens[i]

        bos = token("bos_token_id")
        # llama.cpp's default: sentencepiece vocabularies add BOS unless the file says otherwise.
        if meta("ggml.add_bos_token", model == "llama") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
            )
        specials = {
            "bos_token": bos,
            "eos_token": token("eos_token_id"),
            "unk_token": token("unknown_token_id"),
            "pad_token": token("padding_token_id"),
        }
        extra = [i for i in (meta("ggml.eot_token_id"), meta("ggml.eom_token_id")) if i is not None]
        return Tokenizer(backend, meta("chat_template"), specials, extra)


def _sentencepiece_backend(
    tokens: list[str], scores: list[float] | None, types: list[int], unk_id: int | None, add_space_prefix: bool
) -> Backend:
    """A llama/sentencepiece vocabulary as a byte-fallback BPE, as transformers' LlamaTokenizer builds it."""
    if scores is None:
        raise ModelError("unsupported GGUF tokenizer: sentencepiece vocabulary without tokenizer.ggml.scores")
    unk = tokens[unk_id] if unk_id is not None else None
    bpe = BPE(
        {t: i for i, t in enumerate(tokens)},
        _spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(bpe)
    # llama.cpp prefixes a space at the start and after every special token: Metaspace's "always".
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="always" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if add_space_prefix else []))
    return backend


class StreamDecoder:
    """Ids in, text deltas out, never splitting a UTF-8 character.

    A byte-level token may carry half a character; decoded alone it ends in U+FFFD, so the delta is
    held back until the following tokens complete it. Each step decodes only a short window that
    starts one emitted chunk back (the prefix), so a leading-space rule of the decoder (sentencepiece
    strips the first space) applies to the prefix, not to the new text: cost stays O(window).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this are already emitted

    def push(self, ids: int | Iterable[int]) -> str:
        """Append new ids; return the text they complete (possibly "")."""
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of generation, less a last character the tokens
        left incomplete (a reply cut by its length limit mid-emoji): dropped, as vLLM's incremental
        detokenizer drops it, rather than ending the text in U+FFFD."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        # An incomplete last character decodes to one U+FFFD (the decoder replaces each maximal invalid
        # run once); earlier ones stand for bytes that no later token could have completed: kept.
        return text[len(prefix_text) :].removesuffix("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special) if ids else ""


def _compile_template(source: str) -> Any:
    """A jinja2 template in an immutable sandbox (chat templates are untrusted code), with the same
    helpers transformers gives templates: raise_exception, strftime_now, a non-HTML-escaping tojson,
    and the `{% generation %}` tag (rendered as its body)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template does not parse: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as serialized AddedTokens.
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template to chat_template.jinja (or .json); older ones inline it.
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = _read_json(path / "chat_template.json").get("chat_template", cfg.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model: a .gguf file or a Hugging Face directory."""
    path = Path(path)
    if path.is_file():
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    raise ModelError(f"model not found: {path}")
