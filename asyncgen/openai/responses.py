"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat layer.

:func:`create_response` reads a Responses request (:class:`ResponseCreateRequest`),
turns it into a chat completion request, runs that through
:meth:`OpenAIAdapter.create_chat_completion` and turns the result into a
:class:`Response`, or the chunks of a streamed one into Responses streaming events. So
everything the chat layer does (tools and every ``tool_choice``, structured outputs,
reasoning, error mapping, aborting a closed stream) works the same here; an error the
chat layer raises names the Responses field it came from (``input``,
``max_output_tokens``, ``text.format.schema``, ``tools[0].parameters``, ...).

Mapping notes:

* ``input``: a string (one user message) or a list of items: messages (``role`` user,
  system, developer or assistant; ``content`` a string or ``input_text`` parts, and for
  the assistant ``output_text`` / ``refusal`` parts, as the output sends them back),
  ``function_call`` items (joined, with an assistant message right before them, into one
  assistant message with ``tool_calls``) and ``function_call_output`` items (``tool``
  messages). ``reasoning`` items are accepted and skipped: the chat template is not shown
  earlier reasoning. ``instructions`` becomes a leading system message.
* ``max_output_tokens`` is the chat request's ``max_completion_tokens`` (any value from 1;
  absent: until the end of the turn or ``max_model_len``). ``temperature``, ``top_p``,
  ``parallel_tool_calls`` and function ``tools`` (``{"type": "function", "name", ...}``)
  with ``tool_choice`` ``"none"``, ``"auto"``, ``"required"``, ``{"type": "function",
  "name"}`` or ``{"type": "allowed_tools", "mode", "tools"}`` are the chat request's.
  ``text.format`` (``text``, ``json_object``, ``json_schema``) is its ``response_format``.
* Accepted and ignored: ``metadata`` (echoed), ``user``, ``store`` (nothing is stored:
  the response says ``"store": false``), ``service_tier``, ``prompt_cache_key`` and the
  other prompt-cache fields, ``safety_identifier``, ``max_tool_calls`` (there are no
  built-in tools), ``reasoning.summary``, ``text.verbosity``, ``stream_options``.
* Refused with a 400 naming the field (code ``unsupported_parameter``): anything that
  needs stored state (``previous_response_id``, ``conversation``, ``background``,
  ``prompt`` templates, ``context_management``, ``item_reference`` inputs), ``include``
  with any value, ``top_logprobs`` above 0, ``reasoning.effort``, ``truncation="auto"``,
  ``moderation``, image, file and audio inputs, and tools other than functions (web
  search, file search, computer use, MCP, custom, shell, ...).
* vLLM-style sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
  ``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``,
  ``truncate_prompt_tokens``, ``priority``, ``structured_outputs``, ``chat_template_kwargs``) and the
  chat fields ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty`` are accepted
  (``extra_body`` in the SDK) and passed to the chat request.

