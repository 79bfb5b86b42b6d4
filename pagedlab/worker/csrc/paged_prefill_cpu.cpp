// Prefill attention over a paged KV cache on CPU: every new token of every prefill chunk of a step, causal among
// themselves, after the chunk's cached context, the blocks read where they lie (no gather, no mask tensor).
//
// paged_prefill(out, query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
//               sliding_window)
//   query, out:      [num_tokens, q_heads, head_dim] (the flat batch; any row and head strides)
//   block_tables:    [num_chunks, max_blocks] int64
//   query_start_loc: [num_chunks + 1] int64: chunk c's new tokens are rows [query_start_loc[c], query_start_loc[c + 1])
//   context_lens:    [num_chunks] int64: chunk c's tokens cached before them
//   (attention.PrefillTensors, which the Triton prefill kernel takes too.)
//   The new tokens' K and V are already in the cache (written before attention, as for a decode).
//
// One work item is a chunk's KV head and a tile of up to 48 / group of its rows: the tile's query vectors (rows x
// the head's query heads, at most 48) are transposed once into Qt[d][j], so that a key row's d-th value, broadcast,
// multiplies 16 query vectors at a time (no horizontal sums, as in a matrix product's inner kernel):
//   1. S[t][j] = k_t . q_j for a slab of up to 128 keys, 8 keys at a time (8 x NV accumulators, NV = query
//      vectors / 16, in registers), keys past a row's position (and before its window) set to -inf;
//   2. flash-style online softmax per query vector across slabs: the running maximum, the sum, and the output
//      rescaled when the maximum grows;
//   3. O[d][j] += v_t[d] p[t][j], 8 dimensions at a time.
// Arithmetic is float32; bfloat16 and float16 rows are widened into the slab's buffers as they are read.
// Measured (SmolLM2's 9:3 heads of 64, 2 threads, against prefill_attention chunk by chunk): README, "Benchmarks:
// the levers".
// Explained in chapters/03_paged_attention.ipynb

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vector.h"

