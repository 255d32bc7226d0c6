"""Structured-output grammars against an independent oracle: random documents made from
each schema (json.dumps in several layouts) are accepted, byte by byte and in chunks;
their proper prefixes accept exactly where Python's json parser and a schema checker
written here say the prefix is itself a valid document; hand-made invalid documents are
refused; TokenGuide's sets equal a brute-force scan of SmolLM2's vocabulary; random token
walks under the guide end in documents that json.loads and the schema (or pydantic) accept."""

from __future__ import annotations

import json
import random
from typing import Literal, Optional

import pytest
from pydantic import BaseModel

from asyncgen.errors import InvalidRequestError
from asyncgen.structured import (
    MAX_NUMBER_BYTES,
    MAX_WHITESPACE,
    TokenGuide,
    Vocabulary,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
)


# --- an independent schema checker and instance generator (the subset the tests use) --------
def resolve(root, ref):
    node = root
    for token in ref[2:].split("/") if ref != "#" else ():
        node = node[token]
    return node


def json_equal(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return a == b and (type(a) is type(b) or {type(a), type(b)} <= {int, float})


def has_type(value, t):
    return {
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "integer": type(value) is int,
        "number": type(value) in (int, float),
        "boolean": type(value) is bool,
        "null": value is None,
    }[t]


def conforms(value, schema, root):
    """Whether ``value`` satisfies ``schema`` (objects: declared properties only, in any order)."""
    if schema is True:
        return True
    if "$ref" in schema:
        return conforms(value, resolve(root, schema["$ref"]), root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return any(conforms(value, s, root) for s in schema[key])
    if "allOf" in schema:
        return all(conforms(value, s, root) for s in schema["allOf"])
    if "const" in schema and not json_equal(value, schema["const"]):
        return False
    if "enum" in schema and not any(json_equal(value, v) for v in schema["enum"]):
        return False
    types = schema.get("type")
    if types is not None:
        if not any(has_type(value, t) for t in ([types] if isinstance(types, str) else types)):
            return False
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if props is not None and not set(value) <= set(props):
            return False
        if not all(k in value for k in schema.get("required", [])):
            return False
        for k, v in value.items():
            sub = props[k] if props is not None else extra
            if sub is False or not conforms(v, sub, root):
                return False
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return False
        prefix = schema.get("prefixItems", [])
        for i, v in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", True)
            if sub is False or not conforms(v, sub, root):
                return False
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return False
    return True


ALPHABET = list("abcxyzAZ09 _-.,:{}[]") + ['"', "\\", "/", "\n", "\t", "\x01", "\x7f", "é", "ß", "中", "😀", "\u2028"]


def random_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def random_number(rng, integer):
    if integer or rng.random() < 0.3:
        return rng.choice([0, 1, -1, 7, 42, -300, 10**15, -(10**18), rng.randint(-10**6, 10**6)])
    return rng.choice([0.5, -2.25, 1e-7, 3.14159, 6.02e23, -0.0, 1e300, rng.uniform(-1e4, 1e4)])


def random_any(rng, depth=0):
    kinds = ["string", "number", "bool", "null"] + (["object", "array"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        return {random_text(rng, rng.randint(0, 5)): random_any(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "array":
        return [random_any(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "string":
        return random_text(rng, rng.randint(0, 8))
    if kind == "number":
        return random_number(rng, False)
    return rng.choice([True, False]) if kind == "bool" else None


def instance(schema, rng, root, depth=0):
    """A random value that satisfies ``schema``, objects in declared property order."""
    if schema is True or schema == {}:
        return random_any(rng, depth)
    if "$ref" in schema:
        return instance(resolve(root, schema["$ref"]), rng, root, depth)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(rng.choice(schema[key]), rng, root, depth)
    if "allOf" in schema:
        return instance(schema["allOf"][0], rng, root, depth)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        rest = {k: s for k, s in schema.items() if k != "enum"}
        return rng.choice([value for value in schema["enum"] if conforms(value, rest, root)])
    t = schema.get("type")
    if isinstance(t, list):
        t = rng.choice(t)
    if t == "object":
        if "properties" in schema:
            required = schema.get("required", [])
            return {
                k: instance(s, rng, root, depth + 1)
                for k, s in schema["properties"].items()
                if k in required or rng.random() < 0.5
            }
        values = schema.get("additionalProperties", True)
        return {random_text(rng, rng.randint(0, 6)): instance(values, rng, root, depth + 1) for _ in range(rng.randint(0, 3))}
    if t == "array":
        prefix = schema.get("prefixItems", [])
        low = schema.get("minItems", 0)
        items = schema.get("items", True)
        high = schema.get("maxItems", max(low, len(prefix)) + (3 if depth < 3 else 0))
        if items is False:
            high = min(high, len(prefix))
        n = rng.randint(low, max(low, high)) if depth < 4 else low
        return [instance(prefix[i] if i < len(prefix) else items, rng, root, depth + 1) for i in range(n)]
    if t == "string":
        low = schema.get("minLength", 0)
        return random_text(rng, rng.randint(low, schema.get("maxLength", low + 10)))
    if t in ("integer", "number"):
        return random_number(rng, t == "integer")
    if t == "boolean":
        return rng.choice([True, False])
    return None


# --- schemas ---------------------------------------------------------------------------------
class Address(BaseModel):
    street: str
    city: str
    zip: Optional[str] = None


class Person(BaseModel):
    name: str
    age: int
    height: float
    tags: list[str]
    address: Address
    previous: list[Address] = []
    nickname: Optional[str] = None
    scores: dict[str, int] = {}
    role: Literal["admin", "user"]
    active: bool


TREE = {
    "type": "object",
    "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#"}},
    },
    "required": ["value", "children"],
}

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "score": {"type": "number"},
            "ok": {"type": "boolean"},
            "note": {"type": "string"},
        },
        "required": ["id", "name"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {"a": {"type": "null"}, "b": {"type": "array", "items": {"type": "number"}}},
                "required": ["b"],
            },
            "rows": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"k": {"type": "string"}, "v": {"type": ["integer", "string"]}},
                    "required": ["k", "v"],
                },
            },
        },
        "required": ["meta", "rows"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", 1, None, {"a": [1, 2]}, "é\"q"]},
            "kind": {"const": "fixed"},
            "level": {"type": "integer", "enum": [1, 2, 12, "x"]},
        },
        "required": ["color", "kind", "level"],
    },
    "any_of_null": {
        "type": "object",
        "properties": {
            "v": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}, {"type": "integer"}]},
            "w": {"anyOf": [{"type": "number"}, {"type": "integer"}]},
        },
        "required": ["v", "w"],
    },
    "overlapping_objects": {
        "anyOf": [
            {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
            {"type": "object", "properties": {"a": {"type": "string"}, "c": {"type": "boolean"}}, "required": ["a"]},
        ]
    },
    "pydantic": Person.model_json_schema(),
    "tree": TREE,
    "map": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "prefix_items": {
        "type": "array",
        "prefixItems": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}],
        "items": False,
        "minItems": 2,
    },
    "prefix_then_items": {
        "type": "array",
        "prefixItems": [{"type": "null"}],
        "items": {"type": "string", "minLength": 1, "maxLength": 3},
        "minItems": 1,
        "maxItems": 5,
    },
    "lengths": {
        "type": "array",
        "items": {"type": "string", "minLength": 2, "maxLength": 4},
        "minItems": 1,
        "maxItems": 3,
    },
    "integer": {"type": "integer"},
    "number": {"type": "number"},
    "integer_or_null": {"type": ["integer", "null"]},
    "anything": {},
}


