"""Online serving: requests arriving at random times against one engine in this process.

The host's view of an embedded engine under load. Requests arrive as a Poisson process
(exponential gaps, mean ``1 / --rate`` seconds) for ``--duration`` seconds or until
``--num-requests`` have arrived; each one streams its tokens back on the same event loop
that runs the engine, and a "health" task on that loop sleeps 10 ms again and again and
records how late it wakes (the event-loop lag every other coroutine of the host would
suffer). Reported: time to first token (TTFT) and time per output token (TPOT) p50/p99,
end-to-end latency, request throughput, output tokens/s and the loop lag p50/p99/max.

Workload (no dataset download):

* prompts are random token ids (special tokens excluded); ``--shared-prefix-len N``
  puts the same N random tokens (a "system prompt") in front of every prompt;
* prompt and output lengths are lognormal with the given means:
  ``--prompt-len-mean 160 --output-len-mean 340`` by default, with spreads
  ``--prompt-len-sigma 1.0 --output-len-sigma 0.8`` (of the underlying normal). The
  means are about the ShareGPT averages reported in the vLLM paper (Kwon et al.,
  SOSP 2023); they were not re-derived here, and the lognormal shape and the sigmas are
  an assumption meant to give chat-like long tails, not a fit to any dataset. Lengths
  are clipped to ``[1, --max-prompt-len]`` / ``[1, --max-output-len]`` and to the
  model's context;
* ``ignore_eos=True`` with ``max_tokens`` = the drawn output length, so every request
  generates exactly that many tokens; ``--temperature`` (default 0, greedy).

Definitions: TTFT = first token received - scheduled arrival time (a late start of the
request because the loop lagged counts against TTFT); TTFT from send = first token
received - the client's call of ``engine.stream()``, as a client times it (the two differ
by the send lateness, also reported: how late the loop woke the client's timer, which
asyncio's millisecond polling alone makes up to 1 ms); TPOT = (last token - first token)
/ (output tokens - 1), per request with at least 2 output tokens; throughput spans from
the first arrival to the last completion.

Examples::

    python benchmarks/online.py --rate 0.5 --num-requests 40 --prompt-len-mean 128 --output-len-mean 64
    python benchmarks/online.py --model /data/llama-7b-random --device cuda --dtype float16 \\
        --rate 8 --duration 120 --json online.json
    python benchmarks/online.py --compare-prefix-caching --shared-prefix-len 512 --rate 1 --num-requests 30
    python benchmarks/online.py --quick --model DIR          # a few seconds, for tests

Run from the repository root with asyncgen importable (``pip install -e .``, or
``PYTHONPATH=.``).

``--compare-prefix-caching`` runs the same workload (same seed) twice, with prefix
caching on and off, and prints the ratio of their mean and median TTFT (both
definitions) over every request but the first (the first one fills the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import random
import sys
import time
from typing import Any, Optional

import anyio

LAG_INTERVAL_S = 0.010


# --- workload ----------------------------------------------------------------------------------
@dataclasses.dataclass
class RequestSpec:
    arrival: float  # seconds after the start
    prompt_ids: list[int]
    output_len: int


def lognormal_length(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal draw with the given mean (``mu = ln(mean) - sigma^2 / 2``), rounded and clipped."""
    if sigma <= 0:
        return max(lo, min(hi, round(mean)))
    mu = math.log(mean) - sigma * sigma / 2
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


def build_workload(args: argparse.Namespace, vocab: list[int], max_model_len: int) -> list[RequestSpec]:
    """The same list for the same arguments and vocabulary (seeded), whatever the engine."""
    rng = random.Random(args.seed)
    shared = [rng.choice(vocab) for _ in range(args.shared_prefix_len)]
    room = max_model_len - len(shared)
    if room < 2:
        raise SystemExit(f"--shared-prefix-len {args.shared_prefix_len} leaves no room in max_model_len {max_model_len}")
    specs: list[RequestSpec] = []
    t = 0.0
    while True:
        if args.num_requests is not None and len(specs) >= args.num_requests:
            break
        t += rng.expovariate(args.rate) if math.isfinite(args.rate) else 0.0
        if args.num_requests is None and t > args.duration:
            break
        prompt_len = lognormal_length(
            rng, args.prompt_len_mean, args.prompt_len_sigma, 1, min(args.max_prompt_len, room - 1)
        )
        output_len = lognormal_length(
            rng, args.output_len_mean, args.output_len_sigma, 1, min(args.max_output_len, room - prompt_len)
        )
        prompt = shared + [rng.choice(vocab) for _ in range(prompt_len)]
        specs.append(RequestSpec(t, prompt, output_len))
    return specs