The output holds, in this order: a ``reasoning`` item when the chat message has
``reasoning_content`` (the text in its ``content`` as one ``reasoning_text`` part; the
``summary`` is empty), a ``message`` item with one ``output_text`` part (left out when the
reply is only tool calls), and one ``function_call`` item per tool call (``call_id`` is the
chat tool call's id). ``status`` is "completed", or "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when the output hit its token limit
(``max_output_tokens`` or the end of the context), or "abort" when the engine ended the
request early (the chat layer's finish reason "abort"); the last output item is then
"incomplete" too. ``usage.output_tokens_details.reasoning_tokens`` counts the tokens of
the reasoning text as the tokenizer encodes it (the ``<think>`` markers not counted).

Streamed (``stream: true``), the events are, with ``sequence_number`` counting from 0:
``response.created`` and ``response.in_progress`` (the response with status
"in_progress" and no output), then for each output item, in the order the model writes
them, ``response.output_item.added``; for reasoning ``response.content_part.added``,
``response.reasoning_text.delta``..., ``response.reasoning_text.done``,
``response.content_part.done``; for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for a function call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``;
then ``response.output_item.done``. The last event is ``response.completed`` or
``response.incomplete`` with the whole response. An error after the first event raises
from the stream (as chat streams do); :func:`response_sse_stream` sends it as an ``error``
event. Closing the stream aborts the generation.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, AsyncGenerator, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from .adapter import AsyncStream
from .adapter import _parse as _parse_request
from .errors import APIStatusError, BadRequestError, _most_specific, _param, from_validation_error
from .protocol import (
    ChatCompletion,
    LogitBias,
    OpenAIObject,
    Penalty,
    Stop,
    Temperature,
    TopP,
    VLLMSamplingFields,
    _Strict,
    _unsupported,
)

__all__ = [
    "Response",
    "ResponseCreateRequest",
    "ResponseFunctionToolCall",
    "ResponseOutputMessage",
    "ResponseOutputText",
    "ResponseReasoningItem",
    "ResponseStreamEvent",
    "ResponseUsage",
    "create_response",
    "response_sse_stream",
]


# --- requests ---------------------------------------------------------------------------------
class _Loose(BaseModel):
    """An item of a kind this server refuses: only its ``type`` is read."""

    model_config = ConfigDict(extra="allow")

    type: str


def _tagged(*members: tuple[type, str], field: str = "type", message_if_role: bool = False):
    """A union picked by the value of ``field`` (members: (model, value)); anything else is
    the last member, which takes every value. The tags are ``kind:<value>``, and are taken
    out of error locations (:func:`_validation_error`)."""
    values = {value for _, value in members}
    fallback = members[-1][1]

    def pick(v: Any) -> str:
        t = v.get(field) if isinstance(v, Mapping) else getattr(v, field, None)
        if message_if_role and t is None and isinstance(v, Mapping) and "role" in v:
            t = "message"
        return f"kind:{t if t in values else fallback}"

    return Annotated[
        Union[tuple(Annotated[cls, Tag(f"kind:{value}")] for cls, value in members)],  # type: ignore[misc]
        Discriminator(pick),
    ]


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: Optional[dict[str, Any]] = None


class OutputTextPart(_Strict):
    """An ``output_text`` part of an assistant message sent back in the input."""

    type: Literal["output_text"]
    text: str
    annotations: Optional[list[Any]] = None
    logprobs: Optional[list[Any]] = None


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


ContentPart = _tagged((InputText, "input_text"), (OutputTextPart, "output_text"), (RefusalPart, "refusal"),
                      (_Loose, "other"))


class MessageItem(_Strict):
    """``{"role", "content"}``, with ``"type": "message"`` or without."""

    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, Annotated[list[ContentPart], Field(min_length=1)]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    phase: Optional[Literal["commentary", "final_answer"]] = None


class FunctionCallItem(_Strict):
    """A call the model made, sent back in the input."""

    model_config = ConfigDict(populate_by_name=True)  # merged with _Strict's

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    caller: Optional[dict[str, Any]] = None
    namespace: Optional[str] = None
    async_: Optional[bool] = Field(default=None, alias="async")


class FunctionCallOutputItem(_Strict):
    """What a call returned: a ``tool`` message for the chat template."""

    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    caller: Optional[dict[str, Any]] = None
    name: Optional[str] = None
    namespace: Optional[str] = None


class ReasoningInputItem(_Strict):
    """Earlier reasoning sent back in the input (skipped)."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: Optional[list[Any]] = None
    content: Optional[list[Any]] = None
    encrypted_content: Optional[str] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


InputItem = _tagged(
    (MessageItem, "message"), (FunctionCallItem, "function_call"), (FunctionCallOutputItem, "function_call_output"),
    (ReasoningInputItem, "reasoning"), (_Loose, "other"), message_if_role=True,
)


class FunctionToolParam(_Strict):
    """A function tool as the Responses API spells it: ``{"type": "function", "name", ...}``."""

    model_config = ConfigDict(populate_by_name=True)  # merged with _Strict's

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None
    allowed_callers: Optional[list[str]] = None
    output_schema: Optional[dict[str, Any]] = None
    async_: Optional[bool] = Field(default=None, alias="async")

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


ToolParam = _tagged((FunctionToolParam, "function"), (_Loose, "other"))


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ToolChoiceAllowed(_Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[dict[str, Any]], Field(min_length=1)]


_ToolChoiceObject = _tagged((ToolChoiceFunction, "function"), (ToolChoiceAllowed, "allowed_tools"), (_Loose, "other"))
ToolChoice = Union[Literal["none", "auto", "required"], _ToolChoiceObject]


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    model_config = ConfigDict(populate_by_name=True)  # merged with _Strict's

    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    # ("schema" on the wire; the attribute would shadow BaseModel.schema)
    schema_: dict[str, Any] = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None  # the schema is always enforced


TextFormat = _tagged((TextFormatText, "text"), (TextFormatJSONObject, "json_object"),
                     (TextFormatJSONSchema, "json_schema"), (_Loose, "other"))


class TextConfig(_Strict):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None  # accepted; the model decides


class ReasoningConfig(_Strict):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None


class ResponseStreamOptions(_Strict):
    include_obfuscation: Optional[bool] = None  # accepted; nothing to obfuscate


# Fields passed to the chat request as they are (vLLM's extensions and a few chat fields).
_PASSED = (
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "structured_outputs", "chat_template_kwargs", "seed", "stop", "presence_penalty",
    "frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "priority",
)


class ResponseCreateRequest(VLLMSamplingFields):
    """The body of ``POST /v1/responses``. Null means "the default" for every optional field."""

    model: str
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    tools: Optional[list[ToolParam]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    stream: Optional[bool] = False
    stream_options: Optional[ResponseStreamOptions] = None
    # labels and routing: accepted and ignored
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    access_programs: Optional[dict[str, Any]] = None
    image: Optional[dict[str, Any]] = None
    max_tool_calls: Optional[Annotated[int, Field(ge=1)]] = None
    # refused unless absent or neutral (check_supported)
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    include: Optional[list[str]] = None
    reasoning: Optional[ReasoningConfig] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    background: Optional[bool] = None
    background_options: Optional[dict[str, Any]] = None
    context_management: Optional[list[Any]] = None
    moderation: Optional[dict[str, Any]] = None
    prompt: Optional[dict[str, Any]] = None
    # extensions (vLLM's sampling fields from VLLMSamplingFields, and these), passed to the chat request
    chat_template_kwargs: Optional[dict[str, Any]] = None
    seed: Optional[int] = None
    stop: Optional[Stop] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    logit_bias: Optional[LogitBias] = None

    @model_validator(mode="after")
    def _consistent(self) -> "ResponseCreateRequest":
        if self.stream_options is not None and not self.stream:
            raise BadRequestError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
            )
        return self

    def check_supported(self) -> None:
        """Refuses (BadRequestError naming the field) what this server does not implement."""
        for name, what in (
            ("previous_response_id", "previous_response_id (nothing is stored)"),
            ("conversation", "conversations (nothing is stored)"),
            ("background_options", "background responses"),
            ("moderation", "moderation"),
            ("prompt", "prompt templates"),
        ):
            if getattr(self, name) is not None:
                _unsupported(name, what)
        if self.background:
            _unsupported("background", "background responses")
        if self.context_management:
            _unsupported("context_management", "context management")
        if self.include:
            _unsupported("include", f"include ({', '.join(map(repr, self.include))})")
        if self.top_logprobs:
            _unsupported("top_logprobs", "top_logprobs")
        if self.truncation == "auto":
            _unsupported("truncation", "truncation 'auto'")
        if self.reasoning is not None and self.reasoning.effort is not None:
            _unsupported("reasoning.effort", "reasoning.effort")
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, _Loose):
                _unsupported(f"tools[{i}].type", f"tools of type {tool.type!r}")
            if tool.defer_loading:
                _unsupported(f"tools[{i}].defer_loading", "deferred tool loading")
            if tool.async_:
                _unsupported(f"tools[{i}].async", "asynchronous function tools")
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, _Loose):
            raise BadRequestError(
                f"Invalid value for 'text.format.type': {fmt.type!r}; expected 'text', 'json_object' or 'json_schema'.",
                param="text.format.type", code="invalid_value",
            )
        choice = self.tool_choice
        if isinstance(choice, _Loose):
            _unsupported("tool_choice.type", f"tool_choice of type {choice.type!r}")
        if isinstance(choice, ToolChoiceAllowed):
            for j, ref in enumerate(choice.tools):
                if ref.get("type") != "function":
                    _unsupported(f"tool_choice.tools[{j}].type", f"allowed tools of type {ref.get('type')!r}")
                if not isinstance(ref.get("name"), str):
                    raise BadRequestError(f"Missing required parameter: 'tool_choice.tools[{j}].name'.",
                                          param=f"tool_choice.tools[{j}].name", code="missing_required_parameter")
        if isinstance(self.input, list):
            for i, item in enumerate(self.input):
                if isinstance(item, _Loose):
                    what = "item references (nothing is stored)" if item.type == "item_reference" else None
                    _unsupported(f"input[{i}].type", what or f"input items of type {item.type!r}")
                parts = item.content if isinstance(item, MessageItem) else getattr(item, "output", None)
                field = "content" if isinstance(item, MessageItem) else "output"
                assistant = getattr(item, "role", None) == "assistant"
                for j, part in enumerate(parts if isinstance(parts, list) else ()):
                    where = f"input[{i}].{field}[{j}].type"
                    if isinstance(part, _Loose) and part.type in ("input_image", "input_file", "input_audio"):
                        _unsupported(where, f"input content of type {part.type!r}")
                    if not isinstance(part, (InputText, OutputTextPart, RefusalPart) if assistant else InputText):
                        allowed = "'input_text', 'output_text' or 'refusal'" if assistant else "'input_text'"
                        raise BadRequestError(f"Invalid value for '{where}': {part.type!r}; expected {allowed} here.",
                                              param=where, code="invalid_value")

    # --- the chat request ---------------------------------------------------------------------
    def chat_request(self) -> dict[str, Any]:
        """The chat completion request this one asks for (a dict, validated by the chat layer)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(), "stream": bool(self.stream)}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls", *_PASSED):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [t.chat_tool() for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, str):
            if self.tools or choice == "required":
                body["tool_choice"] = choice
        elif isinstance(choice, ToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif isinstance(choice, ToolChoiceAllowed):
            body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {
                "mode": choice.mode,
                "tools": [{"type": "function", "function": {"name": t["name"]}} for t in choice.tools],
            }}
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, TextFormatJSONSchema):
            schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in schema.items() if v is not None}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        assistant: Optional[dict[str, Any]] = None  # the assistant message function calls join
        for item in items:
            if isinstance(item, MessageItem):
                content: Any = item.content
                if isinstance(content, list):
                    content = [{"type": "refusal", "refusal": p.refusal} if isinstance(p, RefusalPart)
                               else {"type": "text", "text": p.text} for p in content]
                messages.append({"role": item.role, "content": content})
                assistant = messages[-1] if item.role == "assistant" else None
            elif isinstance(item, FunctionCallItem):
                if assistant is None:
                    assistant = {"role": "assistant", "content": None}
                    messages.append(assistant)
                assistant.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function",
                     "function": {"name": item.name, "arguments": item.arguments}}
                )
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output
                if isinstance(output, list):
                    output = "\n".join(p.text for p in output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
                assistant = None
            # reasoning items: skipped (they do not end the assistant's turn either)
        return messages

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response repeats them."""
        tools = [t.model_dump(by_alias=True, exclude_unset=True) for t in self.tools or ()]
        choice = self.tool_choice
        if choice is None:
            choice = "auto"
        elif not isinstance(choice, str):
            choice = choice.model_dump(by_alias=True, exclude_unset=True)
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text is not None else {}
        text.setdefault("format", {"type": "text"})
        text.setdefault("verbosity", "medium")
        return dict(
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            max_tool_calls=self.max_tool_calls,
            metadata=self.metadata or {},
            parallel_tool_calls=self.parallel_tool_calls is not False,
            prompt_cache_key=self.prompt_cache_key,
            reasoning={"effort": None, "summary": self.reasoning.summary if self.reasoning else None},
            safety_identifier=self.safety_identifier,
            temperature=1.0 if self.temperature is None else self.temperature,
            text=text,
            tool_choice=choice,
            tools=tools,
            top_logprobs=0,
            top_p=1.0 if self.top_p is None else self.top_p,
            user=self.user,
        )


# --- responses --------------------------------------------------------------------------------
class ResponseOutputText(OpenAIObject):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(OpenAIObject):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseReasoningText(OpenAIObject):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(OpenAIObject):
    """The model's reasoning (a thinking model's ``<think>`` block) as ``content``; no summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    encrypted_content: Optional[str] = None
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseFunctionToolCall(OpenAIObject):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = Annotated[
    Union[ResponseOutputMessage, ResponseReasoningItem, ResponseFunctionToolCall], Field(discriminator="type")
]


