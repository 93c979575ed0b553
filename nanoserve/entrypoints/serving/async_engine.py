"""AsyncEngine: the API server's asyncio face of the engine-core process.

`generate()` sends a request's token ids to the engine core and yields RequestOutputs as they
are made; `encode()` sends a prefill-only one (an embedding or a score) and returns its
vector. One task receives the engine's messages and runs them through the OutputProcessor
(detokenization, stop strings, logprob formatting) -- in this process, so the engine never
waits on text -- then hands each update to its request's queue (a pooling output goes straight
to its request). A request whose consumer goes away (a client disconnect cancels it) is
aborted in the engine core at once. With several data-parallel engine cores, the client
(dp_client.py) picks each request's engine and sends its aborts there; every engine's outputs
come through the same loop, and any engine that dies fails every request (the server exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from nanoserve.entrypoints.serving.dp_client import DPEngineClient
from nanoserve.entrypoints.serving.image_prompt import PromptIds
from nanoserve.entrypoints.serving.request_logger import RequestLogger
from nanoserve.entrypoints.serving.tenant import current_tenant
from nanoserve.output.processor import OutputProcessor, TimingObserver
from nanoserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from nanoserve.pooling_params import PoolingParams
from nanoserve.protocol import (
    EngineCoreOutput,
    EngineDead,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    RequestError,
    SchedulerStats,
)
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger("nanoserve")
_WATCHDOG_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine core is gone; no request can complete."""


class RequestTimeoutError(TimeoutError):
    """A request passed the server's deadline (--request-timeout) and was aborted."""


class SlowReaderError(RequestTimeoutError):
    """The client left its stream unread too long (--slow-reader-timeout) or let too many
    updates pile up (--max-unread-updates): the request was aborted."""


