"""Incremental detokenization (tokenizers' DecodeStream) against one decode of all ids: on random
id sequences of the byte-level tokenizers (the demo model's and the tiny test model's), whose
single-byte tokens split multi-byte UTF-8 characters, pushed in random chunks; and through the
stop-string matcher, which must cut the streamed text as it cuts the whole text. A Llama-2-style
byte-fallback tokenizer is checked on the ids of real text, and must not fail on random ids
(its decode of invalid UTF-8 is not prefix-stable, so there no stream can match it)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from radixlora.demo import DEMO_MODEL_DIR
from radixlora.text.detokenize import IncrementalDecoder, StopMatcher
from radixlora.text.tokenizer import Tokenizer
from scripts.checkpoints import TINY_CORPUS, build_tokenizer


def byte_fallback_tokenizer() -> HFTokenizer:
    """SentencePiece-style BPE: "▁" for spaces, <0xNN> tokens for bytes outside the vocab."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "é", "中", "文", "▁a", "▁b", "ab", "▁ab", "▁中", "▁▁"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "中"), ("▁", "▁")]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


TOKENIZERS = {
    "demo": lambda: Tokenizer.from_dir(DEMO_MODEL_DIR),
    "tiny": lambda: Tokenizer(build_tokenizer(TINY_CORPUS * 4, 256)),
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request) -> Tokenizer:
    return TOKENIZERS[request.param]()


def stream(tokenizer: Tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """The chunks an IncrementalDecoder releases for ids pushed `cuts` at a time, then flushed."""
    dec, chunks, pos = IncrementalDecoder(tokenizer), [], 0
    for cut in [*cuts, len(ids)]:
        chunks.append(dec.push(ids[pos : pos + cut]))
        pos += cut
    chunks.append(dec.flush())
    return chunks


def test_random_ids_include_split_characters(tokenizer):
    """The byte-level vocabularies hold lone UTF-8 lead and continuation bytes."""
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    seqs = [[rng.randrange(vocab) for _ in range(20)] for _ in range(50)]
    assert any("\ufffd" in tokenizer.decode(ids) for ids in seqs)
    snowman = tokenizer.encode("☃ é 中文", add_special_tokens=False)
    assert tokenizer.decode(snowman) == "☃ é 中文"
    assert any("\ufffd" in tokenizer.decode([i]) for i in snowman)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    cuts=st.lists(st.integers(1, 5), max_size=20),
)
def test_streamed_text_equals_full_decode(tokenizer, data, cuts):
    vocab = tokenizer.vocab_size
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=60))
    assert "".join(stream(tokenizer, ids, cuts)) == tokenizer.decode(ids)


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    cuts=st.lists(st.integers(1, 4), max_size=20),
    stops=st.lists(st.sampled_from(["e", "th", " a", "é", "\ufffd", "中文", "s t"]), max_size=3),
    include=st.booleans(),
)
def test_stops_cut_the_streamed_text_as_the_whole_text(tokenizer, data, cuts, stops, include):
    """Streamed in any chunks, the text ends where the whole text's first stop string ends
    (include: after it, include_stop_str_in_output) or begins (before it)."""
    vocab = tokenizer.vocab_size
    if data.draw(st.booleans()):
        ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40))
    else:
        text = data.draw(st.text("aeths 中文é☃\n", max_size=40))
        ids = tokenizer.encode(text, add_special_tokens=False)
    whole = StopMatcher(stops, include)
    decoded = tokenizer.decode(ids)
    want = whole.feed(decoded)
    if whole.matched is None:
        want += whole.flush()

    matcher, got = StopMatcher(stops, include), ""
    for chunk in stream(tokenizer, ids, cuts):
        got += matcher.feed(chunk)
        if matcher.matched is not None:
            break
    if matcher.matched is None:
        got += matcher.flush()
    assert (got, matcher.matched) == (want, whole.matched)
    if matcher.matched is not None:
        kept = got if include else got + matcher.matched
        assert decoded.startswith(kept) and kept.endswith(matcher.matched)


@settings(max_examples=100, deadline=None)
@given(text=st.text("ab 中文é☃ü\n", max_size=40), cuts=st.lists(st.integers(1, 4), max_size=20))
def test_byte_fallback_text_streams_as_decoded(text, cuts):
    tok = Tokenizer(byte_fallback_tokenizer())
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(stream(tok, ids, cuts)) == tok.decode(ids)


def test_byte_fallback_random_ids_never_fail():
    tok = Tokenizer(byte_fallback_tokenizer())
    rng = random.Random(1)
    restarted = 0
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        restarted += "".join(stream(tok, ids, [1] * len(ids))) != tok.decode(ids)
    assert restarted  # such ids occur, and the decoder goes on past them
