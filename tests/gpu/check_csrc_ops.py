"""Checks and times the csrc CUDA ops on a GPU; standalone (no pytest).

Build first, then run from the repository root:

    python3 setup.py build_ext --inplace
    PYTHONPATH=$PWD python3 tests/gpu/check_csrc_ops.py [--quick] [--no-bench]

Correctness: torch.ops.asyncgen_C.{store_kv_cache, rotary_store_kv, paged_attention_decode} and the
cuda_backend launchers against asyncgen._ops.reference on random inputs (NaN in every
cache slot no sequence owns, shuffled block ids, ragged lengths, partial last blocks,
GQA 1/4/6/8/12, head_dim 64/128/256, fp16/bf16, split-K off/forced/automatic, sliding
window, an empty padded sequence, CUDA-graph replay with new lengths), and the GEMV ops
(dense fp16/bf16 against ``F.linear``, 4-bit against dequantize-then-matmul, at 7B
layer shapes and 1-8 rows). Timing: the decode
kernel for a 7B shape at batch 1/64/256 and 1k-4k context, in GB/s of K/V read against
~4.3 TB/s, next to the Triton decode kernel when asyncgen._ops.triton_backend imports;
the GEMVs at 7B decode shapes next to cuBLAS and the Triton 4-bit GEMV; the fused rotary +
cache write (both kernel forms) next to the Triton rotary plus the csrc cache write at
1-256 tokens (``--rotary-store-only``: that op's checks and timing alone).
Exits 1 on any mismatch, 2 when the extension is not built.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

import torch

from asyncgen._ops import cuda_backend, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared input builders
from csrc_emu.cases import (  # noqa: E402
    make_chunk_case,
    make_decode_case,
    make_rotary_decode_case,
    make_rotary_store_case,
)

PEAK_GBPS = 4300.0
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
DEVICE = "cuda"

failures: list[str] = []
num_checks = 0


def check(name: str, ok: bool, detail: str = "") -> None:
    global num_checks
    num_checks += 1
    if not ok:
        failures.append(f"{name}: {detail}")
        print(f"  FAIL {name} {detail}")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


# ----------------------------------------------------------------------------------------
# Inputs


class Case:
    """A decode batch over a paged cache; unused slots hold NaN unless ``fill_nan`` is off."""

    def __init__(self, *, seq_lens, num_heads, num_kv_heads, head_dim, dtype, block_size=16,
                 sliding_window=None, fill_nan=True, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        num_seqs = len(seq_lens)
        blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 4
        perm = torch.randperm(num_blocks, generator=g)
        poison = int(perm[-1])  # owned by nobody
        width = max(blocks_per_seq) + 2
        tables = torch.full((num_seqs, width + 3), poison, dtype=torch.int32)
        i = 0
        for b, n in enumerate(blocks_per_seq):
            tables[b, :n] = perm[i : i + n]
            i += n
        tables = tables.to(DEVICE)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        torch.manual_seed(seed)
        self.k_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
        self.v_cache = torch.randn(shape, device=DEVICE, dtype=dtype)
        self.k_ref, self.v_ref = self.k_cache, self.v_cache
        if fill_nan:
            owned = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
            before_window = torch.zeros_like(owned)
            for b, n in enumerate(seq_lens):
                pos = torch.arange(n, device=DEVICE)
                slots = tables[b, pos // block_size].long() * block_size + pos % block_size
                owned[slots] = True
                if sliding_window:
                    before_window[slots[: max(0, n - sliding_window)]] = True
            for cache in (self.k_cache, self.v_cache):
                cache.view(-1, num_kv_heads, head_dim)[~owned] = float("nan")
            self.k_ref, self.v_ref = self.k_cache.clone(), self.v_cache.clone()
            for cache in (self.k_cache, self.v_cache):  # the kernel must not read these
                cache.view(-1, num_kv_heads, head_dim)[before_window] = float("nan")
        qkv = torch.randn(num_seqs, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        self.q = qkv[:, :num_heads]  # strided, like the model's q
        self.block_tables = tables[:, :width]  # strided rows
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.max_seq_len = max(seq_lens)

    def op(self, out, partition_size=-1, max_seq_len=None):
        torch.ops.asyncgen_C.paged_attention_decode(
            out, self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale,
            self.max_seq_len if max_seq_len is None else max_seq_len, self.sliding_window or 0,
            partition_size,
        )
        return out

    def reference(self):
        return reference.paged_attention(
            self.q, self.k_ref, self.v_ref, self.block_tables, self.seq_lens, self.query_start_loc,
            self.scale, self.sliding_window,
        )

    def kv_bytes(self) -> int:
        _, _, num_kv_heads, head_dim = self.k_cache.shape
        tokens = int(self.seq_lens.sum())
        if self.sliding_window:
            tokens = sum(min(int(n), self.sliding_window) for n in self.seq_lens)
        return 2 * tokens * num_kv_heads * head_dim * self.k_cache.element_size()


def ragged_lens(num_seqs: int, max_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g).tolist()
    lens[0] = max_len
    if num_seqs > 2:
        lens[1] = min(max_len, 32)  # a full last block
    return lens


# ----------------------------------------------------------------------------------------
# Correctness


def check_store_kv_cache() -> None:
    print("store_kv_cache")
    for dtype, head_dim, slot_dtype in [
        (torch.float16, 128, torch.int64), (torch.bfloat16, 64, torch.int32),
        (torch.float32, 128, torch.int64), (torch.float16, 12, torch.int64),
    ]:
        torch.manual_seed(head_dim)
        num_tokens, num_kv_heads, num_blocks, block_size = 300, 8, 40, 16
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
        slots[torch.rand(num_tokens, device=DEVICE) < 0.2] = -1
        qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads : 3 * num_kv_heads]
        k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        reference.store_kv_cache(key, value, k_ref, v_ref, slots)
        slots = slots.to(slot_dtype)
        torch.ops.asyncgen_C.store_kv_cache(key, value, k_cache, v_cache, slots)
        name = f"store_kv_cache {dtype} d={head_dim} {slot_dtype}"
        check(name, torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "cache differs")
        k2, v2 = k_ref.clone(), v_ref.clone()
        cuda_backend.store_kv_cache(key, value, k2, v2, slots)  # the launcher
        check(name + " (launcher)", torch.equal(k2, k_ref) and torch.equal(v2, v_ref), "cache differs")


def check_rotary_store_kv() -> None:
    """The fused rotary + cache write against the two reference ops, at 7B and 8B (GQA)
    shapes, from a decode token to prompt chunks, with padding slots: q, k, v as views of
    the packed qkv rows (the vectorized kernel) and laid out one element off or with an
    odd head stride (the element-wise kernel), through the op itself and the launcher."""
    print("rotary_store_kv")
    i32, i64 = torch.int32, torch.int64
    for dtype, heads, kv_heads, num_tokens, slot_dtype, pos_dtype, layout in [
        (torch.float16, 32, 32, 1, i64, i64, "packed"), (torch.float16, 32, 32, 16, i32, i64, "packed"),
        (torch.float16, 32, 32, 78, i64, i64, "packed"), (torch.bfloat16, 32, 8, 80, i32, i32, "packed"),
        (torch.float16, 32, 32, 256, i32, i64, "packed"), (torch.bfloat16, 32, 8, 300, i64, i32, "packed"),
        (torch.float32, 32, 8, 7, i64, i64, "packed"), (torch.float32, 32, 8, 80, i32, i64, "packed"),
        (torch.float16, 32, 32, 78, i64, i64, "offset"), (torch.bfloat16, 32, 8, 5, i32, i64, "odd_stride"),
    ]:
        for via in ("op", "launcher"):
            case = make_rotary_store_case(num_tokens=num_tokens, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                                          dtype=dtype, layout=layout, slot_dtype=slot_dtype, pos_dtype=pos_dtype,
                                          max_position=4096, seed=num_tokens + kv_heads, device=DEVICE)
            q, k, v, kc, vc = case.q, case.k, case.v, case.k_cache, case.v_cache
            v_before = v.clone()
            form = "vec" if cuda_backend._rotary_store_vectorized(q, k, v, case.cos_sin, kc, vc) else "elem"
            if via == "op":  # the kernel itself, whatever the launcher would route there
                torch.ops.asyncgen_C.rotary_store_kv(q, k, v, case.positions, case.cos_sin, kc, vc, case.slot_mapping)
            else:
                cuda_backend.rotary_store_kv(case.positions, q, k, v, case.cos_sin, kc, vc, case.slot_mapping)
            tol = TOLERANCE.get(dtype, 1e-5)
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in ((case.q, case.q_ref), (case.k, case.k_ref), (case.k_buffer, case.k_buffer_ref)))
            same_v = torch.equal(case.v_buffer, case.v_buffer_ref) and torch.equal(case.v, v_before)
            check(f"rotary_store_kv {dtype} {heads}/{kv_heads} heads T={num_tokens} {layout} ({form}, {via})",
                  err < tol and same_v, f"rel err {err:.1e}, v and its cache unchanged elsewhere: {same_v}")


def bench_rotary_store_kv() -> None:
    """Per layer call in a CUDA graph (32 layers' caches in turn), 7B shapes: the fused
    kernel's vectorized form (q, k, v as views of the packed qkv rows), its element-wise
    form (the same rows one element off), and the Triton rotary plus the csrc cache write
    that the fused kernel replaces; and what the launcher runs at each token count."""
    from asyncgen._ops import triton_backend

    t = triton_backend.ops()
    heads, head_dim, width = 32, 128, 3 * 32 * 128
    print("\nrotary + cache write, 7B (32 heads, fp16), us per layer call")
    print(f"{'tokens':>6} | {'fused 16B':>9} {'fused elem':>10} {'rotary+store':>12} | launcher runs")
    angles = torch.rand(4096, head_dim // 2, device=DEVICE) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    caches = [tuple(torch.zeros(64, 16, heads, head_dim, device=DEVICE, dtype=torch.float16) for _ in range(2))
              for _ in range(32)]
    for num_tokens in (1, 8, 16, 64, 78, 256):
        flat = torch.randn(num_tokens * width + 1, device=DEVICE, dtype=torch.float16)
        packed = flat[:-1].view(num_tokens, 3 * heads, head_dim)
        offset = flat[1:].view(num_tokens, 3 * heads, head_dim)
        positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
        slots = torch.randperm(64 * 16, device=DEVICE)[:num_tokens]

        def fused(c, qkv):
            q, k, v = qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
            torch.ops.asyncgen_C.rotary_store_kv(q, k, v, positions, cos_sin, c[0], c[1], slots)

        def separate(c):
            q, k, v = packed[:, :heads], packed[:, heads : 2 * heads], packed[:, 2 * heads :]
            t.rotary_embedding(positions, q, k, cos_sin)
            cuda_backend.store_kv_cache(k, v, c[0], c[1], slots)

        q, k, v = packed[:, :heads], packed[:, heads : 2 * heads], packed[:, 2 * heads :]
        assert cuda_backend._rotary_store_vectorized(q, k, v, cos_sin, *caches[0])
        routed = ("fused" if cuda_backend._rotary_store_fusable(positions, q, k, v, *caches[0], cos_sin, slots)
                  else "rotary + store")
        t_vec = 1e3 * cuda_backend.graph_time_ms(lambda c: fused(c, packed), caches)
        t_elem = 1e3 * cuda_backend.graph_time_ms(lambda c: fused(c, offset), caches)
        t_two = 1e3 * cuda_backend.graph_time_ms(separate, caches)
        print(f"{num_tokens:>6} | {t_vec:>9.2f} {t_elem:>10.2f} {t_two:>12.2f} | {routed}", flush=True)
    del caches
    torch.cuda.empty_cache()


def check_decode(quick: bool) -> None:
    print("paged_attention_decode")
    # (num_heads, num_kv_heads, head_dim, block_size, max_len, window)
    shapes = [
        (32, 32, 128, 16, 1500, None),  # MHA, 7B-like
        (32, 8, 128, 16, 1300, None),   # GQA 4
        (64, 8, 128, 16, 900, None),    # GQA 8
        (28, 4, 128, 32, 700, None),    # GQA 7 (padded to 8), block_size 32
        (24, 2, 64, 16, 800, None),     # GQA 12 (two head chunks)
        (8, 8, 64, 16, 1100, None),
        (16, 4, 256, 16, 600, None),
        (32, 8, 128, 16, 1500, 300),    # sliding window
        (16, 16, 64, 16, 700, 1000),    # window wider than the context
    ]
    if quick:
        shapes = shapes[::2]
    for dtype in (torch.float16, torch.bfloat16):
        for s, (num_heads, num_kv_heads, head_dim, block_size, max_len, window) in enumerate(shapes):
            for num_seqs in (1, 5):
                case = Case(seq_lens=ragged_lens(num_seqs, max_len, s), num_heads=num_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                            block_size=block_size, sliding_window=window, seed=s)
                ref = case.reference()
                for partition_size in (0, 64, 256, -1):
                    out = case.op(torch.full_like(case.q, float("nan")), partition_size)
                    err = relative_error(out, ref)
                    name = (f"decode {str(dtype)[6:]} B={num_seqs} H={num_heads} KVH={num_kv_heads} "
                            f"D={head_dim} bs={block_size} L<={max_len} win={window} part={partition_size}")
                    check(name, err < TOLERANCE[dtype], f"rel err {err:.2e}")

    # A padded entry (seq_len 0) gives zeros, never NaN.
    lens = ragged_lens(4, 600, 7)
    lens[-1] = 0
    case = Case(seq_lens=lens, num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    ref = case.reference()
    for partition_size in (0, 64, -1):
        out = case.op(torch.full_like(case.q, float("nan")), partition_size)
        check(f"decode empty sequence part={partition_size}",
              bool((out[-1] == 0).all()) and relative_error(out[:-1], ref[:-1]) < 1e-2, "nonzero or mismatch")

    # An underestimated max_seq_len must stay correct (the last partition takes the rest).
    case = Case(seq_lens=ragged_lens(3, 2000, 8), num_heads=8, num_kv_heads=8, head_dim=64, dtype=torch.float16)
    out = case.op(torch.empty_like(case.q), 128, max_seq_len=500)
    check("decode underestimated max_seq_len", relative_error(out, case.reference()) < 2e-3)


def _rotary_attention_call(rc, out_of_place=True, split_counters=None, max_seq_len=None):
    case = rc.case
    return cuda_backend.rotary_attention(
        rc.positions, case.q, rc.k, rc.v, rc.cos_sin, case.k_cache, case.v_cache, rc.slot_mapping,
        case.block_tables, case.seq_lens, case.query_start_loc, case.scale, case.sliding_window,
        max_query_len=1, max_seq_len=case.max_seq_len if max_seq_len is None else max_seq_len,
        split_counters=split_counters,
    )


def _fused_decode_op(rc, split_counters=None, max_seq_len=None, partition_size=-1):
    """The fused kernel itself (whatever the launcher's batch limit)."""
    case = rc.case
    out = torch.empty_like(case.q)
    torch.ops.asyncgen_C.rotary_paged_attention_decode(
        out, case.q, rc.k, rc.v, rc.positions, rc.cos_sin, case.k_cache, case.v_cache, rc.slot_mapping,
        case.block_tables, case.seq_lens, split_counters, case.scale,
        case.max_seq_len if max_seq_len is None else max_seq_len, case.sliding_window or 0, partition_size)
    return out


def check_rotary_attention(quick: bool) -> None:
    """The fused rotary + cache write + decode attention (rotary_paged_attention_decode,
    through cuda_backend.rotary_attention) against the reference ops in turn: the new
    token's slot holds NaN until the kernel writes it; split-K off, forced and automatic,
    combined by a second kernel or in the kernel (counters back at 0 after); and a CUDA
    graph replayed with new lengths, tokens and slots."""
    print("rotary_attention (fused decode)")
    shapes = [  # (num_heads, num_kv_heads, head_dim, block_size, max_len, window)
        (32, 32, 128, 16, 1500, None), (32, 8, 128, 16, 1300, None), (64, 8, 128, 16, 900, None),
        (28, 4, 128, 32, 700, None), (8, 8, 64, 16, 1100, None), (16, 4, 256, 16, 600, None),
        (32, 8, 128, 16, 1500, 300),
    ]
    if quick:
        shapes = shapes[::2]
    for dtype in (torch.float16, torch.bfloat16):
        for s, (heads, kv_heads, head_dim, block_size, max_len, window) in enumerate(shapes):
            for num_seqs in (1, 5):
                for partition_size, counters in ((0, False), (64, False), (64, True), (-1, True)):
                    case = make_decode_case(num_seqs=num_seqs, num_heads=heads, num_kv_heads=kv_heads,
                                            head_dim=head_dim, block_size=block_size, max_len=max_len, dtype=dtype,
                                            sliding_window=window, empty_seq=num_seqs > 2, seed=s, device=DEVICE)
                    rc = make_rotary_decode_case(case, seed=s)
                    ref = reference.paged_attention(rc.q_ref, rc.k_cache_ref, rc.v_cache_ref, case.block_tables,
                                                    case.seq_lens, case.query_start_loc, case.scale, window)
                    split_counters = torch.zeros(num_seqs * kv_heads, dtype=torch.int32, device=DEVICE)
                    out = torch.full_like(case.q, float("nan"))
                    torch.ops.asyncgen_C.rotary_paged_attention_decode(
                        out, case.q, rc.k, rc.v, rc.positions, rc.cos_sin, case.k_cache, case.v_cache,
                        rc.slot_mapping, case.block_tables, case.seq_lens, split_counters if counters else None,
                        case.scale, case.max_seq_len, window or 0, partition_size)
                    rows = slice(0, num_seqs - 1) if num_seqs > 2 else slice(0, num_seqs)
                    err = relative_error(out[rows], ref[rows])
                    written = rc.slot_mapping[rc.slot_mapping >= 0]
                    flat = lambda c: c.view(-1, kv_heads, head_dim)[written]  # noqa: E731
                    k_err = relative_error(flat(case.k_cache), flat(rc.k_cache_ref))
                    ok = (err < TOLERANCE[dtype] and k_err < TOLERANCE[dtype]
                          and torch.equal(flat(case.v_cache), flat(rc.v_cache_ref)) and not split_counters.any()
                          and (num_seqs <= 2 or bool((out[-1] == 0).all())))
                    check(f"rotary decode {str(dtype)[6:]} B={num_seqs} H={heads} KVH={kv_heads} D={head_dim} "
                          f"bs={block_size} win={window} part={partition_size} counters={counters}", ok,
                          f"rel err {err:.2e}, k {k_err:.2e}, counters {int(split_counters.abs().sum())}")
    # Routing: the launcher takes the fused kernel for a decode step and gives the same.
    case = make_decode_case(num_seqs=3, num_heads=32, num_kv_heads=8, head_dim=128, max_len=900,
                            dtype=torch.float16, seed=3, device=DEVICE)
    rc = make_rotary_decode_case(case, seed=3)
    ref = reference.paged_attention(rc.q_ref, rc.k_cache_ref, rc.v_cache_ref, case.block_tables, case.seq_lens,
                                    case.query_start_loc, case.scale)
    out = _rotary_attention_call(rc, split_counters=torch.zeros(64, dtype=torch.int32, device=DEVICE))
    check("rotary_attention launcher (decode)", relative_error(out, ref) < 2e-3, f"{relative_error(out, ref):.2e}")

    # A captured graph at a fixed max_seq_len (split), replayed with new lengths and tokens.
    case = make_decode_case(num_seqs=4, num_heads=32, num_kv_heads=32, head_dim=128, max_len=1800,
                            dtype=torch.float16, seed=4, device=DEVICE)
    rc = make_rotary_decode_case(case, seed=4)
    counters = torch.zeros(4 * 32, dtype=torch.int32, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _rotary_attention_call(rc, split_counters=counters, max_seq_len=2048)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _rotary_attention_call(rc, split_counters=counters, max_seq_len=2048)
    for step, shrink in enumerate((0, 1, 37, 300, 1200)):
        lens = (case.seq_lens.long() - shrink).clamp_min(1)
        case.seq_lens.copy_(lens)
        rc.positions.copy_(lens - 1)
        tables = case.block_tables.long()
        rows = torch.arange(4, device=DEVICE)
        rc.slot_mapping.copy_(tables[rows, (lens - 1) // 16] * 16 + (lens - 1) % 16)
        rc.k.copy_(torch.randn_like(rc.k))
        rc.v.copy_(torch.randn_like(rc.v))
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        ref = reference.rotary_attention(rc.positions, case.q.clone(), rc.k.clone(), rc.v.clone(), rc.cos_sin, kc, vc,
                                         rc.slot_mapping, case.block_tables, case.seq_lens, case.query_start_loc,
                                         case.scale)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, ref)
        check(f"rotary decode graph replay {step}", err < 2e-3 and not counters.any(), f"rel err {err:.2e}")


PARTITION_SIZES = (32, 64, 128, 256)  # forced split-K partitions timed next to the automatic plan


def bench_rotary_attention() -> None:
    """Per layer call in a CUDA graph (32 layers' caches in turn, so K/V come from HBM):
    the fused kernel (split combined in the kernel, or by the second kernel) against
    rotary_store_kv + paged_attention."""
    import types

    print("\nrotary + cache write + decode attention, 7B (32 heads, fp16), us per layer call")
    print(f"{'batch':>5} {'ctx':>5} | {'fused':>7} {'fused+2nd':>9} {'separate':>8} | fused with partitions of "
          f"{' '.join(f'{p:>6}' for p in PARTITION_SIZES)} tokens")
    heads, head_dim, bs = 32, 128, 16
    angles = torch.rand(8192, head_dim // 2, device=DEVICE) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    for batch, ctx in ((1, 384), (1, 1024), (1, 4096), (4, 1024), (8, 2048), (64, 512)):
        blocks = batch * (ctx // bs + 1)
        layers = []
        for _ in range(32):
            case = types.SimpleNamespace(
                q=torch.randn(batch, heads, head_dim, device=DEVICE, dtype=torch.float16),
                k_cache=torch.randn(blocks, bs, heads, head_dim, device=DEVICE, dtype=torch.float16),
                v_cache=torch.randn(blocks, bs, heads, head_dim, device=DEVICE, dtype=torch.float16),
                block_tables=torch.randperm(blocks, device=DEVICE, dtype=torch.int32).view(batch, -1),
                seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
                scale=head_dim**-0.5, sliding_window=None, max_seq_len=ctx)
            positions = torch.full((batch,), ctx - 1, device=DEVICE)
            slots = case.block_tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
            kv = torch.randn(batch, 2, heads, head_dim, device=DEVICE, dtype=torch.float16)
            layers.append(types.SimpleNamespace(case=case, k=kv[:, 0], v=kv[:, 1], positions=positions,
                                                cos_sin=cos_sin, slot_mapping=slots))
        counters = torch.zeros(batch * heads, dtype=torch.int32, device=DEVICE)
        hint = max(ctx, 2048)  # as the engine's graphs: max_model_len
        fused = 1e3 * cuda_backend.graph_time_ms(
            lambda rc: _fused_decode_op(rc, split_counters=counters, max_seq_len=hint), layers)
        second = 1e3 * cuda_backend.graph_time_ms(lambda rc: _fused_decode_op(rc, max_seq_len=hint), layers)

        def separate(rc):
            c = rc.case
            cuda_backend.rotary_store_kv(rc.positions, c.q, rc.k, rc.v, rc.cos_sin, c.k_cache, c.v_cache, rc.slot_mapping)
            cuda_backend.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.query_start_loc,
                                         c.scale, max_query_len=1, max_seq_len=hint)

        sep = 1e3 * cuda_backend.graph_time_ms(separate, layers)
        forced = [1e3 * cuda_backend.graph_time_ms(
            lambda rc, _p=p: _fused_decode_op(rc, split_counters=counters, max_seq_len=hint, partition_size=_p), layers)
            for p in PARTITION_SIZES]
        print(f"{batch:>5} {ctx:>5} | {fused:>7.2f} {second:>9.2f} {sep:>8.2f} | "
              f"{' '.join(f'{t:>6.2f}' for t in forced)}", flush=True)
        del layers
        torch.cuda.empty_cache()


def check_cuda_graph() -> None:
    print("cuda graph capture")
    case = Case(seq_lens=ragged_lens(4, 900, 9), num_heads=16, num_kv_heads=4, head_dim=128, dtype=torch.float16)
    out = torch.empty_like(case.q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        case.op(out, -1, max_seq_len=1024)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.op(out, -1, max_seq_len=1024)
    for step, shrink in enumerate((0, 1, 37, 300)):
        case.seq_lens.copy_((case.seq_lens - shrink).clamp_min(1))  # in place, as a runner would
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, case.reference())
        check(f"graph replay {step}", err < 2e-3, f"rel err {err:.2e}")


def check_launcher() -> None:
    print("cuda_backend.paged_attention routing")
    case = Case(seq_lens=ragged_lens(6, 1000, 10), num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    ref = case.reference()
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    out = cuda_backend.paged_attention(*args, max_query_len=1, max_seq_len=case.max_seq_len)
    check("launcher decode with hints", relative_error(out, ref) < 1e-2)
    out = cuda_backend.paged_attention(*args)
    check("launcher decode without hints", relative_error(out, ref) < 1e-2)

    try:
        from asyncgen._ops import triton_backend  # noqa: F401
    except ImportError as e:
        print(f"  (triton backend unavailable, mixed-batch fallback not checked: {e})")
        return
    # A mixed batch (prefill chunks and decodes) goes to the Triton kernel.
    q_lens = [3, 1, 0, 17, 1, 5]
    lens = [max(n, q) for n, q in zip(ragged_lens(6, 1000, 11), q_lens)]
    mixed = Case(seq_lens=lens, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=11)
    q = torch.randn(sum(q_lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    out = torch.zeros_like(q)
    cuda_backend.paged_attention(q, mixed.k_ref, mixed.v_ref, mixed.block_tables, mixed.seq_lens, qsl,
                                 mixed.scale, out=out)
    ref = reference.paged_attention(q, mixed.k_ref, mixed.v_ref, mixed.block_tables, mixed.seq_lens, qsl,
                                    mixed.scale, out=torch.zeros_like(q))
    check("launcher mixed batch (triton fallback)", relative_error(out, ref) < 2e-2)


GEMV_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]  # 7B: qkv, o, gate|up, down [N, K]


def check_dense_gemv() -> None:
    print("dense_gemv against F.linear (fp32 accumulation)")
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    for dtype in (torch.float16, torch.bfloat16):
        for n, k in GEMV_SHAPES[:2] + [(100, 264)]:
            w = torch.randn(n, k, generator=gen, device=DEVICE).to(dtype) * 0.02
            bias = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if n == 100 else None
            for m in (1, 3, 8):
                x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
                ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
                for warps in cuda_backend.GEMV_WARPS_PER_ROW:
                    out = cuda_backend.dense_gemv(x, w, bias, warps_per_row=warps)
                    err = relative_error(out, ref)
                    check(f"dense_gemv {n}x{k} M={m} {dtype} warps/row={warps}", err < TOLERANCE[dtype],
                          f"rel err {err:.2e}")
    # In a CUDA graph, with new inputs at replay.
    w = torch.randn(4096, 4096, generator=gen, device=DEVICE).half() * 0.02
    x = torch.randn(2, 4096, generator=gen, device=DEVICE).half()
    cuda_backend.dense_gemv(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cuda_backend.dense_gemv(x, w)
    x.copy_(torch.randn(2, 4096, generator=gen, device=DEVICE).half())
    graph.replay()
    torch.cuda.synchronize()
    check("dense_gemv graph replay", relative_error(y, x.float() @ w.float().t()) < 2e-3)
    try:
        cuda_backend.dense_gemv(torch.randn(9, 4096, device=DEVICE).half(), w)
        check("dense_gemv refuses 9 rows", False, "no error")
    except ValueError as e:
        check("dense_gemv refuses 9 rows", "rows" in str(e), str(e))


def check_dense_gemv_gated() -> None:
    """gated (silu(gate) * up of gate|up) at 7B's gate|up shape and a small one with bias,
    against the product followed by silu_and_mul in the dtype."""
    print("dense_gemv gated against F.linear + silu_and_mul")
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    for dtype in (torch.float16, torch.bfloat16):
        for n, k in ((22016, 4096), (100, 264)):
            w = torch.randn(n, k, generator=gen, device=DEVICE).to(dtype) * 2 * k**-0.5
            bias = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if n == 100 else None
            for m in (1, 2, 8):
                x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
                y = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
                ref = reference.silu_and_mul(y).float()
                for warps in (1, 2, 4):
                    out = cuda_backend.dense_gemv(x, w, bias, warps_per_row=warps, gated=True)
                    err = relative_error(out, ref)
                    check(f"dense_gemv gated {n}x{k} M={m} {dtype} warps/row={warps}", err < TOLERANCE[dtype],
                          f"rel err {err:.2e}")
    try:
        cuda_backend.dense_gemv(torch.randn(1, 64, device=DEVICE).half(), torch.randn(16, 64, device=DEVICE).half(),
                                warps_per_row=8, gated=True)
        check("dense_gemv gated refuses 8 warps a row", False, "no error")
    except ValueError as e:
        check("dense_gemv gated refuses 8 warps a row", "warps_per_row" in str(e), str(e))


def bench_gated(copies: int = 8) -> None:
    """gate|up at one token, fp16, 4 warps a row, in a CUDA graph over ``copies`` weights:
    the GEMV then Triton's silu_and_mul against the gated GEMV."""
    from asyncgen._ops import triton_backend

    silu_and_mul = triton_backend.ops().silu_and_mul
    gen = torch.Generator(device=DEVICE).manual_seed(12)
    ws = [torch.randn(22016, 4096, generator=gen, device=DEVICE).half() * 4096**-0.5 for _ in range(copies)]
    x = torch.randn(1, 4096, generator=gen, device=DEVICE).half()
    t_plain = 1e3 * cuda_backend.graph_time_ms(lambda w: cuda_backend.launch_dense_gemv(x, w, warps_per_row=4), ws)
    t_two = 1e3 * cuda_backend.graph_time_ms(
        lambda w: silu_and_mul(cuda_backend.launch_dense_gemv(x, w, warps_per_row=4)), ws)
    t_gated = 1e3 * cuda_backend.graph_time_ms(
        lambda w: cuda_backend.launch_dense_gemv(x, w, warps_per_row=4, gated=True), ws)
    print(f"\ngate|up 22016x4096 at one token, fp16, 4 warps a row, CUDA graph over {copies} copies: GEMV "
          f"{t_plain:.1f} us, GEMV + silu_and_mul {t_two:.1f} us, gated GEMV {t_gated:.1f} us", flush=True)


def check_quant_gemv() -> None:
    print("quant_gemv_4bit against dequantize-then-matmul")
    from asyncgen._ops import quant_reference as qref

    gen = torch.Generator(device=DEVICE).manual_seed(8)
    for n, k in GEMV_SHAPES:
        for group in (128, 32):
            groups = k // group
            codes = torch.randint(0, 16, (k, n), generator=gen, device=DEVICE)
            qweight = qref.pack_rows(codes, 4)
            scales = (torch.rand(groups, n, generator=gen, device=DEVICE) * 0.002 + 0.0005).half()
            zeros = torch.randint(0, 16, (groups, n), generator=gen, device=DEVICE).half()
            dense = qref.dequantize(qweight, scales, zeros, 4, group).float()
            for m in (1, 4, 8, 13, 64):  # past 8 rows: tensor cores only
                x = torch.randn(m, k, generator=gen, device=DEVICE).half()
                out = cuda_backend.quant_gemv_4bit(x, qweight, scales, zeros, 4, group)
                err = relative_error(out, x.float() @ dense)
                check(f"quant_gemv_4bit {n}x{k} g{group} M={m}", err < 2e-3, f"rel err {err:.2e}")
                if m <= cuda_backend.GEMV_MAX_ROWS:  # the CUDA-core kernel, which the default leaves aside here
                    out = cuda_backend.launch_quant_gemv_4bit(x, qweight, scales, zeros, group, kernel=1)
                    err = relative_error(out, x.float() @ dense)
                    check(f"quant_gemv_4bit cuda cores {n}x{k} g{group} M={m}", err < 2e-3, f"rel err {err:.2e}")
            del codes, qweight, scales, zeros, dense
    try:
        x = torch.randn(1, 64, device=DEVICE).half()
        cuda_backend.quant_gemv_4bit(x, torch.zeros(4, 8, dtype=torch.int32, device=DEVICE),
                                     torch.ones(1, 8, device=DEVICE).half(), torch.zeros(1, 8, device=DEVICE).half(),
                                     8, 64)
        check("quant_gemv_4bit refuses 8 bits", False, "no error")
    except ValueError as e:
        check("quant_gemv_4bit refuses 8 bits", "bits=8" in str(e), str(e))


# ----------------------------------------------------------------------------------------
# Prompt-chunk attention (csrc/chunk_attention.cuh, chunk_attention_wgmma.cuh)

# (name, seqs as (new, cached) tokens, num_heads, num_kv_heads, head_dim, block_size, graph
# tokens (max_query_len hint) or None)
CHUNK_7B_SHAPES = [
    ("prefix hit 78/992 (80-token graph, 8 slots)", [(78, 992), (2, 0)] + [(0, 0)] * 6, 32, 32, 128, 16, 80),
    ("prefix hit 300/992 (320-token graph, 8 slots)", [(300, 992), (20, 0)] + [(0, 0)] * 6, 32, 32, 128, 16, 320),
    ("1,070 from scratch (1,152-token graph)", [(1070, 0), (82, 0)] + [(0, 0)] * 6, 32, 32, 128, 16, 1152),
    ("512-token chunk over 512 + 63 decodes", [(512, 512)] + [(1, 300 + 7 * i) for i in range(63)], 32, 32, 128, 16,
     None),
    ("4 prompts of 512 from scratch", [(512, 0)] * 4, 32, 32, 128, 16, None),
    ("GQA 4: prefix hit 78/992", [(78, 992), (2, 0)] + [(0, 0)] * 6, 32, 8, 128, 16, 80),
    ("prefix hit 78/3,000 (80-token graph, 8 slots)", [(78, 3000), (2, 0)] + [(0, 0)] * 6, 32, 32, 128, 16, 80),
    ("78 from scratch (80-token graph, 8 slots)", [(78, 0), (2, 0)] + [(0, 0)] * 6, 32, 32, 128, 16, 80),
    ("two prefix hits 40/500 + 38/992 (80-token graph, 8 slots)", [(40, 500), (38, 992), (2, 0)] + [(0, 0)] * 5,
     32, 32, 128, 16, 80),
]


def _chunk_case(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    c = make_chunk_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=block_size, dtype=dtype, seed=seed)
    for name in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"):
        setattr(c, name, getattr(c, name).to(DEVICE))
    return c


def _chunk_reference(c):
    return reference.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.query_start_loc,
                                     c.scale)


def _chunk_op(c, out, splits, counters, kernel=0):
    torch.ops.asyncgen_C.chunk_attention(out, c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens,
                                         c.query_start_loc, counters, c.scale, splits, kernel)
    return out


def _chunk_kernels(head_dim):
    """The kernels that take head_dim here: 0 (mma.sync), and 1 (wgmma) on sm_90."""
    return (0, 1) if head_dim == 128 and cuda_backend.has_wgmma(DEVICE) else (0,)


def check_chunk_attention() -> None:
    print("chunk_attention")
    counters = torch.zeros(1 << 16, dtype=torch.int32, device=DEVICE)
    small = [
        ([(78, 130), (50, 0), (0, 0), (0, 0)], 2, 2, 128, 16),
        ([(70, 0), (5, 61), (1, 40)], 4, 4, 64, 16),
        ([(40, 33), (17, 0)], 8, 2, 64, 32),
        ([(23, 9)], 6, 1, 64, 16),
        ([(300, 700), (129, 0)], 16, 2, 128, 16),
    ]
    shapes = small + [(seqs, h, kvh, d, bs) for _, seqs, h, kvh, d, bs, _ in CHUNK_7B_SHAPES]
    for dtype in (torch.float16, torch.bfloat16):
        for i, (seqs, h, kvh, d, bs) in enumerate(shapes):
            c = _chunk_case(seqs, h, kvh, d, bs, dtype, i)
            ref = _chunk_reference(c)
            for kernel in _chunk_kernels(d):
                for splits in (1, 2, 4, 16):
                    out = _chunk_op(c, torch.full_like(c.q, float("nan")), splits, counters, kernel)
                    err = relative_error(out, ref)
                    check(f"chunk kernel {kernel} {str(dtype)[6:]} seqs={len(seqs)} H={h} KVH={kvh} D={d} bs={bs} "
                          f"splits={splits}", err < TOLERANCE[dtype], f"rel err {err:.2e}")
            # Through the backend's routing, with the engine's hints.
            out = cuda_backend.paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens,
                                               c.query_start_loc, c.scale, max_query_len=max(q for q, _ in seqs),
                                               max_seq_len=max(q + k for q, k in seqs))
            err = relative_error(out, ref)
            check(f"chunk routed {str(dtype)[6:]} seqs={len(seqs)} H={h} D={d}", err < TOLERANCE[dtype],
                  f"rel err {err:.2e}")
    check("chunk counters left at zero", int(counters.abs().sum()) == 0)

    # Captured once, replayed with other lengths (as a prompt graph is).
    for kernel in _chunk_kernels(128):
        c = _chunk_case([(78, 500), (50, 0), (0, 0)], 8, 8, 128, 16, torch.float16, 11)
        out = torch.empty_like(c.q)
        _chunk_op(c, out, 4, counters, kernel)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _chunk_op(c, out, 4, counters, kernel)
        for step, shrink in enumerate((0, 13, 200)):
            c.seq_lens[0] = 578 - shrink
            graph.replay()
            torch.cuda.synchronize()
            err = relative_error(out, _chunk_reference(c))
            check(f"chunk kernel {kernel} graph replay {step}", err < 2e-3, f"rel err {err:.2e}")
        check(f"chunk kernel {kernel} counters zero after replays", int(counters.abs().sum()) == 0)


def bench_chunk_attention(copies: int = 8) -> None:
    """Per call in a CUDA graph over `copies` caches: Triton's general kernel (with the
    engine's hints), the backend's choice, and the csrc kernels at fixed splits."""
    from asyncgen._ops import triton_backend

    print("\nchunk attention, fp16, us per call (CUDA graph over 8 caches)")
    counters = torch.zeros(1 << 16, dtype=torch.int32, device=DEVICE)
    tri = triton_backend.ops().paged_attention
    for name, seqs, h, kvh, d, bs, graph_tokens in CHUNK_7B_SHAPES:
        cases = [_chunk_case(seqs, h, kvh, d, bs, torch.float16, 100 + i) for i in range(copies)]
        outs = [torch.empty_like(c.q) for c in cases]
        mql = graph_tokens or max(q for q, _ in seqs)
        hints = dict(max_query_len=mql, max_seq_len=4096)
        row = {}
        row["triton"] = 1e3 * cuda_backend.graph_time_ms(
            lambda co: tri(co[0].q, co[0].k_cache, co[0].v_cache, co[0].block_tables, co[0].seq_lens,
                           co[0].query_start_loc, co[0].scale, None, co[1], **hints), list(zip(cases, outs)), passes=5)
        row["routed"] = 1e3 * cuda_backend.graph_time_ms(
            lambda co: cuda_backend.paged_attention(co[0].q, co[0].k_cache, co[0].v_cache, co[0].block_tables,
                                                    co[0].seq_lens, co[0].query_start_loc, co[0].scale, None, co[1],
                                                    **hints), list(zip(cases, outs)), passes=5)
        for kernel in _chunk_kernels(d):
            for splits in (1, 2, 4, 8, 16):
                row[f"csrc{kernel} {splits}"] = 1e3 * cuda_backend.graph_time_ms(
                    lambda co, s=splits, k=kernel: _chunk_op(co[0], co[1], s, counters, k), list(zip(cases, outs)),
                    passes=5)
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))


def check_errors() -> None:
    print("argument checks")
    case = Case(seq_lens=[40, 3], num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, fill_nan=False)
    for name, kwargs in [
        ("block_tables", dict(block_tables=case.block_tables.long())),
        ("k_cache", dict(k_cache=case.k_cache.float())),
        ("out", dict(out=torch.empty(2, 4, 64, device=DEVICE, dtype=torch.bfloat16))),
    ]:
        a = dict(out=torch.empty_like(case.q), q=case.q, k_cache=case.k_cache, v_cache=case.v_cache,
                 block_tables=case.block_tables, seq_lens=case.seq_lens)
        a.update(kwargs)
        try:
            torch.ops.asyncgen_C.paged_attention_decode(
                a["out"], a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], 0.1, 40, 0)
            check(f"TORCH_CHECK names {name}", False, "no error raised")
        except RuntimeError as e:
            check(f"TORCH_CHECK names {name}", name in str(e), str(e).splitlines()[0])


# ----------------------------------------------------------------------------------------
# Timing


def bench_us(fn) -> float:
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200) * 1e3
    except ImportError:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / 50


def run_benchmarks() -> list[tuple]:
    try:
        from asyncgen._ops import triton_backend

        triton_attention = triton_backend.ops().paged_attention
    except Exception as e:  # triton missing or broken: time csrc alone
        print(f"(triton decode not timed: {type(e).__name__}: {e})")
        triton_attention = None
    rows = []
    configs = [  # (label, num_heads, num_kv_heads, batch, context)
        ("7B", 32, 32, 1, 1024), ("7B", 32, 32, 1, 4096),
        ("7B", 32, 32, 64, 1024), ("7B", 32, 32, 64, 4096),
        ("7B", 32, 32, 256, 1024), ("7B", 32, 32, 256, 2048),
        ("8B-GQA", 32, 8, 1, 4096), ("8B-GQA", 32, 8, 64, 2048), ("8B-GQA", 32, 8, 256, 4096),
    ]
    for label, num_heads, num_kv_heads, batch, context in configs:
        case = Case(seq_lens=[context] * batch, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=128,
                    dtype=torch.bfloat16, fill_nan=False)
        out = torch.empty_like(case.q)
        gbytes = case.kv_bytes() / 1e9
        t_auto = bench_us(lambda: case.op(out, -1))
        t_single = bench_us(lambda: case.op(out, 0))
        t_triton = float("nan")
        if triton_attention is not None:
            t_triton = bench_us(lambda: triton_attention(
                case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc,
                case.scale, None, out, max_query_len=1, max_seq_len=context))
        rows.append((label, batch, context, gbytes * 1e3, t_auto, gbytes / (t_auto * 1e-6),
                     t_single, t_triton, gbytes / (t_triton * 1e-6)))
        del case, out
        torch.cuda.empty_cache()
    return rows


def bench_dense_gemv_split(copies: int = 8) -> None:
    """The dense GEMV at one row with 1, 2 and 4 warps a row against cuBLAS, as the engine's
    start-up timing sees them: one CUDA graph through ``copies`` copies of each 7B weight
    (more than the L2 holds), also at 7B's long-K shape alone (down_proj)."""
    print(f"\ndense GEMV, one row, fp16, CUDA graph over {copies} weight copies: us per call (GB/s)")
    splits = " | ".join(f"{w} warp(s)/row".rjust(15) for w in cuda_backend.GEMV_WARPS_PER_ROW)
    print(f"{'N x K':<12} | {'cuBLAS':>13} | {splits}")
    gen = torch.Generator(device=DEVICE).manual_seed(10)
    for n, k in GEMV_SHAPES:
        ws = [torch.randn(n, k, generator=gen, device=DEVICE).half() * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device=DEVICE).half()
        out = torch.empty(1, n, dtype=torch.float16, device=DEVICE)
        gb = n * k * 2 / 1e3
        times = [1e3 * cuda_backend.graph_time_ms(lambda w: torch.mm(x, w.t(), out=out), ws)]
        for warps in cuda_backend.GEMV_WARPS_PER_ROW:
            times.append(1e3 * cuda_backend.graph_time_ms(
                lambda w, _w=warps: cuda_backend.launch_dense_gemv(x, w, None, out, warps_per_row=_w), ws))
        print(f"{n}x{k:<6} | " + " | ".join(f"{t:6.1f} ({gb / t:5.0f})" for t in times), flush=True)
        del ws
        torch.cuda.empty_cache()


def run_gemv_benchmarks() -> None:
    """csrc GEMV against cuBLAS (dense) and the Triton 4-bit GEMV at 7B decode shapes."""
    from asyncgen._ops import quant_reference as qref

    try:
        from asyncgen._ops.triton_quant_gemv import quant_gemv as triton_quant_gemv
    except Exception as e:
        print(f"(triton quant GEMV not timed: {e})")
        triton_quant_gemv = None
    print("\nGEMV timing (fp16; us; GB/s of weights read vs ~4.3 TB/s)")
    print(f"{'N x K':<12} {'M':>2} | {'cuBLAS':>7} {'csrc':>7} {'GB/s':>6} | {'4bit triton':>11} {'4bit csrc':>9} {'GB/s':>6}")
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    for n, k in GEMV_SHAPES:
        w = torch.randn(n, k, generator=gen, device=DEVICE).half() * 0.02
        codes = torch.randint(0, 16, (k, n), generator=gen, device=DEVICE)
        qweight = qref.pack_rows(codes, 4)
        scales = (torch.rand(k // 128, n, generator=gen, device=DEVICE) * 0.002).half()
        zeros = torch.randint(0, 16, (k // 128, n), generator=gen, device=DEVICE).half()
        qbytes = qweight.numel() * 4 + scales.numel() * 4
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, generator=gen, device=DEVICE).half()
            t_cublas = bench_us(lambda: torch.nn.functional.linear(x, w))
            t_csrc = bench_us(lambda: cuda_backend.dense_gemv(x, w))
            t_q = bench_us(lambda: cuda_backend.quant_gemv_4bit(x, qweight, scales, zeros, 4, 128))
            t_tq = float("nan")
            if triton_quant_gemv is not None and m <= 8:
                t_tq = bench_us(lambda: triton_quant_gemv(x, qweight, scales, zeros, 4, 128))
            print(f"{n}x{k:<6} {m:>2} | {t_cublas:>7.1f} {t_csrc:>7.1f} {w.numel() * 2 / t_csrc / 1e3:>6.0f} | "
                  f"{t_tq:>11.1f} {t_q:>9.1f} {qbytes / t_q / 1e3:>6.0f}", flush=True)
        del w, codes, qweight, scales, zeros
        torch.cuda.empty_cache()


def print_table(rows) -> None:
    print(f"\ndecode timing (head_dim 128, bf16), GB/s of K/V read vs ~{PEAK_GBPS / 1e3:.1f} TB/s")
    header = (f"{'shape':<7} {'batch':>5} {'ctx':>5} {'KV MB':>8} | {'csrc us':>8} {'GB/s':>6} {'%peak':>5} | "
              f"{'1-pass us':>9} | {'triton us':>9} {'GB/s':>6} {'speedup':>8}")
    print(header)
    print("-" * len(header))
    for label, batch, ctx, mb, t, gbps, t1, tt, tgbps in rows:
        speedup = tt / t if not math.isnan(tt) else float("nan")
        print(f"{label:<7} {batch:>5} {ctx:>5} {mb:>8.1f} | {t:>8.1f} {gbps:>6.0f} {100 * gbps / PEAK_GBPS:>5.0f} | "
              f"{t1:>9.1f} | {tt:>9.1f} {tgbps:>6.0f} {speedup:>7.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer correctness shapes")
    parser.add_argument("--no-bench", action="store_true", help="skip the timing")
    parser.add_argument("--rotary-only", action="store_true",
                        help="only the fused rotary + decode attention: its checks and timing")
    parser.add_argument("--rotary-store-only", action="store_true",
                        help="only the fused rotary + cache write: its checks and timing")
    parser.add_argument("--chunk-only", action="store_true",
                        help="only the prompt-chunk attention: its checks and timing")
    parser.add_argument("--gemv-only", action="store_true",
                        help="only the dense GEMV: its checks and its timing by warps per row")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    if not cuda_backend.is_available():
        print(f"asyncgen._C does not load: {cuda_backend._load()[1]}\n{cuda_backend.BUILD_HINT}")
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cuda {torch.version.cuda}")

    steps = [check_store_kv_cache, check_rotary_store_kv, lambda: check_rotary_attention(args.quick),
             lambda: check_decode(args.quick), check_cuda_graph, check_launcher, check_dense_gemv, check_dense_gemv_gated,
             check_quant_gemv, check_chunk_attention,
             check_errors]
    if args.rotary_only:
        steps = [lambda: check_rotary_attention(args.quick)]
    if args.gemv_only:
        steps = [check_dense_gemv, check_dense_gemv_gated, bench_dense_gemv_split, bench_gated]
    if args.chunk_only:
        steps = [check_chunk_attention] + ([] if args.no_bench else [bench_chunk_attention])
    if args.rotary_store_only:
        steps = [check_rotary_store_kv] + ([] if args.no_bench else [bench_rotary_store_kv])
    one_op = args.gemv_only or args.chunk_only or args.rotary_store_only
    for step in steps:
        try:
            step()
        except Exception:
            traceback.print_exc()
            failures.append(f"{getattr(step, '__name__', 'check')}: raised")
        torch.cuda.synchronize()

    if not args.no_bench and not one_op:
        try:
            bench_rotary_attention()
        except Exception:
            traceback.print_exc()
            failures.append("bench_rotary_attention: raised")
    rows = [] if args.no_bench or args.rotary_only or one_op else run_benchmarks()
    if rows:
        print_table(rows)
    if not args.no_bench and not args.rotary_only and not one_op:
        bench_rotary_store_kv()
        bench_dense_gemv_split()
        bench_chunk_attention()
        run_gemv_benchmarks()
    print(f"\n{num_checks} checks, {len(failures)} failed")
    for f in failures:
        print(f"  {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
