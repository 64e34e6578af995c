"""EngineLoop: runs an LLMEngine's step loop on a background thread.

Other threads never touch the engine directly: they `call()` a function that runs on the
loop thread between steps, and read per-request output streams. A step that raises fails
every unfinished request with the error instead of hanging their streams. `outputs_ready`
is notified once per batch of outputs put into streams, so that one reader can wait for
any of many streams (DecodeWorker.poll_many).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from engine.config import use_device
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, StepResult

logger = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[RequestOutput] = queue.Queue()
        self.finished = False  # the reader took the finished output
        self.completed_at: float | None = None  # monotonic time the finished output came

    def put(self, out: RequestOutput) -> None:
        if out.finished:
            self.completed_at = time.monotonic()
        self._queue.put(out)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """Next output; raises queue.Empty after `timeout` seconds."""
        out = self._queue.get(timeout=timeout)
        if out.finished:
            self.finished = True
        return out

    def drain(self) -> list[RequestOutput]:
        """Every output available now, without waiting."""
        items = []
        while True:
            try:
                items.append(self.get(timeout=0))
            except queue.Empty:
                return items

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()


class EngineLoop:
    """Owns the engine thread; everything else talks to it through call() and streams."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.01) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._calls: queue.Queue[tuple[Callable, tuple, Future]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._hooks: list[Callable[[StepResult], None]] = []
        self._stop = threading.Event()
        # Notified (notify_all) after outputs were put into streams, and by wake_readers;
        # `output_batches` counts both, so a waiter sees what happened since it looked.
        self.outputs_ready = threading.Condition()
        self.output_batches = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_steps = 0

    # ---- control -------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop thread; True once it has ended (False: still in a step after
        `timeout` seconds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def call(self, fn: Callable[..., Any], *args) -> Future:
        """Run fn(*args) on the loop thread between steps; the Future carries its result."""
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("engine loop is stopped"))
            return fut
        self._calls.put((fn, args, fut))
        return fut

    def run(self, fn: Callable[..., Any], *args, timeout: float | None = 60.0) -> Any:
        """call() and wait for the result (re-raising the function's exception)."""
        return self.call(fn, *args).result(timeout)

    def add_step_hook(self, hook: Callable[[StepResult], None]) -> None:
        """hook(result) runs on the loop thread after each step (and on idle ticks)."""
        self._hooks.append(hook)

    def open_stream(self, request_id: str) -> RequestStream:
        """Create the stream for a request before it is added (so no output is missed)."""
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = RequestStream(request_id)
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params, **kwargs
    ) -> RequestStream:
        """Add a request on the loop thread; return its stream. Raises the engine's errors."""
        stream = self.open_stream(request_id)
        try:
            self.run(
                lambda: self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)
            )
        except Exception:
            self.close_stream(request_id)
            raise
        return stream

    # ---- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        use_device(self.engine.runner.device)
        while not self._stop.is_set():
            self._run_calls()
            if self.engine.has_unfinished():
                try:
                    result = self.engine.step()
                    self.num_steps += 1
                except Exception as exc:  # noqa: BLE001 - reported to every request
                    logger.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(f"engine step failed: {exc}")
                    continue
                self._dispatch(result)
            else:
                self.engine.record_state()  # gauges follow changes made between steps
                # KV events come between steps too: a KV tier stores blocks on its writer
                # thread, and a disk tier re-indexed at start-up publishes what it holds.
                self._dispatch(StepResult(kv_events=self.engine.take_kv_events()))
                self._wait_for_work()
        self._fail_all("engine loop stopped")

    def _wait_for_work(self) -> None:
        try:
            fn, args, fut = self._calls.get(timeout=self.idle_wait_s)
        except queue.Empty:
            return
        self._execute(fn, args, fut)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, args, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            self._execute(fn, args, fut)

    @staticmethod
    def _execute(fn: Callable, args: tuple, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)

    def wake_readers(self) -> None:
        """Wake every thread waiting on outputs_ready (a reader with new streams to read)."""
        with self.outputs_ready:
            self.output_batches += 1
            self.outputs_ready.notify_all()

    def _dispatch(self, result: StepResult) -> None:
        # Keyed by choice; a request's stream gets every choice's outputs, its last one
        # (finished) after the others.
        if result.outputs:
            with self.outputs_ready:
                for out in result.outputs.values():
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                self.output_batches += 1
                self.outputs_ready.notify_all()
        for hook in self._hooks:
            try:
                hook(result)
            except Exception:  # noqa: BLE001 - a hook must not stop the engine
                logger.error("step hook failed:\n%s", traceback.format_exc())

    def _fail_all(self, error: str) -> None:
        self.engine.fail_all(error)
        self._dispatch(StepResult(outputs=self.engine.take_pending()))
        with self.outputs_ready:
            for rid, stream in list(self._streams.items()):  # streams of requests not added yet
                stream.put(
                    RequestOutput(rid, [], "", 0, finished=True, finish_reason="error", error=error)
                )
            self._streams.clear()
            self.output_batches += 1
            self.outputs_ready.notify_all()
        if self._stop.is_set():
            while True:
                try:
                    _, _, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(error))
