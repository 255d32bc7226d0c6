"""CPU throughput: asyncgen against transformers on SmolLM2-135M-Instruct, same weights.

16 concurrent requests, 128 new tokens each (EOS ignored so every request generates all
of them), greedy, fp32 on both sides (or ``--dtype bfloat16`` on both). transformers runs
``generate()`` on the same 16 prompts as one left-padded batch. Prints total output
tokens/s of each.

    python benchmarks/cpu_smollm2.py [--requests 16] [--new-tokens 128] [--dtype float32]
    python benchmarks/cpu_smollm2.py --prompt-tokens 1000

``--prompt-tokens N`` times the first token of one N-token prompt instead (median of 3,
each prompt with its own first token, so that none hits the prefix cache): asyncgen's
``generate(max_tokens=1)`` against transformers' ``generate(max_new_tokens=1)``.

Set OMP_NUM_THREADS to fix the thread count of both sides (the engine's device thread
included) on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import torch

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms, step by step.",
    "List ten uses for a paperclip.",
    "Describe the city of Seoul to a visitor.",
    "What makes a good cover letter?",
    "Draft an email asking for a meeting next week.",
    "Summarise the plot of a heist movie you invent.",
    "Give advice to a new gardener.",
]


async def run_asyncgen(path, prompts, new_tokens, dtype="float32"):
    from asyncgen import AsyncEngine, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    async with AsyncEngine.from_pretrained(path, device="cpu", dtype=dtype, max_model_len=1024, num_kv_blocks=512) as engine:
        await engine.generate("warm up", SamplingParams(max_tokens=4))
        counts = []

        async def one(p):
            out = await engine.generate(p, params)
            counts.append(len(out.token_ids))

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(one, p)
        return sum(counts), time.perf_counter() - t0


def _prompt_ids(n: int, i: int) -> list[int]:
    return [1000 + i] + list(range(2000, 2000 + n - 1))


async def ttft_asyncgen(path, n, dtype="float32"):
    from asyncgen import AsyncEngine, SamplingParams

    async with AsyncEngine.from_pretrained(path, device="cpu", dtype=dtype, max_model_len=max(2048, n + 1)) as engine:
        await engine.generate(_prompt_ids(n, 0), SamplingParams(max_tokens=1))
        times = []
        for i in range(1, 4):
            t0 = time.perf_counter()
            await engine.generate(_prompt_ids(n, i), SamplingParams(max_tokens=1))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ttft_hf(path, n, dtype="float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    times = []
    with torch.no_grad():
        for i in range(4):
            ids = torch.tensor([_prompt_ids(n, i)])
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run_hf(path, prompts, new_tokens, dtype="float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        out = model.generate(
            **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
        dt = time.perf_counter() - t0
    return (out.shape[1] - batch.input_ids.shape[1]) * out.shape[0], dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of both sides")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="time one prompt's first token instead")
    args = ap.parse_args()
    from asyncgen.fetch import smollm2

    path = smollm2()
    if args.prompt_tokens:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}", flush=True)
        t_a = anyio.run(ttft_asyncgen, path, args.prompt_tokens, args.dtype)
        print(f"asyncgen:     first token of a {args.prompt_tokens}-token prompt in {t_a * 1e3:.0f} ms", flush=True)
        t_h = ttft_hf(path, args.prompt_tokens, args.dtype)
        print(f"transformers: first token of a {args.prompt_tokens}-token prompt in {t_h * 1e3:.0f} ms")
        print(f"ratio: {t_h / t_a:.2f}x")
        return
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (variant {i})" for i in range(args.requests)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}", flush=True)
    n_a, t_a = anyio.run(run_asyncgen, path, prompts, args.new_tokens, args.dtype)
    print(f"asyncgen:     {n_a} tokens in {t_a:.1f} s = {n_a / t_a:.1f} tok/s", flush=True)
    n_h, t_h = run_hf(path, prompts, args.new_tokens, args.dtype)
    print(f"transformers: {n_h} tokens in {t_h:.1f} s = {n_h / t_h:.1f} tok/s")
    print(f"ratio: {(n_a / t_a) / (n_h / t_h):.2f}x")


if __name__ == "__main__":
    main()
