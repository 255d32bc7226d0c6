"""Which kernel computes a linear layer at decode size, checked on the CPU.

The csrc GEMVs only run on a GPU (their arithmetic is tested on the CPU emulator in
test_csrc_emulated.py and on an H200 by tests/gpu/check_csrc_ops.py). Here the csrc
entry points are replaced by the torch reference, recording their calls, so that what
the layers send them (rows, act-order permutation, column slices of fused layers, bias)
and what they do with the result is checked against the dense path.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton fallbacks run interpreted (see test_quant_kernels.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from asyncgen._ops import cuda_backend  # noqa: E402
from asyncgen._ops import quant_reference as qref  # noqa: E402
from asyncgen.model.linear import LinearBase, RowLinear  # noqa: E402


class Calls(list):
    quant_rows = cuda_backend.QUANT_MMA_MAX_ROWS  # what the fake 4-bit kernel takes
    tiled = False  # whether the fake tiled GEMM takes the weights
    wgmma = False  # whether the device runs its warpgroup kernel

    def __init__(self):
        super().__init__()
        self.scratches = []  # the scratch each tiled launch got


@pytest.fixture
def fake_csrc(monkeypatch):
    calls = Calls()

    def quant_max_rows(qweight, scales, zeros, bits, group_size, g_idx=None, bias=None):
        return calls.quant_rows if bits == 4 and g_idx is None else 0

    def input_ok(x, dtype, k, max_rows=cuda_backend.GEMV_MAX_ROWS):
        return x.dim() == 2 and 1 <= x.shape[0] <= max_rows and x.shape[1] == k

    def launch_quant(x, qweight, scales, zeros, group_size, perm=None, bias=None, *, out=None, kernel=0, gated=False):
        calls.append(("quant", x.shape[0], kernel, "gated") if gated else ("quant", x.shape[0], kernel))
        y = qref.quant_matmul(x, qweight, scales, zeros, 4, group_size, None, perm, bias)
        if gated:
            y = torch.nn.functional.silu(y[:, : y.shape[1] // 2]) * y[:, y.shape[1] // 2:]
        if out is None:
            return y
        out.copy_(y)
        return out

    def launch_tiled(x, qweight, scales, zeros, group_size, perm=None, bias=None, *, out=None, warps=4, splits=1,
                     wgmma=False, scratch=None):
        calls.append(("tiled", x.shape[0], warps, splits, wgmma))
        calls.scratches.append(scratch)
        y = qref.quant_matmul(x, qweight, scales, zeros, 4, group_size, None, perm, bias)
        return y if out is None else out.copy_(y)

    def dense_supported(x, weight, bias=None):
        return input_ok(x, weight.dtype, weight.shape[1])

    def launch_dense(x, weight, bias=None, out=None, *, warps_per_row=1, gated=False):
        call = ("dense", x.shape[0]) if warps_per_row == 1 else ("dense", x.shape[0], warps_per_row)
        calls.append((*call, "gated") if gated else call)
        y = torch.nn.functional.linear(x, weight, bias)
        return torch.nn.functional.silu(y[:, : y.shape[1] // 2]) * y[:, y.shape[1] // 2:] if gated else y

    monkeypatch.setattr(cuda_backend, "quant_gemv_4bit_max_rows", quant_max_rows)
    monkeypatch.setattr(cuda_backend, "gemv_input_ok", input_ok)
    monkeypatch.setattr(cuda_backend, "launch_quant_gemv_4bit", launch_quant)
    monkeypatch.setattr(cuda_backend, "launch_quant_gemm_4bit", launch_tiled)
    monkeypatch.setattr(cuda_backend, "quant_gemm_4bit_weight_ok", lambda *args: calls.tiled)
    monkeypatch.setattr(cuda_backend, "has_wgmma", lambda device: calls.wgmma)
    monkeypatch.setattr(cuda_backend, "dense_gemv_supported", dense_supported)
    monkeypatch.setattr(cuda_backend, "launch_dense_gemv", launch_dense)
    return calls


@pytest.mark.parametrize("kernel_rows", [cuda_backend.GEMV_MAX_ROWS, cuda_backend.QUANT_MMA_MAX_ROWS],
                         ids=["cuda_cores", "tensor_cores"])
@pytest.mark.parametrize(
    "variant, csrc_takes",
    [
        ("gptq-4b-g32-act-per-part", True),   # act order, a different g_idx per fused part
        ("awq-g64", True),
        ("gptq-4b-g64-act-unequal", False),   # unequal groups: per-row g_idx, Triton
        ("gptq-8b-g64-act-asym", False),      # 8 bits: Triton
    ],
)
def test_quantized_layers_send_decode_rows_to_the_csrc_gemv(tmp_path, fake_csrc, variant, csrc_takes, kernel_rows):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton fallback runs on the CPU only under TRITON_INTERPRET=1")
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    from asyncgen.model.quantization import CUDA_GEMV_MAX_ROWS

    fake_csrc.quant_rows = kernel_rows  # read when the layers load
    limit = min(kernel_rows, CUDA_GEMV_MAX_ROWS)
    write_checkpoint(tmp_path / variant, VARIANTS[variant])
    dense = load_model(tmp_path / variant, "dense")
    routed = load_model(tmp_path / variant, "cuda")
    layers = [m for m in routed.layers[0].modules() if isinstance(m, LinearBase)]
    ref = [m for m in dense.layers[0].modules() if isinstance(m, LinearBase)]
    gen = torch.Generator().manual_seed(0)
    for lt, ld in zip(layers, ref):
        for rows in (1, limit, limit + 2):
            fake_csrc.clear()
            x = torch.randn(rows, ld.in_features, generator=gen)
            torch.testing.assert_close(lt(x), ld(x), atol=1e-4, rtol=1e-5)
            expected = csrc_takes and rows <= limit
            assert bool(fake_csrc) == expected, (lt.prefix, rows, fake_csrc)
            kernel = 2 if kernel_rows > cuda_backend.GEMV_MAX_ROWS else 1  # tensor cores where they apply
            assert all(call == ("quant", rows, kernel) for call in fake_csrc)


def close(a, b):  # F.linear on other leading shapes may sum in another order
    return torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_dense_layers_use_the_gemv_up_to_their_chosen_rows(fake_csrc):
    layer = RowLinear("o_proj", 64, 48, True, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(48, 64, generator=gen))
    layer.bias.data.copy_(torch.randn(48, generator=gen))
    x = torch.randn(2, 3, 64, generator=gen)  # 6 rows in a leading shape
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), want) and fake_csrc == []  # gemv_rows 0: never
    layer.gemv_rows = 8
    got = layer(x)
    assert got.shape == (2, 3, 48) and close(got, want) and fake_csrc == [("dense", 6)]
    layer.gemv_rows = 4
    fake_csrc.clear()
    assert close(layer(x), want) and fake_csrc == []
    assert close(layer(x[0, :1]), want[0, :1]) and fake_csrc == [("dense", 1)]


def test_choose_dense_gemv_keeps_the_rows_where_it_won(fake_csrc, monkeypatch):
    # Fake timings by (N, rows, warps a row; 0 for cuBLAS): for the 16x64 weights two warps
    # a row are fastest at 1 row, and the GEMV wins at 1 and 2 rows, then loses; it never
    # wins for the 32x64 one, where one warp a row is its fastest.
    timings = {
        (16, 1, 1): 1.5, (16, 1, 2): 1.0, (16, 1, 4): 1.2, (16, 1, 8): 1.1, (16, 1, 0): 2.0,
        (16, 2, 2): 1.0, (16, 2, 0): 2.0, (16, 4, 2): 3.0, (16, 4, 0): 2.0,
        (32, 1, 1): 2.0, (32, 1, 2): 2.5, (32, 1, 4): 3.0, (32, 1, 8): 3.5, (32, 1, 0): 1.0,
    }
    measured, state = [], {}

    def fake_time(fn, items):
        before = len(fake_csrc)
        fn(items[0])
        ours = len(fake_csrc) > before  # each GEMV timing comes before its F.linear
        if ours:
            call = fake_csrc[-1]
            state["rows"], warps = call[1], (call[2] if len(call) > 2 else 1)
        n = items[0].weight.shape[0]
        key = (n, state["rows"], warps if ours else 0)
        measured.append((*key, len(items)))
        return timings[key]

    monkeypatch.setattr(cuda_backend, "dense_gemv", lambda x, w, b=None, out=None, *, warps_per_row=1:
                        cuda_backend.launch_dense_gemv(x, w, b, out, warps_per_row=warps_per_row))
    monkeypatch.setattr(cuda_backend, "graph_time_ms", fake_time)
    layers = [RowLinear(f"l{i}", 64, n, False, torch.float32, "cpu") for i, n in enumerate((16, 16, 32, 16))]
    chosen = cuda_backend.choose_dense_gemv(layers, rows=(1, 2, 4, 8))
    assert chosen == {(16, 64, torch.float32): (2, 2), (32, 64, torch.float32): (0, 1)}
    assert [layer.gemv_rows for layer in layers] == [2, 2, 0, 2]
    assert [layer.gemv_warps_per_row for layer in layers] == [2, 2, 1, 2]
    # Each timing ran over every layer of its shape: at 1 row every split, then the chosen
    # one against cuBLAS up to the first loss.
    assert measured == [
        (16, 1, 1, 3), (16, 1, 2, 3), (16, 1, 4, 3), (16, 1, 8, 3), (16, 1, 0, 3), (16, 2, 2, 3), (16, 2, 0, 3),
        (16, 4, 2, 3), (16, 4, 0, 3), (32, 1, 1, 1), (32, 1, 2, 1), (32, 1, 4, 1), (32, 1, 8, 1), (32, 1, 0, 1),
    ]


def test_dense_layers_pass_their_warps_per_row(fake_csrc):
    layer = RowLinear("down_proj", 64, 48, False, torch.float32, "cpu")
    layer.weight.data.copy_(torch.randn(48, 64, generator=torch.Generator().manual_seed(1)))
    layer.gemv_rows, layer.gemv_warps_per_row = 1, 4
    x = torch.randn(1, 64)
    assert close(layer(x), torch.nn.functional.linear(x, layer.weight)) and fake_csrc == [("dense", 1, 4)]


def test_mlp_takes_silu_and_mul_from_the_gated_gemv_where_set(fake_csrc):
    from types import SimpleNamespace

    from asyncgen._ops import get_ops
    from asyncgen.model.llama import MLP

    cfg = SimpleNamespace(hidden_size=64, intermediate_size=40, mlp_bias=False)
    mlp = MLP(cfg, "model.layers.0.mlp", get_ops("torch"), torch.float32, "cpu", lambda prefix: None)
    gen = torch.Generator().manual_seed(3)
    mlp.gate_up_proj.weight.data.copy_(torch.randn(80, 64, generator=gen))
    mlp.down_proj.weight.data.copy_(torch.randn(64, 40, generator=gen))
    x = torch.randn(2, 64, generator=gen)
    gate, up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    want = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, mlp.down_proj.weight)
    gate_up = mlp.gate_up_proj
    gate_up.gemv_rows, gate_up.gemv_warps_per_row = 2, 8
    assert close(mlp(x), want) and fake_csrc == [("dense", 2, 8)]  # gemv_gated off: the plain GEMV
    fake_csrc.clear()
    gate_up.gemv_gated = True
    assert close(mlp(x), want) and fake_csrc == [("dense", 2, 4, "gated")]  # at most 4 warps a row gated
    fake_csrc.clear()
    assert close(mlp(torch.cat([x, x])), torch.cat([want, want])) and fake_csrc == []  # past its rows: cuBLAS


@pytest.mark.parametrize("variant, gated", [("awq-g64", True), ("gptq-4b-g32-act-per-part", False)])
def test_quantized_mlp_takes_silu_and_mul_from_the_one_row_kernel_where_it_may(tmp_path, fake_csrc, variant, gated):
    """A 4-bit gate|up without act order, routed to the one-row kernel, gives one row's
    silu(gate) * up from its gated form once the runner sets quant_gated; act order (a
    permutation per fused part) keeps the two-step path."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton fallback runs on the CPU only under TRITON_INTERPRET=1")
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    fake_csrc.quant_rows = cuda_backend.GEMV_MAX_ROWS  # the CUDA-core kernels, one-row kernel at 1 row
    write_checkpoint(tmp_path / variant, VARIANTS[variant])
    dense = load_model(tmp_path / variant, "dense").layers[0].mlp
    mlp = load_model(tmp_path / variant, "cuda").layers[0].mlp
    gate_up = mlp.gate_up_proj
    gate_up.gemv_gated = True  # the dense GEMV's flag: not the 4-bit kernel's
    fake_csrc.clear()
    x = torch.randn(1, gate_up.in_features)
    torch.testing.assert_close(mlp(x), dense(x), atol=1e-4, rtol=1e-4)
    assert all(len(call) == 3 for call in fake_csrc), fake_csrc  # nothing gated
    assert gate_up.method.gated_ok(gate_up) == gated
    gate_up.quant_gated = gate_up.method.gated_ok(gate_up)
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 3):
        fake_csrc.clear()
        x = torch.randn(rows, gate_up.in_features, generator=gen)
        torch.testing.assert_close(mlp(x), dense(x), atol=1e-4, rtol=1e-4)
        first = fake_csrc[0] if fake_csrc else None
        assert (first == ("quant", 1, 1, "gated")) == (gated and rows == 1), fake_csrc


