// Llama's RMSNorm, its MLP's SiLU-and-multiply and its attention's rotary embedding, one pass each, on CPU.
//
// rms_norm(out, x, weight, eps)      out = weight * (x / sqrt(mean(x^2) + eps)), over the last dim
//   x, out: [rows, hidden] (any row stride; hidden contiguous); weight: [hidden]
// silu_and_mul(out, gate, up)       out = silu(gate) * up
//   gate, up, out: [rows, inter] (any row strides: gate and up may be the two halves of one fused projection)
// rotary_embedding(q_out, k_out, q, k, cos, sin)   out = x * cos + rotate_half(x) * sin, for x = q and x = k
//   q, k, q_out, k_out: [tokens, heads, head_dim] (any token and head strides: q and k may be slices of one
//   fused projection); cos, sin: [tokens, head_dim]; rotate_half(x) = [-x2, x1] for x = [x1, x2]
//
// Each replaces a chain of torch operators that each read and write the whole tensor (RMSNorm: a widening copy,
// pow, mean, add, rsqrt, two multiplies; the MLP: SiLU, then a multiply; the rotary embedding, for q and k: two
// slices, a negation, a concatenation, two multiplies and an add), so one pass instead of six, two or twelve: on a
// 1,600-token prefill that is memory traffic, on a decode step it is operator dispatch. Rounding follows Hugging
// Face's modules: arithmetic in float32, the normalised row rounded to the input's dtype before the weight
// multiplies it, SiLU rounded before the multiply; only the order of the sum of squares differs (as between any
// two reductions). The rotary embedding is Hugging Face's to the bit: each product and the sum rounded to the
// dtype as torch rounds them, and no product fused into the addition (an FMA rounds once, torch twice).
// Explained in README.md (Benchmarks: the levers)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vector.h"

namespace {

using pagedlab_cpu::exp_approx;

template <typename T>
inline float widen(T v) { return static_cast<float>(v); }

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden, int64_t out_stride,
                   int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* yr = out + r * out_stride;
      float squares = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) squares += widen(xr[i]) * widen(xr[i]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      for (int64_t i = 0; i < hidden; ++i) {
        const T normed = static_cast<T>(widen(xr[i]) * inv);  // HF: .to(input_dtype), then weight * it
        yr[i] = static_cast<T>(widen(weight[i]) * widen(normed));
      }
    }
  });
}

template <typename T>
void silu_and_mul_rows(T* out, const T* gate, const T* up, int64_t rows, int64_t inter, int64_t out_stride,
                       int64_t gate_stride, int64_t up_stride) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate + r * gate_stride;
      const T* u = up + r * up_stride;
      T* y = out + r * out_stride;
      for (int64_t i = 0; i < inter; ++i) {
        const float gi = widen(g[i]);
        const T silu = static_cast<T>(gi / (1.0f + exp_approx(-gi)));  // HF: act_fn(gate) in the dtype, then * up
        y[i] = static_cast<T>(widen(silu) * widen(u[i]));
      }
    }
  });
}

// One head's row: y = x * c + rotate_half(x) * s. Compiled without contraction, so that each product is rounded
// before the sum as torch's separate operators round it (kept out of line: gcc inlines nothing across a change of
// this option).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotate_row(T* __restrict y, const T* __restrict x, const T* __restrict c, const T* __restrict s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const T a = static_cast<T>(widen(x[i]) * widen(c[i]));
    const T b = static_cast<T>(-widen(x[i + half]) * widen(s[i]));
    y[i] = static_cast<T>(widen(a) + widen(b));
  }
  for (int64_t i = half; i < 2 * half; ++i) {
    const T a = static_cast<T>(widen(x[i]) * widen(c[i]));
    const T b = static_cast<T>(widen(x[i - half]) * widen(s[i]));
    y[i] = static_cast<T>(widen(a) + widen(b));
  }
}
#pragma GCC pop_options

struct Heads {  // a [tokens, heads, head_dim] tensor's pointer and strides
  int64_t heads, token_stride, head_stride;
};

template <typename T>
void rotary_rows(T* q_out, T* k_out, const T* q, const T* k, const T* cos, const T* sin, int64_t tokens,
                 int64_t head_dim, Heads qo, Heads ko, Heads qi, Heads ki, int64_t cos_stride, int64_t sin_stride) {
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * cos_stride;
      const T* s = sin + t * sin_stride;
      for (int64_t h = 0; h < qi.heads; ++h)
        rotate_row(q_out + t * qo.token_stride + h * qo.head_stride, q + t * qi.token_stride + h * qi.head_stride,
                   c, s, head_dim / 2);
      for (int64_t h = 0; h < ki.heads; ++h)
        rotate_row(k_out + t * ko.token_stride + h * ko.head_stride, k + t * ki.token_stride + h * ki.head_stride,
                   c, s, head_dim / 2);
    }
  });
}

