"""Where the time to first token of a prefix-cache hit goes, on a real model and device.

Requests arrive one at a time at an otherwise idle engine, each a ``--prefix-len``-token
prefix shared with all the others plus ``--new-len`` tokens of its own, as in
``online.py --compare-prefix-caching``; one run per ``--gap-ms`` value (the pause before
each request: 200 ms leaves the host idle as at 2 requests/s, 0 sends the next one as
soon as the last finished). For each request the host's timestamps around its first step
are recorded, the segments of ``idle_latency.py`` with the real forward pass in place of
its stub (``device``: from the end of the launch to the sampled tokens on the host):

    send      stream() call -> request added        submit  schedule() -> launch() starts
    wake      added -> the loop calls schedule()    launch  launch() on the device thread
    schedule  schedule() (prefix match, blocks)     device  launch() returned -> tokens on the host
    collect, return, update, gap, emit, handoff: as in idle_latency.py

and the launch's pieces: ``prep`` (launch() start to the prompt graph's replay, which
holds ``host_inputs``, ``staging`` and ``pack``; "(cpu)" is the device thread's CPU time
in them; cut at the start of ``_replay_prompt`` into ``prep to inputs`` and ``inputs to
replay``), ``replay`` (the host's graph launch), ``after replay`` (sampling enqueued) and
``gpu step``, CUDA events from the replay to the sampled tokens' copy to the host. Then
``--trace`` more requests run under ``torch.profiler``, and the trace's kernels are cut
up per graph launch: busy time, idle gaps (by the kernel that waited), the host's
``cudaGraphLaunch``. The profiler slows the host; its figures are for the device side.

    python3 benchmarks/prefix_hit_timeline.py --model /tmp/ag7b --requests 30
    python3 benchmarks/prefix_hit_timeline.py --model /tmp/ag7b --no-prefix-caching --gap-ms 200
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from idle_latency import find_first_step, host_segments, record_host_steps  # noqa: E402

GPU_KEYS = ("prep", "prep to inputs", "inputs to replay", "replay", "after replay", "gpu step", "host_inputs",
            "host_inputs (cpu)", "staging", "staging (cpu)",
            "pack", "pack (cpu)", "sample_async", "sample_async (cpu)")  # launch's pieces; the step's device time (CUDA events)
SEGMENTS = ("send", "wake", "schedule", "submit", "launch", "device", "collect", "return", "update", "gap", "emit",
            "handoff")


def install_probes(engine, events: list):
    """Records (name, perf_counter, object) at the start and end of the engine's host
    steps and when a step's sampled tokens reach the host; on CUDA also around each prompt
    graph's replay, with CUDA events at the replay and at the end of the launch. Returns
    a function that takes the module-level probes back out (the engine's stay)."""
    from asyncgen.worker import model_runner as mr
    from asyncgen.worker import sampler

    runner, core = engine._runner, engine._core
    real_result = sampler.PendingSample.result
    module_level = [(sampler.PendingSample, "result", real_result), (mr._PromptGraphInputs, "pack", mr._PromptGraphInputs.pack),
                    (mr, "sample_async", mr.sample_async)]

    def uninstall():
        for owner, name, original in module_level:
            setattr(owner, name, original)

    def result(self):
        res = real_result(self)
        events.append(("waited", time.perf_counter(), self))
        return res

    sampler.PendingSample.result = result

    record_host_steps(core, runner, events)

    # The launch's pieces, each with its wall time and its thread's CPU time (a wait for
    # the GIL or the device shows as wall time without CPU time).
    def piece(owner, name, label):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            res = fn(*args, **kwargs)
            events.append(("piece", time.perf_counter(), (label, time.perf_counter() - t0, time.thread_time() - c0)))
            return res

        setattr(owner, name, timed)

    piece(runner, "_host_inputs", "host_inputs")
    piece(runner, "_staging", "staging")
    piece(mr._PromptGraphInputs, "pack", "pack")
    piece(mr, "sample_async", "sample_async")
    if runner.device.type != "cuda":
        return uninstall

    class TimedGraph:
        """A prompt graph whose replay is bracketed by host timestamps and a CUDA event."""

        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            events.append(("replay:start", time.perf_counter(), start))
            self.graph.replay()
            events.append(("replay:end", time.perf_counter(), None))

    runner._prompt_graphs = {k: (TimedGraph(g), logits) for k, (g, logits) in runner._prompt_graphs.items()}
    replay_prompt = runner._replay_prompt

    @functools.wraps(replay_prompt)
    def replay_prompt_marked(*args):
        events.append(("replay_prompt:start", time.perf_counter(), None))
        return replay_prompt(*args)

    runner._replay_prompt = replay_prompt_marked
    launch = runner.launch

    @functools.wraps(launch)
    def launch_with_end_event(out):
        res = launch(out)
        end = torch.cuda.Event(enable_timing=True)
        end.record()  # after the step's sampling and its copy to the host
        events.append(("launch:event", time.perf_counter(), end))
        return res

    runner.launch = launch_with_end_event
    return uninstall



def segments(events: list, t_send: float, t_recv: float, req_id: str) -> dict[str, float]:
    """The request's first-token path (seconds): :data:`SEGMENTS`, and on CUDA the launch's
    pieces, its CUDA events under ``_events``."""
    f = find_first_step(events, t_send, req_id)
    i_l, i_le, t_launch0, t_launch1 = f["i_l"], f["i_le"], f["t_launch0"], f["t_launch1"]
    seg = host_segments(f, t_send, t_recv)
    seg.update({"launch": t_launch1 - t_launch0, "device": f["t_waited"] - t_launch1})
    seg = {k: seg[k] for k in SEGMENTS}
    try:
        i_r, t_replay0 = f.first("replay:start", i_l)
        if i_r < i_le:
            _, t_replay1 = f.first("replay:end", i_r)
            _, _, ev_end = events[f.first("launch:event", i_le)[0]]
            _, t_inputs = f.first("replay_prompt:start", i_l)
            seg.update({"prep": t_replay0 - t_launch0, "prep to inputs": t_inputs - t_launch0,
                        "inputs to replay": t_replay0 - t_inputs, "replay": t_replay1 - t_replay0,
                        "after replay": t_launch1 - t_replay1, "_events": (events[i_r][2], ev_end)})
    except LookupError:
        pass
    for ev, _, obj in events[i_l:i_le]:
        if ev == "piece":
            label, wall, cpu = obj
            if wall is not None:
                seg[label] = seg.get(label, 0.0) + wall
            seg[label + " (cpu)"] = seg.get(label + " (cpu)", 0.0) + cpu
    return seg


def device_timeline(trace_path: str) -> list[dict]:
    """Per graph launch in a chrome trace from torch.profiler: its device-side pieces (µs)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"),
                      key=lambda e: e["ts"])
    out = []
    for k, launch in enumerate(launches):
        t_launch = launch["ts"]
        t_next = launches[k + 1]["ts"] if k + 1 < len(launches) else float("inf")
        # the step's kernels: from this graph launch to the device-to-host copy of its tokens
        d2h = next((c for c in copies if c["ts"] > t_launch and "DtoH" in c.get("name", "") + str(c.get("args", {}))),
                   None)
        t_end = d2h["ts"] + d2h["dur"] if d2h is not None else t_next
        ks = [e for e in kernels if t_launch <= e["ts"] < min(t_end, t_next)]
        if not ks:
            continue
        gaps = collections.defaultdict(lambda: [0.0, 0])
        busy = 0.0
        prev_end = ks[0]["ts"]
        for e in ks:
            gap = e["ts"] - prev_end
            if gap > 0:
                site = gaps[e["name"][:60]]
                site[0] += gap
                site[1] += 1
            busy += e["dur"]
            prev_end = max(prev_end, e["ts"] + e["dur"])
        span = prev_end - ks[0]["ts"]
        out.append({
            "launch_to_first_kernel_us": ks[0]["ts"] - t_launch,
            "kernels": len(ks),
            "span_us": span,
            "busy_us": busy,
            "idle_us": span - busy,
            "last_kernel_to_tokens_us": (t_end - prev_end) if d2h is not None else None,
            "host_launch_us": launch.get("dur"),
            "gaps": sorted(((name, tot, n) for name, (tot, n) in gaps.items()), key=lambda r: -r[1])[:12],
            "kernel_us": _by_name(ks),
        })
    return out


def _by_name(ks: list[dict]) -> list[tuple[str, float, int]]:
    tot = collections.defaultdict(lambda: [0.0, 0])
    for e in ks:
        tot[e["name"][:60]][0] += e["dur"]
        tot[e["name"][:60]][1] += 1
    return sorted(((n, t, c) for n, (t, c) in tot.items()), key=lambda r: -r[1])[:14]


async def run(args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from asyncgen import AsyncEngine, SamplingParams

    kw = dict(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=not args.no_prefix_caching)
    result: dict = {"args": vars(args)}
    async with AsyncEngine.from_pretrained(args.model, **kw) as engine:
        events: list = []
        uninstall = install_probes(engine, events)
        try:
            gen = torch.Generator().manual_seed(0)
            hi = min(engine.vocab_size, 30000)
            lo = min(1000, hi // 2)  # ordinary tokens, past the special ones
            prefix = torch.randint(lo, hi, (args.prefix_len,), generator=gen).tolist()
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

            async def one(record: bool, gap_ms: float = 200.0):
                prompt = prefix + torch.randint(lo, hi, (args.new_len,), generator=gen).tolist()
                await anyio.sleep(gap_ms / 1e3)
                events.clear()
                t_send = time.perf_counter()
                t_recv, cached = None, None
                stream = engine.stream(prompt, params)
                async with stream:
                    async for chunk in stream:
                        if t_recv is None and chunk.token_ids:
                            t_recv = time.perf_counter()
                        if chunk.finish_reason is not None and chunk.metrics is not None:
                            cached = chunk.metrics.num_cached_tokens
                if not record:
                    return None
                seg = segments(events, t_send, t_recv, stream.request_id)
                if "_events" in seg:
                    ev0, ev1 = seg.pop("_events")
                    ev1.synchronize()
                    seg["gpu step"] = ev0.elapsed_time(ev1) / 1e3  # replay start -> sampled tokens copied
                seg["total"] = t_recv - t_send
                seg["cached"] = cached
                return seg

            for _ in range(args.warmup):
                await one(False)
            for gap_ms in args.gap_ms:
                rows = [await one(True, gap_ms) for _ in range(args.requests)]
                keys = [k for k in (*SEGMENTS, *GPU_KEYS, "total") if all(k in r for r in rows)]
                res = result.setdefault("runs", {})[str(gap_ms)] = {
                    "segments_p50_us": {k: statistics.median(r[k] for r in rows) * 1e6 for k in keys},
                    "segments_mean_us": {k: statistics.fmean(r[k] for r in rows) * 1e6 for k in keys},
                    "cached_tokens_p50": statistics.median(r["cached"] or 0 for r in rows),
                    "requests": rows,  # seconds
                }
                print(f"{len(rows)} requests: {args.prefix_len}-token shared prefix + {args.new_len} new tokens, "
                      f"prefix caching {'off' if args.no_prefix_caching else 'on'} "
                      f"({res['cached_tokens_p50']:.0f} cached at the median), {gap_ms} ms apart")
                print(f"  {'segment':<12} {'p50 µs':>8} {'mean µs':>8}")
                for key in keys:
                    print(f"  {key:<12} {res['segments_p50_us'][key]:8.0f} {res['segments_mean_us'][key]:8.0f}")

            if args.trace and args.device == "cuda":
                await anyio.sleep(0.2)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.trace):
                        await one(False)
                path = os.path.join(tempfile.mkdtemp(), "trace.json")
                prof.export_chrome_trace(path)
                steps = device_timeline(path)
                result["device_steps"] = steps
                # the traced requests' prompt steps: the longest steps in the trace
                for s in sorted(steps, key=lambda s: -s["span_us"])[: args.trace]:
                    print(f"  traced step: {s['kernels']} kernels over {s['span_us']:.0f} µs, busy {s['busy_us']:.0f}, "
                          f"idle {s['idle_us']:.0f}; graph launch -> first kernel {s['launch_to_first_kernel_us']:.0f} µs "
                          f"(host cudaGraphLaunch {s['host_launch_us']} µs); last kernel -> tokens on host "
                          f"{s['last_kernel_to_tokens_us']}")
                    print("    idle before (total µs, count):")
                    for name, tot, n in s["gaps"]:
                        print(f"      {tot:8.1f} {n:4d}  {name}")
                    print("    kernels (total µs, count):")
                    for name, tot, n in s["kernel_us"]:
                        print(f"      {tot:8.1f} {n:4d}  {name}")
        finally:
            uninstall()
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--new-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[200.0, 0.0],
                    help="pause before each request, ms (one run per value)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trace", type=int, default=3, help="requests traced with torch.profiler afterwards (cuda)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = anyio.run(run, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
