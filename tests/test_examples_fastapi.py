"""examples/fastapi_server.py, run as a program under uvicorn and driven by the official
``openai`` client (only ``base_url`` changed): chat, completions and responses, streamed and not,
several clients at once, tool calls, errors, and a client that disconnects mid-stream (its request
must be aborted and its KV blocks freed)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import anyio
import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from asyncgen.fetch import smollm2  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name three colors."}]

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: pathlib.Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"server not ready after {timeout:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The example as its README runs it (no --model: the bundled SmolLM2), on a free port."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("fastapi") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_MODEL"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, "examples/fastapi_server.py", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--num-kv-blocks", "256", "--max-request-mb", "1",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_ready(proc, url + "/health", log, timeout=300)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
async def client(server):
    async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused") as c:
        yield c


async def _stats(server: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{server}/stats")).json()


async def test_models_list_names_the_model(client):
    page = await client.models.list()
    assert [m.id for m in page.data] == [MODEL]
    assert page.data[0].object == "model"
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")


async def test_chat_completion(client):
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert isinstance(resp, ChatCompletion)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
    assert abs(resp.created - time.time()) < 600
    [choice] = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


async def test_sdk_parse_gets_the_pydantic_model(client):
    """The SDK's structured-outputs helper: it sends the model's strict JSON Schema as
    response_format and parses the reply into the model."""
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=12)
        kind: Literal["cat", "dog", "bird"]
        age: int
        owner: Optional[str] = Field(max_length=12)

    ask = [{"role": "user", "content": "Describe a pet as JSON with name, kind, age and owner."}]
    resp = await client.chat.completions.parse(model=MODEL, messages=ask, response_format=Pet, max_tokens=200,
                                               temperature=0.7, seed=5)
    [choice] = resp.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content)


async def test_sdk_tool_calls_whole_streamed_and_parsed(client):
    """Tool calling with the official SDK: a forced call, the same call through the SDK's
    stream helper (which rebuilds calls from the chunks' pieces), and parse() with a
    pydantic tool, whose arguments come back as the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The current weather in a city."""

        city: str = Field(max_length=20)
        unit: Literal["celsius", "fahrenheit"]

    tools = [openai.pydantic_function_tool(GetWeather)]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=ask, tools=tools, tool_choice="required", max_tokens=80, temperature=0)
    whole = await client.chat.completions.create(**kw)
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.function.name == "GetWeather" and c.id for c in calls)
    for c in calls:
        GetWeather.model_validate_json(c.function.arguments)
    async with client.chat.completions.stream(**kw) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(isinstance(c.function.parsed_arguments, GetWeather) for c in streamed)
    assert final.choices[0].finish_reason == "tool_calls"
    parsed = await client.chat.completions.parse(**kw)
    assert [c.function.parsed_arguments for c in parsed.choices[0].message.tool_calls] == [
        GetWeather.model_validate_json(c.function.arguments) for c in calls]
    # the reply goes back as history, with the tool's answer
    history = ask + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 degrees"} for c in calls]
    after = await client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                                 max_tokens=20, temperature=0)
    assert after.choices[0].message.content and after.choices[0].message.tool_calls is None


async def test_responses_api_whole_streamed_and_a_function_call(client):
    """OpenAI's Responses API through the SDK: output_text, the SDK's stream helper over
    the server's events, and a forced function call."""
    from openai.types.responses import Response as SDKResponse

    kw = dict(model=MODEL, input="Name three colors.", max_output_tokens=30, temperature=0)
    resp = await client.responses.create(**kw)
    assert isinstance(resp, SDKResponse) and resp.id.startswith("resp_") and resp.status == "completed"
    assert resp.output_text and resp.usage.output_tokens <= 30
    async with client.responses.stream(**kw) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == resp.output_text
    weather = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                              "required": ["city"], "additionalProperties": False}}
    called = await client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[weather],
                                           tool_choice="required", max_output_tokens=40, temperature=0)
    assert called.status == "completed" and called.output
    for item in called.output:
        assert item.type == "function_call" and item.name == "get_weather" and item.call_id
        assert isinstance(json.loads(item.arguments)["city"], str)


async def test_chat_stream_matches_non_streamed(client):
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert all(isinstance(c, ChatCompletionChunk) and c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


async def test_completions_streamed_and_not(client):
    prompt = "The capital of France is"
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert isinstance(whole, Completion) and whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    echoed = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + whole.choices[0].text


async def test_n_choices_and_logprobs(client):
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=7, logprobs=True, top_logprobs=3
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for choice in resp.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
        assert all(bytes(t.bytes).decode(errors="replace") == t.token for t in content)
    comp = await client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 4
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


async def test_embeddings_through_the_sdk(client):
    texts = ["The capital of France is Paris.", "Dogs are loyal."]
    packed = await client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64 and decodes it
    floats = await client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in packed.data] == [0, 1]
    for a, b in zip(packed.data, floats.data):
        assert len(a.embedding) == 576 and a.embedding == pytest.approx(b.embedding, abs=1e-6)
        assert sum(v * v for v in a.embedding) == pytest.approx(1.0, abs=1e-4)
    assert packed.usage.prompt_tokens == packed.usage.total_tokens > 0
    short = await client.embeddings.create(model=MODEL, input="Hi", dimensions=64, encoding_format="float")
    assert len(short.data[0].embedding) == 64
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model=MODEL, input="")


