// Decode attention over a paged KV cache on CPU, reading each block where it lies (no gather).
//
// paged_decode(out, query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window)
//   query, out:      [num_seqs, q_heads, head_dim]       (any row and head strides; head_dim contiguous)
//   key/value_cache: [num_blocks, block_size, kv_heads, head_dim], contiguous (pagedlab's layout)
//   block_tables:    [num_seqs, max_blocks] int64;  context_lens: [num_seqs] int64 (keys, the new one included)
//   sliding_window:  0 for none, else a query at position L-1 sees the keys at positions > L-1-window
//
// One work item is one sequence and a range of its KV heads (all of them when there are enough sequences
// to keep every thread busy). For every KV head it walks the sequence's blocks twice:
//   1. scores[g][t] = q_g . k_t for the head's `group` query heads (each K row read from memory once),
//   2. softmax weights: the maximum subtracted, exponentials, their sum,
//   3. acc[g] = sum_t p[g][t] v_t (each V row read once), divided by the sum at the end.
// The scores stay whole between the passes (a few kilobytes per head): an exact softmax, no rescaling.
// Arithmetic is float32 whatever the cache's dtype: bfloat16 and float16 rows are widened as they are read.
//
// Speed (head_dim 64, 80 or 128): 16-lane float vectors (GCC/clang vector extensions: one AVX-512 register,
// two AVX2 ones, four NEON ones); head_dim fixed at compile time, so a tile of up to 4 query heads and their
// accumulators stay in registers while each row is loaded (and widened) once per tile; the dot products of 16
// consecutive keys reduced together (`sum16`) rather than one horizontal sum each; and the next block's rows,
// and while scoring the block's value rows, prefetched into L2 while this one is computed. Other head_dims take
// plain loops (`kChunks = 0`).
// Measured (batch 64, context 512, one thread): README, "Decode attention against the memory".
// Explained in chapters/03_paged_attention.ipynb

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vector.h"

