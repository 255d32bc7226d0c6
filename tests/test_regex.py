"""asyncgen.regex against Python's re: random ECMA patterns, each written also as the
equivalent Python pattern, must accept exactly the strings re accepts (fullmatch or
search, with character-count bounds and excluded bytes), over random strings, strings walked out of the DFA
and their mutations, and every short string over a small alphabet. Every compiled DFA is
checked for reachability, co-reachability and UTF-8 well-formedness of every path."""

from __future__ import annotations

import itertools
import random
import re
import time

import pytest

from asyncgen.regex import ByteDFA, RegexError, compile_regex

# ECMA white space and line terminators, in Python class syntax.
PY_SPACE = "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
PY_DOT = "[^\\n\\r\\u2028\\u2029]"

ALPHABET = ["a", "b", "0", "7", " ", "-", ".", "é", "😀", "\n", "\r", "\u2028", "_", "Z", "\t", "\xa0"]
SHORT_ALPHABET = ["a", "b", "0", "-", "é", "😀", "\n", " "]


# --- invariants ---------------------------------------------------------------------------
def utf8_step(st, b):
    """A UTF-8 validator (None at a character boundary, else (bytes left, lo, hi)); raises
    on a byte that cannot continue well-formed UTF-8."""
    if st is None:
        if b < 0x80:
            return None
        for lead_lo, lead_hi, need, lo, hi in ((0xC2, 0xDF, 1, 0x80, 0xBF), (0xE0, 0xE0, 2, 0xA0, 0xBF),
                                               (0xE1, 0xEC, 2, 0x80, 0xBF), (0xED, 0xED, 2, 0x80, 0x9F),
                                               (0xEE, 0xEF, 2, 0x80, 0xBF), (0xF0, 0xF0, 3, 0x90, 0xBF),
                                               (0xF1, 0xF3, 3, 0x80, 0xBF), (0xF4, 0xF4, 3, 0x80, 0x8F)):
            if lead_lo <= b <= lead_hi:
                return (need, lo, hi)
        raise AssertionError(f"byte {b:#x} cannot start a character")
    need, lo, hi = st
    assert lo <= b <= hi, f"byte {b:#x} cannot continue a character"
    return None if need == 1 else (need - 1, 0x80, 0xBF)


def check_invariants(dfa: ByteDFA) -> list[int]:
    """Asserts the DFA's invariants; returns each state's distance to an accepting state."""
    n = len(dfa.next)
    assert n == len(dfa.accepting) and 0 <= dfa.start < n
    assert all(isinstance(row, tuple) and len(row) == 256 for row in dfa.next)
    assert all(-1 <= t < n for row in dfa.next for t in row)
    # Every path from the start is a prefix of well-formed UTF-8, and accepting states
    # are only reached at character boundaries.
    seen = {(dfa.start, None)}
    stack = [(dfa.start, None)]
    while stack:
        s, u = stack.pop()
        if dfa.accepting[s]:
            assert u is None
        for b, t in enumerate(dfa.next[s]):
            if t >= 0:
                v = utf8_step(u, b)
                if (t, v) not in seen:
                    seen.add((t, v))
                    stack.append((t, v))
    assert {s for s, _ in seen} == set(range(n)), "unreachable states"
    dist = [-1] * n
    frontier = [s for s in range(n) if dfa.accepting[s]]
    for s in frontier:
        dist[s] = 0
    rev = [[] for _ in range(n)]
    for s, row in enumerate(dfa.next):
        for t in set(row):
            if t >= 0:
                rev[t].append(s)
    while frontier:
        nxt = []
        for t in frontier:
            for s in rev[t]:
                if dist[s] < 0:
                    dist[s] = dist[t] + 1
                    nxt.append(s)
        frontier = nxt
    assert min(dist) >= 0, "dead states"
    return dist


def walk(dfa: ByteDFA, dist: list[int], rng: random.Random, steps: int) -> str:
    """A random accepted string: random bytes for ``steps``, then towards acceptance."""
    s, out = dfa.start, bytearray()
    for i in itertools.count():
        choices = [(b, t) for b, t in enumerate(dfa.next[s]) if t >= 0]
        if dfa.accepting[s] and (i >= steps or not choices or rng.random() < 0.2):
            break
        if i >= steps:
            choices = [(b, t) for b, t in choices if dist[t] < dist[s]]
        b, s = rng.choice(choices)
        out.append(b)
    assert dfa.matches(bytes(out))
    return out.decode("utf-8")


