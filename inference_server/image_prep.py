"""Image preparation off the gRPC front's event loop.

An engine's submit of a request with images decodes every screenshot, resizes it and runs the image processor (a
VL model: core.vlm.VLSpec.pixels) before the request is queued: about 0.4 s for one 1920x1080 screenshot on a CPU
core. On the event loop, that time held every other call of the server (health checks, text generations, weight
updates). ImagePrep runs those submits on a few threads of its own instead:

- bounded concurrency: `inference.image_threads` threads prepare at once;
- a bound: at most `inference.image_queue` requests with images are admitted (waiting for a thread or being
  prepared); one more is QueueFull (RESOURCE_EXHAUSTED) at once, nothing of it done;
- a deadline: the call's own; a request whose deadline passes while it waits or is prepared answers
  DEADLINE_EXCEEDED, and the engine request its preparation still yields is cancelled. A request the call gave up
  on before a thread took it is never prepared.

What submit raises (ValueError for an unreadable image, QueueFull, EngineClosed) reaches the caller unchanged, so the
status codes are those of a submit on the loop (inference_server/answers.py).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import grpc

from inference_server.answers import code_of
from inference_server.engine_types import QueueFull

LATE = (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while the request's images were prepared")


def _cancel_yielded(f: Future) -> None:
    """A preparation the call gave up on: the engine request it yielded (if any) is cancelled."""
    if not f.cancelled() and f.exception() is None:
        f.result(0).cancel()


def prepared(task: asyncio.Future) -> tuple[Future | None, tuple[grpc.StatusCode, str] | None]:
    """A finished ImagePrep.run task: (its engine Future, None), or (None, the code and details it answers)."""
    if task.cancelled():
        return None, (grpc.StatusCode.CANCELLED, "request cancelled")
    e = task.exception()
    if e is None:
        return task.result(), None
    return None, LATE if isinstance(e, asyncio.TimeoutError) else (code_of(e), str(e))


def drop(task: asyncio.Future) -> None:
    """A preparation whose call ended: not started, it never runs; the engine request it yielded is cancelled."""
    task.cancel()  # a no-op once done
    fut = prepared(task)[0] if task.done() else None
    if fut is not None:
        fut.cancel()


class ImagePrep:
    def __init__(self, threads: int, bound: int):
        self.threads, self.bound = int(threads), int(bound)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._admitted = 0  # preparations waiting for a thread or running (released when the work ends)

    @property
    def admitted(self) -> int:
        return self._admitted

    def _release(self, _f: Future) -> None:
        with self._lock:
            self._admitted -= 1

    async def run(self, submit: Callable[[], Future], timeout: float | None) -> Future:
        """submit() (an engine submit with images -> its concurrent Future) on a preparing thread; its Future.
        Raises what submit raises, QueueFull past the bound, asyncio.TimeoutError once `timeout` seconds pass."""
        with self._lock:
            if self._admitted >= self.bound:
                raise QueueFull(f"{self._admitted} requests with images are already being prepared "
                                f"(inference.image_queue={self.bound})")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tars-image-prep")
            self._admitted += 1
        try:
            cf = self._pool.submit(submit)
        except RuntimeError:  # shut down meanwhile
            self._release(None)
            raise
        cf.add_done_callback(self._release)  # the bound counts work, not waiting callers: released when it ends
        try:
            return await asyncio.wait_for(asyncio.wrap_future(cf), timeout)
        except BaseException:  # the deadline, or the call was cancelled: nothing of this request may run on
            cf.cancel()  # never started: never prepared (its release runs now)
            cf.add_done_callback(_cancel_yielded)  # started: the engine request it yields is cancelled
            raise

    def close(self) -> None:
        """Preparations not started are dropped; running ones finish (their engine requests are cancelled by
        their callers)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