namespace {

using namespace pagedlab_cpu;

#if defined(__clang__)
#define PAGEDLAB_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PAGEDLAB_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vint{__VA_ARGS__})
#endif

// The sums of the lanes of x[0..15], as one vector: result[t] = x[t][0] + ... + x[t][15]. Four rounds, each
// adding the two halves of pairs of vectors side by side: 16 vectors of 16 partial sums -> 8 of 2 x 8 ->
// 4 of 4 x 4 -> 2 of 8 x 2 -> 1 of 16 x 1, in order. 45 vector operations for 16 dot products.
inline vfloat sum16(const vfloat* x) {
  vfloat b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = PAGEDLAB_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PAGEDLAB_SHUFFLE(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = PAGEDLAB_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           PAGEDLAB_SHUFFLE(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = PAGEDLAB_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           PAGEDLAB_SHUFFLE(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return PAGEDLAB_SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PAGEDLAB_SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Ask for a row that a later part of the walk reads: blocks lie anywhere in the cache, so the hardware's stream
// prefetcher cannot know where the next one starts. Into L2, not L1 (locality 2: prefetcht1 on x86): a pass
// keeps a whole block's rows in flight, and L2 tracks more outstanding misses than L1. Measured with SmolLM2's
// 3 KV heads of 64, 32 sequences of 210-240 keys, 30 layers' caches so that every read comes from memory,
// float32, on a 2-core AMD EPYC with AVX-512 (`scripts/bench_decode_prefetch.py`, which builds the variants
// from these two macros; medians of 8 rounds): into L1, the next block only, 1.67 ms a layer at 1 thread and
// 0.96 at 2; into L2, 1.10 and 0.65; into L2 with the value rows asked for while scoring, 1.06 and 0.61.
#ifndef PAGEDLAB_PREFETCH_LOCALITY
#define PAGEDLAB_PREFETCH_LOCALITY 2
#endif
#ifndef PAGEDLAB_PREFETCH_VALUES
#define PAGEDLAB_PREFETCH_VALUES 1
#endif
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t head_dim) {
  const auto* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < head_dim * static_cast<int64_t>(sizeof(scalar_t)); i += 64) {
    __builtin_prefetch(bytes + i, 0, PAGEDLAB_PREFETCH_LOCALITY);
    asm volatile("" : : "r"(bytes + i));  // else GCC deletes a loop that only prefetches, as if it did nothing
  }
}

// The rows of one KV head in one block: `n` rows from `rows`, `token_stride` apart; `next` is the same head's
// first row in the next block (nullptr for the last block). A query-head tile of kTile heads (of the
// group's `group`) is computed per pass over the rows, so each row is loaded and widened once per tile.
struct Rows {
  int64_t n, token_stride;
};

// 1. scores[g * num_keys + t] = q_g . row_t. kChunks = head_dim / 16; the dot products of 16 consecutive
// rows are summed together by sum16. `values` are the same rows in the value cache, asked for here so that
// pass 3 finds them in L2.
template <int64_t kChunks, int64_t kTile, typename scalar_t>
void score_rows(const scalar_t* rows, const scalar_t* next, const scalar_t* values, Rows r, const float* q,
                int64_t group, float* scores, int64_t num_keys) {
  constexpr int64_t kHeadDim = kChunks * kLanes;
  for (int64_t g0 = 0; g0 < group; g0 += kTile) {
    const int64_t gn = std::min(kTile, group - g0);
    vfloat qv[kTile][kChunks];
    for (int64_t g = 0; g < kTile; ++g)
      for (int64_t c = 0; c < kChunks; ++c) qv[g][c] = g < gn ? load(q + (g0 + g) * kHeadDim + c * kLanes) : vfloat{};
    auto dots = [&](int64_t t, vfloat* acc) {
      const scalar_t* row = rows + t * r.token_stride;
      if (g0 == 0) {
        if (next != nullptr) prefetch_row(next + t * r.token_stride, kHeadDim);
        if (PAGEDLAB_PREFETCH_VALUES) prefetch_row(values + t * r.token_stride, kHeadDim);
      }
      for (int64_t g = 0; g < kTile; ++g) acc[g] = vfloat{};
      for (int64_t c = 0; c < kChunks; ++c) {
        const vfloat k = load16(row + c * kLanes);
        for (int64_t g = 0; g < kTile; ++g) acc[g] += qv[g][c] * k;
      }
    };
    int64_t t = 0;
    for (; t + kLanes <= r.n; t += kLanes) {
      vfloat partial[kTile][kLanes], acc[kTile];
      for (int64_t i = 0; i < kLanes; ++i) {
        dots(t + i, acc);
        for (int64_t g = 0; g < kTile; ++g) partial[g][i] = acc[g];
      }
      for (int64_t g = 0; g < gn; ++g) store(scores + (g0 + g) * num_keys + t, sum16(partial[g]));
    }
    for (; t < r.n; ++t) {
      vfloat acc[kTile];
      dots(t, acc);
      for (int64_t g = 0; g < gn; ++g) scores[(g0 + g) * num_keys + t] = hsum(acc[g]);
    }
  }
}

// 3. acc[g * head_dim + d] += sum_t p[g * num_keys + t] row_t[d].
template <int64_t kChunks, int64_t kTile, typename scalar_t>
void accumulate_rows(const scalar_t* rows, const scalar_t* next, Rows r, const float* p, int64_t group, float* acc,
                     int64_t num_keys) {
  constexpr int64_t kHeadDim = kChunks * kLanes;
  for (int64_t g0 = 0; g0 < group; g0 += kTile) {
    const int64_t gn = std::min(kTile, group - g0);
    vfloat a[kTile][kChunks];
    for (int64_t g = 0; g < kTile; ++g)
      for (int64_t c = 0; c < kChunks; ++c) a[g][c] = g < gn ? load(acc + (g0 + g) * kHeadDim + c * kLanes) : vfloat{};
    for (int64_t t = 0; t < r.n; ++t) {
      const scalar_t* row = rows + t * r.token_stride;
      if (next != nullptr && g0 == 0) prefetch_row(next + t * r.token_stride, kHeadDim);
      vfloat weight[kTile];
      for (int64_t g = 0; g < kTile; ++g) weight[g] = broadcast(g < gn ? p[(g0 + g) * num_keys + t] : 0.0f);
      for (int64_t c = 0; c < kChunks; ++c) {
        const vfloat v = load16(row + c * kLanes);
        for (int64_t g = 0; g < kTile; ++g) a[g][c] += weight[g] * v;
      }
    }
    for (int64_t g = 0; g < gn; ++g)
      for (int64_t c = 0; c < kChunks; ++c) store(acc + (g0 + g) * kHeadDim + c * kLanes, a[g][c]);
  }
}

// The same two steps for any head_dim, in plain loops over rows widened to float32 first.
template <typename scalar_t>
void score_rows_any(const scalar_t* rows, Rows r, const float* q, int64_t group, int64_t head_dim, float* scores,
                    int64_t num_keys, float* row) {
  for (int64_t t = 0; t < r.n; ++t) {
    to_float(rows + t * r.token_stride, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += q[g * head_dim + d] * row[d];
      scores[g * num_keys + t] = dot;
    }
  }
}

template <typename scalar_t>
void accumulate_rows_any(const scalar_t* rows, Rows r, const float* p, int64_t group, int64_t head_dim, float* acc,
                         int64_t num_keys, float* row) {
  for (int64_t t = 0; t < r.n; ++t) {
    to_float(rows + t * r.token_stride, row, head_dim);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < head_dim; ++d) acc[g * head_dim + d] += p[g * num_keys + t] * row[d];
  }
}

// One work item: a sequence's KV heads [kv_head_begin, kv_head_end). kChunks = head_dim / 16 when that is
// compiled in (head_dim fixed, so a query-head tile and its accumulators stay in registers), else 0.
template <typename scalar_t, int64_t kChunks, int64_t kTile>
void attend_one(scalar_t* out, const scalar_t* query, int64_t q_head_stride, int64_t out_head_stride,
                const scalar_t* key_cache, const scalar_t* value_cache, const int64_t* block_table,
                int64_t context_len, int64_t first_key, int64_t kv_head_begin, int64_t kv_head_end, int64_t group,
                int64_t block_size, int64_t num_kv_heads, int64_t runtime_head_dim, float scale) {
  const int64_t head_dim = kChunks > 0 ? kChunks * kLanes : runtime_head_dim;
  const int64_t num_keys = context_len - first_key;
  const int64_t heads = (kv_head_end - kv_head_begin) * group;  // query heads of this item
  std::vector<float> q(heads * head_dim), scores(heads * num_keys), acc(heads * head_dim, 0.0f), row(head_dim);
  for (int64_t h = 0; h < heads; ++h) {  // the item's query heads, scaled, as float32
    to_float(query + (kv_head_begin * group + h) * q_head_stride, q.data() + h * head_dim, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) q[h * head_dim + d] *= scale;
  }
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t first_block = first_key / block_size, last_block = (context_len - 1) / block_size;

  // Calls body(rows, next, Rows, first key index, local KV head) for each block's visible rows of each head.
  // `rows - cache` is where they lie in either cache: the scoring pass reads the values' position from it.
  auto for_each_rows = [&](const scalar_t* cache, auto&& body) {
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t t0 = std::max(first_key, b * block_size), t1 = std::min(context_len, (b + 1) * block_size);
      const scalar_t* rows = cache + (block_table[b] * block_size + (t0 - b * block_size)) * token_stride;
      const scalar_t* next = b < last_block ? cache + block_table[b + 1] * block_size * token_stride : nullptr;
      for (int64_t kv = kv_head_begin; kv < kv_head_end; ++kv)
        body(rows + kv * head_dim, next ? next + kv * head_dim : nullptr, Rows{t1 - t0, token_stride},
             t0 - first_key, kv - kv_head_begin);
    }
  };
  // 1. scores
  for_each_rows(key_cache, [&](const scalar_t* rows, const scalar_t* next, Rows r, int64_t t, int64_t kv) {
    const float* qh = q.data() + kv * group * head_dim;
    float* s = scores.data() + kv * group * num_keys + t;
    if constexpr (kChunks > 0)
      score_rows<kChunks, kTile>(rows, next, value_cache + (rows - key_cache), r, qh, group, s, num_keys);
    else
      score_rows_any(rows, r, qh, group, head_dim, s, num_keys, row.data());
  });
  // 2. softmax weights, unnormalised, and their sums
  std::vector<float> sums(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * num_keys;
    float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < num_keys; ++t) m = std::max(m, s[t]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < num_keys; ++t) {
      s[t] = exp_approx(s[t] - m);
      total += s[t];
    }
    sums[h] = total;
  }
  // 3. weighted sum of the values
  for_each_rows(value_cache, [&](const scalar_t* rows, const scalar_t* next, Rows r, int64_t t, int64_t kv) {
    const float* p = scores.data() + kv * group * num_keys + t;
    float* a = acc.data() + kv * group * head_dim;
    if constexpr (kChunks > 0)
      accumulate_rows<kChunks, kTile>(rows, next, r, p, group, a, num_keys);
    else
      accumulate_rows_any(rows, r, p, group, head_dim, a, num_keys, row.data());
  });
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* o = out + (kv_head_begin * group + h) * out_head_stride;
    const float inv = 1.0f / sums[h];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
  }
}

