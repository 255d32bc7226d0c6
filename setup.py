"""Builds asyncgen, with the csrc CUDA extension ``asyncgen._C`` where it can be built.

Metadata lives in pyproject.toml; this file only adds the extension. It is built when
all of these hold, and skipped (a plain pure-Python install) otherwise:

- ``ASYNCGEN_SKIP_CUDA`` is unset (or 0/false/no),
- torch imports and is a CUDA build (``torch.version.cuda``),
- a CUDA toolkit is found (``CUDA_HOME``, or ``nvcc`` on PATH).

Typical commands on a GPU host (no network needed)::

    python3 setup.py build_ext --inplace          # asyncgen/_C*.so next to the sources
    pip install -e . --no-build-isolation         # the same through pip

(pip's default isolated build has no torch, so it installs without the extension.)

Target architectures: ``TORCH_CUDA_ARCH_LIST`` (torch's variable, e.g. ``"9.0a"``) when set;
else ``ASYNCGEN_CUDA_ARCHS`` (e.g. ``"90a"``, ``"80;90a"``, ``"90+PTX"``); else sm_90a. A build
with sm_90a code (Hopper's arch-specific instructions) also has the warpgroup (wgmma)
4-bit GEMM; ``90`` without the ``a`` leaves it out.
``MAX_JOBS`` bounds parallel compiles as usual for torch extensions.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup

CSRC_SOURCES = [
    "csrc/bindings.cpp",
    "csrc/cache_kernels.cu",
    "csrc/chunk_attention.cu",
    "csrc/gemv.cu",
    "csrc/paged_attention.cu",
    "csrc/paged_attention_bf16.cu",
    "csrc/paged_attention_fp16.cu",
]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _gencode_flags(archs: str) -> list[str]:
    """``"80;9.0;90+PTX"`` -> nvcc -gencode flags (+PTX also embeds PTX for that arch)."""
    flags = []
    for item in archs.replace(",", ";").replace(" ", ";").split(";"):
        item = item.strip()
        if not item:
            continue
        ptx = item.endswith("+PTX")
        arch = item.removesuffix("+PTX").replace(".", "")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def _has_sm90a(archs: str) -> bool:
    """Whether an arch list (``"80;90a"``, ``"8.0 9.0a+PTX"``) has sm_90a code."""
    items = archs.replace(",", ";").replace(" ", ";").split(";")
    return any(item.strip().removesuffix("+PTX").replace(".", "") == "90a" for item in items)


def _cuda_extension():
    """(extension or None, reason it was skipped)."""
    if _env_flag("ASYNCGEN_SKIP_CUDA"):
        return None, "ASYNCGEN_SKIP_CUDA is set"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None, "torch is not importable here"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is not a CUDA build"
    if cpp_extension.CUDA_HOME is None:
        return None, "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"

    nvcc_flags = ["-O3", "-lineinfo"]
    cxx_flags = ["-O3"]
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not archs:
        # torch adds no arch flags of its own once one is given here.
        archs = os.environ.get("ASYNCGEN_CUDA_ARCHS", "90a")
        nvcc_flags += _gencode_flags(archs)
    if _has_sm90a(archs):
        nvcc_flags.append("-DAG_WGMMA")
        cxx_flags.append("-DAG_WGMMA")
    extension = cpp_extension.CUDAExtension(
        name="asyncgen._C",
        sources=CSRC_SOURCES,
        depends=sorted(glob.glob("csrc/*.cuh") + glob.glob("csrc/*.h")),  # rebuild on header edits
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    return extension, ""


def _setup_kwargs() -> dict:
    extension, reason = _cuda_extension()
    if extension is None:
        print(f"asyncgen: building without the CUDA extension: {reason}", file=sys.stderr)
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**_setup_kwargs())
