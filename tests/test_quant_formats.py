"""AWQ and GPTQ checkpoint loading, on small random-weight checkpoints packed here.

Each variant (AWQ group 64/128; GPTQ 4/8-bit, sym/asym, group -1/32/64/128, act-order
with equal and unequal groups, different ``g_idx`` per fused part, v1 and v2 zero points)
is written from known integer codes, zero points and scales, then loaded three ways:

- ``dense`` (the CPU path): the loaded weight must equal the weight computed from the
  codes, bit for bit in fp16;
- ``reference`` (packed, torch matmul): each layer's output must match ``dense``;
- through GPTQModel's own dequantization code (AWQ: its GEMM unpacker; GPTQ: its
  ``TorchLinear`` module, v1 zero points converted by its own converter; the ``test``
  extra installs it, see :func:`tool_python`): again bit for bit. Without gptqmodel
  these comparisons skip, except under CI, where they fail.

The packer is :func:`asyncgen.model.quantization.encode_awq` / ``encode_gptq``; the
tool's reading of the same files is what checks that it follows the formats.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncgen._ops import get_ops
from asyncgen.errors import UnsupportedModelError, WeightsError
from asyncgen.model.config import ModelConfig
from asyncgen.model.linear import LinearBase
from asyncgen.model.llama import LlamaForCausalLM
from asyncgen.model.loader import load_weights
from asyncgen.model.quantization import QuantConfig, encode_awq, encode_gptq, linear_method_factory

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 384, 4, 2, 64, 96, 2
PROJ = {  # checkpoint module -> (out, in)
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}

# name -> quantization_config, plus "g_idx": how act-order g_idx are drawn
VARIANTS = {
    "awq-g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "awq-g64": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "gptq-4b-g128-sym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    "gptq-4b-g128-asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False},
    "gptq-4b-channel": {"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True, "desc_act": False},
    "gptq-4b-g64-act-v2": {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False, "desc_act": True,
        "checkpoint_format": "gptq_v2",
    },
    "gptq-4b-g32-act-per-part": {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True, "g_idx": "per-part",
    },
    "gptq-4b-g64-act-unequal": {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": True, "g_idx": "unequal",
    },
    "gptq-8b-g128-sym": {"quant_method": "gptq", "bits": 8, "group_size": 128, "sym": True, "desc_act": False},
    "gptq-8b-g64-act-asym": {"quant_method": "gptq", "bits": 8, "group_size": 64, "sym": False, "desc_act": True},
}


# --- checkpoint writer ---------------------------------------------------------------------------
def _g_idx(k: int, group_size: int, kind: str, gen: torch.Generator, shared: dict) -> torch.Tensor:
    num_groups = -(-k // group_size)
    if kind == "unequal":  # any group for any row: groups of unequal size after sorting
        return torch.randint(0, num_groups, (k,), generator=gen, dtype=torch.int32)
    if kind == "shared" and k in shared:  # parts of one fused layer share their input's order
        return shared[k].clone()
    order = torch.randperm(k, generator=gen)  # act order: row order[j] is quantized j-th
    g = torch.empty(k, dtype=torch.int32)
    g[order] = (torch.arange(k) // group_size).to(torch.int32)
    shared[k] = g
    return g


def write_checkpoint(path: Path, qcfg: dict, seed: int = 0, config_file: str = "config.json", arch: str = "llama") -> dict:
    """A random quantized Llama (or, with ``arch="qwen3"``, Qwen3: q/k norms) checkpoint in
    ``path``; returns {module: (codes, zeros, scales, g_idx)}."""
    gen = torch.Generator().manual_seed(seed)
    qcfg = dict(qcfg)
    g_kind = qcfg.pop("g_idx", "shared")
    method, bits, group = qcfg.get("quant_method", "gptq"), qcfg["bits"], qcfg["group_size"]
    v1 = method == "gptq" and qcfg.get("checkpoint_format", "gptq") == "gptq"
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen).half(),
        "model.norm.weight": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).half(),
        "lm_head.weight": (0.05 * torch.randn(VOCAB, HIDDEN, generator=gen)).half(),
    }
    truth = {}
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).half()
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).half()
        if arch == "qwen3":
            for norm in ("q_norm", "k_norm"):
                tensors[f"model.layers.{i}.self_attn.{norm}.weight"] = (1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).half()
        shared: dict = {}
        for proj, (n, k) in PROJ.items():
            name = f"model.layers.{i}.{proj}"
            size = group if group > 0 else k
            groups = -(-k // size)
            codes = torch.randint(0, 2**bits, (k, n), generator=gen)
            if method == "gptq" and qcfg.get("sym", True):
                zeros = torch.full((groups, n), 2 ** (bits - 1))
            else:  # asymmetric: every value, zero included (v1 stores it as 0xF with a borrow)
                zeros = torch.randint(0, 2**bits, (groups, n), generator=gen)
            scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.002).half()
            g_idx = None
            if method == "awq":
                qweight, qzeros = encode_awq(codes, zeros)
            else:
                kind = "shared" if not qcfg.get("desc_act") else ("per-layer" if g_kind == "per-part" else g_kind)
                if qcfg.get("desc_act"):
                    g_idx = _g_idx(k, size, kind, gen, shared)
                else:
                    g_idx = (torch.arange(k) // size).to(torch.int32)
                qweight, qzeros = encode_gptq(codes, zeros, bits, v1=v1)
                tensors[f"{name}.g_idx"] = g_idx.clone()
            tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"] = qweight, qzeros, scales
            truth[name] = (codes, zeros, scales, g_idx)
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    if arch == "qwen3":
        config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0)
    if config_file == "config.json":
        config["quantization_config"] = qcfg
    else:
        (path / config_file).write_text(json.dumps(qcfg))
    (path / "config.json").write_text(json.dumps(config))
    return truth


def expected_weight(codes, zeros, scales, g_idx, group_size) -> torch.Tensor:
    """[out, in] fp16 straight from the integer codes: the definition of the formats."""
    k = codes.shape[0]
    g = g_idx.long() if g_idx is not None else torch.arange(k) // (group_size if group_size > 0 else k)
    return ((codes.float() - zeros.float()[g]) * scales.float()[g]).half().t()


def load_model(path: Path, kernel: str = "dense", dtype=torch.float32) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, get_ops("torch"), dtype, torch.device("cpu"), linear_method_factory(cfg, kernel))
    load_weights(model, path)
    return model


def loaded_weights(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """{checkpoint module: dense [out, in] weight} split back out of the fused layers."""
    out = {}
    for i, layer in enumerate(model.layers):
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            for shard in lin.full_rows:
                start, size = lin.shard_rows(shard)
                out[lin.checkpoint_name(shard)] = lin.weight[start : start + size]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("quant-variants")
    return {name: (root / name, write_checkpoint(root / name, cfg, seed=i)) for i, (name, cfg) in enumerate(VARIANTS.items())}


# --- loading ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_weights_equal_the_codes(checkpoints, variant):
    path, truth = checkpoints[variant]
    group = VARIANTS[variant]["group_size"]
    weights = loaded_weights(load_model(path))
    assert set(weights) == set(truth)
    for name, (codes, zeros, scales, g_idx) in truth.items():
        want = expected_weight(codes, zeros, scales, g_idx, group)
        got = weights[name]
        assert got.dtype == torch.float32
        assert torch.equal(got.half(), want), name
        assert torch.equal(got, want.float()), name  # fp16 values, exactly representable


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_layers_match_dense(checkpoints, variant):
    """The packed layout (rows sorted by group, segments per g_idx) multiplies as the dense weight."""
    path, _ = checkpoints[variant]
    dense, packed = load_model(path, "dense"), load_model(path, "reference")
    gen = torch.Generator().manual_seed(1)
    for ld, lp in zip(dense.modules(), packed.modules()):
        if not isinstance(ld, LinearBase):
            continue
        assert lp.qweight.dtype == torch.int32 and not hasattr(lp, "weight")
        x = torch.randn(5, ld.in_features, generator=gen)
        torch.testing.assert_close(lp(x), ld(x), rtol=1e-5, atol=1e-4)
    layer = packed.layers[0]
    segments = layer.self_attn.qkv_proj.quant_segments
    if variant == "gptq-4b-g32-act-per-part":
        assert len(segments) == 3 and all(s.perm is not None for s in segments)
    elif variant == "gptq-4b-g64-act-unequal":
        assert segments[0].g_idx is not None
    elif VARIANTS[variant].get("desc_act"):
        assert len(segments) == 1 and segments[0].perm is not None and segments[0].g_idx is None
    else:
        assert len(segments) == 1 and segments[0].perm is None and segments[0].g_idx is None


def test_unquantized_layers_stay_fp16(checkpoints):
    path, _ = checkpoints["awq-g128"]
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg, get_ops("torch"), torch.float16, torch.device("cpu"), linear_method_factory(cfg, "reference"))
    load_weights(model, path)
    from safetensors.torch import load_file

    raw = load_file(str(path / "model.safetensors"))
    assert model.lm_head.dtype == torch.float16 and torch.equal(model.lm_head, raw["lm_head.weight"])
    assert torch.equal(model.embed_tokens.weight, raw["model.embed_tokens.weight"])
    assert model.layers[0].mlp.down_proj.qweight.dtype == torch.int32


@pytest.mark.parametrize("variant", ["awq-g128", "gptq-4b-g32-act-per-part"])
def test_quantized_qwen3_matches_transformers_on_its_dequantized_weights(tmp_path, variant):
    """A Qwen3 checkpoint in AWQ's or GPTQ's layout (q/k norms stay fp16): the logits of
    transformers' Qwen3 with the weights the formats define, for both kernels."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from conftest import forward_in_chunks

    path = tmp_path / variant
    truth = write_checkpoint(path, VARIANTS[variant], seed=5, arch="qwen3")
    state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
             if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for name, (codes, zeros, scales, g_idx) in truth.items():
        state[f"{name}.weight"] = expected_weight(codes, zeros, scales, g_idx, VARIANTS[variant]["group_size"]).float()
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    hf = Qwen3ForCausalLM(Qwen3Config(**config)).eval()
    hf.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids.unsqueeze(0)).logits[0]
        for kernel in ("dense", "reference"):
            got = forward_in_chunks(load_model(path, kernel), ids, [(0, 10), (10, 11), (11, 24)])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert want.abs().max() > 0.1