namespace {

using namespace pagedlab_cpu;

template <int64_t kHeadDim, int64_t NV, typename scalar_t>
void prefill_tile(scalar_t* out, int64_t out_row_stride, int64_t out_head_stride, const scalar_t* query,
                  int64_t q_row_stride, int64_t q_head_stride, const scalar_t* key_cache, const scalar_t* value_cache,
                  const int64_t* block_table, int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
                  int64_t group, int64_t first_pos, int64_t num_rows, int64_t window, float scale) {
  constexpr int64_t kW = NV * kLanes;  // query vectors of the tile, padded
  constexpr int64_t kSlab = 128;
  const int64_t nq = num_rows * group;
  alignas(64) float qt[kHeadDim * kW], ot[kHeadDim * kW], s[kSlab * kW];
  alignas(64) float m[kW], l[kW], pos[kW], lo[kW];
  std::vector<float> krows, vrows;  // widened rows of a slab (bfloat16, float16 caches)
  for (int64_t j = 0; j < kW; ++j) {
    const bool live = j < nq;
    const int64_t p = first_pos + (live ? j / group : 0);
    pos[j] = live ? static_cast<float>(p) : FLT_MAX;  // padding lanes see every key (their outputs are dropped)
    lo[j] = live && window > 0 ? static_cast<float>(p - window + 1) : -FLT_MAX;
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  std::fill(ot, ot + kHeadDim * kW, 0.0f);
  std::fill(qt, qt + kHeadDim * kW, 0.0f);
  {
    std::vector<float> row(kHeadDim);
    for (int64_t j = 0; j < nq; ++j) {
      to_float(query + (j / group) * q_row_stride + (kv_head * group + j % group) * q_head_stride, row.data(),
               kHeadDim);
      for (int64_t d = 0; d < kHeadDim; ++d) qt[d * kW + j] = row[d] * scale;
    }
  }
  const int64_t last_pos = first_pos + num_rows - 1;
  const int64_t key_begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0, key_end = last_pos + 1;
  const int64_t token_stride = num_kv_heads * kHeadDim;
  auto row_of = [&](const scalar_t* cache, int64_t t) {
    return cache + (block_table[t / block_size] * block_size + t % block_size) * token_stride + kv_head * kHeadDim;
  };
  for (int64_t t0 = key_begin; t0 < key_end; t0 += kSlab) {
    const int64_t n = std::min(kSlab, key_end - t0);
    // the slab's key and value rows, as float32 pointers (widened copies for a 16-bit cache)
    const float* kp[kSlab];
    const float* vp[kSlab];
    if constexpr (std::is_same_v<scalar_t, float>) {
      for (int64_t i = 0; i < n; ++i) kp[i] = row_of(key_cache, t0 + i), vp[i] = row_of(value_cache, t0 + i);
    } else {
      krows.resize(kSlab * kHeadDim);
      vrows.resize(kSlab * kHeadDim);
      for (int64_t i = 0; i < n; ++i) {
        to_float(row_of(key_cache, t0 + i), krows.data() + i * kHeadDim, kHeadDim);
        to_float(row_of(value_cache, t0 + i), vrows.data() + i * kHeadDim, kHeadDim);
        kp[i] = krows.data() + i * kHeadDim, vp[i] = vrows.data() + i * kHeadDim;
      }
    }
    // 1. scores, 8 keys at a time
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      const int64_t kn = std::min<int64_t>(8, n - i0);
      vfloat acc[8][NV];
      for (int64_t k = 0; k < 8; ++k)
        for (int64_t v = 0; v < NV; ++v) acc[k][v] = vfloat{};
      const float* rows[8];
      for (int64_t k = 0; k < 8; ++k) rows[k] = kp[i0 + std::min(k, kn - 1)];
      for (int64_t d = 0; d < kHeadDim; ++d) {
        vfloat q[NV];
        for (int64_t v = 0; v < NV; ++v) q[v] = load(qt + d * kW + v * kLanes);
        for (int64_t k = 0; k < 8; ++k) {
          const vfloat kd = broadcast(rows[k][d]);
          for (int64_t v = 0; v < NV; ++v) acc[k][v] += kd * q[v];
        }
      }
      for (int64_t k = 0; k < kn; ++k)
        for (int64_t v = 0; v < NV; ++v) store(s + (i0 + k) * kW + v * kLanes, acc[k][v]);
    }
    // masks: keys after a row's position, and before its window
    const bool causal_part = t0 + n - 1 > first_pos, window_part = window > 0 && t0 < last_pos - window + 1;
    if (causal_part || window_part) {
      for (int64_t i = 0; i < n; ++i) {
        const float t = static_cast<float>(t0 + i);
        float* si = s + i * kW;
#pragma omp simd
        for (int64_t j = 0; j < kW; ++j) si[j] = (t > pos[j] || t < lo[j]) ? -INFINITY : si[j];
      }
    }
    // 2. online softmax: the new maximum, the rescale of what came before, the weights and their sum
    alignas(64) float base[kW], alpha[kW], total[kW];
    for (int64_t j = 0; j < kW; ++j) base[j] = m[j];
    for (int64_t i = 0; i < n; ++i) {
      const float* si = s + i * kW;
#pragma omp simd
      for (int64_t j = 0; j < kW; ++j) base[j] = std::max(base[j], si[j]);
    }
#pragma omp simd
    for (int64_t j = 0; j < kW; ++j) {
      const float safe = base[j] == -INFINITY ? 0.0f : base[j];  // a vector that sees no key yet
      alpha[j] = m[j] == -INFINITY ? 0.0f : exp_approx(m[j] - safe);
      m[j] = base[j];
      base[j] = safe;
      total[j] = 0.0f;
    }
    for (int64_t i = 0; i < n; ++i) {
      float* si = s + i * kW;
#pragma omp simd
      for (int64_t j = 0; j < kW; ++j) {
        si[j] = si[j] == -INFINITY ? 0.0f : exp_approx(si[j] - base[j]);
        total[j] += si[j];
      }
    }
    for (int64_t j = 0; j < kW; ++j) l[j] = l[j] * alpha[j] + total[j];
    // 3. the values, weighted, into the rescaled output
    for (int64_t d0 = 0; d0 < kHeadDim; d0 += 8) {
      vfloat acc[8][NV];
      vfloat a[NV];
      for (int64_t v = 0; v < NV; ++v) a[v] = load(alpha + v * kLanes);
      for (int64_t k = 0; k < 8; ++k)
        for (int64_t v = 0; v < NV; ++v) acc[k][v] = load(ot + (d0 + k) * kW + v * kLanes) * a[v];
      for (int64_t i = 0; i < n; ++i) {
        vfloat p[NV];
        for (int64_t v = 0; v < NV; ++v) p[v] = load(s + i * kW + v * kLanes);
        const float* vr = vp[i] + d0;
        for (int64_t k = 0; k < 8; ++k) {
          const vfloat vd = broadcast(vr[k]);
          for (int64_t v = 0; v < NV; ++v) acc[k][v] += vd * p[v];
        }
      }
      for (int64_t k = 0; k < 8; ++k)
        for (int64_t v = 0; v < NV; ++v) store(ot + (d0 + k) * kW + v * kLanes, acc[k][v]);
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    scalar_t* o = out + (j / group) * out_row_stride + (kv_head * group + j % group) * out_head_stride;
    const float inv = 1.0f / l[j];
    for (int64_t d = 0; d < kHeadDim; ++d) o[d] = static_cast<scalar_t>(ot[d * kW + j] * inv);
  }
}

template <int64_t kHeadDim, typename scalar_t>
using TileFn = decltype(&prefill_tile<kHeadDim, 1, scalar_t>);

template <int64_t kHeadDim, typename scalar_t>
TileFn<kHeadDim, scalar_t> tile_for(int64_t num_vectors) {
  switch ((num_vectors + kLanes - 1) / kLanes) {
    case 1: return prefill_tile<kHeadDim, 1, scalar_t>;
    case 2: return prefill_tile<kHeadDim, 2, scalar_t>;
    default: return prefill_tile<kHeadDim, 3, scalar_t>;
  }
}

constexpr int64_t kTileVectors = 48;  // query vectors (rows x query heads of one KV head) per work item

template <int64_t kHeadDim, typename scalar_t>
void run_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                 float scale, int64_t window) {
  const int64_t num_chunks = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = query.size(1) / num_kv_heads, rows_per_tile = std::max<int64_t>(1, kTileVectors / group);
  const auto* starts = query_start_loc.data_ptr<int64_t>();
  const auto* contexts = context_lens.data_ptr<int64_t>();
  struct Item { int64_t chunk, kv_head, row0, num_rows; };
  std::vector<Item> items;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t num_new = starts[c + 1] - starts[c];
    for (int64_t row0 = 0; row0 < num_new; row0 += rows_per_tile)
      for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({c, h, row0, std::min(rows_per_tile, num_new - row0)});
  }
  // the tiles that see the most keys first, so that dynamic scheduling ends the threads together
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return contexts[a.chunk] + a.row0 + a.num_rows > contexts[b.chunk] + b.row0 + b.num_rows;
  });
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = key_cache.data_ptr<scalar_t>();
  const auto* v = value_cache.data_ptr<scalar_t>();
  const auto* tables = block_tables.data_ptr<int64_t>();
  auto* o = out.data_ptr<scalar_t>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int num_threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const int64_t row = starts[it.chunk] + it.row0;
    tile_for<kHeadDim, scalar_t>(it.num_rows * group)(
        o + row * o_row, o_row, o_head, q + row * q_row, q_row, q_head, k, v, tables + it.chunk * max_blocks,
        block_size, num_kv_heads, it.kv_head, group, contexts[it.chunk] + it.row0, it.num_rows, window, scale);
  }
}

