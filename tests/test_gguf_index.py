"""GGUFIndex on synthetic files: every metadata value type and the tensor table equal `gguf.GGUFReader`'s
parse; arrays are skipped, not read, until asked for; every broken file is a one-line ModelError."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from fusion_compute.model.config import ModelError
from fusion_compute.weights.gguf_index import ArrayRef, GGUFIndex

TOKENS = ["<unk>", "a", "b", "ab", "héllo", "中文", ""]


def _write(path: Path, alignment: int | None = None, extra: dict[str, object] | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_string("t.empty", "")
    w.add_token_list(TOKENS)
    w.add_token_types([2, 1, 1, 1, 1, 1, 3])
    w.add_token_scores([0.0, -1.5, -2.25, 1e-3, 3.0, -0.1, 7.0])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.f64s", [0.1, -2.0])
    for key, value in (extra or {}).items():
        w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("b.weight", q, raw_shape=q.shape, raw_dtype=Q.Q8_0)
    w.add_tensor("c.weight", rng.standard_normal(7).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _table(index: GGUFIndex) -> list[tuple]:
    return [(t.name, list(t.dims), t.qtype, t.offset, t.n_bytes, t.shape) for t in index.tensors.values()]


def _reader_table(reader: gguf.GGUFReader) -> list[tuple]:
    return [
        (t.name, t.shape.tolist(), t.tensor_type, t.data_offset, t.n_bytes, tuple(reversed(t.shape.tolist())))
        for t in reader.tensors
    ]


@pytest.mark.parametrize("alignment", [None, 64, 256])
def test_metadata_and_tensor_table_equal_gguf_reader(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment)
    index, reader = GGUFIndex.open(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # GGUFReader's own pseudo-keys
    assert list(index.values) == list(fields)
    for key, field in fields.items():
        got = index.get(key)
        assert got == field.contents() and type(got) is type(field.contents()), key
    assert _table(index) == _reader_table(reader)
    assert index.data_offset == reader.data_offset and index.data_offset % (alignment or 32) == 0
    # Tensor bytes come from positioned reads, equal to the reader's memory map.
    for t in reader.tensors:
        assert np.array_equal(index.tensor_bytes(index.tensors[t.name]), np.asarray(t.data).view(np.uint8).ravel())


def test_arrays_are_measured_not_read(tmp_path):
    index = GGUFIndex.open(_write(tmp_path / "m.gguf"))
    ref = index.values["tokenizer.ggml.tokens"]
    assert isinstance(ref, ArrayRef) and (ref.item_type, ref.length) == (V.STRING, len(TOKENS))
    assert index.array_length("tokenizer.ggml.tokens") == len(TOKENS) and index.array_length("t.u8") is None
    assert index.get("tokenizer.ggml.tokens") == TOKENS
    with pytest.raises(ModelError, match="is an array, expected a single value"):
        index.scalar("tokenizer.ggml.tokens")
    assert index.scalar("t.str") == "héllo wörld" and index.get("no.such.key", 7) == 7
    with pytest.raises(ModelError, match="'no.such.key' missing"):
        index.get("no.such.key")


def test_nested_array_is_skipped(tmp_path):
    # Arrays of arrays are legal GGUF: parsing steps over them; reading one is refused.
    index = GGUFIndex.open(_write(tmp_path / "n.gguf", extra={"t.nested": [[1, 2], [3]], "t.after": 7}))
    assert index.get("t.after") == 7 and index.array_length("t.nested") == 2
    with pytest.raises(ModelError, match="array of arrays"):
        index.get("t.nested")


def _one_line_error(path: Path, match: str) -> None:
    with pytest.raises(ModelError, match=match) as e:
        GGUFIndex.open(path)
    assert "\n" not in str(e.value)


def test_every_truncation_is_a_model_error(tmp_path):
    full = _write(tmp_path / "full.gguf").read_bytes()
    index = GGUFIndex.open(tmp_path / "full.gguf")
    end = max(t.offset + t.n_bytes for t in index.tensors.values())  # the writer pads after the last tensor
    cut = tmp_path / "cut.gguf"
    for n in range(end):
        cut.write_bytes(full[:n])
        _one_line_error(cut, "truncated|not a GGUF file")
    cut.write_bytes(full[:end])
    assert _table(GGUFIndex.open(cut)) == _table(index)


def _patched(tmp_path: Path, old: bytes, new: bytes, after: bytes = b"") -> Path:
    """The synthetic file with the first `old` after the first `after` replaced by `new` (same length)."""
    data = bytearray(_write(tmp_path / "src.gguf").read_bytes())
    at = data.index(old, data.index(after) + len(after) if after else 0)
    data[at : at + len(old)] = new
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    return tmp_path / "bad.gguf"


def test_bad_files(tmp_path):
    for name, data in [("empty", b""), ("short", b"GG"), ("text", b"hello world, not a model\n" * 4)]:
        (tmp_path / name).write_bytes(data)
        _one_line_error(tmp_path / name, "not a GGUF file")
    _one_line_error(tmp_path / "missing.gguf", "not a readable GGUF file")
    header = b"GGUF" + struct.pack("<I", 3)
    _one_line_error(_patched(tmp_path, header, b"GGUF" + struct.pack("<I", 1)), "unsupported GGUF version 1")
    _one_line_error(_patched(tmp_path, header, b"GGUF" + struct.pack(">I", 3)), "big-endian GGUF files are not")
    # the value type of t.u8 (uint32 after the key) becomes 99
    bad_type = _patched(tmp_path, struct.pack("<I", V.UINT8), struct.pack("<I", 99), b"t.u8")
    _one_line_error(bad_type, "unknown GGUF value type 99")
    _one_line_error(_patched(tmp_path, b"t.i8", b"t.u8"), "duplicate GGUF metadata key 't.u8'")
    _one_line_error(_patched(tmp_path, b"t.i8", b"t.\xff8"), "not UTF-8")
    # the tokens array claims 2^60 items
    count = struct.pack("<IQ", V.STRING, len(TOKENS))
    _one_line_error(_patched(tmp_path, count, struct.pack("<IQ", V.STRING, 2**60)), "truncated")
    # tensor a.weight: n_dims 2, dims 5 and 3, then its ggml type F32 (0) becomes 99
    info = struct.pack("<IQQI", 2, 5, 3, Q.F32)
    _one_line_error(_patched(tmp_path, info, struct.pack("<IQQI", 2, 5, 3, 99)), "ggml type 99, unknown")
    # b.weight (Q8_0, rows of 64): a row of 65 is not whole blocks
    info = struct.pack("<IQQI", 2, 64, 4, Q.Q8_0)
    _one_line_error(_patched(tmp_path, info, struct.pack("<IQQI", 2, 65, 4, Q.Q8_0)), "whole Q8_0 blocks of 32")
    _one_line_error(_write(tmp_path / "al.gguf", extra={"general.alignment": 48}), "power of two")


def test_bad_token_text_is_a_model_error_when_read(tmp_path):
    # Opening skips the tokens without decoding them; reading them reports the bad one.
    index = GGUFIndex.open(_patched(tmp_path, "héllo".encode(), b"h\xff\xffllo", b"tokenizer.ggml.tokens"))
    with pytest.raises(ModelError, match="'tokenizer.ggml.tokens': item 4 is not UTF-8"):
        index.get("tokenizer.ggml.tokens")


def test_read_bytes_past_the_end(tmp_path):
    index = GGUFIndex.open(_write(tmp_path / "m.gguf"))
    size = (tmp_path / "m.gguf").stat().st_size
    assert index.read_bytes(size - 3, 3).size == 3
    with pytest.raises(ModelError, match="truncated"):
        index.read_bytes(size - 3, 4)
