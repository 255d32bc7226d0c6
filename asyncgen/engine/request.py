"""One sequence being generated, as the scheduler sees it: token counters, not phases."""

from __future__ import annotations

import enum
import time
from typing import Optional

from ..sampling_params import SamplingParams

__all__ = ["PLACEHOLDER", "Request", "RequestStatus"]

# Stands in ``token_ids`` for a token that a step on the device is still sampling: the
# scheduler may plan the next step before the current one's tokens reach the host (the
# model runner feeds the device-side sample in its place); ``Scheduler.update`` writes
# the real token over it.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    """A single sequence (one of the ``n`` samples of a user request).

    ``token_ids`` is the prompt followed by every generated token; the last one may be
    :data:`PLACEHOLDER` while the step sampling it runs. ``num_computed_tokens`` counts
    the tokens scheduled into the KV cache (steps planned, maybe still running) and
    ``num_confirmed_tokens`` those whose step has finished. A step computes the tokens
    after ``num_computed_tokens`` and, when it reaches ``num_tokens``, samples one more.
    Preemption resets both counters to 0: the tokens stay and are recomputed.
    ``epoch`` tells the steps of one admission from any other's (see ``ScheduledSeq.epoch``).
    """

    __slots__ = (
        "request_id", "index", "params", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_confirmed_tokens",
        "status", "stop_reason", "eos_token_ids", "max_tokens", "arrival_time", "num_preemptions",
        "num_cached_tokens", "prefix_leader", "first_scheduled_time", "first_token_time", "epoch", "bad_word_ids",
        "priority", "arrival_order", "pooling",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        index: int = 0,
    ):
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_confirmed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[str | int] = None
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic()
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.prefix_leader: Optional["Request"] = None  # the n > 1 sample whose prompt blocks to share
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.epoch = -1  # set by the scheduler at each admission
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
        self.priority = 0  # lower is served first under the "priority" policy
        self.arrival_order = 0  # set by the scheduler when added: ties of priority go by it
        self.pooling = False  # an embedding request: its prompt's last hidden state is returned

    @property
    def prompt_done(self) -> bool:
        """The prompt's KV is in the cache (its last step finished)."""
        return self.num_confirmed_tokens >= self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The first sample of a request with ``prompt_logprobs`` reports them."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def has_placeholder(self) -> bool:
        return bool(self.token_ids) and self.token_ids[-1] == PLACEHOLDER

    def drop_placeholders(self) -> None:
        while self.token_ids and self.token_ids[-1] == PLACEHOLDER:
            self.token_ids.pop()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, prompt={self.num_prompt_tokens})"
        )
