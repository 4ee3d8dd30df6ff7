"""Model configuration: the few numbers the runtime needs, from an HF config.json or GGUF metadata.

Frozen, so nothing downstream can mutate it (gpt-fast's `n_head //= world_size` is the habit we avoid).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FusionError

SUPPORTED_ARCHS = ("llama", "qwen2")


class ModelError(FusionError, ValueError):
    """A model that cannot be loaded or run: bad path, unsupported architecture, bad config."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @staticmethod
    def from_hf(d: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older configs have `rope_theta` + `rope_scaling`.
        params = dict(d.get("rope_parameters") or {})
        scaling = dict(d.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        merged = {**scaling, **params}
        kind = str(merged.get("rope_type", merged.get("type", "default")) or "default")
        if kind not in ("default", "linear", "llama3"):
            raise ModelError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
        return RopeConfig(
            theta=theta,
            kind=kind,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
        )

    def inv_freq(self, head_dim: int) -> list[float]:
        """Rotary inverse frequencies, one per RoPE pair (i, i + d/2); same rules as transformers."""
        base = [1.0 / (self.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
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
    arch: str  # "llama" | "qwen2"
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

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ModelError(f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ModelError(f"head_dim {self.head_dim} is odd: rotary pairs need an even head_dim")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group)."""
        return self.n_heads // self.n_kv_heads

    @staticmethod
    def from_hf(d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "")
        archs = d.get("architectures") or []
        arch = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}.get(model_type)
        if arch is None:
            raise ModelError(f"unsupported architecture: model_type {model_type!r} {archs} (supported: llama, qwen2)")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelError(f"unsupported activation {d.get('hidden_act')!r} (only silu/SwiGLU)")
        if d.get("mlp_bias"):
            raise ModelError("unsupported: mlp_bias=true")
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            arch=arch,
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
            qkv_bias=bool(d.get("attention_bias", arch == "qwen2")),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_id=d.get("bos_token_id"),
            eos_ids=tuple(int(e) for e in eos_ids),
        )

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
        """The shape numbers the plan prints and the audit verifier needs (no weights, no rope)."""
        return {
            "arch": self.arch,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "layers": self.n_layers,
            "heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab,
        }
