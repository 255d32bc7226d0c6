"""OpenAI's Responses API over the chat layer: the request's translation into chat messages
and fields, refused fields naming themselves, the event stream built from chat chunks
(checked against the official SDK's types), and on SmolLM2 the output against the chat
completion it is made from, function calls and their round trip through the history,
structured text formats, reasoning, a token limit, and an early close freeing the blocks."""

from __future__ import annotations

import json

import anyio
import pytest

from conftest import assert_idle
from asyncgen import AsyncEngine
from asyncgen.openai import (
    APIStatusError,
    AsyncStream,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    Response,
    ResponseCreateRequest,
    create_response,
    response_sse_stream,
)
from asyncgen.openai.protocol import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionRequest,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    CompletionUsage,
    Function,
)

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def sdk_check(obj, kind: str = "response"):
    """Validates ``obj``'s JSON with the official SDK's types (strict pydantic validation),
    when the SDK is installed; returns the SDK's object."""
    try:
        from openai.types.responses import Response as SDKResponse
        from openai.types.responses import ResponseStreamEvent as SDKEvent
    except ImportError:
        return None
    from pydantic import TypeAdapter

    data = json.loads(obj.model_dump_json())
    return SDKResponse.model_validate(data) if kind == "response" else TypeAdapter(SDKEvent).validate_python(data)


# --- the translation, without an engine ---------------------------------------------------------------
def test_input_items_become_chat_messages():
    req = ResponseCreateRequest.model_validate({
        "model": "m", "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}",
             "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "one"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
            {"type": "function_call", "call_id": "call_3", "name": "f", "arguments": "{}"},
        ],
    })
    assert req.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    ChatCompletionRequest.model_validate(req.chat_request())  # what the chat layer gets is a valid request


def test_fields_become_the_chat_requests():
    req = ResponseCreateRequest.model_validate({
        "model": "m", "input": "Hi", "max_output_tokens": 20, "temperature": 0.5, "top_p": 0.9,
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "metadata": {"k": "v"}, "store": True, "user": "u", "safety_identifier": "s", "prompt_cache_key": "p",
        "service_tier": "auto", "truncation": "disabled", "include": [], "top_logprobs": 0,
        "reasoning": {"summary": "auto"}, "top_k": 5, "seed": 3,
    })
    chat = req.chat_request()
    assert chat == {
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": False, "max_completion_tokens": 20,
        "temperature": 0.5, "top_p": 0.9, "parallel_tool_calls": False, "top_k": 5, "seed": 3,
        "tools": [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters",
                                                                              "strict")}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]}
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    chat = ResponseCreateRequest.model_validate({"model": "m", "input": "Hi", "tools": [WEATHER], "tool_choice": allowed,
                                                 "text": {"format": fmt}, "stream": True}).chat_request()
    assert chat["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True}}
    assert chat["stream_options"] == {"include_usage": True}  # the usage of the last event
    ChatCompletionRequest.model_validate(chat)


REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text",
     "missing_required_parameter"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     "missing_required_parameter"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "missing_required_parameter"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"colour": "red"}, "colour", "unknown_parameter"),
    # JSON types are not coerced: 4.0 is not an integer, "1" not a number, 1 not a boolean
    ({"max_output_tokens": 4.0}, "max_output_tokens", "invalid_type"),
    ({"temperature": "1"}, "temperature", "invalid_type"),
    ({"stream": 1}, "stream", "invalid_type"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict", "invalid_type"),
    ({"input": [{"role": "user", "content": []}]}, "input[0].content", "invalid_value"),
]


@pytest.mark.parametrize("fields, param, code", REFUSED, ids=[p for _, p, _ in REFUSED])
async def test_refused_fields_name_the_param(fields, param, code):
    class NoChat:
        async def create_chat_completion(self, body):
            raise AssertionError("refused before the chat layer")

    with pytest.raises(BadRequestError) as e:
        await create_response(NoChat(), {"model": "m", "input": "Hi", **fields})
    assert (e.value.param, e.value.code, e.value.status_code) == (param, code, 400)


# --- events from chat chunks, without an engine ----------------------------------------------------------
class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


class _Engine:
    tokenizer = _Tokenizer()


