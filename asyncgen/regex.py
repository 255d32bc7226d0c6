"""Regular expressions compiled to DFAs over bytes, for constrained decoding.

:func:`compile_regex` turns a pattern (the ECMA-262 dialect of JSON Schema's
``pattern``, the subset below, no flags) into a :class:`ByteDFA` whose language is the
UTF-8 encoding of the strings the pattern matches: whole strings by default, or strings
that contain a match anywhere (``search=True``, JSON Schema's semantics). Strings are
sequences of Unicode scalar values (no surrogates), and a pattern is read by code point
(an emoji followed by ``+`` repeats the emoji). The language can be cut to a number of characters
(``min_chars``/``max_chars``) and to strings without some bytes (``excluded_bytes``).
Every state of the result is reachable and can still reach an accepting state, and
every transition keeps the bytes read a prefix of well-formed UTF-8.

Supported syntax:

* literal characters; ``.`` (any character but ``\\n \\r \\u2028 \\u2029``);
* escapes ``\\n \\r \\t \\f \\v \\0 \\xHH \\uHHHH`` (``\\uD83D\\uDE00``, a surrogate pair,
  is one character), and a backslash before any character that is not an ASCII letter
  or digit, which stands for that character;
* ``\\d \\D \\w \\W \\s \\S``: ASCII digits, ASCII word characters, ECMA white space and
  line terminators, and their complements;
* bracket expressions ``[abc] [^abc] [a-z]`` with escapes and the classes above inside
  (where ``\\b`` is U+0008, and ``-`` next to a class such as ``\\w`` is a literal);
  ``[]`` matches nothing and ``[^]`` any character;
* groups ``(...) (?:...) (?<name>...)``; alternation ``|``, empty alternatives included;
* quantifiers ``* + ? {n} {n,} {n,m}`` and their lazy forms (the same language); a
  ``{`` that does not begin a quantifier is a literal;
* ``^`` as the first and ``$`` as the last character of the whole pattern, without a
  top-level ``|``.

Anything else (backreferences, lookarounds, ``\\b \\B``, ``\\c``, ``\\p{..}``, inline
flags, ``\\u{..}``, lone surrogates, anchors elsewhere, a quantifier with nothing to
repeat, unbalanced parentheses, reversed ranges and counts) raises :class:`RegexError`
naming the construct and its position in the pattern.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

__all__ = ["ByteDFA", "RegexError", "compile_regex"]

_MAX_CP = 0x10FFFF
_MAX_DEPTH = 200

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent code-point ranges
Edges = list[tuple[int, int, int]]  # (first byte, last byte, target), sorted
Node = tuple  # ("set", Ranges) | ("seq", nodes) | ("alt", nodes) | ("rep", node, lo, hi)


class RegexError(ValueError):
    """A pattern that cannot be compiled; the message names what and where (position in the pattern)."""


class _TooComplex(Exception):
    pass


def _intern(index: dict, items: list, key, limit: int) -> int:
    """The number of ``key`` among ``items`` (appended if new; _TooComplex past ``limit``)."""
    number = index.get(key)
    if number is None:
        if len(items) >= limit:
            raise _TooComplex
        number = index[key] = len(items)
        items.append(key)
    return number


@dataclass(frozen=True, eq=False, repr=False)
class ByteDFA:
    """A deterministic automaton over bytes: ``next[state][byte]`` is the next state, or -1."""

    start: int
    next: tuple[tuple[int, ...], ...]
    accepting: tuple[bool, ...]

    def advance(self, state: int, data: bytes) -> int:
        """The state after ``data`` from ``state``; -1 once a byte is refused."""
        if state < 0:
            return -1
        rows = self.next
        for b in data:
            state = rows[state][b]
            if state < 0:
                return -1
        return state

    def matches(self, data: bytes) -> bool:
        """Whether the whole of ``data`` is in the language."""
        state = self.advance(self.start, data)
        return state >= 0 and self.accepting[state]

    def __repr__(self) -> str:
        return f"ByteDFA(<{len(self.next)} states>, start={self.start})"


# --- code-point sets ----------------------------------------------------------------------

def _norm(ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(ranges: Ranges) -> Ranges:
    out = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CP:
        out.append((nxt, _MAX_CP))
    return tuple(out)


_ANY: Ranges = ((0, _MAX_CP),)
_DIGIT: Ranges = ((0x30, 0x39),)
_WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE: Ranges = _norm([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                        (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
                        (0xFEFF, 0xFEFF)])
_DOT: Ranges = _complement(_norm([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))
_CLASS_ESCAPES: dict[str, Ranges] = {
    "d": _DIGIT, "D": _complement(_DIGIT),
    "w": _WORD, "W": _complement(_WORD),
    "s": _SPACE, "S": _complement(_SPACE),
}
_CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
_HEX = frozenset("0123456789abcdefABCDEF")
_BRACES = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")


def _count(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18


# --- parsing ------------------------------------------------------------------------------

class _Parser:
    """Recursive descent from the pattern to a tree of ``Node`` tuples."""

    def __init__(self, pattern: str):
        self.p = pattern
        self.n = len(pattern)
        self.i = 0
        self.anchor_start = False
        self.anchor_end = False

    def error(self, what: str, pos: int) -> RegexError:
        return RegexError(f"{what} at position {pos} of pattern {self.p!r}")

    def parse(self) -> Node:
        if self.p.startswith("^"):
            self.anchor_start = True
            self.i = 1
        alts = self.alternatives(0)
        if self.i < self.n:
            raise self.error("unbalanced ')'", self.i)
        if len(alts) > 1 and (self.anchor_start or self.anchor_end):
            which, pos = ("'^'", 0) if self.anchor_start else ("'$'", self.n - 1)
            raise self.error(f"anchor {which} with a top-level alternation '|' is not supported "
                             "(group the alternatives: ^(?:a|b)$)", pos)
        return alts[0] if len(alts) == 1 else ("alt", tuple(alts))

    def alternatives(self, depth: int) -> list[Node]:
        alts = [self.sequence(depth)]
        while self.i < self.n and self.p[self.i] == "|":
            self.i += 1
            alts.append(self.sequence(depth))
        return alts

    def sequence(self, depth: int) -> Node:
        items = []
        while self.i < self.n and self.p[self.i] not in "|)":
            node = self.atom(depth)
            if node is not None:
                items.append(self.quantified(node))
        return items[0] if len(items) == 1 else ("seq", tuple(items))

    def atom(self, depth: int) -> Optional[Node]:
        p, i = self.p, self.i
        c = p[i]
        if c == "(":
            return self.group(depth)
        if c == "[":
            return ("set", self.bracket())
        if c == ".":
            self.i += 1
            return ("set", _DOT)
        if c == "\\":
            e = self.escape(in_class=False)
            return ("set", ((e, e),) if isinstance(e, int) else e)
        if c in "*+?" or (c == "{" and _BRACES.match(p, i)):
            raise self.error(f"nothing to repeat before quantifier {c!r}", i)
        if c == "^":
            raise self.error("anchor '^' (supported only as the first character of the pattern)", i)
        if c == "$":
            if i == self.n - 1 and depth == 0:
                self.anchor_end = True
                self.i += 1
                return None
            raise self.error("anchor '$' (supported only as the last character of the pattern)", i)
        cp = self.char()
        return ("set", ((cp, cp),))

    def char(self) -> int:
        """The literal character at the cursor (a surrogate pair in the string is one)."""
        p, i = self.p, self.i
        cp = ord(p[i])
        self.i = i + 1
        if 0xD800 <= cp <= 0xDFFF:
            if cp <= 0xDBFF and i + 1 < self.n and 0xDC00 <= ord(p[i + 1]) <= 0xDFFF:
                self.i = i + 2
                return 0x10000 + ((cp - 0xD800) << 10) + (ord(p[i + 1]) - 0xDC00)
            raise self.error(f"lone surrogate U+{cp:04X}", i)
        return cp

    def group(self, depth: int) -> Node:
        p, start = self.p, self.i
        if depth >= _MAX_DEPTH:
            raise self.error(f"groups nested more than {_MAX_DEPTH} deep", start)
        i = start + 1
        if p.startswith("?", i):
            head = p[start:i + 3]
            if p.startswith("?:", i):
                i += 2
            elif p.startswith("?=", i) or p.startswith("?!", i):
                raise self.error(f"lookahead {head[:3]!r} is not supported", start)
            elif p.startswith("?<=", i) or p.startswith("?<!", i):
                raise self.error(f"lookbehind {head!r} is not supported", start)
            elif p.startswith("?<", i):
                close = p.find(">", i + 2)
                name = p[i + 2:close] if close >= 0 else ""
                if not name.replace("$", "_").isidentifier():
                    raise self.error("invalid group name in '(?<'", start)
                i = close + 1
            else:
                raise self.error(f"unsupported group syntax {head[:3]!r} (inline flags and other "
                                 "extensions are not supported)", start)
        self.i = i
        alts = self.alternatives(depth + 1)
        if self.i >= self.n:
            raise self.error("unbalanced '(' (no matching ')')", start)
        self.i += 1
        return alts[0] if len(alts) == 1 else ("alt", tuple(alts))

    def quantified(self, node: Node) -> Node:
        q = self.quantifier()
        if q is None:
            return node
        pos = self.i
        if self.quantifier() is not None:
            raise self.error(f"nothing to repeat before quantifier {self.p[pos]!r} "
                             "(a quantifier cannot follow a quantifier)", pos)
        lo, hi = q
        return ("rep", node, lo, hi)

    def quantifier(self) -> Optional[tuple[int, Optional[int]]]:
        p, i = self.p, self.i
        if i >= self.n:
            return None
        c = p[i]
        hi: Optional[int]
        if c == "*":
            lo, hi, j = 0, None, i + 1
        elif c == "+":
            lo, hi, j = 1, None, i + 1
        elif c == "?":
            lo, hi, j = 0, 1, i + 1
        elif c == "{":
            m = _BRACES.match(p, i)
            if m is None:
                return None
            lo = _count(m[1])
            hi = lo if m[2] is None else (_count(m[3]) if m[3] else None)
            if hi is not None and lo > hi:
                raise self.error(f"quantifier {m[0]!r} with min > max", i)
            j = m.end()
        else:
            return None
        if j < self.n and p[j] == "?":
            j += 1
        self.i = j
        return lo, hi

    def hex4(self, at: int) -> Optional[int]:
        h = self.p[at:at + 4]
        return int(h, 16) if len(h) == 4 and all(x in _HEX for x in h) else None

    def escape(self, in_class: bool) -> Union[int, Ranges]:
        """The escape at the cursor: one code point, or a class's ranges."""
        p, start = self.p, self.i
        if start + 1 >= self.n:
            raise self.error("pattern ends with a lone '\\'", start)
        c = p[start + 1]
        self.i = start + 2
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[c]
        if c == "b" and in_class:
            return 0x08
        if c in "bB":
            raise self.error(f"word boundary '\\{c}' is not supported", start)
        if c == "0":
            if self.i < self.n and p[self.i].isdigit():
                raise self.error("octal escape '\\0' followed by a digit is not supported", start)
            return 0
        if c in "123456789":
            raise self.error(f"backreference '\\{c}' is not supported", start)
        if c == "k":
            raise self.error("named backreference '\\k' is not supported", start)
        if c == "c":
            raise self.error("control escape '\\c' is not supported", start)
        if c in "pP":
            raise self.error(f"Unicode property escape '\\{c}' is not supported", start)
        if c == "x":
            h = p[start + 2:start + 4]
            if len(h) < 2 or not all(x in _HEX for x in h):
                raise self.error("'\\x' not followed by two hex digits", start)
            self.i = start + 4
            return int(h, 16)
        if c == "u":
            return self.unicode_escape(start)
        if c.isascii() and c.isalnum():
            raise self.error(f"unsupported escape '\\{c}'", start)
        self.i = start + 1
        return self.char()

    def unicode_escape(self, start: int) -> int:
        cp = self.hex4(start + 2)
        if cp is None:
            if self.p.startswith("{", start + 2):
                raise self.error("'\\u{...}' escapes are not supported", start)
            raise self.error("'\\u' not followed by four hex digits", start)
        self.i = start + 6
        if 0xD800 <= cp <= 0xDBFF and self.p.startswith("\\u", self.i):
            low = self.hex4(self.i + 2)
            if low is not None and 0xDC00 <= low <= 0xDFFF:
                self.i += 6
                return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
        if 0xD800 <= cp <= 0xDFFF:
            raise self.error(f"lone surrogate escape '\\u{cp:04X}'", start)
        return cp

    def class_atom(self) -> Union[int, Ranges]:
        if self.p[self.i] == "\\":
            return self.escape(in_class=True)
        return self.char()

    def bracket(self) -> Ranges:
        p, start = self.p, self.i
        self.i += 1
        negate = self.i < self.n and p[self.i] == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []

        def add(x: Union[int, Ranges]) -> None:
            if isinstance(x, int):
                ranges.append((x, x))
            else:
                ranges.extend(x)

        while True:
            if self.i >= self.n:
                raise self.error("unterminated character class '['", start)
            if p[self.i] == "]":
                self.i += 1
                break
            a_pos = self.i
            a = self.class_atom()
            if self.i + 1 < self.n and p[self.i] == "-" and p[self.i + 1] != "]":
                self.i += 1
                b = self.class_atom()
                if isinstance(a, int) and isinstance(b, int):
                    if a > b:
                        raise self.error(f"bad range {p[a_pos:self.i]!r} in character class (start > end)", a_pos)
                    ranges.append((a, b))
                else:  # a class escape at either end: the '-' is a literal (ECMA Annex B)
                    add(a)
                    add(0x2D)
                    add(b)
            else:
                add(a)
        out = _norm(ranges)
        return _complement(out) if negate else out


