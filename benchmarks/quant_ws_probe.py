"""Where the time of the 4-bit GEMM with producer warps (``csrc/quant_ws.cuh``) goes: the
kernel rebuilt with ``AG_QWS_PROBE`` = 1 (the consumers leave out their products: the
ring of copies and barriers alone), 2 (the producers leave out their copies and the
reordering of x: the products alone), 4 (no ``wgmma``) and 3 (neither copies nor
products: the barriers, the launch and the result store), and with a deeper ring, timed
beside the kernel as it is and the warpgroup kernel without producer warps, at the
Llama-2-7B layer shapes, per call in CUDA graphs over weight copies cycled past L2. The
probes' results are wrong by design; only the kernel as it is gets checked (by
``quant_gemm_sweep.py`` and ``tests/gpu/check_quant_ops.py``); the other variants are
checked here against dequantize-then-matmul before they are timed.

``--timeline`` instead rebuilds it with ``AG_QWS_TIMELINE`` (alone and with probes 1, 2
and 3), runs each shape eagerly over the weight copies in the first launch shape of
``--configs``, and prints from the last call: every block's start, end and SM
(``%globaltimer``), and for the launch's first and last blocks the clock at each wait and
arrival of every unit (slot released, copies asked for, landed, x reordered, each
consumer's waits and chunks), in microseconds since the block started, with the medians
of the intervals between them.

    PYTHONPATH=. python3 benchmarks/quant_ws_probe.py [--rows 16,64] [--configs 8x-1,4x-2,8x8]
    PYTHONPATH=. python3 benchmarks/quant_ws_probe.py --timeline [--rows 16,64] [--configs 8x-1]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_variants import graph_us, row_case, shape_weights  # noqa: E402
from quant_gemm_sweep import BINDING, CSRC, GROUP, SHAPES  # noqa: E402


VARIANTS = {"as is": [], "no products": ["-DAG_QWS_PROBE=1"], "no copies": ["-DAG_QWS_PROBE=2"],
            "no wgmma": ["-DAG_QWS_PROBE=4"], "barriers only": ["-DAG_QWS_PROBE=3"],
            "11 slots": ["-DAG_QWS_STAGES8=11"]}
TIMELINE = ["-DAG_QWS_TIMELINE=1"]
TIMELINE_VARIANTS = {"timeline": TIMELINE, "timeline, no products": [*TIMELINE, "-DAG_QWS_PROBE=1"],
                     "timeline, no copies": [*TIMELINE, "-DAG_QWS_PROBE=2"],
                     "timeline, barriers only": [*TIMELINE, "-DAG_QWS_PROBE=3"]}
ALL_VARIANTS = {**VARIANTS, **TIMELINE_VARIANTS}
# qws_timeline's layout (csrc/quant_ws.cuh: kTlBlocks, kTlUnits, kTlUnitWords, kTlStores)
TL_BLOCKS, TL_UNITS, TL_UNIT_WORDS, TL_STORES, TL_STORE_WORDS = 1024, 64, 16, 8, 6
TL_TRACE_WORDS = 4 + TL_UNITS * TL_UNIT_WORDS + TL_STORE_WORDS * TL_STORES
TL_SLOTS = 8  # the ring's slots at 8 consumer warps (AG_QWS_STAGES8)
(EMPTY_WAIT, ISSUED, X_ISSUED, LANDED, READY, C0_START, C0_FULL, C0_READY, C0_CHUNK0, C0_CHUNK1, C0_END,
 C1_START, C1_FULL, C1_READY, C1_CHUNK1, C1_END) = range(16)
TIMELINE_SOURCE = r"""
#if AG_QWS_TIMELINE
at::Tensor timeline() {
  at::Tensor t = at::empty({asyncgen::kTlWords}, at::kLong);
  TORCH_CHECK(asyncgen::read_qws_timeline(reinterpret_cast<unsigned long long*>(t.data_ptr<int64_t>())),
              "reading qws_timeline failed");
  return t;
}
#endif
"""


def build(name: str):
    from torch.utils.cpp_extension import load_inline

    timeline = name in TIMELINE_VARIANTS
    return load_inline(
        name="ag_qws_" + "".join(ch if ch.isalnum() else "_" for ch in name),
        cpp_sources=BINDING + ("at::Tensor timeline();\n" if timeline else ""),
        cuda_sources=(CSRC / "gemv.cu").read_text() + (TIMELINE_SOURCE if timeline else ""),
        functions=["run", "timeline"] if timeline else ["run"], extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-DAG_WGMMA", *ALL_VARIANTS[name]],
    )


def _build_in_child(name: str) -> str:
    build(name)
    return name


def build_all(names: list[str]) -> dict:
    """{name: module} for each build, compiled in parallel child processes first (before
    CUDA starts here), then loaded."""
    with ProcessPoolExecutor(max_workers=len(names)) as pool:
        list(pool.map(_build_in_child, names))
    return {name: build(name) for name in names}


def launch_args(out, x, weights, scratch, n: int, k: int, warps: int, splits: int, kernel: int = 2) -> tuple:
    """``run``'s arguments for the tiled kernel ``kernel`` (2: with producer warps) in
    launch shape warps x splits with ``weights`` (qweight, scales, zeros), its workspace and
    counters from ``scratch``."""
    from asyncgen._ops import cuda_backend

    m = x.shape[0]
    pieces = cuda_backend.quant_gemm_pieces(n, k, warps, splits, x.device)
    ws, ct = scratch.buffers(pieces * m * n, -(-n // (32 * warps)))
    return (out, x, *weights, GROUP, ws if pieces > 1 else None, ct if pieces > 1 else None, warps, splits, kernel)


def time_builds(mods: dict, calls: list, want: torch.Tensor, label: str) -> tuple[dict, int]:
    """({build: per-call µs of its ``run`` over ``calls`` (argument tuples) in a CUDA
    graph}, failures): a build without probes is first checked against ``want`` with the
    first call's arguments and left out (its failure printed, named by ``label``) where it
    is off by 2e-3 or more."""
    times, failures = {}, 0
    for name, mod in mods.items():
        if not any("PROBE" in flag for flag in ALL_VARIANTS[name]):
            out = calls[0][0]
            out.fill_(float("nan"))
            mod.run(*calls[0])
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            if not err < 2e-3:
                print(f"FAIL {name} {label}: rel err {err:.2e}", flush=True)
                failures += 1
                continue
        times[name] = graph_us([lambda a=a, mod=mod: mod.run(*a) for a in calls])
    return times, failures


def describe_timeline(words: torch.Tensor, table: bool) -> list[str]:
    """What a timeline build's last launch wrote (qws_timeline), as text."""
    import numpy as np

    tl = words.numpy()
    head = tl[: 4 * TL_BLOCKS].reshape(TL_BLOCKS, 4)
    blocks = int((head[:, 0] != 0).sum())
    if blocks == 0:
        return ["  no block wrote the timeline"]
    start, end, sm, count = (head[:blocks, i].astype(np.float64) for i in range(4))
    t0 = start.min()
    lines = [f"  {blocks} blocks on {len(set(sm.tolist()))} SMs, {int(count.min())}-{int(count.max())} units each: "
             f"starts within {(start.max() - t0) / 1e3:.2f} us, ends {(end.min() - t0) / 1e3:.2f}-"
             f"{(end.max() - t0) / 1e3:.2f} us after the first start; a block's time p50 "
             f"{np.median(end - start) / 1e3:.2f}, max {(end - start).max() / 1e3:.2f} us"]
    for traced, block in ((0, 0), (1, blocks - 1)):
        tr = tl[4 * TL_BLOCKS + traced * TL_TRACE_WORDS:][:TL_TRACE_WORDS].astype(np.float64)
        clk0, gt0, clk1, gt1 = tr[:4]
        if gt1 <= gt0 or clk1 <= clk0:
            lines.append(f"  block {block}: no trace")
            continue
        ghz = (clk1 - clk0) / (gt1 - gt0)
        n = min(int(count[block]), TL_UNITS)
        raw = tr[4:4 + TL_UNITS * TL_UNIT_WORDS].reshape(TL_UNITS, TL_UNIT_WORDS)[:n]
        u = np.where(raw > 0, (raw - clk0) / ghz / 1e3, np.nan)  # us since the block's start
        stores = []  # (start, then the time to each next point, pieces)
        for st in tr[4 + TL_UNITS * TL_UNIT_WORDS:].reshape(TL_STORES, TL_STORE_WORDS):
            if st[0] > 0 and st[4] > 0:
                points = [st[0], st[1], *(st[2:4] if st[2] > 0 else [st[1], st[1]]), st[4]]
                stores.append(((st[0] - clk0) / ghz / 1e3, np.diff(points) / ghz / 1e3, int(st[5])))

        def med(values) -> str:
            values = np.asarray(values, dtype=np.float64)
            values = values[~np.isnan(values)]
            return f"{np.median(values):.3f}" if values.size else "-"

        later = slice(TL_SLOTS, n)
        released = np.fmax(u[1:, C0_CHUNK1], u[1:, C1_CHUNK1])  # slot of unit j released at unit j + 1
        refill = u[TL_SLOTS:, ISSUED] - released[: max(0, n - TL_SLOTS)] if n > TL_SLOTS else []
        lines.append(
            f"  block {block} ({ghz:.2f} GHz, {(clk1 - clk0) / ghz / 1e3:.2f} us, {n} units): first copies asked "
            f"{u[0, ISSUED]:.2f}, landed {u[0, LANDED]:.2f}, reordered {u[0, READY]:.2f}, consumer 0 done with unit 0 "
            f"{u[0, C0_END]:.2f}, with the last {u[n - 1, C0_END]:.2f} us; stores at (wait for the kernel "
            "ahead + partials written + ticket taken + rest, pieces) "
            + ", ".join(f"{a:.2f} ({' + '.join(f'{d:.2f}' for d in parts)}, {pieces})" for a, parts, pieces in stores))
        lines.append(
            "    medians, us: producer's wait for a slot " + med(u[later, ISSUED] - u[later, EMPTY_WAIT])
            + " | slot released -> refill asked " + med(refill)
            + " | asked -> landed " + med(u[:, LANDED] - u[:, ISSUED])
            + " | landed -> reordered " + med(u[:, READY] - u[:, LANDED])
            + " | consumer 0 unit to unit " + med(np.diff(u[:, C0_END]))
            + " (waits: full " + med(u[:, C0_FULL] - u[:, C0_START]) + ", ready " + med(u[:, C0_READY] - u[:, C0_FULL])
            + "; ready -> chunk 0 " + med(u[:, C0_CHUNK0] - u[:, C0_READY])
            + ", chunk 0 -> 1 " + med(u[:, C0_CHUNK1] - u[:, C0_CHUNK0])
            + ", chunk 1 -> end " + med(u[:, C0_END] - u[:, C0_CHUNK1])
            + ") | last consumer unit to unit " + med(np.diff(u[:, C1_END]))
            + " | reordered before consumer 0 asked " + med(u[:, C0_START] - u[:, READY]))
        if table and traced == 0:
            names = ["slot wait", "asked", "x asked", "landed", "ready", "c0 start", "c0 full", "c0 ready",
                     "c0 ch0", "c0 ch1", "c0 end", "c1 start", "c1 full", "c1 ready", "c1 ch1", "c1 end"]
            lines.append("    unit " + " ".join(f"{name:>9}" for name in names))
            for j in [*range(min(n, 12)), *range(max(12, n - 3), n)]:
                lines.append(f"    {j:>4} " + " ".join(f"{v:>9.3f}" for v in u[j]))
    return lines


