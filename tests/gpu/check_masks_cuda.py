"""On a CUDA machine: the token masks that are not kernels, through the engine.

A checkpoint with random weights (``benchmarks/quant_decode.py``'s ``write_checkpoint``
makes one), fp16: 16 samples under the strict tool calls' structural tag (the tokens of
``<tool_call>`` pushed up with ``logit_bias``) each stay in the grammar, and those that
stopped are complete; ``bad_words`` keeps a word of the free output out of it;
``allowed_token_ids`` holding the free output's own tokens changes nothing, and five of
them keep a sampled output inside them. Exits non-zero on any failure.

    python tests/gpu/check_masks_cuda.py CHECKPOINT_DIR [DTYPE]
"""

from __future__ import annotations

import sys
import time

import anyio

from asyncgen import AsyncEngine, SamplingParams
from asyncgen.structured import structural_tag_grammar
from asyncgen.tools import strict_tool_call_tag

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TAG = strict_tool_call_tag("hermes", [{"name": "get_weather", "parameters": WEATHER, "strict": True}])


async def main(path: str, dtype: str) -> None:
    g = structural_tag_grammar(TAG)
    async with AsyncEngine.from_pretrained(path, dtype=dtype, max_model_len=1024) as engine:
        tok = engine.tokenizer
        bias = {t: 12.0 for t in tok.encode("<tool_call>", add_special_tokens=False)}
        t0 = time.perf_counter()
        outs = await engine.generate("Weather?", SamplingParams(
            n=16, max_tokens=96, temperature=1.0, seed=3, logit_bias=bias, structured_outputs={"structural_tag": TAG}))
        dt = time.perf_counter() - t0
        opened = sum("<tool_call>" in o.text for o in outs.outputs)
        for o in outs.outputs:
            state = g.advance(g.initial, o.text.encode())
            assert state is not None, o.text
            if o.finish_reason == "stop":
                assert g.accepts(state), o.text
        print(f"tag: 16 samples in {dt:.2f} s, {opened} opened a call, all in the grammar")
        free = await engine.generate("The sea is", SamplingParams(max_tokens=40, temperature=0))
        words = tok.decode(free.token_ids[5:9])
        banned = await engine.generate("The sea is", SamplingParams(max_tokens=40, temperature=0, bad_words=[words]))
        seq = tok.encode(words, add_special_tokens=False)
        ids = list(banned.token_ids)
        assert all(ids[i:i + len(seq)] != seq for i in range(len(ids)))
        allowed = sorted(set(free.token_ids))
        same = await engine.generate("The sea is", SamplingParams(
            max_tokens=40, temperature=0, allowed_token_ids=allowed + sorted(engine.eos_token_ids)))
        assert same.token_ids == free.token_ids, (same.token_ids, free.token_ids)
        few = await engine.generate("The sea is", SamplingParams(
            max_tokens=40, temperature=1.0, seed=1, allowed_token_ids=allowed[:5]))
        assert set(few.token_ids) <= set(allowed[:5])
        print("bad_words and allowed_token_ids: PASS")
    print("PASS")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float16")
