"""Structured outputs: grammars over the output's bytes, and the tokens each state allows.

A :class:`Grammar` is a pushdown automaton over bytes (tokens may split a UTF-8
character, so it never sees characters). Its states are immutable, hashable values: a
state is one *stack* (a tuple of frames, the innermost last) or, where the grammar is
ambiguous (an ``anyOf`` of overlapping schemas), a frozenset of two or more stacks;
alternatives that a byte rules out drop out. Equal situations give equal states, so
whatever is computed per state (the allowed tokens) is computed once.

Five grammars:

* :func:`json_schema_grammar`: one JSON value (RFC 8259) that satisfies a JSON Schema
  (draft 2020-12, the subset below);
* :func:`json_object_grammar`: any JSON object (OpenAI's ``json_object`` mode);
* :func:`choice_grammar`: exactly one of a list of strings;
* :func:`regex_grammar`: raw text that a regular expression matches in whole;
* :func:`structural_tag_grammar`: free text in which each structure that a trigger
  string opens must be complete: its begin string, a JSON value of its schema, its end
  string (vLLM's ``structural_tag``; how strict tool calls are generated in "auto" mode).

The JSON language, as bytes:

* Whitespace (space, ``\\n``, ``\\r``, ``\\t``) where RFC 8259 allows it, in runs of at most
  :data:`MAX_WHITESPACE` bytes (enough for pretty-printed JSON, not enough for a model to
  loop on newlines). Nothing follows the complete top-level value, not even whitespace:
  the only continuation then is the stop token.
* Strings: any Unicode except unescaped control characters (< 0x20); escapes ``\\" \\\\
  \\/ \\b \\f \\n \\r \\t \\uXXXX``. Raw characters must be valid UTF-8 (RFC 3629: no
  overlong forms, no surrogates, nothing past U+10FFFF), checked byte by byte.
* Numbers: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``, integers without the
  fraction and exponent, and at most :data:`MAX_NUMBER_BYTES` bytes each (so a model
  cannot loop on digits). A number ends at the byte after it (``,`` ``]`` ``}`` or
  whitespace); at the top level a complete number is a complete output.

JSON Schema keywords enforced:

* ``type`` (one name or a list); without ``type`` the type follows from the keywords
  present (``properties`` -> object, ``items`` -> array, ``minLength`` -> string, ...),
  and a schema with none of them (``{}``, ``true``) allows any value. ``false`` is refused.
* objects: ``properties`` come in their declared order, those in ``required`` must
  appear, the others may be left out, and no other key may appear (OpenAI's strict mode).
  An object without ``properties`` is a map: any keys, with values of the
  ``additionalProperties`` schema (any value when it is absent or true; only ``{}``
  when it is false); ``properties`` next to an ``additionalProperties`` that is true or a
  schema is refused. Keys are written as ``json.dumps(name, ensure_ascii=False)``.
* arrays: ``items``, ``prefixItems``, ``minItems``, ``maxItems``.
* strings: ``minLength``, ``maxLength`` (characters; an escape is one character, and an
  escaped surrogate pair is one); ``pattern`` (a regular expression that must match
  somewhere in the string, as JSON Schema says; :mod:`asyncgen.regex` lists the syntax);
  ``format`` as one of :data:`FORMATS` (``date-time``, ``date``, ``time``, ``duration``,
  ``uuid``, ``email``, ``hostname``, ``ipv4``, ``uri``, checked as patterns: a hostname's
  labels are 1-63 characters long, the whole name's 253 is not enforced; a URI is RFC 3986's
  with a registered name or IPv4 address as host, not an IP literal in brackets; ``password``
  is a display hint and constrains nothing). In a string with a pattern or format, the
  characters are checked by a DFA as they are decoded: ``\\"``, ``\\n`` and the other
  short escapes stand for their characters, ``\\u`` escapes are not generated, and control
  characters without a short escape cannot occur.
* ``enum`` and ``const`` of any JSON values, written as ``json.dumps(value,
  ensure_ascii=False, separators=(",", ":"))``; the schema's other keywords filter them.
* ``anyOf``; ``oneOf`` is treated as ``anyOf`` (an output matching two branches is not
  refused); ``allOf`` of exactly one schema; ``$ref`` to any JSON pointer within the
  schema (``#``, ``#/$defs/...``, ``#/definitions/...``), recursive schemas included.
* Annotations, ignored: ``title description default examples $schema $id $comment
  deprecated readOnly writeOnly discriminator $defs definitions`` (``$id`` at the root
  only: below it, a schema with an ``$id`` of its own is refused).

Every other keyword (``minimum``, ``multipleOf``, ...) and other formats are refused with an
:class:`~asyncgen.errors.InvalidRequestError` (``param="structured_outputs"``) naming it and
where it is, as are ``anyOf``/``oneOf``/``allOf``/``$ref`` next to validation keywords.
Branches of a schema that admit no finite value (a required property whose schema has
no finite instance) are left out, so every state the grammar reaches can still be
completed.

:class:`TokenGuide` turns a state into the sorted ids of the tokens that may follow it,
walking a byte trie of the :class:`Vocabulary` from the state and pruning each branch at
the first byte the grammar refuses. Tokens of plain string content (no quote, backslash
or control byte, whole UTF-8 characters) leave the grammar's stack as it is wherever a
string is open, so they are decided without it: inside a free string they are allowed as
a block; inside a pattern string or a regex output all of them run through the DFA's
tables at once (numpy, memoized per DFA state). Only the other tokens are walked. In a
structural tag's free text the plain tokens run through the DFA that watches for the
triggers, and those holding a trigger's last byte (which may open a structure) are
walked with the others.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import re
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union
from urllib.parse import unquote

import numpy as np

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .regex import ByteDFA

__all__ = [
    "FORMATS",
    "Grammar",
    "MAX_NUMBER_BYTES",
    "MAX_WHITESPACE",
    "TokenGuide",
    "Vocabulary",
    "choice_grammar",
    "json_object_grammar",
    "json_schema_grammar",
    "regex_grammar",
    "structural_tag_grammar",
]

MAX_WHITESPACE = 40  # bytes in one run of whitespace between JSON tokens
MAX_NUMBER_BYTES = 32  # bytes in one JSON number, sign and exponent included
MEMO_IDS = 16_000_000  # token ids a TokenGuide's memo holds before it is emptied (~128 MB)

State = Any  # a stack (tuple of frames) or a frozenset of two or more stacks

# --- frames ---------------------------------------------------------------------------------
# A stack is a tuple of frames, the innermost last; the bottom frame is always (_END,).
# Each frame is a small tuple whose first item is its tag:
#
#   (_END,)                               the top-level value is complete: no byte may follow
#   (_VALUE, node, ws)                    a value of `node` comes next, after `ws` whitespace bytes
#   (_OBJECT, spec, pos, phase, sub)      in an object; `pos` = index of the next declared key
#                                         that may come; `sub` = whitespace bytes, or the key
#                                         trie node in phase _O_KEY
#   (_ARRAY, spec, count, phase, ws)      in an array of `count` items so far (clamped where
#                                         more items change nothing, so states stay few)
#   (_STRING, spec, count, sub, hi)       in a string: `count` characters (limited strings
#                                         only), `sub` = UTF-8 or escape progress, `hi` = the
#                                         last character was an escaped high surrogate
#   (_NUMBER, integer, phase, length)     in a number of `length` bytes
#   (_LITERAL, lit)                       in one of a set of fixed byte strings (enum, true, ...)
#   (_PATTERN, spec, dstate, escape)      in a string with a pattern or format: `dstate` = the state
#                                         of its characters' DFA, `escape` = after a backslash
#   (_REGEX, dfa, dstate)                 raw output that a regular expression must match
#   (_TAGS, spec, dstate)                 free text of a structural tag (the bottom frame): `dstate`
#                                         = the state of spec.dfa, which watches for the triggers
#   (_BEGIN, spec, lit)                   in the begin string of a structure, after its trigger
#                                         (`lit`: the node of the trie of what follows triggers)
#   (_TAG_END, lit, ws)                   after a structure's value: `ws` whitespace bytes so far
#                                         (-1 once the end string began), then the end string
#
# A frame whose value ends with its last byte (strings, objects, arrays, literals) is
# popped by that byte; its parent was already set to what follows the value. A number (or
# a literal that may go on, like 1 in enum [1, 12]) ends at the next byte it cannot take,
# which is then fed to the parent.
_END, _VALUE, _OBJECT, _ARRAY, _STRING, _NUMBER, _LITERAL, _PATTERN, _REGEX, _TAGS, _BEGIN, _TAG_END = range(12)

_O_OPEN, _O_KEY, _O_COLON, _O_AFTER, _O_COMMA = range(5)  # after {, in a key, before :, after a value, after ,
_A_OPEN, _A_AFTER, _A_COMMA = range(3)  # after [, after an item, after ,

_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_EXP_MARK, _N_EXP_SIGN, _N_EXP = range(8)
_NUM_COMPLETE = (False, True, True, False, True, False, False, True)

# _STRING sub-states: 0 between characters; 1-7 inside a UTF-8 character (see _UTF8_NEXT);
# then escapes.
_S_ESC = 8  # after a backslash
_S_U0 = 9  # after \u
_S_U1, _S_U1D = 10, 11  # one hex digit (_S_U1D: it was d/D)
_S_U2, _S_U2HI, _S_U2LO = 12, 13, 14  # two digits (high surrogate d8-db, low surrogate dc-df)
_S_U3, _S_U3HI, _S_U3LO = 15, 16, 17  # three digits

_QUOTE, _BACKSLASH, _COLON, _COMMA = 0x22, 0x5C, 0x3A, 0x2C
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 0x7B, 0x7D, 0x5B, 0x5D

_FREE_HEX_NEXT = {_S_U0: _S_U1, _S_U1: _S_U2, _S_U2: _S_U3, _S_U3: 0}

_IS_WS = tuple(b in b" \n\r\t" for b in range(256))
_IS_HEX = tuple(b in b"0123456789abcdefABCDEF" for b in range(256))
_SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')

# Byte classes inside a string.
_C_PLAIN, _C_QUOTE, _C_BACKSLASH, _C_LEAD, _C_BAD = range(5)


def _string_class(b: int) -> int:
    if b == _QUOTE:
        return _C_QUOTE
    if b == _BACKSLASH:
        return _C_BACKSLASH
    if 0x20 <= b < 0x80:
        return _C_PLAIN
    if 0xC2 <= b <= 0xF4:
        return _C_LEAD
    return _C_BAD  # control characters, stray continuation bytes, C0 C1 F5-FF


_STRING_CLASS = tuple(_string_class(b) for b in range(256))
_IS_PLAIN = tuple(c == _C_PLAIN for c in _STRING_CLASS)


def _utf8_tables() -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Strict UTF-8 (RFC 3629: no overlong forms, surrogates or code points past U+10FFFF).

    lead[b]: the sub-state after lead byte b; next[sub][b]: the sub-state after
    continuation byte b (-1: refused). Sub-states 1-3: that many continuation bytes
    80-BF due; 4 (after E0): A0-BF then one; 5 (after ED): 80-9F then one; 6 (after
    F0): 90-BF then two; 7 (after F4): 80-8F then two.
    """
    lead = [0] * 256
    for b in range(0xC2, 0xF5):
        lead[b] = 1 if b < 0xE0 else 2 if b < 0xF0 else 3
    lead[0xE0], lead[0xED], lead[0xF0], lead[0xF4] = 4, 5, 6, 7
    ranges = {1: (0x80, 0xBF, 0), 2: (0x80, 0xBF, 1), 3: (0x80, 0xBF, 2),
              4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}
    table = [(-1,) * 256]
    for sub in range(1, 8):
        low, high, nxt = ranges[sub]
        table.append(tuple(nxt if low <= b <= high else -1 for b in range(256)))
    return tuple(lead), tuple(table)


