"""``engine.openai_client()`` against SmolLM2 on the CPU, on asyncio and trio: the
objects and streams of ``openai.AsyncOpenAI``, the request mapping seen in the output,
errors, and that closing or cancelling frees the request's blocks."""

from __future__ import annotations

import anyio
import pytest

from conftest import assert_idle
from asyncgen import AsyncEngine, SamplingParams
from asyncgen.fetch import smollm2
from asyncgen.openai import (
    AsyncStream,
    BadRequestError,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    InProcessOpenAI,
    InternalServerError,
    NotFoundError,
)

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


# Tests of the request mapping, which does not depend on the event loop, run on asyncio only.
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"], scope="module")


@pytest.fixture(scope="module")
async def engine(anyio_backend):
    async with AsyncEngine.from_pretrained(smollm2(), num_kv_blocks=256, max_model_len=2048, max_num_seqs=16) as e:
        yield e


@pytest.fixture
def client(engine):
    return engine.openai_client()


async def test_client_shape(client, engine):
    assert isinstance(client, InProcessOpenAI) and client.model == "SmolLM2-135M-Instruct"
    page = await client.models.list()
    assert page.object == "list" and [m.id for m in page.data] == [client.model]
    assert [m.id async for m in client.models.list()] == [client.model]
    assert (await client.models.retrieve(client.model)).owned_by == "asyncgen"
    async with client as same:
        assert same.with_options(timeout=5) is client
    assert engine.is_running  # closing the client leaves the engine alone


async def test_chat_matches_the_engine(client, engine):
    resp = await client.chat.completions.create(model=client.model, messages=MESSAGES, max_tokens=8, temperature=0)
    direct = await engine.generate(messages=MESSAGES, params=SamplingParams(max_tokens=8, temperature=0))
    assert isinstance(resp, ChatCompletion) and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.content == direct.text
    assert resp.choices[0].finish_reason == direct.finish_reason
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (
        direct.usage.prompt_tokens, direct.usage.completion_tokens)
    assert resp.to_dict()["choices"][0]["message"] == {"role": "assistant", "content": direct.text, "refusal": None}


async def test_chat_stream(client, engine):
    whole = await client.chat.completions.create(model=client.model, messages=MESSAGES, max_tokens=8, temperature=0)
    stream = await client.chat.completions.create(
        model=client.model, messages=MESSAGES, max_tokens=8, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True},
    )
    assert isinstance(stream, AsyncStream)
    chunks = [c async for c in stream]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert sorted(c.choices[0].index for c in chunks[:2]) == [0, 1]
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == whole.choices[0].message.content
        assert [ch.finish_reason for ch in mine if ch.finish_reason] == [whole.choices[0].finish_reason]
        assert mine[-1].finish_reason and mine[-1].delta.to_dict() == {}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 2 * whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats: every chunk with a choice has that choice's usage so far
    stream = await client.chat.completions.create(
        model=client.model, messages=MESSAGES, max_tokens=8, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [c async for c in stream]
    for i in range(2):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        counts = [c.usage.completion_tokens for c in mine]
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens
        assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in mine)
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in mine)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * whole.usage.completion_tokens
    assert_idle(engine)