# --- random patterns: (ECMA text, Python text) --------------------------------------------
LITERALS = [("a", "a"), ("b", "b"), ("0", "0"), ("-", "-"), (" ", " "), ("é", "é"), ("😀", "😀"),
            ("\\.", "\\."), ("\\-", "\\-"), ("\\n", "\\n"), ("\\t", "\\t"), ("\\x61", "a"),
            ("\\u00e9", "é"), ("\\uD83D\\uDE00", "😀"), ("\\u2028", "\\u2028"), ("_", "_")]
ESCAPES = [("\\d", "\\d"), ("\\D", "\\D"), ("\\w", "\\w"), ("\\W", "\\W"),
           ("\\s", f"[{PY_SPACE}]"), ("\\S", f"[^{PY_SPACE}]"), (".", PY_DOT)]
CLASS_ITEMS = [("a", "a"), ("b", "b"), ("0", "0"), ("é", "é"), ("😀", "😀"), ("\\-", "\\-"), (".", "\\."),
               ("a-c", "a-c"), ("0-9", "0-9"), ("\\u00e0-\\u00ff", "\\u00e0-\\u00ff"),
               ("\\uD83D\\uDE00-\\uD83D\\uDE4F", "\\U0001F600-\\U0001F64F"), ("\\n", "\\n"),
               ("\\d", "\\d"), ("\\D", "\\D"), ("\\w", "\\w"), ("\\W", "\\W"), ("\\s", PY_SPACE),
               (" ", " "), ("\\x00-\\x1f", "\\x00-\\x1f")]