_UTF8_LEAD, _UTF8_NEXT = _utf8_tables()


def _number_table(integer: bool) -> tuple[tuple[int, ...], ...]:
    """next phase = table[phase][byte], -1 where the byte cannot continue the number."""
    table = [[-1] * 256 for _ in range(8)]
    digits, nonzero = b"0123456789", b"123456789"
    table[_N_MINUS][ord("0")] = _N_ZERO
    for b in nonzero:
        table[_N_MINUS][b] = _N_INT
    for b in digits:
        table[_N_INT][b] = _N_INT
    if not integer:
        for phase in (_N_ZERO, _N_INT):
            table[phase][ord(".")] = _N_DOT
        for phase in (_N_ZERO, _N_INT, _N_FRAC):
            table[phase][ord("e")] = table[phase][ord("E")] = _N_EXP_MARK
        for b in digits:
            table[_N_DOT][b] = table[_N_FRAC][b] = _N_FRAC
            table[_N_EXP_MARK][b] = table[_N_EXP_SIGN][b] = table[_N_EXP][b] = _N_EXP
        table[_N_EXP_MARK][ord("+")] = table[_N_EXP_MARK][ord("-")] = _N_EXP_SIGN
    return tuple(tuple(row) for row in table)


_NUM_NEXT = (_number_table(False), _number_table(True))  # indexed by the frame's `integer`


# --- compiled schema pieces (immutable once the grammar is built) -----------------------
class _Lit:
    """A node of a trie of fixed byte strings; a leaf is the end of one (``index``: which)."""

    __slots__ = ("children", "terminal", "index")

    def __init__(self):
        self.children: dict[int, _Lit] = {}
        self.terminal = False
        self.index = -1


def _literal_trie(strings: Iterable[bytes], first_index: int = 0) -> _Lit:
    root = _Lit()
    for index, data in enumerate(strings, first_index):
        node = root
        for b in data:
            child = node.children.get(b)
            if child is None:
                child = node.children[b] = _Lit()
            node = child
        node.terminal = True
        node.index = index
    return root


class _StringSpec:
    __slots__ = ("min_length", "max_length", "cap")

    def __init__(self, min_length: int, max_length: Optional[int]):
        self.min_length = min_length
        self.max_length = max_length
        self.cap = max_length if max_length is not None else min_length  # counting further changes nothing


_FREE_STRING = _StringSpec(0, None)

# A JSON escape's character (the byte after the backslash -> the character's byte).
_ESCAPED = {ord('"'): 0x22, 0x5C: 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
            ord("r"): 0x0D, ord("t"): 0x09}
# Characters a pattern string cannot hold: the controls with no short escape (``\uXXXX``
# escapes are not generated in such strings).
_NO_SHORT_ESCAPE = bytes(b for b in range(0x20) if b not in _ESCAPED.values())


class _PatternSpec:
    """A string whose characters a DFA (asyncgen.regex) checks: ``pattern``, ``format``
    and the length bounds next to them. ``escapable[d]``: some escape can follow in DFA
    state d."""

    __slots__ = ("dfa", "escapable")

    def __init__(self, dfa):
        self.dfa = dfa
        self.escapable = tuple(any(row[c] >= 0 for c in _ESCAPED.values()) for row in dfa.next)


class _Property:
    __slots__ = ("name", "key", "node", "required")

    def __init__(self, name: str, node: "_Node", required: bool):
        self.name = name
        self.key = json.dumps(name, ensure_ascii=False).encode()[1:]  # after the opening quote
        self.node = node
        self.required = required


class _ObjectSpec:
    """Declared properties (``props``) or a map (``map_value``: the schema of every value).

    Runtime tables, by ``pos`` (the index of the next declared property that may come):
    ``keys[pos]`` the trie of the keys that may come next (from pos up to the first
    required one), None when none may; ``can_close[pos]``; ``values[i]`` property i's node.
    """

    __slots__ = ("props", "map_value", "keys", "can_close", "values")

    def __init__(self, props: list[_Property], map_value: Optional["_Node"]):
        self.props = props
        self.map_value = map_value
        self.keys: tuple = ()
        self.can_close: tuple = ()
        self.values: tuple = ()

    def finish(self) -> None:
        if self.map_value is not None and not self.map_value.productive:
            self.map_value = None  # no value can complete: only {} is left
            self.props = []
        if self.map_value is not None:
            self.keys, self.can_close = (None,), (True,)
            return
        live = [p for p in self.props if p.node.productive]
        self.values = tuple(p.node for p in live)
        keys, can_close = [], []
        for pos in range(len(live) + 1):
            end = pos
            while end < len(live) and not live[end].required:
                end += 1
            can_close.append(end == len(live))
            candidates = live[pos : end + 1]
            keys.append(_literal_trie((p.key for p in candidates), pos) if candidates else None)
        self.keys, self.can_close = tuple(keys), tuple(can_close)


class _ArraySpec:
    """``prefix`` items, then ``items`` (None: no more); at runtime, :meth:`item_after`
    and ``cap``, the count past which more items change nothing (counts are clamped there
    so that states stay few)."""

    __slots__ = ("prefix", "items", "min_items", "max_items", "limit", "cap")

    def __init__(self, prefix: list["_Node"], items: Optional["_Node"], min_items: int, max_items: Optional[int]):
        self.prefix = prefix
        self.items = items
        self.min_items = min_items
        self.max_items = max_items
        self.limit: Optional[int] = None
        self.cap = 0

    def item(self, i: int) -> Optional["_Node"]:
        return self.prefix[i] if i < len(self.prefix) else self.items

    def item_after(self, count: int) -> Optional["_Node"]:
        """The node of the next item after ``count`` items, None if no more may come."""
        if self.limit is not None and count >= self.limit:
            return None
        return self.prefix[count] if count < len(self.prefix) else self.items

    def max_complete(self) -> Optional[int]:
        """The most items that can be complete values (None: no limit)."""
        limit = self.max_items
        for i, node in enumerate(self.prefix):
            if not node.productive:
                return i if limit is None else min(limit, i)
        if self.items is None or not self.items.productive:
            n = len(self.prefix)
            return n if limit is None else min(limit, n)
        return limit

    def productive(self) -> bool:
        limit = self.max_complete()
        return limit is None or self.min_items <= limit

    def finish(self) -> None:
        self.limit = self.max_complete()
        self.cap = self.limit if self.limit is not None else max(len(self.prefix), self.min_items)


class _Node:
    """One schema: the alternatives a value may take, and ``start``, by first byte, the
    frames that replace a _VALUE frame of this node when that byte arrives.

    ``parts`` (while compiling): ("alt", descriptor) or ("include", node) for anyOf
    branches and references. Descriptors: ("object", _ObjectSpec), ("array", _ArraySpec),
    ("string", _StringSpec), ("number", integer), ("literal", python values),
    ("enum", node) for a node with ``enum``/``const`` (``values`` filtered by ``shadow``,
    the same schema without them).
    """

    __slots__ = ("pointer", "parts", "alts", "enum", "shadow", "values", "productive", "start")

    def __init__(self, pointer: str):
        self.pointer = pointer
        self.parts: list[tuple[str, Any]] = []
        self.alts: Optional[list[tuple[str, Any]]] = None
        self.enum: Optional[list[Any]] = None
        self.shadow: Optional[_Node] = None
        self.values: list[Any] = []
        self.productive = False
        self.start: dict[int, tuple[tuple, ...]] = {}


class _TagSpec:
    """A structural tag's tables: ``dfa`` reads free text and refuses (-1) the byte that
    completes a trigger; ``completed[(d, b)]`` then names the triggers that byte completes
    from DFA state d; ``rests[t]`` is the trie of what follows trigger t in the begin
    strings that start with it (a leaf's ``index``: the structure); ``frames[i]`` replace
    the begin's frame once structure i's begin is complete (its value, then its end)."""

    __slots__ = ("dfa", "completed", "rests", "frames", "last_bytes")

    def __init__(self, dfa, completed: dict, rests: list, frames: list, last_bytes: frozenset):
        self.dfa = dfa
        self.completed = completed
        self.rests = rests
        self.frames = frames
        self.last_bytes = last_bytes


