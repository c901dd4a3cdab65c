"""``RequestHandle``: the caller's side of one request, fed by the engine thread.

The engine thread delivers ``StreamEvent``s (``deliver``) and finally ends the request (``end``) with
its last event and ``Completion``, or with the error it failed with; the caller consumes the same
events by sync iteration or ``aiter()``, or waits for the join with ``result()`` / ``aresult()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time

from flm_runtime.errors import FlmError
from flm_runtime.request import Completion, StreamEvent

_END = object()   # stream terminator, after the final event or instead of it on failure


class RequestCancelledError(FlmError, concurrent.futures.CancelledError):
    """``result()`` / ``aresult()`` of a request its caller cancelled."""


class RequestHandle:
    """The caller's side of one request. Its stream can be consumed once (sync or async);
    ``result()`` / ``aresult()`` work alongside or instead.

    Abandoning a stream (``break`` out of the loop and dropping the iterator, or cancelling the
    asyncio task that iterates) cancels the request, freeing its sequence at the next step.
    A cancelled stream just ends; ``result()`` then raises ``RequestCancelledError``.

    Attributes:
        timeout: seconds from submit, or None.
        deadline: ``time.monotonic()`` value past which the engine cancels the request.
        t_submit: ``time.perf_counter()`` at submit.
    """

    def __init__(self, timeout: float | None = None):
        self.t_submit = time.perf_counter()
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()
        self._items: queue.SimpleQueue = queue.SimpleQueue()   # sync consumer's events
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._done = threading.Event()
        self._callbacks: list = []
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._cancel = False
        self._claimed = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel

    def cancel(self) -> None:
        """Ask the engine to drop the request at its next step (no-op once done)."""
        self._cancel = True

    def __iter__(self):
        """Yields ``StreamEvent``s until the final one (``finish_reason`` set).

        Raises:
            RequestTimeoutError: the deadline passed.
            RuntimeError: the stream was already consumed.
            Exception: whatever failed inside the engine for this request.
        """
        with self._lock:
            self._claim()
        return self._iter_sync()

    def _iter_sync(self):
        try:
            while (item := self._items.get()) is not _END:
                yield item
            self._raise_error()
        finally:
            if not self.done:
                self.cancel()

    async def aiter(self):
        """Async form of iteration; hands events from the engine thread to this event loop
        without blocking it. Same events and errors as sync iteration."""
        loop = asyncio.get_running_loop()
        aqueue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._claim()
            while not self._items.empty():        # events that arrived before we attached
                aqueue.put_nowait(self._items.get_nowait())
            self._async = (loop, aqueue)
        try:
            while (item := await aqueue.get()) is not _END:
                yield item
            self._raise_error()
        finally:
            if not self.done:
                self.cancel()

    def __aiter__(self):
        return self.aiter()

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; returns the join of its events.

        Args:
            timeout: seconds to wait here (not the request's own timeout); None waits forever.

        Raises:
            TimeoutError: ``timeout`` passed before the request ended (the request goes on).
            RequestCancelledError, RequestTimeoutError, or the engine-side error of this request.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not end within {timeout} s")
        return self._outcome()

    async def aresult(self) -> Completion:
        """Async ``result()``; cancelling the awaiting task cancels the request."""
        if not self.done:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def wake() -> None:
                try:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
                except RuntimeError:              # the loop is closed: nobody is waiting
                    pass

            self._on_done(wake)
            try:
                await fut
            except asyncio.CancelledError:
                self.cancel()
                raise
        return self._outcome()

    # ---- engine side ------------------------------------------------------------------------

    def deliver(self, event: StreamEvent) -> None:
        """One event of the stream (engine thread)."""
        with self._lock:
            self._route(event)

    def end(self, event: StreamEvent | None, completion: Completion | None, error: BaseException | None) -> None:
        """The request is over: deliver the final event (or the error), then wake waiters."""
        with self._lock:
            if self.done:
                return
            if event is not None:
                self._route(event)
            self._completion, self._error = completion, error
            self._route(_END)
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def _route(self, item) -> None:
        """To the async consumer's loop if one attached, else to the sync queue (lock held)."""
        if self._async is None:
            self._items.put(item)
            return
        loop, aqueue = self._async
        try:
            loop.call_soon_threadsafe(aqueue.put_nowait, item)
        except RuntimeError:                     # the consumer's loop is gone: nobody listens
            self._cancel = True

    def _claim(self) -> None:
        if self._claimed:
            raise RuntimeError("a RequestHandle's stream can be consumed only once")
        self._claimed = True

    def _on_done(self, cb) -> None:
        with self._lock:
            if not self.done:
                self._callbacks.append(cb)
                return
        cb()

    def _raise_error(self) -> None:
        if self._error is not None and not isinstance(self._error, RequestCancelledError):
            raise self._error

    def _outcome(self) -> Completion:
        if self._error is not None:
            raise self._error
        return self._completion
