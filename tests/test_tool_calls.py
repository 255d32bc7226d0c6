"""Tool calling: the parsers of asyncgen.tools (streamed in any chunking they give what
the whole text gives, and read back the calls a random document was written with), the
schemas that force a call, the OpenAI layer's tools / tool_choice on SmolLM2 (forced calls
validate, streamed equals whole, auto calls read in the model's format), and the history's
tool calls reaching the chat template."""

from __future__ import annotations

import json
import random
import shutil
from typing import Literal

import anyio
import pytest
from pydantic import BaseModel, Field

from asyncgen import AsyncEngine
from asyncgen.engine.tokenizer import apply_chat_template
from asyncgen.errors import InvalidRequestError
from asyncgen.openai import BadRequestError
from asyncgen.openai.adapter import _template_messages
from asyncgen.openai.protocol import ChatCompletionRequest
from asyncgen.structured import json_schema_grammar, structural_tag_grammar
from asyncgen.tools import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    detect_tool_call_parser,
    get_tool_call_parser,
    parse_tool_calls,
    required_tools_schema,
)

NAMES = ["get_weather", "get_time", "search"]


# --- the parsers ---------------------------------------------------------------------------------
def _stream(parser, text: str, rng: random.Random | None) -> tuple[str, list[tuple[str, str]], list]:
    """Feeds ``text`` in random pieces (one piece without rng); the joined content, the
    calls as (name, arguments) joined from their pieces, and the pieces of tool calls."""
    pieces = [text]
    if rng is not None:
        pieces, i = [], 0
        while i < len(text):
            k = rng.choice([1, 1, 2, 3, 5, 8, 20])
            pieces.append(text[i:i + k])
            i += k
    content, calls, raw = "", {}, []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            raw.append(piece)
            if piece.id is not None:
                assert piece.index not in calls and piece.index == len(calls), "a call's first piece has its id"
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments
    return content, [tuple(c) for _, c in sorted(calls.items())], raw


def _random_string(rng: random.Random) -> str:
    alphabet = 'abc xyz{}[]",:\\/<>;\n\té😀' + "tool_call"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 3 else ["str", "int"])
    if kind == "str":
        return _random_string(rng)
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "float":
        return rng.uniform(-10, 10)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_random_string(rng) or "k": _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _dumps(value, rng: random.Random) -> str:
    if rng.random() < 0.3:
        return json.dumps(value, ensure_ascii=False, indent=rng.choice([None, 1, 2]))
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")]))


def _call_object(name: str, args: dict, key: str, rng: random.Random) -> str:
    parts = [f'"name": {json.dumps(name)}', f'"{key}": {_dumps(args, rng)}']
    if rng.random() < 0.2:
        parts.insert(rng.randint(0, 2), f'"extra": {_dumps(_random_value(rng), rng)}')  # skipped
    if rng.random() < 0.2:
        parts.reverse()  # arguments before the name
    return "{" + ", ".join(parts) + "}"


def _random_hermes(rng: random.Random) -> tuple[str, str, list]:
    """A hermes output with random content, calls and things that are not calls; the
    content and calls a reader should find."""
    text, content, calls = "", [], []
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(["text", "call", "call", "array", "not_json", "unknown", "lone_marker"])
        if kind == "text":
            t = rng.choice(["Sure.", "a < b and {x}", "<tool", "JSON: {\"name\": 1}", "done"]) + rng.choice(["", " "])
            text += t
            content.append(t)
        elif kind in ("call", "array"):
            group = []
            for _ in range(1 if kind == "call" else rng.randint(1, 3)):
                name, args = rng.choice(NAMES), {"q": _random_value(rng), "n": rng.randint(0, 9)}
                group.append(_call_object(name, args, "arguments", rng))
                calls.append((name, args))
            body = group[0] if kind == "call" else "[" + ", ".join(group) + "]"
            text += rng.choice(["", "\n"]) + "<tool_call>" + rng.choice(["", "\n"]) + body + rng.choice(["", "\n"]) + "</tool_call>"
            text += rng.choice(["", "\n"])
        elif kind == "not_json":
            t = "<tool_call>not a call</tool_call>"
            text += t
            content.append(t)
        elif kind == "unknown":
            t = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
            text += t
            content.append(t)
        else:
            t = "<tool_call> is how I call tools"
            text += t
            content.append(t)
    return text, content, calls


