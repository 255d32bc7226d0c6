"""Structured outputs through the engine: the parameters, the sampler's mask, greedy
tokens against transformers constrained by a brute-force mask, sampled outputs that parse
and validate, preemption, and the OpenAI layer's response_format."""

from __future__ import annotations

import json
from typing import Literal, Optional

import anyio
import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from asyncgen import AsyncEngine, SamplingParams, StructuredOutputsParams
from asyncgen.engine.tokenizer import TokenBytes
from asyncgen.openai import BadRequestError
from asyncgen.worker.sampler import SamplingRow, sample

ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer"}},
    "required": ["answer", "confidence"],
}
QUESTION = [{"role": "user", "content": "Is the sky blue? Reply in JSON with an answer and a confidence."}]


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "bird"]
    age: int
    vaccinated: bool
    owner: Optional[str] = Field(default=None, max_length=12)


PET_MESSAGES = [{"role": "user", "content": "Describe a pet as JSON with name, kind, age and vaccinated."}]


# --- parameters ------------------------------------------------------------------------------------
def test_exactly_one_constraint_and_the_conflicting_fields():
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputsParams(json=ANSWER, choice=["a"])
    with pytest.raises(ValidationError, match="ignore_eos"):
        SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True), ignore_eos=True)
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(structured_outputs={"choice": ["a", "b"]}, min_tokens=2)
    p = SamplingParams(structured_outputs={"json": json.dumps(ANSWER)})  # JSON text is taken too
    assert p.structured_outputs.grammar is StructuredOutputsParams(json=ANSWER).grammar  # compiled once


def test_an_unsupported_schema_keyword_fails_at_construction_naming_it():
    schema = {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 10000}}}
    with pytest.raises(ValidationError) as e:
        SamplingParams(structured_outputs={"json": schema})
    assert "minimum" in str(e.value) and "#/properties/zip" in str(e.value)


# --- the sampler -------------------------------------------------------------------------------------
def test_sampler_keeps_to_the_mask_and_reports_the_models_logprobs():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(4, vocab) * 3
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 17, 41]] = True
    greedy = SamplingParams(temperature=0, logprobs=2)
    hot = SamplingParams(temperature=1.5, logprobs=2)
    rows = [
        SamplingRow(greedy, [1], [], frozenset(), None, allowed=allowed),
        SamplingRow(greedy, [1], [], frozenset(), None),
        SamplingRow(hot, [1], [], frozenset(), None, allowed=allowed),
        SamplingRow(hot, [1], [], frozenset(), torch.Generator().manual_seed(1), allowed=allowed[:45]),  # short
    ]
    before = logits.clone()
    for _ in range(20):
        tokens, lps = sample(logits.clone(), rows)
        assert tokens[0] == max([3, 17, 41], key=lambda t: before[0, t])
        assert tokens[1] == int(before[1].argmax())
        assert tokens[2] in (3, 17, 41) and tokens[3] in (3, 17, 41)
        for i in (0, 2):  # logprobs: the model's distribution, before the mask
            ref = before[i].log_softmax(-1)
            assert lps[i].logprob == pytest.approx(float(ref[tokens[i]]), abs=1e-5)
            assert [t for t, _ in lps[i].top] == ref.topk(2).indices.tolist()


