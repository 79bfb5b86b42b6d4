"""Decode attention over a paged KV cache on CPU: the variants side by side, checked, then timed.

    .venv/bin/python scripts/attention_variants.py                  # SmolLM2-135M shapes, batch 64 and 256
    .venv/bin/python scripts/attention_variants.py --batch 64 --dtype bfloat16 --flex

Every variant is first checked against the reference (`pagedlab.worker.attention.decode_attention`), then
all are timed interleaved (round robin, median of `--repeats`), so that a busy machine slows them alike.
Times are per layer and include the variant's once-per-step preparation divided by the number of layers.

    reference   gather every request's blocks padded to the longest, one masked SDPA (chapter 03)
    bucketed    pagedlab's CPU path: requests sorted by length, one padded gather + SDPA per length bucket
    live+loop   gather only live slots once, then one SDPA per request on its slice (no padding)
    per-seq     one index_select of the request's blocks and one SDPA per request
    bucket-gqa  bucketed, with SDPA's own grouped-query attention (enable_gqa=True, K/V heads not folded)
    kernel      the C++ kernel that reads blocks in place (pagedlab.worker.cpu_attention), what the engine runs
    flex        torch.compile'd flex_attention reading the paged cache in place through a block mask (--flex)

--prefill also times one request's causal prefill SDPA with 3-D and with 4-D (batch of 1) inputs: the same
call, yet on CPU the 4-D one is 1.3-2.5x faster, which is why `prefill_attention` adds the batch dimension.

--clock cpu (the default) times the process's CPU time, which a machine shared with other jobs disturbs far
less than wall time; run it with OMP_NUM_THREADS=1 for stable numbers, or --clock wall on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedlab.worker.attention import AttentionMetadata, bucketed_decode_attention, decode_attention
from pagedlab.worker.model_runner import keep_freed_memory

NUM_LAYERS = 30  # SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of 64


def make_step(batch, q_heads, kv_heads, head_dim, block_size, max_len, dtype, seed=0, fixed_len=None):
    """A random paged cache with `batch` decodes of random lengths in [20, max_len], blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    if fixed_len is None:
        lens = torch.randint(20, max_len + 1, (batch,), generator=g)
    else:
        lens = torch.full((batch,), fixed_len)
    blocks_per_seq = (lens + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + 1
    physical = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 is the padding block
    tables, taken = [], 0
    for n in blocks_per_seq.tolist():
        tables.append(physical[taken : taken + n])
        taken += n
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    return query, key_cache, value_cache, tables, lens.tolist()


def metadata_for(tables, lens, block_size):
    """The reference's metadata: block tables padded with block 0 to the longest."""
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    return AttentionMetadata(torch.empty(0, dtype=torch.long), len(tables), padded, torch.tensor(lens), [])


# -- variants: each is (prepare once per step, attend once per layer) -------------------------------------


def reference(tables, lens, block_size):
    metadata = metadata_for(tables, lens, block_size)
    return lambda q, kc, vc, scale: decode_attention(q, kc, vc, metadata, scale, None)


def bucketed(tables, lens, block_size):
    order = sorted(range(len(lens)), key=lambda i: -lens[i])  # the model runner puts decodes in this order
    sorted_meta = metadata_for([tables[i] for i in order], [lens[i] for i in order], block_size)
    buckets = sorted_meta.decode_buckets(block_size, None)

    def attend(q, kc, vc, scale):
        out = bucketed_decode_attention(q[order], kc, vc, buckets, scale)
        return out[torch.argsort(torch.tensor(order))]

    return attend


def _live_slots(tables, lens, block_size):
    """The flat cache slots of every live token, request after request, and each request's [start, end)."""
    slots, bounds = [], []
    for table, n in zip(tables, lens):
        start = len(slots)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(n))
        bounds.append((start, len(slots)))
    return torch.tensor(slots), bounds