# --- UTF-8 --------------------------------------------------------------------------------

_LENGTH_SPANS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, _MAX_CP))


def _utf8_split(lo: int, hi: int, out: list) -> None:
    """Appends byte-range sequences for [lo, hi] (one encoded length, no surrogates)."""
    n = len(chr(lo).encode())
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _utf8_split(lo, lo | m, out)
                _utf8_split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _utf8_split(lo, (hi & ~m) - 1, out)
                _utf8_split(hi & ~m, hi, out)
                return
    out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))


@lru_cache(maxsize=512)
def _utf8_sequences(ranges: Ranges) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The UTF-8 encodings of a code-point set, as sequences of byte ranges."""
    out: list = []
    for lo, hi in ranges:
        for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)):
            for x, y in _LENGTH_SPANS:
                s, e = max(a, x), min(b, y)
                if s <= e:
                    _utf8_split(s, e, out)
    return tuple(out)


# --- automata -----------------------------------------------------------------------------

class _NFA:
    """A Thompson NFA over bytes: epsilon edges and byte-range edges per state."""

    def __init__(self, limit: int):
        self.eps: list[list[int]] = []
        self.edges: list[Edges] = []
        self.limit = limit

    def state(self) -> int:
        if len(self.eps) >= self.limit:
            raise _TooComplex
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def chars(self, ranges: Ranges) -> tuple[int, int]:
        start, end = self.state(), self.state()
        by_suffix: dict[tuple, int] = {}

        def via(rest: tuple) -> int:
            if not rest:
                return end
            s = by_suffix.get(rest)
            if s is None:
                s = by_suffix[rest] = self.state()
                self.edges[s].append((rest[0][0], rest[0][1], via(rest[1:])))
            return s

        for seq in _utf8_sequences(ranges):
            self.edges[start].append((seq[0][0], seq[0][1], via(seq[1:])))
        return start, end

    def build(self, node: Node) -> tuple[int, int]:
        kind = node[0]
        if kind == "set":
            return self.chars(node[1])
        if kind == "seq":
            items = node[1]
            if not items:
                s = self.state()
                return s, s
            start, end = self.build(items[0])
            for item in items[1:]:
                s, e = self.build(item)
                self.eps[end].append(s)
                end = e
            return start, end
        if kind == "alt":
            start, end = self.state(), self.state()
            for item in node[1]:
                s, e = self.build(item)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        _, sub, lo, hi = node
        start = cur = self.state()
        for _ in range(lo):
            s, e = self.build(sub)
            self.eps[cur].append(s)
            cur = e
        if hi is None:
            loop = self.state()
            s, e = self.build(sub)
            self.eps[cur].append(loop)
            self.eps[loop].append(s)
            self.eps[e].append(loop)
            return start, loop
        end = self.state()
        for _ in range(hi - lo):
            s, e = self.build(sub)
            self.eps[cur] += [s, end]
            cur = e
        self.eps[cur].append(end)
        return start, end


def _determinize(nfa: _NFA, start: int, accept: int, absorbing: Optional[int],
                 limit: int) -> tuple[list[Edges], list[bool]]:
    """Subset construction. A subset holding ``absorbing`` (a state that accepts every
    continuation) is replaced by that state's closure."""
    eps, edges = nfa.eps, nfa.edges
    closures: dict[int, frozenset[int]] = {}

    def closure(s: int) -> frozenset[int]:
        c = closures.get(s)
        if c is None:
            seen, stack, out = {s}, [s], []
            while stack:
                x = stack.pop()
                if edges[x] or x == accept:
                    out.append(x)
                for y in eps[x]:
                    if y not in seen:
                        seen.add(y)
                        stack.append(y)
            c = closures[s] = frozenset(out)
        return c

    def close(targets) -> frozenset[int]:
        r = frozenset().union(*map(closure, targets))
        if absorbing is not None and absorbing in r:
            return closure(absorbing)
        return r

    first = close((start,))
    index = {first: 0}
    subsets = [first]
    by_targets: dict[frozenset[int], int] = {}
    out: list[Edges] = []
    accepting: list[bool] = []
    k = 0
    while k < len(subsets):
        subset = subsets[k]
        k += 1
        accepting.append(accept in subset)
        es = [e for s in sorted(subset) for e in edges[s]]
        row: Edges = []
        out.append(row)
        if not es:
            continue
        points = sorted({lo for lo, _, _ in es} | {hi + 1 for _, hi, _ in es})
        at = {p: j for j, p in enumerate(points)}
        buckets: list[Optional[set[int]]] = [None] * (len(points) - 1)
        for lo, hi, t in es:
            for j in range(at[lo], at[hi + 1]):
                b = buckets[j]
                if b is None:
                    buckets[j] = {t}
                else:
                    b.add(t)
        for j, b in enumerate(buckets):
            if b is None:
                continue
            key = frozenset(b)
            d = by_targets.get(key)
            if d is None:
                d = by_targets[key] = _intern(index, subsets, close(key), limit)
            lo, hi = points[j], points[j + 1] - 1
            if row and row[-1][2] == d and row[-1][1] + 1 == lo:
                row[-1] = (row[-1][0], hi, d)
            else:
                row.append((lo, hi, d))
    return out, accepting