def feed_bytewise(grammar, data):
    """The state after each prefix of ``data`` (index i: after i bytes); None once refused."""
    states = [grammar.initial]
    for b in data:
        states.append(grammar.advance(states[-1], bytes([b])))
        if states[-1] is None:
            break
    return states


def valid_document(data, schema):
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError:
        return False
    return conforms(value, schema, schema)


def layouts(value):
    for ensure_ascii in (False, True):
        yield json.dumps(value, ensure_ascii=ensure_ascii, separators=(",", ":")).encode()
        yield json.dumps(value, ensure_ascii=ensure_ascii, indent=2).encode()
        yield json.dumps(value, ensure_ascii=ensure_ascii).encode()  # ", " and ": "


# --- documents --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_valid_documents_are_accepted_and_prefixes_only_where_valid(name):
    schema = SCHEMAS[name]
    grammar = json_schema_grammar(schema)
    rng = random.Random(name)
    for _ in range(25):
        value = instance(schema, rng, schema)
        assert conforms(value, schema, schema), value  # the generator itself
        # enum values are written one way only: compact, unescaped
        for data in [next(layouts(value))] if name == "enum" else layouts(value):
            states = feed_bytewise(grammar, data)
            assert len(states) == len(data) + 1 and grammar.accepts(states[-1]), data
            # the same states when the bytes come in random chunks
            state, pos = grammar.initial, 0
            while pos < len(data):
                end = pos + rng.randint(1, 7)
                state = grammar.advance(state, data[pos:end])
                pos = min(end, len(data))
                assert state == states[pos]
        compact = next(layouts(value))
        states = feed_bytewise(grammar, compact)
        for i in range(len(compact)):  # proper prefixes: complete only if a valid document by themselves
            assert grammar.accepts(states[i]) == valid_document(compact[:i], schema), compact[:i]


