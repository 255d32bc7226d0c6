"""End to end on the real SmolLM2-135M-Instruct: greedy tokens equal transformers'."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from asyncgen import AsyncEngine, SamplingParams

NEW_TOKENS = 32

PROMPTS = [
    "Hi",
    "The capital of France is",
    "안녕하세요, 저는",
    "Write a haiku about the sea.",
    "한국의 전통 음식 중에서 가장 유명한 것은 김치입니다. 김치는 배추와 고춧가루로 만들며,",
    "List three prime numbers:",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11, and the astronauts were "
    "Neil Armstrong, Buzz Aldrin and Michael Collins. Armstrong was the first to step onto the lunar surface, "
    "followed by Aldrin, while Collins orbited above in the command module. The landing site was the Sea of "
    "Tranquility. Describe what the astronauts did during their time on the surface, in detail:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2):
    """transformers generate() of each prompt alone, greedy, fp32."""
    model, tok = hf_smollm2
    outs = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
            outs[p] = gen[0, ids.shape[1]:].tolist()
    return outs


async def _generate_all(engine):
    results = {}

    async def one(p):
        out = await engine.generate(p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=False))
        results[p] = list(out.token_ids)

    async with anyio.create_task_group() as tg:
        for p in PROMPTS:
            tg.start_soon(one, p)
    return results


def _assert_equal_to_hf(results, hf_greedy):
    for p in PROMPTS:
        ours, ref = results[p], hf_greedy[p]
        # A sequence that hit EOS in transformers stops there in asyncgen too (EOS kept).
        assert ours == ref[: len(ours)] and len(ours) == len(ref), (p, ours, ref)


@pytest.mark.anyio
async def test_concurrent_greedy_equals_transformers(smollm2_path, hf_greedy):
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=256) as engine:
        results = await _generate_all(engine)
        stats = engine.stats()
    _assert_equal_to_hf(results, hf_greedy)
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_greedy_equals_transformers_under_preemption(smollm2_path, hf_greedy):
    # 20 blocks of 16 tokens cannot hold all 8 sequences at once: requests get preempted.
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=1024, num_kv_blocks=20) as engine:
        results = await _generate_all(engine)
        stats = engine.stats()
    assert stats.num_preemptions > 0
    _assert_equal_to_hf(results, hf_greedy)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_greedy_equals_transformers_with_chunked_prefill(smollm2_path, hf_greedy):
    # A 24-token budget is smaller than the longest prompt (~90 tokens): prompts are chunked.
    async with AsyncEngine.from_pretrained(
        smollm2_path, max_model_len=1024, num_kv_blocks=256, max_num_batched_tokens=24
    ) as engine:
        longest = max(len(engine.tokenizer.encode(p)) for p in PROMPTS)
        assert longest > 24
        results = await _generate_all(engine)
    _assert_equal_to_hf(results, hf_greedy)


@pytest.mark.anyio
async def test_64_streams_complete_and_loop_stays_responsive(smollm2_path):
    gaps = []
    done = anyio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    finished = []
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=512, max_num_seqs=64) as engine:

        async def consume(i):
            chunks = []
            async for chunk in engine.stream(f"Story {i}: once upon a time", SamplingParams(max_tokens=12, temperature=0.8, seed=i)):
                chunks.append(chunk)
            finished.append(chunks[-1].finish_reason)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            async with anyio.create_task_group() as inner:
                for i in range(64):
                    inner.start_soon(consume, i)
            done.set()
        stats = engine.stats()
    worst = max(gaps)
    print(f"worst event-loop gap with 64 streams: {worst * 1000:.1f} ms over {len(gaps)} ticks")
    assert len(finished) == 64 and all(r in ("length", "stop") for r in finished)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert worst < 1.0


@pytest.mark.anyio
async def test_cancelling_streams_at_random_points_frees_every_block(smollm2_path):
    import random

    rng = random.Random(0)
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=128) as engine:

        async def consume_then_cancel(i):
            limit = rng.randrange(0, 6)
            with anyio.move_on_after(rng.uniform(0.0, 1.5)):
                n = 0
                async for _ in engine.stream(f"Count to ten, take {i}:", SamplingParams(max_tokens=40, temperature=1.0)):
                    n += 1
                    if n > limit:
                        break  # leaving the loop early

        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(consume_then_cancel, i)
        # An explicit abort by id, too.
        stream = engine.stream("Tell me a long story.", SamplingParams(max_tokens=200, ignore_eos=True), request_id="to-abort")
        first = await stream.__anext__()
        assert first.request_id == "to-abort"
        assert engine.abort("to-abort")
        rest = [c async for c in stream]
        assert rest and rest[-1].finish_reason == "abort"
        await anyio.sleep(0.05)
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_total_blocks
        # And the engine still serves.
        out = await engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
        assert len(out.token_ids) == 4


@pytest.mark.anyio
async def test_korean_stream_deltas_join_to_final_text(smollm2_path):
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=64) as engine:
        params = SamplingParams(max_tokens=48, temperature=0.9, seed=11)
        deltas, ids = [], []
        async for chunk in engine.stream("한국어로 짧은 시를 써 주세요: 봄비가 내리는", params):
            deltas.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        text = "".join(deltas)
        tok = engine.tokenizer
        expected = tok.decode(ids[:-1] if last.finish_reason == "stop" and last.stop_reason is None else ids, skip_special_tokens=True)
        assert text == expected
        assert all("\ufffd" not in d for d in deltas[:-1])
        assert any(ord(c) > 0xAC00 for c in text), text  # Hangul really came out


@pytest.mark.anyio
async def test_api_forms(smollm2_path):
    engine = AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=64)
    await engine.start()
    try:
        chunks = [c async for c in engine.stream("Hello", SamplingParams(max_tokens=8, temperature=0))]
        assert str(chunks[0]) == chunks[0].text
        assert chunks[-1].finish_reason in ("length", "stop") and all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks)

        out = await engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0))
        assert out.text == "".join(c.text for c in chunks)
        assert out.usage.prompt_tokens == len(engine.tokenizer.encode("Hello"))
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

        ids = engine.tokenizer.encode("Hello")
        by_ids = await engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))
        assert by_ids.token_ids == out.token_ids and by_ids.prompt is None

        chat = await engine.generate(messages=[{"role": "user", "content": "What is 2+2?"}], params=SamplingParams(max_tokens=24, temperature=0))
        assert "<|im_start|>assistant" in chat.prompt and chat.text

        many = await engine.generate("Name a color:", SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1))
        assert [o.index for o in many.outputs] == [0, 1, 2]
        assert len({o.token_ids for o in many.outputs}) > 1
        streamed = {}
        async for c in engine.stream("Name a color:", SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1)):
            streamed.setdefault(c.index, []).extend(c.token_ids)
        assert {i: tuple(v) for i, v in streamed.items()} == {o.index: o.token_ids for o in many.outputs}

        stops = await engine.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=30, temperature=0, stop=[" 6"]))
        assert stops.finish_reason == "stop" and stops.outputs[0].stop_reason == " 6" and " 6" not in stops.text
        # A stop string completed by the last token allowed still ends the completion as "stop".
        count = await engine.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=30, temperature=0))
        k = next(i for i in range(1, 31) if " 6" in engine.tokenizer.decode(count.token_ids[:i]))
        last = await engine.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=k, temperature=0, stop=[" 6"]))
        assert (last.finish_reason, last.outputs[0].stop_reason, last.text) == ("stop", " 6", stops.text)
        # One completed within the first min_tokens tokens does not end it.
        later = await engine.generate(
            "Count: 1, 2, 3,", SamplingParams(max_tokens=k + 4, min_tokens=k, temperature=0, stop=[" 6"])
        )
        assert len(later.token_ids) > k and later.text.startswith(stops.text + " 6")

        lp = await engine.generate("Hello", SamplingParams(max_tokens=3, temperature=0, logprobs=2))
        assert [x.token_id for x in lp.outputs[0].logprobs] == list(lp.token_ids)
        assert all(x.logprob <= 0 and len(x.top) == 2 and x.top[0][0] == x.token_id for x in lp.outputs[0].logprobs)

        stats = engine.stats()
        for field in ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks"):
            assert isinstance(getattr(stats, field), int)
    finally:
        await engine.aclose()
    await engine.aclose()  # idempotent


@pytest.mark.anyio
async def test_seeded_request_is_reproducible_in_any_batch(smollm2_path):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=128) as engine:
        alone = await engine.generate("Tell me about cats.", params)
        results = {}

        async def one(i, p, sp):
            results[i] = await engine.generate(p, sp)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i, f"Other prompt {i}", SamplingParams(max_tokens=20, temperature=1.0))
            tg.start_soon(one, "seeded", "Tell me about cats.", params)
    assert results["seeded"].token_ids == alone.token_ids


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_prefix_caching_changes_no_greedy_token(smollm2_path):
    system = "You are a careful assistant. Answer in one short sentence. " * 6
    questions = ["What is rain?", "What is snow?", "Why is the sky blue?", "What is rain?"]

    async def run(enable):
        results = []
        async with AsyncEngine.from_pretrained(
            smollm2_path, max_model_len=512, num_kv_blocks=128, enable_prefix_caching=enable
        ) as engine:
            for q in questions:  # one after another, so later ones can hit the cache
                out = await engine.generate(
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                    params=SamplingParams(max_tokens=12, temperature=0),
                )
                results.append(out)
            stats = engine.stats()
        return results, stats

    on, stats_on = await run(True)
    off, stats_off = await run(False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert stats_on.prefix_cache_hit_rate > 0.5 and stats_off.prefix_cache_hit_rate == 0
    assert on[0].metrics.num_cached_tokens == 0 and on[1].metrics.num_cached_tokens > 0
    assert on[3].metrics.num_cached_tokens >= on[1].metrics.num_cached_tokens
    assert all(o.metrics.num_cached_tokens == 0 for o in off)
    m = on[1].metrics
    assert m.time_to_first_token >= m.queue_time >= 0 and m.time_per_output_token > 0
    assert m.num_prompt_tokens == len(on[1].prompt_token_ids) and m.num_generation_tokens == len(on[1].token_ids)


@pytest.mark.anyio
async def test_continue_final_message_goes_on_with_a_begun_reply(smollm2_path, hf_smollm2):
    """A reply begun for the model: the prompt ends right after its text (transformers'
    continue_final_message), and the greedy continuation equals transformers' on it,
    through the engine and the OpenAI layer; add_generation_prompt=False opens no turn."""
    from asyncgen.errors import InvalidRequestError
    from asyncgen.openai import BadRequestError

    model, tok = hf_smollm2
    begun = [{"role": "user", "content": "Name three primary colors."},
             {"role": "assistant", "content": "The three primary colors are"}]
    text = tok.apply_chat_template(begun, tokenize=False, continue_final_message=True)
    assert text.endswith("The three primary colors are")
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=64) as engine:
        greedy = SamplingParams(max_tokens=12, temperature=0)
        out = await engine.generate(messages=begun, params=greedy, continue_final_message=True)
        assert out.prompt == text and list(out.token_ids) == ref.tolist()
        client = engine.openai_client()
        reply = await client.chat.completions.create(model=client.model, messages=begun, max_tokens=12, temperature=0,
                                                     extra_body={"continue_final_message": True})
        assert reply.choices[0].message.content == out.text and reply.usage.prompt_tokens == ids.shape[1]
        # echo: the reply starts with the begun message, whole and streamed
        echoed = await client.chat.completions.create(model=client.model, messages=begun, max_tokens=12, temperature=0,
                                                      extra_body={"continue_final_message": True, "echo": True})
        assert echoed.choices[0].message.content == "The three primary colors are" + out.text
        chunks = await client.chat.completions.create(model=client.model, messages=begun, max_tokens=12, temperature=0,
                                                      stream=True, extra_body={"continue_final_message": True, "echo": True})
        assert "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices]) == echoed.choices[0].message.content
        # the turn closed and none opened: the prompt ends with the last message's end of turn
        closed = await engine.generate(messages=begun, params=greedy, add_generation_prompt=False)
        assert closed.prompt == tok.apply_chat_template(begun, tokenize=False) and closed.prompt.endswith("<|im_end|>\n")
        with pytest.raises(InvalidRequestError, match="add_generation_prompt") as e:
            await engine.generate(messages=begun, params=greedy, continue_final_message=True, add_generation_prompt=True)
        assert e.value.param == "continue_final_message"
        with pytest.raises(InvalidRequestError, match="'messages' only"):
            await engine.generate("Hi", greedy, continue_final_message=True)
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model=client.model, messages=begun, extra_body={
                "continue_final_message": True, "add_generation_prompt": True})
        assert e.value.param == "continue_final_message"


@pytest.mark.anyio
async def test_allowed_token_ids_and_bad_words_mask_what_they_name(smollm2_path):
    """allowed_token_ids that hold the greedy output's own tokens change nothing; fewer
    keep every token inside them. A bad word from the greedy output (several tokens,
    and as its own token) never appears once banned; the logprobs stay the model's."""
    from asyncgen.openai import BadRequestError

    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=96) as engine:
        tok = engine.tokenizer
        prompt = "The capital of France is Paris. The capital of Italy is"
        greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
        free = await engine.generate(prompt, greedy)
        own = sorted(set(free.token_ids) | engine.eos_token_ids)
        same = await engine.generate(prompt, greedy.model_copy(update={"allowed_token_ids": own}))
        assert same.token_ids == free.token_ids
        few = sorted(set(tok.encode(" Rome Paris Milan, and the.", add_special_tokens=False)))
        narrow = await engine.generate(prompt, greedy.model_copy(update={"allowed_token_ids": few}))
        assert narrow.token_ids and set(narrow.token_ids) <= set(few)
        # a word of several tokens, and one of one token, both seen in the free output
        words = free.text.split()
        multi = next(w for w in words if len(tok.encode(" " + w, add_special_tokens=False)) > 1)
        single = next(w for w in words if len(tok.encode(" " + w, add_special_tokens=False)) == 1 and w != multi)
        for word in (multi, single):
            banned = await engine.generate(prompt, greedy.model_copy(update={"bad_words": [word]}))
            seq = tok.encode(" " + word, add_special_tokens=False)
            out = list(banned.token_ids)
            assert all(out[i:i + len(seq)] != seq for i in range(len(out))), (word, banned.text)
            assert banned.token_ids != free.token_ids
            # up to the first masked token the outputs agree, with the same logprobs
            k = next(i for i, (a, b) in enumerate(zip(out, free.token_ids)) if a != b)
            lps = banned.outputs[0].logprobs
            ref = free.outputs[0].logprobs
            assert [x.logprob for x in lps[:k]] == pytest.approx([x.logprob for x in ref[:k]])
            # at the masked position the reported distribution is the model's: its top choice is the masked token
            assert [t for t, _ in lps[k].top] == [t for t, _ in ref[k].top] and lps[k].top[0][0] == free.token_ids[k]
            assert [v for _, v in lps[k].top] == pytest.approx([v for _, v in ref[k].top])
        client = engine.openai_client()
        r = await client.completions.create(model=client.model, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"bad_words": [multi]})
        assert multi not in r.choices[0].text.split()
        with pytest.raises(BadRequestError) as e:
            await client.completions.create(model=client.model, prompt=prompt, max_tokens=4,
                                            extra_body={"allowed_token_ids": [10 ** 7]})
        assert e.value.param == "allowed_token_ids"