class ScriptedChat:
    """An adapter whose chat completions are scripted: a whole message, or these chunks."""

    engine = _Engine()

    def __init__(self, message=None, finish_reason="stop", chunks=(), fail_after=None):
        self.message, self.finish_reason, self.chunks, self.fail_after = message, finish_reason, chunks, fail_after
        self.closed = False
        self.body = None

    async def create_chat_completion(self, body):
        self.body = body
        if not body.get("stream"):
            return ChatCompletion(id="c", created=0, model=body["model"], choices=[ChatCompletionChoice(
                index=0, message=self.message, finish_reason=self.finish_reason)],
                usage=CompletionUsage(prompt_tokens=5, completion_tokens=9, total_tokens=14))

        async def chunks():
            try:
                for i, c in enumerate(self.chunks):
                    if i == self.fail_after:
                        raise InternalServerError("The engine stopped: boom")
                    yield c
            finally:
                self.closed = True

        return AsyncStream(chunks())


def _chunk(delta=None, finish=None, usage=None):
    choices = [] if delta is None and finish is None else [
        ChatCompletionChunkChoice(index=0, delta=delta or ChoiceDelta(), finish_reason=finish)]
    return ChatCompletionChunk(id="c", created=0, model="m", choices=choices, usage=usage)


def _call_piece(id=None, name=None, arguments=None):
    return ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(index=0, id=id, type="function" if id else None,
                                                       function=ChoiceDeltaToolCallFunction(name=name,
                                                                                            arguments=arguments))])


SCRIPT = [
    _chunk(ChoiceDelta(role="assistant", content="")),
    _chunk(ChoiceDelta(reasoning_content="Two ")), _chunk(ChoiceDelta(reasoning_content="steps.")),
    _chunk(ChoiceDelta(content="Sure")), _chunk(ChoiceDelta(content=".")),
    _chunk(_call_piece("call_1", "get_weather", "")), _chunk(_call_piece(arguments='{"city": ')),
    _chunk(_call_piece(arguments='"Oslo"}')),
    _chunk(finish="tool_calls"), _chunk(usage=CompletionUsage(prompt_tokens=5, completion_tokens=9, total_tokens=14)),
]
MESSAGE = ChatCompletionMessage(
    content="Sure.", reasoning_content="Two steps.",
    tool_calls=[ChatCompletionMessageToolCall(id="call_1", function=Function(name="get_weather",
                                                                             arguments='{"city": "Oslo"}'))],
)


async def test_output_items_and_events_from_the_chat_layer():
    chat = ScriptedChat(MESSAGE, "tool_calls", SCRIPT)
    whole = await create_response(chat, {"model": "m", "input": "Hi", "tools": [WEATHER]})
    assert isinstance(whole, Response) and whole.id.startswith("resp_") and whole.status == "completed"
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "Two steps." and whole.output[0].summary == []
    assert whole.output_text == "Sure." and whole.output[2].call_id == "call_1"
    assert whole.usage.output_tokens_details.reasoning_tokens == 2 and whole.usage.total_tokens == 14
    assert whole.tools == [WEATHER] and whole.tool_choice == "auto"
    if sdk_check(whole) is not None:
        assert sdk_check(whole).output_text == "Sure."

    stream = await create_response(chat, {"model": "m", "input": "Hi", "tools": [WEATHER], "stream": True})
    events = [e async for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]
    for e in events:
        sdk_check(e, "event")
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.status, getattr(i, "content", None)) for i in added] == [
        ("in_progress", []), ("in_progress", []), ("in_progress", None)]
    final = events[-1].response
    assert final.id == events[0].response.id
    assert [o.model_dump(exclude={"id"}) for o in final.output] == [o.model_dump(exclude={"id"}) for o in whole.output]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [o.model_dump() for o in final.output]
    assert final.usage == whole.usage and chat.closed


async def test_incomplete_and_aborted_responses():
    for finish, reason in (("length", "max_output_tokens"), ("abort", "abort")):
        chat = ScriptedChat(ChatCompletionMessage(content="Red, gr"), finish)
        resp = await create_response(chat, {"model": "m", "input": "Hi", "max_output_tokens": 3})
        assert resp.status == "incomplete" and resp.incomplete_details.reason == reason
        assert resp.output[0].status == "incomplete" and resp.completed_at is None
    chunks = [_chunk(ChoiceDelta(role="assistant", content="")), _chunk(finish="length"),
              _chunk(usage=CompletionUsage(prompt_tokens=5, completion_tokens=1, total_tokens=6))]
    stream = await create_response(ScriptedChat(chunks=chunks), {"model": "m", "input": "Hi", "stream": True})
    events = [e async for e in stream]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == ""
    assert [o.status for o in events[-1].response.output] == ["incomplete"]  # an empty message, as whole


