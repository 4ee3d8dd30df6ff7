"""The stream decoder at its boundaries (issue 47): one token per byte (a byte-level BPE of 256
tokens and no merges, built here), so every invalid or incomplete UTF-8 sequence can be placed
exactly. Only a last character the tokens left incomplete is dropped at the end of a reply; an
invalid byte in the middle is the U+FFFD the tokenizer's own decode gives it, pushed or flushed, and
nothing around it is lost."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from fusion_compute.weights.tokenizer import Tokenizer

FFFD = "\ufffd"


def byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (tokenizers' ByteLevel alphabet, byte by byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    chars = byte_to_char()
    backend = Backend(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


def streamed(tok: Tokenizer, data: bytes, chunks: int = 1) -> tuple[list[str], str]:
    """Push `data`'s bytes (ids) `chunks` at a time: the deltas and the flush."""
    stream = tok.stream()
    ids = list(data)
    deltas = [stream.push(ids[i : i + chunks]) for i in range(0, len(ids), chunks)]
    return deltas, stream.flush()


def test_the_tokenizer_is_one_token_per_byte(tok):
    assert tok.decode(list("é".encode())) == "é"
    assert tok.decode([0xFF]) == FFFD and tok.decode(list(b"a\xe2\x82")) == "a" + FFFD


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_an_invalid_byte_in_the_middle_is_kept_as_its_replacement(tok, chunks):
    """0xFF is never valid UTF-8: no later token completes it. It streams as the decode has it."""
    data = b"ab\xff" + "c€d".encode()
    deltas, tail = streamed(tok, data, chunks)
    assert "".join(deltas) + tail == "ab" + FFFD + "c€d" == tok.decode(list(data))


def test_only_the_last_incomplete_character_is_dropped_at_the_end(tok):
    """A reply cut mid-character: its last, incomplete character is dropped; an invalid byte before
    it, held back with it (the window ended in U+FFFD), is kept."""
    for data, want in [
        (b"ok\xff\xe2\x82", "ok" + FFFD),  # invalid, then the first two bytes of "€"
        (b"ok\xe2\x82", "ok"),  # the cut alone
        (b"\xff", ""),  # a lone invalid last byte is indistinguishable from a cut one
        (b"ok\xff\xffz\xe2", "ok" + FFFD + FFFD + "z"),
        ("é".encode() + b"\xc3", "é"),
    ]:
        deltas, tail = streamed(tok, data)
        assert "".join(deltas) + tail == want, data
        assert all(not d.endswith(FFFD) for d in deltas), deltas  # a delta never ends on a held-back byte


def test_a_character_split_over_pushes_is_held_back_and_never_split(tok):
    data = "a€b😀".encode()
    deltas, tail = streamed(tok, data)
    assert FFFD not in "".join(deltas) and tail == ""
    assert "".join(deltas) == "a€b😀"
    assert deltas.count("") == 2 + 3  # the held-back bytes: two of "€", three of "😀"
