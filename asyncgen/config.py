"""Engine settings, validated once at construction (errors name the field)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EngineConfig"]

_CPU_KV_CACHE_BYTES = 1 << 30


class EngineConfig(BaseModel):
    """Everything ``AsyncEngine.from_pretrained`` accepts besides the model path.

    ``max_model_len`` defaults to the model's ``max_position_embeddings`` and may not
    exceed it. The KV pool is ``num_kv_blocks`` blocks when given; else sized from
    ``kv_cache_memory`` bytes; else, on the CPU, 1 GiB, and on CUDA the part of
    ``gpu_memory_utilization`` of the card left after the weights and a profiled forward
    pass at the largest batch.
    ``enable_prefix_caching`` shares the KV blocks of equal prompt prefixes between
    requests (and between the ``n`` samples of one request). ``ops_backend`` forces a
    kernel backend ("torch", "triton" or "cuda"); "auto" picks the fastest available for
    the device. ``freeze_gc`` (on by default) moves every object alive when the engine
    has loaded out of the cyclic garbage collector's reach until the last engine closes,
    so that the collector's full passes stop pausing the process for hundreds of
    milliseconds (``asyncgen.engine.heap``). ``scheduling_policy="priority"`` serves
    waiting requests by their ``priority`` (lower first; then by arrival) and, when the
    KV pool runs short, preempts the running request of the lowest priority (the latest
    among equals) instead of the latest admitted ("fcfs", the default, takes requests in
    arrival order and refuses a nonzero ``priority``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: Optional[int] = Field(default=None, ge=2)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=16)
    block_size: Literal[8, 16, 32] = 16
    num_kv_blocks: Optional[int] = Field(default=None, ge=1)
    kv_cache_memory: Optional[int] = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    ops_backend: Literal["auto", "torch", "triton", "cuda"] = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    freeze_gc: bool = True
    trust_remote_code: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"

    @property
    def default_cpu_kv_cache_bytes(self) -> int:
        return _CPU_KV_CACHE_BYTES
