"""OpenAI compatibility without a server: OpenAI's request, response, chunk and error
schemas (:mod:`.protocol`), the adapter that serves them with an engine
(:class:`OpenAIAdapter`, :func:`sse_stream`), and an in-process client with the
surface of ``openai.AsyncOpenAI`` (:class:`InProcessOpenAI`, also ``engine.openai_client()``).

A host serving ``/v1/chat/completions`` needs three lines around its framework::

    adapter = OpenAIAdapter(engine)
    result = await adapter.create_chat_completion(await request.json())   # APIStatusError on bad input
    # a ChatCompletion, or an AsyncStream: sse_stream(result) gives the "data: ..." events

``adapter.create_response(body)`` serves ``/v1/responses`` (OpenAI's Responses API,
:mod:`.responses`) the same way; :func:`response_sse_stream` gives its events.
"""

from .adapter import AsyncStream, OpenAIAdapter, sse_stream, to_sampling_params
from .client import InProcessOpenAI
from .errors import (
    APIError,
    APIStatusError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    OpenAIError,
    from_exception,
)
from .protocol import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChoiceDelta,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    ErrorObject,
    ErrorResponse,
    Model,
    ModelList,
    StreamOptions,
    TopLogprob,
)
from .responses import (
    Response,
    ResponseCreateRequest,
    ResponseStreamEvent,
    create_response,
    response_sse_stream,
)

__all__ = [
    "APIError",
    "APIStatusError",
    "AsyncStream",
    "BadRequestError",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionMessage",
    "ChatCompletionRequest",
    "ChatCompletionTokenLogprob",
    "ChoiceDelta",
    "ChoiceLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionUsage",
    "ErrorObject",
    "ErrorResponse",
    "InProcessOpenAI",
    "InternalServerError",
    "Model",
    "ModelList",
    "NotFoundError",
    "OpenAIAdapter",
    "OpenAIError",
    "Response",
    "ResponseCreateRequest",
    "ResponseStreamEvent",
    "StreamOptions",
    "TopLogprob",
    "create_response",
    "from_exception",
    "response_sse_stream",
    "sse_stream",
    "to_sampling_params",
]
