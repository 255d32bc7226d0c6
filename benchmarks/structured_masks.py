"""What one structured-output mask costs the first time a grammar state is met.

A mask (the tokens allowed after a state) is computed by walking a byte trie of the
vocabulary from the state, then memoized per grammar and state, so each distinct state
costs this once per engine. This times the first computation for the kinds of state
that differ most: inside a free string (plain tokens are allowed as a block), inside
strings with a ``pattern`` or ``format`` and in a regex output (plain tokens run through
the DFA's tables all at once, the others are walked), a schema's key and number
states, and a structural tag's free text (plain tokens through the trigger watch's
DFA; the others, and those holding a trigger's last byte, walked). "first mask" is what the model runner pays: the mask as a bool tensor over the
vocabulary, ready for the sampler; "ids" is :meth:`TokenGuide.allowed`'s sorted id list
for the same state (a fresh guide). Each repeat compiles the grammar afresh, so the DFA's
table is filled again; the plain tokens' byte columns are built once per vocabulary,
timed on their own. Grammar compile times are printed too, and what an engine's first
structured request pays: the vocabulary's bytes and tries, then the masks of a short
document's tokens, each state met for the first time. CPU only, no model weights:
the vocabulary is the tokenizer's.

    python benchmarks/structured_masks.py [--tokenizer DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from asyncgen.engine.tokenizer import TokenBytes, load_tokenizer
from asyncgen.structured import TokenGuide, Vocabulary, json_schema_grammar, regex_grammar, structural_tag_grammar
from asyncgen.tools import strict_tool_call_tag
from asyncgen.worker.guided import _SharedGuide


def _object(schema: dict) -> dict:
    return {"type": "object", "properties": {"s": schema}, "required": ["s"]}


# Strict calls of two functions in the hermes format (what tool_choice="auto" runs under).
_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}


def _calls():
    return structural_tag_grammar(strict_tool_call_tag("hermes", [
        {"name": "get_weather", "parameters": _WEATHER, "strict": True},
        {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}, "strict": True},
    ]))


CASES = [
    ("free string", lambda: json_schema_grammar(_object({"type": "string"})), b'{"s": "ab'),
    ("string, maxLength 16", lambda: json_schema_grammar(_object({"type": "string", "maxLength": 16})), b'{"s": "ab'),
    ("pattern ^[a-z ]+$", lambda: json_schema_grammar(_object({"type": "string", "pattern": "^[a-z ]+$"})), b'{"s": "ab'),
    ("pattern abc (search)", lambda: json_schema_grammar(_object({"type": "string", "pattern": "abc"})), b'{"s": "x'),
    ("format email", lambda: json_schema_grammar(_object({"type": "string", "format": "email"})), b'{"s": "ab'),
    ("format date-time", lambda: json_schema_grammar(_object({"type": "string", "format": "date-time"})),
     b'{"s": "2024-0'),
    ("format uri, maxLength 2083",
     lambda: json_schema_grammar(_object({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083})),
     b'{"s": "https://ex'),
    ("regex [A-Z][a-z]+ [0-9]{1,2}", lambda: regex_grammar("[A-Z][a-z]+ [0-9]{1,2}"), b"Ma"),
    ("object key", lambda: json_schema_grammar(_object({"type": "string"})), b"{"),
    ("number", lambda: json_schema_grammar(_object({"type": "integer"})), b'{"s": 1'),
    ("structural tag, free text", _calls, b"Sure, "),
    ("structural tag, in a trigger", _calls, b"Sure <tool_"),
    ("structural tag, a call's string", _calls, b'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
]

DOCUMENT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poet"], "ok": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=None, help="a model or tokenizer directory (default: SmolLM2)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.tokenizer is None:
        from asyncgen.fetch import smollm2

        args.tokenizer = smollm2()
    tokenizer, _ = load_tokenizer(Path(args.tokenizer))
    t0 = time.perf_counter()
    token_bytes = TokenBytes(tokenizer).vocabulary()
    t1 = time.perf_counter()
    vocabulary = Vocabulary(token_bytes)
    t2 = time.perf_counter()
    print(f"vocabulary: {len(token_bytes)} tokens, their bytes read in {(t1 - t0) * 1e3:.0f} ms, "
          f"the tries made in {(t2 - t1) * 1e3:.0f} ms")
    # What an engine's first structured request pays on the device thread: the vocabulary,
    # then the first visit of each state of a document (trie nodes are built as walks reach
    # them), on a vocabulary of its own.
    grammar = json_schema_grammar(DOCUMENT_SCHEMA)
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    t0 = time.perf_counter()
    shared = _SharedGuide(grammar, Vocabulary(token_bytes), len(token_bytes))
    t1 = time.perf_counter()
    state = grammar.initial
    for token_id in ids:
        mask, _ = shared.allowed_mask(state)
        assert mask[token_id], tokenizer.decode([token_id])
        state = grammar.advance(state, token_bytes[token_id])
    t2 = time.perf_counter()
    print(f"first request: tries {(t1 - t0) * 1e3:.0f} ms, then the masks of a {len(ids)}-token document "
          f"{(t2 - t1) * 1e3:.0f} ms")
    # The same for a first request with strict tool calls: text, then a call.
    grammar = _calls()
    reply = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    ids = tokenizer.encode(reply, add_special_tokens=False)
    t0 = time.perf_counter()
    shared = _SharedGuide(grammar, Vocabulary(token_bytes), len(token_bytes))
    t1 = time.perf_counter()
    state = grammar.initial
    times = []
    for token_id in ids:
        t = time.perf_counter()
        mask, _ = shared.allowed_mask(state)
        times.append(time.perf_counter() - t)
        assert mask[token_id], tokenizer.decode([token_id])
        state = grammar.advance(state, token_bytes[token_id])
    assert grammar.accepts(state)
    print(f"first request with strict tool calls: tries {(t1 - t0) * 1e3:.0f} ms, then the masks of a "
          f"{len(ids)}-token reply {sum(times) * 1e3:.0f} ms (its first, free text: {times[0] * 1e3:.0f} ms)")
    t0 = time.perf_counter()
    vocabulary.plain_columns()
    print(f"plain tokens' byte columns (once per vocabulary, at the first pattern or regex state): "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    print(f"{'state':32s} {'compile ms':>10s} {'first mask ms':>13s} {'ids ms':>7s} {'tokens':>7s}")
    for name, make, prefix in CASES:
        compiles, masks, lists = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            grammar = make()
            compiles.append(time.perf_counter() - t0)
            state = grammar.advance(grammar.initial, prefix)
            shared = _SharedGuide(grammar, vocabulary, len(vocabulary.token_bytes))
            t0 = time.perf_counter()
            shared.allowed_mask(state)
            masks.append(time.perf_counter() - t0)
            guide = TokenGuide(grammar, vocabulary)
            t0 = time.perf_counter()
            allowed = guide.allowed(state)
            lists.append(time.perf_counter() - t0)
        print(f"{name:32s} {statistics.median(compiles) * 1e3:10.1f} {statistics.median(masks) * 1e3:13.1f} "
              f"{statistics.median(lists) * 1e3:7.1f} {len(allowed):7d}")


if __name__ == "__main__":
    main()
