"""The ``"triton"`` backend: one Triton kernel per op, each behind a typed launcher.

Every launcher has the signature of its reference in :mod:`asyncgen._ops.reference`
(some add keyword-only options), checks its arguments before launching and raises
``ValueError`` naming the offending argument. Launchers never synchronise with the device
(no ``.item()``, no ``.tolist()``): launch configurations depend only on shapes, dtypes
and optional hints, so a decode step can be captured in a CUDA graph.

Tensors must live on one CUDA device, or on the CPU when ``TRITON_INTERPRET=1`` was set
before the kernel modules were imported (the Triton interpreter; how the tests run).

This module also holds the argument checks the kernel modules share; the kernel modules
import it, and :func:`ops` imports them lazily, so there is no import cycle.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import Ops

__all__ = ["ops"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# Streaming multiprocessors assumed when the device cannot be asked (the interpreter).
DEFAULT_NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def ops() -> Ops:
    """The op bundle whose functions launch Triton kernels (``rotary_store_kv``: the
    rotary kernel, then the cache-write kernel; ``rotary_attention``: those, then
    attention)."""
    from . import compose_rotary_attention
    from .triton_activation import silu_and_mul
    from .triton_kv_cache import store_kv_cache
    from .triton_paged_attention import paged_attention
    from .triton_rms_norm import rms_norm
    from .triton_rotary import rotary_embedding

    def rotary_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping) -> None:
        rotary_embedding(positions, q, k, cos_sin_cache)
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    return Ops("triton", rms_norm, rotary_embedding, silu_and_mul, store_kv_cache, paged_attention, rotary_store_kv,
               compose_rotary_attention(rotary_store_kv, paged_attention))


# ----------------------------------------------------------------------------------------
# Shared launcher checks.


try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - every supported triton has it
    _InterpretedFunction = None


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was defined under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return _InterpretedFunction is not None and isinstance(kernel, _InterpretedFunction)


@functools.lru_cache(maxsize=None)
def dependent_launch_enabled() -> bool:
    """Whether kernels may start before the one ahead of them finishes (Hopper's
    programmatic dependent launch); ``ASYNCGEN_PDL=0`` in the environment at the first
    launch turns it off (read once per process)."""
    return os.environ.get("ASYNCGEN_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _compute_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def launches_dependents(kernel: object, t: torch.Tensor) -> bool:
    """Whether ``kernel`` (a Triton kernel about to run on ``t``'s device) should signal,
    once it may read its inputs (:func:`chain_prologue`), that the next kernel may launch:
    on sm_90+ GPUs, where the csrc one-row GEMV is launched as a dependent and prefetches
    its weights while this kernel runs. The signal has no effect where the next kernel is
    launched the ordinary way."""
    return (
        t.is_cuda
        and not is_interpreted(kernel)
        and dependent_launch_enabled()
        and _compute_major(t.device.index) >= 9  # a CUDA tensor's device always has an index
    )


@functools.lru_cache(maxsize=None)
def _triton_launches_pdl() -> bool:
    """Whether this Triton takes the ``launch_pdl`` launch option (its CUDA backend)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


# Rows (tokens) up to which the Triton elementwise kernels are launched as dependents: the
# decode batches whose products are the csrc GEMVs, the only kernels ahead of them that
# signal early. Past it the kernel ahead is a cuBLAS or Triton GEMM, which never signals,
# so the dependent launch has nothing to overlap (the 7B decode step at batch 64 took
# 8.08 ms with it at every row count and 8.04 ms with this limit; docs/BENCHMARKS.md).
DEPENDENT_MAX_ROWS = 8


def chain_options(kernel: object, t: torch.Tensor) -> dict:
    """The launch arguments of a :func:`chain_prologue` kernel about to run on ``t``:
    ``LAUNCH_DEPENDENTS`` (:func:`launches_dependents`), and ``DEPENDENT`` with the
    ``launch_pdl`` option, true for ``t`` of at most :data:`DEPENDENT_MAX_ROWS` rows
    where the kernel signals and Triton has the option. A dependent kernel may start
    while a csrc product that signals early is finishing; it waits (``gdc_wait``) before
    touching anything that product writes."""
    signals = launches_dependents(kernel, t)
    dependent = signals and t.shape[0] <= DEPENDENT_MAX_ROWS and _triton_launches_pdl()
    options = {"LAUNCH_DEPENDENTS": signals, "DEPENDENT": dependent}
    if dependent:
        options["launch_pdl"] = True
    return options


@triton.jit
def chain_prologue(DEPENDENT: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
    """The first thing a kernel of the decode step's launch chain does (its two flags from
    :func:`chain_options`): with DEPENDENT wait for the kernel ahead, then, with
    LAUNCH_DEPENDENTS, let the next kernel launch and wait
    for this one's output. Only after the wait: signalled before it, the kernel after next
    could be placed on the SMs while the kernel ahead still runs, which slowed the AWQ
    decode step."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()


def dependent_launch_options(kernel: object, t: torch.Tensor) -> dict:
    """:func:`chain_options` without ``LAUNCH_DEPENDENTS``: the dependent launch alone."""
    options = chain_options(kernel, t)
    del options["LAUNCH_DEPENDENTS"]
    return options


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Raises ``ValueError`` naming ``name`` unless ``t`` is a tensor of the given rank and
    dtype whose innermost dimension has stride 1 (the kernels address the others by
    stride)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if t.dim() > 0 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_devices(kernel: object, **tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device that ``kernel`` can run on; returns that device."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all tensors must share a device")
    if device is None:
        raise ValueError("no tensor arguments given")
    if device.type == "cpu":
        if not is_interpreted(kernel):
            raise ValueError(
                f"{first} is on the CPU; Triton kernels run on CPU tensors only under "
                "TRITON_INTERPRET=1, set before asyncgen._ops.triton_* modules are imported"
            )
    elif device.type != "cuda":
        raise ValueError(f"{first} is on {device}; the triton backend needs CUDA tensors")
    elif device.index != torch.cuda.current_device():
        # Triton launches on the current device, whatever the tensors' device.
        raise ValueError(
            f"{first} is on {device} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
            "call torch.cuda.set_device first"
        )
    return device


def check_out(name: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """``out`` (when given) must have exactly this shape and dtype, last dim contiguous."""
    if out is None:
        return
    check_tensor(name, out, dtypes=(dtype,))
    check_shape(name, out, shape)


def flatten_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, last]`` view without copying; rows are addressed by stride.

    A 2-D tensor keeps its row stride; a higher-rank one must be viewable (its leading
    dimensions mergeable), else ``ValueError``.
    """
    if t.dim() == 2:
        return t
    if t.dim() == 1:
        return t.unsqueeze(0)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows "
            "without a copy; pass a contiguous tensor"
        ) from None


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached; :data:`DEFAULT_NUM_SMS` on CPU)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
