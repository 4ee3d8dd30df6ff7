"""GGUF weight source: llama.cpp's single-file format, read through `gguf_index.GGUFIndex`.

Implements the `WeightSource` protocol of `source.py`: tensors come out fp32, under HF names, in HF
layout (out_features, in_features). Three things differ from a safetensors directory:

- names: `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight` (table below);
- quantization: each tensor is dequantized on read with `gguf.quants.dequantize`. A quant block runs
  along a row (GGUF stores one row of bytes per output row), so only the rows and the column blocks
  a caller asks for are ever dequantized: a worker pays for its shard, not for the whole tensor;
- llama.cpp's Q/K row permutation (see `_unpermute_rows`), undone as a row index map.

Opening reads the header, the scalar metadata and the tensor table only (`GGUFIndex`; the
tokenizer's arrays stay unread), and bytes are read with positioned reads in bounded chunks, so a
worker's memory is its share plus small transients. `GGUFWeights.index` is exposed so the client's
tokenizer reads its arrays from the same index without parsing the file again.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ..model.config import GGUF_ARCHS, ModelConfig, ModelError, RopeConfig, Unsupported
from .gguf_index import GGUFIndex, TensorInfo
from .source import Ranges

# GGUF per-layer tensor stem -> HF module path under `model.layers.N.`.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3: per-head RMSNorm gains (d,)
    "attn_k_norm": "self_attn.k_norm",
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

# ggml types stored as plain numbers: read as typed little-endian arrays, converted with astype (as
# GGUFReader's typed views were). Every other type goes through `gguf.quants.dequantize`.
_PLAIN: dict[GGMLQuantizationType, np.dtype] = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
# Bounds on one step of a sliced read: the file bytes read at once, and the elements dequantized at
# once (gguf's dequantize holds its output about twice over while it works). They bound a worker's
# transients to ~20 MB whatever the tensor's size (a 128k x 4096 embedding is 2 GB in fp32).
READ_CHUNK_BYTES = 4 << 20
DEQUANT_CHUNK_ELEMENTS = 1 << 20


def hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor, or None for tensors the runtime does not use (e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def read_config(index: GGUFIndex, path: str | Path = "") -> ModelConfig:
    """ModelConfig from llama.cpp metadata keys (`{arch}.embedding_length`, ...); reads no array."""
    path = path or index.path
    arch = index.scalar("general.architecture")
    if arch not in GGUF_ARCHS:
        raise Unsupported(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")

    def num(key: str, kind: type, default: Any = _MISSING) -> Any:
        value = index.scalar(key) if default is _MISSING else index.scalar(key, default)
        try:
            return None if value is None else kind(value)
        except (TypeError, ValueError):
            raise ModelError(f"{path}: GGUF metadata key {key!r} must be a number, got {value!r}") from None

    def key(name: str, kind: type = int, default: Any = _MISSING) -> Any:
        return num(f"{arch}.{name}", kind, default)

    for feature in ("attention.sliding_window", "attn_logit_softcapping", "expert_count"):
        if index.scalar(f"{arch}.{feature}", None) is not None:  # read by llama.cpp, not implemented here
            raise Unsupported(f"{path}: unsupported GGUF {arch} model: {arch}.{feature} is not implemented")
    names = set(index.tensors)
    hidden = key("embedding_length")
    n_heads = key("attention.head_count")
    if hidden <= 0 or n_heads <= 0:
        raise ModelError(f"{path}: GGUF embedding_length {hidden} and head_count {n_heads} must be positive")
    head_dim = key("attention.key_length", int, 0) or key("rope.dimension_count", int, 0) or hidden // n_heads
    vocab = key("vocab_size", int, None) or index.array_length("tokenizer.ggml.tokens")
    if vocab is None:
        raise ModelError(f"{path}: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    eos = num("tokenizer.ggml.eos_token_id", int, None)
    eot = num("tokenizer.ggml.eot_token_id", int, None)
    eos_ids = tuple(dict.fromkeys(e for e in (eos, eot) if e is not None))
    bos = num("tokenizer.ggml.bos_token_id", int, None)
    theta = key("rope.freq_base", float, 10000.0)
    return ModelConfig(
        arch=arch,
        hidden=hidden,
        intermediate=key("feed_forward_length"),
        n_layers=key("block_count"),
        n_heads=n_heads,
        n_kv_heads=key("attention.head_count_kv", int, n_heads),
        head_dim=head_dim,
        vocab=vocab,
        max_positions=key("context_length", int, 2048),
        rms_eps=key("attention.layer_norm_rms_epsilon", float, 1e-6),
        rope=_rope_config(index, arch, theta, head_dim, path),
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch == "qwen3",
        # llama.cpp writes no `output.weight` when the LM head is the embedding table.
        tie_embeddings="output.weight" not in names,
        bos_id=bos,
        eos_ids=eos_ids,
    )


def _rope_config(index: GGUFIndex, arch: str, theta: float, head_dim: int, path: str | Path) -> RopeConfig:
    kind = index.scalar(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        factor = index.scalar(f"{arch}.rope.scaling.factor")
        if not isinstance(factor, (int, float)):
            raise ModelError(f"{path}: GGUF {arch}.rope.scaling.factor must be a number, got {factor!r}")
        return RopeConfig(theta=theta, kind="linear", factor=float(factor))
    if kind not in ("none", ""):
        raise Unsupported(f"{path}: unsupported GGUF rope scaling {kind!r} (supported: none, linear)")
    freqs = index.tensors.get("rope_freqs.weight")
    if freqs is None:
        return RopeConfig(theta=theta)
    # Llama 3.x: llama.cpp stores the per-pair divisors base_freq / scaled_freq instead of the llama3
    # rope parameters. Recover them by matching the published setting (low 1, high 4, original 8192)
    # with the largest divisor as the factor; refuse anything else rather than run with wrong RoPE.
    divisors = _decode(index.tensor_bytes(freqs), freqs.qtype).astype(np.float64)
    rope = RopeConfig(theta=theta, kind="llama3", factor=float(divisors.max()) if divisors.size else 0.0)
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

    def __init__(self, path: str | Path, index: GGUFIndex | None = None):
        self.path = Path(path)
        self.index = index if index is not None else GGUFIndex.open(self.path)
        self.config = read_config(self.index, self.path)
        self._tensors = {n: t for t in self.index.tensors.values() if (n := hf_name(t.name)) is not None}
        _check_dequantizable(self.path, list(self._tensors.values()))

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape (out, in) of a tensor, without reading it."""
        return self._tensor(name).shape

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        """fp32 `W[rows][:, cols]` in HF layout, reading and dequantizing only the selected rows'
        quant blocks that cover `cols`, a bounded chunk at a time."""
        t = self._tensor(name)
        shape = t.shape
        if rows is not None:
            rows = rows.to(torch.long)
            if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < shape[0]):
                raise ModelError(f"{self.path}: row index out of bounds for {name} with {shape[0]} rows")
        n_head = self._permuted_heads(name)
        if n_head is not None:  # q/k weights, and q/k biases (permuted the same way by the converter)
            perm = _unpermute_rows(shape[0], n_head)
            rows = perm if rows is None else perm[rows]
        if len(shape) != 2:
            # Norms and biases (1-D) are tiny: read and dequantize them whole.
            if len(shape) != 1 and (rows is not None or cols is not None):
                raise ModelError(f"{self.path}: {name} has shape {list(shape)}: only 1-D and 2-D tensors can be sliced")
            out = torch.from_numpy(_decode(self.index.tensor_bytes(t), t.qtype).reshape(shape))
            return out if rows is None else out.index_select(0, rows)
        n_cols = shape[1]
        ranges = [(0, n_cols)] if cols is None else [(int(a), int(b)) for a, b in cols]
        for a, b in ranges:
            if not 0 <= a < b <= n_cols:
                raise ModelError(f"{self.path}: column range [{a}, {b}) out of bounds for {name} with {n_cols} columns")
        return torch.from_numpy(self._read_2d(t, None if rows is None else rows.numpy(), ranges))

    def _read_2d(self, t: TensorInfo, sel: np.ndarray | None, ranges: list[tuple[int, int]]) -> np.ndarray:
        """Rows `sel` (None: all, in order) of a 2-D tensor, columns `ranges` concatenated, fp32.

        Rows are visited in file order, a run of them per positioned read, and their bytes narrowed
        to the quant blocks that cover `ranges` before dequantizing. Exact: a block never straddles
        two rows, and `dequantize` maps each block on its own, so the values equal those of
        dequantizing the whole tensor."""
        n_rows = t.shape[0]
        block, block_bytes = GGML_QUANT_SIZES[t.qtype]
        row_bytes = t.row_bytes
        blocks = [(a // block, math.ceil(b / block)) for a, b in ranges]  # covering quant blocks per range
        lo = min(f for f, _ in blocks) * block_bytes  # one byte span of a row covers every range
        hi = max(e for _, e in blocks) * block_bytes
        out = np.empty((n_rows if sel is None else sel.size, sum(b - a for a, b in ranges)), dtype=np.float32)
        order = None if sel is None else np.argsort(sel, kind="stable")
        wanted = np.arange(n_rows) if sel is None else sel[order]  # rows in file order
        span_rows = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
        step_rows = max(1, DEQUANT_CHUNK_ELEMENTS // max(1, (hi - lo) // block_bytes * block))
        i = 0
        while i < wanted.size:
            first = int(wanted[i])
            j = min(int(np.searchsorted(wanted, first + span_rows)), i + step_rows)
            last = int(wanted[j - 1])
            raw = self.index.read_bytes(t.offset + first * row_bytes, (last - first + 1) * row_bytes)
            part = raw.reshape(last - first + 1, row_bytes)
            part = part[:, lo:hi] if sel is None else part[wanted[i:j] - first, lo:hi]
            dest = slice(i, j) if order is None else order[i:j]
            at = 0
            for (a, b), (f, e) in zip(ranges, blocks, strict=True):
                q = np.ascontiguousarray(part[:, f * block_bytes - lo : e * block_bytes - lo])
                out[dest, at : at + b - a] = _decode(q, t.qtype)[:, a - f * block : b - f * block]
                at += b - a
            i = j
        return out

    def _tensor(self, name: str) -> TensorInfo:
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


def _decode(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """fp32 values of contiguous tensor bytes (last axis: whole blocks of one row), a fresh array."""
    plain = _PLAIN.get(qtype)
    if plain is not None:
        return raw.view(plain).astype(np.float32)
    try:
        return dequantize(raw, qtype)
    except NotImplementedError:
        raise ModelError(f"unsupported GGUF tensor type {qtype.name} (the gguf package cannot dequantize it)") from None


def _check_dequantizable(path: Path, tensors: list[TensorInfo]) -> None:
    """Refuse at open, before any worker starts, a tensor type the gguf package cannot dequantize:
    dequantize one zero block of each type in use."""
    for qtype in sorted({t.qtype for t in tensors} - set(_PLAIN)):
        try:
            _decode(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
        except ModelError:
            name = next(t.name for t in tensors if t.qtype == qtype)
            raise ModelError(
                f"{path}: tensor {name} has type {qtype.name}, which the gguf package cannot dequantize"
            ) from None