def test_modules_to_not_convert_and_dynamic_skip(tmp_path):
    """Parts the config leaves unquantized load as ordinary fp16 weights."""
    path = tmp_path / "mixed"
    write_checkpoint(path, VARIANTS["gptq-4b-g128-sym"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    for proj in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        name = f"model.layers.1.{proj}"
        for t in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[f"{name}.{t}"]
        tensors[f"{name}.weight"] = torch.randn(*PROJ[proj], generator=gen).half()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    for key, value in (("dynamic", {r"-:model\.layers\.1\.mlp\..*": {}}), ("modules_to_not_convert", ["layers.1.mlp"])):
        qcfg = dict(config["quantization_config"])
        qcfg[key] = value
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
        model = load_model(path)
        mlp = model.layers[1].mlp
        assert torch.equal(mlp.down_proj.weight, tensors["model.layers.1.mlp.down_proj.weight"].float())
        assert torch.equal(mlp.gate_up_proj.weight[:INTER], tensors["model.layers.1.mlp.gate_proj.weight"].float())
        assert not hasattr(mlp.down_proj.method, "scheme")
        assert hasattr(model.layers[0].mlp.down_proj.method, "scheme")


def test_modules_in_block_to_quantize(tmp_path):
    """transformers' list of the quantized modules of a block: the others load as fp16."""
    path = tmp_path / "in-block"
    write_checkpoint(path, VARIANTS["gptq-4b-g128-sym"])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.down_proj"
        for t in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[f"{name}.{t}"]
        tensors[f"{name}.weight"] = torch.randn(*PROJ["mlp.down_proj"], generator=gen).half()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"]]
    config["quantization_config"]["modules_in_block_to_quantize"] = blocks
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path)
    for layer in range(2):
        mlp = model.layers[layer].mlp
        assert torch.equal(mlp.down_proj.weight, tensors[f"model.layers.{layer}.mlp.down_proj.weight"].float())
        assert hasattr(mlp.gate_up_proj.method, "scheme") and not hasattr(mlp.down_proj.method, "scheme")


def test_tool_config_files_must_agree_with_config_json(tmp_path):
    """AutoGPTQ's quantize_config.json and AutoAWQ's quant_config.json next to a
    quantization_config: the same settings load, different ones are refused by name."""
    path = tmp_path / "both"
    write_checkpoint(path, VARIANTS["gptq-4b-g128-asym"])
    config = json.loads((path / "config.json").read_text())
    qcfg = config["quantization_config"]
    (path / "quantize_config.json").write_text(json.dumps({**qcfg, "checkpoint_format": "gptq", "damp_percent": 0.1}))
    merged = ModelConfig.from_dir(path).quantization  # what config.json lacks comes from the tool's file
    assert (merged["bits"], merged["checkpoint_format"], merged["damp_percent"]) == (4, "gptq", 0.1)
    config["quantization_config"] = {**qcfg, "checkpoint_format": "gptq"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "quantize_config.json").write_text(json.dumps({**qcfg, "checkpoint_format": "gptq_v2"}))
    with pytest.raises(UnsupportedModelError, match="quantize_config.json disagree on format"):
        ModelConfig.from_dir(path)
    (path / "quantize_config.json").unlink()
    (path / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 64}))
    with pytest.raises(UnsupportedModelError, match="quant_config.json disagree on group_size"):
        ModelConfig.from_dir(path)