# --- one run -------------------------------------------------------------------------------------
@dataclasses.dataclass
class RequestRecord:
    arrival: float
    prompt_len: int
    output_len: int  # asked for
    num_output_tokens: int = 0
    sent: Optional[float] = None  # when the client called engine.stream(), at or after `arrival`
    first_token: Optional[float] = None
    end: Optional[float] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    engine_ttft: Optional[float] = None  # from the final chunk's metrics, when the engine gives them
    engine_queue_time: Optional[float] = None
    num_cached_tokens: Optional[int] = None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def ttft_from_send(self) -> Optional[float]:
        """As a client measures it (vLLM's benchmark does): from the request's submission.
        ``ttft`` counts from the planned arrival, so it also holds the client's own timer
        lateness (``sent - arrival``: the event loop wakes a sleeper up to a millisecond late)."""
        return None if self.first_token is None or self.sent is None else self.first_token - self.sent

    @property
    def tpot(self) -> Optional[float]:
        if self.first_token is None or self.end is None or self.num_output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.num_output_tokens - 1)

    @property
    def latency(self) -> Optional[float]:
        return None if self.end is None else self.end - self.arrival


async def _health(lags: list[float], stop: anyio.Event) -> None:
    """Sleeps LAG_INTERVAL_S again and again; records how late each wake-up is."""
    while not stop.is_set():
        t = time.perf_counter()
        await anyio.sleep(LAG_INTERVAL_S)
        lags.append(max(0.0, time.perf_counter() - t - LAG_INTERVAL_S))


async def _one(engine, spec: RequestSpec, t0: float, params, record: RequestRecord) -> None:
    try:
        record.sent = time.perf_counter() - t0
        async with engine.stream(spec.prompt_ids, params) as stream:
            async for chunk in stream:
                now = time.perf_counter() - t0
                if chunk.token_ids:
                    if record.first_token is None:
                        record.first_token = now
                    record.num_output_tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    record.end = now
                    record.finish_reason = chunk.finish_reason
                    m = getattr(chunk, "metrics", None)
                    if m is not None:
                        record.engine_ttft = getattr(m, "time_to_first_token", None)
                        record.engine_queue_time = getattr(m, "queue_time", None)
                        record.num_cached_tokens = getattr(m, "num_cached_tokens", None)
    except Exception as e:  # recorded and reported; one failed request does not stop the run
        record.error = f"{type(e).__name__}: {e}"


async def run_workload(engine, specs: list[RequestSpec], temperature: float) -> dict[str, Any]:
    from asyncgen import SamplingParams

    records = [RequestRecord(s.arrival, len(s.prompt_ids), s.output_len) for s in specs]
    lags: list[float] = []
    stop = anyio.Event()
    stats_before = engine.stats()
    async with anyio.create_task_group() as outer:
        outer.start_soon(_health, lags, stop)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, (spec, record) in enumerate(zip(specs, records)):
                delay = spec.arrival - (time.perf_counter() - t0)
                if delay > 0:
                    await anyio.sleep(delay)
                params = SamplingParams(
                    max_tokens=spec.output_len, ignore_eos=True, temperature=temperature, seed=i if temperature else None
                )
                tg.start_soon(_one, engine, spec, t0, params, record)
        stop.set()
    stats_after = engine.stats()
    return {"records": records, "lags": lags, "stats_before": stats_before, "stats_after": stats_after}


def engine_kwargs(args: argparse.Namespace, enable_prefix_caching: Optional[bool]) -> dict[str, Any]:
    """The engine options this run sets; options the engine lacks are refused clearly."""
    from asyncgen import EngineConfig

    fields = EngineConfig.model_fields
    kw: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    optional = {
        "max_model_len": args.max_model_len,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": enable_prefix_caching,
    }
    for name, value in optional.items():
        if value is None:
            continue
        if name not in fields:
            raise SystemExit(f"this asyncgen's EngineConfig has no '{name}' option")
        kw[name] = value
    return kw


