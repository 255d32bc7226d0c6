"""Bad input: each gets a clear, typed error, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import ValidationError

from asyncgen import (
    AsyncEngine,
    DuplicateRequestError,
    EngineDeadError,
    EngineStateError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParams,
    UnsupportedModelError,
    WeightsError,
)

ENGINE_ARGS = dict(max_model_len=256, num_kv_blocks=32)


# --- model directories ---------------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        AsyncEngine.from_pretrained(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        AsyncEngine.from_pretrained(tmp_path)


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="directory"):
        AsyncEngine.from_pretrained(f)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as info:
        AsyncEngine.from_pretrained(tmp_path)
    assert "GPT2LMHeadModel" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_unsupported_rope_scaling(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        AsyncEngine.from_pretrained(d)


def test_bad_engine_option_names_the_field(tiny_llama):
    with pytest.raises(ValidationError, match="dtype"):
        AsyncEngine.from_pretrained(tiny_llama, dtype="int3")
    with pytest.raises(ValidationError, match="max_num_seqs"):
        AsyncEngine.from_pretrained(tiny_llama, max_num_seqs=0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_hub_id_fails_clearly_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = AsyncEngine.from_pretrained("some-org/some-model")
    with pytest.raises(ModelNotFoundError, match="some-org/some-model"):
        await engine.start()


def _rewrite_weights(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_cuda_without_a_gpu_fails_at_the_call(tiny_llama, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        AsyncEngine.from_pretrained(tiny_llama, device="cuda")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_kv_budget_without_room_for_a_block(tiny_llama):
    engine = AsyncEngine.from_pretrained(tiny_llama, max_model_len=256, kv_cache_memory=1)
    with pytest.raises(ModelLoadError, match="holds no block"):
        await engine.start()
    assert not engine.is_running


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_missing_tensor_is_named(tiny_llama, tmp_path):
    d = _rewrite_weights(tiny_llama, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        async with AsyncEngine.from_pretrained(d, **ENGINE_ARGS):
            pass


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_misshaped_tensor_names_both_shapes(tiny_llama, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()

    d = _rewrite_weights(tiny_llama, tmp_path / "m", edit)
    with pytest.raises(WeightsError) as info:
        async with AsyncEngine.from_pretrained(d, **ENGINE_ARGS):
            pass
    msg = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in msg and "(16, 64)" in msg and "(32, 64)" in msg


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_corrupt_safetensors_file(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(WeightsError, match="model.safetensors"):
        async with AsyncEngine.from_pretrained(d, **ENGINE_ARGS):
            pass


# --- requests ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    (dict(), InvalidRequestError, "exactly one"),
    (dict(prompt="hi", messages=[{"role": "user", "content": "hi"}]), InvalidRequestError, "exactly one"),
    (dict(prompt=""), InvalidRequestError, "empty"),
    (dict(prompt=[]), InvalidRequestError, "empty"),
    (dict(prompt=[1, -5]), InvalidRequestError, "token ids"),
    (dict(prompt=[1, 10**9]), InvalidRequestError, "token ids"),
    (dict(prompt=3.5), InvalidRequestError, "str or a list"),
    (dict(prompt="word " * 400), PromptTooLongError, "max_model_len"),
    (dict(prompt="hi", params=SamplingParams(max_tokens=500)), PromptTooLongError, "max_tokens"),
    (dict(prompt="hi", params=SamplingParams(stop_token_ids=[10**7])), InvalidRequestError, "stop_token_ids"),
    (dict(prompt="hi", params=SamplingParams(logit_bias={10**7: 1.0})), InvalidRequestError, "logit_bias"),
    (dict(prompt="hi", params={"temperature": -1}), ValidationError, "temperature"),
    (dict(prompt="hi", params="greedy"), InvalidRequestError, "SamplingParams"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), InvalidRequestError, "role"),
    (dict(messages=[{"content": "x"}]), InvalidRequestError, "role"),
    (dict(messages="hello"), InvalidRequestError, "messages"),
    (dict(prompt="hi", request_id=""), InvalidRequestError, "request_id"),
    (dict(prompt="abc \ud800 def"), InvalidRequestError, "lone surrogate (U+D800) at position 4"),
    (dict(messages=[{"role": "user", "content": "hi \udc00"}]), InvalidRequestError, "lone surrogate (U+DC00)"),
    (dict(prompt="hi", params=SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[2])), InvalidRequestError,
     "allowed_token_ids"),
    (dict(prompt="hi", params=SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[29], stop_token_ids=[29],
                                             ignore_eos=True)), InvalidRequestError, "allowed_token_ids"),
]


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=3, best_of=2), "best_of"),
    (dict(max_tokens=2, min_tokens=5), "min_tokens"),
    (dict(structured_outputs={"json_object": True}, min_tokens=1), "min_tokens"),
    (dict(structured_outputs={"choice": ["a"]}, ignore_eos=True), "ignore_eos"),
    (dict(structured_outputs={"regex": "a+"}, allowed_token_ids=[3]), "allowed_token_ids"),
])
def test_a_value_another_field_rules_out_names_itself(kwargs, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    err = info.value.errors()[0]
    assert err["ctx"]["field"] == field and err["msg"].startswith(field), err


@pytest.mark.parametrize("field", ["stop", "bad_words"])
def test_strings_that_are_not_unicode_are_refused(field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**{field: ["ok", "x\ud83d"]})
    err = info.value.errors()[0]
    assert err["loc"] == (field,) and "lone surrogate (U+D83D) at position 1" in err["msg"], err


def test_seeds_are_signed_64_bit():
    assert SamplingParams(seed=-2**63).seed == -2**63 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    for seed in (2**63, -2**63 - 1):
        with pytest.raises(ValidationError) as info:
            SamplingParams(seed=seed)
        assert info.value.errors()[0]["loc"] == ("seed",)


@pytest.mark.anyio
async def test_bad_requests_raise_and_engine_keeps_serving(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=256, num_kv_blocks=64) as engine:
        for kwargs, error, words in BAD_REQUESTS:
            with pytest.raises(error) as info:
                engine.stream(**kwargs)
            assert words in str(info.value), (kwargs, str(info.value))
            if error is not ValidationError:  # the field an error is about, None for the prompt
                want = words if words in ("max_tokens", "stop_token_ids", "logit_bias", "allowed_token_ids") else None
                assert info.value.param == want, kwargs
            out = await engine.generate("Hi", SamplingParams(max_tokens=2, temperature=0))
            assert len(out.token_ids) == 2
        assert 2 in engine.eos_token_ids  # (the cases above take <|im_end|>, 2, as SmolLM2's end token)
        # Allowed tokens beside the stop tokens leave something to sample.
        params = SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=[2, 29], temperature=0)
        out = await engine.generate("Hi", params)
        assert set(out.token_ids) <= {2, 29} and out.token_ids[:2] == (29, 29), out.token_ids
        # A prompt that needs more blocks than the pool has.
        async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=256, num_kv_blocks=2) as small:
            with pytest.raises(PromptTooLongError, match="blocks"):
                small.stream("hello " * 20, SamplingParams(max_tokens=16))


@pytest.mark.anyio
async def test_request_id_clashing_with_a_sample_of_another(smollm2_path):
    import anyio

    params = SamplingParams(n=2, max_tokens=8, ignore_eos=True, temperature=0)
    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        with anyio.fail_after(60):
            live = engine.stream("Hello there", params, request_id="a")
            first = await live.__anext__()
            with pytest.raises(DuplicateRequestError, match="'a#0'"):
                engine.stream("Hi", SamplingParams(max_tokens=4), request_id="a#0")
            rest = [c async for c in live]
            assert sum(len(c.token_ids) for c in (first, *rest)) == 16
            single = engine.stream("Hi", SamplingParams(max_tokens=8, ignore_eos=True), request_id="b#1")
            head = await single.__anext__()  # (one token, or more when steps ran ahead)
            with pytest.raises(DuplicateRequestError, match="'b#1'"):
                engine.stream("Hello", params, request_id="b")
            assert len(head.token_ids) + sum(len(c.token_ids) for c in [c async for c in single]) == 8
        s = engine.stats()
        assert (s.num_running, s.num_free_blocks) == (0, s.num_total_blocks)


@pytest.mark.anyio
async def test_without_max_tokens_a_small_kv_pool_bounds_the_length(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=4) as engine:  # 64 tokens
        out = await engine.generate("Hello", SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
        assert out.finish_reason == "length" and out.usage.total_tokens == 64
        with pytest.raises(PromptTooLongError, match="KV pool"):
            engine.stream("word " * 70, SamplingParams(max_tokens=None))


@pytest.mark.anyio
async def test_duplicate_request_id(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        s1 = engine.stream("Hello", SamplingParams(max_tokens=30), request_id="same")
        await s1.__anext__()
        with pytest.raises(DuplicateRequestError, match="same"):
            engine.stream("Hello", request_id="same")
        await s1.aclose()
        # Taken from the stream() call on, before the first stream is iterated.
        s2 = engine.stream("Hello", SamplingParams(max_tokens=2), request_id="later")
        with pytest.raises(DuplicateRequestError, match="not iterated"):
            engine.stream("Hello", request_id="later")
        sample = engine.stream("Hello", SamplingParams(max_tokens=2), request_id="x#1")
        with pytest.raises(DuplicateRequestError, match="not iterated"):
            engine.stream("Hello", SamplingParams(n=2), request_id="x")  # its samples are x#0 and x#1
        await sample.aclose()
        assert len([c async for c in s2]) >= 1
        s3 = engine.stream("Hello", SamplingParams(max_tokens=2), request_id="later")  # free again
        await s3.aclose()
        assert len([c async for c in engine.stream("Hello", SamplingParams(max_tokens=2), request_id="later")]) >= 1


@pytest.mark.anyio
async def test_lifecycle_errors(smollm2_path):
    engine = AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS)
    with pytest.raises(EngineStateError, match="start"):
        engine.stream("hi")
    with pytest.raises(EngineStateError):
        engine.stats()
    async with engine:
        with pytest.raises(EngineStateError, match="once"):
            await engine.start()
    with pytest.raises(EngineStateError, match="closed"):
        engine.stream("hi")
    with pytest.raises(EngineStateError):
        async with engine:
            pass


@pytest.mark.anyio
async def test_failing_step_kills_every_stream_and_a_new_engine_starts(smollm2_path):
    import anyio

    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        import time

        calls = {"n": 0}
        real = engine._runner.launch
        failed_at = []

        def flaky(out):
            calls["n"] += 1
            if calls["n"] == 3:
                failed_at.append(time.monotonic())
                raise RuntimeError("injected device failure")
            return real(out)

        engine._runner.launch = flaky
        errors = []
        seen_at = []

        async def consume(i):
            try:
                async for _ in engine.stream(f"Prompt {i}", SamplingParams(max_tokens=50)):
                    pass
            except EngineDeadError as e:
                errors.append(e)
                seen_at.append(time.monotonic())

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(consume, i)
        assert len(errors) == 4
        assert max(seen_at) - failed_at[0] < 1.0
        assert all(isinstance(e.__cause__, RuntimeError) and "injected" in str(e.__cause__) for e in errors)
        with pytest.raises(EngineDeadError, match="stopped: a model step failed: RuntimeError: injected device failure"):
            engine.stream("again")
    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as fresh:
        out = await fresh.generate("Hi", SamplingParams(max_tokens=2))
        assert len(out.token_ids) == 2


@pytest.mark.anyio
async def test_model_steps_run_on_one_device_thread_not_the_loop(smollm2_path):
    import threading

    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        seen = set()
        real = engine._runner.launch

        def spy(out):
            seen.add(threading.get_ident())
            return real(out)

        engine._runner.launch = spy
        await engine.generate("Hi", SamplingParams(max_tokens=5))
        await engine.generate("Hello", SamplingParams(max_tokens=5))
    assert seen == {engine._device.ident}
    assert threading.get_ident() not in seen


@pytest.mark.anyio
async def test_aclose_while_streaming_ends_streams_with_abort(smollm2_path):
    import anyio

    engine = AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS)
    await engine.start()
    reasons = []

    async def consume():
        last = None
        # ignore_eos: a sampled end of text must not finish a stream before aclose() does.
        async for c in engine.stream("Tell me a story", SamplingParams(max_tokens=100, ignore_eos=True)):
            last = c
        reasons.append(last.finish_reason)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        tg.start_soon(consume)
        await anyio.sleep(0.5)
        await engine.aclose()
    assert reasons == ["abort", "abort"]


@pytest.mark.anyio
async def test_requests_from_another_threads_loop_are_refused(smollm2_path):
    import asyncio
    import threading

    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        seen = {}

        def other_thread():
            async def use():
                try:
                    engine.stream("Hello", SamplingParams(max_tokens=2))
                except EngineStateError as e:
                    seen["error"] = str(e)

            asyncio.run(use())

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(10)
        assert "another thread" in seen["error"]
        out = await engine.generate("Hi", SamplingParams(max_tokens=2, temperature=0))
        assert len(out.token_ids) == 2


@pytest.mark.anyio
async def test_a_second_reader_of_a_stream_is_refused(smollm2_path):
    import anyio

    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        stream = engine.stream("Once upon a time", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        first: list = []

        async def read():
            async for chunk in stream:
                first.extend(chunk.token_ids)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.wait_all_tasks_blocked()  # the first reader waits for a chunk
                with pytest.raises(EngineStateError, match="one reader"):
                    await stream.__anext__()
        assert len(first) == 8  # the first reader got the whole output
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
