"""Tool calls in a model's output: parsers that split streamed text into content and
tool calls, and the structured-output schemas that force a call.

Models write tool calls in their own formats; a :class:`ToolCallParser` knows one of them
and is fed the output as it streams. Each :meth:`~ToolCallParser.feed` returns a
:class:`ToolCallDelta`: new content text, and new pieces of tool calls (a call's id and
name first, then its ``arguments`` text in pieces). The pieces of one output joined are
the same whatever the chunking, so a streamed reply and a whole one agree.

Formats (``name``: the models that write it):

* ``hermes``: Qwen2, Qwen2.5, Qwen3, Hermes 2/3 and others;
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call,
  anywhere in the output; a block holding a JSON array of such objects is taken too.
* ``llama3_json``: Llama 3.1-3.3's JSON tool calls; the output starts with
  ``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``), several
  separated by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": ...}``
  (Mistral's tokenizers mark ``[TOOL_CALLS]`` special, so the OpenAI layer keeps special
  tokens in the text for this parser).

:func:`detect_tool_call_parser` names the format a chat template writes, from the
markers in it.

What is parsed, exactly:

* A call object has a ``name`` (a string) and ``arguments`` or ``parameters``: a JSON
  value whose text becomes the call's ``arguments`` as written (a JSON string there is
  decoded: its content is the arguments), ``{}`` when absent. Other keys are skipped.
* Given the names of the tools, a call to any other name is not a call. An object that
  is not a call (no name, an unknown name, text that is not JSON) is content, marker
  and all: nothing the model wrote is dropped, except whitespace next to calls.
* A call is sent as soon as its name is known; what follows is its arguments' text as
  it arrives. Should the object then break off (the output ended, or it stopped being
  JSON), the call keeps what was sent, and the text after the break is content.

:func:`required_tools_schema` and :func:`named_tool_schema` are the JSON Schemas
the OpenAI layer constrains the output to for ``tool_choice="required"`` and a named
function; their outputs are read with :class:`RequiredToolCallsParser` and
:class:`NamedToolCallParser`. With ``tool_choice="auto"``, :func:`strict_tool_call_tag`
gives the structural tag under which the calls a model writes in the ``hermes`` format
follow the schemas of its ``strict`` functions, the text around them left free.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from .errors import InvalidRequestError

__all__ = [
    "NamedToolCallParser",
    "RequiredToolCallsParser",
    "TOOL_CALL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallPiece",
    "detect_tool_call_parser",
    "get_tool_call_parser",
    "named_tool_schema",
    "parse_tool_calls",
    "partial_marker",
    "required_tools_schema",
    "strict_tool_call_tag",
]

_WS = " \t\n\r"


@dataclass
class ToolCallPiece:
    """A piece of the tool call at ``index``: its first piece has ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None


@dataclass
class ToolCallDelta:
    content: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: Optional[str] = None) -> str:
    """A tool call's id: OpenAI's form (``call_`` and 24 hex digits), or with ``style``
    "mistral" the 9 letters and digits that Mistral's chat templates require of the ids
    sent back to them."""
    if style == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


# --- scanning JSON as it arrives ---------------------------------------------------------------
class _ValueScan:
    """Follows one JSON value char by char: where it ends, without checking it fully."""

    __slots__ = ("depth", "in_string", "escape", "kind", "done")

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.kind: Optional[str] = None  # "container", "string", "scalar"
        self.done = False

    def feed(self, s: str, i: int, final: bool) -> int:
        """Consumes s[i:] up to the value's end (not past it); returns the new index."""
        n = len(s)
        if self.kind is None:
            c = s[i]
            self.kind = "container" if c in "{[" else "string" if c == '"' else "scalar"
            if self.kind != "scalar":  # step over the opening character
                self.depth = 1 if self.kind == "container" else 0
                self.in_string = self.kind == "string"
                i += 1
        if self.kind == "scalar":
            while i < n and s[i] not in ",}]" + _WS:
                i += 1
            if i < n or final:
                self.done = True
            return i
        while i < n:
            c = s[i]
            i += 1
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.kind == "string":
                        self.done = True
                        return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i
        return i


