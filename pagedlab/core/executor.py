"""The written contract of the device side (vLLM's abstract `Executor`): what the engine core may ask of it.

An executor runs each step's `SchedulerOutput` (the block moves, one forward pass, sampling) and returns a
`ModelRunnerOutput`; it describes its KV cache once, in a frozen `WorkerInfo`. Three implement it: the
`Worker` in this process, the tensor-parallel `MultiprocExecutor` over N processes, and the simulator's
`MadeUpExecutor`, which makes tokens up. The core reads the info record, never the executor's attributes, but
one: an executor that runs several batches at once (pipeline stages) says how many in `max_concurrent_batches`
and takes `execute_model(output, non_block=True)`, returning a future whose `result()` is the output; the core
then keeps a queue of batches in flight (`pagedlab.core.engine_core`).

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagedlab.core.preemption import PreemptionCostModel
from pagedlab.core.sched_output import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerInfo:
    """The device side's KV cache and how it runs, as the core needs it."""

    num_blocks: int  # device KV blocks
    num_cpu_blocks: int  # CPU swap blocks (0: no swap space, recompute only)
    bytes_per_block: int  # one block's K and V in every layer (over all tensor-parallel ranks)
    max_model_len: int  # the model's limit, capped by what the cache holds
    attention_backend: str = "torch"
    cost_model: PreemptionCostModel | None = None  # what "auto" preemption asks (measured at start-up)


class Executor(Protocol):
    info: WorkerInfo

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's block moves, drop the state of `scheduler_output.finished_req_ids`, run the step."""
        ...

    def shutdown(self) -> None:
        """Stop whatever runs outside this process (safe to call twice)."""
        ...


def check_max_model_len(max_model_len: int | None, num_blocks: int, block_size: int) -> None:
    """A max_model_len that no request could ever reach is refused, with the cache's size."""
    capacity = num_blocks * block_size
    if max_model_len is not None and max_model_len > capacity:
        raise ValueError(
            f"max_model_len={max_model_len} can never fit: the KV cache holds {num_blocks} blocks "
            f"x {block_size} = {capacity} tokens; raise the KV budget or lower max_model_len"
        )
