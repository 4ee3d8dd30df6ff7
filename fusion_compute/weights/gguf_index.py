"""GGUF index: the header, metadata and tensor table of a llama.cpp GGUF file, and positioned reads of
its bytes, without parsing what nobody asks for.

Why not `gguf.GGUFReader`: it turns every metadata value into numpy views and Python objects when it
opens a file. For SmolLM2 that is ~100k token and merge strings: ~3 s and ~160 MB in every process
that opens the model, and a worker uses none of them. Opening an index reads the header, the scalar
and string values and the tensor infos; an array value is only measured (item type, count, byte
span) and is read when someone asks for it (the client's tokenizer). Tensor bytes come from
positioned reads, never from a memory map: touched pages of a mapped file count toward the resident
set, so a worker that reads a column slice of every row would carry whole tensors.

Layout (GGUF v2 and v3, little-endian; ggml's docs/gguf.md):

    "GGUF" | uint32 version | uint64 tensor count | uint64 metadata count
    metadata:     (string key, uint32 value type, value) * metadata count
    tensor infos: (string name, uint32 n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset) * count
    padding to `general.alignment` (default 32), then the data section (tensor offsets are relative to it)

A string is a uint64 byte count and UTF-8 bytes; an array is a uint32 item type, a uint64 count and
the items. `dims[0]` is the length of a row (ggml order), so the numpy shape is the dims reversed.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..model.config import ModelError

__all__ = ["ArrayRef", "GGUFIndex", "TensorInfo"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 used 32-bit counts and lengths; gguf.GGUFReader does not read it either
DEFAULT_ALIGNMENT = 32
WINDOW_BYTES = 1 << 20  # the head of the file is parsed through a buffer of this size
MAX_NESTING = 8  # arrays of arrays: deeper is refused (a crafted file must not exhaust the stack)

_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32, _U64 = _SCALARS[GGUFValueType.UINT32], _SCALARS[GGUFValueType.UINT64]
_MISSING = object()


@dataclass(frozen=True)
class ArrayRef:
    """An array value, not read: item type, item count, and its items' byte span [start, end) in the file."""

    item_type: GGUFValueType
    length: int
    start: int
    end: int


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. `offset` is absolute (data section start + the stored offset)."""

    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the length of a row
    qtype: GGMLQuantizationType
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy (and HF) order: rows first."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.dims[0] if self.dims[0] else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: quant blocks run along a row and never straddle two."""
        block, block_bytes = GGML_QUANT_SIZES[self.qtype]
        return self.dims[0] // block * block_bytes

    @property
    def n_bytes(self) -> int:
        return self.n_rows * self.row_bytes


