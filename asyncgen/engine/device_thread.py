"""The one thread that owns the device.

Every model call (loading, each step, shutdown) runs here, never on the event-loop
thread. Awaiting a job parks only the awaiting task: the thread wakes the loop when the
job is done through the loop's own thread-safe callback (asyncio's
``call_soon_threadsafe`` or trio's ``run_sync_soon``), so the loop keeps serving other
tasks meanwhile and no second thread is involved.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import anyio

__all__ = ["DeviceThread", "current_async_library", "threadsafe_caller"]


def current_async_library() -> str:
    """``"asyncio"`` or ``"trio"``: the event loop running in this thread."""
    import asyncio

    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    try:
        import trio

        trio.lowlevel.current_task()
        return "trio"
    except (ImportError, RuntimeError):
        pass
    raise RuntimeError("asyncgen needs a running asyncio or trio event loop")


def threadsafe_caller() -> Callable[[Callable[[], Any]], None]:
    """A function that schedules a callback on the current event loop from any thread."""
    lib = current_async_library()
    if lib == "asyncio":
        import asyncio

        return asyncio.get_running_loop().call_soon_threadsafe
    if lib == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


class DeviceThread:
    def __init__(self, name: str = "asyncgen-device"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` on the device thread and returns its result (or raises).

        The wait is shielded from cancellation: a job, once submitted, always completes
        before this returns, so the caller never loses track of device work in flight.
        """
        call_soon = threadsafe_caller()
        done = anyio.Event()
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["result"] = fn(*args)
            except BaseException as e:  # handed to the awaiting task, re-raised there
                box["error"] = e
            try:
                call_soon(done.set)
            except RuntimeError:
                pass  # the loop is gone; nobody is waiting any more

        self._jobs.put(job)
        with anyio.CancelScope(shield=True):
            await done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def stop(self) -> None:
        """Lets the thread exit after the jobs already queued."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
