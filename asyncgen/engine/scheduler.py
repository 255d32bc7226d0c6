"""Continuous batching: which tokens of which requests the next model step computes.

Plain Python (no torch, no async). :meth:`Scheduler.schedule` returns a
:class:`SchedulerOutput`, the only thing the model runner sees; :meth:`Scheduler.update`
takes the sampled tokens back.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from typing import Iterable, Optional

from ..sampling_params import SamplingParams
from .block_manager import BlockManager
from .request import PLACEHOLDER, Request, RequestStatus

__all__ = ["NewRequestData", "ScheduledSeq", "Scheduler", "SchedulerOutput"]


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute ``token_ids`` at positions
    ``start_pos .. start_pos + len(token_ids) - 1``, writing their KV into ``block_ids``."""

    req_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool  # the step reaches the sequence's last known token: sample the next one
    # The admission of the request this step belongs to, unique within the scheduler: a
    # step planned before its request was preempted, or for an earlier request with the
    # same id (aborted, then the id reused while the step ran), is stale, and update skips it.
    epoch: int = 0
    prompt_logprobs: bool = False  # report the logprob of each prompt token this chunk predicts


@dataclasses.dataclass(frozen=True, slots=True)
class NewRequestData:
    """What the runner keeps about a sequence for its lifetime (sampling state)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: Optional[int]
    stop_token_ids: frozenset[int]  # masked while fewer than min_tokens were generated
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # bad_words as token sequences
    pooling: bool = False  # return the final hidden state at the prompt's last token


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The contract between scheduler and model runner, one per step.

    ``seqs`` are in batch order; ``new_requests`` are seen by the runner for the first
    time this step; ``finished_req_ids`` ended since the last step (the runner drops
    their state).
    """

    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestData]
    finished_req_ids: list[str]
    num_batched_tokens: int
    preempted_req_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def _priority_key(req: Request) -> tuple[int, int]:
    return req.priority, req.arrival_order


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 policy: str = "fcfs"):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.by_priority = policy == "priority"
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._unseen: dict[str, NewRequestData] = {}  # added, not yet sent to the runner
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self._num_admissions = 0
        self._num_added = 0

    # --- admission and removal --------------------------------------------------------------
    def add(self, req: Request, seed: Optional[int] = None) -> None:
        if req.request_id in self.requests:
            raise KeyError(f"duplicate sequence id {req.request_id!r}")
        self.requests[req.request_id] = req
        req.arrival_order = self._num_added
        self._num_added += 1
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.append(req)
        stop_ids = frozenset(req.params.stop_token_ids or ()) | (frozenset() if req.params.ignore_eos else req.eos_token_ids)
        self._unseen[req.request_id] = NewRequestData(req.request_id, req.prompt_token_ids, req.params, seed, stop_ids,
                                                      req.bad_word_ids, req.pooling)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Ends ``req`` now: it leaves the queues and its blocks return to the pool."""
        if req.status.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.drop_placeholders()
        self.block_manager.free(req.request_id)
        del self.requests[req.request_id]
        if self._unseen.pop(req.request_id, None) is None:  # the runner knows it: tell it to forget
            self._finished_ids.append(req.request_id)

    def _insert_waiting(self, req: Request) -> None:
        """Into the waiting queue in (priority, arrival) order."""
        bisect.insort(self.waiting, req, key=_priority_key)

    def abort(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None:
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Picks the next step's tokens.

        Invariant: every request has ``num_computed_tokens <= num_tokens``; a request is
        given the next ``num_tokens - num_computed_tokens`` tokens (a decode is the case
        where that is 1), cut to the token budget, which is how long prompts are chunked.
        Scheduling advances ``num_computed_tokens`` at once and, for a sequence that
        samples, appends a :data:`PLACEHOLDER`, so the next step can be planned while
        this one runs; a sequence whose pending token will end it by length is left out.
        Running requests go first, in admission order; when the pool cannot hold a
        running request's next tokens, the most recently admitted running request is
        preempted (blocks freed, recomputed later) until it can. Waiting requests are
        admitted in arrival order while the budget, ``max_num_seqs`` and the pool allow,
        and not at all in a step that had to preempt. Under the priority policy "admission
        order" and "arrival order" are (priority, arrival) order: the running requests are
        taken by it, the last of them (the lowest priority) is the one preempted, and the
        waiting queue is kept in it.
        """
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []
        if self.by_priority:
            self.running.sort(key=_priority_key)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.has_placeholder and (
                req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len
            ):
                i += 1  # its pending token is its last: update() will finish it
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            end = req.num_computed_tokens + n
            while not bm.can_allocate(req.request_id, end):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            seqs.append(self._take(req, n))
            budget -= n
            i += 1

        if not preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                leader = req.prefix_leader
                if leader is not None and leader.status is RequestStatus.RUNNING and not leader.prompt_done:
                    # A sample of an n > 1 request waits until the first sample's prompt is
                    # in the cache, then shares its blocks instead of recomputing them.
                    skipped.append(self.waiting.popleft())
                    continue
                cached: list[int] = []
                if req.num_computed_tokens == 0 and not req.wants_prompt_logprobs:
                    # (Prompt logprobs need every prompt position computed, cached or not.)
                    cached = bm.match_prefix(req.token_ids)
                start = len(cached) * bm.block_size if cached else req.num_computed_tokens
                n = min(req.num_tokens - start, budget)
                if not bm.can_allocate(req.request_id, start + n, cached):
                    break
                self.waiting.popleft()
                if req.num_computed_tokens == 0:
                    bm.record_query(req.num_tokens, len(cached) * bm.block_size)
                    req.num_cached_tokens = len(cached) * bm.block_size
                req.num_computed_tokens = req.num_confirmed_tokens = start
                req.status = RequestStatus.RUNNING
                req.epoch = self._num_admissions
                self._num_admissions += 1
                self.running.append(req)
                seqs.append(self._take(req, n, cached))
                budget -= n
            self.waiting.extendleft(reversed(skipped))

        if not seqs:  # nothing runs: the runner will not see this output; keep its news
            return SchedulerOutput([], [], [], 0, preempted)
        new_requests, self._unseen = list(self._unseen.values()), {}
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(seqs, new_requests, finished, self.max_num_batched_tokens - budget, preempted)

    def _take(self, req: Request, n: int, cached: list[int] = ()) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + n
        table = self.block_manager.allocate(req.request_id, end, cached)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        sample = end == req.num_tokens
        seq = ScheduledSeq(
            req.request_id, req.token_ids[start:end], start, list(table), sample, req.epoch,
            req.wants_prompt_logprobs and start < req.num_prompt_tokens - 1,
        )
        req.num_computed_tokens = end
        if sample:
            req.token_ids.append(PLACEHOLDER)
        return seq

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.request_id)
        req.drop_placeholders()  # the step sampling it is discarded: the token is recomputed
        req.num_computed_tokens = req.num_confirmed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._insert_waiting(req)
        else:
            self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Confirms the tokens a finished step computed and writes its sampled tokens
        over their placeholders. Returns the requests that received a token (finished
        ones included, with their status set). Sequences finished or preempted since the
        step was scheduled are skipped: their blocks and state are already gone or reset,
        and a preempted sequence recomputes (and resamples) what it lost."""
        got: list[Request] = []
        for seq in out.seqs:
            req = self.running_request(seq)
            if req is None:
                continue
            end = seq.start_pos + len(seq.token_ids)
            if end > req.num_confirmed_tokens:
                req.num_confirmed_tokens = end
            self.block_manager.cache_full_blocks(req.request_id, req.token_ids, end)
            token = sampled.get(seq.req_id) if seq.sample else None
            if token is None:
                continue
            req.token_ids[end] = token  # over its placeholder
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            got.append(req)
            status = self._check_stop(req, token, end + 1 - req.num_prompt_tokens)
            if status is not None:
                self.finish(req, status)
        return got

    def running_request(self, seq: ScheduledSeq) -> Optional[Request]:
        """The request ``seq`` was scheduled for, if it still runs in the admission that
        step belongs to (None: finished, preempted, or its id now names another request)."""
        req = self.requests.get(seq.req_id)
        if req is None or req.status is not RequestStatus.RUNNING or req.epoch != seq.epoch:
            return None
        return req

    def _check_stop(self, req: Request, token: int, num_output: int) -> Optional[RequestStatus]:
        """Whether ``token``, the ``num_output``-th output token of ``req``, ends it."""
        p = req.params
        # The sampler masks stop tokens until min_tokens were generated.
        if num_output > p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or req.num_prompt_tokens + num_output >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def iter_requests(self) -> Iterable[Request]:
        return self.requests.values()

