"""The model's shape, read once from a Hugging Face ``config.json`` and checked."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional

from ..errors import ModelNotFoundError, UnsupportedModelError

__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("silu", "swish")  # one function under two names, as transformers reads them
# What transformers' config class of each architecture assumes for a field config.json
# leaves out (not for one set to null: see from_dict).
_DEFAULTS = {
    "LlamaForCausalLM": dict(num_key_value_heads=None, head_dim=None, max_position_embeddings=2048),
    "MistralForCausalLM": dict(num_key_value_heads=8, head_dim=None, max_position_embeddings=4096 * 32,
                               sliding_window=4096),
    "Qwen2ForCausalLM": dict(num_key_value_heads=32, head_dim=None, max_position_embeddings=32768,
                             sliding_window=4096),
    "Qwen3ForCausalLM": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                             sliding_window=4096),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Biases, as each architecture's modeling code in transformers gives them: Llama and
    # Qwen3 on q/k/v and o with ``attention_bias`` (and Llama on the MLP with
    # ``mlp_bias``); Qwen2 on q/k/v always; Mistral nowhere.
    attention_bias: bool  # q, k and v
    mlp_bias: bool
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    sliding_window: Optional[int]
    torch_dtype: Optional[str]
    quantization: Optional[dict[str, Any]]
    # RMSNorm over each head's q and k before the rotary embedding (Qwen3).
    qk_norm: bool = False
    o_proj_bias: bool = False
    # The attention window of each layer (None: full attention); empty means every
    # layer has ``sliding_window``.
    layer_windows: tuple[Optional[int], ...] = ()

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of layer ``layer``, or None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelNotFoundError(f"{path} has no config.json; is it a Hugging Face model directory?")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(f"{cfg_path} is not valid JSON: {e}") from e
        # AutoGPTQ's and (older) AutoAWQ's own files: read when config.json has no
        # quantization_config; when it has one, they must agree, and fill in what it lacks.
        for name in ("quantize_config.json", "quant_config.json"):
            quant_path = path / name
            if not quant_path.is_file():
                continue
            try:
                side = json.loads(quant_path.read_text())
            except (OSError, ValueError) as e:
                raise ModelNotFoundError(f"{quant_path} is not valid JSON: {e}") from e
            if raw.get("quantization_config") is None:
                raw["quantization_config"] = side
            else:
                _check_same_quantization(raw["quantization_config"], side, name)
                if isinstance(side, dict) and isinstance(raw["quantization_config"], dict):
                    raw["quantization_config"] = {**side, **raw["quantization_config"]}
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise UnsupportedModelError(f"config.json must hold a JSON object, not {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, list):
            raise UnsupportedModelError(f"config.json's architectures must be a list of class names, got {archs!r}")
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        defaults = _DEFAULTS[arch]
        hidden = _number(raw, "hidden_size", int)
        num_heads = _number(raw, "num_attention_heads", int)
        # Null: derived from the heads (as transformers reads null); absent: the
        # architecture's default, where it has one other than that.
        derived = {"num_key_value_heads": num_heads, "head_dim": hidden // num_heads}
        num_kv_heads, head_dim = (
            _number(raw, key, int, nullable=True,
                    default=derived[key] if key in raw else defaults[key] or derived[key])
            for key in ("num_key_value_heads", "head_dim")
        )
        vocab_size = _number(raw, "vocab_size", int)
        intermediate = _number(raw, "intermediate_size", int)
        num_layers = _number(raw, "num_hidden_layers", int)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        # a sequence holds its prompt and at least one generated token
        max_positions = _number(raw, "max_position_embeddings", int, default=defaults["max_position_embeddings"],
                                least=2)
        rope_theta, rope_scaling = _rope_settings(raw, max_positions)
        sliding_window, layer_windows = _sliding_windows(raw, arch, num_layers)
        if raw.get("hidden_act", "silu") not in _ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu'")
        biased = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and _flag(raw, "attention_bias")
        quant = raw.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise UnsupportedModelError(f"quantization_config must be a JSON object, got {quant!r}")
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(raw, "rms_norm_eps", float, default=1e-6),
            max_position_embeddings=max_positions,
            tie_word_embeddings=_flag(raw, "tie_word_embeddings"),
            attention_bias=arch == "Qwen2ForCausalLM" or biased,
            mlp_bias=arch == "LlamaForCausalLM" and _flag(raw, "mlp_bias"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=quant,
            qk_norm=arch == "Qwen3ForCausalLM",
            o_proj_bias=biased,
            layer_windows=layer_windows,
        )

    def inv_freq(self):
        """RoPE inverse frequencies [head_dim // 2], fp32, with the config's scaling applied."""
        import torch

        base = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", "default")
        if kind == "linear":
            return base / float(scaling["factor"])
        if kind == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling.get("low_freq_factor", 1.0))
            high = float(scaling.get("high_freq_factor", 4.0))
            old_len = float(scaling["original_max_position_embeddings"])
            wavelen = 2 * math.pi / base
            scaled = torch.where(wavelen > old_len / low, base / factor, base)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            return torch.where(medium, smoothed, scaled)
        return base


_REQUIRED = object()