# --- the runner's guides ----------------------------------------------------------------------------
def test_sequence_guide_masks_follow_the_tokens_back_and_forth(hf_smollm2, monkeypatch):
    """A sequence's masks equal brute force over the vocabulary after each output token,
    also when a preemption takes tokens back and with the caches emptied at every call."""
    import asyncgen.worker.guided as guided

    monkeypatch.setattr(guided, "_MASK_BYTES", 1)
    monkeypatch.setattr(guided, "_GRAMMARS_KEPT", 1)
    _, tok = hf_smollm2
    vocab_bytes = TokenBytes(tok).vocabulary()
    factory = guided.GuideFactory(lambda: vocab_bytes, width=len(vocab_bytes) + 8)  # padded logits
    spec = StructuredOutputsParams(json=ANSWER)
    seq = factory(spec, frozenset({2, 7}))
    factory(StructuredOutputsParams(choice=["a"]), frozenset({2}))  # evicts ANSWER's guide: seq keeps its own
    text = '{"answer": "no", "confidence": 7}'
    out = tok.encode(text)
    assert b"".join(vocab_bytes[t] for t in out) == text.encode()

    def brute(n):
        grammar, state = spec.grammar, spec.grammar.initial
        for t in out[:n]:
            state = grammar.advance(state, vocab_bytes[t])
        want = torch.zeros(len(vocab_bytes) + 8, dtype=torch.bool)
        want[_brute_force_allowed(grammar, vocab_bytes, state, 2)] = True
        if grammar.accepts(state):
            want[7] = True
        return want

    for n in [0, 1, 2, len(out) - 1, 3, len(out), 1, len(out)]:  # back and forth, as preemption does
        got = seq.mask(out, n)
        assert torch.equal(got, brute(n)), n
    assert seq.mask(out, len(out)).nonzero().flatten().tolist() == [2, 7]  # complete: only the stop tokens


# --- against transformers ------------------------------------------------------------------------------
def _brute_force_allowed(grammar, vocab_bytes, state, eos):
    ids = [i for i, b in enumerate(vocab_bytes) if b is not None and grammar.advance(state, b) is not None]
    return ids + ([eos] if grammar.accepts(state) else [])


@pytest.fixture(scope="module")
def hf_constrained(hf_smollm2):
    """transformers' greedy tokens for QUESTION under ANSWER, each step's allowed tokens
    found by trying every token of the vocabulary on the grammar."""
    model, tok = hf_smollm2
    grammar = StructuredOutputsParams(json=ANSWER).grammar
    vocab_bytes = TokenBytes(tok).vocabulary()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    state, out = grammar.initial, []
    with torch.no_grad():
        for _ in range(60):
            logits = model(ids).logits[0, -1]
            allowed = _brute_force_allowed(grammar, vocab_bytes, state, tok.eos_token_id)
            nxt = max(allowed, key=lambda t: float(logits[t]))
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
            state = grammar.advance(state, vocab_bytes[nxt])
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.mark.anyio
async def test_greedy_json_schema_equals_constrained_transformers(smollm2_path, hf_constrained):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": ANSWER})
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=128) as engine:
        out = await engine.generate(messages=QUESTION, params=params)
    assert list(out.token_ids) == hf_constrained
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert set(value) == {"answer", "confidence"} and value["answer"] in ("yes", "no")
    assert isinstance(value["confidence"], int)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_structured_requests_under_preemption_match_their_runs_alone(smollm2_path, hf_constrained):
    """Guided and unguided requests together in a pool too small for all of them: each
    guided one gets what it gets alone (greedy: the constrained transformers tokens;
    seeded sampling: its own tokens alone), and valid JSON."""
    pet = StructuredOutputsParams(json=Pet.model_json_schema())
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=200, structured_outputs=pet) for s in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": ANSWER})
    plain = SamplingParams(temperature=0, max_tokens=48)
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=256) as roomy:
        alone = [await roomy.generate(messages=PET_MESSAGES, params=p) for p in seeded]
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=24) as tight:
        results: dict[int, object] = {}

        async def run(i, params, messages):
            results[i] = await tight.generate(messages=messages, params=params)

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(seeded):
                tg.start_soon(run, i, p, PET_MESSAGES)
            tg.start_soon(run, 4, greedy, QUESTION)
            for i in range(5, 9):
                tg.start_soon(run, i, plain, [{"role": "user", "content": f"Count from {i} to {i + 30}."}])
        assert tight.stats().num_preemptions > 0
    for i, ref in enumerate(alone):
        assert list(results[i].token_ids) == list(ref.token_ids)
        assert ref.finish_reason == "stop"
        Pet.model_validate_json(ref.text)
    assert list(results[4].token_ids) == hf_constrained


