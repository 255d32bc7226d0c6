"""Streamed text against a full-decode oracle, on SmolLM2's real tokenizer, with random
token sequences and stop strings.

The oracle knows nothing of windows or hold-back arithmetic. From ``tokenizer.decode`` of
the whole sequence and of each prefix it derives what a stream must produce:

* ``full = decode(ids)``. After ``m`` tokens the text known is the decode of ``ids[:m]``,
  except that a token whose text ends in U+FFFD (a character still incomplete) releases
  its text with the next token that leaves none dangling (the documented hold-back; vLLM
  does the same). ``known[m]`` is its length; after the final flush it is ``len(full)``.
* A stop string counts only where an occurrence of it in ``full`` ends past
  ``known[min_tokens]``, the text of the first ``min_tokens`` tokens: one completed by those
  tokens never ends the text, one that starts inside them and ends later does (vLLM's
  ``min_tokens`` applies to stop strings the same way).
* The text ends at the first step (token, or the final flush) that makes a counting
  occurrence known. Of the occurrences that step reveals, the one starting first wins,
  the first in ``stop`` on a tie. This "when it is generated" reading is vLLM's; within a
  step vLLM takes the first stop string in list order instead, which can cut later: the
  earliest start is what asyncgen does (as the detokenizer's docstring says). Overlapping occurrences are thus
  resolved by time first, then by position: with ``stop=["abcd", "bc"]``, "a", "b", "c"
  as three tokens stop at "bc" (text "a"); "a", "bcd" as two tokens stop at "abcd".
* The kept text is ``full`` up to the start of that occurrence, or up to its end with
  ``include_stop_str_in_output``.

While running, a stream must not have released any tail of ``known[m]`` that is a proper
prefix of a stop string (it could still become one), and must have released the rest,
but for a tail that is a whole stop string shorter than the longest (possible only inside
``min_tokens``, where holding it a token longer is harmless).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import pytest

from asyncgen import SamplingParams
from asyncgen.engine.core import EngineCore, RequestGroup
from asyncgen.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [1, 9690, 198]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return Vocab(tokenizer)


# --- oracle -----------------------------------------------------------------------------------
def occurrences(text: str, s: str):
    at = text.find(s)
    while at != -1:
        yield at
        at = text.find(s, at + 1)  # overlapping ones too: "aa" in "aaa" twice


class Oracle:
    def __init__(self, tokenizer, ids, stop, skip_special_tokens=True, min_tokens=0, include_stop=False):
        self.stop = list(stop)
        decode = lambda x: tokenizer.decode(x, skip_special_tokens=skip_special_tokens)  # noqa: E731
        self.full = full = decode(ids)
        known = [0]
        for m in range(1, len(ids) + 1):
            text = decode(ids[:m])
            if text.endswith(FFFD) or len(text) <= known[-1]:
                known.append(known[-1])
            else:
                # The whole premise: a prefix's decode, once no character dangles, is a
                # prefix of the full decode (true of byte-level BPE).
                assert full.startswith(text), (ids[:m], text, full)
                known.append(len(text))
        known.append(len(full))  # the final flush
        self.known = known
        self.stop_step: Optional[int] = None  # tokens fed when it stopped; len(ids) + 1: at the flush
        self.stop_str: Optional[str] = None
        self.text = full
        if not self.stop or len(ids) <= min_tokens:
            return
        floor = known[min_tokens]
        found = sorted(
            (at, i, s) for i, s in enumerate(self.stop) for at in occurrences(full, s) if at + len(s) > floor
        )
        for m in range(min_tokens + 1, len(known)):
            revealed = [o for o in found if o[0] + len(o[2]) <= known[m]]
            if revealed:
                at, _, s = revealed[0]
                self.stop_step, self.stop_str = m, s
                self.text = full[: at + len(s) if include_stop else at]
                return

    def running_bounds(self, m: int) -> tuple[int, int]:
        """(least, most) characters a stream may have released after ``m`` tokens, before
        it stopped or finished."""
        assert self.stop_step is None or m < self.stop_step
        k = self.known[m]
        text = self.full[:k]
        return k - _held_tail(text, self.stop, proper=False), k - _held_tail(text, self.stop, proper=True)


def _held_tail(text: str, stop: list[str], proper: bool) -> int:
    longest = max((len(s) for s in stop), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) and (len(s) > k or not proper) for s in stop):
            return k
    return 0


# --- random cases ----------------------------------------------------------------------------
FRAGMENTS = [
    # ASCII, whitespace runs, leading-space words, repeats that make stop strings overlap
    "hello", " world", " the", "STOP", " STOP", "END", "  ", "   x", "\n", "\n\n", "\t", "...", "a", "aa",
    "aaaa", "abab", "ab", "abc", " a", "12", " 345", ",", "<|im_end|>", "<", "|",
    # accents: precomposed, combining marks, ligatures
    "café", " naïve", "e\u0301", "A\u030a\u0323", "ñ", "ß", "ﬁ", "Ω",
    # CJK, kana, Hangul
    "中文", "漢字", " かな", "カタカナ", "한국어", " 안녕하세요",
    # emoji: 4-byte, skin tone, ZWJ sequences, flags, variation selectors
    "😀", " 🎉", "👍🏽", "👨\u200d👩\u200d👧", "🇯🇵", "❤\ufe0f", "🧑\u200d💻",
    # odd ones: a real U+FFFD, math alphanumerics, zero-width and no-break spaces, NUL
    FFFD, "𝔘𝔫", "\u200b", "\u00a0", "€", "→", "\x00",
]
LEAD_BYTES = [0xC3, 0xCE, 0xE2, 0xE4, 0xE6, 0xEA, 0xED, 0xF0, 0xF3, 0xF4]
CONT_BYTES = [0x80, 0x81, 0x8F, 0x9F, 0xA9, 0xB8, 0xBF]


class Vocab:
    """SmolLM2's byte tokens (GPT-2's byte-to-character table) and special tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
        char_of = {b: chr(b) for b in printable}
        for n, b in enumerate(b for b in range(256) if b not in char_of):
            char_of[b] = chr(256 + n)
        self.byte_of_char = {c: b for b, c in char_of.items()}
        vocab = tokenizer.get_vocab()
        # A few bytes (some controls, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5-0xFF) have no token.
        self.byte_token = {b: vocab[c] for b, c in char_of.items() if c in vocab}
        self.special = sorted(tokenizer.added_tokens_decoder)
        self.size = len(tokenizer)

    def token_bytes(self, token_id: int) -> Optional[bytes]:
        if token_id in self.special:
            return None
        return bytes(self.byte_of_char[c] for c in self.tokenizer.convert_ids_to_tokens(token_id))

    def random_ids(self, rng: random.Random, max_len: int) -> list[int]:
        count = rng.randint(1, max(10, max_len // 4))
        text = "".join(rng.choice(FRAGMENTS) + rng.choice(["", "", " "]) for _ in range(count))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        for _ in range(rng.choice([0, 0, 1, 2, 4, 8])):
            self._mutate(rng, ids)
        if rng.random() < 0.15:  # generation cut off inside a character
            ids.append(self.byte_token[rng.choice(LEAD_BYTES)])
        return ids[:max_len] or [self.byte_token[rng.choice(LEAD_BYTES)]]

    def _mutate(self, rng: random.Random, ids: list[int]) -> None:
        at = rng.randint(0, len(ids))
        kind = rng.random()
        if kind < 0.35 and ids:
            # Byte fallback: a token spelled out one byte token at a time.
            at = min(at, len(ids) - 1)
            raw = self.token_bytes(ids[at])
            if raw is not None and all(b in self.byte_token for b in raw):
                ids[at : at + 1] = [self.byte_token[b] for b in raw]
        elif kind < 0.5:
            b = rng.choice(LEAD_BYTES + CONT_BYTES + [0x20, 0x41, 0x0A])
            ids.insert(at, self.byte_token[b])
        elif kind < 0.65:
            ids.insert(at, rng.choice([0, 1, 2, 2, rng.choice(self.special)]))
        elif kind < 0.8:
            ids.insert(at, rng.randrange(len(self.special), self.size))  # any token, often a piece of a character
        elif ids:
            del ids[min(at, len(ids) - 1)]  # breaks a character apart, or joins two halves


def random_stops(rng: random.Random, full: str) -> list[str]:
    stops: list[str] = []
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4])):
        kind = rng.random()
        if full and kind < 0.45:  # a substring: straddles tokens, splits graphemes, may start with a space
            a = rng.randrange(len(full))
            s = full[a : a + rng.choice([1, 1, 2, 2, 3, 4, 6, 9])]
        elif full and kind < 0.55:
            spaces = [i for i, c in enumerate(full) if c == " "]
            a = rng.choice(spaces) if spaces else 0
            s = full[a : a + rng.randint(1, 4)]
        elif full and kind < 0.65:
            s = rng.choice(full)  # one character: a combining mark, a ZWJ, U+FFFD...
        elif stops and kind < 0.85:  # a prefix or extension of one already chosen
            base = rng.choice(stops)
            if len(base) > 1 and rng.random() < 0.5:
                s = base[: rng.randrange(1, len(base))]
            else:
                at = full.find(base)
                s = full[at : at + len(base) + rng.randint(1, 3)] if at != -1 else base + "x"
        else:
            s = rng.choice(FRAGMENTS + ["zzz", " q", "ST", "STOPS"])  # often absent: only held, then released
        if s:
            stops.append(s)
    return stops


