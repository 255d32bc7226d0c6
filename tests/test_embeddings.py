"""Embeddings (engine.embed, /v1/embeddings): the final hidden state at the prompt's last
token equals transformers' on the same weights (SmolLM2 and a random Qwen3), alone, beside
generation requests, from the prefix cache and chunked; the OpenAI layer's forms."""

from __future__ import annotations

import base64

import anyio
import numpy as np
import pytest
import torch

from asyncgen import AsyncEngine, InvalidRequestError, SamplingParams
from conftest import assert_idle, save_tiny_model

TEXTS = [
    "The capital of France is Paris.",
    "Dogs are loyal animals that love their owners. " * 12,  # several KV blocks, chunked below
    "안녕하세요, 저는 학생입니다.",
]


def _hf_last_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


@pytest.fixture(scope="module")
def hf_base(smollm2_path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.mark.anyio
async def test_embeddings_equal_transformers_hidden_states(smollm2_path, hf_base):
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=96,
                                           max_num_batched_tokens=48) as engine:
        assert engine.hidden_size == 576
        want = {}
        for text in TEXTS:
            out = await engine.embed(text)
            raw = _hf_last_hidden(hf_base, list(out.prompt_token_ids))
            want[text] = raw
            assert out.prompt == text and out.usage.prompt_tokens == len(out.prompt_token_ids)
            assert torch.allclose(torch.tensor(out.embedding), raw / raw.norm(), atol=1e-5)
            unnormalized = await engine.embed(text, normalize=False)  # from the prefix cache now
            assert torch.allclose(torch.tensor(unnormalized.embedding), raw, atol=1e-4, rtol=1e-4)
            short = await engine.embed(text, dimensions=64)
            assert torch.allclose(torch.tensor(short.embedding), raw[:64] / raw[:64].norm(), atol=1e-5)
        # beside generation requests, all at once: each as alone
        got: dict = {}

        async def embed(text):
            got[text] = (await engine.embed(text)).embedding

        async def generate():
            out = await engine.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0))
            got["gen"] = out.token_ids

        alone = await engine.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0))
        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            for text in TEXTS:
                tg.start_soon(embed, text)
        assert got["gen"] == alone.token_ids
        assert engine.stats().num_generation_tokens == 48  # the two generations': an embedding outputs no token
        finals = []
        remove = engine.add_finish_listener(finals.append)
        await engine.embed(TEXTS[0])
        remove()
        assert [c.metrics.num_generation_tokens for c in finals] == [0]
        for text in TEXTS:
            assert torch.allclose(torch.tensor(got[text]), want[text] / want[text].norm(), atol=1e-5)
        # chat messages and truncation
        msgs = [{"role": "user", "content": "Hi there"}]
        chat = await engine.embed(messages=msgs)
        assert chat.prompt == engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        cut = await engine.embed(TEXTS[1], truncate_prompt_tokens=10)
        raw = _hf_last_hidden(hf_base, list(cut.prompt_token_ids))
        assert len(cut.prompt_token_ids) == 10 and torch.allclose(torch.tensor(cut.embedding), raw / raw.norm(),
                                                                  atol=1e-5)
        for bad in (0, 577, True, 2.5):
            with pytest.raises(InvalidRequestError, match="dimensions") as e:
                await engine.embed("Hi", dimensions=bad)
            assert e.value.param == "dimensions"
        with pytest.raises(InvalidRequestError, match="empty"):
            await engine.embed("")
        assert_idle(engine)