def test_autoawq_quant_config_json(tmp_path):
    """Older AutoAWQ writes its settings only to quant_config.json."""
    path = tmp_path / "autoawq"
    qcfg = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    truth = write_checkpoint(path, VARIANTS["awq-g128"], config_file="quant_config.json")
    (path / "quant_config.json").write_text(json.dumps(qcfg))  # AutoAWQ's names, no quant_method
    assert ModelConfig.from_dir(path).quantization == qcfg
    weights = loaded_weights(load_model(path))
    codes, zeros, scales, g_idx = truth["model.layers.0.mlp.up_proj"]
    assert torch.equal(weights["model.layers.0.mlp.up_proj"].half(), expected_weight(codes, zeros, scales, g_idx, 128))


def test_a_tensor_after_its_layer_was_assembled_is_named(tmp_path):
    path = _corrupt(tmp_path, "gptq-4b-g128-sym", "model.layers.0.mlp.up_proj.qweight", lambda t: t)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(*PROJ["mlp.up_proj"]).half()
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight' arrived after"):
        load_model(path)


def test_quantize_config_json(tmp_path):
    """AutoGPTQ's separate quantize_config.json (no quant_method in it) is read."""
    path = tmp_path / "autogptq"
    qcfg = {k: v for k, v in VARIANTS["gptq-4b-g128-asym"].items() if k != "quant_method"}
    truth = write_checkpoint(path, qcfg, config_file="quantize_config.json")
    cfg = ModelConfig.from_dir(path)
    assert cfg.quantization["bits"] == 4
    weights = loaded_weights(load_model(path))
    codes, zeros, scales, g_idx = truth["model.layers.0.mlp.up_proj"]
    assert torch.equal(weights["model.layers.0.mlp.up_proj"].half(), expected_weight(codes, zeros, scales, g_idx, 128))