@dataclass
class Case:
    seed: int
    ids: list[int]
    stop: list[str]
    skip_special_tokens: bool
    min_tokens: int
    include_stop: bool
    extra: dict = field(default_factory=dict)

    def describe(self, **texts) -> str:
        lines = [
            f"seed={self.seed}",
            f"ids={self.ids}",
            f"stop={self.stop!r}",
            f"skip_special_tokens={self.skip_special_tokens} min_tokens={self.min_tokens} "
            f"include_stop_str_in_output={self.include_stop} {self.extra}",
        ]
        lines += [f"{k}={v!r}" for k, v in texts.items()]
        return "\n".join(lines)


def random_case(seed: int, tokenizer, vocab: Vocab, max_len: int = 40) -> Case:
    rng = random.Random(seed)
    ids = vocab.random_ids(rng, max_len)
    skip = rng.random() < 0.5
    stop = random_stops(rng, tokenizer.decode(ids, skip_special_tokens=skip))
    include = rng.random() < 0.5
    r = rng.random()
    if r < 0.4:
        min_tokens = 0
    elif r < 0.7 and stop:
        # Around the step that reveals the first occurrence: the boundary cases.
        plain = Oracle(tokenizer, ids, stop, skip)
        step = plain.stop_step if plain.stop_step is not None else len(ids)
        min_tokens = max(0, min(len(ids), step + rng.choice([-2, -1, -1, 0, 0, 1])))
    else:
        min_tokens = rng.randint(0, len(ids))
    return Case(seed, ids, stop, skip, min_tokens, include)


