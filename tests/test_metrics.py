"""The Prometheus collector: names, labels and values against ``engine.stats()``, scrapes
from another thread while requests stream, and the documentation of every metric."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import anyio
import pytest

from asyncgen import AsyncEngine, SamplingParams

from conftest import save_tiny_model

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "METRICS.md"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-metrics"), "llama", smollm2_path, vocab_size=512)


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # before the engine's device thread starts; tiny ops prefer one
    yield
    torch.set_num_threads(n)


def EngineCollector(*args, **kwargs):
    # Imported when a test runs, not at collection: importing asyncgen.metrics makes it an
    # attribute of the asyncgen package, which test_exported_members checks.
    from asyncgen.metrics import EngineCollector

    return EngineCollector(*args, **kwargs)


def _value(registry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {"model_name": "tiny", **labels})


def test_missing_prometheus_client_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(ImportError, match="pip install prometheus-client"):
        EngineCollector(object())


@pytest.mark.anyio
async def test_values_follow_the_engine_from_before_start_to_after_requests(tiny_model):
    # A pool of 12 blocks cannot hold 6 sequences of 60 tokens: preemptions happen.
    engine = AsyncEngine.from_pretrained(tiny_model, max_model_len=128, num_kv_blocks=12)
    registry = CollectorRegistry()
    collector = EngineCollector(engine, model_name="tiny", observe_all=False)  # the host observes
    registry.register(collector)

    # Before start: the families exist, the engine-state ones have no samples yet.
    assert _value(registry, "asyncgen:engine_running") == 0
    assert _value(registry, "asyncgen:num_requests_running") is None
    assert _value(registry, "asyncgen:time_to_first_token_seconds_count") == 0

    async with engine:
        assert _value(registry, "asyncgen:engine_running") == 1
        finals = []

        async def one(i: int) -> None:
            params = SamplingParams(n=1 + i % 2, max_tokens=40, ignore_eos=True)
            async for chunk in engine.stream([10 + i] * 20, params):
                if collector.observe(chunk):  # ignores all but the last chunk of a completion
                    finals.append(chunk)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
        out = await engine.generate([3, 4, 5], SamplingParams(n=2, max_tokens=5, ignore_eos=True))
        assert collector.observe(out) == 2
        stats = engine.stats()

        assert len(finals) == 6
        assert _value(registry, "asyncgen:num_requests_running") == stats.num_running == 0
        assert _value(registry, "asyncgen:num_requests_waiting") == 0
        assert _value(registry, "asyncgen:kv_cache_usage_perc") == 0.0
        assert _value(registry, "asyncgen:kv_cache_num_blocks") == 12
        assert _value(registry, "asyncgen:kv_cache_num_free_blocks") == 12
        assert _value(registry, "asyncgen:num_preemptions_total") == stats.num_preemptions > 0
        assert _value(registry, "asyncgen:prompt_tokens_total") == stats.num_prompt_tokens == 6 * 20 + 2 * 3
        assert _value(registry, "asyncgen:generation_tokens_total") == stats.num_generation_tokens == 6 * 40 + 2 * 5
        assert _value(registry, "asyncgen:num_requests_finished_total") == stats.num_finished_requests == 5
        assert _value(registry, "asyncgen:request_success_total", finished_reason="length") == 8
        assert _value(registry, "asyncgen:request_success_total", finished_reason="abort") == 0
        if hasattr(stats, "prefix_cache_hit_rate"):
            assert _value(registry, "asyncgen:prefix_cache_hit_rate") == pytest.approx(stats.prefix_cache_hit_rate)

        # Per-completion histograms count the completions that carried metrics.
        with_metrics = [c for c in finals if getattr(c, "metrics", None) is not None]
        with_metrics += [o for o in out.outputs if getattr(o, "metrics", None) is not None]
        ttft_count = _value(registry, "asyncgen:time_to_first_token_seconds_count")
        assert ttft_count == len(with_metrics)
        assert _value(registry, "asyncgen:time_to_first_token_seconds_bucket", le="+Inf") == ttft_count
        if with_metrics:
            assert _value(registry, "asyncgen:time_to_first_token_seconds_sum") > 0
            assert _value(registry, "asyncgen:request_generation_tokens_sum") == sum(
                m.metrics.num_generation_tokens for m in with_metrics
            )

    assert _value(registry, "asyncgen:engine_running") == 0
    text = generate_latest(registry).decode()
    assert 'asyncgen:num_preemptions_total{model_name="tiny"}' in text
    assert "# TYPE asyncgen:time_per_output_token_seconds histogram" in text


@pytest.mark.anyio
async def test_by_default_every_completion_is_recorded(tiny_model, caplog):
    """Without observe() calls: generate(), streams read to the end or left early, and
    the OpenAI layer's requests all count; a host's failing listener is logged and
    changes nothing for the requests."""
    async with AsyncEngine.from_pretrained(tiny_model, max_model_len=128, num_kv_blocks=64) as engine:
        registry = CollectorRegistry()
        collector = EngineCollector(engine, model_name="tiny")
        registry.register(collector)
        seen = []
        remove = engine.add_finish_listener(seen.append)

        def broken(chunk):
            raise ValueError("a host bug")

        engine.add_finish_listener(broken)
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        out = await engine.generate([5, 6, 7], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
        async for _ in engine.stream([8, 9], params):
            pass
        async with engine.stream([8, 10], SamplingParams(max_tokens=50, ignore_eos=True)) as stream:
            async for _ in stream:
                break  # leaving early aborts it
        client = engine.openai_client()
        resp = await client.completions.create(model=engine.model_name, prompt=[11, 12], max_tokens=4)
        remove()
        await engine.generate([13], params)  # after remove(): not in seen

        assert [c.finish_reason for c in out.outputs] == ["length", "length"]
        assert resp.choices[0].finish_reason == "length"
        assert sorted(c.finish_reason for c in seen) == ["abort", "length", "length", "length", "length"]
        assert all(c.metrics is not None for c in seen)
        assert _value(registry, "asyncgen:request_success_total", finished_reason="length") == 5
        assert _value(registry, "asyncgen:request_success_total", finished_reason="abort") == 1
        assert _value(registry, "asyncgen:time_to_first_token_seconds_count") == 6
        aborted = sum(c.metrics.num_generation_tokens for c in seen if c.finish_reason == "abort")
        # generate() n=2, the stream, the OpenAI request, the generate() after remove().
        assert _value(registry, "asyncgen:request_generation_tokens_sum") == 2 * 6 + 6 + 4 + 6 + aborted
        assert "a host bug" in caplog.text and "finish listener" in caplog.text
        with pytest.raises(RuntimeError, match="twice"):
            collector.observe(out)


@pytest.mark.anyio
async def test_scrapes_from_another_thread_while_requests_stream(tiny_model):
    async with AsyncEngine.from_pretrained(tiny_model, max_model_len=256, num_kv_blocks=64) as engine:
        registry = CollectorRegistry()
        registry.register(EngineCollector(engine, model_name="tiny"))
        seen_running: list[float] = []
        done = anyio.Event()

        async def scraper() -> None:
            while not done.is_set():  # as prometheus_client's HTTP server thread would
                text = await anyio.to_thread.run_sync(generate_latest, registry)
                m = re.search(r'^asyncgen:num_requests_running\{model_name="tiny"\} (\S+)$', text.decode(), re.M)
                seen_running.append(float(m.group(1)))
                await anyio.sleep(0.01)

        async def consume(i: int) -> None:
            async for _ in engine.stream([7, i, 9], SamplingParams(max_tokens=60, ignore_eos=True)):
                pass

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(scraper)
                async with anyio.create_task_group() as inner:
                    for i in range(8):
                        inner.start_soon(consume, i)
                done.set()
    assert len(seen_running) >= 2
    assert max(seen_running) > 0


def test_a_second_collector_with_the_same_names_is_refused(tiny_model):
    engine = AsyncEngine.from_pretrained(tiny_model, max_model_len=128, num_kv_blocks=8)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    with pytest.raises(ValueError, match="asyncgen:"):
        registry.register(EngineCollector(engine))


def test_every_metric_is_documented(tiny_model):
    engine = AsyncEngine.from_pretrained(tiny_model, max_model_len=128, num_kv_blocks=8)
    exposed = set()
    for family in EngineCollector(engine).describe():
        name = family.name + ("_total" if family.type == "counter" else "")
        exposed.add(name)
    documented = set(re.findall(r"^\| `(asyncgen:[a-z_:]+)`", DOCS.read_text(), re.M))
    assert exposed == documented
