"""From OpenAI requests to engine calls, and from engine chunks to OpenAI responses.

:class:`OpenAIAdapter` is everything a host needs to serve ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses`` and ``/v1/models`` with one engine: it validates a
request (errors are :class:`~asyncgen.openai.errors.APIStatusError` with OpenAI's error
object), submits it, and returns either the whole response or an :class:`AsyncStream` of
chunks. :func:`sse_stream` turns such a stream into server-sent events
(:func:`~asyncgen.openai.responses.response_sse_stream` for the Responses API's events).

Everything that can be wrong with a request is raised by ``create_*`` itself, before the
first chunk, so an HTTP host can still answer 400 instead of a 200 event stream.
Closing an :class:`AsyncStream` (or leaving ``async with``, or cancelling the task
iterating it) aborts the engine request and frees its KV blocks.

Mapping notes:

* ``max_completion_tokens`` (or the older ``max_tokens``) becomes ``SamplingParams.max_tokens``;
  absent in a chat request means "until end of turn or ``max_model_len``". The legacy
  completions endpoint keeps OpenAI's default of 16.
* ``top_p=0`` (allowed by OpenAI, not by SamplingParams) is greedy decoding.
* ``logit_bias`` keys are token ids written as strings, as in OpenAI's JSON.
* Chat ``logprobs=true`` + ``top_logprobs=k``, or completions ``logprobs=k``, ask the
  engine for ``k`` alternatives per token; completions' ``top_logprobs`` also hold the
  sampled token (so up to ``k + 1`` entries), as OpenAI documents. The logprobs cover
  the returned text: a token that ended generation (end of turn, a stop token id) is
  not in them unless vLLM's ``include_stop_str_in_output`` puts its text in the reply
  (empty for a special token unless ``skip_special_tokens`` is false), nor are the
  tokens of a stop string cut from the text. When streamed, a
  token's logprob is sent with the chunk that sends the text it starts (a token whose
  text is held back, as a possible stop string, waits with it).
* ``usage.prompt_tokens_details.cached_tokens`` (the Responses API's
  ``input_tokens_details.cached_tokens``) counts the prompt's tokens served from the
  prefix cache (null in the running usage of ``continuous_usage_stats``).
* ``stream_options.include_usage`` sends the usage in a last chunk with no choices;
  with vLLM's ``continuous_usage_stats`` too, every chunk that has a choice also carries
  the usage so far: the prompt's tokens and that choice's generated tokens.
* vLLM's ``return_token_ids`` adds the prompt's token ids (a chat completion's
  ``prompt_token_ids``; each completions choice's) and each choice's generated ids
  (``token_ids``: every token generated, those of a stop string cut from the text
  included). Streamed, the prompt's ids come in the first chunk (of each choice, for
  completions) and each chunk carries the tokens generated since the last one.
* Completions' ``text_offset`` is where each token starts in the choice's text,
  counted in characters (a token that continues a multi-byte character starts where
  that character does; one after bytes no byte can complete, shown as U+FFFD, starts
  after that U+FFFD); with ``echo`` the completion's offsets follow the prompt's.
* Completions ``echo=true`` with ``max_tokens=0`` scores the prompt without
  generating: the choice is the echoed prompt (with its logprobs when asked for),
  ``finish_reason`` "length" and no completion tokens.
* ``developer`` messages are rendered as ``system`` messages; text content parts of one
  message are joined with newlines.
* ``finish_reason`` "abort" (the engine ended the request early) is passed through, as
  vLLM's OpenAI server does.
* Several prompts in one completions request run concurrently; when streamed, their
  chunks are taken from each prompt in turn.
* Completions ``echo`` with ``logprobs=k`` also asks for the prompt's logprobs: the
  echoed tokens come first in ``logprobs`` (the first with ``None``, as nothing predicts
  it). When streamed, the echo chunk waits for the prompt's first chunk, which carries
  them.
* Tools: the function ``tools`` go to the chat template, which shows them to the model.
  With ``tool_choice="auto"`` (the default when tools are given) the output is read for
  calls in the model's own format (``tool_call_parser``); text around them is the
  message's ``content``, null when only calls were made; with ``parallel_tool_calls=false``
  the reply ends with its first call (OpenAI's at most one): the request is stopped once
  the call is read, and what the model wrote after it is not part of the reply
  (``finish_reason`` "tool_calls"; ``usage`` still counts every token generated). ``"required"`` (and
  ``allowed_tools`` in required mode) constrains the output, with structured outputs, to a
  JSON array of ``{"name", "parameters"}`` objects, one call with
  ``parallel_tool_calls=false``; a named function constrains it to that function's
  arguments. Arguments are the JSON text the model wrote. ``finish_reason`` is
  "tool_calls" when a reply ends with calls ("stop" for a named function, as OpenAI
  answers). When streamed, a call's id, type and name come in its first piece, then its
  arguments in pieces, as OpenAI sends them. A forced call's parameters must be a schema
  structured outputs can enforce; one that is not is refused, naming the tool.
  In ``"auto"``, a function with ``strict: true`` has its calls enforced too where the
  model writes the ``hermes`` format: the output is free text, and each ``<tool_call>``
  it opens must name an offered function and hold arguments valid for a strict one's
  schema (any JSON object for the others), with a structural tag (vLLM's
  ``structural_tag``; a strict function's schema must then be enforceable, as a forced
  call's). Calls in the ``llama3_json`` and ``mistral`` formats, and all calls of a
  request that sets ``response_format`` or ``structured_outputs``, are read as written.
  With a reasoning parser, the ``<think>`` block is left free (calls are not read there).
* Reasoning: with ``reasoning_parser`` on, a ``<think>`` block (opened by the output, or
  by the prompt as DeepSeek-R1's template does) goes to the message's
  ``reasoning_content`` and to the chunks' ``delta.reasoning_content``; tool calls are
  read from the answer after it.
* Completions ``best_of > n`` samples ``best_of`` completions per prompt and returns the
  ``n`` with the highest cumulative logprob (``engine.generate``); it cannot be streamed.
"""

from __future__ import annotations

import base64
import codecs
import dataclasses
import functools
import json
import time
import uuid
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Generic, Mapping, Optional, Sequence, TypeVar, Union

import anyio
import numpy as np
from pydantic import ValidationError

from ..engine.detokenizer import IncrementalDetokenizer
from ..engine.gather import gather
from ..engine.tokenizer import TokenBytes, apply_chat_template
from ..errors import AsyncGenError
from ..outputs import CompletionOutput, StreamChunk, TokenLogprob, Usage
from ..reasoning import ReasoningParser, opens_reasoning, template_reasons
from ..sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from ..structured import json_schema_grammar
from ..tools import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    detect_tool_call_parser,
    get_tool_call_parser,
    named_tool_schema,
    parse_tool_calls,
    required_tools_schema,
    strict_tool_call_tag,
)
from .errors import APIStatusError, BadRequestError, NotFoundError, from_exception, from_validation_error
from .protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionMessageToolCall,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    CreateEmbeddingResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    DeveloperMessage,
    Embedding,
    EmbeddingRequest,
    EmbeddingUsage,
    Function,
    Model,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    ToolMessage,
    TopLogprob,
)

