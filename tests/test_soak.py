"""Serving under load: random requests cancelled at random await points leave nothing
behind; ``aclose()`` and a failing model step end every live stream promptly.

The engine runs a tiny random-weight Llama with a 512-token vocabulary, so that a step
costs little and the tests exercise the engine's bookkeeping, not the model.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import anyio
import pytest

from asyncgen import AsyncEngine, EngineDeadError, EngineStateError, SamplingParams

from conftest import save_tiny_model

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SOAK_REQUESTS = 400


def _load(name: str):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    module_name = f"_asyncgen_benchmark_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


soak = _load("soak")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-soak"), "llama", smollm2_path, vocab_size=512)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny ops on a shared CPU run many times faster on one intra-op thread. Set before
    each engine starts (its device thread keeps the count it was created with)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _running_tasks() -> set[int]:
    return {t.id for t in anyio.get_running_tasks()}


# --- the soak ------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_soak_with_random_cancellations_leaves_nothing_behind(tiny_model):
    async with AsyncEngine.from_pretrained(tiny_model, **soak.engine_options()) as engine:
        plans = soak.plan_requests(SOAK_REQUESTS, seed=7, vocab=soak.vocabulary(engine),
                                   max_model_len=engine.max_model_len)
        report = await soak.run_soak(engine, plans, seed=7, timeout=60.0)
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    print(f"soak: {report.num_requests} requests in {report.seconds:.1f} s, outcomes {dict(report.outcomes)}, "
          f"preemptions {report.num_preemptions}, leaks {report.leaks}")
    assert report.num_stuck == 0
    assert report.errors == []
    assert report.leaks == {}  # blocks, queues, request maps, block tables, runner state
    # The workload really did what it claims: every kind of cancellation, under pressure.
    for outcome in ("complete", "deadline_hit", "broke_early", "aborted", "drop"):
        assert report.outcomes[outcome] > 0, outcome
    assert report.finish_reasons["abort"] > 0 and report.finish_reasons["length"] > 0
    assert report.num_preemptions > 0
    assert len(out.token_ids) == 5


# --- aclose() and a failing step ---------------------------------------------------------------
@pytest.mark.anyio
async def test_aclose_while_many_requests_stream_ends_each_with_abort(tiny_model):
    tasks_before = _running_tasks()
    engine = AsyncEngine.from_pretrained(tiny_model, max_model_len=256, num_kv_blocks=64, max_num_seqs=16)
    await engine.start()
    results: dict[int, dict[int, str]] = {}
    errors: list[BaseException] = []
    started = anyio.Event()
    num_requests = 40

    async def consume(i: int) -> None:
        reasons: dict[int, str] = {}
        try:
            async for chunk in engine.stream([5 + i, 6, 7], SamplingParams(n=1 + i % 3, max_tokens=200, ignore_eos=True)):
                if chunk.finish_reason is not None:
                    reasons[chunk.index] = chunk.finish_reason
                if len(results) + 1 == num_requests:
                    started.set()
        except BaseException as e:  # nothing may be raised into a consumer
            errors.append(e)
            raise
        results[i] = reasons

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(num_requests):
                tg.start_soon(consume, i)
            while engine.stats().num_generation_tokens < 50:  # some run, some still wait
                await anyio.sleep(0.01)
            stats = engine.stats()
            assert stats.num_running > 0 and stats.num_waiting > 0
            await engine.aclose()
    assert errors == []
    assert sorted(results) == list(range(num_requests))
    for i, reasons in results.items():
        assert reasons == {k: "abort" for k in range(1 + i % 3)}, (i, reasons)
    assert _running_tasks() == tasks_before  # the background loop is gone
    engine._device.join(timeout=5)
    assert not engine._device._thread.is_alive()
    with pytest.raises(EngineStateError):
        engine.stream("hi")


@pytest.mark.anyio
async def test_failing_step_turns_every_live_stream_into_engine_dead_error(tiny_model):
    tasks_before = _running_tasks()
    num_requests = 30
    async with AsyncEngine.from_pretrained(tiny_model, max_model_len=256, num_kv_blocks=64, max_num_seqs=8) as engine:
        real = engine._runner.launch
        calls = {"n": 0}
        failed_at: list[float] = []

        def failing(out):
            calls["n"] += 1
            if calls["n"] == 6:
                failed_at.append(time.monotonic())
                raise RuntimeError("injected device failure")
            return real(out)

        engine._runner.launch = failing
        seen: dict[int, float] = {}
        other: list[BaseException] = []

        async def consume(i: int) -> None:
            try:
                async for _ in engine.stream([9, 8, 7 + i], SamplingParams(n=1 + i % 2, max_tokens=100, ignore_eos=True)):
                    pass
            except EngineDeadError as e:
                assert isinstance(e.__cause__, RuntimeError) and "injected" in str(e.__cause__)
                seen[i] = time.monotonic()
            except BaseException as e:
                other.append(e)
                raise

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(num_requests):
                    tg.start_soon(consume, i)
        assert other == []
        assert sorted(seen) == list(range(num_requests))  # running and waiting requests alike
        assert max(seen.values()) - failed_at[0] < 1.0
        with pytest.raises(EngineDeadError):
            engine.stream("again")
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert not engine._core.groups and not engine._core.scheduler.requests
    assert _running_tasks() == tasks_before
    async with AsyncEngine.from_pretrained(tiny_model, max_model_len=256, num_kv_blocks=64) as fresh:
        out = await fresh.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.token_ids) == 3


# --- leaks the soak found ---------------------------------------------------------------------
@pytest.mark.anyio
async def test_leaving_async_for_without_closing_aborts(tiny_model):
    async with AsyncEngine.from_pretrained(tiny_model, max_model_len=256, num_kv_blocks=64) as engine:

        async def read_one_chunk() -> None:
            async for _ in engine.stream([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
                break  # no 'async with', no aclose(): the stream is simply dropped

        await read_one_chunk()
        await anyio.sleep(0.2)
        assert engine.stats().num_running == 0


@pytest.mark.anyio
async def test_request_aborted_before_its_first_step_leaves_no_runner_state(tiny_model):
    async with AsyncEngine.from_pretrained(tiny_model, max_model_len=256, num_kv_blocks=64) as engine:
        stream = engine.stream([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="early")
        # What the first __anext__ does before it awaits; then an abort with no await in
        # between, so no step can have seen the request (on either backend).
        engine._register(stream)
        assert engine.abort("early")
        await stream.aclose()
        for _ in range(2):  # the next steps tell the runner about new and finished requests
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        assert "early" not in engine._runner.states


# --- the online benchmark ----------------------------------------------------------------------
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_online_benchmark_quick_with_prefix_caching_comparison(tiny_model, tmp_path, anyio_backend):
    from asyncgen import EngineConfig

    online = _load("online")
    out = tmp_path / "online.json"
    compare = "enable_prefix_caching" in EngineConfig.model_fields
    report = online.main([
        "--quick", "--model", str(tiny_model), "--device", "cpu", "--shared-prefix-len", "48",
        "--json", str(out), "--backend", anyio_backend, *(["--compare-prefix-caching"] if compare else []),
    ])
    runs = {"prefix_caching_on", "prefix_caching_off"} if compare else {"run"}
    assert json.loads(out.read_text())["runs"].keys() == runs
    for label, run in report["runs"].items():
        s = run["summary"]
        assert s["num_completed"] == s["num_requests"] == 8 and s["num_errors"] == 0, (label, s)
        assert s["leaked_blocks"] == 0
        assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p99"] > 0 and s["output_tokens_per_s"] > 0
        # from the client's call: never longer than from the planned arrival, which it follows
        assert 0 < s["ttft_from_send_s"]["p50"] <= s["ttft_s"]["p50"] and s["send_lateness_s"]["p50"] >= 0
        assert all(r["sent"] >= r["arrival"] for r in run["requests"])
        assert s["loop_lag_ms"]["samples"] > 0 and s["loop_lag_ms"]["p99"] is not None
        # ignore_eos with max_tokens = the drawn length: every request generates exactly that
        assert all(r["num_output_tokens"] == r["output_len"] for r in run["requests"])
    if compare:
        on = report["runs"]["prefix_caching_on"]["summary"]
        off = report["runs"]["prefix_caching_off"]["summary"]
        if on["mean_cached_prompt_tokens"] is not None:  # the engine reports per-request metrics
            # every request after the first finds the shared prefix's full blocks cached
            assert on["mean_cached_prompt_tokens"] >= 48 - 16 and off["mean_cached_prompt_tokens"] == 0
        assert report["prefix_caching_ttft_ratio"]["mean"] > 0
        assert report["prefix_caching_ttft_from_send_ratio"]["mean"] > 0


# --- the prefix-hit timeline -------------------------------------------------------------------
def test_prefix_hit_timeline_segments_tile_each_first_token(tiny_model):
    from asyncgen.worker import model_runner, sampler

    timeline = _load("prefix_hit_timeline")
    originals = (sampler.PendingSample.result, model_runner._PromptGraphInputs.pack, model_runner.sample_async)
    report = timeline.main([
        "--model", str(tiny_model), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
        "--max-num-seqs", "8", "--prefix-len", "48", "--new-len", "8", "--requests", "3", "--warmup", "1",
        "--gap-ms", "5", "0", "--trace", "0",
    ])
    # its probes are taken back out of the modules other tests use
    assert (sampler.PendingSample.result, model_runner._PromptGraphInputs.pack, model_runner.sample_async) == originals
    assert report["runs"].keys() == {"5.0", "0.0"}
    for run in report["runs"].values():
        assert run["cached_tokens_p50"] == 48  # the prefix's three full blocks of 16
        for r in run["requests"]:
            parts = [r[k] for k in timeline.SEGMENTS]
            assert all(p >= 0 for p in parts), r
            # consecutive timestamps: the segments add up to the stream() call -> first token time
            assert sum(parts) == pytest.approx(r["total"], rel=1e-9, abs=1e-9), r
            assert 0 < r["host_inputs (cpu)"] and r["host_inputs"] <= r["launch"]
