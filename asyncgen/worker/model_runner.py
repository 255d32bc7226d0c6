"""Executes a :class:`SchedulerOutput`: tensors in, one forward pass, sampled tokens out.

Runs only on the device thread. It keeps no scheduling state, just each live sequence's
sampling state (parameters, seeded generator, tokens for penalties), created when the
sequence first appears in ``new_requests`` and dropped when it is listed as finished.

A step is two calls: :meth:`ModelRunner.launch` enqueues the whole step on the device
and returns at once; :meth:`ModelRunner.collect` waits for its tokens. The engine
launches step N+1 before collecting step N, so the device never waits for the host.
A sequence whose input token is still being sampled by the previous launch arrives as
a :data:`~asyncgen.engine.request.PLACEHOLDER`: the runner feeds that launch's device-
side sample in its place. A sequence with a penalty or a grammar also needs that token
on the host, to count it or to advance its grammar over it: such a step's forward pass
is launched at once and its sampling is enqueued when the previous step is collected,
before the forward pass has finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from itertools import chain
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from .._ops import get_ops
from ..config import EngineConfig
from ..engine.request import PLACEHOLDER
from ..engine.scheduler import SchedulerOutput
from ..model.config import ModelConfig
from ..model.llama import AttentionMetadata, LlamaForCausalLM
from ..model.loader import load_weights
from ..outputs import TokenLogprob
from .guided import GuideFactory, SequenceGuide, TokenFilter
from .sampler import PendingSample, SamplingRow, sample_async, token_ranks

__all__ = ["LaunchedStep", "ModelOutput", "ModelRunner", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)

# Prompt (and mixed) steps of up to this many tokens replay a CUDA graph; longer ones
# keep the device busy long enough to hide their kernel launches.
_MAX_PROMPT_GRAPH_TOKENS = 2048
# A step pays for its graph's padding in every kernel. Every 16 tokens up to 128: a short
# chunk after a cached prefix (a prefix-cache hit; on the H200 the attention of a 78-token
# chunk took 24.2 us a layer in an 80-token graph, 27.2 in the 128-token one). Then every
# 128, where the products' time grows with the rows.
_PROMPT_GRAPH_SIZES = (16, 32, 48, 64, 80, 96, 112, *range(128, 2049, 128))
# Prompt graphs of up to this many tokens are also captured with this many sequence slots.
# The general attention kernel splits the context only for batches of at most
# triton_paged_attention._PREFILL_SPLIT_MAX_SEQS sequences: the narrow graphs must not
# have more slots than that, or a prefix-cache hit would not split.
_NARROW_PROMPT_TOKENS = 512
_NARROW_PROMPT_SLOTS = 8
# The narrow graphs' sizes: from 128 tokens every 32, so that a prefix-cache hit whose new
# part is a chat turn of a few hundred tokens pays for less padding. Steps of many
# sequences keep the wide graphs every 128.
_NARROW_PROMPT_SIZES = (16, 32, 48, 64, 80, 96, 112, *range(128, _NARROW_PROMPT_TOKENS + 1, 32))


def _decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes captured as CUDA graphs: 1, 2, 4, 8, then every 16, up to
    ``max_num_seqs`` (at most 512)."""
    max_bs = min(max_num_seqs, 512)
    return sorted({b for b in (1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs) if b <= max_bs})


