"""Run one scheduled step through an unmodified `transformers` model over the paged KV cache.

The runner flattens the step into one ragged row (decodes first, then prefill chunks), builds the attention
metadata once, calls the model with pagedlab's attention selected for that call only, keeps the logits of
the rows that sample, and hands them to the sampler. It owns the KV cache tensor and nothing else of state.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from dataclasses import dataclass

import torch

from pagedlab.core.kv_cache_manager import BlockTable
from pagedlab.core.request import Request
from pagedlab.core.scheduler import ScheduledRequest
from pagedlab.worker.attention import ATTENTION_NAME, AttentionMetadata, PagedAttentionContext, PrefillChunk
from pagedlab.worker.cuda_graph import CudaGraph, DecodeGraphs
from pagedlab.worker.kv_cache import KVCacheSpec
from pagedlab.worker.sampler import Sampler, SamplerOutput, SamplingRequest


@dataclass(frozen=True)
class WorkItem:
    """One request's part of a step, with what the runner needs to read its tokens and slots.

    `forks` are the other samples of an n > 1 request that sample their first token from this request's
    last row of logits (the prompt is computed once).
    """

    request: Request
    scheduled: ScheduledRequest
    block_table: BlockTable
    forks: tuple[Request, ...] = ()


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, tuple[int, dict[int, float] | None]]  # request_id -> (token_id, logprobs if asked)
    beam_logprobs: dict[str, torch.Tensor]  # beam sequence id -> [vocab_size] next-token log-probabilities


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str):
    """Select an attention implementation for the duration of one call, then restore the model's own.

    The model object is the user's: after the engine's call it runs with its own attention again, so
    `model.generate()` keeps working on the same object.
    """
    config = model.config
    previous = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = previous


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the kernel; True if it agreed.

    By default glibc serves allocations above 32 MiB (and, after a free, often much smaller ones) straight
    from the kernel and hands them back on free, so every step's fresh activation and gathered-KV tensors
    are page-faulted and zeroed again: on a CPU that costs as much as the attention arithmetic (a 34 MB
    gather: 69 ms fresh, 10 ms into memory already touched). It changes no result, only where memory comes
    from, for the whole process; the process keeps its peak memory instead of shrinking after a burst.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl, Windows): nothing to tune
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


def _row_order(item: WorkItem) -> tuple[bool, int]:
    """Sort key of the flat batch's rows: decodes first, longest context first; then prefills, as scheduled."""
    scheduled = item.scheduled
    return (not scheduled.is_decode, -scheduled.num_computed_tokens if scheduled.is_decode else 0)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, spec: KVCacheSpec, num_blocks: int, block_size: int, seed: int,
        attention_backend: str = "torch",
    ) -> None:  # fmt: skip
        self.model = model
        self.attention_backend = attention_backend
        self.device = next(model.parameters()).device
        self.spec = spec
        self.block_size = block_size
        if self.device.type == "cpu":
            keep_freed_memory()  # else each step page-faults its big tensors in afresh (see the function)
        self.kv_cache = spec.allocate(num_blocks, block_size, self.device)
        self.sampler = Sampler(seed, self.device)
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, graph_class: type = CudaGraph) -> bool:
        """Record decode steps as CUDA graphs (`pagedlab.worker.cuda_graph`); False if that failed (eager then).
        `graph_class=EagerGraph` runs the same bookkeeping without a GPU."""
        if self.attention_backend != "triton":
            raise ValueError("decode graphs need the Triton attention backend (the torch one plans in Python)")
        graphs = DecodeGraphs(self._forward, self.kv_cache, max_num_seqs, max_model_len, self.block_size, graph_class)
        with torch.inference_mode():
            if graphs.capture_all():
                self.decode_graphs = graphs
        return self.decode_graphs is not None

    def _forward(self, input_ids, positions, context: PagedAttentionContext, logits_to_keep=0) -> torch.Tensor:
        """The unmodified model on one flat row, with pagedlab's attention: logits [rows kept, vocab]."""
        with _attention_implementation(self.model, ATTENTION_NAME):
            return self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_to_keep,
                pagedlab_context=context,
            ).logits[0]

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Clear newly allocated blocks in every layer, so that masked-out slots hold finite values."""
        if block_ids:
            self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)] = 0

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks (every layer, K and V) in one indexed copy, source -> copy."""
        if copies:
            source, target = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
            self.kv_cache[:, :, target] = self.kv_cache[:, :, source]

    def execute(self, items: list[WorkItem]) -> RunnerOutput:
        """Compute the step: sample a token for each request that samples; beam-search sequences get their
        next-token log-probabilities instead, for the engine's beam step to choose from."""
        input_ids, positions, sample_rows, metadata = self._prepare(items)
        rows = [request for item in items if item.scheduled.samples for request in (item.request, *item.forks)]
        with torch.inference_mode():
            logits = self.decode_graphs.run(input_ids, positions, metadata) if self.decode_graphs else None
            if logits is not None:
                logits = logits[sample_rows]  # a recorded decode step
            else:
                context = PagedAttentionContext(metadata, self.kv_cache, self.attention_backend)
                keep = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
                logits = self._forward(input_ids, positions, context, keep)
            sampled_rows = [i for i, request in enumerate(rows) if not request.is_beam]
            beam_rows = [i for i, request in enumerate(rows) if request.is_beam]
            sampling = [self._sampling_request(rows[i]) for i in sampled_rows]
            out: SamplerOutput = self.sampler(logits[sampled_rows] if beam_rows else logits, sampling)
            beam_logprobs = torch.log_softmax(logits[beam_rows].float(), dim=-1) if beam_rows else None
        sampled = {
            row.request_id: (token_id, logprobs)
            for row, token_id, logprobs in zip(sampling, out.token_ids, out.logprobs)
        }
        beams = {rows[i].request_id: beam_logprobs[j] for j, i in enumerate(beam_rows)}
        return RunnerOutput(sampled, beams)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    @staticmethod
    def _sampling_request(request: Request) -> SamplingRequest:
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        if request.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(request.eos_token_ids)
            banned = eos + params.stop_token_ids
        return SamplingRequest(request.request_id, params, banned)

    def _prepare(self, items: list[WorkItem]):
        """The flat batch: token ids, positions, the rows that sample, and attention metadata.

        The rows are ordered for attention: decodes first, longest context first (so that its length buckets
        are runs of rows), then prefill chunks. `sample_rows` stays in the order of `items` (the scheduler's),
        so the sampler sees the requests in that order whatever the row order.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        block_size = self.block_size
        last_row: dict[int, int] = {}  # index in items -> its last row in the flat batch
        for index in sorted(range(len(items)), key=lambda i: _row_order(items[i])):
            item = items[index]
            s, table = item.scheduled, item.block_table
            start, stop = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            row = len(input_ids)
            last_row[index] = row + s.num_new_tokens - 1
            input_ids.extend(item.request.token_ids(start, stop))
            positions.extend(range(start, stop))
            slots.extend(table.slot(p) for p in range(start, stop))
            num_blocks = -(-stop // block_size)
            if s.is_decode:
                decode_tables.append(table.block_ids[:num_blocks])
                decode_lens.append(stop)
            else:
                block_ids = torch.tensor(table.block_ids[:num_blocks], device=self.device)
                prefills.append(PrefillChunk(row, row + s.num_new_tokens, start, block_ids))
        for index, item in enumerate(items):
            if item.scheduled.samples:
                sample_rows.extend([last_row[index]] * (1 + len(item.forks)))
        device = self.device
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            num_decodes=len(decode_tables),
            decode_block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(len(padded), max_blocks),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=device),
            prefills=prefills,
        )
        return (
            torch.tensor(input_ids, device=device),
            torch.tensor(positions, device=device),
            sample_rows,
            metadata,
        )
