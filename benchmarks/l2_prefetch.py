"""Decode step time with and without the L2 weight prefetch, per batch size and setting.

For each model directory given, starts an ``AsyncEngine`` on it, then for each prefetch
setting (which linear layers, how many bytes of each) re-captures the decode CUDA graphs
with that setting at every batch size and times decode steps at context 384 as the engine
runs them (each step launched before the previous one is collected; see
``h200_llama7b.decode_step_times``). Prints a table of milliseconds per step and the
speedup over no prefetch.

    python3 benchmarks/l2_prefetch.py --model /tmp/ag7b [--awq] [--batches 1 4 16 64]

``--awq`` also writes a 7B-shaped AWQ checkpoint (``quant_decode.write_checkpoint``) and
measures it the same way. A CUDA machine with the csrc extension built is needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_llama7b import decode_step_times  # noqa: E402

MiB = 1 << 20
# (label, targets, bytes asked for per weight); None: no prefetch.
SETTINGS = [
    ("none", None, 0),
    ("o_proj", {"o_proj"}, 64 * MiB),
    ("all 8M", None, 8 * MiB),
    ("all 16M", None, 16 * MiB),
    ("all 32M", None, 32 * MiB),
    ("all 64M", None, 64 * MiB),
]


async def measure(path: Path, batches: list[int], ctx: int) -> dict:
    from asyncgen import AsyncEngine
    from asyncgen.model.prefetch import PREFETCH_TARGETS, WeightPrefetch

    engine = AsyncEngine.from_pretrained(
        path, device="cuda", dtype="float16", max_model_len=2048, max_num_seqs=max(batches),
        max_num_batched_tokens=4096, gpu_memory_utilization=0.85,
        enforce_eager=True,  # no graphs at start: each setting captures its own decode graphs
    )
    await engine.start()
    runner = engine._runner
    op = runner.model.ops.prefetch_l2
    if op is None:
        raise SystemExit("the ops backend offers no prefetch_l2 (is the csrc extension built?)")
    stream = torch.cuda.Stream()
    results = {}
    try:
        for label, targets, max_bytes in SETTINGS:
            def setup():
                runner._weight_prefetch = (
                    None if max_bytes == 0 else WeightPrefetch(op, max_bytes, stream, targets or PREFETCH_TARGETS)
                )
                runner._prefetch_max_batch = max(batches)
                runner._capture_decode_graphs()
                return decode_step_times(engine, batches, ctx)

            pipelined, one_at_a_time = await engine._device.run(setup)
            results[label] = {"pipelined_ms": pipelined, "sync_ms": one_at_a_time}
            print(f"{path.name} {label:>8}: " + "  ".join(f"b{b} {pipelined[b]:.3f}" for b in batches), flush=True)
    finally:
        await engine.aclose()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=[], help="a model directory (repeatable)")
    ap.add_argument("--awq", action="store_true", help="also measure a 7B-shaped AWQ checkpoint written here")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory for the AWQ checkpoint")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--ctx", type=int, default=384)
    ap.add_argument("--out", default="l2_prefetch.json")
    args = ap.parse_args()
    models = [Path(m) for m in args.model]
    work = None
    if args.awq:
        from quant_decode import LLAMA2_7B, write_checkpoint

        work = Path(tempfile.mkdtemp(prefix="asyncgen-awq-"))
        t0 = time.perf_counter()
        write_checkpoint(work / "awq7b", dict(LLAMA2_7B), True, "cuda", args.tokenizer)
        torch.cuda.empty_cache()
        print(f"AWQ checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
        models.append(work / "awq7b")
    results = {"gpu": torch.cuda.get_device_name(), "ctx": args.ctx}
    try:
        for m in models:
            results[m.name] = anyio.run(measure, m, args.batches, args.ctx)
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n=== decode step ms at context {args.ctx} (pipelined), by L2 prefetch setting; x = speedup over none ===")
    for m in models:
        r = results[m.name]
        base = r["none"]["pipelined_ms"]
        print(f"{m.name}:")
        print(f"  {'setting':>8} " + " ".join(f"{f'b{b}':>14}" for b in args.batches))
        for label, _, _ in SETTINGS:
            row = r[label]["pipelined_ms"]
            print(f"  {label:>8} " + " ".join(f"{row[b]:8.3f} {base[b] / row[b]:4.2f}x" for b in args.batches))


if __name__ == "__main__":
    main()
