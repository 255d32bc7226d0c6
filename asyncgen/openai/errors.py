"""Errors shaped like the official ``openai`` SDK's, and the mapping from engine errors.

::

    OpenAIError
    └── APIError                   .message .body .type .param .code
        └── APIStatusError         .status_code; .to_response() is OpenAI's error object
            ├── BadRequestError    400  invalid_request_error (bad field, prompt too long, ...)
            ├── NotFoundError      404  invalid_request_error, code model_not_found
            └── InternalServerError  500/503  server_error (the engine died or is not running)

``body`` is the inner error object (``{"message", "type", "param", "code"}``), as in the
SDK, so ``except openai.BadRequestError as e: e.param`` code reads the same here.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from pydantic import ValidationError

from ..errors import EngineDeadError, EngineStateError, InvalidRequestError, PromptTooLongError

__all__ = [
    "APIError",
    "APIStatusError",
    "BadRequestError",
    "InternalServerError",
    "NotFoundError",
    "OpenAIError",
    "from_exception",
    "from_validation_error",
]


class OpenAIError(Exception):
    """Base of the errors the in-process OpenAI client raises."""


class APIError(OpenAIError):
    def __init__(
        self,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ):
        self.body: dict[str, Any] = {"message": message, "type": type, "param": param, "code": code}
        self.type = type
        self.param = param
        self.code = code
        self.request = None
        super().__init__(message)

    @property
    def message(self) -> str:
        return self.body["message"]

    def to_response(self):
        """OpenAI's error object: ``ErrorResponse(error=ErrorObject(...))``."""
        from .protocol import ErrorObject, ErrorResponse

        return ErrorResponse(error=ErrorObject(**self.body))


class APIStatusError(APIError):
    status_code: int = 500

    def __init__(self, message: str, *, status_code: Optional[int] = None, **kwargs: Any):
        super().__init__(message, **kwargs)
        if status_code is not None:
            self.status_code = status_code
        self.response = None
        self.request_id = None

    def __str__(self) -> str:
        return f"Error code: {self.status_code} - {{'error': {self.body!r}}}"


class BadRequestError(APIStatusError):
    status_code = 400


class NotFoundError(APIStatusError):
    status_code = 404


class InternalServerError(APIStatusError):
    status_code = 500

    def __init__(self, message: str, **kwargs: Any):
        kwargs.setdefault("type", "server_error")
        super().__init__(message, **kwargs)


def from_exception(
    exc: BaseException, *, prompt_param: str = "messages", fields: Optional[Mapping[str, str]] = None
) -> APIStatusError:
    """The OpenAI-shaped error for an exception raised while serving a request.

    ``prompt_param`` is the request field the prompt came from ("messages" or "prompt"),
    named by errors about the prompt (too long, no chat template, bad token ids); an
    error about a sampling field names it, renamed by ``fields`` where the request
    spells it differently (``{"max_tokens": "max_completion_tokens"}``).
    Exceptions that are not request errors become a 500 without internal details.
    """
    if isinstance(exc, APIStatusError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, InvalidRequestError):
        param = prompt_param if exc.param is None else (fields or {}).get(exc.param, exc.param)
        code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
        err = BadRequestError(_client_names(str(exc), fields), param=param, code=code)
    elif isinstance(exc, EngineDeadError):
        err = InternalServerError(f"The engine stopped: {exc}")
    elif isinstance(exc, EngineStateError):
        err = InternalServerError(f"The engine is not serving: {exc}", status_code=503)
    else:
        err = InternalServerError("The server had an error while processing your request.")
    err.__cause__ = exc
    return err


# Entries pydantic puts in an error's location that are not request fields: union members
# ("str", "list[...]") and the tag a discriminated union picked (a message's role, a content
# part's type), which comes right after a list index.
_UNION_MEMBERS = {"str", "int", "float", "bool", "none", "dict", "list"}
_TAGS = {"system", "developer", "user", "assistant", "tool", "function", "text", "refusal", "image_url",
         "input_audio", "file"}
# Discriminated fields that are not in a list: the member's tag follows the field's name.
_FIELD_TAGS = {
    "response_format": {"text", "json_object", "json_schema", "structural_tag"},
    "tool_choice": {"function", "allowed_tools", "custom"},
}


def _param(loc: tuple, field_names: dict[str, str], tags_after_index=_TAGS, field_tags=_FIELD_TAGS) -> Optional[str]:
    """The dotted field path of a pydantic location, without the steps that name a union
    member or a validator, nor the tags of chat messages' and parts' unions
    (``tags_after_index``, after a list index) and of ``field_tags``' fields."""
    out = ""
    after_index = False
    tags: set = set()
    for item in loc:
        if isinstance(item, str) and (item in _UNION_MEMBERS or "[" in item or item.startswith("function-")):
            continue  # a union's or validator's own step: the field's name and tag go on around it
        if item in tags:
            tags = set()
            continue
        tags = field_tags.get(item, set()) if isinstance(item, str) else set()
        if isinstance(item, int):
            out += f"[{item}]"
            after_index = True
            continue
        if after_index and item in tags_after_index:
            after_index = False
            continue
        after_index = False
        item = field_names.get(item, item) if not out else item
        out += f".{item}" if out else item
    return out or None


def _most_specific(errors: list[dict]) -> dict:
    """Of the errors about the first invalid field, the one that says the most: a value
    that does not fit one member of a union ("should be a valid string") says less than
    one that went deeper into the member the client evidently meant."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    return min(same, key=lambda e: (e["type"].endswith("_type"), -len(e["loc"])))


def _client_names(text: str, field_names: Optional[Mapping[str, str]]) -> str:
    """``text`` with each field named as the request spells it (``field_names``: the
    engine's name -> the request's), whole words only."""
    for name, client in (field_names or {}).items():
        if client != name:
            text = re.sub(rf"\b{re.escape(name)}\b", client, text)
    return text


def from_validation_error(exc: ValidationError, field_names: Optional[dict[str, str]] = None) -> BadRequestError:
    """A 400 naming the first invalid field; ``field_names`` renames top-level fields
    (e.g. SamplingParams' ``logprobs`` to the chat request's ``top_logprobs``), in the
    parameter and in the message. A value refused because of another field's (a check of
    the whole model, which pydantic gives no location) names the field in its
    ``ctx["field"]``."""
    first = _most_specific(exc.errors())
    kind = first["type"]
    loc = tuple(first["loc"])
    if not loc and "field" in first.get("ctx", {}):
        loc = (first["ctx"]["field"],)
    param = _param(loc, field_names or {})
    if kind.startswith("union_tag") and "discriminator" in first.get("ctx", {}):
        param = f"{param}.{first['ctx']['discriminator'].strip(chr(39))}"
    if kind == "extra_forbidden":
        code = "unknown_parameter"
        if param and "." not in param and "[" not in param:
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"Unknown parameter: '{param}'."
    elif kind == "missing":
        code = "missing_required_parameter"
        message = f"Missing required parameter: '{param}'."
    else:
        code = "invalid_type" if kind.endswith(("_type", "_parsing")) or kind.startswith("union_tag") else "invalid_value"
        where = f"'{param}'" if param else "the request"
        text = first["msg"]
        if kind == "value_error":  # a validator's own message, without pydantic's "Value error, "
            text = text.removeprefix("Value error, ")
        text = _client_names(text, field_names)
        message = f"Invalid {'type' if code == 'invalid_type' else 'value'} for {where}: {text}."
    err = BadRequestError(message, param=param, code=code)
    err.__cause__ = exc
    return err
