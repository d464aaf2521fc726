"""The serving Engine on a thread of its own, for an asyncio server.

`Engine` is synchronous and not thread-safe, so one background thread owns it: it takes commands
(add a request, abort one, take a metrics snapshot) from a queue guarded by a condition, runs
`engine.step()` while there is work, and hands each `RequestOutput` to the asyncio loop of the
request's submitter with `loop.call_soon_threadsafe`. With no work and no command it sleeps on the
condition (no busy spin).

`await loop.submit(prompt_ids, params, request_id)` returns a `RequestStream` (an async iterator
of the request's outputs, ending after the finished one) once the engine accepted the request; the
engine's ValueError (prompt too long, ids outside the vocabulary, bad parameters) is raised there.
If `engine.step()` raises, every in-flight request fails with `EngineError` (its stream raises it),
the engine is asked to abort them, and the loop goes on; after `MAX_CONSECUTIVE_STEP_FAILURES`
failures without a token decoded in between it stops (/health then answers 503), and later
submissions fail with `EngineError` at once.

Which thread runs the engine matters for speed on a CPU. OpenMP (torch's and inductor's kernels)
keeps a pool of worker threads per thread that starts parallel work. Once two threads have done so
(the one that compiled and warmed the model, and the loop's), libgomp has more threads than cores
and stops spinning between parallel regions: every region then wakes its workers from sleep. On
the 2-core machine this cut the bundled pair's decoding at batch 1 to a third (1342 -> 406 tok/s,
k = 3, inductor). So `serve` runs the loop on the main thread, the one that compiled the model
(`EngineLoop(engine, start_thread=False)`, then `run()`), and the HTTP server on another thread;
`start_thread=True` (the default, for tests and embedding) starts a thread of its own.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading

log = logging.getLogger("eagle_fx.serving")

MAX_CONSECUTIVE_STEP_FAILURES = 3
_ACCEPTED = object()  # first item of a stream: the engine took the request


class EngineError(RuntimeError):
    """The engine failed (an exception in step()) or was shut down while a request was in flight."""


class RequestStream:
    """The outputs of one request, as an async iterator (ends after the finished output)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def put_threadsafe(self, item) -> bool:
        """Deliver `item` (a RequestOutput, _ACCEPTED or an exception) from the engine thread;
        False when the submitter's loop is closed (nobody is listening any more)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:
            return False

    async def wait_accepted(self) -> None:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item

    def __aiter__(self):
        return self

    async def __anext__(self):
        """The next output; outputs that queued up meanwhile come merged into it (RequestOutput.then),
        so a consumer that fell behind sends one event for them, not one per engine step."""
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self.queue.empty():
            later = self.queue.get_nowait()
            if isinstance(later, BaseException):
                self.queue.put_nowait(later)  # (the queue was empty but for it: it stays next)
                break
            item = item.then(later)
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item


def _put_all(items) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


class EngineLoop:
    """Owns `engine` on one background thread; every public method is thread-safe."""

    def __init__(self, engine, max_model_len: int | None = None, name: str = "eagle-fx-engine",
                 start_thread: bool = True):
        """start_thread=False: no thread is started; the caller runs the loop with `run()` on a
        thread of its own choosing (see the module: the thread that compiled the model is fastest)."""
        self.engine = engine
        self.max_model_len = max_model_len
        self._cond = threading.Condition()
        self._commands: collections.deque = collections.deque()
        self._stopping = False
        self._dead: str | None = None  # why the loop stopped, once it has
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._last_metrics: dict = {}
        self._thread: threading.Thread | None = None  # the thread running the loop, once it runs
        self._finished = threading.Event()  # set when run() returns
        if start_thread:
            threading.Thread(target=self.run, name=name, daemon=True).start()
            with self._cond:
                while self._thread is None:
                    self._cond.wait()

    # ---- the asyncio / any-thread side ----

    @property
    def alive(self) -> bool:
        """Not stopped, and (once the loop was started) its thread still runs it."""
        return self._dead is None and (self._thread is None or self._thread.is_alive())

    def _push(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    async def submit(self, prompt_ids: list[int], params, request_id: str) -> RequestStream:
        """Add a request; return its stream once the engine took it. Raises the engine's
        ValueError for a bad request, EngineError when the engine is stopped or failed."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._cond:
            if self._dead is not None or self._stopping:
                raise EngineError(f"the engine is not running ({self._dead or 'shutting down'})")
            self._commands.append(("add", stream, list(prompt_ids), params))
            self._cond.notify()
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to abort the request (frees its KV blocks); a no-op once it finished."""
        self._push(("abort", request_id))

    def request_metrics(self) -> concurrent.futures.Future:
        """A future of `engine.metrics()` taken on the engine thread between steps (the last
        snapshot when the loop is stopped)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._dead is not None or (self._thread is not None and not self._thread.is_alive()):
                future.set_result(dict(self._last_metrics))
                return future
            self._commands.append(("metrics", future))
            self._cond.notify()
        return future

    def metrics(self, timeout: float = 10.0) -> dict:
        """`engine.metrics()` (blocking; from any thread but the engine's)."""
        return self.request_metrics().result(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight fail with EngineError. Waits up to `timeout`
        seconds for the loop to end (unless called on the loop's own thread, or before it ran)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._finished.wait(timeout)

    # ---- the engine thread ----

    def run(self) -> None:
        """Run the loop on the calling thread until `shutdown()` (or until it dies); once only."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("this EngineLoop already ran")
            self._thread = threading.current_thread()
            self._cond.notify_all()
        try:
            self._loop()
        finally:
            self._finished.set()

    def _loop(self) -> None:
        failures = 0
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not self._has_work():
                        self._snapshot_metrics()
                        self._cond.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                if stopping:
                    self._fail_all(EngineError("the server is shutting down"), abort=True)
                    for command in commands:
                        self._refuse(command, EngineError("the server is shutting down"))
                    self._dead = "shut down"
                    return
                for command in commands:
                    self._handle(command)
                if not self._has_work():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - any engine failure must reach the clients
                    failures += 1
                    log.exception("engine.step() failed (%d in a row); failing %d in-flight request(s)",
                                  failures, len(self._streams))
                    self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"), abort=True)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        self._dead = f"engine.step() failed {failures} times in a row: {type(e).__name__}: {e}"
                        log.error("eagle-fx engine loop stopped: %s", self._dead)
                        self._drain_after_death()
                        return
                    continue
                if any(o.new_token_ids for o in outputs):  # decoding works (a prefill-only step proves nothing)
                    failures = 0
                self._deliver(outputs)
                if self._streams and not self.engine.has_unfinished():
                    self._fail_all(EngineError("the engine dropped the request without finishing it"), abort=False)
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: never leave clients hanging
            self._dead = f"the engine loop crashed: {type(e).__name__}: {e}"
            log.exception("eagle-fx engine loop crashed")
            self._fail_all(EngineError(self._dead), abort=False)
            self._drain_after_death()

    def _has_work(self) -> bool:
        return bool(self._streams) or self.engine.has_unfinished()

    def _snapshot_metrics(self) -> None:
        try:
            self._last_metrics = self.engine.metrics()
        except Exception:  # noqa: BLE001
            log.exception("engine.metrics() failed")

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt_ids, params = command
            if stream.request_id in self._streams:
                stream.put_threadsafe(ValueError(f"request id {stream.request_id!r} is already in flight"))
                return
            try:
                self.engine.add_request(prompt_ids, params, request_id=stream.request_id)
            except ValueError as e:
                stream.put_threadsafe(e)
                return
            except Exception as e:  # noqa: BLE001
                log.exception("engine.add_request failed")
                stream.put_threadsafe(EngineError(f"the engine failed to add the request: {type(e).__name__}: {e}"))
                return
            self._streams[stream.request_id] = stream
            if not stream.put_threadsafe(_ACCEPTED):
                self._abort(stream.request_id)
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "metrics":
            future = command[1]
            try:
                self._last_metrics = self.engine.metrics()
                future.set_result(dict(self._last_metrics))
            except Exception as e:  # noqa: BLE001
                future.set_exception(e)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # noqa: BLE001
            log.exception("engine.abort(%r) failed", request_id)
            self._streams.pop(request_id, None)

    def _deliver(self, outputs) -> None:
        """A step's outputs to their streams: one wake-up of each listening event loop per step
        (call_soon_threadsafe writes to the loop's wake-up pipe), not one per output."""
        by_loop: dict = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody listens to these streams any more
                for stream, out in items:
                    if not out.finished:
                        self._abort(out.request_id)

    def _fail_all(self, error: Exception, abort: bool) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            if abort:  # freed in the engine before the client hears of it
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001
                    log.exception("engine.abort(%r) failed after a step failure", request_id)
            stream.put_threadsafe(error)

    def _refuse(self, command: tuple, error: Exception) -> None:
        if command[0] == "add":
            command[1].put_threadsafe(error)
        elif command[0] == "metrics":
            command[1].set_result(dict(self._last_metrics))

    def _drain_after_death(self) -> None:
        """The loop is stopping for good: answer the commands that raced in."""
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            self._refuse(command, EngineError(f"the engine is not running ({self._dead})"))
