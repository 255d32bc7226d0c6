"""The synchronous heart of the engine: requests in, stream chunks out.

``EngineCore`` holds the scheduler, the detokenizers and one :class:`RequestGroup` per
user request (its ``n`` sequences and its chunk queue). It never awaits and never touches
the device: the async engine calls ``schedule()``, runs the step on the device thread,
then ``process()`` with the sampled tokens. Every method runs on the event-loop thread,
so each is atomic with respect to the tasks that consume streams.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Optional

from ..errors import DuplicateRequestError
from ..outputs import EngineStats, RequestMetrics, StreamChunk, Usage
from ..sampling_params import SamplingParams
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput

__all__ = ["EngineCore", "RequestGroup"]

log = logging.getLogger("asyncgen")


def _end_at_stop_string(req: Request, stop: Optional[str], over=(RequestStatus.FINISHED_LENGTH,)) -> None:
    """A request that finished as one of ``over`` and whose text a stop string then cut
    ends as "stop" with that string."""
    if stop is not None and req.status in over:
        req.status = RequestStatus.FINISHED_STOPPED
        req.stop_reason = stop


# A stop string found in the text of a sequence's last token ends it as "stop" with that
# string, whether the token ended it by the length limit or as a stop token.
_STRING_OVER = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample ``index`` of a request seeded with ``seed`` (a signed
    64-bit integer): an unsigned 64-bit value, distinct for distinct seeds at one index."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


class _Seq:
    __slots__ = ("req", "detok", "pending_ids", "pending_logprobs", "undecoded", "done")

    def __init__(self, req: Request, detok: IncrementalDetokenizer):
        self.req = req
        self.detok = detok
        self.pending_ids: list[int] = []  # generated but not yet sent in a chunk
        self.pending_logprobs: list = []
        self.undecoded = 0  # the last of pending_ids that update added and emit has not decoded
        self.done = False


class RequestGroup:
    """A user request: ``n`` sequences sharing a prompt, and the queue its stream reads.

    ``queue`` holds StreamChunks and, when the engine dies, the exception to raise.
    ``notify`` is called whenever something was queued (the stream's wake-up).
    """

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs: dict[str, _Seq] = {}
        self.queue: deque = deque()
        self.notify: Callable[[], None] = lambda: None
        # generate() reads only the whole result: its task is woken once, at the end,
        # instead of once per token (hundreds of task switches per step saved at scale).
        self.wake_each_chunk = True
        self.num_unfinished = params.num_sequences
        self.num_completion_tokens = 0
        # With prompt_logprobs: one slot per prompt token (the first stays None), filled
        # as chunks are computed, sent once on index 0's first chunk.
        self.prompt_logprobs: Optional[list] = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = False
        self.arrival_time = time.monotonic()
        self.bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
        self.priority = 0  # (the "priority" scheduling policy's)
        # An embedding request (AsyncEngine.embed): the final hidden state at the prompt's
        # last token, fp32 on the host, once its prompt step is collected.
        self.pooling = False
        self.embedding = None

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class EngineCore:
    def __init__(
        self,
        tokenizer,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
    ):
        self.tokenizer = tokenizer
        # Called with the last chunk of every completion (AsyncEngine.add_finish_listener).
        self.finish_listeners: list[Callable[[StreamChunk], object]] = []
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                                   scheduling_policy)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.groups: dict[str, RequestGroup] = {}
        self._group_of: dict[str, RequestGroup] = {}  # sequence id -> its group
        self.num_steps = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self.num_finished = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # --- requests ---------------------------------------------------------------------------
    def check_request_id(self, request_id: str, count: int) -> None:
        """Raises DuplicateRequestError if a request with this id and ``count`` sequences
        would share an id with a live request or one of its sequences."""
        if request_id in self.groups:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in use")
        for seq_id in seq_ids(request_id, count):
            other = self._group_of.get(seq_id)
            if other is not None:
                raise DuplicateRequestError(
                    f"request_id {request_id!r} clashes with live request {other.request_id!r}: the sequence id "
                    f"{seq_id!r} is taken (the samples of a request with n > 1 are '<request_id>#<i>')"
                )

    def add(self, group: RequestGroup, max_tokens: int) -> None:
        """Registers every sequence of ``group`` with the scheduler (atomic)."""
        p = group.params
        count = p.num_sequences
        self.check_request_id(group.request_id, count)
        if count > p.n and p.logprobs is None:
            # best_of ranks the samples by cumulative logprob: each sequence reports its
            # sampled tokens' logprobs (the output keeps them only if they were asked for).
            p = p.model_copy(update={"logprobs": 0})
        leader = None
        for i, seq_id in enumerate(seq_ids(group.request_id, count)):
            seed = None if p.seed is None else sample_seed(p.seed, i)
            req = Request(seq_id, group.prompt_token_ids, p, self.eos_token_ids, max_tokens, index=i)
            req.bad_word_ids = group.bad_word_ids
            req.priority = group.priority
            req.pooling = group.pooling
            if self.block_manager.enable_prefix_caching:
                req.prefix_leader = leader
                leader = leader or req
            detok = IncrementalDetokenizer(
                self.tokenizer, p.skip_special_tokens, p.stop_strings, p.include_stop_str_in_output, p.min_tokens,
                group.prompt_token_ids,
            )
            group.seqs[seq_id] = _Seq(req, detok)
            self._group_of[seq_id] = group
            self.scheduler.add(req, seed)
        self.groups[group.request_id] = group
        group.arrival_time = time.monotonic()
        for seq in group.seqs.values():
            seq.req.arrival_time = group.arrival_time
        self.num_prompt_tokens += len(group.prompt_token_ids) * count

    def abort(self, request_id: str) -> bool:
        """Ends every sequence of the request now and frees its blocks; its stream gets a
        final chunk with finish_reason "abort" (if it is still reading)."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        for seq_id, seq in group.seqs.items():
            if not seq.done:
                self.scheduler.abort(seq_id)
                self._catch_up(group, seq)
                self._flush(seq)
                self._emit(group, seq, finished=True)
        return True

    def _catch_up(self, group: RequestGroup, seq: _Seq) -> None:
        """Decodes what emit would have for tokens update gave ``seq`` just before an
        abort, so that the final chunk's text and usage cover all its token ids."""
        n, seq.undecoded = seq.undecoded, 0
        if not n:
            return
        group.num_completion_tokens += n
        req = seq.req
        ids = seq.pending_ids[-n:]
        if req.status is RequestStatus.FINISHED_STOPPED and not seq.detok.include_stop:
            ids = ids[:-1]  # a stop token is kept in token_ids, not in text
        _end_at_stop_string(req, seq.detok.add(ids) if ids else None, _STRING_OVER)  # as emit does

    @staticmethod
    def _flush(seq: _Seq) -> None:
        """Releases the text a finished sequence held back for a partial character. A stop
        string completed only by that text ends the completion as "stop" too, as one
        completed by its last token would (the stop string overrides a stop token's
        reason, as it does in vLLM: the text was cut at it)."""
        _end_at_stop_string(seq.req, seq.detok.flush(), _STRING_OVER)

    def fail_all(self, error: BaseException) -> None:
        """Ends every request with ``error`` (the engine died)."""
        for group in list(self.groups.values()):
            group.queue.append(error)
            for seq_id, seq in group.seqs.items():
                if not seq.done:
                    self.scheduler.abort(seq_id)
                    seq.done = True
            self._forget(group)
            group.notify()

    # --- steps ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def process(
        self, out: SchedulerOutput, sampled: dict[str, int], logprobs: Optional[dict] = None,
        prompt_logprobs: Optional[dict] = None, pooled: Optional[dict] = None,
    ) -> None:
        """``update`` then ``emit``: a whole step's results applied at once."""
        self.emit(self.update(out, sampled, logprobs, prompt_logprobs, pooled))

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], logprobs: Optional[dict] = None,
        prompt_logprobs: Optional[dict] = None, pooled: Optional[dict] = None,
    ) -> list[Request]:
        """The part of applying a step that the next ``schedule()`` depends on: counters,
        appended tokens, stop tokens and length limits. Returns the requests that got a
        token, for ``emit``."""
        self.num_steps += 1
        now = time.monotonic()
        self._recent.append((now, len(sampled)))
        while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
            self._recent.popleft()
        if prompt_logprobs:
            for seq in out.seqs:
                items = prompt_logprobs.get(seq.req_id)
                # A stale step's (see ScheduledSeq.epoch) may be of another prompt under the same id.
                if items is None or self.scheduler.running_request(seq) is None:
                    continue
                group = self._group_of[seq.req_id]
                if group.prompt_logprobs is not None:
                    for pos, lp in items:
                        group.prompt_logprobs[pos] = lp
        reqs = self.scheduler.update(out, sampled)
        for req in reqs:
            seq = self._group_of[req.request_id].seqs[req.request_id]
            seq.pending_ids.append(sampled[req.request_id])
            seq.undecoded += 1
            if logprobs and req.request_id in logprobs:
                seq.pending_logprobs.append(logprobs[req.request_id])
        self.num_generation_tokens += len(reqs)
        if pooled:  # embedding requests: their vector; their one token is not output, nor counted
            for req in reqs:
                if req.request_id in pooled:
                    self._group_of[req.request_id].embedding = pooled[req.request_id]
                    self.num_generation_tokens -= 1
        return reqs

    def emit(self, reqs: list[Request]) -> None:
        """The rest, which may overlap the next step on the device: text, stop strings,
        stream chunks. A stop string found here ends its request; the token the next step
        computes for it is then discarded by ``update``."""
        touched: list[RequestGroup] = []
        for req in reqs:
            group = self._group_of.get(req.request_id)
            if group is None:
                continue
            seq = group.seqs[req.request_id]
            # Aborted since update (the host's tasks run between emit's slices), its id
            # perhaps taken by a new request already: its token goes nowhere.
            if seq.done or seq.req is not req:
                continue
            seq.undecoded -= 1
            group.num_completion_tokens += 1
            finished = req.status.finished
            # A token that ended the sequence as a stop token (EOS, stop_token_ids) is kept in
            # token_ids; its text joins the output only with include_stop_str_in_output, as in
            # vLLM (and is empty for a special token unless skip_special_tokens=False).
            is_stop_token = finished and req.status is RequestStatus.FINISHED_STOPPED
            if not is_stop_token or seq.detok.include_stop:
                stop = seq.detok.add([seq.pending_ids[-1]])
                if stop is not None and not finished:
                    req.stop_reason = stop
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                    finished = True
                elif stop is not None:  # completed by the last token: the text ends there
                    _end_at_stop_string(req, stop, _STRING_OVER)
            if finished:
                self._flush(seq)
            self._emit(group, seq, finished, notify=False)
            if group.wake_each_chunk or group.finished:
                touched.append(group)
        for group in touched:
            group.notify()

    def _emit(self, group: RequestGroup, seq: _Seq, finished: bool, notify: bool = True) -> None:
        text = seq.detok.delta(finished)
        if not text and not finished:
            return
        reason = None
        usage = None
        metrics = None
        if finished:
            seq.done = True
            status = seq.req.status
            reason = status.value if status.finished else "abort"
            group.num_unfinished -= 1
            metrics = _metrics(seq.req)
            if group.finished:
                # The prompt's cached tokens: those of its first sample, which the others
                # follow into the cache.
                first = next(iter(group.seqs.values())).req
                usage = Usage(len(group.prompt_token_ids), group.num_completion_tokens, first.num_cached_tokens)
                self._forget(group)
        prompt_lps = None
        if group.prompt_logprobs is not None and not group.prompt_logprobs_sent and seq.req.index == 0:
            if all(lp is not None for lp in group.prompt_logprobs[1:]):  # else aborted before they were done
                prompt_lps = tuple(group.prompt_logprobs)
                group.prompt_logprobs_sent = True
        chunk = StreamChunk(
            group.request_id, seq.req.index, text, tuple(seq.pending_ids), reason,
            seq.req.stop_reason if reason == "stop" else None, usage,
            tuple(seq.pending_logprobs) if seq.req.params.logprobs is not None else None,
            metrics, prompt_lps,
        )
        seq.pending_ids = []
        seq.pending_logprobs = []
        group.queue.append(chunk)
        if finished:
            for listener in tuple(self.finish_listeners):
                try:
                    listener(chunk)
                except Exception:  # a host's callback must not stop the engine or the request
                    log.exception("finish listener %r failed on request %r", listener, group.request_id)
        if notify:
            group.notify()

    def _forget(self, group: RequestGroup) -> None:
        if self.groups.pop(group.request_id, None) is not None:
            self.num_finished += 1
        for seq_id in group.seqs:
            self._group_of.pop(seq_id, None)

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        now = time.monotonic()
        recent = [(t, n) for t, n in tuple(self._recent) if now - t <= _RATE_WINDOW_S]
        rate = sum(n for _, n in recent) / (now - recent[0][0]) if len(recent) > 1 and now > recent[0][0] else 0.0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            block_size=bm.block_size,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_finished_requests=self.num_finished,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            kv_cache_usage=1.0 - bm.num_free_blocks / bm.num_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_hit_rate=bm.hit_rate,
            generation_tokens_per_s=rate,
            **_gpu_stats(),
        )