def _string_end(s: str, i: int) -> Optional[int]:
    """The index after the JSON string starting at s[i] (a quote), or None if it has not ended."""
    j = i + 1
    n = len(s)
    while j < n:
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def partial_marker(s: str, marker: str) -> int:
    """The length of the longest end of ``s`` that begins ``marker``."""
    for k in range(min(len(s), len(marker) - 1), 0, -1):
        if marker.startswith(s[-k:]):
            return k
    return 0


class _Broken(Exception):
    """The text being read is not a tool call (or stopped being one) from ``at`` on."""

    def __init__(self, at: int):
        super().__init__(at)
        self.at = at


class _Call:
    """The call object being read."""

    __slots__ = ("mode", "key", "name", "args", "args_string", "args_done", "scan", "sent", "sent_args")

    def __init__(self):
        self.mode = "open"  # open -> key -> colon -> value -> (args | skip) -> comma -> key ...
        self.key: Optional[str] = None
        self.name: Optional[str] = None
        self.args: Optional[str] = None  # the arguments' text read so far
        self.args_string = False  # written as a JSON string (decoded once complete)
        self.args_done = False
        self.scan: Optional[_ValueScan] = None
        self.sent = False  # its id and name went out
        self.sent_args = 0  # how much of args went out


# --- the parsers ------------------------------------------------------------------------------
class ToolCallParser:
    """Splits one output into content and tool calls as it streams.

    ``feed(text)`` for each new piece of text, then ``finish()`` once; each returns the
    :class:`ToolCallDelta` for what it made certain. ``tool_names``: the names of the
    tools offered (calls to other names are read as content); None takes any name.
    ``max_calls``: the reply ends with that many calls (OpenAI's
    ``parallel_tool_calls=false`` is one): once the last of them is closed, or broke off
    after it went out, :attr:`ended` is true and the text after it is not read.
    """

    name = ""
    start_marker: Optional[str] = None  # opens calls anywhere in the text
    end_marker: Optional[str] = None  # closes them (may be missing at the end of the output)
    at_start = False  # calls only at the very start of the output (after whitespace)
    start_prefix: Optional[str] = None  # an optional marker before calls at the start
    openers = "{["  # what may open the calls (an object, or an array of objects)
    separator: Optional[str] = None  # between calls written one after another
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    call_id_style: Optional[str] = None  # how the calls' ids are made (new_call_id)

    def __init__(self, tool_names: Optional[Iterable[str]] = None, max_calls: Optional[int] = None,
                 call_id_style: Optional[str] = None):
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {max_calls}")
        if call_id_style is not None:
            self.call_id_style = call_id_style
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self.max_calls = max_calls
        self._buf = ""
        self._i = 0  # _buf[:_i] is read
        self._mark: Optional[int] = None  # where the text of a call not yet sent begins
        self._mode = "start" if self.at_start else "text"
        self._lstrip = False  # drop whitespace after a call
        self._in_array = False
        self._array_items = 0
        self._array_comma = False
        self._call: Optional[_Call] = None
        self._calls: list[ToolCall] = []
        self._out = ToolCallDelta()
        self._finished = False

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls read so far (the last one possibly unfinished)."""
        return [ToolCall(c.id, c.name, c.arguments) for c in self._calls]

    @property
    def ended(self) -> bool:
        """Whether the reply has its ``max_calls`` calls: nothing after them is read."""
        return self._mode == "ended"

    def feed(self, text: str) -> ToolCallDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._mode == "ended":
            return ToolCallDelta()
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolCallDelta:
        """What the end of the output makes certain: held text, an unfinished call's text."""
        if self._finished:
            return ToolCallDelta()
        self._finished = True
        return self._run(final=True)

    # --- the machine ------------------------------------------------------------------------
    def _run(self, final: bool) -> ToolCallDelta:
        while True:
            try:
                if not self._step(final):
                    break
            except _Broken as e:
                self._recover(e.at)
        if self._mode == "ended":
            self._buf, self._i, self._mark = "", 0, None
        elif final:
            self._flush_end()
        keep = self._i if self._mark is None else min(self._i, self._mark)
        if keep:
            self._buf = self._buf[keep:]
            self._i -= keep
            if self._mark is not None:
                self._mark -= keep
        out, self._out = self._out, ToolCallDelta()
        return out

    def _content(self, text: str) -> None:
        self._out.content += text

    def _step(self, final: bool) -> bool:
        """Reads on from _buf[_i]; False when more text is needed."""
        mode = self._mode
        if mode == "ended":
            return False
        if mode == "text":
            return self._step_text(final)
        if mode == "start":
            return self._step_start(final)
        if mode == "object":
            return self._step_object(final)
        s, j = self._buf, _skip_ws(self._buf, self._i)
        if mode == "after":
            return self._step_after(j, final)
        if j >= len(s):
            return False
        c = s[j]
        if mode == "body":  # after an opening marker: one object, or an array of them
            if c not in self.openers:
                raise _Broken(j)
            self._in_array = c == "["
            self._array_items, self._array_comma = 0, False
            if self._in_array:
                self._i, self._mode = j + 1, "array"
            else:
                self._open_call(j)
            return True
        if mode == "array":  # before an element, between two, or at the end
            if c == "{" and (self._array_items == 0 or self._array_comma):
                self._open_call(j)
            elif c == "," and self._array_items and not self._array_comma:
                self._array_comma = True
                self._i = j + 1
            elif c == "]" and not self._array_comma:
                self._i, self._mode, self._in_array = j + 1, "after", False
            else:
                raise _Broken(j)
            return True
        raise AssertionError(mode)

    def _step_text(self, final: bool) -> bool:
        s, i = self._buf, self._i
        if self._lstrip:
            i = self._i = _skip_ws(s, i)
            if i >= len(s):
                return False
            self._lstrip = False
        marker = self.start_marker
        j = s.find(marker, i) if marker else -1
        if j >= 0:
            text = s[i:j].rstrip(_WS)  # whitespace before a call is its layout (content if no call comes)
            self._content(text)
            self._mark, self._i, self._mode = i + len(text), j + len(marker), "body"
            return True
        if final:
            return False
        end = len(s) - (partial_marker(s[i:], marker) if marker else 0)
        text = s[i:end].rstrip(_WS)  # held: it may turn out to be layout before a call
        self._content(text)
        self._i = i + len(text)
        return False

    def _step_start(self, final: bool) -> bool:
        s, i = self._buf, self._i
        j = _skip_ws(s, i)
        prefix = self.start_prefix
        if prefix is not None:
            if s.startswith(prefix, j):
                j = _skip_ws(s, j + len(prefix))
            elif j < len(s) and prefix.startswith(s[j:]) and not final:
                return False
        if j >= len(s):
            return False
        if s[j] in self.openers:
            self._mark, self._i, self._mode = i, j, "body"
        else:
            self._mode = "text"
        return True

    def _open_call(self, j: int) -> None:
        self._call = _Call()
        if self._mark is None:
            self._mark = j
        self._i, self._mode = j, "object"

    def _step_object(self, final: bool) -> bool:
        s, call = self._buf, self._call
        om = call.mode
        if om in ("args", "skip"):
            i = self._i
            j = call.scan.feed(s, i, final)
            self._i = j
            if om == "args":
                call.args += s[i:j]
                if call.scan.done:
                    call.args_done = True
                    if call.args_string:
                        try:
                            call.args = json.loads(call.args)
                        except ValueError:
                            raise _Broken(j) from None
                self._send()
            if call.scan.done:
                call.mode = "comma"
                return True
            return False
        j = _skip_ws(s, self._i)
        if j >= len(s):
            return False
        c = s[j]
        if om == "open":
            if c != "{":
                raise _Broken(j)
            call.mode, self._i = "key", j + 1
        elif om == "key":
            if c == "}" and call.key is None:
                return self._close_call(j + 1)
            if c != '"':
                raise _Broken(j)
            end = _string_end(s, j)
            if end is None:
                return False
            call.key = _loads(s[j:end], j)
            call.mode, self._i = "colon", end
        elif om == "colon":
            if c != ":":
                raise _Broken(j)
            call.mode, self._i = "value", j + 1
        elif om == "value":
            if call.key == "name" and call.name is None:
                if c != '"':
                    raise _Broken(j)
                end = _string_end(s, j)
                if end is None:
                    return False
                name = _loads(s[j:end], j)
                if not name or (self.tool_names is not None and name not in self.tool_names):
                    raise _Broken(j)
                call.name = name
                self._send()
                call.mode, self._i = "comma", end
            else:
                call.scan = _ValueScan()
                if call.key in self.argument_keys and call.args is None:
                    call.args, call.args_string = "", c == '"'
                    call.mode = "args"
                else:
                    call.mode = "skip"
                self._i = j
        elif om == "comma":
            if c == ",":
                call.mode, self._i = "key", j + 1
            elif c == "}":
                return self._close_call(j + 1)
            else:
                raise _Broken(j)
        return True

    def _send(self) -> None:
        """Sends the call's id and name once its name is known, then its arguments as they come."""
        call = self._call
        if call.name is None:
            return
        if not call.sent:
            self._calls.append(ToolCall(new_call_id(self.call_id_style), call.name, ""))
            self._out.tool_calls.append(ToolCallPiece(len(self._calls) - 1, "", self._calls[-1].id, call.name))
            call.sent = True
            self._mark = None
        if call.args is None or (call.args_string and not call.args_done):
            return
        piece = call.args[call.sent_args:]
        if piece:
            call.sent_args = len(call.args)
            index = len(self._calls) - 1
            self._calls[index].arguments += piece
            pieces = self._out.tool_calls
            if pieces and pieces[-1].index == index:
                pieces[-1].arguments += piece
            else:
                pieces.append(ToolCallPiece(index, piece))

    def _close_call(self, j: int) -> bool:
        call = self._call
        if call.name is None:
            raise _Broken(j)
        if call.args is None:
            call.args, call.args_done = "{}", True
            self._send()
        self._call = None
        self._i = j
        if self._full():
            return False
        if self._in_array:
            self._array_items += 1
            self._array_comma = False
            self._mode = "array"
        else:
            self._mode = "after"
        return True

    def _full(self) -> bool:
        """Ends the reading once the calls that went out reach ``max_calls``."""
        if self.max_calls is not None and len(self._calls) >= self.max_calls:
            self._mode = "ended"
            return True
        return False

    def _step_after(self, j: int, final: bool) -> bool:
        """After a call (or an array of them): a closing marker, a separator, or text."""
        s = self._buf
        rest = s[j:]
        if self.end_marker is not None:
            if rest.startswith(self.end_marker):
                self._i, self._mode, self._lstrip = j + len(self.end_marker), "text", True
                return True
            if self.end_marker.startswith(rest) and rest:
                if not final:
                    return False
                self._i, self._mode = len(s), "text"  # a marker cut off by the end of the output is layout
                return True
        elif self.separator is not None and rest.startswith(self.separator):
            self._i = j + len(self.separator)
            self._mark, self._mode = j, "body"
            return True
        if not rest and not final:
            return False
        self._i, self._mode, self._lstrip = j, "text", False
        return True

    def _recover(self, at: int) -> None:
        """What was read as a call is none (or stopped being one at ``at``): it is text."""
        call = self._call
        self._call = None
        self._in_array = False
        self._mode = "text"
        if self._mark is None:  # a call went out: it keeps what it has; text resumes at `at`
            self._i = at
            self._full()
            return
        start, self._mark = self._mark, None
        marker = self.start_marker
        k = _skip_ws(self._buf, start)
        if marker and self._buf.startswith(marker, k):
            # the marker is text; what follows it is read again (it may hold a real call)
            self._content(self._buf[start:k + len(marker)])
            self._i = k + len(marker)
        else:
            self._content(self._buf[start:at])
            self._i = at
        del call

    def _flush_end(self) -> None:
        """At the end of the output: held text and an unsent call's text are content
        (whitespace alone only when no call was made)."""
        s = self._buf
        if self._mark is not None:
            rest = s[self._mark:]
            self._mark = None
        elif self._mode in ("text", "start"):
            rest = s[self._i:]
        else:
            rest = ""
        self._i = len(s)
        if rest.strip(_WS) or (rest and not self._calls):
            self._content(rest)


