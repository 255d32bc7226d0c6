"""OpenAI's wire format for chat completions, (legacy) completions, embeddings and models,
as pydantic models with OpenAI's field names and defaults.

Requests (``ChatCompletionRequest``, ``CompletionRequest``) are what a client sends;
they reject unknown fields the way OpenAI does ("Unrecognized request argument
supplied"). Fields OpenAI documents but this engine cannot honour (audio, custom
tools, predicted outputs, ...) are accepted when absent, null or at their neutral value and
refused otherwise by :meth:`ChatCompletionRequest.check_supported`, with ``param``
naming the field. ``response_format`` of type ``json_object`` and ``json_schema`` is
honoured (structured outputs: :class:`asyncgen.StructuredOutputsParams`), on completions
too as vLLM allows. Function ``tools`` are honoured with every ``tool_choice`` (``none``,
``auto``, ``required``, a named function, ``allowed_tools``); assistant ``tool_calls``
and ``tool`` messages in the history go to the chat template. Fields that only label or route a request (``user``, ``metadata``,
``store``, ``service_tier``, ``prompt_cache_key``, ...) are accepted and ignored.

A few sampling fields beyond OpenAI's, with vLLM's names (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``allowed_token_ids``,
``bad_words``, ``truncate_prompt_tokens``, ``priority``, ``structured_outputs``, e.g.
``{"choice": ["yes", "no"]}`` or ``{"regex": "[0-9]{3}"}``), are accepted as extensions,
and so are chat's ``chat_template_kwargs`` (variables for the chat template, such as
Qwen3's ``enable_thinking``), ``continue_final_message`` (the model goes on with the last
message, an assistant reply begun for it; the reply holds what it adds, or with ``echo``
the whole message) and ``add_generation_prompt``; the official client sends them through
``extra_body``. vLLM's ``use_beam_search`` (with ``length_penalty``) makes the ``n``
choices the ``n`` best sequences of a beam search of width ``n``; whole responses only,
without logprobs, stop sequences, penalties, tools or structured outputs (each refused
naming the field); the sampling fields (``temperature``, ``top_p``, ``seed``, ...) do not
apply to it.

Responses (``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``, ``ModelList``,
``ErrorResponse``) serialise to the JSON OpenAI sends. ``finish_reason`` is "stop" or
"length", or "abort" for a request the engine ended early (the client went away or the
engine shut down); like vLLM's OpenAI server, asyncgen passes "abort" through rather than
disguise it as a normal stop.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from .errors import BadRequestError

__all__ = [
    "AllowedToolsChoice",
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
    "ChatCompletionRequest",
    "ChatCompletionTokenLogprob",
    "ChatMessage",
    "ChoiceDelta",
    "ChoiceDeltaToolCall",
    "ChoiceDeltaToolCallFunction",
    "ChoiceLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionUsage",
    "CreateEmbeddingResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "DeveloperMessage",
    "Embedding",
    "EmbeddingRequest",
    "EmbeddingUsage",
    "ErrorObject",
    "ErrorResponse",
    "FinishReason",
    "Function",
    "FunctionCall",
    "FunctionDefinition",
    "FunctionMessage",
    "FunctionTool",
    "MessageToolCall",
    "Model",
    "ModelList",
    "NamedToolChoice",
    "PromptTokensDetails",
    "StreamOptions",
    "SystemMessage",
    "ToolMessage",
    "TokenizeRequest",
    "TokenizeResponse",
    "TopLogprob",
    "UserMessage",
    "VLLMSamplingFields",
]

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call", "abort"]

_MAX_STOP_SEQUENCES = 4  # OpenAI's documented limit
_MAX_N = 128


# --- requests ---------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalContentPart(_Strict):
    type: Literal["refusal"]
    refusal: str


class ImageURL(_Strict):
    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImageContentPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudioContentPart(_Strict):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class FileContentPart(_Strict):
    type: Literal["file"]
    file: dict[str, Any]


UserContentPart = Annotated[
    Union[TextContentPart, ImageContentPart, InputAudioContentPart, FileContentPart],
    Field(discriminator="type"),
]
AssistantContentPart = Annotated[Union[TextContentPart, RefusalContentPart], Field(discriminator="type")]
# A message's parts: a list, when sent, holds at least one (OpenAI refuses an empty one too).
TextParts = Annotated[list[TextContentPart], Field(min_length=1)]
UserParts = Annotated[list[UserContentPart], Field(min_length=1)]


class SystemMessage(_Strict):
    role: Literal["system"]
    content: Union[str, TextParts]
    name: Optional[str] = None


class DeveloperMessage(_Strict):
    """OpenAI's newer name for system instructions; rendered as a system message."""

    role: Literal["developer"]
    content: Union[str, TextParts]
    name: Optional[str] = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Union[str, UserParts]
    name: Optional[str] = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(_Strict):
    """A call the assistant made, as a client sends it back in the history."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class CustomMessageToolCall(_Strict):
    id: str
    type: Literal["custom"]
    custom: dict[str, Any]


MessageToolCallParam = Annotated[Union[MessageToolCall, CustomMessageToolCall], Field(discriminator="type")]


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Optional[Union[str, list[AssistantContentPart]]] = None
    name: Optional[str] = None
    refusal: Optional[str] = None
    audio: Optional[dict[str, Any]] = None
    tool_calls: Optional[list[MessageToolCallParam]] = None
    function_call: Optional[dict[str, Any]] = None
    # a thinking model's earlier reasoning, as replies carry it; templates that keep it render it
    reasoning_content: Optional[str] = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Union[str, TextParts]
    tool_call_id: str


class FunctionMessage(_Strict):
    role: Literal["function"]
    content: Optional[str] = None
    name: str


ChatMessage = Annotated[
    Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage],
    Field(discriminator="role"),
]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    include_obfuscation: Optional[bool] = None  # accepted; nothing to obfuscate in-process
    # vLLM's: with include_usage, every chunk that has a choice carries the usage so far
    # (that choice's completion tokens)
    continuous_usage_stats: Optional[bool] = None


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
Stop = Union[str, Annotated[list[str], Field(max_length=_MAX_STOP_SEQUENCES)]]
LogitBias = dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON Schema; absent: no parameters
    strict: Optional[bool] = None  # forced calls always follow the schema; "auto" ones do where true (hermes)


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class CustomTool(_Strict):
    type: Literal["custom"]
    custom: dict[str, Any]


Tool = Annotated[Union[FunctionTool, CustomTool], Field(discriminator="type")]


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Strict):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1)]


class AllowedToolsChoice(_Strict):
    """``{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}``:
    ``auto`` or ``required`` over a subset of ``tools``."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class CustomToolChoice(_Strict):
    type: Literal["custom"]
    custom: dict[str, Any]


