"""Times the csrc prompt-chunk attention kernels (csrc/chunk_attention.cuh, mma.sync:
kernel 0; chunk_attention_wgmma.cuh, warpgroup: kernel 1) at 1, 2 and 4 context splits
on a prefix-cache hit's shapes (Llama-2-7B, fp16: 32 heads, head_dim 128, cache blocks of
16), and runs them eagerly for ``ncu``:

- ``78/992``: 78 new tokens over 992 cached in the 80-token prompt graph's 8 sequence
  slots (a 2-token padding sequence, six empty slots), as the engine runs it;
- ``78 scratch``: the same graph with no cached prefix (one or two key tiles);
- ``78/992 alone``: the 78 tokens as the only sequence (no padding, no empty slots).

``time`` replays each call in a CUDA graph over 8 KV caches (µs per call); ``profile``
runs each configuration twice, eagerly, for a profiler to catch (``--shapes`` picks some)::

    PYTHONPATH=. python3 benchmarks/chunk_split_profile.py time
    PYTHONPATH=. ncu --clock-control none -k regex:chunk_attention --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats --section SourceCounters \
        --section InstructionStats --print-details all \
        python3 benchmarks/chunk_split_profile.py profile --shapes "78/992 alone"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from check_csrc_ops import _chunk_case, _chunk_op  # noqa: E402  (the GPU check's case builder and op call)

from asyncgen._ops import cuda_backend  # noqa: E402

SHAPES = {
    "78/992": [(78, 992), (2, 0)] + [(0, 0)] * 6,
    "78 scratch": [(78, 0), (2, 0)] + [(0, 0)] * 6,
    "78/992 alone": [(78, 992)],
}


def cases(seqs, copies: int = 8):
    """(case on the GPU, output buffer) for each of `copies` seeds, 7B shapes, fp16."""
    out = []
    for i in range(copies):
        c = _chunk_case(seqs, 32, 32, 128, 16, torch.float16, 100 + i)
        out.append((c, torch.empty_like(c.q)))
    return out


def call(item, splits: int, kernel: int, counters: torch.Tensor) -> None:
    _chunk_op(item[0], item[1], splits, counters, kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["time", "profile"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    module, why = cuda_backend._load()
    if module is None:
        sys.exit(f"asyncgen._C does not load: {why}\n{cuda_backend.BUILD_HINT}")
    kernels = (0, 1) if cuda_backend.has_wgmma(torch.device("cuda")) else (0,)
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    for name in args.shapes:
        items = cases(SHAPES[name])
        for kernel in kernels:
            for splits in (1, 2, 4):
                if args.mode == "time":
                    t = 1e3 * cuda_backend.graph_time_ms(lambda it, s=splits, k=kernel: call(it, s, k, counters),
                                                         items, passes=5)
                    print(f"{name} kernel {kernel} splits {splits}: {t:.1f} us", flush=True)
                else:
                    for item in items[:2]:
                        call(item, splits, kernel, counters)
                    torch.cuda.synchronize()
                    print(f"ran {name} kernel {kernel} splits {splits} twice", flush=True)


if __name__ == "__main__":
    main()
