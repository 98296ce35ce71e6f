// A whole decode step's decoder layers in one call: torch.ops.<ns>.decode_layers.
//
// Why: a decode step of a deep model at batch 1 is ~11 kernel calls a layer, and
// each call from Python costs its interpreter and dispatcher overhead (~5-10 us):
// on SmolLM2's 30 layers that was ~28-38% of a step (docs/results.md, issue 28),
// time in which the core streams no weights. This op runs the same kernels, in
// the same order and on the same buffers as model.forward with NativeOps, through
// the C++ dispatcher instead (~0.3 us a call), so its outputs are bit-identical
// to the Python loop's.
//
// Per layer l: x = rms_norm(h, norms[2l]); qkv = x @ projs[4l]^T (+ biases[2l]);
// rope_write(qkv, qk_norms[2l], qk_norms[2l+1], ...); attn = paged_decode(q);
// h += attn @ projs[4l+1]^T (+ biases[2l+1]); x = rms_norm(h, norms[2l+1]);
// h += silu_mul(x @ projs[4l+2]^T) @ projs[4l+3]^T. A projection whose qtypes entry
// is 0 is dense (`linear`), else GGUF block-quantized of that GGML type (`qlinear`).
// The projections run in namespace proj_ns and the attention in attn_ns (the
// levels the engine's measured choice picked); norms, rope and SiLU in this one.
//
// LoRA adapters (lora.py, csrc/lora.cpp): with lora_index (7 entries a layer, one
// per module q, k, v, o, gate, up, down: an index into lora_a / lora_b, or -1),
// each targeted module's output columns get their rows' low-rank term right after
// the projection (lora_add, this namespace), before anything reads them; lora_starts
// and lora_ranks hold per module each row's columns ([N] int64 each), lora_scales
// each row's scale. Empty lora_index: no term (the model alone).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#if !defined(AEGAEON_OPS)
#define AEGAEON_OPS aegaeon
#endif
#define AEGAEON_STACK_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define AEGAEON_STACK_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
#define AEGAEON_STR2(x) #x
#define AEGAEON_STR(x) AEGAEON_STR2(x)

namespace {

using OptTensor = std::optional<at::Tensor>;
using LinearFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&);
using QLinearFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                       const OptTensor&);
using NormFn = void(const at::Tensor&, const at::Tensor&, const OptTensor&, double);
using SiluFn = void(const at::Tensor&, const at::Tensor&);
using RopeFn = void(const at::Tensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                    const at::Tensor&, int64_t, double);
using PagedFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, int64_t, double);
using LoraFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&);
constexpr int64_t kLoraModules = 7;  // q, k, v, o, gate, up, down

template <typename F>
c10::TypedOperatorHandle<F> op(c10::string_view ns, const char* name) {
  const std::string qualified = std::string(ns) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "").typed<F>();
}