@pytest.mark.anyio
async def test_a_bad_word_is_banned_with_and_without_its_leading_space(smollm2_path):
    """As vLLM forms bad words: " Paris" bans the token "Paris" (a text's start) as well as
    " Paris" (the middle of one), and "Paris" bans both too. allowed_token_ids left with
    nothing but stop tokens held back by min_tokens and banned words are refused."""
    from asyncgen import InvalidRequestError

    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=256, num_kv_blocks=64) as engine:
        tok = engine.tokenizer
        (bare,) = tok.encode("Paris", add_special_tokens=False)
        (spaced,) = tok.encode(" Paris", add_special_tokens=False)
        prompt = "The capital of France is"
        pushed = SamplingParams(max_tokens=4, temperature=0, logit_bias={bare: 25.0})
        free = await engine.generate(prompt, pushed)
        assert bare in free.token_ids  # the bias makes the bare token the greedy choice
        for word in (" Paris", "Paris", "  Paris"):
            out = await engine.generate(prompt, pushed.model_copy(update={"bad_words": [word]}))
            assert bare not in out.token_ids and spaced not in out.token_ids, (word, out.text)
        eos = min(engine.eos_token_ids)
        with pytest.raises(InvalidRequestError, match="bad_words") as refused:
            await engine.generate(prompt, SamplingParams(max_tokens=4, allowed_token_ids=[eos, spaced],
                                                         bad_words=["Paris"], min_tokens=2))
        assert refused.value.param == "bad_words"
        (rome,) = tok.encode(" Rome", add_special_tokens=False)
        ok = await engine.generate(prompt, SamplingParams(max_tokens=4, allowed_token_ids=[eos, spaced, rome],
                                                          bad_words=["Paris"], min_tokens=2, temperature=0))
        assert list(ok.token_ids[:2]) == [rome, rome] and set(ok.token_ids) <= {eos, rome}


