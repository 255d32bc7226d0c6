"""What the engine hands back: stream chunks, whole results, usage and engine statistics."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

__all__ = [
    "BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "EmbeddingOutput", "EngineStats", "RequestMetrics",
    "RequestOutput", "StreamChunk", "TokenLogprob", "Usage",
]

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts with OpenAI's field names. ``cached_tokens``: of the prompt's tokens,
    those whose KV blocks came from the prefix cache (OpenAI's
    ``prompt_tokens_details.cached_tokens``, vLLM's ``num_cached_tokens``; None where not
    counted)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Optional[int] = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings of one completion, in seconds (``time.monotonic()`` for the instants).

    ``queue_time``: arrival to first scheduled; ``time_to_first_token``: arrival to the
    first generated token; ``time_per_output_token``: mean gap between later tokens.
    ``num_cached_tokens`` prompt tokens came from the prefix cache instead of being
    computed.
    """

    arrival_time: float
    finished_time: float
    queue_time: Optional[float]
    time_to_first_token: Optional[float]
    time_per_output_token: Optional[float]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    num_preemptions: int


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one generated token and, when asked for, of the ``k`` most
    likely tokens at its position (most likely first). Computed from the logits the
    sampler used after min_tokens' mask of the stop tokens (which then have no logprob:
    -inf), logit_bias and the penalties; before temperature, top-k/p/min-p and the masks
    of structured outputs, allowed_token_ids and bad_words."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    # As vLLM's Logprob.rank: 1 + the number of other tokens at least as likely (1: the most
    # likely; the token may rank below the top k it comes with).
    rank: Optional[int] = None


@dataclasses.dataclass(frozen=True, slots=True)
class StreamChunk:
    """One piece of a streamed completion.

    ``text`` is the new text since the previous chunk of the same ``index`` (it may be
    empty while a multi-byte character or a possible stop string is still incomplete);
    ``token_ids`` the tokens generated since then. The last chunk of a completion has
    ``finish_reason`` set ("stop", "length" or "abort"); for a "stop" ended by a stop
    string or stop token, ``stop_reason`` holds it. ``str(chunk)`` is ``chunk.text``.
    """

    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[FinishReason] = None
    stop_reason: Optional[str | int] = None
    usage: Optional[Usage] = None
    logprobs: Optional[tuple[TokenLogprob, ...]] = None  # one per token id, when asked for
    metrics: Optional[RequestMetrics] = None  # on the last chunk of each completion
    # With ``prompt_logprobs``: on the first chunk of index 0, one entry per prompt token
    # (None for the first, which nothing predicts).
    prompt_logprobs: Optional[tuple[Optional[TokenLogprob], ...]] = None

    def __str__(self) -> str:
        return self.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One finished completion of a request (there are ``n`` of them)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[FinishReason]
    stop_reason: Optional[str | int] = None
    logprobs: Optional[tuple[TokenLogprob, ...]] = None
    metrics: Optional[RequestMetrics] = None
    # Sum of the sampled tokens' logprobs (with ``logprobs`` or ``best_of``), else None.
    cumulative_logprob: Optional[float] = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """The whole result of ``engine.generate()``.

    ``text``, ``token_ids`` and ``finish_reason`` are those of the first completion, for
    the common ``n == 1`` case; ``outputs`` holds all ``n``, ordered by index.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    usage: Usage
    # With ``prompt_logprobs``: one entry per prompt token, None for the first.
    prompt_logprobs: Optional[tuple[Optional[TokenLogprob], ...]] = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> Optional[RequestMetrics]:
        return self.outputs[0].metrics

    def __str__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearchSequence:
    """One sequence of a beam search, best first by ``score``: its generated tokens (the
    end-of-sequence token included when it ended with one, finish reason "stop"; else
    "length"), their text (special tokens skipped), each token's logprob, their sum, and
    ``cumulative_logprob / len(token_ids) ** length_penalty``."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """The result of ``engine.beam_search()``: ``beam_width`` sequences, best first;
    ``text`` and ``token_ids`` are the best one's. ``usage`` counts the prompt once and
    the returned sequences' tokens."""

    prompt: Optional[str]
    prompt_token_ids: tuple[int, ...]
    sequences: tuple[BeamSearchSequence, ...]
    usage: Usage

    @property
    def text(self) -> str:
        return self.sequences[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.sequences[0].token_ids

    def __str__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """The result of ``engine.embed()``: the model's final hidden state (after its last
    norm) at the prompt's last token, as floats; L2-normalised unless asked otherwise,
    cut to its first ``dimensions`` values before that where asked. ``usage`` counts the
    prompt's tokens."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: tuple[int, ...]
    embedding: tuple[float, ...]
    usage: Usage


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load, for dashboards and load balancers."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_preemptions: int
    num_steps: int
    num_finished_requests: int
    num_prompt_tokens: int  # once per sequence: n times, or best_of times when larger
    num_generation_tokens: int
    kv_cache_usage: float
    num_cached_blocks: int
    prefix_cache_hit_rate: float
    generation_tokens_per_s: float  # over the last 10 seconds
    gpu_memory_allocated_bytes: Optional[int] = None
    gpu_memory_total_bytes: Optional[int] = None
    gpu_utilization: Optional[float] = None  # percent, where NVML is available

    @property
    def num_preempted(self) -> int:
        return self.num_preemptions