def _number(raw: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED, least: float = 0,
            prefix: str = "", nullable: bool = False) -> Any:
    """``raw[key]`` as a finite ``kind`` (int or float) above 0 and at least ``least``
    (4096.0 reads as the integer 4096, 4096.5 is refused); ``default`` where it is absent,
    or null for a ``nullable`` field (as transformers reads ``num_key_value_heads: null``).
    UnsupportedModelError naming the field (``prefix`` + ``key``) where it is required and
    missing, or not such a number."""
    name = prefix + key
    value = raw.get(key)
    if key not in raw or (value is None and nullable):
        if default is _REQUIRED:
            raise UnsupportedModelError(f"config.json lacks the required field {name!r}")
        return default
    what = "an integer" if kind is int else "a number"
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (kind is int and not float(value).is_integer())):
        raise UnsupportedModelError(f"config.json's {name} must be {what}, got {value!r}")
    value = kind(value)
    if value <= 0 or value < least:
        bound = f"at least {least:g}" if least > 0 else "positive"
        raise UnsupportedModelError(f"config.json's {name} must be {bound}, got {value!r}")
    return value


def _flag(raw: dict[str, Any], key: str) -> bool:
    """``raw[key]`` as a boolean, False where absent or null; UnsupportedModelError
    naming the field for anything but true or false (the string "false" included)."""
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UnsupportedModelError(f"config.json's {key} must be true or false, got {value!r}")
    return value


def _sliding_windows(raw: dict[str, Any], arch: str, num_layers: int) -> tuple[Optional[int], tuple]:
    """(window, per-layer windows) as transformers reads them: Llama never slides,
    Mistral in every layer; Qwen2/Qwen3 only with ``use_sliding_window``, in the layers
    ``layer_types`` marks "sliding_attention" or, without it, from ``max_window_layers`` on.
    A config without ``sliding_window`` gets the architecture's default (4,096 tokens);
    null means none."""
    window = raw.get("sliding_window", _DEFAULTS[arch].get("sliding_window"))
    if arch == "LlamaForCausalLM" or (arch in _QWEN and not raw.get("use_sliding_window", False)):
        window = None  # transformers' Llama has no window; Qwen's is off unless switched on
    if window is None or window == 0:
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"sliding_window must be a positive integer, got {window!r}")
    if arch not in _QWEN:
        return window, ()
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise UnsupportedModelError(f"max_window_layers must be a non-negative integer, got {first!r}")
        return window, tuple(window if i >= first else None for i in range(num_layers))
    kinds = {"full_attention": None, "sliding_attention": window}
    if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
        raise UnsupportedModelError(
            f"layer_types must list one of {sorted(kinds)} for each of the {num_layers} layers, got {types!r}"
        )
    return window, tuple(kinds[t] for t in types)


def _rope_settings(raw: dict[str, Any], max_positions: int) -> tuple[float, Optional[dict[str, Any]]]:
    """(theta, scaling) as transformers reads them from the older ``rope_theta`` and
    ``rope_scaling`` fields or the newer ``rope_parameters`` dict: ``rope_scaling``, when
    set, stands for ``rope_parameters``; the dict's own ``rope_theta`` wins over a
    top-level one; llama3's ``original_max_position_embeddings`` is a top-level field's,
    else the dict's, else ``max_position_embeddings``."""
    params = raw.get("rope_parameters") or None
    scaling = raw.get("rope_scaling") or None
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise UnsupportedModelError(f"config.json's {key} must be a JSON object, got {value!r}")
    source = "rope_scaling" if scaling is not None else "rope_parameters"
    rope = dict(scaling or params or {})
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested:
        raise UnsupportedModelError(f"{source} set per layer type ({', '.join(nested)}) is not supported")
    if "rope_theta" in rope:
        theta = _number(rope, "rope_theta", float, prefix=f"{source}.")
    else:
        theta = _number(raw, "rope_theta", float, 10000.0)
    fraction = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if fraction is not None and fraction != 1:
        raise UnsupportedModelError(f"partial_rotary_factor {fraction!r} is not supported; the rotary embedding "
                                    "covers every dimension of a head")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    rope["rope_type"] = kind
    # both divide frequencies by a factor; llama3's other fields have defaults
    _number(rope, "factor", float, prefix=f"{source}.")
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        _number(rope, key, float, default=None, prefix=f"{source}.", nullable=True)
    if kind == "llama3":
        if "original_max_position_embeddings" in raw:
            rope["original_max_position_embeddings"] = _number(raw, "original_max_position_embeddings", int)
        elif rope.get("original_max_position_embeddings") is None:
            rope["original_max_position_embeddings"] = max_positions
    return theta, rope


# The settings that decide how a quantized checkpoint's tensors read, under each name the
# tools write them.
_QUANT_SETTINGS = {
    "method": ("quant_method",),
    "bits": ("bits", "w_bit"),
    "group_size": ("group_size", "q_group_size"),
    "format": ("checkpoint_format", "format", "version"),
    "desc_act": ("desc_act",),
    "sym": ("sym",),
    "zero_point": ("zero_point",),
}


def _check_same_quantization(in_config: Any, side: Any, side_name: str) -> None:
    """UnsupportedModelError if config.json's quantization_config and a tool's own config
    file set one of the settings that decide the tensors' reading differently."""
    if not isinstance(in_config, dict) or not isinstance(side, dict):
        return  # the quantization config's own checks report a malformed one
    for setting, keys in _QUANT_SETTINGS.items():
        a = next((in_config[k] for k in keys if in_config.get(k) is not None), None)
        b = next((side[k] for k in keys if side.get(k) is not None), None)
        if a is not None and b is not None and str(a).lower() != str(b).lower():
            raise UnsupportedModelError(
                f"config.json's quantization_config and {side_name} disagree on {setting}: {a!r} against {b!r}"
            )
