"""Paged attention in plain torch, plugged into unmodified `transformers` models.

pagedlab registers `paged_attention_forward` with `transformers.AttentionInterface` under the name
"pagedlab". The model runner calls the model on one flattened ragged batch (all scheduled tokens of all
requests in a single row) and passes a `PagedAttentionContext` through the model's keyword arguments. For each
layer this function then

  1. writes the new tokens' K and V into their slots of the paged cache (`slot_mapping`), and
  2. attends each query token to its request's whole context, read through the block table.

The flat batch holds decodes first (one token each), then prefill chunks (several tokens each, causal among
themselves, after any context already in the cache):

    rows:  [ d0 d1 d2 ... | p0 p0 p0 p0 p0 | p1 p1 p1 ]
             decodes        prefill 0        prefill 1

`decode_attention` is the reference: every decode's blocks gathered, padded to the longest, one masked SDPA;
`prefill_attention` likewise for one prefill chunk. On CPU the forward pass runs C++ kernels that read the blocks
where they lie (`cpu_attention.py`, built at first use): one call for the decodes, one for all prefill chunks.
Where they cannot be built, the prefill chunks run `prefill_attention` one by one, and the decodes
`bucketed_decode_attention`: the same arithmetic as the reference over runs of decodes of similar length (the
model runner sends decodes longest first), which gathers about half the keys on a chat workload and keeps each
bucket's gathered K and V small enough to stay in cache for SDPA.
The Triton kernels in `pagedlab.kernels` compute the same thing; this file is their reference.

A quantised cache (`kv_cache_dtype="fp8"`, worker/kv_quant.py) is quantised as it is written and dequantised
as each gathered tile is read; attention always sees the stored values, the new tokens' own K and V included,
so that chunking, preemption and prefix caching leave the tokens unchanged with it too.

# Explained in chapters/03_paged_attention.ipynb
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pagedlab.worker import cpu_attention
from pagedlab.worker.kv_quant import KVScales, dequantize, is_quantized, quantize

ATTENTION_NAME = "pagedlab"


@dataclass
class PrefillChunk:
    """Rows [start, end) of the flat batch: one request's new tokens, after `num_context` cached ones."""

    start: int
    end: int
    num_context: int
    block_ids: torch.Tensor  # [num_blocks_of_request] physical blocks covering num_context + (end - start) tokens

    @property
    def num_new(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefillTensors:
    """A step's prefill chunks as dense int64 tensors, the form both kernel backends take (the C++ prefill kernel on
    CPU, Triton's on a GPU): chunk i's new tokens are rows [query_start_loc[i], query_start_loc[i + 1]) of the flat
    batch, after num_context[i] cached tokens, in the blocks of block_tables[i] (padded with block 0)."""

    query_start_loc: torch.Tensor  # [num_chunks + 1]
    num_context: torch.Tensor  # [num_chunks]
    block_tables: torch.Tensor  # [num_chunks, max_blocks]
    max_num_new: int  # the longest chunk's new tokens

    @classmethod
    def build(cls, chunks: list[PrefillChunk], device: torch.device | None = None) -> PrefillTensors:
        """From chunks that lie back to back in the flat batch (as the model runner lays them out)."""
        for before, after in zip(chunks, chunks[1:]):
            if before.end != after.start:
                raise ValueError(f"prefill chunks must be back to back: one ends at row {before.end}, "
                                 f"the next starts at row {after.start}")
        device = device if device is not None else chunks[0].block_ids.device
        query_start_loc = torch.tensor([c.start for c in chunks] + [chunks[-1].end], dtype=torch.long, device=device)
        num_context = torch.tensor([c.num_context for c in chunks], dtype=torch.long, device=device)
        block_tables = torch.nn.utils.rnn.pad_sequence(
            [c.block_ids.to(device=device, dtype=torch.long) for c in chunks], batch_first=True, padding_value=0)
        return cls(query_start_loc, num_context, block_tables, max(c.num_new for c in chunks))


@dataclass
class DecodeBucket:
    """Decode rows [start, end) of similar context length, attended together in one padded call."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks]: the bucket's block tables, padded with block 0
    mask: torch.Tensor | None  # [end - start, 1, 1, max_blocks * block_size], True where a key is seen; None: all


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block * block_size + offset) of each new token
    num_decodes: int  # the first num_decodes rows are decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor  # [num_decodes] tokens of context including the new one
    prefills: list[PrefillChunk]
    _masks: dict = field(default_factory=dict)  # per-step cache of decode masks, by sliding window
    kernel_inputs: dict = field(default_factory=dict)  # per-step cache of what a kernel backend derives

    def clear_caches(self) -> None:
        """Forget what was derived for a step (masks, kernel inputs), as a new step starts afresh."""
        self._masks.clear()
        self.kernel_inputs.clear()

    def prefill_tensors(self, device: torch.device) -> PrefillTensors:
        """The prefill chunks as the kernels take them (built on the first layer that asks, then reused)."""
        tensors = self.kernel_inputs.get("prefill_tensors")
        if tensors is None:
            tensors = self.kernel_inputs["prefill_tensors"] = PrefillTensors.build(self.prefills, device)
        return tensors

    def decode_buckets(self, block_size: int, sliding_window: int | None) -> list[DecodeBucket]:
        """The decodes split into length buckets (built on the first layer that asks, then reused)."""
        key = ("buckets", sliding_window)
        buckets = self._masks.get(key)
        if buckets is None:
            lens = self.decode_context_lens.tolist()
            tables = self.decode_block_tables
            buckets = self._masks[key] = decode_buckets(tables, lens, block_size, sliding_window, tables.device)
        return buckets

    def decode_mask(self, block_size: int, sliding_window: int | None) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] True where a decode query may attend."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            num_keys = self.decode_block_tables.shape[1] * block_size
            key_pos = torch.arange(num_keys, device=self.decode_context_lens.device)
            lens = self.decode_context_lens[:, None]
            mask = key_pos[None, :] < lens
            if sliding_window is not None:  # query at position lens-1 sees keys with q - k < window
                mask &= key_pos[None, :] > lens - 1 - sliding_window
            mask = self._masks[sliding_window] = mask[:, None, None, :]
        return mask


@dataclass
class PagedAttentionContext:
    """What the attention function receives on every layer: this step's metadata and the paged KV cache."""

    metadata: AttentionMetadata
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    backend: str = "torch"  # "torch" (this file) or "triton" (pagedlab.kernels.backend)
    kv_scales: KVScales | None = None  # a float8 cache's per-layer K and V scales; None for a full-precision one


def write_to_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
    k_scale=None, v_scale=None,
) -> None:
    """Store K and V of the new tokens ([num_tokens, kv_heads, head_dim]) into their flat slots; into a float8
    cache quantised by k_scale / v_scale (as bytes: torch has no float8 index_copy_ on CPU)."""
    num_kv_heads, head_dim = key.shape[1:]
    if is_quantized(key_cache.dtype):
        key = quantize(key, k_scale, key_cache.dtype).view(torch.uint8)
        value = quantize(value, v_scale, value_cache.dtype).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scale=None, dtype=None) -> torch.Tensor:
    """The blocks' slots, in logical order: [..., num_blocks * block_size, kv_heads, head_dim]; a float8
    cache's tile dequantised to `dtype` by `scale` (the only full-precision copy is this tile)."""
    blocks = cache.index_select(0, block_ids.reshape(-1))  # [n * num_blocks, block_size, kv_heads, head_dim]
    if is_quantized(cache.dtype):
        blocks = dequantize(blocks, scale, dtype)
    return blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _stored(x: torch.Tensor, cache: torch.Tensor, scale) -> torch.Tensor:
    """What the cache gives back for x: x itself, or x through a float8 cache's quantiser."""
    if not is_quantized(cache.dtype):
        return x
    return dequantize(quantize(x, scale, cache.dtype), scale, x.dtype)