@pytest.mark.anyio
async def test_sampled_outputs_parse_and_validate(smollm2_path):
    schema = Pet.model_json_schema()
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=256) as engine:
        out = await engine.generate(
            messages=PET_MESSAGES,
            params=SamplingParams(n=6, temperature=1.0, seed=7, max_tokens=300, structured_outputs={"json": schema},
                                  logit_bias={tok: 8.0 for tok in (16096, 17, 3726, 314, 44)}),  # " Sure! Here is<"
        )
        choice = await engine.generate(
            "Is water wet? Answer:",
            SamplingParams(n=8, temperature=1.2, seed=3, max_tokens=10,
                           structured_outputs={"choice": ["yes", "no", "not sure"]}),
        )
        obj = await engine.generate(
            messages=[{"role": "user", "content": 'Write the JSON object {"city": "Paris"}.'}],
            params=SamplingParams(temperature=0, max_tokens=300, structured_outputs={"json_object": True}),
        )
        stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        Pet.model_validate_json(c.text)
    assert len({c.text for c in out.outputs}) > 1
    assert all(c.text in ("yes", "no", "not sure") and c.finish_reason == "stop" for c in choice.outputs)
    assert obj.finish_reason == "stop" and json.loads(obj.text)["city"] == "Paris"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"], scope="module")
async def test_streamed_text_is_the_generated_json(smollm2_path):
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=200,
                            structured_outputs={"json": Pet.model_json_schema()})
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=128) as engine:
        pieces = [c.text async for c in engine.stream(messages=PET_MESSAGES, params=params)]
        whole = await engine.generate(messages=PET_MESSAGES, params=params)
    assert "".join(pieces) == whole.text
    Pet.model_validate_json(whole.text)


_EXIT_SCRIPT = """
import anyio, sys
from asyncgen import AsyncEngine, SamplingParams
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = %r

async def main():
    async with AsyncEngine.from_pretrained(sys.argv[1], max_model_len=1024, num_kv_blocks=64) as engine:
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs={"json": SCHEMA})
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: engine.generate(messages=MESSAGES, params=params))
    assert not engine._device._thread.is_alive()

anyio.run(main)
"""


def test_the_process_exits_cleanly_after_aclose(smollm2_path, tmp_path):
    """aclose() returns once the device thread has ended: a process that exited while the
    thread still unwound (here after two structured requests) aborted with SIGABRT."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_EXIT_SCRIPT % (Pet.model_json_schema(),))
    done = subprocess.run([sys.executable, str(script), str(smollm2_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


# --- the OpenAI layer ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def client(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=128) as engine:
        yield engine.openai_client()


@pytest.mark.anyio
async def test_openai_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}}
    r = await client.chat.completions.create(model=client.model, messages=PET_MESSAGES, response_format=fmt,
                                             temperature=0.5, seed=1, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    Pet.model_validate_json(r.choices[0].message.content)
    chunks = await client.chat.completions.create(model=client.model, messages=PET_MESSAGES, response_format=fmt,
                                                  temperature=0.5, seed=1, max_tokens=200, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert text == r.choices[0].message.content
    ask = [{"role": "user", "content": "Return a JSON object with keys a and b set to 1 and 2."}]
    r = await client.chat.completions.create(model=client.model, messages=ask, max_tokens=200,
                                             response_format={"type": "json_object"}, temperature=0)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = await client.completions.create(model=client.model, prompt="Is the sky blue? Answer:", max_tokens=5,
                                        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"choice": ["a"]}}},
         "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"choices": ["a"]}}}, "structured_outputs.choices"),
    ],
)
async def test_openai_structured_output_errors_name_the_field(client, fields, param):
    with pytest.raises(BadRequestError) as e:
        await client.chat.completions.create(model=client.model, messages=QUESTION, **fields)
    assert e.value.param == param, e.value.message
    r = await client.chat.completions.create(model=client.model, messages=QUESTION, max_tokens=3)
    assert r.choices[0].message.content  # the engine still serves
