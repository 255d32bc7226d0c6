"""``python -m asyncgen "prompt"``: stream a reply from a model (the bundled SmolLM2 by default)."""

from __future__ import annotations

import argparse
import sys
import time
import typing

import anyio

from . import AsyncEngine, SamplingParams
from .config import EngineConfig


def _choices(field: str) -> tuple[str, ...]:
    """The values the engine's config takes for ``field`` (a Literal)."""
    return typing.get_args(EngineConfig.model_fields[field].annotation)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncgen", description=__doc__)
    p.add_argument("prompt", help="what to ask")
    p.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct, fetched once into the cache)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", choices=_choices("device"))
    p.add_argument("--dtype", default="auto", choices=_choices("dtype"),
                   help="auto: fp32 on the CPU; bfloat16 is faster on CPUs with AVX-512 BF16 (docs/BENCHMARKS.md)")
    return p.parse_args(argv)


async def _run(args: argparse.Namespace) -> None:
    model = args.model
    if model is None:
        from .fetch import smollm2

        model = await anyio.to_thread.run_sync(smollm2)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    async with AsyncEngine.from_pretrained(model, device=args.device, dtype=args.dtype, max_model_len=4096) as engine:
        if args.raw:
            stream = engine.stream(args.prompt, params)
        else:
            stream = engine.stream(messages=[{"role": "user", "content": args.prompt}], params=params)
        start = time.perf_counter()
        n = 0
        async for chunk in stream:
            n += len(chunk.token_ids)
            print(chunk.text, end="", flush=True)
        elapsed = time.perf_counter() - start
    print(f"\n[{n} tokens in {elapsed:.1f} s, {n / elapsed:.1f} tokens/s, finish: {chunk.finish_reason}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    anyio.run(_run, _parse(argv))


if __name__ == "__main__":
    main()
