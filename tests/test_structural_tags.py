"""Structural tags: free text in which each structure a trigger opens is constrained
(asyncgen.structured.structural_tag_grammar), its token masks against the general walk,
and the params and OpenAI fields that carry it."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from asyncgen import SamplingParams, StructuredOutputsParams
from asyncgen.errors import InvalidRequestError
from asyncgen.structured import TokenGuide, Vocabulary, _walk, structural_tag_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
CALLS = {
    "type": "structural_tag",
    "triggers": ["<tool_call>"],
    "structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER, "end": "}\n</tool_call>"},
        {"begin": '<tool_call>\n{"name": "get_time", "arguments": ', "schema": TIME, "end": "}\n</tool_call>"},
    ],
}
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n</tool_call>'


def _reads(grammar, text: str) -> bool:
    """Whether ``text`` is a complete output of ``grammar``, fed one byte at a time."""
    state = grammar.initial
    for b in text.encode():
        state = grammar.advance(state, bytes([b]))
        if state is None:
            return False
    return grammar.accepts(state)


def _prefix_ok(grammar, text: str) -> bool:
    return grammar.advance(grammar.initial, text.encode()) is not None


def test_free_text_around_structures_and_what_is_refused():
    g = structural_tag_grammar(CALLS)
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    accepted = [
        "",
        "No call: just text, with <tool and <tool_call and tool_call> and {\"name\": 1}.",
        WEATHER_CALL,
        "Checking.\n" + WEATHER_CALL + "\nand " + time_call + " done <tool_",
        '<tool_call>\n{"name": "get_time", "arguments":   {}  \n}\n</tool_call>',  # whitespace before value and end
        "<<tool_call>\n" + '{"name": "get_time", "arguments": {}}\n</tool_call>',  # the trigger after a partial one
        "é中😀 \x00\xff",  # any text, controls and all
    ]
    for text in accepted:
        assert _reads(g, text), text
    refused_prefixes = [
        '<tool_call>\n{"name": "get_wether"',  # a name no structure begins with
        "<tool_call>{",  # the begin's newline is part of it
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": 1',  # the schema holds
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "far too long a name"',
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"',  # declared order
        '<tool_call>\n{"name": "get_time", "arguments": {}}</tool_call>',  # the end's newline
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call',
    ]
    for text in refused_prefixes[:-1]:
        assert not _prefix_ok(g, text), text
    # from the trigger's last byte to the end's, the output may not end: a structure is open
    text = "Hi " + WEATHER_CALL
    assert _reads(g, text[: len("Hi <tool_call")])  # a trigger not yet complete is text
    for cut in range(len("Hi <tool_call>"), len(text)):
        assert _prefix_ok(g, text[:cut]) and not _reads(g, text[:cut])
    assert _reads(g, text) and not _reads(g, refused_prefixes[-1])


def test_triggers_that_overlap_begins_equal_to_triggers_and_an_empty_end():
    g = structural_tag_grammar({"triggers": ["ab", "b"], "structures": [
        {"begin": "ab=", "schema": {"type": "integer"}, "end": ";"},
        {"begin": "b", "schema": {"enum": [1, 12]}, "end": ""},
    ]})
    assert _reads(g, "xab=7;y") and _reads(g, "xab=-70;") and not _prefix_ok(g, "xab=7y")
    # "ab" also completes "b": after it come "=" (the first structure) or its value (the second)
    assert _reads(g, "xab12") and _reads(g, "xab1") and _reads(g, "b1 then text b12")
    assert not _prefix_ok(g, "ab3") and not _reads(g, "xb") and not _reads(g, "xab=")
    # an empty end: the value ends where free text starts, and the output may end after it
    assert _reads(g, "b12") and _reads(g, "b1x")


def test_a_reasoning_block_is_left_free():
    """"may_open": a <think> block that opens the output (after blank space) is free, a
    later or unclosed-then-text one is not special; "inside": free until </think>."""
    g = structural_tag_grammar({**CALLS, "reasoning": "may_open"})
    assert _reads(g, "<think>I could write <tool_call> here, or <tool_call>{ x</think>\n" + WEATHER_CALL)
    assert _reads(g, " \n <think>a <tool_call> b</think>ok") and _reads(g, "<think>never closed <tool_call>")
    assert not _prefix_ok(g, "<think>x</think> <tool_call>oops")  # watched after the block
    assert not _prefix_ok(g, "x<think> <tool_call>oops")  # a block that does not open the output
    assert not _prefix_ok(g, "<tool_call>oops") and _prefix_ok(g, "<thi")
    assert not _prefix_ok(g, "<thx <tool_call>oops") and _reads(g, "<th " + WEATHER_CALL)
    inside = structural_tag_grammar({**CALLS, "reasoning": "inside"})
    assert _reads(inside, "a <tool_call> b </think>" + WEATHER_CALL)
    assert not _prefix_ok(inside, "a</think><tool_call>x") and _reads(inside, "<think> again <tool_call></think>")
    plain = structural_tag_grammar(CALLS)
    assert not _prefix_ok(plain, "<think><tool_call>x")


@pytest.mark.parametrize("tag, words", [
    ({"triggers": [], "structures": CALLS["structures"]}, "triggers must be a non-empty list"),
    ({"triggers": ["<tool_call>"], "structures": []}, "structures must be a non-empty list"),
    ({"triggers": ["<x>"], "structures": CALLS["structures"]}, "starts with none of the triggers"),
    ({"triggers": ["<tool_call>", "<y>"], "structures": CALLS["structures"]}, "'<y>' starts none"),
    ({"triggers": ["<a"], "structures": [{"begin": "<a", "end": ""}, {"begin": "<a", "end": "x"}]},
     r"structures\[1\].begin '<a' repeats structures\[0\]"),
    ({"triggers": ["<a"], "structures": [{"begin": "<a", "schema": {"type": "integer", "minimum": 1}, "end": ""}]},
     r"structures\[0\].schema: .*minimum"),
    ({"triggers": ["<a"], "structures": [{"begin": "<a", "shape": {}, "end": ""}]}, r"structures\[0\] must be an object"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "only the form"),
    ({**CALLS, "reasoning": "always"}, "reasoning must be"),
    ({"triggers": ["<th"], "structures": [{"begin": "<th", "end": ""}], "reasoning": "may_open"}, "ends inside '<think>'"),
    ({"triggers": ["\n<a"], "structures": [{"begin": "\n<a", "end": ""}], "reasoning": "may_open"}, "blank space"),
    ("{not json", "not valid JSON"),
])
def test_malformed_tags_are_refused_naming_what_is_wrong(tag, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        structural_tag_grammar(tag)
    assert e.value.param == "structured_outputs"


def _general_walk(vocabulary, state):
    out = []
    _walk(vocabulary.trie, state, out)
    return tuple(sorted(out))


@pytest.fixture(scope="module")
def tag_vocabulary(token_bytes):
    """SmolLM2's single bytes, 3,000 of its other tokens, and tokens made to straddle a
    trigger: ending it, holding it whole, running from it into the begin or past an end."""
    rng = random.Random(11)
    singles = [data for data in token_bytes if data and len(data) == 1]
    longer = [data for data in token_bytes if data and len(data) > 1]
    made = [b"<tool_call>", b"<tool", b"_call", b"call>", b"l>", b">\n", b'>\n{"', b"<tool_call>\n", b'{"name": "',
            b'get_weather", "', b'arguments": {"', b"}}", b"}\n</tool_call>", b"</tool_call>", b"\n</", b"x<tool_call>",
            b"call><tool_call>", b'"}}\n</tool_call> ok', b"<<tool_", "é<tool_call>".encode(), b'call>\n{"name": "get_time',
            b"<think>", b"</think>", b"<think>\n", b"</think>\n\n", b"</", b"think>", b"ink> <tool_call>", b" <think>",
            None, b""]
    return Vocabulary(singles + rng.sample(longer, 3000) + made)


@pytest.mark.parametrize("reasoning", [None, "may_open", "inside"])
def test_masks_equal_the_general_walk_on_walks_steered_into_structures(tag_vocabulary, reasoning):
    """Walks that mostly take the token that goes furthest along a script of text and
    calls from where they left it (and otherwise any allowed token): at every state, the mask (free text's
    DFA fast path, the plain tokens that hold a trigger's last byte, the other tokens
    walked) equals the general walk of every token; also with a reasoning block."""
    vocab = tag_vocabulary
    g = structural_tag_grammar(CALLS if reasoning is None else {**CALLS, "reasoning": reasoning})
    guide = TokenGuide(g, vocab)
    scripts = [
        "Sure. " + WEATHER_CALL + " and then " + WEATHER_CALL.replace("Lyon", "Paris"),
        'x<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call> ok',
        "call><tool_call>\n" + '{"name": "get_time", "arguments": {}}\n</tool_call>',
        " <think>maybe <tool_call> now</think>\n\n" + WEATHER_CALL,
    ]
    rng = random.Random(3)
    entered = in_free_text = 0
    for trial in range(24):
        script = ("notes <tool_call> </think>" if reasoning == "inside" else "").encode() + scripts[trial % 4].encode()
        state, written, at = g.initial, b"", 0
        for _ in range(rng.randint(10, 50)):
            allowed = guide.allowed(state)
            assert allowed == _general_walk(vocab, state), (trial, written)
            if not allowed:
                break
            in_free_text += state[-1][0] == g.initial[-1][0] if type(state) is tuple else 0
            on_script = [t for t in allowed if script.startswith(vocab.token_bytes[t], at)]
            if on_script and rng.random() < 0.75:
                token = max(on_script, key=lambda t: len(vocab.token_bytes[t]))
                at += len(vocab.token_bytes[token])
            else:
                token = rng.choice(allowed)
            written += vocab.token_bytes[token]
            state = g.advance(state, vocab.token_bytes[token])
            entered += type(state) is not tuple or len(state) > 1
    assert entered > 100 and in_free_text > 100, (entered, in_free_text)


def test_free_text_masks_run_plain_tokens_through_the_dfa(vocabulary, monkeypatch):
    """In free text only the non-plain tokens and the plain ones that hold a trigger's last
    byte are walked (a few hundred of SmolLM2's 49,152); the mask equals the general walk."""
    from asyncgen import structured

    walked = []
    real_walk = structured._walk
    monkeypatch.setattr(structured, "_walk", lambda trie, state, out: (walked.append(trie), real_walk(trie, state, out)))
    g = structural_tag_grammar(CALLS)
    guide = TokenGuide(g, vocabulary)
    allowed = guide.allowed(g.initial)
    with_last_byte = vocabulary.plain_trie_with(frozenset(b">"))
    assert walked == [vocabulary.other_trie, with_last_byte]
    ids: list = []
    real_walk(with_last_byte, g.initial, ids)
    assert 0 < len(ids) < 1000 and all(b">" in vocabulary.token_bytes[i] for i in ids)
    monkeypatch.setattr(structured, "_walk", real_walk)
    assert allowed == _general_walk(vocabulary, g.initial)
    # after "<tool_call", a token may only go on with ">\n{" or stay text
    state = g.advance(g.initial, b"Hi <tool_call")
    after = guide.allowed(state)
    assert after == _general_walk(vocabulary, state)
    for i in after:
        data = vocabulary.token_bytes[i]
        assert not data.startswith(b">") or b'>\n{"name": "get_'.startswith(data[:16]) or data[:16].startswith(b'>\n{"name": "get_')


def test_params_and_openai_fields_carry_the_tag():
    params = SamplingParams(structured_outputs={"structural_tag": json.dumps(CALLS)}, max_tokens=8)
    assert params.structured_outputs.free_text and params.structured_outputs.structural_tag == CALLS
    # free text may be held open: ignore_eos and min_tokens are allowed here (not with a schema)
    SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=CALLS), ignore_eos=True, min_tokens=3)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(structured_outputs={"json": WEATHER}, min_tokens=3)
    with pytest.raises(ValidationError, match="exactly one of json, json_object, choice, regex, structural_tag"):
        StructuredOutputsParams(structural_tag=CALLS, regex="a")
    with pytest.raises(ValidationError, match=r"structures\[0\].schema"):
        StructuredOutputsParams(structural_tag={"triggers": ["<"], "structures": [
            {"begin": "<", "schema": {"not": {}}, "end": ">"}]})

    from asyncgen.openai.adapter import to_sampling_params
    from asyncgen.openai.errors import BadRequestError
    from asyncgen.openai.protocol import ChatCompletionRequest

    fmt = {"type": "structural_tag", "triggers": CALLS["triggers"], "structures": CALLS["structures"]}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], response_format=fmt)
    assert to_sampling_params(req).structured_outputs.structural_tag == fmt
    bad = {**fmt, "structures": [{"begin": "<x>", "schema": WEATHER, "end": ""}]}
    with pytest.raises(BadRequestError, match="starts with none of the triggers") as e:
        to_sampling_params(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 response_format=bad))
    assert e.value.param == "response_format"
