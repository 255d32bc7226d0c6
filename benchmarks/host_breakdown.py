"""Where an engine step's host time goes.

Wraps the per-step functions of the engine loop (``EngineCore.update``, ``schedule``,
``emit``) and of the model runner (``launch``, ``collect``, and the wait for the device
inside ``collect``) with timers, runs an offline workload through ``AsyncEngine``, and
prints each function's mean milliseconds per step next to the wall time per step. With
``--profile-step`` it also runs one prompt step of ``--step-tokens`` tokens over
``--step-cached`` cached ones through cProfile and prints the functions that took the
most host time.

    python benchmarks/host_breakdown.py --model DIR [--device cuda] [--requests 256]

With ``--fake-model`` the forward pass is replaced by a stub returning random logits, so
the figures are the engine's own bookkeeping at that batch size on this host.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import io
import pstats
import time
from pathlib import Path

import anyio
import torch


def wrap(obj, name: str, stats: dict, key: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[key].append(time.perf_counter() - t0)

    setattr(obj, name, timed)


async def run(args) -> None:
    from asyncgen import AsyncEngine, SamplingParams
    from asyncgen.worker import sampler

    engine = AsyncEngine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.requests,
        max_num_batched_tokens=8192, **({"gpu_memory_utilization": 0.85} if args.device == "cuda" else {"num_kv_blocks": args.requests * 40}),
    )
    await engine.start()
    try:
        runner, core = engine._runner, engine._core
        if args.fake_model:
            vocab = engine.vocab_size

            class Fake:
                layers = runner.model.layers

                def __call__(self, ids, pos, meta):
                    return torch.zeros(ids.shape[0], 8, device=ids.device)

                def compute_logits(self, h):
                    return torch.randn(h.shape[0], vocab, device=h.device)

            runner.model, runner._graphs = Fake(), {}
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, min(engine.vocab_size, 30000), (args.requests, args.prompt_len), generator=gen).tolist()
        await engine.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
        stats: dict[str, list[float]] = collections.defaultdict(list)
        for name in ("update", "schedule", "emit"):
            wrap(core, name, stats, name)
        for name in ("launch", "collect"):
            wrap(runner, name, stats, name)
        real_result = sampler.PendingSample.result

        def result(self):
            t0 = time.perf_counter()
            if self._event is not None:
                self._event.synchronize()
            stats["collect: wait for device"].append(time.perf_counter() - t0)
            return real_result(self)

        sampler.PendingSample.result = result
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
        steps0 = core.num_steps
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(engine.generate, p, params)
        wall = time.perf_counter() - t0
        sampler.PendingSample.result = real_result
        steps = core.num_steps - steps0
        print(f"{args.requests} requests x {args.prompt_len} -> {args.new_tokens} tokens: {wall:.2f} s, {steps} steps, "
              f"{wall / steps * 1e3:.2f} ms per step, {args.requests * args.new_tokens / wall:.0f} tok/s")
        for key, values in stats.items():
            print(f"  {key:<26} {sum(values) / steps * 1e3:7.2f} ms per step  (calls {len(values)}, "
                  f"max {max(values) * 1e3:.1f} ms)")
        if args.profile_step and not args.fake_model:
            profile_prompt_step(runner, args.step_tokens, args.step_cached)
    finally:
        await engine.aclose()


def profile_prompt_step(runner, tokens: int, cached: int) -> None:
    from asyncgen import SamplingParams
    from asyncgen.engine.scheduler import NewRequestData, ScheduledSeq, SchedulerOutput

    bs = runner.block_size
    total = tokens + cached
    table = list(range(-(-(total + 1) // bs)))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    new = NewRequestData("p", [7] * total, greedy, None, frozenset())
    runner.execute(SchedulerOutput([ScheduledSeq("p", [7] * total, 0, table, True)], [new], [], total, []))
    step = SchedulerOutput([ScheduledSeq("p", [7] * tokens, cached, table, True)], [], [], tokens, [])
    for _ in range(3):
        runner.execute(step)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        runner.execute(step)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(f"cProfile of 5 prompt steps ({tokens} tokens over {cached} cached), by own time:")
    print(s.getvalue()[:6000])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--fake-model", action="store_true")
    ap.add_argument("--profile-step", action="store_true")
    ap.add_argument("--step-tokens", type=int, default=78)
    ap.add_argument("--step-cached", type=int, default=992)
    args = ap.parse_args()
    anyio.run(run, args)


if __name__ == "__main__":
    main()