template <typename scalar_t>
void run_prefill_any(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens, float scale, int64_t window) {
  switch (query.size(2)) {
    case 64: return run_prefill<64, scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                              context_lens, scale, window);
    case 80: return run_prefill<80, scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                              context_lens, scale, window);
    case 128: return run_prefill<128, scalar_t>(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                                context_lens, scale, window);
    default: TORCH_CHECK(false, "paged_prefill: head_dim 64, 80 or 128 only, got ", query.size(2));
  }
}

}  // namespace

void paged_prefill(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                   at::Tensor block_tables, at::Tensor query_start_loc, at::Tensor context_lens, double scale,
                   int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, q_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "key and value caches differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key/value cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous in query and out");
  for (const auto* t : {&block_tables, &query_start_loc, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "block tables and lengths must be int64");
  TORCH_CHECK(query_start_loc.numel() == block_tables.size(0) + 1 && context_lens.numel() == block_tables.size(0),
              "query_start_loc must have one entry per chunk and one more, context_lens one per chunk");
  TORCH_CHECK(key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "head shapes do not match");
  TORCH_CHECK(query.size(1) / key_cache.size(2) <= kTileVectors, "paged_prefill: at most 48 query heads a KV head");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "query, out and the caches must share one dtype");
  const float s = static_cast<float>(scale);
  switch (dtype) {
    case at::kFloat: return run_prefill_any<float>(out, query, key_cache, value_cache, block_tables,
                                                   query_start_loc, context_lens, s, sliding_window);
    case at::kBFloat16: return run_prefill_any<c10::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                                              query_start_loc, context_lens, s, sliding_window);
    case at::kHalf: return run_prefill_any<c10::Half>(out, query, key_cache, value_cache, block_tables,
                                                      query_start_loc, context_lens, s, sliding_window);
    default: TORCH_CHECK(false, "paged_prefill: float32, bfloat16 or float16 only, got ", dtype);
  }
}

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) { m.def("paged_prefill", &paged_prefill); }
