"""Strings constrained by JSON Schema ``pattern`` and ``format``, and raw output by a
regular expression (structured outputs' ``regex``): documents are accepted exactly where
Python's ``re`` (or a list of known good and bad values) says so, the token masks equal a
brute-force scan of SmolLM2's vocabulary, random token walks end in values that pydantic
accepts, and SmolLM2 generates under them through the engine."""

from __future__ import annotations

import datetime
import json
import random
import re
import uuid
from typing import Optional

import numpy as np
import pytest
from pydantic import BaseModel, Field, ValidationError

import asyncgen.structured as structured
from asyncgen import AsyncEngine, SamplingParams
from asyncgen.errors import InvalidRequestError
from asyncgen.structured import FORMATS, TokenGuide, Vocabulary, json_schema_grammar, regex_grammar
from test_structured import brute_force, token_walk

# JSON Schema patterns (search semantics), written so that Python's re reads them the same
PATTERNS = [
    r"^[A-Z]{2}-[0-9]{3,5}$",
    r"ab+c",
    r"^(foo|bar)+(baz)?$",
    r"[é中]{2}",
    r"^\+?[0-9 ]{4,9}$",
    r"^$",
    r'^[^"\\]*"[a-z]\\?$',  # a quote and a backslash: written escaped in JSON
    r"^a\nb$",  # a control character that has a short escape
]
ALPHABET = list("abcfoorbzAZ0123456789-+ \"\\\n\t\x01é中😀") + ["foo", "bar", "baz", "AB-123", "AZ-99999"]


def _accepts(grammar, data: bytes) -> bool:
    state = grammar.advance(grammar.initial, data)
    return state is not None and grammar.accepts(state)


def _candidates(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(n)]


def _writable(s: str) -> bool:
    """Whether the string can be written in a pattern string: no control character
    without a short escape."""
    return not any(ord(c) < 0x20 and c not in "\b\f\n\r\t" for c in s)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("bounds", [(0, None), (3, 6)])
def test_pattern_strings_are_accepted_exactly_where_re_search_matches(pattern, bounds):
    low, high = bounds
    schema = {"type": "string", "pattern": pattern}
    if high is not None:
        schema.update(minLength=low, maxLength=high)
    try:
        grammar = json_schema_grammar(schema)
    except InvalidRequestError as e:  # only when no string fits both the pattern and the bounds
        assert "no string" in str(e) and high is not None
        return
    rng = random.Random(pattern)
    fixed = ["AB-123", "AZ-99999", "abbbc", "xxabcxx", "foobarbaz", "foofoo", "é中", "x中中", "+123 45",
             "", 'xx"q', 'x"q\\', "a\nb", "abc\x01", "+1234", "12 34"]
    matched = 0
    for s in fixed + _candidates(rng, 400):
        want = bool(re.search(pattern, s)) and low <= len(s) <= (high if high is not None else len(s)) and _writable(s)
        doc = json.dumps(s, ensure_ascii=False).encode()
        assert _accepts(grammar, doc) == want, (pattern, s)
        matched += want
        if want:  # every prefix of a good document can go on
            state = grammar.initial
            for b in doc:
                state = grammar.advance(state, bytes([b]))
                assert state is not None
    assert matched >= 1


def test_patterns_and_formats_inside_objects_and_unions():
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "when": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["code", "when", "id"],
    }
    g = json_schema_grammar(schema)
    u = str(uuid.UUID(int=random.Random(1).getrandbits(128)))
    assert _accepts(g, json.dumps({"code": "ABC", "when": "2024-02-29T13:05:00Z", "id": u}).encode())
    assert _accepts(g, json.dumps({"code": "XYZ", "when": None, "id": u.upper()}).encode())
    assert not _accepts(g, json.dumps({"code": "ABCD", "when": None, "id": u}).encode())
    assert not _accepts(g, json.dumps({"code": "ABC", "when": "yesterday", "id": u}).encode())
    # enum values are filtered by the pattern
    e = json_schema_grammar({"type": "string", "enum": ["AB-1", "AB-123", "x"], "pattern": PATTERNS[0]})
    assert _accepts(e, b'"AB-123"') and not _accepts(e, b'"x"')


