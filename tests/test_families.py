"""Every supported family (model/config.py: FAMILIES) against transformers, at several shapes each,
and the refusal of what the runtime does not implement.

Quick (no processes): the dense twin, the one copy of the layer's math outside the sharded runtime,
against transformers in float64 on random-weight models built from transformers' own config classes
(MistralConfig, Qwen3Config, Phi3Config, Qwen2Config with its sliding window): GQA and MHA, tied and
untied heads, odd widths, sliding windows shorter than the prompt; greedy ids identical, logits within
LOGIT_ATOL, incremental decode equal to the full forward. Slow: the sharded arithmetic at N = 1..4 (split
KV groups at N = 3, 4; uneven capacities) in this process (tests/inproc.py), and through real workers
the structural mode at N = 3, the masked mode at 1+1, the audit and the exchanges counted.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from test_cli import no_new_workers  # noqa: F401 (a fixture)
from tiny_models import build

from fusion_compute.model import reference
from fusion_compute.model.config import FAMILIES, ModelConfig, ModelError, Unsupported
from fusion_compute.model.dense import DenseModel
from fusion_compute.weights.loader import open_weights

# As tests/test_parity.py: the runtime's fp32 error against float64 on these 3-layer models is ~1e-5
# (logits up to ~8); 3e-4 sits 20x above it and far below what a missing piece does here: a window not
# applied, a q/k norm dropped or LongRoPE's attention factor ignored moves logits by > 1e-1 (the
# negative controls below measure it).
LOGIT_ATOL = 3e-4
PROMPT = [5, 17, 33, 2, 99, 100, 7, 8, 9, 10, 11, 200, 3]  # 13 tokens: longer than every window below
NEW_TOKENS = 24

# name -> (family, overrides of tiny_models.TINY[family]); each a shape the family must run exactly
SHAPES = {
    "mistral-gqa-w5": ("mistral", {}),
    "mistral-mha-tied-w3": ("mistral", {"num_key_value_heads": 4, "tie_word_embeddings": True, "sliding_window": 3}),
    "mistral-odd-w7": (
        "mistral",
        {"hidden_size": 72, "intermediate_size": 100, "num_attention_heads": 6, "head_dim": 12, "sliding_window": 7},
    ),
    "mistral-nowindow": ("mistral", {"sliding_window": None}),
    "qwen3-gqa-odd-tied": ("qwen3", {}),
    "qwen3-mha-untied": (
        "qwen3",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}),
    "gemma3-gqa-odd-tied": ("gemma3_text", {}),
    "gemma3-mha-untied-plain": (
        "gemma3_text",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "tie_word_embeddings": False,
            "query_pre_attn_scalar": 16,
            "layer_types": None,
            "sliding_window_pattern": 2,
            "rope_parameters": None,
        },
    ),
    "phi3-gqa-longrope": ("phi3", {}),
    "phi3-mha-tied-plain": ("phi3", {"num_key_value_heads": 4, "tie_word_embeddings": True, "rope_scaling": None}),
    "phi3-odd-window": (
        "phi3",
        {
            "hidden_size": 72,
            "intermediate_size": 100,
            "num_attention_heads": 6,
            "sliding_window": 6,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.5] * 6, "long_factor": [3.0] * 6},
        },
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (path, transformers' float64 model), built once per module."""
    out = {}
    for name, (family, overrides) in SHAPES.items():
        path = build(tmp_path_factory.mktemp(name), family, seed=1, **overrides)
        out[name] = (path, reference.load_reference(path))
    return out


def dense_greedy(model: DenseModel, ids: list[int], n: int) -> list[int]:
    out = [int(model.forward(ids, 0)[-1].argmax())]
    while len(out) < n:
        out.append(int(model.forward([out[-1]], len(ids) + len(out) - 1)[-1].argmax()))
    return out


def test_every_family_has_a_shape():
    assert {family for family, _ in SHAPES.values()} >= set(FAMILIES) - {"llama", "qwen2"}