def test_pydantic_documents_validate_with_pydantic():
    schema = Person.model_json_schema()
    grammar = json_schema_grammar(json.dumps(schema))  # the JSON text form
    rng = random.Random(5)
    for _ in range(20):
        data = json.dumps(instance(schema, rng, schema)).encode()
        assert grammar.accepts(grammar.advance(grammar.initial, data))
        Person.model_validate_json(data)


def rejected(grammar, data):
    state = grammar.advance(grammar.initial, data.encode() if isinstance(data, str) else data)
    return state is None or not grammar.accepts(state)


def test_invalid_documents_are_rejected():
    flat = json_schema_grammar(SCHEMAS["flat"])
    assert not rejected(flat, '{"id":1,"name":"x"}')  # the baseline the cases below break
    for doc in [
        '{"id":"1","name":"x"}',  # wrong type
        '{"id":1.5,"name":"x"}',  # integer with a fraction
        '{"id":1e3,"name":"x"}',
        '{"name":"x"}',  # missing required key
        '{"id":1}',
        '{"id":1,"name":"x","extra":1}',  # extra key
        '{"name":"x","id":1}',  # keys out of order
        '{"id":1,"name":"x","note":"n","ok":true}',
        '{"id":01,"name":"x"}',  # bad numbers
        '{"id":-,"name":"x"}',
        '{"id":1,"name":"x","score":1.}',
        '{"id":1,"name":"x","score":1e}',
        '{"id":1,"name":"x","score":.5}',
        '{"id":1,"name":"x","score":+1}',
        '{"id":1,"name":"x","ok":tru}',
        '{"id":1,"name":"x',  # unterminated string
        '{"id":1,"name":"a\nb"}',  # control character in a string
        '{"id":1,"name":"a\\x"}',  # bad escape
        '{"id":1,"name":"\\u12G4"}',
        b'{"id":1,"name":"\xff"}',  # invalid UTF-8
        b'{"id":1,"name":"\xc3"}',
        b'{"id":1,"name":"\x80"}',
        b'{"id":1,"name":"\xe4\xb8"}',
        b'{"id":1,"name":"\xed\xa0\x80"}',  # a surrogate, UTF-8 encoded
        b'{"id":1,"name":"\xe0\x80\xaf"}',  # overlong
        b'{"id":1,"name":"\xc0\xaf"}',
        b'{"id":1,"name":"\xf4\x90\x80\x80"}',  # past U+10FFFF
        '{"id":1,"name":"x"} ',  # anything after the value
        '{"id":1,"name":"x"}\n',
        '{"id":1,"name":"x"}{}',
        '{"id":1,,"name":"x"}',
        '{"id":1,"name":"x",}',
        '{"id" 1,"name":"x"}',
        "{'id':1,'name':'x'}",
        '[{"id":1,"name":"x"}]',
    ]:
        assert rejected(flat, doc), doc
    lengths = json_schema_grammar(SCHEMAS["lengths"])
    assert not rejected(lengths, '["ab","abcd","\\u00e9\\ud83d\\ude00"]')
    for doc in ['[]', '["ab","ab","ab","ab"]', '["a"]', '["abcde"]', '["ab\\n\\t\\""]', '["😀😀😀😀😀"]',
                '["ab\\udc00\\udc00\\udc00"]']:  # lone low surrogates count
        assert rejected(lengths, doc), doc
    prefix = json_schema_grammar(SCHEMAS["prefix_items"])
    assert not rejected(prefix, '["a",1]') and not rejected(prefix, '["a",1,false]')
    for doc in ['["a"]', '["a",1,false,null]', '[1,"a"]', '["a",1,"b"]']:
        assert rejected(prefix, doc), doc
    enum = json_schema_grammar(SCHEMAS["enum"])
    assert not rejected(enum, '{"color":{"a":[1,2]},"kind":"fixed","level":12}')
    for doc in [
        '{"color":"blue","kind":"fixed","level":1}',
        '{"color":"red","kind":"other","level":1}',
        '{"color":"red","kind":"fixed","level":"x"}',  # in the enum, but not an integer
        '{"color":"red","kind":"fixed","level":3}',
        '{"color":"red","kind":"fixed","level":123}',
        '{"color":{"a":[1, 2]},"kind":"fixed","level":1}',  # enum values are written compact
    ]:
        assert rejected(enum, doc), doc
    integer = json_schema_grammar({"type": "integer"})
    for doc in ["1.0", "-0.5", "1e2", "", " ", "1 ", "1" * (MAX_NUMBER_BYTES + 1), "-" + "1" * MAX_NUMBER_BYTES]:
        assert rejected(integer, doc), doc
    assert not rejected(integer, "1" * MAX_NUMBER_BYTES) and not rejected(integer, "-" + "1" * (MAX_NUMBER_BYTES - 1))
    # the whitespace cap, per run
    any_value = json_schema_grammar({})
    assert not rejected(any_value, " " * MAX_WHITESPACE + "[1," + "\n" * MAX_WHITESPACE + "2]")
    assert rejected(any_value, " " * (MAX_WHITESPACE + 1) + "1")
    assert rejected(any_value, "[1," + "\t" * (MAX_WHITESPACE + 1) + "2]")
    assert rejected(any_value, '{"a"' + " " * (MAX_WHITESPACE + 1) + ':1}')