GOOD = {
    "date": ["2024-02-29", "2000-02-29", "1999-12-31", "0001-01-01", "2023-04-30"],
    "time": ["13:05:00Z", "23:59:59.123456+05:30", "00:00:00-08:00"],
    "date-time": ["2024-02-29T13:05:00Z", "2024-02-29T13:05:00.5+01:00",
                  datetime.datetime(2020, 5, 17, 8, 1, 2, 345, tzinfo=datetime.timezone.utc).isoformat()],
    "duration": ["P3D", "PT5M", "P1W", "P1Y2M3DT4H5M6S", "PT0S", "P2MT1H"],
    "uuid": [str(uuid.UUID(int=7)), "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11"],
    "email": ["a@example.com", "first.last+tag@sub.domain.org", "x_y@a-b.io"],
    "hostname": ["localhost", "a.b-c.example", "x1"],
    "ipv4": ["0.0.0.0", "192.168.1.255", "255.255.255.255"],
    "uri": ["https://example.com/a?b=c#d", "mailto:a@b.org", "urn:isbn:0451450523", "http://u:p@h:80/p%20q/?x#y",
            "file:///etc/passwd", "a:"],
    "password": ["anything at all", ""],
}
BAD = {
    "date": ["2024-13-01", "2024-1-01", "24-01-01", "2024-01-32", "2024/01/01", "2023-02-29", "1900-02-29",
             "2024-11-31", "0000-01-01"],
    "time": ["13:05:00", "24:00:00Z", "13:5:00Z", "13:05:00+5:00", "23:59:60Z", "12:00:00z", "12:00:00.1234567Z"],
    "date-time": ["2024-02-29 13:05:00Z", "2024-02-29T13:05:00", "2024-02-29", "2024-02-29t13:05:00Z"],
    "duration": ["P", "PT", "P1H", "1D", "P1DT"],
    "uuid": ["123", str(uuid.UUID(int=7)).replace("-", ""), "g0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"],
    "email": ["a@b", "@example.com", "a b@example.com", "a@@example.com", "a@example.c"],
    "hostname": ["-a.com", "a..b", "a_b.com", ""],
    "ipv4": ["256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4.5"],
    # RFC 3986: a percent sign starts two hex digits; one '#'; brackets only around an IP-literal host
    "uri": ["example.com", "//x", "http://a b", "", "a:%zz", "a:%", "a:#x#y", "a:[x", "http://h:8a/"],
    "password": [],
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_formats_accept_good_values_and_refuse_bad_ones(fmt):
    g = json_schema_grammar({"type": "string", "format": fmt})
    for s in GOOD[fmt]:
        assert _accepts(g, json.dumps(s).encode()), (fmt, s)
        if fmt in ("date", "date-time"):  # what is generated, Python reads
            (datetime.date if fmt == "date" else datetime.datetime).fromisoformat(s)
    for s in BAD[fmt]:
        assert not _accepts(g, json.dumps(s).encode()), (fmt, s)


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "format": "ipv6"}, "'format' 'ipv6' at # is not supported"),
    ({"type": "string", "pattern": "(a"}, "'pattern' '(a' at #"),
    ({"type": "string", "pattern": r"(a)\1"}, "'pattern'"),
    ({"type": "string", "pattern": "a", "format": "date"}, "'pattern' next to 'format'"),
    ({"type": "integer", "format": "int32"}, "'format' at # applies to string values"),
    ({"type": "string", "pattern": "^[a-z]{5}$", "maxLength": 3}, "no string"),
])
def test_pattern_and_format_errors_name_what_and_where(schema, words):
    with pytest.raises(InvalidRequestError) as e:
        json_schema_grammar({"type": "object", "properties": {"p": schema}, "required": ["p"]})
    assert words.replace(" at #", " at #/properties/p") in str(e.value) and e.value.param == "structured_outputs"


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[0-9]{4}", r"(yes|no)( because [a-z ]{1,20})?", r"héllo\n?[😀]+"])
def test_regex_grammar_is_re_fullmatch(pattern):
    g = regex_grammar(pattern)
    rng = random.Random(pattern)
    alphabet = list("0123456789- yesnobcau\n") + ["é", "😀", "héllo", "yes", " because "]
    fixed = ["555-1234", "000-0000", "55-1234", "yes", "no because it is", "no because ", "héllo😀", "héllo\n😀😀", "hello😀"]
    hits = 0
    for s in fixed + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(500)]:
        want = re.fullmatch(pattern, s) is not None
        assert _accepts(g, s.encode()) == want, (pattern, s)
        hits += want
    assert hits >= 2
    with pytest.raises(InvalidRequestError, match="regex"):
        regex_grammar("a(?=b)")


