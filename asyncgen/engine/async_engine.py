"""``AsyncEngine``: the public face of the engine, living in the host's event loop.

Lifecycle (one way through, each state says what is allowed)::

    NEW --start()/__aenter__--> STARTING --> RUNNING --aclose()/__aexit__--> CLOSED
                                   \\                \\-- a step raised --> DEAD --aclose()--> CLOSED
                                    \\-- loading failed --> CLOSED

The background loop is a task of the host's loop (an asyncio task, or a trio system
task), started by ``start()``. Each iteration schedules on the loop thread, runs the
model step on the device thread, and routes the results to the request streams.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import threading
import uuid
import weakref
import warnings
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

import anyio

from ..config import EngineConfig
from ..errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineStateError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
)
from ..outputs import (
    BeamSearchOutput, CompletionOutput, EmbeddingOutput, EngineStats, RequestOutput, StreamChunk, Usage,
)
from ..sampling_params import BeamSearchParams, SamplingParams
from ..structured import unicode_problem
from . import heap
from .core import EngineCore, RequestGroup, seq_ids
from .device_thread import DeviceThread, current_async_library, running_loop, threadsafe_caller

__all__ = ["AsyncEngine", "RequestStream"]

log = logging.getLogger("asyncgen")

Prompt = Union[str, Sequence[int]]
# Up to this many sequences with a token, a step's chunks are emitted before the next
# launch (while one more step is in flight); more wait until after it.
_EMIT_FIRST_MAX = 8
_EMIT_SLICE = 64  # requests per slice of a step's output handed to streams between yields
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class _State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    DEAD = "dead"
    CLOSED = "closed"


class AsyncEngine:
    """Continuous-batching generation inside the caller's event loop (asyncio or trio).

    Create it with :meth:`from_pretrained`, then either ``async with engine:`` or
    ``await engine.start()`` ... ``await engine.aclose()``.
    """

    def __init__(self, model: str | Path, config: EngineConfig):
        self._model = model
        self.config = config
        self._state = _State.NEW
        self._core: Optional[EngineCore] = None
        self._runner = None
        self._tokenizer = None
        self._device: Optional[DeviceThread] = None
        self._loop_thread: Optional[int] = None
        self._loop: Any = None  # the event loop the engine runs in (running_loop())
        self._start_done: Optional[anyio.Event] = None  # set when start() has loaded or failed
        self._closing: Optional[anyio.Event] = None  # set when aclose() has released everything
        self._call_soon = None
        self._wakeup: Optional[anyio.Event] = None
        self._stopped: Optional[anyio.Event] = None
        # Aborts handed to the loop (by a stream collected from another thread, or in the
        # middle of the engine's own work): each request's group, aborted if still live.
        self._pending_aborts: deque[RequestGroup] = deque()
        # Streams opened with a request_id of the caller's, until their first __anext__
        # submits them: their ids are taken from the stream() call on.
        self._unsent: "weakref.WeakValueDictionary[str, RequestStream]" = weakref.WeakValueDictionary()
        self._finish_listeners: list[Callable[[StreamChunk], Any]] = []
        self._dead_error: Optional[EngineDeadError] = None
        self._task = None
        self._heap_frozen = False  # this engine holds a heap.freeze() (freeze_gc)
        self.model_name = str(model)
        self.max_model_len = 0
        self._max_seq_tokens = 0  # the longest sequence: max_model_len, or what the KV pool holds
        self.vocab_size = 0
        self._tokenizer_overflows = False  # the tokenizer has ids past the model's vocabulary
        self._max_token_chars = 1  # the longest token's text, in characters (at most)
        self.hidden_size = 0  # the model's, once loaded: the length of embed()'s vectors
        self._pooling_mode: Optional[str] = None  # what the model's sentence-transformers config declares

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_kv_blocks: Optional[int] = None,
        kv_cache_memory: Optional[int] = None,
        **kwargs: Any,
    ) -> "AsyncEngine":
        """An engine for a Hugging Face model directory (or hub id), not yet started.

        Checks the arguments and, for a local directory, its ``config.json`` right away
        (cheap); the weights are loaded by ``start()`` on the device thread. Other
        keyword arguments are :class:`~asyncgen.config.EngineConfig` fields
        (``gpu_memory_utilization``, ``ops_backend``, ``enforce_eager``, ``freeze_gc``).
        """
        config = EngineConfig(
            dtype=dtype, device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory, **kwargs,
        )
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a directory path or a hub id, not {type(model).__name__}")
        if not str(model).strip():
            raise ModelNotFoundError("model is an empty string; pass the model's directory")
        from ..worker.model_runner import check_backend, resolve_device

        # Raise here, not at start(): device="cuda" without a GPU, a backend the device cannot run.
        check_backend(config.ops_backend, resolve_device(config.device))
        path = Path(model).expanduser()
        if path.is_dir():
            from ..model.config import ModelConfig

            _check_model_len(config, ModelConfig.from_dir(path))  # a missing or unsupported config, early
        elif path.exists():
            raise ModelNotFoundError(f"{model} is a file; pass the model's directory")
        elif not _HUB_ID.match(str(model)):
            raise ModelNotFoundError(f"model directory {model} does not exist")
        return cls(model, config)

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Loads the model (on the device thread) and starts the background loop."""
        if self._state is not _State.NEW:
            raise EngineStateError(f"start() on an engine that is {self._state.value}; an engine starts once")
        self._state = _State.STARTING
        self._start_done = anyio.Event()
        self._device = DeviceThread()
        try:
            await self._device.run(self._load)
        except BaseException:
            self._state = _State.CLOSED
            self._device.stop()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._device.join)
            raise
        finally:
            self._start_done.set()
        self._loop_thread = threading.get_ident()
        self._loop = running_loop()
        self._call_soon = threadsafe_caller()
        self._wakeup = anyio.Event()
        self._stopped = anyio.Event()
        self._state = _State.RUNNING
        lib = current_async_library()
        if lib == "asyncio":
            import asyncio

            self._task = asyncio.get_running_loop().create_task(self._run(), name="asyncgen-engine")
        else:
            import trio

            trio.lowlevel.spawn_system_task(self._run, name="asyncgen-engine")

    def _load(self) -> None:
        """Device thread: resolve the path, tokenizer, model, KV pool."""
        from ..model.config import ModelConfig
        from ..worker.model_runner import ModelRunner
        from .tokenizer import TokenBytes, load_tokenizer, resolve_model_path

        path = resolve_model_path(self._model)
        model_cfg = ModelConfig.from_dir(path)
        _check_model_len(self.config, model_cfg)
        max_len = self.config.max_model_len or model_cfg.max_position_embeddings
        tokenizer, eos_ids = load_tokenizer(path, self.config.trust_remote_code)
        linear_method = None
        if model_cfg.quantization is not None:
            from ..model.quantization import linear_method_factory

            linear_method = linear_method_factory(model_cfg)
        runner = ModelRunner(path, model_cfg, self.config, max_len, linear_method)
        runner.token_bytes = lambda: TokenBytes(tokenizer).vocabulary()
        num_blocks = runner.load()
        self._runner = runner
        self._tokenizer = tokenizer
        self.max_model_len = max_len
        self._max_seq_tokens = min(max_len, num_blocks * self.config.block_size)
        if self._max_seq_tokens < max_len:
            log.warning(
                "the KV pool holds %d tokens (%d blocks), fewer than max_model_len=%d: requests without max_tokens "
                "generate up to %d tokens in all; give the engine more KV memory to allow more",
                num_blocks * self.config.block_size, num_blocks, max_len, self._max_seq_tokens,
            )
        self.vocab_size = model_cfg.vocab_size
        self._tokenizer_overflows = len(tokenizer) > model_cfg.vocab_size
        # in the tokenizer's own spelling, never shorter than the text a token stands for
        self._max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        if self._tokenizer_overflows:
            log.warning(
                "the tokenizer has %d tokens, the model's vocabulary %d: prompts whose text encodes to the "
                "tokenizer's last %d ids are refused", len(tokenizer), model_cfg.vocab_size,
                len(tokenizer) - model_cfg.vocab_size,
            )
        self.hidden_size = model_cfg.hidden_size
        self._pooling_mode = _declared_pooling(path)
        self.model_name = _display_name(self._model, path)
        self._core = EngineCore(
            tokenizer, num_blocks, self.config.block_size, self.config.max_num_seqs,
            self.config.max_num_batched_tokens, max_len, eos_ids, self.config.enable_prefix_caching,
            self.config.scheduling_policy,
        )
        self._core.finish_listeners = self._finish_listeners
        if self.config.freeze_gc:  # last: everything loading made is long-lived now
            heap.freeze()
            self._heap_frozen = True

    async def aclose(self) -> None:
        """Stops the engine: live requests end with finish_reason "abort", the loop
        exits, the model and KV pool are released. Idempotent; a call while start() is
        still loading waits for the load, then closes; one while another call closes
        returns when that one is done."""
        if self._state is _State.STARTING:
            await self._start_done.wait()
        if self._closing is not None:
            await self._closing.wait()
            return
        if self._state in (_State.CLOSED, _State.NEW):
            self._state = _State.CLOSED
            return
        self._closing = anyio.Event()
        try:
            await self._close()
        finally:
            self._closing.set()

    async def _close(self) -> None:
        self._state = _State.CLOSED
        if self._core is not None:
            for request_id in list(self._core.groups):
                self._core.abort(request_id)
        if self._stopped is not None:  # the loop ran: let it finish (a dead one may still be unwinding)
            self._wake()
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()
        with anyio.CancelScope(shield=True):
            await self._device.run(self._runner.shutdown)
            self._device.stop()
            # Wait for the thread to end: a process that exits while it still unwinds
            # its torch state can abort ("terminate called without an active exception").
            await anyio.to_thread.run_sync(self._device.join)
        self._runner = None
        if self._heap_frozen:
            self._heap_frozen = False
            heap.release()

    async def __aenter__(self) -> "AsyncEngine":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if getattr(self, "_state", None) in (_State.RUNNING, _State.DEAD):
            warnings.warn(
                f"AsyncEngine for {self.model_name} was not closed; use 'async with' or 'await engine.aclose()'",
                ResourceWarning,
                stacklevel=1,
            )

    @property
    def is_running(self) -> bool:
        return self._state is _State.RUNNING

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end generation unless ``ignore_eos`` (the tokenizer's EOS and the
        model's generation config's); empty before the engine started."""
        return self._core.eos_token_ids if self._core is not None else frozenset()

    # --- the background loop ----------------------------------------------------------------
    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        """The engine loop. Steps are planned one ahead: while the device runs step N,
        step N+1 is already launched behind it, and the loop turns step N's tokens into
        text and stream chunks::

            launch(N+1) ... collect(N) -> update(N) -> schedule + launch(N+2) -> emit(N) ...

        ``update`` confirms N's tokens (counters, stop tokens, lengths); ``emit`` does
        the rest (detokenizing, stop strings, chunks) while N+1 runs. For a handful of
        sequences ``emit`` comes before the launch instead: it is short, N+1 keeps the
        device busy meanwhile, and their tokens (a new request's first) reach the
        streams sooner. A request with a penalty or a grammar reads the previous step's
        token on the host: its step's forward pass is launched ahead all the same, and
        the runner enqueues its sampling when ``collect(N)`` brings that token, while the
        forward pass of N+1 runs.

        The loop awaits each launch before going on: the device thread's Python then
        never competes with the loop's for the GIL (every torch call releases it, and
        taking it back from a busy thread can cost a whole switch interval). Host work
        stays serial, and the device still never waits as long as one step's host work
        is shorter than one step on the device.
        """
        core = self._core
        inflight: deque = deque()  # (SchedulerOutput, LaunchedStep), in launch order
        try:
            while self._state is _State.RUNNING:
                self._drain_pending_aborts()
                await self._launch_ahead(inflight)
                if not inflight:
                    if not self._wakeup.is_set():
                        await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                out, launched = inflight.popleft()
                result = await self._device.run(self._runner.collect, launched)
                reqs = core.update(out, result.sampled, result.logprobs, result.prompt_logprobs, result.pooled)
                self._drain_pending_aborts()
                if inflight and len(reqs) <= _EMIT_FIRST_MAX:
                    # The next step is already queued on the device, and a few sequences'
                    # text takes far less time than it: their chunks go out before the
                    # launch, whose host work would otherwise delay them (a first token
                    # above all).
                    core.emit(reqs)
                    reqs = []
                    # Their consumers run now, before the launch's host work: on the device
                    # thread it would hold the GIL that their tasks need.
                    await anyio.lowlevel.checkpoint()
                await self._launch_ahead(inflight)
                # Emit in slices, yielding between them (and letting the streams' consumers
                # take their chunks), so no stretch of engine work holds the host's loop long.
                for i in range(0, len(reqs), _EMIT_SLICE):
                    await anyio.lowlevel.checkpoint()
                    core.emit(reqs[i : i + _EMIT_SLICE])
                await anyio.lowlevel.checkpoint()
        except BaseException as e:
            if isinstance(e, anyio.get_cancelled_exc_class()):
                # Not a failure of the engine: its host ended it (an event loop that ends
                # with the engine open cancels its task; so does a task group it ran in).
                self._die(EngineDeadError(
                    "the engine's background task was cancelled before aclose() (its event loop "
                    "ended, or the task group it ran in was cancelled)"), e, traceback=False)
                raise
            self._die(EngineDeadError(f"a model step failed: {type(e).__name__}: {e}"), e)
        finally:
            if inflight:  # closing: let the device finish what it was given
                with anyio.CancelScope(shield=True):
                    try:
                        await self._device.run(self._runner.collect, inflight[-1][1])
                    except BaseException:
                        pass  # the engine is stopping; the step's result has no reader
            self._stopped.set()

    async def _launch_ahead(self, inflight: deque) -> None:
        """Schedules and launches steps until two are in flight."""
        core = self._core
        while len(inflight) < 2 and core.scheduler.has_work:
            out = core.schedule()
            if out.is_empty:
                return
            # The wait is shielded (Job.result): a launch always completes and is recorded.
            inflight.append((out, await self._device.submit(self._runner.launch, out).result()))

    def _die(self, error: EngineDeadError, cause: BaseException, traceback: bool = True) -> None:
        error.__cause__ = cause
        self._dead_error = error
        if self._state is _State.RUNNING:
            self._state = _State.DEAD
        if traceback:
            log.error("engine stopped: %s", error, exc_info=cause)
        else:
            log.warning("engine stopped: %s", error)
        self._core.fail_all(error)

    def _drain_pending_aborts(self) -> None:
        while self._pending_aborts:
            group = self._pending_aborts.popleft()
            if self._core.groups.get(group.request_id) is group:  # (its id may be another request's by now)
                self._core.abort(group.request_id)

    def _abort_later(self, group: RequestGroup) -> None:
        """Hands the abort of ``group``'s request to the engine's loop: from any thread, and
        from a finalizer, which may run in the middle of the engine's own work (the
        garbage collector runs wherever objects are allocated)."""
        self._pending_aborts.append(group)
        try:
            self._call_soon(self._wake)
        except RuntimeError:
            pass  # loop closed: nothing left to free

    # --- requests ---------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._state is _State.RUNNING:
            self._check_loop_thread()
            return
        if self._state is _State.DEAD:
            raise EngineDeadError(f"the engine stopped: {self._dead_error}; create a new one") from self._dead_error
        raise EngineStateError(f"the engine is {self._state.value}; use 'async with engine' or 'await engine.start()' first")

    def _check_loop_thread(self) -> None:
        """EngineStateError for a request made outside the event loop the engine runs in
        (its state belongs to that loop): from another thread, or from another loop of the
        same thread (an engine started in one ``asyncio.run`` and used in the next while
        the first is suspended, as by a test framework's loop per test)."""
        if threading.get_ident() != self._loop_thread:
            raise EngineStateError(
                "the engine runs in the event loop of another thread; make requests from that loop (from another "
                "thread, hand them to it, e.g. with anyio.from_thread.run or asyncio.run_coroutine_threadsafe)"
            )
        loop = running_loop()
        if loop is not self._loop:
            where = "no event loop runs here" if loop is None else "this is another event loop of its thread"
            raise EngineStateError(
                f"the engine runs in the event loop that started it, and {where}; make requests from that loop, or "
                "start an engine in this one"
            )

    def stream(
        self,
        prompt: Optional[Prompt] = None,
        params: Optional[SamplingParams] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        request_id: Optional[str] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tools: Optional[list[dict[str, Any]]] = None,
        continue_final_message: bool = False,
        add_generation_prompt: Optional[bool] = None,
        priority: int = 0,
    ) -> "RequestStream":
        """Generates for one prompt, yielding :class:`StreamChunk` as text arrives.

        Exactly one of ``prompt`` (a string or a list of token ids) and ``messages``
        (chat messages, formatted by the model's chat template) is given. The request
        is checked here, so bad input raises at the call site; it is submitted when
        iteration starts. Leaving the loop early, cancelling the consuming task or
        ``aclose()`` on the stream aborts it and frees its blocks at once.

        ``chat_template_kwargs`` (with ``messages`` only) are extra variables for the chat
        template, e.g. ``{"enable_thinking": False}`` for Qwen3's. ``tools`` (with
        ``messages`` only) are the tools the template shows the model, in OpenAI's form
        (``{"type": "function", "function": {"name", "description", "parameters"}}``);
        :mod:`asyncgen.tools` reads the calls back out of the output.
        ``continue_final_message=True`` (with ``messages`` only) has the model go on with
        the last message, typically an assistant reply begun for it, instead of opening a
        new turn: the output is what follows its content. ``add_generation_prompt=False``
        ends the prompt after the last message's turn, opening none. ``priority`` orders
        the request among others under ``scheduling_policy="priority"`` (lower first).
        """
        params = _coerce_params(params)
        if params.num_sequences > params.n:
            raise InvalidRequestError(
                f"best_of={params.best_of} > n={params.n} cannot be streamed: the best {params.n} are only "
                "known at the end; use generate()"
            )
        return self._open_stream(prompt, params, messages, request_id, chat_template_kwargs, tools,
                                 continue_final_message, add_generation_prompt, priority)

    def _open_stream(self, prompt, params, messages, request_id, chat_template_kwargs=None, tools=None,
                     continue_final_message=False, add_generation_prompt=None, priority=0,
                     pooling=False) -> "RequestStream":
        self._check_running()
        params = _coerce_params(params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an int, got {priority!r}", param="priority")
        if priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority={priority} needs the engine's scheduling_policy=\"priority\" (it is "
                f"{self.config.scheduling_policy!r})", param="priority",
            )
        # the most tokens the prompt may have: past that, a text too long to hold them is refused untokenized
        most = None if params.truncate_prompt_tokens is not None else self.max_model_len - (not pooling)
        prompt_text, token_ids = self._tokenize(prompt, messages, chat_template_kwargs, tools, continue_final_message,
                                                add_generation_prompt, most)
        if params.truncate_prompt_tokens is not None:
            prompt_text, token_ids = self._truncate(prompt_text, token_ids, params.truncate_prompt_tokens)
        bad_word_ids = self._bad_word_ids(params.bad_words) if params.bad_words else ()
        if pooling:
            self._check_pooled_fits(token_ids)
        else:
            self._check_fits(token_ids, params, bad_word_ids)
        own_id = request_id is not None
        if not own_id:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        else:
            self._check_request_id(request_id, params.num_sequences)
        group = RequestGroup(request_id, prompt_text, token_ids, params)
        group.priority = priority
        group.bad_word_ids = bad_word_ids
        stream = RequestStream(self, group, self._max_tokens(token_ids, params))
        if own_id:
            self._unsent[request_id] = stream
        return stream

    def _truncate(self, text: Optional[str], token_ids: list[int], keep: int) -> tuple[Optional[str], list[int]]:
        """The prompt's last ``keep`` tokens (-1: ``max_model_len``), and their text."""
        if keep == -1:
            keep = self.max_model_len
        elif keep > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({self.max_model_len})",
                param="truncate_prompt_tokens",
            )
        if len(token_ids) <= keep:
            return text, token_ids
        token_ids = token_ids[-keep:]
        return (None if text is None else self._tokenizer.decode(token_ids)), token_ids

    def _bad_word_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """The token sequences of ``bad_words``, as vLLM forms them: each word without its
        leading spaces (as it tokenizes at the start of a text) and after one space (as in
        the middle of one), the latter where it is another token sequence of the same
        length."""
        out: dict[tuple[int, ...], None] = {}
        for word in words:
            bare = tuple(self._tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self._tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out[bare] = None
            if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out[spaced] = None
        return tuple(ids for ids in out if ids)

    def _check_request_id(self, request_id: str, count: int) -> None:
        """DuplicateRequestError if the id (or a sample id of it) is taken by a live request
        or by a stream opened with it and not submitted yet."""
        self._core.check_request_id(request_id, count)
        mine = set(seq_ids(request_id, count))
        for other_id, other in list(self._unsent.items()):
            if other._registered or other._closed:
                continue
            if other_id == request_id or mine & set(seq_ids(other_id, other.group.params.num_sequences)):
                raise DuplicateRequestError(
                    f"request_id {request_id!r} clashes with {other_id!r}, the id of a stream opened and not "
                    "iterated yet"
                )

    async def generate(
        self,
        prompt: Optional[Prompt] = None,
        params: Optional[SamplingParams] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        request_id: Optional[str] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tools: Optional[list[dict[str, Any]]] = None,
        continue_final_message: bool = False,
        add_generation_prompt: Optional[bool] = None,
        priority: int = 0,
    ) -> RequestOutput:
        """Generates for one prompt and returns the whole :class:`RequestOutput` (the
        arguments are :meth:`stream`'s). With ``best_of``, the ``n`` completions with the
        highest cumulative logprob, best first."""
        stream = self._open_stream(prompt, params, messages, request_id, chat_template_kwargs, tools,
                                   continue_final_message, add_generation_prompt, priority)
        stream.group.wake_each_chunk = False
        want = stream.group.params
        n = want.num_sequences
        texts: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        reasons: list[Any] = [None] * n
        stops: list[Any] = [None] * n
        lps: list[list] = [[] for _ in range(n)]
        metrics: list[Any] = [None] * n
        usage = None
        prompt_lps = None
        async with stream:
            async for chunk in stream:
                if chunk.prompt_logprobs is not None:
                    prompt_lps = chunk.prompt_logprobs
                texts[chunk.index].append(chunk.text)
                ids[chunk.index].extend(chunk.token_ids)
                if chunk.logprobs:
                    lps[chunk.index].extend(chunk.logprobs)
                if chunk.finish_reason is not None:
                    reasons[chunk.index] = chunk.finish_reason
                    stops[chunk.index] = chunk.stop_reason
                    metrics[chunk.index] = chunk.metrics
                if chunk.usage is not None:
                    usage = chunk.usage
        cumulative = [sum(lp.logprob for lp in lps[i]) if lps[i] else None for i in range(n)]
        order = list(range(n))
        if n > want.n:  # best_of: keep the n most likely, best first
            order = sorted(order, key=lambda i: cumulative[i] if cumulative[i] is not None else float("-inf"),
                           reverse=True)[: want.n]
        outputs = tuple(
            CompletionOutput(
                rank, "".join(texts[i]), tuple(ids[i]), reasons[i], stops[i],
                tuple(lps[i]) if want.logprobs is not None else None,
                metrics[i], cumulative[i] if (want.logprobs is not None or n > want.n) else None,
            )
            for rank, i in enumerate(order)
        )
        g = stream.group
        return RequestOutput(g.request_id, g.prompt, tuple(g.prompt_token_ids), outputs, usage, prompt_lps)

    async def beam_search(
        self,
        prompt: Optional[Prompt] = None,
        params: Union[BeamSearchParams, dict[str, Any], None] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tools: Optional[list[dict[str, Any]]] = None,
        continue_final_message: bool = False,
        add_generation_prompt: Optional[bool] = None,
        priority: int = 0,
    ) -> BeamSearchOutput:
        """Beam search (vLLM's ``beam_search``): the ``params.beam_width`` most likely
        sequences found by keeping that many at each step (:class:`BeamSearchParams`),
        best first. The prompt arguments and ``priority`` are :meth:`stream`'s. Each step
        is a batch of one-token requests, one per sequence kept, served beside all other
        requests.
        """
        self._check_running()
        if params is None:
            raise InvalidRequestError("beam_search needs params with a beam_width", param="beam_width")
        if not isinstance(params, BeamSearchParams):
            params = BeamSearchParams.model_validate(params)
        prompt_text, token_ids = self._tokenize(prompt, messages, chat_template_kwargs, tools, continue_final_message,
                                                add_generation_prompt, self.max_model_len - 1)
        self._check_fits(token_ids, SamplingParams(max_tokens=params.max_tokens))
        if params.max_tokens is None:
            most = self._max_tokens(token_ids, SamplingParams(max_tokens=None))
            params = params.model_copy(update={"max_tokens": most})
        from .beam_search import beam_search

        return await beam_search(self, prompt_text, token_ids, params, priority)

    async def embed(
        self,
        prompt: Optional[Prompt] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        normalize: bool = True,
        dimensions: Optional[int] = None,
        truncate_prompt_tokens: Optional[int] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
    ) -> EmbeddingOutput:
        """An embedding of the prompt (vLLM's ``embed`` with last-token pooling): the
        model's final hidden state, after its last norm, at the prompt's last token, the
        way decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are read.
        ``normalize`` scales it to unit length; ``dimensions`` keeps its first values
        (Matryoshka models), before normalising. The prompt arguments are
        :meth:`stream`'s; ``truncate_prompt_tokens`` is :class:`SamplingParams`'. The
        request is scheduled with generation requests and shares the prefix cache. The
        prompt may hold up to ``max_model_len`` tokens (``truncate_prompt_tokens=-1``
        keeps that many); it is served as a request for one token, which is neither
        stored nor returned. A model whose sentence-transformers
        configuration declares another pooling (mean, CLS, ...) is refused."""
        self._check_running()
        if self._pooling_mode not in (None, "lasttoken"):
            raise InvalidRequestError(
                f"this model's sentence-transformers configuration pools by {self._pooling_mode!r}; embed() reads the "
                "last token's hidden state only, which would not be this model's embedding"
            )
        hidden = self.hidden_size
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 1 <= dimensions <= hidden):
            raise InvalidRequestError(f"dimensions must be an int in [1, {hidden}] (the model's hidden size), got "
                                      f"{dimensions!r}", param="dimensions")
        params = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate_prompt_tokens)
        stream = self._open_stream(prompt, params, messages, request_id, chat_template_kwargs, priority=priority,
                                   pooling=True)
        group = stream.group
        group.pooling = True
        group.wake_each_chunk = False
        finish = None
        async with stream:
            async for chunk in stream:
                finish = chunk.finish_reason or finish
        if group.embedding is None:  # aborted before its prompt was computed
            raise EngineStateError(f"embedding request {group.request_id!r} ended ({finish}) before its prompt was "
                                   "computed")
        vector = group.embedding[:dimensions] if dimensions is not None else group.embedding
        if normalize:
            vector = vector / vector.norm().clamp_min(1e-12)
        return EmbeddingOutput(group.request_id, group.prompt, tuple(group.prompt_token_ids), tuple(vector.tolist()),
                               Usage(len(group.prompt_token_ids), 0))

    def abort(self, request_id: str) -> bool:
        """Aborts a request now (its stream ends with finish_reason "abort"); False if no
        such live request. A stream opened with this ``request_id`` and not iterated yet
        is submitted and aborted at once, so it ends the same way. Call from the engine's
        event loop (EngineStateError from another thread or loop)."""
        if self._state is _State.RUNNING:
            self._check_loop_thread()
        if self._core is None:
            return False
        stream = self._unsent.get(request_id)
        if stream is not None and not stream._registered and not stream._closed and self._state is _State.RUNNING:
            self._register(stream)
            stream._registered = True
        return self._core.abort(request_id)

    def add_finish_listener(self, listener: Callable[[StreamChunk], Any]) -> Callable[[], None]:
        """Calls ``listener(chunk)`` with the last chunk of every completion this engine
        finishes (``finish_reason`` set, ``metrics`` attached), whoever reads the request:
        ``generate()``, a stream, the OpenAI layer; aborted ones too (finish_reason
        "abort"). It runs on the event loop's thread as the chunk is made, so it must be
        quick; an exception from it is logged and affects neither the request nor the
        engine. Returns a function that removes the listener. :class:`asyncgen.metrics.EngineCollector`
        uses this to record every request."""
        self._finish_listeners.append(listener)

        def remove() -> None:
            if listener in self._finish_listeners:
                self._finish_listeners.remove(listener)

        return remove

    def openai_client(self, **kwargs: Any):
        """An in-process client with the surface of ``openai.AsyncOpenAI`` (chat
        completions, completions, models) that calls this engine directly; ``kwargs``
        are :class:`~asyncgen.openai.InProcessOpenAI`'s (``model_names``, ``tool_call_parser``)."""
        from ..openai.client import InProcessOpenAI

        return InProcessOpenAI(self, **kwargs)

    def stats(self) -> EngineStats:
        """Load and usage counters: running/waiting requests, free/total KV blocks, ..."""
        if self._core is None:
            raise EngineStateError("stats() before the engine started")
        # Read where the loop that changes these counters runs (any of its thread's loops:
        # while another runs, the engine's is suspended).
        if threading.get_ident() != self._loop_thread:
            raise EngineStateError(
                "stats() reads state the engine's event loop changes, which runs in another thread; call it from "
                "that loop (from another thread, hand it over, e.g. with anyio.from_thread.run_sync)"
            )
        return self._core.stats()

    # --- request checks ---------------------------------------------------------------------
    def _tokenize(self, prompt, messages, chat_template_kwargs=None, tools=None, continue_final_message=False,
                  add_generation_prompt=None, most: Optional[int] = None) -> tuple[Optional[str], list[int]]:
        """(the prompt's text, its token ids). A text with more characters than ``most``
        tokens of the longest kind hold is refused before it is tokenized: encoding a
        prompt of megabytes would take seconds on the event loop and hundreds of bytes of
        memory for each of its characters, only to refuse it."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give exactly one of 'prompt' and 'messages'")
        for name, value in (("chat_template_kwargs", chat_template_kwargs), ("tools", tools),
                            ("continue_final_message", continue_final_message or None),
                            ("add_generation_prompt", add_generation_prompt)):
            if value is not None and messages is None:
                raise InvalidRequestError(
                    f"{name} apply to 'messages' only; this request gave a prompt", param=name,
                )
        tok = self._tokenizer
        if messages is not None:
            from .tokenizer import apply_chat_template

            text = apply_chat_template(tok, messages, chat_template_kwargs, tools, add_generation_prompt,
                                       continue_final_message)
            self._check_text(text, "messages (as the chat template renders them)", most)
            return text, self._check_text_ids(tok.encode(text, add_special_tokens=False), "messages")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            self._check_text(prompt, "prompt", most)
            return prompt, self._check_text_ids(tok.encode(prompt), "prompt")
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("prompt must not be an empty list of token ids")
            if _all_ids_in_range(prompt, self.vocab_size):
                return None, list(prompt)
            bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}); got {bad[:5]!r}"
                )
            return None, list(prompt)
        raise InvalidRequestError(f"prompt must be a str or a list of token ids, not {type(prompt).__name__}")

    def _check_text(self, text: str, what: str, most: Optional[int]) -> None:
        """A prompt's text before it is tokenized: not more characters than ``most`` tokens
        can hold, and valid Unicode."""
        if most is not None and len(text) > most * self._max_token_chars:
            raise PromptTooLongError(
                f"{len(text)} characters of {what}: at least {-(-len(text) // self._max_token_chars)} tokens, as "
                f"no token of this tokenizer is longer than {self._max_token_chars} characters; max_model_len is "
                f"{self.max_model_len}"
            )
        problem = unicode_problem(text)  # a lone surrogate, which a tokenizer cannot encode
        if problem is not None:
            raise InvalidRequestError(f"{what}: {problem}")

    def _check_text_ids(self, ids: list[int], what: str) -> list[int]:
        """``ids`` as they are, or InvalidRequestError where the tokenizer gave ids past the
        model's vocabulary (a tokenizer with more tokens than the model, checked only then)."""
        if self._tokenizer_overflows and ids and max(ids) >= self.vocab_size:
            bad = sorted({t for t in ids if t >= self.vocab_size})
            pieces = ", ".join(repr(self._tokenizer.convert_ids_to_tokens(t)) for t in bad[:5])
            raise InvalidRequestError(
                f"token ids {bad[:5]} ({pieces}) of the {what} are past the model's vocabulary of "
                f"{self.vocab_size} tokens (its tokenizer has {len(self._tokenizer)})"
            )
        return ids

    def _max_tokens(self, token_ids: list[int], params: SamplingParams) -> int:
        """``params.max_tokens``, or without it as many as fit: up to ``max_model_len``
        tokens in all, or what the KV pool holds for one sequence if that is fewer."""
        if params.max_tokens is None:
            return self._max_seq_tokens - len(token_ids)
        return params.max_tokens

    def _check_fits(self, token_ids: list[int], params: SamplingParams, bad_word_ids=()) -> None:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no room to generate"
            )
        if params.max_tokens is None and n >= self._max_seq_tokens:
            raise PromptTooLongError(
                f"prompt has {n} tokens; the KV pool holds {self._max_seq_tokens} tokens for one sequence, which "
                "leaves no room to generate. Give the engine more KV memory"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds max_model_len ({self.max_model_len}); lower max_tokens or shorten the prompt",
                param="max_tokens",
            )
        bm = self._core.block_manager
        need = bm.blocks_for(n + self._max_tokens(token_ids, params))
        if need > bm.num_blocks:
            raise PromptTooLongError(
                f"a sequence of {n} prompt + {self._max_tokens(token_ids, params)} new tokens needs {need} KV "
                f"blocks; the pool has {bm.num_blocks}. Lower max_tokens or give the engine more KV memory",
                param=None if params.max_tokens is None else "max_tokens",
            )
        for field, ids in (("stop_token_ids", params.stop_token_ids or ()), ("logit_bias", params.logit_bias or {}),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{field} holds token ids outside the vocabulary ({self.vocab_size}): {bad[:5]}", param=field
                )
        if params.allowed_token_ids and params.min_tokens:
            stops = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
            allowed = set(params.allowed_token_ids)
            if allowed <= stops:
                raise InvalidRequestError(
                    f"allowed_token_ids holds stop tokens only, which min_tokens ({params.min_tokens}) keeps from "
                    "being sampled: no token could come next", param="allowed_token_ids",
                )
            if allowed <= stops | {w[0] for w in bad_word_ids if len(w) == 1}:  # one-token bad words: banned
                raise InvalidRequestError(
                    f"allowed_token_ids holds only stop tokens, which min_tokens ({params.min_tokens}) keeps from "
                    "being sampled, and tokens that bad_words bans: no token could come next", param="bad_words",
                )

    def _check_pooled_fits(self, token_ids: list[int]) -> None:
        """An embedding's prompt: all of ``max_model_len`` may be used, as the token its
        request samples is never stored in the KV cache."""
        n = len(token_ids)
        if n > self.max_model_len:
            raise PromptTooLongError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} "
                                     "(truncate_prompt_tokens=-1 keeps its last max_model_len tokens)")
        if n > self._max_seq_tokens:
            raise PromptTooLongError(f"prompt has {n} tokens; the KV pool holds {self._max_seq_tokens} tokens for "
                                     "one sequence. Give the engine more KV memory")

    def _register(self, stream: "RequestStream") -> None:
        self._check_running()
        self._core.add(stream.group, stream.max_tokens)  # DuplicateRequestError for an id in use
        if self._unsent.get(stream.group.request_id) is stream:
            del self._unsent[stream.group.request_id]
        self._wake()


