"""AWQ and GPTQ checkpoints: their config, their tensors, and the linear method that runs them.

A checkpoint whose ``config.json`` has a ``quantization_config`` (or whose directory has
a ``quantize_config.json`` or ``quant_config.json``) gets :func:`linear_method_factory`;
every decoder linear layer then loads its packed tensors through
:class:`QuantLinearMethod`. Embeddings, norms and the LM head are never quantized by
these tools and load as usual.

The two formats, per checkpoint module with ``K`` input and ``N`` output features::

    AWQ (GEMM)  qweight [K, N // 8] int32   packed along N; within a word, field p holds
                                            column 8j + ORDER[p], ORDER = [0,2,4,6,1,3,5,7]
                qzeros  [G, N // 8] int32   same packing, zero points as stored
                scales  [G, N]      fp16    G = K / group_size (bf16 from GPTQModel run in bf16)
    GPTQ        qweight [K*bits/32, N] int32  packed along K, field i of word j = row j*pack + i
                qzeros  [G, ceil(N*bits/32)] int32  packed along N; checkpoint format v1
                                            ("gptq") stores zero - 1, v2 ("gptq_v2") the zero
                scales  [G, N]      fp16    G = ceil(K / group_size), 1 when group_size = -1
                g_idx   [K]         int32   group of each input row (act-order when desc_act)

    weight[n, k] = (code[k, n] - zero[g(k), n]) * scale[g(k), n]

Loading converts both into one layout (see :mod:`asyncgen._ops.quant_reference`):
codes packed along K, unpacked zero points, and for act-order checkpoints the input rows
sorted by group. How each layer then computes:

- ``"dense"`` (the CPU default): the weight is dequantized once, at load, into an
  ordinary ``[N, K]`` weight of the compute dtype; ``apply`` is ``F.linear``.
- ``"triton"`` (the CUDA default without the csrc extension): the weight stays packed
  (4 or 8 bits a weight) and the Triton kernels dequantize tiles in registers: a GEMV
  for a few rows (decode), a GEMM for prompt chunks and large batches.
- ``"cuda"`` (the CUDA default where the csrc extension is built): as ``"triton"``, but
  decode-sized inputs of 4-bit fp16 layers go to the csrc GEMV
  (:func:`asyncgen._ops.cuda_backend.quant_gemv_4bit`).
- ``"reference"``: packed, multiplied by the torch reference (tests).

Act-order (``desc_act``) checkpoints: the rows of each module's weight are permuted once
at load so that ``g_idx`` becomes sorted; when every group then spans ``group_size``
consecutive rows (always the case for tool-made checkpoints) the kernels read one scale
row per tile, and they gather the activation columns through the same permutation
(``x[:, perm]``, fused into the load of the activation tile). A ``g_idx`` that does not
sort into equal groups still works: the sorted per-row group indices go to the kernel.
Fused layers (q|k|v, gate|up) whose parts carry different ``g_idx`` are multiplied part
by part, each into its columns of one output.

GPTQ v1 zero points are converted by adding ``0x11111111`` (4-bit; ``0x01010101``
8-bit) to each packed 32-bit word, carries included: the exact inverse of how GPTQModel
writes v1 (subtracting the same constant from its v2 words), and the same as adding one
to each field on its own unless a field holds all ones (a zero point of 0, which v1 can
only store through that borrow). AWQ's ``zero_point`` flag is not trusted: GPTQModel
writes ``false`` for symmetric AWQ yet stores the zero points (all 8), so the stored
``qzeros`` are always used.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

import torch
from torch import nn

from .._ops import quant_reference as qref
from ..errors import UnsupportedModelError, WeightsError
from .linear import LinearBase, LinearMethod, check_shape

__all__ = ["QuantConfig", "QuantLinearMethod", "QuantScheme", "encode_awq", "encode_gptq", "linear_method_factory"]

METHODS = ("awq", "gptq")
KERNELS = ("auto", "cuda", "dense", "reference", "triton")
# At most this many rows go to the Triton GEMV kernel; more go to the GEMM.
GEMV_MAX_ROWS = 4
# With kernel "cuda": at most this many rows go to the csrc 4-bit kernels where they take the
# layer (4 bits, fp16, groups of consecutive rows; more than 8 rows on tensor cores only,
# see cuda_backend.quant_gemv_4bit_max_rows); the Triton kernels do the rest.
CUDA_GEMV_MAX_ROWS = 64
# The kernels a segment routes rows to (the csrc ones are cuda_backend.QUANT_KERNELS values),
# and the row counts at which choose_kernels times them (the decode CUDA graphs' sizes).
TRITON, CUDA_CORES, TENSOR_CORES = 0, 1, 2
# Route values from TILED on: the tiled csrc GEMM with launch shape
# cuda_backend.QUANT_GEMM_CONFIGS[value - TILED] (the mma.sync or the warpgroup kernel);
# choose_kernels times it from TILED_MIN_ROWS rows.
TILED = 16
TILED_MIN_ROWS = 8
ROUTE_ROWS = (1, 2, 4, 8, 16, 32, 48, 64)
# Where a route covers CUDA_GEMV_MAX_ROWS rows, choose_kernels times up to this many times
# as many rows in pieces through it against the Triton GEMM (_Segment.chunk_rows).
CHUNK_FACTOR = 2
# Prompt-sized row counts at which the Triton 4-bit GEMM is timed against
# dequantize-then-cuBLAS (QuantLinearMethod.choose_dequant_rows).
DEQUANT_ROWS = (64, 128, 256, 512, 1024)

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field p of an AWQ word holds column ORDER[p]
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> offset added to stored zeros
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# --- config ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How one module's weight was quantized."""

    method: str  # "awq" or "gptq"
    bits: int
    group_size: int  # rows per group; -1: one group over all input rows
    desc_act: bool  # GPTQ act-order: g_idx is required and may be any permutation of groups
    zero_offset: int  # added to every stored zero-point field (1 for GPTQ v1 checkpoints)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, validated once.

    ``skip``: module-name substrings left unquantized (AWQ's ``modules_to_not_convert``).
    ``dynamic``: GPTQModel's per-module rules, in order: (regex, None) leaves a matching
    module unquantized, (regex, scheme) quantizes it with ``scheme``; the first match wins.
    ``in_block``: the only decoder-layer modules that are quantized (names within a layer,
    such as ``mlp.up_proj``; transformers' ``modules_in_block_to_quantize``), or None.
    """

    scheme: QuantScheme
    skip: tuple[str, ...] = ()
    dynamic: tuple[tuple[re.Pattern, Optional[QuantScheme]], ...] = ()
    in_block: Optional[frozenset[str]] = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QuantConfig":
        if not isinstance(raw, dict):
            raise UnsupportedModelError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
        method = str(raw.get("quant_method") or raw.get("method") or _guess_method(raw)).lower()
        if method not in METHODS:
            raise UnsupportedModelError(
                f"quantization method {method!r} is not supported; supported: {', '.join(METHODS)}"
            )
        if raw.get("lm_head"):
            raise UnsupportedModelError("a quantized lm_head (quantization_config.lm_head = true) is not supported")
        pack_dtype = str(raw.get("pack_dtype", "int32")).replace("torch.", "")
        if pack_dtype != "int32":
            raise UnsupportedModelError(f"{method} pack_dtype {pack_dtype!r} is not supported; only 'int32'")
        if raw.get("is_marlin_format"):
            raise UnsupportedModelError("the GPTQ Marlin format (quantization_config.is_marlin_format) is not supported")
        scheme = _scheme(method, raw, raw)
        skip = _names(raw, "modules_to_not_convert")
        in_block = None
        if raw.get("modules_in_block_to_quantize") is not None:
            groups = raw["modules_in_block_to_quantize"]
            if not isinstance(groups, list) or not all(
                isinstance(g, list) and all(isinstance(m, str) for m in g) for g in groups
            ):
                raise UnsupportedModelError(
                    "quantization_config.modules_in_block_to_quantize must be a list of lists of module names"
                )
            in_block = frozenset(m for g in groups for m in g)
        rules = raw.get("dynamic") or {}
        if not isinstance(rules, dict) or not all(isinstance(v, dict) or v is None for v in rules.values()):
            raise UnsupportedModelError(
                "quantization_config.dynamic must be an object of pattern -> overrides (an object), "
                f"got {type(rules).__name__}"
            )
        dynamic = []
        for pattern, overrides in rules.items():
            negative = pattern.startswith("-:")
            regex = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
            try:
                compiled = re.compile(regex)
            except re.error as e:
                raise UnsupportedModelError(f"quantization_config.dynamic pattern {pattern!r} is invalid: {e}") from e
            dynamic.append((compiled, None if negative else _scheme(method, {**raw, **(overrides or {})}, raw)))
        return cls(scheme, skip, tuple(dynamic), in_block)

    def scheme_for(self, module: str) -> Optional[QuantScheme]:
        """The scheme of checkpoint module ``module`` (e.g. ``model.layers.0.mlp.up_proj``),
        or None when the checkpoint keeps it unquantized."""
        if any(s in module for s in self.skip):
            return None
        if self.in_block is not None:
            inner = _LAYER_PREFIX.sub("", module, count=1)
            if inner != module and inner not in self.in_block:
                return None
        for regex, scheme in self.dynamic:
            if regex.match(module):
                return scheme
        return self.scheme


_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")


def _names(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    """``raw[key]``, a list of module names (or null), as a tuple."""
    value = raw.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedModelError(f"quantization_config.{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _int_field(method: str, raw: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    """The first of ``names`` present in ``raw`` as an integer (``default`` if none is)."""
    name = next((n for n in names if raw.get(n) is not None), None)
    if name is None:
        return default
    value = raw[name]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UnsupportedModelError(f"{method} quantization_config.{name} must be an integer, got {raw[name]!r}")
    return value


def _guess_method(raw: dict[str, Any]) -> str:
    """AutoAWQ's and AutoGPTQ's own config files may lack ``quant_method``."""
    if "w_bit" in raw or "q_group_size" in raw:
        return "awq"
    if "bits" in raw:
        return "gptq"
    raise UnsupportedModelError("quantization_config has no quant_method")


def _scheme(method: str, raw: dict[str, Any], base: dict[str, Any]) -> QuantScheme:
    bits = _int_field(method, raw, ("bits", "w_bit"), 4)
    group_size = _int_field(method, raw, ("group_size", "q_group_size"), 128)
    if group_size == 0 or group_size < -1:
        raise UnsupportedModelError(f"{method} group_size {group_size} is not supported; use a positive size or -1")
    if method == "awq":
        if bits != 4:
            raise UnsupportedModelError(f"AWQ with {bits} bits is not supported; only 4-bit")
        for key in ("version", "format", "checkpoint_format"):
            value = str(raw.get(key) or "gemm").lower()
            if value != "gemm":
                raise UnsupportedModelError(f"AWQ {key} {value!r} is not supported; only 'gemm'")
        if str(raw.get("backend") or "").lower().replace("_", "-") == "llm-awq":
            raise UnsupportedModelError("AWQ backend 'llm-awq' (its own packing) is not supported; only GEMM packing")
        if group_size == -1:
            raise UnsupportedModelError("AWQ with group_size -1 is not supported")
        return QuantScheme("awq", 4, group_size, False, 0)
    if bits not in (4, 8):
        raise UnsupportedModelError(f"GPTQ with {bits} bits is not supported; supported: 4, 8")
    formats = {k: str(base[k]).lower() for k in ("format", "checkpoint_format") if base.get(k)}
    if len(set(formats.values())) > 1:
        raise UnsupportedModelError(
            f"GPTQ quantization_config names two checkpoint formats: format {formats['format']!r} and "
            f"checkpoint_format {formats['checkpoint_format']!r}"
        )
    fmt = next(iter(formats.values()), "gptq")
    if fmt not in _GPTQ_FORMATS:
        raise UnsupportedModelError(
            f"GPTQ checkpoint_format {fmt!r} is not supported; supported: {', '.join(_GPTQ_FORMATS)}"
        )
    return QuantScheme("gptq", bits, group_size, bool(raw.get("desc_act", False)), _GPTQ_FORMATS[fmt])


def linear_method_factory(model_cfg, kernel: str = "auto") -> Callable[[str], Optional[LinearMethod]]:
    """``prefix -> LinearMethod | None`` for the model's quantization config.

    ``kernel``: one of :data:`KERNELS`; "auto" is "cuda" on CUDA where the csrc extension
    is built, "triton" on CUDA without it, and "dense" elsewhere.
    Raises :class:`UnsupportedModelError` naming what the config asks for that is not
    implemented.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    cfg = QuantConfig.from_dict(model_cfg.quantization)

    def factory(prefix: str) -> Optional[LinearMethod]:
        head, _, last = prefix.rpartition(".")
        modules = [f"{head}.{p}" for p in _FUSED_PARTS[last]] if last in _FUSED_PARTS else [prefix]
        schemes = {m: cfg.scheme_for(m) for m in modules}
        if len(set(schemes.values())) > 1:
            detail = ", ".join(f"{m}: {s}" for m, s in schemes.items())
            raise UnsupportedModelError(f"the parts of fused layer {prefix} are quantized differently ({detail})")
        scheme = schemes[modules[0]]
        return None if scheme is None else QuantLinearMethod(scheme, kernel)

    return factory


# --- the linear method ------------------------------------------------------------------------
@dataclasses.dataclass
class _Segment:
    """Output columns [start, end) of a layer that share one input permutation."""

    start: int
    end: int
    perm: Optional[torch.Tensor]  # [K] int64: weight row k multiplies input column perm[k]
    g_idx: Optional[torch.Tensor]  # [K] int32 group of each (permuted) row; None: k // group_size
    # Kernel "cuda": which kernel takes x of m rows is route[m] (TRITON past its end), see
    # QuantLinearMethod.choose_kernels; its length - 1 is the most rows the csrc kernels
    # take with these columns (past 8: the tensor-core kernel takes them).
    route: tuple[int, ...] = ()
    # x of at least this many rows (0: never) is multiplied by the weight dequantized to a
    # dense buffer, through cuBLAS; see QuantLinearMethod.choose_dequant_rows.
    dequant_rows: int = 0
    # x of more rows than the route covers, up to this many (0: none), goes through the
    # route's kernels in pieces of at most len(route) - 1 rows; see choose_kernels.
    chunk_rows: int = 0
    # The tiled csrc GEMM's split workspace (cuda_backend.GemmScratch), one per model: set by
    # the model runner before choose_kernels; None uses the device's default one.
    gemm_scratch: Optional[Any] = None


@dataclasses.dataclass
class _Part:
    """One checkpoint module's tensors, converted as they arrive (this rank's slice)."""

    codes: Optional[torch.Tensor] = None  # [K, n] uint8, checkpoint row order
    zeros: Optional[torch.Tensor] = None  # [G, n] int16, the true zero points
    scales: Optional[torch.Tensor] = None  # [G, n]
    g_idx: Optional[torch.Tensor] = None  # [K] int64


class QuantLinearMethod(LinearMethod):
    """Loads one (possibly fused) layer's AWQ or GPTQ tensors and multiplies by them.

    Tensors are checked and converted as they arrive; once every part of the layer has
    its tensors, the layer is assembled (dense weight, or packed buffers ``qweight``
    [K/pack, N] int32, ``scales`` and ``zeros`` [G, N]) and the converted parts dropped.
    """

    def __init__(self, scheme: QuantScheme, kernel: str = "auto"):
        self.scheme = scheme
        self.kernel = kernel
        self.pack = 32 // scheme.bits

    def tensor_names(self) -> list[str]:
        names = ["qweight", "qzeros", "scales"]
        return [*names, "g_idx"] if self.scheme.desc_act else names

    # --- loading -----------------------------------------------------------------------------
    def create_weights(self, layer: LinearBase, dtype, device) -> None:
        device = torch.device(device)
        kernel = self.kernel
        if kernel == "auto":
            kernel = "dense"
            if device.type == "cuda":
                from .._ops import cuda_backend_available

                kernel = "cuda" if cuda_backend_available() else "triton"
        layer.quant_kernel = kernel
        layer.quant_dtype = dtype
        layer.quant_device = device
        layer.quant_parts = {shard: _Part() for shard in layer.full_rows}
        layer.quant_segments = []
        k = layer.checkpoint_cols()
        size = self.scheme.group_size if self.scheme.group_size > 0 else k
        layer.quant_group_size = size
        layer.quant_num_groups = -(-k // size)

    def load(self, layer: LinearBase, name: str, tensor: torch.Tensor, shard) -> None:
        parts = getattr(layer, "quant_parts", None)  # None once the layer is assembled
        part = None if parts is None else parts.get(shard)
        full = f"{layer.checkpoint_name(shard)}.{name}"
        if part is None:
            raise WeightsError(f"tensor {full!r} arrived after its layer was assembled")
        s = self.scheme
        k, n, groups = layer.checkpoint_cols(), layer.checkpoint_rows(shard), layer.quant_num_groups
        in_start, in_size = layer.shard_cols()
        t = tensor.to(layer.quant_device)
        if name == "qweight":
            _check_dtype(full, t, (torch.int32,))
            if s.method == "awq":
                _check_divisible(full, "output features", n, 8)
                check_shape(full, (k, n // 8), t.shape)
                codes = _unpack_awq(t)
            else:
                _check_divisible(full, "input features", k, self.pack)
                check_shape(full, (k // self.pack, n), t.shape)
                codes = qref.unpack_rows(t, s.bits)
            codes = layer.take_shard(codes[in_start : in_start + in_size], shard, dim=1)
            part.codes = codes.to(torch.uint8)
        elif name == "qzeros":
            _check_dtype(full, t, (torch.int32,))
            if s.method == "awq":
                _check_divisible(full, "output features", n, 8)
                check_shape(full, (groups, n // 8), t.shape)
                zeros = _unpack_awq(t)
            else:
                check_shape(full, (groups, -(-n // self.pack)), t.shape)
                if s.zero_offset:
                    t = _add_to_fields(t, s.zero_offset, s.bits)
                zeros = qref.unpack_cols(t, s.bits)[:, :n]
            part.zeros = layer.take_shard(zeros, shard, dim=1).to(torch.int16)
        elif name == "scales":
            _check_dtype(full, t, (torch.float16, torch.bfloat16, torch.float32))
            check_shape(full, (groups, n), t.shape)
            part.scales = layer.take_shard(t, shard, dim=1)
        elif name == "g_idx" and s.method == "gptq":
            _check_dtype(full, t, (torch.int32, torch.int64))
            check_shape(full, (k,), t.shape)
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= groups):
                raise WeightsError(
                    f"tensor {full!r} has group indices in [{int(t.min())}, {int(t.max())}], "
                    f"but group_size {s.group_size} gives {groups} groups for {k} input features"
                )
            part.g_idx = t[in_start : in_start + in_size].long()
        else:
            raise WeightsError(f"unexpected tensor {full!r} for a {s.method.upper()} linear layer")
        if self._complete(layer, need_g_idx=s.method == "gptq"):
            self._assemble(layer)

    def finalize(self, layer: LinearBase) -> None:
        if layer.quant_parts is not None and self._complete(layer, need_g_idx=False):
            self._assemble(layer)

    def _complete(self, layer, need_g_idx: bool) -> bool:
        return all(
            p.codes is not None and p.zeros is not None and p.scales is not None and (p.g_idx is not None or not need_g_idx)
            for p in layer.quant_parts.values()
        )

    def _assemble(self, layer: LinearBase) -> None:
        """Builds the layer's weight from its converted parts (see the class docstring)."""
        parts = list(layer.quant_parts.values())
        layer.quant_parts = None
        size, bits = layer.quant_group_size, self.scheme.bits
        k = parts[0].codes.shape[0]
        device = parts[0].codes.device
        in_start = layer.shard_cols()[0]
        plain = (in_start + torch.arange(k, device=device)) // size  # groups when there is no g_idx
        groups = [p.g_idx if p.g_idx is not None else plain for p in parts]
        if layer.quant_kernel == "dense":
            # [N, K]: each part dequantized with its own groups, rows in checkpoint order.
            pieces = []
            for p, g in zip(parts, groups):
                w = (p.codes.float() - p.zeros.float()[g]) * p.scales.float()[g]
                pieces.append(w.to(p.scales.dtype).to(layer.quant_dtype).t())
            layer.weight = nn.Parameter(torch.cat(pieces).contiguous(), requires_grad=False)
            return
        scales_dtype = parts[0].scales.dtype
        if any(p.scales.dtype != scales_dtype for p in parts):
            raise WeightsError(f"the parts of {layer.prefix} have scales of different dtypes")
        codes = torch.cat([p.codes for p in parts], dim=1)  # [K, N]
        # Consecutive parts with equal groups share a segment (one kernel launch).
        segments, start = [], 0
        for p, g in zip(parts, groups):
            end = start + p.codes.shape[1]
            if segments and torch.equal(segments[-1][2], g):
                segments[-1][1] = end
            else:
                segments.append([start, end, g])
            start = end
        trivial = torch.arange(k, device=device) // size
        layer.quant_segments = []
        for start, end, g in segments:
            perm = g_idx = None
            if not torch.equal(g, trivial):
                # Sort the rows by group; the kernel reads x[:, perm] against them.
                perm = torch.argsort(g, stable=True)
                codes[:, start:end] = codes[perm, start:end]
                g_sorted = g[perm]
                if not torch.equal(g_sorted, trivial):
                    g_idx = g_sorted.to(torch.int32)  # unequal groups: per-row indices
            layer.quant_segments.append(_Segment(start, end, perm, g_idx))
        layer.register_buffer("qweight", qref.pack_rows(codes, bits), persistent=False)  # [K/pack, N]
        layer.register_buffer("scales", torch.cat([p.scales for p in parts], dim=1).contiguous(), persistent=False)
        zeros = torch.cat([p.zeros for p in parts], dim=1).to(scales_dtype).contiguous()
        layer.register_buffer("zeros", zeros, persistent=False)  # [G, N]
        if layer.quant_kernel == "cuda":
            from .._ops import cuda_backend

            for seg in layer.quant_segments:
                weight, bias = self._columns(layer, seg)
                rows = min(cuda_backend.quant_gemv_4bit_max_rows(*weight, bits, size, seg.g_idx, bias),
                           CUDA_GEMV_MAX_ROWS)
                # Until timed: the tensor-core kernel where it applies, else the CUDA-core one.
                default = TENSOR_CORES if rows > cuda_backend.GEMV_MAX_ROWS else CUDA_CORES
                seg.route = (TRITON,) + (default,) * rows

    @staticmethod
    def _columns(layer: LinearBase, seg: _Segment) -> tuple[tuple[torch.Tensor, ...], Optional[torch.Tensor]]:
        """((qweight, scales, zeros), bias) of the segment's output columns."""
        if len(layer.quant_segments) == 1:
            return (layer.qweight, layer.scales, layer.zeros), layer.bias
        cols = slice(seg.start, seg.end)
        bias = layer.bias[cols] if layer.bias is not None else None
        return (layer.qweight[:, cols], layer.scales[:, cols], layer.zeros[:, cols]), bias

    # --- forward -------------------------------------------------------------------------------
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if layer.quant_kernel == "dense":
            return torch.nn.functional.linear(x, layer.weight, layer.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        m, n = x2.shape[0], layer.out_features
        if len(layer.quant_segments) == 1:
            seg = layer.quant_segments[0]
            out = self._matmul(layer, x2, layer.qweight, layer.scales, layer.zeros, seg, layer.bias, None)
            return out.view(*lead, n)
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        for seg in layer.quant_segments:
            (qweight, scales, zeros), bias = self._columns(layer, seg)
            self._matmul(layer, x2, qweight, scales, zeros, seg, bias, out[:, seg.start : seg.end])
        return out.view(*lead, n)

    def apply_gated(self, layer: LinearBase, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``silu(gate) * up`` of a gate|up layer from the csrc one-row 4-bit kernel, for one
        row where the model runner set ``quant_gated`` (after :meth:`gated_ok`: the layer is
        one segment without act order, routed to that kernel at one row, and takes its gated
        form); else None."""
        if not layer.quant_gated or x.numel() != x.shape[-1]:
            return None
        from .._ops import cuda_backend

        x2 = x.reshape(1, x.shape[-1])
        if not cuda_backend.gemv_input_ok(x2, torch.float16, layer.in_features, 1):
            return None
        y = cuda_backend.launch_quant_gemv_4bit(
            x2, layer.qweight, layer.scales, layer.zeros, layer.quant_group_size, None, layer.bias,
            kernel=CUDA_CORES, gated=True,
        )
        return y.view(*x.shape[:-1], layer.out_features // 2)

    def gated_ok(self, layer: LinearBase) -> bool:
        """Whether :meth:`apply_gated` may serve this gate|up layer at one row."""
        if layer.quant_kernel != "cuda" or len(layer.quant_segments) != 1:
            return False
        seg = layer.quant_segments[0]
        from .._ops import cuda_backend

        return (
            seg.perm is None and seg.g_idx is None and len(seg.route) > 1 and seg.route[1] == CUDA_CORES
            and cuda_backend.quant_gemv1_gated_ok(layer.qweight, layer.scales, layer.zeros, layer.quant_group_size)
        )

    def _matmul(self, layer, x, qweight, scales, zeros, seg: _Segment, bias, out):
        bits, size = self.scheme.bits, layer.quant_group_size
        if layer.quant_kernel == "reference":
            y = qref.quant_matmul(x, qweight, scales, zeros, bits, size, seg.g_idx, seg.perm, bias)
            if out is None:
                return y
            out.copy_(y)
            return out
        m = x.shape[0]
        if seg.dequant_rows and m >= seg.dequant_rows:
            from .._ops.triton_quant_gemm import dequant_matmul

            return dequant_matmul(x, qweight, scales, zeros, bits, size, seg.g_idx, seg.perm, bias, out=out)
        return self._quantized(x, qweight, scales, zeros, seg, bias, out, size)

    def _quantized(self, x, qweight, scales, zeros, seg: _Segment, bias, out, size):
        """``x @ W`` by the 4-bit kernels, without dequantizing: through the route where it
        covers x's rows (in pieces up to ``chunk_rows``), else the Triton kernels."""
        m = x.shape[0]
        if m < len(seg.route) or m <= seg.chunk_rows:
            from .._ops import cuda_backend

            rows = max(len(seg.route) - 1, seg.chunk_rows)
            if cuda_backend.gemv_input_ok(x, torch.float16, qweight.shape[0] * 8, rows):
                return self._chunked(x, qweight, scales, zeros, seg, bias, out, size)
        return self._triton(x, qweight, scales, zeros, seg, bias, out, size)

    def _chunked(self, x, qweight, scales, zeros, seg: _Segment, bias, out, size):
        """``x @ W`` through the route: in pieces of its most rows (one piece where it covers
        x's rows), each piece by its row count's kernel (x checked by the caller)."""
        step = len(seg.route) - 1
        if out is None:
            out = torch.empty(x.shape[0], qweight.shape[1], dtype=x.dtype, device=x.device)
        for start in range(0, x.shape[0], step):
            piece, piece_out = x[start : start + step], out[start : start + step]
            kernel = seg.route[piece.shape[0]]
            if kernel == TRITON:
                self._triton(piece, qweight, scales, zeros, seg, bias, piece_out, size)
            else:
                self._csrc(piece, qweight, scales, zeros, seg, bias, piece_out, size, kernel)
        return out

    @staticmethod
    def _csrc(x, qweight, scales, zeros, seg: _Segment, bias, out, size, kernel: int):
        """The csrc 4-bit kernel that route value ``kernel`` (not TRITON) names."""
        from .._ops import cuda_backend

        if kernel >= TILED:
            warps, splits, wgmma = cuda_backend.QUANT_GEMM_CONFIGS[kernel - TILED]
            return cuda_backend.launch_quant_gemm_4bit(
                x, qweight, scales, zeros, size, seg.perm, bias, out=out, warps=warps, splits=splits, wgmma=wgmma,
                scratch=seg.gemm_scratch,
            )
        return cuda_backend.launch_quant_gemv_4bit(x, qweight, scales, zeros, size, seg.perm, bias, out=out,
                                                   kernel=kernel)

    def _triton(self, x, qweight, scales, zeros, seg: _Segment, bias, out, size):
        if x.shape[0] <= GEMV_MAX_ROWS:
            from .._ops.triton_quant_gemv import quant_gemv as kernel
        else:
            from .._ops.triton_quant_gemm import quant_gemm as kernel
        return kernel(x, qweight, scales, zeros, self.scheme.bits, size, seg.g_idx, seg.perm, bias, out=out)

    @staticmethod
    def _segments_by_shape(layers, route_limit: bool = False) -> dict[tuple, list]:
        """The segments of ``layers`` grouped for the start-up timings (one CUDA graph runs
        through each group): by (K, N, group size, act order), and with ``route_limit``
        also by the most rows the csrc kernels take (segments they do not take left out).
        Each item is (method, segment, (qweight, scales, zeros), bias, group size)."""
        by_shape: dict[tuple, list] = {}
        for layer in layers:
            method = layer.method
            for seg in layer.quant_segments:
                if route_limit and len(seg.route) <= 1:
                    continue
                (qweight, scales, zeros), bias = method._columns(layer, seg)
                key = (qweight.shape[0] * method.pack, qweight.shape[1], layer.quant_group_size, seg.perm is not None)
                if route_limit:
                    key += (len(seg.route) - 1,)
                by_shape.setdefault(key, []).append((method, seg, (qweight, scales, zeros), bias, layer.quant_group_size))
        return by_shape

    @staticmethod
    def _timing_buffers(items, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A random x of ``m`` rows and an output wide enough for every item of one shape."""
        qweight, scales = items[0][2][:2]
        k = qweight.shape[0] * items[0][0].pack
        x = torch.randn(m, k, dtype=scales.dtype, device=qweight.device)
        out = torch.empty(m, max(it[2][0].shape[1] for it in items), dtype=scales.dtype, device=qweight.device)
        return x, out

    @staticmethod
    def _time_product(items, m: int, product) -> float:
        """Device time (ms a segment) of ``product(method, x, qweight, scales, zeros, seg,
        bias, out, size)`` (a method's signature, as ``QuantLinearMethod._triton``) for x of
        ``m`` rows, through one CUDA graph over the shape's segments ``items``."""
        from .._ops import cuda_backend

        x, out = QuantLinearMethod._timing_buffers(items, m)

        def call(item):
            method, seg, (qweight, scales, zeros), bias, size = item
            return product(method, x, qweight, scales, zeros, seg, bias, out[:, : qweight.shape[1]], size)

        return cuda_backend.graph_time_ms(call, items)

    @staticmethod
    def kernel_name(kernel: int) -> str:
        """A route value's kernel, as the start-up log names it."""
        if kernel >= TILED:
            from .._ops import cuda_backend

            warps, splits, wgmma = cuda_backend.QUANT_GEMM_CONFIGS[kernel - TILED]
            shape = f"-split{splits}" if splits > 1 else f"-balanced{-splits}" if splits < 0 else ""
            return f"csrc-{('tiled', 'wgmma', 'ws')[wgmma]}-{warps}w{shape}"
        return ("triton", "csrc-cuda-cores", "csrc-tensor-cores")[kernel]

    @staticmethod
    @torch.inference_mode()
    def choose_kernels(layers) -> dict[tuple, tuple[int, ...]]:
        """Times the kernels that can take each csrc-routed segment shape among ``layers``
        (kernel "cuda") at each row count of :data:`ROUTE_ROWS`: the Triton kernels, the
        csrc CUDA-core kernel (up to 8 rows), the csrc tensor-core kernel where it
        applies, and from :data:`TILED_MIN_ROWS` rows the tiled csrc GEMM in each launch
        shape of ``cuda_backend.QUANT_GEMM_CONFIGS`` the device runs, where it takes the weight. Each segment
        then routes the rows up to a timed count (and past the previous one) to that count's
        fastest kernel. Where the route reaches :data:`CUDA_GEMV_MAX_ROWS` rows on tensor
        cores, :data:`CHUNK_FACTOR` times as many rows are timed in pieces through the route
        against the Triton GEMM, and the segment's ``chunk_rows`` set to that count where the
        pieces won. Timings replay one CUDA graph through every segment of the shape, so
        weights come from memory as in a forward pass.
        Returns {(K, N, group size, act order): kernel per row count of ROUTE_ROWS}. Run
        before the model's CUDA graphs are captured; it changes which kernel computes, not
        what (to rounding)."""
        from .._ops import cuda_backend

        chosen = {}
        for key, items in QuantLinearMethod._segments_by_shape(layers, route_limit=True).items():
            max_rows = key[-1]
            tensor_cores = max_rows > cuda_backend.GEMV_MAX_ROWS
            tiled = tensor_cores and all(
                cuda_backend.quant_gemm_4bit_weight_ok(*item[2], item[4]) for item in items
            )
            device = items[0][2][0].device
            tiled_kernels = [TILED + i for i in cuda_backend.quant_gemm_config_indices(device)] if tiled else []

            def product(kernel):  # the kernel as _time_product takes a product
                if kernel == TRITON:
                    return QuantLinearMethod._triton
                return lambda method, x, qweight, scales, zeros, seg, bias, out, size: QuantLinearMethod._csrc(
                    x, qweight, scales, zeros, seg, bias, out, size, kernel)

            route, picks, done = [TRITON] * (CUDA_GEMV_MAX_ROWS + 1), [], 0
            for m in ROUTE_ROWS:
                if m > max_rows:
                    break
                candidates = [TRITON] + [CUDA_CORES] * (m <= cuda_backend.GEMV_MAX_ROWS) + [TENSOR_CORES] * tensor_cores
                if m >= TILED_MIN_ROWS:
                    candidates += tiled_kernels
                times = {c: QuantLinearMethod._time_product(items, m, product(c)) for c in candidates}
                best = min(times, key=times.get)
                route[done + 1 : m + 1] = [best] * (m - done)
                picks.append(best)
                done = m
            for _, seg, *_ in items:
                seg.route = tuple(route[: done + 1])
            if tensor_cores and done == CUDA_GEMV_MAX_ROWS:
                # Twice the route's rows: in two pieces through it, or the Triton GEMM.
                m = CHUNK_FACTOR * done
                timed = QuantLinearMethod._time_product
                chunked = timed(items, m, QuantLinearMethod._chunked) < timed(items, m, QuantLinearMethod._triton)
                for _, seg, *_ in items:
                    seg.chunk_rows = m if chunked else 0
            chosen[key[:-1]] = tuple(picks)
        return chosen

    @staticmethod
    @torch.inference_mode()
    def choose_dequant_rows(layers, rows=DEQUANT_ROWS) -> dict[tuple, int]:
        """Times, per weight shape among ``layers`` (kernel "triton" or "cuda" on a GPU),
        the 4-bit product the layer would otherwise run (``_quantized``: the Triton GEMM, or
        with kernel "cuda" after :meth:`choose_kernels` the csrc route or its pieces where
        they take the rows) against dequantize-then-cuBLAS at each count in ``rows``
        (prompt-sized), and sets each segment's ``dequant_rows`` to the smallest count from
        which dequantizing won at every larger count timed (0: it never won at the
        largest). Timed as ``choose_kernels`` times, through one CUDA graph over every
        segment of the shape. Returns {(K, N, group size, act order): dequant_rows}."""
        from .._ops.triton_quant_gemm import dequant_matmul

        def dequantized(method, x, qweight, scales, zeros, seg, bias, out, size):
            return dequant_matmul(x, qweight, scales, zeros, method.scheme.bits, size, seg.g_idx, seg.perm, bias,
                                  out=out)

        timed = QuantLinearMethod._time_product
        chosen = {}
        for key, items in QuantLinearMethod._segments_by_shape(layers).items():
            wins = []
            for m in rows:
                wins.append(timed(items, m, dequantized) < timed(items, m, QuantLinearMethod._quantized))
            start = 0
            for m, won in zip(reversed(rows), reversed(wins)):
                if not won:
                    break
                start = m
            for _, seg, *_ in items:
                seg.dequant_rows = start
            chosen[key] = start
        return chosen


# --- format helpers ------------------------------------------------------------------------------
def encode_awq(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [K, N/8], qzeros [G, N/8]) as AutoAWQ's GEMM format stores 4-bit ``codes``
    [K, N] and zero points ``zeros`` [G, N]; the inverse of what loading reads."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        rows, n = t.shape
        fields = t.reshape(rows, n // 8, 8)[:, :, list(_AWQ_ORDER)].reshape(rows, n)
        return qref.pack_cols(fields, 4)

    return pack(codes), pack(zeros)


def encode_gptq(codes: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight [K*bits/32, N], qzeros [G, N*bits/32]) as GPTQ stores ``codes`` [K, N] (rows
    in checkpoint order) and ``zeros`` [G, N]; ``v1``: the zero-minus-one convention,
    written by 32-bit word subtraction as GPTQModel does."""
    qzeros = qref.pack_cols(zeros, bits)
    if v1:
        qzeros = _add_to_fields(qzeros, -1, bits)
    return qref.pack_rows(codes, bits), qzeros


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N // 8] AWQ words -> [R, N] codes in column order."""
    fields = qref.unpack_cols(packed, 4)  # [R, N], field p of word j at column 8j + p
    rows, n = fields.shape
    codes = torch.empty_like(fields)
    order = torch.tensor(_AWQ_ORDER, device=packed.device)
    codes.view(rows, n // 8, 8)[:, :, order] = fields.view(rows, n // 8, 8)
    return codes


def _add_to_fields(words: torch.Tensor, offset: int, bits: int) -> torch.Tensor:
    """Adds ``offset`` to every field of each int32 word as one 32-bit addition (carries
    propagate to the next field; the top field wraps)."""
    step = sum(offset << (bits * i) for i in range(32 // bits))
    wide = (words.to(torch.int64) + step) & 0xFFFFFFFF
    return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise WeightsError(f"tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, expected {allowed}")


def _check_divisible(name: str, what: str, value: int, by: int) -> None:
    if value % by:
        raise WeightsError(f"tensor {name!r}: the layer's {what} ({value}) are not a multiple of {by}")
