"""The device side on a Ray cluster: the P x T ranks of `MultiprocExecutor` as Ray actors, vLLM's
`distributed_executor_backend="ray"`.

Ray only places the ranks and carries the driver's calls; the ranks meet and talk as they do under the "mp"
backend, through `torch.distributed` (a store this process hosts, then gloo on CPU or NCCL on CUDA), and each
runs the same `RankWorker`. A placement group reserves one bundle per rank (a CPU, or a GPU) before any actor
starts, packed onto as few nodes as it can, so that a cluster too small is refused up front rather than found
out half-started. Rank r runs in bundle r. An actor runs the calls of one caller in the order they were sent,
which is what several batches in flight need, as under "mp".

A rank that dies, raises or does not answer within `distributed_timeout` stops every actor and raises
`TensorParallelError`, as under "mp"; `shutdown()` (or garbage collection) kills the actors and removes the
placement group. The engine joins the cluster this process has joined (`ray.init(address=...)` before building
it), else the one RAY_ADDRESS names, else it starts a local one. Every node must reach this machine (the
store) and must have the model's folder at the same path.

# Explained in README.md (Beyond one device: pipeline parallelism)
"""

from __future__ import annotations

import os
import time
import weakref
from types import MappingProxyType

import torch

from pagedlab.config import EngineConfig
from pagedlab.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedlab.worker.executor import TensorParallelError, describe_ranks

# Ray starts its workers at niceness 15, below every ordinary process: on a machine busy with anything else a rank
# then gets a sliver of a core (two spinning processes on 2 cores kept both ranks from finishing `import torch` for
# minutes, and the start-up timed out). The ranks are the engine's compute, so a local cluster the engine starts
# runs them at the default priority; a cluster of `ray start` takes `RAY_worker_niceness=0` in its environment.
LOCAL_CLUSTER_CONFIG = MappingProxyType({"worker_niceness": 0})  # ray.init adds its own keys to the dict it gets


def import_ray():
    """The `ray` module, or a ValueError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(
            'distributed_executor_backend="ray" needs Ray, which is not installed: pip install "pagedlab[ray]" '
            '(or use the default, distributed_executor_backend="mp", for ranks on this machine)'
        ) from None
    return ray


class RankActor:
    """One rank in a Ray actor: the `RankWorker` a rank process runs, answering the driver's calls."""

    def __init__(self, rank: int, size: int, model_path, dtype, device_type: str, config: EngineConfig,
                 store_addr: tuple[str, int], num_threads: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from pagedlab.worker.tp_worker import RankWorker, init_distributed, output_rank

        # Under Ray a GPU actor sees its own GPU only, as device 0.
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device(device_type)
        if device.type == "cpu":
            torch.set_num_threads(num_threads)
        host, port = store_addr
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.distributed_timeout))
        mesh = init_distributed(rank, size, device, store, config.distributed_timeout, config.pipeline_parallel_size)
        self.ranked = RankWorker(model_path, dtype, device, config, mesh)
        self.rank, self.replies_outputs = rank, output_rank(config)

    def call(self, method: str, *args):
        result = getattr(self.ranked, method)(*args)
        return None if method == "execute_model" and self.rank != self.replies_outputs else result

    def pid(self) -> int:
        return os.getpid()


class RayStepFuture:
    """A step sent to every actor whose output has not been read yet."""

    def __init__(self, executor: RayExecutor, refs: list) -> None:
        self._executor, self._refs = executor, refs

    def result(self) -> ModelRunnerOutput:
        return self._executor._get(self._refs, "execute_model")[self._executor.output_rank]


