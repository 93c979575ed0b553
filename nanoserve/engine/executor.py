"""How the engine core reaches its workers: one `StepInput` out, one `StepOutput` back a step.

At one rank there is one worker, in the core's own process (`InProcessExecutor`). Tensor
parallelism gives the same interface a multi-process implementation (tp_executor.py): the step
input is data only (flat numpy arrays and msgspec structs, protocol.py), so it is published to
every rank as msgpack, and rank 0's sampling comes back. `serialize=True` sends every step
through that encoding in-process, so tests show that nothing but data crosses the seam.
"""

from __future__ import annotations

from typing import Protocol

from nanoserve.engine.worker import Worker
from nanoserve.protocol import (
    StepInput,
    StepOutput,
    decode_step,
    decode_step_output,
    encode,
)


class Executor(Protocol):
    """Runs a step on every worker; rank 0's output is the step's."""

    @property
    def local_worker(self) -> Worker:
        """The worker in this process (rank 0's): its sampler validates requests, and tests
        and benches read its runner's model and cache."""

    def execute_step(self, step: StepInput) -> StepOutput:
        """Run `step` on every worker; rank 0's sampled tokens, logprobs and pooled vectors."""

    def pin_cores(self) -> None:
        """Put this process on its share of the cores where the executor split them among
        ranks (an engine-core process only: in-process, as under `LLM`, the caller's process
        keeps its affinity)."""

    def check_health(self) -> None:
        """Raise if a worker is gone (the engine loop asks between steps, too)."""

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """One worker, called directly (or through msgpack both ways, with `serialize`)."""

    def __init__(self, worker: Worker, serialize: bool = False) -> None:
        self.worker = worker
        self.serialize = serialize

    @property
    def local_worker(self) -> Worker:
        return self.worker

    def pin_cores(self) -> None:
        pass  # one worker: the process keeps the cores it was given

    def execute_step(self, step: StepInput) -> StepOutput:
        if not self.serialize:
            return self.worker.execute(step)
        output = self.worker.execute(decode_step(encode(step)))
        return decode_step_output(encode(output))

    def check_health(self) -> None:
        pass  # the worker is this process

    def shutdown(self) -> None:
        pass
