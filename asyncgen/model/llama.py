"""The Llama family (Llama, Mistral, Qwen2) over a paged KV cache.

One forward pass computes a flat batch of tokens from many sequences::

    input_ids  [T]            positions [T]
    embed -> L x (norm -> qkv -> rotary -> cache write -> paged attention -> o_proj
                  -> norm -> gate_up -> silu*mul -> down) -> norm -> hidden [T, hidden]

(a step of a token or two on the csrc GEMVs folds the norms, the residual adds and
silu*mul into the products: ``LlamaForCausalLM._forward_fused``)

and ``compute_logits`` projects only the rows that sample. Every op comes from the
``Ops`` bundle chosen at construction, so the same module runs the torch reference on
the CPU and the Triton/CUDA kernels on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from torch import nn

from .._ops import Ops
from .config import ModelConfig
from .linear import LinearMethod, MergedLinear, QKVLinear, RowLinear

__all__ = ["AttentionMetadata", "LlamaForCausalLM"]


@dataclasses.dataclass
class AttentionMetadata:
    """Where each token of the step lives in the paged cache (see ``_ops.reference``)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps, self.ops = eps, ops

    def forward(self, x, residual=None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, ops: Ops, dtype, device, method_factory):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        self.qkv_proj = QKVLinear(
            prefix, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.attention_bias, dtype, device, method_factory(f"{prefix}.qkv_proj"),
        )
        self.o_proj = RowLinear(
            f"{prefix}.o_proj", self.q_size, cfg.hidden_size, False, dtype, device, method_factory(f"{prefix}.o_proj")
        )
        # Bound by the model runner once the pool is allocated:
        # [num_blocks, block_size, num_kv_heads, head_dim] each.
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        # int32 zeros the attention kernels may use to combine a split context (shared by
        # the layers, which run one after another); bound by the model runner on CUDA.
        self.split_counters: Optional[torch.Tensor] = None

    def forward(self, positions, x, meta: AttentionMetadata, cos_sin_cache):
        return self.o_proj(self.attend(positions, self.qkv_proj(x), meta, cos_sin_cache))

    def attend(self, positions, qkv, meta: AttentionMetadata, cos_sin_cache):
        """Rotary, the cache write and attention from the q|k|v product: [T, q_size]."""
        T = qkv.shape[0]
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        o = self.ops.rotary_attention(
            positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, self.scale, self.sliding_window,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, split_counters=self.split_counters,
        )
        return o.view(T, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, ops: Ops, dtype, device, method_factory):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = MergedLinear(
            prefix, "gate_up_proj", cfg.hidden_size,
            {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            cfg.mlp_bias, dtype, device, method_factory(f"{prefix}.gate_up_proj"),
        )
        self.down_proj = RowLinear(
            f"{prefix}.down_proj", cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device,
            method_factory(f"{prefix}.down_proj"),
        )

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, prefix, ops, dtype, device, method_factory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", ops, dtype, device, method_factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        self.mlp = MLP(cfg, f"{prefix}.mlp", ops, dtype, device, method_factory)

    def forward(self, positions, x, residual, meta, cos_sin_cache):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, meta, cos_sin_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
        linear_method: "callable[[str], LinearMethod | None]" = lambda prefix: None,
        max_position: int | None = None,
    ):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, f"model.layers.{i}", ops, dtype, device, linear_method) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
            )  # [vocab, hidden]
        # Steps of up to this many tokens run each layer as five kernels (see forward); set by
        # enable_fused_decode, 0 (never) until then.
        self.fused_decode_rows = 0
        max_position = max_position or cfg.max_position_embeddings
        inv_freq = cfg.inv_freq()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of each rotated pair, then sin.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def enable_fused_decode(self) -> int:
        """Lets steps of few tokens run fused (see ``forward``) where every layer's four
        products are unquantized and on the csrc GEMV at that many rows (``gemv_rows``, set
        by ``cuda_backend.choose_dense_gemv``) and the extension has the fused op; not when
        ``ASYNCGEN_FUSED_DECODE=0`` is set. Returns the rows (0: never)."""
        from .._ops import cuda_backend
        from .linear import UnquantizedLinearMethod

        linears = [lin for layer in self.layers
                   for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj)]
        rows = min((lin.gemv_rows for lin in linears), default=0)
        if (os.environ.get("ASYNCGEN_FUSED_DECODE", "1") == "0"
                or not all(type(lin.method) is UnquantizedLinearMethod for lin in linears)
                or not cuda_backend.dense_gemv_fused_available()):
            rows = 0
        self.fused_decode_rows = rows
        return rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        if 0 < x.shape[0] <= self.fused_decode_rows:
            return self._forward_fused(x, positions, meta)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, self.cos_sin_cache)
        x, _ = self.norm(x, residual)
        return x

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` with the norms, SiLU-and-multiply and residual adds inside the csrc
        GEMVs: o_proj and down_proj add their output to the residual stream in place and
        sum its squares (``sums``, one row per norm), and the next product (gate|up, or the
        next layer's q|k|v) normalises the residual as it reads it, with those sums; gate|up
        writes silu(gate) * up. The same arithmetic as the unfused path, rounded where the
        separate ops round except for the normalised input, which stays fp32; the squares
        are added in fp64 (csrc/gemv.cuh)."""
        from .._ops.cuda_backend import launch_dense_gemv_fused as gemv

        layers = self.layers
        sums = torch.zeros(2 * len(layers) - 1, x.shape[0], dtype=torch.float64, device=x.device)
        h, residual = layers[0].input_layernorm(x)  # residual is x, updated in place from here
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if i == 0:
                qkv = attn.qkv_proj(h)
            else:
                norm, lin = layer.input_layernorm, attn.qkv_proj
                qkv = gemv(residual, lin.weight, lin.bias, warps_per_row=lin.gemv_warps_per_row,
                           norm_weight=norm.weight, sum_squares_in=sums[2 * i - 1], eps=norm.eps)
            o = attn.attend(positions, qkv, meta, self.cos_sin_cache)
            gemv(o, attn.o_proj.weight, attn.o_proj.bias, warps_per_row=attn.o_proj.gemv_warps_per_row,
                 add_to=residual, sum_squares_out=sums[2 * i])
            norm, lin = layer.post_attention_layernorm, mlp.gate_up_proj
            act = gemv(residual, lin.weight, lin.bias, warps_per_row=min(lin.gemv_warps_per_row, 4),
                       norm_weight=norm.weight, sum_squares_in=sums[2 * i], eps=norm.eps, gated=True)
            if i + 1 < len(layers):
                lin = mlp.down_proj
                gemv(act, lin.weight, lin.bias, warps_per_row=lin.gemv_warps_per_row,
                     add_to=residual, sum_squares_out=sums[2 * i + 1])
            else:
                h, _ = self.norm(mlp.down_proj(act), residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for the given rows of hidden states."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight).float()
