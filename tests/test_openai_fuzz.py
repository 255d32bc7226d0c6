"""Randomized consistency of the OpenAI layer (``engine.openai_client()``).

Each case draws a greedy chat or legacy-completions request (n, max_tokens /
max_completion_tokens, logprobs, echo and prompt scoring, token-id prompts and lists of
prompts, logit_bias, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, include_usage), runs it once without stop strings through
``engine.generate`` (the *base*), adds stop strings cut from the base's text (lists of
them, overlapping ones, absent ones), and then checks four ways of running it against
each other and against what the base implies:

* an oracle: the base's tokens with the documented stop-string semantics applied to
  their bytes (decoded independently of the engine's detokenizer): the text, the finish
  reason, the number of tokens generated, and which tokens' logprobs cover the text;
* ``engine.generate`` with the full request: the same text, finish reason and tokens;
* the non-streamed response: text, finish reason, usage, choice indices, logprobs
  (chat: tokens, exact bytes and top lists; completions: tokens, text offsets, top dicts,
  the echoed prompt's own logprobs);
* the streamed response: deltas joined per choice equal the non-streamed choice, one
  role chunk and one finish chunk per choice, logprobs sent with the text they start,
  the usage chunk last.

The model has random weights and SmolLM2's tokenizer: greedy output is deterministic
nonsense, and logit_bias on tokens holding parts of UTF-8 characters, whole non-ASCII
characters, special tokens and EOS steers it into split and invalid characters, visible
and skipped special tokens, and EOS mid-way. Greedy choices between tokens whose
logprobs are nearly tied may flip between batch shapes, so a case whose base has such a
near-tie is skipped (and counted) rather than compared. Every run must leave the engine
idle. A failure names the seed and the request.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import json
import random
from typing import Any, Optional

import pytest

from conftest import assert_idle
from asyncgen import AsyncEngine, SamplingParams
from asyncgen.openai import BadRequestError

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 512
TIE = 1e-4  # base top-2 logprob gap below which a greedy choice may flip between batch shapes
TOL = 1e-3  # logprobs of the same token in different runs (batch shapes round differently)
WORDS = (
    "The", " capital", " of", " France", " is", " Paris", ".", ",", " one", " two", " three", "\n", "\n\n", " ",
    "  ", " café", " naïve", " Voilà", " 日本語", " 한국", " 😀", "—", " “quoted”", "é", "<", "|", ">",
)
SPECIAL_LITERALS = ("<|im_start|>", "<|endoftext|>", "<repo_name>", "<|im_end|>")


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread runs the tiny model fastest on a shared CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
async def engine(tiny_llama, anyio_backend):
    async with AsyncEngine.from_pretrained(
        tiny_llama, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=256,
        max_num_seqs=16, freeze_gc=False,
    ) as e:
        yield e


@pytest.fixture(scope="module")
def vocab(engine):
    return Vocab(engine.tokenizer, engine._core.eos_token_ids)


# --- token facts, independent of the adapter's ---------------------------------------------------
class Vocab:
    """Token bytes from the byte-level BPE table, and pools of tokens to steer the model."""

    def __init__(self, tokenizer, eos_ids):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.tok = tokenizer
        self.eos = sorted(eos_ids)
        self.added = set(tokenizer.get_added_vocab().values())  # all skipped by skip_special_tokens
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self._raw = [
            p.encode() if i in self.added else bytes(to_byte[c] for c in p) for i, p in enumerate(pieces)
        ]
        self.partial, self.non_ascii = [], []
        for i, raw in enumerate(self._raw):
            if i in self.added:
                continue
            try:
                if not raw.isascii() and raw.decode():
                    self.non_ascii.append(i)
            except UnicodeDecodeError:
                self.partial.append(i)
        self.special = sorted(self.added - set(self.eos))
        self.ordinary = range(max(self.added) + 1, len(tokenizer))

    def raw(self, token_id: int) -> bytes:
        return self._raw[token_id]

    def text_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        return b"" if skip_special_tokens and token_id in self.added else self._raw[token_id]

    def token_str(self, token_id: int) -> str:
        return self._raw[token_id].decode("utf-8", "replace")


@dataclasses.dataclass
class Walk:
    texts: list[str]  # the text after i tokens (a piece ending in an incomplete character waits)
    starts: list[int]  # where token j starts: after the characters complete before its first byte
    final: str  # the whole decode, an incomplete character at the end flushed as U+FFFD


def walk(vocab: Vocab, ids, skip: bool) -> Walk:
    """Decodes ``ids`` one token at a time as the docs describe. A token whose first byte
    continues a character starts where the character does; one that follows bytes no
    byte can complete any more (an invalid sequence, shown as U+FFFD) starts after them."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    raw = b""
    w = Walk([""], [], "")
    complete = 0
    for t in ids:
        b = vocab.text_bytes(t, skip)
        pending = decoder.getstate()[0]
        w.starts.append(complete + (bool(pending and b) and not _continues(pending, b[:1])))
        raw += b
        complete += len(decoder.decode(b))
        full = raw.decode("utf-8", "replace")
        w.texts.append(full if len(full) > len(w.texts[-1]) and not full.endswith("\ufffd") else w.texts[-1])
    w.final = raw.decode("utf-8", "replace")
    return w