def _squash(s: str) -> str:
    return "".join(s.split())


@pytest.mark.parametrize("seed", range(40))
def test_hermes_reads_random_outputs_the_same_in_any_chunking(seed):
    rng = random.Random(seed)
    cls = get_tool_call_parser("hermes")
    for _ in range(10):
        text, want_content, want_calls = _random_hermes(rng)
        whole = _stream(cls(NAMES), text, None)
        content, calls, _ = whole
        assert [(n, json.loads(a)) for n, a in calls] == [(n, a) for n, a in want_calls], text
        # content: the text around the calls, less only the whitespace next to calls
        assert _squash(content) == _squash("".join(want_content)), text
        for _ in range(5):
            assert _stream(cls(NAMES), text, rng)[:2] == whole[:2], text
        # the same output cut off anywhere: chunking still does not matter, and what was
        # read so far never changes (a call sent is not taken back)
        cut = text[:rng.randint(0, len(text))]
        part = _stream(cls(NAMES), cut, None)
        assert _stream(cls(NAMES), cut, rng)[:2] == part[:2]
        sent = [(n, a) for n, a in part[1]]
        for (n, a), (wn, wa) in zip(sent, calls):
            assert n == wn and wa.startswith(a)
        # damaged anywhere, in every format: chunking does not matter, and text read as
        # no call at all comes back whole as content
        k = rng.randint(0, len(text))
        bent = text[:k] + rng.choice(["}", "{", '"', "<tool_call>", "</tool_call>", "]", ";", "\\"]) + text[k:]
        for other in ("hermes", "llama3_json", "mistral"):
            whole = _stream(get_tool_call_parser(other)(NAMES), bent, None)
            assert _stream(get_tool_call_parser(other)(NAMES), bent, rng)[:2] == whole[:2], (other, bent)
            if not whole[1]:
                assert whole[0] == bent


@pytest.mark.parametrize("parser,key,render", [
    ("llama3_json", "parameters", lambda objs: "; ".join(objs)),
    ("mistral", "arguments", lambda objs: "[TOOL_CALLS] [" + ", ".join(objs) + "]"),
    ("required", "parameters", lambda objs: "[" + ", ".join(objs) + "]"),
])
@pytest.mark.parametrize("seed", range(10))
def test_the_other_formats_read_random_calls_in_any_chunking(parser, key, render, seed):
    rng = random.Random(seed)
    cls = RequiredToolCallsParser if parser == "required" else get_tool_call_parser(parser)
    for _ in range(10):
        want = [(rng.choice(NAMES), {"a": _random_value(rng)}) for _ in range(rng.randint(1, 3))]
        text = render([_call_object(n, a, key, rng) for n, a in want])
        if parser == "llama3_json" and rng.random() < 0.3:
            text = "<|python_tag|>" + text
        whole = _stream(cls(NAMES), text, None)
        assert whole[0] == ""
        assert [(n, json.loads(a)) for n, a in whole[1]] == want
        for _ in range(3):
            assert _stream(cls(NAMES), text, rng)[:2] == whole[:2]


@pytest.mark.parametrize("seed", range(10))
def test_max_calls_ends_the_reply_with_its_calls_in_any_chunking(seed):
    """With max_calls=k the calls are the first k the whole text holds, the content is
    the text before the k-th (a prefix of the whole content), and the chunking does not
    matter; the parser has ended exactly where the text holds k calls."""
    rng = random.Random(seed)
    for name, make in [("hermes", lambda: _random_hermes(rng)[0]),
                       ("llama3_json", lambda: "; ".join(_call_object(rng.choice(NAMES), {"a": _random_value(rng)},
                                                                      "parameters", rng) for _ in range(3))),
                       ("mistral", lambda: "[TOOL_CALLS][" + ", ".join(
                           _call_object(rng.choice(NAMES), {"a": _random_value(rng)}, "arguments", rng)
                           for _ in range(3)) + "]")]:
        cls = get_tool_call_parser(name)
        for _ in range(8):
            text = make()
            content, calls, _ = _stream(cls(NAMES), text, None)
            for k in (1, 2):
                parser = cls(NAMES, max_calls=k)
                got = _stream(parser, text, None)
                assert got[1] == calls[:k] and content.startswith(got[0]), (name, k, text)
                assert parser.ended == (len(calls) >= k)
                for _ in range(3):
                    assert _stream(cls(NAMES, max_calls=k), text, rng)[:2] == got[:2], (name, k, text)
    with pytest.raises(ValueError, match="max_calls"):
        get_tool_call_parser("hermes")(NAMES, max_calls=0)