@pytest.mark.anyio
async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(smollm2_path):
    from asyncgen.errors import InvalidRequestError, PromptTooLongError

    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=256, num_kv_blocks=64) as engine:
        long = "Once upon a time there was a small village by the sea. " * 30
        ids = engine.tokenizer.encode(long)
        assert len(ids) > 256
        greedy = SamplingParams(max_tokens=8, temperature=0)
        with pytest.raises(PromptTooLongError):
            await engine.generate(long, greedy)
        cut = await engine.generate(long, greedy.model_copy(update={"truncate_prompt_tokens": 100}))
        tail = await engine.generate(ids[-100:], greedy)
        assert cut.token_ids == tail.token_ids and cut.usage.prompt_tokens == 100
        assert cut.prompt == engine.tokenizer.decode(ids[-100:])
        short = await engine.generate("Hi there", greedy.model_copy(update={"truncate_prompt_tokens": 100}))
        assert short.prompt == "Hi there"  # shorter than k: as it is
        with pytest.raises(InvalidRequestError, match="greater than max_model_len") as e:
            await engine.generate(long, greedy.model_copy(update={"truncate_prompt_tokens": 300}))
        assert e.value.param == "truncate_prompt_tokens"
        with pytest.raises(PromptTooLongError):  # -1 keeps max_model_len tokens: none left to generate
            await engine.generate(long, greedy.model_copy(update={"truncate_prompt_tokens": -1}))
        client = engine.openai_client()
        r = await client.completions.create(model=client.model, prompt=long, max_tokens=8, temperature=0,
                                            extra_body={"truncate_prompt_tokens": 100})
        assert r.usage.prompt_tokens == 100 and r.choices[0].text == tail.text


