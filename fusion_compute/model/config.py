"""Model configuration: the few numbers the runtime needs, from an HF config.json or GGUF metadata.

Frozen, so nothing downstream can mutate it (gpt-fast's `n_head //= world_size` is the habit we avoid).

The families (FAMILIES) and what each changes in the Llama layer:

    llama     the reference layer: RMSNorm, q/k/v/o, RoPE (default, linear, llama3), SwiGLU
    mistral   llama's layer; sliding-window attention where the config sets `sliding_window`
              (query i sees keys j with i - W < j <= i, on every layer)
    qwen2     a bias on q, k and v; sliding window on the layers past `max_window_layers` when
              `use_sliding_window` (transformers' `layer_types`)
    qwen3     no bias; RMSNorm on each head of q and k before RoPE (`q_norm`, `k_norm`, gains (d,));
              sliding window as qwen2
    phi3      llama's layer with q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`: split by
              the config's head counts); LongRoPE; sliding window as mistral (Phi-3, Phi-3.5, Phi-4;
              Phi-4-mini's partial rotary is refused)
    gemma3_text  Gemma 3's text decoder: RMSNorm gains (1 + w) (folded in when read: architecture.py),
              the embedding times √H, GeGLU (tanh GELU), q/k norms per head as qwen3, a post-norm on
              the attention output and on the MLP output before each residual add (`post_norms`),
              local sliding-window layers (`layer_types`) with their own RoPE base (`rope_local`),
              the attention scale query_pre_attn_scalar^-1/2; logit soft-capping refused

Anything a config asks for that the runtime does not compute (another family, mixture-of-experts,
an unknown RoPE type, attention soft-capping, biases on o_proj or the MLP, partial rotary) is refused
by `from_hf` with one line naming what is supported (`Unsupported`, exit 2), before any worker
starts: a feature silently ignored is a model that runs and answers wrongly.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import FusionError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")  # transformers' model_type of each
GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # GGUF's general.architecture values weights/gguf.py reads
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# transformers' mixture-of-experts families: named as such in the refusal
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx", "jamba")


class ModelError(FusionError, ValueError):
    """A model that cannot be loaded or run: bad path, unsupported architecture, bad config."""


class Unsupported(ModelError):
    """A model of a family, or with a feature, this runtime does not implement: refused before any
    worker starts, like a bad command line (exit 2)."""

    exit_code = 2


@dataclass(frozen=True)
class RopeConfig:
    """RoPE as transformers' ROPE_INIT_FUNCTIONS compute it. LongRoPE (Phi-3: "longrope", older "su")
    divides the base frequencies by per-pair factors, `short_factor` while a forward's positions stay
    within `original_max_position` and `long_factor` once one is past it (transformers picks per
    forward, from that forward's largest position), and multiplies cos and sin by `attention_factor`
    (√(1 + ln s / ln L₀), s = max_positions / L₀, unless the config sets it)."""

    theta: float = 10000.0
    kind: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: one per pair
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # cos and sin are multiplied by it (longrope)

    @staticmethod
    def from_hf(d: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older configs have `rope_theta` + `rope_scaling`.
        params = dict(d.get("rope_parameters") or {})
        scaling = dict(d.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        merged = {**scaling, **params}
        kind = str(merged.get("rope_type", merged.get("type", "default")) or "default")
        kind = "longrope" if kind == "su" else kind  # Phi-3's first configs (transformers does the same)
        if kind not in ROPE_TYPES:
            raise Unsupported(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if kind == "longrope":
            return RopeConfig._longrope(d, theta, merged)
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
        )

    @staticmethod
    def _longrope(d: dict[str, Any], theta: float, merged: dict[str, Any]) -> RopeConfig:
        """transformers' _compute_longrope_parameters: the factor defaults to max_positions / L₀."""
        original = int(
            merged.get("original_max_position_embeddings")
            or d.get("original_max_position_embeddings")
            or d.get("max_position_embeddings", 2048)
        )
        factor = merged.get("factor")
        factor = float(d.get("max_position_embeddings", original)) / original if factor is None else float(factor)
        attention = merged.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        short, long = merged.get("short_factor"), merged.get("long_factor")
        if not isinstance(short, list) or not isinstance(long, list):
            raise ModelError("longrope rope scaling needs short_factor and long_factor lists")
        return RopeConfig(
            theta=theta,
            kind="longrope",
            factor=factor,
            original_max_position=original,
            short_factor=tuple(float(f) for f in short),
            long_factor=tuple(float(f) for f in long),
            attention_factor=float(attention),
        )

    def inv_freq(self, head_dim: int, long: bool = False) -> list[float]:
        """Rotary inverse frequencies, one per RoPE pair (i, i + d/2); same rules as transformers
        (`long`: LongRoPE's long factors, for a forward past original_max_position)."""
        base = [1.0 / (self.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
        if self.kind == "longrope":
            ext = self.long_factor if long else self.short_factor
            if len(ext) != len(base):
                raise ModelError(f"longrope has {len(ext)} factors for {len(base)} rotary pairs")
            return [f / e for f, e in zip(base, ext, strict=True)]
        if self.kind == "linear":
            return [f / self.factor for f in base]
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            out = []
            for f in base:
                wavelen = 2 * math.pi / f
                if wavelen < high_wavelen:
                    out.append(f)
                elif wavelen > low_wavelen:
                    out.append(f / self.factor)
                else:
                    smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                        self.high_freq_factor - self.low_freq_factor
                    )
                    out.append((1 - smooth) * f / self.factor + smooth * f)
            return out
        return base


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # the family: one of FAMILIES
    hidden: int  # H
    intermediate: int  # I
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # d
    vocab: int
    max_positions: int
    rms_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    qkv_bias: bool = False
    tie_embeddings: bool = False
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    # per layer: the sliding window W (query i attends keys i - W < j <= i), None = full causal; () = all full
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3): gains q_norm, k_norm (d,)
    # Gemma 3: what its layer changes besides qk_norm and the windows
    gain_offset: float = 0.0  # every RMSNorm gain is offset + w (Gemma: 1 + w)
    embed_scale: float = 1.0  # the embedding rows are multiplied by it (Gemma: √H)
    attn_scale: float | None = None  # the scores' scale; None: head_dim^-1/2 (Gemma: query_pre_attn_scalar^-1/2)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    post_norms: bool = False  # RMSNorm on the attention and the MLP outputs before the residual adds (Gemma)
    rope_local: RopeConfig | None = None  # the RoPE of the local (sliding) layers where it differs (Gemma)
    local_layers: tuple[bool, ...] = ()  # per layer: uses rope_local (Gemma's "sliding_attention")

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise Unsupported(f"unsupported architecture {self.arch!r} (supported: {', '.join(FAMILIES)})")
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ModelError(f"{len(self.layer_windows)} layer windows for {self.n_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ModelError(f"sliding windows must be >= 1, got {self.layer_windows}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelError(f"activation {self.activation!r} (supported: silu, gelu_tanh)")
        if self.local_layers and len(self.local_layers) != self.n_layers:
            raise ModelError(f"{len(self.local_layers)} local-layer flags for {self.n_layers} layers")
        if self.head_dim % 2:
            raise ModelError(f"head_dim {self.head_dim} is odd: rotary pairs need an even head_dim")

    @property
    def scale(self) -> float:
        """The attention scores' scale: attn_scale, else head_dim^-1/2."""
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def local_rope(self, layer: int) -> bool:
        """Layer `layer` rotates with rope_local (a Gemma local layer), else with rope."""
        return self.rope_local is not None and bool(self.local_layers) and self.local_layers[layer]

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window W, or None for full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers (None: full causal), in first-use order: one mask each."""
        return tuple(dict.fromkeys(self.layer_windows)) if self.layer_windows else (None,)

    def features(self) -> list[str]:
        """What this model's family adds to the Llama layer, in words (`fusion plan`'s picture)."""
        out = []
        windows = [w for w in self.layer_windows if w is not None]
        if windows:
            sizes = "/".join(str(w) for w in dict.fromkeys(windows))
            out.append(f"sliding window {sizes} on {len(windows)} of {self.n_layers} layers")
        if self.qkv_bias:
            out.append("q/k/v bias")
        if self.qk_norm:
            out.append("per-head q/k norms (split groups' sums ride in the score sums)")
        if self.rope.kind != "default":
            out.append(f"RoPE {self.rope.kind}")
        if self.post_norms:
            out.append("post-norms on the attention and MLP outputs (+2 all-worker Σy² sums per layer)")
        if self.activation != "silu":
            out.append("GeGLU (tanh GELU)")
        if self.gain_offset:
            out.append(f"norm gains {self.gain_offset:g} + w")
        if self.embed_scale != 1.0:
            out.append(f"embedding × {self.embed_scale:.4g}")
        if self.rope_local is not None and any(self.local_layers):
            out.append(f"local RoPE θ {self.rope_local.theta:g} on {sum(self.local_layers)} layers")
        return out

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.n_heads // self.n_kv_heads

    @staticmethod
    def from_hf(d: dict[str, Any]) -> ModelConfig:
        """The config of a transformers directory's config.json, through its family's reader (FAMILIES);
        a family or feature this runtime does not implement is refused (Unsupported), never ignored."""
        model_type = str(d.get("model_type", ""))
        reader = _READERS.get(model_type)
        if reader is None:
            archs = d.get("architectures") or []
            what = "mixture-of-experts model" if _is_moe(d) else "architecture"
            raise Unsupported(
                f"unsupported {what}: model_type {model_type!r} {archs} (supported: {', '.join(FAMILIES)})"
            )
        _refuse_unimplemented(d, model_type)
        return reader(d)

    @staticmethod
    def from_hf_dir(path: str | Path) -> ModelConfig:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise ModelError(f"{path}: no config.json (expected a Hugging Face model directory or a .gguf file)")
        try:
            return ModelConfig.from_hf(json.loads(cfg.read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ModelError(f"{cfg}: malformed config ({type(e).__name__}: {e})") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def dims(self) -> dict[str, Any]:
        """The shape numbers the plan prints and the audit verifier needs (no weights, no rope); a
        family's own pieces (q/k norms, sliding windows) only where it has them."""
        out: dict[str, Any] = {
            "arch": self.arch,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "layers": self.n_layers,
            "heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab,
        }
        if self.qk_norm:
            out["qk_norm"] = True
        if any(w is not None for w in self.layer_windows):
            out["windows"] = list(self.layer_windows)
        if self.post_norms:
            out["post_norms"] = True
        return out


def _is_moe(d: dict[str, Any]) -> bool:
    return d.get("model_type") in _MOE_TYPES or any(
        d.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
    )


def _refuse_unimplemented(d: dict[str, Any], family: str) -> None:
    """Unsupported for any setting the family's reader would otherwise drop on the floor."""

    def no(feature: str) -> Unsupported:
        return Unsupported(f"unsupported {family} config: {feature} is not implemented (supported: {_SUPPORTED_NOTE})")

    if _is_moe(d):
        raise no("mixture-of-experts (num_experts)")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(cap) is not None:
            raise no(f"{cap}={d[cap]}")
    if family == "gemma3_text":
        if d.get("use_bidirectional_attention"):
            raise no("use_bidirectional_attention=true")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise no(f"activation {act!r} (only gelu_pytorch_tanh/GeGLU)")
    elif d.get("hidden_act", "silu") != "silu":
        raise no(f"activation {d.get('hidden_act')!r} (only silu/SwiGLU)")
    if d.get("mlp_bias"):
        raise no("mlp_bias=true")
    if d.get("attention_bias") and family != "qwen2":
        # llama/qwen3 put this bias on o_proj as well as q/k/v; qwen2's q/k/v bias is its own, always on
        raise no("attention_bias=true")
    params = {**dict(d.get("rope_scaling") or {}), **dict(d.get("rope_parameters") or {})}
    # Gemma 3: one RoPE per layer type (transformers 5's rope_parameters keyed by layer type)
    per_type = [params[k] for k in ("full_attention", "sliding_attention") if isinstance(params.get(k), dict)]
    for p in per_type or [params]:
        kind = str(p.get("rope_type", p.get("type", "default")) or "default")
        if kind not in (*ROPE_TYPES, "su"):
            raise no(f"rope type {kind!r}")
        partial = d.get("partial_rotary_factor", p.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise no(f"partial_rotary_factor={partial}")
    kinds = set(d.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        raise no(f"layer types {sorted(kinds)}")


_SUPPORTED_NOTE = (
    f"families {', '.join(FAMILIES)}; rope {', '.join(ROPE_TYPES)}, full rotary; SwiGLU (GeGLU on gemma3_text); "
    "q/k/v bias on qwen2; sliding window"
)


def _llama_like(d: dict[str, Any], family: str, **extra: Any) -> ModelConfig:
    """The fields every family reads the same way (transformers' LlamaConfig names)."""
    n_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        arch=family,
        hidden=hidden,
        intermediate=int(d["intermediate_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or hidden // n_heads),
        vocab=int(d["vocab_size"]),
        max_positions=int(d.get("max_position_embeddings", 2048)),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig.from_hf(d),
        bos_id=d.get("bos_token_id"),
        eos_ids=tuple(int(e) for e in eos_ids),
        **{"tie_embeddings": bool(d.get("tie_word_embeddings", False)), **extra},
    )


def _window(d: dict[str, Any]) -> int | None:
    w = d.get("sliding_window")
    return None if w is None else int(w)


def _qwen_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: the window only when `use_sliding_window`, on the layers transformers' layer_types
    marks sliding (by default those from `max_window_layers` on)."""
    w = _window(d) if d.get("use_sliding_window") else None
    n = int(d["num_hidden_layers"])
    if w is None:
        return ()
    types = d.get("layer_types") or [
        "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention" for i in range(n)
    ]
    return tuple(w if t == "sliding_attention" else None for t in types)


def _llama(d: dict[str, Any]) -> ModelConfig:
    return _llama_like(d, "llama")


def _mistral(d: dict[str, Any]) -> ModelConfig:
    """Llama's layer; `sliding_window` on every layer (transformers' MistralModel ignores layer_types)."""
    w = _window(d)
    return _llama_like(d, "mistral", layer_windows=() if w is None else (w,) * int(d["num_hidden_layers"]))


def _qwen2(d: dict[str, Any]) -> ModelConfig:
    return _llama_like(d, "qwen2", qkv_bias=True, layer_windows=_qwen_windows(d))


def _qwen3(d: dict[str, Any]) -> ModelConfig:
    return _llama_like(d, "qwen3", qk_norm=True, layer_windows=_qwen_windows(d))


def _phi3(d: dict[str, Any]) -> ModelConfig:
    """Phi-3's `sliding_window`, like Mistral's, applies to every layer (transformers' Phi3Model)."""
    w = _window(d)
    return _llama_like(d, "phi3", layer_windows=() if w is None else (w,) * int(d["num_hidden_layers"]))


def _gemma3(d: dict[str, Any]) -> ModelConfig:
    """Gemma 3's text decoder (transformers' Gemma3TextConfig). Its layer_types default, like
    transformers', to every `sliding_window_pattern`-th layer (6) global and the rest local; the
    global layers' RoPE is rope_parameters["full_attention"] (rope_theta, 1e6 by default), the local
    layers' rope_parameters["sliding_attention"] (rope_local_base_freq, 1e4). Older configs give
    rope_theta, rope_local_base_freq and rope_scaling (global layers only) at the top level."""
    n = int(d["num_hidden_layers"])
    pattern = int(d.get("sliding_window_pattern") or 6)
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = d.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if not full:  # the older spelling
        full = {**dict(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    max_pos = d.get("max_position_embeddings", 131_072)
    rope = RopeConfig.from_hf({"rope_parameters": full, "max_position_embeddings": max_pos})
    rope_local = RopeConfig.from_hf({"rope_parameters": local, "max_position_embeddings": max_pos})
    w = _window(d)
    hidden = int(d["hidden_size"])
    base = {**d, "rope_parameters": None, "rope_scaling": None}
    out = _llama_like(
        {**base, "rope_theta": rope.theta},
        "gemma3_text",
        qk_norm=True,
        layer_windows=tuple(w if t == "sliding_attention" else None for t in types) if w is not None else (),
        gain_offset=1.0,
        embed_scale=math.sqrt(hidden),
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        activation="gelu_tanh",
        post_norms=True,
        rope_local=rope_local,
        local_layers=tuple(t == "sliding_attention" for t in types),
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
    )
    return replace(out, rope=rope)


_READERS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "gemma3_text": _gemma3,
}