class InputTokensDetails(OpenAIObject):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIObject):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIObject):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIObject):
    reason: Optional[str] = None  # "max_output_tokens", or "abort" (the engine ended the request)


class Response(OpenAIObject):
    """A model response; ``output_text`` joins the text of its messages, as the SDK's does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled", "queued"]
    completed_at: Optional[int] = None
    error: Optional[dict[str, Any]] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    max_tool_calls: Optional[int] = None
    model: str
    output: list[ResponseOutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    store: bool = False
    temperature: Optional[float] = None
    text: Optional[dict[str, Any]] = None
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: Optional[int] = None
    top_p: Optional[float] = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False

    @property
    def output_text(self) -> str:
        return "".join(
            part.text for item in self.output if isinstance(item, ResponseOutputMessage) for part in item.content
            if isinstance(part, ResponseOutputText)
        )


# --- streaming events -------------------------------------------------------------------------
class ResponseStreamEvent(OpenAIObject):
    """One streaming event: its ``type``, ``sequence_number`` and the fields of that type."""

    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseStreamEvent):
    """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``."""

    response: Response


class ResponseOutputItemEvent(ResponseStreamEvent):
    """``response.output_item.added`` and ``.done``."""

    output_index: int
    item: ResponseOutputItem


class ResponseContentPartEvent(ResponseStreamEvent):
    """``response.content_part.added`` and ``.done``."""

    item_id: str
    output_index: int
    content_index: int
    part: Annotated[Union[ResponseOutputText, ResponseReasoningText], Field(discriminator="type")]


class ResponseTextDeltaEvent(ResponseStreamEvent):
    """``response.output_text.delta``: a piece of a message's text."""

    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class ResponseTextDoneEvent(ResponseStreamEvent):
    """``response.output_text.done``: the message's whole text."""

    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ResponseReasoningTextDeltaEvent(ResponseStreamEvent):
    """``response.reasoning_text.delta``: a piece of the reasoning."""

    item_id: str
    output_index: int
    content_index: int
    delta: str