@pytest.mark.anyio
async def test_priority_policy_serves_waiting_requests_by_priority(smollm2_path):
    """One sequence at a time: requests that arrive while one runs are served lowest
    priority value first, then in arrival order; outputs are what they are alone. Under
    the default policy a priority is refused, naming the field."""
    from asyncgen.errors import InvalidRequestError
    from asyncgen.openai import BadRequestError

    greedy = SamplingParams(max_tokens=6, temperature=0)
    prompts = {"b": "Blue is", "c": "Cats are", "d": "Dogs are", "e": "Eggs are"}
    priorities = {"b": 5, "c": -1, "d": 5, "e": 0}
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=256, num_kv_blocks=64, max_num_seqs=1,
                                           scheduling_policy="priority") as engine:
        done, outs = [], {}

        async def one(name):
            outs[name] = await engine.generate(prompts[name], greedy, priority=priorities[name])
            done.append(name)

        async with engine.stream("A long story:", SamplingParams(max_tokens=24, temperature=0), priority=9) as first:
            await first.__anext__()  # running: the others wait behind it
            async with anyio.create_task_group() as tg:
                for name in prompts:
                    tg.start_soon(one, name)
                    await anyio.sleep(0.01)
                async for _ in first:
                    pass
        assert done == ["c", "e", "b", "d"]
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=256, num_kv_blocks=64) as engine:
        for name, prompt in prompts.items():
            assert (await engine.generate(prompt, greedy)).token_ids == outs[name].token_ids
        with pytest.raises(InvalidRequestError, match="scheduling_policy") as e:
            await engine.generate("Hi", greedy, priority=1)
        assert e.value.param == "priority"
        client = engine.openai_client()
        with pytest.raises(BadRequestError) as e:
            await client.completions.create(model=client.model, prompt="Hi", max_tokens=2, extra_body={"priority": 1})
        assert e.value.param == "priority"