def test_number_length_cap_never_strands_a_number():
    number = json_schema_grammar({"type": "array", "items": {"type": "number"}})
    # one byte short of the cap: "-", ".", "e" and the exponent's sign would need a digit
    # that could not fit, so they are refused where they would leave a number unfinished
    body = "1" * (MAX_NUMBER_BYTES - 1)
    state = number.advance(number.initial, ("[" + body).encode())
    assert number.advance(state, b".") is None and number.advance(state, b"e") is None
    assert number.advance(state, b"5]") is not None and number.advance(state, b"55") is None
    state = number.advance(number.initial, ("[" + "1" * (MAX_NUMBER_BYTES - 2) + "e").encode())
    assert number.advance(state, b"-") is None and number.advance(state, b"1]") is not None
    state = number.advance(number.initial, ("[" + "1" * (MAX_NUMBER_BYTES - 3) + "e").encode())
    assert number.advance(state, b"-1]") is not None


def test_strings_that_reach_max_length_only_take_the_end_or_a_surrogate_pairs_low_half():
    g = json_schema_grammar({"type": "string", "maxLength": 2})
    full = g.advance(g.initial, b'"ab')
    for more in [b"c", b"\\n", b"\\u0041", b"\xc3\xa9", b"\\"]:
        assert g.advance(full, more) is None, more
    high = g.advance(g.initial, b'"a\\ud83d')
    assert g.accepts(g.advance(high, b'\\ude00"'))
    assert g.advance(high, b"\\n") is None and g.advance(high, b"\\u0041") is None
    # at the limit after a high surrogate, a backslash may only start its low half
    assert g.advance(high, b"\\") is not None and g.advance(high, b"\\ud8") is None


def test_states_are_canonical():
    g = json_schema_grammar(SCHEMAS["map"])
    a = g.advance(g.initial, b'{"k": [1, 2], "long key": [')
    b = g.advance(g.initial, b'{"": [')
    assert a == b and hash(a) == hash(b)
    s = json_schema_grammar({"type": "array", "items": {"type": "string"}})
    assert s.advance(s.initial, b'["abc') == s.advance(s.initial, b'["x", "y", "abc\\u00e9def')
    a = json_schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 2})
    assert a.advance(a.initial, b"[1,2,3,") == a.advance(a.initial, b"[1, 2, 3, 4, 5,")
    assert a.advance(a.initial, b"[1,") != a.advance(a.initial, b"[1,2,")  # one item short of minItems
    # ambiguity that resolves leaves one stack, not a set of one
    g = json_schema_grammar(SCHEMAS["overlapping_objects"])
    both = g.advance(g.initial, b'{"a": "x"')
    assert type(both) is frozenset and len(both) == 2
    one = g.advance(both, b', "b": 1')
    assert type(one) is tuple and one == g.advance(g.advance(g.initial, b'{"a": "x", "b"'), b": 1")


