"""Loads a Hugging Face safetensors checkpoint into a :class:`LlamaForCausalLM`.

Checkpoint names map onto the fused layers (``q_proj``/``k_proj``/``v_proj`` into
``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``); every tensor is checked
against the shape the config implies, and every expected tensor must be present.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Optional

import torch

from ..errors import WeightsError
from .linear import LinearBase, check_float, check_shape
from .llama import LlamaForCausalLM

__all__ = ["checkpoint_files", "load_weights"]

log = logging.getLogger(__name__)

_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(\w+)$")
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate_proj"),
    "up_proj": ("gate_up_proj", "up_proj"),
    "down_proj": ("down_proj", None),
}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.g_idx_sorted)$")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (sharded through the index file or one)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index: {type(e).__name__}: {e}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise WeightsError(f"{index} is not a valid safetensors index: its weight_map must map tensor names "
                               "to file names")
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    found = sorted(p.name for p in path.iterdir())
    raise WeightsError(f"{path} has no *.safetensors weights (found: {', '.join(found) or 'nothing'})")


def _iter_tensors(files: list[Path]):
    """(name, tensor) of every file's tensors; WeightsError for a name in two files (which
    copy would be meant is unknowable: a stray backup next to the shards, say)."""
    from safetensors import safe_open

    seen: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if name in seen:
                        raise WeightsError(f"tensor {name!r} is in both {seen[name]} and {f}; keep one copy")
                    seen[name] = f
                    yield name, sf.get_tensor(name)
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise WeightsError(f"cannot read {f}: {type(e).__name__}: {e}") from e


def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Copies every checkpoint tensor into ``model``; raises :class:`WeightsError` naming
    any missing, unexpected-for-this-config or mis-shaped tensor."""
    cfg = model.cfg
    files = checkpoint_files(path)
    simple: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        simple["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        simple[f"model.layers.{i}.input_layernorm.weight"] = layer.input_layernorm.weight
        simple[f"model.layers.{i}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        if layer.self_attn.q_norm is not None:
            simple[f"model.layers.{i}.self_attn.q_norm.weight"] = layer.self_attn.q_norm.weight
            simple[f"model.layers.{i}.self_attn.k_norm.weight"] = layer.self_attn.k_norm.weight
    loaded: set[str] = set()
    unexpected: list[str] = []
    own_head: Optional[torch.Tensor] = None  # a tied config's checkpoint that holds an lm_head too

    for name, tensor in _iter_tensors(files):
        if name in simple:
            param = simple[name]
            check_shape(name, tuple(param.shape), tuple(tensor.shape))
            check_float(name, tensor)
            param.data.copy_(tensor)
            loaded.add(name)
            continue
        m = _LINEAR.match(name)
        if m and int(m.group(1)) < cfg.num_layers and m.group(3) in _FUSED:
            idx, block, proj, tensor_name = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            fused, shard = _FUSED[proj]
            layer: LinearBase = getattr(getattr(model.layers[idx], block), fused)
            layer.load(tensor_name, tensor, shard)
            continue
        if name == "lm_head.weight" and model.lm_head is None:  # tied: the embedding serves, if it is the same
            check_shape(name, tuple(model.embed_tokens.weight.shape), tuple(tensor.shape))
            check_float(name, tensor)
            own_head = tensor
            continue
        if _IGNORED.search(name):
            continue
        unexpected.append(name)

    missing = [n for n in simple if n not in loaded]
    for i, layer in enumerate(model.layers):
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            for tensor_name, shard in lin.expected_tensors():
                if (tensor_name, shard) not in lin.loaded:
                    missing.append(f"{lin.checkpoint_name(shard)}.{tensor_name}")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"checkpoint in {path} lacks tensors: {', '.join(missing[:5])}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise WeightsError(
            f"checkpoint in {path} has tensors this {cfg.architecture} config does not use: "
            f"{', '.join(unexpected[:5])}{more}"
        )
    if own_head is not None:
        # transformers (5.x) ties only what is the same: a head that differs from the
        # embedding is the model's head, whatever tie_word_embeddings says.
        head = own_head.to(device=model.embed_tokens.weight.device, dtype=model.embed_tokens.weight.dtype)
        if not torch.equal(head, model.embed_tokens.weight):
            log.info("%s: lm_head.weight differs from the embedding it is declared tied to; it is used as the "
                     "output head, as transformers does", path)
            model.lm_head = torch.nn.Parameter(head, requires_grad=False)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.method.finalize(module)