class ResponseReasoningTextDoneEvent(ResponseStreamEvent):
    """``response.reasoning_text.done``: the whole reasoning."""

    item_id: str
    output_index: int
    content_index: int
    text: str


class ResponseFunctionCallArgumentsDeltaEvent(ResponseStreamEvent):
    """``response.function_call_arguments.delta``: a piece of a call's arguments."""

    item_id: str
    output_index: int
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(ResponseStreamEvent):
    """``response.function_call_arguments.done``: the call's whole arguments."""

    item_id: str
    output_index: int
    arguments: str


# --- the conversion ---------------------------------------------------------------------------
async def create_response(adapter, request: Union[ResponseCreateRequest, Mapping[str, Any]]
                          ) -> Union[Response, AsyncStream[ResponseStreamEvent]]:
    """A :class:`Response`, or an :class:`AsyncStream` of events when ``request.stream``.
    Raises APIStatusError (BadRequestError naming the field, NotFoundError, ...) before
    anything is generated, as ``create_chat_completion`` does."""
    req = _parse(request)
    created = int(time.time())
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        result = await adapter.create_chat_completion(req.chat_request())
    except APIStatusError as e:
        raise _renamed(e)
    if req.stream:
        return AsyncStream(_events(adapter, req, result, rid, created))
    return _from_completion(adapter, req, result, rid, created)


