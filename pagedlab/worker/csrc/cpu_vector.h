// Float vectors for pagedlab's C++ CPU kernels (paged_decode_cpu.cpp, paged_prefill_cpu.cpp): 16 float32 lanes
// in GCC/clang vector extensions (one AVX-512 register, two AVX2 ones, four NEON ones), loads that widen bfloat16
// and float16 rows to float32, and a vectorisable exp (softmax weights; fused_cpu.cpp's SiLU).

#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedlab_cpu {

constexpr int64_t kLanes = 16;
using vfloat = float __attribute__((vector_size(64)));
using vint = int32_t __attribute__((vector_size(64)));
using vu32 = uint32_t __attribute__((vector_size(64)));
using vu16 = uint16_t __attribute__((vector_size(32)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

inline vfloat broadcast(float x) { return vfloat{} + x; }

// Widen n values to float32: bfloat16 is the top half of a float32; float16 goes through c10.
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vu16 half;
    std::memcpy(&half, bits + i, sizeof(half));
    const vu32 wide = __builtin_convertvector(half, vu32) << 16;
    std::memcpy(dst + i, &wide, sizeof(wide));
  }
  for (; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp(x) in a form the compiler vectorises (std::exp stays a scalar call without -ffast-math), for softmax weights
// (x <= 0: scores minus their maximum) and the SiLU: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6
// Taylor polynomial (relative error below 2e-7, about one float ulp), times 2^n built from the exponent bits. Below
// -87 it is exp(-87) (nothing against a softmax's largest weight, 1, or the SiLU's 1 + exp(-g)), above 88.7
// infinity (float's own overflow, so that silu(-huge) is -0, as torch's). The clamps are std::min and std::max and
// the rounding std::nearbyint: with branchy ternaries instead, gcc left the prefill kernel's softmax loops scalar
// (tests/worker/test_cpu_vectorised.py reads its report).
inline float exp_approx(float x) {
  const float overflow = x > 88.72f ? INFINITY : 1.0f;  // a factor, not a branch: the loop stays one of vectors
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const int32_t k = static_cast<int32_t>(n);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // the high part exact in float
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);  // a union here keeps gcc from vectorising the loop (2026-12-04)
  return p * scale * overflow;
}

// 16 values of a cache row as a float32 vector.
inline vfloat load16(const float* p) { return load(p); }

inline vfloat load16(const c10::BFloat16* p) {
  vu16 half;
  std::memcpy(&half, p, sizeof(half));
  const vu32 wide = __builtin_convertvector(half, vu32) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline vfloat load16(const c10::Half* p) {
  float f[kLanes];
  to_float(p, f, kLanes);
  return load(f);
}

}  // namespace pagedlab_cpu