void decode_layers(const at::Tensor& h, at::TensorList norms, at::TensorList projs,
                   const c10::List<OptTensor>& biases, const c10::List<OptTensor>& qk_norms,
                   at::IntArrayRef qtypes,
                   const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache,
                   const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                   const at::Tensor& block_table, const at::Tensor& context_lens,
                   int64_t num_q, double eps, double scale, c10::string_view proj_ns,
                   c10::string_view attn_ns, at::TensorList lora_a, at::TensorList lora_b,
                   at::IntArrayRef lora_index, at::TensorList lora_starts,
                   at::TensorList lora_ranks, const OptTensor& lora_scales) {
  const auto layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(projs.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 2 * layers &&
                  static_cast<int64_t>(qk_norms.size()) == 2 * layers &&
                  static_cast<int64_t>(qtypes.size()) == 4 * layers,
              "decode_layers: per layer 2 norms, 4 projections, 2 biases, 2 q/k norms, "
              "4 qtypes");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be contiguous [N, hidden]");
  TORCH_CHECK(cache.dim() == 6, "cache must be [blocks, layers, 2, block_size, Hkv, D]");
  TORCH_CHECK(cache.size(1) == layers, "the cache's layers differ from the weights'");
  const c10::string_view ns = AEGAEON_STR(AEGAEON_OPS);
  const OptTensor no_bias;
  const auto linear = op<LinearFn>(proj_ns, "linear");
  const auto qlinear = op<QLinearFn>(proj_ns, "qlinear");
  const auto norm = op<NormFn>(ns, "rms_norm");
  const auto silu = op<SiluFn>(ns, "silu_mul");
  const auto rope = op<RopeFn>(ns, "rope_write");
  const auto paged = op<PagedFn>(attn_ns, "paged_decode");
  const bool with_lora = !lora_index.empty();
  TORCH_CHECK(!with_lora || (static_cast<int64_t>(lora_index.size()) == kLoraModules * layers &&
                             lora_a.size() == lora_b.size() &&
                             static_cast<int64_t>(lora_starts.size()) == kLoraModules &&
                             static_cast<int64_t>(lora_ranks.size()) == kLoraModules &&
                             lora_scales.has_value()),
              "decode_layers: LoRA needs 7 indices a layer, A and B alike, 7 starts and ranks, "
              "the scales");
  std::optional<c10::TypedOperatorHandle<LoraFn>> lora_add;
  if (with_lora) lora_add.emplace(op<LoraFn>(ns, "lora_add"));

  const int64_t n = h.size(0), dim = cache.size(5), num_kv = cache.size(4);
  const int64_t heads = num_q + 2 * num_kv;
  const auto opts = h.options();
  const at::Tensor x = at::empty({n, h.size(1)}, opts);
  const at::Tensor qkv = at::empty({n, projs[0].size(0)}, opts);
  TORCH_CHECK(qkv.size(1) == heads * dim, "qkv rows must be (Hq + 2 Hkv) * D");
  const at::Tensor qkv3 = qkv.view({n, heads, dim});
  const at::Tensor q = qkv3.slice(1, 0, num_q);
  const at::Tensor attn = at::empty({n, num_q, dim}, opts);
  const at::Tensor attn2 = attn.view({n, num_q * dim});
  const at::Tensor out = at::empty({n, h.size(1)}, opts);
  const at::Tensor gate_up = at::empty({n, projs[2].size(0)}, opts);
  const at::Tensor act = at::empty({n, projs[2].size(0) / 2}, opts);
  auto project = [&](const at::Tensor& dst, const at::Tensor& src, int64_t i,
                     const OptTensor& bias) {
    if (qtypes[i] != 0) {
      qlinear.call(dst, src, projs[i], qtypes[i], bias);
    } else {
      linear.call(dst, src, projs[i], bias);
    }
  };
  // module m's columns [begin, end) of dst get their rows' term of src
  auto lora = [&](int64_t l, int64_t m, const at::Tensor& dst, int64_t begin, int64_t end,
                  const at::Tensor& src) {
    if (!with_lora) return;
    const int64_t i = lora_index[kLoraModules * l + m];
    if (i < 0) return;
    lora_add->call(dst.slice(1, begin, end), src, lora_a[i], lora_b[i], lora_starts[m],
                   lora_ranks[m], *lora_scales);
  };
  const int64_t q_cols = num_q * dim, kv_cols = num_kv * dim;
  const int64_t inter = projs[2].size(0) / 2, hidden = h.size(1);
  for (int64_t l = 0; l < layers; ++l) {
    norm.call(x, h, norms[2 * l], eps);
    project(qkv, x, 4 * l, biases.get(2 * l));
    lora(l, 0, qkv, 0, q_cols, x);
    lora(l, 1, qkv, q_cols, q_cols + kv_cols, x);
    lora(l, 2, qkv, q_cols + kv_cols, q_cols + 2 * kv_cols, x);
    rope.call(qkv3, qk_norms.get(2 * l), qk_norms.get(2 * l + 1), cos, sin, cache, l, slot_blocks,
              slot_offsets, num_q, eps);
    paged.call(attn, q, cache, block_table, context_lens, l, scale);
    project(out, attn2, 4 * l + 1, biases.get(2 * l + 1));
    lora(l, 3, out, 0, hidden, attn2);
    h.add_(out);
    norm.call(x, h, norms[2 * l + 1], eps);
    project(gate_up, x, 4 * l + 2, no_bias);
    lora(l, 4, gate_up, 0, inter, x);
    lora(l, 5, gate_up, inter, 2 * inter, x);
    silu.call(act, gate_up);
    project(out, act, 4 * l + 3, no_bias);
    lora(l, 6, out, 0, hidden, act);
    h.add_(out);
  }
}

}  // namespace

AEGAEON_STACK_FRAGMENT(AEGAEON_OPS, m) {
  m.def("decode_layers(Tensor(a!) h, Tensor[] norms, Tensor[] projs, Tensor?[] biases, "
        "Tensor?[] qk_norms, int[] qtypes, Tensor cos, Tensor sin, Tensor(b!) cache, "
        "Tensor slot_blocks, Tensor slot_offsets, Tensor block_table, Tensor context_lens, "
        "int num_q, float eps, float scale, str proj_ns, str attn_ns, Tensor[] lora_a, "
        "Tensor[] lora_b, int[] lora_index, Tensor[] lora_starts, Tensor[] lora_ranks, "
        "Tensor? lora_scales) -> ()");
}

AEGAEON_STACK_IMPL(AEGAEON_OPS, CPU, m) { m.impl("decode_layers", decode_layers); }