__all__ = ["AsyncStream", "OpenAIAdapter", "sse_stream", "to_sampling_params"]

T = TypeVar("T")

_EXTENSION_FIELDS = (
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "include_stop_str_in_output", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
)


# --- requests ---------------------------------------------------------------------------------
def to_sampling_params(request: Union[ChatCompletionRequest, CompletionRequest]) -> SamplingParams:
    """The engine's SamplingParams for a validated request (BadRequestError naming the
    request's field if the combination is invalid)."""
    chat = isinstance(request, ChatCompletionRequest)
    if request.length_penalty is not None and not request.use_beam_search:
        raise BadRequestError("Invalid value for 'length_penalty': it applies to use_beam_search only.",
                              param="length_penalty", code="invalid_value")
    if chat:
        max_tokens = request.max_completion_tokens or request.max_tokens
        max_tokens_field = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        max_tokens, max_tokens_field = request.max_tokens, "max_tokens"
        logprobs, logprobs_field = request.logprobs, "logprobs"
        if max_tokens == 0:  # echo only (the request checked it): one token, not returned
            max_tokens = 1
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    kwargs: dict[str, Any] = dict(
        n=request.n or 1,
        temperature=temperature,
        top_p=top_p,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias),
        seed=request.seed,
        stop=request.stop,  # (an empty string is refused as [""] is, not dropped)
        max_tokens=max_tokens,
        logprobs=logprobs,
    )
    if not chat:
        if request.best_of is not None and request.best_of > (request.n or 1) and request.max_tokens != 0:
            kwargs["best_of"] = request.best_of
        if request.echo and request.logprobs is not None:
            kwargs["prompt_logprobs"] = request.logprobs  # echoed tokens carry their logprobs
    for name in _EXTENSION_FIELDS:
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = value
    names = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}
    structured = request.structured_spec()
    if structured is not None:
        names["structured_outputs"], kwargs["structured_outputs"] = structured
    if chat and request.forces_tool_call:
        names["structured_outputs"], kwargs["structured_outputs"] = "tools", {"json": _tool_call_schema(request)}
    try:
        return SamplingParams(**kwargs)
    except ValidationError as e:
        raise from_validation_error(e, names) from e


def _logit_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequestError(
                f"Invalid key in 'logit_bias': {key!r} is not a token id.", param="logit_bias", code="invalid_value"
            ) from None
        out[token_id] = value
    return out


def _check_tool_schemas(request: ChatCompletionRequest, functions: list) -> None:
    """BadRequestError naming the first of ``functions`` whose parameters structured
    outputs cannot enforce."""
    for f in functions:
        try:
            json_schema_grammar(named_tool_schema(f.model_dump()))
        except AsyncGenError as e:
            i = next(i for i, t in enumerate(request.tools) if getattr(t, "function", None) is f)
            raise BadRequestError(
                f"Invalid value for 'tools[{i}].function.parameters': {e}", param=f"tools[{i}].function.parameters"
            ) from e


def _tool_call_schema(request: ChatCompletionRequest) -> Any:
    """The JSON Schema a forced tool call is generated under (BadRequestError naming the
    tool whose parameters it cannot enforce)."""
    functions = request.offered_functions
    _check_tool_schemas(request, functions)
    if request.tool_mode == "named":
        return named_tool_schema(functions[0].model_dump())
    return required_tools_schema([f.model_dump() for f in functions], parallel=request.parallel_tool_calls is not False)


def _content_text(content) -> Optional[str]:
    """A message's content as one string (text parts joined with newlines)."""
    if isinstance(content, list):
        return "\n".join(p.text if p.type == "text" else p.refusal for p in content)
    return content


def _echoed(request: ChatCompletionRequest) -> str:
    """With ``echo``, the text the reply starts with: the last message's, where it is the
    assistant's (the reply goes on with it); else ""."""
    last = request.messages[-1]
    if not request.echo or not isinstance(last, AssistantMessage):
        return ""
    return _content_text(last.content) or ""


def _template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: a role and a string, the participant's
    ``name`` where the message has one, and the history's tool calls (arguments as a dict
    where they are a JSON object, as templates expect)."""
    out = []
    for m in request.messages:
        role = "system" if isinstance(m, DeveloperMessage) else m.role
        content = _content_text(m.content)
        message: dict[str, Any] = {"role": role}
        if isinstance(m, AssistantMessage):
            if content is None:
                content = m.refusal or ""
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                    for c in m.tool_calls
                ]
            if m.reasoning_content is not None:
                message["reasoning_content"] = m.reasoning_content
        message["content"] = content
        if getattr(m, "name", None):  # a participant's name, for templates that render it
            message["name"] = m.name
        if isinstance(m, ToolMessage):
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _split_reasoning(reasoning: Optional[Callable[[], ReasoningParser]], text: str) -> tuple[Optional[str], str]:
    """(the reasoning, the rest) of a whole reply's text; (None, text) without a parser."""
    if reasoning is None:
        return None, text
    parser = reasoning()
    (r1, text1), (r2, text2) = parser.feed(text), parser.finish()
    return (r1 + r2) or None, text1 + text2


def _parse(model_cls, request: Any, to_error=from_validation_error):
    """The validated, supported request (``to_error`` turns a ValidationError into the 400)."""
    if isinstance(request, model_cls):
        parsed = request
    elif isinstance(request, Mapping):
        try:
            parsed = model_cls.model_validate(dict(request))
        except ValidationError as e:
            raise to_error(e) from e
    else:
        raise BadRequestError("The request body must be a JSON object.", code="invalid_type")
    check = getattr(parsed, "check_supported", None)  # (requests with fields they cannot honour)
    if check is not None:
        check()
    return parsed


# --- token text for logprobs ----------------------------------------------------------------------
class _TokenText:
    """The exact bytes of a token, and its text as OpenAI's logprobs show it."""

    def __init__(self, tokenizer):
        self._bytes = TokenBytes(tokenizer)
        self.special = self._bytes.special
        self._cache: dict[int, tuple[str, list[int], bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        return self._entry(token_id)[:2]

    def raw(self, token_id: int) -> bytes:
        return self._entry(token_id)[2]

    def _entry(self, token_id: int) -> tuple[str, list[int], bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw), raw)
        return hit


class _TokenStarts:
    """Where each next token starts in the text the engine's detokenizer makes of them,
    in characters: after the characters complete before its first byte. A token whose
    first byte continues a character starts where the character does; one that follows
    bytes no byte can complete (an invalid sequence, shown as U+FFFD) starts after them.
    The detokenizer gives the text; the tokens' bytes, fed to a UTF-8 decoder alongside,
    tell the two kinds of trailing U+FFFD apart."""

    def __init__(self, tokenizer, text: _TokenText, skip_special_tokens: bool, prompt_token_ids: Sequence[int] = ()):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_token_ids=prompt_token_ids)
        self._text = text
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_id: int) -> int:
        """The start of ``token_id``, which then joins the text."""
        data = b"" if self._skip and token_id in self._text.special else self._text.raw(token_id)
        pending = self._utf8.getstate()[0]
        partial = bool(pending) and (not data or _continues(pending, data[:1]))
        start = self._detok.complete_length(partial)
        self._detok.add([token_id])
        self._utf8.decode(data)
        return start


