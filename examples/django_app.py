"""A Django project in one file: async views that stream from asyncgen.

    python examples/django_app.py --host 127.0.0.1 --port 8000 [--model DIR] [--graceful-shutdown-s 10]

Views:

* ``GET /write?topic=...&max_tokens=...``: a short article on the topic, streamed as plain
  text with ``StreamingHttpResponse`` (open it in a browser, or ``curl -N``).
* ``POST /v1/chat/completions``: OpenAI-compatible, JSON or server-sent events.
* ``GET /v1/models``.
* ``GET /stats``: the engine's counters (``engine.stats()``) as JSON.

Django serves async views and async streaming only under an ASGI server, where one event
loop runs for the life of the process; the engine lives in that loop. Django itself has
no startup hook for async resources, so ``application`` below wraps Django's ASGI app and
answers the ASGI lifespan protocol: the engine starts when the server starts and closes
when it stops. Stopping (Ctrl+C, SIGTERM) waits up to ``--graceful-shutdown-s`` for open
responses to finish; the rest are cut off and their generations aborted as the engine
closes. (Under ``runserver``, a WSGI server, each request gets a new event loop,
and an engine cannot outlive one; use an ASGI server.)

When a client disconnects, Django's ASGI handler cancels the task that is streaming the
response; the cancellation reaches the ``async for`` over the engine stream, which aborts
the request and frees its KV blocks.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import Any, Optional

import django
from django.conf import settings

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY=os.environ.get("DJANGO_SECRET_KEY", "asyncgen-example-not-secret"),
        ALLOWED_HOSTS=["127.0.0.1", "localhost", "testserver"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=[],
        MIDDLEWARE=[],
        DATABASES={},
        USE_TZ=True,
    )
    django.setup()

from django.core.asgi import get_asgi_application  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.http import require_GET, require_POST  # noqa: E402

from asyncgen import AsyncEngine, SamplingParams  # noqa: E402
from asyncgen.openai import APIStatusError, AsyncStream, InternalServerError, OpenAIAdapter, sse_stream  # noqa: E402

_engine: Optional[AsyncEngine] = None
_adapter: Optional[OpenAIAdapter] = None


async def start_engine(model: Optional[str] = None, **engine_kwargs: Any) -> AsyncEngine:
    """Loads and starts the engine in the running event loop (the server's)."""
    global _engine, _adapter
    if model is None:
        from asyncgen.fetch import smollm2

        model = os.environ.get("ASYNCGEN_MODEL") or str(smollm2())
    engine = AsyncEngine.from_pretrained(model, **engine_kwargs)
    await engine.start()
    _engine, _adapter = engine, OpenAIAdapter(engine)
    return engine


async def stop_engine() -> None:
    global _engine, _adapter
    engine, _engine, _adapter = _engine, None, None
    if engine is not None:
        await engine.aclose()


def _openai() -> OpenAIAdapter:
    if _adapter is None:
        raise InternalServerError("The engine is not running.", status_code=503)
    return _adapter


def _error(exc: APIStatusError) -> JsonResponse:
    return JsonResponse(exc.to_response().to_dict(), status=exc.status_code)


# --- views ------------------------------------------------------------------------------------
@require_GET
async def write(request: HttpRequest) -> HttpResponse:
    """Streams a short article on ``topic`` as plain text."""
    topic = request.GET.get("topic", "").strip()
    if not topic:
        return HttpResponse("Give a topic: /write?topic=...\n", status=400, content_type="text/plain")
    try:
        max_tokens = min(int(request.GET.get("max_tokens", "300")), 1000)
        engine = _openai().engine
        messages = [
            {"role": "system", "content": "You are a writer. Answer with the article only."},
            {"role": "user", "content": f"Write a short article about {topic}."},
        ]
        stream = engine.stream(messages=messages, params=SamplingParams(max_tokens=max_tokens, temperature=0.7))
    except ValueError as e:  # a bad max_tokens, or a request the engine refuses
        return HttpResponse(f"{e}\n", status=400, content_type="text/plain")
    except APIStatusError as e:
        return _error(e)

    async def text():
        async with stream:  # closed, and so aborted, however the response ends
            async for chunk in stream:
                if chunk.text:
                    yield chunk.text

    return StreamingHttpResponse(text(), content_type="text/plain; charset=utf-8")


@require_POST
async def chat_completions(request: HttpRequest) -> HttpResponse:
    try:
        body = json.loads(request.body or b"null")
    except ValueError as e:
        return JsonResponse({"error": {"message": f"The request body is not valid JSON: {e}",
                                       "type": "invalid_request_error", "param": None, "code": "invalid_json"}},
                            status=400)
    try:
        result = await _openai().create_chat_completion(body)
    except APIStatusError as e:
        return _error(e)
    if isinstance(result, AsyncStream):
        response = StreamingHttpResponse(sse_stream(result), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        return response
    return JsonResponse(result.to_dict())


@require_GET
async def models(request: HttpRequest) -> HttpResponse:
    try:
        return JsonResponse(_openai().list_models().to_dict())
    except APIStatusError as e:
        return _error(e)


@require_GET
async def stats(request: HttpRequest) -> HttpResponse:
    try:
        return JsonResponse(asdict(_openai().engine.stats()))
    except APIStatusError as e:
        return _error(e)


urlpatterns = [
    path("write", write),
    path("v1/chat/completions", chat_completions),
    path("v1/models", models),
    path("stats", stats),
]


# --- ASGI -------------------------------------------------------------------------------------
class EngineLifespan:
    """Django's ASGI application plus the lifespan protocol, which starts the engine when
    the server starts and closes it when the server stops."""

    def __init__(self, app, **engine_kwargs: Any):
        self.app = app
        self.engine_kwargs = engine_kwargs

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await start_engine(**self.engine_kwargs)
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await stop_engine()
                await send({"type": "lifespan.shutdown.complete"})
                return


application = EngineLifespan(get_asgi_application())


def main(argv: Optional[list[str]] = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="A Django app streaming from asyncgen.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="model directory (default: $ASYNCGEN_MODEL, else SmolLM2)")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--graceful-shutdown-s", type=float, default=10,
        help="at shutdown, how long open responses may go on before their connections are cut and the engine "
        "closes",
    )
    args = parser.parse_args(argv)
    application.engine_kwargs = {
        "model": args.model, "num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len,
    }
    uvicorn.run(application, host=args.host, port=args.port, lifespan="on",
                timeout_graceful_shutdown=args.graceful_shutdown_s)


if __name__ == "__main__":
    main()
