"""Run one scheduled step through an unmodified `transformers` model over the paged KV cache.

The runner flattens the step's `ScheduledRequest`s into one ragged row (decodes first, then prefill chunks),
builds the attention metadata once, calls the model with pagedlab's attention selected for that call only,
keeps the logits of the rows that sample, and hands them to the sampler (and, for the chunks that ask for their
prompt's logprobs, keeps every row they score). It reads only the step's data (token
ids, block tables, how to sample), owns the KV cache tensor, and keeps no other state but the sampler's.

# Explained in chapters/05_continuous_batching.ipynb
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Sequence

import torch

from pagedlab.core.block_table import cdiv
from pagedlab.core.sched_output import ModelRunnerOutput, ScheduledRequest
from pagedlab.worker import cpu_attention
from pagedlab.worker.attention import ATTENTION_NAME, AttentionMetadata, PagedAttentionContext, PrefillChunk
from pagedlab.worker.cpu_fused import FusedModules
from pagedlab.worker.cpu_linear import PackedLinears
from pagedlab.worker.cuda_graph import CudaGraph, DecodeGraphs
from pagedlab.worker.kv_cache import KVCacheSpec
from pagedlab.worker.kv_quant import KVScales, is_quantized
from pagedlab.worker.rejection_sampler import verify
from pagedlab.worker.sampler import Sampler, SamplerOutput, logprob_entries


@contextlib.contextmanager
def engine_call(model: torch.nn.Module, name: str):
    """Select an attention implementation, and eval mode, for the duration of one call; then restore the
    model's own.

    The model object is the user's: after the engine's call it runs with its own attention again, and in its
    own mode (a model in training mode would otherwise apply dropout), so `model.generate()` or a training
    loop keeps working on the same object.
    """
    config = model.config
    previous, training = config._attn_implementation_internal, model.training
    config._attn_implementation_internal = name
    if training:
        model.eval()
    try:
        yield
    finally:
        config._attn_implementation_internal = previous
        if training:
            model.train()


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


def _row_order(scheduled: ScheduledRequest) -> tuple[bool, int]:
    """Sort key of the flat batch's rows: decodes first, longest context first; then prefills, as scheduled."""
    return (not scheduled.is_decode, -scheduled.num_computed_tokens if scheduled.is_decode else 0)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, spec: KVCacheSpec, num_blocks: int, block_size: int, seed: int,
        attention_backend: str = "torch", last_stage: bool = True, linear_backend: str = "torch",
        cpu_fused_ops: bool = False,
    ) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.device = next(model.parameters()).device
        self.spec = spec
        self.block_size = block_size
        if self.device.type == "cpu":
            keep_freed_memory()  # else each step page-faults its big tensors in afresh (see the function)
        self.kv_cache = spec.allocate(num_blocks, block_size, self.device)
        self.kv_scales = KVScales.ones(spec.num_layers, spec.dtype, self.device) if is_quantized(spec.dtype) else None
        self.sampler = Sampler(seed, self.device)
        # Llama-style norms, MLPs and attention projections through one-pass C++ ops on CPU, in the engine's calls
        # only (cpu_fused)
        kernel = cpu_attention.kernel() if cpu_fused_ops and self.device.type == "cpu" else None
        self.fused = FusedModules(model, kernel, linear_backend == "onednn") if kernel is not None else None
        # "onednn": the linear layers' weights packed once for oneDNN, used in the engine's calls only
        skip = self.fused.stacked_layers if self.fused is not None else frozenset()
        self.linears = PackedLinears(model, skip) if linear_backend == "onednn" else None
        self.decode_graphs: DecodeGraphs | None = None
        # False on a pipeline stage before the last (`pagedlab.worker.pipeline_parallel`): its forward pass sends
        # the hidden states on, and there is nothing to sample
        self.last_stage = last_stage

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
        linears = self.linears.installed() if self.linears is not None else contextlib.nullcontext()
        fused = self.fused.installed(self.linears) if self.fused is not None else contextlib.nullcontext()
        with engine_call(self.model, ATTENTION_NAME), linears, fused:
            return self.model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_to_keep,
                pagedlab_context=context,
            ).logits[0]

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Clear newly allocated blocks in every layer, so that masked-out slots hold finite values.

        One fill per block (each a strided view of num_layers x 2 contiguous runs) rather than one indexed
        write: on CPU, torch's index_put with a scalar costs 4-5x more per block (16 blocks of SmolLM2's
        cache: 1.33 ms indexed, 0.33 ms block by block)."""
        for block_id in block_ids:
            self.kv_cache[:, :, block_id].zero_()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy whole blocks (every layer, K and V) in one indexed copy, source -> copy."""
        if copies:
            source, target = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
            self.kv_cache[:, :, target] = self.kv_cache[:, :, source]

    def execute(self, scheduled: Sequence[ScheduledRequest]) -> ModelRunnerOutput:
        """Compute the step: draw a token for each sampling target; beam sequences get their next-token
        log-probabilities instead, for the beam step to choose from; sequences with drafts have them verified."""
        input_ids, positions, sample_rows, metadata, first_rows = self._prepare(scheduled)
        scored = [(s, first_rows[i]) for i, s in enumerate(scheduled) if s.prompt_logprobs is not None]
        prompt_rows = [row + j for s, row in scored for j in range(len(s.prompt_logprobs.token_ids))]
        targets = [target for s in scheduled for target in s.sampling]
        verified = {s.request_id: s for s in scheduled if s.num_spec_tokens}
        to_verify, verify_rows = [], []
        if verified:  # speculative decoding: every row of a verified chunk is scored, not only its last
            rows = list(zip(targets, sample_rows))
            to_verify = [(t, row) for t, row in rows if t.request_id in verified]
            targets = [t for t, _ in rows if t.request_id not in verified]
            sample_rows = [row for t, row in rows if t.request_id not in verified]
            verify_rows = [
                r for t, row in to_verify for r in range(row - verified[t.request_id].num_spec_tokens, row + 1)
            ]
        with torch.inference_mode():
            logits = self.decode_graphs.run(input_ids, positions, metadata) if self.decode_graphs else None
            if logits is not None:
                logits = logits[sample_rows + prompt_rows]  # a recorded decode step (it has no drafts)
            else:
                context = PagedAttentionContext(metadata, self.kv_cache, self.attention_backend, self.kv_scales)
                keep = torch.tensor(sample_rows + verify_rows + prompt_rows, dtype=torch.long, device=self.device)
                logits = self._forward(input_ids, positions, context, keep)
            if not self.last_stage:
                return ModelRunnerOutput()
            if prompt_rows:
                logits, prompt_logits = logits[: -len(prompt_rows)], logits[-len(prompt_rows) :]
            if verify_rows:
                logits, verify_logits = logits[: len(sample_rows)], logits[len(sample_rows) :]
            sampled_rows = [i for i, target in enumerate(targets) if not target.is_beam]
            beam_rows = [i for i, target in enumerate(targets) if target.is_beam]
            sampling = [targets[i] for i in sampled_rows]
            out: SamplerOutput = self.sampler(logits[sampled_rows] if beam_rows else logits, sampling)
            beam_logprobs = torch.log_softmax(logits[beam_rows].float(), dim=-1) if beam_rows else None
            checks = verify(verify_logits, [(verified[t.request_id].spec_token_ids, t) for t, _ in to_verify],
                            self.sampler) if to_verify else []
            prompt_logprobs = _prompt_logprobs(prompt_logits, [s for s, _ in scored]) if scored else {}
        sampled = {target.request_id: (token_id,) for target, token_id in zip(sampling, out.token_ids)}
        logprobs = {t.request_id: (lp,) for t, lp in zip(sampling, out.logprobs) if lp is not None}
        beams = {targets[i].request_id: beam_logprobs[j] for j, i in enumerate(beam_rows)}
        for (target, _), check in zip(to_verify, checks):  # the accepted drafts, then the token drawn after them
            drafts = verified[target.request_id].spec_token_ids[: check.num_accepted]
            sampled[target.request_id] = (*drafts, check.token_id)
            if check.logprobs is not None:
                logprobs[target.request_id] = tuple(check.logprobs)
        return ModelRunnerOutput(sampled, logprobs, beams, prompt_logprobs=prompt_logprobs)

    def logits(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """The model's logits for every row of one batch, without sampling (teacher-forced scoring): [rows, vocab]
        in the batch's row order (decodes first, then prefill chunks)."""
        input_ids, positions, _, metadata, _ = self._prepare(scheduled)
        context = PagedAttentionContext(metadata, self.kv_cache, self.attention_backend, self.kv_scales)
        keep = torch.arange(len(input_ids), device=self.device)
        with torch.inference_mode():
            return self._forward(input_ids, positions, context, keep)

    def _prepare(self, scheduled: Sequence[ScheduledRequest]):
        """The flat batch: token ids, positions, the rows that sample, attention metadata, and each sequence's
        first row.

        The rows are ordered for attention: decodes first, longest context first (so that its length buckets
        are runs of rows), then prefill chunks. `sample_rows` stays in the scheduler's order (one entry per
        sampling target), so the sampler sees the requests in that order whatever the row order.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        block_size = self.block_size
        last_row: dict[int, int] = {}  # index in scheduled -> its last row in the flat batch
        for index in sorted(range(len(scheduled)), key=lambda i: _row_order(scheduled[i])):
            s = scheduled[index]
            start, stop = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            row = len(input_ids)
            last_row[index] = row + s.num_new_tokens - 1
            input_ids.extend(s.token_ids)
            positions.extend(range(start, stop))
            blocks = s.block_ids
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, stop))
            num_blocks = cdiv(stop, block_size)
            if s.is_decode:
                decode_tables.append(list(blocks[:num_blocks]))
                decode_lens.append(stop)
            else:
                block_ids = torch.tensor(blocks[:num_blocks], device=self.device)
                prefills.append(PrefillChunk(row, row + s.num_new_tokens, start, block_ids))
        sample_rows = [last_row[i] for i, s in enumerate(scheduled) for _ in s.sampling]
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
        first_rows = [last_row[i] - s.num_new_tokens + 1 for i, s in enumerate(scheduled)]
        return (
            torch.tensor(input_ids, device=device),
            torch.tensor(positions, device=device),
            sample_rows,
            metadata,
            first_rows,
        )


def _prompt_logprobs(logits: torch.Tensor, scored: list[ScheduledRequest]) -> dict[str, tuple[dict[int, float], ...]]:
    """Each chunk's prompt-token logprobs from its scored rows. logits: [sum of the chunks' scored rows, vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out, start = {}, 0
    for s in scored:
        asked = s.prompt_logprobs
        rows = logprobs[start : start + len(asked.token_ids)]
        out[s.request_id] = tuple(logprob_entries(rows, asked.token_ids, asked.num_logprobs))
        start += len(asked.token_ids)
    return out