# --- the detokenizer driven as EngineCore.emit drives it --------------------------------------
def check_detokenizer(tokenizer, case: Case, rng: random.Random) -> None:
    oracle = Oracle(tokenizer, case.ids, case.stop, case.skip_special_tokens, case.min_tokens, case.include_stop)
    det = IncrementalDetokenizer(
        tokenizer, case.skip_special_tokens, case.stop, case.include_stop, case.min_tokens
    )
    # The last token arrives as the final one (max_tokens) or is followed by a flush (abort).
    last_finishes = rng.random() < 0.5
    pieces: list[str] = []
    emitted = 0
    stop_step = None

    def fail(msg: str) -> str:
        streamed = "".join(pieces)
        return f"{msg}\n" + case.describe(full=oracle.full, expected=oracle.text, streamed=streamed, pieces=pieces)

    for m, t in enumerate(case.ids, 1):
        stop = det.add([t])
        finished = stop is not None or (last_finishes and m == len(case.ids))
        if finished:
            det.flush()
        piece = det.delta(finished)
        pieces.append(piece)
        emitted += len(piece)
        if stop is not None:
            stop_step = m
            break
        if not finished:
            least, most = oracle.running_bounds(m)
            assert least <= emitted <= most, fail(f"after {m} tokens {emitted} characters out, not {least}..{most}")
    else:
        if not last_finishes:
            det.flush()
            pieces.append(det.delta(True))
        if det.stopped_by is not None:
            stop_step = len(case.ids) + 1
    streamed = "".join(pieces)
    assert streamed == oracle.text, fail("streamed text differs from the oracle's")
    assert (stop_step, det.stopped_by) == (oracle.stop_step, oracle.stop_str), fail(
        f"stopped at step {stop_step} by {det.stopped_by!r}, expected {oracle.stop_step} by {oracle.stop_str!r}"
    )
    offset = 0
    for piece in pieces:  # never a replacement character where the full decode has a real one
        for i, c in enumerate(piece):
            assert c != FFFD or oracle.full[offset + i] == FFFD, fail("U+FFFD streamed")
        offset += len(piece)
    if stop_step is not None:
        # Nothing more comes out once a stop string ended the text, whatever follows.
        more = [det.add([t]) for t in case.ids[:3]]
        assert all(s == oracle.stop_str for s in more), fail("a later add forgot the stop")
        det.flush()
        assert det.delta(False) == det.delta(True) == "", fail("text after the stop")


