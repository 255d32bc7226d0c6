"""cuBLASLt matrix products with a chosen algorithm, through the library torch loaded.

``torch.nn.functional.linear`` asks cuBLAS for its one heuristic pick per shape. For the
skinny products of decode batches and short prompt chunks (tens to a few hundred rows
against 7B-sized weights) that pick can leave the GPU partly idle: a tile grid of 1.3 or
1.5 waves, or a split-K whose reduction runs as a second kernel. cuBLASLt lists several
algorithms for a shape (``cublasLtMatmulAlgoGetHeuristic``), and the fastest of them,
timed on the device, can be run instead (:func:`choose_dense_algos` in ``cuda_backend``).

The library is the ``libcublasLt`` that torch's own cuBLAS loaded into the process (found
in ``/proc/self/maps``), reached through ``ctypes``: no headers, no link step, the same
version torch runs. The calls cost host time (a few microseconds each), so the engine
chooses algorithms only for the row counts its CUDA graphs run, whose capture pays that
cost once (an eager step of such a row count pays it per call).

Row-major ``out [M, N] = x [M, K] @ weight[N, K]^T (+ bias)`` is, in cuBLAS's column-major
terms, ``out^T [N, M] = op_T(weight) [N, K] @ x^T [K, M]``: A is the weight (transposed),
B is x, D is out, all contiguous (leading dimensions K, K and N). Accumulation and
scaling are fp32, as torch's own fp16/bf16 products.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass

import torch

__all__ = ["Algo", "LtMatmul", "LtRoute", "available"]

# Values of the public cuBLASLt enums (cublasLt.h, cublas_api.h, library_types.h).
_CUBLAS_COMPUTE_32F = 68
_CUDA_R_32F = 0
_CUDA_TYPES = {torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_OP_N, _OP_T = 0, 1
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_STATUS_SUCCESS = 0
# Pointers the algorithms may assume: torch's allocator gives 512-byte aligned blocks, and
# cuBLASLt's heuristics assume 256 unless told otherwise.
_ALIGNMENT = 256


class _AlgoStruct(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t


class _HeuristicResult(ctypes.Structure):
    _fields_ = [  # cublasLtMatmulHeuristicResult_t
        ("algo", _AlgoStruct),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@dataclass(frozen=True)
class Algo:
    """One algorithm of a shape: its opaque 64 bytes, the workspace it needs and the waves
    of thread blocks cuBLASLt expects it to launch."""

    data: tuple[int, ...]
    workspace_size: int
    waves: float
    rank: int  # position in cuBLASLt's heuristic order (0: its first pick)

    @functools.cached_property
    def struct(self) -> _AlgoStruct:
        """The algorithm as cublasLtMatmul takes it (built once)."""
        a = _AlgoStruct()
        a.data[:] = self.data
        return a


class _Library:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, vp, i, sz = ctypes.POINTER, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "cublasLtCreate": [p(vp)],
            "cublasLtMatmulDescCreate": [p(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatrixLayoutCreate": [p(vp), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [p(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, p(_HeuristicResult), p(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, p(_AlgoStruct), vp, sz, vp],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.lib = lib
        self._handles: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def check(self, status: int, what: str) -> None:
        if status != _STATUS_SUCCESS:
            raise RuntimeError(f"cuBLASLt {what} failed with status {status}")

    def handle(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            h = self._handles.get(device)
            if h is None:
                h = ctypes.c_void_p()
                with torch.cuda.device(device):
                    self.check(self.lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
                self._handles[device] = h
            return h


def _loaded_path() -> str | None:
    """The path of the libcublasLt mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.count(" ") >= 5 else ""
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=None)
def _library() -> _Library | None:
    if not torch.cuda.is_available():
        return None
    path = _loaded_path()
    if path is None:
        # cuBLAS (which loads cuBLASLt) is loaded on the first product.
        a = torch.zeros(16, 16, dtype=torch.float16, device="cuda")
        torch.matmul(a, a)
        torch.cuda.synchronize()
        path = _loaded_path()
    if path is None:
        return None
    try:
        return _Library(path)
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """Whether a CUDA device is present and torch's cuBLASLt could be bound, unless
    ``ASYNCGEN_CUBLASLT=0`` is set (then every product stays with ``F.linear``). Never
    raises."""
    if os.environ.get("ASYNCGEN_CUBLASLT", "").strip() == "0":
        return False
    try:
        return _library() is not None
    except Exception:  # a broken CUDA setup counts as unavailable
        return False


