// The LoRA term of a decode step, each row its own adapter's: torch.ops.<ns>.lora_add.
//
// Why: a decode step that mixes the base's rows with rows of several adapters adds,
// after each targeted projection, every row's low-rank term. With torch's GEMMs
// that is three small GEMMs a projection over every adapter of the step (a row's
// term computed against every adapter's columns, then masked): at rank 8-16 on a
// small model those calls cost more than the base's projection. This kernel reads
// only each row's own adapter (Punica's BGMV on the CPU): per row n of adapter
// columns [c, c + r) with scale s,
//   t[k] = s * sum_i A[c + k, i] * x[n, i]          (k < r, float32, not rounded)
//   out[n, j] += sum_k B[j, c + k] * t[k]            (rounded once into out's dtype)
// A is [S, in] and B [O, S] (the step's adapters stacked, lora.LoraStack); a row of
// the base has rank 0 and is left as it is. x, out: rows of unit-stride columns.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "simd.h"

#if !defined(AEGAEON_OPS)
#define AEGAEON_OPS aegaeon
#endif
#define AEGAEON_LORA_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define AEGAEON_LORA_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {

using namespace aegaeon_simd;

constexpr int64_t kMaxRank = 64;

template <typename T>
float dot(const T* a, const T* b, int64_t n) {
  int64_t c = 0;
  float acc = 0.f;
#if defined(AEGAEON_SIMD)
  F16 v = zero16();
  for (; c + 16 <= n; c += 16) v = fmadd16(load16(a + c), load16(b + c), v);
  if (c < n) {
    const int m = static_cast<int>(n - c);
    v = fmadd16(load16(a + c, m), load16(b + c, m), v);
    c = n;
  }
  acc = reduce_add16(v);
#endif
  for (; c < n; ++c) acc += static_cast<float>(a[c]) * static_cast<float>(b[c]);
  return acc;
}

// sum_k w[k] * t[k] for k < r (w in T, t in float32)
template <typename T>
float dot_t(const T* w, const float* t, int64_t r) {
  int64_t c = 0;
  float acc = 0.f;
#if defined(AEGAEON_SIMD)
  F16 v = zero16();
  for (; c + 16 <= r; c += 16) v = fmadd16(load16(w + c), load16(t + c), v);
  if (c < r) {
    const int m = static_cast<int>(r - c);
    v = fmadd16(load16(w + c, m), load16(t + c, m), v);
    c = r;
  }
  acc = reduce_add16(v);
#endif
  for (; c < r; ++c) acc += static_cast<float>(w[c]) * t[c];
  return acc;
}

template <typename T>
void run(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
         const int64_t* starts, const int64_t* ranks, const float* scales) {
  const int64_t rows = x.size(0), in = x.size(1), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sx = x.stride(0), sa = a.stride(0), sb = b.stride(0), so = out.stride(0);
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t r = ranks[n], c = starts[n];
    if (r <= 0) continue;
    float t[kMaxRank];
    for (int64_t k = 0; k < r; ++k) t[k] = scales[n] * dot(ap + (c + k) * sa, xp + n * sx, in);
    T* row = op + n * so;
    // output columns split over threads: a decode step's rows are few, its columns many
    at::parallel_for(0, width, 256, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        row[j] = T(static_cast<float>(row[j]) + dot_t(bp + j * sb + c, t, r));
      }
    });
  }
}

void lora_add(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
              const at::Tensor& b, const at::Tensor& starts, const at::Tensor& ranks,
              const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 2 && b.dim() == 2 && out.dim() == 2,
              "lora_add: x [N, in], a [S, in], b [O, S], out [N, O]");
  TORCH_CHECK(a.size(1) == x.size(1) && b.size(0) == out.size(1) && b.size(1) == a.size(0) &&
                  out.size(0) == x.size(0),
              "lora_add: shapes do not match");
  TORCH_CHECK(x.stride(1) == 1 && a.stride(1) == 1 && b.stride(1) == 1 && out.stride(1) == 1,
              "lora_add: rows must be unit-stride");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type() &&
                  b.scalar_type() == out.scalar_type(),
              "lora_add: x, a, b and out must share a dtype");
  const int64_t rows = x.size(0);
  TORCH_CHECK(starts.scalar_type() == at::kLong && ranks.scalar_type() == at::kLong &&
                  scales.scalar_type() == at::kFloat && starts.is_contiguous() &&
                  ranks.is_contiguous() && scales.is_contiguous() && starts.numel() == rows &&
                  ranks.numel() == rows && scales.numel() == rows,
              "lora_add: starts, ranks (int64) and scales (float32): one per row");
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* rp = ranks.data_ptr<int64_t>();
  for (int64_t n = 0; n < rows; ++n) {
    TORCH_CHECK(rp[n] >= 0 && rp[n] <= kMaxRank, "lora_add: ranks must be in 0..64");
    TORCH_CHECK(rp[n] == 0 || (sp[n] >= 0 && sp[n] + rp[n] <= a.size(0)),
                "lora_add: a row's columns lie outside the stacked matrices");
  }
  switch (x.scalar_type()) {
    case at::kFloat: return run<float>(out, x, a, b, sp, rp, scales.data_ptr<float>());
    case at::kBFloat16:
      return run<c10::BFloat16>(out, x, a, b, sp, rp, scales.data_ptr<float>());
    default: TORCH_CHECK(false, "lora_add: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

AEGAEON_LORA_FRAGMENT(AEGAEON_OPS, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor starts, Tensor ranks, "
        "Tensor scales) -> ()");
}

AEGAEON_LORA_IMPL(AEGAEON_OPS, CPU, m) { m.impl("lora_add", lora_add); }
