"""Linear layers that know how to load their slice of a checkpoint.

Each layer is written for tensor parallelism (``tp_size`` > 1 splits the output dim of
column-parallel layers and the input dim of row-parallel ones) though the engine runs one
shard today. How a layer stores and applies its weight is a :class:`LinearMethod`, so a
quantized checkpoint swaps the method, not the model::

    QKVLinear          q_proj | k_proj | v_proj  -> one [q + 2 * kv, hidden] weight
    MergedLinear       gate_proj | up_proj       -> one [2 * intermediate, hidden] weight
    RowLinear          o_proj, down_proj         (input dim split across shards)
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import WeightsError

__all__ = ["LinearBase", "LinearMethod", "MergedLinear", "QKVLinear", "RowLinear", "UnquantizedLinearMethod"]


class LinearMethod:
    """How a linear layer holds its weight and multiplies by it.

    ``create_weights`` registers parameters on the layer (their checkpoint names, e.g.
    ``weight`` or ``qweight``/``scales``/``qzeros``); ``load`` copies one checkpoint
    tensor (or one shard of a fused layer) into them; ``apply`` computes ``x @ W.T + b``;
    ``finalize`` runs once after every tensor is loaded (repacking, reordering).
    """

    def create_weights(self, layer: "LinearBase", dtype: torch.dtype, device) -> None:
        raise NotImplementedError

    def load(self, layer: "LinearBase", name: str, tensor: torch.Tensor, shard: int | str | None) -> None:
        raise NotImplementedError

    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_gated(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gate|up layer from one kernel, or None where the method
        has none for ``x`` (the caller then applies ``silu_and_mul`` to ``apply``)."""
        return None

    def finalize(self, layer: "LinearBase") -> None:
        pass


