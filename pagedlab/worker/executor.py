"""The device side over N processes, behind the `Worker`'s interface: vLLM V1's `MultiprocExecutor`.

The driver (the engine's process: scheduler, block manager, outputs) starts one process per rank
(`tp_worker.worker_main`): P pipeline stages of T tensor-parallel ranks, rank = stage x T + position. It hosts the
store through which they find each other, and at every step sends all of them the same pickled `SchedulerOutput`
(a broadcast over pipes); each rank applies the block moves to its own KV pool and runs its shard of its stage;
the first rank of the last stage sends the step's `ModelRunnerOutput` back. With P > 1 stages, P batches may be in
flight (`max_concurrent_batches`, vLLM's name): `execute_model(..., non_block=True)` sends a step and returns a
future; every rank answers its messages in order, so the oldest step's replies come first. A rank that dies,
raises or does not answer within `distributed_timeout` stops every rank and raises `TensorParallelError`.
`shutdown()`, garbage collection of the executor and the end of the interpreter all stop the ranks and wait for
them.

Under `torchrun` nothing is started: every process runs the same script, hence the same engine, with its rank in
process (vLLM's "external launcher"); the scheduler is deterministic, so every rank schedules the same steps.

# Explained in chapters/12_tensor_parallelism.ipynb
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from pagedlab.config import EngineConfig
from pagedlab.core.executor import WorkerInfo
from pagedlab.core.preemption import PreemptionMode
from pagedlab.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedlab.models import check_supported, load_tokenizer, model_path, resolve_device, resolve_dtype
from pagedlab.worker.tensor_parallel import check_tensor_parallel_size

logger = logging.getLogger("pagedlab")
START_METHOD_VARIABLE = "PAGEDLAB_WORKER_MULTIPROC_METHOD"  # forkserver (default where there is one), spawn, fork


class TensorParallelError(RuntimeError):
    """A tensor- or pipeline-parallel rank died, raised or hung; every rank has been stopped."""


def refuse_model_object(config: EngineConfig) -> None:
    sizes = [f"{name}_parallel_size={size}" for name, size in
             (("tensor", config.tensor_parallel_size), ("pipeline", config.pipeline_parallel_size)) if size > 1]
    raise ValueError(
        f"{' and '.join(sizes)} needs the model as a folder or Hub id: each rank loads its own shard in its "
        f"own process, and a model object lives in this one; save it (model.save_pretrained(folder)) and pass "
        f"the folder"
    )


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(model, tokenizer, dtype, device, config: EngineConfig):
    """(the driver's model, tokenizer, worker) of a tensor-parallel engine.

    The driver's model is the architecture on PyTorch's meta device (its config, generation config and shapes, no
    weights); under torchrun it is this rank's shard."""
    from transformers import AutoConfig, PreTrainedModel

    from pagedlab.worker.pipeline_parallel import check_pipeline_parallel_size, layer_partition

    size = config.tensor_parallel_size
    if isinstance(model, PreTrainedModel):
        refuse_model_object(config)
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a name, a path or a transformers PreTrainedModel, got {type(model).__name__}")
    device, path = resolve_device(device), model_path(model)
    dtype = resolve_dtype(dtype, device)
    hf_config = AutoConfig.from_pretrained(path)
    check_supported(hf_config)
    check_tensor_parallel_size(hf_config, size)  # before any process starts
    check_pipeline_parallel_size(hf_config, config.pipeline_parallel_size, config.pipeline_layer_partition)
    if config.distributed_executor_backend == "ray":
        from pagedlab.worker.ray_executor import import_ray

        if under_torchrun():
            raise ValueError('distributed_executor_backend="ray" places the ranks itself; under torchrun, which '
                             'started them already, leave it at "mp"')
        import_ray()  # installed, or a ValueError saying how
    world = config.world_size
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"{world} ranks (pipeline_parallel_size x tensor_parallel_size) need {world} CUDA devices; torch sees "
            f"{torch.cuda.device_count()}"
        )
    tokenizer = load_tokenizer(path, tokenizer)
    if config.pipeline_parallel_size > 1:
        if under_torchrun():
            raise ValueError("pipeline_parallel_size > 1 runs under pagedlab's own executor, not torchrun: under "
                             "torchrun every rank runs its own scheduler, and only the last stage sees the tokens")
        bounds = layer_partition(hf_config.num_hidden_layers, config.pipeline_parallel_size,
                                 config.pipeline_layer_partition)
        logger.info("pipeline stages (layers [start, stop)): %s", ", ".join(
            f"stage {stage}: {start}-{stop}" for stage, (start, stop) in enumerate(bounds)))
    if under_torchrun():
        from pagedlab.worker.tp_worker import RankWorker, init_distributed

        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        rank_device = torch.device("cuda", local_rank) if device.type == "cuda" else device
        mesh = init_distributed(rank, size, rank_device, timeout=config.distributed_timeout)
        ranked = RankWorker(path, dtype, rank_device, config, mesh)
        return ranked.model, tokenizer, ranked.worker
    if config.distributed_executor_backend == "ray":
        from pagedlab.worker.ray_executor import RayExecutor

        return driver_model(path, hf_config, dtype), tokenizer, RayExecutor(path, dtype, device, config)
    return driver_model(path, hf_config, dtype), tokenizer, MultiprocExecutor(path, dtype, device, config)


