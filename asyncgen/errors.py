"""Every exception asyncgen raises on purpose.

::

    AsyncGenError
    ├── ModelLoadError                 the model cannot be served: its directory, or no
    │   │                              device, kernels or KV-cache room for it as configured
    │   ├── ModelNotFoundError         no such directory, no config.json, hub unreachable
    │   ├── UnsupportedModelError      architecture or option asyncgen does not implement
    │   └── WeightsError               missing, mis-shaped or unreadable tensors
    ├── InvalidRequestError            a request the engine refuses (also a ValueError)
    │   ├── PromptTooLongError         prompt (+ max_tokens) over max_model_len or the pool
    │   └── DuplicateRequestError      a request_id already in use
    ├── EngineStateError               used before start(), after aclose(), entered twice,
    │                                  from another thread's loop; a stream read by two tasks
    └── EngineDeadError                a model step failed; every live stream gets this

Invalid ``SamplingParams`` raise pydantic's ``ValidationError`` (itself a ValueError),
which names the field.
"""

from __future__ import annotations

__all__ = [
    "AsyncGenError",
    "DuplicateRequestError",
    "EngineDeadError",
    "EngineStateError",
    "InvalidRequestError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "UnsupportedModelError",
    "WeightsError",
]


class AsyncGenError(Exception):
    """Base class of asyncgen's own errors."""


class ModelLoadError(AsyncGenError):
    """The model cannot be loaded and served as configured: a problem with its directory,
    or a device or KV-cache budget that cannot hold it (no CUDA device for
    ``device="cuda"``, an ``ops_backend`` the device cannot run, a budget without room for
    one KV block or a pool too large to allocate, ``max_model_len`` past the model's
    ``max_position_embeddings``)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """No model at the given path (or the hub id could not be resolved)."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint asks for an architecture or option that asyncgen does not implement."""


class WeightsError(ModelLoadError):
    """A weight tensor is missing, has the wrong shape, or its file is unreadable."""


class InvalidRequestError(AsyncGenError, ValueError):
    """A request the engine refuses; the engine keeps serving the others.

    ``param`` names the :class:`~asyncgen.SamplingParams` field the error is about
    (``"max_tokens"``, ``"stop_token_ids"``, ...) or the call's argument
    (``"chat_template_kwargs"``), or None for the prompt itself.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit ``max_model_len`` or the KV pool."""


class DuplicateRequestError(InvalidRequestError):
    """A live request already uses this ``request_id``."""


class EngineStateError(AsyncGenError, RuntimeError):
    """The engine is not in a state that allows this call (not started, closed, entered
    twice, called from outside the event loop it runs in), or a stream that another task
    is reading was asked for its next chunk."""


class EngineDeadError(AsyncGenError, RuntimeError):
    """A model step failed. The engine stopped and every live request ended with this error.

    ``__cause__`` holds the original exception.
    """
