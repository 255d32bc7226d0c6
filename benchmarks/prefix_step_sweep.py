"""Times the Triton attention kernel of a short prompt chunk over a long cached prefix (a
prefix-cache hit) at Llama-2-7B shapes on a GPU, at each of its configurations.

The step is the one ``benchmarks/online.py --compare-prefix-caching`` measures: 78 new
tokens of one sequence over 992 cached ones, replayed as the engine's 128-token prompt
graph with 8 sequence slots (the 50 padding tokens form a second sequence, the other six
slots are empty).

The general paged-attention kernel runs at each tiling (BLOCK_M, BLOCK_N, warps,
stages) and context split, split reduction included, against the configuration the
engine picks. Each configuration is first checked against the engine's.

Every timing replays one CUDA graph that cycles through 8 copies of the KV cache (more
than L2 holds), as a forward pass reads each layer's once. (Its first version also timed
the four dense products at 64-128 rows, cuBLAS against a Triton weight-streaming GEMM;
that GEMM lost and was removed: docs/BENCHMARKS.md.)

    PYTHONPATH=. python3 benchmarks/prefix_step_sweep.py [--json out.json] [--profile-once]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch

HEADS, HEAD_DIM, BLOCK_SIZE = 32, 128, 16
NEW, CACHED, GRAPH_TOKENS, SLOTS = 78, 992, 128, 8
COPIES = 8


def graph_us(calls) -> float:
    from asyncgen._ops.cuda_backend import graph_time_ms

    return 1e3 * graph_time_ms(lambda call: call(), calls, passes=5)


def attention_inputs(gen):
    """8 KV caches with random contents and a shuffled block table; q for the graph's 128
    tokens."""
    seq_len = NEW + CACHED
    pad = GRAPH_TOKENS - NEW
    blocks_needed = math.ceil(seq_len / BLOCK_SIZE) + math.ceil(pad / BLOCK_SIZE)
    num_blocks = blocks_needed + 8
    caches = []
    for _ in range(COPIES):
        k = torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, generator=gen, device="cuda").half()
        v = torch.randn(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, generator=gen, device="cuda").half()
        caches.append((k, v))
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    max_blocks = 4096 // BLOCK_SIZE
    tables = torch.zeros(SLOTS, max_blocks, dtype=torch.int32, device="cuda")
    n0 = math.ceil(seq_len / BLOCK_SIZE)
    tables[0, :n0] = perm[:n0]
    tables[1, : math.ceil(pad / BLOCK_SIZE)] = perm[n0 : n0 + math.ceil(pad / BLOCK_SIZE)]
    seq_lens = torch.zeros(SLOTS, dtype=torch.int32, device="cuda")
    seq_lens[0], seq_lens[1] = seq_len, pad
    qsl = torch.full((SLOTS + 1,), GRAPH_TOKENS, dtype=torch.int32, device="cuda")
    qsl[0], qsl[1] = 0, NEW
    q = torch.randn(GRAPH_TOKENS, HEADS, HEAD_DIM, generator=gen, device="cuda").half()
    return q, caches, tables, seq_lens, qsl


def sweep_attention(gen, results: dict, grid) -> None:
    from asyncgen._ops import triton_paged_attention as tpa

    q, caches, tables, seq_lens, qsl = attention_inputs(gen)
    scale = HEAD_DIM**-0.5
    original = tpa._general_config

    def run(cfg, splits, cache, out):
        if cfg is not None:
            tpa._general_config = lambda *a, **k: cfg
        try:
            return tpa.paged_attention(q, cache[0], cache[1], tables, seq_lens, qsl, scale, out=out,
                                       max_query_len=GRAPH_TOKENS, max_seq_len=4096, num_splits=splits)
        finally:
            tpa._general_config = original

    outs = [torch.empty_like(q) for _ in range(COPIES)]
    ref = run(None, None, caches[0], torch.empty_like(q))
    torch.cuda.synchronize()
    default_cfg = original(HEAD_DIM, 1, GRAPH_TOKENS, torch.float16)
    default_us = graph_us([lambda c=c, o=o: run(None, None, c, o) for c, o in zip(caches, outs)])
    print(f"attention default {default_cfg} (splits chosen by the engine): {default_us:.2f} us", flush=True)
    rows = [{"config": list(default_cfg), "splits": None, "us": default_us}]

    def measure(cfg, splits):
        try:
            got = run(cfg, splits, caches[0], torch.empty_like(q))
            err = (got[:NEW].float() - ref[:NEW].float()).abs().max().item()
            if not err < 2e-2:
                print(f"attention {cfg} splits {splits}: WRONG (max err {err})", flush=True)
                return None
            us = graph_us([lambda c=c, o=o: run(cfg, splits, c, o) for c, o in zip(caches, outs)])
        except Exception as e:  # out of shared memory or registers for this tiling
            print(f"attention {cfg} splits {splits}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            return None
        print(f"attention {cfg} splits {splits}: {us:.2f} us", flush=True)
        rows.append({"config": list(cfg), "splits": splits, "us": us})
        return us

    first = []
    for bm, bn, splits in itertools.product(grid.block_m, grid.block_n, grid.splits):
        warps = 8 if bm >= 128 else 4
        us = measure((bm, bn, warps, 2), splits)
        if us is not None:
            first.append((us, bm, bn, splits))
    first.sort()
    for _, bm, bn, splits in first[: grid.top]:
        for warps, stages in itertools.product(grid.warps, grid.stages):
            if (warps, stages) != (8 if bm >= 128 else 4, 2):
                measure((bm, bn, warps, stages), splits)
    best = min(rows[1:], key=lambda r: r["us"])
    print(f"attention best {best} against default {default_us:.2f} us", flush=True)
    results["attention"] = rows


def profile_once(gen) -> None:
    """The engine's attention call of the prefix-hit step, five times, eagerly."""
    from asyncgen._ops import triton_paged_attention as tpa

    q, caches, tables, seq_lens, qsl = attention_inputs(gen)
    out = torch.empty_like(q)
    for i in range(5):
        tpa.paged_attention(q, caches[i % COPIES][0], caches[i % COPIES][1], tables, seq_lens, qsl, HEAD_DIM**-0.5,
                            out=out, max_query_len=GRAPH_TOKENS, max_seq_len=4096)
    torch.cuda.synchronize()


def main() -> int:
    global GRAPH_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--graph-tokens", type=int, default=GRAPH_TOKENS,
                        help="tokens of the prompt graph the step replays (the new tokens plus padding)")
    parser.add_argument("--block-m", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--top", type=int, default=6, help="tilings of the first pass tried with other warps/stages")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--profile-once", action="store_true",
                        help="run the engine's configuration a few times eagerly and exit (for ncu)")
    args = parser.parse_args()
    GRAPH_TOKENS = args.graph_tokens
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name()}
    if args.profile_once:
        profile_once(gen)
        return 0
    sweep_attention(gen, results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