def driver_model(path, hf_config, dtype: torch.dtype) -> torch.nn.Module:
    """The model's architecture on the meta device: what the driver reads (vocabulary, EOS ids), no memory."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the one derived from the config stays
        pass
    return model.eval()


@dataclass(frozen=True)
class RemoteSwapPools:
    """The CPU swap pools, one per rank in the rank's process (each holds its heads of `num_blocks` blocks)."""

    num_blocks: int
    bytes_per_rank: int


def describe_ranks(ranks, config: EngineConfig) -> tuple[WorkerInfo, RemoteSwapPools | None]:
    """The `WorkerInfo` of P x T ranks from what each reported (`RankInfo`), and their swap pools, if any."""
    first = ranks[0]
    bytes_per_block = sum(rank.bytes_per_block for rank in ranks)  # a block's bytes over all ranks
    info = WorkerInfo(first.num_blocks, first.num_cpu_blocks, bytes_per_block, first.max_model_len,
                      first.attention_backend, first.cost_model)
    swap = None
    if PreemptionMode(config.preemption_mode) != PreemptionMode.RECOMPUTE:
        swap = RemoteSwapPools(first.num_cpu_blocks, first.num_cpu_blocks * first.bytes_per_block)
    return info, swap


def _context():
    method = os.environ.get(START_METHOD_VARIABLE) or (
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    context = multiprocessing.get_context(method)
    if method == "forkserver":  # the fork server imports torch and pagedlab once; each rank is then a fork of it
        context.set_forkserver_preload(["pagedlab.worker.tp_worker"])
    return context


class MultiprocExecutor:
    """N ranks in N processes, used by the engine exactly as it uses a `Worker`."""

    def __init__(self, path, dtype: torch.dtype, device: torch.device, config: EngineConfig) -> None:
        import torch.distributed as dist

        from pagedlab.worker.tp_worker import RankInfo, output_rank, worker_main

        self.size, self.timeout = config.world_size, config.distributed_timeout
        self.output_rank = output_rank(config)
        self.max_concurrent_batches = config.max_concurrent_batches or config.pipeline_parallel_size
        self._failure: str | None = None
        self._pending: deque[StepFuture] = deque()  # steps sent whose replies are not read yet, oldest first
        # The ranks meet at a store this process hosts, on a free port: nothing to configure, no port to collide.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        context = _context()
        num_threads = max(1, torch.get_num_threads() // self.size)
        self.processes, self.connections = [], []
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.connections)
        for rank in range(self.size):
            rank_device = torch.device("cuda", rank) if device.type == "cuda" else device
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main, name=f"pagedlab-rank{rank}", daemon=True,
                args=(rank, self.size, path, dtype, rank_device, config, ("127.0.0.1", self._store.port), theirs,
                      num_threads),
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self.connections.append(ours)
        self.ranks: list[RankInfo] = self._gather("start-up")
        self.info, self.cpu_kv_cache = describe_ranks(self.ranks, config)

    # -- the Executor's interface (pagedlab.core.executor) -----------------------------------------------------

    def execute_model(self, output: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Send the step to every rank; the output rank's comes back (the last stage's others computed the same,
        the earlier stages none). `non_block`: return at once a future of it, and let the ranks work."""
        self._send("execute_model", output)
        future = StepFuture(self)
        self._pending.append(future)
        return future if non_block else future.result()

    def shutdown(self) -> None:
        """Stop every rank and wait for it (safe to call twice)."""
        self._finalizer()

    # -- messages -------------------------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args) -> list:
        """Call `RankWorker.<method>(*args)` on every rank; their results in rank order (after the steps in flight)."""
        self._complete(None)
        self._send(method, *args)
        return self._gather(method)

    def _send(self, method: str, *args) -> None:
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel ranks were stopped: {self._failure}")
        payload = pickle.dumps((method, args))  # pickled once, sent N times
        for rank, connection in enumerate(self.connections):
            try:
                connection.send_bytes(payload)
            except OSError:
                self._fail(f"rank {rank} is gone ({self._exit_status(rank)})")

    def _complete(self, future: StepFuture | None) -> None:
        """Read the replies of the steps in flight, oldest first, up to `future` (None: all of them)."""
        while self._pending and (future is None or not future.done):
            oldest = self._pending.popleft()
            oldest.set(self._gather("execute_model")[self.output_rank])

    def _gather(self, what: str) -> list:
        """One reply from every rank, within the timeout, watching every process for an early death."""
        deadline = time.monotonic() + self.timeout
        replies: dict[int, object] = {}
        pending = dict(enumerate(self.connections))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"rank(s) {sorted(pending)} did not answer {what!r} within {self.timeout:g} s "
                           f"(distributed_timeout): hung")
            sentinels = {self.processes[rank].sentinel: rank for rank in pending}
            ready = wait([*pending.values(), *sentinels], timeout=remaining)
            for rank, connection in list(pending.items()):
                if connection in ready:
                    try:
                        status, value = pickle.loads(connection.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(f"rank {rank} died during {what!r} ({self._exit_status(rank)}){_hint(what)}")
                    if status == "error":
                        self._fail(f"rank {rank} raised during {what!r}:\n{value}")
                    replies[rank] = value
                    del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending and not pending[rank].poll():
                    self._fail(f"rank {rank} died during {what!r} ({self._exit_status(rank)}){_hint(what)}")
        return [replies[rank] for rank in range(self.size)]

    def _exit_status(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(timeout=0.1)
        code = process.exitcode
        if code is None:
            return f"pid {process.pid}, still running"
        return f"pid {process.pid}, killed by signal {-code}" if code < 0 else f"pid {process.pid}, exit code {code}"

    def _fail(self, why: str):
        self._failure = why.splitlines()[0]
        self.shutdown()
        raise TensorParallelError(why)


class StepFuture:
    """A step sent to the ranks whose output has not been read yet (`MultiprocExecutor.execute_model`)."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        self._executor, self.done, self._output = executor, False, None

    def set(self, output: ModelRunnerOutput) -> None:
        self.done, self._output = True, output

    def result(self) -> ModelRunnerOutput:
        """Its output, once the ranks have answered it (and every step sent before it)."""
        self._executor._complete(self)
        return self._output


def _hint(what: str) -> str:
    if what != "start-up":
        return ""
    return ("; its error is printed above. A rank process imports the main script again (forkserver or spawn): "
            "a script that builds an LLM must guard its top level with `if __name__ == \"__main__\":`")


def _stop(processes, connections, grace: float = 5.0) -> None:
    """Ask every rank to stop, wait `grace` seconds, then terminate and kill what is left; close the pipes."""
    for connection in connections:
        try:
            connection.send_bytes(pickle.dumps(("shutdown", ())))
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=1.0)
        if process.is_alive():
            process.kill()  # a stopped (SIGSTOP) or stuck process ignores SIGTERM until it runs again
            process.join()
    for connection in connections:
        connection.close()
