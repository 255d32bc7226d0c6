"""Checks the Triton backend on a CUDA GPU at real model sizes and times it.

Every kernel is compared with its torch reference (:mod:`asyncgen._ops.reference`), then
timed with ``triton.testing.do_bench`` (L2 flushed between runs). The table reports the
bytes each call must move, the time, the achieved bandwidth and its share of 4.3 TB/s
(about what an H200's HBM3e sustains; the time floor of a memory-bound kernel is
``bytes / 4.3 TB/s``), and for attention the achieved TFLOP/s.

Shapes are those of a 7B Llama-family model: 32 query heads, 8 (GQA) or 32 (MHA) kv heads,
head_dim 128, hidden 4096, intermediate 11008, KV block size 16.

Run from the repository root (no pytest needed)::

    PYTHONPATH=. python tests/gpu/check_triton_ops.py [--dtype bf16|fp16|fp32] [--quick]
                                                      [--sweep] [--no-graph]

``--sweep`` also times alternative tile configurations of the attention kernels and
prints the fastest one per case, to tune ``_decode_config`` / ``_general_config``.
Exits with status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import triton
from triton.testing import do_bench

from asyncgen._ops import get_ops
from asyncgen._ops import reference as ref
from asyncgen._ops import triton_paged_attention as tpa

HBM_BYTES_PER_S = 4.3e12
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (atol, rtol) against the fp32 references. Attention on the GPU rounds the softmax
# probabilities to the input dtype before the PV product, hence the looser 16-bit bounds.
TOL = {torch.float32: (2e-4, 2e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}

NUM_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK_SIZE = 32, 128, 4096, 11008, 16


@dataclass
class Row:
    op: str
    case: str
    max_err: float
    ok: bool
    ms: float
    num_bytes: float
    flops: float = 0.0
    torch_ms: float | None = None


ROWS: list[Row] = []


def bench(fn) -> float:
    """Median milliseconds of ``fn``."""
    try:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    except TypeError:  # older triton: no return_mode
        return do_bench(fn, warmup=25, rep=100)


def bench_graph(fn, reps: int = 20) -> float:
    """Milliseconds of ``fn`` replayed from a CUDA graph of ``reps`` calls (best of 5): its
    device time without the host's launch costs, as inside the engine's graphs."""
    from asyncgen._ops import cuda_backend

    return cuda_backend.graph_time_ms(lambda _: fn(), [None] * reps, passes=5)


def compare(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    atol, rtol = TOL[dtype]
    a, e = actual.float(), expected.float()
    err = (a - e).abs()
    ok = bool(torch.isfinite(a).all()) and bool((err <= atol + rtol * e.abs()).all())
    return float(err.max()) if err.numel() else 0.0, ok


def record(op, case, err_ok, ms, num_bytes, flops=0.0, torch_ms=None) -> None:
    ROWS.append(Row(op, case, err_ok[0], err_ok[1], ms, num_bytes, flops, torch_ms))
    r = ROWS[-1]
    print(f"  {op:<16} {case:<40} {'ok ' if r.ok else 'FAIL'} {ms * 1e3:9.1f} us", flush=True)


# ----------------------------------------------------------------------------------------
# Elementwise ops


def check_rms_norm(ops, dtype, token_counts):
    es = torch.finfo(dtype).bits // 8
    weight = torch.randn(HIDDEN, dtype=dtype, device="cuda")
    for num_tokens in token_counts:
        for with_residual in (False, True):
            x = torch.randn(num_tokens, HIDDEN, dtype=dtype, device="cuda")
            residual = torch.randn_like(x) if with_residual else None
            got = ops.rms_norm(x, weight, 1e-6, residual)
            want = ref.rms_norm(x, weight, 1e-6, residual)
            e1, ok1 = compare(got[0], want[0], dtype)
            e2, ok2 = compare(got[1], want[1], dtype)
            out = torch.empty_like(x)
            res_out = torch.empty_like(x) if with_residual else None
            ms = bench(lambda: ops.rms_norm(x, weight, 1e-6, residual, out=out, residual_out=res_out))
            torch_ms = bench(lambda: ref.rms_norm(x, weight, 1e-6, residual))
            moved = num_tokens * HIDDEN * es * (4 if with_residual else 2) + HIDDEN * es
            record("rms_norm", f"T={num_tokens} residual={with_residual}", (max(e1, e2), ok1 and ok2), ms, moved,
                   torch_ms=torch_ms)


def _cos_sin_cache(max_position: int) -> torch.Tensor:
    inv_freq = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device="cuda") / HEAD_DIM))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cuda"), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, head_dim]


def check_rotary(ops, dtype, token_counts):
    es = torch.finfo(dtype).bits // 8
    cache = _cos_sin_cache(32768)
    for num_kv_heads in (8, 32):
        for num_tokens in token_counts:
            # q and k as views of one fused qkv projection, as the model produces them.
            qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * num_kv_heads) * HEAD_DIM, dtype=dtype, device="cuda")
            q = qkv[:, : NUM_HEADS * HEAD_DIM].view(num_tokens, NUM_HEADS, HEAD_DIM)
            k = qkv[:, NUM_HEADS * HEAD_DIM: (NUM_HEADS + num_kv_heads) * HEAD_DIM].view(num_tokens, num_kv_heads,
                                                                                          HEAD_DIM)
            positions = torch.randint(0, 32768, (num_tokens,), device="cuda")
            q_ref, k_ref = q.clone(), k.clone()
            ops.rotary_embedding(positions, q, k, cache)
            ref.rotary_embedding(positions, q_ref, k_ref, cache)
            e1, ok1 = compare(q, q_ref, dtype)
            e2, ok2 = compare(k, k_ref, dtype)
            ms = bench(lambda: ops.rotary_embedding(positions, q, k, cache))
            torch_ms = bench(lambda: ref.rotary_embedding(positions, q_ref, k_ref, cache))
            moved = 2 * num_tokens * (NUM_HEADS + num_kv_heads) * HEAD_DIM * es + num_tokens * (HEAD_DIM * 4 + 8)
            record("rotary", f"T={num_tokens} kv_heads={num_kv_heads}", (max(e1, e2), ok1 and ok2), ms, moved,
                   torch_ms=torch_ms)


def check_silu_and_mul(ops, dtype, token_counts):
    es = torch.finfo(dtype).bits // 8
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, 2 * INTERMEDIATE, dtype=dtype, device="cuda")
        err_ok = compare(ops.silu_and_mul(x), ref.silu_and_mul(x), dtype)
        out = torch.empty(num_tokens, INTERMEDIATE, dtype=dtype, device="cuda")
        ms = bench(lambda: ops.silu_and_mul(x, out=out))
        torch_ms = bench(lambda: ref.silu_and_mul(x))
        record("silu_and_mul", f"T={num_tokens}", err_ok, ms, 3 * num_tokens * INTERMEDIATE * es, torch_ms=torch_ms)


def check_store_kv_cache(ops, dtype, token_counts):
    es = torch.finfo(dtype).bits // 8
    for num_kv_heads in (8, 32):
        for num_tokens in token_counts:
            num_blocks = 2 * triton.cdiv(num_tokens, BLOCK_SIZE) + 8
            shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
            k_cache = torch.zeros(shape, dtype=dtype, device="cuda")
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
            slots[::7] = -1
            key = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
            value = torch.randn_like(key)
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            ops.store_kv_cache(key, value, k_cache, v_cache, slots)
            ref.store_kv_cache(key, value, k_ref, v_ref, slots)
            ok = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
            ms = bench(lambda: ops.store_kv_cache(key, value, k_cache, v_cache, slots))
            torch_ms = bench(lambda: ref.store_kv_cache(key, value, k_ref, v_ref, slots))
            moved = 4 * num_tokens * num_kv_heads * HEAD_DIM * es + 8 * num_tokens
            record("store_kv_cache", f"T={num_tokens} kv_heads={num_kv_heads}", (0.0, ok), ms, moved,
                   torch_ms=torch_ms)


# ----------------------------------------------------------------------------------------
# Paged attention


def make_batch(q_lens, seq_lens, num_kv_heads, dtype, head_dim=HEAD_DIM, block_size=BLOCK_SIZE):
    """A paged batch on the GPU: shuffled block ids, NaN in every slot no sequence owns."""
    blocks_per_seq = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32, device="cuda")
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device="cuda")
    used = 0
    for b, n in enumerate(seq_lens):
        ids = perm[used: used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(ids)] = ids
        owned[ids.long()] = True
        tail = n - (len(ids) - 1) * block_size
        owned[ids[-1].long(), tail:] = False
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    query_start_loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cuda")
    query_start_loc[1:] = torch.tensor(q_lens, device="cuda").cumsum(0)
    q = torch.randn(sum(q_lens), NUM_HEADS, head_dim, dtype=dtype, device="cuda")
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), query_start_loc=query_start_loc)


def sub_batch(batch: dict, num_seqs: int) -> dict:
    """The first ``num_seqs`` sequences of ``batch`` (to keep the reference cheap)."""
    qsl = batch["query_start_loc"][: num_seqs + 1]
    return dict(batch, q=batch["q"][: int(qsl[-1])], block_tables=batch["block_tables"][:num_seqs],
                seq_lens=batch["seq_lens"][:num_seqs], query_start_loc=qsl)


def attention_cost(q_lens, seq_lens, num_kv_heads, dtype, window=None) -> tuple[float, float]:
    """(bytes, flops) of one call: K/V of every attended position once per kv head (the
    query-head group shares it), q in, out back; QK^T and PV over the allowed keys."""
    es = torch.finfo(dtype).bits // 8
    kv_bytes = flops = 0.0
    for q_len, n in zip(q_lens, seq_lens):
        lo = 0 if window is None else max(0, n - q_len - window + 1)
        kv_bytes += (n - lo) * num_kv_heads * HEAD_DIM * 2 * es
        keys = sum(min(p + 1, window or p + 1) for p in range(n - q_len, n))  # allowed keys per query
        flops += 4 * NUM_HEADS * HEAD_DIM * keys
    q_bytes = 2 * sum(q_lens) * NUM_HEADS * HEAD_DIM * es
    return kv_bytes + q_bytes, flops


def check_attention_case(ops, dtype, name, q_lens, seq_lens, num_kv_heads, *, window=None, hints=None,
                         verify_seqs=8, sweep=False, graph=False):
    hints = hints or {}
    batch = make_batch(q_lens, seq_lens, num_kv_heads, dtype)
    scale = HEAD_DIM ** -0.5
    out = torch.empty_like(batch["q"])
    ops.paged_attention(**batch, scale=scale, sliding_window=window, out=out, **hints)
    small = sub_batch(batch, min(verify_seqs, len(seq_lens)))
    want = ref.paged_attention(**small, scale=scale, sliding_window=window)
    err_ok = compare(out[: small["q"].shape[0]], want, dtype)
    run = lambda: ops.paged_attention(**batch, scale=scale, sliding_window=window, out=out, **hints)  # noqa: E731
    ms = bench_graph(run) if graph else bench(run)
    num_bytes, flops = attention_cost(q_lens, seq_lens, num_kv_heads, dtype, window)
    record("paged_attention", name, err_ok, ms, num_bytes, flops)
    if sweep:
        sweep_attention(ops, batch, scale, window, out, hints, name)
    del batch, out
    torch.cuda.empty_cache()


def sweep_attention(ops, batch, scale, window, out, hints, name):
    decode = hints.get("max_query_len") == 1
    original = tpa._decode_config if decode else tpa._general_config
    results = []
    if decode:  # (BLOCK_N, num_warps, num_stages)
        configs = [(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    else:  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
        configs = [(bm, bn, w, s) for bm in (32, 64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    try:
        for cfg in configs:
            if decode:
                tpa._decode_config = lambda head_dim, dtype, cfg=cfg: cfg
            else:
                tpa._general_config = lambda head_dim, group_pad, mql, dtype, cfg=cfg: (max(cfg[0], group_pad),
                                                                                        *cfg[1:])
            try:
                ms = bench(lambda: ops.paged_attention(**batch, scale=scale, sliding_window=window, out=out, **hints))
            except Exception as exc:  # out of shared memory / registers for this config
                print(f"      {cfg}: {type(exc).__name__}")
                continue
            results.append((ms, cfg))
    finally:
        if decode:
            tpa._decode_config = original
        else:
            tpa._general_config = original
    if decode:
        for splits in (1, 2, 4, 8, 16, 32):
            ms = bench(lambda: ops.paged_attention(**batch, scale=scale, sliding_window=window, out=out,
                                                   **dict(hints, num_splits=splits)))
            results.append((ms, f"default tiles, num_splits={splits}"))
    results.sort(key=lambda r: r[0])
    for ms, cfg in results[:3]:
        print(f"      sweep {name}: {cfg} {ms * 1e3:.1f} us")


def check_attention(ops, dtype, quick, sweep):
    ctx_long = 8192 if quick else 32768
    for kvh in (8, 32):
        # Decode: many sequences (the batch fills the GPU) and few with long contexts
        # (split-K). Automatic split choice, and forced single split for comparison.
        cases = [(1, ctx_long), (8, ctx_long // 4), (64, 2048), (256, 1024)]
        if not quick:
            cases += [(16, 8192), (128, 4096 if kvh == 8 else 2048)]
        for num_seqs, ctx in cases:
            lens = [ctx - (37 * i) % (ctx // 2) for i in range(num_seqs)]  # ragged, partial last blocks
            base = dict(max_query_len=1, max_seq_len=max(lens))
            splits = tpa._num_splits(num_seqs, kvh, max(lens), tpa._decode_config(HEAD_DIM, dtype)[0],
                                     torch.cuda.get_device_properties(0).multi_processor_count)
            check_attention_case(ops, dtype, f"decode B={num_seqs} ctx~{ctx} kvh={kvh} splits={splits}",
                                 [1] * num_seqs, lens, kvh, hints=base, sweep=sweep)
            if splits > 1:
                check_attention_case(ops, dtype, f"decode B={num_seqs} ctx~{ctx} kvh={kvh} splits=1",
                                     [1] * num_seqs, lens, kvh, hints=dict(base, num_splits=1))
        check_attention_case(ops, dtype, f"decode B=64 ctx~2048 kvh={kvh} general kernel", [1] * 64,
                             [2048 - (37 * i) % 1024 for i in range(64)], kvh, hints=dict(max_query_len=None))
        # Prefill and mixed batches.
        prefill_len = 2048 if quick else 8192
        check_attention_case(ops, dtype, f"prefill 1x{prefill_len} kvh={kvh}", [prefill_len], [prefill_len], kvh,
                             hints=dict(max_query_len=prefill_len, max_seq_len=prefill_len), sweep=sweep)
        check_attention_case(ops, dtype, f"chunked 4x1024 after 2048 kvh={kvh}", [1024] * 4, [3072] * 4, kvh,
                             hints=dict(max_query_len=1024, max_seq_len=3072), sweep=sweep)
        # A prefix-cache hit: 78 new tokens over 992 cached, with the hints of the engine's
        # 128-token prompt graph (the context is split), and split once for comparison.
        # Timed in a CUDA graph, as the engine runs it (two launches and the partials'
        # allocation would otherwise be timed on the host).
        cached_hints = dict(max_query_len=128, max_seq_len=4096)
        check_attention_case(ops, dtype, f"78 after 992 cached kvh={kvh} (graph)", [78], [1070], kvh,
                             hints=cached_hints, graph=True)
        check_attention_case(ops, dtype, f"78 after 992 cached kvh={kvh} splits=1 (graph)", [78], [1070], kvh,
                             hints=dict(cached_hints, num_splits=1), graph=True)
        mixed_q = [512] + [1] * 128
        mixed_n = [512] + [2048 - 13 * i for i in range(128)]
        check_attention_case(ops, dtype, f"mixed 512 + 128 decodes kvh={kvh}", mixed_q, mixed_n, kvh,
                             hints=dict(max_query_len=512, max_seq_len=2048), verify_seqs=6, sweep=sweep)
    # Sliding window (Mistral-like: 8 kv heads, window 4096).
    lens = [16384 - 101 * i for i in range(16)]
    check_attention_case(ops, dtype, "decode B=16 ctx~16K window=4096", [1] * 16, lens, 8, window=4096,
                         hints=dict(max_query_len=1, max_seq_len=max(lens)))
    check_attention_case(ops, dtype, "chunked 2x2048 after 6144 window=4096", [2048] * 2, [8192] * 2, 8,
                         window=4096, hints=dict(max_query_len=2048, max_seq_len=8192))


def engine_like_prefix_batch(num_kv_heads, dtype, slots=8):
    """The attention inputs of the engine's 128-token prompt graph with ``slots`` sequence
    slots for one prefix-cache hit: 78 new tokens over 992 cached, the padding sequence
    (50 tokens, no context), and empty slots."""
    batch = make_batch([78, 50], [1070, 50], num_kv_heads, dtype)
    extra = slots - 2
    bt = batch["block_tables"]
    batch["block_tables"] = torch.cat([bt, torch.zeros(extra, bt.shape[1], dtype=bt.dtype, device="cuda")])
    batch["seq_lens"] = torch.cat([batch["seq_lens"], torch.zeros(extra, dtype=torch.int32, device="cuda")])
    qsl = batch["query_start_loc"]
    batch["query_start_loc"] = torch.cat([qsl, qsl[-1:].repeat(extra)])
    return batch


def sweep_prefix(ops, dtype) -> None:
    """Graph-timed launch configurations of the general kernel on a prefix-cache hit (the
    engine's hints: max_query_len 128, max_seq_len 4096): tiles, warps, stages, splits."""
    import itertools

    scale = HEAD_DIM ** -0.5
    hints = dict(max_query_len=128, max_seq_len=4096)
    original_cfg = tpa._general_config
    for kvh in (32, 8):
        batch = engine_like_prefix_batch(kvh, dtype)
        out = torch.empty_like(batch["q"])
        want = ref.paged_attention(**sub_batch(batch, 1), scale=scale)
        results = []
        for bm, bn, warps, stages, splits in itertools.product(
                (16, 32, 64, 128), (32, 64, 128), (4, 8), (2, 3), (None, 4, 8, 16)):
            if bm * bn > 128 * 64:
                continue
            tpa._general_config = lambda head_dim, group_pad, mql, dt, c=(bm, bn, warps, stages): (max(c[0], group_pad), *c[1:])
            try:
                run = lambda: ops.paged_attention(**batch, scale=scale, out=out, num_splits=splits, **hints)  # noqa: E731
                run()
                _, ok = compare(out[:78], want, dtype)
                us = bench_graph(run) * 1e3
            except Exception as exc:  # out of shared memory / registers for this configuration
                print(f"      {(bm, bn, warps, stages, splits)}: {type(exc).__name__}")
                continue
            finally:
                tpa._general_config = original_cfg
            results.append((us, ok, dict(block_m=bm, block_n=bn, warps=warps, stages=stages, splits=splits)))
        run = lambda: ops.paged_attention(**batch, scale=scale, out=out, **hints)  # noqa: E731
        default = bench_graph(run) * 1e3
        results.sort(key=lambda r: r[0])
        print(f"  prefix hit kvh={kvh}: default {default:.1f} us; fastest:")
        for us, ok, cfg in results[:8]:
            print(f"      {us:6.1f} us {'ok' if ok else 'WRONG'} {cfg}")
        bad = [cfg for _, ok, cfg in results if not ok]
        if bad:
            print(f"  WRONG results from {len(bad)} configurations, e.g. {bad[:3]}")
        del batch, out
        torch.cuda.empty_cache()


def check_cuda_graph(ops, dtype):
    """A decode step (cache write + attention) captured in a CUDA graph and replayed with
    new inputs must match an eager call: the launchers must not sync or branch on values."""
    num_seqs, num_kv_heads = 32, 8
    lens = [1500 - 29 * i for i in range(num_seqs)]
    batch = make_batch([1] * num_seqs, lens, num_kv_heads, dtype)
    key = torch.randn(num_seqs, num_kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    # Each token's key goes to its own (last) position, which the attention then reads.
    last = batch["seq_lens"].long() - 1
    blocks = batch["block_tables"].long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0]
    slots = blocks * BLOCK_SIZE + last % BLOCK_SIZE
    out = torch.empty_like(batch["q"])
    hints = dict(max_query_len=1, max_seq_len=2048)

    def step():
        ops.store_kv_cache(key, value, batch["k_cache"], batch["v_cache"], slots)
        ops.paged_attention(**batch, scale=HEAD_DIM ** -0.5, out=out, **hints)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    batch["q"].copy_(torch.randn_like(batch["q"]))
    key.copy_(torch.randn_like(key))
    value.copy_(torch.randn_like(value))
    graph.replay()
    torch.cuda.synchronize()
    want = ref.paged_attention(**batch, scale=HEAD_DIM ** -0.5)
    ms = bench(graph.replay)
    num_bytes, flops = attention_cost([1] * num_seqs, lens, num_kv_heads, dtype)
    record("cuda graph", f"store_kv + decode B={num_seqs} kvh={num_kv_heads}", compare(out, want, dtype), ms,
           num_bytes, flops)


# ----------------------------------------------------------------------------------------


def compiled_variants(kernel) -> int | None:
    """How many variants of a Triton kernel are compiled (on any device), or None where
    this Triton keeps them elsewhere."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return None
    return sum(len(entry[0]) for entry in caches.values())


def check_no_compile_while_serving(ops, dtype) -> None:
    """Steps that differ only in how many sequences they hold (1, a multiple of 16, other)
    and in their block-table width reuse the attention kernels compiled for the first of
    them: a new batch composition never stalls an eager step for a Triton compile."""
    kernels = (tpa._paged_attention_kernel, tpa._paged_decode_kernel, tpa._reduce_splits_kernel)
    scale = HEAD_DIM ** -0.5
    counts = None
    ok, cases = True, 0
    for num_seqs, extra_width in ((3, 0), (16, 5), (1, 1), (17, 16), (191, 3), (254, 0)):
        # (Split counts fixed: a different count is a different kernel by design.)
        for q_len, hints in ((1, dict(max_query_len=1, max_seq_len=2048, num_splits=2)),
                             (5, dict(max_query_len=5, num_splits=2))):
            lens = [200 + 7 * i for i in range(num_seqs)]
            batch = make_batch([q_len] * num_seqs, lens, 8, dtype)
            if extra_width:  # a wider table, as an eager step with a longer sequence has
                pad = torch.zeros(num_seqs, extra_width, dtype=batch["block_tables"].dtype, device="cuda")
                batch["block_tables"] = torch.cat([batch["block_tables"], pad], dim=1)
            got = ops.paged_attention(**batch, scale=scale, **hints)
            err_ok = compare(got, ref.paged_attention(**batch, scale=scale), dtype)
            ok &= err_ok[1]
            cases += 1
        now = [compiled_variants(k) for k in kernels]
        if None in now:
            print("    (this Triton keeps compiled variants where the check cannot count them)")
            break
        if counts is None:
            counts = now
        elif now != counts:
            ok = False
            print(f"    {num_seqs} sequences compiled new variants: {counts} -> {now}")
    record("no compile", f"{cases} steps of 1-254 seqs, tables of 5 widths", (0.0, ok), float("nan"), 0.0)


def print_table() -> None:
    print()
    header = (f"{'op':<16} {'case':<44} {'ok':<4} {'max err':>9} {'time us':>9} {'floor us':>9} "
              f"{'MB':>9} {'GB/s':>7} {'% 4.3TB/s':>9} {'TFLOP/s':>8} {'torch us':>9}")
    print(header)
    print("-" * len(header))
    for r in ROWS:
        seconds = r.ms * 1e-3
        gbps = r.num_bytes / seconds / 1e9
        floor_us = r.num_bytes / HBM_BYTES_PER_S * 1e6
        tflops = f"{r.flops / seconds / 1e12:8.1f}" if r.flops else f"{'':8}"
        torch_us = f"{r.torch_ms * 1e3:9.1f}" if r.torch_ms is not None else f"{'':9}"
        print(f"{r.op:<16} {r.case:<44} {'ok' if r.ok else 'FAIL':<4} {r.max_err:9.2e} {r.ms * 1e3:9.1f} "
              f"{floor_us:9.1f} {r.num_bytes / 1e6:9.2f} {gbps:7.0f} {100 * gbps * 1e9 / HBM_BYTES_PER_S:8.1f}% "
              f"{tflops} {torch_us}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    parser.add_argument("--sweep", action="store_true", help="also time alternative attention tile configs")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA graph capture check")
    parser.add_argument("--sweep-prefix", action="store_true",
                        help="only time launch configurations of a prefix-cache hit (in CUDA graphs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device; this script checks the compiled kernels on a GPU", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"dtype {args.dtype}")
    ops = get_ops("triton")
    if args.sweep_prefix:
        sweep_prefix(ops, dtype)
        return 0
    token_counts = [1, 256, 4096] if args.quick else [1, 64, 256, 2048, 8192, 32768]
    check_rms_norm(ops, dtype, token_counts)
    check_rotary(ops, dtype, token_counts)
    check_silu_and_mul(ops, dtype, token_counts)
    check_store_kv_cache(ops, dtype, token_counts)
    check_attention(ops, dtype, args.quick, args.sweep)
    if not args.no_graph:
        check_cuda_graph(ops, dtype)
    check_no_compile_while_serving(ops, dtype)
    print_table()
    failed = [r for r in ROWS if not r.ok]
    print(f"\n{len(ROWS) - len(failed)} / {len(ROWS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