def test_masks_equal_brute_force_and_walks_end_in_valid_values(vocabulary, token_bytes, closers):
    class Booking(BaseModel):
        code: str = Field(pattern=r"^[A-Z]{2}[0-9]{2,4}$")
        day: datetime.date
        at: datetime.datetime
        ref: uuid.UUID
        note: Optional[str] = Field(default=None, pattern=r"ok", max_length=8)

    schema = Booking.model_json_schema()
    g = json_schema_grammar(schema)
    guide = TokenGuide(g, vocabulary)
    prefixes = [b'{"code": "', b'{"code": "AB1', b'{"code": "AB12", "day": "2024-0', b'{"code": "AB12", "day": "2024-01-02", "at": "',
                b'{"code": "AB12", "day": "2024-01-02", "at": "2024-01-02T10:00:00Z", "ref": "0a', b'{"code": "AB12", "day": "'
                b'2024-01-02", "at": "2024-01-02T10:00:00Z", "ref": "' + str(uuid.UUID(int=3)).encode() + b'", "note": "xo']
    for p in prefixes:
        state = g.advance(g.initial, p)
        assert state is not None, p
        assert guide.allowed(state) == brute_force(g, token_bytes, state), p
    rng = random.Random(3)
    for _ in range(4):
        ids, state = token_walk(guide, token_bytes, rng, closers)
        Booking.model_validate_json(b"".join(token_bytes[i] for i in ids))
    r = regex_grammar(r"(yes|no), [a-z]{2,6}!")
    rguide = TokenGuide(r, vocabulary)
    state = r.advance(r.initial, b"no, ab")
    assert rguide.allowed(state) == brute_force(r, token_bytes, state)
    for _ in range(6):
        ids, _ = token_walk(rguide, token_bytes, rng, closers)
        assert re.fullmatch(r"(yes|no), [a-z]{2,6}!", b"".join(token_bytes[i] for i in ids).decode())


def general_walk(vocabulary, state):
    """The allowed tokens as the general walk finds them: every token through ``_step``."""
    out = []
    structured._walk(vocabulary.trie, state, out)
    return tuple(sorted(out))


@pytest.fixture(scope="module")
def small_vocabulary(token_bytes):
    """Some 3,000 of SmolLM2's tokens, all its single bytes (so a walk never gets stuck),
    and tokens made to sit at the edges: quotes, backslashes and control bytes inside,
    cut UTF-8 characters, long runs, duplicates, special and empty tokens."""
    rng = random.Random(5)
    singles = [data for data in token_bytes if data and len(data) == 1]
    longer = [data for data in token_bytes if data and len(data) > 1]
    made = [b'ab"', b'\\n', b'"\\', b"\xc3", b"\xa9x", b"\xe4\xb8", b"\xad", "é中".encode(), "😀".encode(), b"x" * 30,
            b"-" * 70, b"2024-01-02T", b"13:05:00Z", b"\t\t", b"\x01a", b"\x7f", b"AB-12", b"foo", b"foo", None, b""]
    return Vocabulary(singles + rng.sample(longer, 3000) + made)