def _continues(pending: bytes, byte: bytes) -> bool:
    """Whether ``byte`` can follow ``pending``, the start of a UTF-8 character."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + byte)
    except UnicodeDecodeError:
        return False
    return True


def _visible_logprobs(
    chunk: StreamChunk | CompletionOutput, stop_token_ids: frozenset[int] = frozenset()
) -> Optional[tuple[TokenLogprob, ...]]:
    """The chunk's (or completion's) logprobs without a final stop token (which is not
    part of the text). ``stop_token_ids``: the request's (EOS included unless ignored).

    A "stop" whose stop_reason is not a string ended on a stop token. One whose reason is
    a string may have too: when the flush of a partial character at the end completes a
    stop string, the string is the reason, whatever ended generation. A last token that
    is one of the request's stop tokens is then the one that ended it: sampled past
    min_tokens, a stop token ends the completion before its text is decoded."""
    lps = chunk.logprobs
    if lps is None:
        return None
    if lps and chunk.finish_reason == "stop" and (
        not isinstance(chunk.stop_reason, str) or lps[-1].token_id in stop_token_ids
    ):
        lps = lps[:-1]
    return lps


class _AlignedLogprobs:
    """One choice's logprobs, each paired with where its token starts in the choice's
    text (characters), and released once the text from that point on has been sent.

    The starts come from decoding the tokens one at a time as the engine's detokenizer
    does, so they count the characters of the engine's text (a token that continues a
    multi-byte character starts where the character does). The engine sends a token's
    id and logprob with the chunk that carries its text, except while that text is held
    back as a possible stop string; such tokens wait here. At a finish by a stop string
    the tokens starting past the kept text (the stop string's) are dropped.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool, stop_token_ids: frozenset[int] = frozenset(),
                 text: Optional[_TokenText] = None, keep_stop_token: bool = False,
                 prompt_token_ids: Sequence[int] = ()):
        self._starts = _TokenStarts(tokenizer, text or _TokenText(tokenizer), skip_special_tokens, prompt_token_ids)
        self._stop_token_ids = stop_token_ids
        self._keep_stop_token = keep_stop_token  # include_stop_str_in_output: its text is sent
        self._held: list[tuple[int, TokenLogprob]] = []
        self.sent = 0  # characters of the choice's text sent so far

    def add(self, chunk: StreamChunk | CompletionOutput) -> list[tuple[int, TokenLogprob]]:
        """Takes a chunk (or a whole output), its text as sent; returns the (start, logprob)
        pairs whose text has now been sent, in order."""
        # A stop token whose text was asked for is kept as any token is (below, a stop string
        # that ends the text drops the tokens that start past it).
        lps = chunk.logprobs if self._keep_stop_token else _visible_logprobs(chunk, self._stop_token_ids)
        for lp in lps or ():
            self._held.append((self._starts.next(lp.token_id), lp))
        self.sent += len(chunk.text)
        if chunk.finish_reason is not None and not isinstance(chunk.stop_reason, str):
            ready = len(self._held)  # the whole text is out
        else:
            ready = 0
            while ready < len(self._held) and self._held[ready][0] < self.sent:
                ready += 1
        out = self._held[:ready]
        self._held = [] if chunk.finish_reason is not None else self._held[ready:]
        return out


# --- streams ----------------------------------------------------------------------------------
class AsyncStream(Generic[T], AsyncIterator[T]):
    """The chunks of a streamed response, like the official SDK's ``AsyncStream``.

    Iterate with ``async for``; ``await stream.close()`` (or ``async with stream``) stops
    early and aborts the generation, freeing its KV blocks at once.
    """

    def __init__(self, chunks: AsyncIterator[T]):
        self._chunks = chunks

    def __aiter__(self) -> "AsyncStream[T]":
        return self

    async def __anext__(self) -> T:
        return await self._chunks.__anext__()

    async def close(self) -> None:
        await self._chunks.aclose()

    aclose = close

    async def __aenter__(self) -> "AsyncStream[T]":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


async def sse_stream(stream: AsyncStream) -> AsyncGenerator[str, None]:
    """Server-sent events for a streamed response: ``data: {json}\\n\\n`` per chunk, then
    ``data: [DONE]\\n\\n``. An error after the first chunk (the engine died) is sent as
    ``data: {"error": ...}``, which the official client raises as an APIError. Closing
    this iterator closes ``stream`` and aborts the request."""
    try:
        async for chunk in stream:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except APIStatusError as e:
        yield f"data: {e.to_response().model_dump_json()}\n\n"
    finally:
        await stream.close()
    yield "data: [DONE]\n\n"