def _prompt_graph_keys(max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """The prompt-step graphs to capture, as (tokens, sequence slots), ascending: each
    size of ``_PROMPT_GRAPH_SIZES`` within the token budget with a slot per sequence it
    can hold (``min(tokens, max_num_seqs + 1)``, the padding sequence included), and each
    of ``_NARROW_PROMPT_SIZES`` with at most ``_NARROW_PROMPT_SLOTS`` (one graph where the
    two coincide)."""
    limit = min(_MAX_PROMPT_GRAPH_TOKENS, max_num_batched_tokens)
    slots = max_num_seqs + 1
    keys = {(t, min(t, slots)) for t in _PROMPT_GRAPH_SIZES if t <= limit}
    keys |= {(t, min(t, slots, _NARROW_PROMPT_SLOTS)) for t in _NARROW_PROMPT_SIZES if t <= limit}
    return sorted(keys)


_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from ..errors import ModelLoadError

        raise ModelLoadError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def check_backend(backend: str, device: torch.device) -> None:
    """ModelLoadError where ``ops_backend`` cannot run on ``device``: csrc kernels off a
    CUDA device or unbuilt, Triton without the package or, on the CPU, without its
    interpreter (``TRITON_INTERPRET=1``, set before asyncgen's Triton modules load)."""
    from ..errors import ModelLoadError

    problem = None
    if backend == "cuda":
        if device.type != "cuda":
            problem = f"its csrc kernels run on a CUDA device, and the engine's device is {device.type}"
        else:
            from .._ops import cuda_backend_available

            if not cuda_backend_available():
                try:
                    from .._ops.cuda_backend import BUILD_HINT as problem
                except ImportError as e:
                    problem = f"asyncgen._ops.cuda_backend does not import ({e})"
    elif backend == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            problem = "the triton package is not installed"
        elif device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            problem = "Triton kernels run on the CPU only under TRITON_INTERPRET=1"
        elif device.type not in ("cpu", "cuda"):
            problem = f"Triton kernels run on CUDA devices, not {device.type}"
    if problem:
        raise ModelLoadError(f"ops_backend={backend!r} cannot serve here: {problem}; ops_backend='auto' picks one "
                             "that can")


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and lossy
    declared = _DTYPES.get(str(model_cfg.torch_dtype).replace("torch.", ""), torch.float16)
    return torch.float16 if declared == torch.float32 else declared


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elt


@dataclasses.dataclass
class ModelOutput:
    """What a step returns to the engine: sampled tokens and, where asked, logprobs
    (``prompt_logprobs``: per sequence, ``(position, TokenLogprob)`` of each prompt token
    the step's chunk predicted)."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = dataclasses.field(default_factory=dict)
    # Embedding requests whose prompt ended in this step: the final hidden state at its
    # last token (fp32, on the host).
    pooled: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LaunchedStep:
    """A step enqueued on the device; :meth:`ModelRunner.collect` turns it into a
    :class:`ModelOutput`."""

    sampling_ids: list[str]
    pending: Optional[PendingSample]
    # (per-sequence (req_id, first position, count, k), [R] targets, [R] logprobs,
    #  [R, k] top ids, [R, k] top logprobs) on the device, or None
    prompt_logprobs: Optional[tuple] = None
    # The sampled sequences' states as of the launch: a token collected after its request
    # ended goes to that request's history, never to a new request given the same id.
    states: tuple = ()
    # (logits, sample ends) while the sampling waits for the previous step's tokens
    deferred: Optional[tuple] = None
    # (req_ids, [R, hidden] fp32 on the device): embedding requests' pooled rows, or None
    pooled: Optional[tuple] = None
    output: Optional[ModelOutput] = None  # once collected


@dataclasses.dataclass
class _SeqState:
    params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # as collected (penalties and grammars read it)
    stop_token_ids: frozenset[int]
    generator: Optional[torch.Generator]
    # The seeded generator's state before each recent output position was sampled: a
    # token dropped by preemption is drawn again from the same state, so a seeded request
    # gets the tokens it gets alone.
    generator_states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    guide: Optional[SequenceGuide] = None  # structured outputs: the grammar's states and masks
    token_filter: Optional[TokenFilter] = None  # allowed_token_ids, bad_words
    # The output positions of the launched steps' rows not yet collected, in launch order.
    in_flight: deque = dataclasses.field(default_factory=deque)


# Output positions behind the newest whose generator states are kept: tokens a
# preemption drops are the steps in flight, at most a few positions back.
_GENERATOR_STATES_KEPT = 4


def _waits_for_history(st: _SeqState, position: int) -> bool:
    """Whether sampling ``st``'s output token at ``position`` reads output tokens not yet
    collected (a penalty counts them, a grammar advances over them)."""
    if len(st.output_token_ids) >= position:
        return False
    p = st.params
    return st.guide is not None or (st.token_filter is not None and st.token_filter.reads_history) or (
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    )


def _position_generator(st: _SeqState, position: int) -> None:
    """Puts ``st``'s generator where it was when output ``position`` was first sampled
    (or records where it is now, on the first visit)."""
    states = st.generator_states
    saved = states.get(position)
    if saved is not None:
        st.generator.set_state(saved)
    else:
        states[position] = st.generator.get_state()
    for old in [p for p in states if p < position - _GENERATOR_STATES_KEPT or p > position]:
        del states[old]


class ModelRunner:
    """Owns the model, the KV pool and the per-sequence sampling state on one device."""

    def __init__(self, path: Path, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int, linear_method=None):
        self.path, self.model_cfg, self.cfg = path, model_cfg, cfg
        self.max_model_len = max_model_len
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.block_size = cfg.block_size
        self.linear_method = linear_method
        self.states: dict[str, _SeqState] = {}
        self._pooling: set[str] = set()  # ids of the embedding requests among the states
        self.model: Optional[LlamaForCausalLM] = None
        self.num_blocks = 0
        self.ops_backend = self._pick_backend()
        self._graphs: dict[int, tuple] = {}
        self._graph_sizes: list[int] = []
        # The previous launch's sampled tokens on the device, and each sequence's row.
        self._last_tokens: Optional[torch.Tensor] = None
        self._last_rows: dict[str, int] = {}
        self._unabsorbed: deque[LaunchedStep] = deque()  # launched, tokens not yet collected, in order
        self._deferred: Optional[LaunchedStep] = None  # the launched step whose sampling waits
        self._staging_ring: list[list] = []  # [pinned buffer, event of its last copy, the buffer as an array]
        self._lt_workspace: Optional[torch.Tensor] = None  # the cuBLASLt routes' workspace (_choose_dense_algos)
        self._staging_next = 0
        # Structured outputs: the engine sets token_bytes (the vocabulary's bytes, read when
        # a request first needs them); the guides are made on the first such request.
        self.token_bytes: Optional[Callable[[], list[Optional[bytes]]]] = None
        self._guide_factory: Optional[GuideFactory] = None

    def _guides(self) -> GuideFactory:
        if self._guide_factory is None:
            if self.token_bytes is None:
                raise RuntimeError("structured outputs need the runner's token_bytes (set by the engine)")
            self._guide_factory = GuideFactory(self.token_bytes, self.model_cfg.vocab_size)
        return self._guide_factory

    def _pick_backend(self) -> str:
        wanted = self.cfg.ops_backend
        if wanted != "auto":
            check_backend(wanted, self.device)
            return wanted
        if self.device.type != "cuda":
            return "torch"
        from .._ops import cuda_backend_available

        return "cuda" if cuda_backend_available() else "triton"

    # --- start-up (device thread) ---------------------------------------------------------
    def _choose_gemv(self) -> None:
        """Times the csrc GEMV against cuBLAS for each unquantized linear weight shape at
        decode-sized batches, and for 4-bit layers the csrc kernels against Triton; each
        layer then uses whichever was faster (``cuda_backend.choose_dense_gemv``,
        ``QuantLinearMethod.choose_kernels``)."""
        from .._ops import cuda_backend
        from ..model.linear import LinearBase

        from ..model.quantization import ROUTE_ROWS, QuantLinearMethod

        linear = [m for m in self.model.modules() if isinstance(m, LinearBase)]
        layers = self._dense_layers()
        if layers:
            t0 = time.perf_counter()
            chosen = cuda_backend.choose_dense_gemv(layers)
            table = ", ".join(f"{n}x{k}: {rows}" + (f" ({warps} warps a row)" if rows and warps > 1 else "")
                              for (n, k, _), (rows, warps) in chosen.items())
            log.info("csrc GEMV up to this many rows per weight shape (else cuBLAS): %s (timed in %.2f s)",
                     table, time.perf_counter() - t0)
            dense = {id(layer) for layer in layers}
            for layer in self.model.layers:
                if id(layer.mlp.gate_up_proj) in dense:
                    layer.mlp.gate_up_proj.gemv_gated = True  # SiLU-and-multiply inside the GEMV
        quantized = [m for m in linear if getattr(m, "quant_kernel", None) == "cuda"]
        if quantized:
            scratch = cuda_backend.GemmScratch(self.device)  # this model's split workspace
            for layer in quantized:
                for seg in layer.quant_segments:
                    seg.gemm_scratch = scratch
            t0 = time.perf_counter()
            chosen = QuantLinearMethod.choose_kernels(quantized)
            table = "; ".join(
                f"{k}x{n} g{g}{' act-order' if act else ''}: "
                + ", ".join(f"{m}:{QuantLinearMethod.kernel_name(c)}" for m, c in zip(ROUTE_ROWS, picks))
                for (k, n, g, act), picks in chosen.items()
            )
            log.info("4-bit kernels by rows (K x N: rows:kernel): %s (timed in %.2f s)", table, time.perf_counter() - t0)
            segments = [seg for layer in quantized for seg in layer.quant_segments]
            chunked = [seg for seg in segments if seg.chunk_rows]
            if chunked:
                step = len(chunked[0].route) - 1
                log.info("4-bit products of %d-%d rows in pieces of %d through those kernels (faster than Triton "
                         "when timed): %d of %d segments", step + 1, chunked[0].chunk_rows, step, len(chunked),
                         len(segments))
            if os.environ.get("ASYNCGEN_GATED_4BIT", "1") != "0":
                self._gate_quantized_mlps()

    def _gate_quantized_mlps(self) -> None:
        """Lets each 4-bit gate|up that the one-row kernel serves at one row give
        silu(gate) * up itself there (no SiLU-and-multiply kernel in a single stream's step)."""
        gated = 0
        for layer in self.model.layers:
            gate_up = layer.mlp.gate_up_proj
            if getattr(gate_up, "quant_kernel", None) == "cuda" and gate_up.method.gated_ok(gate_up):
                gate_up.quant_gated = True
                gated += 1
        if gated:
            log.info("gate|up of %d layers gives silu(gate) * up from the one-row 4-bit kernel", gated)

    def _dense_layers(self) -> list:
        """The model's linear layers with an unquantized weight [N, K] in the model's dtype."""
        from ..model.linear import LinearBase

        return [m for m in self.model.modules() if isinstance(m, LinearBase)
                and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
                and m.weight.dtype == self.dtype]

    def _choose_dense_algos(self) -> None:
        """Times cuBLASLt's algorithms against ``F.linear`` for each unquantized weight
        shape at the row counts the CUDA graphs will run (``cuda_backend.choose_dense_algos``);
        the graphs then capture the faster. The routes share this model's workspace."""
        if self.cfg.enforce_eager:
            return
        from .._ops import cuda_backend

        layers = self._dense_layers()
        if not layers:
            return
        rows = set(_decode_graph_sizes(self.cfg.max_num_seqs))
        rows.update(t for t, _ in _prompt_graph_keys(self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs))
        t0 = time.perf_counter()
        self._lt_workspace = torch.empty(cuda_backend.LT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        chosen = cuda_backend.choose_dense_algos(layers, sorted(rows), self._lt_workspace)
        if not any(chosen.values()):
            self._lt_workspace = None  # no route holds it
        table = "; ".join(f"{n}x{k}: " + (", ".join(f"{m}:#{rank}" for m, rank in picks.items()) or "none")
                          for (n, k, _, _), picks in chosen.items())
        log.info("cuBLASLt algorithms by rows (N x K: rows:#heuristic rank; else cuBLAS): %s (timed in %.2f s)",
                 table or "cuBLASLt unavailable", time.perf_counter() - t0)

    def _choose_dequant(self) -> None:
        """Times the Triton 4-bit GEMM against dequantize-then-cuBLAS at prompt sizes for each
        4-bit weight shape and sets where prompt steps switch to the latter
        (``QuantLinearMethod.choose_dequant_rows``)."""
        from ..model.linear import LinearBase
        from ..model.quantization import QuantLinearMethod

        quantized = [m for m in self.model.modules()
                     if isinstance(m, LinearBase) and getattr(m, "quant_kernel", None) in ("triton", "cuda")]
        if not quantized:
            return
        t0 = time.perf_counter()
        chosen = QuantLinearMethod.choose_dequant_rows(quantized)
        table = "; ".join(
            f"{k}x{n} g{g}{' act-order' if act else ''}: {f'from {rows} rows' if rows else 'never'}"
            for (k, n, g, act), rows in chosen.items()
        )
        log.info("4-bit prompt products dequantized for cuBLAS: %s (timed in %.2f s)", table, time.perf_counter() - t0)

    def load(self) -> int:
        """Builds the model, loads weights, sizes and allocates the KV pool.

        Returns the number of KV blocks.
        """
        t0 = time.perf_counter()
        ops = get_ops(self.ops_backend)
        factory = self.linear_method or (lambda prefix: None)
        self.model = LlamaForCausalLM(
            self.model_cfg, ops, self.dtype, self.device, factory, max_position=self.max_model_len
        )
        load_weights(self.model, self.path)
        self.model.eval()
        if self.ops_backend == "cuda" and self.dtype in (torch.float16, torch.bfloat16):
            self._choose_gemv()
        if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16):
            self._choose_dequant()
            self._choose_dense_algos()
        log.info(
            "loaded %s (%s, %s, ops=%s) in %.1f s",
            self.path, self.dtype, self.device, self.ops_backend, time.perf_counter() - t0,
        )
        self.num_blocks = self._decide_num_blocks()
        try:
            self._allocate_kv_cache(self.num_blocks)
        except (RuntimeError, TypeError, OverflowError) as e:  # out of memory, or a size past int64
            from ..errors import ModelLoadError

            self._free_kv_cache()
            size = self.num_blocks * kv_block_bytes(self.model_cfg, self.block_size, self.dtype)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ModelLoadError(
                f"the KV pool of {self.num_blocks} blocks ({size / 2**30:.1f} GiB) cannot be allocated on "
                f"{self.device}: {type(e).__name__}: {reason}; lower num_kv_blocks or kv_cache_memory"
            ) from e
        per_seq = -(-self.max_model_len // self.block_size)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB); %.1f sequences of max_model_len=%d fit at once",
            self.num_blocks, self.block_size,
            self.num_blocks * kv_block_bytes(self.model_cfg, self.block_size, self.dtype) / 2**20,
            self.num_blocks / per_seq, self.max_model_len,
        )
        self.capture_graphs()
        return self.num_blocks

    def _decide_num_blocks(self) -> int:
        cfg = self.cfg
        per_block = kv_block_bytes(self.model_cfg, self.block_size, self.dtype)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = cfg.default_cpu_kv_cache_bytes
        num = budget // per_block
        if num < 1:
            from ..errors import ModelLoadError

            raise ModelLoadError(
                f"the KV-cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                "raise kv_cache_memory / gpu_memory_utilization or lower block_size"
            )
        return int(num)

    def _profile_cuda_budget(self) -> int:
        """Bytes left for KV blocks: ``gpu_memory_utilization`` of the card minus what the
        weights and one forward pass at ``max_num_batched_tokens`` tokens took at peak."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        self._allocate_kv_cache(blocks)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device).unsqueeze(0),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.inference_mode():
            hidden = self.model(ids, torch.arange(n, device=self.device), meta)
            logits = self.model.compute_logits(hidden[-min(n, self.cfg.max_num_seqs):])
            del hidden, logits
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self._free_kv_cache()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free, _ = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.cfg.gpu_memory_utilization) - peak - max(used_elsewhere, 0)
        log.info(
            "memory profile: total %.1f GiB, weights+activations peak %.2f GiB, other processes %.2f GiB, "
            "KV budget %.2f GiB",
            total / 2**30, peak / 2**30, max(used_elsewhere, 0) / 2**30, budget / 2**30,
        )
        return max(budget, 0)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.model_cfg
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        # One counter per (sequence, kv head) of a decode batch, for the attention kernel's
        # split-K combine; the layers take turns with it (one stream).
        counters = None
        if self.device.type == "cuda":
            counters = torch.zeros(max(self.cfg.max_num_seqs, 1) * c.num_kv_heads, dtype=torch.int32, device=self.device)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.split_counters = counters

    def _free_kv_cache(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = layer.self_attn.split_counters = None

    def shutdown(self) -> None:
        """Drops the model and the pool so their device memory can be reused."""
        if self.model is not None:
            self._free_kv_cache()
        self.model = None
        self._graphs.clear()
        self._graph_inputs = None
        self._prompt_graphs, self._prompt_inputs, self._prompt_graph_keys = {}, None, []
        self._lt_workspace = None
        self.states.clear()
        self._last_tokens, self._last_rows = None, {}
        self._unabsorbed.clear()  # (a deferred step holds its logits)
        self._deferred = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # --- CUDA graphs (device thread) --------------------------------------------------------
    def capture_graphs(self) -> None:
        """Captures the decode step (forward + logits) at a ladder of batch sizes.

        A decode batch of ``B`` sequences replays the smallest captured size >= B with the
        extra rows padded (slot -1: nothing written; length 1; outputs ignored). Kernel
        launch settings depend only on shapes and on ``max_seq_len``, which is fixed at
        ``max_model_len`` for the captured graphs.
        """
        if self.device.type != "cuda" or self.cfg.enforce_eager:
            return
        t0 = time.perf_counter()
        sizes = _decode_graph_sizes(self.cfg.max_num_seqs)
        max_bs = sizes[-1]
        max_blocks = -(-self.max_model_len // self.block_size)
        dev = self.device
        g = self._graph_inputs = {
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev),
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
        }
        self._graphs = {}
        pool = None
        for b in reversed(sizes):
            meta = AttentionMetadata(
                g["slot_mapping"][:b], g["block_tables"][:b], g["seq_lens"][:b], g["query_start_loc"][: b + 1],
                max_query_len=1, max_seq_len=self.max_model_len,
            )
            with torch.inference_mode():
                for _ in range(2):  # warm up: autotuning and lazy initialisation stay out of the graph
                    self.model.compute_logits(self.model(g["input_ids"][:b], g["positions"][:b], meta))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.compute_logits(self.model(g["input_ids"][:b], g["positions"][:b], meta))
                pool = graph.pool()
            self._graphs[b] = (graph, logits)
        self._graph_sizes = sizes
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", sizes, time.perf_counter() - t0)
        self._capture_prompt_graphs(pool)

    def _capture_prompt_graphs(self, pool) -> None:
        """Captures steps that compute prompt tokens (alone or with decodes) at a ladder of
        token counts up to ``_MAX_PROMPT_GRAPH_TOKENS``.

        Launching a step's few hundred kernels one by one costs about as much host time as
        a short step costs on the device, so a short prompt chunk over a cached prefix
        would otherwise wait on Python. A step of ``T`` tokens from ``B`` sequences replays
        the smallest captured size ``P >= T`` with room for more than ``B`` sequences
        (``min(P, max_num_seqs + 1)`` slots, and up to ``_NARROW_PROMPT_TOKENS`` tokens
        also a variant with ``_NARROW_PROMPT_SLOTS``): the ``P - T`` extra tokens form one
        padding sequence (no cached context, slot -1: nothing is written), and the
        sequences after it have no tokens, so their programs exit. Those programs still
        cost a launch each, per head and context split: a short chunk from one request (a
        prefix-cache hit) takes the narrow variant. Logits are computed for one row per
        sequence slot.
        """
        keys = _prompt_graph_keys(self.cfg.max_num_batched_tokens, self.cfg.max_num_seqs)
        if not keys:
            return
        t0 = time.perf_counter()
        sizes = sorted({t for t, _ in keys})
        max_blocks = -(-self.max_model_len // self.block_size)
        self._prompt_graphs, self._prompt_inputs = {}, {}
        for t, b in reversed(keys):
            # Each graph reads its own packed inputs (one copy writes them all), set up
            # as a valid step to warm up and capture with: one sequence of t tokens, no context.
            g = self._prompt_inputs[t, b] = _PromptGraphInputs(t, b, max_blocks, self.device)
            g.seq_lens[0] = t
            g.query_start_loc.fill_(t)
            g.query_start_loc[0] = 0
            meta = AttentionMetadata(
                g.slot_mapping, g.block_tables, g.seq_lens, g.query_start_loc,
                max_query_len=t, max_seq_len=self.max_model_len,
            )
            with torch.inference_mode():
                def step():
                    hidden = self.model(g.input_ids, g.positions, meta)
                    return self.model.compute_logits(hidden[g.logits_idx])

                for _ in range(2):
                    step()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = step()
                pool = graph.pool()
            self._prompt_graphs[t, b] = (graph, logits)
        self._prompt_graph_keys = keys
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for prompt steps of up to %s tokens (%d graphs, the shortest also with %d "
                 "sequence slots) in %.1f s", sizes, len(keys), _NARROW_PROMPT_SLOTS, time.perf_counter() - t0)

    def _replay_prompt(self, key: tuple[int, int], host: "_HostInputs") -> torch.Tensor:
        """Writes the step into the graph's packed inputs with one copy and replays it;
        the logits of the sampled rows."""
        g = self._prompt_inputs[key]
        n_seq, width = host.tables.shape
        full_rows = n_seq * g.max_blocks * 4 <= _PACKED_TABLE_BYTES
        size = g.packed_words(n_seq) if full_rows else g.table_offset
        narrow = 0 if full_rows else -(-n_seq * width // 2)  # the table's words, sent apart
        if self.device.type == "cuda":
            buf, words, event = self._staging(size + narrow)
        else:
            buf = torch.empty(size + narrow, dtype=torch.int64)
            words, event = buf.numpy(), None
        g.pack(words[:size], host, full_rows)
        g.buf[:size].copy_(buf[:size], non_blocking=True)
        if not full_rows:  # long block tables: only the step's columns travel (a strided copy)
            tables = words[size : size + narrow].view(np.int32)[: n_seq * width]
            tables[:] = host.tables.reshape(-1)
            src = buf[size:].view(torch.int32)[: n_seq * width].view(n_seq, width)
            g.block_tables[:n_seq, :width].copy_(src, non_blocking=True)
        if event is not None:
            event.record()
        n_fill = host.fill_dst.size
        if n_fill:
            self._fill_placeholders(g.input_ids, g.fill_dst[:n_fill], g.fill_src[:n_fill])
        graph, logits = self._prompt_graphs[key]
        graph.replay()
        return logits[: host.logits_idx.size]

    def _prompt_graph_for(self, num_tokens: int, num_seqs: int) -> Optional[tuple[int, int]]:
        """The captured prompt graph (tokens, sequence slots) for this step: the fewest
        tokens, then the fewest slots, that hold it (one slot for the padding)."""
        for t, b in getattr(self, "_prompt_graph_keys", ()):
            if t >= num_tokens and b > num_seqs:
                return t, b
        return None

    def _graph_for(self, batch: int):
        for b in self._graph_sizes:
            if b >= batch:
                return b
        return None

    # --- one step (device thread) ------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """Runs one step and waits for it: the sampled token of every sequence that
        samples (and its logprobs where asked for)."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Enqueues one step (inputs, forward pass, sampling) without waiting for the
        device. Steps must be launched in the order they were scheduled."""
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
            self._pooling.discard(req_id)
        for new in out.new_requests:
            gen = None
            if new.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(new.seed)
            st = _SeqState(new.params, new.prompt_token_ids, [], new.stop_token_ids, gen)
            if new.params.structured_outputs is not None:
                st.guide = self._guides()(new.params.structured_outputs, new.stop_token_ids)
            if new.params.allowed_token_ids or new.bad_word_ids:
                st.token_filter = TokenFilter(new.params.allowed_token_ids, new.bad_word_ids, self.model_cfg.vocab_size)
            if new.pooling:
                self._pooling.add(new.req_id)
            self.states[new.req_id] = st
        if not out.seqs:
            return LaunchedStep([], None)
        if self._deferred is not None:  # this step's inputs include the tokens it samples
            self._sample_deferred()

        host = self._host_inputs(out)
        # Rows that end an embedding request's prompt: their hidden states are kept, which
        # only the eager forward pass exposes (graphs compute the sampled rows' logits).
        pool = []
        if self._pooling:
            pool = [i for i, (req_id, end) in enumerate(zip(host.sampling_ids, host.sample_ends))
                    if req_id in self._pooling and end == len(self.states[req_id].prompt_token_ids)]
        graph_bs = self._graph_for(len(out.seqs)) if host.is_decode and self._graphs and not pool else None
        prompt_t = None
        if not host.is_decode and host.plp is None and not pool:
            prompt_t = self._prompt_graph_for(host.input_ids.size, len(out.seqs))
        plp = pooled = None
        if prompt_t is not None:
            logits = self._replay_prompt(prompt_t, host)
        else:
            inputs = self._upload(host)
            if graph_bs is not None:
                logits = self._replay(graph_bs, inputs)
            else:
                self._fill_placeholders(inputs.input_ids, inputs.fill_dst, inputs.fill_src)
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
                logits = self.model.compute_logits(hidden[inputs.logits_idx])
                if inputs.plp is not None:
                    plp = self._prompt_logprobs(hidden, inputs.plp)
                if pool:
                    rows = inputs.logits_idx[torch.tensor(pool, device=inputs.logits_idx.device)]
                    pooled = ([host.sampling_ids[i] for i in pool], hidden[rows].float())
        states = tuple(self.states[req_id] for req_id in host.sampling_ids)
        waits = False
        for st, end in zip(states, host.sample_ends):
            position = end - len(st.prompt_token_ids)
            st.in_flight.append(position)
            waits = waits or _waits_for_history(st, position)
        step = LaunchedStep(host.sampling_ids, None, plp, states, pooled=pooled)
        self._unabsorbed.append(step)
        if waits:
            # A penalty or a grammar reads the token the previous step is still sampling:
            # the forward pass is queued now, its sampling once that token is on the host.
            step.deferred = (logits, host.sample_ends)
            self._deferred = step
        else:
            self._sample(step, logits, host.sample_ends)
        return step

    def _sample(self, step: LaunchedStep, logits: torch.Tensor, sample_ends: list[int]) -> None:
        """Enqueues the sampling of ``step``'s rows from ``logits``; their inputs (history,
        grammar states) are the tokens collected so far, which must be complete."""
        rows = []
        for st, end in zip(step.states, sample_ends):
            generated = end - len(st.prompt_token_ids)  # output tokens before the one sampled now
            if len(st.output_token_ids) > generated:  # a preempted sequence resamples a dropped token
                del st.output_token_ids[generated:]
            if st.generator is not None:
                _position_generator(st, generated)
            allowed = None if st.guide is None else st.guide.mask(st.output_token_ids, generated)
            if st.token_filter is not None:
                allowed = st.token_filter.mask(st.output_token_ids, generated, allowed)
            rows.append(SamplingRow(
                st.params, st.prompt_token_ids, st.output_token_ids, st.stop_token_ids, st.generator, generated, allowed
            ))
        tokens, step.pending = sample_async(logits, rows)  # (its event also covers plp's tensors)
        self._last_tokens = tokens
        self._last_rows = {req_id: i for i, req_id in enumerate(step.sampling_ids)}

    def _sample_deferred(self) -> None:
        """Samples the step whose sampling waited for earlier tokens, collecting (waiting
        for) the steps before it first."""
        step = self._deferred
        while self._unabsorbed[0] is not step:
            self._absorb(self._unabsorbed[0])
        self._deferred = None
        logits, sample_ends = step.deferred
        step.deferred = None
        self._sample(step, logits, sample_ends)

    def _prompt_logprobs(self, hidden: torch.Tensor, plp: tuple) -> tuple:
        """Log-probabilities of the prompt tokens this step's chunks predict (and each
        position's top k), from fp32 logits of the hidden state before each of them."""
        seqs, rows, targets = plp
        lp = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1)
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
        k = max(s[3] for s in seqs)
        top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (None, None)
        return seqs, targets, chosen, token_ranks(lp, chosen), top_ids, top_lp

    def collect(self, step: LaunchedStep) -> ModelOutput:
        """Waits for a launched step's tokens (and logprobs) to reach the host. Steps are
        collected in launch order: collecting one first collects those before it."""
        result = self._absorb(step)
        if self._deferred is not None and self._unabsorbed[0] is self._deferred:
            # The next step's history is now complete: its sampling goes on the device
            # behind its forward pass, which is still running.
            self._sample_deferred()
        return result

    def _absorb(self, step: LaunchedStep) -> ModelOutput:
        """Waits for ``step`` (after the steps launched before it) and adds its tokens to
        the sequences' histories, once; later calls return the same output."""
        if step.output is not None:
            return step.output
        if step.pending is None and step.deferred is None:
            return ModelOutput({}, {})
        while self._unabsorbed[0] is not step:
            self._absorb(self._unabsorbed[0])
        if step.deferred is not None:
            self._sample_deferred()
        result = ModelOutput({}, {})
        tokens, logprobs = step.pending.result()
        if step.prompt_logprobs is not None:
            result.prompt_logprobs = _prompt_logprobs_to_host(step.prompt_logprobs)
        if step.pooled is not None:
            ids, rows = step.pooled
            rows = rows.cpu()
            result.pooled = {req_id: rows[i] for i, req_id in enumerate(ids)}
        for req_id, st, tok, lp in zip(step.sampling_ids, step.states, tokens, logprobs):
            # (If the request ended while the step ran, the scheduler drops the token; its
            # state is no longer in self.states, and a new request with its id has another.)
            position = st.in_flight.popleft()
            if all(later > position for later in st.in_flight):
                del st.output_token_ids[position:]  # (tokens a preemption dropped)
                st.output_token_ids.append(tok)
            # else the sequence was preempted and a later step samples this position
            # again: that token, not this one, goes into its history.
            result.sampled[req_id] = tok
            if lp is not None:
                result.logprobs[req_id] = lp
        self._unabsorbed.popleft()
        step.output = result
        return result

    def _fill_placeholders(self, input_ids: torch.Tensor, fill_dst: Optional[torch.Tensor],
                           fill_src: Optional[torch.Tensor]) -> None:
        """Writes the previous launch's device-side samples (rows ``fill_src``) over the
        placeholder inputs (rows ``fill_dst``); nothing where ``fill_dst`` is None."""
        if fill_dst is not None:
            input_ids.index_copy_(0, fill_dst, self._last_tokens.index_select(0, fill_src))

    def _replay(self, b: int, inputs: "_StepInputs") -> torch.Tensor:
        g = self._graph_inputs
        n = inputs.input_ids.shape[0]
        g["input_ids"][:n].copy_(inputs.input_ids)
        self._fill_placeholders(g["input_ids"], inputs.fill_dst, inputs.fill_src)
        g["positions"][:n].copy_(inputs.positions)
        g["slot_mapping"][:n].copy_(inputs.meta.slot_mapping)
        g["slot_mapping"][n:b].fill_(-1)
        g["seq_lens"][:n].copy_(inputs.meta.seq_lens)
        g["seq_lens"][n:b].fill_(1)
        width = inputs.meta.block_tables.shape[1]
        g["block_tables"][:n, :width].copy_(inputs.meta.block_tables)
        graph, logits = self._graphs[b]
        graph.replay()
        return logits[:n]

    def _prepare(self, out: SchedulerOutput) -> "_StepInputs":
        """The step's inputs on the device (the eager and decode-graph steps' form)."""
        return self._upload(self._host_inputs(out))

    def _host_inputs(self, out: SchedulerOutput) -> "_HostInputs":
        """The step's index arrays, built with numpy on the host."""
        if len(out.seqs) == 1:
            return self._host_inputs_one(out.seqs[0])
        return self._host_inputs_many(out.seqs)

    def _host_inputs_one(self, s) -> "_HostInputs":
        """:meth:`_host_inputs_many` for a step of one sequence (a request's prompt at an
        idle engine, one stream's decode) in a third of the numpy calls: this work lies
        between a request's arrival and the start of its first step on the device."""
        bs = self.block_size
        q, start = len(s.token_ids), s.start_pos
        end = start + q
        input_ids = np.array(s.token_ids, dtype=np.int64)
        positions = np.arange(start, end, dtype=np.int64)
        tables = np.array(s.block_ids, dtype=np.int64).reshape(1, -1)
        slot_mapping = tables[0, positions // bs] * bs + positions % bs
        qsl = np.array((0, q), dtype=np.int64)
        if s.sample:
            logits_idx, sampling_ids, sample_ends = np.array((q - 1,), dtype=np.int64), [s.req_id], [end]
        else:
            logits_idx, sampling_ids, sample_ends = _NO_ROWS, [], []
        plp = self._prompt_logprob_rows((s,), qsl) if s.prompt_logprobs else None
        fill_dst = fill_src = _NO_ROWS
        if s.token_ids[0] == PLACEHOLDER:
            fill_dst, fill_src = np.zeros(1, dtype=np.int64), self._fill_src((s.req_id,))
        return _HostInputs(
            input_ids, positions, slot_mapping, logits_idx, fill_dst, fill_src, np.array((end,), dtype=np.int64), qsl,
            tables, q, sampling_ids, sample_ends, q == 1, plp,
        )

    def _host_inputs_many(self, seqs) -> "_HostInputs":
        """The step's index arrays for any number of sequences."""
        bs = self.block_size
        n = len(seqs)
        q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=n)
        seq_lens = starts + q_lens
        qsl = np.zeros(n + 1, dtype=np.int64)
        q_lens.cumsum(out=qsl[1:])
        total = int(qsl[-1])
        if total == n:  # all decodes: one token each
            input_ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
            seq_of_token = np.arange(n)
            positions = starts
        else:
            input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=total)
            # Position of every token: its sequence's start plus its offset within the chunk.
            seq_of_token = np.repeat(np.arange(n), q_lens)
            positions = starts[seq_of_token] + (np.arange(total) - qsl[:-1][seq_of_token])
        max_blocks = max(len(s.block_ids) for s in seqs)
        tables = np.zeros((n, max_blocks), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_ids)] = s.block_ids
        block_idx, offset = np.divmod(positions, bs)
        slot_mapping = tables[seq_of_token, block_idx] * bs + offset
        sample_rows = [i for i, s in enumerate(seqs) if s.sample]
        logits_idx = qsl[1:][sample_rows] - 1
        plp = self._prompt_logprob_rows(seqs, qsl)
        # Inputs still being sampled by the previous launch (always a chunk's only token).
        fill = [i for i, s in enumerate(seqs) if s.token_ids[0] == PLACEHOLDER]
        fill_dst = qsl[:-1][fill]
        fill_src = self._fill_src([seqs[i].req_id for i in fill])
        return _HostInputs(
            input_ids, positions, slot_mapping, logits_idx, fill_dst, fill_src, seq_lens, qsl, tables,
            int(q_lens.max()), [seqs[i].req_id for i in sample_rows], seq_lens[sample_rows].tolist(), total == n, plp,
        )

    def _fill_src(self, req_ids) -> np.ndarray:
        """The previous launch's sample row of each of these sequences, whose input token
        that launch is still sampling."""
        try:
            return np.fromiter((self._last_rows[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        except KeyError as e:
            raise RuntimeError(f"sequence {e.args[0]!r} has a pending token the previous step did not sample") from None

    def _upload(self, host: "_HostInputs") -> "_StepInputs":
        """Moves the step's arrays to the device in one copy.

        The int32 inputs (seq_lens, query_start_loc, block tables) and the int64 ones are
        packed into one int64 host array, the int32 section reinterpreted in place, so the
        device gets every input with one transfer and no dtype conversion. Each int32 part
        starts on a 16-byte boundary, as a tensor of its own would::

            flat, int64:   [ int32 section (h words) | ids | positions | slots | logits_idx | fill_dst | fill_src ]
            int32 section: [ seq_lens, pad | qsl, pad | tables, pad ]
                             0               q0          t0
        """
        n, max_blocks = host.tables.shape
        # int32 parts at 16-byte boundaries: seq_lens at 0, qsl at q0, the tables at t0.
        q0 = -(-n // 4) * 4
        t0 = q0 + -(-(n + 1) // 4) * 4
        h = -(-(t0 + n * max_blocks) // 4) * 2  # int64 words of the int32 section
        parts64 = (host.input_ids, host.positions, host.slot_mapping, host.logits_idx, host.fill_dst, host.fill_src)
        sizes64 = [a.size for a in parts64]
        flat = np.empty(h + sum(sizes64), dtype=np.int64)
        sec32 = flat[:h].view(np.int32)
        sec32[:n] = host.seq_lens
        sec32[q0 : q0 + n + 1] = host.qsl
        sec32[t0 : t0 + n * max_blocks] = host.tables.reshape(-1)
        np.concatenate(parts64, out=flat[h:])
        if self.device.type == "cuda":
            buf, words, event = self._staging(flat.size)
            words[: flat.size] = flat
            dev = buf[: flat.size].to(self.device, non_blocking=True)
            event.record()
        else:
            dev = torch.from_numpy(flat)
        ids_t, pos_t, slot_t, logits_t, fill_dst_t, fill_src_t = dev[h:].split_with_sizes(sizes64)
        dev32 = dev[:h].view(torch.int32)
        seq_lens_t, qsl_t, tables_t = dev32[:n], dev32[q0 : q0 + n + 1], dev32[t0 : t0 + n * max_blocks]
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            block_tables=tables_t.view(n, max_blocks),
            seq_lens=seq_lens_t,
            query_start_loc=qsl_t,
            max_query_len=host.max_query_len,
            max_seq_len=int(host.seq_lens.max()),
        )
        plp = host.plp
        if plp is not None:
            rows_t, targets_t = torch.from_numpy(plp[1]), torch.from_numpy(plp[2])
            if self.device.type == "cuda":  # pinned and asynchronous: no wait for the device
                rows_t = rows_t.pin_memory().to(self.device, non_blocking=True)
                targets_t = targets_t.pin_memory().to(self.device, non_blocking=True)
            plp = (plp[0], rows_t, targets_t)
        fill = host.fill_dst.size > 0
        return _StepInputs(
            ids_t, pos_t, meta, logits_t, host.sampling_ids, host.sample_ends, host.is_decode,
            fill_dst_t if fill else None, fill_src_t if fill else None, plp,
        )

    def _prompt_logprob_rows(self, seqs, qsl) -> Optional[tuple]:
        """For chunks that report prompt logprobs: ``(per-sequence (req_id, first predicted
        position, count, k), token rows [R], predicted prompt tokens [R])``, or None."""
        entries, rows, targets = [], [], []
        for i, s in enumerate(seqs):
            if not s.prompt_logprobs:
                continue
            st = self.states[s.req_id]
            prompt = st.prompt_token_ids
            # Token at position p predicts position p + 1, while that is still in the prompt.
            last = min(s.start_pos + len(s.token_ids), len(prompt) - 1)
            count = last - s.start_pos
            if count <= 0:
                continue
            entries.append((s.req_id, s.start_pos + 1, count, st.params.prompt_logprobs))
            rows.extend(range(int(qsl[i]), int(qsl[i]) + count))
            targets.extend(prompt[s.start_pos + 1 : last + 1])
        if not entries:
            return None
        return entries, np.asarray(rows, dtype=np.int64), np.asarray(targets, dtype=np.int64)

    def _staging(self, size: int) -> tuple[torch.Tensor, np.ndarray, "torch.cuda.Event"]:
        """A pinned host buffer of at least ``size`` int64s (as a tensor and as an array)
        and the event to record after copying from it.
        Buffers rotate, and one is rewritten only after its last copy finished, as steps
        are launched ahead of the device."""
        if not self._staging_ring:
            self._staging_ring = [[None, torch.cuda.Event(), None] for _ in range(3)]
        slot = self._staging_ring[self._staging_next]
        self._staging_next = (self._staging_next + 1) % len(self._staging_ring)
        buf, event, words = slot
        event.synchronize()  # returns at once unless the device is three steps behind
        if buf is None or buf.numel() < size:
            buf = slot[0] = torch.empty(max(size, 1 << 16), dtype=torch.int64, pin_memory=True)
            words = slot[2] = buf.numpy()
        return buf, words, event


@dataclasses.dataclass
class _HostInputs:
    """A step's inputs as host arrays (int64), before they travel to the device."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    logits_idx: np.ndarray  # [S] rows of the hidden states that sample
    fill_dst: np.ndarray  # [F] input rows to take from the previous launch's samples
    fill_src: np.ndarray  # [F] ... and which of its rows
    seq_lens: np.ndarray  # [N]
    qsl: np.ndarray  # [N + 1] query start locations
    tables: np.ndarray  # [N, W] block tables, W = the step's longest
    max_query_len: int
    sampling_ids: list[str]  # the S sequences that sample, in row order
    sample_ends: list[int]  # ... and how many tokens each has before the sampled one
    is_decode: bool  # every sequence computes exactly one token
    plp: Optional[tuple] = None  # prompt-logprob rows (see ModelRunner._prompt_logprob_rows), on the host


# An empty index array (no sampled rows, no placeholders), shared and never written.
_NO_ROWS = np.empty(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False

# Block-table rows of up to this many bytes travel whole, in the prompt graph's one copy;
# longer ones (long max_model_len, many sequences) only the step's columns, in a second.
_PACKED_TABLE_BYTES = 64 << 10


class _PromptGraphInputs:
    """The inputs of one prompt-step graph of ``t`` tokens and ``b`` sequence slots,
    packed in one int64 device buffer so that a step writes all of them, padding
    included, with one host-to-device copy::

        words: [ ids | positions | slots | logits_idx | fill_dst | fill_src | seq_lens | qsl | block tables ]
                 t     t           t       b            b          b          b int32    b+1   b x max_blocks int32

    Every part starts on a 16-byte boundary. ``fill_dst`` and ``fill_src`` are not read
    by the graph: they say which inputs to overwrite with the previous launch's samples
    before the replay. The block tables come last, so a step copies the rows of its own
    sequences and leaves the others' earlier (valid) block ids in place.
    """

    def __init__(self, num_tokens: int, num_slots: int, max_blocks: int, device):
        t, b = num_tokens, num_slots
        self.num_tokens, self.num_slots, self.max_blocks = t, b, max_blocks
        offsets, words = [], 0
        for n in (t, t, t, b, b, b, -(-b // 2), -(-(b + 1) // 2), -(-b * max_blocks // 2)):
            offsets.append(words)
            words += -(-n // 2) * 2
        self.offsets = offsets
        self.table_offset = offsets[8]
        self.buf = torch.zeros(words, dtype=torch.int64, device=device)
        o = offsets
        self.input_ids, self.positions, self.slot_mapping = (self.buf[o[i] : o[i] + t] for i in range(3))
        self.logits_idx, self.fill_dst, self.fill_src = (self.buf[o[i] : o[i] + b] for i in range(3, 6))
        self.slot_mapping.fill_(-1)
        as32 = self.buf.view(torch.int32)
        self.seq_lens = as32[2 * o[6] : 2 * o[6] + b]
        self.query_start_loc = as32[2 * o[7] : 2 * o[7] + b + 1]
        self.block_tables = as32[2 * o[8] : 2 * o[8] + b * max_blocks].view(b, max_blocks)

    def packed_words(self, num_seqs: int) -> int:
        """Words a step of ``num_seqs`` sequences copies when its table rows travel whole."""
        return self.table_offset + -(-num_seqs * self.max_blocks // 2)

    def pack(self, flat: np.ndarray, host: _HostInputs, full_rows: bool) -> None:
        """Writes the step into ``flat``, laid out as ``buf``'s first ``flat.size`` words:
        the step's tokens, then padding (token 0 at position 0, slot -1: nothing written)
        up to ``t`` tokens as one more sequence, and sequence slots after it with no
        tokens; with ``full_rows``, the block-table rows of the step's sequences."""
        t, b = self.num_tokens, self.num_slots
        o = self.offsets
        n_tok, n_seq, n_sample, n_fill = host.input_ids.size, host.seq_lens.size, host.logits_idx.size, host.fill_dst.size
        for off, values, pad in ((o[0], host.input_ids, 0), (o[1], host.positions, 0), (o[2], host.slot_mapping, -1)):
            flat[off : off + n_tok] = values
            flat[off + n_tok : off + t] = pad
        flat[o[3] : o[3] + n_sample] = host.logits_idx
        flat[o[3] + n_sample : o[3] + b] = 0  # rows left from a larger step would be out of range
        flat[o[4] : o[4] + n_fill] = host.fill_dst
        flat[o[5] : o[5] + n_fill] = host.fill_src
        as32 = flat.view(np.int32)
        seq_lens = as32[2 * o[6] : 2 * o[6] + b]
        seq_lens[:n_seq] = host.seq_lens
        seq_lens[n_seq:] = 0
        seq_lens[n_seq : n_seq + 1] = t - n_tok  # the padding sequence (maybe empty)
        qsl = as32[2 * o[7] : 2 * o[7] + b + 1]
        qsl[: n_seq + 1] = host.qsl
        qsl[n_seq + 1 :] = t
        if full_rows:
            width = host.tables.shape[1]
            rows = as32[2 * o[8] : 2 * o[8] + n_seq * self.max_blocks].reshape(n_seq, self.max_blocks)
            rows[:, :width] = host.tables
            rows[:, width:] = 0
            as32[2 * o[8] + rows.size : 2 * flat.size] = 0  # the next row's first id, if the last word holds it


@dataclasses.dataclass
class _StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_idx: torch.Tensor  # [S] rows of the hidden states that sample
    sampling_ids: list[str]  # the S sequences that sample, in row order
    sample_ends: list[int]  # ... and how many tokens each has before the sampled one
    is_decode: bool  # every sequence computes exactly one token
    fill_dst: Optional[torch.Tensor] = None  # input rows to take from the previous launch's samples
    fill_src: Optional[torch.Tensor] = None  # ... and which of its rows
    plp: Optional[tuple] = None  # prompt-logprob rows (see ModelRunner._prompt_logprob_rows)


def _prompt_logprobs_to_host(plp: tuple) -> dict[str, list[tuple[int, TokenLogprob]]]:
    seqs, targets, chosen, ranks, top_ids, top_lp = plp
    targets, chosen, ranks = targets.tolist(), chosen.tolist(), ranks.tolist()
    top_ids = top_ids.tolist() if top_ids is not None else None
    top_lp = top_lp.tolist() if top_lp is not None else None
    out: dict[str, list[tuple[int, TokenLogprob]]] = {}
    r = 0
    for req_id, first, count, k in seqs:
        items = []
        for j in range(count):
            top = tuple(zip(top_ids[r][:k], top_lp[r][:k])) if k else ()
            items.append((first + j, TokenLogprob(targets[r], chosen[r], top, ranks[r])))
            r += 1
        out[req_id] = items
    return out