def test_dense_gemv_names_a_bad_warps_per_row():
    with pytest.raises(ValueError, match="warps_per_row"):
        cuda_backend.dense_gemv(torch.zeros(1, 64), torch.zeros(48, 64), warps_per_row=3)


def test_choose_kernels_routes_each_row_count_to_the_fastest(tmp_path, fake_csrc, monkeypatch):
    """QuantLinearMethod.choose_kernels with the timer and kernels faked: each row count up
    to a timed one goes to the kernel timed fastest there, and rows past the csrc limit
    stay on Triton (in one piece: two pieces through the route, Triton at 64 rows, were
    timed slower)."""
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    from asyncgen.model.quantization import CUDA_CORES, ROUTE_ROWS, TENSOR_CORES, TRITON, QuantLinearMethod

    def fake_triton(self, x, qweight, scales, zeros, seg, bias, out, size):
        fake_csrc.append(("triton", x.shape[0], TRITON))
        return out

    # Made-up timings: the CUDA-core kernel wins at 1 row, tensor cores at 2-32, Triton at 48+.
    def fake_time(fn, items):  # each call's time, summed over the calls one item makes
        fake_csrc.clear()
        fn(items[0])
        return sum({TRITON: 5.0 if m >= 48 else 9.0, CUDA_CORES: 1.0 if m == 1 else 8.0,
                    TENSOR_CORES: 6.0 if m >= 48 else 2.0}[kernel] for _, m, kernel in fake_csrc)

    monkeypatch.setattr(QuantLinearMethod, "_triton", fake_triton)
    monkeypatch.setattr(cuda_backend, "graph_time_ms", fake_time)
    write_checkpoint(tmp_path / "awq", VARIANTS["awq-g64"])
    model = load_model(tmp_path / "awq", "cuda")
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and getattr(m, "quant_kernel", None)]
    chosen = QuantLinearMethod.choose_kernels(layers)
    want_picks = tuple(CUDA_CORES if m == 1 else TRITON if m >= 48 else TENSOR_CORES for m in ROUTE_ROWS)
    assert chosen and all(picks == want_picks for picks in chosen.values())
    for layer in layers:
        for seg in layer.quant_segments:
            assert seg.route[1] == CUDA_CORES
            assert set(seg.route[2:33]) == {TENSOR_CORES}
            assert set(seg.route[33:65]) == {TRITON} and len(seg.route) == 65
            assert seg.chunk_rows == 0