def _parse(request: Any) -> ResponseCreateRequest:
    return _parse_request(ResponseCreateRequest, request, _validation_error)


def _validation_error(e: ValidationError) -> BadRequestError:
    """from_validation_error, with the union tags of this module out of the locations."""
    errors = []
    for d in e.errors(include_url=False):
        d = {k: d[k] for k in ("type", "loc", "input", "ctx") if k in d}
        d["loc"] = tuple(x for x in d["loc"] if not (isinstance(x, str) and x.startswith("kind:")))
        errors.append(d)
    try:
        cleaned = ValidationError.from_exception_data(e.title, errors)
    except Exception:  # an error pydantic cannot rebuild: the original, tags and all
        return from_validation_error(e)
    err = from_validation_error(cleaned)
    # Content parts' "text" / "refusal" follow a list index, where the generic reader takes
    # them for a chat message's tag: name the field from the location itself.
    param = _param(tuple(_most_specific(cleaned.errors())["loc"]), {}, tags_after_index=(), field_tags={})
    if param and err.param and param != err.param and param.startswith(err.param):
        _set_param(err, param)
    return err


def _set_param(err: APIStatusError, param: Optional[str]) -> None:
    old = err.param
    if old is not None and param is not None:
        err.body["message"] = err.body["message"].replace(f"'{old}'", f"'{param}'")
    err.body["param"] = err.param = param


