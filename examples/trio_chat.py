"""A terminal chat with a local model, written as a plain trio program.

    python examples/trio_chat.py [--model DIR] [--max-tokens N] [--timeout SECONDS]

Type a message and press Enter; the answer streams in as it is generated, followed by
its time to first token and speed. ``/reset`` forgets the conversation, ``/quit`` (or
end of input) leaves. Each answer runs under ``trio.move_on_after(--timeout)``: when the
deadline passes, trio cancels the ``async for`` and the engine aborts the request and
frees its memory at once; the partial answer is kept. Ctrl+C leaves (the engine closes
first) with status 130.

Nothing here is specific to asyncio: the engine's background loop runs as a trio system
task, and cancellation is trio's own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import aclosing
from typing import AsyncGenerator, AsyncIterator, Optional, TextIO

import trio

from asyncgen import AsyncEngine, InvalidRequestError, SamplingParams

SYSTEM = "You are a helpful assistant. Answer clearly and briefly."


async def stdin_lines() -> AsyncGenerator[str, None]:
    """Lines typed by the user, read in a worker thread so the event loop stays free."""
    while True:
        line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line:
            return
        yield line.rstrip("\n")


async def chat(
    engine: AsyncEngine,
    lines: AsyncIterator[str],
    out: TextIO = sys.stdout,
    *,
    max_tokens: int = 512,
    temperature: float = 0.7,
    timeout: float = 120.0,
    echo: bool = False,
) -> list[dict[str, str]]:
    """Runs the conversation until ``lines`` ends or says ``/quit``; returns the history."""
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)

    def say(text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=out, flush=True)

    say("you> ", end="")
    async for line in lines:
        if echo:
            say(line)
        text = line.strip()
        if text == "/quit":
            break
        if text == "/reset":
            del history[1:]
            say("(conversation cleared)")
        elif text:
            history.append({"role": "user", "content": text})
            say("assistant> ", end="")
            try:
                answer = await _answer(engine, history, params, timeout, say)
            except InvalidRequestError as e:  # e.g. the conversation no longer fits the context
                history.pop()
                say(f"\n(error: {e}; try /reset)")
            else:
                history.append({"role": "assistant", "content": answer})
        say("you> ", end="")
    say()
    return history


async def _answer(engine: AsyncEngine, history, params: SamplingParams, timeout: float, say) -> str:
    parts: list[str] = []
    num_tokens = 0
    start = time.perf_counter()
    first: Optional[float] = None
    stream = engine.stream(messages=history, params=params)
    with trio.move_on_after(timeout) as deadline:
        async with stream:
            async for chunk in stream:
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                num_tokens += len(chunk.token_ids)
                parts.append(chunk.text)
                say(chunk.text, end="")
    elapsed = time.perf_counter() - start
    note = f"stopped after {timeout:g} s, " if deadline.cancelled_caught else ""
    if first is None:
        say(f"\n[{note}no tokens]")
    else:
        rate = (num_tokens - 1) / (elapsed - (first - start)) if num_tokens > 1 and elapsed > first - start else 0.0
        say(f"\n[{note}{num_tokens} tokens, first after {first - start:.2f} s, {rate:.1f} tokens/s]")
    return "".join(parts)


async def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Chat with a local model (trio).")
    parser.add_argument("--model", default=None, help="model directory (default: $ASYNCGEN_MODEL, else SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per answer")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks of 16 tokens")
    args = parser.parse_args(argv)
    model = args.model or os.environ.get("ASYNCGEN_MODEL")
    if model is None:
        from asyncgen.fetch import smollm2

        model = str(smollm2())
    engine = AsyncEngine.from_pretrained(model, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks)
    async with engine, aclosing(stdin_lines()) as lines:
        await chat(
            engine, lines, max_tokens=args.max_tokens, temperature=args.temperature,
            timeout=args.timeout, echo=not sys.stdin.isatty(),
        )


if __name__ == "__main__":
    try:
        trio.run(main)
    except KeyboardInterrupt:  # Ctrl+C: the engine closed as main unwound; no traceback
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None