async def test_completions_several_prompts(client, engine):
    prompts = ["The capital of France is", "One, two, three,"]
    singles = [
        (await client.completions.create(model=client.model, prompt=p, max_tokens=4, temperature=0)).choices[0].text
        for p in prompts
    ]
    resp = await client.completions.create(model=client.model, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert isinstance(resp, Completion) and resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert resp.usage.completion_tokens == 16

    stream = await client.completions.create(
        model=client.model, prompt=prompts, max_tokens=4, temperature=0, stream=True, echo=True,
        stream_options={"include_usage": True},
    )
    texts = {0: "", 1: ""}
    finish = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {0: prompts[0] + singles[0], 1: prompts[1] + singles[1]}
    assert finish == {0: "length", 1: "length"} and chunk.usage.completion_tokens == 8
    stream = await client.completions.create(
        model=client.model, prompt=prompts, max_tokens=4, temperature=0, stream=True, echo=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    seen = {0: [], 1: []}
    async for chunk in stream:
        for choice in chunk.choices:
            seen[choice.index].append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
    for i, p in enumerate(prompts):
        assert {u[0] for u in seen[i]} == {len(engine.tokenizer.encode(p))}
        assert [u[1] for u in seen[i]][0] == 0 and seen[i][-1][1] == 4


@ASYNCIO_ONLY
async def test_token_id_prompts(client, engine):
    ids = engine.tokenizer.encode("The capital of France is")
    resp = await client.completions.create(model=client.model, prompt=ids, max_tokens=4, temperature=0, echo=True)
    text = await client.completions.create(model=client.model, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert resp.choices[0].text == "The capital of France is" + text.choices[0].text


@ASYNCIO_ONLY
async def test_stop_and_logit_bias_reach_the_sampler(client, engine):
    prompt = "The capital of France is"
    base = (await client.completions.create(model=client.model, prompt=prompt, max_tokens=8, temperature=0)).choices[0]
    first_word = base.text.split()[0]
    stopped = await client.completions.create(model=client.model, prompt=prompt, max_tokens=8, temperature=0, stop=[first_word])
    assert stopped.choices[0].finish_reason == "stop" and first_word not in stopped.choices[0].text
    first_token = engine.tokenizer.encode(base.text)[0]
    biased = await client.completions.create(
        model=client.model, prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(first_token): -100}
    )
    assert engine.tokenizer.encode(biased.choices[0].text)[0] != first_token


@ASYNCIO_ONLY
async def test_roles_and_content_parts(client):
    async def prompt_tokens(messages):
        r = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=1)
        return r.usage.prompt_tokens

    system = await prompt_tokens([{"role": "system", "content": "Be brief."}, *MESSAGES])
    developer = await prompt_tokens([{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *MESSAGES])
    assert system == developer
    joined = await prompt_tokens([{"role": "user", "content": "Hello\nworld"}])
    parts = await prompt_tokens([{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}])
    assert joined == parts


@ASYNCIO_ONLY
async def test_replies_go_back_into_the_history(client):
    """As with the SDK, a reply's message object (or the Responses ``output`` items) is
    put back into the next request, and tuples or generators count as lists."""
    reply = (await client.chat.completions.create(model=client.model, messages=MESSAGES, max_tokens=6,
                                                   temperature=0)).choices[0].message
    follow = {"role": "user", "content": "And of Italy?"}
    as_dict = {"role": "assistant", "content": reply.content}
    expected = await client.chat.completions.create(model=client.model, messages=[*MESSAGES, as_dict, follow],
                                                    max_tokens=6, temperature=0, stop=["x"])
    got = await client.chat.completions.create(model=client.model, messages=(m for m in [*MESSAGES, reply, follow]),
                                               max_tokens=6, temperature=0, stop=("x",))
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.choices[0].message.content == expected.choices[0].message.content

    first = await client.responses.create(model=client.model, input=MESSAGES, max_output_tokens=6, temperature=0)
    assert [item.type for item in first.output] == ["message"]
    expected = await client.responses.create(
        model=client.model, input=[*MESSAGES, {"role": "assistant", "content": first.output_text}, follow],
        max_output_tokens=6, temperature=0)
    got = await client.responses.create(model=client.model, input=[*MESSAGES, *first.output, follow],
                                        max_output_tokens=6, temperature=0)
    assert got.usage.input_tokens == expected.usage.input_tokens and got.output_text == expected.output_text


@ASYNCIO_ONLY
async def test_logprobs(client, engine):
    resp = await client.chat.completions.create(
        model=client.model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    no_top = await client.chat.completions.create(model=client.model, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)
    plain = await client.chat.completions.create(model=client.model, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None

    stream = await client.completions.create(
        model=client.model, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2, stream=True
    )
    tokens, offsets, text = [], [], ""
    async for chunk in stream:
        lp = chunk.choices[0].logprobs
        tokens += lp.tokens
        offsets += lp.text_offset
        text += chunk.choices[0].text
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(tokens) == text and len(tokens) == 4
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@ASYNCIO_ONLY
async def test_completion_logprobs_follow_the_text(client, engine):
    tok = engine.tokenizer
    prompt = "Voilà: café, naïve, 日本語 😀 and"
    resp = await client.completions.create(
        model=client.model, prompt=prompt, max_tokens=6, temperature=1.5, seed=3, logprobs=2, echo=True
    )
    choice = resp.choices[0]
    lp = choice.logprobs
    ids = tok.encode(prompt)
    n = len(ids)
    assert choice.text.startswith(prompt) and len(lp.tokens) == n + 6
    # prompt offsets: where each token's first byte falls in the prompt's characters
    assert lp.text_offset[:n] == [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(n)]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[n] == len(prompt)
    assert lp.text_offset[-1] < len(choice.text)
    # the sampled token is among the top logprobs (up to logprobs + 1 of them)
    for token, value, top in zip(lp.tokens[n:], lp.token_logprobs[n:], lp.top_logprobs[n:]):
        assert top[token] == pytest.approx(value) and len(top) <= 3

    # a stop string cut from the text takes its tokens out of the logprobs, streamed or not
    base = await client.completions.create(model=client.model, prompt="The capital of France is", max_tokens=8,
                                           temperature=0)
    words = base.choices[0].text.split(" ")
    stop = " " + words[2]  # the text is cut before the second word
    kwargs = dict(model=client.model, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=1,
                  stop=[stop])
    whole = (await client.completions.create(**kwargs)).choices[0]
    assert whole.finish_reason == "stop" and whole.text == base.choices[0].text[: base.choices[0].text.index(stop)]
    assert "".join(whole.logprobs.tokens) == whole.text
    streamed_tokens, streamed_text = [], ""
    async for chunk in await client.completions.create(**kwargs, stream=True):
        streamed_tokens += chunk.choices[0].logprobs.tokens
        streamed_text += chunk.choices[0].text
    assert (streamed_text, streamed_tokens) == (whole.text, whole.logprobs.tokens)
    chat_kwargs = dict(model=client.model, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True)
    reply = (await client.chat.completions.create(**chat_kwargs)).choices[0].message.content
    cut = " " + reply.split(" ")[2]
    chat = (await client.chat.completions.create(**chat_kwargs, stop=[cut])).choices[0]
    assert chat.finish_reason == "stop" and "".join(t.token for t in chat.logprobs.content) == chat.message.content
    assert_idle(engine)


@ASYNCIO_ONLY
async def test_completion_echo_with_max_tokens_zero_scores_the_prompt(client, engine):
    prompt = "The capital of France is Paris"
    scored = await client.completions.create(model=client.model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert (choice.text, choice.finish_reason) == (prompt, "length")
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(engine.tokenizer.encode(prompt)), 0)
    assert "".join(choice.logprobs.tokens) == prompt and choice.logprobs.token_logprobs[0] is None
    out = await engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([lp.logprob for lp in out.prompt_logprobs[1:]])
    chunks = [c async for c in await client.completions.create(
        model=client.model, prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(BadRequestError) as e:
        await client.completions.create(model=client.model, prompt=prompt, max_tokens=0)
    assert e.value.param == "max_tokens"
    assert_idle(engine)


async def test_closing_a_stream_aborts_it(client, engine):
    stream = await client.chat.completions.create(
        model=client.model, messages=MESSAGES, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    async with stream:
        got = 0
        async for chunk in stream:
            got += bool(chunk.choices[0].delta.content)
            if got == 2:
                break
        assert engine.stats().num_running == 1
    assert_idle(engine)


async def test_cancelling_a_request_aborts_it(client, engine):
    with anyio.move_on_after(1.0) as scope:
        await client.chat.completions.create(
            model=client.model, messages=MESSAGES, max_tokens=1000, extra_body={"ignore_eos": True}
        )
    assert scope.cancelled_caught
    await anyio.sleep(0)
    assert_idle(engine)


async def test_engine_abort_is_finish_reason_abort(client, engine):
    stream = await client.chat.completions.create(
        model=client.model, messages=MESSAGES, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    reasons = []
    async for chunk in stream:
        if chunk.choices[0].delta.content and not reasons:
            assert engine.abort(chunk.id)  # the response id is the engine's request id
            reasons.append(None)
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons == [None, "abort"]
    assert_idle(engine)


@ASYNCIO_ONLY
async def test_request_errors(client, engine, monkeypatch):
    async def error(**kw):
        kw.setdefault("model", client.model)
        kw.setdefault("messages", MESSAGES)
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(**kw)
        assert e.value.status_code == 400 and e.value.body["param"] == e.value.param
        return e.value

    assert (await error(temperature=2.5)).param == "temperature"
    assert (await error(colour="red")).param == "colour"
    assert (await error(extra_body={"top_k": "many"})).param == "top_k"
    assert (await error(logit_bias={"99999999": 1})).param == "logit_bias"
    err = await error(messages=[{"role": "user", "content": "word " * 2100}])
    assert (err.param, err.code) == ("messages", "context_length_exceeded")
    err = await error(max_completion_tokens=2040, stream=True)
    assert (err.param, err.code) == ("max_completion_tokens", "context_length_exceeded")
    assert (await error(max_tokens=2040)).param == "max_tokens"
    with pytest.raises(NotFoundError) as e:
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert (e.value.status_code, e.value.code, e.value.param) == (404, "model_not_found", "model")
    with pytest.raises(BadRequestError) as e:
        await client.completions.create(model=client.model, prompt="")
    assert e.value.param == "prompt"
    with pytest.raises(BadRequestError) as e:
        await client.completions.create(model=client.model, prompt=[10**9])
    assert e.value.param == "prompt"

    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    err = await error()
    assert err.param == "messages" and "chat template" in err.message
    assert_idle(engine)


THINK = "<think>\n\n</think>\n\n"


@ASYNCIO_ONLY
async def test_chat_template_kwargs_reach_the_template(client, engine, monkeypatch):
    from asyncgen.errors import InvalidRequestError

    # A template variable as Qwen3's templates read enable_thinking.
    template = engine.tokenizer.chat_template + (
        "{%- if enable_thinking is defined and enable_thinking is false %}" + THINK + "{% endif %}"
    )
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    one = SamplingParams(max_tokens=1, temperature=0)
    plain = await engine.generate(messages=MESSAGES, params=one)
    off = await engine.generate(messages=MESSAGES, params=one, chat_template_kwargs={"enable_thinking": False})
    assert not plain.prompt.endswith(THINK) and off.prompt == plain.prompt + THINK
    assert list(off.prompt_token_ids) == engine.tokenizer.encode(off.prompt, add_special_tokens=False)

    added = len(off.prompt_token_ids) - len(plain.prompt_token_ids)
    kwargs = dict(model=client.model, messages=MESSAGES, max_tokens=1)
    base = await client.chat.completions.create(**kwargs)
    resp = await client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert added > 0 and resp.usage.prompt_tokens == base.usage.prompt_tokens + added

    with pytest.raises(InvalidRequestError, match="messages") as e:
        engine.stream("Hello", one, chat_template_kwargs={"enable_thinking": False})
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="'tokenize'") as e:
        engine.stream(messages=MESSAGES, params=one, chat_template_kwargs={"tokenize": True})
    assert e.value.param == "chat_template_kwargs"
    for bad in ({"tokenize": True}, ["enable_thinking"]):
        with pytest.raises(BadRequestError) as err:
            await client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": bad})
        assert err.value.param == "chat_template_kwargs"
    assert_idle(engine)


@ASYNCIO_ONLY
async def test_sdk_sentinels_count_as_absent(client):
    openai = pytest.importorskip("openai")
    resp = await client.chat.completions.create(
        model=client.model, messages=MESSAGES, max_tokens=2, temperature=openai.NOT_GIVEN, seed=openai.omit
    )
    assert resp.usage.completion_tokens <= 2


@ASYNCIO_ONLY
async def test_engine_not_running():
    engine = AsyncEngine.from_pretrained(smollm2())
    client = engine.openai_client()
    with pytest.raises(InternalServerError) as e:
        await client.chat.completions.create(model=engine.model_name, messages=MESSAGES)
    assert e.value.status_code == 503 and e.value.type == "server_error"


@ASYNCIO_ONLY
async def test_served_model_names(engine):
    client = InProcessOpenAI(engine, model_names=["smol", "assistant"])
    assert [m.id for m in (await client.models.list()).data] == ["smol", "assistant"] and client.model == "smol"
    resp = await client.chat.completions.create(model="assistant", messages=MESSAGES, max_tokens=1)
    assert resp.model == "assistant"
    with pytest.raises(NotFoundError):
        await client.chat.completions.create(model=engine.model_name, messages=MESSAGES, max_tokens=1)


async def test_return_token_ids(client, engine):
    """vLLM's return_token_ids: the prompt's ids and each choice's generated ids, whole and
    streamed (the prompt's in the first chunk, each chunk's own tokens in it); absent
    from the JSON otherwise."""
    kw = dict(model=client.model, messages=MESSAGES, max_tokens=8, temperature=0)
    direct = await engine.generate(messages=MESSAGES, params=SamplingParams(max_tokens=8, temperature=0))
    plain = await client.chat.completions.create(**kw)
    assert "prompt_token_ids" not in plain.to_dict() and "token_ids" not in plain.to_dict()["choices"][0]
    whole = await client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    prompt_ids = engine.tokenizer.encode(direct.prompt, add_special_tokens=False)
    assert whole.prompt_token_ids == prompt_ids and whole.choices[0].token_ids == list(direct.token_ids)
    chunks = [c async for c in await client.chat.completions.create(**kw, n=2, stream=True,
                                                                    extra_body={"return_token_ids": True})]
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    for i in range(2):
        ids = [t for c in chunks for ch in c.choices if ch.index == i for t in ch.token_ids]
        assert ids == list(direct.token_ids)
    prompt = "The capital of France is"
    one = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0))
    done = await client.completions.create(model=client.model, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                           extra_body={"return_token_ids": True})
    assert done.choices[0].prompt_token_ids == engine.tokenizer.encode(prompt)
    assert done.choices[0].token_ids == list(one.token_ids)
    pieces = [ch for c in await _collect_stream(client.completions.create(
        model=client.model, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        extra_body={"return_token_ids": True})) for ch in c.choices]
    assert pieces[0].prompt_token_ids == engine.tokenizer.encode(prompt)
    assert [t for ch in pieces for t in ch.token_ids] == list(one.token_ids)
    best = await client.completions.create(model=client.model, prompt=prompt, max_tokens=6, temperature=0, best_of=2,
                                           extra_body={"return_token_ids": True})
    assert best.choices[0].token_ids == list(one.token_ids)
    assert_idle(engine)


async def _collect_stream(pending):
    return [c async for c in await pending]