class AsyncEngine:
    """Requests in, RequestOutputs out, over the engine-core sockets."""

    def __init__(self, client: DPEngineClient, tokenizer: Any, ready: EngineReady,
                 engine_alive: Callable[[], bool],
                 observer: TimingObserver | None = None, request_timeout: float | None = None,
                 request_logger: RequestLogger | None = None,
                 slow_reader_timeout: float = 30.0, max_unread_updates: int = 4096) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.ready = ready
        self.engine_alive = engine_alive
        self.processor = OutputProcessor(tokenizer, observer)
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        # pooling requests in flight: each gets its one output (never through the processor)
        self.pooling: dict[str, asyncio.Future[EngineCoreOutput]] = {}
        self._num_sequences = 0  # the n of each request in `queues`, summed
        self.dead_reason: str | None = None
        self.on_dead: Callable[[], None] | None = None
        self.request_timeout = request_timeout  # seconds from admission; None = no deadline
        self.slow_reader_timeout = slow_reader_timeout
        self.max_unread_updates = max_unread_updates
        # when each request's consumer last took an update (or began): a consumer that stops
        # (its client does not read, so the HTTP send waits) lets its queue grow
        self.last_read: dict[str, float] = {}
        self.stalled: set[str] = set()  # aborted for that: their later updates are dropped
        self.request_logger = request_logger
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_in_flight(self) -> int:
        return len(self.queues) + len(self.pooling)

    @property
    def engine_stats(self) -> list[SchedulerStats]:
        """Each engine core's latest stats (one per --data-parallel-size)."""
        return self.client.engine_stats

    @property
    def num_sequences_in_flight(self) -> int:
        """Engine sequences of the requests in flight: a request's n samples are n."""
        return self._num_sequences

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        """A loop that stops on its own is fatal: nothing would reach the requests again."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s failed", task.get_name(), exc_info=task.exception())
            self._die(f"{task.get_name()} failed: {task.exception()!r}")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Updates for one request (shaped by params.output_kind) until it finishes, or until
        its deadline: then it is aborted in the engine and RequestTimeoutError raised. A
        `PromptIds` carries the prompt's images with its ids (serving/image_prompt.py)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.request_logger is not None:
            self.request_logger.log(request_id, prompt, prompt_token_ids, params)
        deadline = None if self.request_timeout is None \
            else asyncio.get_running_loop().time() + self.request_timeout
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        engine_requests = self.processor.add_request(request_id, prompt, prompt_token_ids,
                                                     params)
        self.queues[request_id] = queue
        self.last_read[request_id] = asyncio.get_running_loop().time()
        self._num_sequences += params.n
        finished = False
        try:
            tenant = current_tenant.get()
            await self.client.add([  # every sample on one engine core, beside its leader
                EngineRequest(engine_id, list(prompt_token_ids), sample_params,
                              self.client.client_index, leader, tenant=tenant,
                              images=list(prompt_token_ids.images)
                              if isinstance(prompt_token_ids, PromptIds) else [])
                for engine_id, sample_params, leader in engine_requests])
            while True:
                item = await self._next(queue, deadline)
                self.last_read[request_id] = asyncio.get_running_loop().time()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._num_sequences -= params.n
            self.queues.pop(request_id, None)
            self.last_read.pop(request_id, None)
            self.stalled.discard(request_id)
            if not finished:  # cancelled, disconnected, or an error on our side: stop it
                self._abort_nowait(request_id)

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     pooling_params: PoolingParams) -> PoolingRequestOutput:
        """A prefill-only request: its vector once the engine has pooled its prompt. It counts
        as one sequence in flight; cancelled (its client went away) or past its deadline
        (RequestTimeoutError), it is aborted in the engine."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self.pooling or request_id in self.queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EngineCoreOutput] = loop.create_future()
        self.pooling[request_id] = future
        if self.request_logger is not None:
            self.request_logger.log_pooling(request_id, prompt_token_ids, pooling_params.task)
        started = time.monotonic()
        self._num_sequences += 1
        try:
            await self.client.add([EngineRequest(
                request_id, prompt_token_ids, SamplingParams(max_tokens=1),
                self.client.client_index, None, pooling_params)])
            try:
                async with asyncio.timeout(self.request_timeout):
                    out = await asyncio.shield(future)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request ran past the server's deadline of {self.request_timeout:g} s "
                    "(--request-timeout) and was stopped") from None
        finally:
            self._num_sequences -= 1
            self.pooling.pop(request_id, None)
            if not future.done() and self.dead_reason is None:  # cancelled or timed out
                self._abort_pooling_nowait(request_id)
        assert out.pooled is not None
        if self.processor.observer is not None:
            self.processor.observer.pooled(time.monotonic() - started, len(prompt_token_ids))
        return PoolingRequestOutput(request_id, prompt_token_ids, PoolingOutput(out.pooled),
                                    out.num_cached_tokens)

    def _abort_pooling_nowait(self, request_id: str) -> None:
        try:
            self.client.abort_nowait([request_id])
        except Exception as e:  # zmq.Again (queue full) or a closed socket
            logger.warning("could not send the abort of %s to the engine core: %r",
                           request_id, e)

    def _deliver_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand each pooling output to its request; the rest, for the output processor."""
        rest = []
        for eo in outputs:
            future = self.pooling.get(eo.request_id)
            if future is None:
                rest.append(eo)
            elif not future.done():
                if eo.pooled is None:
                    future.set_exception(ValueError(
                        f"the engine finished the request without a vector ({eo.finish_reason})"))
                else:
                    future.set_result(eo)
        return rest

    async def _next(self, queue: asyncio.Queue[RequestOutput | BaseException],
                    deadline: float | None) -> RequestOutput | BaseException:
        """The request's next update; past its deadline, RequestTimeoutError (checked before
        taking a queued update too, so a slow reader cannot outrun it)."""
        if deadline is None:
            return await queue.get()
        try:
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError
            async with asyncio.timeout_at(deadline):
                return await queue.get()
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request ran past the server's deadline of {self.request_timeout:g} s "
                "(--request-timeout) and was stopped") from None

    def _abort_nowait(self, request_id: str) -> None:
        engine_ids = self.processor.engine_ids(request_id)
        self.processor.abort(request_id)
        if engine_ids and self.dead_reason is None:
            try:
                self.client.abort_nowait(engine_ids)
            except Exception as e:  # zmq.Again (queue full) or a closed socket
                # the engine keeps running the request until it ends by itself: say so
                logger.warning("could not send the abort of %s to the engine core: %r",
                               request_id, e)

    async def _receive_loop(self) -> None:
        while True:
            message = await self.client.recv()
            if isinstance(message, EngineOutputs):
                outputs = message.outputs
                if self.pooling:
                    outputs = self._deliver_pooled(outputs)
                result = self.processor.process(outputs)
                for output in result.outputs:
                    queue = self.queues.get(output.request_id)
                    if queue is not None and not self._reader_stalled(output.request_id, queue):
                        queue.put_nowait(output)
                if result.to_abort:  # stop strings: free the blocks now
                    await self.client.abort(result.to_abort)
            elif isinstance(message, RequestError):
                self._fail_engine_request(message)
            elif isinstance(message, EngineDead):
                self._die(f"engine core {message.engine_index} failed: "
                          f"{message.message.splitlines()[-1]}")

    def _reader_stalled(self, request_id: str,
                        queue: asyncio.Queue[RequestOutput | BaseException]) -> bool:
        """Whether the consumer of `request_id` has stopped taking its updates (a client that
        does not read its stream); if so, its request is aborted, its queued updates dropped and
        SlowReaderError left for it, should it ever read again."""
        if request_id in self.stalled:
            return True
        if queue.empty():
            return False
        unread_for = asyncio.get_running_loop().time() - self.last_read.get(request_id, 0.0)
        if unread_for < self.slow_reader_timeout and queue.qsize() < self.max_unread_updates:
            return False
        logger.warning("request %s: its client left %d updates unread for %.1f s; aborted",
                       request_id, queue.qsize(), unread_for)
        self.stalled.add(request_id)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(SlowReaderError(
            f"the client read its stream too slowly ({unread_for:.1f} s without reading, "
            f"{self.max_unread_updates} updates at most: --slow-reader-timeout, "
            "--max-unread-updates); the request was stopped"))
        self._abort_nowait(request_id)
        return True

    def _fail_engine_request(self, message: RequestError) -> None:
        future = self.pooling.get(message.request_id)
        if future is not None and not future.done():
            future.set_exception(ValueError(message.message))
            return
        sample = self.processor.samples.get(message.request_id)
        if sample is None:
            return
        queue = self.queues.get(sample.request_id)
        self._abort_nowait(sample.request_id)
        if queue is not None:
            queue.put_nowait(ValueError(message.message))

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(_WATCHDOG_INTERVAL_S)
            if not self.engine_alive():
                self._die("the engine core process exited")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        logger.error("engine core dead: %s", reason)
        self.dead_reason = reason
        for queue in self.queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self.pooling.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead()