async def test_several_clients_at_once_one_leaving(server):
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused") as c:
            if i % 2:
                stream = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=10, stream=True
                )
                results[i] = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            else:
                resp = await c.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=10, seed=i)
                results[i] = resp.choices[0].text

    async def leaver() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused") as c:
            stream = await c.completions.create(
                model=MODEL, prompt="A long tale:", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in stream:
                break
            await stream.close()

    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            tg.start_soon(leaver)
            for i in range(6):
                tg.start_soon(one, i)
    assert sorted(results) == list(range(6)) and all(results.values())
    with anyio.fail_after(60):
        while (await _stats(server))["num_running"]:
            await anyio.sleep(0.1)
    stats = await _stats(server)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_model_from_flag_env_or_bundled(monkeypatch):
    spec = importlib.util.spec_from_file_location("fastapi_server", REPO_ROOT / "examples" / "fastapi_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("ASYNCGEN_MODEL", "/models/from-env")
    assert module.resolve_model("/models/from-flag") == "/models/from-flag"
    assert module.resolve_model() == "/models/from-env"
    monkeypatch.delenv("ASYNCGEN_MODEL")
    assert module.resolve_model() == str(smollm2())


async def test_disconnect_mid_stream_aborts_and_frees_blocks(client, server):
    before = await _stats(server)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a very long story."}],
        max_tokens=1500, stream=True, extra_body={"ignore_eos": True},
    )
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 3:
            break
    during = await _stats(server)
    assert during["num_running"] == 1 and during["num_free_blocks"] < during["num_total_blocks"]
    await stream.close()  # drops the connection mid-stream

    with anyio.fail_after(60):
        while True:
            stats = await _stats(server)
            if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
                break
            await anyio.sleep(0.1)
    assert stats["num_waiting"] == 0
    assert stats["num_finished_requests"] == before["num_finished_requests"] + 1
    assert stats["num_generation_tokens"] - before["num_generation_tokens"] < 1500


async def test_errors_are_openai_error_objects(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:  # refused before the event stream starts
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, extra_body={"colour": 1})
    assert e.value.param == "colour" and "Unrecognized request argument" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.param == "tool_choice" and "tool_call_parser" in e.value.message  # auto needs a parser
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 3000}])
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found"
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post(f"{server}/v1/nope", json={})
        assert r.status_code == 404 and "/v1/nope" in r.json()["error"]["message"]
        r = await http.get(f"{server}/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    stats = await _stats(server)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


async def test_oversized_and_too_deep_bodies_are_refused_and_the_connection_serves_on(server):
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    big = json.dumps({**chat, "messages": [{"role": "user", "content": "a" * 2**20}]}).encode()

    async def chunked():  # no Content-Length: the limit holds as the body arrives
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    async with httpx.AsyncClient(base_url=server, timeout=60) as http:
        for content in (big, chunked()):
            r = await http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large" and "1048576 bytes" in r.json()["error"]["message"]
        deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = await http.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert "nested too deeply" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json=chat)  # the same connection
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


async def test_tokenize_and_detokenize_routes(server):
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{server}/tokenize", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
        back = await http.post(f"{server}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]})
        assert back.status_code == 200 and "<|im_start|>" in back.json()["prompt"]
        bad = await http.post(f"{server}/tokenize", json={"model": MODEL})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


async def test_metrics_count_every_request_and_health_answers(client, server):
    async with httpx.AsyncClient() as http:
        before = await http.get(f"{server}/metrics")
        assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
        await client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3,
                                        extra_body={"ignore_eos": True})
        text = (await http.get(f"{server}/metrics")).text
        health = await http.get(f"{server}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}

    def value(body: str, name: str) -> float:
        line = next(ln for ln in body.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    # The request above, read by the OpenAI layer, is counted without any host code.
    name = 'asyncgen:request_success_total{finished_reason="length",model_name="SmolLM2-135M-Instruct"}'
    assert name in text
    assert value(text, "asyncgen:engine_running") == 1
    assert value(text, "asyncgen:request_generation_tokens_count") == value(
        before.text, "asyncgen:request_generation_tokens_count"
    ) + 1
    assert value(text, "asyncgen:time_to_first_token_seconds_count") >= 1


def test_health_is_503_once_the_engine_is_down():
    from fastapi.testclient import TestClient

    spec = importlib.util.spec_from_file_location("fastapi_server", REPO_ROOT / "examples" / "fastapi_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = module.create_app(max_model_len=256, num_kv_blocks=16)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        engine = app.state.engine

        class Down:  # the engine as it is after a failed step or aclose()
            is_running = False

        app.state.engine = Down()
        r = http.get("/health")
        app.state.engine = engine
    assert r.status_code == 503 and r.json() == {"status": "down"}
