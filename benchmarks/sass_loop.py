"""Counts the instructions of a csrc kernel's main loop in its SASS, without a GPU.

Compiles one instantiation of a kernel template from ``csrc/`` to a cubin with ``nvcc``,
disassembles it with ``cuobjdump -sass``, finds the loop (a backward branch and the
instructions up to its target) that holds the most ``HMMA`` instructions, and prints its
length, its ``HMMA`` count and its instruction mix. The default is the tiled 4-bit GEMM
at 64 rows and 4 warps, whose stage loop docs/BENCHMARKS.md counts::

    python3 benchmarks/sass_loop.py [--header quant_gemm.cuh] \\
        [--kernel "asyncgen::quant_gemm_4bit_tiled_kernel<8, 4>(const asyncgen::QuantGemmParams)"] \\
        [--csrc DIR] [--arch sm_90a] [-D AG_QGEMM_STAGES=3]

Needs ``nvcc`` and ``cuobjdump`` (the CUDA toolkit, or the ``nvidia-cuda-cuobjdump`` wheel;
``$CUOBJDUMP`` names its binary).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
DEFAULT_KERNEL = "asyncgen::quant_gemm_4bit_tiled_kernel<8, 4>(const asyncgen::QuantGemmParams)"
LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);")
TARGET = re.compile(r"BRA\b.*?(0x[0-9a-f]+)")


def opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]) if words else ""


def hottest_loop(sass: str) -> list[str]:
    """The instructions of the loop with the most HMMA (empty if there is none)."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(LINE.match, sass.splitlines()) if m]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    best: list[str] = []
    for i, (addr, text) in enumerate(ins):
        m = TARGET.search(text)
        if not m or int(m.group(1), 16) >= addr or int(m.group(1), 16) not in index:
            continue
        body = [t for _, t in ins[index[int(m.group(1), 16)] : i + 1]]
        if sum("HMMA" in t for t in body) > sum("HMMA" in t for t in best):
            best = body
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--header", default="quant_gemm.cuh")
    ap.add_argument("--kernel", default=DEFAULT_KERNEL, help="the instantiation, as C++ (template args and signature)")
    ap.add_argument("--csrc", default=str(CSRC), help="the csrc directory to compile from")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a macro, NAME=VALUE")
    args = ap.parse_args()
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not shutil.which("nvcc") or not cuobjdump:
        print("needs nvcc and cuobjdump on PATH (or $CUOBJDUMP)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        unit, cubin = Path(tmp) / "unit.cu", Path(tmp) / "unit.cubin"
        unit.write_text(f'#include "{args.header}"\ntemplate __global__ void {args.kernel};\n')
        arch = args.arch.removeprefix("sm_")
        subprocess.run(["nvcc", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-O3", "-std=c++17", f"-I{args.csrc}",
                        *(f"-D{d}" for d in args.defines), "-cubin", "-o", str(cubin), str(unit)], check=True)
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    loop = hottest_loop(sass)
    if not loop:
        print("no loop with HMMA instructions found", file=sys.stderr)
        return 1
    hmma = sum("HMMA" in t for t in loop)
    print(f"{args.kernel}: the loop has {len(loop)} instructions, {hmma} HMMA ({len(loop) / hmma:.2f} per HMMA)")
    mix = collections.Counter(opcode(t) for t in loop)
    print("  " + ", ".join(f"{op} {n}" for op, n in mix.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
