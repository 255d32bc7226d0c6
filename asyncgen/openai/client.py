"""``InProcessOpenAI``: the surface of ``openai.AsyncOpenAI`` over an engine, with no HTTP.

::

    client = engine.openai_client()
    resp = await client.chat.completions.create(model=client.model, messages=[...])
    print(resp.choices[0].message.content)

    stream = await client.chat.completions.create(model=..., messages=[...], stream=True)
    async for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="")

    resp = await client.responses.create(model=client.model, input="Hi")   # the Responses API
    print(resp.output_text)

Arguments are the SDK's: request fields as keywords, plus ``extra_body`` (merged into
the request, e.g. ``{"top_k": 20}``), ``extra_headers``, ``extra_query`` and ``timeout``
(accepted and ignored: there is no HTTP). The SDK's ``NOT_GIVEN`` / ``omit`` sentinels
count as absent, and values are taken as the SDK sends them: a tuple or a generator as a
list, a reply's ``message`` or ``output`` items put back into the history as their JSON.
Errors are :mod:`asyncgen.openai.errors` classes with the SDK's names and attributes
(``BadRequestError.status_code``, ``.param``, ``.body``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Optional

from pydantic import BaseModel

from .adapter import OpenAIAdapter
from .protocol import Model, ModelList

__all__ = ["InProcessOpenAI"]

_SENTINELS = ("NotGiven", "Omit")


def _request(params: dict[str, Any], extra_body: Optional[dict[str, Any]]) -> dict[str, Any]:
    body = {k: _as_sent(v) for k, v in params.items() if type(v).__name__ not in _SENTINELS}
    if extra_body:
        body.update(_as_sent(extra_body))
    return body


def _as_sent(value: Any) -> Any:
    """``value`` as the SDK would send it in JSON: a response object (a reply's
    ``message`` or a Responses ``output`` item put back into the history) as its fields,
    a mapping as a dict, any other iterable (a tuple, a generator) as a list."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return {k: _as_sent(v) for k, v in value.items()}
    if isinstance(value, (str, bytes, bytearray)):
        return value
    if isinstance(value, Iterable):
        return [_as_sent(v) for v in value]
    return value


class _Endpoint:
    """One ``create`` endpoint: the SDK's keywords in, the adapter's method called."""

    _method = ""

    def __init__(self, adapter: OpenAIAdapter):
        self._adapter = adapter

    async def create(
        self,
        *,
        extra_headers: Any = None,
        extra_query: Any = None,
        extra_body: Optional[dict[str, Any]] = None,
        timeout: Any = None,
        **params: Any,
    ) -> Any:
        return await getattr(self._adapter, self._method)(_request(params, extra_body))


class _ChatCompletions(_Endpoint):
    """``create``: a ChatCompletion, or an AsyncStream of ChatCompletionChunk with ``stream=True``."""

    _method = "create_chat_completion"


class _Chat:
    def __init__(self, adapter: OpenAIAdapter):
        self.completions = _ChatCompletions(adapter)


class _Completions(_Endpoint):
    """``create``: a Completion, or an AsyncStream of Completion chunks with ``stream=True``."""

    _method = "create_completion"


class _Responses(_Endpoint):
    """``create``: a Response, or an AsyncStream of its events with ``stream=True``."""

    _method = "create_response"


class _Embeddings(_Endpoint):
    """``create``: a CreateEmbeddingResponse (``encoding_format`` "float" unless asked:
    the SDK's default base64 is its own transport, which it decodes)."""

    _method = "create_embedding"


class _ModelPage:
    """What ``models.list()`` returns: await it for the ModelList (``.data``), or iterate
    it with ``async for`` for the models, as with the SDK's paginator."""

    def __init__(self, page: ModelList):
        self._page = page

    def __await__(self):
        async def page() -> ModelList:
            return self._page

        return page().__await__()

    async def __aiter__(self):
        for model in self._page.data:
            yield model


class _Models:
    def __init__(self, adapter: OpenAIAdapter):
        self._adapter = adapter

    def list(self, **_: Any) -> _ModelPage:
        return _ModelPage(self._adapter.list_models())

    async def retrieve(self, model: str, **_: Any) -> Model:
        return self._adapter.retrieve_model(model)


class InProcessOpenAI:
    """``openai.AsyncOpenAI``'s ``chat.completions``, ``completions``, ``responses``,
    ``embeddings`` and ``models``, answered by ``engine`` in the caller's event loop.

    The client does not own the engine: closing the client leaves the engine running.
    ``model_names`` are the names accepted in ``model`` (default: the engine's
    ``model_name``); ``client.model`` is the first, handy for ``model=client.model``.
    ``tool_call_parser`` and ``reasoning_parser`` are :class:`OpenAIAdapter`'s.
    """

    def __init__(self, engine, *, model_names: Optional[list[str]] = None, tool_call_parser: Optional[str] = "auto",
                 reasoning_parser: Optional[str] = "auto"):
        self.adapter = OpenAIAdapter(engine, model_names=model_names, tool_call_parser=tool_call_parser,
                                     reasoning_parser=reasoning_parser)
        self.chat = _Chat(self.adapter)
        self.completions = _Completions(self.adapter)
        self.responses = _Responses(self.adapter)
        self.embeddings = _Embeddings(self.adapter)
        self.models = _Models(self.adapter)

    @property
    def model(self) -> str:
        return self.adapter.model_names[0]

    def with_options(self, **_: Any) -> "InProcessOpenAI":
        """The SDK's per-call options (timeouts, retries) mean nothing in-process."""
        return self

    async def close(self) -> None:
        """Nothing to release; the engine stays up (the caller owns it)."""

    async def __aenter__(self) -> "InProcessOpenAI":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