# --- the engine core, tokens forced, steps pipelined as AsyncEngine._run does -------------------
@dataclass
class EngineExpected:
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: object
    oracle: Oracle  # over every forced token, for the running bounds


def expect_engine(tokenizer, case: Case) -> EngineExpected:
    """What the core must stream for ``case.ids`` forced as its samples. A stop token
    (EOS unless ignored, or one of ``stop_token_ids``, past ``min_tokens``) stays in the
    token ids but adds no text unless ``include_stop_str_in_output`` (as in vLLM); ``max_tokens`` ends the text with the token it allows; an
    abort keeps the tokens update already took. A stop string makes the reason "stop"
    even when only the final flush reveals it, overriding a stop token's reason (as vLLM
    lets a stop string found in the step a stop token ends win); after an abort the
    reason stays "abort" but the text is still cut."""
    x = case.extra
    ids, min_tokens = case.ids, case.min_tokens
    whole = Oracle(tokenizer, ids, case.stop, case.skip_special_tokens, min_tokens, case.include_stop)
    reason, stop_reason = None, None
    for m, t in enumerate(ids, 1):
        if m > min_tokens and ((t == EOS and not x["ignore_eos"]) or t in x["stop_token_ids"]):
            # A stop token is not text, unless include_stop_str_in_output asks for it.
            token_ids, text_ids = ids[:m], ids[: m if case.include_stop else m - 1]
            reason, stop_reason = "stop", (None if t == EOS and not x["ignore_eos"] else t)
            if case.include_stop and whole.stop_step == m:  # its text completed a stop string
                stop_reason = whole.stop_str
            break
        length = m >= x["max_tokens"]
        if x["abort_at"] == (m, "before emit"):
            token_ids = text_ids = ids[:m]
            reason = "length" if length else "abort"
            if length and whole.stop_step == m:
                reason, stop_reason = "stop", whole.stop_str
            break
        if whole.stop_step == m:
            token_ids = text_ids = ids[:m]
            reason, stop_reason = "stop", whole.stop_str
            break
        if length or x["abort_at"] == (m, "after emit"):
            token_ids = text_ids = ids[:m]
            reason = "length" if length else "abort"
            break
    assert reason is not None, "max_tokens <= len(ids) ends every case"
    final = Oracle(tokenizer, text_ids, case.stop, case.skip_special_tokens, min_tokens, case.include_stop)
    if final.stop_step == len(text_ids) + 1 and reason != "abort":
        # A stop string that only the final flush reveals still ended the text.
        reason, stop_reason = "stop", final.stop_str
    return EngineExpected(token_ids, final.text, reason, stop_reason, whole)


def random_engine_case(seed: int, tokenizer, vocab: Vocab) -> Case:
    case = random_case(seed, tokenizer, vocab, max_len=24)
    rng = random.Random(seed ^ 0x5EED)
    n = len(case.ids)
    max_tokens = n if rng.random() < 0.6 else rng.randint(max(1, case.min_tokens), n)
    abort_at = None
    if rng.random() < 0.3:
        abort_at = (rng.randint(1, n), rng.choice(["before emit", "after emit"]))
    case.extra = dict(
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.4,
        stop_token_ids=[rng.choice(case.ids)] if rng.random() < 0.2 else [],
        abort_at=abort_at,
    )
    return case


