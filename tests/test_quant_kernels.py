"""The quantized GEMM and GEMV Triton kernels against the torch reference ``quant_matmul``.

Runs on the CPU through the Triton interpreter: ``TRITON_INTERPRET=1`` is set here, before
any kernel module is imported, unless the environment already sets it (run with
``TRITON_INTERPRET=0`` on a CUDA machine to test the compiled kernels on the GPU).
Sizes are small because the interpreter executes every program in Python; they still
cover both K-split modes, ragged edges, per-tile and per-row groups, 4 and 8 bits.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from asyncgen._ops import quant_reference as qref  # noqa: E402
from asyncgen._ops.triton_quant_gemm import dequant_matmul, dequantize, quant_gemm  # noqa: E402
from asyncgen._ops.triton_quant_gemv import MAX_ROWS, quant_gemv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

# The kernels round each weight exactly as the reference does and accumulate in fp32, so
# only the summation order differs; bf16 outputs may differ by an ulp (the interpreter
# truncates when it casts to bf16).
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def make_weights(k, n, bits, group_size, g_idx_kind="none", seed=0, scales_dtype=torch.float16):
    """Random packed weights; ``g_idx_kind``: none | sorted (unequal groups) | permuted."""
    gen = torch.Generator().manual_seed(seed)
    size = group_size if group_size > 0 else k
    num_groups = -(-k // size)
    codes = torch.randint(0, 2**bits, (k, n), generator=gen)
    scales = (torch.rand(num_groups, n, generator=gen) * 0.02 + 0.002).to(scales_dtype)
    zeros = torch.randint(0, 2**bits, (num_groups, n), generator=gen).to(scales_dtype)
    g_idx = perm = None
    if g_idx_kind == "sorted":
        g_idx = torch.sort(torch.randint(0, num_groups, (k,), generator=gen)).values.int()
    if g_idx_kind in ("permuted", "sorted"):
        perm = torch.randperm(k, generator=gen)
    t = dict(qweight=qref.pack_rows(codes, bits), scales=scales, zeros=zeros, g_idx=g_idx, perm=perm)
    return {name: (v.to(DEVICE) if v is not None else None) for name, v in t.items()}, size


def run_both(kernel, m, k, n, bits, group_size, dtype, g_idx_kind="none", bias=False, seed=0):
    w, size = make_weights(k, n, bits, group_size, g_idx_kind, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    args = (w["qweight"], w["scales"], w["zeros"], bits, size, w["g_idx"], w["perm"], b)
    return kernel(x, *args), qref.quant_matmul(x, *args), x, args


def assert_matches(got, want, dtype, x=None, args=None):
    atol, rtol = TOL[dtype]
    if dtype == torch.bfloat16 and INTERPRET:
        # The interpreter truncates fp16 -> bf16 where the reference rounds: each weight
        # may be one bf16 step (2**-7 relative) off, so the bound grows with |x| @ |W|.
        w = qref.dequantize(*args[:5], args[5]).float().abs()
        xs = x.float().abs() if args[6] is None else x.float().abs()[:, args[6]]
        atol = (xs @ w) * 2**-7 + atol
        assert bool(((got.float() - want.float()).abs() <= atol + rtol * want.float().abs()).all())
        return
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


CASES = [
    # (m, k, n, bits, group_size, g_idx_kind, bias)
    (1, 128, 64, 4, 32, "none", False),  # one K tile: no split
    (3, 512, 96, 4, 128, "none", True),  # K split over programs, ragged N
    (2, 256, 64, 4, 64, "permuted", False),  # act order: sorted rows, permuted x
    (4, 256, 80, 4, 64, "sorted", True),  # unequal groups: per-row g_idx
    (1, 192, 64, 4, -1, "none", False),  # one group over all rows, K not a power of two
    (2, 256, 64, 8, 64, "permuted", False),
    (8, 128, 32, 8, 32, "none", True),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_gemv_matches_reference(case, dtype):
    m, k, n, bits, group, kind, bias = case
    got, want, x, args = run_both(quant_gemv, m, k, n, bits, group, dtype, kind, bias)
    assert got.dtype == dtype
    assert_matches(got, want, dtype, x, args)


GEMM_CASES = [
    (17, 128, 64, 4, 128, "none", False),
    (5, 512, 96, 4, 128, "none", True),  # split K
    (33, 256, 80, 4, 64, "permuted", True),
    (20, 256, 64, 4, 64, "sorted", False),
    (70, 192, 64, 4, -1, "none", False),  # BLOCK_M 128, one group
    (16, 256, 64, 4, 32, "none", False),  # group smaller than the K tile
    (24, 256, 64, 8, 64, "permuted", False),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_matches_reference(case, dtype):
    m, k, n, bits, group, kind, bias = case
    got, want, x, args = run_both(quant_gemm, m, k, n, bits, group, dtype, kind, bias)
    assert got.dtype == dtype
    assert_matches(got, want, dtype, x, args)


@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + GEMM_CASES[4:5])
def test_dequantize_equals_reference(case, scales_dtype):
    # The same fp32 product rounded once to the scales' dtype: equal bit for bit, whether
    # the kernel ORs the codes into 16-bit floats (4-bit, and 8-bit in fp16) or converts.
    _, k, n, bits, group, kind, _ = case
    w, size = make_weights(k, n, bits, group, kind, seed=5, scales_dtype=scales_dtype)
    got = dequantize(w["qweight"], w["scales"], w["zeros"], bits, size, w["g_idx"])
    want = qref.dequantize(w["qweight"], w["scales"], w["zeros"], bits, size, w["g_idx"])
    assert got.dtype == want.dtype
    if scales_dtype == torch.bfloat16 and INTERPRET:
        # The interpreter truncates its casts to bf16 where the GPU rounds: one step at most.
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GEMM_CASES)
def test_dequant_matmul_matches_reference(case, dtype):
    m, k, n, bits, group, kind, bias = case
    got, want, x, args = run_both(dequant_matmul, m, k, n, bits, group, dtype, kind, bias, seed=4)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_dequantize_checks_name_the_argument():
    w, size = make_weights(128, 64, 4, 64)
    with pytest.raises(ValueError, match="scales"):
        dequantize(w["qweight"], w["scales"][:, :-1], w["zeros"], 4, size)
    with pytest.raises(ValueError, match="group"):
        dequantize(w["qweight"], w["scales"], w["zeros"], 4, 16)  # 8 groups of 16 rows; 2 given
    with pytest.raises(ValueError, match="out"):
        dequantize(w["qweight"], w["scales"], w["zeros"], 4, size, out=torch.empty(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="bits"):
        dequantize(w["qweight"], w["scales"], w["zeros"], 5, size)


# Where a tile lies in one group the default unpacks each packed word once and ORs 4-bit
# codes into floats; the paths it replaced, still taken elsewhere (per-row groups, codes
# that do not fit a significand), on the same cases.
OTHER_DEQUANT = {
    "converted": {"MAGIC": False},  # each word once, codes converted to floats
    "each-row": {"MAGIC": False, "UNPACK_ONCE": False},  # a load per weight row, as with per-row groups
}


@pytest.mark.parametrize("path", OTHER_DEQUANT)
@pytest.mark.parametrize("case", [GEMM_CASES[i] for i in (0, 1, 2, 4, 6)])
def test_gemm_other_dequantization_paths_match_reference(monkeypatch, case, path):
    from asyncgen._ops import triton_quant_gemm as tqg

    default = tqg._config
    monkeypatch.setattr(tqg, "_config", lambda *a: {**default(*a), **OTHER_DEQUANT[path]})
    m, k, n, bits, group, kind, bias = case
    got, want, x, args = run_both(quant_gemm, m, k, n, bits, group, torch.float16, kind, bias, seed=3)
    assert_matches(got, want, torch.float16, x, args)


@pytest.mark.parametrize("case", [GEMM_CASES[0], GEMM_CASES[1]])
def test_gemm_with_bf16_scales_matches_reference(case):
    m, k, n, bits, group, kind, bias = case
    w, size = make_weights(k, n, bits, group, kind, seed=7, scales_dtype=torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEVICE)
    args = (w["qweight"], w["scales"], w["zeros"], bits, size, w["g_idx"], w["perm"], None)
    assert_matches(quant_gemm(x, *args), qref.quant_matmul(x, *args), torch.bfloat16, x, args)


def test_magic_dequantization_only_where_codes_fit():
    from asyncgen._ops.triton_quant_gemm import magic_exact

    assert magic_exact(4, torch.float16) and magic_exact(8, torch.float16) and magic_exact(4, torch.bfloat16)
    assert not magic_exact(8, torch.bfloat16) and not magic_exact(4, torch.float32)


def test_gemm_at_one_row_equals_gemv():
    g1, want, _, _ = run_both(quant_gemm, 1, 256, 64, 4, 64, torch.float16, "permuted")
    g2, _, _, _ = run_both(quant_gemv, 1, 256, 64, 4, 64, torch.float16, "permuted")
    torch.testing.assert_close(g1, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(g2, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kernel", [quant_gemm, quant_gemv, dequant_matmul])
def test_out_may_be_a_column_slice(kernel):
    """Fused layers whose parts differ in g_idx write each part into its columns."""
    w, size = make_weights(128, 96, 4, 64, "permuted")
    x = torch.randn(3, 128).half().to(DEVICE)
    wide = torch.full((3, 160), 7.0, dtype=torch.float16, device=DEVICE)
    cols = slice(32, 96)
    args = (w["qweight"][:, cols], w["scales"][:, cols], w["zeros"][:, cols], 4, size, None, w["perm"])
    kernel(x, *args, out=wide[:, cols])
    torch.testing.assert_close(wide[:, cols], qref.quant_matmul(x, *args), atol=2e-3, rtol=2e-3)
    assert bool((wide[:, :32] == 7).all()) and bool((wide[:, 96:] == 7).all())


def test_launcher_checks_name_the_argument():
    w, size = make_weights(128, 64, 4, 64)
    x = torch.randn(2, 128).half().to(DEVICE)
    with pytest.raises(ValueError, match="qweight"):
        quant_gemm(x, w["qweight"][:-1], w["scales"], w["zeros"], 4, size)
    with pytest.raises(ValueError, match="scales"):
        quant_gemm(x, w["qweight"], w["scales"][:, :-1], w["zeros"], 4, size)
    with pytest.raises(ValueError, match="x has 130 columns"):
        quant_gemm(torch.randn(2, 130).half().to(DEVICE), w["qweight"], w["scales"], w["zeros"], 4, size)
    with pytest.raises(ValueError, match="perm"):
        quant_gemv(x, w["qweight"], w["scales"], w["zeros"], 4, size, perm=torch.arange(64, device=DEVICE))
    with pytest.raises(ValueError, match="bits"):
        quant_gemv(x, w["qweight"], w["scales"], w["zeros"], 3, size)
    with pytest.raises(ValueError, match="at most"):
        quant_gemv(torch.randn(MAX_ROWS + 1, 128).half().to(DEVICE), w["qweight"], w["scales"], w["zeros"], 4, size)


# --- the model's layers on the kernels ----------------------------------------------------------------
@pytest.mark.parametrize("variant", ["gptq-4b-g32-act-per-part", "gptq-4b-g64-act-unequal", "gptq-8b-g64-act-asym"])
@pytest.mark.skipif(not INTERPRET, reason="builds its layers on the CPU, where the kernels run interpreted")
def test_layers_on_the_kernels_match_dense(tmp_path, variant):
    """A loaded checkpoint's layers on the Triton kernels (GEMV and GEMM) match the dense path."""
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    from asyncgen.model.linear import LinearBase

    write_checkpoint(tmp_path / variant, VARIANTS[variant])
    dense, triton_model = load_model(tmp_path / variant, "dense"), load_model(tmp_path / variant, "triton")
    layers = [m for m in triton_model.layers[0].modules() if isinstance(m, LinearBase)]
    ref = [m for m in dense.layers[0].modules() if isinstance(m, LinearBase)]
    gen = torch.Generator().manual_seed(0)
    for lt, ld in zip(layers, ref):
        for rows in (1, 6):
            x = torch.randn(rows, ld.in_features, generator=gen)
            torch.testing.assert_close(lt(x), ld(x), atol=1e-4, rtol=1e-5)
    # Prompt-sized inputs dequantized for a dense matmul (as choose_dequant_rows sets on a
    # GPU where that is faster): from 6 rows here, so 1 row stays on the kernels.
    for lt in layers:
        for seg in lt.quant_segments:
            seg.dequant_rows = 6
    for lt, ld in zip(layers, ref):
        for rows in (1, 6, 9):
            x = torch.randn(rows, ld.in_features, generator=gen)
            torch.testing.assert_close(lt(x), ld(x), atol=1e-4, rtol=1e-5)
