"""The GPU's memory ceilings for a decode step: copy bandwidth, read-only bandwidth, and
what cuBLAS reaches on the 7B decode products at one row.

A batch-1 decode step mostly reads weights, so its floor is set by how fast the GPU can
*read*, which is not the copy figure (a copy also writes). Measured here:

* copy: ``dst.copy_(src)`` over 4 GiB, counting bytes read plus bytes written;
* read: a Triton kernel that sums 4 GiB of fp16 in 16-byte vectors (one fp32 per
  program written back), counting bytes read;
* the four Llama-2-7B products at one row (``F.linear``, fp16), each over 32 copies of its
  weight in turn inside a CUDA graph (as the 32 layers of a step; past L2), in GB/s of
  weight read and as a share of the read ceiling.

    python3 benchmarks/read_bandwidth.py

Each figure is the best of 5 timed passes after a warm-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GiB = 1 << 30
SHAPES = {"q|k|v": (12288, 4096), "o_proj": (4096, 4096), "gate|up": (22016, 4096), "down_proj": (4096, 11008)}


@triton.jit
def _sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def _best_ms(fn, passes: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def main() -> None:
    torch.manual_seed(0)
    n = 4 * GiB // 2
    src = torch.randn(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _best_ms(lambda: dst.copy_(src))
    copy_tbs = 2 * 4 * GiB / copy_ms / 1e9
    del dst

    block, iters = 4096, 8
    grid = (triton.cdiv(n, block * iters),)
    partial = torch.empty(grid[0], dtype=torch.float32, device="cuda")
    read_ms = _best_ms(lambda: _sum_kernel[grid](src, partial, n, BLOCK=block, ITERS=iters, num_warps=8))
    read_tbs = 4 * GiB / read_ms / 1e9
    ok = torch.allclose(partial.sum(), src.float().sum(), rtol=1e-3, atol=1.0)
    print(f"copy {copy_tbs:.2f} TB/s (read + write); read {read_tbs:.2f} TB/s (sum {'checked' if ok else 'WRONG'})")
    del src, partial

    x = torch.randn(1, 4096, dtype=torch.float16, device="cuda")
    print(f"{'product':>10} {'N x K':>12} {'us/call':>8} {'TB/s':>6} {'of read':>8}")
    for name, (rows, k) in SHAPES.items():
        xs = x if k == 4096 else torch.randn(1, k, dtype=torch.float16, device="cuda")
        weights = [torch.randn(rows, k, dtype=torch.float16, device="cuda") for _ in range(32)]
        for w in weights[:2]:
            torch.nn.functional.linear(xs, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                torch.nn.functional.linear(xs, w)
        us = _best_ms(graph.replay) * 1000 / len(weights)
        tbs = rows * k * 2 / us / 1e6
        print(f"{name:>10} {rows:>6}x{k:<5} {us:8.1f} {tbs:6.2f} {tbs / read_tbs * 100:7.0f}%")
        del weights, graph


if __name__ == "__main__":
    main()
