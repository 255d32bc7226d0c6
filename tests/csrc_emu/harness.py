"""Builds and drives the CPU emulation of the csrc kernels (``emulate.cpp``) via ctypes.

The emulation runs the real kernel source (``csrc/*.cuh``) with a host compiler, one
fiber per CUDA thread, so the kernels' indexing, masking and cross-lane logic can be
checked against ``asyncgen._ops.reference`` on a machine with no GPU. It needs a C++20
compiler and the CUDA headers (``cuda_fp16.h``); :func:`build` returns None without them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "csrc"
SOURCES = [HERE / "emulate.cpp", HERE / "emu_runtime.h", *sorted(CSRC.glob("*.cuh"))]

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}


class DecodeParams(ctypes.Structure):
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("part_max", ctypes.c_void_p),
        ("part_sum", ctypes.c_void_p),
        ("part_out", ctypes.c_void_p),
        ("out_stride_seq", ctypes.c_int64),
        ("out_stride_head", ctypes.c_int64),
        ("q_stride_seq", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("k_stride_block", ctypes.c_int64),
        ("v_stride_block", ctypes.c_int64),
        ("block_table_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("sliding_window", ctypes.c_int),
        ("partition_size", ctypes.c_int),
        ("max_partitions", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("split_counters", ctypes.c_void_p),
        ("k_new", ctypes.c_void_p),
        ("v_new", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p),
        ("k_new_stride_seq", ctypes.c_int64),
        ("k_new_stride_head", ctypes.c_int64),
        ("v_new_stride_seq", ctypes.c_int64),
        ("v_new_stride_head", ctypes.c_int64),
        ("cos_sin_stride", ctypes.c_int64),
    ]


class ChunkAttentionParams(ctypes.Structure):
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("q", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("query_start_loc", ctypes.c_void_p),
        ("part_out", ctypes.c_void_p),
        ("part_ml", ctypes.c_void_p),
        ("split_counters", ctypes.c_void_p),
        ("q_stride_token", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("out_stride_token", ctypes.c_int64),
        ("out_stride_head", ctypes.c_int64),
        ("k_stride_block", ctypes.c_int64),
        ("v_stride_block", ctypes.c_int64),
        ("block_table_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int),
        ("num_seqs", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("block_shift", ctypes.c_int),
        ("num_splits", ctypes.c_int),
        ("scale_log2", ctypes.c_float),
    ]


class StoreKVParams(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_void_p),
        ("value", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("key_stride_token", ctypes.c_int64),
        ("key_stride_head", ctypes.c_int64),
        ("value_stride_token", ctypes.c_int64),
        ("value_stride_head", ctypes.c_int64),
        ("k_stride_block", ctypes.c_int64),
        ("v_stride_block", ctypes.c_int64),
        ("num_tokens", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("block_size", ctypes.c_int),
    ]


class RotaryStoreParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("cos_sin", ctypes.c_void_p),
        ("slot_mapping", ctypes.c_void_p),
        ("q_stride_token", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("k_stride_token", ctypes.c_int64),
        ("k_stride_head", ctypes.c_int64),
        ("v_stride_token", ctypes.c_int64),
        ("v_stride_head", ctypes.c_int64),
        ("k_stride_block", ctypes.c_int64),
        ("v_stride_block", ctypes.c_int64),
        ("cos_sin_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("block_size", ctypes.c_int),
    ]


class DenseGemvParams(ctypes.Structure):
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_stride", ctypes.c_int64),
        ("x_stride", ctypes.c_int64),
        ("weight_stride", ctypes.c_int64),
        ("m", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("warps_per_row", ctypes.c_int),
        ("gated", ctypes.c_bool),
    ]


class QuantGemvParams(ctypes.Structure):
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("qweight", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("zeros", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_stride", ctypes.c_int64),
        ("x_stride", ctypes.c_int64),
        ("qweight_stride", ctypes.c_int64),
        ("scales_stride", ctypes.c_int64),
        ("zeros_stride", ctypes.c_int64),
        ("m", ctypes.c_int),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("group_size", ctypes.c_int),
        ("gated", ctypes.c_int),
    ]


class QuantGemmParams(ctypes.Structure):
    _fields_ = [
        ("q", QuantGemvParams),
        ("workspace", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("splits", ctypes.c_int),
        ("warps", ctypes.c_int),
        ("wgmma", ctypes.c_int),
        ("stream_blocks", ctypes.c_int),
    ]


def _cuda_include() -> Path | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    for root in roots:
        if root and (Path(root) / "include" / "cuda_fp16.h").exists():
            return Path(root) / "include"
    return None


def build(out_dir: Path) -> "Emulator | None":
    """Compiles the emulator into ``out_dir`` (reused while the sources are unchanged)."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    include = _cuda_include()
    if cxx is None or include is None:
        return None
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    lib = out_dir / f"agemu_{digest}.so"
    if not lib.exists():
        cmd = [
            cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-fno-strict-aliasing",
            f"-I{CSRC}", f"-I{include}", str(HERE / "emulate.cpp"), "-o", str(lib),
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return Emulator(ctypes.CDLL(str(lib)))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Emulator:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        assert lib.ag_sizeof_decode_params() == ctypes.sizeof(DecodeParams)
        assert lib.ag_sizeof_chunk_params() == ctypes.sizeof(ChunkAttentionParams)
        lib.ag_chunk_attention.argtypes = [ctypes.POINTER(ChunkAttentionParams), ctypes.c_int, ctypes.c_int, ctypes.c_int]
        assert lib.ag_sizeof_store_params() == ctypes.sizeof(StoreKVParams)
        assert lib.ag_sizeof_rotary_store_params() == ctypes.sizeof(RotaryStoreParams)
        lib.ag_rotary_store_kv.argtypes = [ctypes.POINTER(RotaryStoreParams)] + [ctypes.c_int] * 3 + [
            ctypes.POINTER(ctypes.c_int)]
        assert lib.ag_sizeof_dense_gemv_params() == ctypes.sizeof(DenseGemvParams)
        assert lib.ag_sizeof_quant_gemv_params() == ctypes.sizeof(QuantGemvParams)
        lib.ag_dense_gemv.argtypes = [ctypes.POINTER(DenseGemvParams), ctypes.c_int]
        lib.ag_quant_gemv_4bit.argtypes = [ctypes.POINTER(QuantGemvParams), ctypes.c_int]
        lib.ag_quant_gemv_4bit_mma_ok.argtypes = [ctypes.POINTER(QuantGemvParams)]
        lib.ag_quant_gemv1_ok.argtypes = [ctypes.POINTER(QuantGemvParams)]
        self.last_quant_kernel = ""
        assert lib.ag_sizeof_quant_gemm_params() == ctypes.sizeof(QuantGemmParams)
        lib.ag_quant_gemm_4bit.argtypes = [ctypes.POINTER(QuantGemmParams)]
        lib.ag_paged_attention_decode.argtypes = [ctypes.POINTER(DecodeParams), ctypes.c_int]
        lib.ag_set_reverse_blocks.argtypes = [ctypes.c_int]
        lib.ag_store_kv_cache.argtypes = [ctypes.POINTER(StoreKVParams)] + [ctypes.c_int] * 3

    def plan(self, num_seqs, num_heads, num_kv_heads, max_seq_len, sliding_window, num_sms,
             partition_size) -> tuple[int, int]:
        size, count = ctypes.c_int(), ctypes.c_int()
        self.lib.ag_plan_decode(num_seqs, num_heads, num_kv_heads, max_seq_len, sliding_window,
                                num_sms, partition_size, ctypes.byref(size), ctypes.byref(count))
        return size.value, count.value

    def paged_attention_decode(self, out, q, k_cache, v_cache, block_tables, seq_lens, scale,
                               max_seq_len, sliding_window=0, partition_size=-1, num_sms=132, *,
                               rotary=None, split_counters=None, reverse_blocks=False):
        """Mirrors the torch ops' glue: plan, scratch buffers, params, launch. ``rotary``:
        ``(k, v, positions, cos_sin_cache, slot_mapping)`` for the fused rotary and cache
        write (rotary_paged_attention_decode); ``split_counters``: the int32 counters of
        the in-kernel combine; ``reverse_blocks`` runs the blocks in reverse order."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        size, count = self.plan(num_seqs, num_heads, num_kv_heads, max_seq_len, sliding_window,
                                num_sms, partition_size)
        part_max = part_sum = part_out = None
        if count > 1:
            part_max = torch.empty(num_seqs, num_heads, count)
            part_sum = torch.empty(num_seqs, num_heads, count)
            part_out = torch.empty(num_seqs, num_heads, count, head_dim)
        p = DecodeParams(
            _ptr(out), _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(seq_lens),
            _ptr(part_max), _ptr(part_sum), _ptr(part_out),
            out.stride(0), out.stride(1), q.stride(0), q.stride(1),
            k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
            num_seqs, num_heads, num_kv_heads, head_dim, k_cache.shape[1], sliding_window,
            size, count, scale,
        )
        if count > 1 and split_counters is not None:
            assert split_counters.numel() >= num_seqs * num_kv_heads
            p.split_counters = _ptr(split_counters)
        if rotary is not None:
            k, v, positions, cos_sin, slot_mapping = rotary
            p.k_new, p.v_new, p.positions, p.slot_mapping, p.cos_sin = (
                _ptr(k), _ptr(v), _ptr(positions), _ptr(slot_mapping), _ptr(cos_sin))
            p.k_new_stride_seq, p.k_new_stride_head = k.stride(0), k.stride(1)
            p.v_new_stride_seq, p.v_new_stride_head = v.stride(0), v.stride(1)
            p.cos_sin_stride = cos_sin.stride(0)
        self.lib.ag_set_reverse_blocks(int(reverse_blocks))
        try:
            rc = self.lib.ag_paged_attention_decode(ctypes.byref(p), DTYPE_CODES[q.dtype])
        finally:
            self.lib.ag_set_reverse_blocks(0)
        assert rc == 0, "unsupported head_dim (or group) for the kernel"
        return count

    def chunk_attention(self, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                        num_splits=1, split_counters=None, reverse_blocks=False, kernel=0):
        """The prompt-chunk attention kernel (chunk_attention.cuh; ``kernel=1``: the
        warpgroup one, chunk_attention_wgmma.cuh) into ``out``, with the glue's scratch
        buffers; ``split_counters`` (int32 zeros) is required for ``num_splits > 1``.
        Returns False when the kernel does not take the shapes."""
        num_tokens, num_heads, head_dim = q.shape
        part_out = part_ml = None
        if num_splits > 1:
            assert split_counters is not None
            part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim)
            part_ml = torch.empty(num_tokens, num_heads, num_splits, 2)
        p = ChunkAttentionParams(
            _ptr(out), _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(seq_lens),
            _ptr(query_start_loc), _ptr(part_out), _ptr(part_ml), _ptr(split_counters),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), v_cache.stride(0),
            block_tables.stride(0), num_tokens, seq_lens.shape[0], num_heads, k_cache.shape[2],
            k_cache.shape[1].bit_length() - 1, num_splits, scale * 1.4426950408889634,
        )
        self.lib.ag_set_reverse_blocks(int(reverse_blocks))
        try:
            return self.lib.ag_chunk_attention(ctypes.byref(p), DTYPE_CODES[q.dtype], head_dim, kernel) == 0
        finally:
            self.lib.ag_set_reverse_blocks(0)

    def store_kv_cache(self, key, value, k_cache, v_cache, slot_mapping):
        es = key.element_size()
        aligned = all(t.data_ptr() % 16 == 0 for t in (key, value, k_cache, v_cache)) and all(
            (s * es) % 16 == 0
            for s in (key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                      k_cache.stride(0), v_cache.stride(0), key.shape[2])
        )
        p = StoreKVParams(
            _ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slot_mapping),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), v_cache.stride(0),
            key.shape[0], key.shape[1], key.shape[2], k_cache.shape[1],
        )
        rc = self.lib.ag_store_kv_cache(ctypes.byref(p), es, slot_mapping.dtype == torch.int64, aligned)
        assert rc == 0
        return aligned

    def rotary_store_kv(self, q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping) -> bool:
        """The fused rotary + cache write (cache_kernels.cuh), in place on q, k and the caches.
        Returns whether the launcher took the vectorized kernel (else the element-wise one)."""
        p = RotaryStoreParams(
            _ptr(q), _ptr(k), _ptr(v), _ptr(k_cache), _ptr(v_cache), _ptr(positions), _ptr(cos_sin_cache),
            _ptr(slot_mapping), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), v_cache.stride(0), cos_sin_cache.stride(0),
            q.shape[0], q.shape[1], k.shape[1], q.shape[2], k_cache.shape[1],
        )
        dtype = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[q.dtype]
        vectorized = ctypes.c_int()
        rc = self.lib.ag_rotary_store_kv(ctypes.byref(p), dtype, slot_mapping.dtype == torch.int64,
                                         positions.dtype == torch.int64, ctypes.byref(vectorized))
        assert rc == 0
        return bool(vectorized.value)

    def dense_gemv(self, out, x, weight, bias=None, warps_per_row=0, gated=False):
        """out[m, n] = x[m] . weight[n] (+ bias[n]), or gated: out[m, j] = silu(y[m, j]) *
        y[m, N / 2 + j]; the glue's layout requirements hold."""
        p = DenseGemvParams(
            _ptr(out), _ptr(x), _ptr(weight), _ptr(bias), out.stride(0), x.stride(0), weight.stride(0),
            x.shape[0], weight.shape[0], weight.shape[1], warps_per_row, gated,
        )
        assert self.lib.ag_dense_gemv(ctypes.byref(p), DTYPE_CODES[x.dtype]) == 0, "no kernel takes the launch"

    def quant_gemv_4bit(self, out, x, qweight, scales, zeros, group_size, bias=None, tensor_cores=True,
                        gated=False):
        """out = x @ dequant(qweight) (+ bias), fp16, 4-bit codes packed along K. With
        ``tensor_cores`` the launcher takes the mma kernel where it accepts the shape (as on
        sm_80+); returns whether it did. ``last_quant_kernel`` names the kernel that ran:
        "mma", "stream" (one row) or "cores". ``gated``: one row, out [1, N / 2] =
        silu(y[:, :N / 2]) * y[:, N / 2:] from the one-row kernel."""
        p = QuantGemvParams(
            _ptr(out), _ptr(x), _ptr(qweight), _ptr(scales), _ptr(zeros), _ptr(bias),
            out.stride(0), x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0),
            x.shape[0], qweight.shape[1], x.shape[1], group_size, int(gated),
        )
        assert self.lib.ag_quant_gemv_4bit(ctypes.byref(p), int(tensor_cores)) == 0, "too many rows"
        used_mma = bool(tensor_cores and self.lib.ag_quant_gemv_4bit_mma_ok(ctypes.byref(p)))
        stream = bool(self.lib.ag_quant_gemv1_ok(ctypes.byref(p)))
        self.last_quant_kernel = "mma" if used_mma else "stream" if stream else "cores"
        return used_mma

    def quant_gemm_4bit(self, out, x, qweight, scales, zeros, group_size, bias=None, warps=4, splits=1,
                        workspace=None, counters=None, wgmma=False, stream_blocks=0):
        """out = x @ dequant(qweight) (+ bias) by the tiled tensor-core GEMM (quant_gemm.cuh),
        or with ``wgmma`` its warpgroup version (quant_wgmma.cuh), its K split over ``splits``
        blocks per column range (then ``workspace`` fp32 and ``counters`` int32 zeros are
        needed), or with ``stream_blocks`` a balanced launch of that many blocks (``splits``:
        the plan's most blocks sharing a column block). Returns False where the kernel
        refuses the call."""
        q = QuantGemvParams(
            _ptr(out), _ptr(x), _ptr(qweight), _ptr(scales), _ptr(zeros), _ptr(bias),
            out.stride(0), x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0),
            x.shape[0], qweight.shape[1], x.shape[1], group_size, 0,
        )
        p = QuantGemmParams(q, _ptr(workspace), _ptr(counters), splits, warps, int(wgmma), stream_blocks)
        return self.lib.ag_quant_gemm_4bit(ctypes.byref(p)) == 0

    def plan_stream_gemm(self, n, k, warps, blocks_wanted) -> tuple[int, int]:
        """plan_stream_gemm (quant_gemm.cuh): (blocks, most blocks sharing a column block)."""
        blocks, most = ctypes.c_int(), ctypes.c_int()
        self.lib.ag_plan_stream_gemm(n, k, warps, ctypes.c_int64(blocks_wanted), ctypes.byref(blocks),
                                     ctypes.byref(most))
        return blocks.value, most.value
