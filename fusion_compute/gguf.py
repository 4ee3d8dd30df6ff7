"""GGUF weight source: llama.cpp's single-file format, read through `gguf.GGUFReader` (memory-mapped).

Implements the `WeightSource` protocol of `weights.py`: tensors come out fp32, under HF names, in HF
layout (out_features, in_features). Three things differ from a safetensors directory:

- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight` (table below);
- quantization: each tensor is dequantized on read with `gguf.quants.dequantize`. A quant block runs
  along a row (GGUF stores one row of bytes per output row), so only the rows and the column blocks
  a caller asks for are ever dequantized: a worker pays for its shard, not for the whole tensor;
- llama.cpp's Q/K row permutation (see `_unpermute_rows`), undone as a row index map.

Opening a file costs a few seconds (GGUFReader parses every metadata array element, ~100k tokens and
merges); `GGUFWeights.reader` is exposed so the tokenizer can reuse the parsed file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from .config import SUPPORTED_ARCHS, ModelConfig, ModelError, RopeConfig
from .source import Ranges

# GGUF per-layer tensor stem -> HF module path under `model.layers.N.`.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_MISSING = object()


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor, or None for tensors the runtime does not use (e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def metadata(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """One GGUF metadata value (scalar, string or list); ModelError naming the key if absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelError(f"{reader.data.filename}: GGUF metadata key {key!r} missing")
        return default
    return field.contents()