@pytest.mark.parametrize("name", list(SHAPES))
def test_dense_twin_matches_transformers(models, name):
    path, ref = models[name]
    family = SHAPES[name][0]
    config = ModelConfig.from_hf_dir(path)
    assert config.arch == family
    want = reference.logits(ref, PROMPT)
    model = DenseModel(open_weights(path))
    full = model.forward(PROMPT, 0).double()
    assert torch.allclose(full, want, atol=LOGIT_ATOL, rtol=0), (full - want).abs().max()
    model = DenseModel(open_weights(path))
    steps = [model.forward(PROMPT[:4], 0)] + [model.forward([t], 4 + i) for i, t in enumerate(PROMPT[4:])]
    inc = torch.cat(steps).double()
    if config.rope.kind == "longrope" and len(PROMPT) > config.rope.original_max_position:
        pytest.fail("the prompt must stay on LongRoPE's short factors for the full forward to equal decode")
    assert torch.allclose(inc, full, atol=LOGIT_ATOL, rtol=0), (inc - full).abs().max()
    want_ids = reference.greedy(ref, PROMPT, NEW_TOKENS)
    assert len(set(want_ids)) >= 6, f"flat reference continuation {want_ids}: a weak test"
    assert dense_greedy(DenseModel(open_weights(path)), PROMPT, NEW_TOKENS) == want_ids


def test_the_window_matters(models):
    """Negative control: the Mistral model read without its window (as this runtime read every
    Mistral before) leaves transformers on the 13-token prompt; so does Phi-3 without LongRoPE's
    factors and Qwen3 without its q/k norms. Each piece the families add is load-bearing here."""
    import dataclasses

    for name, strip in (
        ("mistral-gqa-w5", {"layer_windows": ()}),
        ("qwen3-gqa-odd-tied", {"qk_norm": False}),
        # Gemma 3: each of its pieces, one at a time (the (1 + w) gains: test_gemma3_gains_are_one_plus_w)
        ("gemma3-gqa-odd-tied", {"post_norms": False}),
        ("gemma3-gqa-odd-tied", {"embed_scale": 1.0}),
        ("gemma3-gqa-odd-tied", {"activation": "silu"}),
        ("gemma3-gqa-odd-tied", {"attn_scale": None}),
        ("gemma3-gqa-odd-tied", {"rope_local": None}),
        ("gemma3-gqa-odd-tied", {"layer_windows": ()}),
        ("gemma3-gqa-odd-tied", {"qk_norm": False}),
    ):
        path, ref = models[name]
        src = open_weights(path)
        src.config = dataclasses.replace(src.config, **strip)
        got = DenseModel(src).forward(PROMPT, 0).double()
        # Gemma's tiny model (init std 0.02) has logits ~0.3: its pieces move them by > 30 LOGIT_ATOL
        floor = 30 * LOGIT_ATOL if name.startswith("gemma") else 0.1
        assert (got - reference.logits(ref, PROMPT)).abs().max() > floor, (name, strip)
    path, ref = models["phi3-gqa-longrope"]
    src = open_weights(path)
    src.config = dataclasses.replace(src.config, rope=dataclasses.replace(src.config.rope, kind="default"))
    got = DenseModel(src).forward(PROMPT, 0).double()
    assert (got - reference.logits(ref, PROMPT)).abs().max() > 0.1


def test_gemma3_gains_are_one_plus_w(models):
    """Gemma stores every RMSNorm gain as w and multiplies by 1 + w: every reader returns 1 + w (so
    every consumer folds the same gain), and read as w the model leaves transformers."""
    import dataclasses

    from safetensors.torch import load_file

    from fusion_compute.model import architecture as arch

    path, ref = models["gemma3-gqa-odd-tied"]
    src = open_weights(path)
    stored = load_file(path / "model.safetensors")
    layer = "model.layers.1."
    assert torch.equal(arch.read_norm(src, 1, "gate_up"), 1 + stored[layer + "pre_feedforward_layernorm.weight"])
    assert torch.equal(arch.read_post_norm(src, 1, "o"), 1 + stored[layer + "post_attention_layernorm.weight"])
    assert torch.equal(arch.read_post_norm(src, 1, "down"), 1 + stored[layer + "post_feedforward_layernorm.weight"])
    assert torch.equal(arch.read_qk_norms(src, 1)[1], 1 + stored[layer + "self_attn.k_norm.weight"])
    assert torch.equal(arch.read_final_norm(src), 1 + stored["model.norm.weight"])
    src.config = dataclasses.replace(src.config, gain_offset=0.0)
    got = DenseModel(src).forward(PROMPT, 0).double()
    assert (got - reference.logits(ref, PROMPT)).abs().max() > 0.1


