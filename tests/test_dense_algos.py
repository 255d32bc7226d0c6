"""Which cuBLASLt algorithm a dense layer's product runs at each row count, checked on the CPU.

cuBLASLt runs only on a GPU (``tests/gpu/check_dense_algos.py`` checks the chosen routes
there against ``F.linear``, in and out of CUDA graphs). Here a stand-in plan computes
``F.linear`` (wrongly for one algorithm) and the timings are given, so that the choice, the
routing of each row count and the fallbacks are checked.
"""

from __future__ import annotations

import pytest
import torch

from asyncgen._ops import cublaslt, cuda_backend
from asyncgen.model.linear import RowLinear
from asyncgen.worker.model_runner import _decode_graph_sizes

WRONG = 3  # the algorithm of this rank computes a wrong product
WORKSPACE = (0, 0, 4096, 0, 1 << 30)  # bytes each rank needs; rank 4 needs more than is given


class FakePlan:
    def __init__(self, m, n, k, dtype, has_bias, device):
        self.m, self.n, self.k = m, n, k
        self.runs: list[tuple[int, int]] = []
        PLANS.append(self)

    def algos(self, max_count=32, workspace_bytes=32 << 20):
        return [cublaslt.Algo((rank,) * 8, ws, 1.0, rank) for rank, ws in enumerate(WORKSPACE)
                if ws <= workspace_bytes][:max_count]

    def accepts(self, out, x, weight, bias):
        return True

    def run(self, out, x, weight, bias, algo, workspace):
        assert algo.workspace_size == 0 or algo.workspace_size <= workspace.numel()
        y = torch.nn.functional.linear(x, weight, bias)
        out.copy_(y + 1 if algo.rank == WRONG else y)
        self.runs.append((self.m, algo.rank))


PLANS: list[FakePlan] = []


@pytest.fixture
def fake_lt(monkeypatch):
    PLANS.clear()
    monkeypatch.setattr(cublaslt, "available", lambda: True)
    monkeypatch.setattr(cublaslt, "LtMatmul", FakePlan)
    monkeypatch.setattr(cublaslt, "_ALIGNMENT", 1)  # CPU tensors are only 64-byte aligned
    return PLANS


def layers_of(*shapes, bias=False):
    gen = torch.Generator().manual_seed(0)
    layers = []
    for i, (n, k) in enumerate(shapes):
        layer = RowLinear(f"l{i}", k, n, bias, torch.float32, "cpu")
        layer.weight.data.copy_(torch.randn(n, k, generator=gen))
        if bias:
            layer.bias.data.copy_(torch.randn(n, generator=gen))
        layers.append(layer)
    return layers


def test_each_row_count_takes_the_fastest_right_algorithm_that_wins_clearly(fake_lt, monkeypatch):
    # Timings by (N, rows, rank; None for F.linear). 16x64 at 16 rows: rank 1 is fastest;
    # rank 3 would be faster still but computes a wrong product, rank 4 needs too much
    # workspace. At 32 rows the best algorithm is only 2 % faster: F.linear stays. At 64
    # rows rank 0 wins. The GEMV takes 1 row of the 16x64 weights and up to 16 rows of
    # the 32x64 one, so their timings start at 16 and 32 rows.
    timings = {
        (16, 16, None): 10.0, (16, 16, 0): 9.9, (16, 16, 1): 8.0, (16, 16, 2): 9.0, (16, 16, 3): 1.0,
        (16, 32, None): 10.0, (16, 32, 0): 9.8, (16, 32, 1): 9.9, (16, 32, 2): 11.0,
        (16, 64, None): 10.0, (16, 64, 0): 7.0, (16, 64, 1): 8.0, (16, 64, 2): 9.0,
        (32, 32, None): 5.0, (32, 32, 0): 6.0, (32, 32, 1): 4.0, (32, 32, 2): 6.0,
        (32, 64, None): 5.0, (32, 64, 0): 6.0, (32, 64, 1): 6.0, (32, 64, 2): 6.0,
    }
    measured = []

    def fake_time(fn, items, passes=3):
        before = sum(len(p.runs) for p in fake_lt)
        fn(items[0])
        runs = [r for p in fake_lt for r in p.runs]
        n = items[0].weight.shape[0]
        if len(runs) > before:
            m, rank = runs[-1]
        else:
            m, rank = state["rows"], None
        measured.append((n, m, rank, len(items)))
        return timings[n, m, rank]

    state = {}
    real_linear = torch.nn.functional.linear

    def spy_linear(x, w, b=None):
        state["rows"] = x.shape[0]
        return real_linear(x, w, b)

    monkeypatch.setattr(cuda_backend, "graph_time_ms", fake_time)
    monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
    layers = layers_of((16, 64), (16, 64), (32, 64))
    layers[0].gemv_rows = layers[1].gemv_rows = 1
    layers[2].gemv_rows = 16
    workspace = torch.empty(8192, dtype=torch.uint8)
    chosen = cuda_backend.choose_dense_algos(layers, [1, 16, 32, 64, 512], workspace)
    monkeypatch.setattr(torch.nn.functional, "linear", real_linear)

    assert chosen == {(16, 64, torch.float32, False): {16: 1, 64: 0}, (32, 64, torch.float32, False): {32: 1}}
    assert {m: r.algo.rank for m, r in layers[0].lt_routes.items()} == {16: 1, 64: 0}
    assert layers[1].lt_routes == layers[0].lt_routes  # one route per shape and row count
    assert {m: r.algo.rank for m, r in layers[2].lt_routes.items()} == {32: 1}
    assert all(r.workspace is workspace for r in layers[0].lt_routes.values())
    # 512 rows is past LT_MAX_ROWS and 1 row goes to the GEMV: neither was timed. The
    # wrong algorithm and the one needing too much workspace were never timed either.
    assert {m for _, m, _, _ in measured} == {16, 32, 64}
    assert all(rank not in (WRONG, 4) for _, _, rank, _ in measured)
    assert all(count == (2 if n == 16 else 1) for n, _, _, count in measured)  # every layer of the shape