_TEXT_RENAMES = (("'response_format'", "'text.format'"), ("response_format", "text.format"),
                 ("'max_completion_tokens'", "'max_output_tokens'"), ("max_completion_tokens", "max_output_tokens"),
                 ("'messages'", "'input'"))


def _renamed(err: APIStatusError) -> APIStatusError:
    """A chat layer's error, naming the Responses request's field."""
    param = err.param
    if param is not None:
        new = param
        if param.startswith("messages"):
            new = "input"
        elif param == "max_completion_tokens":
            new = "max_output_tokens"
        elif param.startswith("response_format"):
            new = "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
        else:
            m = re.match(r"tools\[(\d+)\]\.function(.*)$", param)
            if m:
                new = f"tools[{m.group(1)}]{m.group(2)}"
        if new != param:
            _set_param(err, new)
    message = err.body["message"]
    for old, new_text in _TEXT_RENAMES:
        message = message.replace(old, new_text)
    err.body["message"] = message
    return err


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish_reason: Optional[str]) -> tuple[str, Optional[IncompleteDetails]]:
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    if finish_reason in ("abort", None):
        return "incomplete", IncompleteDetails(reason="abort")
    return "completed", None


def _usage(adapter, usage, reasoning: str) -> ResponseUsage:
    """A response's usage from its chat completion's (``CompletionUsage``)."""
    prompt_tokens, completion_tokens = usage.prompt_tokens, usage.completion_tokens
    details = usage.prompt_tokens_details
    cached = InputTokensDetails(cached_tokens=details.cached_tokens if details is not None else 0)
    reasoning_tokens = 0
    if reasoning:
        try:
            reasoning_tokens = len(adapter.engine.tokenizer.encode(reasoning, add_special_tokens=False))
        except Exception:
            reasoning_tokens = 0
    return ResponseUsage(
        input_tokens=prompt_tokens, input_tokens_details=cached, output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning_tokens, completion_tokens)),
    )