def _enter(base: tuple, spec: _TagSpec, lit: _Lit, out: list) -> None:
    """Appends the stacks of ``base`` (ending with the free text's frame) at trie node
    ``lit`` of the begin strings: a structure's value where one ends, more begin where
    one goes on."""
    if lit.terminal:
        out.append(base + spec.frames[lit.index])
    if lit.children:
        out.append(base + ((_BEGIN, spec, lit),))


# --- the automaton ------------------------------------------------------------------------
def _feed(stack: tuple, b: int, out: list) -> None:
    """Appends to ``out`` every stack that ``stack`` becomes after byte ``b``."""
    top = stack[-1]
    tag = top[0]
    if tag == _STRING:
        spec, sub = top[1], top[3]
        if spec is not _FREE_STRING:
            _feed_limited_string(stack, top, b, out)
        elif sub == 0:
            cls = _STRING_CLASS[b]
            if cls == _C_PLAIN:
                out.append(stack)
            elif cls == _C_QUOTE:
                out.append(stack[:-1])
            elif cls == _C_BACKSLASH:
                out.append(stack[:-1] + ((_STRING, spec, 0, _S_ESC, 0),))
            elif cls == _C_LEAD:
                out.append(stack[:-1] + ((_STRING, spec, 0, _UTF8_LEAD[b], 0),))
        elif sub < _S_ESC:
            nxt = _UTF8_NEXT[sub][b]
            if nxt >= 0:
                out.append(stack[:-1] + ((_STRING, spec, 0, nxt, 0),))
        elif sub == _S_ESC:
            if b in _SIMPLE_ESCAPES:
                out.append(stack[:-1] + ((_STRING, spec, 0, 0, 0),))
            elif b == 0x75:  # u
                out.append(stack[:-1] + ((_STRING, spec, 0, _S_U0, 0),))
        elif _IS_HEX[b]:  # free strings use only _S_U0 -> _S_U1 -> _S_U2 -> _S_U3 -> 0
            out.append(stack[:-1] + ((_STRING, spec, 0, _FREE_HEX_NEXT[sub], 0),))
    elif tag == _VALUE:
        if _IS_WS[b]:
            if top[2] < MAX_WHITESPACE:
                out.append(stack[:-1] + ((_VALUE, top[1], top[2] + 1),))
        else:
            alts = top[1].start.get(b)
            if alts:
                base = stack[:-1]
                for frames in alts:
                    out.append(base + frames)
    elif tag == _OBJECT:
        _feed_object(stack, top, b, out)
    elif tag == _ARRAY:
        _feed_array(stack, top, b, out)
    elif tag == _NUMBER:
        integer, phase, length = top[1], top[2], top[3]
        nxt = _NUM_NEXT[integer][phase][b]
        if nxt >= 0:
            # an incomplete number needs room for one more byte, or it could never end
            if length < MAX_NUMBER_BYTES - (0 if _NUM_COMPLETE[nxt] else 1):
                out.append(stack[:-1] + ((_NUMBER, integer, nxt, length + 1),))
        elif _NUM_COMPLETE[phase]:
            _feed(stack[:-1], b, out)
    elif tag == _PATTERN:
        _feed_pattern(stack, top, b, out)
    elif tag == _REGEX:
        nxt = top[1].next[top[2]][b]
        if nxt >= 0:
            out.append(stack[:-1] + ((_REGEX, top[1], nxt),))
    elif tag == _LITERAL:
        lit = top[1]
        child = lit.children.get(b)
        if child is not None:
            out.append(stack[:-1] + ((_LITERAL, child),) if child.children else stack[:-1])
        elif lit.terminal:
            _feed(stack[:-1], b, out)
    elif tag == _TAGS:
        spec, d = top[1], top[2]
        nxt = spec.dfa.next[d][b]
        if nxt >= 0:
            out.append(stack[:-1] + ((_TAGS, spec, nxt),))
        else:  # a trigger is complete: a structure that begins with it follows
            base = stack[:-1] + ((_TAGS, spec, 0),)  # (0: the watch's start, after the structure)
            for t in spec.completed[(d, b)]:
                _enter(base, spec, spec.rests[t], out)
    elif tag == _BEGIN:
        child = top[2].children.get(b)
        if child is not None:
            _enter(stack[:-1], top[1], child, out)
    elif tag == _TAG_END:
        lit, ws = top[1], top[2]
        if ws >= 0 and _IS_WS[b] and ws < MAX_WHITESPACE:
            out.append(stack[:-1] + ((_TAG_END, lit, ws + 1),))
        child = lit.children.get(b)
        if child is not None:
            out.append(stack[:-1] + ((_TAG_END, child, -1),) if child.children else stack[:-1])
    # _END: nothing may follow


def _feed_object(stack: tuple, top: tuple, b: int, out: list) -> None:
    _, spec, pos, phase, sub = top
    if phase == _O_KEY:
        child = sub.children.get(b)
        if child is not None:
            if child.children:
                out.append(stack[:-1] + ((_OBJECT, spec, pos, _O_KEY, child),))
            else:  # the closing quote: the key is property child.index
                out.append(stack[:-1] + ((_OBJECT, spec, child.index + 1, _O_COLON, 0),))
    elif _IS_WS[b]:
        if sub < MAX_WHITESPACE:
            out.append(stack[:-1] + ((_OBJECT, spec, pos, phase, sub + 1),))
    elif phase == _O_COLON:
        if b == _COLON:
            value = spec.map_value if spec.map_value is not None else spec.values[pos - 1]
            out.append(stack[:-1] + ((_OBJECT, spec, pos, _O_AFTER, 0), (_VALUE, value, 0)))
    elif phase == _O_AFTER:
        if b == _COMMA:
            if spec.map_value is not None or spec.keys[pos] is not None:
                out.append(stack[:-1] + ((_OBJECT, spec, pos, _O_COMMA, 0),))
        elif b == _RBRACE and spec.can_close[pos]:
            out.append(stack[:-1])
    elif b == _QUOTE:  # _O_OPEN or _O_COMMA: a key
        if spec.map_value is not None:
            out.append(stack[:-1] + ((_OBJECT, spec, 0, _O_COLON, 0), (_STRING, _FREE_STRING, 0, 0, 0)))
        elif spec.keys[pos] is not None:
            out.append(stack[:-1] + ((_OBJECT, spec, pos, _O_KEY, spec.keys[pos]),))
    elif b == _RBRACE and phase == _O_OPEN and spec.can_close[pos]:
        out.append(stack[:-1])


def _feed_array(stack: tuple, top: tuple, b: int, out: list) -> None:
    _, spec, count, phase, ws = top
    if _IS_WS[b]:
        if ws < MAX_WHITESPACE:
            out.append(stack[:-1] + ((_ARRAY, spec, count, phase, ws + 1),))
    elif phase == _A_AFTER:
        if b == _COMMA:
            if spec.item_after(count) is not None:
                out.append(stack[:-1] + ((_ARRAY, spec, count, _A_COMMA, 0),))
        elif b == _RBRACKET and count >= spec.min_items:
            out.append(stack[:-1])
    elif b == _RBRACKET:
        if phase == _A_OPEN and count >= spec.min_items:
            out.append(stack[:-1])
    else:  # the first byte of an item
        node = spec.item_after(count)
        alts = node.start.get(b) if node is not None else None
        if alts:
            base = stack[:-1] + ((_ARRAY, spec, min(count + 1, spec.cap), _A_AFTER, 0),)
            for frames in alts:
                out.append(base + frames)


def _feed_pattern(stack: tuple, top: tuple, b: int, out: list) -> None:
    """A string whose characters a DFA checks: raw bytes go to it as they are, an escape
    as the character it stands for; the closing quote only where the DFA accepts."""
    _, spec, d, escape = top
    row = spec.dfa.next[d]
    if escape:
        c = _ESCAPED.get(b)
        if c is not None and row[c] >= 0:
            out.append(stack[:-1] + ((_PATTERN, spec, row[c], 0),))
    elif b == _QUOTE:
        if spec.dfa.accepting[d]:
            out.append(stack[:-1])
    elif b == _BACKSLASH:
        if spec.escapable[d]:
            out.append(stack[:-1] + ((_PATTERN, spec, d, 1),))
    elif b >= 0x20 and row[b] >= 0:
        out.append(stack[:-1] + ((_PATTERN, spec, row[b], 0),))


def _feed_limited_string(stack: tuple, top: tuple, b: int, out: list) -> None:
    """A string with minLength/maxLength: characters are counted where they complete
    (an escape at its last byte, a raw character at its lead byte), and a byte is refused
    as soon as the string could no longer end within maxLength."""
    _, spec, count, sub, hi = top
    full = spec.max_length is not None and count >= spec.max_length
    counted = min(count + 1, spec.cap)
    if sub == 0:
        cls = _STRING_CLASS[b]
        if cls == _C_QUOTE:
            if count >= spec.min_length:
                out.append(stack[:-1])
        elif cls == _C_BACKSLASH:
            if not full or hi:  # when full, only the low half of a surrogate pair fits
                out.append(stack[:-1] + ((_STRING, spec, count, _S_ESC, hi),))
        elif cls != _C_BAD and not full:
            sub = 0 if cls == _C_PLAIN else _UTF8_LEAD[b]
            out.append(stack[:-1] + ((_STRING, spec, counted, sub, 0),))
        return
    if sub < _S_ESC:
        nxt = _UTF8_NEXT[sub][b]
        if nxt >= 0:
            out.append(stack[:-1] + ((_STRING, spec, count, nxt, 0),))
        return
    if sub == _S_ESC:
        if b in _SIMPLE_ESCAPES:
            if not full:
                out.append(stack[:-1] + ((_STRING, spec, counted, 0, 0),))
        elif b == 0x75 and (not full or hi):
            out.append(stack[:-1] + ((_STRING, spec, count, _S_U0, hi),))
        return
    if not _IS_HEX[b]:
        return
    if sub == _S_U0:
        nxt = _S_U1D if b in b"dD" else _S_U1
    elif sub == _S_U1D:
        nxt = _S_U2HI if b in b"89abAB" else _S_U2LO if b in b"cdefCDEF" else _S_U2
    elif sub == _S_U1:
        nxt = _S_U2
    elif sub in (_S_U2, _S_U2HI, _S_U2LO):
        nxt = sub + (_S_U3 - _S_U2)
    else:  # the fourth digit completes the escape
        if sub == _S_U3LO and hi:  # the low half of a pair: the pair is one character
            out.append(stack[:-1] + ((_STRING, spec, count, 0, 0),))
        elif not full:
            out.append(stack[:-1] + ((_STRING, spec, counted, 0, 1 if sub == _S_U3HI else 0),))
        return
    if full and nxt not in (_S_U1D, _S_U2LO, _S_U3LO):  # only a low surrogate still fits
        return
    out.append(stack[:-1] + ((_STRING, spec, count, nxt, hi),))