FAST_PATH_SCHEMAS = [
    *({"type": "string", "pattern": p} for p in PATTERNS),
    {"type": "string", "pattern": "^[a-z ]+$", "minLength": 3, "maxLength": 12},
    {"type": "string", "pattern": "[0-9]", "maxLength": 40},
    *({"type": "string", "format": f} for f in ("date-time", "email", "uuid", "hostname", "ipv4", "duration")),
    {"type": "string", "format": "uri", "minLength": 1, "maxLength": 60},
    {"anyOf": [{"type": "string", "pattern": "^[a-z ]*$"}, {"type": "string", "pattern": "[aeiou]"},
               {"type": "string", "maxLength": 30}]},
    {"anyOf": [{"type": "string", "format": "hostname"}, {"type": "string", "minLength": 2, "maxLength": 12}]},
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "pattern": "^[0-9]+$"}]},
    {"anyOf": [{"type": "string", "pattern": "^[^0-9]"}, {"type": "string"}]},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,5}$"},
                                      "b": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,5}$"}}},
     "required": ["a", "b"]},
]
FAST_PATH_REGEXES = [r"[A-Z][a-z]+ [0-9]{1,2}", r'(yes|no), [a-z "\\]{2,9}!', r"héllo\n?[😀]+", r"[^x]*x"]


def test_the_dfa_fast_path_equals_the_general_walk_in_random_states(small_vocabulary):
    """Every state on random token walks through pattern strings, formats, length bounds,
    unions of patterns and strings, and regex outputs: the masks equal the general walk."""
    vocab = small_vocabulary
    grammars = [json_schema_grammar(s) for s in FAST_PATH_SCHEMAS] + [regex_grammar(r) for r in FAST_PATH_REGEXES]
    rng = random.Random(7)
    kinds = {"dfa": 0, "union": 0, "mixed": 0}
    for grammar in grammars:
        guide = TokenGuide(grammar, vocab)
        for _ in range(2):
            state = grammar.initial
            for _ in range(rng.randint(5, 25)):
                allowed = guide.allowed(state)
                assert allowed == general_walk(vocab, state)
                block = structured._plain_block(state)
                if block is not None and block[1]:
                    kinds["dfa"] += 1
                    kinds["union"] += len(block[1]) > 1
                    kinds["mixed"] += block[0] is not False
                if not allowed or (grammar.accepts(state) and rng.random() < 0.2):
                    break
                state = grammar.advance(state, vocab.token_bytes[rng.choice(allowed)])
    assert kinds["dfa"] > 300 and kinds["union"] > 5 and kinds["mixed"] > 5, kinds


def test_pattern_and_regex_states_run_plain_tokens_through_the_dfa(vocabulary, token_bytes, monkeypatch):
    """Inside a pattern string (an object's, an array's, an anyOf's of a pattern and a
    string) and in a regex output, only the non-plain tokens are walked; the plain ones
    go through the DFA, once per DFA state however many grammar states share it."""
    walked, runs = [], []
    real_walk, real_mask = structured._walk, structured._DFATable.plain_mask
    monkeypatch.setattr(structured, "_walk", lambda trie, state, out: (walked.append(trie), real_walk(trie, state, out)))
    monkeypatch.setattr(structured._DFATable, "plain_mask",
                        lambda self, columns, size, d: (runs.append(d), real_mask(self, columns, size, d))[1])
    code = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,5}$"}
    g = json_schema_grammar({"type": "object", "properties": {
        "a": code, "b": {"type": "array", "items": code, "minItems": 2},
        "c": {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "maxLength": 9}]},
        "d": {"type": "string", "pattern": r"^[a-z\n]+$"}}})
    r = regex_grammar(r"[A-Z][a-z]+ [0-9]{1,2}")
    cases = [(g, b'{"a": "AB-1'), (g, b'{"a": "AB-123", "b": ["AB-1'), (g, b'{"a": "AB-123", "b": ["XY-123", "CD-9'),
             (g, b'{"c": "2024-0'), (r, b"Ma")]
    guides = {id(g): TokenGuide(g, vocabulary), id(r): TokenGuide(r, vocabulary)}
    for grammar, prefix in cases:
        state = grammar.advance(grammar.initial, prefix)
        walked.clear()
        allowed = guides[id(grammar)].allowed(state)
        assert walked == [vocabulary.other_trie], prefix
        assert allowed == brute_force(grammar, token_bytes, state), prefix
    assert type(g.advance(g.initial, b'{"c": "2024-0')) is frozenset
    assert len(runs) == 3  # the three codes after "XX-9" share one DFA state
    walked.clear()
    escape = g.advance(g.initial, b'{"d": "a\\')  # after a backslash: the general walk
    assert guides[id(g)].allowed(escape) == brute_force(g, token_bytes, escape) and walked == [vocabulary.trie]