# A bucket pads its rows to its longest, wasting at most BUCKET_SLACK of its live keys (or MIN_WASTE_TOKENS),
# and gathers at most BUCKET_TOKENS keys per row group, so that K and V are still in cache when SDPA reads them.
BUCKET_SLACK = 0.25
MIN_WASTE_TOKENS = 128
BUCKET_TOKENS = 2048


def decode_buckets(
    block_tables: torch.Tensor, context_lens: list[int], block_size: int, sliding_window: int | None, device,
    slack: float = BUCKET_SLACK, max_tokens: int = BUCKET_TOKENS,
) -> list[DecodeBucket]:
    """Split the decode rows, in their order, into runs whose padded gather stays close to their live keys.

    A run grows while padding its rows to whole blocks of its longest row costs at most `slack` more keys than
    the rows hold, and while it gathers at most `max_tokens` keys. Rows sorted longest first (as the model
    runner sends them) make few, tight buckets; in blocks of 16 tokens:

        blocks per row:  9 9 8 8 7 | 4 4 3 | 1 1 1
        padded gather:   9 9 9 9 9 | 4 4 4 | 1 1 1
    """
    buckets, start = [], 0
    while start < len(context_lens):
        end, longest, live = start + 1, context_lens[start], context_lens[start]
        while end < len(context_lens):
            new_longest, new_live = max(longest, context_lens[end]), live + context_lens[end]
            padded = -(-new_longest // block_size) * block_size * (end + 1 - start)
            if padded - new_live > max(slack * new_live, MIN_WASTE_TOKENS) or padded > max_tokens:
                break
            end, longest, live = end + 1, new_longest, new_live
        num_blocks = -(-longest // block_size)
        lens = context_lens[start:end]
        mask = None
        if sliding_window is not None or any(n != num_blocks * block_size for n in lens):
            key_pos = torch.arange(num_blocks * block_size, device=device)
            lens_t = torch.tensor(lens, device=device)[:, None]
            mask = key_pos[None, :] < lens_t
            if sliding_window is not None:  # as in AttentionMetadata.decode_mask
                mask &= key_pos[None, :] > lens_t - 1 - sliding_window
            mask = mask[:, None, None, :]
        buckets.append(DecodeBucket(start, end, block_tables[start:end, :num_blocks], mask))
        start = end
    return buckets


def bucketed_decode_attention(
    query, key_cache, value_cache, buckets: list[DecodeBucket], scale, out=None, k_scale=None, v_scale=None
):
    """`decode_attention` bucket by bucket: the same result, without padding every row to the longest.

    query [num_decodes, q_heads, head_dim] -> out [num_decodes, q_heads, head_dim]. This is the torch path's
    CPU workhorse: on a chat workload the reference gathers two to three times the live keys of each layer.
    """
    num_decodes, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    q = query.reshape(num_decodes, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    for bucket in buckets:
        rows = slice(bucket.start, bucket.end)
        k = _gather(key_cache, bucket.block_tables, k_scale, query.dtype).transpose(1, 2)  # [n, kv_heads, keys, hd]
        v = _gather(value_cache, bucket.block_tables, v_scale, query.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[rows], k, v, attn_mask=bucket.mask, scale=scale)
        out[rows] = o.reshape(-1, num_q_heads, head_dim)
    return out


def decode_attention(
    query, key_cache, value_cache, metadata: AttentionMetadata, scale, sliding_window, k_scale=None, v_scale=None
):
    """query [num_decodes, q_heads, head_dim] -> [num_decodes, q_heads, head_dim].

    Each KV head serves `group = q_heads // kv_heads` query heads; they are laid out as `group` query rows of
    that KV head, so grouped-query attention needs no copy of K or V.
    """
    num_decodes, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    q = query.reshape(num_decodes, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    tables = metadata.decode_block_tables
    k = _gather(key_cache, tables, k_scale, query.dtype).transpose(1, 2)  # [B, kv_heads, keys, head_dim]
    v = _gather(value_cache, tables, v_scale, query.dtype).transpose(1, 2)
    mask = metadata.decode_mask(block_size, sliding_window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_decodes, num_q_heads, head_dim)


def prefill_attention(
    query, key, value, key_cache, value_cache, chunk: PrefillChunk, scale, sliding_window, k_scale=None, v_scale=None
):
    """One request's new tokens: query [n, q_heads, head_dim], its own key/value [n, kv_heads, head_dim].

    The tensors go to SDPA with a batch dimension of 1: on CPU, torch 2.13 runs 4-D inputs 1.3-2.5x faster
    than the same 3-D ones (9:3 heads, 16-400 tokens; `scripts/attention_variants.py --prefill`)."""
    q = query.transpose(0, 1)[None]  # [1, q_heads, n, head_dim]
    if chunk.num_context == 0 and sliding_window is None:
        k = _stored(key, key_cache, k_scale).transpose(0, 1)[None]
        v = _stored(value, value_cache, v_scale).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    num_keys = chunk.num_context + chunk.num_new
    k = _gather(key_cache, chunk.block_ids, k_scale, query.dtype)[:num_keys].transpose(0, 1)[None]  # [1, kv, keys, hd]
    v = _gather(value_cache, chunk.block_ids, v_scale, query.dtype)[:num_keys].transpose(0, 1)[None]
    q_pos = torch.arange(chunk.num_context, num_keys, device=query.device)[:, None]
    k_pos = torch.arange(num_keys, device=query.device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, q_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    pagedlab_context: PagedAttentionContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `transformers` attention-interface entry point. Returns [1, num_tokens, q_heads, head_dim]."""
    if pagedlab_context is None:
        raise RuntimeError(
            "the 'pagedlab' attention implementation only runs inside the pagedlab engine "
            "(it needs the engine's block tables); use attn_implementation='sdpa' elsewhere"
        )
    metadata = pagedlab_context.metadata
    key_cache, value_cache = pagedlab_context.kv_cache[module.layer_idx]
    kv_scales, k_scale, v_scale = pagedlab_context.kv_scales, None, None
    q = query[0].transpose(0, 1)  # [num_tokens, q_heads, head_dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if kv_scales is not None:
        kv_scales.observe(module.layer_idx, k, v)
        k_scale, v_scale = kv_scales.scales[module.layer_idx]
    if pagedlab_context.backend == "triton":
        from pagedlab.kernels.backend import triton_attention  # imported only when asked for: triton is optional

        layer_scales = kv_scales.scales[module.layer_idx] if kv_scales is not None else None
        out = triton_attention(q, k, v, key_cache, value_cache, metadata, scaling, sliding_window, layer_scales)
        return out.unsqueeze(0), None
    write_to_cache(k, v, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, unlike q (a transposed view)
    num_decodes = metadata.num_decodes
    if num_decodes:
        decode_q, decode_out = q[:num_decodes], out[:num_decodes]
        kernel = cpu_attention.kernel() if cpu_attention.supports(decode_q, key_cache) else None
        if kernel is not None:  # blocks read in place, no gather
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            cpu_attention.paged_decode_cpu(decode_q, key_cache, value_cache, metadata.decode_block_tables,
                                           metadata.decode_context_lens, scale, sliding_window, decode_out, kernel)
        else:
            buckets = metadata.decode_buckets(key_cache.shape[1], sliding_window)
            bucketed_decode_attention(decode_q, key_cache, value_cache, buckets, scaling, decode_out, k_scale, v_scale)
    if metadata.prefills:
        kernel = cpu_attention.kernel() if cpu_attention.supports_prefill(q, key_cache) else None
        if kernel is not None:  # every chunk in one call, the blocks read in place, no gather, no mask
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            cpu_attention.paged_prefill_cpu(q, key_cache, value_cache, metadata.prefill_tensors(q.device), scale,
                                            sliding_window, out, kernel)
        else:
            for chunk in metadata.prefills:
                rows = slice(chunk.start, chunk.end)
                out[rows] = prefill_attention(
                    q[rows], k[rows], v[rows], key_cache, value_cache, chunk, scaling, sliding_window, k_scale, v_scale
                )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