Heads heads_of(const at::Tensor& t) { return {t.size(1), t.stride(0), t.stride(1)}; }

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1,
              name, " must be a CPU [tokens, heads, head_dim] tensor, head_dim contiguous");
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be a CPU [rows, n] tensor, n contiguous");
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "out and x differ in shape");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "x, weight and out must share one dtype");
  const auto rows = x.size(0), hidden = x.size(1);
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      return rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), rows, hidden,
                           out.stride(0), x.stride(0), e);
    case at::kBFloat16:
      return rms_norm_rows(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                           weight.data_ptr<c10::BFloat16>(), rows, hidden, out.stride(0), x.stride(0), e);
    case at::kHalf:
      return rms_norm_rows(out.data_ptr<c10::Half>(), x.data_ptr<c10::Half>(), weight.data_ptr<c10::Half>(), rows,
                           hidden, out.stride(0), x.stride(0), e);
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16 only, got ", x.scalar_type());
  }
}

void silu_and_mul(at::Tensor out, at::Tensor gate, at::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  check_rows(out, "out");
  TORCH_CHECK(gate.sizes() == out.sizes() && up.sizes() == out.sizes(), "gate, up and out must share one shape");
  TORCH_CHECK(gate.scalar_type() == out.scalar_type() && up.scalar_type() == out.scalar_type(),
              "gate, up and out must share one dtype");
  const auto rows = out.size(0), inter = out.size(1);
  const auto so = out.stride(0), sg = gate.stride(0), su = up.stride(0);
  switch (out.scalar_type()) {
    case at::kFloat:
      return silu_and_mul_rows(out.data_ptr<float>(), gate.data_ptr<float>(), up.data_ptr<float>(), rows, inter, so,
                               sg, su);
    case at::kBFloat16:
      return silu_and_mul_rows(out.data_ptr<c10::BFloat16>(), gate.data_ptr<c10::BFloat16>(),
                               up.data_ptr<c10::BFloat16>(), rows, inter, so, sg, su);
    case at::kHalf:
      return silu_and_mul_rows(out.data_ptr<c10::Half>(), gate.data_ptr<c10::Half>(), up.data_ptr<c10::Half>(), rows,
                               inter, so, sg, su);
    default: TORCH_CHECK(false, "silu_and_mul: float32, bfloat16 or float16 only, got ", out.scalar_type());
  }
}

void rotary_embedding(at::Tensor q_out, at::Tensor k_out, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(q_out, "q_out");
  check_heads(k_out, "k_out");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(q_out.sizes() == q.sizes() && k_out.sizes() == k.sizes(), "q_out and k_out must be q's and k's shapes");
  const auto tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == head_dim, "q and k must share tokens and head_dim");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == head_dim,
              "cos and sin must be [tokens, head_dim]");
  const auto dtype = q.scalar_type();
  for (const at::Tensor* t : {&k, &q_out, &k_out, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == dtype, "q, k, their outputs, cos and sin must share one dtype");
  const Heads qo = heads_of(q_out), ko = heads_of(k_out), qi = heads_of(q), ki = heads_of(k);
  switch (dtype) {
    case at::kFloat:
      return rotary_rows(q_out.data_ptr<float>(), k_out.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>(),
                         cos.data_ptr<float>(), sin.data_ptr<float>(), tokens, head_dim, qo, ko, qi, ki,
                         cos.stride(0), sin.stride(0));
    case at::kBFloat16:
      return rotary_rows(q_out.data_ptr<c10::BFloat16>(), k_out.data_ptr<c10::BFloat16>(),
                         q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(),
                         sin.data_ptr<c10::BFloat16>(), tokens, head_dim, qo, ko, qi, ki, cos.stride(0),
                         sin.stride(0));
    case at::kHalf:
      return rotary_rows(q_out.data_ptr<c10::Half>(), k_out.data_ptr<c10::Half>(), q.data_ptr<c10::Half>(),
                         k.data_ptr<c10::Half>(), cos.data_ptr<c10::Half>(), sin.data_ptr<c10::Half>(), tokens,
                         head_dim, qo, ko, qi, ki, cos.stride(0), sin.stride(0));
    default: TORCH_CHECK(false, "rotary_embedding: float32, bfloat16 or float16 only, got ", dtype);
  }
}

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_embedding", &rotary_embedding);
}