# --- the adapter ------------------------------------------------------------------------------
class OpenAIAdapter:
    """Serves OpenAI chat completions, completions and models with one running engine.

    ``model_names`` are the names clients may put in ``model`` (default: the engine's
    ``model_name``, the model directory's name); any other name is a 404, as in OpenAI's
    API; responses name the model the request asked for.

    ``tool_call_parser`` names how the model writes tool calls (``hermes``,
    ``llama3_json``, ``mistral``: :mod:`asyncgen.tools`), which ``tool_choice="auto"``
    needs; "auto" (the default) takes it from the markers in the chat template, None
    turns auto tool choice off. ``required`` and named functions need none: the output is
    constrained to the call (see the module notes).

    ``reasoning_parser="think"`` moves a thinking model's ``<think>`` block out of the
    content into the message's ``reasoning_content`` (:mod:`asyncgen.reasoning`); "auto"
    (the default) does so for chat templates that write such blocks, None never.
    """

    def __init__(self, engine, *, model_names: Optional[list[str]] = None, owned_by: str = "asyncgen",
                 tool_call_parser: Optional[str] = "auto", reasoning_parser: Optional[str] = "auto"):
        self.engine = engine
        self._model_names = list(model_names) if model_names else None
        self.owned_by = owned_by
        self.created = int(time.time())
        self._token_text: Optional[_TokenText] = None
        if tool_call_parser == "auto":
            tool_call_parser = detect_tool_call_parser(getattr(engine.tokenizer, "chat_template", None))
        elif tool_call_parser is not None:
            get_tool_call_parser(tool_call_parser)  # (an unknown name is refused here)
        self.tool_call_parser: Optional[str] = tool_call_parser
        if reasoning_parser not in ("auto", "think", None):
            raise ValueError(f"unknown reasoning_parser {reasoning_parser!r}; known: 'think', 'auto', None")
        if reasoning_parser == "auto":
            reasoning_parser = "think" if template_reasons(getattr(engine.tokenizer, "chat_template", None)) else None
        self.reasoning_parser: Optional[str] = reasoning_parser

    @property
    def model_names(self) -> list[str]:
        return self._model_names or [self.engine.model_name]

    # --- models -------------------------------------------------------------------------------
    def list_models(self) -> ModelList:
        return ModelList(data=[Model(id=n, created=self.created, owned_by=self.owned_by) for n in self.model_names])

    def retrieve_model(self, model: str) -> Model:
        self._check_model(model)
        return Model(id=model, created=self.created, owned_by=self.owned_by)

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise NotFoundError(
                f"The model `{model}` does not exist. This server serves: {', '.join(self.model_names)}.",
                param="model",
                code="model_not_found",
            )

    # --- chat ---------------------------------------------------------------------------------
    async def create_chat_completion(
        self, request: Union[ChatCompletionRequest, Mapping[str, Any]]
    ) -> Union[ChatCompletion, AsyncStream[ChatCompletionChunk]]:
        """A ``ChatCompletion``, or an :class:`AsyncStream` of ``ChatCompletionChunk`` when
        ``request.stream``. Raises APIStatusError (BadRequestError, NotFoundError, ...)."""
        req = _parse(ChatCompletionRequest, request)
        self._check_model(req.model)
        tool_parser = self._tool_parser(req)
        messages = _template_messages(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        params = self._strict_calls(req, to_sampling_params(req), messages, tools)
        if tool_parser is not None and self.tool_call_parser == "mistral" and req.skip_special_tokens is None:
            params = params.model_copy(update={"skip_special_tokens": False})  # [TOOL_CALLS] is a special token
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fields = {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens else None
        if req.use_beam_search:
            return await self._beam_chat(req, params, messages, rid, fields)
        stream = self._open(None, messages, params, rid, "messages", fields, req.chat_template_kwargs,
                            tools, bool(req.continue_final_message), req.add_generation_prompt, req.priority or 0)
        reasoning = None
        if self.reasoning_parser is not None:
            # a constrained output (structured outputs, a forced tool call) has no room for a
            # block the prompt opened: it is read as reasoning only if it opens one itself
            structured = params.structured_outputs
            inside = (structured is None or structured.free_text) and opens_reasoning(stream.group.prompt)
            reasoning = functools.partial(ReasoningParser, inside)
        created = int(time.time())
        if req.stream:
            return AsyncStream(self._chat_chunks(stream, req, rid, created, tool_parser, reasoning))
        # With parallel_tool_calls=false a reply ends with its first call: the generation
        # stops there (a parser per choice watches for it).
        until = None
        if tool_parser is not None and req.tool_mode == "auto" and req.parallel_tool_calls is False:
            until = [_CallWatch(tool_parser(), reasoning() if reasoning is not None else None) for _ in range(params.n)]
        outs, usage, _ = await self._collect([stream], params.n, "messages", until=until)
        echo = _echoed(req)
        choices = []
        for i, out in enumerate(outs):
            logprobs = None
            if req.logprobs:
                logprobs = ChoiceLogprobs(content=self._chat_logprobs(lp for _, lp in out.logprobs))
            text = "".join(out.texts)
            finish_reason = out.finish_reason
            thought, text = _split_reasoning(reasoning, text)
            if tool_parser is None:
                message = ChatCompletionMessage(content=text)
            else:
                parser = tool_parser()
                content, calls = parse_tool_calls(parser, text)
                if parser.ended:  # it ended with its call; the rest was not read
                    finish_reason = "tool_calls"
                message = ChatCompletionMessage(
                    content=content or (None if calls else content),
                    tool_calls=[
                        ChatCompletionMessageToolCall(id=c.id, function=Function(name=c.name, arguments=c.arguments))
                        for c in calls
                    ] or None,
                )
                finish_reason = _tool_finish_reason(req, finish_reason, bool(calls))
            message.reasoning_content = thought
            if echo:
                message.content = echo + (message.content or "")
            ids = {"token_ids": out.token_ids} if req.return_token_ids else {}
            choices.append(ChatCompletionChoice(index=i, message=message, logprobs=logprobs, finish_reason=finish_reason,
                                                **ids))
        ids = {"prompt_token_ids": list(stream.prompt_token_ids)} if req.return_token_ids else {}
        return ChatCompletion(id=rid, created=created, model=req.model, choices=choices, usage=usage, **ids)

    async def create_response(self, request: Any) -> Any:
        """OpenAI's Responses API (``POST /v1/responses``): a ``Response``, or an
        :class:`AsyncStream` of its streaming events when ``request.stream``; run as a chat
        completion (:mod:`asyncgen.openai.responses`)."""
        from .responses import create_response

        return await create_response(self, request)

    def _strict_calls(self, req: ChatCompletionRequest, params: SamplingParams, messages: list[dict[str, Any]],
                      tools: Optional[list[dict[str, Any]]]) -> SamplingParams:
        """``params`` under which, with ``tool_choice="auto"`` and a ``strict`` function
        offered, every call the model opens follows the schema of a strict function (any
        JSON object for the others) and names an offered one, the text around the calls
        left free: for the hermes format, and unless the request constrains its output
        otherwise (``response_format``, ``structured_outputs``), which then wins."""
        functions = req.offered_functions
        if (req.tool_mode != "auto" or params.structured_outputs is not None or self.tool_call_parser is None
                or not any(f.strict for f in functions)):
            return params
        reasoning = None
        if self.reasoning_parser is not None:  # calls are read after the <think> block: leave it free
            # (whether the prompt leaves one open decides the grammar, so the template is
            # rendered here as well as when the stream opens)
            try:
                prompt = apply_chat_template(self.engine.tokenizer, messages, req.chat_template_kwargs, tools,
                                             req.add_generation_prompt, bool(req.continue_final_message))
            except AsyncGenError:
                prompt = None  # (opening the stream raises it, with the field named)
            reasoning = "inside" if opens_reasoning(prompt) else "may_open"
        tag = strict_tool_call_tag(self.tool_call_parser, [f.model_dump() for f in functions], reasoning)
        if tag is None:
            return params
        _check_tool_schemas(req, [f for f in functions if f.strict])
        return params.model_copy(update={"structured_outputs": StructuredOutputsParams(structural_tag=tag)})

    def _tool_parser(self, req: ChatCompletionRequest):
        """A factory of the parser that reads tool calls out of each choice, or None."""
        mode = req.tool_mode
        if mode is None:
            return None
        # Mistral's templates refuse the ids of calls sent back unless they are its own kind.
        style = "mistral" if self.tool_call_parser == "mistral" else None
        if mode == "named":
            name = req.offered_functions[0].name
            return lambda: NamedToolCallParser(name, call_id_style=style)
        names = [f.name for f in req.offered_functions]
        if mode == "required":
            return lambda: RequiredToolCallsParser(names, call_id_style=style)
        if self.tool_call_parser is None:
            raise BadRequestError(
                "Invalid value for 'tool_choice': \"auto\" tool choice needs to know how this model writes "
                "tool calls, and its chat template shows none of the formats asyncgen reads. Start the "
                "adapter with tool_call_parser= one of hermes, llama3_json, mistral, or send "
                "tool_choice=\"required\" or a named function (these need no parser).", param="tool_choice",
            )
        cls = get_tool_call_parser(self.tool_call_parser)
        max_calls = 1 if req.parallel_tool_calls is False else None
        return lambda: cls(names, max_calls=max_calls)

    async def _chat_chunks(self, stream, req: ChatCompletionRequest, rid: str, created: int, tool_parser=None,
                           reasoning=None):
        model = req.model
        n = req.n or 1
        tokens = _ChoiceTokens(req, n, lambda i: stream.prompt_token_ids)
        extra = {"prompt_token_ids": list(stream.prompt_token_ids)} if req.return_token_ids else {}

        def chunk(choices, usage=None):
            nonlocal extra
            if choices:
                choices, usage = tokens.attach(choices, usage)
            out = ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage, **extra)
            if choices:
                extra = {}  # (the prompt's ids go in the first chunk only)
            return out

        usage = None
        aligned = [self._aligner(stream) for _ in range(n)]
        parsers = [tool_parser() for _ in range(n)] if tool_parser is not None else None
        thinkers = [reasoning() for _ in range(n)] if reasoning is not None else None
        made_calls = [False] * n
        done = [False] * n  # the choice's finish went out
        running = [True] * n  # the engine still generates it
        try:
            echo = _echoed(req)
            for i in range(n):
                yield chunk([ChatCompletionChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=echo))])
            async for c in stream:
                tokens.add(c.index, c.token_ids, send=not done[c.index])
                if c.usage is not None:
                    usage = c.usage
                if c.finish_reason is not None:
                    running[c.index] = False
                if done[c.index]:  # ended with its call (parallel_tool_calls=false); the abort's chunk
                    continue
                lps = [lp for _, lp in aligned[c.index].add(c)] if req.logprobs else None
                text, thought = c.text, ""
                if thinkers is not None:
                    thought, text = thinkers[c.index].feed(text)
                    if c.finish_reason is not None:
                        more_thought, more_text = thinkers[c.index].finish()
                        thought, text = thought + more_thought, text + more_text
                if parsers is None:
                    delta = ChoiceDelta(content=text) if text else None
                else:
                    delta = _tool_delta(parsers[c.index].feed(text))
                    if c.finish_reason is not None:
                        delta = _merge_deltas(delta, _tool_delta(parsers[c.index].finish()))
                    made_calls[c.index] |= bool(delta is not None and delta.tool_calls)
                if thought:
                    delta = _merge_deltas(ChoiceDelta(reasoning_content=thought), delta)
                if delta is not None or lps:
                    logprobs = ChoiceLogprobs(content=self._chat_logprobs(lps)) if req.logprobs else None
                    yield chunk([ChatCompletionChunkChoice(index=c.index, delta=delta or ChoiceDelta(), logprobs=logprobs)])
                ended = parsers is not None and parsers[c.index].ended
                if c.finish_reason is not None or ended:
                    finish = "tool_calls" if ended else c.finish_reason
                    if parsers is not None:
                        finish = _tool_finish_reason(req, finish, made_calls[c.index])
                    yield chunk([ChatCompletionChunkChoice(index=c.index, delta=ChoiceDelta(), finish_reason=finish)])
                    done[c.index] = True
                    if all(done) and any(running):  # a reply ended with its call: stop generating it
                        self.engine.abort(stream.request_id)  # (its final chunks bring the usage)
        except AsyncGenError as e:
            raise from_exception(e, prompt_param="messages") from e
        finally:
            await stream.aclose()
        if req.include_usage and usage is not None:
            yield chunk([], _usage([usage]))

    def _chat_logprobs(self, lps) -> list[ChatCompletionTokenLogprob]:
        text = self._text_of()
        out = []
        for lp in lps:
            token, raw = text(lp.token_id)
            top = [TopLogprob(token=text(t)[0], logprob=v, bytes=text(t)[1]) for t, v in lp.top]
            out.append(ChatCompletionTokenLogprob(token=token, logprob=lp.logprob, bytes=raw, top_logprobs=top))
        return out

    # --- completions --------------------------------------------------------------------------
    async def create_completion(
        self, request: Union[CompletionRequest, Mapping[str, Any]]
    ) -> Union[Completion, AsyncStream[Completion]]:
        """A ``Completion``, or an :class:`AsyncStream` of ``Completion`` chunks when
        ``request.stream``. A list of prompts gives ``n`` choices per prompt, numbered
        prompt by prompt."""
        req = _parse(CompletionRequest, request)
        self._check_model(req.model)
        params = to_sampling_params(req)
        prompts = req.prompts
        if not prompts:
            raise BadRequestError("'prompt' must not be empty.", param="prompt", code="invalid_value")
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.use_beam_search:
            return await self._beam_completion(req, params, prompts, rid)
        if params.num_sequences > params.n:  # best_of: whole results only (streaming refused)
            return await self._best_of_completion(req, params, prompts, rid)
        streams = []
        try:
            for k, prompt in enumerate(prompts):
                streams.append(self._open(prompt, None, params, rid if len(prompts) == 1 else f"{rid}-{k}", "prompt",
                                          priority=req.priority or 0))
        except APIStatusError:
            for s in streams:
                await s.aclose()
            raise
        echoes = [self._echo(p) if req.echo else "" for p in prompts]
        created = int(time.time())
        if req.stream:
            return AsyncStream(self._completion_chunks(streams, req, params.n, echoes, rid, created))
        prompt_ids = [s.prompt_token_ids for s in streams]
        outs, usage, prompt_lps = await self._collect(streams, params.n, "prompt", scoring=req.max_tokens == 0)
        choices = []
        for index, out in enumerate(outs):
            k = index // params.n
            echo = echoes[k]
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(out.logprobs, len(echo))
                if req.echo:
                    logprobs = _joined(self._prompt_logprobs(prompt_ids[k], prompt_lps[k]), logprobs)
            text = echo + "".join(out.texts)
            ids = {"prompt_token_ids": list(prompt_ids[k]), "token_ids": out.token_ids} if req.return_token_ids else {}
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                            **ids))
        return Completion(id=rid, created=created, model=req.model, choices=choices, usage=usage)

    async def _best_of_completion(self, req: CompletionRequest, params: SamplingParams, prompts, rid: str) -> Completion:
        """``best_of > n``: each prompt through ``engine.generate``, which samples
        ``best_of`` completions and keeps the ``n`` with the highest cumulative logprob."""
        results = await self._gather([
            functools.partial(self.engine.generate, prompt, params, request_id=rid if len(prompts) == 1 else f"{rid}-{k}",
                              priority=req.priority or 0)
            for k, prompt in enumerate(prompts)
        ], "prompt")
        created = int(time.time())
        choices = []
        for k, (prompt, res) in enumerate(zip(prompts, results)):
            echo = self._echo(prompt) if req.echo else ""
            for out in res.outputs:
                logprobs = None
                if req.logprobs is not None:
                    aligned = self._aligner(params, res.prompt_token_ids).add(out)
                    logprobs = self._completion_logprobs(aligned, len(echo))
                    if req.echo:
                        logprobs = _joined(self._prompt_logprobs(res.prompt_token_ids, res.prompt_logprobs), logprobs)
                ids = {"prompt_token_ids": list(res.prompt_token_ids), "token_ids": list(out.token_ids)} \
                    if req.return_token_ids else {}
                choices.append(CompletionChoice(index=k * params.n + out.index, text=echo + out.text,
                                                logprobs=logprobs, finish_reason=out.finish_reason, **ids))
        return Completion(id=rid, created=created, model=req.model, choices=choices,
                          usage=_usage([r.usage for r in results]))

    # --- tokens (vLLM's /tokenize and /detokenize) -------------------------------------------
    async def tokenize(self, request: Union[TokenizeRequest, Mapping[str, Any]]) -> TokenizeResponse:
        """A prompt, or chat messages through the template, as the model's token ids."""
        req = _parse(TokenizeRequest, request)
        if req.model is not None:
            self._check_model(req.model)
        tok = self.engine.tokenizer
        if req.messages is None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            try:
                text = apply_chat_template(tok, _template_messages(req), req.chat_template_kwargs, tools,
                                           req.add_generation_prompt, bool(req.continue_final_message))
            except AsyncGenError as e:
                raise from_exception(e, prompt_param="messages") from e
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, request: Union[DetokenizeRequest, Mapping[str, Any]]) -> DetokenizeResponse:
        """Token ids back to text, special tokens kept."""
        req = _parse(DetokenizeRequest, request)
        if req.model is not None:
            self._check_model(req.model)
        vocab = self.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"Invalid value for 'tokens': ids must be in [0, {vocab}), got {bad[:5]}.",
                                  param="tokens", code="invalid_value")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(req.tokens))

    # --- embeddings -------------------------------------------------------------------------
    async def create_embedding(self, request: Union[EmbeddingRequest, Mapping[str, Any]]) -> CreateEmbeddingResponse:
        """``POST /v1/embeddings``: one :meth:`AsyncEngine.embed` per input, all at once."""
        req = _parse(EmbeddingRequest, request)
        self._check_model(req.model)
        inputs = req.inputs
        if not inputs or any(not x for x in inputs):
            raise BadRequestError("Invalid value for 'input': it must not be empty, nor hold an empty input.",
                                  param="input", code="invalid_value")
        results = await self._gather([
            functools.partial(self.engine.embed, x, normalize=req.normalize is not False, dimensions=req.dimensions,
                              truncate_prompt_tokens=req.truncate_prompt_tokens, priority=req.priority or 0)
            for x in inputs
        ], "input")
        data = []
        for k, res in enumerate(results):
            vector: Any = list(res.embedding)
            if req.encoding_format == "base64":
                vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
            data.append(Embedding(index=k, embedding=vector))
        tokens = sum(r.usage.prompt_tokens for r in results)
        return CreateEmbeddingResponse(data=data, model=req.model,
                                       usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    # --- beam search (vLLM's use_beam_search) ---------------------------------------------------
    def _beam_params(self, req, params: SamplingParams, fields=None) -> BeamSearchParams:
        """The request's BeamSearchParams: width n; BadRequestError naming a field that
        beam search cannot honour."""
        fields = fields or {}
        structured = req.structured_spec()
        refused = {
            "stream": bool(req.stream), "logprobs": params.logprobs is not None,
            "best_of": params.num_sequences > params.n,
            "max_tokens": getattr(req, "max_tokens", None) == 0, "stop": bool(params.stop),
            "stop_token_ids": bool(params.stop_token_ids), "min_tokens": params.min_tokens > 0,
            "presence_penalty": params.presence_penalty != 0, "frequency_penalty": params.frequency_penalty != 0,
            "repetition_penalty": params.repetition_penalty != 1, "logit_bias": bool(params.logit_bias),
            "allowed_token_ids": params.allowed_token_ids is not None, "bad_words": bool(params.bad_words),
            "skip_special_tokens": not params.skip_special_tokens,
            "truncate_prompt_tokens": params.truncate_prompt_tokens is not None,
            "tools": bool(getattr(req, "tools", None)),
            structured[0].split(".")[0] if structured else "structured_outputs": params.structured_outputs is not None,
        }
        for name, bad in refused.items():
            if bad:
                name = fields.get(name, name)
                raise BadRequestError(f"Invalid value for '{name}': not supported with use_beam_search.", param=name,
                                      code="invalid_value")
        try:
            return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                    length_penalty=1.0 if req.length_penalty is None else req.length_penalty)
        except ValidationError as e:
            raise from_validation_error(e, {"beam_width": "n", **fields}) from e

    async def _gather(self, calls: list[Callable[[], Any]], prompt_param: str, fields=None) -> list:
        """Awaits every call at once, in order; the first engine error cancels the others
        and becomes the response's (``prompt_param`` and ``fields`` as in from_exception)."""
        try:
            return await gather(calls, (AsyncGenError, ValidationError))
        except (AsyncGenError, ValidationError) as e:
            raise from_exception(e, prompt_param=prompt_param, fields=fields) from e

    async def _beam_completion(self, req: CompletionRequest, params: SamplingParams, prompts, rid: str) -> Completion:
        beam = self._beam_params(req, params)
        results = await self._gather([functools.partial(self.engine.beam_search, p, beam, priority=req.priority or 0)
                                      for p in prompts], "prompt")
        choices = []
        for k, res in enumerate(results):
            echo = self._echo(prompts[k]) if req.echo else ""
            for seq in res.sequences:
                ids = {"prompt_token_ids": list(res.prompt_token_ids), "token_ids": list(seq.token_ids)} \
                    if req.return_token_ids else {}
                choices.append(CompletionChoice(index=k * params.n + seq.index, text=echo + seq.text,
                                                finish_reason=seq.finish_reason, **ids))
        return Completion(id=rid, created=int(time.time()), model=req.model, choices=choices,
                          usage=_usage([r.usage for r in results]))

    async def _beam_chat(self, req: ChatCompletionRequest, params: SamplingParams, messages, rid: str,
                         fields) -> ChatCompletion:
        beam = self._beam_params(req, params, fields)
        (res,) = await self._gather([functools.partial(
            self.engine.beam_search, messages=messages, params=beam, chat_template_kwargs=req.chat_template_kwargs,
            continue_final_message=bool(req.continue_final_message), add_generation_prompt=req.add_generation_prompt,
            priority=req.priority or 0,
        )], "messages", fields)
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = functools.partial(ReasoningParser, opens_reasoning(res.prompt))
        choices = []
        for seq in res.sequences:
            thought, text = _split_reasoning(reasoning, seq.text)
            message = ChatCompletionMessage(content=text)
            message.reasoning_content = thought
            ids = {"token_ids": list(seq.token_ids)} if req.return_token_ids else {}
            choices.append(ChatCompletionChoice(index=seq.index, message=message, finish_reason=seq.finish_reason,
                                                **ids))
        ids = {"prompt_token_ids": list(res.prompt_token_ids)} if req.return_token_ids else {}
        return ChatCompletion(id=rid, created=int(time.time()), model=req.model, choices=choices,
                              usage=_usage([res.usage]), **ids)

    async def _completion_chunks(self, streams, req: CompletionRequest, n: int, echoes, rid: str, created: int):
        scoring = req.max_tokens == 0
        model = req.model
        bases = [len(echoes[k // n]) for k in range(n * len(streams))]
        aligned = [self._aligner(streams[k // n]) for k in range(n * len(streams))]

        # (the prompt's ids go in each choice's first chunk)
        tokens = _ChoiceTokens(req, n * len(streams), lambda i: streams[i // n].prompt_token_ids, per_choice_prompt=True)

        def chunk(choices, usage=None):
            if choices:
                choices, usage = tokens.attach(choices, usage)
            return Completion(id=rid, created=created, model=model, choices=choices, usage=usage)

        usages: list[Usage] = []
        # With echo and logprobs, a prompt's echo waits for its prompt logprobs, which come
        # with its first chunk; chunks read before that one are held back until then.
        echo_logprobs = bool(req.echo) and req.logprobs is not None
        pending_echo = set(range(len(streams))) if echo_logprobs else set()
        held: dict[int, list] = {k: [] for k in pending_echo}
        try:
            if req.echo and not echo_logprobs:
                for index in range(n * len(streams)):
                    yield chunk([CompletionChoice(index=index, text=echoes[index // n])])
            # Chunks of several prompts are read from each in turn. The engine runs all of
            # them concurrently whoever is reading; this only orders the reading.
            active = list(enumerate(streams))
            ready: list[tuple[int, Any]] = []
            while active or ready:
                if ready:
                    k, c = ready.pop(0)
                else:
                    k, stream = active.pop(0)
                    try:
                        c = await stream.__anext__()
                        if scoring:
                            c = _without_generation(c)
                    except StopAsyncIteration:
                        if k in pending_echo:  # ended before its prompt logprobs (aborted)
                            pending_echo.discard(k)
                            for i in range(n):
                                yield chunk([CompletionChoice(index=k * n + i, text=echoes[k])])
                            ready.extend((k, h) for h in held.pop(k))
                        continue
                    active.append((k, stream))
                    if k in pending_echo:
                        if c.prompt_logprobs is None:
                            held[k].append(c)
                            continue
                        pending_echo.discard(k)
                        lps = self._prompt_logprobs(streams[k].prompt_token_ids, c.prompt_logprobs)
                        for i in range(n):
                            yield chunk([CompletionChoice(index=k * n + i, text=echoes[k], logprobs=lps)])
                        ready.extend((k, h) for h in held.pop(k))
                        ready.append((k, c))
                        continue
                index = k * n + c.index
                tokens.add(index, c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(aligned[index].add(c), bases[index])
                if c.text or (logprobs is not None and logprobs.tokens) or c.finish_reason is not None:
                    yield chunk([CompletionChoice(index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason)])
                if c.usage is not None:
                    usages.append(c.usage)
        except AsyncGenError as e:
            raise from_exception(e, prompt_param="prompt") from e
        finally:
            for s in streams:
                await s.aclose()
        if req.include_usage and usages:
            yield chunk([], _usage(usages))

    def _completion_logprobs(self, aligned, base: int) -> CompletionLogprobs:
        """``aligned``: (start in the completion's text, logprob) pairs; ``base``: the
        length of the text before the completion (the echo)."""
        text = self._text_of()
        out = CompletionLogprobs()
        for start, lp in aligned:
            out.tokens.append(text(lp.token_id)[0])
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(_top_by_text(text, lp))
            out.text_offset.append(base + start)
        return out

    def _prompt_logprobs(self, token_ids, lps) -> CompletionLogprobs:
        """The echoed prompt's tokens with their logprobs (None for the first token, which
        nothing predicts); text offsets from 0, in characters of the decoded prompt."""
        text = self._text_of()
        # Special tokens counted as their text: the echo keeps them (see _echo).
        starts = _TokenStarts(self.engine.tokenizer, text, skip_special_tokens=False)
        out = CompletionLogprobs()
        for i, token_id in enumerate(token_ids):
            lp = lps[i] if lps is not None and i < len(lps) else None
            out.tokens.append(text(token_id)[0])
            out.text_offset.append(starts.next(token_id))
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else _top_by_text(text, lp))
        return out

    def _echo(self, prompt) -> str:
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)

    # --- shared -------------------------------------------------------------------------------
    def _open(self, prompt, messages, params: SamplingParams, request_id: str, prompt_param: str, fields=None,
              chat_template_kwargs=None, tools=None, continue_final_message=False, add_generation_prompt=None,
              priority=0):
        try:
            return self.engine.stream(prompt, params, messages=messages, request_id=request_id,
                                      chat_template_kwargs=chat_template_kwargs, tools=tools,
                                      continue_final_message=continue_final_message,
                                      add_generation_prompt=add_generation_prompt, priority=priority)
        except (AsyncGenError, ValidationError) as e:
            raise from_exception(e, prompt_param=prompt_param, fields=fields) from e

    async def _collect(
        self, streams, n: int, prompt_param: str, scoring: bool = False, until: Optional[list] = None
    ) -> tuple[list["_Output"], CompletionUsage, list]:
        """Runs every stream to the end; their outputs, ``n`` per stream, the total usage,
        and each stream's prompt logprobs (None where not asked for). With ``scoring``
        the generated token is dropped (completions' ``max_tokens=0``). ``until``: a
        :class:`_CallWatch` per output, fed its text; once each output of a stream has
        finished or its watch has ended, the request is aborted (its outputs then end in
        "abort")."""
        outs = [_Output() for _ in range(n * len(streams))]
        aligned = [self._aligner(streams[i // n]) for i in range(n * len(streams))]
        usages: list[Usage] = []
        prompt_lps: list = [None] * len(streams)

        errors: list[AsyncGenError] = []

        async def drain(k: int, stream) -> None:
            watched = until[k * n : (k + 1) * n] if until is not None else None
            try:
                async for c in stream:
                    if scoring:
                        c = _without_generation(c)
                    if c.prompt_logprobs is not None:
                        prompt_lps[k] = c.prompt_logprobs
                    out = outs[k * n + c.index]
                    out.texts.append(c.text)
                    out.token_ids.extend(c.token_ids)
                    if c.logprobs is not None:
                        out.logprobs.extend(aligned[k * n + c.index].add(c))
                    if c.finish_reason is not None:
                        out.finish_reason = c.finish_reason
                    if c.usage is not None:
                        usages.append(c.usage)
                    if watched is not None and not watched[c.index].ended:
                        watched[c.index].feed(c.text)
                        mine = outs[k * n : (k + 1) * n]
                        if (watched[c.index].ended or c.finish_reason is not None) and all(
                            p.ended or o.finish_reason is not None for p, o in zip(watched, mine)
                        ) and any(o.finish_reason is None for o in mine):
                            self.engine.abort(stream.request_id)  # the replies left ended with their call
            except AsyncGenError as e:
                errors.append(e)
                tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                for k, stream in enumerate(streams):
                    tg.start_soon(drain, k, stream)
        finally:
            for stream in streams:
                await stream.aclose()
        if errors:
            raise from_exception(errors[0], prompt_param=prompt_param) from errors[0]
        return outs, _usage(usages), prompt_lps

    def _aligner(self, source: Any, prompt_token_ids: Sequence[int] = ()) -> _AlignedLogprobs:
        """A logprob aligner for one choice of a stream (or of SamplingParams and the
        prompt's token ids)."""
        if isinstance(source, SamplingParams):
            params = source
        else:
            params, prompt_token_ids = source.group.params, source.group.prompt_token_ids
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.engine.eos_token_ids
        return _AlignedLogprobs(self.engine.tokenizer, params.skip_special_tokens, stop_ids, self._text_of(),
                                params.include_stop_str_in_output, prompt_token_ids)

    def _text_of(self) -> _TokenText:
        if self._token_text is None:
            self._token_text = _TokenText(self.engine.tokenizer)
        return self._token_text


class _CallWatch:
    """Reads one output's answer (after a reasoning block, where the adapter splits one
    off) for tool calls, to tell when a reply that takes one call has it."""

    __slots__ = ("parser", "reasoning")

    def __init__(self, parser, reasoning=None):
        self.parser = parser
        self.reasoning = reasoning

    @property
    def ended(self) -> bool:
        return self.parser.ended

    def feed(self, text: str) -> None:
        if self.reasoning is not None:
            text = self.reasoning.feed(text)[1]
        self.parser.feed(text)


class _ChoiceTokens:
    """A stream's tokens by choice, for what its chunks carry: the usage so far
    (``continuous_usage_stats``) and the generated ids not sent yet (``return_token_ids``;
    with ``per_choice_prompt``, a choice's first chunk carries its prompt's ids too)."""

    def __init__(self, req, count: int, prompt_ids: Callable[[int], Sequence[int]], per_choice_prompt: bool = False):
        self._usage = req.continuous_usage
        self._ids = req.return_token_ids
        self._prompt_ids = prompt_ids
        self._generated = [0] * count
        self._unsent: list[list[int]] = [[] for _ in range(count)]
        self._prompt_due = [per_choice_prompt] * count

    def add(self, index: int, token_ids: Sequence[int], send: bool = True) -> None:
        self._generated[index] += len(token_ids)
        if send:
            self._unsent[index].extend(token_ids)

    def attach(self, choices: list, usage):
        """``choices`` (one choice) and ``usage`` with what this stream's chunk carries."""
        i = choices[0].index
        if usage is None and self._usage:
            usage = _usage([Usage(len(self._prompt_ids(i)), self._generated[i])])
        if self._ids:
            update: dict[str, Any] = {"token_ids": self._unsent[i]}
            if self._prompt_due[i]:
                update["prompt_token_ids"] = list(self._prompt_ids(i))
                self._prompt_due[i] = False
            choices = [choices[0].model_copy(update=update)]
            self._unsent[i] = []
        return choices, usage


class _Output:
    __slots__ = ("texts", "logprobs", "finish_reason", "token_ids")

    def __init__(self):
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, TokenLogprob]] = []  # (start in the text, logprob)
        self.finish_reason: Optional[str] = None


def _tool_delta(delta) -> Optional[ChoiceDelta]:
    """A ChoiceDelta for a parser's ToolCallDelta (None if it holds nothing)."""
    if not delta:
        return None
    calls = [
        ChoiceDeltaToolCall(
            index=p.index, id=p.id, type="function" if p.id is not None else None,
            function=ChoiceDeltaToolCallFunction(name=p.name, arguments=p.arguments),
        )
        for p in delta.tool_calls
    ]
    return ChoiceDelta(content=delta.content or None, tool_calls=calls or None)


def _merge_deltas(a: Optional[ChoiceDelta], b: Optional[ChoiceDelta]) -> Optional[ChoiceDelta]:
    if a is None or b is None:
        return a or b
    content = (a.content or "") + (b.content or "")
    reasoning = (a.reasoning_content or "") + (b.reasoning_content or "")
    return ChoiceDelta(content=content or None, reasoning_content=reasoning or None,
                       tool_calls=((a.tool_calls or []) + (b.tool_calls or [])) or None)


def _tool_finish_reason(req: ChatCompletionRequest, finish: Optional[str], made_calls: bool) -> Optional[str]:
    """The finish reason of a reply read for tool calls: "tool_calls" where it ended
    normally with calls, but "stop" for a named function, as OpenAI answers; "length" and
    "abort" stay."""
    if finish == "stop" and made_calls and req.tool_mode != "named":
        return "tool_calls"
    return finish


def _top_by_text(text: "_TokenText", lp: TokenLogprob) -> dict[str, float]:
    """Completions' ``top_logprobs`` entry: token text -> logprob for the ``k`` most
    likely tokens and the sampled one (the higher logprob where two ids decode to the
    same text)."""
    top: dict[str, float] = {}
    for t, v in (*lp.top, (lp.token_id, lp.logprob)):
        s = text(t)[0]
        top[s] = max(v, top.get(s, v))
    return top


def _without_generation(chunk: StreamChunk) -> StreamChunk:
    """A chunk of a prompt scored with completions' ``max_tokens=0`` (generated as one
    token): the same chunk without that token, finishing with "length"."""
    finish = chunk.finish_reason
    usage = chunk.usage
    return dataclasses.replace(
        chunk, text="", token_ids=(), logprobs=None if chunk.logprobs is None else (),
        finish_reason="length" if finish is not None and finish != "abort" else finish, stop_reason=None,
        usage=None if usage is None else Usage(usage.prompt_tokens, 0),
    )


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def _usage(usages: list[Usage]) -> CompletionUsage:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    details = None
    if usages and all(u.cached_tokens is not None for u in usages):
        details = PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in usages))
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=details)
