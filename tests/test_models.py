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
    # q/k/v and o biases; heads of 24 (not a power of two: the kernels' tiles are masked)
    "llama-biases-head-dim-24": dict(attention_bias=True, mlp_bias=True, head_dim=24),
    "mistral-sliding": dict(sliding_window=16),
    "qwen2": {},
    # The window only from layer 1 on (max_window_layers), as transformers reads it.
    "qwen2-sliding": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    # head_dim set apart from hidden_size / num_attention_heads, as Qwen3's configs do.
    "qwen3": dict(head_dim=32),
    "qwen3-attention-bias": dict(head_dim=32, attention_bias=True),
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


@pytest.mark.parametrize("differs", [True, False])
def test_a_tied_checkpoint_that_holds_its_own_lm_head(tmp_path, smollm2_path, differs):
    """tie_word_embeddings with an lm_head.weight in the checkpoint too: transformers ties
    them only if they are equal, and asyncgen reads it so (a second head only then)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path, "llama", smollm2_path, tie_word_embeddings=True)
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = torch.randn_like(embed) if differs else embed.clone()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert torch.equal(hf.lm_head.weight, weights["lm_head.weight"])  # the head transformers uses
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, get_ops("torch"), torch.float32, torch.device("cpu"))
    load_weights(model, path)
    assert (model.lm_head is not None) == differs
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
        got = forward_in_chunks(model, ids, [(0, 24)])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_qwen3_sliding(tmp_path_factory, smollm2_path):
    return save_tiny_model(tmp_path_factory.mktemp("qwen3-window"), "qwen3", smollm2_path, head_dim=32,
                           use_sliding_window=True, sliding_window=8, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny_llama_head_dim_24(tmp_path_factory, smollm2_path):
    return save_tiny_model(tmp_path_factory.mktemp("llama-hd24"), "llama", smollm2_path, head_dim=24,
                           attention_bias=True)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3_sliding", "tiny_llama_head_dim_24"])
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


# config.json files as they occur (written by older and newer transformers, by hand, by
# conversion scripts), each read by asyncgen and by transformers' config class of its
# architecture: the shapes, windows and rotary frequencies must agree.
_ROPE_8X = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CONFIG_READINGS = {
    "fields left out": ("LlamaForCausalLM", dict(num_key_value_heads=None, max_position_embeddings=None)),
    "null kv heads and head_dim": ("LlamaForCausalLM", dict(num_key_value_heads="null", head_dim="null")),
    # (32 heads: the default kv head counts, 8 and 32, must divide them)
    "Mistral, fields left out": ("MistralForCausalLM", dict(num_attention_heads=32, num_key_value_heads=None,
                                                            sliding_window=None, max_position_embeddings=None)),
    "Mistral, no window": ("MistralForCausalLM", dict(sliding_window="null")),
    "Qwen2, fields left out": ("Qwen2ForCausalLM", dict(num_attention_heads=32, num_key_value_heads=None,
                                                        max_position_embeddings=None, use_sliding_window=True,
                                                        sliding_window=None)),
    "Qwen3, fields left out": ("Qwen3ForCausalLM", dict(num_attention_heads=32, num_key_value_heads=None,
                                                        head_dim=None, max_position_embeddings=None)),
    "theta at the top": ("LlamaForCausalLM", dict(rope_theta=500000.0)),
    "theta in rope_parameters wins": ("LlamaForCausalLM", dict(rope_theta=10000.0, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0})),
    "theta in a legacy rope_scaling": ("LlamaForCausalLM", dict(rope_scaling={
        "type": "linear", "factor": 2.0, "rope_theta": 500000.0})),
    "rope_scaling stands for rope_parameters": ("LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama3 without its original length": ("LlamaForCausalLM", dict(max_position_embeddings=512,
                                                                     rope_parameters=dict(_ROPE_8X))),
    "llama3, original length at the top": ("LlamaForCausalLM", dict(
        original_max_position_embeddings=256,
        rope_parameters={**_ROPE_8X, "original_max_position_embeddings": 4096})),
    "llama3 in rope_parameters, theta at the top": ("LlamaForCausalLM", dict(
        rope_theta=500000.0, rope_parameters={**_ROPE_8X, "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("name", list(CONFIG_READINGS))
def test_config_reads_as_transformers_reads_it(name):
    import copy
    import importlib

    import transformers

    arch, changes = CONFIG_READINGS[name]
    raw = _raw_config(arch, max_position_embeddings=2048)
    for key, value in changes.items():  # None: the field left out; "null": set to null
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = None if value == "null" else value
    theirs = getattr(transformers, arch).config_class.from_dict(copy.deepcopy(raw))  # (it fills in nested dicts)
    ours = ModelConfig.from_dict(copy.deepcopy(raw))
    assert (ours.num_kv_heads, ours.head_dim, ours.max_position_embeddings) == (
        theirs.num_key_value_heads, getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads,
        theirs.max_position_embeddings)
    types = getattr(theirs, "layer_types", None)
    window = theirs.sliding_window if arch != "LlamaForCausalLM" else None
    expected = [window if types is None or types[i] == "sliding_attention" else None for i in range(ours.num_layers)]
    assert [ours.window(i) for i in range(ours.num_layers)] == expected
    prefix = arch.removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{prefix.lower()}.modeling_{prefix.lower()}")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(config=theirs)
    assert rotary.attention_scaling == 1.0
    torch.testing.assert_close(ours.inv_freq(), rotary.inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch, flag, biased", [
    ("LlamaForCausalLM", "attention_bias", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("LlamaForCausalLM", "mlp_bias", ("gate_proj", "up_proj", "down_proj")),
    ("Qwen3ForCausalLM", "attention_bias", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("Qwen2ForCausalLM", "attention_bias", ("q_proj", "k_proj", "v_proj")),  # q/k/v always, o never
    ("Qwen2ForCausalLM", "mlp_bias", ("q_proj", "k_proj", "v_proj")),
    ("MistralForCausalLM", "attention_bias", ()),
])
def test_biases_are_those_transformers_gives_the_architecture(arch, flag, biased):
    """A bias flag counts only where transformers' modeling code of the architecture reads
    it: the checkpoint it saves has exactly these bias tensors, and asyncgen expects them."""
    import transformers

    raw = _raw_config(arch, **{flag: True})
    hf = getattr(transformers, arch)(getattr(transformers, arch).config_class.from_dict(dict(raw)))
    names = {n.split(".")[-2] for n, _ in hf.named_parameters() if n.endswith(".bias")}
    assert names == set(biased)
    cfg = ModelConfig.from_dict(raw)
    ours = {"q_proj", "k_proj", "v_proj"} if cfg.attention_bias else set()
    ours |= {"o_proj"} if cfg.o_proj_bias else set()
    ours |= {"gate_proj", "up_proj", "down_proj"} if cfg.mlp_bias else set()
    assert ours == set(biased)


@pytest.mark.parametrize("fields, named", [
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}), "per layer type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_rope_and_activation_settings_computed_otherwise_are_refused(fields, named):
    from asyncgen.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_dict(_raw_config("LlamaForCausalLM", **fields))
