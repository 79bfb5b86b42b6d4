"""One rank: its process group, its shard of the model and of the paged KV cache, its `Worker`.

Every rank loads the model from its folder, cuts its tensor-parallel shard (`tensor_parallel.shard_model`) and
its pipeline stage (`pipeline_parallel.cut_stage`), and builds an ordinary `Worker` over it, whose KV cache holds
this rank's `num_kv_heads / T` heads of its stage's layers, in as many blocks as every other rank: the ranks agree
on the smallest count, so one block table addresses all P x T pools. The start-up measurement
behind "auto" preemption is rank 0's, so that every rank's scheduler (under torchrun) decides alike.

`RankWorker` is what a rank runs; `worker_main` is the loop of a rank in its own process, answering the driver
(`pagedlab.worker.executor.MultiprocExecutor`) until it says stop or goes away.

# Explained in chapters/12_tensor_parallelism.ipynb
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pagedlab.config import EngineConfig
from pagedlab.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedlab.models import load_weights
from pagedlab.worker.kv_cache import KVCacheSpec, num_blocks_for_budget
from pagedlab.worker.kv_quant import resolve_kv_cache_dtype
from pagedlab.worker.pipeline_parallel import StageStats, cut_stage, layer_partition
from pagedlab.worker.tensor_parallel import CollectiveStats, shard_model
from pagedlab.worker.worker import Worker

logger = logging.getLogger("pagedlab")


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the driver once it is ready."""

    rank: int
    stage: int  # its pipeline stage (0 without pipeline parallelism)
    layers: tuple[int, int]  # the decoder layers [start, stop) its stage holds
    num_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    bytes_per_block: int  # this rank's share of a block
    kv_cache_bytes: int  # this rank's KV pool
    kv_heads: tuple[int, int]  # the KV heads [start, stop) this rank holds
    attention_backend: str
    cost_model: object  # PreemptionCostModel | None (rank 0's, on every rank)


def init_distributed(rank: int, size: int, device: torch.device, store=None, timeout: float = 300.0,
                     pipeline_parallel_size: int = 1):
    """Join the process group (gloo on CPU, nccl on CUDA) and return the 2-D device mesh of the ranks, ("pp", "tp"):
    `pipeline_parallel_size` stages of size / pipeline_parallel_size tensor-parallel ranks."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
    if dist.get_world_size() != size:
        raise ValueError(f"{size} ranks expected but the process group has {dist.get_world_size()}")
    return init_device_mesh(device.type, (pipeline_parallel_size, size // pipeline_parallel_size),
                            mesh_dim_names=("pp", "tp"))


def output_rank(config: EngineConfig) -> int:
    """The rank whose step outputs go back to the driver: the first of the last stage, the only stage that samples."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


