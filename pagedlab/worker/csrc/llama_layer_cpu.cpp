// A Llama decoder layer's decode step on CPU in one call: the operators that `cpu_fused`'s forwards run from
// Python, in the same order on the same kernels, so the result is the same to the bit.
//
// llama_decode_layer(hidden, input_norm, input_eps, qkv, qkv_bias, num_heads, num_kv_heads, cos, sin,
//                    key_cache, value_cache, slots, block_tables, context_lens, scale,
//                    o, o_bias, post_norm, post_eps, gate_up, gate_up_bias, down, down_bias) -> hidden'
//   hidden: [tokens, hidden] contiguous, one decode token per sequence; qkv, o, gate_up, down: weights packed for
//   oneDNN (`cpu_linear.pack`; q, k, v stacked, gate and up stacked); cos, sin: [tokens, head_dim];
//   key_cache, value_cache: the layer's [num_blocks, block_size, kv_heads, head_dim]; slots: [tokens] int64;
//   block_tables: [tokens, max_blocks] int64; context_lens: [tokens] int64.
//
//   x = rms_norm(hidden); q, k, v = x @ qkv; q, k = rotary(q, k); cache[slots] = k, v;
//   h = hidden + paged_decode(q) @ o; y = rms_norm(h); return h + silu_and_mul(y @ gate_up) @ down
//
// Why: on a decode step the layer's arithmetic is small and its Python is not. From Python the layer is some
// fifty torch calls (module calls, views, splits, empty tensors, the attention interface), a few microseconds
// each: at 2 threads this call takes 6-8 ms off a SmolLM2 decode step of 22-83 ms (1 to 32 sequences, float32 and
// bfloat16). vLLM's CPU backend compiles the model's graph for the same reason. Only pure-decode steps come here
// (`cpu_fused.FusedModules.decode_layer_inputs` decides); prefills, float8 caches, hooks, MKL's few-rows products
// and the attention's torch path keep the Python layers.
// Explained in README.md (Benchmarks: the levers)

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

// the kernels of fused_cpu.cpp and paged_decode_cpu.cpp, built into the same library
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void silu_and_mul(at::Tensor out, at::Tensor gate, at::Tensor up);
void rotary_embedding(at::Tensor q_out, at::Tensor k_out, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
void paged_decode(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                  at::Tensor block_tables, at::Tensor context_lens, double scale, int64_t sliding_window);

namespace {

// torch's oneDNN linear on a packed weight, as `cpu_linear.packed_linear` calls it from Python
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                            c10::List<std::optional<c10::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
}

at::Tensor normed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto out = at::empty(x.sizes(), x.options());
  rms_norm(out, x, weight, eps);
  return out;
}

}  // namespace

at::Tensor llama_decode_layer(at::Tensor hidden, at::Tensor input_norm, double input_eps, at::Tensor qkv,
                              std::optional<at::Tensor> qkv_bias, int64_t num_heads, int64_t num_kv_heads,
                              at::Tensor cos, at::Tensor sin, at::Tensor key_cache, at::Tensor value_cache,
                              at::Tensor slots, at::Tensor block_tables, at::Tensor context_lens, double scale,
                              at::Tensor o, std::optional<at::Tensor> o_bias, at::Tensor post_norm, double post_eps,
                              at::Tensor gate_up, std::optional<at::Tensor> gate_up_bias, at::Tensor down,
                              std::optional<at::Tensor> down_bias) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [tokens, hidden] tensor");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == hidden.size(0),
              "slots must be [tokens] int64");
  const int64_t tokens = hidden.size(0), head_dim = cos.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;

  // attention: q, k, v from one GEMM, their rotary embedding, the cache write, the decode kernel, o_proj
  const auto projected = packed_linear(normed(hidden, input_norm, input_eps), qkv, qkv_bias);
  TORCH_CHECK(projected.size(1) == q_size + 2 * kv_size, "the qkv weight does not match the heads");
  const auto q = projected.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
  const auto k = projected.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
  const auto v = projected.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  auto query = at::empty({tokens, num_heads, head_dim}, hidden.options());
  auto key = at::empty({tokens, num_kv_heads, head_dim}, hidden.options());
  rotary_embedding(query, key, q, k, cos, sin);
  key_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slots, key);
  value_cache.view({-1, num_kv_heads, head_dim}).index_copy_(0, slots, v);
  auto attended = at::empty({tokens, num_heads, head_dim}, hidden.options());
  paged_decode(attended, query, key_cache, value_cache, block_tables, context_lens, scale, 0);
  const auto h = at::add(hidden, packed_linear(attended.view({tokens, q_size}), o, o_bias));

  // MLP: gate and up from one GEMM, SiLU-and-multiply, down_proj
  const auto gate_and_up = packed_linear(normed(h, post_norm, post_eps), gate_up, gate_up_bias);
  const int64_t inter = gate_and_up.size(1) / 2;
  auto act = at::empty({tokens, inter}, hidden.options());
  silu_and_mul(act, gate_and_up.narrow(1, 0, inter), gate_and_up.narrow(1, inter, inter));
  return at::add(h, packed_linear(act, down, down_bias));
}

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) { m.def("llama_decode_layer", &llama_decode_layer); }
