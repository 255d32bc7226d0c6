"""An OpenAI-compatible HTTP server in one file: FastAPI + asyncgen.

    python examples/fastapi_server.py --host 127.0.0.1 --port 8000 [--model DIR] [--tool-call-parser NAME]
        [--max-request-mb 32] [--graceful-shutdown-s 10]

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``
(OpenAI's Responses API), each JSON or, with ``"stream": true``, server-sent events (the
Responses API's as ``event: <type>`` and ``data: {json}`` lines, with no ``[DONE]``);
``POST /v1/embeddings`` (the final hidden state at each input's last token, JSON); vLLM's
``POST /tokenize`` and ``POST /detokenize``;
``GET /v1/models``, ``GET /v1/models/{id}``, plus ``GET /health`` (200 while the engine
serves, 503 once it is down, for a load balancer's or orchestrator's probe), ``GET /stats``
(the engine's load and KV-cache figures) and, where ``prometheus-client`` is installed,
``GET /metrics`` (every request's timings and the engine's counters in Prometheus' text
format; docs/METRICS.md).

The model is ``--model``, else ``$ASYNCGEN_MODEL``, else the bundled SmolLM2-135M-Instruct.
``--tool-call-parser`` says how the model writes tool calls, for ``tool_choice="auto"``
(default: from its chat template; ``required`` and named functions need none).
The official client works unchanged but for the address::

    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    async for chunk in await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], stream=True):
        print(chunk.choices[0].delta.content or "", end="")
    resp = await client.responses.create(model="SmolLM2-135M-Instruct", input="Hi")
    print(resp.output_text)

The engine lives in the app's lifespan: it starts before the first request and closes at
shutdown, which waits up to ``--graceful-shutdown-s`` for open requests to finish (the
rest are cut off, their generations aborted). Request bodies over ``--max-request-mb``
get a 413, and an unforeseen failure a 500 in OpenAI's error shape (logged with its
traceback). A client that disconnects mid-request gets its generation aborted and its
KV blocks freed at once: for a stream, Starlette stops iterating the event generator and
the ``finally`` below closes the engine stream; for a plain request, the handler is
cancelled as soon as the server reports the disconnect.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, Optional

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncgen import AsyncEngine
from asyncgen.openai import (
    APIStatusError, AsyncStream, BadRequestError, OpenAIAdapter, from_exception, response_sse_stream, sse_stream,
)

log = logging.getLogger("fastapi_server")


def resolve_model(model: Optional[str] = None) -> str:
    """``model``, else ``$ASYNCGEN_MODEL``, else the bundled SmolLM2 (built on first use)."""
    model = model or os.environ.get("ASYNCGEN_MODEL")
    if model:
        return model
    from asyncgen.fetch import smollm2

    return str(smollm2())


def create_app(model: Optional[str] = None, tool_call_parser: Optional[str] = "auto",
               max_request_bytes: int = 32 * 2**20, **engine_kwargs: Any) -> FastAPI:
    """The app; ``engine_kwargs`` go to ``AsyncEngine.from_pretrained`` (``max_model_len``,
    ``num_kv_blocks``, ``max_num_seqs``, ...), ``tool_call_parser`` to ``OpenAIAdapter``;
    bodies over ``max_request_bytes`` get a 413."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with AsyncEngine.from_pretrained(resolve_model(model), **engine_kwargs) as engine:
            app.state.engine = engine
            app.state.openai = OpenAIAdapter(engine, tool_call_parser=tool_call_parser)
            app.state.metrics = _metrics_registry(engine)
            yield

    app = FastAPI(title="asyncgen OpenAI-compatible server", lifespan=lifespan)
    app.state.max_request_bytes = max_request_bytes

    @app.exception_handler(APIStatusError)
    async def openai_error(request: Request, exc: APIStatusError) -> JSONResponse:
        return JSONResponse(exc.to_response().to_dict(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # An unknown route (404) or method (405) answers in OpenAI's error shape too.
        body = {"message": f"{exc.detail}: {request.method} {request.url.path}", "type": "invalid_request_error",
                "param": None, "code": None}
        return JSONResponse({"error": body}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        adapter: OpenAIAdapter = request.app.state.openai
        return await _respond(request, adapter.create_chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        adapter: OpenAIAdapter = request.app.state.openai
        return await _respond(request, adapter.create_completion)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        adapter: OpenAIAdapter = request.app.state.openai
        return await _respond(request, adapter.create_response, response_sse_stream)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        adapter: OpenAIAdapter = request.app.state.openai
        return await _respond(request, adapter.create_embedding)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        adapter: OpenAIAdapter = request.app.state.openai
        return await _respond(request, adapter.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        adapter: OpenAIAdapter = request.app.state.openai
        return await _respond(request, adapter.detokenize)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        return request.app.state.openai.list_models().to_dict()

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> dict:
        return request.app.state.openai.retrieve_model(model).to_dict()

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if request.app.state.engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "down"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = request.app.state.metrics
        if registry is None:
            raise StarletteHTTPException(404, "Not Found (pip install prometheus-client to serve /metrics)")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats(request: Request) -> dict:
        return asdict(request.app.state.engine.stats())

    return app


def _metrics_registry(engine: AsyncEngine) -> Any:
    """A Prometheus registry with the engine's collector (it records every request), or
    None without prometheus_client."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        return None
    from asyncgen.metrics import EngineCollector

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry


async def _read_json(request: Request) -> Any:
    """The request's JSON body; a 413 past ``app.state.max_request_bytes`` (counted as it
    arrives, so a body without a Content-Length is cut off too), a 400 for anything that
    is not JSON (nesting deeper than the parser goes included)."""
    limit = request.app.state.max_request_bytes
    too_large = APIStatusError(f"The request body is larger than this server's limit of {limit} bytes.",
                               status_code=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequestError(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise BadRequestError("The request body is not valid JSON: it is nested too deeply.",
                              code="invalid_json") from None


async def _respond(request: Request, create, events_of=sse_stream) -> Response:
    """``create``'s result for the request's JSON body: a JSON response, or the server-sent
    events ``events_of`` makes of a stream."""
    body = await _read_json(request)
    result = await _unless_disconnected(request, create, body)
    if isinstance(result, Response):
        return result
    if isinstance(result, AsyncStream):
        # Whether iteration ends, fails or is cut short by a disconnect, closing the event
        # generator closes the engine stream; the background task makes sure it is closed
        # even if Starlette drops the generator without finishing it.
        events = events_of(result)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(events.aclose),
        )
    return JSONResponse(result.to_dict())


async def _unless_disconnected(request: Request, create, body: Any):
    """``await create(body)``, cancelled (which aborts the generation) if the client goes
    away first. The body is already read, so the next ASGI message can only be the
    disconnect. A streamed result returns at once; its disconnects are StreamingResponse's."""

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    result = error = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        try:
            result = await create(body)
        except Exception as e:  # an unforeseen failure answers as OpenAI's 500 does, and is logged
            error = from_exception(e)
            if error.status_code >= 500:
                log.error("request failed", exc_info=e)
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    if result is None:  # the client left; nobody is waiting for an answer
        return Response(status_code=499)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=None, help="model directory (default: $ASYNCGEN_MODEL, else SmolLM2)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-request-mb", type=float, default=32, help="larger request bodies get a 413")
    parser.add_argument(
        "--graceful-shutdown-s", type=float, default=10,
        help="at shutdown, how long open requests may go on before their connections are cut and the engine "
        "closes",
    )
    parser.add_argument(
        "--tool-call-parser", default="auto",
        help="how the model writes tool calls, for tool_choice=auto: hermes, llama3_json, mistral, or auto "
        "(from the chat template)",
    )
    args = parser.parse_args(argv)
    app = create_app(
        args.model, tool_call_parser=args.tool_call_parser, max_request_bytes=int(args.max_request_mb * 2**20),
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=args.graceful_shutdown_s)


if __name__ == "__main__":
    main()