def live_loop(tables, lens, block_size):
    slots, bounds = _live_slots(tables, lens, block_size)

    def attend(q, kc, vc, scale):
        b, hq, d = q.shape
        hk = kc.shape[2]
        k = kc.view(-1, hk, d).index_select(0, slots).transpose(0, 1)  # [kv_heads, live, head_dim]
        v = vc.view(-1, hk, d).index_select(0, slots).transpose(0, 1)
        qg = q.view(b, hk, hq // hk, d)
        out = torch.empty_like(qg)
        for i, (s, e) in enumerate(bounds):
            out[i] = F.scaled_dot_product_attention(qg[i], k[:, s:e], v[:, s:e], scale=scale)
        return out.view(b, hq, d)

    return attend


def per_seq(tables, lens, block_size):
    ids = [torch.tensor(t) for t in tables]

    def attend(q, kc, vc, scale):
        b, hq, d = q.shape
        hk = kc.shape[2]
        qg = q.view(b, hk, hq // hk, d)
        out = torch.empty_like(qg)
        for i, n in enumerate(lens):
            k = kc.index_select(0, ids[i]).view(-1, hk, d)[:n].transpose(0, 1)
            v = vc.index_select(0, ids[i]).view(-1, hk, d)[:n].transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(qg[i], k, v, scale=scale)
        return out.view(b, hq, d)

    return attend


_COMPILED: dict = {}  # torch.compile'd functions, made once per process


def flex(tables, lens, block_size):
    """flex_attention reading the paged cache in place: a block mask whose KV blocks are physical blocks."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    compiled = _COMPILED.setdefault("flex", torch.compile(flex_attention, dynamic=False))
    batch, num_cache_blocks = len(tables), max(max(t) for t in tables) + 1
    lens_t = torch.tensor(lens, dtype=torch.int32)
    owner = torch.full((num_cache_blocks,), -1, dtype=torch.int32)  # physical block -> request, logical index
    logical = torch.zeros(num_cache_blocks, dtype=torch.int32)
    kv_indices = torch.zeros(1, 1, batch, num_cache_blocks, dtype=torch.int32)  # must span the whole cache
    for i, table in enumerate(tables):
        owner[table] = i
        logical[table] = torch.arange(len(table), dtype=torch.int32)
        kv_indices[0, 0, i, : len(table)] = torch.tensor(table, dtype=torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        return (owner[block] == q_idx) & (logical[block] * block_size + kv_idx % block_size < lens_t[q_idx])

    num_kv_blocks = torch.tensor([len(t) for t in tables], dtype=torch.int32).view(1, 1, batch)
    block_mask = BlockMask.from_kv_blocks(num_kv_blocks, kv_indices, BLOCK_SIZE=(1, block_size), mask_mod=mask_mod,
                                          seq_lengths=(batch, num_cache_blocks * block_size))

    def attend(q, kc, vc, scale):
        hk, d = kc.shape[2:]
        k = kc.view(1, -1, hk, d).transpose(1, 2)  # [1, kv_heads, all slots, head_dim]: a view, no copy
        v = vc.view(1, -1, hk, d).transpose(1, 2)
        out = compiled(q.transpose(0, 1)[None], k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    return attend


def bucket_gqa(tables, lens, block_size):
    """As bucketed, but the query keeps its q_heads and SDPA maps them onto the KV heads (enable_gqa)."""
    from pagedlab.worker.attention import _gather

    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    sorted_meta = metadata_for([tables[i] for i in order], [lens[i] for i in order], block_size)
    buckets = sorted_meta.decode_buckets(block_size, None)
    inverse = torch.argsort(torch.tensor(order))

    def attend(q, kc, vc, scale):
        q = q[order]
        out = torch.empty_like(q)
        for b in buckets:
            k = _gather(kc, b.block_tables).transpose(1, 2)  # [n, kv_heads, keys, head_dim]
            v = _gather(vc, b.block_tables).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[b.start : b.end, :, None], k, v, attn_mask=b.mask, scale=scale,
                                               enable_gqa=True)
            out[b.start : b.end] = o[:, :, 0]
        return out[inverse]

    return attend


def kernel(tables, lens, block_size):
    from pagedlab.worker import cpu_attention

    module = cpu_attention.load().module
    if module is None:
        raise RuntimeError(f"no C++ kernel here: {cpu_attention.load().error}")
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    lens_t = torch.tensor(lens)
    return lambda q, kc, vc, scale: cpu_attention.paged_decode_cpu(q, kc, vc, padded, lens_t, scale, None,
                                                                   module=module)


VARIANTS = {"reference": reference, "bucketed": bucketed, "live+loop": live_loop, "per-seq": per_seq,
            "bucket-gqa": bucket_gqa, "kernel": kernel}



def run(batch, dtype, args):
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    q_heads, kv_heads, head_dim, block_size = 9, 3, 64, args.block_size
    query, kc, vc, tables, lens = make_step(batch, q_heads, kv_heads, head_dim, block_size, args.max_len, dtype,
                                            fixed_len=args.fixed_len)
    scale = head_dim**-0.5
    variants = dict(VARIANTS)
    if args.flex:
        variants["flex"] = flex
    prepared, prep_ms = {}, {}
    for name, make in variants.items():
        start = clock()
        prepared[name] = make(tables, lens, block_size)
        prep_ms[name] = (clock() - start) * 1e3
    expected = prepared["reference"](query, kc, vc, scale)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-4)
    first_call_ms = {}
    for name, attend in prepared.items():
        start = clock()
        torch.testing.assert_close(attend(query, kc, vc, scale), expected, **tol)
        first_call_ms[name] = (clock() - start) * 1e3
    times = {name: [] for name in prepared}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, attend in prepared.items():
                start = clock()
                attend(query, kc, vc, scale)
                times[name].append((clock() - start) * 1e3)
    live = sum(lens)
    padded = batch * max(-(-n // block_size) for n in lens) * block_size
    print(f"\nbatch={batch} dtype={str(dtype).removeprefix('torch.')} live tokens={live} padded to longest={padded}")
    print(f"{'variant':<11} {'ms/layer':>9} {'+prep/30':>9} {'x ref':>6} {'1st call ms':>12}")
    ref = statistics.median(times["reference"]) + prep_ms["reference"] / NUM_LAYERS
    for name, t in times.items():
        median = statistics.median(t)
        per_layer = median + prep_ms[name] / NUM_LAYERS
        print(f"{name:<11} {median:9.2f} {per_layer:9.2f} {ref / per_layer:6.2f} {first_call_ms[name]:12.1f}")


def prefill_layouts(args) -> None:
    """A causal prefill of n tokens after `context` cached ones, as 3-D and as 4-D SDPA inputs."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"\nprefill SDPA, 9 query heads over 3 KV heads of 64 (ms per call, median of {args.repeats})")
    print(f"{'context':>7} {'new':>5} {'3-D':>7} {'4-D':>7} {'x':>5}")
    for context, n in ((0, 64), (0, 200), (0, 400), (400, 16), (400, 64), (200, 200)):
        q, k, v = torch.randn(9, n, 64), torch.randn(3, context + n, 64), torch.randn(3, context + n, 64)
        mask = torch.arange(context + n)[None, :] <= torch.arange(context, context + n)[:, None]
        def three(q=q, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        def four(q=q, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0]

        torch.testing.assert_close(three(), four())
        times = {}
        for name, call in (("3-D", three), ("4-D", four)):
            samples = []
            for _ in range(args.repeats):
                start = clock()
                call()
                samples.append((clock() - start) * 1e3)
            times[name] = statistics.median(samples)
        print(f"{context:7d} {n:5d} {times['3-D']:7.2f} {times['4-D']:7.2f} {times['3-D'] / times['4-D']:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--max-len", type=int, default=700, help="context lengths are uniform in [20, max-len]")
    parser.add_argument("--fixed-len", type=int, default=None, help="every context this long (else random)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--flex", action="store_true", help="also time torch.compile'd flex_attention")
    parser.add_argument("--prefill", action="store_true", help="also time prefill SDPA with 3-D vs 4-D inputs")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--malloc", choices=["keep", "default"], default="keep",
                        help="keep: glibc keeps freed memory (what the model runner sets on CPU); default: glibc's")
    args = parser.parse_args()
    if args.malloc == "keep":
        keep_freed_memory()
    print(f"threads={torch.get_num_threads()} malloc={args.malloc} clock={args.clock}")
    for dtype in args.dtype:
        for batch in args.batch:
            run(batch, getattr(torch, dtype), args)
    if args.prefill:
        prefill_layouts(args)


if __name__ == "__main__":
    main()