@pytest.mark.anyio
async def test_embedding_prompts_may_fill_max_model_len(smollm2_path, hf_base):
    """An embedding request's sampled token is never stored, so its prompt may hold all of
    ``max_model_len`` (generation needs one position more); ``truncate_prompt_tokens=-1``
    keeps that many. One token more is refused, naming both figures."""
    from asyncgen import PromptTooLongError

    text = TEXTS[1] * 2
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=64, num_kv_blocks=16,
                                           max_num_batched_tokens=24) as engine:
        ids = engine.tokenizer.encode(text)
        assert len(ids) > 65
        full = await engine.embed(ids[:64], normalize=False)
        raw = _hf_last_hidden(hf_base, ids[:64])
        assert torch.allclose(torch.tensor(full.embedding), raw, atol=1e-4, rtol=1e-4)
        cut = await engine.embed(text, truncate_prompt_tokens=-1)
        assert list(cut.prompt_token_ids) == ids[-64:]
        raw = _hf_last_hidden(hf_base, ids[-64:])
        assert torch.allclose(torch.tensor(cut.embedding), raw / raw.norm(), atol=1e-5)
        with pytest.raises(PromptTooLongError, match="65 tokens; max_model_len is 64"):
            await engine.embed(ids[:65])
        with pytest.raises(PromptTooLongError, match="leaves no room"):  # generation: 64 leaves none
            await engine.generate(ids[:64], SamplingParams(max_tokens=1))
        assert engine.stats().num_generation_tokens == 0
        assert_idle(engine)


@pytest.mark.anyio
async def test_embeddings_of_a_qwen3_model(tmp_path_factory, smollm2_path):
    from transformers import AutoModel

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-embed"), "qwen3", smollm2_path, head_dim=32)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    async with AsyncEngine.from_pretrained(path, num_kv_blocks=64) as engine:
        for text in TEXTS:
            out = await engine.embed(text)
            raw = _hf_last_hidden(hf, list(out.prompt_token_ids))
            assert torch.allclose(torch.tensor(out.embedding), raw / raw.norm(), atol=1e-5)


@pytest.mark.anyio
async def test_embeddings_follow_the_declared_pooling(tmp_path_factory, smollm2_path):
    """A sentence-transformers directory that declares last-token pooling is served; one
    that declares mean pooling is refused, naming it, and the engine serves on."""
    import json

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-st-pooling"), "llama", smollm2_path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (path / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": False for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                                                  "weightedmean_tokens", "lasttoken")}
    for mode, served in (("pooling_mode_lasttoken", True), ("pooling_mode_mean_tokens", False)):
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags,
                                                                     mode: True}))
        async with AsyncEngine.from_pretrained(path, num_kv_blocks=32) as engine:
            if served:
                assert len((await engine.embed("Hi")).embedding) == 64
            else:
                with pytest.raises(InvalidRequestError, match="'mean'"):
                    await engine.embed("Hi")
                out = await engine.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))
                assert out.finish_reason == "length"


@pytest.mark.anyio
async def test_embeddings_through_the_openai_layer(smollm2_path):
    from asyncgen.openai import BadRequestError

    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=96) as engine:
        client = engine.openai_client()
        ids = [engine.tokenizer.encode(text) for text in TEXTS]
        for inputs in (TEXTS, ids, ids[2]):
            resp = await client.embeddings.create(model=client.model, input=inputs)
            inputs = [inputs] if isinstance(inputs[0], int) else inputs
            assert resp.object == "list" and [d.index for d in resp.data] == list(range(len(inputs)))
            for d, x in zip(resp.data, inputs):
                assert d.object == "embedding"  # (batched with the others: equal to fp32 rounding)
                assert d.embedding == pytest.approx(list((await engine.embed(x)).embedding), abs=1e-5)
            tokens = sum(len(engine.tokenizer.encode(x)) if isinstance(x, str) else len(x) for x in inputs)
            assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
        packed = await client.embeddings.create(model=client.model, input=TEXTS[0], encoding_format="base64",
                                                dimensions=32)
        vector = np.frombuffer(base64.b64decode(packed.data[0].embedding), dtype="<f4")
        assert vector.tolist() == pytest.approx(list((await engine.embed(TEXTS[0], dimensions=32)).embedding), abs=1e-7)
        raw = await client.embeddings.create(model=client.model, input=TEXTS[0], extra_body={"normalize": False})
        assert raw.data[0].embedding == pytest.approx(list((await engine.embed(TEXTS[0], normalize=False)).embedding))
        for kwargs, param in (({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [10**7]}, "input"),
                              ({"input": "Hi", "dimensions": 4096}, "dimensions"),
                              ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
                              ({"input": "Hi", "extra_body": {"pooling": "mean"}}, "pooling")):
            with pytest.raises(BadRequestError) as e:
                await client.embeddings.create(model=client.model, **kwargs)
            assert e.value.param == param, kwargs
        assert_idle(engine)