# --- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "qcfg, words",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["bitsandbytes"]),
        ({"quant_method": "fp8"}, ["fp8"]),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["GPTQ", "3 bits"]),
        ({"quant_method": "gptq", "bits": 2, "group_size": 128}, ["2 bits"]),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, ["AWQ", "8 bits"]),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, ["gemv"]),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, ["exllama"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, ["marlin"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_p"}, ["gptq_p"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, ["int16"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, ["lm_head"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 0}, ["group_size 0"]),
        ({"quant_method": "gptq", "bits": 4.5, "group_size": 128}, ["bits", "4.5"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, ["Marlin"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2", "checkpoint_format": "gptq"},
         ["gptq_v2", "gptq'"]),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "checkpoint_format": "gemv"}, ["checkpoint_format", "gemv"]),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "backend": "llm-awq"}, ["llm-awq"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": [[".*", {}]]}, ["dynamic"]),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": "lm_head"},
         ["modules_to_not_convert"]),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "modules_in_block_to_quantize": ["mlp.up_proj"]},
         ["modules_in_block_to_quantize"]),
    ],
)
def test_unsupported_configs_are_named(qcfg, words):
    with pytest.raises(UnsupportedModelError) as info:
        QuantConfig.from_dict(qcfg)
    for w in words:
        assert w in str(info.value)


