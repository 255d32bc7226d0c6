"""On a CUDA machine: greedy tokens of the CUDA path equal transformers' generate().

A Llama-shaped model with random weights (fp32 in both, so the comparison is exact up
to kernel rounding), and a Qwen3-shaped one (q/k norms; a 128-token sliding window in
its later layers), 12 prompts of very different lengths submitted at once, in three
settings: plenty of KV blocks; a pool so small that requests are preempted; a token
budget smaller than the longest prompt (chunked prefill); requests arriving one by
one while others decode, three of them after a shared 400-token prefix is cached (mixed steps of every size, each replaying a prompt-step CUDA
graph smaller or larger than the one before); no CUDA graphs. Each kernel backend that
imports is checked. Exits non-zero on any mismatch.

    python tests/gpu/check_engine_cuda.py --tokenizer DIR
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import anyio
import torch

NEW_TOKENS = 24
GATED: dict = {}  # backend -> whether the last engine's gate|up layers take the gated GEMV


def build(directory: Path, tokenizer_dir: Path, head_dim: int, arch: str = "llama"):
    import transformers
    from transformers import AutoTokenizer

    heads = 1024 // head_dim if 1024 % head_dim == 0 else 16  # (transformers wants heads dividing the width)
    shape = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=2048,
    )
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**shape, head_dim=head_dim, use_sliding_window=True, sliding_window=128,
                                       max_window_layers=3)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        # head_dim given: 80 (16 heads of a 1,024-wide model) is not hidden / heads
        cfg, model_cls = transformers.LlamaConfig(**shape, head_dim=head_dim), transformers.LlamaForCausalLM
    torch.manual_seed(head_dim)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
            elif arch == "qwen3":  # norm weights away from 1, so that a missing q/k norm shows
                p.normal_(1.0, 0.1)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return model.cuda()


def hf_greedy(model, prompts, penalised=frozenset()):
    """transformers' greedy tokens; the prompts whose index is in ``penalised`` with
    repetition_penalty=PENALTY."""
    outs = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device="cuda")
            g = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                               repetition_penalty=PENALTY if i in penalised else 1.0)
            outs.append(g[0, len(p):].tolist())
    return outs


PENALTY = 1.3


async def engine_greedy(path, prompts, backend, stagger_s: float = 0.0, dtype="float32", logprobs=None,
                        penalised=frozenset(), **kwargs):
    from asyncgen import AsyncEngine, SamplingParams

    results = [None] * len(prompts)
    async with AsyncEngine.from_pretrained(path, device="cuda", dtype=dtype, max_model_len=1024, max_num_seqs=16, ops_backend=backend, **kwargs) as engine:

        async def one(i):
            await anyio.sleep(i * stagger_s)
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=logprobs,
                                    repetition_penalty=PENALTY if i in penalised else 1.0)
            out = await engine.generate(prompts[i], params)
            results[i] = list(out.token_ids) if logprobs is None else list(out.outputs[0].logprobs)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        stats = engine.stats()
        GATED[backend] = engine._runner.model.layers[0].mlp.gate_up_proj.gemv_gated
    return results, stats


def check_half(path: Path, prompts, label: str) -> int:
    """fp16, where the csrc decode kernels (the fused rotary + attention, the GEMVs) and the
    dependent launches run: the cuda backend against the Triton one in the same dtype.
    Rounding differs, so tokens must agree until the first position where the two
    disagree, and there the logits must be a near tie (top-2 logprobs within 0.1 in both);
    up to it, the chosen tokens' logprobs agree within 0.05. Returns the failure count.
    Requests one at a time keep every decode step at one token, where the cuda backend's
    gate|up writes silu(gate) * up itself (the gated GEMV)."""
    failures = 0
    settings = {
        "graphs": dict(num_kv_blocks=1024),
        "staggered": dict(num_kv_blocks=1024, stagger_s=0.03),
        # Each request alone: every decode step has one token.
        "one by one": dict(num_kv_blocks=1024, stagger_s=0.3),
    }
    for name, kw in settings.items():
        runs = {b: anyio.run(functools.partial(engine_greedy, path, prompts, b, dtype="float16", logprobs=2, **kw))[0]
                for b in ("triton", "cuda")}
        worst, diverged, bad = 0.0, 0, []
        for i, (a, b) in enumerate(zip(runs["triton"], runs["cuda"])):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x.token_id != y.token_id), None)
            upto = len(a) if j is None else j
            worst = max([worst] + [abs(x.logprob - y.logprob) for x, y in zip(a[:upto], b[:upto])])
            if j is not None:
                diverged += 1
                gaps = [abs(t.top[0][1] - t.top[1][1]) for t in (a[j], b[j]) if len(t.top) >= 2]
                if not gaps or max(gaps) > 0.1:
                    bad.append((i, j, gaps))
        ok = worst < 0.05 and not bad
        print(f"{label} fp16 cuda (gated GEMV {GATED.get('cuda')}) vs triton "
              f"{name:10s} max logprob diff {worst:.3f}, {diverged} prompts "
              f"diverge at a near tie{'' if not bad else f'; NOT a tie: {bad}'}  {'OK' if ok else 'MISMATCH'}", flush=True)
        failures += not ok
    return failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--head-dims", default="64,128", help="comma-separated head dims to check (default 64,128)")
    ap.add_argument("--archs", default="llama,qwen3",
                    help="llama (at each head dim) and/or qwen3 (at head dim 128); default both")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from asyncgen._ops import cuda_backend_available

    backends = ["triton"] + (["cuda"] if cuda_backend_available() else [])
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 7, 16, 17, 33, 64, 100, 129, 150, 200, 257]
    prompts = [torch.randint(0, 32000, (n,), generator=gen).tolist() for n in lengths]
    # Prompts sharing a 400-token prefix: with prefix caching (on by default) the later ones
    # compute a short chunk over cached blocks, which splits the attention's context.
    prefix = torch.randint(0, 32000, (400,), generator=gen).tolist()
    prompts += [prefix + torch.randint(0, 32000, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    failures = 0
    archs = args.archs.split(",")
    cases = [("llama", int(h)) for h in args.head_dims.split(",")] if "llama" in archs else []
    cases += [("qwen3", 128)] if "qwen3" in archs else []
    for arch, head_dim in cases:
        with tempfile.TemporaryDirectory() as d:
            model = build(Path(d), Path(args.tokenizer), head_dim, arch)
            ref = hf_greedy(model, prompts)
            # Every other request with a penalty: its steps' sampling waits for the previous
            # token (the forward pass still runs ahead), and the plain rows sample with it.
            penalised = frozenset(range(0, len(prompts), 2))
            ref_penalised = hf_greedy(model, prompts, penalised)
            del model
            torch.cuda.empty_cache()
            settings = {
                "plenty": dict(num_kv_blocks=1024),
                "preemption": dict(num_kv_blocks=40),
                "chunked": dict(num_kv_blocks=1024, max_num_batched_tokens=64),
                "eager": dict(num_kv_blocks=1024, enforce_eager=True),
                "staggered": dict(num_kv_blocks=1024, stagger_s=0.03),
                "penalised": dict(num_kv_blocks=1024, penalised=penalised),
                "penalised preemption": dict(num_kv_blocks=40, penalised=penalised),
            }
            for backend in backends:
                for name, kw in settings.items():
                    got, stats = anyio.run(functools.partial(engine_greedy, Path(d), prompts, backend, **kw))
                    want = ref_penalised if "penalised" in kw else ref
                    bad = [i for i in range(len(prompts)) if got[i] != want[i]]
                    first = [
                        next((j for j, (a, b) in enumerate(zip(got[i], want[i])) if a != b), None) for i in bad
                    ]
                    status = "OK" if not bad else f"MISMATCH in prompts {bad} at tokens {first}"
                    print(f"{arch} head_dim={head_dim} backend={backend:6s} {name:20s} preemptions={stats.num_preemptions:3d} "
                          f"prefix-cache hits {stats.prefix_cache_hit_rate:.2f}  {status}", flush=True)
                    if name.endswith("preemption") and stats.num_preemptions == 0:
                        print("  (no preemption happened: the setting is too generous)")
                        failures += 1
                    failures += bool(bad)
            if "cuda" in backends:
                failures += check_half(Path(d), prompts, f"{arch} head_dim={head_dim}")
    print("engine-vs-transformers:", "PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
