"""Checks and times the one-row 4-bit products of a Llama layer chained in one persistent
launch (csrc/layer_chain.cuh) against the separate kernels the engine runs at one row.

The chain is o_proj (+ residual) -> RMSNorm -> gate|up (silu * up) -> down_proj
(+ residual) -> the next layer's RMSNorm -> q|k|v, at Llama-2-7B shapes with random AWQ-
layout weights (group 128). "separate" is what the engine launches for it: the one-row
4-bit kernel four times (gate|up gated) and the Triton RMSNorm twice, chained by dependent
launches. Checks: the chain against the separate kernels (each output's relative error),
one launch against one launch a phase (bit for bit), and CUDA-graph replays. Timing: a CUDA
graph over ``--layers`` layers, each with its own weights (so that they are read from
DRAM as in a step), a copy of q|k|v's first 4096 values standing in for the attention
between layers; µs a layer, median of ``--repeats`` replays.

    PYTHONPATH=. python3 benchmarks/layer_chain.py [--layers 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from asyncgen._ops import cuda_backend as cb
from asyncgen._ops.triton_rms_norm import rms_norm

HIDDEN, INTER, QKV, GROUP, EPS = 4096, 11008, 12288, 128, 1e-5
CUDA_CORES = 1  # quant_gemv_4bit's kernel argument: the one-row kernel at one row


def packed(n: int, k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32, device=device)
    scales = (torch.rand(k // GROUP, n, generator=gen, device=device) * 0.002 + 0.001).half()
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=gen, device=device).half()
    return qweight, scales, zeros


class Layer:
    def __init__(self, gen: torch.Generator, device):
        self.o = packed(HIDDEN, HIDDEN, gen, device)
        self.gu = packed(2 * INTER, HIDDEN, gen, device)
        self.down = packed(HIDDEN, INTER, gen, device)
        self.qkv = packed(QKV, HIDDEN, gen, device)
        self.norm2 = (torch.rand(HIDDEN, generator=gen, device=device) + 0.5).half()
        self.norm1 = (torch.rand(HIDDEN, generator=gen, device=device) + 0.5).half()


class State:
    """The activations a layer reads and writes (one row each)."""

    def __init__(self, gen: torch.Generator, device):
        self.attn = torch.randn(1, HIDDEN, generator=gen, device=device).half()
        self.residual = torch.randn(1, HIDDEN, generator=gen, device=device).half()
        self.act = torch.empty(1, INTER, dtype=torch.float16, device=device)
        self.qkv = torch.empty(1, QKV, dtype=torch.float16, device=device)

    def clone(self) -> "State":
        other = object.__new__(State)
        for name in ("attn", "residual", "act", "qkv"):
            setattr(other, name, getattr(self, name).clone())
        return other


def separate(layer: Layer, s: State) -> None:
    o = cb.launch_quant_gemv_4bit(s.attn, *layer.o, GROUP, kernel=CUDA_CORES)
    h, _ = rms_norm(o, layer.norm2, EPS, s.residual, residual_out=s.residual)
    cb.launch_quant_gemv_4bit(h, *layer.gu, GROUP, out=s.act, kernel=CUDA_CORES, gated=True)
    d = cb.launch_quant_gemv_4bit(s.act, *layer.down, GROUP, kernel=CUDA_CORES)
    h2, _ = rms_norm(d, layer.norm1, EPS, s.residual, residual_out=s.residual)
    cb.launch_quant_gemv_4bit(h2, *layer.qkv, GROUP, out=s.qkv, kernel=CUDA_CORES)


def chain_phases(layer: Layer, s: State, cols: tuple[int, int, int, int]) -> list:
    return [
        cb.ChainPhase(*layer.o, GROUP, s.attn, s.residual, cb.CHAIN_RESIDUAL, None, cols[0]),
        cb.ChainPhase(*layer.gu, GROUP, s.residual, s.act, cb.CHAIN_GATED, layer.norm2, cols[1]),
        cb.ChainPhase(*layer.down, GROUP, s.act, s.residual, cb.CHAIN_RESIDUAL, None, cols[2]),
        cb.ChainPhase(*layer.qkv, GROUP, s.residual, s.qkv, cb.CHAIN_OUT, layer.norm1, cols[3]),
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def graph_us(step, layers: int, repeats: int) -> float:
    """µs a layer of `step` (all layers) replayed in a CUDA graph, median of `repeats`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / layers)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [Layer(gen, device) for _ in range(args.layers)]
    state = State(gen, device)
    scratch = cb.ChainScratch(device)
    most = scratch.max_grid(INTER)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"chain kernel: at most {most} blocks at once ({most / sms:.1f} an SM)", flush=True)
    results: dict = {"max_grid": most, "checks": [], "timing_us_per_layer": {}}
    failures = 0

    # --- checks ---------------------------------------------------------------------------
    layer = layers[0]
    ref = state.clone()
    separate(layer, ref)
    configs = [(4, 8, 4, 8), (8, 8, 8, 8), (4, 4, 4, 4)]
    grids = sorted({g for g in (sms, 2 * sms, 3 * sms, most) if g <= most})
    for cols in configs:
        for grid in grids:
            one, split = state.clone(), state.clone()
            cb.launch_quant_chain_4bit(chain_phases(layer, one, cols), scratch, EPS, grid)
            cb.launch_quant_chain_4bit(chain_phases(layer, split, cols), scratch, EPS, grid, split=True)
            torch.cuda.synchronize()
            errs = {name: rel(getattr(one, name), getattr(ref, name)) for name in ("act", "residual", "qkv")}
            same = all(torch.equal(getattr(one, n), getattr(split, n)) for n in ("act", "residual", "qkv"))
            ok = max(errs.values()) < 5e-3 and same
            failures += not ok
            line = f"check cols={cols} grid={grid}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
            print(line + f", one launch == split: {same} -> {'ok' if ok else 'FAILED'}", flush=True)
            results["checks"].append({"cols": cols, "grid": grid, **errs, "split_equal": same, "ok": ok})
    # graph replays with new inputs each time
    g_state = state.clone()
    phases = chain_phases(layer, g_state, configs[0])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cb.launch_quant_chain_4bit(phases, scratch, EPS, grids[-1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        cb.launch_quant_chain_4bit(phases, scratch, EPS, grids[-1])
    for i in range(5):
        g_state.attn.normal_()
        g_state.residual.normal_()
        fresh = g_state.clone()
        separate(layer, fresh)
        graph.replay()
        torch.cuda.synchronize()
        errs = [rel(getattr(g_state, n), getattr(fresh, n)) for n in ("act", "residual", "qkv")]
        ok = max(errs) < 5e-3
        failures += not ok
        print(f"graph replay {i}: worst relative error {max(errs):.2e} -> {'ok' if ok else 'FAILED'}", flush=True)
    results["failures"] = failures

    # --- timing ---------------------------------------------------------------------------
    def run_separate():
        for lay in layers:
            separate(lay, state)
            state.attn.copy_(state.qkv[:, :HIDDEN])

    def run_chain(cols, grid, split=False):
        plans = [chain_phases(lay, state, cols) for lay in layers]

        def step():
            for plan in plans:
                cb.launch_quant_chain_4bit(plan, scratch, EPS, grid, split=split)
                state.attn.copy_(state.qkv[:, :HIDDEN])

        return step

    chains: dict[str, tuple] = {}

    def record(name, us, setting=None):
        results["timing_us_per_layer"][name] = us
        if setting is not None:
            chains[name] = setting
        print(f"{name}: {us:.2f} us a layer", flush=True)

    record("separate kernels", graph_us(run_separate, len(layers), args.repeats))
    for cols in configs:
        for grid in grids:
            record(f"chain cols={cols} grid={grid}", graph_us(run_chain(cols, grid), len(layers), args.repeats),
                   (cols, grid))
    best = min((results["timing_us_per_layer"][k], k) for k in chains)
    record("separate kernels (again)", graph_us(run_separate, len(layers), args.repeats))
    cols, grid = chains[best[1]]
    record(f"chain cols={cols} grid={grid}, one launch a phase",
           graph_us(run_chain(cols, grid, split=True), len(layers), args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"RESULT failures={failures} best={best[1]} {best[0]:.2f} us", flush=True)


if __name__ == "__main__":
    main()