def test_a_layer_runs_its_route_at_that_row_count_only(fake_lt):
    (layer,) = layers_of((16, 64), bias=True)
    plan = FakePlan(8, 16, 64, torch.float32, True, 0)
    layer.lt_routes[8] = cublaslt.LtRoute(plan, cublaslt.Algo((2,) * 8, 0, 1.0, 2), None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=gen)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.allclose(layer(x), want) and plan.runs == [(8, 2)]
    assert torch.allclose(layer(x[:4]), want[:4]) and plan.runs == [(8, 2)]  # 4 rows: F.linear
    # Rows that are not contiguous (a column slice) are not what the plan describes.
    wide = torch.randn(8, 128, generator=gen)
    got = layer(wide[:, :64])
    assert torch.allclose(got, torch.nn.functional.linear(wide[:, :64], layer.weight, layer.bias))
    assert plan.runs == [(8, 2)]


def test_route_rejects_misaligned_input(monkeypatch):
    monkeypatch.setattr(cublaslt, "_ALIGNMENT", 256)
    route = cublaslt.LtRoute(FakePlan(4, 16, 64, torch.float32, False, 0), cublaslt.Algo((0,) * 8, 0, 1.0, 0), None)
    base = torch.empty(4 * 64 + 64)
    offset = next(i for i in range(1, 64) if (base.data_ptr() + 4 * i) % 256)
    assert not route.takes(base[offset : offset + 256].view(4, 64))


def test_nothing_is_routed_without_cublaslt(monkeypatch):
    monkeypatch.setattr(cublaslt, "available", lambda: False)
    layers = layers_of((16, 64))
    assert cuda_backend.choose_dense_algos(layers, [16, 32], torch.empty(16, dtype=torch.uint8)) == {}
    assert layers[0].lt_routes == {}


def test_cublaslt_is_unavailable_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert not cublaslt.available()
    with pytest.raises(RuntimeError, match="cuBLASLt is not available"):
        cublaslt.LtMatmul(16, 16, 16, torch.float16, False, 0)


def test_decode_graph_sizes():
    assert _decode_graph_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert _decode_graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert _decode_graph_sizes(3) == [1, 2, 3]
    assert _decode_graph_sizes(2000)[-1] == 512


@pytest.mark.parametrize("picked", [True, False])
def test_runner_times_the_graphs_row_counts_and_keeps_the_workspace_only_for_routes(monkeypatch, picked):
    from types import SimpleNamespace

    from asyncgen.worker import model_runner as mr

    runner = mr.ModelRunner.__new__(mr.ModelRunner)  # only the start-up choice is under test
    runner.cfg = SimpleNamespace(enforce_eager=False, max_num_seqs=40, max_num_batched_tokens=96)
    runner.device, runner.dtype = torch.device("cpu"), torch.float32
    layers = layers_of((16, 64), (32, 64))
    runner.model = torch.nn.ModuleList(layers)
    seen = {}

    def fake_choose(got_layers, rows, workspace):
        seen.update(layers=got_layers, rows=rows, workspace=workspace)
        return {(16, 64, torch.float32, False): {16: 0} if picked else {}, (32, 64, torch.float32, False): {}}

    monkeypatch.setattr(cuda_backend, "choose_dense_algos", fake_choose)
    runner._choose_dense_algos()
    assert seen["layers"] == layers
    # The decode graphs' batch sizes and the prompt graphs' token counts, once each.
    assert seen["rows"] == [1, 2, 4, 8, 16, 32, 40, 48, 64, 80, 96]
    assert seen["workspace"].numel() == cuda_backend.LT_WORKSPACE_BYTES
    assert (runner._lt_workspace is seen["workspace"]) if picked else runner._lt_workspace is None
