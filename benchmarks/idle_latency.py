"""The host's latency around one request's first step at an idle engine.

A request arrives at an engine with nothing else to do; its first token reaches the
consumer's ``async for`` one model step later plus the host's work around that step:
waking the loop, scheduling (the prefix match), handing the step to the device thread,
building and uploading its inputs, launching, waiting, handing the tokens back,
updating, detokenizing and resuming the consumer. This benchmark measures that host
share on any machine by replacing the model with a stub and the device with a clock:

* the forward pass returns fixed logits at once (with ``--graphs``, through stand-ins
  for the CUDA graphs, so the runner's graph-replay path, its input copies included,
  runs as on a GPU, on CPU tensors);
* each launched step is "on the device" for ``--step-ms`` after the previous one ends;
  waiting for its tokens sleeps until then (the GIL released, as a CUDA event wait does).

Each request has a ``--prefix-len``-token prefix shared with all the others (in the
prefix cache after the first request) and ``--new-len`` tokens of its own, and asks for
``--max-tokens`` tokens; the next one is sent ``--gap-ms`` after the previous finished.
Reported per request, p50 and mean: from the ``engine.stream()`` call to the first
token in the consumer's hands, less the stub's step time (the host latency), and its
segments in order::

    send      stream() call -> request added (prompt checks, registration)
    wake      added -> the loop calls schedule()
    schedule  schedule() (prefix match, block allocation)
    submit    schedule() returned -> launch() starts on the device thread
    launch    launch() up to the step's enqueue (inputs built and uploaded, forward)
    (step)    the stub's device time, excluded
    wait+     how late the wait for the device returned (the stub's sleep overshoot)
    collect   wait returned -> collect() returned (tokens to the host, outputs)
    return    collect() returned -> the loop resumes (update() starts)
    update    update()
    gap       update() -> emit() of the request's first token
    emit      emit() (detokenizing, the stream chunk)
    handoff   emit() returned -> the consumer's async for receives the chunk

With ``--concurrent N`` it instead runs N requests at once (``--load-tokens`` output
tokens each, no shared prefix) and prints the wall time per step and tokens/s, for
checking that a change to the idle path does not slow a loaded engine down.

    python benchmarks/idle_latency.py [--model DIR] [--graphs] [--requests 200]
    python benchmarks/idle_latency.py --concurrent 256 --step-ms 0
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import threading
import time
from pathlib import Path

import anyio
import torch

SEGMENTS = ("send", "wake", "schedule", "submit", "launch", "wait+", "collect", "return", "update", "gap", "emit",
            "handoff")
_HOT_TOKEN = 262  # an ordinary word piece in SmolLM2's vocabulary: one chunk of text per token


class DeviceClock:
    """The device as a queue of steps of fixed length: a step enqueued at ``t`` finishes
    ``step_s`` after the later of ``t`` and the previous step's end."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.free_at = 0.0
        self._slack_set: set[int] = set()

    def enqueue(self) -> tuple[float, float]:
        now = time.perf_counter()
        start = max(now, self.free_at)
        self.free_at = start + self.step_s
        return start, self.free_at

    def wait(self, until: float) -> None:
        tid = threading.get_ident()
        if tid not in self._slack_set:  # 1 µs timer slack on this thread: sleeps end on time
            self._slack_set.add(tid)
            try:
                ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
            except (OSError, AttributeError):
                pass
        remaining = until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def install_stubs(engine, clock: DeviceClock, graphs: bool, events: list) -> None:
    """Replaces the model by a stub (and, with ``graphs``, the CUDA graphs by stand-ins)
    and the device by ``clock``; records timestamps into ``events`` (unless None)."""
    from asyncgen.worker import sampler

    runner, core = engine._runner, engine._core
    vocab = 1024

    class FakeModel:
        layers = runner.model.layers

        def __call__(self, ids, pos, meta):
            return torch.zeros(ids.shape[0], 8)

        def compute_logits(self, h):
            logits = torch.zeros(h.shape[0], vocab)
            logits[:, _HOT_TOKEN] = 1.0
            return logits

    runner.model = FakeModel()
    runner._graphs = {}
    if graphs:
        install_fake_graphs(runner, vocab)

    real_init, real_result = sampler.PendingSample.__init__, sampler.PendingSample.result

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._stub_start, self._stub_ready = clock.enqueue()
        if events is not None:
            events.append(("enqueued", time.perf_counter(), self))

    def result(self):
        clock.wait(self._stub_ready)
        if events is not None:
            events.append(("waited", time.perf_counter(), self))
        return real_result(self)

    sampler.PendingSample.__init__, sampler.PendingSample.result = init, result
    if events is None:
        return

    record_host_steps(core, runner, events)


