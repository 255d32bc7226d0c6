"""asyncgen: an embeddable async LLM inference engine.

::

    from asyncgen import AsyncEngine, SamplingParams

    async with AsyncEngine.from_pretrained(path) as engine:
        async for chunk in engine.stream("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="")
"""

from .config import EngineConfig
from .engine.async_engine import AsyncEngine, RequestStream
from .errors import (
    AsyncGenError,
    DuplicateRequestError,
    EngineDeadError,
    EngineStateError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
    WeightsError,
)
from .outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    EmbeddingOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    StreamChunk,
    TokenLogprob,
    Usage,
)
from .sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "AsyncGenError",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "DuplicateRequestError",
    "EmbeddingOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStateError",
    "EngineStats",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StreamChunk",
    "StructuredOutputsParams",
    "TokenLogprob",
    "UnsupportedModelError",
    "Usage",
    "WeightsError",
]