template <typename scalar_t>
using AttendFn = void (*)(scalar_t*, const scalar_t*, int64_t, int64_t, const scalar_t*, const scalar_t*,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          float);

// A tile of up to 4 query heads per pass over the rows, so that tile x head_dim / 16 accumulators fit in
// the registers (32 with AVX-512): head_dim 64 and 80 take tiles of 1-4, head_dim 128 tiles of 1-2.
template <typename scalar_t, int64_t kChunks>
AttendFn<scalar_t> attend_tiled(int64_t group) {
  constexpr int64_t kMaxTile = kChunks <= 5 ? 4 : 2;
  switch (std::min(group, kMaxTile)) {
    case 1: return attend_one<scalar_t, kChunks, 1>;
    case 2: return attend_one<scalar_t, kChunks, 2>;
    case 3: return attend_one<scalar_t, kChunks, std::min<int64_t>(3, kMaxTile)>;
    default: return attend_one<scalar_t, kChunks, kMaxTile>;
  }
}

// The compiled head_dims: 64, 80 and 128; any other takes the plain loops.
template <typename scalar_t>
AttendFn<scalar_t> attend_for(int64_t head_dim, int64_t group) {
  switch (head_dim) {
    case 64: return attend_tiled<scalar_t, 4>(group);
    case 80: return attend_tiled<scalar_t, 5>(group);
    case 128: return attend_tiled<scalar_t, 8>(group);
    default: return attend_one<scalar_t, 0, 1>;
  }
}