def _continues(pending: bytes, byte: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(pending + byte)
        return True
    except UnicodeDecodeError:
        return False


@dataclasses.dataclass
class Expected:
    text: str
    finish: str
    num_tokens: int  # generated, a final stop token included
    # The tokens whose logprobs cover the text and where each starts (see walk).
    covering: tuple[list[int], list[int]]
    by_stop_string: bool
    cut_mid_token: bool  # a stop string cut the text inside the last covering token
    by_flush: bool = False  # the stop string ends in the partial character flushed at the end

    @property
    def ids(self) -> list[int]:
        return self.covering[0]


def expect(vocab: Vocab, base, stops: list[str], include_stop: bool, min_tokens: int, skip: bool) -> Expected:
    """What a request with ``stops`` returns, from the base output without them: the
    first stop string completed by a token after the first ``min_tokens`` ends the text
    (before it, or after it with include_stop_str_in_output); a stop token ends the
    completion and is in neither text nor logprobs, unless include_stop_str_in_output
    puts it in both (as vLLM does)."""
    ids = list(base.token_ids)
    stop_token = base.finish_reason == "stop"  # the base has no stop strings
    text_ids = ids[:-1] if stop_token and not include_stop else ids
    w = walk(vocab, text_ids, skip)
    m = len(text_ids)
    # After token i the text is texts[i]; the flush at the end (an incomplete character
    # decoded as U+FFFD) may complete a stop string too, once every token is generated.
    steps = [(i, w.texts[i - 1], w.texts[i], i) for i in range(1, m + 1)] + [(m, w.texts[m], w.final, len(ids))]
    for i, before, now, generated in steps:
        if i <= min_tokens or not stops:
            continue
        hits = [(now.find(s, max(0, len(before) - len(s) + 1)), s) for s in stops]  # ending in the new text
        hits = [(at, s) for at, s in hits if at != -1]
        if hits:
            at, s = min(hits, key=lambda h: h[0])
            text = now[: at + len(s) if include_stop else at]
            starts = w.starts
            covering = ([text_ids[j] for j in range(i) if starts[j] < len(text)],
                        [x for x in starts[:i] if x < len(text)])
            whole = walk(vocab, covering[0], skip).final
            return Expected(text, "stop", generated, covering, True, whole != text, now is w.final)
    return Expected(w.final, base.finish_reason, len(ids), (text_ids, w.starts), False, False)


def assert_covering(got_items: list, got_offsets: Optional[list[int]], covering, to_item, base: int = 0) -> list[int]:
    """The tokens (and offsets) are those of ``covering``; returns its token ids."""
    got = (list(got_items), None if got_offsets is None else list(got_offsets))
    ids, starts = covering
    assert got == ([to_item(t) for t in ids], None if got_offsets is None else [base + x for x in starts]), (
        "the tokens that cover the text (and where they start)")
    return ids


def near_tie(lps, upto: int) -> bool:
    return any(len(lp.top) > 1 and lp.top[0][1] - lp.top[1][1] < TIE for lp in lps[:upto])


# --- cases ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    seed: int
    chat: bool
    prompts: list  # completions: strings or token-id lists; chat: one list of messages
    body: dict[str, Any]  # the request, less model, stream and stream_options
    extra: dict[str, Any]  # the extension fields, sent through extra_body
    include_usage: bool
    params: SamplingParams  # the same request for engine.generate, without stop strings
    k: Optional[int]  # logprobs asked for: chat top_logprobs / completions logprobs
    scoring: bool = False

    @property
    def n(self) -> int:
        return self.params.n

    def describe(self) -> str:
        prompt = {"messages": self.prompts[0]} if self.chat else {"prompt": self.body.get("prompt")}
        body = {k: v for k, v in self.body.items() if k not in ("messages", "prompt")}
        return (f"seed {self.seed}: {'chat' if self.chat else 'completions'} {json.dumps(prompt, ensure_ascii=False)} "
                f"{json.dumps(body, ensure_ascii=False)} extra_body={json.dumps(self.extra, ensure_ascii=False)} "
                f"include_usage={self.include_usage}")

    def run_params(self, stop) -> SamplingParams:
        update: dict[str, Any] = {"stop": stop or None}
        if not self.chat and self.body.get("echo") and self.k is not None:
            update["prompt_logprobs"] = self.k
        return self.params.model_copy(update=update)


def _text(rng: random.Random, specials: bool) -> str:
    words = WORDS + SPECIAL_LITERALS if specials else WORDS
    return "".join(rng.choice(words) for _ in range(rng.randint(1, 8)))


def _ids(rng: random.Random, vocab: Vocab) -> list[int]:
    pools = [vocab.ordinary] * 4 + [vocab.partial, vocab.non_ascii, vocab.special]
    return [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 12))]


