"""Streamed text: the increments `StreamDecoder` sends add up to the decode of all the ids, however the ids were
chunked, on a byte-level BPE tokenizer (the embedded model's: characters split across tokens), a word-level one
(spaces between words, special tokens skipped) and a SentencePiece-style one (a word's leading space dropped at the
start of a text); and each push decodes a bounded window of ids, not all of them. (A decode that cleans up spaces
before punctuation across tokens, `clean_up_tokenization_spaces`, is not additive for any stream: the engine then
answers with what it streamed.)"""

import pytest
from hypothesis import given, settings, strategies as st

from conftest import tiny_tokenizer
from lossless.decoding.models import load_tokenizer
from lossless.text import StreamDecoder


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<s>", "</s>", "<unk>", "\u2581the", "\u2581cat", "s", "\u2581sat", ".", ",", "\u2581", "\u2581on"]
    tok = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()  # drops the leading "\u2581" of a text's first piece
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers():
    return {"byte-level": load_tokenizer("smollm2-135m"), "word-level": tiny_tokenizer(),
            "metaspace": _metaspace_tokenizer()}


def _streamed(tok, ids: list[int], cuts: list[int]) -> str:
    stream, pieces, last = StreamDecoder(tok), [], 0
    for at in sorted({c % (len(ids) + 1) for c in cuts}) + [len(ids)]:
        pieces.append(stream.push(ids[last:at]))
        last = at
    return "".join(pieces)


def _ids(tok, draw_text, draw_ids):
    """Ids of drawn text (multi-byte characters, punctuation) with drawn raw ids mixed in (special tokens, pieces
    of characters)."""
    return tok(draw_text, add_special_tokens=False)["input_ids"] + [i % len(tok) for i in draw_ids]


TEXT = st.lists(st.sampled_from(list("ab .,!?'\n") + ["\u00e9", "\u65e5\u672c", "\U0001f642", " the", " cats"]),
               max_size=30).map("".join)


@pytest.mark.parametrize("name", ["byte-level", "word-level", "metaspace"])
@settings(max_examples=150, deadline=None)
@given(text=TEXT, raw=st.lists(st.integers(0, 2**31), max_size=8), order=st.randoms(use_true_random=False),
       cuts=st.lists(st.integers(0, 60), max_size=15))
def test_the_increments_add_up_to_the_decode_of_all_the_ids(tokenizers, name, text, raw, order, cuts):
    tok = tokenizers[name]
    ids = _ids(tok, text, raw)
    order.shuffle(ids)
    whole = tok.decode(ids, skip_special_tokens=True)
    streamed = _streamed(tok, ids, cuts)
    assert whole.startswith(streamed)  # what was sent is never taken back
    if not whole.endswith("\ufffd"):  # held back only while a character may still be completed
        assert streamed == whole


def test_a_character_split_across_tokens_is_held_back_until_it_is_whole(tokenizers):
    tok = tokenizers["byte-level"]
    ids = tok("\U0001f642!", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2  # the emoji's four bytes span several tokens
    stream = StreamDecoder(tok)
    assert [stream.push([i]) for i in ids[:-2]] == [""] * (len(ids) - 2)
    assert stream.push(ids[-2:]) == "\U0001f642!"


def test_each_push_decodes_a_bounded_window_not_every_id(tokenizers):
    tok = tokenizers["byte-level"]
    ids = tok(" word" * 2000, add_special_tokens=False)["input_ids"]
    decoded = []

    class Counting:
        def decode(self, some, **kw):
            decoded.append(len(some))
            return tok.decode(some, **kw)

    stream = StreamDecoder(Counting())
    text = "".join(stream.push([i]) for i in ids)
    assert text == tok.decode(ids)
    assert max(decoded) <= 2 and sum(decoded) <= 3 * len(ids)  # re-decoding all: ~len(ids)^2 / 2