def drive_core(tokenizer, ids: list[int], params: SamplingParams, abort_at=None, after_emit=None) -> RequestGroup:
    """Forces ``ids`` as the sampled tokens of one request, update/schedule/emit pipelined
    two steps deep as ``AsyncEngine._run`` does; ``abort_at=(k, "before emit" or "after
    emit")`` aborts it around the ``k``-th token's emit; ``after_emit(k, group)`` runs after each."""
    core = EngineCore(tokenizer, num_blocks=32, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=256, eos_token_ids=frozenset({EOS}))
    group = RequestGroup("r", None, PROMPT, params)
    core.add(group, params.max_tokens)
    inflight: deque = deque()
    fed = 0

    def launch() -> None:
        while len(inflight) < 2 and core.scheduler.has_work:
            out = core.schedule()
            if out.is_empty:
                return
            inflight.append(out)

    launch()
    while inflight:
        out = inflight.popleft()
        # A step planned behind a finished request samples a token that update drops.
        token = ids[fed] if fed < len(ids) else 0
        reqs = core.update(out, {seq.req_id: token for seq in out.seqs if seq.sample})
        if not reqs:
            launch()
            continue
        fed += 1
        if abort_at == (fed, "before emit"):
            core.abort("r")
        launch()
        core.emit(reqs)
        if abort_at == (fed, "after emit"):
            core.abort("r")
        if after_emit is not None:
            after_emit(fed, group)
    return group


def check_engine(tokenizer, case: Case) -> None:
    x = case.extra
    params = SamplingParams(
        max_tokens=x["max_tokens"], min_tokens=case.min_tokens, stop=case.stop or None,
        stop_token_ids=x["stop_token_ids"] or None, ignore_eos=x["ignore_eos"],
        include_stop_str_in_output=case.include_stop, skip_special_tokens=case.skip_special_tokens,
    )
    expected = expect_engine(tokenizer, case)

    def streamed(group) -> str:
        return "".join(c.text for c in group.queue)

    def fail(msg: str, group) -> str:
        chunks = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in group.queue]
        texts = dict(full=expected.oracle.full, expected=expected.text, streamed=streamed(group), chunks=chunks)
        return f"{msg}\n" + case.describe(**texts)

    def running(fed: int, group: RequestGroup) -> None:
        if not group.finished:
            least, most = expected.oracle.running_bounds(fed)
            out = len(streamed(group))
            assert least <= out <= most, fail(f"after {fed} tokens {out} characters out, not {least}..{most}", group)

    group = drive_core(tokenizer, case.ids, params, x["abort_at"], running)
    chunks = list(group.queue)
    assert group.finished and chunks, fail("the request did not finish", group)
    assert all(c.finish_reason is None and c.text for c in chunks[:-1]), fail("an empty or final chunk too early", group)
    last = chunks[-1]
    got = ([t for c in chunks for t in c.token_ids], streamed(group), last.finish_reason, last.stop_reason)
    want = (expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason)
    assert got == want, fail(f"got {got!r}\nwant {want!r}", group)
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids), fail("usage", group)


# --- tests ----------------------------------------------------------------------------------------
def run_cases(tokenizer, vocab, seeds, max_len: int, engine_every: int) -> None:
    for seed in seeds:
        case = random_case(seed, tokenizer, vocab, max_len)
        check_detokenizer(tokenizer, case, random.Random(seed))
        if seed % engine_every == 0:
            check_engine(tokenizer, random_engine_case(seed, tokenizer, vocab))


def test_random_streams_match_the_full_decode_oracle(tokenizer, vocab):
    """3000 token sequences through the detokenizer, half of them also through the core."""
    start = time.monotonic()
    run_cases(tokenizer, vocab, range(3000), max_len=40, engine_every=2)
    assert time.monotonic() - start < 60  # keeps the default suite quick (about 2 s here)


@pytest.mark.slow
def test_many_long_random_streams_match_the_full_decode_oracle(tokenizer, vocab):
    run_cases(tokenizer, vocab, range(100_000, 115_000), max_len=120, engine_every=2)