ToolChoice = Union[
    Literal["none", "auto", "required"],
    Annotated[Union[NamedToolChoice, AllowedToolsChoice, CustomToolChoice], Field(discriminator="type")],
]


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJSONObject(_Strict):
    type: Literal["json_object"]


class JSONSchema(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Optional[str] = None
    # ("schema" on the wire; the attribute would shadow BaseModel.schema)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced


class ResponseFormatJSONSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchema


class StructuralTagStructure(_Strict):
    begin: str
    # ("schema" on the wire, as in JSONSchema)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    end: str


class ResponseFormatStructuralTag(_Strict):
    """vLLM's extension: free text in which each structure a trigger opens follows its
    schema (:func:`asyncgen.structured.structural_tag_grammar`)."""

    type: Literal["structural_tag"]
    structures: Annotated[list[StructuralTagStructure], Field(min_length=1)]
    triggers: Annotated[list[str], Field(min_length=1)]


ResponseFormat = Annotated[
    Union[ResponseFormatText, ResponseFormatJSONObject, ResponseFormatJSONSchema, ResponseFormatStructuralTag],
    Field(discriminator="type"),
]


class VLLMSamplingFields(_Strict):
    """Sampling fields beyond OpenAI's, with vLLM's names (``extra_body`` in the SDK)."""

    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    priority: Optional[int] = None  # under the engine's scheduling_policy="priority": lower first
    # vLLM's: {"json": schema} | {"json_object": true} | {"choice": [...]} | {"regex": "..."}
    # | {"structural_tag": {...}} (StructuredOutputsParams)
    structured_outputs: Optional[dict[str, Any]] = None


class _SamplingExtensions(VLLMSamplingFields):
    """vLLM's sampling fields and ``response_format``, shared by chat and completions."""

    # OpenAI's (chat), also taken on completions as vLLM does
    response_format: Optional[ResponseFormat] = None
    # vLLM's: the response holds the prompt's token ids and each choice's generated ones
    # (streamed: the prompt's in the first chunk, each chunk's own tokens in it)
    return_token_ids: Optional[bool] = None
    # vLLM's: the n choices are the n best sequences of a beam search of width n
    # (asyncgen.BeamSearchParams); length_penalty divides each score by length ** it
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None

    @property
    def include_usage(self) -> bool:
        """(``stream`` and ``stream_options`` are each subclass's fields.)"""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def structured_spec(self) -> Optional[tuple[str, dict[str, Any]]]:
        """(the field it came from, StructuredOutputsParams' arguments), or None."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if self.structured_outputs is not None:
                raise BadRequestError(
                    "Invalid value for 'structured_outputs': give either it or a response_format of type "
                    f"{fmt.type!r}, not both.", param="structured_outputs",
                )
            if isinstance(fmt, ResponseFormatJSONObject):
                return "response_format", {"json_object": True}
            if isinstance(fmt, ResponseFormatStructuralTag):
                return "response_format", {"structural_tag": fmt.model_dump(by_alias=True)}
            schema = fmt.json_schema.schema_
            return "response_format.json_schema.schema", {"json": True if schema is None else schema}
        if self.structured_outputs is not None:
            return "structured_outputs", self.structured_outputs
        return None


class ChatCompletionRequest(_SamplingExtensions):
    """The body of ``POST /v1/chat/completions``. Null means "the default" for every
    optional field, as in OpenAI's API."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    model: str
    # vLLM's extensions: extra variables for the chat template ({"enable_thinking": false});
    # go on with the last message instead of opening a turn (add_generation_prompt then
    # defaults to false; true with it is refused); open no turn after the last message.
    chat_template_kwargs: Optional[dict[str, Any]] = None
    continue_final_message: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    echo: Optional[bool] = None  # vLLM's: a reply to an assistant message starts with its text
    audio: Optional[dict[str, Any]] = None
    frequency_penalty: Optional[Penalty] = 0.0
    function_call: Optional[Union[str, dict[str, Any]]] = None
    functions: Optional[list[dict[str, Any]]] = None
    logit_bias: Optional[LogitBias] = None
    logprobs: Optional[bool] = False
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    metadata: Optional[dict[str, str]] = None
    modalities: Optional[list[Literal["text", "audio"]]] = None
    moderation: Optional[Any] = None
    n: Optional[Annotated[int, Field(ge=1, le=_MAX_N)]] = 1
    parallel_tool_calls: Optional[bool] = None
    prediction: Optional[dict[str, Any]] = None
    presence_penalty: Optional[Penalty] = 0.0
    prompt_cache_key: Optional[str] = None
    prompt_cache_options: Optional[Any] = None
    prompt_cache_retention: Optional[str] = None
    reasoning_effort: Optional[str] = None
    safety_identifier: Optional[str] = None
    seed: Optional[int] = None
    service_tier: Optional[str] = None
    stop: Optional[Stop] = None
    store: Optional[bool] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Temperature] = 1.0
    tool_choice: Optional[ToolChoice] = None
    tools: Optional[list[Tool]] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    top_p: Optional[TopP] = 1.0
    user: Optional[str] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        _check_stream_options(self.stream, self.stream_options)
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise BadRequestError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                param="tool_choice",
            )
        if self.tools:
            seen: set[str] = set()
            for i, tool in enumerate(self.tools):
                if isinstance(tool, FunctionTool):
                    if tool.function.name in seen:
                        raise BadRequestError(
                            f"Invalid 'tools[{i}].function.name': the name {tool.function.name!r} is used by "
                            "an earlier tool.", param=f"tools[{i}].function.name",
                        )
                    seen.add(tool.function.name)
            choice = self.tool_choice
            named = [choice] if isinstance(choice, NamedToolChoice) else []
            if isinstance(choice, AllowedToolsChoice):
                named = choice.allowed_tools.tools
            for t in named:
                if t.function.name not in seen:
                    raise BadRequestError(
                        f"Invalid value for 'tool_choice': no function named {t.function.name!r} in 'tools'.",
                        param="tool_choice",
                    )
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError(
                "Invalid value for 'top_logprobs': 'logprobs' must be set to true to use 'top_logprobs'.",
                param="top_logprobs",
            )
        return self

    def check_supported(self) -> None:
        """Refuses (BadRequestError naming the field) what this engine does not implement."""
        if self.functions:
            _unsupported("functions", "the deprecated 'functions' (use 'tools')")
        if self.function_call not in (None, "none", "auto"):
            _unsupported("function_call", "the deprecated 'function_call' (use 'tool_choice')")
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, CustomTool):
                _unsupported(f"tools[{i}].type", "tools of type 'custom'")
        if isinstance(self.tool_choice, CustomToolChoice):
            _unsupported("tool_choice.type", "tool_choice of type 'custom'")
        if self.forces_tool_call and self.structured_spec() is not None:
            raise BadRequestError(
                "Invalid value for 'tool_choice': a forced tool call constrains the output to the call, so it "
                "cannot be combined with 'response_format' or 'structured_outputs'.", param="tool_choice",
            )
        if self.audio is not None or (self.modalities and "audio" in self.modalities):
            _unsupported("audio" if self.audio is not None else "modalities", "audio output")
        if self.prediction is not None:
            _unsupported("prediction", "predicted outputs")
        if self.web_search_options is not None:
            _unsupported("web_search_options", "web search")
        if self.reasoning_effort is not None:
            _unsupported("reasoning_effort", "reasoning_effort on a model that does not reason")
        for i, m in enumerate(self.messages):
            if isinstance(m, FunctionMessage):
                _unsupported(f"messages[{i}].role", "messages with role 'function' (deprecated; use 'tool')")
            if isinstance(m, AssistantMessage):
                if m.function_call or m.audio:
                    _unsupported(f"messages[{i}]", "assistant function_call and audio in the history")
                for j, call in enumerate(m.tool_calls or ()):
                    if isinstance(call, CustomMessageToolCall):
                        _unsupported(f"messages[{i}].tool_calls[{j}].type", "tool calls of type 'custom'")
            if isinstance(m, UserMessage) and isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if not isinstance(part, TextContentPart):
                        _unsupported(f"messages[{i}].content[{j}].type", f"content parts of type {part.type!r}")

    @property
    def tool_mode(self) -> Optional[str]:
        """None (no tools, or ``tool_choice="none"``), "auto", "required" or "named"."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        if choice is None:
            return "auto"
        if isinstance(choice, str):
            return choice
        if isinstance(choice, AllowedToolsChoice):
            return choice.allowed_tools.mode
        return "named"

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_mode in ("required", "named")

    @property
    def offered_functions(self) -> list[FunctionDefinition]:
        """The functions the model may call: all of ``tools``, or those ``tool_choice`` allows."""
        functions = [t.function for t in self.tools or () if isinstance(t, FunctionTool)]
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return [f for f in functions if f.name == choice.function.name]
        if isinstance(choice, AllowedToolsChoice):
            names = {t.function.name for t in choice.allowed_tools.tools}
            return [f for f in functions if f.name in names]
        return functions


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingExtensions):
    """The body of ``POST /v1/completions`` (OpenAI's legacy endpoint)."""

    model: str
    prompt: PromptType
    best_of: Optional[Annotated[int, Field(ge=0, le=20)]] = None
    echo: Optional[bool] = False
    frequency_penalty: Optional[Penalty] = 0.0
    logit_bias: Optional[LogitBias] = None
    logprobs: Optional[Annotated[int, Field(ge=0, le=5)]] = None
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = 16  # 0: score the prompt (with echo)
    n: Optional[Annotated[int, Field(ge=1, le=_MAX_N)]] = 1
    presence_penalty: Optional[Penalty] = 0.0
    seed: Optional[int] = None
    stop: Optional[Stop] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    suffix: Optional[str] = None
    temperature: Optional[Temperature] = 1.0
    top_p: Optional[TopP] = 1.0
    user: Optional[str] = None

    @model_validator(mode="after")
    def _consistent(self) -> "CompletionRequest":
        _check_stream_options(self.stream, self.stream_options)
        if self.max_tokens == 0 and not self.echo:
            raise BadRequestError(
                "Invalid value for 'max_tokens': 0 is only allowed with echo=true (to score the prompt).",
                param="max_tokens",
            )
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise BadRequestError(f"Invalid value for 'best_of': it must be >= n ({n}).", param="best_of")
        return self

    def check_supported(self) -> None:
        if self.suffix:
            _unsupported("suffix", "suffix (fill-in-the-middle)")
        if self.stream and self.best_of is not None and self.best_of > (self.n or 1):
            raise BadRequestError(
                "Invalid value for 'best_of': best_of greater than n cannot be streamed (the best completions "
                "are known only at the end).", param="best_of",
            )

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """``prompt`` as a list of prompts (a string or a list of token ids each)."""
        return _prompt_list(self.prompt)


def _prompt_list(p: PromptType) -> list[Union[str, list[int]]]:
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


class EmbeddingRequest(_Strict):
    """The body of ``POST /v1/embeddings``. ``input``: a string, a list of token ids, or a
    list of either (one embedding each, in order). ``encoding_format`` "base64" sends each
    vector as the base64 of its float32 little-endian bytes (what the official SDK asks
    for by default, and decodes). ``dimensions`` keeps each vector's first values, then
    normalises. Beyond OpenAI's fields, vLLM's ``truncate_prompt_tokens``, ``normalize``
    (default true) and ``priority``."""

    model: str
    input: PromptType
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Annotated[int, Field(ge=1)]] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    normalize: Optional[bool] = None
    priority: Optional[int] = None

    @property
    def inputs(self) -> list[Union[str, list[int]]]:
        """``input`` as a list of inputs (a string or a list of token ids each)."""
        return _prompt_list(self.input)


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` formatted by the chat
    template (with ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` and
    ``continue_final_message`` as in a chat request), as the model's token ids, as a
    request would see them. ``add_special_tokens`` defaults to true for a prompt and false
    for messages (the template writes its own)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    tools: Optional[list[FunctionTool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = None

    @model_validator(mode="after")
    def _one_source(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise BadRequestError("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        if self.messages is None:
            for name in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
                if getattr(self, name) is not None:
                    raise BadRequestError(f"Invalid value for '{name}': it applies to 'messages' only.", param=name)
        return self


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``: token ids back to text (special tokens kept)."""

    model: Optional[str] = None
    tokens: list[int]


def _check_stream_options(stream: Optional[bool], options: Optional[StreamOptions]) -> None:
    if options is not None and not stream:
        raise BadRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )


def _unsupported(param: str, what: str) -> None:
    raise BadRequestError(f"{what} is not supported by this server.", param=param, code="unsupported_parameter")


# --- responses --------------------------------------------------------------------------------
class OpenAIObject(BaseModel):
    """Base of the response objects: pydantic models with the SDK's helpers."""

    model_config = ConfigDict(extra="allow")

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict OpenAI's API would send."""
        return self.model_dump(mode="json")

    def to_json(self, *, indent: Optional[int] = 2) -> str:
        return self.model_dump_json(indent=indent)


class PromptTokensDetails(OpenAIObject):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionUsage(OpenAIObject):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class Embedding(OpenAIObject):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # str: base64 of float32 little-endian bytes


class EmbeddingUsage(OpenAIObject):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class TokenizeResponse(OpenAIObject):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None  # with return_token_strs


class DetokenizeResponse(OpenAIObject):
    prompt: str


class TopLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatCompletionTokenLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIObject):
    content: Optional[list[ChatCompletionTokenLogprob]] = None
    refusal: Optional[list[ChatCompletionTokenLogprob]] = None


class Function(OpenAIObject):
    name: str
    arguments: str  # JSON text


class ChatCompletionMessageToolCall(OpenAIObject):
    id: str
    type: Literal["function"] = "function"
    function: Function


class ChatCompletionMessage(OpenAIObject):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ChatCompletionMessageToolCall]] = None  # left out of the JSON when None
    # a thinking model's reasoning (vLLM's and DeepSeek's name), left out of the JSON when None
    reasoning_content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler):
        out = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class _DropNulls(OpenAIObject):
    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChoiceDeltaToolCallFunction(_DropNulls):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ChoiceDeltaToolCall(_DropNulls):
    """A piece of a tool call: the first piece of each has its ``id``, ``type`` and name;
    the ``arguments`` pieces of one ``index`` joined are its arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[ChoiceDeltaToolCallFunction] = None


class ChatCompletionChoice(OpenAIObject):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class ChatCompletion(OpenAIObject):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[CompletionUsage] = None
    system_fingerprint: Optional[str] = None
    service_tier: Optional[str] = None


class ChoiceDelta(_DropNulls):
    """The new part of a message; fields that did not change are left out of the JSON."""

    role: Optional[Literal["system", "developer", "user", "assistant", "tool"]] = None
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ChoiceDeltaToolCall]] = None
    reasoning_content: Optional[str] = None


class ChatCompletionChunkChoice(OpenAIObject):
    index: int
    delta: ChoiceDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class ChatCompletionChunk(OpenAIObject):
    """One server-sent event of a streamed chat completion. With
    ``stream_options.include_usage`` the last one has no choices and carries ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Optional[CompletionUsage] = None
    system_fingerprint: Optional[str] = None
    service_tier: Optional[str] = None


class CompletionLogprobs(OpenAIObject):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(OpenAIObject):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class Completion(OpenAIObject):
    """A legacy completion; streamed, each server-sent event is one of these too."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[CompletionUsage] = None
    system_fingerprint: Optional[str] = None


class Model(OpenAIObject):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorObject(OpenAIObject):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(OpenAIObject):
    """``{"error": {"message", "type", "param", "code"}}``, the body of every error."""

    error: ErrorObject
