"""Where a one-stream decode step's time goes: the step with parts of the model left out.

The 7B-shaped AWQ and fp16 checkpoints of ``quant_decode.py`` are each served by their own
process through ``AsyncEngine``, once as they are and once per variant in which the cuda
backend's RMSNorm, its rotary + attention, or both are replaced by functions that launch
no kernel (the norm returns its input, the attention an uninitialised output). The
outputs of those variants are meaningless; their token rate says how much of the
CUDA-graph step the left-out kernels cost, chain of dependent launches included, which a
profile of eager kernels does not show. With both left out, what remains is the
embedding, the four products a layer, the ``lm_head`` and the sampling.

    python3 benchmarks/decode_ablation.py --tokenizer DIR [--out decode_ablation.json]

Each run: one warm-up request, then three times a request of 16 and one of 256 greedy
tokens after the same 32-token prompt; the rate is 240 tokens over the difference of their
times (so the prompt step and the first tokens cancel out), and the median of the three is
reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_decode import (  # noqa: E402
    LLAMA2_7B, add_model_arguments, model_config, report, run_measuring, write_checkpoint,
)

VARIANTS = {
    "awq": ("all", "no-norm", "no-attention", "no-norm-no-attention"),
    "fp16": ("all", "no-norm-no-attention"),
}


def _leave_out(variant: str) -> None:
    """Makes the cuda backend's op bundle launch nothing for the parts `variant` names."""
    from asyncgen._ops import cuda_backend

    build = cuda_backend.ops

    def ops():
        o, repl = build(), {}
        if "no-norm" in variant:
            repl["rms_norm"] = lambda x, weight, eps, residual=None: (x, x if residual is None else residual)
        if "no-attention" in variant:
            repl["rotary_attention"] = lambda positions, q, *args, **kwargs: torch.empty_like(q)
        return dataclasses.replace(o, **repl)

    cuda_backend.ops = ops


async def measure(path: str, variant: str, repeats: int, tokens: int) -> dict:
    from asyncgen import AsyncEngine, SamplingParams

    _leave_out(variant)
    prompt = torch.randint(3, 32000, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    t0 = time.perf_counter()
    engine = AsyncEngine.from_pretrained(path, device="cuda", dtype="float16", max_model_len=1024, max_num_seqs=8,
                                         gpu_memory_utilization=0.85)
    await engine.start()
    res = {"start_seconds": time.perf_counter() - t0}
    try:
        await engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))

        async def seconds(n: int) -> float:
            t = time.perf_counter()
            out = await engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            assert len(out.outputs[0].token_ids) == n
            return time.perf_counter() - t

        rates = []
        for _ in range(repeats):
            short, long = await seconds(16), await seconds(tokens)
            rates.append((tokens - 16) / (long - short))
        res["runs_tokens_per_s"] = rates
        res["tokens_per_s"] = statistics.median(rates)
    finally:
        await engine.aclose()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--out", default="decode_ablation.json")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of requests timed; the median is reported")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--models", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--variants", nargs="+", default=None, choices=sorted({v for vs in VARIANTS.values() for v in vs}),
                    help="only these variants (default: each model's all)")
    ap.add_argument("--measure", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: path, variant
    args = ap.parse_args()
    if args.measure:
        import anyio

        res = anyio.run(measure, args.measure[0], args.measure[1], args.repeats, args.tokens)
        report(res)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = model_config(LLAMA2_7B, args)
    work = Path(tempfile.mkdtemp(prefix="asyncgen-ablation-"))
    results: dict = {"config": cfg, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        for name in args.models:
            variants = [v for v in VARIANTS[name] if args.variants is None or v in args.variants]
            write_checkpoint(work / name, cfg, name == "awq", "cuda", args.tokenizer)
            torch.cuda.empty_cache()
            results[name] = {}
            for variant in variants:
                cmd = [sys.executable, __file__, "--measure", str(work / name), variant,
                       "--repeats", str(args.repeats), "--tokens", str(args.tokens)]
                res, proc = run_measuring(cmd)
                if res is None:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    res = {"error": f"exit {proc.returncode}"}
                results[name][variant] = res
                print(f"{name} {variant}: {results[name][variant]}", flush=True)
            shutil.rmtree(work / name, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    fp16 = results.get("fp16", {}).get("all", {}).get("tokens_per_s")
    print(f"\n{'model':6} {'variant':24} {'tok/s':>8} {'step ms':>8} {'vs fp16':>8}")
    for name in args.models:
        for variant, r in results[name].items():
            rate = r.get("tokens_per_s")
            if rate is None:
                print(f"{name:6} {variant:24} {'failed':>8}")
                continue
            ratio = f"{rate / fp16:.2f}x" if fp16 else ""
            print(f"{name:6} {variant:24} {rate:8.1f} {1e3 / rate:8.3f} {ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
