"""Tiny random-weight Llama, Mistral, Qwen2 and Qwen3 checkpoints saved by transformers: one
forward pass over the paged cache gives transformers' logits; the Triton backend (under
the interpreter on the CPU) generates what the torch reference generates."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from asyncgen import AsyncEngine, SamplingParams
from asyncgen._ops import get_ops
from asyncgen.model.config import ModelConfig
from asyncgen.model.llama import LlamaForCausalLM
from asyncgen.model.loader import load_weights

from conftest import forward_in_chunks, save_tiny_model

VARIANTS = {
    "llama": {},
    "llama-rope-llama3": dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "llama-rope-linear-tied": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True),
    "mistral-sliding": dict(sliding_window=16),
    "qwen2": {},
    # The window only from layer 1 on (max_window_layers), as transformers reads it.
    "qwen2-sliding": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    # head_dim set apart from hidden_size / num_attention_heads, as Qwen3's configs do.
    "qwen3": dict(head_dim=32),
    "qwen3-sliding-tied": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                               tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory, smollm2_path):
    name = request.param
    arch = name.split("-")[0]
    return save_tiny_model(tmp_path_factory.mktemp(name), arch, smollm2_path, **VARIANTS[name])


def test_logits_match_transformers(tiny: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    cfg = ModelConfig.from_dir(tiny)
    model = LlamaForCausalLM(cfg, get_ops("torch"), torch.float32, torch.device("cpu"))
    load_weights(model, tiny)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (40,))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
        got = forward_in_chunks(model, ids, [(0, 17), (17, 18), (18, 40)])
    assert ref.abs().max() > 1.0  # logits are not trivially flat
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_qwen3_sliding(tmp_path_factory, smollm2_path):
    return save_tiny_model(tmp_path_factory.mktemp("qwen3-window"), "qwen3", smollm2_path, head_dim=32,
                           use_sliding_window=True, sliding_window=8, max_window_layers=1)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3_sliding"])
async def test_triton_backend_generates_like_the_reference(model, request):
    path = request.getfixturevalue(model)
    prompts = ["Hello there", "A much longer prompt that will be chunked into pieces by the budget", "x"]

    async def run(backend):
        res = {}
        async with AsyncEngine.from_pretrained(
            path, ops_backend=backend, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16
        ) as engine:

            async def one(p):
                out = await engine.generate(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                res[p] = out.token_ids

            async with anyio.create_task_group() as tg:
                for p in prompts:
                    tg.start_soon(one, p)
        return res

    pytest.importorskip("triton")
    assert await run("triton") == await run("torch")


def _raw_config(arch: str, **fields) -> dict:
    raw = dict(architectures=[arch], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=100, intermediate_size=128, num_hidden_layers=4)
    raw.update(fields)
    return raw


@pytest.mark.parametrize(
    "arch, fields, windows",
    [
        # Qwen slides only when switched on, from max_window_layers on when layer_types is absent.
        ("Qwen2ForCausalLM", dict(sliding_window=32, max_window_layers=1), [None] * 4),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2),
         [None, None, 32, 32]),
        ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=32,
                                  layer_types=["sliding_attention", "full_attention"] * 2),
         [32, None, 32, None]),
        # Mistral slides in every layer; transformers' Llama ignores a window in its config.
        ("MistralForCausalLM", dict(sliding_window=32), [32] * 4),
        ("LlamaForCausalLM", dict(sliding_window=32), [None] * 4),
    ],
)
def test_sliding_window_per_layer(arch, fields, windows):
    cfg = ModelConfig.from_dict(_raw_config(arch, **fields))
    assert [cfg.window(i) for i in range(cfg.num_layers)] == windows


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
        (dict(layer_types=["chunked_attention"] * 4), "layer_types"),
        (dict(sliding_window=-4), "sliding_window"),
        (dict(max_window_layers="2"), "max_window_layers"),
    ],
)
def test_malformed_sliding_window_settings_are_refused(fields, named):
    from asyncgen.errors import UnsupportedModelError

    raw = _raw_config("Qwen3ForCausalLM", **{"use_sliding_window": True, "sliding_window": 32, **fields})
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_dict(raw)