def test_fused_parts_quantized_differently(tmp_path):
    path = tmp_path / "mixed-fused"
    qcfg = {**VARIANTS["gptq-4b-g128-sym"], "dynamic": {r"model\.layers\.0\.self_attn\.k_proj": {"bits": 8}}}
    write_checkpoint(path, VARIANTS["gptq-4b-g128-sym"])
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    with pytest.raises(UnsupportedModelError, match="self_attn.qkv_proj"):
        load_model(path)


def _corrupt(tmp_path, variant, name, make):
    path = tmp_path / "bad"
    write_checkpoint(path, VARIANTS[variant])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = make(tensors[name])
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    "variant, name, make, words",
    [
        ("awq-g128", "model.layers.0.mlp.up_proj.qweight", lambda t: t[:, :-1].contiguous(), ["qweight", "shape"]),
        ("awq-g128", "model.layers.1.self_attn.k_proj.scales", lambda t: t[:1].contiguous(), ["k_proj.scales"]),
        ("awq-g64", "model.layers.0.mlp.down_proj.qzeros", lambda t: t[:-1].contiguous(), ["down_proj.qzeros"]),
        ("gptq-4b-g128-sym", "model.layers.0.self_attn.o_proj.qweight", lambda t: t.float(), ["o_proj.qweight", "dtype"]),
        ("gptq-4b-g128-sym", "model.layers.0.self_attn.q_proj.scales", lambda t: torch.cat([t, t]), ["q_proj.scales", "shape"]),
        ("gptq-8b-g128-sym", "model.layers.0.mlp.gate_proj.qweight", lambda t: t[: t.shape[0] // 2].contiguous(), ["gate_proj.qweight"]),
        ("gptq-4b-g64-act-v2", "model.layers.0.mlp.up_proj.g_idx", lambda t: t + 100, ["up_proj.g_idx", "group"]),
        ("gptq-4b-g64-act-v2", "model.layers.0.mlp.up_proj.g_idx", lambda t: t[:-1].contiguous(), ["up_proj.g_idx"]),
    ],
)
def test_mismatched_tensors_are_named(tmp_path, variant, name, make, words):
    path = _corrupt(tmp_path, variant, name, make)
    with pytest.raises(WeightsError) as info:
        load_model(path)
    for w in words:
        assert w in str(info.value)


def test_missing_g_idx_for_act_order(tmp_path):
    path = _corrupt(tmp_path, "gptq-4b-g64-act-v2", "model.layers.1.mlp.down_proj.g_idx", lambda t: t)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.g_idx"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightsError, match="down_proj.g_idx"):
        load_model(path)


# --- the reference tool's own dequantization -----------------------------------------------------------
# Runs under the interpreter that has gptqmodel; writes {module: [out, in] weight} per checkpoint.
TOOL_DEQUANT = r'''
import json, sys, os
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
import torch
from safetensors.torch import load_file, save_file
from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

def dequant_dir(src, dst):
    qcfg = json.load(open(os.path.join(src, "config.json"))).get("quantization_config")
    if qcfg is None:
        qcfg = json.load(open(os.path.join(src, "quantize_config.json")))
    method = (qcfg.get("quant_method") or "gptq").lower()
    bits = int(qcfg.get("bits", 4))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        prefix = key[: -len(".qweight")]
        qweight, qzeros, scales = (tensors[f"{prefix}.{t}"] for t in ("qweight", "qzeros", "scales"))
        if method == "awq":
            group = qweight.shape[0] // scales.shape[0]
            w = dequantize_gemm(qweight, qzeros, scales, bits, group)  # [in, out]
        else:
            g_idx = tensors[f"{prefix}.g_idx"]
            k, n = g_idx.shape[0], scales.shape[1]
            group = int(qcfg.get("group_size", 128))
            m = TorchLinear(bits=bits, group_size=group if group > 0 else k, sym=bool(qcfg.get("sym", True)),
                            desc_act=bool(qcfg.get("desc_act", False)), in_features=k, out_features=n,
                            bias=False, pack_dtype=torch.int32, register_buffers=True)
            m.qweight.copy_(qweight); m.qzeros.copy_(qzeros); m.scales.copy_(scales); m.g_idx.copy_(g_idx)
            if str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower() == "gptq":
                convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
            m.eval()
            w = m.dequantize_weight()  # [in, out]
        out[prefix] = w.t().contiguous()  # [out, in] in the dtype the tool computes in
    save_file(out, dst)

for src, dst in json.loads(sys.argv[1]):
    dequant_dir(src, dst)
print("OK")
'''


@functools.cache
def tool_python() -> str | None:
    """An interpreter that imports gptqmodel: ``$ASYNCGEN_GPTQMODEL_PYTHON``, else this one
    (the ``test`` extra pins gptqmodel), else ``~/.venvs/gptq/bin/python``; None when none does."""
    candidates = [os.environ.get("ASYNCGEN_GPTQMODEL_PYTHON"), sys.executable, str(Path.home() / ".venvs/gptq/bin/python")]
    for exe in candidates:
        if exe and Path(exe).exists():
            probe = subprocess.run([exe, "-c", "import gptqmodel"], capture_output=True, timeout=300)
            if probe.returncode == 0:
                return exe
    return None


def require_tool_python() -> str:
    """:func:`tool_python`, or a skip where gptqmodel is missing; under CI a failure, since
    the comparisons with the tool are the point of these tests."""
    exe = tool_python()
    if exe is None:
        reason = "gptqmodel is not installed (pip install -e '.[test]'; see docs/QUANTIZATION.md)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI runs the comparisons with the tool, it does not skip them", pytrace=False)
        pytest.skip(reason)
    return exe


def run_tool_dequant(jobs: list[tuple[Path, Path]]) -> None:
    exe = require_tool_python()
    env = {**os.environ, "GPTQMODEL_CPU_WORKERS": "2", "OMP_NUM_THREADS": "2"}
    arg = json.dumps([[str(src), str(dst)] for src, dst in jobs])
    res = subprocess.run([exe, "-c", TOOL_DEQUANT, arg], capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.fixture(scope="module")
def tool_weights(checkpoints, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("tool-dequant")
    jobs = [(path, out / f"{name}.safetensors") for name, (path, _) in checkpoints.items()]
    run_tool_dequant(jobs)
    from safetensors.torch import load_file

    return {name: load_file(str(out / f"{name}.safetensors")) for name in checkpoints}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weights_equal_the_tools_dequantization(checkpoints, tool_weights, variant):
    path, truth = checkpoints[variant]
    ours = loaded_weights(load_model(path))
    theirs = tool_weights[variant]
    assert set(theirs) == set(truth)
    for name, w in theirs.items():
        assert w.dtype == torch.float16
        assert torch.equal(ours[name].to(w.dtype), w), name
