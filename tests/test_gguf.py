"""GGUFWeights: config and every layer-0 weight vs transformers' own GGUF loader; every tensor bit-identical
to dequantizing `gguf.GGUFReader`'s parse; slicing; bounded read transients; synthetic and broken files."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from test_rope import LLAMA31, hf_inv_freq

import fusion_compute.weights.gguf as gguf_source
from fusion_compute.model.config import ModelError
from fusion_compute.weights.gguf import GGUFWeights, hf_name
from fusion_compute.weights.gguf_index import ArrayRef
from fusion_compute.weights.loader import default_model_path

# transformers dequantizes with its own kernels; both are fp32 reconstructions of the same blocks.
DEQUANT_ATOL = 1e-6


@pytest.fixture(scope="module")
def weights() -> GGUFWeights:
    return GGUFWeights(default_model_path())


@pytest.fixture(scope="module")
def reference() -> gguf.GGUFReader:
    """The gguf package's own parse of the bundled file (what gguf.py read through before GGUFIndex)."""
    return gguf.GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def hf_model(smollm_ref):
    return smollm_ref  # one transformers load of the GGUF per test session (conftest)


@pytest.mark.slow  # transformers' SmolLM2 from the GGUF: ~7 s of CPU (13 before gguf_parsed_once), once per run (conftest)
def test_config_matches_transformers(weights, hf_model):
    c, hf = weights.config, hf_model.config
    assert (c.arch, c.hidden, c.intermediate, c.n_layers) == ("llama", 576, 1536, 30)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.vocab) == (9, 3, 64, 49152)
    assert c.tie_embeddings and hf.tie_word_embeddings
    assert (c.hidden, c.intermediate, c.n_layers) == (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (c.vocab, c.max_positions, c.rms_eps) == (hf.vocab_size, hf.max_position_embeddings, hf.rms_norm_eps)
    assert c.rope.theta == hf.rope_parameters["rope_theta"] and c.rope.kind == "default"
    assert c.qkv_bias == hf.attention_bias
    assert c.bos_id == hf.bos_token_id and c.eos_ids == (hf.eos_token_id,)


@pytest.mark.slow
def test_layer0_weights_equal_transformers(weights, hf_model):
    # q_proj / k_proj equal only if llama.cpp's RoPE row permutation is undone correctly.
    params = dict(hf_model.named_parameters())
    names = [n for n in params if n.startswith("model.layers.0.")] + ["model.embed_tokens.weight", "model.norm.weight"]
    assert len(names) == 11 and not weights.has("lm_head.weight")
    for name in names:
        ours, ref = weights.read(name), params[name].detach()
        assert ours.dtype == torch.float32 and ours.shape == ref.shape, name
        diff = (ours - ref).abs().max().item()
        assert diff <= DEQUANT_ATOL, f"{name}: max |diff| {diff:.3g}"


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.self_attn.q_proj.weight",  # Q4_1, permuted rows
        "model.layers.3.self_attn.k_proj.weight",  # Q4_1, permuted rows, kv heads
        "model.layers.3.mlp.down_proj.weight",  # Q4_1, 1536 columns
        "model.embed_tokens.weight",  # Q8_0
    ],
)
def test_read_rows_cols_equals_slicing(weights, name):
    full = weights.read(name)
    out, inp = full.shape
    g = torch.Generator().manual_seed(0)
    rows = torch.randperm(out, generator=g)[: out // 3]
    cols = [(5, 40), (64, 65), (inp - 70, inp)]  # not block aligned, single column, to the end
    expect = torch.cat([full[:, a:b] for a, b in cols], dim=1)[rows]
    assert torch.equal(weights.read(name, rows=rows, cols=cols), expect)
    assert torch.equal(weights.read(name, rows=rows), full[rows])
    assert torch.equal(weights.read(name, cols=cols), torch.cat([full[:, a:b] for a, b in cols], dim=1))


def _llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # inverse of convert_hf_to_gguf.py's LlamaModel.permute (`_llama_permute` below)
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # bitwise comparison: -0.0 != 0.0, NaN == same NaN


@pytest.mark.slow
def test_index_equals_gguf_reader(weights, reference):
    index = weights.index
    fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(index.values) == list(fields)
    assert isinstance(index.values["tokenizer.ggml.merges"], ArrayRef)  # not read by opening
    for key, field in fields.items():
        assert index.get(key) == field.contents(), key
    ours = [(t.name, list(t.dims), t.qtype, t.offset, t.n_bytes) for t in index.tensors.values()]
    assert ours == [(t.name, t.shape.tolist(), t.tensor_type, t.data_offset, t.n_bytes) for t in reference.tensors]


@pytest.mark.slow
def test_every_tensor_bit_identical_to_gguf_reader(weights, reference):
    """Every tensor of the bundled model, whole and sliced, equals gguf's dequantization of GGUFReader's
    memory map bit for bit (llama q/k rows un-permuted): the reader changed, the numbers did not."""
    c = weights.config
    g = torch.Generator().manual_seed(0)
    covered = set()
    for t in reference.tensors:
        name = hf_name(t.name)
        assert name is not None, t.name
        data = np.asarray(t.data)
        want = dequantize(data, t.tensor_type) if data.dtype == np.uint8 else data.astype(np.float32)
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            want = _llama_unpermute(want, c.n_heads if ".q_proj." in name else c.n_kv_heads)
        want = torch.from_numpy(np.ascontiguousarray(want))
        got = weights.read(name)
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(_bits(got), _bits(want)), name
        covered.add(t.tensor_type)
        if want.dim() == 2:
            out, inp = want.shape
            rows = torch.cat([torch.randperm(out, generator=g)[: out // 3], torch.tensor([0, out - 1, 0])])
            cols = [(3, 77), (100, 101), (inp - 40, inp)]  # unaligned, one column, to the end
            expect = torch.cat([want[:, a:b] for a, b in cols], dim=1)[rows]
            assert torch.equal(_bits(weights.read(name, rows=rows, cols=cols)), _bits(expect)), name
    assert covered == {Q.Q4_1, Q.Q8_0, Q.F32} == {t.tensor_type for t in reference.tensors}


def _read_peak(src: GGUFWeights, name: str) -> tuple[int, int]:
    """(output bytes, peak bytes traced while reading) of one whole-tensor read."""
    tracemalloc.start()
    try:
        out = src.read(name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out.numel() * 4, peak


def test_read_transients_are_bounded(weights, monkeypatch):
    # The embedding is 108 MiB in fp32. Read in bounded chunks, a read holds little beyond its output;
    # dequantized in one go (the chunk bounds lifted), gguf's dequantize holds about two more copies.
    size, peak = _read_peak(weights, "model.embed_tokens.weight")
    assert size == 49152 * 576 * 4 and peak - size < 32 << 20, f"{(peak - size) / 2**20:.0f} MiB over the output"
    monkeypatch.setattr(gguf_source, "READ_CHUNK_BYTES", 1 << 40)
    monkeypatch.setattr(gguf_source, "DEQUANT_CHUNK_ELEMENTS", 1 << 40)
    size, peak = _read_peak(weights, "model.embed_tokens.weight")
    assert peak - size > 100 << 20  # the measurement sees the transients it bounds


def test_open_reads_no_arrays():
    # GGUFReader allocates ~160 MB opening this file (its token and merge arrays as Python objects).
    tracemalloc.start()
    try:
        src = GGUFWeights(default_model_path())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert src.config.vocab == 49152 and peak < 4 << 20, f"opening allocated {peak / 2**20:.1f} MiB"


def test_read_1d_rows(weights):
    norm = weights.read("model.layers.0.input_layernorm.weight")
    rows = torch.tensor([7, 0, 575])
    assert norm.shape == (576,) and torch.equal(
        weights.read("model.layers.0.input_layernorm.weight", rows=rows), norm[rows]
    )


def test_missing_tensor_and_bad_slices(weights):
    with pytest.raises(ModelError, match="missing"):
        weights.read("lm_head.weight")
    with pytest.raises(ModelError, match="out of bounds"):
        weights.read("model.layers.0.mlp.up_proj.weight", cols=[(500, 600)])
    with pytest.raises(ModelError, match="row index out of bounds"):
        weights.read("model.layers.0.mlp.up_proj.weight", rows=torch.tensor([0, 1536]))
    with pytest.raises(ModelError, match="row index out of bounds"):
        weights.read("model.layers.0.self_attn.q_proj.weight", rows=torch.tensor([-1]))  # permuted rows
    with pytest.raises(ModelError, match="row index out of bounds"):
        weights.read("model.layers.0.input_layernorm.weight", rows=torch.tensor([576]))


# --- synthetic files -------------------------------------------------------------------------------


def _write(path: Path, arch: str, meta: dict[str, str | int | float], tensors: dict[str, tuple[np.ndarray, Q]]) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        add = {str: w.add_string, float: w.add_float32, int: w.add_uint32}[type(value)]
        add(key.format(arch=arch), value)
    for name, (x, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, x.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            q = gguf.quants.quantize(x, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


H, FFN, NH, NKV, D = 64, 96, 4, 2, 16
META = {
    "{arch}.embedding_length": H,
    "{arch}.feed_forward_length": FFN,
    "{arch}.block_count": 1,
    "{arch}.attention.head_count": NH,
    "{arch}.attention.head_count_kv": NKV,
    "{arch}.context_length": 128,
    "{arch}.vocab_size": 32,
    "{arch}.rope.freq_base": 1e6,
    "{arch}.attention.layer_norm_rms_epsilon": 1e-6,
}


def _rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unsupported_arch(tmp_path):
    path = _write(tmp_path / "g.gguf", "gemma", META, {"token_embd.weight": (_rand(32, H), Q.F32)})
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gemma'"):
        GGUFWeights(path)


def test_unsupported_quantization_and_bad_metadata(tmp_path):
    # Q8_1 is a ggml type the gguf package cannot dequantize: refused at open, before any worker starts.
    w = gguf.GGUFWriter(tmp_path / "q81.gguf", "llama")
    for key, value in META.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key.format(arch="llama"), value)
    w.add_tensor(
        "token_embd.weight", np.zeros((32, H // 32 * 40), np.uint8), raw_shape=(32, H // 32 * 40), raw_dtype=Q.Q8_1
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="token_embd.weight has type Q8_1, which the gguf package cannot dequantize"):
        GGUFWeights(tmp_path / "q81.gguf")
    tensors = {"token_embd.weight": (_rand(32, H), Q.F32)}
    bad = _write(tmp_path / "s.gguf", "llama", {**META, "{arch}.embedding_length": "wide"}, tensors)
    with pytest.raises(ModelError, match="'llama.embedding_length' must be a number, got 'wide'"):
        GGUFWeights(bad)
    no_hidden = {k: v for k, v in META.items() if k != "{arch}.embedding_length"}
    with pytest.raises(ModelError, match="'llama.embedding_length' missing"):
        GGUFWeights(_write(tmp_path / "m.gguf", "llama", no_hidden, tensors))


def test_qwen2_types_roundtrip(tmp_path):
    # Qwen2 GGUFs keep HF row order (llama.cpp uses NEOX rope for them): no un-permutation.
    ref = {
        "token_embd.weight": (_rand(32, H), Q.Q8_0),
        "output.weight": (_rand(32, H), Q.BF16),
        "blk.0.attn_q.weight": (_rand(NH * D, H), Q.F16),
        "blk.0.attn_q.bias": (_rand(NH * D), Q.F32),
        "blk.0.attn_k.weight": (_rand(NKV * D, H), Q.Q4_1),
        "blk.0.ffn_down.weight": (_rand(H, FFN), Q.Q8_0),
    }
    w = GGUFWeights(_write(tmp_path / "q.gguf", "qwen2", META, ref))
    c = w.config
    assert (c.arch, c.hidden, c.head_dim, c.vocab, c.rope.theta) == ("qwen2", H, D, 32, 1e6)
    assert c.qkv_bias and not c.tie_embeddings
    hf = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
        "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    }
    tol = {Q.F32: 0, Q.F16: 1e-2, Q.BF16: 2e-2, Q.Q8_0: 5e-2, Q.Q4_1: 0.5}
    for name, src in hf.items():
        x, qtype = ref[src]
        got = w.read(name)
        assert got.shape == x.shape, name
        assert (got - torch.from_numpy(x)).abs().max().item() <= tol[qtype] * np.abs(x).max(), name
    rows, cols = torch.tensor([3, 1]), [(10, 40), (50, 96)]
    full = w.read("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(
        w.read("model.layers.0.mlp.down_proj.weight", rows, cols), torch.cat([full[:, 10:40], full[:, 50:96]], 1)[rows]
    )


def test_llama_unpermute_and_linear_rope(tmp_path):
    q, k = _rand(NH * D, H), _rand(NKV * D, H)
    tensors = {
        "token_embd.weight": (_rand(32, H), Q.F32),
        "blk.0.attn_q.weight": (_llama_permute(q, NH), Q.F32),
        "blk.0.attn_k.weight": (_llama_permute(k, NKV), Q.F32),
        "blk.0.attn_q.bias": (_llama_permute(q[:, 0].copy(), NH), Q.F32),  # the converter permutes biases too
    }
    meta = {**META, "{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}
    src = GGUFWeights(_write(tmp_path / "l.gguf", "llama", meta, tensors))
    assert (src.config.rope.kind, src.config.rope.factor) == ("linear", 4.0)
    assert src.config.tie_embeddings and src.config.qkv_bias
    assert torch.equal(src.read("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))
    assert torch.equal(src.read("model.layers.0.self_attn.k_proj.weight"), torch.from_numpy(k))
    assert torch.equal(src.read("model.layers.0.self_attn.q_proj.bias"), torch.from_numpy(q[:, 0]))
    rows = torch.tensor([17, 0, 5])
    assert torch.equal(src.read("model.layers.0.self_attn.q_proj.bias", rows=rows), torch.from_numpy(q[[17, 0, 5], 0]))
    got = src.read("model.layers.0.self_attn.k_proj.weight", rows=rows, cols=[(3, 9)])
    assert torch.equal(got, torch.from_numpy(k[[17, 0, 5], 3:9]))


def test_llama3_rope_freqs(tmp_path):
    # Llama 3.x GGUFs carry per-pair divisors (rope_freqs.weight) instead of the llama3 parameters.
    # The divisors come from transformers' llama3 rule (test_rope.hf_inv_freq), not from RopeConfig's.
    theta, factor = 5e5, 32.0
    scaled = hf_inv_freq(theta, D, {**LLAMA31, "factor": factor, "original_max_position_embeddings": 8192})
    divisors = np.array([b / s for b, s in zip(hf_inv_freq(theta, D, None), scaled, strict=True)], np.float32)
    meta = {**META, "{arch}.rope.freq_base": theta}
    tensors = {"token_embd.weight": (_rand(32, H), Q.F32), "rope_freqs.weight": (divisors, Q.F32)}
    rope = GGUFWeights(_write(tmp_path / "l3.gguf", "llama", meta, tensors)).config.rope
    assert (rope.kind, rope.factor, rope.low_freq_factor, rope.high_freq_factor) == ("llama3", factor, 1.0, 4.0)
    bad = {**tensors, "rope_freqs.weight": (divisors[::-1].copy(), Q.F32)}
    with pytest.raises(ModelError, match="rope_freqs"):
        GGUFWeights(_write(tmp_path / "bad.gguf", "llama", meta, bad))