def _exclude(edges: list[Edges], excluded: bytes) -> list[Edges]:
    """The edges without those on the ``excluded`` bytes."""
    ex = sorted(set(excluded))
    out = []
    for row in edges:
        new: Edges = []
        for lo, hi, t in row:
            for b in ex[bisect_left(ex, lo):bisect_right(ex, hi)]:
                if lo < b:
                    new.append((lo, b - 1, t))
                lo = b + 1
            if lo <= hi:
                new.append((lo, hi, t))
        out.append(new)
    return out


def _trim(edges: list[Edges], accepting: list[bool], start: int) -> Optional[tuple[list[Edges], list[bool]]]:
    """Drops the states unreachable from ``start`` and those that reach no accepting state,
    renumbering the rest in breadth-first order from ``start`` (which becomes 0); None when
    the language is empty."""
    n = len(edges)
    rev: list[list[int]] = [[] for _ in range(n)]
    for s, row in enumerate(edges):
        for _, _, t in row:
            rev[t].append(s)
    live = list(accepting)
    stack = [s for s in range(n) if live[s]]
    while stack:
        for s in rev[stack.pop()]:
            if not live[s]:
                live[s] = True
                stack.append(s)
    if not live[start]:
        return None
    new = {start: 0}
    order = [start]
    k = 0
    while k < len(order):
        for _, _, t in edges[order[k]]:
            if live[t] and t not in new:
                new[t] = len(order)
                order.append(t)
        k += 1
    out = [[(lo, hi, new[t]) for lo, hi, t in edges[s] if live[t]] for s in order]
    return out, [accepting[s] for s in order]


