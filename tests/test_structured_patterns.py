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

import pytest
from pydantic import BaseModel, Field, ValidationError

from asyncgen import AsyncEngine, SamplingParams
from asyncgen.errors import InvalidRequestError
from asyncgen.structured import FORMATS, TokenGuide, json_schema_grammar, regex_grammar
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
    "uri": ["https://example.com/a?b=c#d", "mailto:a@b.org", "urn:isbn:0451450523"],
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
    "uri": ["example.com", "//x", "http://a b", ""],
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