def _step(state: State, b: int) -> Optional[State]:
    """The state after one byte, or None."""
    if type(state) is tuple:
        top = state[-1]
        if top[0] == _STRING and top[3] == 0 and top[1] is _FREE_STRING and _IS_PLAIN[b]:
            return state  # the hot path: plain text inside a string
        if top[0] == _TAGS:  # the other one: a structural tag's free text
            nxt = top[1].dfa.next[top[2]][b]
            if nxt >= 0:
                return state[:-1] + ((_TAGS, top[1], nxt),)
        out: list = []
        _feed(state, b, out)
    else:
        out = []
        for stack in state:
            _feed(stack, b, out)
    if not out:
        return None
    if len(out) == 1:
        return out[0]
    stacks = frozenset(out)
    return stacks if len(stacks) > 1 else out[0]


def _stack_accepts(stack: tuple) -> bool:
    top = stack[-1]
    if top[0] == _END or top[0] == _TAGS:
        return True
    if top[0] == _REGEX:
        return top[1].accepting[top[2]]
    if len(stack) == 2:  # a top-level number or literal that could go on but may end here
        if top[0] == _NUMBER:
            return _NUM_COMPLETE[top[2]]
        if top[0] == _LITERAL:
            return top[1].terminal
    return False


class Grammar:
    """A language of byte strings, as an automaton with immutable, hashable states.

    Immutable and safe to share between threads. :attr:`initial` is the state before any
    output; :meth:`advance` never changes a state, it returns a new one.
    """

    __slots__ = ("_initial",)

    def __init__(self, initial: State):
        self._initial = initial

    @property
    def initial(self) -> State:
        return self._initial

    def advance(self, state: State, data: bytes) -> Optional[State]:
        """The state after ``data``, or None if ``data`` cannot follow ``state``."""
        for b in data:
            state = _step(state, b)
            if state is None:
                return None
        return state

    def accepts(self, state: State) -> bool:
        """Whether the bytes so far form a complete output (generation may end here)."""
        if type(state) is tuple:
            return _stack_accepts(state)
        return any(_stack_accepts(stack) for stack in state)


# --- schema compilation ---------------------------------------------------------------------
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "discriminator", "$defs", "definitions",
})
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_COMPOSITION = ("$ref", "anyOf", "oneOf", "allOf")
_SUPPORTED = frozenset(
    {"type", "enum", "const", *_OBJECT_KEYWORDS, *_ARRAY_KEYWORDS, *_STRING_KEYWORDS, *_COMPOSITION}
)
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


# ``format`` values enforced on strings, as patterns matched in whole (None: a hint only).
# Dates and times take the forms of RFC 3339 that Python's datetime (and so pydantic) reads:
# real calendar days (29 February in leap years only), years from 0001, uppercase T and Z,
# no leap second, at most six fractional digits.
_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    r"(" + _YEAR + r"-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    r"|02-(0[1-9]|1[0-9]|2[0-8]))|" + _LEAP_YEAR + r"-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DUR_TIME = r"T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
# RFC 3986 URI (a host is a reg-name, which IPv4 addresses are too; IP-literals in brackets
# are not generated): percent signs start two hex digits, '#' only once.
_PCT = r"%[0-9A-Fa-f]{2}"
_URI_CHARS = r"A-Za-z0-9\-._~!$&'()*+,;="  # unreserved and sub-delims
_PCHAR = r"([" + _URI_CHARS + r":@]|" + _PCT + ")"
_SEGMENTS = "(/" + _PCHAR + "*)*"
_AUTHORITY = r"(([" + _URI_CHARS + r":]|" + _PCT + r")*@)?([" + _URI_CHARS + "]|" + _PCT + r")*(:[0-9]*)?"
_QUERY = r"([" + _URI_CHARS + r":@/?]|" + _PCT + ")*"
_URI = (r"[A-Za-z][A-Za-z0-9+.-]*:(//" + _AUTHORITY + _SEGMENTS + "|/(" + _PCHAR + "+" + _SEGMENTS + ")?|"
        + _PCHAR + "+" + _SEGMENTS + r")?(\?" + _QUERY + ")?(#" + _QUERY + ")?")
FORMATS: dict[str, Optional[str]] = {
    "date": _DATE,  # RFC 3339 full-date
    "time": _TIME,  # RFC 3339 full-time (the offset is required)
    "date-time": _DATE + "T" + _TIME,
    "duration": r"P([0-9]+W|([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)(" + _DUR_TIME + ")?|"
                + _DUR_TIME + ")",  # RFC 3339 appendix A
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": _ATOM + r"(\." + _ATOM + ")*@(" + _LABEL + r"\.)+[A-Za-z]{2,63}",  # a dot-atom address
    "hostname": _LABEL + r"(\." + _LABEL + ")*",
    "ipv4": r"(" + _OCTET + r"\.){3}" + _OCTET,
    "uri": _URI,  # RFC 3986 URI
    "password": None,  # how to show it (pydantic's SecretStr): any string
}


def unicode_problem(text: str) -> Optional[str]:
    """None for text that has a UTF-8 form (and so bytes to match and tokens); else what
    is wrong with it: a lone surrogate, which a tokenizer cannot encode nor a decoded
    output contain."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate (U+{ord(text[e.start]):04X}) at position {e.start} is not valid Unicode"
    return None


def _encodable(text: str) -> bool:
    """Whether a string's UTF-8 exists (no lone surrogates)."""
    return unicode_problem(text) is None