@pytest.mark.anyio
async def test_include_stop_str_in_output_puts_the_stop_tokens_text_in_the_output(smollm2_path):
    """As in vLLM: the token that ended a completion (EOS, a stop token id) is detokenized
    into its text only with include_stop_str_in_output; a special token's text then
    shows only with skip_special_tokens=False. The OpenAI layer's logprobs cover it too."""
    engine = AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=64)
    await engine.start()
    try:
        tok = engine.tokenizer
        messages = [{"role": "user", "content": "Say hello."}]

        async def run(**kw):
            params = SamplingParams(max_tokens=64, temperature=0, **kw)
            chunks = [c async for c in engine.stream(messages=messages, params=params)]
            out = await engine.generate(messages=messages, params=params)
            assert "".join(c.text for c in chunks) == out.text
            return out

        plain = await run()
        assert plain.finish_reason == "stop" and plain.outputs[0].stop_reason is None  # ended by EOS
        eos = plain.token_ids[-1]
        assert eos in engine.eos_token_ids and plain.text == tok.decode(plain.token_ids[:-1])
        shown = await run(include_stop_str_in_output=True, skip_special_tokens=False)
        assert shown.token_ids == plain.token_ids
        assert shown.text == tok.decode(list(shown.token_ids), skip_special_tokens=False)
        assert shown.text.endswith(tok.convert_ids_to_tokens(eos)) and shown.text != plain.text
        assert (await run(skip_special_tokens=False)).text == plain.text  # not asked for: left out
        assert (await run(include_stop_str_in_output=True)).text == plain.text  # a skipped special token

        # A stop token id that is an ordinary token: its text ends the output when asked for.
        k = next(i for i, t in enumerate(plain.token_ids[:-1]) if tok.decode([t]).strip())
        stop_id = plain.token_ids[k]
        cut = await run(stop_token_ids=[stop_id])
        kept = await run(stop_token_ids=[stop_id], include_stop_str_in_output=True)
        assert cut.token_ids == kept.token_ids == plain.token_ids[: k + 1]
        assert (cut.outputs[0].stop_reason, kept.outputs[0].stop_reason) == (stop_id, stop_id)
        assert cut.text == tok.decode(plain.token_ids[:k]) and kept.text == tok.decode(plain.token_ids[: k + 1])

        client = engine.openai_client()
        chat = await client.chat.completions.create(
            model=client.model, messages=messages, max_tokens=64, temperature=0, logprobs=True,
            extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False})
        choice = chat.choices[0]
        assert choice.message.content == shown.text
        assert [lp.token for lp in choice.logprobs.content][-1] == tok.convert_ids_to_tokens(eos)
        assert "".join(lp.token for lp in choice.logprobs.content) == shown.text
        default = await client.chat.completions.create(
            model=client.model, messages=messages, max_tokens=64, temperature=0, logprobs=True)
        assert len(default.choices[0].logprobs.content) == len(choice.logprobs.content) - 1
    finally:
        await engine.aclose()


