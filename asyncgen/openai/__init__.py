"""OpenAI compatibility without a server: OpenAI's request, response, chunk and error
schemas (:mod:`.protocol`), the adapter that serves them with an engine
(:class:`OpenAIAdapter`, :func:`sse_stream`), and an in-process client with the
surface of ``openai.AsyncOpenAI`` (:class:`InProcessOpenAI`, also ``engine.openai_client()``).

A host serving ``/v1/chat/completions`` needs three lines around its framework::

    adapter = OpenAIAdapter(engine)
    result = await adapter.create_chat_completion(await request.json())   # APIStatusError on bad input
    # a ChatCompletion, or an AsyncStream: sse_stream(result) gives the "data: ..." events
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
    "StreamOptions",
    "TopLogprob",
    "from_exception",
    "sse_stream",
    "to_sampling_params",
]