def _minimize(edges: list[Edges], accepting: list[bool]) -> tuple[list[Edges], list[bool]]:
    """Hopcroft's partition refinement over the byte classes the edges distinguish (states
    trimmed, start 0); the result is trimmed and renumbered from its start."""
    n = len(edges)
    points = {0, 256}
    for row in edges:
        for lo, hi, _ in row:
            points.add(lo)
            points.add(hi + 1)
    cuts = sorted(points)
    col = {p: c for c, p in enumerate(cuts)}
    classes = len(cuts) - 1
    sink = n
    inverse: list[dict[int, list[int]]] = [{} for _ in range(classes)]
    for s in range(n + 1):
        row = [sink] * classes
        if s < n:
            for lo, hi, t in edges[s]:
                for c in range(col[lo], col[hi + 1]):
                    row[c] = t
        for c, t in enumerate(row):
            inverse[c].setdefault(t, []).append(s)
    acc = {s for s in range(n) if accepting[s]}
    rej = set(range(n + 1)) - acc
    blocks = [acc, rej]
    block_of = [1] * (n + 1)
    for s in acc:
        block_of[s] = 0
    first = 0 if len(acc) <= len(rej) else 1
    work = [first]
    in_work = [first == 0, first == 1]
    while work:
        a = work.pop()
        in_work[a] = False
        splitter = tuple(blocks[a])
        for inv in inverse:
            touched: dict[int, list[int]] = {}
            for t in splitter:
                pre = inv.get(t)
                if pre:
                    for s in pre:
                        touched.setdefault(block_of[s], []).append(s)
            for b, part in touched.items():
                rest = blocks[b]
                if len(part) == len(rest):
                    continue
                rest.difference_update(part)
                nb = len(blocks)
                blocks.append(set(part))
                for s in part:
                    block_of[s] = nb
                if in_work[b] or len(part) <= len(rest):
                    work.append(nb)
                    in_work.append(True)
                else:
                    work.append(b)
                    in_work[b] = True
                    in_work.append(False)
    dead = block_of[sink]
    rep = {}
    for s in range(n):
        rep.setdefault(block_of[s], s)
    out: list[Edges] = [[] for _ in blocks]
    for b, s in rep.items():
        row = out[b]
        for lo, hi, t in edges[s]:
            d = block_of[t]
            if d == dead:
                continue
            if row and row[-1][2] == d and row[-1][1] + 1 == lo:
                row[-1] = (row[-1][0], hi, d)
            else:
                row.append((lo, hi, d))
    acc_blocks = [b in rep and accepting[rep[b]] for b in range(len(blocks))]
    trimmed = _trim(out, acc_blocks, block_of[0])
    assert trimmed is not None
    return trimmed