async def test_errors_mid_stream_and_as_server_sent_events():
    chat = ScriptedChat(chunks=SCRIPT, fail_after=4)
    stream = await create_response(chat, {"model": "m", "input": "Hi", "stream": True})
    with pytest.raises(InternalServerError):
        async for _ in stream:
            pass
    assert chat.closed
    chat = ScriptedChat(chunks=SCRIPT, fail_after=4)
    lines = [s async for s in response_sse_stream(await create_response(chat, {"model": "m", "input": "Hi",
                                                                                 "stream": True}))]
    assert all(s.startswith("event: ") and s.endswith("\n\n") for s in lines)
    assert "[DONE]" not in "".join(lines)
    kind, data = lines[-1].split("\n")[:2]
    error = json.loads(data.removeprefix("data: "))
    assert kind == "event: error" and error["type"] == "error" and "boom" in error["message"]
    assert error["sequence_number"] == len(lines) - 1 and chat.closed
    first = lines[0].split("\n")
    assert first[0] == "event: response.created" and json.loads(first[1][6:])["type"] == "response.created"


# --- on SmolLM2 -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
async def engine(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, num_kv_blocks=128, max_model_len=2048,
                                           max_num_seqs=4) as e:
        yield e


@pytest.fixture
def client(engine):
    return engine.openai_client()


