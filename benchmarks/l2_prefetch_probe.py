"""Whether o_proj's weight can be read into L2 while a prefix-cache hit's attention runs,
so that the product after it reads from L2 instead of HBM (Llama-2-7B shapes, fp16, on a
GPU).

At a prefix-cache hit (78 new tokens over 992 cached, the engine's 80-token prompt graph
with 8 sequence slots) a layer's attention reads 17.5 MB of K/V in about 24 µs, a small
share of what HBM can move in that time, and o_proj (80 × 4096 × 4096, 33.5 MB of
weight) comes right after it. Each variant runs in a CUDA graph over 8 layers' caches and
weights (more than L2 holds), µs a layer:

- ``attention``, ``o_proj``, ``prefetch``: each alone;
- ``attention -> o_proj``: as the engine runs them;
- ``attention | prefetch(o_proj) -> o_proj``: a Triton kernel on a second stream reads
  the weight (loads marked evict_last) while the attention runs; o_proj waits for both.
  ``--programs`` sets the prefetch kernel's blocks, ``--fraction`` how much of the
  weight it reads (from the start).

    PYTHONPATH=. python3 benchmarks/l2_prefetch_probe.py [--programs 16 32 66] [--fraction 0.5 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunk_split_profile import SHAPES, cases  # noqa: E402

from asyncgen._ops import cuda_backend, triton_backend  # noqa: E402

LAYERS = 8
HIDDEN = 4096
GRAPH_TOKENS = 80


@triton.jit
def _prefetch_kernel(w_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, per_program, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int, fraction: float) -> None:
    n = int(w.numel() * fraction)
    block = 4096
    per_program = triton.cdiv(triton.cdiv(n, programs), block) * block
    _prefetch_kernel[(programs,)](w, sink, n, per_program, BLOCK=block, num_warps=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 32, 66])
    parser.add_argument("--fraction", type=float, nargs="+", default=[0.5, 1.0])
    args = parser.parse_args()
    layers = [
        (c, out, torch.randn(HIDDEN, HIDDEN, dtype=torch.float16, device="cuda") / 64,
         torch.empty(GRAPH_TOKENS, HIDDEN, dtype=torch.float16, device="cuda"))
        for c, out in cases(SHAPES["78/992"], LAYERS)
    ]
    attention = triton_backend.ops().paged_attention
    sink = torch.zeros(1024, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()

    def attend(layer):
        c, out, _, _ = layer
        attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, c.query_start_loc, c.scale, None, out,
                  max_query_len=GRAPH_TOKENS, max_seq_len=4096)

    def o_proj(layer):
        _, out, w, y = layer
        torch.mm(out.view(GRAPH_TOKENS, HIDDEN), w.t(), out=y)

    def overlapped(layer, programs, fraction):
        main = torch.cuda.current_stream()
        fork, join = torch.cuda.Event(), torch.cuda.Event()
        fork.record(main)
        side.wait_event(fork)
        with torch.cuda.stream(side):
            prefetch(layer[2], sink, programs, fraction)
            join.record(side)
        attend(layer)
        main.wait_event(join)
        o_proj(layer)

    def t(fn):
        return 1e3 * cuda_backend.graph_time_ms(fn, layers, passes=5)

    base = {}
    base["attention"] = t(attend)
    base["o_proj"] = t(o_proj)
    base["attention -> o_proj"] = t(lambda layer: (attend(layer), o_proj(layer)))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("µs a layer (CUDA graph over 8 layers)")
    for name, value in base.items():
        print(f"  {name:<45} {value:7.1f}")
    # The overlapped product must equal the plain one.
    ref = [None] * LAYERS
    for i, layer in enumerate(layers):
        attend(layer)
        o_proj(layer)
        ref[i] = layer[3].clone()
    for programs in args.programs:
        for fraction in args.fraction:
            alone = t(lambda layer, p=programs, f=fraction: prefetch(layer[2], sink, p, f))
            both = t(lambda layer, p=programs, f=fraction: overlapped(layer, p, f))
            same = all(torch.equal(layer[3], r) for layer, r in zip(layers, ref))
            print(f"  prefetch {fraction:.0%} of the weight, {programs} blocks: alone {alone:6.1f}; "
                  f"attention | prefetch -> o_proj {both:7.1f} (outputs {'equal' if same else 'DIFFER'})")


if __name__ == "__main__":
    main()