def timeline_main(args, rows, configs) -> int:
    names = [v for v in args.variants.split(",") if v in TIMELINE_VARIANTS] or list(TIMELINE_VARIANTS)
    mods = build_all(names)

    from asyncgen._ops import cuda_backend

    scratch = cuda_backend.GemmScratch("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    warps, splits = configs[0]
    failures = 0
    print(f"{torch.cuda.get_device_name()}: launch {warps}x{splits}; the last of eager calls over weight copies "
          "cycled past L2; per-call us in a CUDA graph beside")
    for k, n in SHAPES:
        weights, _ = shape_weights(k, n, gen)
        for m in rows:
            x, out, want = row_case(m, k, n, weights, gen)
            calls = [launch_args(out, x, w, scratch, n, k, warps, splits) for w in weights]
            times, failed = time_builds(mods, calls, want, f"{k}x{n} M={m}")
            failures += failed
            for name, t in times.items():
                mod = mods[name]
                mod.timeline()  # cleared
                for a in calls:
                    mod.run(*a)
                torch.cuda.synchronize()
                print(f"{k}x{n} M={m} {name}: {t:.1f} us a call in the graph", flush=True)
                print("\n".join(describe_timeline(mod.timeline(), table=name == "timeline")), flush=True)
        del weights
        torch.cuda.empty_cache()
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--configs", default="8x-1,4x-2,8x8", help="warps x splits of the kernel with producer warps")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="builds to time, comma-separated")
    ap.add_argument("--timeline", action="store_true", help="the timeline builds instead (see above)")
    args = ap.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    if args.timeline:
        return timeline_main(args, rows, configs)
    names = [v for v in args.variants.split(",") if v]
    if "as is" not in names:
        names.insert(0, "as is")  # its build also times the warpgroup kernel
    mods = build_all(names)

    from asyncgen._ops import cuda_backend

    scratch = cuda_backend.GemmScratch("cuda")
    failures = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: per-call us, weights cycled past L2")
    for k, n in SHAPES:
        weights, _ = shape_weights(k, n, gen)
        for m in rows:
            x, out, want = row_case(m, k, n, weights, gen)
            cells = []
            for warps, splits in configs:
                calls = [launch_args(out, x, w, scratch, n, k, warps, splits) for w in weights]
                times, failed = time_builds(mods, calls, want, f"{warps}x{splits} {k}x{n} M={m}")
                failures += failed
                cells += [f"{warps}x{splits} {name} {t:.1f}" for name, t in times.items()]
            wg = graph_us([lambda a=launch_args(out, x, w, scratch, n, k, 4, 4, kernel=1): mods["as is"].run(*a)
                           for w in weights])
            print(f"{k}x{n} M={m}: wgmma 4x4 {wg:.1f} | " + " | ".join(cells), flush=True)
        del weights
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
