"""The csrc extension's Python side where the extension may be missing (CPU machines):
nothing raises at import, the backend says it is unavailable, asking for it says how to
build it, and the launchers reject bad arguments by name before touching a device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncgen._ops import cuda_backend, get_ops

ROOT = Path(__file__).resolve().parent.parent


def test_is_available_is_a_bool_and_false_without_cuda():
    available = cuda_backend.is_available()
    assert isinstance(available, bool)
    if not torch.cuda.is_available():
        assert available is False


def test_get_ops_cuda_says_how_to_build_when_extension_missing(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_extension", lambda: None)
    assert cuda_backend.is_available() is False
    with pytest.raises(RuntimeError, match=r"setup\.py build_ext --inplace"):
        get_ops("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine may have the extension built")
def test_get_ops_cuda_raises_runtime_error_here():
    with pytest.raises(RuntimeError, match="asyncgen._C"):
        get_ops("cuda")


def _decode_args(**overrides):
    num_seqs, num_heads, num_kv_heads, head_dim = 2, 4, 2, 64
    args = dict(
        q=torch.randn(num_seqs, num_heads, head_dim, dtype=torch.float16),
        k_cache=torch.randn(3, 16, num_kv_heads, head_dim, dtype=torch.float16),
        v_cache=torch.randn(3, 16, num_kv_heads, head_dim, dtype=torch.float16),
        block_tables=torch.zeros(num_seqs, 2, dtype=torch.int32),
        seq_lens=torch.ones(num_seqs, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        scale=0.125,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("q", torch.randn(2, 4, dtype=torch.float16), "q must have 3 dimensions"),
        ("k_cache", torch.randn(3, 16, 2, 64, dtype=torch.float32), "k_cache must have dtype"),
        ("v_cache", torch.randn(3, 16, 2, 32, dtype=torch.float16), "v_cache must have k_cache's shape"),
        ("block_tables", torch.zeros(2, 2), "block_tables must have dtype"),
        ("seq_lens", torch.ones(3, dtype=torch.int32), "block_tables must have 3 rows"),
        ("query_start_loc", torch.arange(2, dtype=torch.int32), "query_start_loc must have shape"),
        ("scale", "0.1", "scale must be a float"),
        ("q", torch.randn(2, 3, 64, dtype=torch.float16), "multiple of k_cache's num_kv_heads"),
    ],
)
def test_paged_attention_rejects_bad_arguments_by_name(name, bad, message):
    with pytest.raises(ValueError, match=message):
        cuda_backend.paged_attention(**_decode_args(**{name: bad}))


def test_paged_attention_rejects_bad_hints_and_cpu_tensors():
    with pytest.raises(ValueError, match="max_seq_len must be None or an int"):
        cuda_backend.paged_attention(**_decode_args(), max_seq_len=-1)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        cuda_backend.paged_attention(**_decode_args(), sliding_window=0)
    with pytest.raises(ValueError, match="q is on cpu; the cuda backend needs CUDA tensors"):
        cuda_backend.paged_attention(**_decode_args())


def _rotary_attention_args(**overrides):
    args = _decode_args()
    num_seqs, num_heads, head_dim = args["q"].shape
    args.update(
        positions=torch.zeros(num_seqs, dtype=torch.int64),
        k=torch.randn(num_seqs, 2, head_dim, dtype=torch.float16),
        v=torch.randn(num_seqs, 2, head_dim, dtype=torch.float16),
        cos_sin_cache=torch.randn(16, head_dim),
        slot_mapping=torch.arange(num_seqs, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=1,
    )
    args.update(overrides)
    return args


def test_rotary_attention_rejects_bad_arguments_by_name(monkeypatch):
    # With the extension "present", a decode step meets the fused kernel's checks; bad
    # arguments and CPU tensors are named either there or by the ops it falls back to.
    monkeypatch.setattr(cuda_backend, "_extension", lambda: object())
    with pytest.raises(ValueError, match="scale must be a float"):
        cuda_backend.rotary_attention(**_rotary_attention_args(scale="0.1"))
    with pytest.raises(ValueError, match="max_seq_len must be None or an int"):
        cuda_backend.rotary_attention(**_rotary_attention_args(max_seq_len=-2))
    with pytest.raises(ValueError, match="q is on cpu; the cuda backend needs CUDA tensors"):
        cuda_backend.rotary_attention(**_rotary_attention_args())
    # Not fusable (k's head_dim does not match q's): the separate ops check it.
    with pytest.raises(ValueError, match="k must have shape"):
        cuda_backend.rotary_attention(**_rotary_attention_args(k=torch.randn(2, 2, 32, dtype=torch.float16)))


@pytest.mark.parametrize(
    "num_tokens, layout, cos_sin_dtype, fused",
    [
        (1, "packed", torch.float32, True),
        (80, "packed", torch.float32, True),    # the vectorized form takes any token count
        (256, "packed", torch.float32, True),
        (8, "offset", torch.float32, True),     # only the element-wise form: up to 8 tokens
        (80, "offset", torch.float32, False),
        (80, "odd_stride", torch.float32, False),
        (80, "packed", torch.float16, False),   # the fused kernel needs fp32 cos/sin
    ],
)
def test_rotary_store_kv_routing(monkeypatch, num_tokens, layout, cos_sin_dtype, fused):
    """Which kernels rotary_store_kv runs, from the tensors alone (the CPU tensors reach the
    fused kernel's device check, or the two ops it falls back to, stubbed here)."""
    triton_backend = pytest.importorskip("asyncgen._ops.triton_backend")
    from csrc_emu.cases import make_rotary_store_case

    calls = []
    monkeypatch.setattr(cuda_backend, "_extension", lambda: object())
    triton_ops = SimpleNamespace(rotary_embedding=lambda *a: calls.append("rotary"))
    monkeypatch.setattr(triton_backend, "ops", lambda: triton_ops)
    monkeypatch.setattr(cuda_backend, "store_kv_cache", lambda *a: calls.append("store"))
    case = make_rotary_store_case(num_tokens=num_tokens, num_heads=8, num_kv_heads=2, head_dim=64,
                                  dtype=torch.float16, layout=layout)
    args = (case.positions, case.q, case.k, case.v, case.cos_sin.to(cos_sin_dtype), case.k_cache, case.v_cache,
            case.slot_mapping)
    if fused:
        with pytest.raises(ValueError, match="q is on cpu; the cuda backend needs CUDA tensors"):
            cuda_backend.rotary_store_kv(*args)
        assert calls == []
    else:
        cuda_backend.rotary_store_kv(*args)
        assert calls == ["rotary", "store"]


def test_store_kv_cache_rejects_bad_arguments_by_name():
    key = torch.randn(5, 2, 64, dtype=torch.float16)
    cache = torch.zeros(3, 16, 2, 64, dtype=torch.float16)
    slots = torch.arange(5)
    with pytest.raises(ValueError, match="value must have key's shape"):
        cuda_backend.store_kv_cache(key, key[:4], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        cuda_backend.store_kv_cache(key, key, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, block_size, 2, 64\]"):
        cuda_backend.store_kv_cache(key, key, cache[..., :32], cache[..., :32].clone(), slots)
    with pytest.raises(ValueError, match="key is on cpu"):
        cuda_backend.store_kv_cache(key, key, cache, cache.clone(), slots)


def test_setup_py_skips_the_extension_when_asked():
    env = dict(os.environ, ASYNCGEN_SKIP_CUDA="1")
    result = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "asyncgen"
    assert "building without the CUDA extension: ASYNCGEN_SKIP_CUDA is set" in result.stderr



def _setup_functions(*names):
    """Functions of setup.py (which runs setup() when imported), compiled on their own."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    module = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names],
                        type_ignores=[])
    namespace: dict = {}
    exec(compile(module, "setup.py", "exec"), namespace)
    return [namespace[name] for name in names]


def test_setup_py_builds_sm90a_and_says_so_to_the_sources():
    gencode_flags, has_sm90a = _setup_functions("_gencode_flags", "_has_sm90a")
    assert gencode_flags("90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert gencode_flags("80;90+PTX") == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                                          "-gencode=arch=compute_90,code=compute_90"]
    assert has_sm90a("90a") and has_sm90a("8.0 9.0a+PTX") and has_sm90a("80,90a")
    assert not has_sm90a("90") and not has_sm90a("80;9.0") and not has_sm90a("")


@pytest.mark.parametrize(
    "built, capability, expected",
    [(True, (9, 0), True), (True, (8, 0), False), (True, (10, 0), False), (False, (9, 0), False), (None, (9, 0), False)],
)
def test_the_warpgroup_gemm_is_timed_only_where_the_build_and_the_gpu_have_it(monkeypatch, built, capability, expected):
    extension = SimpleNamespace() if built is None else SimpleNamespace(has_wgmma=built)
    monkeypatch.setattr(cuda_backend, "_extension", lambda: extension)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert cuda_backend.has_wgmma("cuda") is expected
    indices = cuda_backend.quant_gemm_config_indices("cuda")
    kernels = {cuda_backend.QUANT_GEMM_CONFIGS[i][2] for i in indices}
    assert kernels == ({0, 1, 2} if expected else {0})  # 2: with producer warps (unless ASYNCGEN_QUANT_WS=0)
    without = [i for i, config in enumerate(cuda_backend.QUANT_GEMM_CONFIGS) if not config[2]]
    assert indices == (list(range(len(cuda_backend.QUANT_GEMM_CONFIGS))) if expected else without)


@pytest.mark.parametrize("setting, timed", [(None, True), ("1", True), ("0", False)])
def test_the_producer_warp_gemm_is_timed_unless_switched_off(setting, timed):
    """ASYNCGEN_QUANT_WS=0 leaves the producer-warp kernel's launch shapes out of those the
    engine times (read once, when cuda_backend is imported: a fresh process)."""
    env = {k: v for k, v in os.environ.items() if k != "ASYNCGEN_QUANT_WS"}
    if setting is not None:
        env["ASYNCGEN_QUANT_WS"] = setting
    code = ("from asyncgen._ops import cuda_backend as c; "
            "print(sorted({k for _, _, k in c.QUANT_GEMM_CONFIGS}), all(x in c.QUANT_GEMM_CONFIGS "
            "for x in c.QUANT_GEMM_WS_CONFIGS))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.split()
    assert out == (["[0,", "1,", "2]", "True"] if timed else ["[0,", "1]", "False"])
