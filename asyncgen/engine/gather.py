"""Awaiting several engine calls at once, with the first failure raised as it is."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence

import anyio

__all__ = ["gather"]


async def gather(calls: Sequence[Callable[[], Awaitable[Any]]],
                 errors: tuple[type[BaseException], ...] = (Exception,)) -> list:
    """The results of ``calls``, awaited at once, in order. The first call to raise one of
    ``errors`` cancels the others, and its exception is raised as it is, not inside an
    exception group."""
    results: list[Any] = [None] * len(calls)
    failed: list[BaseException] = []

    async def one(k: int, call) -> None:
        try:
            results[k] = await call()
        except errors as e:
            failed.append(e)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        for k, call in enumerate(calls):
            tg.start_soon(one, k, call)
    if failed:
        raise failed[0]
    return results
