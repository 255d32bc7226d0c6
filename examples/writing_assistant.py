"""A writing assistant serving many people at once.

    python examples/writing_assistant.py [--users 8] [--max-tokens 600] [--out DIR] [--backend trio]

Each user asks for a different long document (a blog post, a cover letter, an email
draft, ...). All of them stream concurrently from one engine, which batches them step
by step. As each document finishes, its line is printed; at the end a table shows, per
request, the time to first token (TTFT), the number of tokens, the decode speed and the
total time, then the totals. ``--out DIR`` saves the documents as Markdown files.

The requests go through ``engine.openai_client()``, the in-process client with the
``openai.AsyncOpenAI`` surface: the same code would run against an OpenAI-compatible
server with ``openai.AsyncOpenAI(base_url=...)`` in its place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import statistics
import sys
import time
from typing import Optional

import anyio

from asyncgen import AsyncEngine

REQUESTS = [
    ("alice", "blog post", "Write a blog post for beginners about starting a vegetable garden on a balcony."),
    ("bruno", "cover letter", "Write a cover letter for a junior data analyst position at a public library."),
    ("chen", "email draft", "Draft a polite email to a landlord asking to fix a leaking kitchen tap this week."),
    ("dara", "product description", "Write a product description for a lightweight waterproof hiking backpack."),
    ("emeka", "meeting summary", "Write a summary of a team meeting that decided to move the release by two weeks."),
    ("farah", "speech", "Write a short wedding toast for an old friend who loves sailing."),
    ("gus", "newsletter", "Write the opening section of a neighbourhood newsletter announcing a spring clean-up."),
    ("hana", "README", "Write the introduction of a README for a small command-line tool that renames photos by date."),
    ("ivan", "recipe", "Write a recipe with steps for a simple lentil soup, with a short story before it."),
    ("julia", "review", "Write a thoughtful review of a fictional mystery novel set in a lighthouse."),
]

SYSTEM = "You are a skilled writing assistant. Write the complete document the user asks for, in a natural tone."


@dataclasses.dataclass
class Result:
    user: str
    kind: str
    text: str = ""
    ttft: Optional[float] = None  # seconds from submission to the first text
    total: float = 0.0  # seconds from submission to the end
    tokens: int = 0
    finish_reason: Optional[str] = None

    @property
    def tokens_per_s(self) -> float:
        """Decode speed after the first token."""
        decode_time = self.total - (self.ttft or 0.0)
        return (self.tokens - 1) / decode_time if self.tokens > 1 and decode_time > 0 else 0.0


async def write_document(client, user: str, kind: str, instructions: str, max_tokens: int, seed: int) -> Result:
    result = Result(user, kind)
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=client.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": instructions}],
        max_tokens=max_tokens,
        temperature=0.8,
        seed=seed,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = []
    async with stream:
        async for chunk in stream:
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if result.ttft is None:
                        result.ttft = time.perf_counter() - start
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    result.finish_reason = choice.finish_reason
    result.total = time.perf_counter() - start
    result.text = "".join(parts)
    return result


async def run(engine: AsyncEngine, num_users: int, max_tokens: int, out_dir: Optional[pathlib.Path] = None) -> list[Result]:
    """Streams ``num_users`` documents concurrently; prints each as it finishes and a table
    at the end; returns the results in request order."""
    client = engine.openai_client()
    results: list[Optional[Result]] = [None] * num_users
    start = time.perf_counter()

    async def one(i: int) -> None:
        user, kind, instructions = REQUESTS[i % len(REQUESTS)]
        if i >= len(REQUESTS):
            user = f"{user}{i // len(REQUESTS) + 1}"
        r = await write_document(client, user, kind, instructions, max_tokens, seed=i)
        results[i] = r
        print(f"[{time.perf_counter() - start:6.1f} s] {r.user}'s {r.kind}: {r.tokens} tokens ({r.finish_reason})",
              flush=True)
        if out_dir is not None:
            name = re.sub(r"\W+", "-", f"{r.user}-{r.kind}").strip("-")
            (out_dir / f"{name}.md").write_text(f"# {r.kind.capitalize()} for {r.user}\n\n{r.text.strip()}\n")

    print(f"{num_users} users, up to {max_tokens} tokens each, on {engine.model_name}", flush=True)
    async with anyio.create_task_group() as tg:
        for i in range(num_users):
            tg.start_soon(one, i)
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]  # all of them: the task group waited for every one
    print_table(done, wall)
    return done


def print_table(results: list[Result], wall: float) -> None:
    print()
    print(f"{'user':<10} {'document':<20} {'TTFT s':>7} {'tokens':>7} {'tok/s':>7} {'total s':>8}  finish")
    for r in results:
        ttft = f"{r.ttft:7.2f}" if r.ttft is not None else f"{'-':>7}"
        print(f"{r.user:<10} {r.kind:<20} {ttft} {r.tokens:>7} {r.tokens_per_s:>7.1f} {r.total:>8.2f}  {r.finish_reason}")
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    print(f"\n{len(results)} documents, {tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tokens/s overall")
    if ttfts:
        print(f"time to first token: mean {statistics.mean(ttfts):.2f} s, max {max(ttfts):.2f} s")


async def amain(argv: Optional[list[str]] = None) -> list[Result]:
    parser = argparse.ArgumentParser(description="Many users' documents, streamed concurrently.")
    parser.add_argument("--model", default=None, help="model directory (default: $ASYNCGEN_MODEL, else SmolLM2)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="save the documents in this directory")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks of 16 tokens")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio", help="event loop to run on")
    args = parser.parse_args(argv)
    if args.users < 0:
        parser.error(f"--users must be 0 or more, got {args.users}")
    if not 1 <= args.max_tokens < args.max_model_len:
        parser.error(f"--max-tokens must be at least 1 and leave room for the prompt within --max-model-len "
                     f"({args.max_model_len}), got {args.max_tokens}")
    model = args.model or os.environ.get("ASYNCGEN_MODEL")
    if model is None:
        from asyncgen.fetch import smollm2

        model = str(smollm2())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    engine = AsyncEngine.from_pretrained(
        model, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(args.users, 1)
    )
    async with engine:
        return await run(engine, args.users, args.max_tokens, args.out)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    known, _ = parser.parse_known_args(argv)
    try:
        anyio.run(amain, argv, backend=known.backend)
    except KeyboardInterrupt:  # Ctrl+C: the engine closed as amain unwound; no traceback
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