def _with_length(edges: list[Edges], accepting: list[bool], min_chars: int,
                 max_chars: Optional[int], limit: int) -> tuple[list[Edges], list[bool]]:
    """Product with the automaton of "between min_chars and max_chars characters" (states
    (count, continuation bytes pending); the count saturates at min_chars when max_chars
    is None). The start is state 0."""

    def length_edges(k: int, pending: int) -> tuple:
        if pending:
            return ((0x80, 0xBF, (k, pending - 1)),)
        if max_chars is not None and k >= max_chars:
            return ()
        nk = k + 1 if max_chars is not None else min(k + 1, min_chars)
        return ((0x00, 0x7F, (nk, 0)), (0xC0, 0xDF, (nk, 1)), (0xE0, 0xEF, (nk, 2)), (0xF0, 0xF7, (nk, 3)))

    first = (0, 0, 0)
    index = {first: 0}
    pairs = [first]
    out: list[Edges] = []
    acc: list[bool] = []
    j = 0
    while j < len(pairs):
        r, k, pending = pairs[j]
        j += 1
        acc.append(accepting[r] and not pending and k >= min_chars)
        a, b = edges[r], length_edges(k, pending)
        row: Edges = []
        x = y = 0
        while x < len(a) and y < len(b):
            lo, hi = max(a[x][0], b[y][0]), min(a[x][1], b[y][1])
            if lo <= hi:
                row.append((lo, hi, _intern(index, pairs, (a[x][2], *b[y][2]), limit)))
            if a[x][1] < b[y][1]:
                x += 1
            else:
                y += 1
        out.append(row)
    return out, acc