def test_plain_masks_go_with_the_memo_and_odd_vocabularies_work(small_vocabulary, monkeypatch):
    g = json_schema_grammar({"type": "string", "pattern": "[0-9]", "maxLength": 30})
    states = [g.advance(g.initial, b'"' + b"a" * n) for n in range(12)]
    first = [TokenGuide(g, small_vocabulary).allowed(st) for st in states]
    monkeypatch.setattr(structured, "MEMO_IDS", 3 * (len(first[0]) + small_vocabulary.size // 8))
    guide = TokenGuide(g, small_vocabulary)
    for _ in range(2):
        assert [guide.allowed(st) for st in states] == first
        assert len(guide._plain_masks) <= 3 and len(guide._memo) <= 3 and guide._memo_ids <= structured.MEMO_IDS
    # The runner asks for masks only (allowed_mask, no id memo): the plain masks stay bounded.
    monkeypatch.setattr(structured, "MEMO_IDS", 2 * (small_vocabulary.size // 8))
    guide = TokenGuide(g, small_vocabulary)
    for _ in range(2):
        masks = [guide.allowed_mask(st) for st in states]
        assert [tuple(np.flatnonzero(m).tolist()) for m in masks] == first
        assert len(guide._plain_masks) <= 2 and guide._memo_ids <= structured.MEMO_IDS
    no_plain = Vocabulary([b'"', b"\\", None, b"\xc3", b"\x01"])  # no plain token at all
    inside = g.advance(g.initial, b'"')
    assert TokenGuide(g, no_plain).allowed(inside) == (1, 3) == general_walk(no_plain, inside)


def test_sampling_params_take_regex_and_refuse_two_constraints():
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs.grammar is SamplingParams(structured_outputs={"regex": "[0-9]+"}).structured_outputs.grammar
    with pytest.raises(ValidationError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValidationError, match="regex"):
        SamplingParams(structured_outputs={"regex": "(unclosed"})


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_smollm2_generates_under_regex_and_pattern_schemas(smollm2_path):
    class Event(BaseModel):
        name: str = Field(max_length=20)
        day: datetime.date
        code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")

    ask = [{"role": "user", "content": "Give me a phone number and an event as JSON."}]
    async with AsyncEngine.from_pretrained(smollm2_path, max_num_seqs=8, num_kv_blocks=256) as engine:
        phone = SamplingParams(structured_outputs={"regex": r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}"}, max_tokens=30, temperature=0)
        out = await engine.generate(messages=ask, params=phone)
        assert out.finish_reason == "stop" and re.fullmatch(r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}", out.text), out.text
        event = SamplingParams(structured_outputs={"json": Event.model_json_schema()}, max_tokens=120, temperature=0.8,
                               seed=4, n=3)
        res = await engine.generate(messages=ask, params=event)
        for o in res.outputs:
            assert o.finish_reason == "stop"
            Event.model_validate_json(o.text)
        client = engine.openai_client()
        resp = await client.chat.completions.create(model=client.model, messages=ask, max_tokens=30, temperature=0,
                                                    extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]+ [0-9]{1,2}"}})
        assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{1,2}", resp.choices[0].message.content)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks


def test_uri_format_is_the_rfc3986_pattern_on_random_strings():
    """The grammar of format "uri" accepts a string exactly when Python's re fullmatches
    the pattern (ASCII classes only, so ECMA and Python read it alike)."""
    import random
    import re

    g = json_schema_grammar({"type": "string", "format": "uri"})
    pattern = re.compile(FORMATS["uri"])
    rng = random.Random(3986)
    pieces = ["a", "z9", ":", "/", "//", "%", "%2F", "%g1", "#", "?", "@", "[", "]", ".", "-", "~", "!", " ", "h:80"]
    seen = {True: 0, False: 0}
    for _ in range(400):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 7)))
        if rng.random() < 0.7:
            s = rng.choice(["http:", "a:", "urn:x:", "s+v.1:"]) + s
        want = pattern.fullmatch(s) is not None
        assert _accepts(g, json.dumps(s).encode()) == want, s
        seen[want] += 1
    assert min(seen.values()) > 50