def _response(req: ResponseCreateRequest, rid: str, created: int, status: str, output: list,
              incomplete: Optional[IncompleteDetails] = None, usage: Optional[ResponseUsage] = None) -> Response:
    return Response(
        id=rid, created_at=created, status=status, model=req.model, output=output, usage=usage,
        incomplete_details=incomplete, completed_at=int(time.time()) if status == "completed" else None, **req.echo(),
    )


def _from_completion(adapter, req: ResponseCreateRequest, completion: ChatCompletion, rid: str,
                     created: int) -> Response:
    choice = completion.choices[0]
    message = choice.message
    status, incomplete = _status(choice.finish_reason)
    output: list[Any] = []
    if message.reasoning_content:
        output.append(ResponseReasoningItem(
            id=_new_id("rs"), content=[ResponseReasoningText(text=message.reasoning_content)], status="completed"))
    if message.content or not message.tool_calls:
        output.append(ResponseOutputMessage(
            id=_new_id("msg"), status="completed", content=[ResponseOutputText(text=message.content or "")]))
    for call in message.tool_calls or ():
        output.append(ResponseFunctionToolCall(
            id=_new_id("fc"), call_id=call.id, name=call.function.name, arguments=call.function.arguments,
            status="completed",
        ))
    if status == "incomplete":
        output[-1].status = "incomplete"
    u = completion.usage
    usage = _usage(adapter, u, message.reasoning_content or "") if u else None
    return _response(req, rid, created, status, output, incomplete, usage)


class _EventWriter:
    """The events of a streamed response, from the chat deltas: each output item is
    opened at its first delta and closed when the next one opens, or at the end."""

    def __init__(self):
        self.seq = 0
        self.output: list[Any] = []
        self.open: Optional[int] = None  # output index of the open item
        self.calls: dict[int, int] = {}  # chat tool call index -> output index
        self.reasoning = ""

    def event(self, cls: type, type: str, **fields: Any) -> ResponseStreamEvent:
        e = cls(type=type, sequence_number=self.seq, **fields)
        self.seq += 1
        return e

    def _add(self, item: Any) -> list[ResponseStreamEvent]:
        """Opens ``item`` (a message or reasoning with no content yet, or a call)."""
        self.output.append(item)
        index = self.open = len(self.output) - 1
        events = [self.event(ResponseOutputItemEvent, "response.output_item.added", output_index=index,
                             item=item.model_copy(deep=True))]
        part = None
        if isinstance(item, ResponseOutputMessage):
            part = ResponseOutputText(text="")
        elif isinstance(item, ResponseReasoningItem):
            part = ResponseReasoningText(text="")
        if part is not None:
            item.content.append(part)
            events.append(self._part("response.content_part.added", index, part.model_copy()))
        return events

    def _part(self, type: str, index: int, part: Any) -> ResponseStreamEvent:
        return self.event(ResponseContentPartEvent, type, item_id=self.output[index].id, output_index=index,
                          content_index=0, part=part)

    def text(self, delta: str, reasoning: bool) -> list[ResponseStreamEvent]:
        """A piece of the reasoning or of the message's text."""
        kind = ResponseReasoningItem if reasoning else ResponseOutputMessage
        events: list[ResponseStreamEvent] = []
        if self.open is None or not isinstance(self.output[self.open], kind):
            events += self.close()
            events += self._add(kind(id=_new_id("rs" if reasoning else "msg"), status="in_progress"))
        item = self.output[self.open]
        item.content[0].text += delta
        if reasoning:
            self.reasoning += delta
            events.append(self.event(ResponseReasoningTextDeltaEvent, "response.reasoning_text.delta",
                                     item_id=item.id, output_index=self.open, content_index=0, delta=delta))
        else:
            events.append(self.event(ResponseTextDeltaEvent, "response.output_text.delta", item_id=item.id,
                                     output_index=self.open, content_index=0, delta=delta))
        return events

    def call(self, piece) -> list[ResponseStreamEvent]:
        """A piece of a tool call: the first (with the id and name) opens its item."""
        events: list[ResponseStreamEvent] = []
        fn = piece.function
        if piece.id is not None:
            events += self.close()
            events += self._add(ResponseFunctionToolCall(
                id=_new_id("fc"), call_id=piece.id, name=(fn.name if fn else None) or "", arguments="",
                status="in_progress",
            ))
            self.calls[piece.index] = self.open
        index = self.calls.get(piece.index)
        if index is not None and fn is not None and fn.arguments:
            item = self.output[index]
            item.arguments += fn.arguments
            events.append(self.event(ResponseFunctionCallArgumentsDeltaEvent, "response.function_call_arguments.delta",
                                     item_id=item.id, output_index=index, delta=fn.arguments))
        return events

    def close(self, status: str = "completed") -> list[ResponseStreamEvent]:
        """The done events of the open item, if any."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.output[index]
        item.status = status
        events = []
        if isinstance(item, ResponseFunctionToolCall):
            events.append(self.event(ResponseFunctionCallArgumentsDoneEvent, "response.function_call_arguments.done",
                                     item_id=item.id, output_index=index, arguments=item.arguments))
        else:
            part = item.content[0]
            if isinstance(item, ResponseReasoningItem):
                events.append(self.event(ResponseReasoningTextDoneEvent, "response.reasoning_text.done",
                                         item_id=item.id, output_index=index, content_index=0, text=part.text))
            else:
                events.append(self.event(ResponseTextDoneEvent, "response.output_text.done", item_id=item.id,
                                         output_index=index, content_index=0, text=part.text))
            events.append(self._part("response.content_part.done", index, part.model_copy()))
        events.append(self.event(ResponseOutputItemEvent, "response.output_item.done", output_index=index,
                                 item=item.model_copy(deep=True)))
        return events

    def finish(self, status: str) -> list[ResponseStreamEvent]:
        """The last item's done events; an empty message first if nothing was written."""
        events: list[ResponseStreamEvent] = []
        if not self.output:
            events += self._add(ResponseOutputMessage(id=_new_id("msg"), status="in_progress"))
        return events + self.close(status)


