"""Weight sources: read only the slices a party needs, in HF naming and HF layout (out, in), fp32.

Two formats implement the same `WeightSource` protocol: a Hugging Face directory of safetensors
(here) and a GGUF file (`gguf.py`). A worker asks for `W[rows, cols]` where `cols` are its input
coordinates (a few contiguous ranges) and `rows` an output permutation; safetensors' `get_slice`
reads just those columns from disk, so worker memory scales with its share of the model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from ..model.config import ModelConfig, ModelError
from .source import Ranges, WeightSource, default_model_path, resolve_model_path

__all__ = ["Ranges", "WeightSource", "SafetensorsWeights", "default_model_path", "open_weights", "resolve_model_path"]


def open_weights(model: str | Path | None) -> WeightSource:
    path = resolve_model_path(model)
    if path.is_file():
        from .gguf import GGUFWeights

        return GGUFWeights(path)
    return SafetensorsWeights(path)


def _select(t: torch.Tensor, rows: torch.Tensor | None, cols: Ranges | None) -> torch.Tensor:
    if cols is not None and t.dim() == 2:
        t = torch.cat([t[:, a:b] for a, b in cols], dim=1)
    if rows is not None:
        t = t.index_select(0, rows)
    return t


_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
READ_CHUNK_BYTES = 16 << 20  # rows are read in bounded chunks, then narrowed to the wanted columns


class _SafetensorsFile:
    """One .safetensors file read with pread, not mmap.

    Why not `safe_open(...).get_slice`: it memory-maps the file, and a column slice of a row-major
    tensor touches every page of it, so each worker's resident set would grow by the whole tensor
    (the full model, over all layers) even though it keeps only 1/N. Reading bounded chunks of rows
    and keeping only the wanted columns makes worker memory follow its share.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > path.stat().st_size - 8:
                raise ValueError(f"header length {n} beyond the file's end")
            header = json.loads(f.read(n))
        self.base = 8 + n
        header.pop("__metadata__", None)
        self.tensors: dict[str, dict] = header

    def read(self, name: str, cols: Ranges | None) -> torch.Tensor:
        info = self.tensors[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelError(f"{self.path.name}: {name} has unsupported dtype {info['dtype']}")
        shape = list(info["shape"])
        begin, end = info["data_offsets"]
        es = torch.tensor([], dtype=dtype).element_size()
        with open(self.path, "rb", buffering=0) as f:
            if len(shape) != 2 or cols is None:
                f.seek(self.base + begin)
                data = bytearray(f.read(end - begin))
                return torch.frombuffer(data, dtype=dtype).view(shape).to(torch.float32)
            rows, width = shape
            row_bytes = width * es
            step = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
            parts = []
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                f.seek(self.base + begin + r0 * row_bytes)
                chunk = torch.frombuffer(bytearray(f.read((r1 - r0) * row_bytes)), dtype=dtype).view(r1 - r0, width)
                parts.append(torch.cat([chunk[:, a:b] for a, b in cols], dim=1).to(torch.float32))
            return torch.cat(parts) if len(parts) > 1 else parts[0]


class SafetensorsWeights:
    """A Hugging Face model directory: config.json + model.safetensors or a sharded index."""

    def __init__(self, path: Path):
        self.path = path
        self.config = ModelConfig.from_hf_dir(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{path}: no *.safetensors files")
        self._where: dict[str, _SafetensorsFile] = {}
        for name in files:
            try:
                st = _SafetensorsFile(path / name)
            except (OSError, ValueError, struct.error) as e:
                raise ModelError(f"{path / name}: unreadable safetensors file ({e})") from None
            self._where.update(dict.fromkeys(st.tensors, st))

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, rows: torch.Tensor | None = None, cols: Ranges | None = None) -> torch.Tensor:
        if name not in self._where:
            raise ModelError(f"{self.path}: tensor {name} missing")
        return _select(self._where[name].read(name, cols), rows, None)
