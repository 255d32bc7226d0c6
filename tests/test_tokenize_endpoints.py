"""vLLM's /tokenize and /detokenize through the OpenAI adapter, against the tokenizer and
the chat template as transformers applies them, and against what a request is given."""

from __future__ import annotations

import pytest

from asyncgen import AsyncEngine, SamplingParams
from asyncgen.openai import BadRequestError, OpenAIAdapter

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.mark.anyio
async def test_tokenize_and_detokenize(smollm2_path, hf_smollm2):
    _, tok = hf_smollm2
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=32) as engine:
        adapter = OpenAIAdapter(engine)
        r = await adapter.tokenize({"model": adapter.model_names[0], "prompt": "Hello world", "return_token_strs": True})
        assert r.tokens == tok("Hello world").input_ids and r.count == len(r.tokens) and r.max_model_len == 512
        assert r.token_strs == tok.convert_ids_to_tokens(r.tokens)
        chat = await adapter.tokenize({"messages": MESSAGES})
        text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        assert chat.tokens == tok(text, add_special_tokens=False).input_ids and chat.token_strs is None
        out = await engine.generate(messages=MESSAGES, params=SamplingParams(max_tokens=1))
        assert list(out.prompt_token_ids) == chat.tokens  # what a chat request is given
        closed = await adapter.tokenize({"messages": MESSAGES, "add_generation_prompt": False})
        assert closed.tokens == tok(tok.apply_chat_template(MESSAGES, tokenize=False), add_special_tokens=False).input_ids
        back = await adapter.detokenize({"tokens": chat.tokens})
        assert back.prompt == text
        for body, param in (({"prompt": "a", "messages": MESSAGES}, "prompt"), ({}, "prompt"),
                            ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
                            ({"prompt": "a", "model": "gpt-4o"}, "model"), ({"prompt": "a", "extra": 1}, "extra")):
            with pytest.raises(Exception) as e:
                await adapter.tokenize(body)
            assert e.value.param == param, body
        with pytest.raises(BadRequestError) as e:
            await adapter.detokenize({"tokens": [1, 10**7]})
        assert e.value.param == "tokens"
