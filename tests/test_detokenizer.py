"""Incremental detokenization on SmolLM2's real tokenizer."""

import pytest

from asyncgen.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "안녕하세요! 오늘 날씨가 정말 좋네요. 한국어 문장을 토큰 단위로 나누면 바이트가 쪼개집니다.",
    "Emoji 🎉🚀 and CJK 漢字かな交じり文 mixed with  double  spaces.",
    "Plain English, with punctuation: commas, periods... and (parentheses)!",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_full_decode_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer)
    pieces = []
    for t in ids:
        det.add([t])
        pieces.append(det.delta(finished=False))
    det.flush()
    pieces.append(det.delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # Multi-byte characters really were split across tokens (else this test proves little).
    if not text.isascii():
        assert any(p == "" for p in pieces[:-1])


def test_partial_character_at_the_end_is_flushed_like_a_full_decode(tokenizer):
    ids = tokenizer.encode("한국")
    det = IncrementalDetokenizer(tokenizer)
    det.add(ids[:-1])
    det.flush()
    assert det.delta(finished=True) == tokenizer.decode(ids[:-1])


def test_stop_string_is_cut_and_never_split_across_deltas(tokenizer):
    text = "one two three STOP four five"
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, stop=["STOP", "zzz"])
    pieces = []
    for t in ids:
        stop = det.add([t])
        pieces.append(det.delta(finished=stop is not None))
        if stop:
            break
    assert stop == "STOP"
    assert "".join(pieces) == "one two three "
    assert not any("S" in p for p in pieces)


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop(tokenizer):
    ids = tokenizer.encode("alpha ST beta")
    det = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    pieces = []
    for t in ids:
        assert det.add([t]) is None
        pieces.append(det.delta(finished=False))
    pieces.append(det.delta(finished=True))
    assert "".join(pieces) == "alpha ST beta"


def test_min_tokens_keeps_an_early_stop_string_in_the_text(tokenizer):
    ids = tokenizer.encode("one STOP two three STOP four")
    k = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[: i + 1]))  # completes the first
    det = IncrementalDetokenizer(tokenizer, stop=["STOP"], min_tokens=k + 1)
    found = [(i, det.add([t])) for i, t in enumerate(ids)]
    first = next(i for i, stop in found if stop)
    assert first > k and det.text == "one STOP two three "
    eager = IncrementalDetokenizer(tokenizer, stop=["STOP"], min_tokens=k)
    assert [eager.add([t]) for t in ids[: k + 1]][-1] == "STOP" and eager.text == "one "


def test_include_stop_str_in_output(tokenizer):
    det = IncrementalDetokenizer(tokenizer, stop=["END"], include_stop_str_in_output=True)
    assert det.add(tokenizer.encode("a b END c")) == "END"
    assert det.delta(finished=True) == "a b END"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    for skip, expected in ((True, tokenizer.decode(ids, skip_special_tokens=True)), (False, tokenizer.decode(ids))):
        det = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        for t in ids:
            det.add([t])
        det.flush()
        assert det.delta(finished=True) == expected


def test_token_bytes_join_to_the_text_and_the_vocabulary_agrees_with_each_token(tokenizer):
    """The bytes of each token (the vocabulary structured outputs read) joined give the
    text's UTF-8 bytes; vocabulary() gives every id what TokenBytes(id) does."""
    from asyncgen.engine.tokenizer import TokenBytes

    token_bytes = TokenBytes(tokenizer)
    vocabulary = token_bytes.vocabulary()
    assert len(vocabulary) == len(tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(vocabulary[i] for i in ids) == text.encode()
    special = set(tokenizer.all_special_ids)
    assert special and all(vocabulary[i] is None for i in special)
    assert all(vocabulary[i] == token_bytes(i) for i in range(len(tokenizer)) if vocabulary[i] is not None)