def test_json_object_grammar():
    g = json_object_grammar()
    rng = random.Random(3)
    for _ in range(60):
        value = {random_text(rng, rng.randint(0, 6)): random_any(rng, 1) for _ in range(rng.randint(0, 5))}
        for data in layouts(value):
            state = g.advance(g.initial, data)
            assert state is not None and g.accepts(state), data
    for doc in ["[]", '"x"', "1", "true", "null", " ", "{", '{"a"}', '{"a":}', "{1:2}"]:
        assert rejected(g, doc), doc


def test_choice_grammar():
    options = ["yes", "yes!", "no", "maybe so", "é😀"]
    g = choice_grammar(options)
    for option in options:
        data = option.encode()
        states = feed_bytewise(g, data)
        assert g.accepts(states[-1])
        for i in range(len(data)):
            assert states[i] is not None
            assert g.accepts(states[i]) == (data[:i] in {o.encode() for o in options}), data[:i]
    for other in ["", "y", "yes!!", "Yes", "no ", " no", "maybe", '"no"', "é"]:
        assert rejected(g, other), other


# --- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("keyword,value", [
    ("minimum", 0), ("maximum", 9), ("exclusiveMinimum", 0),
    ("exclusiveMaximum", 9), ("multipleOf", 2), ("patternProperties", {}), ("propertyNames", {}),
    ("minProperties", 1), ("maxProperties", 1), ("uniqueItems", True), ("contains", {}), ("minContains", 1),
    ("maxContains", 1), ("not", {}), ("if", {}), ("then", {}), ("else", {}), ("dependentRequired", {}),
    ("dependentSchemas", {}), ("unevaluatedProperties", False), ("unevaluatedItems", False), ("x-custom", 1),
])
def test_refused_keywords_name_the_keyword_and_where(keyword, value):
    schema = {"type": "object", "properties": {"zip": {"type": "string", keyword: value}}}
    with pytest.raises(InvalidRequestError) as info:
        json_schema_grammar(schema)
    assert info.value.param == "structured_outputs"
    message = str(info.value)
    assert f"'{keyword}' at #/properties/zip" in message and "supported keywords" in message


@pytest.mark.parametrize("schema,fragment", [
    (False, "false"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b'"),
    ({"type": "object", "required": ["b"]}, "'b'"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "'additionalProperties' at #"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}}, "'additionalProperties'"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "'allOf' at #"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "object", "properties": {"a\ud800": {}}}, "a lone surrogate (U+D800) at position 1"),
    # a nested schema resource: its own $refs would resolve against its $id
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}, "required": ["x"],
      "$defs": {"A": {"$id": "http://example.com/a", "$ref": "#/$defs/B", "$defs": {"B": {"type": "integer"}}},
                "B": {"type": "string"}}}, "'$id' at #/$defs/A"),
    ({"type": "string", "anyOf": [{"maxLength": 2}]}, "'anyOf' at #"),
    ({"type": "strin"}, "'type' at #"),
    ({"type": "string", "minItems": 1}, "'minItems' at #"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "'maxLength' at #"),
    ({"type": "array", "minItems": -1}, "'minItems' at #"),
    ({"type": "array", "items": [{}]}, "'items' at #"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2}, "'minItems' at #"),
    ({"properties": {"a": {"enum": ["x"], "type": "integer"}}}, "#/properties/a"),
    ({"properties": {"a": {"type": "integer", "const": 1, "enum": [2, 3]}}}, "#/properties/a"),
    ({"properties": {"a": False}}, "#/properties/a"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}}, "itself"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "no finite"),
    ("{not json", "not valid JSON"),
    (3, "int"),
])
def test_invalid_schemas_are_refused(schema, fragment):
    with pytest.raises(InvalidRequestError) as info:
        json_schema_grammar(schema)
    assert info.value.param == "structured_outputs"
    assert str(info.value).startswith("structured_outputs: ") and fragment in str(info.value)