async def _events(adapter, req: ResponseCreateRequest, chunks: AsyncStream, rid: str, created: int):
    w = _EventWriter()
    shell = _response(req, rid, created, "in_progress", [])
    finish_reason = None
    usage = None
    try:
        yield w.event(ResponseLifecycleEvent, "response.created", response=shell)
        yield w.event(ResponseLifecycleEvent, "response.in_progress", response=shell.model_copy(deep=True))
        async for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                delta = choice.delta
                if delta.reasoning_content:
                    for e in w.text(delta.reasoning_content, reasoning=True):
                        yield e
                if delta.content:
                    for e in w.text(delta.content, reasoning=False):
                        yield e
                for piece in delta.tool_calls or ():
                    for e in w.call(piece):
                        yield e
                if choice.finish_reason is not None:
                    finish_reason = choice.finish_reason
    except APIStatusError as e:
        raise _renamed(e)
    finally:
        await chunks.close()
    status, incomplete = _status(finish_reason)
    for e in w.finish(status):
        yield e
    u = _usage(adapter, usage, w.reasoning) if usage is not None else None
    final = _response(req, rid, created, status, [item.model_copy(deep=True) for item in w.output], incomplete, u)
    yield w.event(ResponseLifecycleEvent, f"response.{status}", response=final)


async def response_sse_stream(stream: AsyncStream) -> AsyncGenerator[str, None]:
    """Server-sent events for a streamed response: ``event: <type>\\ndata: {json}\\n\\n``
    per event, and no ``[DONE]`` (the Responses API sends none). An error after the first
    event (the engine died) is sent as an ``error`` event (``code``, ``message``,
    ``param``). Closing this iterator closes ``stream`` and aborts the request."""
    seq = 0
    try:
        async for event in stream:
            seq = event.sequence_number + 1
            yield f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
    except APIStatusError as e:
        error = {"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param,
                 "sequence_number": seq}
        yield f"event: error\ndata: {json.dumps(error)}\n\n"
    finally:
        await stream.close()