@pytest.mark.parametrize("wgmma", [True, False], ids=["with-wgmma", "without-wgmma"])
def test_choose_kernels_times_the_tiled_gemm_in_each_launch_shape(tmp_path, fake_csrc, monkeypatch, wgmma):
    """Where the tiled GEMM takes the weights it is timed from TILED_MIN_ROWS rows in every
    launch shape the device runs (the warpgroup kernel's only where it has them); the
    fastest shape's route value sends those rows to it with that shape, and the layer's
    output stays the reference's. Past 64 rows, x goes to it in pieces of 64 (timed faster
    than the Triton GEMM at 128 rows), up to 128 rows."""
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    from asyncgen.model.quantization import TENSOR_CORES, TILED, TILED_MIN_ROWS, TRITON, QuantLinearMethod

    configs = cuda_backend.QUANT_GEMM_CONFIGS
    best = configs.index((8, 3, wgmma))
    timed = []

    def call_time(call):
        if call[0] == "tiled":  # 8 warps, 3 splits (the warpgroup kernel where timed) fastest from 32 rows
            return 1.0 if call[1] >= 32 and call[2:] == (8, 3, wgmma) else 4.0
        return {TRITON: 9.0, TENSOR_CORES: 3.0}.get(call[2], 8.0)

    def fake_time(fn, items):  # each call's time, summed over the calls one item makes
        fake_csrc.clear()
        fn(items[0])
        timed.extend(fake_csrc)
        return sum(call_time(call) for call in fake_csrc)

    def fake_triton(self, x, qweight, scales, zeros, seg, bias, out, size):
        fake_csrc.append(("triton", x.shape[0], TRITON))
        return out if out is not None else torch.zeros(x.shape[0], qweight.shape[1])

    fake_csrc.tiled, fake_csrc.wgmma = True, wgmma
    monkeypatch.setattr(QuantLinearMethod, "_triton", fake_triton)
    monkeypatch.setattr(cuda_backend, "graph_time_ms", fake_time)
    write_checkpoint(tmp_path / "awq", VARIANTS["awq-g64"])
    model = load_model(tmp_path / "awq", "cuda")
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and getattr(m, "quant_kernel", None)]
    scratch = cuda_backend.GemmScratch("cpu")  # as the model runner gives each model one
    for layer in layers:
        for seg in layer.quant_segments:
            seg.gemm_scratch = scratch
    chosen = QuantLinearMethod.choose_kernels(layers)
    tiled_rows = {call[1] for call in timed if call[0] == "tiled"}
    assert tiled_rows and min(tiled_rows) == TILED_MIN_ROWS
    shapes = {call[2:] for call in timed if call[0] == "tiled"}
    assert shapes == {config for config in configs if wgmma or not config[2]}
    for picks in chosen.values():
        assert picks[-1] == TILED + best and TILED + best in picks
    dense = load_model(tmp_path / "awq", "dense")
    gen = torch.Generator().manual_seed(1)
    for lt, ld in zip(layers, [m for m in dense.modules() if isinstance(m, LinearBase)]):
        for seg in lt.quant_segments:
            assert set(seg.route[17:65]) == {TILED + best} and set(seg.route[2:9]) == {TENSOR_CORES}
        fake_csrc.clear()
        x = torch.randn(40, ld.in_features, generator=gen)
        torch.testing.assert_close(lt(x), ld(x), atol=1e-4, rtol=1e-5)
        assert fake_csrc and all(call == ("tiled", 40, 8, 3, wgmma) for call in fake_csrc)
        assert all(seg.chunk_rows == 128 for seg in lt.quant_segments)
        for rows, pieces in ((100, [64, 36]), (128, [64, 64])):
            fake_csrc.clear()
            x = torch.randn(rows, ld.in_features, generator=gen)
            torch.testing.assert_close(lt(x), ld(x), atol=1e-4, rtol=1e-5)
            per_segment = len(lt.quant_segments)
            assert fake_csrc == [("tiled", r, 8, 3, wgmma) for r in pieces] * per_segment
        fake_csrc.clear()
        x = torch.randn(129, ld.in_features, generator=gen)
        lt(x)  # past chunk_rows: Triton, in one piece
        assert fake_csrc == [("triton", 129, TRITON)] * len(lt.quant_segments)
    assert QuantLinearMethod.kernel_name(TILED + best) == f"csrc-{'wgmma' if wgmma else 'tiled'}-8w-split3"
    assert QuantLinearMethod.kernel_name(TILED + configs.index((8, -1, True))) == "csrc-wgmma-8w-balanced1"
    assert QuantLinearMethod.kernel_name(TILED + configs.index((4, 1, False))) == "csrc-tiled-4w"
    assert fake_csrc.scratches and all(sc is scratch for sc in fake_csrc.scratches)