class _Head:
    """Forward parsing of the file's head through one bounded buffer: a skipped array's bytes are
    never read, and a corrupt length runs into the file's end, not into memory."""

    def __init__(self, f: IO[bytes], size: int, path: Path):
        self.f, self.size, self.path = f, size, path
        self.base = 0
        self.buf = b""

    def at(self, pos: int, n: int) -> int:
        """Offset of file position `pos` in `self.buf`, with bytes [pos, pos + n) in it."""
        off = pos - self.base
        if off < 0 or off + n > len(self.buf):
            if pos + n > self.size:
                raise ModelError(f"{self.path}: truncated GGUF file (needs byte {pos + n}, has {self.size})")
            self.f.seek(pos)
            self.buf = self.f.read(max(n, WINDOW_BYTES))
            self.base, off = pos, 0
            if len(self.buf) < n:
                raise ModelError(f"{self.path}: truncated GGUF file (short read at byte {pos})")
        return off

    def scalar(self, pos: int, s: struct.Struct) -> Any:
        return s.unpack_from(self.buf, self.at(pos, s.size))[0]

    def string(self, pos: int, what: str) -> tuple[str, int]:
        n = self.scalar(pos, _U64)
        off = self.at(pos + 8, n)
        try:
            return self.buf[off : off + n].decode("utf-8"), pos + 8 + n
        except UnicodeDecodeError:
            raise ModelError(f"{self.path}: {what} at byte {pos} is not UTF-8") from None

    def value_type(self, pos: int, what: str) -> GGUFValueType:
        raw = self.scalar(pos, _U32)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ModelError(f"{self.path}: {what} has unknown GGUF value type {raw}") from None

    def skip_items(self, pos: int, item: GGUFValueType, count: int, key: str, depth: int = 0) -> int:
        """Position after `count` items of type `item` starting at `pos`; reads only string lengths
        (and nested array headers), never the items."""
        if depth > MAX_NESTING:
            raise ModelError(f"{self.path}: {key} nests arrays more than {MAX_NESTING} deep")
        fixed = _SCALARS.get(item)
        least = fixed.size if fixed is not None else (8 if item == GGUFValueType.STRING else 12)
        if count * least > self.size - pos:
            raise ModelError(f"{self.path}: truncated GGUF file ({key}: {count} items do not fit in the file)")
        if fixed is not None:
            return pos + count * fixed.size
        if item == GGUFValueType.STRING:
            # The hot loop of opening a file (~100k tokens and merges): unpack lengths straight from
            # the buffer, refilling it only when a length crosses its end.
            buf, base, unpack = self.buf, self.base, _U64.unpack_from
            for _ in range(count):
                if not 0 <= pos - base <= len(buf) - 8:
                    self.at(pos, 8)
                    buf, base = self.buf, self.base
                pos += 8 + unpack(buf, pos - base)[0]
            if pos > self.size:
                raise ModelError(f"{self.path}: truncated GGUF file ({key} runs past the file's end)")
            return pos
        for _ in range(count):  # arrays of arrays
            sub = self.value_type(pos, key)
            n = self.scalar(pos + 4, _U64)
            pos = self.skip_items(pos + 12, sub, n, key, depth + 1)
        return pos