_RATE_WINDOW_S = 10.0


def seq_ids(request_id: str, count: int) -> list[str]:
    """The sequence ids of a request's ``count`` samples."""
    return [request_id] if count == 1 else [f"{request_id}#{i}" for i in range(count)]


def _metrics(req) -> RequestMetrics:
    now = time.monotonic()
    n = 0 if req.pooling else req.num_output_tokens  # (an embedding's one token is not output)
    first = req.first_token_time
    return RequestMetrics(
        arrival_time=req.arrival_time,
        finished_time=now,
        queue_time=None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
        time_to_first_token=None if first is None else first - req.arrival_time,
        time_per_output_token=(now - first) / (n - 1) if first is not None and n > 1 else None,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_generation_tokens=n,
        num_preemptions=req.num_preemptions,
    )


def _gpu_stats() -> dict:
    """Memory (and utilisation where NVML answers) of the current CUDA device, if any.

    Reads counters only; it launches no GPU work, so it is safe on the loop thread."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out = {
        "gpu_memory_allocated_bytes": torch.cuda.memory_allocated(),
        "gpu_memory_total_bytes": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
    }
    try:
        out["gpu_utilization"] = float(torch.cuda.utilization())
    except Exception:  # NVML missing or not permitted: leave the field unset (None)
        pass
    return out