def gen_class(rng):
    negate = rng.random() < 0.3
    items = [rng.choice(CLASS_ITEMS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.05:
        return ("[^]", "[\\s\\S]") if negate else ("[]", "(?!)")
    hat = "^" if negate else ""
    ecma = "[" + hat + "".join(e for e, _ in items)
    py = "[" + hat + "".join(p for _, p in items)
    if not negate and rng.random() < 0.15:  # \S inside a class: a union in Python
        return ecma + "\\S]", f"(?:{py}]|[^{PY_SPACE}])"
    return ecma + "]", py + "]"


def gen_atom(rng, depth, names):
    r = rng.random()
    if depth < 3 and r < 0.2:
        e, p = gen_alt(rng, depth + 1, names)
        kind = rng.randrange(3)
        if kind == 0:
            return f"({e})", f"({p})"
        if kind == 1:
            return f"(?:{e})", f"(?:{p})"
        name = f"g{len(names)}"
        names.append(name)
        return f"(?<{name}>{e})", f"(?P<{name}>{p})"
    if r < 0.55:
        return rng.choice(LITERALS)
    if r < 0.75:
        return rng.choice(ESCAPES)
    return gen_class(rng)


def gen_quantifier(rng):
    q = rng.choice(["*", "+", "?", "{0}", "{1}", "{2}", "{0,}", "{2,}", "{1,3}", "{0,2}", "{2,3}"])
    return q + ("?" if rng.random() < 0.2 else "")


def gen_seq(rng, depth, names):
    e, p = "", ""
    for _ in range(rng.randint(0, 3)):
        ae, ap = gen_atom(rng, depth, names)
        if rng.random() < 0.35:
            q = gen_quantifier(rng)
            ae, ap = ae + q, ap + q
        e, p = e + ae, p + ap
    return e, p


def gen_alt(rng, depth, names):
    alts = [gen_seq(rng, depth, names) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return "|".join(e for e, _ in alts), "|".join(p for _, p in alts)


def gen_pattern(rng):
    """An ECMA pattern, the equivalent Python pattern (for re.ASCII), and its anchors."""
    names: list[str] = []
    e, p = gen_alt(rng, 0, names)
    start = end = False
    if not _has_top_level_alt(e):
        start, end = rng.random() < 0.3, rng.random() < 0.3
    ecma = ("^" if start else "") + e + ("$" if end else "")
    return ecma, p, start, end


def _has_top_level_alt(e):
    depth, i, in_class = 0, 0, False
    while i < len(e):
        c = e[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if e.startswith("[]", i) or e.startswith("[^]", i):
                i += 2 if e.startswith("[]", i) else 3
                in_class = False
                continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            return True
        i += 1
    return False


def oracle(py, start, end, search, min_chars, max_chars, excluded=""):
    body = re.compile(("\\A" if start else "") + f"(?:{py})" + ("\\Z" if end else ""), re.ASCII)
    match = body.search if search else body.fullmatch

    def accepts(s: str) -> bool:
        if len(s) < min_chars or (max_chars is not None and len(s) > max_chars):
            return False
        if any(c in excluded for c in s):
            return False
        return match(s) is not None
    return accepts


def mutate(rng, s):
    chars = list(s)
    for _ in range(rng.randint(1, 2)):
        op = rng.randrange(3)
        i = rng.randint(0, len(chars))
        if op == 0 or not chars:
            chars.insert(i, rng.choice(ALPHABET))
        elif op == 1:
            del chars[min(i, len(chars) - 1)]
        else:
            chars[min(i, len(chars) - 1)] = rng.choice(ALPHABET)
    return "".join(chars)


SHORT_STRINGS = ["".join(t) for k in range(4) for t in itertools.product(SHORT_ALPHABET, repeat=k)]


@pytest.mark.parametrize("seed", range(8))
def test_random_patterns_against_re(seed):
    rng = random.Random(seed)
    for case in range(40):
        ecma, py, start, end = gen_pattern(rng)
        search = rng.random() < 0.4
        min_chars, max_chars = 0, None
        if rng.random() < 0.3:
            min_chars = rng.choice([0, 1, 2, 3])
            max_chars = rng.choice([None, 2, 3, 5])
        excluded = rng.choice(["", "", "", "\n", "\n\r\t", "a-"])
        accepts = oracle(py, start, end, search, min_chars, max_chars, excluded)
        what = f"{ecma!r} (python {py!r}) search={search} chars={min_chars}..{max_chars} excluded={excluded!r}"
        strings = list(SHORT_STRINGS) if case % 4 == 0 else rng.sample(SHORT_STRINGS, 60)
        strings += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(60)]
        try:
            dfa = compile_regex(ecma, search=search, min_chars=min_chars, max_chars=max_chars,
                                excluded_bytes=excluded.encode())
        except RegexError as e:
            assert "matches no string" in str(e), what
            assert not any(map(accepts, strings)), what
            continue
        dist = check_invariants(dfa)
        walks = [walk(dfa, dist, rng, rng.choice([0, 3, 10])) for _ in range(15)]
        strings += walks + [mutate(rng, s) for s in walks for _ in range(2)]
        for s in strings:
            assert dfa.matches(s.encode()) == accepts(s), f"{what} on {s!r}"


# --- fixed cases --------------------------------------------------------------------------
REALISTIC = {
    "email": (r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$", False),
    "date-time": (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt ]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)"
                  r"(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)", True),
    "uuid": (r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$", False),
    "word": (r"[a-z]{1,64}", False),
}


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_realistic_patterns(name):
    pattern, search = REALISTIC[name]
    t = time.perf_counter()
    dfa = compile_regex(pattern, search=search)
    assert time.perf_counter() - t < 1.0
    dist = check_invariants(dfa)
    rng = random.Random(name)
    py = re.compile(pattern, re.ASCII)
    match = py.search if search else py.fullmatch
    samples = [walk(dfa, dist, rng, 40) for _ in range(50)]
    samples += [mutate(rng, s) for s in samples]
    samples += ["a@b.co", "a@b.c", "x 2024-02-30T23:59:60.5+01:00 y", "2024-13-01T00:00:00Z",
                "123e4567-e89b-12d3-a456-426614174000", "a" * 64, "a" * 65, "", "abc\n"]
    for s in samples:
        assert dfa.matches(s.encode()) == (match(s) is not None), s


@pytest.mark.parametrize("pattern, yes, no", [
    ("a{,5}", ["a{,5}"], ["a", "aaaaa"]),
    ("a{", ["a{"], ["a"]),
    ("x{2,b}", ["x{2,b}"], ["xx"]),
    ("a}]", ["a}]"], []),
    ("[]", [], ["", "a", "]"]),
    ("[^]", ["a", "\n", "😀"], ["", "ab"]),
    ("[]a]", [], ["a", "]a]", "]"]),
    ("[\\w-.]+", ["a-.", "_"], ["", " ", "é"]),
    ("[\\b]", ["\b"], ["b", "\\"]),
    ("\\0", ["\0"], ["0"]),
    ("\\/\\$\\^\\{\\}\\|", ["/$^{}|"], []),
    ("\\é", ["é"], ["e"]),
    ("^$", [""], ["a"]),
    ("^", [""], ["a"]),
    ("a$", ["a"], ["a\n"]),
    ("(?<x>a)(?<y_1$>b)+", ["ab", "abb"], ["a"]),
    ("a|", ["a", ""], ["aa"]),
    ("|", [""], ["a"]),
    ("(a|)+?b*?", ["", "a", "aab", "b"], ["ba"]),
    ("😀{2}", ["😀😀"], ["😀", "\ud83d\ude00"]),
    (".", ["a", "\u2027", "\x00", "\U0010FFFF"], ["\n", "\r", "\u2028", "\u2029", ""]),
    ("\\s", [" ", "\t", "\v", "\f", "\ufeff", "\u3000", "\u2001"], ["\x1c", "\u200b", "\x85", "a"]),
    ("[\\u0400-\\u04FF]+", ["Жж"], ["a", "ԁ"]),
])
def test_fixed_cases(pattern, yes, no):
    try:
        dfa = compile_regex(pattern)
    except RegexError as e:
        assert not yes and "matches no string" in str(e)
        return
    check_invariants(dfa)
    for s in yes:
        assert dfa.matches(s.encode("utf-8", "surrogatepass")), s
    for s in no:
        assert not dfa.matches(s.encode("utf-8", "surrogatepass")), s


def test_search_anchors():
    assert compile_regex("ab", search=True).matches("xxabyy".encode())
    assert compile_regex("^ab", search=True).matches(b"abyy")
    assert not compile_regex("^ab", search=True).matches(b"xab")
    assert compile_regex("ab$", search=True).matches(b"xab")
    assert not compile_regex("ab$", search=True).matches(b"aby")
    assert not compile_regex("^ab$", search=True).matches(b"abab")
    assert compile_regex("", search=True).matches("é😀".encode())
    assert compile_regex("^", search=False).matches(b"")


def test_length_bounds():
    dfa = compile_regex("[\\s\\S]*", min_chars=2, max_chars=3)
    check_invariants(dfa)
    for s, ok in [("", False), ("é", False), ("é😀", True), ("abc", True), ("abcd", False), ("😀😀😀", True)]:
        assert dfa.matches(s.encode()) == ok, s
    dfa = compile_regex("a+", min_chars=3)
    assert not dfa.matches(b"aa") and dfa.matches(b"aaa") and dfa.matches(b"a" * 50)
    with pytest.raises(RegexError, match="matches no string"):
        compile_regex("a{5}", max_chars=3)
    with pytest.raises(RegexError, match="matches no string"):
        compile_regex("a*", min_chars=4, max_chars=3)
    with pytest.raises(ValueError):
        compile_regex("a", min_chars=-1)


def test_excluded_bytes():
    control = bytes(range(0x20))
    dfa = compile_regex("[\\s\\S]*", excluded_bytes=control)
    check_invariants(dfa)
    for b in control:
        assert dfa.advance(dfa.start, bytes([b])) == -1
        assert all(dfa.next[s][b] == -1 for s in range(len(dfa.next)))
    assert dfa.matches("héllo 😀 wörld".encode())
    assert not dfa.matches(b"a\nb")
    with pytest.raises(RegexError, match="matches no string"):
        compile_regex("a\\nb", excluded_bytes=b"\n")
    dfa = compile_regex("a|\\n", excluded_bytes=b"\n")
    assert dfa.matches(b"a") and not dfa.matches(b"\n")
    dfa = compile_regex("a\\s*b", search=True, excluded_bytes=b"\t")
    check_invariants(dfa)
    assert dfa.matches(b"xa  b") and not dfa.matches(b"a\tb")


def test_empty_language():
    for pattern in ["[^\\s\\S]", "[]", "a[]b", "(?:[]|[^\\d\\D])+"]:
        with pytest.raises(RegexError, match="matches no string"):
            compile_regex(pattern)
    with pytest.raises(RegexError, match="matches no string"):
        compile_regex("[]", search=True)


def test_too_complex():
    with pytest.raises(RegexError, match="too complex.*20000"):
        compile_regex("(a|b)*a(a|b){16}")
    with pytest.raises(RegexError, match="too complex.*50"):
        compile_regex("[a-z]{1,64}", max_states=50)
    with pytest.raises(RegexError, match="too complex"):
        compile_regex("a{1000000000}")
    with pytest.raises(RegexError, match="too complex"):
        compile_regex("(?:){99999999999999999999999}")
    with pytest.raises(RegexError, match="too complex"):
        compile_regex("[\\s\\S]*", max_chars=100_000)


@pytest.mark.parametrize("pattern, needle, pos", [
    ("(a)\\1", "backreference", 3),
    ("\\k<x>", "named backreference", 0),
    ("a(?=b)", "lookahead", 1),
    ("a(?!b)", "lookahead", 1),
    ("(?<=a)b", "lookbehind", 0),
    ("(?<!a)b", "lookbehind", 0),
    ("a\\b", "word boundary", 1),
    ("\\Ba", "word boundary", 0),
    ("[\\B]", "word boundary", 1),
    ("\\cJ", "control escape", 0),
    ("\\p{L}", "Unicode property", 0),
    ("[\\P{L}]", "Unicode property", 1),
    ("(?i)a", "unsupported group syntax", 0),
    ("(?P<x>a)", "unsupported group syntax", 0),
    ("(?<1x>a)", "group name", 0),
    ("*a", "nothing to repeat", 0),
    ("a|+", "nothing to repeat", 2),
    ("{2}", "nothing to repeat", 0),
    ("a**", "nothing to repeat", 2),
    ("a{2}{3}", "nothing to repeat", 4),
    ("a?+", "nothing to repeat", 2),
    ("^*", "nothing to repeat", 1),
    ("(a", "unbalanced '('", 0),
    ("a)", "unbalanced ')'", 1),
    ("((a)", "unbalanced '('", 0),
    ("[z-a]", "bad range", 1),
    ("[a", "unterminated character class", 0),
    ("a{3,2}", "min > max", 1),
    ("^a|b", "'^'", 0),
    ("a|b$", "'$'", 3),
    ("^a|^b", "'^'", 3),
    ("(^a)", "'^'", 1),
    ("a^", "'^'", 1),
    ("$a", "'$'", 0),
    ("(a$)", "'$'", 2),
    ("\\u{1F600}", "\\u{...}", 0),
    ("\\uD83D", "lone surrogate", 0),
    ("a\\uDE00", "lone surrogate", 1),
    ("[\\uD800-\\uDBFF]", "lone surrogate", 1),
    ("\ud83d", "lone surrogate", 0),
    ("\\u12", "four hex digits", 0),
    ("\\x4", "two hex digits", 0),
    ("\\z", "unsupported escape", 0),
    ("\\A", "unsupported escape", 0),
    ("\\01", "octal", 0),
    ("a\\", "lone '\\'", 1),
    ("(" * 300 + ")" * 300, "nested", 200),
])
def test_unsupported(pattern, needle, pos):
    with pytest.raises(RegexError) as info:
        compile_regex(pattern)
    message = str(info.value)
    assert needle in message and f"position {pos}" in message, message


def test_deterministic_and_interface():
    a = compile_regex("[a-c]+é|😀{1,3}", search=True, max_chars=6)
    b = compile_regex("[a-c]+é|😀{1,3}", search=True, max_chars=6)
    assert (a.start, a.next, a.accepting) == (b.start, b.next, b.accepting)
    assert isinstance(a.next, tuple) and isinstance(a.accepting, tuple)
    assert a.advance(-1, b"") == -1 and a.advance(a.start, b"\xff") == -1
    s = a.advance(a.start, "zzaé".encode())
    assert s >= 0 and a.accepting[s]
    assert issubclass(RegexError, ValueError)
    assert "states" in repr(a)