def _nested(levels: int, wrap) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels - 1):
        schema = wrap(schema)
    return schema


@pytest.mark.parametrize("wrap", [lambda s: {"type": "array", "items": s},
                                  lambda s: {"type": "object", "properties": {"a": s}, "required": ["a"]},
                                  lambda s: {"anyOf": [s, {"type": "null"}]}])
def test_nesting_is_bounded_by_a_typed_error_not_the_stack(wrap):
    grammar = json_schema_grammar(_nested(100, wrap))  # 100 levels, the root's included, compile
    assert grammar is not None
    for levels in (101, 2000):
        with pytest.raises(InvalidRequestError, match="is nested more than 100 levels deep"):
            json_schema_grammar(_nested(levels, wrap))
    value: list = []
    for _ in range(5000):
        value = [value]
    with pytest.raises(InvalidRequestError, match="the value at #/enum/0 is nested too deeply"):
        json_schema_grammar({"enum": [value]})


@pytest.mark.parametrize("options", [[], [""], ["a", ""], "abc", [1], None])
def test_bad_choices_are_refused(options):
    with pytest.raises(InvalidRequestError) as info:
        choice_grammar(options)
    assert info.value.param == "structured_outputs"


def test_annotations_are_ignored_and_optional_unsatisfiable_branches_dropped():
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "T", "description": "d",
        "type": "object", "$defs": {"unused": {"pattern": "x"}},
        "properties": {
            "a": {"type": "string", "default": "x", "examples": ["y"], "deprecated": False, "readOnly": True},
            # a recursion with no end: can never be completed, so it may never start
            "loop": {"type": "object", "properties": {"again": {"$ref": "#/properties/loop"}}, "required": ["again"]},
        },
        "required": ["a"],
    }
    g = json_schema_grammar(schema)
    assert not rejected(g, '{"a":"x"}')
    assert g.advance(g.initial, b'{"a":"x","l') is None


# --- token level ------------------------------------------------------------------------------
TOKEN_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "short": {"type": "string", "maxLength": 10},
        "either": {"anyOf": [
            {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
            {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3}, "y": {"type": "null"}}},
        ]},
    },
    "required": ["name", "tags", "age", "short"],
}


def brute_force(grammar, token_bytes, state):
    return tuple(i for i, data in enumerate(token_bytes) if data and grammar.advance(state, data) is not None)


def token_walk(guide, token_bytes, rng, closers, max_tokens=400, stop_when=lambda state: False):
    """Random allowed tokens, more often ones that close strings/containers, until the
    output is complete and (for top-level numbers) the walk chooses to stop."""
    grammar = guide.grammar
    state, ids = grammar.initial, []
    while len(ids) < max_tokens:
        allowed = guide.allowed(state)
        if grammar.accepts(state) and (not allowed or rng.random() < 0.5 or stop_when(state)):
            return ids, state
        assert allowed, b"".join(token_bytes[i] for i in ids)  # never stuck before the end
        preferred = None
        if rng.random() < 0.6:
            allowed_set = set(allowed)
            for group in closers:
                preferred = [i for i in group if i in allowed_set]
                if preferred:
                    break
        token = rng.choice(preferred or allowed)
        ids.append(token)
        state = grammar.advance(state, token_bytes[token])
        assert state is not None
    raise AssertionError(f"no end after {max_tokens} tokens: {b''.join(token_bytes[i] for i in ids)!r}")


