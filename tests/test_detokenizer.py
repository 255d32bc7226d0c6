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


# --- a SentencePiece-style tokenizer (Metaspace pieces, a decoder that strips the first
# word-start space), as Llama 2 and Mistral have ---------------------------------------------
SENTENCES = [
    "Hello world, how are you doing today?",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "We stream tokens one at a time and join the pieces back together.",
]


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory):
    """A small BPE tokenizer over Metaspace pieces, saved as transformers saves one, with a
    tiny random Llama of its vocabulary beside it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "<s>", "</s>"]))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>", clean_up_tokenization_spaces=False)
    d = tmp_path_factory.mktemp("metaspace")
    tok.save_pretrained(d)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_the_first_output_token_keeps_its_word_start_space_after_the_prompt(metaspace_dir):
    """The window starts in the prompt, as vLLM's does: the text is decode(prompt + output)
    past decode(prompt), where decode(output) alone would drop the first word's space; a
    stop string that begins with that space is found."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(metaspace_dir)
    rng = random.Random(5)
    spaced = 0
    for sentence in SENTENCES:
        ids = tok.encode(sentence, add_special_tokens=False)
        for cut in range(1, len(ids)):
            prompt, out = ids[:cut], ids[cut:]
            want = tok.decode(prompt + out)[len(tok.decode(prompt)):]
            assert tok.decode(prompt + out).startswith(tok.decode(prompt))
            det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
            pieces = []
            for t in out:
                det.add([t])
                pieces.append(det.delta(False))
            det.flush()
            pieces.append(det.delta(True))
            assert "".join(pieces) == want, (prompt, out)
            spaced += want.startswith(" ") and not tok.decode(out).startswith(" ")
            if want.startswith(" ") and len(want) > 3:
                stop = want[: rng.randint(2, len(want) - 1)]
                cutter = IncrementalDetokenizer(tok, stop=[stop], prompt_token_ids=prompt)
                for t in out:
                    if cutter.add([t]) is not None:
                        break
                assert cutter.stopped_by == stop and cutter.text == "", (stop, want)
    assert spaced > 10  # the cases where decoding the output alone loses the space


@pytest.mark.anyio
async def test_the_engine_streams_an_output_as_it_reads_after_the_prompt(metaspace_dir):
    from asyncgen import AsyncEngine, SamplingParams
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(metaspace_dir)
    async with AsyncEngine.from_pretrained(metaspace_dir, max_model_len=128, num_kv_blocks=32) as engine:
        client = engine.openai_client()
        for sentence in SENTENCES:
            prompt = " ".join(sentence.split()[:4])
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
            chunks = [c async for c in engine.stream(prompt, params)]
            ids = engine.tokenizer.encode(prompt)
            out = [t for c in chunks for t in c.token_ids]
            text = "".join(c.text for c in chunks)
            assert text == tok.decode(ids + out)[len(tok.decode(ids)):]
            # the OpenAI layer's offsets count the same text
            done = await client.completions.create(model=client.model, prompt=prompt, max_tokens=12, temperature=0,
                                                   logprobs=0, extra_body={"ignore_eos": True})
            choice = done.choices[0]
            assert choice.text == text and choice.logprobs.text_offset[0] == 0
            assert "".join(choice.logprobs.tokens) == text