async def run_once(args: argparse.Namespace, enable_prefix_caching: Optional[bool]) -> dict[str, Any]:
    from asyncgen import AsyncEngine, SamplingParams

    kw = engine_kwargs(args, enable_prefix_caching)
    async with AsyncEngine.from_pretrained(args.model, **kw) as engine:
        special = set(getattr(engine.tokenizer, "all_special_ids", []) or [])
        vocab = [i for i in range(engine.vocab_size) if i not in special]
        specs = build_workload(args, vocab, engine.max_model_len)
        # Warm-up (first-call allocations, kernels compiled on first use): a burst of 32
        # requests with the workload's prompt lengths and random tokens (never a prefix
        # of the workload's prompts), 4 output tokens each, all at once.
        warm_rng = random.Random(args.seed + 1)
        warm = [
            [warm_rng.choice(vocab) for _ in range(lognormal_length(
                warm_rng, args.prompt_len_mean, args.prompt_len_sigma, 1, min(args.max_prompt_len, engine.max_model_len - 8)))]
            for _ in range(32 if not args.quick else 2)
        ]
        async with anyio.create_task_group() as tg:
            for prompt in warm:
                tg.start_soon(engine.generate, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        result = await run_workload(engine, specs, args.temperature)
        result["engine"] = {"model_name": engine.model_name, "max_model_len": engine.max_model_len, **kw}
        result["config"] = {k: getattr(engine.config, k) for k in type(engine.config).model_fields}
    return result


# --- statistics ------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def summarize(result: dict[str, Any], skip_first: int = 0) -> dict[str, Any]:
    records: list[RequestRecord] = result["records"]
    done = [r for r in records if r.end is not None and r.error is None]
    errors = [r for r in records if r.error is not None]
    span = max((r.end for r in done), default=0.0) - min((r.arrival for r in records), default=0.0)
    ttft = [r.ttft for r in done[skip_first:] if r.ttft is not None]
    ttft_send = [r.ttft_from_send for r in done[skip_first:] if r.ttft_from_send is not None]
    late = [r.sent - r.arrival for r in done[skip_first:] if r.sent is not None]
    tpot = [r.tpot for r in done if r.tpot is not None]
    lat = [r.latency for r in done if r.latency is not None]
    out_tokens = sum(r.num_output_tokens for r in done)
    lags_ms = [x * 1000 for x in result["lags"]]
    before, after = result["stats_before"], result["stats_after"]
    cached = [r.num_cached_tokens for r in done[skip_first:] if r.num_cached_tokens is not None]
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_errors": len(errors),
        "errors": sorted({r.error for r in errors})[:5],
        "duration_s": span,
        "request_throughput_per_s": len(done) / span if span > 0 else None,
        "output_tokens_per_s": out_tokens / span if span > 0 else None,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_len for r in done),
        "mean_prompt_len": _mean([r.prompt_len for r in records]),
        "mean_output_len": _mean([r.output_len for r in records]),
        "ttft_s": {"mean": _mean(ttft), "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "ttft_from_send_s": {
            "mean": _mean(ttft_send), "p50": percentile(ttft_send, 50), "p99": percentile(ttft_send, 99),
        },
        "send_lateness_s": {"mean": _mean(late), "p50": percentile(late, 50), "p99": percentile(late, 99)},
        "tpot_s": {"mean": _mean(tpot), "p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        "latency_s": {"mean": _mean(lat), "p50": percentile(lat, 50), "p99": percentile(lat, 99)},
        "loop_lag_ms": {
            "interval_ms": LAG_INTERVAL_S * 1000, "samples": len(lags_ms), "p50": percentile(lags_ms, 50),
            "p99": percentile(lags_ms, 99), "max": max(lags_ms, default=None),
        },
        "engine_ttft_mean_s": _mean([r.engine_ttft for r in done[skip_first:] if r.engine_ttft is not None]),
        "engine_queue_time_mean_s": _mean([r.engine_queue_time for r in done if r.engine_queue_time is not None]),
        "mean_cached_prompt_tokens": _mean(cached),
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "num_steps": after.num_steps - before.num_steps,
        "prefix_cache_hit_rate": getattr(after, "prefix_cache_hit_rate", None),
        "leaked_blocks": after.num_total_blocks - after.num_free_blocks,
    }