class RayExecutor:
    """P x T ranks as Ray actors, used by the engine exactly as it uses a `Worker` (or a `MultiprocExecutor`)."""

    def __init__(self, path, dtype: torch.dtype, device: torch.device, config: EngineConfig) -> None:
        import torch.distributed as dist

        from pagedlab.worker.tp_worker import output_rank

        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"_system_config": dict(LOCAL_CLUSTER_CONFIG)}))
        self.size, self.timeout = config.world_size, config.distributed_timeout
        self.output_rank = output_rank(config)
        self.max_concurrent_batches = config.max_concurrent_batches or config.pipeline_parallel_size
        self._failure: str | None = None
        resource = "GPU" if device.type == "cuda" else "CPU"
        available = ray.cluster_resources().get(resource, 0)
        if available < self.size:
            raise ValueError(
                f"{self.size} ranks (pipeline_parallel_size x tensor_parallel_size) need {self.size} {resource}s on "
                f"the Ray cluster, which has {available:g}; add nodes (ray start --address=...) or use fewer ranks"
            )
        self.actors: list = []
        self.placement_group = placement_group([{resource: 1}] * self.size, strategy="PACK")
        self._finalizer = weakref.finalize(self, _stop, ray, self.actors, self.placement_group)
        try:
            ray.get(self.placement_group.ready(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            self._fail(f"the Ray cluster did not place {self.size} bundles of one {resource} within "
                       f"{self.timeout:g} s (distributed_timeout)")
        # The ranks meet at a store this process hosts, on a free port, at an address the other nodes can reach.
        host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        actor_class = ray.remote(RankActor)
        num_threads = max(1, int(ray.cluster_resources().get("CPU", 1)) // self.size) if resource == "CPU" else 1
        for rank in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(
                name=None, num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0,
                scheduling_strategy=strategy,
            ).remote(rank, self.size, str(path), dtype, device.type, config, (host, self._store.port), num_threads))
        self.ranks = self._get([actor.call.remote("info") for actor in self.actors], "start-up")
        self.info, self.cpu_kv_cache = describe_ranks(self.ranks, config)

    # -- the Executor's interface (pagedlab.core.executor) -----------------------------------------------------

    def execute_model(self, output: SchedulerOutput, non_block: bool = False) -> ModelRunnerOutput | RayStepFuture:
        """Send the step to every actor; the output rank's comes back. `non_block`: return a future of it."""
        future = RayStepFuture(self, self._send("execute_model", output))
        return future if non_block else future.result()

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group (safe to call twice)."""
        self._finalizer()

    def pids(self) -> list[int]:
        """The actors' process ids, in rank order."""
        return self._get([actor.pid.remote() for actor in self.actors], "pid")

    # -- calls ----------------------------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args) -> list:
        """Call `RankWorker.<method>(*args)` on every rank (after the steps sent before); results in rank order."""
        return self._get(self._send(method, *args), method)

    def _send(self, method: str, *args) -> list:
        if self._failure is not None:
            raise TensorParallelError(f"the Ray ranks were stopped: {self._failure}")
        args = [self.ray.put(arg) for arg in args]  # serialized once, read by every actor
        return [actor.call.remote(method, *args) for actor in self.actors]

    def _get(self, refs: list, what: str) -> list:
        """Every rank's reply, within the timeout; a rank that died, raised or hung stops them all."""
        ray = self.ray
        if self._failure is not None:
            raise TensorParallelError(f"the Ray ranks were stopped: {self._failure}")
        deadline, pending = time.monotonic() + self.timeout, list(refs)
        try:
            while pending:  # each reply as it comes, so that one rank's death is seen while the others wait
                ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    rank = refs.index(pending[0])
                    self._fail(f"Ray rank {rank} did not answer {what!r} within {self.timeout:g} s "
                               f"(distributed_timeout): hung")
                ray.get(ready)
            return ray.get(refs)
        except ray.exceptions.RayActorError as error:
            self._fail(f"a Ray rank died during {what!r}: {str(error).splitlines()[0]}")
        except ray.exceptions.RayTaskError as error:
            self._fail(f"a Ray rank raised during {what!r}:\n{error}")

    def _fail(self, why: str):
        self._failure = why.splitlines()[0]
        self.shutdown()
        raise TensorParallelError(why)


def _stop(ray, actors: list, group) -> None:
    """Kill the actors (a killed actor's process ends with it) and give the placement group's bundles back."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
    try:
        remove_placement_group(group)
        deadline = time.monotonic() + 5.0  # the cluster frees the bundles soon after: wait, so close() is done
        while placement_group_table(group).get("state") != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the cluster is gone
        pass

