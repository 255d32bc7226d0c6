"""Bad input: each gets a clear, typed error, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import anyio
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


async def _start_fails(model_dir, error, match):
    """Starting an engine on ``model_dir`` raises ``error``, its message matching ``match``."""
    with pytest.raises(error, match=match):
        async with AsyncEngine.from_pretrained(model_dir, **ENGINE_ARGS):
            pass


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
    await _start_fails(d, WeightsError, r"model\.layers\.1\.mlp\.up_proj\.weight")


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
    await _start_fails(d, WeightsError, "model.safetensors")


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size="64"), "hidden_size must be an integer, got '64'"),
    (dict(hidden_size=64.5), "hidden_size must be an integer"),
    (dict(num_attention_heads=0), "num_attention_heads must be positive"),
    (dict(max_position_embeddings=1), "max_position_embeddings must be at least 2"),
    (dict(rms_norm_eps=None), "rms_norm_eps must be a number, got None"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps must be positive"),
    (dict(rope_parameters=None, rope_theta="big"), "rope_theta must be a number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_parameters.rope_theta must be a number"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(rope_scaling="linear"), "rope_scaling must be a JSON object"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1"}),
     "rope_scaling.low_freq_factor must be a number"),
    (dict(quantization_config="gptq"), "quantization_config must be a JSON object"),
    (dict(architectures={"name": "LlamaForCausalLM"}), "architectures must be a list"),
])
def test_config_values_of_the_wrong_kind_name_the_field(tiny_llama, tmp_path, changes, message):
    d = _with_config(tiny_llama, tmp_path / "m", **changes)
    with pytest.raises(UnsupportedModelError) as info:
        AsyncEngine.from_pretrained(d)
    assert message in str(info.value)


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(UnsupportedModelError, match="must hold a JSON object, not list"):
        AsyncEngine.from_pretrained(tmp_path)


def test_null_means_the_default_where_transformers_reads_it_so(tiny_llama, tmp_path):
    from asyncgen.model.config import ModelConfig

    d = _with_config(tiny_llama, tmp_path / "m", num_key_value_heads=None, head_dim=None)
    cfg = ModelConfig.from_dir(d)
    assert (cfg.num_kv_heads, cfg.head_dim) == (cfg.num_heads, cfg.hidden_size // cfg.num_heads)


def test_max_model_len_over_the_models_positions(tiny_llama):
    limit = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    AsyncEngine.from_pretrained(tiny_llama, max_model_len=limit)
    with pytest.raises(ModelLoadError, match=f"max_model_len={limit + 1} is over the model's max_position_embeddings"):
        AsyncEngine.from_pretrained(tiny_llama, max_model_len=limit + 1)


def test_an_ops_backend_the_device_cannot_run(tiny_llama, monkeypatch):
    with pytest.raises(ModelLoadError, match="ops_backend='cuda' cannot serve here: its csrc kernels run on a CUDA"):
        AsyncEngine.from_pretrained(tiny_llama, device="cpu", ops_backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ModelLoadError, match="ops_backend='triton' cannot serve here: .*TRITON_INTERPRET=1"):
        AsyncEngine.from_pretrained(tiny_llama, device="cpu", ops_backend="triton")


def test_the_model_argument(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="model must be a directory path or a hub id, not NoneType"):
        AsyncEngine.from_pretrained(None)
    monkeypatch.chdir(tmp_path)  # "" is not the current directory
    with pytest.raises(ModelNotFoundError, match="empty string"):
        AsyncEngine.from_pretrained("")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("dtype", ["int8", "bool", "float8_e4m3fn"])
async def test_weights_that_are_not_floats_are_refused(tiny_llama, tmp_path, dtype):
    import torch

    def edit(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(getattr(torch, dtype))

    d = _rewrite_weights(tiny_llama, tmp_path / "m", edit)
    await _start_fails(d, WeightsError, f"'model.embed_tokens.weight' is {dtype}")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_tensor_in_two_files_is_refused(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    embed = load_file(d / "model.safetensors")["model.embed_tokens.weight"]
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")  # read by its glob, as a stray file is
    save_file({"model.embed_tokens.weight": embed * 0}, d / "old-copy.safetensors")
    await _start_fails(d, WeightsError, "'model.embed_tokens.weight' is in both .*model-00001-of-00001.safetensors "
                                        "and .*old-copy.safetensors")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("index", [{"weight_map": ["model.safetensors"]}, {"weight_map": {"x": 5}}, ["x"]])
async def test_a_malformed_index_is_a_weights_error(tiny_llama, tmp_path, index):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    await _start_fails(d, WeightsError, "is not a valid safetensors index")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_tied_models_lm_head_must_fit_the_embedding(tiny_llama, tmp_path):
    import torch

    d = _with_config(tiny_llama, tmp_path / "m", tie_word_embeddings=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = torch.ones(5, 5, dtype=tensors["lm_head.weight"].dtype)
    save_file(tensors, d / "model.safetensors")
    await _start_fails(d, WeightsError, r"'lm_head.weight' has shape \(5, 5\)")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_kv_pool_too_large_to_allocate(tiny_llama):
    engine = AsyncEngine.from_pretrained(tiny_llama, max_model_len=256, num_kv_blocks=10**13)
    with pytest.raises(ModelLoadError, match="the KV pool of 10000000000000 blocks .* cannot be allocated"):
        await engine.start()
    assert not engine.is_running


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("content", ["[2]", '{"eos_token_id": "2"}', '{"eos_token_id": [2, "a"]}'])
async def test_a_malformed_generation_config(tiny_llama, tmp_path, content):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    (d / "generation_config.json").write_text(content)
    await _start_fails(d, ModelLoadError, "generation_config.json")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_text_past_a_smaller_models_vocabulary_is_refused(tiny_llama, tmp_path):
    """A tokenizer with more tokens than the model: the prompts that reach its last ids
    are refused one by one, and the engine serves the rest."""
    vocab = 1000
    d = _with_config(tiny_llama, tmp_path / "m", vocab_size=vocab)
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab].clone()
    save_file(tensors, d / "model.safetensors")
    async with AsyncEngine.from_pretrained(d, **ENGINE_ARGS) as engine:
        text = "Hello world"
        ids = engine.tokenizer.encode(text)
        assert max(ids) >= vocab  # the check below is reached
        with pytest.raises(InvalidRequestError, match=f"token ids .* of the prompt are past the model's vocabulary of "
                                                      f"{vocab} tokens"):
            await engine.generate(text, SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError, match="of the messages are past"):
            await engine.generate(messages=[{"role": "user", "content": text}], params=SamplingParams(max_tokens=2))
        out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out.token_ids) == 2 and engine.is_running


# --- requests ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    (dict(), InvalidRequestError, "exactly one"),
    (dict(prompt="hi", messages=[{"role": "user", "content": "hi"}]), InvalidRequestError, "exactly one"),
    (dict(prompt=""), InvalidRequestError, "empty"),
    (dict(prompt=[]), InvalidRequestError, "empty"),
    (dict(prompt=[1, -5]), InvalidRequestError, "token ids"),
    (dict(prompt=[1, 10**9]), InvalidRequestError, "token ids"),
    (dict(prompt=3.5), InvalidRequestError, "str or a list"),
    (dict(prompt="word " * 400), PromptTooLongError, "prompt has 401 tokens; max_model_len"),
    # far too long to hold max_model_len tokens: refused before the tokenizer reads it
    (dict(prompt="word " * 20_000), PromptTooLongError, "100000 characters of prompt: at least"),
    (dict(messages=[{"role": "user", "content": "word " * 20_000}]), PromptTooLongError,
     "characters of messages (as the chat template renders them): at least"),
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


def test_requests_from_another_loop_of_the_same_thread_are_refused(smollm2_path):
    """An engine started in one asyncio loop and used from a second one of the same
    thread while the first is suspended (a test framework's session loop and its loop
    per test): a typed error at once, not a request no loop will ever run."""
    import asyncio

    engine = AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS)
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(engine.start())

        async def use():
            async with asyncio.timeout(30):
                with pytest.raises(EngineStateError, match="another event loop of its thread"):
                    await engine.generate("Hi", SamplingParams(max_tokens=2))
                with pytest.raises(EngineStateError, match="another event loop"):
                    engine.abort("anything")

        asyncio.run(use())
        with pytest.raises(EngineStateError, match="no event loop runs here"):
            engine.stream("Hi")  # (outside any loop)
        out = first.run_until_complete(engine.generate("Hi", SamplingParams(max_tokens=2)))
        assert len(out.token_ids) == 2
    finally:
        first.run_until_complete(engine.aclose())
        first.close()


@pytest.mark.anyio
async def test_abort_from_another_thread_is_refused_and_the_stream_goes_on(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        stream = engine.stream("Once upon a time", SamplingParams(max_tokens=12, ignore_eos=True), request_id="job")
        chunks = [await stream.__anext__()]
        error = await anyio.to_thread.run_sync(lambda: pytest.raises(EngineStateError, engine.abort, "job"))
        assert "another thread" in str(error.value)
        # stats() reads what the loop changes: refused there too; handed to the loop, it reads.
        error = await anyio.to_thread.run_sync(lambda: pytest.raises(EngineStateError, engine.stats))
        assert "another thread" in str(error.value)
        handed = await anyio.to_thread.run_sync(lambda: anyio.from_thread.run_sync(engine.stats))
        assert handed.num_running == 1
        with anyio.fail_after(30):
            chunks += [c async for c in stream]
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 12
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.anyio
async def test_a_stream_collected_during_the_engines_own_work_is_aborted_after_it(smollm2_path):
    """A stream dropped mid-request inside a reference cycle is finalized wherever the
    garbage collector runs, here in the middle of a step's scheduling: its abort waits for
    the engine's loop, and the step planned with the request goes on undisturbed."""
    import gc

    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        stream = engine.stream("Once upon a time", SamplingParams(max_tokens=60, ignore_eos=True))
        await stream.__anext__()
        stream.cycle = stream  # once dropped, reachable only through itself
        del stream
        blocks = engine._core.scheduler.block_manager
        real = blocks.allocate
        collected = []

        def allocate(request_id, *args):
            if request_id == "hi" and not collected:  # the step holds the dropped request already
                collected.append(gc.collect())  # (what any allocation may start)
            return real(request_id, *args)

        blocks.allocate = allocate
        with anyio.fail_after(30):
            out = await engine.generate("Hi", SamplingParams(max_tokens=8, ignore_eos=True), request_id="hi")
            assert len(out.token_ids) == 8
            while engine.stats().num_running:  # the dropped request: aborted by the loop
                await anyio.sleep(0.01)
        assert collected and collected[0] > 0
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.anyio
async def test_abort_of_a_stream_not_iterated_yet_ends_it(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS) as engine:
        stream = engine.stream("Once upon a time", SamplingParams(max_tokens=40, ignore_eos=True), request_id="job")
        assert engine.abort("job") is True
        with anyio.fail_after(30):
            chunks = [c async for c in stream]
        assert [(c.finish_reason, c.token_ids) for c in chunks] == [("abort", ())]
        assert engine.abort("job") is False
        out = await engine.generate("Hi", SamplingParams(max_tokens=2), request_id="job")  # the id is free again
        assert len(out.token_ids) == 2
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.anyio
async def test_aclose_while_start_loads_waits_for_it_then_closes(smollm2_path):
    engine = AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.start)
            while engine._start_done is None:
                await anyio.sleep(0)
            await engine.aclose()
            assert not engine.is_running and engine._runner is None
            assert not engine._device._thread.is_alive()
    with pytest.raises(EngineStateError, match="closed"):
        engine.stream("Hi")


@pytest.mark.anyio
async def test_every_concurrent_aclose_returns_once_the_engine_is_released(smollm2_path):
    engine = AsyncEngine.from_pretrained(smollm2_path, **ENGINE_ARGS)
    await engine.start()
    seen = []

    async def close():
        await engine.aclose()
        seen.append((engine._runner is None, engine._device._thread.is_alive()))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(close)
    assert seen == [(True, False)] * 3


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


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_event_loop_ending_with_the_engine_open_warns_without_a_traceback(tiny_llama, backend):
    """A script whose loop ends without aclose() (asyncio.run / trio.run cancel the
    engine's task): one warning line that says so, not an ERROR with a traceback as for a
    failed step; the process exits normally."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import anyio
        from asyncgen import AsyncEngine, SamplingParams

        async def main():
            engine = AsyncEngine.from_pretrained({str(tiny_llama)!r}, max_model_len=64, num_kv_blocks=8)
            await engine.start()
            out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
            print("generated", len(out.token_ids), flush=True)

        anyio.run(main, backend={backend!r})
        print("exited", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["generated", "2", "exited"]
    assert "Traceback" not in done.stderr, done.stderr
    assert "engine stopped" in done.stderr and "cancelled before aclose()" in done.stderr, done.stderr
