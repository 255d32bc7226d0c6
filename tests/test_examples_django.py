"""examples/django_app.py with Django's async test client (the views, streaming with
StreamingHttpResponse) and as a raw ASGI app (lifespan, client disconnect)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import anyio
import pytest

pytest.importorskip("django")

from asyncgen.fetch import smollm2  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "django_app.py"
MODEL = "SmolLM2-135M-Instruct"
ENGINE_KWARGS = {"num_kv_blocks": 256, "max_model_len": 2048}

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # Django's async support is asyncio's


@pytest.fixture(scope="module")
def app():
    spec = importlib.util.spec_from_file_location("django_app", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["django_app"] = module  # ROOT_URLCONF names the module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
async def engine(app, anyio_backend):
    engine = await app.start_engine(str(smollm2()), **ENGINE_KWARGS)
    yield engine
    await app.stop_engine()


@pytest.fixture
def client(engine):
    from django.test import AsyncClient

    return AsyncClient()


def idle(engine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


async def test_write_streams_plain_text(client, engine):
    response = await client.get("/write", {"topic": "rain", "max_tokens": "24"})
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    pieces = [piece async for piece in response.streaming_content]
    assert len(pieces) > 3
    assert b"".join(pieces).decode().strip()
    assert idle(engine)


async def test_write_rejects_bad_input(client):
    assert (await client.get("/write")).status_code == 400
    assert (await client.get("/write", {"topic": "rain", "max_tokens": "lots"})).status_code == 400


async def test_chat_completions_sse(client, engine):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/chat/completions", body, content_type="application/json")
    assert response.status_code == 200 and response["Content-Type"] == "text/event-stream"
    raw = b"".join([piece async for piece in response.streaming_content]).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 10
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])

    body["stream"] = False
    del body["stream_options"]
    response = await client.post("/v1/chat/completions", body, content_type="application/json")
    whole = response.json()
    assert response.status_code == 200 and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == streamed
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == MODEL
    assert idle(engine)


async def test_chat_completions_errors(client):
    response = await client.post("/v1/chat/completions", {"model": MODEL, "messages": []}, content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    response = await client.post("/v1/chat/completions", "{oops", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_disconnect_aborts_the_stream(app, engine):
    """Drives the ASGI app as a server would, with the client leaving after the first
    piece of text: Django cancels the response and the engine frees the request."""
    pieces: list[bytes] = []
    gone = anyio.Event()
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            pieces.append(message["body"])
            gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": "/write", "raw_path": b"/write", "query_string": b"topic=a+very+long+story&max_tokens=1000",
        "headers": [(b"host", b"testserver")], "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
    }
    with anyio.fail_after(120):
        await app.application(scope, receive, send)
        while not idle(engine):
            await anyio.sleep(0.05)
    assert len(pieces) < 50  # stopped early, not after 1000 tokens


async def test_lifespan_starts_and_stops_the_engine(app, monkeypatch):
    calls = []

    async def start_engine(**kwargs):
        calls.append(("start", kwargs))

    async def stop_engine():
        calls.append(("stop",))

    monkeypatch.setattr(app, "start_engine", start_engine)
    monkeypatch.setattr(app, "stop_engine", stop_engine)
    events = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = []

    async def receive():
        return events.pop(0)

    async def send(message):
        sent.append((message["type"], list(calls)))

    lifespan = app.EngineLifespan(app.application.app, model="some/dir", num_kv_blocks=64)
    await lifespan({"type": "lifespan"}, receive, send)
    start = ("start", {"model": "some/dir", "num_kv_blocks": 64})
    assert sent == [("lifespan.startup.complete", [start]), ("lifespan.shutdown.complete", [start, ("stop",)])]


async def test_failed_startup_is_reported(app, monkeypatch):
    async def start_engine(**kwargs):
        raise FileNotFoundError("no model there")

    monkeypatch.setattr(app, "start_engine", start_engine)
    sent = []

    async def receive():
        return {"type": "lifespan.startup"}

    async def send(message):
        sent.append(message)

    await app.EngineLifespan(app.application.app)({"type": "lifespan"}, receive, send)
    assert sent == [{"type": "lifespan.startup.failed", "message": "FileNotFoundError: no model there"}]


async def test_no_engine_is_a_503(app, client):
    running, app._engine, app._adapter = (app._engine, app._adapter), None, None
    try:
        response = await client.get("/v1/models")
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
    finally:
        app._engine, app._adapter = running


def test_a_stop_signal_with_a_response_streaming_exits_after_the_grace_period(tmp_path):
    """The example as a user runs it: SIGTERM while a long article streams. The server
    waits ``--graceful-shutdown-s`` for it, then cuts it off and closes the engine,
    instead of waiting for the whole generation (minutes on a CPU)."""
    import os
    import signal
    import socket
    import subprocess
    import threading
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(EXAMPLE.parents[1]), os.environ.get(
        "PYTHONPATH")) if p)}
    log = tmp_path / "server.log"
    cmd = [sys.executable, str(EXAMPLE), "--port", str(port), "--model", str(smollm2()), "--num-kv-blocks", "256",
           "--max-model-len", "2048", "--graceful-shutdown-s", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.25)
        started = threading.Event()
        received: list[bytes] = []

        def read():
            try:
                with httpx.stream("GET", url + "/write", params={"topic": "the sea", "max_tokens": "1000"},
                                  timeout=60) as response:
                    for piece in response.iter_bytes():
                        received.append(piece)
                        started.set()
            except httpx.HTTPError:
                pass  # cut off at shutdown
            started.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert started.wait(120) and received
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - signalled
        reader.join(10)
        assert took < 12, f"exited {took:.1f} s after SIGTERM"
        assert "Waiting for connections to close" in log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