template <typename scalar_t>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& context_lens,
         float scale, int64_t sliding_window) {
  const int64_t num_seqs = query.size(0), q_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = q_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t out_seq_stride = out.stride(0), out_head_stride = out.stride(1);
  const auto* tables = block_tables.data_ptr<int64_t>();
  const auto* lens = context_lens.data_ptr<int64_t>();
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = key_cache.data_ptr<scalar_t>();
  const auto* v = value_cache.data_ptr<scalar_t>();
  auto* o = out.data_ptr<scalar_t>();
  const auto attend = attend_for<scalar_t>(head_dim, group);
  const int num_threads = at::get_num_threads();
  // Enough sequences to share out: each item takes a whole sequence; else one item per (sequence, KV head).
  const int64_t heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  // Dynamic scheduling: rows come longest first, so equal shares of rows are not equal shares of work.
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < num_seqs * items_per_seq; ++item) {
    const int64_t seq = item / items_per_seq, kv0 = (item % items_per_seq) * heads_per_item;
    const int64_t len = lens[seq];
    if (len <= 0) continue;
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    attend(o + seq * out_seq_stride, q + seq * q_seq_stride, q_head_stride, out_head_stride, k, v,
           tables + seq * max_blocks, len, first, kv0, kv0 + heads_per_item, group, block_size, num_kv_heads,
           head_dim, scale);
  }
}

}  // namespace

void paged_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                  at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_seqs, q_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(), "key and value caches differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key/value cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous in query and out");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "block tables must be contiguous");
  TORCH_CHECK(key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "head shapes do not match");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "query, out and the caches must share one dtype");
  const float s = static_cast<float>(scale);
  switch (dtype) {
    case at::kFloat: return run<float>(out, query, key_cache, value_cache, block_tables, context_lens, s,
                                       sliding_window);
    case at::kBFloat16: return run<c10::BFloat16>(out, query, key_cache, value_cache, block_tables, context_lens, s,
                                                  sliding_window);
    case at::kHalf: return run<c10::Half>(out, query, key_cache, value_cache, block_tables, context_lens, s,
                                          sliding_window);
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16 or float16 only, got ", dtype);
  }
}

// Registered as an operator, torch.ops.<build name>.paged_decode: torch/library.h and ATen's Tensor are a fifth of
// the headers of torch/extension.h (the Python bindings, autograd, nn), so the first build is that much shorter.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