def test_fused_phi3_checkpoint_splits_by_the_config(models):
    """Phi-3 stores q/k/v and gate/up fused; every reader gets the same rows through architecture.py:
    a row range that straddles q | k is read from the one tensor, equal to the full read's rows."""
    from safetensors.torch import load_file

    from fusion_compute.model import architecture as arch

    path, _ = models["phi3-gqa-longrope"]
    src = open_weights(path)
    stored = load_file(path / "model.safetensors")
    qkv = stored["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(arch.read_weight(src, 1, "qkv"), qkv)
    assert torch.equal(arch.read_weight(src, 1, "qkv", rows=(60, 70), cols=[(3, 9)]), qkv[60:70, 3:9])
    gu = stored["model.layers.1.mlp.gate_up_proj.weight"]
    assert arch.read_weight(src, 1, "gate_up").shape == gu.shape == (2 * src.config.intermediate, src.config.hidden)


# The refusal cases' base config: small, valid for every family listed
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def hf(config_class, **kw) -> dict:
    return json.loads(config_class(**kw).to_json_string())


def refusals() -> list[tuple[dict, str]]:
    import transformers as tf

    small = SMALL
    return [
        (hf(tf.MixtralConfig, **small), "unsupported mixture-of-experts model: model_type 'mixtral'"),
        (hf(tf.Qwen3MoeConfig, **small), "unsupported mixture-of-experts model: model_type 'qwen3_moe'"),
        (hf(tf.Gemma2Config, **small), "unsupported architecture: model_type 'gemma2'"),
        ({**hf(tf.LlamaConfig, **small), "num_local_experts": 8}, "mixture-of-experts"),
        ({**hf(tf.Qwen3Config, **small), "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({**hf(tf.MistralConfig, **small), "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        (
            {**hf(tf.LlamaConfig, **small), "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'yarn' is not implemented",
        ),
        ({**hf(tf.LlamaConfig, **small), "attention_bias": True}, "attention_bias=true"),
        ({**hf(tf.Qwen3Config, **small), "attention_bias": True}, "attention_bias=true"),
        ({**hf(tf.LlamaConfig, **small), "mlp_bias": True}, "mlp_bias=true"),
        ({**hf(tf.MistralConfig, **small), "hidden_act": "gelu"}, "activation 'gelu'"),
        ({**hf(tf.Phi3Config, pad_token_id=0, **small), "partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
        (
            {**hf(tf.Qwen3Config, **small), "layer_types": ["chunked_attention"] * 2},
            "layer types ['chunked_attention']",
        ),
        # Gemma 3: its text decoder loads, its soft-capping (None by default) and the rest are refused
        ({**hf(tf.Gemma3TextConfig, **small), "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({**hf(tf.Gemma3TextConfig, **small), "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({**hf(tf.Gemma3TextConfig, **small), "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({**hf(tf.Gemma3TextConfig, **small), "hidden_activation": "gelu"}, "activation 'gelu'"),
        (hf(tf.Gemma3Config), "unsupported architecture: model_type 'gemma3'"),  # the multimodal wrapper
    ]


@pytest.mark.parametrize("i", range(18))
def test_unimplemented_is_refused_naming_what_is_supported(i):
    d, needle = refusals()[i]
    with pytest.raises(Unsupported) as e:
        ModelConfig.from_hf(d)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    assert "llama, mistral, qwen2, qwen3, phi3, gemma3_text" in msg, msg  # names every supported family
    assert e.value.exit_code == 2


def test_refusal_cases_are_each_accepted_without_their_feature():
    """Negative controls of the refusals: the same configs without the refused key load (so each
    refusal is caused by the key it names, not by something else in the config)."""
    import transformers as tf

    small = SMALL
    for cls in (tf.LlamaConfig, tf.MistralConfig, tf.Qwen3Config, tf.Qwen2Config):
        ModelConfig.from_hf(hf(cls, **small))
    ModelConfig.from_hf(hf(tf.Phi3Config, pad_token_id=0, **small))
    gemma = ModelConfig.from_hf(hf(tf.Gemma3TextConfig, **small))
    assert gemma.arch == "gemma3_text" and gemma.post_norms and gemma.rope_local is not None
    with pytest.raises(ModelError, match="sliding windows must be >= 1"):
        ModelConfig.from_hf({**hf(tf.MistralConfig, **small), "sliding_window": 0})


FAMILY_BASES = ("mistral-gqa-w5", "qwen3-gqa-odd-tied", "phi3-gqa-longrope", "gemma3-gqa-odd-tied")


@pytest.fixture(scope="module")
def wanted(models):
    """name -> transformers' float64 logits of PROMPT and its NEW_TOKENS greedy ids, each once."""

    @functools.cache
    def want(name: str) -> tuple[torch.Tensor, list[int]]:
        _, ref = models[name]
        return reference.logits(ref, PROMPT), reference.greedy(ref, PROMPT, NEW_TOKENS)

    return want


# The sharded arithmetic of every family in this process (tests/inproc.py: the workers' ShardedModel
# as threads over the in-memory fabric, the client's arithmetic done by ShardedRun): N = 1..4 (whole KV
# groups at N <= 2, groups split by RoPE pairs at N = 3, 4: each family's base shape has 2 KV heads),
# uneven capacities, full and sliding layers mixed in one model. Prefill logits, incremental decode ==
# full forward, greedy ids identical: the checks these cases had through real workers, which
# test_sharded_runtimes_match_transformers keeps for what a process adds (below).
INPROC_CASES = [
    (name, n, caps)
    for name in FAMILY_BASES
    for n, caps in ((1, None), (2, None), (3, None), (4, None), (3, (2.0, 1.0, 1.0)))
] + [
    ("qwen3-sliding", 3, None),
    ("qwen2-sliding", 4, (1.0, 2.0, 1.0, 1.0)),
    ("gemma3-mha-untied-plain", 3, (1.0, 1.0, 2.0)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,n,caps", INPROC_CASES, ids=[f"{c[0]}-N{c[1]}{'-cap' if c[2] else ''}" for c in INPROC_CASES]
)
def test_sharded_model_matches_transformers(models, wanted, name, n, caps):
    from inproc import ShardedRun

    path, _ = models[name]
    want, want_ids = wanted(name)
    run = ShardedRun(path, n, caps, max_seq=128)
    if name in FAMILY_BASES and n >= 3:  # what N = 3, 4 are for: partial scores summed among a group's owners
        assert any(len(owners) > 1 for owners in run.plan.group_owners), run.plan.group_owners
    full = run.forward(PROMPT)
    assert torch.allclose(full, want, atol=LOGIT_ATOL, rtol=0), (full - want).abs().max()
    run.reset()
    inc = torch.cat([run.forward(PROMPT[:5])] + [run.forward([t]) for t in PROMPT[5:]])
    assert torch.allclose(inc, full, atol=LOGIT_ATOL, rtol=0), (inc - full).abs().max()
    run.reset()
    assert run.greedy(PROMPT, NEW_TOKENS) == want_ids


# Through the real workers (threads of this process; on gloo, processes), what the runtime adds to the
# arithmetic above: the client's engine (the family's embedding scale, ingress, egress, final norm and
# head), the wire and the links' score sums (and Qwen3's q/k norm sums, Gemma's post-norm sums) at
# N = 3, where every base shape's KV groups split;
# the masked mode at 1+1; Gemma's post-norm sums on a fabric (comm.sum_norms' all-reduce branch).
RUNTIME_CASES = [
    (name, mode, n, None) for name in FAMILY_BASES for mode, n in (("structural", 3), ("masked", (1, 1)))
] + [
    ("qwen2-sliding", "masked", (1, 1), None),
    ("gemma3-gqa-odd-tied", "gloo", 3, None),
]


def engine(mode: str, path, n, caps):
    """The job, its workers threads of this process (tests/inproc.py: the real workers over the real
    links), but on the gloo fabric, which runs between processes."""
    from inproc import masked_threads, threads

    from fusion_compute.masked.client import MaskedEngine
    from fusion_compute.structural.client import Engine, EngineOptions

    if mode == "masked":
        return MaskedEngine(path, masked_threads(n_a=n[0], n_b=n[1:], timeout_s=60, context=128))
    if mode == "gloo":
        return Engine(path, EngineOptions(n_workers=n, comm_backend="gloo", insecure=True, timeout_s=60, context=128))
    return Engine(path, threads(n_workers=n, capacities=caps, timeout_s=60, context=128))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,mode,n,caps",
    RUNTIME_CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}{'-cap' if c[3] else ''}" for c in RUNTIME_CASES],
)
def test_sharded_runtimes_match_transformers(models, wanted, name, mode, n, caps):
    from fusion_compute.generation.generate import generate
    from fusion_compute.generation.sampling_params import SamplingParams

    path, _ = models[name]
    want, want_ids = wanted(name)
    with engine(mode, path, n, caps) as eng:
        eng.reset()
        full = eng.forward(PROMPT, all_logits=True)
        assert torch.allclose(full.double(), want, atol=LOGIT_ATOL, rtol=0), (full.double() - want).abs().max()
        eng.reset()
        steps = [eng.forward(PROMPT[:5], all_logits=True)] + [eng.forward([t], all_logits=True) for t in PROMPT[5:]]
        assert torch.allclose(torch.cat(steps), full, atol=LOGIT_ATOL, rtol=0)
        res = generate(eng, PROMPT, max_new_tokens=NEW_TOKENS, sampling=SamplingParams())
        assert res.token_ids == want_ids


AUDITED = FAMILY_BASES


@pytest.fixture(scope="module")
def good_audit(models, tmp_path_factory):
    """name -> the audited run of that family's base shape at N = 3 (worker processes), run once: the
    tests below read the same logs again under another expectation or another logged plan, which is
    the verifier's business alone, so its workers need not run again."""
    from test_audit import audited

    @functools.cache
    def run(name: str) -> dict:
        return audited(models[name][0], tmp_path_factory.mktemp(f"audit-{name}"), 3)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", AUDITED)
def test_audit_closes_and_its_negative_controls_fail(models, good_audit, name, tmp_path):
    """One model per family at N = 3 (a split KV group: score sums, and Qwen3's q/k norm sums): the
    audit closes every step with the family's transfers predicted; the Megatron-style baseline, the
    same tokens through the same attention code, is rejected; an injected gather is rejected."""
    from test_audit import audited

    path, _ = models[name]
    good = good_audit(name)
    assert good["ok"], good["first_violations"]
    assert good["closed_decode"] == good["decode_steps"] > 0
    bad = audited(path, tmp_path / "megatron", 3, variant="megatron")
    c = bad["violation_counts"]
    assert not bad["ok"] and c["no_full_holder"] and c["partition"] and c["closure"], c
    assert bad["generated_sha256"] == good["generated_sha256"]  # a correct baseline, wrongly placed
    leak = audited(path, tmp_path / "gather", 3, inject_leak="gather@1")
    assert not leak["ok"] and leak["violation_counts"]["closure"], leak["violation_counts"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,key,op",
    [("qwen3-gqa-odd-tied", "qk_norm", "L0.scores.g0"), ("gemma3-gqa-odd-tied", "post_norms", "L0.post_o")],
)
def test_audit_rejects_a_norm_exchange_it_did_not_predict(good_audit, monkeypatch, name, key, op):
    """Negative controls of the extended expectation: read as a family without q/k norms, the Qwen3
    run's score sums carry more than the scores (the heads' Σq², Σk²); read as a family without
    post-norms, the Gemma 3 run's all-worker Σy² sums are transfers nobody predicted. The verifier
    says so, naming the first. The logs are those of the run the audit above closes (good_audit):
    the same bytes, read again by the verifier (verify_dir, as the runner does) under the narrower
    expectation."""
    from fusion_compute.audit.verify import expectation, verify_dir

    good = good_audit(name)  # run (if not yet) before the expectation is narrowed below
    assert good["ok"], good["first_violations"]  # the same logs close under the family's own expectation
    real = expectation.expected_transfers

    def without_qk_norm(w, decls, owners, dims, *a, **kw):
        return real(w, decls, owners, {k: v for k, v in dims.items() if k != key}, *a, **kw)

    monkeypatch.setattr(expectation, "expected_transfers", without_qk_norm)
    from fusion_compute.audit.verify import checks

    monkeypatch.setattr(checks, "expected_transfers", without_qk_norm)
    r = verify_dir(good["dir"])
    assert not r.ok and r.counts()["accounting"], r.counts()
    assert op in " ".join(f"{v.invariant} [{v.where()}]: {v.message}" for v in r.violations[:5])


@pytest.mark.slow
def test_the_verifier_reads_the_kept_last_down_scatter_from_the_logged_plan(good_audit):
    """Gemma 3's last down keeps its scatter (its post-norm needs the summed y: plan.boundary's
    down_to_client is false, one merge instead of two), and the run's manifest says so. The audit
    closes reading it there; the same logs read with the flag flipped (as a family without
    post-norms) are rejected: an L3.down scatter nobody predicted, and the workers' rows of the final
    residual held where the flag says nobody holds them. The logs: the N = 3 run the audit above
    closes (good_audit), read again."""
    from pathlib import Path

    from fusion_compute.audit import schema as S
    from fusion_compute.audit.verify import load_manifest, verify_epoch

    good = good_audit("gemma3-gqa-odd-tied")
    assert good["ok"], good["first_violations"]
    epoch = Path(good["dir"]) / S.epoch_dir(0)
    manifest = load_manifest(epoch)
    boundary = manifest["plan"]["boundary"]
    assert boundary["down_to_client"] is False and boundary["merged"] == ["L0.qkv reduce-scatter into the ingress"]
    assert verify_epoch(epoch, manifest).ok
    flipped = {**manifest, "plan": {**manifest["plan"], "boundary": {**boundary, "down_to_client": True}}}
    wrong = verify_epoch(epoch, flipped)
    c = wrong.counts()
    assert not wrong.ok and c["accounting"] and c["holding"], c
    assert "L3.down" in " ".join(v.message for v in wrong.violations)


@pytest.mark.slow
@pytest.mark.usefixtures("no_new_workers")
@pytest.mark.parametrize("i", [0, 4, 6])  # a MoE model, attention soft-capping, an unknown RoPE type
def test_the_command_refuses_before_any_worker_starts(i, tmp_path):
    from procs import run
    from test_cli import assert_one_line_error

    d, needle = refusals()[i]
    (tmp_path / "config.json").write_text(json.dumps(d))
    for args in (("generate", "--prompt-ids", "1", "--workers", "2"), ("plan", "--workers", "2")):
        r = run(args[0], "--model", str(tmp_path), *args[1:])
        assert r.returncode == 2, r.stderr
        assert_one_line_error(r, needle)


@pytest.mark.slow
@pytest.mark.parametrize("name", AUDITED)
def test_rounds_per_layer_are_counted_as_the_plan_says(models, name):
    """The exchanges one decode step costs each worker, counted by its comm layer (Comm's counters,
    which bench/ops.stats reads off worker processes), equal the plan's collectives_per_forward
    (collectives_per_layer × layers, less the scatters the boundary merges: layer 0's QKV, and the
    last layer's down but with post-norms) at N = 2 (whole KV groups) and N = 3 (a split group): the
    figures of docs/performance.md's table of families, less those. In this process (tests/inproc.py:
    the workers' ShardedModel and Comm, the collectives on the in-memory fabric); what worker
    processes exchange over the links is the audit's to account for, step by step, above."""
    from inproc import ShardedRun

    from fusion_compute.bench.rtt import rounds_per_token

    path, _ = models[name]
    for n in (2, 3):
        run = ShardedRun(path, n)
        run.forward(PROMPT)
        before = [s["collectives"] for s in run.stats()]
        run.forward([7])
        counted = [s["collectives"] - b for s, b in zip(run.stats(), before, strict=True)]
        layers = run.config.n_layers
        planned = [run.plan.collectives_per_forward(w) for w in range(n)]
        assert counted == planned, (n, counted, planned)
        # the latency model's rounds per decode step: ingress, egress and the busiest worker's
        assert rounds_per_token(str(path), n, "sharded") == 2 + max(counted)
        print(f"{name} N={n}: exchanges per decode step per worker {counted} ({layers} layers)")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral-gqa-w5", "qwen3-gqa-odd-tied", "gemma3-gqa-odd-tied"])
def test_batched_decodes_keep_each_sessions_window(models, name):
    """Several sessions decoding in one step are attended together, padded to the longest (ops.py's
    Decodes): each must still see only its own last W keys (Mistral, W = 5), and each new key of a
    split group is normalized by its own head's norm once the score sum brings it (Qwen3). N = 3,
    two sessions at different positions, against transformers run on each alone. In this process
    (tests/inproc.py): the engine's batching over worker processes is test_batching.py's."""
    from inproc import ShardedRun

    path, ref = models[name]
    a, b = [5, 17, 33, 2, 99, 100, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46]
    run = ShardedRun(path, 3, slots=2)
    run.forward_batch([(0, a), (1, b)])
    step2 = [x[-1] for x in run.forward_batch([(0, [11]), (1, [11])])]
    step3 = [x[-1] for x in run.forward_batch([(1, [12]), (0, [12])])]
    for got, want in (
        (step2[0], reference.logits(ref, a + [11])[-1]),
        (step2[1], reference.logits(ref, b + [11])[-1]),
        (step3[0], reference.logits(ref, b + [11, 12])[-1]),
        (step3[1], reference.logits(ref, a + [11, 12])[-1]),
    ):
        assert torch.allclose(got, want, atol=LOGIT_ATOL, rtol=0), (got - want).abs().max()


def test_the_plan_and_its_picture_show_the_familys_pieces(models):
    """`fusion plan` prints the plan (its model dims name the windows and the q/k norms) and draws
    the ownership picture, whose subtitle says what the family adds; a Llama says nothing extra."""
    from fusion_compute.structural.picture import plan_picture
    from fusion_compute.structural.plan import make_plan

    want = {
        "mistral-gqa-w5": ("sliding window 5 on 3 of 3 layers", {"windows": [5, 5, 5]}),
        "qwen3-sliding": ("sliding window 4 on 2 of 3 layers", {"qk_norm": True, "windows": [None, 4, 4]}),
        "qwen3-gqa-odd-tied": ("per-head q/k norms", {"qk_norm": True}),
        "phi3-gqa-longrope": ("RoPE longrope", {}),
        "gemma3-gqa-odd-tied": (
            "post-norms on the attention and MLP outputs (+2 all-worker Σy² sums per layer)",
            {"qk_norm": True, "windows": [5, 5, None, 5], "post_norms": True},
        ),
    }
    for name, (words, dims) in want.items():
        plan = make_plan(ModelConfig.from_hf_dir(models[name][0]), 3)
        assert words in plan_picture(plan).subtitle, name
        assert plan.to_dict()["model"].items() >= dims.items(), name
    llama = ModelConfig("llama", 64, 120, 3, 4, 2, 16, 300, 256, 1e-5)
    assert llama.features() == [] and "windows" not in llama.dims() and "qk_norm" not in llama.dims()


def test_qwen3_from_gguf_equals_its_safetensors(models, tmp_path):
    """A Qwen3 GGUF (llama.cpp's names: attn_q_norm / attn_k_norm, no Q/K permutation for qwen3,
    head_dim in attention.key_length) written from the tiny model's own tensors in float32 loads to
    the same config and the same logits as its safetensors directory, and as transformers."""
    import gguf
    from safetensors.torch import load_file

    path, ref = models["qwen3-gqa-odd-tied"]
    c = ModelConfig.from_hf_dir(path)
    w = gguf.GGUFWriter(tmp_path / "q3.gguf", "qwen3")
    for key, value in {
        "embedding_length": c.hidden,
        "feed_forward_length": c.intermediate,
        "block_count": c.n_layers,
        "attention.head_count": c.n_heads,
        "attention.head_count_kv": c.n_kv_heads,
        "attention.key_length": c.head_dim,
        "context_length": c.max_positions,
        "vocab_size": c.vocab,
    }.items():
        w.add_uint32(f"qwen3.{key}", value)
    w.add_float32("qwen3.rope.freq_base", c.rope.theta)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", c.rms_eps)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    stems = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, x in load_file(path / "model.safetensors").items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            names[name] = f"blk.{layer}.{stems[module]}.weight"
        w.add_tensor(names[name], x.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = open_weights(tmp_path / "q3.gguf")
    got = src.config
    assert (got.arch, got.qk_norm, got.qkv_bias, got.head_dim, got.tie_embeddings) == ("qwen3", True, False, 12, True)
    logits = DenseModel(src).forward(PROMPT, 0).double()
    assert torch.allclose(logits, reference.logits(ref, PROMPT), atol=LOGIT_ATOL, rtol=0)