class LtMatmul:
    """``out [m, n] = x [m, k] @ weight [n, k]^T (+ bias [n])`` of one shape and dtype, all
    contiguous.

    Holds the cuBLASLt descriptors of the shape; :meth:`algos` lists its algorithms and
    :meth:`run` launches one on the current stream. Not safe to share between threads
    that run it at the same time (the bias pointer is a descriptor attribute).
    """

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool, device: int):
        lib = _library()
        if lib is None:
            raise RuntimeError("cuBLASLt is not available (no CUDA device, or torch's libcublasLt was not found)")
        if dtype not in _CUDA_TYPES:
            raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
        if min(m, n, k) < 1:
            raise ValueError(f"m, n and k must be positive, got {(m, n, k)}")
        self.m, self.n, self.k, self.dtype, self.has_bias, self.device = m, n, k, dtype, has_bias, device
        self._lib = lib
        self._handle = lib.handle(device)
        f, check, ct = lib.lib, lib.check, _CUDA_TYPES[dtype]
        self._desc = ctypes.c_void_p()
        check(f.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _CUBLAS_COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N),
                            (_DESC_EPILOGUE, _EPILOGUE_BIAS if has_bias else _EPILOGUE_DEFAULT)):
            v = ctypes.c_int(value)
            check(f.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(v), ctypes.sizeof(v)), "DescSetAttribute")
        self._a, self._b, self._d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(f.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), ct, k, n, k), "MatrixLayoutCreate")  # weight
        check(f.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), ct, k, m, k), "MatrixLayoutCreate")  # x
        check(f.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), ct, n, m, n), "MatrixLayoutCreate")  # out
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._bias_ptr = ctypes.c_void_p(0)

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        f = lib.lib
        for layout in (getattr(self, "_a", None), getattr(self, "_b", None), getattr(self, "_d", None)):
            if layout:
                f.cublasLtMatrixLayoutDestroy(layout)
        if getattr(self, "_desc", None):
            f.cublasLtMatmulDescDestroy(self._desc)

    def algos(self, max_count: int = 32, workspace_bytes: int = 32 << 20) -> list[Algo]:
        """Up to ``max_count`` algorithms cuBLASLt offers for the shape that need at most
        ``workspace_bytes`` of workspace, in its heuristic order."""
        f, check = self._lib.lib, self._lib.check
        pref = ctypes.c_void_p()
        check(f.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            ws = ctypes.c_uint64(workspace_bytes)
            check(f.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                         ctypes.sizeof(ws)), "PreferenceSetAttribute")
            results = (_HeuristicResult * max_count)()
            returned = ctypes.c_int(0)
            status = f.cublasLtMatmulAlgoGetHeuristic(self._handle, self._desc, self._a, self._b, self._d, self._d,
                                                      pref, max_count, results, ctypes.byref(returned))
            if status != _STATUS_SUCCESS:
                return []
            return [Algo(tuple(r.algo.data), int(r.workspace_size), float(r.waves), i)
                    for i, r in enumerate(results[: returned.value]) if r.state == _STATUS_SUCCESS]
        finally:
            f.cublasLtMatmulPreferenceDestroy(pref)

    def accepts(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the tensors have this plan's shapes, dtype, device, strides and the
        pointer alignment its algorithms assume."""
        tensors = [out, x, weight] + ([bias] if bias is not None else [])
        return (
            (bias is not None) == self.has_bias
            and all(t.dtype == self.dtype and t.is_cuda and t.device.index == self.device for t in tensors)
            and tuple(x.shape) == (self.m, self.k) and x.is_contiguous()
            and tuple(weight.shape) == (self.n, self.k) and weight.is_contiguous()
            and tuple(out.shape) == (self.m, self.n) and out.is_contiguous()
            and (bias is None or (tuple(bias.shape) == (self.n,) and bias.is_contiguous()))
            and all(t.data_ptr() % _ALIGNMENT == 0 for t in tensors)
        )

    def run(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, algo: Algo,
            workspace: torch.Tensor | None) -> None:
        """Launches ``algo`` on the current stream. The caller has checked :meth:`accepts`
        once for these tensors' layout; ``workspace`` (uint8, on the device) holds at least
        ``algo.workspace_size`` bytes, and no other launch uses it at the same time."""
        f = self._lib.lib
        if bias is not None:
            self._bias_ptr.value = bias.data_ptr()
            f.cublasLtMatmulDescSetAttribute(self._desc, _DESC_BIAS_POINTER, ctypes.byref(self._bias_ptr),
                                             ctypes.sizeof(self._bias_ptr))
        ws_size = algo.workspace_size
        if ws_size and (workspace is None or workspace.numel() < ws_size):
            raise ValueError(f"the algorithm needs {ws_size} bytes of workspace")
        ws_ptr = workspace.data_ptr() if ws_size else None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        status = f.cublasLtMatmul(self._handle, self._desc, ctypes.byref(self._alpha), weight.data_ptr(), self._a,
                                  x.data_ptr(), self._b, ctypes.byref(self._beta), out.data_ptr(), self._d,
                                  out.data_ptr(), self._d, ctypes.byref(algo.struct), ws_ptr, ws_size, stream)
        self._lib.check(status, "cublasLtMatmul")


class LtRoute:
    """A layer's product at one row count through one chosen algorithm: ``route(x, weight,
    bias)`` returns a new ``out``. ``workspace`` is the model's, shared by its routes (they
    run one after another on the model's stream)."""

    __slots__ = ("plan", "algo", "workspace")

    def __init__(self, plan: LtMatmul, algo: Algo, workspace: torch.Tensor | None):
        self.plan, self.algo, self.workspace = plan, algo, workspace

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` (the layer's input, of the plan's row count) is contiguous and
        aligned as the plan wants; the weight and bias were checked when the route was
        chosen."""
        return x.dim() == 2 and x.is_contiguous() and x.data_ptr() % _ALIGNMENT == 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty(self.plan.m, self.plan.n, dtype=x.dtype, device=x.device)
        self.plan.run(out, x, weight, bias, self.algo, self.workspace)
        return out