def test_max_calls_keeps_the_text_before_the_call_and_drops_the_rest():
    hermes = get_tool_call_parser("hermes")(NAMES, max_calls=1)
    text = ('Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and more')
    first = hermes.feed(text[:60])
    assert first.content == "Checking." and not hermes.ended
    rest = hermes.feed(text[60:])
    assert hermes.ended and rest.content == "" and [p.index for p in rest.tool_calls] == [0]
    assert hermes.feed("ignored <tool_call>") == hermes.finish() == type(rest)()
    assert [(c.name, c.arguments) for c in hermes.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    # a call that broke off after it went out is the reply's call too
    broken = get_tool_call_parser("hermes")(NAMES, max_calls=1)
    content, calls = parse_tool_calls(broken, '<tool_call>{"name": "search", "arguments": {"q": 1} oops '
                                              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert broken.ended and content == "" and [(c.name, c.arguments) for c in calls] == [("search", '{"q": 1}')]


def test_what_is_not_a_call_is_content_and_nothing_is_dropped():
    hermes = get_tool_call_parser("hermes")
    for text in ["<tool_call>not json</tool_call> after", 'Use <tool_call>{"name": "nope", "arguments": {}}</tool_call>',
                 "a <tool_cal", "plain text\n\n", "<tool_call>", '<tool_call>{"arguments": {}}</tool_call>']:
        assert parse_tool_calls(hermes(NAMES), text) == (text, [])
    llama = get_tool_call_parser("llama3_json")
    for text in ['{"answer": 42} is JSON', "  Plain answer.  ", '{"name": "Bob", "age": 3}']:
        assert parse_tool_calls(llama(NAMES), text) == (text, [])
    # with no names given, any name is a call
    assert parse_tool_calls(llama(), '{"name": "Bob", "parameters": {"age": 3}}')[1][0].name == "Bob"


def test_a_call_cut_off_keeps_what_was_sent_and_text_after_a_broken_call_is_content():
    hermes = get_tool_call_parser("hermes")
    content, calls = parse_tool_calls(hermes(NAMES), 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "Checking." and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]
    content, calls = parse_tool_calls(hermes(NAMES), '<tool_call>{"name": "search", "arguments": {"q": 1} oops')
    assert content == "oops" and calls[0].arguments == '{"q": 1}'
    content, calls = parse_tool_calls(hermes(NAMES), '<tool_call>{"name": "search", "arguments": {}}\n</tool_')
    assert content == "" and calls[0].arguments == "{}"  # a closing marker cut off is layout
    # no arguments at all, arguments written as a JSON string, and whitespace around calls
    content, calls = parse_tool_calls(
        hermes(NAMES), '<tool_call>{"name": "get_time"}</tool_call>\n\n<tool_call>{"name": "search", '
        '"arguments": "{\\"q\\": \\"x\\"}"}</tool_call>\n')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", "{}"), ("search", '{"q": "x"}')]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_named_parser_sends_the_header_first_then_every_piece_as_arguments():
    p = NamedToolCallParser("get_time")
    first = p.feed("")
    assert first.tool_calls[0].id and first.tool_calls[0].name == "get_time" and first.tool_calls[0].arguments == ""
    assert p.feed('{"tz"').tool_calls[0].arguments == '{"tz"'
    p.feed(': "CET"}')
    assert not p.finish()
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("get_time", '{"tz": "CET"}')]
    assert NamedToolCallParser("f").finish().tool_calls[0].name == "f"  # even with no text at all


def test_detect_parser_from_chat_template_markers_and_unknown_names():
    assert detect_tool_call_parser("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert detect_tool_call_parser("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert detect_tool_call_parser("<|start_header_id|>ipython ... <|python_tag|>") == "llama3_json"
    assert detect_tool_call_parser("<|im_start|>{{ message.content }}") is None
    assert detect_tool_call_parser(None) is None
    with pytest.raises(InvalidRequestError, match="unknown tool call parser 'nope'"):
        get_tool_call_parser("nope")


def test_required_schema_admits_calls_to_the_functions_only():
    functions = [
        {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                               "required": ["city"]}},
        {"name": "get_time"},  # no parameters: {} only
    ]

    def accepts(schema, text: str) -> bool:
        g = json_schema_grammar(schema)
        state = g.advance(g.initial, text.encode())
        return state is not None and g.accepts(state)

    schema = required_tools_schema(functions)
    assert accepts(schema, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]')
    assert not accepts(schema, "[]")
    assert not accepts(schema, '[{"name": "rm", "parameters": {}}]')
    assert not accepts(schema, '[{"name": "get_time", "parameters": {"x": 1}}]')
    assert not accepts(schema, '[{"name": "get_weather", "parameters": {}}]')
    one = required_tools_schema(functions, parallel=False)
    assert accepts(one, '[{"name": "get_time", "parameters": {}}]')
    assert not accepts(one, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')


# --- the OpenAI layer: requests --------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                                                    "required": ["tz"]}},
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


class Weather(BaseModel):
    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class Time(BaseModel):
    tz: str = Field(max_length=12)


ARGS = {"get_weather": Weather, "get_time": Time}


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": ASK, **fields})


def test_request_checks_name_the_field():
    cases = [
        ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "used by an earlier tool"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "x"}}]}}}, "tool_choice", "'x'"),
    ]
    for fields, param, words in cases:
        with pytest.raises(BadRequestError, match=words) as e:
            _request(**fields)
        assert e.value.param == param
    refused = [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages[0].role"),
    ]
    for fields, param in refused:
        with pytest.raises(BadRequestError) as e:
            _request(**fields).check_supported()
        assert e.value.param == param
    # malformed tools and choices: the error names the field, past the union's tag
    from asyncgen.openai.adapter import _parse

    malformed = [
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "x", "tools": []}}},
         "tool_choice.allowed_tools.mode"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ]
    for fields, param in malformed:
        with pytest.raises(BadRequestError) as e:
            _parse(ChatCompletionRequest, {"model": "m", "messages": ASK, **fields})
        assert e.value.param == param
    r = _request(tools=TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}})
    assert r.tool_mode == "auto" and [f.name for f in r.offered_functions] == ["get_time"]
    assert _request(tools=TOOLS).tool_mode == "auto" and _request(tools=TOOLS, tool_choice="none").tool_mode is None


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions. Write a call as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for call in message.tool_calls %}<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory, smollm2_path):
    """SmolLM2's weights with a chat template that shows tools and writes hermes calls."""
    d = tmp_path_factory.mktemp("smollm2-hermes")
    for f in smollm2_path.iterdir():
        if f.name != "chat_template.jinja":
            (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return d


def test_history_tool_calls_and_tool_messages_reach_the_template(hermes_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes_model)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    req = _request(messages=history, tools=TOOLS)
    req.check_supported()
    prompt = apply_chat_template(tok, _template_messages(req), None, [t.model_dump(exclude_none=True) for t in req.tools])
    assert '"name": "get_time"' in prompt  # the tools are shown
    call = json.loads(prompt.split("<tool_call>")[-1].split("</tool_call>")[0])
    assert call == {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}  # a dict, not a string
    assert "<|im_start|>tool\n18 degrees, sunny<|im_end|>" in prompt


# --- the OpenAI layer on SmolLM2 -----------------------------------------------------------------
@pytest.fixture
def anyio_backend():
    return "asyncio"  # (the OpenAI layer runs on trio too: tests/test_openai_client.py)


def _joined_stream_calls(chunks) -> tuple[str, list[tuple[str, str]], list]:
    content, calls, finish = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            for piece in d.tool_calls or ():
                if piece.id is not None:
                    assert piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                else:
                    assert piece.function.name is None
                calls[piece.index][2] += piece.function.arguments or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return content, [tuple(c[1:]) for _, c in sorted(calls.items())], finish


async def _stream_all(client, **kw):
    stream = await client.chat.completions.create(stream=True, **kw)
    return [c async for c in stream]


@pytest.mark.anyio
async def test_forced_calls_validate_and_stream_as_they_are_returned(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, max_num_seqs=8, num_kv_blocks=256) as engine:
        client = engine.openai_client()
        kw = dict(model=client.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=160)
        for choice, parallel in (("required", None), ("required", False),
                                 ({"type": "function", "function": {"name": "get_weather"}}, None)):
            extra = {} if parallel is None else {"parallel_tool_calls": parallel}
            whole = await client.chat.completions.create(tool_choice=choice, **kw, **extra)
            c = whole.choices[0]
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
            assert calls and c.message.content is None
            for name, args in calls:
                ARGS[name].model_validate_json(args)  # the schema held
            if choice == "required":
                assert c.finish_reason == "tool_calls"
                if parallel is False:
                    assert len(calls) == 1
            else:
                assert c.finish_reason == "stop" and [n for n, _ in calls] == ["get_weather"]
            streamed = _joined_stream_calls(await _stream_all(client, tool_choice=choice, **kw, **extra))
            assert streamed == ("", calls, [c.finish_reason])
        # n > 1 sampled: every choice is read on its own
        resp = await client.chat.completions.create(tool_choice="required", n=3, seed=5, **{**kw, "temperature": 1.0})
        for c in resp.choices:
            for t in c.message.tool_calls:
                ARGS[t.function.name].model_validate_json(t.function.arguments)
        # a forced call's parameters must be enforceable; the error names the tool
        bad = {"type": "function", "function": {"name": "zip", "parameters": {
            "type": "object", "properties": {"z": {"type": "integer", "minimum": 10000}}}}}
        with pytest.raises(BadRequestError, match="minimum") as e:
            await client.chat.completions.create(tool_choice="required", **{**kw, "tools": [WEATHER, bad]})
        assert e.value.param == "tools[1].function.parameters"
        # SmolLM2's own template writes no tool calls: auto needs a parser named
        with pytest.raises(BadRequestError, match="tool_call_parser") as e:
            await client.chat.completions.create(**kw)
        assert e.value.param == "tool_choice"
        # tool_choice none: a plain reply
        plain = await client.chat.completions.create(tool_choice="none", **kw)
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.anyio
async def test_auto_reads_calls_in_the_models_format(hermes_model):
    """The template is detected as hermes; the reply is forced (structured outputs'
    choice) to text the parser must split, streamed and whole."""
    reply = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    async with AsyncEngine.from_pretrained(hermes_model, max_num_seqs=4, num_kv_blocks=128) as engine:
        client = engine.openai_client()
        assert client.adapter.tool_call_parser == "hermes"
        kw = dict(model=client.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                  extra_body={"structured_outputs": {"choice": [reply]}})
        whole = await client.chat.completions.create(**kw)
        c = whole.choices[0]
        assert c.message.content == "Let me look that up."
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"tz": "CET"}')]
        assert c.finish_reason == "tool_calls"
        assert _joined_stream_calls(await _stream_all(client, **kw)) == (c.message.content, calls, ["tool_calls"])
        # cut off by max_tokens: "length"; a call whose name was read keeps what it has,
        # text that had not become a call yet is content
        cuts = {}

        async def cut(max_tokens: int) -> None:
            cuts[max_tokens] = (await client.chat.completions.create(**{**kw, "max_tokens": max_tokens})).choices[0]

        async with anyio.create_task_group() as tg:
            for max_tokens in range(12, 40, 3):
                tg.start_soon(cut, max_tokens)
        cut_calls = 0
        for s in cuts.values():
            assert s.finish_reason == "length"
            if s.message.tool_calls:
                cut_calls += 1
                assert s.message.content == "Let me look that up." and s.message.tool_calls[0].function.name == "get_weather"
                assert '{"city": "Paris", "unit": "celsius"}'.startswith(s.message.tool_calls[0].function.arguments)
            else:
                assert reply.startswith(s.message.content) and len(s.message.content) > len("Let me look that up.")
        assert 0 < cut_calls < 10
        # unconstrained, this reply has no calls: its content is the text, whitespace and all
        free = await client.chat.completions.create(model=client.model, messages=ASK, tools=TOOLS, max_tokens=40, seed=1)
        text = (await engine.generate(messages=_template_messages(_request(tools=TOOLS)), tools=TOOLS,
                                      params=_params(max_tokens=40, seed=1))).text
        assert free.choices[0].message.content == text and free.choices[0].message.tool_calls is None