def test_gemm_scratch_grows_and_keeps_what_graphs_captured():
    scratch = cuda_backend.GemmScratch("cpu")
    ws, counters = scratch.buffers(100, 10)
    assert ws.numel() >= 100 and ws.dtype == torch.float32
    assert counters.numel() >= 10 and counters.dtype == torch.int32 and int(counters.abs().sum()) == 0
    assert scratch.buffers(50, 5)[0] is ws  # big enough: the same buffers
    bigger, same_counters = scratch.buffers(1000, 10)
    assert bigger.numel() >= 1000 and same_counters is counters
    assert any(t is ws for t in scratch._retired)  # the old workspace stays alive
    other = cuda_backend.GemmScratch("cpu")
    assert other.buffers(100, 10)[0] is not scratch.workspace  # one per model


def test_choose_dequant_rows_switches_where_dequantizing_wins_from_there_on(tmp_path, monkeypatch):
    """QuantLinearMethod.choose_dequant_rows with the timer and kernels faked: the switch is
    the smallest timed count from which dequantize-then-matmul won at every larger one, and
    a shape where it lost at the largest count never switches."""
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    from asyncgen._ops import triton_quant_gemm
    from asyncgen.model.quantization import DEQUANT_ROWS, QuantLinearMethod

    calls = []
    monkeypatch.setattr(triton_quant_gemm, "quant_gemm", lambda x, *a, out: calls.append(("gemm", x.shape[0])))
    monkeypatch.setattr(triton_quant_gemm, "dequant_matmul", lambda x, *a, out: calls.append(("deq", x.shape[0])))
    write_checkpoint(tmp_path / "awq", VARIANTS["awq-g64"])
    model = load_model(tmp_path / "awq", "triton")
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and getattr(m, "quant_kernel", None)]
    widest = max(seg.end - seg.start for layer in layers for seg in layer.quant_segments)

    def fake_time(fn, items):
        calls.clear()
        fn(items[0])
        (kernel, m), = calls
        n = items[0][2][0].shape[1]
        if n == widest:  # dequantizing loses at the largest count: never
            return 1.0 if kernel == "gemm" else 2.0
        # Dequantizing wins at 64 rows, loses at 128, wins from 256 on: the switch is 256.
        wins = m == 64 or m >= 256
        return (2.0 if kernel == "gemm" else 1.0) if wins else (1.0 if kernel == "gemm" else 2.0)

    monkeypatch.setattr(cuda_backend, "graph_time_ms", fake_time)
    chosen = QuantLinearMethod.choose_dequant_rows(layers)
    assert DEQUANT_ROWS[:3] == (64, 128, 256)
    assert {key[1]: rows for key, rows in chosen.items()} == {
        key[1]: (0 if key[1] == widest else 256) for key in chosen
    }
    assert len(set(chosen.values())) == 2
    for layer in layers:
        for seg in layer.quant_segments:
            assert seg.dequant_rows == (0 if seg.end - seg.start == widest else 256)


