"""asyncgen.openai without an engine: request validation and its error objects, the
mapping to SamplingParams, response and chunk JSON, server-sent events, token bytes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import asyncgen.openai as aoai
from asyncgen import SamplingParams, StreamChunk, TokenLogprob, Usage
from asyncgen.openai import (
    AsyncStream,
    BadRequestError,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChoiceDelta,
    CompletionRequest,
    CompletionUsage,
    InternalServerError,
    from_exception,
    sse_stream,
    to_sampling_params,
)
from asyncgen.openai.adapter import (
    _AlignedLogprobs,
    _parse,
    _template_messages,
    _TokenText,
    _top_by_text,
    _usage,
    _visible_logprobs,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return _parse(ChatCompletionRequest, {"model": "m", "messages": USER, **kw})


def completion(**kw):
    return _parse(CompletionRequest, {"model": "m", "prompt": "hi", **kw})


def test_the_openai_package_is_not_needed():
    code = "import sys, asyncgen.openai; assert 'openai' not in sys.modules, 'asyncgen.openai imported openai'"
    root = str(pathlib.Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": root})


def test_public_api_is_sorted_and_importable():
    assert aoai.__all__ == sorted(aoai.__all__)
    for name in aoai.__all__:
        assert getattr(aoai, name) is not None


# --- requests -----------------------------------------------------------------------------------
def test_openai_defaults():
    c = chat()
    assert (c.temperature, c.top_p, c.n, c.stream, c.logprobs, c.max_tokens, c.max_completion_tokens) == (
        1.0, 1.0, 1, False, False, None, None)
    p = to_sampling_params(c)
    assert p.max_tokens is None and p.temperature == 1.0 and p.logprobs is None and p.n == 1
    legacy = completion()
    assert legacy.max_tokens == 16 and to_sampling_params(legacy).max_tokens == 16
    assert to_sampling_params(completion(max_tokens=None)).max_tokens is None


def test_nulls_mean_defaults():
    p = to_sampling_params(chat(temperature=None, top_p=None, n=None, presence_penalty=None, stop=None))
    assert (p.temperature, p.top_p, p.n, p.presence_penalty, p.stop) == (1.0, 1.0, 1, 0.0, None)


def test_mapping_to_sampling_params():
    p = to_sampling_params(chat(
        max_completion_tokens=7, max_tokens=99, temperature=0.5, top_p=0.9, n=3, seed=11, stop=["\n", "END"],
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"42": -100, "7": 2.5}, logprobs=True,
        top_logprobs=4, top_k=20, min_p=0.05, repetition_penalty=1.1, ignore_eos=True, min_tokens=2,
    ))
    assert p == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, n=3, seed=11, stop=["\n", "END"], presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={42: -100.0, 7: 2.5}, logprobs=4, top_k=20, min_p=0.05,
        repetition_penalty=1.1, ignore_eos=True, min_tokens=2,
    )
    assert to_sampling_params(chat(max_tokens=5)).max_tokens == 5
    assert to_sampling_params(chat(logprobs=True)).logprobs == 0
    assert to_sampling_params(completion(logprobs=3)).logprobs == 3
    assert to_sampling_params(completion(logprobs=0)).logprobs == 0
    assert to_sampling_params(chat(stop="x")).stop == "x"
    greedy = to_sampling_params(chat(top_p=0))
    assert greedy.temperature == 0.0 and greedy.is_greedy


def test_template_messages():
    req = chat(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}], "name": "ann"},
        {"role": "assistant", "content": None, "refusal": "No."},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure"}]},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"},
    ])
    assert _template_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nworld", "name": "ann"},
        {"role": "assistant", "content": "No."},
        {"role": "assistant", "content": "Sure"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"},
    ]


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "invalid_value"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"logit_bias": {"12": 500}}, "logit_bias.12", "invalid_value"),
        ({"colour": "red"}, "colour", "unknown_parameter"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_type"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text",
         "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": "x", "mood": 1}]}, "messages[0].mood", "unknown_parameter"),
        # JSON types are not coerced (as OpenAI refuses them): a boolean is not an integer,
        # 4.0 not an integer, "0.5" not a number, "true" not a boolean
        ({"n": True}, "n", "invalid_type"),
        ({"max_tokens": 4.0}, "max_tokens", "invalid_type"),
        ({"seed": 1.0}, "seed", "invalid_type"),
        ({"temperature": "0.5"}, "temperature", "invalid_type"),
        ({"stream": "true"}, "stream", "invalid_type"),
        ({"logprobs": 1}, "logprobs", "invalid_type"),
        ({"logit_bias": {"12": True}}, "logit_bias.12", "invalid_type"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "invalid_value"),
        ({"messages": [{"role": "system", "content": []}, {"role": "user", "content": "x"}]}, "messages[0].content",
         "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
    ],
)
def test_invalid_chat_requests_name_the_field(fields, param, code):
    with pytest.raises(BadRequestError) as e:
        chat(**fields)
    err = e.value
    assert (err.param, err.code, err.status_code, err.type) == (param, code, 400, "invalid_request_error")
    assert err.body == {"message": err.message, "type": "invalid_request_error", "param": param, "code": code}
    body = err.to_response().to_dict()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("fields, param", [({"temperature": float("nan")}, "temperature"),
                                           ({"top_p": float("inf")}, "top_p"),
                                           ({"logit_bias": {"12": float("-inf")}}, "logit_bias.12")])
def test_non_finite_numbers_are_named_as_such(fields, param):
    with pytest.raises(BadRequestError) as e:
        chat(**fields)
    assert (e.value.param, e.value.code) == (param, "invalid_value") and "finite number" in e.value.message


def test_missing_model_and_unrecognized_argument_messages():
    with pytest.raises(BadRequestError) as e:
        _parse(ChatCompletionRequest, {"messages": USER})
    assert e.value.param == "model" and e.value.message == "Missing required parameter: 'model'."
    with pytest.raises(BadRequestError) as e:
        chat(colour="red")
    assert e.value.message == "Unrecognized request argument supplied: colour"
    with pytest.raises(BadRequestError) as e:
        _parse(ChatCompletionRequest, ["not", "an", "object"])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto", "functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
         "messages[0].content[1].type"),
        ({"messages": [{"role": "function", "name": "f", "content": "42"}]}, "messages[0].role"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]},
         "messages[0].tool_calls[0].type"),
    ],
)
def test_unsupported_features_are_refused_by_name(fields, param):
    with pytest.raises(BadRequestError) as e:
        chat(**fields)
    assert e.value.param == param and e.value.code == "unsupported_parameter"


def test_labels_and_neutral_values_are_accepted():
    c = chat(user="u1", metadata={"k": "v"}, store=False, service_tier="auto", response_format={"type": "text"},
             tool_choice="none", parallel_tool_calls=True, prompt_cache_key="k", safety_identifier="s",
             stream=True, stream_options={"include_usage": True}, modalities=["text"])
    assert c.include_usage


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logprobs": 6}, "logprobs"),
        ({"suffix": "end"}, "suffix"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 4, "n": 2, "stream": True}, "best_of"),  # cannot be streamed
        ({"prompt": [[1, 2], [3, "a"]]}, "prompt[1][1]"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_invalid_completion_requests(fields, param):
    with pytest.raises(BadRequestError) as e:
        to_sampling_params(completion(**fields))
    assert e.value.param == param


def test_completion_prompt_forms():
    assert completion(prompt="a").prompts == ["a"]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]


def test_sampling_params_errors_name_the_request_field():
    with pytest.raises(BadRequestError) as e:
        to_sampling_params(chat(logit_bias={"-3": 1}))
    assert e.value.param == "logit_bias"
    for stop in ([""], ""):  # the bare string as the list holding it
        with pytest.raises(BadRequestError) as e:
            to_sampling_params(chat(stop=stop))
        assert e.value.param == "stop" and e.value.message == (
            "Invalid value for 'stop': stop strings must not be empty.")


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "fields, param, names",
    [
        ({"max_tokens": 2, "min_tokens": 5}, "min_tokens", ("min_tokens (5)", "max_tokens (2)")),
        ({"max_completion_tokens": 2, "min_tokens": 5}, "min_tokens", ("max_completion_tokens (2)",)),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", ("response_format",)),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", ("response_format",)),
        ({"response_format": {"type": "json_object"}, "allowed_token_ids": [5]}, "allowed_token_ids",
         ("response_format",)),
        ({"tools": [TOOL], "tool_choice": "required", "min_tokens": 2}, "min_tokens", ("tools",)),
    ],
)
def test_values_that_another_field_rules_out_name_both_as_the_request_does(fields, param, names):
    with pytest.raises(BadRequestError) as e:
        to_sampling_params(chat(**fields))
    err = e.value
    assert (err.param, err.code) == (param, "invalid_value")
    assert err.message.startswith(f"Invalid value for '{param}': ")
    for name in names:
        assert name in err.message
    assert "structured_outputs" not in err.message and "Value error" not in err.message
    if "max_completion_tokens" in fields:
        assert "max_tokens" not in err.message


@pytest.mark.parametrize("seed, ok", [(2**63 - 1, True), (-2**63, True), (2**63, False), (-2**63 - 1, False)])
def test_seeds_are_signed_64_bit(seed, ok):
    if ok:
        assert to_sampling_params(chat(seed=seed)).seed == seed
        return
    with pytest.raises(BadRequestError) as e:
        to_sampling_params(chat(seed=seed))
    assert e.value.param == "seed"


def test_engine_errors_map_to_openai_errors():
    from asyncgen import EngineDeadError, EngineStateError, InvalidRequestError, PromptTooLongError

    err = from_exception(PromptTooLongError("prompt has 9000 tokens"), prompt_param="prompt")
    assert (err.status_code, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    err = from_exception(InvalidRequestError("this model's tokenizer has no chat template"))
    assert (err.status_code, err.param) == (400, "messages")
    err = from_exception(InvalidRequestError("logit_bias holds token ids outside the vocabulary", param="logit_bias"))
    assert err.param == "logit_bias"
    too_long = PromptTooLongError("prompt (10 tokens) + max_tokens (9000) = 9010 exceeds", param="max_tokens")
    err = from_exception(too_long, prompt_param="messages")
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    err = from_exception(too_long, prompt_param="messages", fields={"max_tokens": "max_completion_tokens"})
    assert err.param == "max_completion_tokens"
    assert err.message == "prompt (10 tokens) + max_completion_tokens (9000) = 9010 exceeds"
    err = from_exception(EngineDeadError("boom"))
    assert isinstance(err, InternalServerError) and err.status_code == 500 and err.type == "server_error"
    assert from_exception(EngineStateError("closed")).status_code == 503
    err = from_exception(RuntimeError("secret internals"))
    assert err.status_code == 500 and "secret" not in err.message
    assert str(BadRequestError("bad", param="n")).startswith("Error code: 400 - {'error': {'message': 'bad'")


# --- responses ----------------------------------------------------------------------------------
def test_chunk_json_shape():
    usage = CompletionUsage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    first = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[
        ChatCompletionChunkChoice(index=0, delta=ChoiceDelta(role="assistant", content=""))])
    last = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[
        ChatCompletionChunkChoice(index=0, delta=ChoiceDelta(), finish_reason="length")])
    tail = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[], usage=usage)
    assert first.to_dict()["choices"][0] == {
        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    assert first.to_dict()["object"] == "chat.completion.chunk"
    assert last.to_dict()["choices"][0]["delta"] == {} and last.to_dict()["choices"][0]["finish_reason"] == "length"
    assert tail.to_dict()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                       "prompt_tokens_details": None}
    cached = _usage([Usage(3, 2, 1), Usage(4, 1, 0)]).to_dict()
    assert cached == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                      "prompt_tokens_details": {"cached_tokens": 1}}


def test_responses_parse_as_the_official_sdk_types():
    types = pytest.importorskip("openai.types.chat")
    resp = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop", "logprobs": {"content": [
            {"token": "hi", "logprob": -0.1, "bytes": [104, 105], "top_logprobs": [
                {"token": "hi", "logprob": -0.1, "bytes": [104, 105]}]}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })
    sdk = types.ChatCompletion.model_validate(json.loads(resp.model_dump_json()))
    assert sdk.choices[0].message.content == "hi" and sdk.choices[0].logprobs.content[0].bytes == [104, 105]
    assert sdk.object == "chat.completion" and sdk.usage.total_tokens == 2


async def _chunks(items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


@pytest.mark.anyio
async def test_sse_stream_events_and_mid_stream_error():
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[])
    events = [e async for e in sse_stream(AsyncStream(_chunks([chunk, chunk])))]
    assert events == [f"data: {chunk.model_dump_json()}\n\n"] * 2 + ["data: [DONE]\n\n"]
    events = [e async for e in sse_stream(AsyncStream(_chunks([chunk, InternalServerError("engine died")])))]
    assert json.loads(events[1][len("data: "):])["error"]["type"] == "server_error"
    assert events[-1] == "data: [DONE]\n\n"


@pytest.mark.anyio
async def test_closing_the_events_closes_the_stream():
    closed = []

    async def chunks():
        try:
            while True:
                yield ChatCompletionChunk(id="c", created=1, model="m", choices=[])
        finally:
            closed.append(True)

    events = sse_stream(AsyncStream(chunks()))
    await events.__anext__()
    await events.aclose()
    assert closed == [True]


@pytest.fixture
def anyio_backend():
    return "asyncio"


# --- logprobs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from asyncgen.fetch import smollm2

    return AutoTokenizer.from_pretrained(str(smollm2()))


def test_token_bytes_are_exact_for_split_characters(tokenizer):
    text = " héllo 한국 😀 <tag>"
    ids = tokenizer.encode(text)
    token_text = _TokenText(tokenizer)
    raw = b"".join(bytes(token_text(i)[1]) for i in ids)
    assert raw == text.encode()
    assert any("\ufffd" in token_text(i)[0] for i in ids)  # a token holding part of a character
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_text(eos) == ("<|im_end|>", list(b"<|im_end|>"))


def test_a_final_stop_token_is_not_in_the_logprobs():
    lps = (TokenLogprob(5, -0.1), TokenLogprob(2, -0.2))
    eos_end = StreamChunk("r", 0, "x", (5, 2), "stop", None, logprobs=lps)
    assert _visible_logprobs(eos_end) == lps[:1]
    stop_string_end = StreamChunk("r", 0, "x", (5, 2), "stop", "END", logprobs=lps)
    assert _visible_logprobs(stop_string_end) == lps
    assert _visible_logprobs(StreamChunk("r", 0, "x", (5, 2), "length", logprobs=lps)) == lps
    assert _visible_logprobs(StreamChunk("r", 0, "x", (5,))) is None


def _engine_chunks(tokenizer, ids, stop=(), finish="length"):
    """The chunks the engine's emit step makes for ``ids`` sampled one a step: a token's
    id and logprob travel with the first chunk that has text (or the last one)."""
    from asyncgen.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, True, list(stop))
    pending, chunks = [], []
    for i, t in enumerate(ids):
        pending.append(t)
        stopped = detok.add([t])
        last = stopped is not None or i == len(ids) - 1
        if last:
            detok.flush()
        text = detok.delta(last)
        if not text and not last:
            continue
        reason = ("stop" if stopped else finish) if last else None
        lps = tuple(TokenLogprob(x, -1.0 - j) for j, x in enumerate(pending))
        chunks.append(StreamChunk("r", 0, text, tuple(pending), reason, stopped, logprobs=lps))
        pending = []
        if stopped:
            break
    return chunks


def test_aligned_logprobs_start_where_their_characters_do(tokenizer):
    text = " Voilà: café, naïve, 日本語 😀 and 한국"
    ids = tokenizer.encode(text)
    aligned = _AlignedLogprobs(tokenizer, True)
    got, sent = [], ""
    for c in _engine_chunks(tokenizer, ids):
        sent += c.text
        released = aligned.add(c)
        assert all(start < len(sent) for start, _ in released)  # released with their text
        got += released
    assert sent == text and [lp.token_id for _, lp in got] == ids
    starts = [start for start, _ in got]
    # where each token starts: the complete characters of the tokens before it
    assert starts == [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert starts == sorted(starts) and any(a == b for a, b in zip(starts, starts[1:]))  # split characters


def test_aligned_logprobs_skip_special_tokens_inside_a_character(tokenizer):
    """A skipped special token between the bytes of one character adds no bytes: the
    token after it still continues the character."""
    from asyncgen.engine.tokenizer import TokenBytes

    vocab = TokenBytes(tokenizer).vocabulary()
    lead, end = vocab.index(b"\xe2\x82"), vocab.index(b"\xac")  # "€" in two tokens
    [word] = tokenizer.encode(" word")
    special = tokenizer.convert_tokens_to_ids("<jupyter_code>")  # an added token marked special
    for skip, starts, text in ((True, [0, 0, 0, 1], "€ word"), (False, [0, 1, 15, 16], "\ufffd<jupyter_code>\ufffd word")):
        ids = [lead, special, end, word]
        assert tokenizer.decode(ids, skip_special_tokens=skip) == text
        aligned = _AlignedLogprobs(tokenizer, skip)
        lps = tuple(TokenLogprob(t, -1.0) for t in ids)
        got = aligned.add(StreamChunk("r", 0, text, tuple(ids), "length", None, logprobs=lps))
        assert [start for start, _ in got] == starts


def test_aligned_logprobs_leave_out_a_cut_stop_string(tokenizer):
    ids = tokenizer.encode("The cat is a majestic animal")
    chunks = _engine_chunks(tokenizer, ids, stop=[" majestic"])
    assert chunks[-1].stop_reason == " majestic"
    aligned = _AlignedLogprobs(tokenizer, True)
    text, kept = "", []
    for c in chunks:
        text += c.text
        kept += [lp.token_id for _, lp in aligned.add(c)]
    assert text == "The cat is a" and tokenizer.decode(kept) == text
    # with the stop string in the output, its tokens stay
    from asyncgen.engine.detokenizer import IncrementalDetokenizer

    included = _AlignedLogprobs(tokenizer, True)
    detok = IncrementalDetokenizer(tokenizer, True, [" majestic"], include_stop_str_in_output=True)
    upto = next(ids[:i] for i in range(len(ids)) if tokenizer.decode(ids[:i]) == "The cat is a majestic")
    for t in upto:
        detok.add([t])
    whole = StreamChunk("r", 0, detok.text, tuple(upto), "stop", " majestic",
                        logprobs=tuple(TokenLogprob(t, -1.0) for t in upto))
    assert [lp.token_id for _, lp in included.add(whole)] == upto
    # a final stop token is dropped, the text before it kept whole
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = StreamChunk("r", 0, "The cat", (*ids[:2], eos), "stop", eos,
                        logprobs=tuple(TokenLogprob(t, -1.0) for t in (*ids[:2], eos)))
    assert [lp.token_id for _, lp in _AlignedLogprobs(tokenizer, True).add(ended)] == ids[:2]


def test_completion_top_logprobs_hold_the_sampled_token(tokenizer):
    token_text = _TokenText(tokenizer)
    a, b, c = tokenizer.encode(" Paris London heated")
    lp = TokenLogprob(c, -5.0, ((a, -0.5), (b, -1.0)))
    assert _top_by_text(token_text, lp) == {" Paris": -0.5, " London": -1.0, " heated": -5.0}
    assert _top_by_text(token_text, TokenLogprob(a, -0.5, ((a, -0.5),))) == {" Paris": -0.5}
    assert _top_by_text(token_text, TokenLogprob(a, -0.5)) == {" Paris": -0.5}  # logprobs=0


def test_completion_max_tokens_zero_needs_echo():
    assert to_sampling_params(completion(max_tokens=0, echo=True, logprobs=1)).max_tokens == 1
    with pytest.raises(BadRequestError) as info:
        completion(max_tokens=0)
    assert info.value.param == "max_tokens" and "echo" in info.value.message