class RequestStream(AsyncIterator[StreamChunk]):
    """The async iterator ``engine.stream()`` returns.

    Cancellation semantics: ``__anext__`` either returns a chunk or raises; if it is
    cancelled (or the stream is closed, or dropped before it finished), the request is
    aborted and its blocks are freed before the next step. A stream has one reader: a
    task that asks for the next chunk while another waits for one gets an
    EngineStateError (the waiting reader and the request go on).
    """

    def __init__(self, engine: AsyncEngine, group: RequestGroup, max_tokens: int):
        self.engine = engine
        self.group = group
        self.max_tokens = max_tokens
        self._registered = False
        self._closed = False
        self._event: Optional[anyio.Event] = None
        # The engine holds the group; the group must not hold the stream, or a stream
        # dropped mid-request could never be collected (and so never aborted).
        notify = weakref.WeakMethod(self._notify)
        group.notify = lambda: (m := notify()) is not None and m()

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids, as the model sees them (chat template applied)."""
        return tuple(self.group.prompt_token_ids)

    def _notify(self) -> None:
        if self._event is not None:
            self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._closed:
            raise StopAsyncIteration
        if not self._registered:
            self.engine._register(self)
            self._registered = True
        queue = self.group.queue
        if not queue and self._event is not None and not self._event.is_set():
            raise EngineStateError(f"request {self.request_id!r}: another task is waiting for this stream's next "
                                   "chunk; a stream has one reader")
        try:
            while not queue:
                if self.group.finished:
                    self._closed = True
                    raise StopAsyncIteration
                self._event = anyio.Event()
                await self._event.wait()
        except BaseException as e:
            if not isinstance(e, StopAsyncIteration):
                self._abort()
            raise
        item = queue.popleft()
        if isinstance(item, BaseException):
            self._closed = True
            raise item
        return item

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            if self._registered and not self.group.finished:
                if running_loop() is self.engine._loop:
                    self.engine.abort(self.group.request_id)
                else:
                    self.engine._abort_later(self.group)

    async def aclose(self) -> None:
        """Aborts the request if it is still generating."""
        self._abort()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._abort()

    def __del__(self) -> None:
        if getattr(self, "_registered", False) and not self._closed and not self.group.finished:
            try:
                self.engine._abort_later(self.group)
            except Exception:
                pass


def _declared_pooling(path: Path) -> Optional[str]:
    """The pooling a sentence-transformers model directory declares (its Pooling module's
    ``config.json``: "lasttoken", "mean", "cls", ...), or None where it declares none."""
    import json

    folder = "1_Pooling"
    try:
        modules = json.loads((path / "modules.json").read_text())
        folder = next(m["path"] for m in modules if str(m.get("type", "")).endswith(".Pooling"))
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        pass
    try:
        cfg = json.loads((path / folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
             for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    return modes[0] if len(modes) == 1 else (",".join(sorted(modes)) or None)


def _check_model_len(config: EngineConfig, model_cfg) -> None:
    """ModelLoadError where ``max_model_len`` asks for more positions than the model has
    (its ``max_position_embeddings``): the rotary table would go on past what it learned."""
    if config.max_model_len is not None and config.max_model_len > model_cfg.max_position_embeddings:
        raise ModelLoadError(
            f"max_model_len={config.max_model_len} is over the model's max_position_embeddings "
            f"({model_cfg.max_position_embeddings}); pass at most that"
        )


def _all_ids_in_range(ids: Sequence[Any], vocab_size: int) -> bool:
    """Whether every element is a plain ``int`` in ``[0, vocab_size)``: the common case,
    checked in C (a long prompt is checked on every request, before it is queued)."""
    return set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size


def _coerce_params(params: Any) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, dict):
        return SamplingParams(**params)  # raises ValidationError naming the field
    raise InvalidRequestError(f"params must be a SamplingParams (or a dict of its fields), not {type(params).__name__}")


def _display_name(model: Any, path: Path) -> str:
    """The name a host shows for the model: the hub id, or the directory's name."""
    return path.name if Path(model).expanduser().is_dir() else str(model)