def check_shape(full_name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
    if tuple(expected) != tuple(got):
        raise WeightsError(f"tensor {full_name!r} has shape {tuple(got)}, expected {tuple(expected)}")


# What an unquantized weight may be stored as (converted to the model's dtype on load).
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(full_name: str, tensor: torch.Tensor) -> None:
    """WeightsError unless ``tensor`` holds plain floating-point values: an integer, boolean
    or 8-bit float tensor copied as it is would give the model wrong weights silently."""
    if tensor.dtype not in WEIGHT_DTYPES:
        raise WeightsError(
            f"tensor {full_name!r} is {str(tensor.dtype).removeprefix('torch.')}; unquantized weights must be "
            "float16, bfloat16 or float32 (a quantized checkpoint names its method in config.json's "
            "quantization_config)"
        )


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, dtype, device):
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype, device=device), requires_grad=False
        )  # [out, in]

    def load(self, layer, name, tensor, shard):
        if name != "weight":
            raise WeightsError(f"unexpected tensor {layer.prefix}.{name} for an unquantized linear layer")
        out_start, out_size = layer.shard_rows(shard)
        in_start, in_size = layer.shard_cols()
        expected = (layer.checkpoint_rows(shard), layer.checkpoint_cols())
        check_shape(f"{layer.checkpoint_name(shard)}.weight", expected, tensor.shape)
        check_float(f"{layer.checkpoint_name(shard)}.weight", tensor)
        piece = layer.take_shard(tensor, shard)
        layer.weight.data[out_start : out_start + out_size].copy_(piece[:, in_start : in_start + in_size])

    def apply(self, layer, x):
        x2 = _gemv_input(layer, x)
        if x2 is not None:
            from .._ops import cuda_backend

            y = cuda_backend.launch_dense_gemv(x2, layer.weight, layer.bias, warps_per_row=layer.gemv_warps_per_row)
            return y.view(*x.shape[:-1], layer.out_features)
        route = layer.lt_routes.get(x.shape[0]) if layer.lt_routes else None
        if route is not None and route.takes(x):
            return route(x, layer.weight, layer.bias)
        return torch.nn.functional.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer, x):
        """``silu(gate) * up`` of a gate|up layer from one csrc GEMV, where the layer's
        ``gemv_gated`` is set and it takes ``x`` at this size; else None."""
        x2 = _gemv_input(layer, x) if layer.gemv_gated else None
        if x2 is None:
            return None
        from .._ops import cuda_backend

        y = cuda_backend.launch_dense_gemv(
            x2, layer.weight, layer.bias, warps_per_row=min(layer.gemv_warps_per_row, 4), gated=True
        )
        return y.view(*x.shape[:-1], layer.out_features // 2)


def _gemv_input(layer, x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as [rows, in_features] where the csrc dense GEMV takes it: at most
    ``layer.gemv_rows`` rows (> 0 only where choose_dense_gemv checked the weight) that
    fit its input checks; else None."""
    rows = layer.gemv_rows
    if not (rows and x.dim() >= 1 and x.numel() <= rows * x.shape[-1]):
        return None
    from .._ops import cuda_backend

    x2 = x.reshape(-1, x.shape[-1])
    return x2 if cuda_backend.gemv_input_ok(x2, layer.weight.dtype, layer.in_features) else None


class LinearBase(nn.Module):
    """``y = x @ W.T + b`` with ``W`` of shape [out_features, in_features] on this shard.

    ``shards`` maps a shard id to (start row, rows) of the fused output for fused
    layers; a plain layer has the single shard ``None``.
    """

    def __init__(
        self,
        prefix: str,
        in_features: int,
        shard_sizes: dict,
        bias: bool,
        dtype: torch.dtype,
        device,
        method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_input: bool = False,
    ):
        super().__init__()
        self.prefix = prefix
        self.tp_rank, self.tp_size, self.split_input = tp_rank, tp_size, split_input
        self.full_in_features = in_features
        self.in_features = in_features // tp_size if split_input else in_features
        # Per shard: rows in the checkpoint and rows on this rank (split when column-parallel).
        self.full_rows = dict(shard_sizes)
        self.local_rows = {k: (v if split_input else v // tp_size) for k, v in shard_sizes.items()}
        self.offsets, off = {}, 0
        for k, v in self.local_rows.items():
            self.offsets[k] = off
            off += v
        self.out_features = off
        # Up to this many rows of input go to the csrc GEMV instead of F.linear (0: never),
        # with this many warps per output feature; set per weight shape by
        # asyncgen._ops.cuda_backend.choose_dense_gemv.
        self.gemv_rows = 0
        self.gemv_warps_per_row = 1
        # gate|up layers: whether those rows also go to the GEMV that writes silu(gate) * up
        # (set by the model runner with the cuda backend).
        self.gemv_gated = False
        # 4-bit gate|up layers: whether one row gives silu(gate) * up from the one-row 4-bit
        # kernel (set by the model runner, after QuantLinearMethod.gated_ok).
        self.quant_gated = False
        # Row counts whose product runs a chosen cuBLASLt algorithm instead of F.linear
        # ({rows: cublaslt.LtRoute}; set by asyncgen._ops.cuda_backend.choose_dense_algos).
        self.lt_routes: dict = {}
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, dtype, device)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.loaded: set = set()

    # --- index helpers shared by the linear methods -------------------------------------
    def shard_rows(self, shard) -> tuple[int, int]:
        """(start, size) of ``shard``'s rows in this rank's fused output."""
        return self.offsets[shard], self.local_rows[shard]

    def shard_cols(self) -> tuple[int, int]:
        """(start, size) of this rank's slice of the checkpoint's input dim."""
        if self.split_input:
            return self.tp_rank * self.in_features, self.in_features
        return 0, self.in_features

    def checkpoint_rows(self, shard) -> int:
        return self.full_rows[shard]

    def checkpoint_cols(self) -> int:
        return self.full_in_features

    def checkpoint_name(self, shard) -> str:
        return self.prefix if shard is None else self.shard_names[shard]

    def take_shard(self, tensor: torch.Tensor, shard, dim: int = 0) -> torch.Tensor:
        """This rank's slice along the output dim ``dim`` (all of it when not column-split)."""
        if self.split_input or self.tp_size == 1:
            return tensor
        size = self.local_rows[shard]
        return tensor.narrow(dim, self.tp_rank * size, size)

    # --- loading and forward ----------------------------------------------------------
    def load(self, name: str, tensor: torch.Tensor, shard=None) -> None:
        if name == "bias":
            if self.bias is None:
                raise WeightsError(f"unexpected tensor {self.checkpoint_name(shard)}.bias (the config has no bias)")
            check_shape(f"{self.checkpoint_name(shard)}.bias", (self.checkpoint_rows(shard),), tensor.shape)
            check_float(f"{self.checkpoint_name(shard)}.bias", tensor)
            start, size = self.shard_rows(shard)
            self.bias.data[start : start + size].copy_(self.take_shard(tensor, shard))
        else:
            self.method.load(self, name, tensor, shard)
        self.loaded.add((name, shard))

    def expected_tensors(self) -> list[tuple[str, object]]:
        names = self.method.tensor_names() if hasattr(self.method, "tensor_names") else ["weight"]
        if self.bias is not None:
            names = [*names, "bias"]
        return [(n, s) for s in self.full_rows for n in names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gate|up layer's output from one kernel, or None where
        its method has none for ``x`` (then apply ``silu_and_mul`` to ``forward``)."""
        return self.method.apply_gated(self, x)


class QKVLinear(LinearBase):
    """``parent`` is the attention module's checkpoint prefix (``model.layers.3.self_attn``)."""

    def __init__(self, parent, hidden, num_heads, num_kv_heads, head_dim, bias, dtype, device, method=None, **tp):
        self.shard_names = {s: f"{parent}.{s}_proj" for s in "qkv"}
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(f"{parent}.qkv_proj", hidden, sizes, bias, dtype, device, method, **tp)


class MergedLinear(LinearBase):
    """Output-concatenated projections of one module, e.g. ``gate_proj`` | ``up_proj``
    under ``parent`` = ``model.layers.3.mlp``."""

    def __init__(self, parent, name, hidden, names_sizes: dict[str, int], bias, dtype, device, method=None, **tp):
        self.shard_names = {n: f"{parent}.{n}" for n in names_sizes}
        super().__init__(f"{parent}.{name}", hidden, names_sizes, bias, dtype, device, method, **tp)


class RowLinear(LinearBase):
    """Input dim split across shards (o_proj, down_proj); output is a partial sum per rank."""

    def __init__(self, prefix, in_features, out_features, bias, dtype, device, method=None, **tp):
        self.shard_names = {None: prefix}
        super().__init__(prefix, in_features, {None: out_features}, bias, dtype, device, method, split_input=True, **tp)