async def test_text_equals_the_chat_completion_streamed_or_not(client, engine):
    """Greedy: the output is the chat completion of the same messages, instructions first;
    streamed, the deltas join to it and the last event carries the same response."""
    kw = dict(model=client.model, max_output_tokens=10, temperature=0)
    resp = await client.responses.create(input=ASK, instructions="Answer briefly.", **kw)
    chat = await client.chat.completions.create(
        model=client.model, messages=[{"role": "system", "content": "Answer briefly."}, *ASK], max_tokens=10,
        temperature=0)
    choice = chat.choices[0]
    assert resp.output_text == choice.message.content and resp.output_text
    assert resp.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                   chat.usage.completion_tokens)
    assert resp.instructions == "Answer briefly." and resp.model == client.model
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    sdk_check(resp)

    stream = await client.responses.create(input=ASK, instructions="Answer briefly.", stream=True, **kw)
    events = [e async for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added", "response.content_part.added"]
    assert events[-1].type == f"response.{resp.status}"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == resp.output_text and len(deltas) > 1
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response
    assert done.text == final.output_text == resp.output_text
    # the same counts, but for the cached ones: the prompt is in the prefix cache by now
    other = {"input_tokens_details"}
    assert final.usage.model_dump(exclude=other) == resp.usage.model_dump(exclude=other)
    assert final.usage.input_tokens_details.cached_tokens > 0
    for e in events:
        sdk_check(e, "event")
    assert_idle(engine)


async def test_max_output_tokens_makes_it_incomplete(client):
    resp = await client.responses.create(model=client.model, input="Count to twenty.", max_output_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete" and resp.max_output_tokens == 3


async def test_function_calls_and_their_round_trip(client, engine):
    """A forced call gives function_call items with valid arguments; sent back with their
    outputs, the model answers as the chat layer does for the same history."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = await client.responses.create(model=client.model, input=ask, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert resp.status == "completed" and resp.tool_choice == "required" and resp.parallel_tool_calls is False
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    sdk_check(resp)

    history = ask + [o.to_dict() for o in resp.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]
    after = await client.responses.create(model=client.model, input=history, tools=[WEATHER], tool_choice="none",
                                          max_output_tokens=6, temperature=0)
    chat = await client.chat.completions.create(
        model=client.model, max_tokens=6, temperature=0, tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}], tool_choice="none",
        messages=ask + [
            {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}])
    assert after.output_text == chat.choices[0].message.content and after.output_text
    assert [o.type for o in after.output] == ["message"]
    assert_idle(engine)


async def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "color", "strict": True, "schema": {
        "type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"], "additionalProperties": False}}
    resp = await client.responses.create(model=client.model, input="Pick a color.", text={"format": fmt},
                                         max_output_tokens=30, temperature=0)
    assert resp.status == "completed" and resp.text["format"]["name"] == "color"
    assert json.loads(resp.output_text)["color"] in ("red", "green", "blue")
    sdk_check(resp)


async def test_auto_calls_end_with_the_first_when_parallel_tool_calls_is_false(engine):
    """Read with the hermes parser (the output is forced to two calls): both come back,
    or with parallel_tool_calls=false the first alone, and the generation stops there."""
    client = engine.openai_client(tool_call_parser="hermes")
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    kw = dict(model=client.model, input="The weather in Paris and Lyon?", tools=[WEATHER], max_output_tokens=200,
              temperature=0, extra_body={"structured_outputs": {"choice": [reply]}})
    both = await client.responses.create(**kw)
    assert [(o.type, o.arguments) for o in both.output] == [("function_call", '{"city": "Paris"}'),
                                                            ("function_call", '{"city": "Lyon"}')]
    one = await client.responses.create(parallel_tool_calls=False, **kw)
    assert one.status == "completed" and one.parallel_tool_calls is False
    assert [(o.type, o.arguments, o.status) for o in one.output] == [("function_call", '{"city": "Paris"}', "completed")]
    assert one.usage.output_tokens < both.usage.output_tokens - 10
    sdk_check(one)


async def test_reasoning_comes_first_as_its_own_item(engine):
    """With the think parser on (forced here on SmolLM2's weights), a <think> block the
    output opens is a reasoning item before the message, streamed as reasoning_text events."""
    client = engine.openai_client(reasoning_parser="think")
    reply = "<think>\nPlan.\n</think>\n\nHi!"
    kw = dict(model=client.model, input="Hello", max_output_tokens=30, temperature=0,
              extra_body={"structured_outputs": {"choice": [reply]}})
    got = {}

    async def whole():
        got["resp"] = await client.responses.create(**kw)

    async def streamed():
        got["events"] = [e async for e in await client.responses.create(stream=True, **kw)]

    async with anyio.create_task_group() as tg:  # (the output is forced: batching cannot change it)
        tg.start_soon(whole)
        tg.start_soon(streamed)
    resp, events = got["resp"], got["events"]
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Plan." and resp.output_text == "Hi!"
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Plan."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi!"
    assert events[-1].response.output_text == "Hi!" and events[-1].response.output[0].content[0].text == "Plan."
    for e in events:
        sdk_check(e, "event")


async def test_errors_from_the_chat_layer_name_responses_fields(client):
    with pytest.raises(BadRequestError) as e:
        await client.responses.create(model=client.model, input="word " * 3000)
    assert e.value.param == "input" and e.value.code == "context_length_exceeded"
    with pytest.raises(BadRequestError) as e:
        await client.responses.create(model=client.model, input="Hi", max_output_tokens=10**7)
    assert e.value.param == "max_output_tokens" and e.value.code == "context_length_exceeded"
    message = e.value.body["message"]
    assert "max_output_tokens (10000000)" in message and "max_tokens" not in message, message
    with pytest.raises(BadRequestError) as e:
        await client.responses.create(model=client.model, input="Hi", text={"format": {"type": "json_object"}},
                                      extra_body={"min_tokens": 2})
    assert e.value.param == "min_tokens"
    assert "text.format" in e.value.body["message"] and "structured_outputs" not in e.value.body["message"]
    with pytest.raises(BadRequestError) as e:
        await client.responses.create(model=client.model, input="Hi", tools=[WEATHER])
    assert e.value.param == "tool_choice"  # auto needs a parser SmolLM2's template does not give
    with pytest.raises(BadRequestError) as e:
        await client.responses.create(model=client.model, input="Hi", text={"format": {"type": "json_object"}},
                                      extra_body={"structured_outputs": {"regex": "a"}})
    assert e.value.param == "structured_outputs"
    with pytest.raises(NotFoundError) as e:
        await client.responses.create(model="gpt-4o", input="Hi")
    assert e.value.param == "model"
    with pytest.raises(APIStatusError) as e:  # refused before the stream starts
        await client.responses.create(model=client.model, input="Hi", stream=True, background=True)
    assert e.value.param == "background"


async def test_closing_the_stream_early_frees_the_blocks(client, engine):
    stream = await client.responses.create(model=client.model, input="Write a long story.", max_output_tokens=500,
                                           stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for event in stream:
        seen += event.type == "response.output_text.delta"
        if seen == 2:
            break
    assert engine.stats().num_running == 1
    await stream.close()
    with anyio.fail_after(30):
        while engine.stats().num_running:
            await anyio.sleep(0.01)
    assert_idle(engine)