@pytest.mark.anyio
async def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(smollm2_path):
    """OpenAI's prompt_tokens_details.cached_tokens (chat, completions) and the Responses
    API's input_tokens_details.cached_tokens: the request's full blocks found in the cache,
    as the engine's own metrics count them."""
    async with AsyncEngine.from_pretrained(smollm2_path, max_model_len=512, num_kv_blocks=96, block_size=16) as engine:
        seen = []
        engine.add_finish_listener(lambda chunk: seen.append(chunk.metrics.num_cached_tokens))
        client = engine.openai_client()
        messages = [{"role": "system", "content": "You are a terse assistant. " * 12},
                    {"role": "user", "content": "Name a fruit."}]
        first = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
        again = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=4)
        prompt = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == seen[0] == 0
        assert again.usage.prompt_tokens_details.cached_tokens == seen[1] == (prompt - 1) // 16 * 16 > 0
        streamed = [c async for c in await client.chat.completions.create(
            model=client.model, messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True})]
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == seen[2] == seen[1]
        text = "The same long document. " * 10
        done = [await client.completions.create(model=client.model, prompt=text, max_tokens=2) for _ in range(2)]
        assert [d.usage.prompt_tokens_details.cached_tokens for d in done] == seen[3:5] and seen[4] > 0
        responses = [await client.responses.create(model=client.model, instructions=messages[0]["content"],
                                                   input="Name a fruit.", max_output_tokens=4) for _ in range(2)]
        assert [r.usage.input_tokens_details.cached_tokens for r in responses] == seen[5:7] and seen[6] > 0