def record_host_steps(core, runner, events: list) -> None:
    """Records ``(name:start|end, perf_counter, object)`` around the engine core's and the
    runner's host steps (the object: the step's SchedulerOutput or LaunchedStep, else the
    call's first argument)."""

    def wrap(obj, name):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args):
            events.append((name + ":start", time.perf_counter(), args[0] if args else None))
            res = fn(*args)
            events.append((name + ":end", time.perf_counter(), res if name in ("schedule", "launch") else args[0]))
            return res

        setattr(obj, name, timed)

    for name in ("add", "schedule", "update", "emit"):
        wrap(core, name)
    for name in ("launch", "collect"):
        wrap(runner, name)


def install_fake_graphs(runner, vocab: int) -> None:
    """CUDA-graph stand-ins on the CPU: the runner's graph inputs as CPU tensors and
    graphs whose replay does nothing, their logits preset to pick ``_HOT_TOKEN``."""
    from asyncgen.worker import model_runner as mr

    class FakeGraph:
        def replay(self):
            pass

    def logits(rows):
        t = torch.zeros(rows, vocab)
        t[:, _HOT_TOKEN] = 1.0
        return t

    sizes = mr._decode_graph_sizes(runner.cfg.max_num_seqs)
    max_bs = sizes[-1]
    max_blocks = -(-runner.max_model_len // runner.block_size)
    runner._graph_inputs = {
        "input_ids": torch.zeros(max_bs, dtype=torch.int64),
        "positions": torch.zeros(max_bs, dtype=torch.int64),
        "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64),
        "block_tables": torch.zeros(max_bs, max_blocks, dtype=torch.int32),
        "seq_lens": torch.ones(max_bs, dtype=torch.int32),
        "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32),
    }
    runner._graphs = {b: (FakeGraph(), logits(b)) for b in sizes}
    runner._graph_sizes = sizes
    keys = mr._prompt_graph_keys(runner.cfg.max_num_batched_tokens, runner.cfg.max_num_seqs)
    runner._prompt_inputs = {(t, b): mr._PromptGraphInputs(t, b, max_blocks, runner.device) for t, b in keys}
    runner._prompt_graphs = {k: (FakeGraph(), logits(k[1])) for k in keys}
    runner._prompt_graph_keys = keys


class FirstStep(dict):
    """The recorded events of a request's first step (see :func:`find_first_step`)."""

    def first(self, name, after, key=None):
        """(index, time) of the first event ``name`` at or after index ``after``."""
        events = self["events"]
        for i in range(after, len(events)):
            ev, t, obj = events[i]
            if ev == name and (key is None or key(obj)):
                return i, t
        raise LookupError(name)


def find_first_step(events: list, t_send: float, req_id: str) -> FirstStep:
    """Indices ``i_*`` and times ``t_*`` of the events on request ``req_id``'s path from its
    ``stream()`` call (``t_send``) to the emission of its first token, from the records of
    :func:`record_host_steps` and a ``("waited", t, pending)`` event when a step's tokens
    reached the host; also the step's ``out`` (SchedulerOutput), ``launched`` and ``pending``."""
    f = FirstStep(events=events)
    first = f.first
    start = next(i for i, (_, t, _) in enumerate(events) if t >= t_send)
    i_add, f["t_added"] = first("add:end", start)
    # The request's prompt step: the first schedule() after it was added whose output has it.
    i = i_add
    while True:
        i, f["t_sched0"] = first("schedule:start", i + 1)
        i_s, f["t_sched1"] = first("schedule:end", i)
        out = events[i_s][2]
        if any(s.req_id == req_id and s.sample for s in out.seqs):
            break
    f["out"] = out
    f["i_l"], f["t_launch0"] = first("launch:start", i_s, lambda o: o is out)
    f["i_le"], f["t_launch1"] = first("launch:end", f["i_l"])  # (the device thread runs one call at a time)
    launched = f["launched"] = events[f["i_le"]][2]
    pending = f["pending"] = launched.pending
    i_c, _ = first("collect:start", f["i_le"], lambda o: o is launched)
    i_w, f["t_waited"] = first("waited", i_c, lambda o: o is pending)
    i_ce, f["t_collect1"] = first("collect:end", i_w, lambda o: o is launched)
    i_u, f["t_update0"] = first("update:start", i_ce, lambda o: o is out)
    i_ue, f["t_update1"] = first("update:end", i_u)
    i_e, f["t_emit0"] = first("emit:start", i_ue, lambda reqs: any(r.request_id == req_id for r in reqs))
    _, f["t_emit1"] = first("emit:end", i_e)
    return f


def segments(events: list, t_send: float, t_recv: float, req_id: str) -> dict[str, float]:
    """The request's first-token path, cut at the recorded timestamps (seconds)."""
    f = find_first_step(events, t_send, req_id)
    pending = f["pending"]
    _, t_enq = f.first("enqueued", f["i_l"], lambda o: o is pending)
    ready = pending._stub_ready
    seg = host_segments(f, t_send, t_recv)
    seg.update({
        "launch": t_enq - f["t_launch0"],
        "wait+": f["t_waited"] - ready,
        # device time the request waited for beyond its own step (a step queued ahead of it)
        "(queued)": pending._stub_start - t_enq,
    })
    return {k: seg[k] for k in (*SEGMENTS, "(queued)")}


def host_segments(f: FirstStep, t_send: float, t_recv: float) -> dict[str, float]:
    """The host's segments of a first step found by :func:`find_first_step` up to the
    launch and from the tokens' arrival on the host (seconds)."""
    return {
        "send": f["t_added"] - t_send,
        "wake": f["t_sched0"] - f["t_added"],
        "schedule": f["t_sched1"] - f["t_sched0"],
        "submit": f["t_launch0"] - f["t_sched1"],
        "collect": f["t_collect1"] - f["t_waited"],
        "return": f["t_update0"] - f["t_collect1"],
        "update": f["t_update1"] - f["t_update0"],
        "gap": f["t_emit0"] - f["t_update1"],
        "emit": f["t_emit1"] - f["t_emit0"],
        "handoff": t_recv - f["t_emit1"],
    }


async def idle(engine, args, events: list) -> None:
    from asyncgen import SamplingParams

    gen = torch.Generator().manual_seed(0)
    hi = min(engine.vocab_size, 30000)
    prefix = torch.randint(1000, hi, (args.prefix_len,), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for k in range(args.requests + args.warmup):
        prompt = prefix + torch.randint(1000, hi, (args.new_len,), generator=gen).tolist()
        await anyio.sleep(args.gap_ms / 1e3)
        events.clear()
        t_send = time.perf_counter()
        t_recv = None
        stream = engine.stream(prompt, params)
        async with stream:
            async for chunk in stream:
                if t_recv is None and chunk.token_ids:
                    t_recv = time.perf_counter()
                if chunk.finish_reason is not None:
                    cached = chunk.metrics.num_cached_tokens
        if k < args.warmup:
            continue
        seg = segments(events, t_send, t_recv, stream.request_id)
        seg["total"] = t_recv - t_send - args.step_ms / 1e3
        seg["cached"] = cached
        rows.append(seg)
    print(f"{len(rows)} requests, {args.prefix_len}-token shared prefix + {args.new_len} new tokens "
          f"({statistics.median(r['cached'] for r in rows):.0f} cached at the median), step {args.step_ms} ms, "
          f"graphs {'on' if args.graphs else 'off'}")
    print(f"  {'segment':<10} {'p50 µs':>8} {'mean µs':>8}")
    for key in (*SEGMENTS, "(queued)", "total"):
        vals = [r[key] * 1e6 for r in rows]
        print(f"  {key:<10} {statistics.median(vals):8.0f} {statistics.fmean(vals):8.0f}")
    print(f"  sum of segment p50s: {sum(statistics.median(r[k] for r in rows) for k in SEGMENTS) * 1e6:.0f} µs")


async def loaded(engine, args, events: list) -> None:
    from asyncgen import SamplingParams

    gen = torch.Generator().manual_seed(1)
    hi = min(engine.vocab_size, 30000)
    prompts = torch.randint(1000, hi, (args.concurrent, args.load_prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.load_tokens, temperature=0, ignore_eos=True)
    await engine.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(args.repeats):
        core = engine._core
        steps0 = core.num_steps
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(_drain, engine, p, params)
        wall = time.perf_counter() - t0
        steps = core.num_steps - steps0
        print(f"{args.concurrent} concurrent x {args.load_prompt_len} -> {args.load_tokens} tokens, step {args.step_ms} ms: "
              f"{wall:.2f} s, {steps} steps, {wall / steps * 1e3:.2f} ms per step, "
              f"{args.concurrent * args.load_tokens / wall:.0f} tok/s")


async def _drain(engine, prompt, params) -> None:
    async with engine.stream(prompt, params) as stream:
        async for _ in stream:
            pass


async def main_async(args) -> None:
    from asyncgen import AsyncEngine

    model = args.model
    if model is None:
        from asyncgen.fetch import smollm2

        model = smollm2()
    engine = AsyncEngine.from_pretrained(
        model, device="cpu", max_model_len=2048, max_num_seqs=max(args.concurrent, 8),
        max_num_batched_tokens=2048, num_kv_blocks=max(4096, args.concurrent * 40),
    )
    await engine.start()
    events: list = []
    try:
        install_stubs(engine, DeviceClock(args.step_ms / 1e3), args.graphs, None if args.concurrent else events)
        if args.concurrent:
            await loaded(engine, args, events)
        else:
            await idle(engine, args, events)
    finally:
        await engine.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a model directory (default: SmolLM2 from the cache)")
    ap.add_argument("--graphs", action="store_true", help="run the CUDA-graph replay path with CPU stand-ins")
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--new-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=20.0)
    ap.add_argument("--concurrent", type=int, default=0)
    ap.add_argument("--load-prompt-len", type=int, default=128)
    ap.add_argument("--load-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = ap.parse_args()
    anyio.run(main_async, args, backend=args.backend)


if __name__ == "__main__":
    main()