def draw(seed: int, vocab: Vocab) -> Case:
    rng = random.Random(seed)
    chat = rng.random() < 0.5
    specials = rng.random() < 0.2
    body: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    params: dict[str, Any] = {"n": rng.choice((1, 1, 2, 3))}
    if params["n"] > 1 or rng.random() < 0.3:
        body["n"] = params["n"]
    if rng.random() < 0.8:
        body["temperature"] = 0
    else:
        body["top_p"] = 0  # greedy too, in OpenAI's other spelling
    params["temperature"] = 0.0
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 99)
        params["seed"] = body["seed"]
    max_tokens = rng.randint(1, 24)
    params["max_tokens"] = max_tokens
    k = None
    scoring = False
    if chat:
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": rng.choice(("system", "developer")), "content": _text(rng, specials)})
        messages.append({"role": "user", "content": _text(rng, specials)})
        if rng.random() < 0.3:
            messages.append({"role": "assistant", "content": _text(rng, specials)})
            messages.append({"role": "user", "content": _text(rng, specials)})
        if rng.random() < 0.2:
            messages[-1]["content"] = [{"type": "text", "text": _text(rng, specials)} for _ in range(2)]
        prompts = [messages]
        body["messages"] = messages
        which = "neither" if rng.random() < 0.05 else rng.choice(("max_tokens", "max_completion_tokens", "both"))
        if which == "both":  # max_completion_tokens wins
            body["max_completion_tokens"], body["max_tokens"] = max_tokens, rng.randint(1, 40)
        elif which == "neither":  # until the end of the turn: EOS made certain, after min_tokens
            params["max_tokens"] = None
            body["logit_bias"] = {str(vocab.eos[0]): 30}
            params["logit_bias"] = {vocab.eos[0]: 30.0}
            if rng.random() < 0.5:
                extra["min_tokens"] = params["min_tokens"] = max_tokens
        else:
            body[which] = max_tokens
        if rng.random() < 0.5:
            body["logprobs"] = True
            k = rng.choice((None, 0, 1, 2, 5))
            if k is not None:
                body["top_logprobs"] = k
            k = k or 0
    else:
        form = rng.choice(("str", "str", "ids", "strs", "idss"))
        if form == "str":
            prompts = [_text(rng, specials)]
            body["prompt"] = prompts[0]
        elif form == "ids":
            prompts = [_ids(rng, vocab)]
            body["prompt"] = prompts[0]
        else:
            one = (lambda: _text(rng, specials)) if form == "strs" else (lambda: _ids(rng, vocab))
            prompts = [one() for _ in range(rng.randint(1, 3))]
            body["prompt"] = prompts
        if rng.random() < 0.5:
            k = rng.choice((0, 1, 3, 5))
            body["logprobs"] = k
        if rng.random() < 0.35:
            body["echo"] = True
            scoring = rng.random() < 0.35
        if scoring:
            body["max_tokens"] = 0
            params["max_tokens"] = max_tokens = 1
        elif max_tokens != 16 or rng.random() < 0.5:
            body["max_tokens"] = max_tokens
        if rng.random() < 0.12:
            body["best_of"] = params["n"] + rng.choice((0, 1, 2))
            if body["best_of"] > params["n"] and not scoring:  # the best n of them; not streamed
                params["best_of"] = body["best_of"]
    endless = chat and params["max_tokens"] is None
    pools = rng.sample([vocab.partial, vocab.non_ascii, vocab.special, vocab.eos], rng.randint(1, 3))
    if endless or rng.random() < 0.4:
        pools = []
    if pools:
        bias: dict[int, float] = {}
        for pool in pools:
            for t in rng.sample(pool, min(len(pool), rng.randint(1, 4))):
                bias[t] = round(rng.uniform(0.5, 5.0), 2)
        body["logit_bias"] = {str(t): v for t, v in bias.items()}
        params["logit_bias"] = bias
        if rng.random() < 0.2:
            extra["stop_token_ids"] = params["stop_token_ids"] = rng.sample(sorted(bias), 1)
    if not endless and rng.random() < 0.2:
        extra["ignore_eos"] = params["ignore_eos"] = True
    if not scoring and not endless and rng.random() < 0.3:
        extra["min_tokens"] = params["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.3 or vocab.special in pools:
        extra["skip_special_tokens"] = params["skip_special_tokens"] = rng.random() < 0.4
    if rng.random() < 0.3:
        extra["include_stop_str_in_output"] = params["include_stop_str_in_output"] = rng.random() < 0.7
    if k is not None:
        params["logprobs"] = k
    return Case(seed, chat, prompts, body, extra, rng.random() < 0.5, SamplingParams(**params), k, scoring)


def draw_stops(rng: random.Random, texts: list[str]):
    """Stop strings cut from the base's texts so that they end it midway: one (as a
    string or a list), several, overlapping ones, one that never appears."""
    texts = [t for t in texts if t]
    if not texts or rng.random() < 0.4:
        return None

    def piece() -> str:
        t = rng.choice(texts)
        if rng.random() < 0.2:  # the end, perhaps a partial character flushed
            return t[-rng.randint(1, 6) :]
        a = rng.randrange(len(t))
        return t[a : a + rng.randint(1, 6)]

    stops = [piece()]
    for _ in range(rng.choice((0, 0, 1, 2, 3))):
        s = rng.choice(stops)
        kind = rng.choice(("piece", "head", "tail", "longer", "absent"))
        if kind == "head" and len(s) > 1:
            s = s[:-1]
        elif kind == "tail" and len(s) > 1:
            s = s[1:]
        elif kind == "longer":
            s = s + rng.choice(("x", " ", "\n", "é", s[0]))
        elif kind == "absent":
            s = "\x07never"
        else:
            s = piece()
        if s not in stops:
            stops.append(s)
    return stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops


# --- running and checking a case -----------------------------------------------------------------
def template_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as the adapter documents handing them to the chat template:
    developer as system, text parts joined with newlines."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


async def generate(engine, case: Case, prompt, params: SamplingParams):
    if case.chat:
        return await engine.generate(messages=template_messages(prompt), params=params)
    return await engine.generate(prompt, params)


async def run_case(engine, client, vocab: Vocab, seed: int, tally) -> bool:
    """Runs and checks the case of ``seed``; False if it was skipped (a near-tie)."""
    case = draw(seed, vocab)
    rng = random.Random(seed * 7919 + 1)
    try:
        # The base: no stop strings, the top two logprobs at each position (near-ties).
        base_params = case.params.model_copy(update={"logprobs": max(2, case.k or 0), "prompt_logprobs": case.k
                                                     if not case.chat and case.body.get("echo") and case.k is not None
                                                     else None})
        bases = [await generate(engine, case, p, base_params) for p in case.prompts]
        if any(near_tie(b.outputs[0].logprobs, len(b.outputs[0].token_ids)) for b in bases):
            tally["skipped (near-tie)"] += 1
            return False
        for b in bases:  # greedy: the n samples are one
            assert all(o.token_ids == b.outputs[0].token_ids and o.text == b.outputs[0].text for o in b.outputs)
        stop = None if case.scoring else draw_stops(rng, [b.outputs[0].text for b in bases])
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if stop is not None:
            case.body["stop"] = stop
        p = case.params
        expected = [expect(vocab, b.outputs[0], stops, p.include_stop_str_in_output, p.min_tokens,
                            p.skip_special_tokens) for b in bases]
        prompt_ids = [list(b.prompt_token_ids) for b in bases]

        # engine.generate with the whole request
        directs = [await generate(engine, case, prompt, case.run_params(stop)) for prompt in case.prompts]
        for d, e, b in zip(directs, expected, bases):
            for o in d.outputs:
                assert (o.text, o.finish_reason) == (e.text, e.finish), "engine.generate vs the base's tokens"
                assert list(o.token_ids) == list(b.outputs[0].token_ids[: e.num_tokens])
            assert sum(len(o.token_ids) for o in d.outputs) == case.n * e.num_tokens
            assert d.usage.completion_tokens == p.num_sequences * e.num_tokens

        kwargs = dict(model=client.model, **case.body)
        if case.extra:
            kwargs["extra_body"] = dict(case.extra)
        create = client.chat.completions.create if case.chat else client.completions.create
        whole = await create(**kwargs)
        check_whole(case, vocab, whole, bases, expected, prompt_ids, directs)
        assert_idle(engine)
        stream_kwargs = dict(kwargs, stream=True)
        if case.include_usage:
            stream_kwargs["stream_options"] = {"include_usage": True}
        if case.body.get("best_of", 0) > p.n:  # refused even where scoring ignores it, as OpenAI does
            with pytest.raises(BadRequestError) as refused:
                await create(**stream_kwargs)
            assert refused.value.param == "best_of"
        else:
            chunks = [c async for c in await create(**stream_kwargs)]
            check_stream(case, whole, chunks, expected, vocab)
        assert_idle(engine)
    except AssertionError as e:
        raise AssertionError(f"{case.describe()}\n{e}") from e
    note(tally, case, expected, vocab, bases)
    return True


def note(tally, case: Case, expected: list[Expected], vocab: Vocab, bases) -> None:
    """Counts what a case exercised, so that a change to the drawing that stops covering
    something shows."""
    tally["chat" if case.chat else "completions"] += 1
    tally["n > 1"] += case.n > 1
    tally["several prompts"] += len(case.prompts) > 1
    tally["token-id prompts"] += not case.chat and not isinstance(case.prompts[0], str)
    tally["logprobs"] += case.k is not None
    tally["echo"] += bool(case.body.get("echo"))
    tally["echo + logprobs"] += bool(case.body.get("echo")) and case.k is not None
    tally["scoring (max_tokens=0)"] += case.scoring
    tally["best_of > n"] += case.params.num_sequences > case.n
    tally["include_usage"] += case.include_usage
    tally["stopped by a stop string"] += any(e.by_stop_string for e in expected)
    tally["stop string kept (include_stop_str_in_output)"] += case.params.include_stop_str_in_output and any(
        e.by_stop_string for e in expected)
    tally["stop string cuts a token"] += any(e.cut_mid_token for e in expected)
    tally["stop token (EOS or stop_token_ids)"] += any(b.outputs[0].finish_reason == "stop" for b in bases)
    tally["stop string in the final flush"] += any(e.by_flush for e in expected)
    tally["min_tokens"] += case.params.min_tokens > 0
    tally["split character"] += any("\ufffd" in vocab.token_str(t) for e in expected for t in e.ids)
    tally["special token in output"] += any(t in vocab.added for e in expected for t in e.ids)
    tally["special token shown"] += not case.params.skip_special_tokens and any(
        t in vocab.added for e in expected for t in e.ids)


def _choice_expectation(case: Case, index: int, expected, vocab):
    k = index // case.n
    if case.chat or not case.body.get("echo"):
        echo = ""
    elif isinstance(case.prompts[k], str):
        echo = case.prompts[k]
    else:
        echo = walk(vocab, case.prompts[k], False).final
    return k, echo, expected[k]


def check_whole(case: Case, vocab: Vocab, resp, bases, expected, prompt_ids, directs) -> None:
    count = case.n * len(case.prompts)
    assert sorted(c.index for c in resp.choices) == list(range(count)), "each choice index once"
    num_tokens = 0 if case.scoring else case.params.num_sequences * sum(e.num_tokens for e in expected)
    usage = (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens)
    prompt_tokens = sum(len(p) for p in prompt_ids)
    assert usage == (prompt_tokens, num_tokens, prompt_tokens + num_tokens)
    if not case.scoring:
        assert resp.usage.completion_tokens == sum(d.usage.completion_tokens for d in directs)
    texts = {}
    for choice in resp.choices:
        k, echo, e = _choice_expectation(case, choice.index, expected, vocab)
        base = bases[k].outputs[0]
        if case.chat:
            assert choice.message.role == "assistant" and choice.message.refusal is None
            text = choice.message.content
        else:
            text = choice.text
        texts[choice.index] = text
        want_text = echo if case.scoring else echo + e.text
        assert text == want_text, f"choice {choice.index}"
        assert choice.finish_reason == ("length" if case.scoring else e.finish), f"choice {choice.index}"
        if case.k is None:
            assert choice.logprobs is None
            continue
        lps = base.logprobs
        if case.chat:
            check_chat_logprobs(case, vocab, choice.logprobs.content, text, e, lps)
        else:
            check_completion_logprobs(case, vocab, choice.logprobs, text, echo, e, lps, bases[k], prompt_ids[k])
    for i in range(0, count, case.n):  # greedy: the n choices of a prompt are one
        assert len({texts[j] for j in range(i, i + case.n)}) == 1


def check_chat_logprobs(case: Case, vocab: Vocab, content, text: str, e: Expected, base_lps) -> None:
    ids = assert_covering([bytes(t.bytes) for t in content], None, e.covering, vocab.raw)
    # the claim of the docs: the tokens cover the returned text (the last one may go on
    # into a stop string cut from it)
    shown = b"".join(vocab.text_bytes(t, case.params.skip_special_tokens) for t in ids).decode("utf-8", "replace")
    assert shown == text or (e.by_stop_string and shown.startswith(text))
    for j, t in enumerate(content):
        assert t.token == bytes(t.bytes).decode("utf-8", "replace")
        assert t.logprob == pytest.approx(base_lps[j].logprob, abs=TOL)
        assert len(t.top_logprobs) == case.k
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert_same_top({bytes(x.bytes): x.logprob for x in t.top_logprobs},
                        {vocab.raw(i): v for i, v in base_lps[j].top[: case.k]})
        assert all(x.token == bytes(x.bytes).decode("utf-8", "replace") for x in t.top_logprobs)
        if case.k:  # greedy: the chosen token is the most likely one
            assert t.top_logprobs[0].bytes == t.bytes and t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def _top_dict(vocab: Vocab, lp, k: int) -> dict[str, float]:
    top: dict[str, float] = {}
    for t, v in (*lp.top[:k], (lp.token_id, lp.logprob)):
        s = vocab.token_str(t)
        top[s] = max(v, top.get(s, v))
    return top


def assert_same_top(got: dict, want: dict) -> None:
    """The same alternatives with the same logprobs, but for those tied with the least
    likely one kept: which of them makes the cut may differ between batch shapes."""
    assert len(got) == len(want)
    for key in got.keys() & want.keys():
        assert got[key] == pytest.approx(want[key], abs=TOL), key
    if got.keys() != want.keys():
        floor = min(want.values())
        for key in got.keys() ^ want.keys():
            assert abs(got.get(key, want.get(key)) - floor) < TOL, (got, want)


def _check_top_dicts(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert_same_top(g, w)


def _check_offsets_point_into(text: str, tokens: list[str], offsets: list[int], cut: bool) -> None:
    """Where a token is whole characters, the text at its offset is the token (or, where
    a stop string cut the text inside it, the token's start)."""
    for tok, off in zip(tokens, offsets):
        if tok and "\ufffd" not in tok and not (tok.startswith("<") and tok.endswith(">")):
            while text[off : off + 1] == "\ufffd":
                off += 1  # an invalid sequence before the token (see walk)
            if cut and off + len(tok) > len(text):
                assert tok.startswith(text[off:]), (tok, off)
            else:
                assert text[off : off + len(tok)] == tok, (tok, off)


def check_completion_logprobs(case: Case, vocab, lp, text: str, echo: str, e: Expected, base_lps, base, prompt_ids):
    k = case.k
    n_echo = len(prompt_ids) if case.body.get("echo") else 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    if n_echo:
        # the echoed prompt: its tokens, where they start in the echo, their logprobs
        w = walk(vocab, prompt_ids, False)
        assert w.final == echo, "the echo is the decoded prompt"
        assert_covering(lp.tokens[:n_echo], lp.text_offset[:n_echo], (prompt_ids, w.starts), vocab.token_str)
        plps = base.prompt_logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:n_echo] == pytest.approx([x.logprob for x in plps[1:]], abs=TOL)
        _check_top_dicts(lp.top_logprobs[1:n_echo], [_top_dict(vocab, x, k) for x in plps[1:]])
    covering = ([], []) if case.scoring else e.covering
    ids = assert_covering(lp.tokens[n_echo:], lp.text_offset[n_echo:], covering, vocab.token_str, len(echo))
    assert lp.token_logprobs[n_echo:] == pytest.approx([x.logprob for x in base_lps[: len(ids)]], abs=TOL)
    _check_top_dicts(lp.top_logprobs[n_echo:], [_top_dict(vocab, x, k) for x in base_lps[: len(ids)]])
    for top in lp.top_logprobs[n_echo:]:
        assert 1 <= len(top) <= max(k, 1)  # greedy: the sampled token is among the k
    _check_offsets_point_into(text, lp.tokens, lp.text_offset, e.by_stop_string)
    assert lp.text_offset == sorted(lp.text_offset)
    if not case.params.skip_special_tokens or not any(t in vocab.added for t in ids):
        joined = "".join(lp.tokens)
        if "\ufffd" not in joined:  # no token splits a character
            assert joined == text or (e.by_stop_string and joined.startswith(text))


def check_stream(case: Case, whole, chunks, expected: list[Expected], vocab: Vocab) -> None:
    assert len({c.id for c in chunks}) == 1 and all(c.model == whole.model for c in chunks)
    body = chunks
    if case.include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        body = chunks[:-1]
    assert all(c.usage is None for c in body) and all(len(c.choices) == 1 for c in body)
    by_index: dict[int, list] = {}
    for c in body:
        by_index.setdefault(c.choices[0].index, []).append(c.choices[0])
    assert sorted(by_index) == sorted(c.index for c in whole.choices)
    for want in whole.choices:
        got = by_index[want.index]
        finishes = [g.finish_reason for g in got if g.finish_reason is not None]
        assert finishes == [want.finish_reason] and got[-1].finish_reason is not None, f"choice {want.index}"
        if case.chat:
            assert got[0].delta.role == "assistant" and got[0].delta.content == ""
            assert all(g.delta.role is None for g in got[1:])
            assert got[-1].delta.to_dict() == {}
            assert "".join(g.delta.content or "" for g in got) == want.message.content, f"choice {want.index}"
            if want.logprobs is None:
                assert all(g.logprobs is None for g in got)
            else:
                content = [t for g in got if g.logprobs is not None for t in g.logprobs.content]
                _same_chat_logprobs(content, want.logprobs.content)
                _check_chat_logprobs_go_with_their_text(got, want, expected[0], vocab)
        else:
            assert "".join(g.text for g in got) == want.text, f"choice {want.index}"
            if want.logprobs is None:
                assert all(g.logprobs is None for g in got)
                continue
            sent = 0
            tokens, offsets, values, tops = [], [], [], []
            for g in got:
                before, sent = sent, sent + len(g.text)
                if g.logprobs is None:
                    assert not g.text, "text without its logprobs"
                    continue
                last = g.finish_reason is not None
                for off in g.logprobs.text_offset:  # sent with the text it starts
                    assert before <= off < sent or (last and before <= off <= sent), (off, before, sent)
                tokens += g.logprobs.tokens
                offsets += g.logprobs.text_offset
                values += g.logprobs.token_logprobs
                tops += g.logprobs.top_logprobs
            w = want.logprobs
            assert (tokens, offsets) == (w.tokens, w.text_offset)
            assert values == pytest.approx(w.token_logprobs, abs=TOL)
            _check_top_dicts(tops, w.top_logprobs)


def _check_chat_logprobs_go_with_their_text(got, want, e: Expected, vocab: Vocab) -> None:
    """Each token's logprob is sent with the chunk that sends the text it starts (the
    rest with the last text, before the finish chunk)."""
    ids, starts = e.covering
    assert [vocab.raw(t) for t in ids] == [bytes(t.bytes) for t in want.logprobs.content]
    sent = done = 0
    for g, following in zip(got, got[1:] + [None]):
        before, sent = sent, sent + len(g.delta.content or "")
        if g.logprobs is None:
            continue
        last = following is not None and following.finish_reason is not None
        for start in starts[done : done + len(g.logprobs.content)]:
            assert before <= start < sent or (last and before <= start <= sent), (start, before, sent)
        done += len(g.logprobs.content)


def _same_chat_logprobs(got, want) -> None:
    assert [(t.token, t.bytes) for t in got] == [(t.token, t.bytes) for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=TOL)
    for g, w in zip(got, want):
        assert_same_top({bytes(x.bytes): x.logprob for x in g.top_logprobs},
                        {bytes(x.bytes): x.logprob for x in w.top_logprobs})


async def fuzz(engine, vocab: Vocab, seeds) -> collections.Counter:
    client = engine.openai_client()
    tally: collections.Counter = collections.Counter()
    for seed in seeds:
        await run_case(engine, client, vocab, seed, tally)
    return tally


COVERAGE = (
    "chat", "completions", "n > 1", "several prompts", "token-id prompts", "logprobs", "echo", "echo + logprobs",
    "scoring (max_tokens=0)", "best_of > n", "include_usage", "stopped by a stop string",
    "stop string kept (include_stop_str_in_output)", "stop string cuts a token", "stop token (EOS or stop_token_ids)",
    "min_tokens", "split character", "special token in output", "special token shown",
)


def assert_covered(tally: collections.Counter, seeds) -> None:
    assert not [c for c in COVERAGE if not tally[c]], f"not exercised: {dict(tally)}"
    assert tally["skipped (near-tie)"] <= max(1, len(seeds) // 20), dict(tally)


# Tests whose subject does not depend on the event loop run on asyncio only.
ASYNCIO_ONLY = pytest.mark.parametrize("anyio_backend", ["asyncio"], scope="module")


async def test_openai_layer_is_consistent(engine, vocab, anyio_backend):
    seeds = range(*{"asyncio": (0, 100), "trio": (1000, 1100)}[anyio_backend])
    assert_covered(await fuzz(engine, vocab, seeds), seeds)


@pytest.mark.slow
@ASYNCIO_ONLY
async def test_openai_layer_is_consistent_many_cases(engine, vocab):
    seeds = range(10_000, 10_400)
    assert_covered(await fuzz(engine, vocab, seeds), seeds)


@pytest.mark.slow
@ASYNCIO_ONLY
async def test_openai_layer_is_consistent_on_smollm2(smollm2_path):
    """Real text: words, newlines and the end of a chat turn instead of random tokens."""
    async with AsyncEngine.from_pretrained(smollm2_path, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN,
                                           max_num_seqs=16) as engine:
        tally = await fuzz(engine, Vocab(engine.tokenizer, engine._core.eos_token_ids), range(20_000, 20_024))
    assert tally["stopped by a stop string"] and tally["chat"] and tally["completions"], dict(tally)


# --- regressions -----------------------------------------------------------------------------------
@ASYNCIO_ONLY
async def test_echo_offsets_count_special_tokens(engine):
    """The echo keeps a prompt's special tokens as text, so the offsets of the tokens
    after one count its characters."""
    client = engine.openai_client()
    prompt = "a<|im_start|>b<repo_name>c"
    for p in (prompt, engine.tokenizer.encode(prompt)):
        choice = (await client.completions.create(model=client.model, prompt=p, max_tokens=0, echo=True,
                                                   logprobs=0)).choices[0]
        assert choice.text == prompt and choice.logprobs.tokens == ["a", "<|im_start|>", "b", "<repo_name>", "c"]
        assert choice.logprobs.text_offset == [0, 1, 13, 14, 25]
    stream = await client.completions.create(model=client.model, prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                                             stream=True)
    first = [c async for c in stream][0].choices[0]
    assert first.text == prompt and first.logprobs.text_offset == [0, 1, 13, 14, 25]


@ASYNCIO_ONLY
async def test_offsets_after_an_invalid_character(engine):
    """A token after bytes no byte can complete starts after their U+FFFD; one that
    continues a character starts where the character does."""
    from asyncgen.engine.tokenizer import TokenBytes

    client = engine.openai_client()
    vocab_bytes = TokenBytes(engine.tokenizer).vocabulary()
    lone, lead = vocab_bytes.index(b"\x80"), vocab_bytes.index(b"\xe2\x82")  # 2 of the 3 bytes of "€"
    [word] = engine.tokenizer.encode(" word")
    euro_end = vocab_bytes.index(b"\xac")
    cases = [
        ([lone, word, lead, lead, word], "\ufffd word\ufffd\ufffd word", [0, 1, 6, 7, 8]),
        ([word, lead, euro_end, word], " word€ word", [0, 5, 5, 6]),  # the last byte continues the character
        ([lead, word], "\ufffd word", [0, 1]),
    ]
    for ids, text, offsets in cases:
        choice = (await client.completions.create(model=client.model, prompt=ids, max_tokens=0, echo=True,
                                                   logprobs=0)).choices[0]
        assert (choice.text, choice.logprobs.text_offset) == (text, offsets)


@ASYNCIO_ONLY
async def test_a_stop_token_is_not_in_the_logprobs_when_the_flush_completes_a_stop_string(engine, vocab):
    """A completion that ends on a partial character and then EOS: the flush shows the
    character as U+FFFD, which completes the stop string, and the stop string becomes
    the finish's reason. EOS is not in the logprobs, as it is not in the text; with
    include_stop_str_in_output (which asks for its text: empty, as special tokens are
    skipped), it is, where the character it follows starts."""
    client = engine.openai_client()
    lead = next(t for t in vocab.partial if vocab.raw(t)[0] >= 0xE0 and len(vocab.raw(t)) == 2)  # 2 of 3 bytes
    eos = vocab.eos[0]
    # The lead bytes first; then, penalised for having appeared, they lose to EOS.
    steer = dict(max_tokens=4, temperature=0, logit_bias={str(lead): 100, str(eos): 98}, presence_penalty=2,
                 frequency_penalty=2)
    params = SamplingParams(**dict(steer, logit_bias={lead: 100, eos: 98}))
    request = dict(steer, model=client.model, stop=["\ufffd"], extra_body={"include_stop_str_in_output": True})
    messages = [{"role": "user", "content": "Hi"}]
    assert (await engine.generate("Hi", params)).token_ids == (lead, eos)  # what the requests rely on
    assert (await engine.generate(messages=messages, params=params)).token_ids == (lead, eos)

    for include in (False, True):
        request["extra_body"] = {"include_stop_str_in_output": include}
        text = "\ufffd" if include else ""
        # the tokens that cover the text (EOS's text is skipped, empty; its logprob's bytes are its own)
        want = [(lead, vocab.raw(lead)), (eos, vocab.raw(eos))] if include else []
        whole = (await client.completions.create(**request, prompt="Hi", logprobs=1)).choices[0]
        assert (whole.text, whole.finish_reason) == (text, "stop")
        assert whole.logprobs.text_offset == [0] * len(want)
        streamed = [c.choices[0] async for c in await client.completions.create(**request, prompt="Hi", logprobs=1,
                                                                                 stream=True)]
        assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens
        chat = (await client.chat.completions.create(**request, messages=messages, logprobs=True)).choices[0]
        assert chat.message.content == text and [t.bytes for t in chat.logprobs.content] == [list(b) for _, b in want]
    assert_idle(engine)
