"""An asyncio event loop in a daemon thread: a blocking API over async code whose loop-bound state
(the rollout client's aiohttp session and its keep-alive connections) lives across calls.

    loop = LoopThread("megarl-rollout-client")
    result = loop.run(coroutine)       # from any thread but the loop's own; blocks until it is done
    result = await loop.wrap(coroutine)  # from another event loop: runs there, awaited here
    loop.close(cleanup)                # cancels what still runs, awaits cleanup(), joins the thread

Any number of threads may call `run` at once: their coroutines share the loop. The loop keeps
running between calls, so a connection its peer closed is noticed and dropped at once.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Optional, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def in_loop(self) -> bool:
        """Whether the caller runs in this loop's thread."""
        return threading.current_thread() is self._thread

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the loop and wait for its result (or exception). If the wait is
        interrupted (KeyboardInterrupt), the coroutine is cancelled."""
        if self.in_loop():
            coroutine.close()
            raise RuntimeError("LoopThread.run called from its own loop (it would wait for itself): await instead")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # no-op once done; else the task is cancelled on the loop
            raise

    async def wrap(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Await, from another event loop, `coroutine` run on this one (cancelling the await
        cancels it)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.loop))

    def close(self, cleanup: Optional[Callable[[], Awaitable[None]]] = None, timeout_s: float = 30.0) -> None:
        """Cancel every task still on the loop (their callers get `CancelledError`), await
        `cleanup()` there, stop the loop and join its thread (each wait at most `timeout_s`)."""
        if self.in_loop():
            raise RuntimeError("LoopThread.close called from its own loop (it would wait for itself)")
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if cleanup is not None:
                await cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self.loop.close()