def _loads(text: str, at: int) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise _Broken(at) from None


class HermesToolCallParser(ToolCallParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"


class Llama3JsonToolCallParser(ToolCallParser):
    name = "llama3_json"
    at_start = True
    start_prefix = "<|python_tag|>"
    openers = "{"
    separator = ";"


class MistralToolCallParser(ToolCallParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    call_id_style = "mistral"


class RequiredToolCallsParser(ToolCallParser):
    """Reads the output of :func:`required_tools_schema`: ``[{"name": ..., "parameters": ...}, ...]``."""

    name = "required"
    at_start = True
    openers = "["
    argument_keys = ("parameters",)


class NamedToolCallParser:
    """Reads the output of :func:`named_tool_schema`: the arguments of one call to ``name``."""

    ended = False  # (the grammar ends the reply; see ToolCallParser.ended)

    def __init__(self, name: str, call_id_style: Optional[str] = None):
        self._call = ToolCall(new_call_id(call_id_style), name, "")
        self._started = False
        self._finished = False

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(self._call.id, self._call.name, self._call.arguments)] if self._started else []

    def feed(self, text: str) -> ToolCallDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out = ToolCallDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallPiece(0, text, self._call.id, self._call.name))
        elif text:
            out.tool_calls.append(ToolCallPiece(0, text))
        self._call.arguments += text
        return out

    def finish(self) -> ToolCallDelta:
        if self._finished or self._started:
            self._finished = True
            return ToolCallDelta()
        return self.feed("")


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesToolCallParser, Llama3JsonToolCallParser, MistralToolCallParser)
}


