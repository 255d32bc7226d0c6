"""asyncgen against transformers on a Llama-2-7B-shaped model with random fp16 weights.

One process, one GPU, the same weights for both (transformers builds the model, saves it
as a safetensors directory, asyncgen loads that directory):

  (a) offline throughput: 256 requests of 128 random prompt tokens / 256 output tokens;
      transformers ``generate()`` at batch 256 and ``generate_batch()`` on the same inputs;
  (b) one stream's decode tokens/s;
  (c) time of one decode step at batch 1, 64 and 256 (context 384) against the floor set
      by reading the weights and the KV cache once from HBM, measured as the engine runs
      steps (each launched before the previous one is collected) and one at a time;
  (d) with ``--profile``: the device time of each kernel in one eager decode step at
      batch 1, and the time of a prompt step over a cached prefix (78 new tokens after
      992 cached) against the same 1,070 tokens computed from scratch;
  (e) with ``--timeline``: where the wall time of (a) goes, step by step: the device time
      of each step (CUDA events around its launch), the device's idle time between steps,
      and the host time of each launch, summed for prompt (and mixed) steps and for decode
      steps by context; and the garbage collector's passes meanwhile. ``--compare-gc``
      first runs (a) on other prompts with the collector walking the whole heap (as with
      ``freeze_gc=False``), timed the same way.

Usage (a CUDA machine; no network): ``python benchmarks/h200_llama7b.py --tokenizer DIR``
where DIR holds any Llama-compatible tokenizer with ids >= 32000 (SmolLM2's works); the
tokenizer only turns generated ids into text. ``--quick`` shrinks every size for a smoke run.
Prints a table at the end and writes the numbers as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import anyio
import torch


def build_checkpoint(directory: Path, tokenizer_dir: Path, cfg_kwargs: dict):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**cfg_kwargs)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.float16).eval()
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return model


def hf_offline(model, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"seconds": dt, "output_tokens": n, "tokens_per_s": n / dt}


def hf_generate_batch(model, prompts: list[list[int]], new_tokens: int) -> dict:
    from transformers import GenerationConfig

    gc_ = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        res = model.generate_batch(inputs=prompts, generation_config=gc_)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(r.generated_tokens) for r in res.values())
    return {"seconds": dt, "output_tokens": n, "tokens_per_s": n / dt}


def hf_single_stream(model, prompt: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": new_tokens, "tokens_per_s": new_tokens / dt}


class StepTimeline:
    """Wraps a model runner's ``launch`` and ``collect`` to record each step: host times,
    and CUDA events before and after its launch (device time of the step; the device's idle
    time before it is the interval from the previous step's end event)."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []
        self._launch, self._collect = runner.launch, runner.collect

    def __enter__(self):
        def launch(out):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step = self._launch(out)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            ctx = max((s.start_pos + len(s.token_ids) for s in out.seqs), default=0)
            self.steps.append({"seqs": len(out.seqs), "tokens": out.num_batched_tokens, "ctx": ctx, "start": start,
                               "end": end, "host_launch_ms": (time.perf_counter() - t0) * 1000, "step": step})
            return step

        def collect(step):
            t0 = time.perf_counter()
            try:
                return self._collect(step)
            finally:
                for rec in reversed(self.steps):
                    if rec["step"] is step:
                        rec["host_collect_ms"] = (time.perf_counter() - t0) * 1000
                        break

        self.runner.launch, self.runner.collect = launch, collect
        return self

    def __exit__(self, *exc):
        self.runner.launch, self.runner.collect = self._launch, self._collect

    def summary(self) -> dict:
        torch.cuda.synchronize()
        rows, prev_end = [], None
        for rec in self.steps:
            rows.append({
                "seqs": rec["seqs"], "tokens": rec["tokens"], "ctx": rec["ctx"],
                "device_ms": rec["start"].elapsed_time(rec["end"]),
                "idle_before_ms": prev_end.elapsed_time(rec["start"]) if prev_end is not None else 0.0,
                "host_launch_ms": rec["host_launch_ms"], "host_collect_ms": rec.get("host_collect_ms", 0.0),
            })
            prev_end = rec["end"]
        decode = [r for r in rows if r["tokens"] == r["seqs"]]
        prompt = [r for r in rows if r["tokens"] != r["seqs"]]
        out = {"steps": len(rows), "span_ms": sum(r["device_ms"] + r["idle_before_ms"] for r in rows),
               "prompt_steps": len(prompt), "prompt_device_ms": sum(r["device_ms"] for r in prompt),
               "decode_steps": len(decode), "decode_device_ms": sum(r["device_ms"] for r in decode),
               "idle_ms": sum(r["idle_before_ms"] for r in rows), "rows": rows}
        print(f"    timeline: {out['steps']} steps over {out['span_ms']:.0f} ms of device time line; "
              f"prompt/mixed steps {out['prompt_steps']}: {out['prompt_device_ms']:.0f} ms; decode steps "
              f"{out['decode_steps']}: {out['decode_device_ms']:.0f} ms; device idle between steps {out['idle_ms']:.0f} ms")
        for r in prompt:
            print(f"    prompt step {r['seqs']:>3} seqs {r['tokens']:>5} tokens: device {r['device_ms']:7.2f} ms, "
                  f"idle before {r['idle_before_ms']:6.2f}, host launch {r['host_launch_ms']:6.2f}")
        for lo in range(0, max((r["ctx"] for r in decode), default=0) + 1, 64):
            bucket = [r for r in decode if lo <= r["ctx"] < lo + 64]
            if bucket:
                n = len(bucket)
                print(f"    decode ctx {lo:>4}-{lo + 63:<4} x{n:<4} batch {max(r['seqs'] for r in bucket):>3}: device "
                      f"{sum(r['device_ms'] for r in bucket) / n:6.2f} ms/step, idle before "
                      f"{sum(r['idle_before_ms'] for r in bucket) / n:5.2f}, host launch "
                      f"{sum(r['host_launch_ms'] for r in bucket) / n:5.2f}, collect {sum(r['host_collect_ms'] for r in bucket) / n:5.2f}")
        return out


class GcPauses:
    """Records the duration of every garbage-collector pass, by generation."""

    def __init__(self):
        self.passes: list[tuple[int, float]] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes.append((info["generation"], (time.perf_counter() - self._start) * 1000))

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        out = {}
        for g in range(3):
            ms = [d for gen, d in self.passes if gen == g]
            out[f"gen{g}"] = {"passes": len(ms), "total_ms": sum(ms), "max_ms": max(ms, default=0.0)}
        print("    garbage collector: " + "; ".join(
            f"gen {g} {v['passes']} passes, {v['total_ms']:.1f} ms, longest {v['max_ms']:.1f} ms"
            for g, v in ((g, out[f"gen{g}"]) for g in range(3))), flush=True)
        return out


async def asyncgen_runs(
    path: Path, prompts, warm_prompts, compare_prompts, new_tokens: int, single_tokens: int, step_batches, ctx: int,
    backend: str, profile: bool, timeline: bool = False, compare_gc: bool = False,
) -> dict:
    from asyncgen import AsyncEngine, SamplingParams
    from asyncgen.engine import heap

    res = {}
    t0 = time.perf_counter()
    engine = AsyncEngine.from_pretrained(
        path, device="cuda", dtype="float16", max_model_len=2048, max_num_seqs=256,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.85, ops_backend=backend,
    )
    await engine.start()
    res["start_seconds"] = time.perf_counter() - t0
    res["num_kv_blocks"] = engine.stats().num_total_blocks
    res["ops_backend"] = engine._runner.ops_backend
    try:
        async def offline(batch, max_tokens: int, record: bool = False, label: str = "(a)") -> dict:
            counts = []

            async def one(p):
                out = await engine.generate(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
                counts.append(len(out.token_ids))

            recorder = StepTimeline(engine._runner) if record else None
            pauses = GcPauses() if record else None
            with recorder or contextlib.nullcontext(), pauses or contextlib.nullcontext():
                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for p in batch:
                        tg.start_soon(one, p)
                dt = time.perf_counter() - t0
            out = {"seconds": dt, "output_tokens": sum(counts), "tokens_per_s": sum(counts) / dt}
            if record:
                print(f"(e) {label}: {out['tokens_per_s']:.0f} tok/s", flush=True)
                out["timeline"] = await engine._device.run(recorder.summary)
                out["gc_pauses"] = pauses.summary()
            return out

        # Warm-up: the same workload on other prompts of the same length (so that no timed
        # prompt is in the prefix cache), so that every kernel variant the timed run needs
        # exists beforehand and the batch goes through the same compositions of prompt
        # chunks and decodes.
        await offline(warm_prompts, new_tokens)
        if compare_gc:
            # The same workload on other prompts with the collector walking the whole heap,
            # as it does with freeze_gc=False: the engine's freeze (the only one held) is
            # released, then taken again as the engine left it.
            heap.release()
            res["offline_gc_unfrozen"] = await offline(compare_prompts, new_tokens, True, "(a) with the heap unfrozen")
            heap.freeze()
        res["offline"] = await offline(prompts, new_tokens, record=timeline)

        res["single_stream"] = await single_stream(engine, prompts[0], single_tokens)
        res["decode_step_ms"], res["decode_step_sync_ms"] = decode_step_times(engine, step_batches, ctx)
        if profile:
            res["profile"] = profile_steps(engine)
        gate_ups = [layer.mlp.gate_up_proj for layer in engine._runner.model.layers]
        res["gated_gemv"] = all(g.gemv_gated for g in gate_ups)
        if res["gated_gemv"]:
            # The same one stream and batch-1 step with SiLU-and-multiply as its own kernel
            # after the gate|up GEMV (as before the gated GEMV), graphs recaptured.
            for g in gate_ups:
                g.gemv_gated = False
            engine._runner.capture_graphs()
            res["ungated"] = {"single_stream": await single_stream(engine, prompts[1], single_tokens)}
            res["ungated"]["decode_step_ms"], res["ungated"]["decode_step_sync_ms"] = decode_step_times(engine, [1], ctx)
    finally:
        await engine.aclose()
    return res


async def single_stream(engine, prompt, tokens: int) -> dict:
    """Decode tokens/s of one stream: the tokens after its first chunk, over the time from
    its first chunk to its last (a chunk may carry more than one token)."""
    from asyncgen import SamplingParams

    times, counts = [], []
    async for chunk in engine.stream(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
        times.append(time.perf_counter())
        counts.append(len(chunk.token_ids))
    decode_tokens = sum(counts[1:])
    return {"ttft_or_first_gap_s": None, "chunks": len(times), "decode_tokens": decode_tokens,
            "tokens_per_s": decode_tokens / (times[-1] - times[0])}


def decode_step_times(engine, batches, ctx: int) -> tuple[dict, dict]:
    """Times synthetic decode batches at context ``ctx``: pipelined as the engine runs them
    (step k+1 launched before step k is collected: the interval between steps) and one
    at a time (``runner.execute``: host work plus device work, nothing overlapped)."""
    from asyncgen import SamplingParams
    from asyncgen.engine.scheduler import NewRequestData, ScheduledSeq, SchedulerOutput

    runner = engine._runner
    bs = runner.block_size
    blocks_per_seq = -(-(ctx + 1) // bs)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    out, sync = {}, {}
    for b in batches:
        ids = [f"bench-{b}-{i}" for i in range(b)]
        new = [NewRequestData(r, [1] * ctx, greedy, None, frozenset()) for r in ids]
        seqs = [
            ScheduledSeq(r, [5], ctx, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
            for i, r in enumerate(ids)
        ]
        runner.execute(SchedulerOutput(seqs, new, [], b, []))
        step = SchedulerOutput(seqs, [], [], b, [])
        for _ in range(3):
            runner.execute(step)
        torch.cuda.synchronize()
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            runner.execute(step)
        torch.cuda.synchronize()
        sync[b] = (time.perf_counter() - t0) / n * 1000
        t0 = time.perf_counter()
        prev = runner.launch(step)
        for _ in range(n - 1):
            nxt = runner.launch(step)
            runner.collect(prev)
            prev = nxt
        runner.collect(prev)
        out[b] = (time.perf_counter() - t0) / n * 1000
        runner.execute(SchedulerOutput([], [], ids, 0, []))
    return out, sync


def profile_steps(engine) -> dict:
    """(d): per-kernel device time of one eager decode step at batch 1 (context 384) and at
    batch 64 (context 128, with the step's time as the engine runs it), and a prompt step
    over a cached prefix against the same prompt from scratch."""
    from torch.profiler import ProfilerActivity, profile

    from asyncgen import SamplingParams
    from asyncgen.engine.scheduler import NewRequestData, ScheduledSeq, SchedulerOutput

    runner = engine._runner
    bs = runner.block_size
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CPU: a smoke run
    greedy = SamplingParams(temperature=0, max_tokens=10)
    result = {}

    def step_ms(step, warm: int, reps: int) -> float:
        """Host-timed ms of ``step`` as the runner runs it, after ``warm`` runs."""
        for _ in range(warm):
            runner.execute(step)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.execute(step)
        sync()
        return (time.perf_counter() - t0) / reps * 1000

    def kernels(step, reps=3) -> list:
        for _ in range(2):
            runner.execute(step)
        sync()
        activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            for _ in range(reps):
                runner.execute(step)
            sync()
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0 and ev.count >= reps:
                rows.append((ev.key[:90], ev.count // reps, t / reps))
        rows.sort(key=lambda r: -r[2])
        return rows

    # Decode at batch 1, eager (no CUDA graph) so each kernel shows.
    ctx = 384
    new = NewRequestData("prof-dec", [1] * ctx, greedy, None, frozenset())
    seq = ScheduledSeq("prof-dec", [5], ctx, list(range(-(-(ctx + 1) // bs))), True)
    runner.execute(SchedulerOutput([seq], [new], [], 1, []))
    graphs, runner._graphs = runner._graphs, {}
    rows = kernels(SchedulerOutput([seq], [], [], 1, []))
    runner._graphs = graphs
    runner.execute(SchedulerOutput([], [], ["prof-dec"], 0, []))
    total = sum(r[2] for r in rows)
    print(f"(d) eager decode step, batch 1, ctx {ctx}: {total / 1000:.2f} ms of kernels, "
          f"{sum(r[1] for r in rows)} launches")
    for name, count, us in rows[:16]:
        print(f"    {us:9.1f} us  x{count:<4d} {name}")
    result["decode_b1_kernels"] = [{"kernel": n, "per_step": c, "us": t} for n, c, t in rows]

    # Decode at batch 64 (context 128 each): the step as the engine runs it (its CUDA graph,
    # timed on the host around execute()), then eager so each kernel shows.
    batch, ctx = 64, 128
    per_seq = -(-(ctx + 1) // bs)
    ids = [f"prof-b64-{i}" for i in range(batch)]
    news = [NewRequestData(rid, [1] * ctx, greedy, None, frozenset()) for rid in ids]
    first = runner.num_blocks - batch * per_seq  # the pool's last blocks
    seqs = [ScheduledSeq(rid, [5], ctx, list(range(first + i * per_seq, first + (i + 1) * per_seq)), True)
            for i, rid in enumerate(ids)]
    runner.execute(SchedulerOutput(seqs, news, [], batch, []))
    step = SchedulerOutput(seqs, [], [], batch, [])
    graph_ms = step_ms(step, warm=3, reps=10)
    graphs, runner._graphs = runner._graphs, {}
    rows = kernels(step)
    runner._graphs = graphs
    runner.execute(SchedulerOutput([], [], ids, 0, []))
    total = sum(r[2] for r in rows)
    print(f"(d) decode step, batch {batch}, ctx {ctx}: {graph_ms:.2f} ms a step as run (graph, host-timed); "
          f"eager {total / 1000:.2f} ms of kernels, {sum(r[1] for r in rows)} launches")
    for name, count, us in rows[:16]:
        print(f"    {us:9.1f} us  x{count:<4d} {name}")
    result["decode_b64_step_ms"] = graph_ms
    result["decode_b64_kernels"] = [{"kernel": n, "per_step": c, "us": t} for n, c, t in rows]

    # A 1,070-token prompt: all of it, then 78 tokens over 992 cached ones.
    prompt, cached = 1070, 992
    table = list(range(1000, 1000 + -(-(prompt + 1) // bs)))
    timings = {}
    for name, start in (("from_scratch", 0), ("over_cached_prefix", cached)):
        rid = f"prof-{name}"
        new = NewRequestData(rid, [7] * prompt, greedy, None, frozenset())
        step = SchedulerOutput([ScheduledSeq(rid, [7] * (prompt - start), start, table, True)], [new], [], prompt - start, [])
        runner.execute(step)
        again = SchedulerOutput([ScheduledSeq(rid, [7] * (prompt - start), start, table, True)], [], [], prompt - start, [])
        timings[name] = step_ms(again, warm=2, reps=5)
        if name == "over_cached_prefix":
            rows = kernels(again)
            result["cached_prefill_kernels"] = [{"kernel": n, "per_step": c, "us": t} for n, c, t in rows]
            print(f"(d) {prompt - start}-token step over {start} cached: {sum(r[2] for r in rows) / 1000:.2f} ms of kernels")
            for kname, count, us in rows[:10]:
                print(f"    {us:9.1f} us  x{count:<4d} {kname}")
        runner.execute(SchedulerOutput([], [], [rid], 0, []))
    print(f"(d) prompt step: {prompt} tokens from scratch {timings['from_scratch']:.2f} ms; "
          f"{prompt - cached} tokens over {cached} cached {timings['over_cached_prefix']:.2f} ms")
    result["prompt_step_ms"] = timings
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="bench_7b.json")
    ap.add_argument("--workdir", default=None, help="where to write the checkpoint (kept); default: a temp dir, removed")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also run (d): kernel times and the cached-prefix step")
    ap.add_argument("--timeline", action="store_true", help="also run (e): where the time of (a) goes, step by step")
    ap.add_argument("--compare-gc", action="store_true",
                    help="also run (a) once on other prompts with the heap unfrozen (as with freeze_gc=False), timed as (e)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    if args.quick:
        cfg = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
        n_req, prompt_len, new_tokens, single_tokens = 32, 128, 32, 32
    else:
        cfg = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
        n_req, prompt_len, new_tokens, single_tokens = 256, 128, 256, 256
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 32000, (n_req, prompt_len), generator=gen).tolist()
    # Same shapes, other tokens: the warm-up's and the comparison run's prompts share no
    # block with the timed ones, so the timed run computes every prompt token.
    warm_prompts = torch.randint(0, 32000, (n_req, prompt_len), generator=gen).tolist()
    compare_prompts = torch.randint(0, 32000, (n_req, prompt_len), generator=gen).tolist()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="asyncgen-7b-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"config": cfg, "requests": n_req, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.perf_counter()
    model = build_checkpoint(work, Path(args.tokenizer), cfg)
    results["checkpoint_seconds"] = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results["weight_bytes"] = weight_bytes
    if not args.skip_hf:
        results["hf_single_stream"] = hf_single_stream(model, prompts[0], 64 if not args.quick else 16)
        print("hf single", results["hf_single_stream"], flush=True)
        results["hf_generate_b256"] = hf_offline(model, prompts, new_tokens)
        print("hf generate", results["hf_generate_b256"], flush=True)
        try:
            results["hf_generate_batch"] = hf_generate_batch(model, prompts, new_tokens)
        except Exception as e:  # the API moved between transformers releases: say so, keep going
            results["hf_generate_batch"] = {"error": f"{type(e).__name__}: {e}"}
        print("hf generate_batch", results["hf_generate_batch"], flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()

    ctx = prompt_len + new_tokens
    results["asyncgen"] = anyio.run(
        asyncgen_runs, work, prompts, warm_prompts, compare_prompts, new_tokens, single_tokens,
        (1, 64, 256) if not args.quick else (1, 8, 32), ctx, args.backend, args.profile, args.timeline, args.compare_gc,
    )
    bw = 4.3e12
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    floors = {b: (weight_bytes + b * ctx * kv_bytes_per_token) / bw * 1000 for b in results["asyncgen"]["decode_step_ms"]}
    results["decode_floor_ms"] = floors
    Path(args.out).write_text(json.dumps(results, indent=2))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)

    a = results["asyncgen"]
    print("\n=== asyncgen vs transformers,", results["gpu"], "===")
    print(f"weights {weight_bytes / 1e9:.2f} GB; KV blocks {a['num_kv_blocks']}; backend {a['ops_backend']}; start {a['start_seconds']:.1f} s")
    print(f"(a) offline {n_req}x{prompt_len}->{new_tokens}: asyncgen {a['offline']['tokens_per_s']:.0f} tok/s", end="")
    if not args.skip_hf:
        hf = results["hf_generate_b256"]["tokens_per_s"]
        print(f"; HF generate {hf:.0f} tok/s ({a['offline']['tokens_per_s'] / hf:.1f}x); HF generate_batch {results['hf_generate_batch'].get('tokens_per_s', float('nan')):.0f} tok/s")
    else:
        print()
    if "offline_gc_unfrozen" in a:
        u = a["offline_gc_unfrozen"]
        print(f"    the same workload with the heap unfrozen (freeze_gc=False): {u['tokens_per_s']:.0f} tok/s, "
              f"device idle between steps {u['timeline']['idle_ms']:.0f} ms (frozen: "
              f"{a['offline'].get('timeline', {}).get('idle_ms', float('nan')):.0f} ms)")
    print(f"(b) single stream: asyncgen {a['single_stream']['tokens_per_s']:.1f} tok/s", end="")
    if not args.skip_hf:
        print(f"; HF generate {results['hf_single_stream']['tokens_per_s']:.1f} tok/s")
    else:
        print()
    if "ungated" in a:
        u = a["ungated"]
        print(f"    with silu_and_mul as its own kernel (gated GEMV off): single stream "
              f"{u['single_stream']['tokens_per_s']:.1f} tok/s, batch-1 step {u['decode_step_ms'][1]:.2f} ms pipelined")
    for b, ms in a["decode_step_ms"].items():
        print(f"(c) decode step batch {b:>3} ctx {ctx}: {ms:.2f} ms pipelined, {a['decode_step_sync_ms'][b]:.2f} ms "
              f"one at a time (floor {floors[b]:.2f} ms, {floors[b] / ms * 100:.0f}% of bandwidth)")


if __name__ == "__main__":
    main()
