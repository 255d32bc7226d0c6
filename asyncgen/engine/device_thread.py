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

__all__ = ["DeviceThread", "Job", "current_async_library", "running_loop", "threadsafe_caller"]


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


def running_loop() -> Any:
    """The event loop running in this thread (asyncio's loop, trio's run token), or None:
    what tells two loops of one thread apart (an engine started in one, used in another)."""
    import asyncio

    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop
    try:
        import trio

        return trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        return None


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

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Job":
        """Queues ``fn(*args)`` on the device thread and returns at once; ``await
        job.result()`` later. Call from the event-loop thread."""
        job = Job(fn, args, threadsafe_caller())
        self._jobs.put(job.run)
        return job

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` on the device thread and returns its result (or raises)."""
        return await self.submit(fn, *args).result()

    def stop(self) -> None:
        """Lets the thread exit after the jobs already queued."""
        self._jobs.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class Job:
    """One call queued on the device thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple, call_soon: Callable[[Callable[[], Any]], None]):
        self._fn, self._args, self._call_soon = fn, args, call_soon
        self._done = anyio.Event()
        self._box: dict[str, Any] = {}

    def run(self) -> None:  # on the device thread
        try:
            self._box["result"] = self._fn(*self._args)
        except BaseException as e:  # handed to the awaiting task, re-raised there
            self._box["error"] = e
        try:
            self._call_soon(self._done.set)
        except RuntimeError:
            pass  # the loop is gone; nobody is waiting any more

    async def result(self) -> Any:
        """The call's result (or its exception). The wait is shielded from cancellation:
        a job, once submitted, completes before this returns, so device work in flight is
        never lost track of."""
        with anyio.CancelScope(shield=True):
            await self._done.wait()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["result"]