def _array_len(reader: GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else len(field.data)


def open_reader(path: str | Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_config(reader: GGUFReader, path: str | Path = "") -> ModelConfig:
    """ModelConfig from llama.cpp metadata keys (`{arch}.embedding_length`, ...)."""
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def key(name: str, default: Any = _MISSING) -> Any:
        return metadata(reader, f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0) or hidden // n_heads)
    vocab = key("vocab_size", None) or _array_len(reader, "tokenizer.ggml.tokens")
    if vocab is None:
        raise ModelError(f"{path}: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    eos = metadata(reader, "tokenizer.ggml.eos_token_id", None)
    eot = metadata(reader, "tokenizer.ggml.eot_token_id", None)
    eos_ids = tuple(dict.fromkeys(int(e) for e in (eos, eot) if e is not None))
    bos = metadata(reader, "tokenizer.ggml.bos_token_id", None)
    theta = float(key("rope.freq_base", 10000.0))
    return ModelConfig(
        arch=arch,
        hidden=hidden,
        intermediate=int(key("feed_forward_length")),
        n_layers=int(key("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        vocab=int(vocab),
        max_positions=int(key("context_length", 2048)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope_config(reader, arch, theta, head_dim, path),
        qkv_bias="blk.0.attn_q.bias" in names,
        # llama.cpp writes no `output.weight` when the LM head is the embedding table.
        tie_embeddings="output.weight" not in names,
        bos_id=None if bos is None else int(bos),
        eos_ids=eos_ids,
    )


def _rope_config(reader: GGUFReader, arch: str, theta: float, head_dim: int, path: str | Path) -> RopeConfig:
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(metadata(reader, f"{arch}.rope.scaling.factor")))
    if kind not in ("none", ""):
        raise ModelError(f"{path}: unsupported GGUF rope scaling {kind!r} (supported: none, linear)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return RopeConfig(theta=theta)
    # Llama 3.x: llama.cpp stores the per-pair divisors base_freq / scaled_freq instead of the llama3
    # rope parameters. Recover them by matching the published setting (low 1, high 4, original 8192)
    # with the largest divisor as the factor; refuse anything else rather than run with wrong RoPE.
    divisors = np.asarray(freqs.data, dtype=np.float64)
    rope = RopeConfig(theta=theta, kind="llama3", factor=float(divisors.max()))
    base = RopeConfig(theta=theta).inv_freq(head_dim)
    expect = np.array([b / s for b, s in zip(base, rope.inv_freq(head_dim), strict=True)])
    if expect.shape != divisors.shape or not np.allclose(expect, divisors, rtol=1e-4):
        raise ModelError(f"{path}: rope_freqs.weight does not match llama3 rope scaling (factor {rope.factor})")
    return rope


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row map HF row -> GGUF row for a llama q_proj/k_proj.

    convert_hf_to_gguf.py stores `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`: it interleaves the two
    RoPE halves (i, i + d/2) into adjacent rows (2i, 2i + 1) because llama.cpp's llama rope is the
    GPT-J (adjacent pair) kind. Our RoPE, like HF's, pairs i with i + d/2, so we read the rows back in
    HF order. Qwen2 GGUFs use llama.cpp's NEOX rope and are stored unpermuted.
    """
    d = n_rows // n_head
    gguf_rows = torch.arange(n_rows).view(n_head, d // 2, 2)  # (h, i, j): GGUF row h*d + 2i + j
    return gguf_rows.transpose(1, 2).reshape(n_rows)  # at HF row h*d + j*d/2 + i


class GGUFWeights:
    """A .gguf model file as a WeightSource."""

    def __init__(self, path: str | Path, reader: GGUFReader | None = None):
        self.path = Path(path)
        self.reader = reader if reader is not None else open_reader(self.path)
        self.config = read_config(self.reader, self.path)
        self._tensors = {n: t for t in self.reader.tensors if (n := hf_name(t.name)) is not None}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape (out, in) of a tensor, without reading it."""
        return tuple(int(n) for n in reversed(self._tensor(name).shape.tolist()))

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        """fp32 `W[rows][:, cols]` in HF layout, dequantizing only the selected rows and column blocks."""
        t = self._tensor(name)
        qtype = GGMLQuantizationType(t.tensor_type)
        data = t.data  # memmap: (out, in) elements, or (out, bytes per row) for quantized/BF16 types
        shape = self.shape(name)
        n_head = self._permuted_heads(name)
        if n_head is not None:  # q/k weights, and q/k biases (permuted the same way by the converter)
            perm = _unpermute_rows(shape[0], n_head)
            rows = perm if rows is None else perm[rows]
        if data.ndim == 1:
            # 1-D quantized data is a flat run of blocks: dequantize it all (norms and biases are tiny).
            out = _to_tensor(_dequantize(data, qtype))
            return out if rows is None else out.index_select(0, rows.to(torch.long))
        if rows is not None:
            # Gathering whole rows of quant bytes is exact: no block straddles two rows.
            data = data[rows.to(torch.long).numpy()]
        n_cols = shape[1]
        if cols is None or list(cols) == [(0, n_cols)]:
            return _to_tensor(_dequantize(data, qtype))
        out = np.empty((data.shape[0], sum(b - a for a, b in cols)), dtype=np.float32)
        at = 0
        for a, b in cols:
            if not 0 <= a < b <= n_cols:
                raise ModelError(f"{self.path}: column range [{a}, {b}) out of bounds for {name} with {n_cols} columns")
            out[:, at : at + b - a] = _dequantize_cols(data, qtype, a, b)
            at += b - a
        return torch.from_numpy(out)

    def _tensor(self, name: str) -> Any:
        t = self._tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: tensor {name} missing")
        return t

    def _permuted_heads(self, name: str) -> int | None:
        if self.config.arch != "llama":
            return None
        if ".self_attn.q_proj." in name:
            return self.config.n_heads
        if ".self_attn.k_proj." in name:
            return self.config.n_kv_heads
        return None


def _dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if data.dtype != np.uint8:
        # F32/F16/F64/I8..I64 come typed from the reader; astype copies out of the read-only mmap.
        return data.astype(np.float32)
    try:
        return dequantize(data, qtype)
    except NotImplementedError:
        raise ModelError(
            f"unsupported GGUF tensor type {qtype.name} (gguf {qtype.name} dequantization missing)"
        ) from None


def _dequantize_cols(data: np.ndarray, qtype: GGMLQuantizationType, a: int, b: int) -> np.ndarray:
    """Columns [a, b) of every row, dequantizing only the quant blocks that cover them."""
    if data.dtype != np.uint8:
        return data[:, a:b].astype(np.float32)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    first, last = a // block, math.ceil(b / block)
    blocks = np.ascontiguousarray(data[:, first * block_bytes : last * block_bytes])
    return _dequantize(blocks, qtype)[:, a - first * block : b - first * block]


def _to_tensor(x: np.ndarray) -> torch.Tensor:
    # Copy only if x still views the read-only mmap (F32 via dequantize): torch needs writable memory.
    return torch.from_numpy(np.require(x, dtype=np.float32, requirements=["C", "W"]))
