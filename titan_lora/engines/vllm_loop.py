"""One thread that owns a vLLM engine: it steps requests and runs control work between steps.

vLLM's offline engine is not thread-safe, and in-process its worker would run a control call in the
middle of a forward pass. Funnelling everything through this thread gives both: requests keep
decoding across adapter loads, and every load lands between two steps. Every generate call has a
deadline: its requests still running then are aborted in vLLM, so a caller that gave up (or
disconnected) cannot leave work behind; a failed step aborts every request, so the next ones run.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger("titan_lora.engine")


class _Batch:
    """The outputs of one generate call, filled in as its requests finish."""

    def __init__(self, n: int) -> None:
        self.outputs: list[Any] = [None] * n
        self.remaining = n
        self.future: Future = Future()


class EngineLoop:
    """Serialises all access to one `vllm.LLM` on a dedicated thread."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._commands: queue.Queue[tuple[Callable[[Any], Any], Future]] = queue.Queue()
        self._requests: dict[str, tuple[_Batch, int]] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-engine-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> Any:
        """Run `fn(llm)` on the engine thread between two steps and return its result (TimeoutError
        after `timeout_s`, if given)."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future.result(timeout=timeout_s)

    def rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`collective_rpc` to the worker extension; the first worker's answer."""
        return self.call(lambda llm: llm.collective_rpc(method, args=args), timeout_s)[0]

    def generate(self, prompts: list[list[int]], params: Any, lora: Any, timeout_s: float) -> list[Any]:
        """Run one request per token-id prompt to completion; outputs in prompt order. Requests still
        running after `timeout_s` are aborted and TimeoutError is raised.

        `params` is one SamplingParams for all prompts, or a list with one per prompt.
        """
        batch = _Batch(len(prompts))
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        request_ids = [uuid.uuid4().hex for _ in prompts]

        def submit(llm: Any) -> None:
            for i, (request_id, ids, p) in enumerate(zip(request_ids, prompts, per_prompt)):
                self._requests[request_id] = (batch, i)
                llm.llm_engine.add_request(request_id, {"prompt_token_ids": ids}, p, lora_request=lora)

        self.call(submit)
        try:
            return batch.future.result(timeout=timeout_s)
        except TimeoutError:
            self.call(lambda llm: self._abort(request_ids))
            if batch.future.done() and batch.future.exception() is None:  # it finished at the deadline
                return batch.future.result()
            raise TimeoutError(f"{len(prompts)} requests did not finish within timeout_s={timeout_s:g}; "
                               "they were aborted (raise [weight_sync] rollout_timeout_s if they need "
                               "longer)") from None

    @contextlib.contextmanager
    def using(self, adapter: str | None, n: int) -> Iterator[None]:
        """Count `n` requests as in flight on `adapter` while the block runs."""
        with self._cond:
            self._in_flight[adapter or ""] += n
        try:
            yield
        finally:
            with self._cond:
                self._in_flight[adapter or ""] -= n
                self._cond.notify_all()

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per adapter name ("" for the base)."""
        with self._cond:
            return {k: v for k, v in self._in_flight.items() if v}

    def wait_unused(self, adapter: str, timeout_s: float) -> bool:
        """Wait until no request uses `adapter`; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight[adapter] == 0, timeout_s)

    def warm_up(self) -> None:
        """One tiny request: the first forward pass is several times slower than the rest."""
        from vllm import SamplingParams

        self.generate([[1, 2, 3]], SamplingParams(max_tokens=2), None, timeout_s=600)

    def stop(self) -> None:
        """Stop the thread after the current step."""
        self._stopped.set()

    def _run(self) -> None:
        engine = self.llm.llm_engine
        while not self._stopped.is_set():
            busy = engine.has_unfinished_requests()
            self._run_commands(block=not busy)
            if engine.has_unfinished_requests():
                try:
                    self._deliver(engine.step())
                except Exception as err:  # noqa: BLE001 (every waiting caller must hear about it)
                    logger.exception("engine step failed")
                    self._fail_all(err)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            try:
                future.set_result(fn(self.llm))
            except Exception as err:  # noqa: BLE001 (returned to the caller)
                future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            if not out.finished or out.request_id not in self._requests:
                continue
            batch, index = self._requests.pop(out.request_id)
            batch.outputs[index] = out
            batch.remaining -= 1
            if batch.remaining == 0:
                batch.future.set_result(batch.outputs)

    def _abort(self, request_ids: list[str]) -> None:
        """Drop `request_ids` from vLLM and from our table (on the engine thread)."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
        self.llm.llm_engine.abort_request(request_ids)

    def _fail_all(self, err: Exception) -> None:
        """Fail every waiting caller and abort their requests: vLLM would otherwise step them again,
        and fail again, forever."""
        request_ids = list(self._requests)
        for batch, _ in list(self._requests.values()):
            if not batch.future.done():
                batch.future.set_exception(err)
        try:
            self._abort(request_ids)
        except Exception:  # noqa: BLE001 (the loop must keep serving; the callers already have the error)
            logger.exception("aborting %d requests after a failed step failed", len(request_ids))