def _error(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured_outputs: {message}", param="structured_outputs")


def _unsupported(keyword: str, pointer: str) -> InvalidRequestError:
    return _error(
        f"{keyword!r} at {pointer} is not supported (supported keywords: {', '.join(sorted(_SUPPORTED))}; "
        f"ignored annotations: {', '.join(sorted(_ANNOTATIONS))})"
    )


def _escape_pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _serialize(value: Any, pointer: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise _error(f"the value {value!r} at {pointer} is not JSON ({e})") from None


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _bounds(schema: dict, low: str, high: str, pointer: str) -> tuple[int, Optional[int]]:
    """The schema's ``low`` count (0 when absent) and ``high`` count (None when absent)."""
    least = _count(schema.get(low, 0), low, pointer)
    most = schema.get(high)
    if most is not None:
        most = _count(most, high, pointer)
        if most < least:
            raise _error(f"'{high}' at {pointer} ({most}) is below '{low}' ({least})")
    return least, most


def _count(value: Any, keyword: str, pointer: str) -> int:
    if type(value) is not int or value < 0:
        raise _error(f"{keyword!r} at {pointer} must be a non-negative integer, got {value!r}")
    return value


# Schemas inside schemas (an array's items, a property's value, a branch) compile
# recursively; deeper nesting than this is refused rather than left to Python's stack.
_MAX_NESTING = 100


class _Compiler:
    """Turns a schema into nodes (:meth:`compile`), then checks and links them (:meth:`finish`)."""

    def __init__(self, root: Any):
        self.root = root
        self.depth = 0  # of the schemas being compiled, one inside the other
        self.nodes: list[_Node] = []
        self.by_pointer: dict[str, _Node] = {}  # $ref targets
        self.strings: dict[tuple[int, Optional[int]], _StringSpec] = {(0, None): _FREE_STRING}
        self._any: Optional[_Node] = None

    def new_node(self, pointer: str) -> _Node:
        node = _Node(pointer)
        self.nodes.append(node)
        return node

    def any_node(self) -> _Node:
        """Any JSON value (one node per grammar, so equal situations share states)."""
        if self._any is None:
            node = self._any = self.new_node("#")
            node.parts = [
                ("alt", ("object", _ObjectSpec([], node))),
                ("alt", ("array", _ArraySpec([], node, 0, None))),
                ("alt", ("string", _FREE_STRING)),
                ("alt", ("number", False)),
                ("alt", ("literal", [True, False, None])),
            ]
        return self._any

    def node_at(self, pointer: str) -> _Node:
        """The node of the schema at a JSON pointer ("#", "#/$defs/Name", ...)."""
        node = self.by_pointer.get(pointer)
        if node is None:
            # registered before compiling, so references inside reach it
            node = self.by_pointer[pointer] = self.new_node(pointer)
            node.parts = [("include", self.compile(self.resolve(pointer), pointer))]
        return node

    def resolve(self, pointer: str) -> Any:
        target = self.root
        for token in pointer[1:].split("/")[1:] if pointer != "#" else ():
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise _error(f"$ref {pointer!r} points to nothing in the schema")
        return target

    def compile(self, schema: Any, pointer: str) -> _Node:
        if self.depth >= _MAX_NESTING:
            raise _error(f"the schema at {pointer} is nested more than {_MAX_NESTING} levels deep, which is not "
                         "supported")
        self.depth += 1
        try:
            return self._compile(schema, pointer)
        finally:
            self.depth -= 1

    def _compile(self, schema: Any, pointer: str) -> _Node:
        if schema is True:
            return self.any_node()
        if schema is False:
            raise _error(f"the schema at {pointer} is false: no value satisfies it")
        if not isinstance(schema, dict):
            raise _error(f"the schema at {pointer} must be an object or a boolean, got {schema!r}")
        for keyword in schema:
            if keyword not in _SUPPORTED and keyword not in _ANNOTATIONS:
                raise _unsupported(keyword, pointer)
        if "$id" in schema and pointer != "#":
            # A schema resource of its own: the $refs inside it would resolve against its
            # $id, and this compiler resolves every $ref from the root.
            raise _error(f"'$id' at {pointer} is not supported below the root (a $ref inside that schema would "
                         "resolve against it; move its $defs to the root)")
        if "enum" in schema or "const" in schema:
            return self.compile_enum(schema, pointer)
        composition = [k for k in _COMPOSITION if k in schema]
        if composition:
            others = [k for k in schema if k in _SUPPORTED and k != composition[0]]
            if others:
                raise _error(
                    f"{composition[0]!r} at {pointer} cannot be combined with {others[0]!r} "
                    "(move the keyword into each branch)"
                )
            return self.compile_composition(composition[0], schema[composition[0]], pointer)
        return self.compile_typed(schema, pointer)

    def compile_enum(self, schema: dict, pointer: str) -> _Node:
        values: list[Any]
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise _error(f"'enum' at {pointer} must be a non-empty list")
            if "const" in schema:
                values = [v for v in values if _json_equal(v, schema["const"])]
        else:
            values = [schema["const"]]
        for i, value in enumerate(values):
            try:
                _serialize(value, f"{pointer}/enum/{i}")
            except RecursionError:
                raise _error(f"the value at {pointer}/enum/{i} is nested too deeply") from None
        node = self.new_node(pointer)
        node.enum = values
        node.shadow = self.compile({k: v for k, v in schema.items() if k not in ("enum", "const")}, pointer)
        node.parts = [("alt", ("enum", node))]
        return node

    def compile_composition(self, keyword: str, value: Any, pointer: str) -> _Node:
        if keyword == "$ref":
            if not isinstance(value, str) or not (value == "#" or value.startswith("#/")):
                raise _error(f"$ref {value!r} at {pointer} is not supported: only references within the "
                             "schema ('#', '#/$defs/...') are")
            return self.node_at(value)
        if not isinstance(value, list) or not value:
            raise _error(f"{keyword!r} at {pointer} must be a non-empty list of schemas")
        if keyword == "allOf":
            if len(value) != 1:
                raise _error(f"'allOf' at {pointer} with {len(value)} schemas is not supported (only one)")
            return self.compile(value[0], f"{pointer}/allOf/0")
        node = self.new_node(pointer)  # anyOf, oneOf
        node.parts = [("include", self.compile(sub, f"{pointer}/{keyword}/{i}")) for i, sub in enumerate(value)]
        return node

    def compile_typed(self, schema: dict, pointer: str) -> _Node:
        families = {
            "object": [k for k in _OBJECT_KEYWORDS if k in schema],
            "array": [k for k in _ARRAY_KEYWORDS if k in schema],
            "string": [k for k in _STRING_KEYWORDS if k in schema],
        }
        types = schema.get("type")
        if types is None:
            types = [t for t, used in families.items() if used] or list(_TYPES)
        else:
            if isinstance(types, str):
                types = [types]
            if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
                raise _error(f"'type' at {pointer} must be one of {', '.join(_TYPES)} or a non-empty list of them, "
                             f"got {schema['type']!r}")
            for family, used in families.items():
                if used and family not in types:
                    raise _error(f"{used[0]!r} at {pointer} applies to {family} values, but 'type' is {schema['type']!r}")
        if "number" in types:
            types = [t for t in types if t != "integer"]
        node = self.new_node(pointer)
        literals: list[Any] = []
        for t in dict.fromkeys(types):
            if t == "object":
                node.parts.append(("alt", ("object", self.compile_object(schema, pointer))))
            elif t == "array":
                node.parts.append(("alt", ("array", self.compile_array(schema, pointer))))
            elif t == "string":
                node.parts.append(("alt", self.compile_string(schema, pointer)))
            elif t in ("number", "integer"):
                node.parts.append(("alt", ("number", t == "integer")))
            else:
                literals.extend([True, False] if t == "boolean" else [None])
        if literals:
            node.parts.append(("alt", ("literal", literals)))
        return node

    def compile_object(self, schema: dict, pointer: str) -> _ObjectSpec:
        properties = schema.get("properties")
        required = schema.get("required", [])
        extra = schema.get("additionalProperties")
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise _error(f"'required' at {pointer} must be a list of strings")
        if properties is None:
            if required:
                raise _error(f"'required' at {pointer} names {required[0]!r}, which is not in 'properties'")
            if extra is False:
                return _ObjectSpec([], None)
            if extra is None or extra is True:
                return _ObjectSpec([], self.any_node())
            return _ObjectSpec([], self.compile(extra, f"{pointer}/additionalProperties"))
        if not isinstance(properties, dict):
            raise _error(f"'properties' at {pointer} must be an object")
        if extra is not None and extra is not False:
            raise _error(f"'additionalProperties' at {pointer} next to 'properties' is not supported: "
                         "an object with declared properties admits no other keys")
        for key in required:
            if key not in properties:
                raise _error(f"'required' at {pointer} names {key!r}, which is not in 'properties'")
        for name in properties:
            problem = unicode_problem(name)
            if problem is not None:
                raise _error(f"the property name {name!r} at {pointer}/properties cannot be generated: {problem}")
        props = [
            _Property(name, self.compile(sub, f"{pointer}/properties/{_escape_pointer(name)}"), name in required)
            for name, sub in properties.items()
        ]
        return _ObjectSpec(props, None)

    def compile_array(self, schema: dict, pointer: str) -> _ArraySpec:
        prefix_schemas = schema.get("prefixItems", [])
        if not isinstance(prefix_schemas, list):
            raise _error(f"'prefixItems' at {pointer} must be a list of schemas")
        prefix = [self.compile(sub, f"{pointer}/prefixItems/{i}") for i, sub in enumerate(prefix_schemas)]
        items_schema = schema.get("items", True)
        if isinstance(items_schema, list):
            raise _error(f"'items' at {pointer} is a list (the tuple form of older drafts); use 'prefixItems'")
        items = None if items_schema is False else self.compile(items_schema, f"{pointer}/items")
        min_items, max_items = _bounds(schema, "minItems", "maxItems", pointer)
        if items is None and min_items > len(prefix):
            raise _error(f"'minItems' at {pointer} ({min_items}) asks for more items than 'prefixItems' "
                         f"holds ({len(prefix)}), and 'items' is false")
        return _ArraySpec(prefix, items, min_items, max_items)

    def compile_string(self, schema: dict, pointer: str) -> tuple[str, Any]:
        """("string", _StringSpec), or ("pattern", _PatternSpec) with a pattern or format."""
        min_length, max_length = _bounds(schema, "minLength", "maxLength", pointer)
        pattern, search = schema.get("pattern"), True
        fmt = schema.get("format")
        if fmt is not None:
            if fmt not in FORMATS:
                raise _error(f"'format' {fmt!r} at {pointer} is not supported (supported: {', '.join(sorted(FORMATS))})")
            if FORMATS[fmt] is not None:
                if pattern is not None:
                    raise _error(f"'pattern' next to 'format' at {pointer} is not supported (give one of them)")
                pattern, search = FORMATS[fmt], False
        if pattern is None:
            key = (min_length, max_length)
            if key not in self.strings:
                self.strings[key] = _StringSpec(min_length, max_length)
            return "string", self.strings[key]
        if not isinstance(pattern, str):
            raise _error(f"'pattern' at {pointer} must be a string, got {pattern!r}")
        key = (pattern, search, min_length, max_length)
        if key not in self.strings:
            from .regex import RegexError, compile_regex

            what = f"'pattern' {pattern!r}" if search else f"'format' {fmt!r}"
            try:
                dfa = compile_regex(pattern, search=search, min_chars=min_length, max_chars=max_length,
                                    excluded_bytes=_NO_SHORT_ESCAPE)
            except RegexError as e:
                raise _error(f"{what} at {pointer}: {e}") from None
            self.strings[key] = _PatternSpec(dfa)
        return "pattern", self.strings[key]

    # --- linking -----------------------------------------------------------------------
    def finish(self, root: _Node) -> None:
        """Flattens includes into alternatives, filters enums, drops what cannot complete,
        and builds the runtime tables. Raises if the root admits no finite value."""
        for node in self.nodes:
            self.flatten(node, [])
        for node in self.nodes:
            if node.enum is not None:
                node.values = [v for v in node.enum if self.matches(v, node.shadow, ())]
                if not node.values:
                    raise _error(f"no value of 'enum'/'const' at {node.pointer} satisfies the schema's other keywords")
        changed = True
        while changed:  # least fixpoint: a node is productive if some alternative can complete
            changed = False
            for node in self.nodes:
                if not node.productive and any(_alt_productive(alt) for alt in node.alts):
                    node.productive = changed = True
        if not root.productive:
            raise _error(f"the schema at {root.pointer} admits no finite JSON value (every branch recurses without end)")
        finished: set[int] = set()
        for node in self.nodes:
            node.alts = [alt for alt in node.alts if _alt_productive(alt)]
            for kind, spec in node.alts:
                if kind in ("object", "array") and id(spec) not in finished:
                    finished.add(id(spec))
                    spec.finish()
        for node in self.nodes:
            node.start = _start_table(node)

    def flatten(self, node: _Node, path: list[_Node]) -> list:
        if node.alts is not None:
            return node.alts
        if node in path:
            raise _error(f"the schema at {node.pointer} refers to itself without nesting in an object or array")
        path.append(node)
        alts: list = []
        for kind, part in node.parts:
            for alt in self.flatten(part, path) if kind == "include" else [part]:
                if alt not in alts:
                    alts.append(alt)
        path.pop()
        if ("number", False) in alts and ("number", True) in alts:
            alts.remove(("number", True))
        node.alts = alts
        return alts

    def matches(self, value: Any, node: _Node, enums: tuple) -> bool:
        """Whether a JSON value satisfies ``node`` (used to filter enum values)."""
        return any(self.matches_alt(value, alt, enums) for alt in node.alts)

    def matches_alt(self, value: Any, alt: tuple, enums: tuple) -> bool:
        kind, spec = alt
        if kind == "enum":
            if spec in enums:
                raise _error(f"the 'enum' at {spec.pointer} refers to itself through $ref")
            return any(_json_equal(value, v) for v in spec.enum) and self.matches(value, spec.shadow, enums + (spec,))
        if kind == "literal":
            return any(_json_equal(value, v) for v in spec)
        if kind == "string":
            n = len(value) if isinstance(value, str) else -1
            return n >= spec.min_length and (spec.max_length is None or n <= spec.max_length)
        if kind == "pattern":
            return isinstance(value, str) and _encodable(value) and spec.dfa.matches(value.encode())
        if kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
            return not spec or isinstance(value, int) or value.is_integer()
        if kind == "array":
            if not isinstance(value, list) or len(value) < spec.min_items:
                return False
            if spec.max_items is not None and len(value) > spec.max_items:
                return False
            items = [spec.item(i) for i in range(len(value))]
            return all(n is not None and self.matches(v, n, ()) for v, n in zip(value, items))
        if not isinstance(value, dict):  # object
            return False
        if spec.map_value is not None:
            return all(self.matches(v, spec.map_value, ()) for v in value.values())
        props = {p.name: p for p in spec.props}
        return (
            all(k in props for k in value)
            and all(p.name in value for p in spec.props if p.required)
            and all(self.matches(v, props[k].node, ()) for k, v in value.items())
        )


def _alt_productive(alt: tuple) -> bool:
    kind, spec = alt
    if kind == "object":
        return spec.map_value is not None or all(p.node.productive for p in spec.props if p.required)
    if kind == "array":
        return spec.productive()
    return True  # strings, numbers, literals, filtered enums (never empty)


def _start_table(node: _Node) -> dict[int, tuple[tuple, ...]]:
    """First byte -> the frame sequences (one per alternative) that a value starts with."""
    table: dict[int, list[tuple]] = {}

    def add(b: int, frames: tuple) -> None:
        options = table.setdefault(b, [])
        if frames not in options:
            options.append(frames)

    literals: list[bytes] = []
    for kind, spec in node.alts:
        if kind == "object":
            add(_LBRACE, ((_OBJECT, spec, 0, _O_OPEN, 0),))
        elif kind == "array":
            add(_LBRACKET, ((_ARRAY, spec, 0, _A_OPEN, 0),))
        elif kind == "string":
            add(_QUOTE, ((_STRING, spec, 0, 0, 0),))
        elif kind == "pattern":
            add(_QUOTE, ((_PATTERN, spec, spec.dfa.start, 0),))
        elif kind == "number":
            add(ord("-"), ((_NUMBER, spec, _N_MINUS, 1),))
            add(ord("0"), ((_NUMBER, spec, _N_ZERO, 1),))
            for b in b"123456789":
                add(b, ((_NUMBER, spec, _N_INT, 1),))
        else:
            values = spec.values if kind == "enum" else spec
            literals.extend(_serialize(v, node.pointer) for v in values)
    if literals:
        for b, child in _literal_trie(dict.fromkeys(literals)).children.items():
            add(b, ((_LITERAL, child),) if child.children else ())
    return {b: tuple(options) for b, options in table.items()}


def _json_grammar(compiler: _Compiler, root: _Node) -> Grammar:
    compiler.finish(root)
    return Grammar(((_END,), (_VALUE, root, 0)))


def json_schema_grammar(schema: Union[dict, bool, str]) -> Grammar:
    """The grammar of the JSON values that satisfy ``schema`` (a dict, a boolean, or the
    schema's JSON text). Raises InvalidRequestError for keywords it does not enforce."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise _error(f"the schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise _error(f"the schema must be a JSON object or a boolean, got {type(schema).__name__}")
    compiler = _Compiler(schema)
    return _json_grammar(compiler, compiler.node_at("#"))


def json_object_grammar() -> Grammar:
    """Any JSON object at the top level (OpenAI's ``json_object`` response format)."""
    compiler = _Compiler({})
    root = compiler.new_node("#")
    root.parts = [("alt", ("object", _ObjectSpec([], compiler.any_node())))]
    return _json_grammar(compiler, root)


def regex_grammar(pattern: str) -> Grammar:
    """Raw text (not JSON) that the regular expression matches in whole (the syntax of
    :mod:`asyncgen.regex`, that of JSON Schema's ``pattern``)."""
    from .regex import RegexError, compile_regex

    if not isinstance(pattern, str):
        raise _error(f"regex must be a string, got {pattern!r}")
    try:
        dfa = compile_regex(pattern)
    except RegexError as e:
        raise _error(f"regex {pattern!r}: {e}") from None
    return Grammar(((_END,), (_REGEX, dfa, dfa.start)))


def choice_grammar(options: list[str]) -> Grammar:
    """Exactly one of ``options`` (raw text, not JSON), nothing before or after it."""
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise _error(f"choice must be a non-empty list of non-empty strings, got {options!r}")
    root = _literal_trie(o.encode() for o in options)
    return Grammar(((_END,), (_LITERAL, root)))


_WS_BYTES = frozenset(b" \t\n\r")


def _trigger_dfa(triggers: list[bytes], reasoning: Optional[str] = None):
    """Free text watched for ``triggers``: a DFA whose states are the longest suffix of the
    text so far that is a proper prefix of a trigger, and the byte that completes a trigger
    leads nowhere (-1); with it, {(state, byte): the triggers completed}. State 0 is the
    watch's start, where the text goes on after a structure.

    With ``reasoning``, a ``<think>`` block is not watched: "may_open", one that opens the
    output (after blank space); "inside", one the prompt left open, which the output
    closes. That is where the reasoning parser (:mod:`asyncgen.reasoning`) reads reasoning.
    """
    from .reasoning import THINK_END, THINK_START
    from .regex import ByteDFA

    prefixes = sorted({t[:i] for t in triggers for i in range(len(t))}, key=lambda p: (len(p), p))
    number = {p: i for i, p in enumerate(prefixes)}  # b"" (the watch's start) is 0

    def watch(d: int, b: int) -> tuple[int, tuple[int, ...]]:
        """(the next watch state, or -1 with the triggers ``b`` completes)."""
        text = prefixes[d] + _BYTE[b]
        done = tuple(t for t, trigger in enumerate(triggers) if text.endswith(trigger))
        if done:
            return -1, done
        while text not in number:
            text = text[1:]
        return number[text], ()

    rows: list[list[int]] = []
    completed: dict[tuple[int, int], tuple[int, ...]] = {}
    for d in range(len(prefixes)):
        row = []
        for b in range(256):
            nxt, done = watch(d, b)
            if done:
                completed[(d, b)] = done
            row.append(nxt)
        rows.append(row)
    start = 0
    if reasoning is not None:
        opening, closing = THINK_START.encode(), THINK_END.encode()
        think = len(rows)  # state think + j: in the block, j bytes of </think> matched
        for j in range(len(closing)):
            row = []
            for b in range(256):
                text = closing[:j] + _BYTE[b]
                if text == closing:
                    row.append(0)  # closed: the watch starts
                    continue
                k = next(k for k in range(len(text), -1, -1) if closing.startswith(text[len(text) - k:]))
                row.append(think + k)
            rows.append(row)
        start = think
        if reasoning == "may_open":
            # state start + k: blank space then k bytes of <think> read, nothing watched yet;
            # another byte makes all of it text, and the watch goes on from where it would be
            start = len(rows)
            for k in range(len(opening)):
                d = 0
                for b in opening[:k]:
                    d, done = watch(d, b)
                    if done:
                        raise _error(f"structural_tag: a trigger ends inside {THINK_START!r}, which may open the "
                                     "output's reasoning")
                row = []
                for b in range(256):
                    if b == opening[k]:
                        row.append(start + k + 1 if k + 1 < len(opening) else think)
                    elif k == 0 and b in _WS_BYTES:
                        if watch(0, b) != (0, ()):
                            raise _error("structural_tag: a trigger starts with blank space, which may come "
                                         "before the output's reasoning")
                        row.append(start)
                    else:
                        nxt, done = watch(d, b)
                        if done:
                            completed[(start + k, b)] = done
                        row.append(nxt)
                rows.append(row)
    return ByteDFA(start, tuple(map(tuple, rows)), (True,) * len(rows)), completed


def structural_tag_grammar(tag: Union[dict, str]) -> Grammar:
    """Free text in which structures are constrained (vLLM's ``structural_tag``)::

        {"type": "structural_tag",
         "triggers": ["<tool_call>"],
         "structures": [{"begin": "<tool_call>{\"name\": \"f\", \"arguments\": ",
                         "schema": {...}, "end": "}</tool_call>"}]}

    The output is any text until a trigger appears in it. From the trigger on, the text
    must be the rest of the ``begin`` of a structure that starts with that trigger, then
    a JSON value that satisfies the structure's ``schema`` (whitespace may come before
    the value and before ``end``), then its ``end``; after that it is free text again,
    watched for triggers. Generation may end anywhere in free text, not inside a
    structure. Every begin must start with a trigger, every trigger must start some
    begin, and no two begins may be equal.

    asyncgen's extension, ``"reasoning"``: with ``"may_open"``, a ``<think>`` block that
    opens the output (after blank space) is not watched; with ``"inside"``, the output
    starts in such a block (the prompt opened it) and is watched once it closes. Text in
    that block is reasoning to :mod:`asyncgen.reasoning`, where a call is not read.
    """
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise _error(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise _error(f"structural_tag must be a JSON object, got {type(tag).__name__}")
    unknown = sorted(set(tag) - {"type", "structures", "triggers", "reasoning"})
    if unknown or tag.get("type", "structural_tag") != "structural_tag":
        raise _error("structural_tag: only the form {\"type\": \"structural_tag\", \"structures\": [...], "
                     f"\"triggers\": [...]}} is supported (got the keys {sorted(tag)}, type {tag.get('type')!r})")
    reasoning = tag.get("reasoning")
    if reasoning not in (None, "may_open", "inside"):
        raise _error(f"structural_tag.reasoning must be \"may_open\" or \"inside\", got {reasoning!r}")
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _error(f"structural_tag.triggers must be a non-empty list of non-empty strings, got {triggers!r}")
    if not isinstance(structures, list) or not structures:
        raise _error(f"structural_tag.structures must be a non-empty list, got {structures!r}")
    trigger_bytes = list(dict.fromkeys(t.encode() for t in triggers if _encodable(t)))
    if len(trigger_bytes) != len(set(triggers)):
        raise _error("structural_tag.triggers: a trigger is not valid Unicode text")
    begins, frames = [], []
    for i, structure in enumerate(structures):
        where = f"structural_tag.structures[{i}]"
        if not isinstance(structure, dict) or set(structure) - {"begin", "schema", "end"} or "begin" not in structure:
            raise _error(f"{where} must be an object with begin, schema and end, got {structure!r}")
        begin, end, schema = structure["begin"], structure.get("end", ""), structure.get("schema", True)
        if not isinstance(begin, str) or not isinstance(end, str) or not _encodable(begin + end):
            raise _error(f"{where}: begin and end must be strings of valid Unicode text")
        data = begin.encode()
        if data in begins:
            raise _error(f"{where}.begin {begin!r} repeats structures[{begins.index(data)}].begin")
        if not any(data.startswith(t) for t in trigger_bytes):
            raise _error(f"{where}.begin {begin!r} starts with none of the triggers {triggers!r}")
        if schema is None:
            schema = True
        if not isinstance(schema, (dict, bool)):
            raise _error(f"{where}.schema must be a JSON Schema object, got {schema!r}")
        try:
            compiler = _Compiler(schema)
            root = compiler.node_at("#")
            compiler.finish(root)
        except InvalidRequestError as e:
            raise _error(f"{where}.schema: {str(e).removeprefix('structured_outputs: ')}") from None
        value = (_VALUE, root, 0)
        frames.append(((_TAG_END, _literal_trie([end.encode()]), 0), value) if end else (value,))
        begins.append(data)
    rests = []
    for trigger in trigger_bytes:
        mine = [(j, data[len(trigger):]) for j, data in enumerate(begins) if data.startswith(trigger)]
        if not mine:
            raise _error(f"structural_tag.triggers: {trigger.decode()!r} starts none of the structures' begins")
        rest = _Lit()
        for j, data in mine:
            node = rest
            for b in data:
                node = node.children.setdefault(b, _Lit())
            node.terminal, node.index = True, j
        rests.append(rest)
    dfa, completed = _trigger_dfa(trigger_bytes, reasoning)
    spec = _TagSpec(dfa, completed, rests, frames, frozenset(t[-1] for t in trigger_bytes))
    return Grammar(((_TAGS, spec, dfa.start),))


# --- tokens ---------------------------------------------------------------------------------
# A byte trie of token strings: entries (byte, ids ending at that byte, child entries), the
# children empty (a falsy tuple) or a _TrieNode. Iterating a trie gives its entries.
_Trie = Union[tuple, "_TrieNode"]

_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]')
_BYTE = [bytes((b,)) for b in range(256)]


class _TrieNode:
    """A trie node over a run of byte strings sorted together (``data[lo:hi]``, all
    sharing their first ``depth`` bytes), whose entries are built the first time they are
    read. A walk that dies at a byte never builds what lies below it, so a vocabulary's
    trie costs a sort up front, not a node per distinct prefix (hundreds of thousands).
    Threads that read a node first at the same time build equal entries."""

    __slots__ = ("_data", "_ids", "_lo", "_hi", "_depth", "_entries")

    def __init__(self, data: list[bytes], ids: list[int], lo: int, hi: int, depth: int):
        self._data = data
        self._ids = ids
        self._lo = lo
        self._hi = hi
        self._depth = depth
        self._entries: Optional[tuple] = None

    def __bool__(self) -> bool:
        return True  # a node holds at least one string

    def __iter__(self):
        return iter(self.entries())

    def entries(self) -> tuple:
        """(byte, ids ending at that byte, child node or ()) for each next byte, in order."""
        entries = self._entries
        if entries is None:
            entries = self._entries = self._build()
        return entries

    def _build(self) -> tuple:
        data, ids, hi, depth = self._data, self._ids, self._hi, self._depth
        i = self._lo
        prefix = data[i][:depth]
        length = depth + 1  # of the strings that end at this node's entries
        entries = []
        while i < hi:
            b = data[i][depth]
            end = hi if b == 255 else bisect.bisect_left(data, prefix + _BYTE[b + 1], i + 1, hi)
            exact = i  # [i, exact): the strings that end here (equal ones sort first)
            while exact < end and len(data[exact]) == length:
                exact += 1
            child = _TrieNode(data, ids, exact, end, length) if exact < end else ()
            entries.append((b, tuple(ids[i:exact]) if exact > i else (), child))
            i = end
        return tuple(entries)


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector off, as it was before afterwards. A walk that reaches
    new parts of a vocabulary's trie builds up to a hundred thousand nodes without cycles;
    the collector's passes that their allocations would set off (over the whole heap)
    took two thirds of such a walk on the 2-core CPU, and find nothing to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _token_trie(tokens: Iterable[tuple[int, bytes]]) -> _Trie:
    """The trie of non-empty token strings, given as (id, bytes)."""
    pairs = sorted((data, token_id) for token_id, data in tokens)
    if not pairs:
        return ()
    return _TrieNode([data for data, _ in pairs], [token_id for _, token_id in pairs], 0, len(pairs), 0)


def _plain_chars(data: bytes) -> Optional[int]:
    """The characters of a token that is plain string content (no quote, backslash or
    control byte; whole UTF-8 characters), else None."""
    if _NOT_PLAIN.search(data):
        return None
    try:
        return len(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None


class Vocabulary:
    """The tokens' bytes, indexed by token id, as tries for :class:`TokenGuide`.

    None marks a token that is never allowed (special tokens); so is an empty byte string
    (it would let generation go on without progress). Read-only once built, but for the
    tries' nodes, built as walks first reach them, and :meth:`plain_columns`, built the
    first time a pattern or regex state needs it (threads that race there build equal
    copies); share one between guides.
    """

    def __init__(self, token_bytes: list[Optional[bytes]]):
        self.token_bytes = token_bytes
        self.size = len(token_bytes)
        tokens = [(i, data) for i, data in enumerate(token_bytes) if data]
        self.trie = _token_trie(tokens)
        plain: list[tuple[int, int]] = []  # (characters, id)
        other: list[tuple[int, bytes]] = []
        for token_id, data in tokens:
            chars = _plain_chars(data)
            if chars is None:
                other.append((token_id, data))
            else:
                plain.append((chars, token_id))
        # Plain content keeps a string's state (besides its character count): inside a
        # string these are allowed as a block, and only `other_trie` is walked.
        self.plain_ids = tuple(sorted(token_id for _, token_id in plain))
        plain.sort()
        self.plain_by_chars = tuple(token_id for _, token_id in plain)
        # plain_within[k]: how many plain tokens have at most k characters
        longest = plain[-1][0] if plain else 0
        within = [0] * (longest + 1)
        for chars, _ in plain:
            within[chars] += 1
        for k in range(1, longest + 1):
            within[k] += within[k - 1]
        self.plain_within = tuple(within)
        self._plain_by_chars = np.array(self.plain_by_chars, dtype=np.intp)
        self.other_trie = _token_trie(other)
        self._plain_columns: Optional[_PlainColumns] = None
        self._plain_tries: dict[frozenset[int], _Trie] = {}

    def plain_within_ids(self, room: Optional[int]) -> np.ndarray:
        """The ids of the plain tokens of at most ``room`` characters (all for None)."""
        if room is None:
            return self._plain_by_chars
        within = self.plain_within
        return self._plain_by_chars[: within[min(room, len(within) - 1)]]

    def plain_trie_with(self, data: frozenset[int]) -> _Trie:
        """The trie of the plain tokens that hold any of the bytes ``data`` (built on first use)."""
        trie = self._plain_tries.get(data)
        if trie is None:
            tokens = [(i, self.token_bytes[i]) for i in self.plain_ids]
            trie = self._plain_tries[data] = _token_trie((i, t) for i, t in tokens if not data.isdisjoint(t))
        return trie

    def plain_columns(self) -> _PlainColumns:
        """The plain tokens laid out to run through a DFA all at once (built on first use)."""
        if self._plain_columns is None:
            self._plain_columns = _PlainColumns(self.token_bytes, self.plain_ids)
        return self._plain_columns


class _PlainColumns:
    """The plain tokens, longest first, byte by byte: ``columns[k]`` holds byte k of the
    tokens that have more than k bytes, and those are the first ``len(columns[k])`` of
    ``ids``, so that one numpy pass per byte position moves every token still going::

        ids   bytes        columns[0]  columns[1]  columns[2]
        7     a b c        a           b           c
        3     d e          d           e
        9     f            f
    """

    __slots__ = ("ids", "columns")

    def __init__(self, token_bytes: list[Optional[bytes]], plain_ids: tuple[int, ...]):
        order = sorted(plain_ids, key=lambda i: -len(token_bytes[i]))
        longest = len(token_bytes[order[0]]) if order else 0
        padded = b"".join(token_bytes[i].ljust(longest, b"\0") for i in order)
        matrix = np.frombuffer(padded, dtype=np.uint8).reshape(len(order), longest)  # [num_plain, longest]
        lengths = np.array([len(token_bytes[i]) for i in order], dtype=np.intp)  # [num_plain], descending
        num_longer = np.searchsorted(-lengths, -np.arange(longest), side="left")  # [longest]: tokens of > k bytes
        self.ids = np.array(order, dtype=np.intp)  # [num_plain]
        self.columns = tuple(matrix[:n, k].astype(np.intp) for k, n in enumerate(num_longer.tolist()))


_COMPACT_BELOW = 8  # _DFATable.plain_mask carries on only the live tokens once fewer than 1 in 8 are


class _DFATable:
    """A :class:`~asyncgen.regex.ByteDFA`'s rows as a numpy table, filled as runs reach
    them, to run every plain token through the DFA at once (:meth:`plain_mask`).

    Table rows are numbered in the order DFA states are met; row 0 is the dead state (DFA
    state -1: every byte leads back to it). ``table[row, byte]`` is the next row, -1 while
    ``row`` is not filled, so a DFA of thousands of states (a long ``maxLength``) is read
    only as far as the tokens go. Only the owning :class:`TokenGuide` calls it.
    """

    def __init__(self, dfa: ByteDFA):
        self.dfa = dfa
        self._row_of = {-1: 0}  # DFA state -> row
        self._states = [-1]  # row -> DFA state
        self._table = np.full((16, 256), -1, dtype=np.int32)  # [capacity, 256]
        self._table[0] = 0

    def plain_mask(self, columns: _PlainColumns, size: int, state: int) -> np.ndarray:
        """[size] bool: the plain tokens whose whole bytes the DFA reads from ``state``
        (to a live state, never -1), by token id.

        Byte position by byte position, all the tokens still going move at once while
        many of them are live; once few are, only the live ones are carried on (``live``:
        their positions in ``columns.ids``, ascending).
        """
        mask = np.zeros(size, dtype=np.bool_)
        if not columns.columns:
            return mask
        start = self._row(state)
        if self._table[start, 0] < 0:
            self._fill(start)
        rows = self._table[start].take(columns.columns[0])  # [num_plain]: each token's row after its bytes so far
        k = 1
        while k < len(columns.columns):
            going = rows[: len(columns.columns[k])]
            if np.count_nonzero(going) * _COMPACT_BELOW < len(going):
                break
            going[:] = self._next(going, columns.columns[k])
            k += 1
        num_going = len(columns.columns[k]) if k < len(columns.columns) else 0
        mask[columns.ids[num_going:][rows[num_going:] != 0]] = True  # the tokens of at most k bytes
        live = np.flatnonzero(rows[:num_going])  # [num_live]
        after = rows[live]  # [num_live]
        for column in columns.columns[k:]:
            ended = np.searchsorted(live, len(column))  # live[ended:] have no byte here
            mask[columns.ids[live[ended:]]] = True
            live = live[:ended]
            after = self._next(after[:ended], column[live])
            kept = after != 0
            live, after = live[kept], after[kept]
            if not len(live):
                break
        mask[columns.ids[live]] = True
        return mask

    def _next(self, rows: np.ndarray, column: np.ndarray) -> np.ndarray:
        """The rows after one byte each: ``table[rows[i], column[i]]``, filling rows as needed."""
        index = (rows << 8) | column
        after = self._table.ravel().take(index)
        unfilled = after < 0
        if unfilled.any():
            needed = np.zeros(len(self._states), dtype=np.bool_)
            needed[rows] = unfilled  # well defined: a row is filled whole or not at all
            for row in np.flatnonzero(needed).tolist():
                self._fill(row)
            after = self._table.ravel().take(index)
        return after

    def _fill(self, row: int) -> None:
        targets = self.dfa.next[self._states[row]]
        row_of = {s: self._row(s) for s in set(targets)}  # a row has few distinct targets
        self._table[row] = list(map(row_of.__getitem__, targets))  # after _row, which may grow the table

    def _row(self, state: int) -> int:
        row = self._row_of.get(state)
        if row is None:
            row = self._row_of[state] = len(self._states)
            self._states.append(state)
            if row == len(self._table):
                grown = np.full((2 * row, 256), -1, dtype=np.int32)
                grown[:row] = self._table
                self._table = grown
        return row


def _walk(trie: _Trie, state: State, out: list) -> None:
    """Appends the ids of the tokens in ``trie`` that can follow ``state``."""
    todo = [(trie, state)]
    while todo:
        entries, state = todo.pop()
        if type(entries) is _TrieNode:  # (its entries, without a call to __iter__ once built)
            entries = entries._entries or entries.entries()
        for b, ids, children in entries:
            after = _step(state, b)
            if after is not None:
                if ids:
                    out.extend(ids)
                if children:
                    todo.append((children, after))


def _plain_block(
    state: State,
) -> Optional[tuple[Union[int, None, bool], list[tuple[ByteDFA, int]], frozenset[int]]]:
    """How ``state`` decides the plain tokens without the general walk, where every
    alternative is inside a string between characters, inside a pattern string not after
    a backslash, in a regex output or in a structural tag's free text; None where some
    alternative is elsewhere.

    A plain token changes only the top frame of such a stack, and never pops it, so the
    token can follow the state exactly where one alternative alone takes it whole: in a
    string, any token of at most ``room`` characters (None: no limit; False: no string
    alternative); in a pattern string, a regex output or free text, the tokens that its
    DFA reads from its DFA state (``runs``: the (DFA, DFA state) pairs). The exception is
    a plain token that completes a trigger in free text, which the free text's DFA
    refuses: such a token holds the trigger's last byte, and the plain tokens holding
    one of ``walk_bytes`` must be walked as well.
    """
    room: Union[int, None, bool] = False
    runs = []
    walk_bytes: frozenset[int] = frozenset()
    for stack in (state,) if type(state) is tuple else state:
        top = stack[-1]
        tag = top[0]
        if tag == _STRING and top[3] == 0:
            spec = top[1]
            if spec.max_length is None:
                room = None
            elif room is not None:
                left = spec.max_length - top[2]
                room = left if room is False else max(room, left)
        elif tag == _PATTERN and not top[3]:
            runs.append((top[1].dfa, top[2]))
        elif tag == _REGEX:
            runs.append((top[1], top[2]))
        elif tag == _TAGS:
            runs.append((top[1].dfa, top[2]))
            walk_bytes |= top[1].last_bytes
        else:
            return None
    return room, runs, walk_bytes


class TokenGuide:
    """The tokens a grammar allows after each state, over one vocabulary.

    :meth:`allowed` is memoized per state (states are canonical, so the memo holds one
    entry per distinct situation; a grammar without unbounded nesting has finitely many).
    A state inside a string allows most of the vocabulary, and a long ``maxLength`` or
    deep nesting makes many such states, so the memo is emptied once it holds
    :data:`MEMO_IDS` ids in all (about 8 bytes each) and fills again as states recur.
    The plain tokens a DFA state allows are memoized too, per (DFA, DFA state), since
    grammar states that differ below a pattern string share them; each such mask (one
    byte per token) counts as ``size // 8`` ids and goes with the memo.
    One thread may call :meth:`allowed` while others read its results.
    """

    def __init__(self, grammar: Grammar, vocabulary: Vocabulary):
        self.grammar = grammar
        self.vocabulary = vocabulary
        self._memo: dict[State, tuple[int, ...]] = {}
        self._memo_ids = 0
        self._plain_masks: dict[tuple[ByteDFA, int], np.ndarray] = {}  # [size] bool each
        self._dfa_tables: dict[ByteDFA, _DFATable] = {}

    def allowed(self, state: State) -> tuple[int, ...]:
        """Sorted ids of the tokens whose whole byte string can follow ``state``; the same
        tuple object for the same state while it stays memoized. Stop tokens are not
        included: the caller adds them where ``grammar.accepts(state)``."""
        ids = self._memo.get(state)
        if ids is None:
            ids = self._compute(state)
            if self._memo_ids + len(ids) > MEMO_IDS:
                self._memo = {}
                self._plain_masks = {}
                self._memo_ids = 0
            ids = self._memo.setdefault(state, ids)
            self._memo_ids += len(ids)
        return ids

    def _compute(self, state: State) -> tuple[int, ...]:
        return tuple(np.flatnonzero(self.allowed_mask(state)).tolist())

    def allowed_mask(self, state: State) -> np.ndarray:
        """What :meth:`allowed` lists, as a new bool array over the vocabulary, built
        without a list of ids for the plain tokens (tens of thousands inside a string).
        Not memoized here: the caller keeps the masks it wants to keep."""
        vocab = self.vocabulary
        out: list[int] = []
        block = _plain_block(state)
        with _collector_paused():
            _walk(vocab.trie if block is None else vocab.other_trie, state, out)
            if block is not None and block[2]:
                _walk(vocab.plain_trie_with(block[2]), state, out)
        if block is None:
            mask = np.zeros(vocab.size, dtype=bool)
        else:
            room, runs, _ = block
            if runs:
                masks = [self._plain_mask(dfa, d) for dfa, d in dict.fromkeys(runs)]
                mask = np.logical_or.reduce(masks) if len(masks) > 1 else masks[0].copy()
                if room is not False:  # string alternatives too: their plain tokens by length
                    mask[vocab.plain_within_ids(room)] = True
            else:
                mask = np.zeros(vocab.size, dtype=bool)
                mask[vocab.plain_within_ids(room)] = True
        if out:
            mask[np.array(out, dtype=np.intp)] = True
        return mask

    def _plain_mask(self, dfa: ByteDFA, d: int) -> np.ndarray:
        mask = self._plain_masks.get((dfa, d))
        if mask is None:
            table = self._dfa_tables.get(dfa)
            if table is None:
                table = self._dfa_tables[dfa] = _DFATable(dfa)
            vocab = self.vocabulary
            mask = table.plain_mask(vocab.plain_columns(), vocab.size, d)
            if self._memo_ids + vocab.size // 8 > MEMO_IDS:  # (allowed_mask's callers fill no other memo)
                self._memo = {}
                self._plain_masks = {}
                self._memo_ids = 0
            self._plain_masks[(dfa, d)] = mask
            self._memo_ids += vocab.size // 8
        return mask
