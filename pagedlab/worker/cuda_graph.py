"""CUDA graphs for decode steps: record the model's forward once per padded batch size, replay it after.

A decode step of a small model at a small batch is launch-bound: 30 layers of norms, projections, RoPE and
attention are hundreds of small kernels, and the GPU waits for the CPU to launch each one. A CUDA graph
records the kernels of one forward pass for a fixed batch size and replays them all with a single launch.
Whatever changes between replays lives in static tensors that the recorded kernels read: token ids,
positions, the slot each new K/V goes to, the block tables and the context lengths. So:

    capture, per size S (largest first, at start-up):     replay, for a step of B <= S decodes:
      static tensors of S rows                              copy the step's B rows into the static tensors,
      run the model on them twice (Triton compiles)         pad rows B..S: slot -1 (the KV store skips it),
      record a third run into a graph                       context length 1, block 0, token 0
                                                            graph.replay(); keep the logits of rows < B

Padding rows compute garbage that no one reads: every operation of a decoder is row-wise except attention,
which reads only each row's own context. Only pure-decode steps (one new token per sequence) with the Triton
backend on CUDA run graphs: the torch backend splits the decodes into length buckets in Python, from the
step's lengths, which no recording can hold; steps with a prefill, or more decodes than the largest size,
run eagerly. Block tables are recorded at max_model_len wide, so the decode kernel's grid (and its split-K
choice) is the same at every replay. All graphs share one memory pool: each replay's activations are dead
once its logits are taken, as vLLM relies on too.

Each size is checked once after capture: its replay must give the logits the eager forward gave on the same
inputs, or graphs are switched off with a warning (`LLM(enforce_eager=True)` switches them off outright).

# Explained in chapters/09_the_whole_engine.ipynb
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedlab.core.block_table import cdiv
from pagedlab.worker.attention import AttentionMetadata, PagedAttentionContext

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes recorded: CAPTURE_SIZES up to max_num_seqs, and max_num_seqs itself."""
    sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
    return sorted(set(sizes))


class CudaGraph:
    """One recorded forward pass on the GPU (`torch.cuda.CUDAGraph`), in a memory pool shared by all sizes."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return forward()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """The same contract without a GPU: `replay` re-runs the forward into the tensor `capture` returned.

    It exercises everything around the recording (static tensors, padding, picking a size, taking rows)
    where no CUDA device exists, as in the CPU tests."""

    def __init__(self, pool=None) -> None:
        self.forward: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.forward = forward
        self.output = forward()
        return self.output

    def replay(self) -> None:
        self.output.copy_(self.forward())


class DecodeGraphs:
    """Recorded decode steps for the padded sizes of `capture_sizes(max_num_seqs)`.

    `forward(input_ids [S], positions [S], context) -> logits [S, vocab]` runs the model eagerly; it is what
    gets recorded. The static tensors hold max_num_seqs rows; a size-S graph reads their first S rows.
    """

    def __init__(
        self, forward: Callable, kv_cache: torch.Tensor, max_num_seqs: int, max_model_len: int, block_size: int,
        graph_class: type = CudaGraph,
    ) -> None:
        device = kv_cache.device
        self.forward = forward
        self.kv_cache = kv_cache
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = cdiv(max_model_len, block_size)
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, object] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.graph_class = graph_class
        self.enabled = True

    def _context(self, size: int) -> PagedAttentionContext:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefills=[],
        )
        return PagedAttentionContext(metadata, self.kv_cache, "triton")

    def _run(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._context(size))

    def capture_all(self) -> bool:
        """Record every size, largest first (the pool then serves the smaller ones from the same memory).
        Returns whether graphs are on: a failure or a mismatch switches them off, with a warning."""
        pool = torch.cuda.graph_pool_handle() if self.graph_class is CudaGraph else None
        try:
            for size in reversed(self.sizes):
                self._capture(size, pool)
        except Exception as error:  # a model whose forward cannot be recorded: run eagerly instead
            logger.warning("CUDA graphs off: capturing the decode step failed (%s: %s)", type(error).__name__, error)
            self.graphs.clear()
            self.logits.clear()
            self.enabled = False
        return self.enabled

    def _capture(self, size: int, pool) -> None:
        self._reset_padding(0)
        side = torch.cuda.Stream() if self.graph_class is CudaGraph else None
        if side is not None:  # warm up (Triton compiles, cuBLAS picks kernels) off the default stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(size)
                expected = self._run(size).clone()
            torch.cuda.current_stream().wait_stream(side)
        else:
            expected = self._run(size).clone()
        graph = self.graph_class(pool)
        self.logits[size] = graph.capture(lambda: self._run(size))
        self.graphs[size] = graph
        graph.replay()  # the same kernels on the same inputs: equal up to a rounding step of the model's dtype
        tolerance = 1e-4 if self.kv_cache.dtype == torch.float32 else 2e-2
        if not torch.allclose(self.logits[size], expected, rtol=tolerance, atol=tolerance, equal_nan=True):
            raise RuntimeError(f"the size-{size} graph's logits differ from the eager forward's")

    def _reset_padding(self, start: int) -> None:
        """Rows from `start` on become padding: no KV written, one key of block 0 read, token 0."""
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slot_mapping[start:] = -1
        self.context_lens[start:] = 1

    def size_for(self, num_decodes: int) -> int | None:
        """The smallest recorded size that holds `num_decodes` rows, or None (run eagerly)."""
        if not self.enabled:
            return None
        return next((s for s in self.sizes if s >= num_decodes and s in self.graphs), None)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """Replay the step if it is all decodes and a recorded size holds it: logits [size, vocab] (rows past the
        step's are padding); None otherwise (the caller runs the step eagerly)."""
        num = metadata.num_decodes
        size = None if metadata.prefills else self.size_for(num)
        if size is None:
            return None
        assert num == input_ids.shape[0]
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slot_mapping[:num].copy_(metadata.slot_mapping)
        self.context_lens[:num].copy_(metadata.decode_context_lens)
        tables = metadata.decode_block_tables
        self.block_tables[:num, : tables.shape[1]].copy_(tables)  # entries past a row's length are never read
        self._reset_padding(num)
        self.graphs[size].replay()
        return self.logits[size]
