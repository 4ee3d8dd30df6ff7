"""Tokenizer vs transformers: the bundled GGUF vocabulary, its chat template, streaming, HF dirs, sentencepiece."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import transformers  # noqa: E402  (a test dependency: missing must fail, not skip)

from fusion_compute.cli.options import tokenizer_for
from fusion_compute.model.config import ModelError
from fusion_compute.weights.gguf import GGUFWeights
from fusion_compute.weights.gguf_index import GGUFIndex
from fusion_compute.weights.loader import default_model_path
from fusion_compute.weights.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\n\n\n",
    "The year 2024 had 366 days; π≈3.14159.",
    "1234567890",
    "x1y22z333 v2.0.1-rc3",
    "price: $1,299.99 (-15%)",
    "naïve café résumé Zürich",
    "Привет, мир!",
    "日本語のテキスト、中文字符。",
    "한국어 문장",
    "emoji 😀🎉👩‍👩‍👧‍👦 🇫🇷 ❤️",
    "def f(x):\n    return x**2  # square\n",
    "if (a<=b && c!=d) { return -1; }",
    "<|im_start|>user\nhi<|im_end|>",
    "don't won't I'm they'll",
    "https://example.com/path?q=1&r=2#frag",
    "\u00a0non-breaking\u2003spaces",
    "a" * 50,
]
# llama.cpp's "smollm" pre-tokenizer (like SmolLM2's own tokenizer.json) isolates every numeric
# character (\p{N}). transformers' GGUF converter builds a plain GPT-2 byte-level tokenizer without
# that split, so " ¾" stays one pre-token there and merges into "Ġ" + "Â"... bytes. ASCII digits agree
# (the vocabulary has no space+digit merges); non-ASCII numerics after a space do not.
NUMERIC_DIFF = ["½ ¾ ²³ ١٢٣ ４５６"]
CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks 😀"},
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def hf():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_basics(ours):
    assert ours.vocab_size == 49152
    # eos <|im_end|> (also the template's turn end), plus <|endoftext|>
    assert ours.eos_ids == (ours.token_id("<|im_end|>"), ours.token_id("<|endoftext|>")) == (2, 0)
    assert ours.encode("<|im_start|>") == [1]  # special text is one token; no BOS (add_bos_token false)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equals_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf(text).input_ids
    assert ours.decode(ids) == hf.decode(ids) == text


@pytest.mark.slow  # transformers' tokenizer from the GGUF: ~8 s to load on a loaded machine
@pytest.mark.parametrize("text", NUMERIC_DIFF)
def test_numeric_split_differs_from_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids != hf(text).input_ids and ours.decode(ids) == text
    # every token holding a numeric character holds nothing else (no "Ġ¾")
    pieces = [ours.decode([i]) for i in ids]
    assert " " in pieces and not any(p.startswith(" ") and len(p) > 1 for p in pieces)


@pytest.mark.slow
def test_chat_matches_transformers(ours, hf):
    text = ours.render_chat(CHAT)
    assert text == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.chat_ids(CHAT) == hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    no_prompt = ours.render_chat(CHAT, add_generation_prompt=False)
    assert no_prompt == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)


def test_client_tokenizer_reuses_the_weights_index(ours, monkeypatch):
    # The client opens the GGUF once: the tokenizer reads its arrays through the weight source's index.
    path = default_model_path()
    src = GGUFWeights(path)

    def reopen(_: object) -> GGUFIndex:
        raise AssertionError("the GGUF file was parsed a second time")

    monkeypatch.setattr(GGUFIndex, "open", staticmethod(reopen))
    tok = tokenizer_for(path, src, needed=True)
    assert (tok.vocab_size, tok.eos_ids, tok.chat_template) == (ours.vocab_size, ours.eos_ids, ours.chat_template)
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text)
    assert tok.chat_ids(CHAT) == ours.chat_ids(CHAT)


def test_stream_decoder_never_splits_characters(ours):
    text = "héllo 👩‍👩‍👧‍👦🎉 中文 ok 😀"
    ids = ours.encode(text)
    stream = ours.stream()
    deltas = [stream.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some emoji bytes were held back
    assert "".join(deltas) + stream.flush() == text
    # whole chunks at once; a dangling half character is dropped at flush, never U+FFFD (a reply cut by
    # its length limit mid-emoji ends before the emoji, as vLLM's incremental detokenizer ends it)
    stream = ours.stream()
    assert stream.push(ids[:3]) + stream.push(ids[3:]) == text
    half = ours.encode("😀")[:1]
    stream = ours.stream()
    assert stream.push(half) == "" and stream.flush() == ""
    cut = ours.encode("ok 😀")[:-1]  # "ok", then " " and half the emoji's bytes in one token
    stream = ours.stream()
    assert "".join(stream.push(i) for i in cut) + stream.flush() == "ok "


def test_hf_dir_roundtrip(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<|turn|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["hello world, the quick brown fox", "turn by turn 12 héllo"] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}<|turn|>\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template=template
    )
    fast.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    for text in ["hello world", "the fox, héllo 12 😀", "<|turn|>hi"]:
        assert tok.encode(text) == ref(text).input_ids and tok.encode(text)[0] == 0  # BOS from post-processor
        assert tok.decode(tok.encode(text), skip_special=True) == text.replace("<|turn|>", "")
    chat = [{"role": "user", "content": "hello"}]
    assert tok.render_chat(chat) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.chat_ids(chat) == ref.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert tok.eos_ids == (1, 2)  # eos, generation_config (the template's turn end <|turn|> is id 2 too)
    with pytest.raises(Exception, match="bad role system"):
        tok.render_chat([{"role": "system", "content": "x"}])


def _spm_gguf(path: Path) -> Path:
    pieces = [
        "▁",
        "e",
        "t",
        "h",
        "a",
        "i",
        "n",
        "g",
        "o",
        "r",
        "l",
        "d",
        "w",
        "▁t",
        "he",
        "▁the",
        "in",
        "ing",
        "▁a",
        "er",
        "▁w",
        "or",
        "ld",
        "▁wor",
        "▁world",
        "▁h",
        "el",
        "▁hel",
        "lo",
        "▁hello",
        "é",
        "中",
    ]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_gguf(tmp_path):
    tok = Tokenizer.from_gguf(_spm_gguf(tmp_path / "spm.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["hello world", " the thing", "  two spaces", "héllo 中文 ü", "a\nb", "hello</s> world", ""]:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids and ids[0] == 1  # llama.cpp adds BOS to sentencepiece vocabularies
        assert tok.decode(ids[1:]) == ref.decode(ids[1:])
        # sentencepiece's prefix space is stripped on decode: a text's own leading space is lost in both
        assert tok.decode(ids[1:]) in (text, text[1:])
    # Text right after a special token: llama.cpp (and sentencepiece-era Llama 2, "<s>[INST]" -> "▁[")
    # prefixes a space; transformers' converter (Metaspace prepend_scheme="first") does not.
    after_special = tok.encode("a") + [2] + tok.encode("hello")[1:]
    assert tok.encode("a</s>hello") == after_special != ref("a</s>hello").input_ids
    assert tok.eos_ids == (2,)


def test_unsupported_gguf_tokenizer(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="unsupported GGUF tokenizer model 'bert'"):
        load_tokenizer(tmp_path / "t.gguf")
