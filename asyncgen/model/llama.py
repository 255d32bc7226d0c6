"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One forward pass computes a flat batch of tokens from many sequences::

    input_ids  [T]            positions [T]
    embed -> L x (norm -> qkv [-> q/k norm] -> rotary -> cache write -> paged attention
                  -> o_proj -> norm -> gate_up -> silu*mul -> down) -> norm -> hidden [T, hidden]

and ``compute_logits`` projects only the rows that sample. Every op comes from the
``Ops`` bundle chosen at construction, so the same module runs the torch reference on
the CPU and the Triton/CUDA kernels on a GPU.
"""

from __future__ import annotations

import dataclasses
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
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str, ops: Ops, dtype, device, method_factory):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.window(layer)
        # Qwen3: RMSNorm over each head's q and k, before the rotary embedding.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, dtype, device) if cfg.qk_norm else None
        self.qkv_proj = QKVLinear(
            prefix, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.attention_bias, dtype, device, method_factory(f"{prefix}.qkv_proj"),
        )
        self.o_proj = RowLinear(
            f"{prefix}.o_proj", self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device,
            method_factory(f"{prefix}.o_proj"),
        )
        # Bound by the model runner once the pool is allocated:
        # [num_blocks, block_size, num_kv_heads, head_dim] each.
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        # int32 zeros the attention kernels may use to combine a split context (shared by
        # the layers, which run one after another); bound by the model runner on CUDA.
        self.split_counters: Optional[torch.Tensor] = None

    def forward(self, positions, x, meta: AttentionMetadata, cos_sin_cache):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # The kernels take rows of head_dim as a view: one copy of q and of k.
            q = self.q_norm(q.contiguous())[0]
            k = self.k_norm(k.contiguous())[0]
        o = self.ops.rotary_attention(
            positions, q, k, v, cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, self.scale, self.sliding_window,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, split_counters=self.split_counters,
        )
        return self.o_proj(o.view(T, self.q_size))


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
        act = self.gate_up_proj.forward_gated(x)  # one csrc GEMV at decode size on CUDA
        if act is None:
            act = self.ops.silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer, prefix, ops, dtype, device, method_factory):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        self.self_attn = Attention(cfg, layer, f"{prefix}.self_attn", ops, dtype, device, method_factory)
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
            DecoderLayer(cfg, i, f"model.layers.{i}", ops, dtype, device, linear_method) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
            )  # [vocab, hidden]
        max_position = max_position or cfg.max_position_embeddings
        inv_freq = cfg.inv_freq()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of each rotated pair, then sin.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device), persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, self.cos_sin_cache)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for the given rows of hidden states."""
        return torch.nn.functional.linear(hidden, self.lm_head_weight).float()