@pytest.mark.anyio
async def test_auto_with_parallel_tool_calls_false_ends_with_the_first_call(hermes_model):
    """The reply holds two calls; with parallel_tool_calls=false it ends with the first,
    whole and streamed, and the request stops generating there (fewer tokens)."""
    reply = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n</tool_call>')
    async with AsyncEngine.from_pretrained(hermes_model, max_num_seqs=4, num_kv_blocks=128) as engine:
        client = engine.openai_client()
        kw = dict(model=client.model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
                  extra_body={"structured_outputs": {"choice": [reply]}})
        full = await client.chat.completions.create(**kw)
        assert len(full.choices[0].message.tool_calls) == 3
        one = await client.chat.completions.create(parallel_tool_calls=False, **kw)
        c = one.choices[0]
        first = [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
        assert c.message.content == "Let me look that up." and c.finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == first
        # stopped at the first call: the two calls after it (over 40 tokens) were not generated
        assert one.usage.completion_tokens < full.usage.completion_tokens - 30
        chunks = await _stream_all(client, parallel_tool_calls=False, stream_options={"include_usage": True}, **kw)
        assert _joined_stream_calls(chunks) == ("Let me look that up.", first, ["tool_calls"])
        assert chunks[-1].usage.completion_tokens < full.usage.completion_tokens - 30
        # n = 2: each choice ends with its own first call; the request stops once both have
        two = await client.chat.completions.create(parallel_tool_calls=False, n=2, **kw)
        assert [(c.finish_reason, len(c.message.tool_calls)) for c in two.choices] == [("tool_calls", 1)] * 2
        assert two.usage.completion_tokens < 2 * full.usage.completion_tokens - 60
        streamed = await _stream_all(client, parallel_tool_calls=False, n=2, **kw)
        assert sorted(ch.index for k in streamed for ch in k.choices if ch.finish_reason) == [0, 1]
        # a reply with no call ends as usual
        plain = await client.chat.completions.create(**{**kw, "extra_body": {"structured_outputs": {"choice": ["No."]}}},
                                                     parallel_tool_calls=False)
        assert plain.choices[0].message.content == "No." and plain.choices[0].finish_reason == "stop"
        # a call inside a reasoning block is not the reply's: the answer's first call is
        thinking = engine.openai_client(reasoning_parser="think")
        thought = ('<think>\nMaybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call> first.\n</think>\n\n'
                   + reply.split("\n", 1)[1])
        for stream in (False, True):
            got = await thinking.chat.completions.create(
                stream=stream, parallel_tool_calls=False, **{**kw, "extra_body": {"structured_outputs": {"choice": [thought]}}})
            if stream:
                got = [k async for k in got]
                reasoning = "".join(ch.delta.reasoning_content or "" for k in got for ch in k.choices)
                assert _joined_stream_calls(got) == ("", first, ["tool_calls"])
            else:
                msg = got.choices[0].message
                reasoning = msg.reasoning_content
                assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == first
                assert got.choices[0].finish_reason == "tool_calls" and msg.content is None
            assert "get_time" in reasoning
        assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


# A conversation in which the model has called get_weather before: SmolLM2 then often
# writes a call of its own.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris, in celsius?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 degrees"},
    {"role": "assistant", "content": "It is 18 degrees in Paris."},
    {"role": "user", "content": "And what is the weather in Lyon, in celsius?"},
]