def test_the_generator_reaches_the_hard_cases(tokenizer, vocab):
    """The fuzz proves little unless its inputs split characters, carry special tokens and
    real U+FFFDs, and stop in every way; this counts that they do (in the default test's
    first 400 cases)."""
    seen = dict.fromkeys(["held token", "special", "fffd", "stop", "stop at flush", "min_tokens skipped one",
                          "straddling stop", "stop prefix of another", "include"], 0)
    for seed in range(400):
        case = random_case(seed, tokenizer, vocab)
        o = Oracle(tokenizer, case.ids, case.stop, case.skip_special_tokens, case.min_tokens, case.include_stop)
        decode = lambda x: tokenizer.decode(x, skip_special_tokens=case.skip_special_tokens)  # noqa: E731
        seen["held token"] += any(decode(case.ids[:m]).endswith(FFFD) for m in range(1, len(case.ids) + 1))
        seen["special"] += any(t in vocab.special for t in case.ids)
        seen["fffd"] += FFFD in o.full
        seen["stop"] += o.stop_str is not None
        seen["stop at flush"] += o.stop_step == len(case.ids) + 1
        seen["include"] += o.stop_str is not None and case.include_stop
        seen["stop prefix of another"] += any(a != b and b.startswith(a) for a in case.stop for b in case.stop)
        if case.min_tokens:
            eager = Oracle(tokenizer, case.ids, case.stop, case.skip_special_tokens)
            seen["min_tokens skipped one"] += eager.stop_str is not None and eager.stop_step <= case.min_tokens
        if o.stop_str is not None:
            end = len(o.text) + (0 if case.include_stop else len(o.stop_str))
            seen["straddling stop"] += end not in o.known  # ends inside a token's text
    assert min(seen.values()) >= 5, seen


# --- regressions the fuzz found ---------------------------------------------------------------------
def stream(tokenizer, ids, **kwargs) -> tuple[str, Optional[str]]:
    det = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = []
    for t in ids:
        stop = det.add([t])
        if stop is not None:
            det.flush()
        pieces.append(det.delta(stop is not None))
        if stop is not None:
            break
    det.flush()
    pieces.append(det.delta(True))
    return "".join(pieces), det.stopped_by


def test_min_tokens_ignores_a_shorter_stop_string_completed_inside_them(tokenizer):
    # The search for stop strings in new text reached back as far as the longest one
    # needed, so once past min_tokens it found a shorter one that had ended before.
    a, b = tokenizer.encode("a"), tokenizer.encode("b")
    assert stream(tokenizer, a + b, stop=["a", "xyz"], min_tokens=1) == ("ab", None)
    # "な" in two byte tokens: completed by the second, inside min_tokens=2.
    na = tokenizer.encode("な")
    assert len(na) == 2 and tokenizer.decode(na[:1]) == "\ufffd"
    assert stream(tokenizer, na + tokenizer.encode("2"), stop=["12", "な"], min_tokens=2) == ("な2", None)
    # One that starts inside min_tokens and ends after them still counts.
    assert stream(tokenizer, a + b, stop=["ab", "xyz"], min_tokens=1) == ("", "ab")


@pytest.mark.parametrize("tail, params", [
    ([], dict(max_tokens=2)),
    ([EOS], dict(max_tokens=8)),
    ([EOS], dict(max_tokens=8, stop_token_ids=[EOS], ignore_eos=True)),
], ids=["max_tokens", "eos", "stop_token_ids"])
def test_a_stop_string_only_the_final_flush_reveals_ends_the_completion_as_stop(tokenizer, tail, params):
    # The last text token is " " and the first three bytes of an emoji: its text waits
    # for a fourth byte that never comes, so only the flush at the end releases it.
    ids = tokenizer.encode("a") + [tokenizer.convert_tokens_to_ids("ĠðŁĺ")] + tail
    assert tokenizer.decode(ids[:2]) == "a \ufffd"
    for include, text in ((False, "a"), (True, "a ")):
        sampling = SamplingParams(stop=[" "], include_stop_str_in_output=include, **params)
        group = drive_core(tokenizer, ids, sampling)
        last = group.queue[-1]
        assert "".join(c.text for c in group.queue) == text
        assert [t for c in group.queue for t in c.token_ids] == ids
        # Before: "length", or the stop token as the reason, though the text was cut.
        assert (last.finish_reason, last.stop_reason) == ("stop", " ")
