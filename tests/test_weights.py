"""Safetensors reader: sharded index, bf16, column/row slices equal the plain safetensors load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fusion_compute.bench.models import build_random
from fusion_compute.model.config import ModelError
from fusion_compute.weights.loader import open_weights

TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 97,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return build_random(tmp_path_factory.mktemp("sharded"), TINY, shards=2)


def test_sharded_bf16_slices_equal_full_load(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3  # embeddings + 2 layer shards
    full = {}
    for f in set(index.values()):
        full.update(load_file(sharded / f))
    src = open_weights(sharded)
    assert src.config.hidden == 48 and src.config.qkv_bias and src.config.tie_embeddings
    rows = torch.tensor([5, 0, 7, 3])
    for name, t in full.items():
        want = t.float()
        assert torch.equal(src.read(name), want), name
        if t.dim() == 2:
            cols = [(1, 4), (10, 12)]
            got = src.read(name, rows=rows, cols=cols)
            assert torch.equal(got, torch.cat([want[:, 1:4], want[:, 10:12]], 1)[rows]), name


def test_chunked_reads_cover_every_row(sharded, monkeypatch):
    import fusion_compute.weights.loader as w

    monkeypatch.setattr(w, "READ_CHUNK_BYTES", 7 * 48 * 2)  # 7 rows per chunk: 80 rows -> 12 chunks
    name = "model.layers.1.mlp.gate_proj.weight"
    full = open_weights(sharded).read(name)
    assert torch.equal(open_weights(sharded).read(name, cols=[(0, 48)]), full)


def test_missing_and_corrupt(tmp_path, sharded):
    with pytest.raises(ModelError, match="missing"):
        open_weights(sharded).read("model.layers.9.mlp.up_proj.weight")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((sharded / "config.json").read_text())
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        open_weights(bad)
    (bad / "model.safetensors").write_bytes(b"\\xff" * 3)
    with pytest.raises(ModelError, match="unreadable"):
        open_weights(bad)