def _fmt(x: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def print_summary(title: str, s: dict[str, Any]) -> None:
    print(f"== {title}")
    print(f"requests           {s['num_completed']}/{s['num_requests']} completed, {s['num_errors']} errors"
          + (f" ({'; '.join(s['errors'])})" if s["errors"] else ""))
    print(f"duration           {_fmt(s['duration_s'], digits=2)} s")
    print(f"mean prompt/output {_fmt(s['mean_prompt_len'])} / {_fmt(s['mean_output_len'])} tokens")
    print(f"request throughput {_fmt(s['request_throughput_per_s'], digits=3)} req/s")
    print(f"output throughput  {_fmt(s['output_tokens_per_s'])} tok/s")
    rows = (("ttft_s", "TTFT"), ("ttft_from_send_s", "TTFT from send"), ("send_lateness_s", "send lateness"),
            ("tpot_s", "TPOT"), ("latency_s", "latency"))
    for key, label in rows:
        d = s[key]
        print(f"{label:<18} mean {_fmt(d['mean'], 1000)} ms  p50 {_fmt(d['p50'], 1000)} ms  p99 {_fmt(d['p99'], 1000)} ms")
    lag = s["loop_lag_ms"]
    print(f"loop lag (10 ms)   p50 {_fmt(lag['p50'], digits=2)} ms  p99 {_fmt(lag['p99'], digits=2)} ms  "
          f"max {_fmt(lag['max'], digits=2)} ms  ({lag['samples']} samples)")
    print(f"preemptions        {s['num_preemptions']}   steps {s['num_steps']}   leaked blocks {s['leaked_blocks']}")
    if s["engine_ttft_mean_s"] is not None:
        print(f"engine side        TTFT mean {_fmt(s['engine_ttft_mean_s'], 1000, 2)} ms (request added -> first token "
              f"sampled), queue mean {_fmt(s['engine_queue_time_mean_s'], 1000, 2)} ms (added -> first scheduled)")
    if s["mean_cached_prompt_tokens"] is not None:
        print(f"cached prompt tok  {_fmt(s['mean_cached_prompt_tokens'])} per request (mean)")


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device in ("cuda", "auto") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# --- command line ------------------------------------------------------------------------------
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--num-kv-blocks", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="default: the engine's default")
    ap.add_argument("--compare-prefix-caching", action="store_true",
                    help="run the workload with prefix caching on, then off, and print the TTFT ratio")
    ap.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (inf: all at once)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (unless --num-requests)")
    ap.add_argument("--num-requests", type=int, help="stop after this many arrivals (overrides --duration)")
    ap.add_argument("--prompt-len-mean", type=float, default=160.0)
    ap.add_argument("--prompt-len-sigma", type=float, default=1.0)
    ap.add_argument("--max-prompt-len", type=int, default=2048)
    ap.add_argument("--output-len-mean", type=float, default=340.0)
    ap.add_argument("--output-len-sigma", type=float, default=0.8)
    ap.add_argument("--max-output-len", type=int, default=2048)
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a common prefix on every prompt")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--torch-threads", type=int,
                    help="torch intra-op threads (default: torch's); on a busy CPU 1 can be much faster")
    ap.add_argument("--json", metavar="OUT", help="write the summary (and every request's timings) here")
    ap.add_argument("--quick", action="store_true", help="a few tiny requests: a smoke run for tests")
    ap.add_argument("--log-level", default="WARNING", help="of the engine's log (INFO shows its start-up choices)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rate, args.num_requests = 20.0, 8
        args.prompt_len_mean, args.output_len_mean = 24.0, 8.0
        args.max_prompt_len, args.max_output_len = 64, 16
        args.max_model_len = args.max_model_len or 256
        args.num_kv_blocks = args.num_kv_blocks or 128
    if args.rate <= 0:
        ap.error("--rate must be > 0")
    if args.shared_prefix_len < 0:
        ap.error("--shared-prefix-len must be >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("asyncgen").setLevel(args.log_level.upper())
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)  # before the engine's device thread starts
    if args.model is None:
        from asyncgen.fetch import smollm2

        args.model = str(smollm2())
    runs: dict[str, dict[str, Any]] = {}
    if args.compare_prefix_caching:
        for label, flag in (("prefix_caching_on", True), ("prefix_caching_off", False)):
            runs[label] = anyio.run(run_once, args, flag, backend=args.backend)
    else:
        runs["run"] = anyio.run(run_once, args, args.enable_prefix_caching, backend=args.backend)

    skip = 1 if args.compare_prefix_caching else 0
    report: dict[str, Any] = {
        "command": " ".join(["python benchmarks/online.py"] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(args.device),
        "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in vars(args).items()},
        "runs": {},
    }
    for label, result in runs.items():
        s = summarize(result, skip_first=skip)
        print_summary(f"{label} ({result['engine']['model_name']})", s)
        report["runs"][label] = {
            "summary": s,
            "engine": result["engine"],
            "requests": [dataclasses.asdict(r) for r in result["records"]],
        }
    if args.compare_prefix_caching:
        for key, name, label in (("ttft_s", "prefix_caching_ttft_ratio", "from planned arrival"),
                                 ("ttft_from_send_s", "prefix_caching_ttft_from_send_ratio", "from send")):
            on = report["runs"]["prefix_caching_on"]["summary"][key]
            off = report["runs"]["prefix_caching_off"]["summary"][key]
            ratio = off["mean"] / on["mean"] if on["mean"] and off["mean"] is not None else None
            ratio_p50 = off["p50"] / on["p50"] if on["p50"] and off["p50"] is not None else None
            report[name] = {"mean": ratio, "p50": ratio_p50}
            print(f"== TTFT ({label}) without / with prefix caching (requests after the first): "
                  f"mean {_fmt(ratio, digits=2)}x, p50 {_fmt(ratio_p50, digits=2)}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


if __name__ == "__main__":
    main()