class RankWorker:
    """This rank's sharded model and its `Worker`; the driver's messages are its methods."""

    def __init__(self, model_path, dtype, device: torch.device, config: EngineConfig, mesh) -> None:
        tp_mesh = mesh["tp"]
        self.rank, self.size = dist.get_rank(), mesh.size()
        self.stage, tp_rank, tp_size = mesh["pp"].get_local_rank(), tp_mesh.get_local_rank(), tp_mesh.size()
        self.stats, self.stage_stats = CollectiveStats(), StageStats()
        model = load_weights(model_path, dtype, device)
        num_layers = model.config.num_hidden_layers
        bounds = layer_partition(num_layers, mesh["pp"].size(), config.pipeline_layer_partition)
        self.layers = bounds[self.stage]
        self.model = shard_model(model, tp_mesh, self.stats) if tp_size > 1 else model
        if len(bounds) > 1:
            cut_stage(self.model, self.stage, bounds, self.rank, tp_size, self.stage_stats)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, next(self.model.parameters()).dtype)
        full = KVCacheSpec.from_model_config(model.config, kv_dtype)  # an fp8 cache: its real bytes per block
        spec = dataclasses.replace(full, num_kv_heads=full.num_kv_heads // tp_size,
                                   num_layers=self.layers[1] - self.layers[0])
        self.kv_heads = (tp_rank * spec.num_kv_heads, (tp_rank + 1) * spec.num_kv_heads)
        # The same number of blocks on every rank: the smallest any rank's budget allows.
        wanted_len = config.max_model_len or getattr(model.config, "max_position_embeddings", None) or 1 << 30
        num_blocks = torch.tensor(num_blocks_for_budget(
            spec, config.block_size, device, num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory, gpu_memory_utilization=config.gpu_memory_utilization,
            max_useful_tokens=config.max_num_seqs * wanted_len,
        ))
        dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN)  # over every rank of every stage
        # CUDA graphs would have to record the collectives too: parallel steps run eagerly.
        rank_config = dataclasses.replace(config, num_kv_blocks=int(num_blocks), enforce_eager=True)
        self.worker = Worker(self.model, rank_config, kv_cache_spec=spec, last_stage=self.stage == len(bounds) - 1)
        shared = [self.worker.cost_model]
        dist.broadcast_object_list(shared, src=0)
        self.worker.cost_model = shared[0]
        self.worker.info = dataclasses.replace(self.worker.info, cost_model=shared[0])
        self.worker.config = dataclasses.replace(
            self.worker.config, num_kv_blocks=config.num_kv_blocks, enforce_eager=config.enforce_eager
        )  # what the engine was asked for, with max_model_len resolved
        self.stats.reset()  # the start-up measurements are not steps
        self.stage_stats.reset()

    def info(self) -> RankInfo:
        worker = self.worker
        return RankInfo(
            self.rank, self.stage, self.layers, worker.num_blocks, worker.num_cpu_blocks, worker.config.max_model_len,
            worker.bytes_per_block, self.kv_cache_bytes(), self.kv_heads, worker.attention_backend, worker.cost_model,
        )

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        start, waited = time.perf_counter(), self.stage_stats.receive_wait_s
        try:
            return self.worker.execute_model(output)
        finally:
            self.stage_stats.record_step(start, time.perf_counter(), self.stage_stats.receive_wait_s - waited)

    def kv_cache_bytes(self) -> int:
        """The bytes of this rank's KV pool (its heads of every block)."""
        return self.worker.model_runner.kv_cache.nbytes

    def swap_cache_bytes(self) -> int:
        """The bytes of this rank's CPU swap pool (its heads of every CPU block)."""
        cpu = self.worker.cpu_kv_cache
        return cpu.cache.nbytes if cpu is not None else 0

    def kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's K and V of some blocks: [layers, 2, len(block_ids), block_size, kv_heads / N, head_dim]."""
        return self.worker.model_runner.kv_cache[:, :, block_ids].cpu()

    def collective_stats(self, reset: bool = False) -> CollectiveStats:
        snapshot = self.stats.snapshot()
        if reset:
            self.stats.reset()
        return snapshot

    def pipeline_stats(self, reset: bool = False) -> StageStats:
        """This rank's traffic between pipeline stages (none without pipeline parallelism) and its step time."""
        snapshot = self.stage_stats.snapshot()
        if reset:
            self.stage_stats.reset()
        return snapshot


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, even while it waits in a collective."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _read_messages(conn, inbox: queue.Queue) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone
            message = ("shutdown", ())
        inbox.put(message)
        if message[0] == "shutdown":
            return


def worker_main(rank: int, size: int, model_path, dtype, device, config, store_addr, conn, num_threads) -> None:
    """A rank in its own process: build, report `RankInfo`, then answer (method, args) messages until "shutdown"
    or until the driver's end of the pipe closes. Replies are ("ok", value) or ("error", traceback text); only
    the first rank of the last stage sends the step's output back (its stage's others computed the same, the
    earlier stages none). A thread reads the messages as they come, so that a driver sending the next step while
    this rank replies to the last one (several batches in flight) never waits on a full pipe."""
    _die_with_parent()
    if device.type == "cpu":
        torch.set_num_threads(num_threads)
    try:
        host, port = store_addr
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.distributed_timeout))
        mesh = init_distributed(rank, size, device, store, config.distributed_timeout, config.pipeline_parallel_size)
        ranked = RankWorker(model_path, dtype, device, config, mesh)
        replies_outputs = output_rank(config)
        conn.send_bytes(pickle.dumps(("ok", ranked.info())))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_messages, args=(conn, inbox), name="pagedlab-inbox", daemon=True).start()
    while True:
        method, args = inbox.get()
        if method == "shutdown":  # asked, or the driver is gone
            break
        try:
            result = getattr(ranked, method)(*args)
            reply = ("ok", None if method == "execute_model" and rank != replies_outputs else result)
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            conn.send_bytes(pickle.dumps(reply))
        except (BrokenPipeError, OSError):
            break
    dist.destroy_process_group()