def compile_regex(pattern: str, *, search: bool = False, min_chars: int = 0,
                  max_chars: int | None = None, excluded_bytes: bytes = b"",
                  max_states: int = 20_000) -> ByteDFA:
    """The DFA over UTF-8 bytes of the strings that ``pattern`` matches (whole, or anywhere
    with ``search``), of ``min_chars`` to ``max_chars`` characters, without transitions on
    ``excluded_bytes``. Raises :class:`RegexError` for an unsupported or invalid pattern,
    an empty language, or automata of more than ``max_states`` states."""
    if min_chars < 0 or (max_chars is not None and max_chars < 0):
        raise ValueError("min_chars and max_chars must be >= 0")
    if max_states < 1:
        raise ValueError("max_states must be >= 1")
    parser = _Parser(pattern)
    tree = parser.parse()
    try:
        nfa = _NFA(max_states)
        start, end = nfa.build(tree)
        absorbing = None
        if search and not parser.anchor_start:
            loop = nfa.state()
            s, e = nfa.chars(_ANY)
            nfa.eps[loop] += [s, start]
            nfa.eps[e].append(loop)
            start = loop
        if search and not parser.anchor_end:
            loop = nfa.state()
            s, e = nfa.chars(_ANY)
            nfa.eps[end].append(loop)
            nfa.eps[loop].append(s)
            nfa.eps[e].append(loop)
            end = absorbing = loop
        edges, accepting = _determinize(nfa, start, end, absorbing, max_states)
        if excluded_bytes:
            edges = _exclude(edges, excluded_bytes)
        dfa = _trim(edges, accepting, 0)
        if dfa is not None:
            dfa = _minimize(*dfa)
            if min_chars or max_chars is not None:
                dfa = _trim(*_with_length(*dfa, min_chars, max_chars, max_states), 0)
    except _TooComplex:
        raise RegexError(f"pattern {pattern!r} is too complex: its automaton would need more than "
                         f"{max_states} states (max_states)") from None
    if dfa is None:
        where = []
        if min_chars or max_chars is not None:
            where.append(f"of {min_chars} to {'any number of' if max_chars is None else max_chars} characters")
        if excluded_bytes:
            where.append(f"without the bytes {bytes(sorted(set(excluded_bytes)))!r}")
        raise RegexError(f"pattern {pattern!r} matches no string" + "".join(" " + w for w in where))
    edges, accepting = dfa
    rows = []
    for row in edges:
        full = [-1] * 256
        for lo, hi, t in row:
            full[lo:hi + 1] = [t] * (hi - lo + 1)
        rows.append(tuple(full))
    return ByteDFA(0, tuple(rows), tuple(accepting))