class GGUFIndex:
    """A GGUF file's metadata (arrays unread) and tensor table; `read_bytes` reads any byte range.

    Open with `GGUFIndex.open(path)`; every problem with the file is a one-line `ModelError`."""

    def __init__(
        self, path: Path, version: int, values: dict[str, Any], tensors: dict[str, TensorInfo], data_offset: int
    ):
        self.path = path
        self.version = version
        self.values = values  # key -> int | float | bool | str | ArrayRef
        self.tensors = tensors  # in file order
        self.data_offset = data_offset

    @staticmethod
    def open(path: str | Path) -> GGUFIndex:
        path = Path(path)
        try:
            with open(path, "rb") as f:
                return _parse(_Head(f, os.fstat(f.fileno()).st_size, path))
        except OSError as e:
            raise ModelError(f"{path}: not a readable GGUF file ({e.strerror or e})") from None

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value: a scalar, a string, or an array read now as a list (as `GGUFReader`'s
        `ReaderField.contents()` gives it). ModelError naming the key if absent and no default."""
        value = self.values.get(key, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise ModelError(f"{self.path}: GGUF metadata key {key!r} missing")
            return default
        return self.read_array(key, value) if isinstance(value, ArrayRef) else value

    def scalar(self, key: str, default: Any = _MISSING) -> Any:
        """A scalar or string value; an array under `key` is an error (and is not read)."""
        if isinstance(self.values.get(key), ArrayRef):
            raise ModelError(f"{self.path}: GGUF metadata key {key!r} is an array, expected a single value")
        return self.get(key, default)

    def array_length(self, key: str) -> int | None:
        value = self.values.get(key)
        return value.length if isinstance(value, ArrayRef) else None

    def read_array(self, key: str, ref: ArrayRef) -> list[Any]:
        raw = self.read_bytes(ref.start, ref.end - ref.start)
        fixed = _SCALARS.get(ref.item_type)
        if fixed is not None:
            return np.frombuffer(raw, dtype=np.dtype(fixed.format), count=ref.length).tolist()
        if ref.item_type != GGUFValueType.STRING:
            raise ModelError(f"{self.path}: GGUF metadata key {key!r} is an array of arrays, which is not supported")
        data, out, pos, unpack = raw.tobytes(), [], 0, _U64.unpack_from
        try:
            for _ in range(ref.length):
                n = unpack(data, pos)[0]
                out.append(data[pos + 8 : pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        except UnicodeDecodeError:
            raise ModelError(f"{self.path}: GGUF metadata key {key!r}: item {len(out)} is not UTF-8") from None
        except struct.error:  # lengths were checked when the file was opened: it changed since
            raise ModelError(f"{self.path}: GGUF metadata key {key!r} changed since the file was opened") from None
        return out

    def read_bytes(self, offset: int, n: int) -> np.ndarray:
        """Bytes [offset, offset + n) of the file as a fresh, writable uint8 array (a positioned
        read into private memory: the resident set grows by what the caller keeps, not the file)."""
        out = np.empty(n, dtype=np.uint8)
        view = out.data  # the array's own buffer, as a memoryview: readinto fills `out` in place
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(offset)
                got = 0
                while got < n:
                    k = f.readinto(view[got:])
                    if not k:
                        raise ModelError(f"{self.path}: truncated GGUF file (nothing at byte {offset + got})")
                    got += k
        except OSError as e:
            raise ModelError(f"{self.path}: GGUF file unreadable ({e.strerror or e})") from None
        return out

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        return self.read_bytes(t.offset, t.n_bytes)


def _parse(h: _Head) -> GGUFIndex:
    path = h.path
    off = h.at(0, 4) if h.size >= 4 else 0
    if h.buf[off : off + 4] != MAGIC:
        raise ModelError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    version = h.scalar(4, _U32)
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise ModelError(f"{path}: big-endian GGUF files are not supported")
        raise ModelError(f"{path}: unsupported GGUF version {version} (supported: {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = h.scalar(8, _U64), h.scalar(16, _U64)
    pos = 24
    values: dict[str, Any] = {}
    value: object  # a string, a scalar or an ArrayRef, by vtype
    for _ in range(n_kv):
        key, pos = h.string(pos, "a metadata key")
        vtype = h.value_type(pos, f"metadata key {key!r}")
        pos += 4
        if vtype == GGUFValueType.STRING:
            value, pos = h.string(pos, f"metadata key {key!r}")
        elif vtype == GGUFValueType.ARRAY:
            item = h.value_type(pos, f"metadata key {key!r}")
            count = h.scalar(pos + 4, _U64)
            end = h.skip_items(pos + 12, item, count, f"metadata key {key!r}")
            value, pos = ArrayRef(item, count, pos + 12, end), end
        else:
            s = _SCALARS[vtype]
            value, pos = h.scalar(pos, s), pos + s.size
        if key in values:
            raise ModelError(f"{path}: duplicate GGUF metadata key {key!r}")
        values[key] = value
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelError(f"{path}: general.alignment must be a power of two, got {alignment!r}")
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name, pos = h.string(pos, "a tensor name")
        n_dims = h.scalar(pos, _U32)
        if n_dims * 8 > h.size - pos:
            raise ModelError(f"{path}: truncated GGUF file (tensor {name} claims {n_dims} dimensions)")
        dims = tuple(h.scalar(pos + 4 + 8 * i, _U64) for i in range(n_dims))
        pos += 4 + 8 * n_dims
        raw_type, rel = h.scalar(pos, _U32), h.scalar(pos + 4, _U64)
        pos += 12
        infos.append((name, dims, raw_type, rel))
    data_offset = -(-pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, raw_type, rel in infos:
        t = _tensor_info(path, name, dims, raw_type, data_offset + rel)
        if name in tensors:
            raise ModelError(f"{path}: duplicate GGUF tensor {name}")
        if t.offset + t.n_bytes > h.size:
            raise ModelError(
                f"{path}: truncated GGUF file (tensor {name} ends at byte {t.offset + t.n_bytes}, "
                f"the file has {h.size})"
            )
        tensors[name] = t
    return GGUFIndex(path, version, values, tensors, data_offset)


def _tensor_info(path: Path, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ModelError(f"{path}: tensor {name} has ggml type {raw_type}, unknown to the gguf package") from None
    if qtype not in GGML_QUANT_SIZES:
        raise ModelError(f"{path}: tensor {name} has ggml type {qtype.name}, without a block size in gguf")
    if not dims:
        raise ModelError(f"{path}: tensor {name} has no dimensions")
    block = GGML_QUANT_SIZES[qtype][0]
    if dims[0] % block:
        raise ModelError(f"{path}: tensor {name} dims {list(dims)}: rows must be whole {qtype.name} blocks of {block}")
    return TensorInfo(name, dims, qtype, offset)