def get_tool_call_parser(name: str) -> type[ToolCallParser]:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}",
            param="tool_call_parser",
        ) from None


def detect_tool_call_parser(chat_template: Optional[str]) -> Optional[str]:
    """The parser for the tool calls a chat template teaches the model to write, from
    the markers in the template; None if it writes none that a parser knows."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return "llama3_json"
    return None


def parse_tool_calls(parser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's content and tool calls (as streaming it through ``parser`` would give)."""
    first = parser.feed(text)
    last = parser.finish()
    return first.content + last.content, parser.tool_calls


# --- forcing calls with structured outputs ------------------------------------------------
def _parameters(function: dict[str, Any]) -> Any:
    params = function.get("parameters")
    return {"type": "object", "additionalProperties": False} if params is None else params


def named_tool_schema(function: dict[str, Any]) -> Any:
    """The schema of the arguments of a call to ``function`` (an OpenAI function
    definition: name, description, parameters): its parameters, or ``{}`` if it has none."""
    return _parameters(function)


# The formats whose calls a structural tag can hold. A call in them opens with a marker
# the model writes anywhere in its text (not so llama3_json's, which only starts an output,
# nor mistral's, a special token that structured outputs never allow).
_CALL_TAGS = ("hermes",)


def strict_tool_call_tag(parser: str, functions: list[dict[str, Any]],
                         reasoning: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The structural tag (see :func:`asyncgen.structured.structural_tag_grammar`) under
    which each call the model opens in format ``parser`` names one of ``functions`` and
    has arguments valid for its ``parameters`` where the function is ``strict`` (any JSON
    object where it is not), while the text around the calls stays free; None for the
    formats it cannot hold (``llama3_json``, ``mistral``). ``reasoning`` ("may_open" or
    "inside") leaves a thinking model's ``<think>`` block free, where calls are not read."""
    if parser not in _CALL_TAGS:
        return None
    start, end = TOOL_CALL_PARSERS[parser].start_marker, TOOL_CALL_PARSERS[parser].end_marker
    structures = [
        {"begin": f'{start}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
         "schema": _parameters(f) if f.get("strict") else {"type": "object"}, "end": f"}}\n{end}"}
        for f in functions
    ]
    tag = {"type": "structural_tag", "structures": structures, "triggers": [start]}
    if reasoning is not None:
        tag["reasoning"] = reasoning
    return tag


def required_tools_schema(functions: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """A JSON array of one or more calls (one with ``parallel=False``), each
    ``{"name": <one of the functions>, "parameters": <its arguments>}``."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)},
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