def test_allowed_equals_brute_force_on_smollm2(vocabulary, token_bytes, closers):
    grammar = json_schema_grammar(TOKEN_SCHEMA)
    guide = TokenGuide(grammar, vocabulary)
    prefixes = [
        b"",  # top level, whitespace allowed
        b'{"name": "Hel',  # inside a free string
        '{"name": "caf'.encode() + b"\xc3",  # in the middle of a two-byte character
        b'{"name": "x\\u00',  # in a \u escape
        b'{"name": "x", "ta',  # in a declared key
        b'{"name": "x", "tags": {"k',  # in a map key
        b'{"name": "x", "tags": {"k": ',  # after a colon
        b'{"name": "x", "tags": {}, "age": -1',  # inside a number
        b'{"name": "x", "tags": {}, "age": 1, "short": "abcdefgh',  # two characters from maxLength
        b'{"name": "x", "tags": {}, "age": 1, "short": "", "either": {"x": "ab',  # two alternatives
    ]
    states = [grammar.advance(grammar.initial, p) for p in prefixes]
    assert type(states[-1]) is frozenset  # the anyOf really is ambiguous there
    rng = random.Random(11)
    ids, _ = token_walk(guide, token_bytes, rng, closers)
    walked = [grammar.advance(grammar.initial, b"".join(token_bytes[i] for i in ids[:n])) for n in (3, len(ids) // 2)]
    for state in states + walked:
        assert state is not None
        allowed = guide.allowed(state)
        assert allowed == brute_force(grammar, token_bytes, state)
        assert guide.allowed(state) is allowed
    free_string = guide.allowed(states[1])
    assert len(free_string) > 40_000 and len(guide.allowed(states[4])) < 50
    choice = choice_grammar(["yes", "yes!", "no"])
    assert TokenGuide(choice, vocabulary).allowed(choice.initial) == brute_force(choice, token_bytes, choice.initial)


def test_the_memo_is_bounded_and_answers_stay_the_same(vocabulary, monkeypatch):
    """Past MEMO_IDS ids in all the memo starts again; what allowed() returns does not change."""
    import asyncgen.structured as structured

    grammar = json_schema_grammar({"type": "object", "properties": {"s": {"type": "string", "maxLength": 50}}})
    states = [grammar.advance(grammar.initial, b'{"s": "' + b"a" * n) for n in range(12)]
    first = [TokenGuide(grammar, vocabulary).allowed(st) for st in states]
    monkeypatch.setattr(structured, "MEMO_IDS", 3 * len(first[0]))
    guide = TokenGuide(grammar, vocabulary)
    for _ in range(2):
        assert [guide.allowed(st) for st in states] == first
        assert len(guide._memo) <= 3 and guide._memo_ids <= structured.MEMO_IDS


def test_special_and_empty_tokens_are_never_allowed():
    vocab = Vocabulary([b"a", None, b"", b'"', b"ab", b"\xc3", b"\xa9", b"a", b"a", b'"', b'"'])
    g = json_schema_grammar({"type": "string"})
    guide = TokenGuide(g, vocab)
    assert guide.allowed(g.initial) == (3, 9, 10)  # tokens with the same bytes all count
    inside = g.advance(g.initial, b'"')
    assert guide.allowed(inside) == (0, 3, 4, 5, 7, 8, 9, 10)
    assert guide.allowed(g.advance(inside, b"\xc3")) == (6,)


WALK_SCHEMAS = ["flat", "nested", "enum", "any_of_null", "overlapping_objects", "pydantic", "tree", "map",
                "prefix_then_items", "lengths"]


@pytest.mark.parametrize("name", WALK_SCHEMAS)
def test_token_walks_end_in_valid_documents(name, vocabulary, token_bytes, closers):
    schema = SCHEMAS[name]
    grammar = json_schema_grammar(schema)
    guide = TokenGuide(grammar, vocabulary)
    rng = random.Random(name)
    for _ in range(4):
        ids, state = token_walk(guide, token_bytes, rng, closers)
        assert guide.allowed(state) == ()  # a complete object or array: nothing may follow
        data = b"".join(token_bytes[i] for i in ids)
        value = json.loads(data.decode("utf-8"))
        assert conforms(value, schema, schema), data
        if name == "pydantic":
            Person.model_validate_json(data)


def test_token_walks_json_object_and_choice(vocabulary, token_bytes, closers):
    rng = random.Random(2)
    g = json_object_grammar()
    guide = TokenGuide(g, vocabulary)
    for _ in range(4):
        ids, _ = token_walk(guide, token_bytes, rng, closers)
        assert isinstance(json.loads(b"".join(token_bytes[i] for i in ids)), dict)
    options = ["yes", "yes!", "no", "maybe so"]
    g = choice_grammar(options)
    guide = TokenGuide(g, vocabulary)
    seen = set()
    for _ in range(30):
        ids, _ = token_walk(guide, token_bytes, rng, closers)
        text = b"".join(token_bytes[i] for i in ids).decode()
        assert text in options
        seen.add(text)
    assert len(seen) >= 3
    # a top-level number: the walk may stop at any complete number
    g = json_schema_grammar({"type": "number"})
    guide = TokenGuide(g, vocabulary)
    for _ in range(10):
        ids, _ = token_walk(guide, token_bytes, rng, closers)
        data = b"".join(token_bytes[i] for i in ids)
        assert isinstance(json.loads(data), (int, float)) and len(data.lstrip()) <= MAX_NUMBER_BYTES


def test_random_byte_walks_always_reach_an_end():
    """From every state reached, some completion exists: walks over random allowed bytes
    (biased toward closing bytes) always end, through escapes, length limits, UTF-8 and
    the number cap."""
    rng = random.Random(8)
    closing = b'"}]'
    for name in ["lengths", "prefix_then_items", "any_of_null", "enum", "tree", "integer", "number", "anything"]:
        grammar = json_schema_grammar(SCHEMAS[name])
        for _ in range(15):
            state, data = grammar.initial, b""
            while not (grammar.accepts(state) and rng.random() < 0.3):
                options = [b for b in range(256) if grammar.advance(state, bytes([b])) is not None]
                if not options:
                    break
                close = [b for b in options if b in closing]
                b = rng.choice(close if close and rng.random() < 0.3 else options)
                data += bytes([b])
                state = grammar.advance(state, bytes([b]))
                assert len(data) < 3000, (name, data)
            assert grammar.accepts(state), (name, data)
            value = json.loads(data.decode("utf-8"))
            assert conforms(value, SCHEMAS[name], SCHEMAS[name]), data


def trie_contents(trie, prefix=b""):
    """(id, bytes) of every token under ``trie``, reading every node."""
    found = []
    for b, ids, children in trie:
        data = prefix + bytes([b])
        found += [(i, data) for i in ids]
        if children:
            found += trie_contents(children, data)
    return found


def test_the_token_trie_holds_every_token_once():
    """Random byte strings (0x00 and 0xff among them, some equal, many prefixes of others)."""
    rng = random.Random(5)
    pool = [bytes(rng.choice([0, 1, 2, 0x7F, 0xFE, 0xFF]) for _ in range(rng.randint(1, 5))) for _ in range(60)]
    token_bytes = [rng.choice(pool + [None, b""]) for _ in range(400)] + [b"\xff" * 6, b"\x00", b"\xff"]
    vocab = Vocabulary(token_bytes)
    expected = sorted((i, data) for i, data in enumerate(token_bytes) if data)
    assert sorted(trie_contents(vocab.trie)) == expected
    bytes_at_root = [b for b, _, _ in vocab.trie]
    assert bytes_at_root == sorted(set(bytes_at_root))
    assert Vocabulary([None, b""]).trie == ()


def test_a_walk_builds_only_the_trie_nodes_it_reaches(vocabulary, token_bytes, monkeypatch):
    """A state that allows a few tokens builds a few of the 49,152-token trie's nodes; the
    answer is the brute-force one. The collector is paused while nodes are built."""
    import gc

    import asyncgen.structured as structured

    built, collector = [], []
    real_build = structured._TrieNode._build

    def build(node):
        built.append(node)
        collector.append(gc.isenabled())
        return real_build(node)

    monkeypatch.setattr(structured._TrieNode, "_build", build)
    fresh = Vocabulary(token_bytes)
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    state = grammar.advance(grammar.initial, b'{"n": ')
    guide = TokenGuide(grammar, fresh)
    assert guide.allowed(state) == brute_force(grammar, token_bytes, state)
    assert 0 < len(built) < 1000 and not any(collector) and gc.isenabled()  # of about 69,000
    before = len(built)
    guide.allowed(grammar.advance(grammar.initial, b'{"n": 1'))
    guide.allowed(state)  # memoized, and its nodes are built already
    assert len(built) - before < 1000


def test_walks_leave_the_collector_as_they_found_it(vocabulary):
    """The collector is paused while a walk builds trie nodes; it is on again afterwards,
    or stays off where the host had turned it off."""
    import gc

    grammar = json_schema_grammar({"type": "array", "items": {"type": "boolean"}})
    assert gc.isenabled()
    TokenGuide(grammar, Vocabulary(vocabulary.token_bytes)).allowed(grammar.initial)
    assert gc.isenabled()
    gc.disable()
    try:
        TokenGuide(grammar, Vocabulary(vocabulary.token_bytes)).allowed(grammar.initial)
        assert not gc.isenabled()
    finally:
        gc.enable()