def _valid_call(name: str, arguments: str) -> bool:
    """Whether a call names an offered function and its arguments satisfy its schema."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    if name == "get_weather":
        return (list(args) == ["city", "unit"] and isinstance(args["city"], str) and len(args["city"]) <= 24
                and args["unit"] in ("celsius", "fahrenheit"))
    return name == "get_time" and list(args) == ["tz"] and isinstance(args["tz"], str) and len(args["tz"]) <= 12


@pytest.mark.anyio
async def test_auto_with_strict_functions_writes_only_valid_calls(hermes_model):
    """Sampled hot, SmolLM2's unconstrained calls break (unknown names, arguments off the
    schema, left as content); with ``strict`` the same requests write only calls that name
    an offered function with valid arguments, around free text, whole and streamed."""
    def strict(on: bool):
        return [{**t, "function": {**t["function"], "strict": on}} for t in TOOLS]

    async with AsyncEngine.from_pretrained(hermes_model, max_num_seqs=8, num_kv_blocks=256) as engine:
        client = engine.openai_client()
        kw = dict(model=client.model, messages=FEW_SHOT, max_tokens=40, temperature=1.3, seed=5, n=8)
        loose = (await client.chat.completions.create(tools=strict(False), **kw)).choices
        broken = [c for c in loose if "<tool_call>" in (c.message.content or "")]
        invalid = [t for c in loose for t in c.message.tool_calls or () if not _valid_call(t.function.name, t.function.arguments)]
        assert broken or invalid  # what strict rules out happens here
        enforced = (await client.chat.completions.create(tools=strict(True), **kw)).choices
        calls = [(t.function.name, t.function.arguments) for c in enforced for t in c.message.tool_calls or ()]
        assert calls and all(_valid_call(*call) for call in calls), calls
        for c in enforced:
            # a call the model opened is always read, unless max_tokens cut it off
            assert "<tool_call>" not in (c.message.content or "") or c.finish_reason == "length"
            assert c.finish_reason == ("tool_calls" if c.message.tool_calls else c.finish_reason)
        chunks = await _stream_all(client, tools=strict(True), **{**kw, "n": 1, "seed": 7})
        content, streamed, finish = _joined_stream_calls(chunks)
        assert all(_valid_call(*call) for call in streamed)
        whole = (await client.chat.completions.create(tools=strict(True), **{**kw, "n": 1, "seed": 7})).choices[0]
        assert streamed == [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or ()]
        # a strict function's schema must be enforceable; a loose one's is read as written
        odd = [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "integer", "minimum": 1}}}]
        with pytest.raises(BadRequestError, match="minimum") as e:
            await client.chat.completions.create(tools=[{**odd[0], "function": {**odd[0]["function"], "strict": True}}],
                                                 **{**kw, "n": 1})
        assert e.value.param == "tools[0].function.parameters"
        await client.chat.completions.create(tools=odd, **{**kw, "n": 1, "max_tokens": 4})
        # the Responses API passes a function's strict on: its function_call items are valid too
        history = [FEW_SHOT[0], {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                 "arguments": FEW_SHOT[1]["tool_calls"][0]["function"]["arguments"]},
                   {"type": "function_call_output", "call_id": "c1", "output": "18 degrees"}, *FEW_SHOT[3:]]
        tools = [{"type": "function", **t["function"], "strict": True} for t in TOOLS]
        items = []

        async def respond(seed: int) -> None:
            r = await client.responses.create(model=client.model, input=history, tools=tools, temperature=1.3,
                                              max_output_tokens=40, extra_body={"seed": seed})
            items.extend((o.name, o.arguments) for o in r.output if o.type == "function_call")

        async with anyio.create_task_group() as tg:
            for seed in range(4):
                tg.start_soon(respond, seed)
        assert items and all(_valid_call(*item) for item in items), items
        assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


@pytest.mark.anyio
async def test_strict_calls_leave_a_reasoning_block_free(hermes_model):
    """With a reasoning parser the strict calls' tag leaves the <think> block free: one
    the output may open, or, when the prompt ends inside one, the rest of it."""
    from asyncgen import SamplingParams

    async with AsyncEngine.from_pretrained(hermes_model, max_num_seqs=4, num_kv_blocks=128) as engine:
        strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]

        def tag(adapter, **fields):
            req = _request(tools=strict, **fields)
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            return adapter._strict_calls(req, SamplingParams(), _template_messages(req), tools).structured_outputs.structural_tag

        thinking = engine.openai_client(reasoning_parser="think").adapter
        opens = tag(thinking)
        assert opens["reasoning"] == "may_open"
        begun = [*ASK, {"role": "assistant", "content": "<think>\nI may write <tool_call> here"}]
        inside = tag(thinking, messages=begun, continue_final_message=True)
        assert inside["reasoning"] == "inside"
        assert "reasoning" not in tag(engine.openai_client(reasoning_parser=None).adapter)
        # what each lets through: a <tool_call> in the block is text; after it, a call
        for spec, free in ((opens, "<think>I call <tool_call> x</think>"), (inside, "I call <tool_call> x</think>")):
            g = structural_tag_grammar(spec)
            assert g.advance(g.initial, free.encode()) is not None
            assert g.advance(g.initial, (free + "<tool_call> x").encode()) is None
        g = structural_tag_grammar(opens)
        assert g.advance(g.initial, b"<tool_call> x") is None  # no block: watched from the start


@pytest.mark.anyio
async def test_a_structural_tag_leaves_free_text_as_the_model_writes_it(hermes_model):
    """Greedy, the reply to ASK opens no call: under the strict calls' structural tag its
    tokens are the unconstrained ones (free text is not constrained, and the mask of the
    end-of-turn token is the model's)."""
    from asyncgen.tools import strict_tool_call_tag

    tag = strict_tool_call_tag("hermes", [{**t["function"], "strict": True} for t in TOOLS])
    async with AsyncEngine.from_pretrained(hermes_model, max_num_seqs=4, num_kv_blocks=128) as engine:
        messages = _template_messages(_request(tools=TOOLS))
        free = await engine.generate(messages=messages, tools=TOOLS, params=_params(max_tokens=48, temperature=0))
        tagged = await engine.generate(messages=messages, tools=TOOLS, params=_params(
            max_tokens=48, temperature=0, structured_outputs={"structural_tag": tag}))
        assert "<tool_call>" not in free.text and len(free.token_ids) > 8
        assert tagged.token_ids == free.token_ids and tagged.finish_reason == free.finish_reason


def _params(**kw):
    from asyncgen import SamplingParams

    return SamplingParams(**kw)


def test_engine_tools_apply_to_messages_only(smollm2_path):
    async def main():
        async with AsyncEngine.from_pretrained(smollm2_path, max_num_seqs=2, num_kv_blocks=64) as engine:
            with pytest.raises(InvalidRequestError, match="tools apply to 'messages' only"):
                engine.stream("hi", tools=TOOLS)
            with pytest.raises(InvalidRequestError, match="tools must be a list of dicts"):
                engine.stream(messages=ASK, tools="get_weather")

    anyio.run(main)


# A template in the Mistral format that, as Mistral's own do, refuses call ids that are not
# 9 letters and digits when a call or a tool result comes back in the history.
MISTRAL_TEMPLATE = r"""{{- bos_token -}}
{%- for m in messages -%}
{%- if m.role == "user" -%}
{%- if tools -%}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}
[INST] {{ m.content }}[/INST]
{%- elif m.tool_calls -%}
[TOOL_CALLS] [
{%- for c in m.tool_calls -%}
{%- if c.id | length != 9 or not c.id.isalnum() -%}{{ raise_exception("call ids must be 9 letters and digits") }}{%- endif -%}
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}, "id": "{{ c.id }}"}
{%- if not loop.last %}, {% endif -%}
{%- endfor -%}]{{ eos_token }}
{%- elif m.role == "tool" -%}
{%- if m.tool_call_id | length != 9 -%}{{ raise_exception("call ids must be 9 letters and digits") }}{%- endif -%}
[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif m.role == "assistant" -%}
{{ m.content }}{{ eos_token }}
{%- endif -%}
{%- endfor -%}"""


@pytest.mark.anyio
async def test_mistral_call_ids_are_ones_its_template_takes_back(tmp_path, smollm2_path):
    """Calls read in the Mistral format, or forced (required, named), get 9-character ids,
    and the conversation goes on with the call and its result in the history."""
    import re

    d = tmp_path / "smollm2-mistral"
    d.mkdir()
    for f in smollm2_path.iterdir():
        if f.name != "chat_template.jinja":
            (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    reply = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    async with AsyncEngine.from_pretrained(d, max_model_len=1024, num_kv_blocks=128) as engine:
        client = engine.openai_client()
        assert client.adapter.tool_call_parser == "mistral"
        weather = [t for t in TOOLS if t["function"]["name"] == "get_weather"]
        kw = dict(model=client.model, tools=weather, temperature=0, max_tokens=40)
        forced = {"structured_outputs": {"choice": [reply]}, "skip_special_tokens": False}
        for extra in ({"tool_choice": "auto", "extra_body": forced}, {"tool_choice": "required"},
                      {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
            out = await client.chat.completions.create(messages=ASK, **kw, **extra)
            message = out.choices[0].message
            [call] = message.tool_calls
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id), call.id
            history = ASK + [message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
            after = await client.chat.completions.create(messages=history, model=client.model, max_tokens=2)
            assert after.choices[0].message.content is not None