def test_choose_dequant_rows_times_dequantizing_against_the_route(tmp_path, fake_csrc, monkeypatch):
    """After choose_kernels, dequantizing is timed against what the layer would run
    without it: at 64 rows the csrc route, at 128 its pieces (both faster here), past
    that the Triton GEMM (slower): the switch is where the Triton GEMM takes over, not
    where dequantizing first beat it."""
    from test_quant_formats import VARIANTS, load_model, write_checkpoint

    from asyncgen._ops import triton_quant_gemm
    from asyncgen.model.quantization import DEQUANT_ROWS, TENSOR_CORES, TRITON, QuantLinearMethod

    def fake_triton(self, x, qweight, scales, zeros, seg, bias, out, size):
        fake_csrc.append(("triton", x.shape[0], TRITON))
        return out

    monkeypatch.setattr(QuantLinearMethod, "_triton", fake_triton)
    monkeypatch.setattr(triton_quant_gemm, "dequant_matmul", lambda x, *a, out: fake_csrc.append(("deq", x.shape[0], -1)))
    def fake_time(fn, items):  # per call: the tensor-core kernel 1, Triton 9, dequantizing 5
        fake_csrc.clear()
        fn(items[0])
        return sum({TENSOR_CORES: 1.0, TRITON: 9.0, -1: 5.0}.get(call[2], 8.0) for call in fake_csrc)

    monkeypatch.setattr(cuda_backend, "graph_time_ms", fake_time)
    write_checkpoint(tmp_path / "awq", VARIANTS["awq-g64"])
    model = load_model(tmp_path / "awq", "cuda")
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and getattr(m, "quant_kernel", None)]
    QuantLinearMethod.choose_kernels(layers)
    assert all(seg.chunk_rows == 128 for layer in layers for seg in layer.quant_segments)
    chosen = QuantLinearMethod.choose_dequant_rows(layers)
    assert DEQUANT_ROWS[:3] == (64, 128, 256)
    assert chosen and set(chosen.values()) == {256}
    assert all(seg.dequant_rows == 256 for layer in layers for seg in layer.quant_segments)
