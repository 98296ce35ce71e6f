// Skinny matmul for decode: out[N, O] = x[N, I] @ w[O, I]^T (+ bias) for a few
// rows N (one per sequence of a decode step). Registered as torch.ops.aegaeon.linear.
//
// Why: a decode step streams every weight once; at N <= 16 the work is bound
// by that stream, and oneDNN through torch.mm reaches ~10-15 GB/s here (with
// a fixed cost of ~50 us per call on small weights) while a plain loop over the
// weight rows reaches the memory's ~25 GB/s. The weight is read in place,
// row-major [O, I] as the checkpoint (and the engine's packed layout) stores
// it: nothing is prepacked, so the weights stay views of caller-owned bytes.
//
// Algorithm: the output is cut into tiles of 16 rows of w (the parallel unit).
// Within a tile, x's rows go in blocks of NB (8, 4, 2 or 1) and the tile's rows
// in sub-blocks of R = 16 / NB, so that R * NB = 16 accumulators (16-lane
// float32 vectors) hold partial dot products of every (row, x row) pair while
// the inner loop walks I: per step, R loads of w, R * NB fused multiply-adds
// (vdpbf16ps on bfloat16: 32 products each, exact in float32; FMA on float32).
// The 16 accumulators are then summed lane-wise with one transpose-add
// (sum16x16) into 16 outputs. x is packed once per call into a contiguous
// buffer; a ragged end of I is handled with masked loads.
//
// Needs AVX-512 (float32) and AVX512-BF16 (bfloat16); `linear_supported`
// tells Python which dtypes this build can run (the rest stays on torch.mm).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AEGAEON_AMX 1
#endif

namespace {

constexpr int kTile = 16;   // output rows per parallel task
constexpr int kMaxRows = 16;  // x rows the kernel takes (decode batches)

#if defined(__AVX512F__)
using namespace aegaeon_simd;

// Per-dtype steps: kStep elements of I per multiply-add, with a masked variant.
template <typename T>
struct Step;

template <>
struct Step<float> {
  static constexpr int kStep = 16;
  using W = __m512;
  static W load(const float* p) { return _mm512_loadu_ps(p); }
  static W load_tail(const float* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static __m512 madd(__m512 acc, W w, W x) { return _mm512_fmadd_ps(w, x, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct Step<c10::BFloat16> {
  static constexpr int kStep = 32;
  using W = __m512bh;
  static W load(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W load_tail(const c10::BFloat16* p, int n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  static __m512 madd(__m512 acc, W w, W x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

// The 16 dot products of w rows o0 .. o0 + R (clamped to the last row) with x
// rows n0 .. n0 + NB; result lane r * NB + n.
template <typename T, int R, int NB>
inline __m512 dots(const T* w, int64_t w_stride, int64_t rows, const T* x, int64_t in,
                   int64_t o0, int64_t n0) {
  using S = Step<T>;
  static_assert(R * NB == 16, "16 accumulators");
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const T* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(o0 + r, rows - 1) * w_stride;
  const T* xr = x + n0 * in;
  int64_t c = 0;
  for (; c + S::kStep <= in; c += S::kStep) {
    typename S::W wv[R];
    for (int r = 0; r < R; ++r) wv[r] = S::load(wr[r] + c);
    for (int n = 0; n < NB; ++n) {
      const typename S::W xv = S::load(xr + n * in + c);
      for (int r = 0; r < R; ++r) acc[r * NB + n] = S::madd(acc[r * NB + n], wv[r], xv);
    }
  }
  if (c < in) {
    const int tail = static_cast<int>(in - c);
    typename S::W wv[R];
    for (int r = 0; r < R; ++r) wv[r] = S::load_tail(wr[r] + c, tail);
    for (int n = 0; n < NB; ++n) {
      const typename S::W xv = S::load_tail(xr + n * in + c, tail);
      for (int r = 0; r < R; ++r) acc[r * NB + n] = S::madd(acc[r * NB + n], wv[r], xv);
    }
  }
  return sum16x16(acc);
}

struct LinearArgs {
  const void* w;
  int64_t w_stride, rows, in;
  const void* bias;  // [rows] or null
  void* out;
  int64_t out_stride_n, out_stride_o;
};

// Rows o0 .. o0 + kTile of out for x rows n0 .. n0 + NB.
template <typename T, int NB>
void tile_rows(const LinearArgs& a, const T* x, int64_t o0, int64_t n0) {
  constexpr int R = 16 / NB;
  const T* w = static_cast<const T*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  for (int64_t s = o0; s < std::min(o0 + kTile, a.rows); s += R) {
    alignas(64) float res[16];
    _mm512_store_ps(res, dots<T, R, NB>(w, a.w_stride, a.rows, x, a.in, s, n0));
    for (int r = 0; r < R && s + r < a.rows; ++r) {
      const float b = bias ? static_cast<float>(bias[s + r]) : 0.f;
      for (int n = 0; n < NB; ++n) {
        out[(n0 + n) * a.out_stride_n + (s + r) * a.out_stride_o] = T(res[r * NB + n] + b);
      }
    }
  }
}

#if defined(AEGAEON_AMX)
// AMX path (bfloat16, I % 32 == 0, O >= 16). Tiles: C0/C1 (0, 1) hold float32
// [16 rows of w, N] for two 16-row blocks; A0/A1 (2, 3) are 16 rows x 32
// inputs of w, loaded in place with the row stride of w; B (4) is 32 inputs x N
// of x in the VNNI layout tdpbf16ps wants ([I / 2][N][2]: pairs of inputs
// adjacent), packed once per call. One step: 2 tdpbf16ps of 16 x N x 32.
struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_usable() {
  // the kernel must let this process use the tile data state (Linux >= 5.16)
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}

// Output rows [16 * blk, 16 * blk + 16) of blocks blk in [first, last), two at a time.
void amx_blocks(const LinearArgs& a, const c10::BFloat16* xp, int64_t num, int64_t first,
                int64_t last) {
  TileConfig cfg;
  const auto cols = static_cast<uint16_t>(num * 4);
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = cols;
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  cfg.rows[4] = 16, cfg.colsb[4] = cols;
  _tile_loadconfig(&cfg);
  const auto* w = static_cast<const c10::BFloat16*>(a.w);
  const auto* bias = static_cast<const c10::BFloat16*>(a.bias);
  auto* out = static_cast<c10::BFloat16*>(a.out);
  const int64_t w_bytes = a.w_stride * 2;
  alignas(64) float c[2][16 * 16];
  for (int64_t blk = first; blk < last; blk += 2) {
    // a last block past the end starts at rows - 16 (its rows already done are not stored)
    const int64_t s0 = std::min(16 * blk, a.rows - 16);
    const int64_t s1 = std::min(16 * (blk + 1), a.rows - 16);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < a.in; k += 32) {
      _tile_loadd(4, xp + k * num, cols);
      _tile_loadd(2, w + s0 * a.w_stride + k, w_bytes);
      _tile_loadd(3, w + s1 * a.w_stride + k, w_bytes);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, c[0], cols);
    _tile_stored(1, c[1], cols);
    for (int half = 0; half < 2 && blk + half < last; ++half) {
      const int64_t start = half ? s1 : s0;
      for (int64_t o = 16 * (blk + half); o < std::min(16 * (blk + half) + 16, a.rows); ++o) {
        const float b = bias ? static_cast<float>(bias[o]) : 0.f;
        for (int64_t n = 0; n < num; ++n) {
          out[n * a.out_stride_n + o * a.out_stride_o] =
              c10::BFloat16(c[half][(o - start) * num + n] + b);
        }
      }
    }
  }
  _tile_release();
}

void run_amx(const LinearArgs& a, const at::Tensor& x_in) {
  const int64_t num = x_in.size(0), in = a.in;
  thread_local std::vector<c10::BFloat16> packed;
  packed.resize(num * in);
  const auto* x = static_cast<const c10::BFloat16*>(x_in.data_ptr());
  const int64_t sn = x_in.stride(0), si = x_in.stride(1);
  if (si == 1) {  // a pair of inputs is one 32-bit word: a [N, I/2] -> [I/2, N] transpose
    auto* dst = reinterpret_cast<uint32_t*>(packed.data());
    for (int64_t n = 0; n < num; ++n) {
      uint32_t pair;
      for (int64_t i = 0; i < in / 2; ++i) {
        std::memcpy(&pair, x + n * sn + 2 * i, sizeof pair);
        dst[i * num + n] = pair;
      }
    }
  } else {
    for (int64_t n = 0; n < num; ++n) {
      for (int64_t i = 0; i < in; ++i) packed[(i / 2) * num * 2 + n * 2 + i % 2] = x[n * sn + i * si];
    }
  }
  const int64_t blocks = (a.rows + 15) / 16;
  const c10::BFloat16* xp = packed.data();  // this thread's buffer, not a worker's
  at::parallel_for(0, (blocks + 1) / 2, 4, [&](int64_t begin, int64_t end) {
    amx_blocks(a, xp, num, 2 * begin, std::min(2 * end, blocks));  // pairs of blocks
  });
}
#endif

template <typename T>
void run_linear(const LinearArgs& a, const at::Tensor& x_in) {
  // x packed as contiguous [N, I] in a per-thread buffer (no allocation per call)
  const int64_t num = x_in.size(0), in = a.in;
  thread_local std::vector<T> packed;
  const T* x = static_cast<const T*>(x_in.data_ptr());
  if (!(x_in.stride(1) == 1 && x_in.stride(0) == in)) {
    packed.resize(num * in);
    const int64_t sn = x_in.stride(0), si = x_in.stride(1);
    for (int64_t n = 0; n < num; ++n) {
      for (int64_t i = 0; i < in; ++i) packed[n * in + i] = x[n * sn + i * si];
    }
    x = packed.data();
  }
  const int64_t tiles = (a.rows + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t n0 = 0;
      for (; n0 + 8 <= num; n0 += 8) tile_rows<T, 8>(a, x, t * kTile, n0);
      if (n0 + 4 <= num) { tile_rows<T, 4>(a, x, t * kTile, n0); n0 += 4; }
      if (n0 + 2 <= num) { tile_rows<T, 2>(a, x, t * kTile, n0); n0 += 2; }
      if (n0 < num) tile_rows<T, 1>(a, x, t * kTile, n0);
    }
  });
}
#endif

bool linear_supported(c10::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

void linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(linear_supported(x.scalar_type()), "linear: dtype not supported by this build");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "x [N, I], w [O, I], out [N, O]");
  TORCH_CHECK(x.size(0) <= kMaxRows && x.size(0) >= 1, "linear takes 1..16 rows of x");
  TORCH_CHECK(w.size(1) == x.size(1) && w.stride(1) == 1, "w must be [O, I], rows unit-stride");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "out must be [N, O]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "x, w and out must share a dtype");
  const void* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == w.size(0), "bias must be contiguous [O]");
    b = bias->data_ptr();
  }
#if defined(__AVX512F__)
  LinearArgs a{w.data_ptr(), w.stride(0), w.size(0), w.size(1), b, out.data_ptr(),
               out.stride(0), out.stride(1)};
#if defined(AEGAEON_AMX)
  if (x.scalar_type() == at::kBFloat16 && a.in % 32 == 0 && a.rows >= 16 && amx_usable()) {
    return run_amx(a, x);
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return run_linear<c10::BFloat16>(a, x);
#endif
  return run_linear<float>(a, x);
#endif
}

// ---- elementwise ops of a layer, one pass each (float32, bfloat16) ----------------
// They round where transformers rounds, so that a bfloat16 model gives the same
// bits up to the order of a float32 sum: RMSNorm normalises in float32, rounds,
// then multiplies by the weight in the dtype; silu(gate) is rounded before the
// multiply by up. In float32 every rounding is the identity.

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  int64_t c = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; c + 16 <= n; c += 16) acc = _mm512_fmadd_ps(load16(x + c), load16(x + c), acc);
  if (c < n) {
    const __m512 v = load16(x + c, static_cast<int>(n - c));
    acc = _mm512_fmadd_ps(v, v, acc);
    c = n;
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; c < n; ++c) ss += static_cast<float>(x[c]) * static_cast<float>(x[c]);
  return ss;
}

// out = T(x * rsqrt(mean(x^2) + eps)) (* w, rounded again) for one row of n.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float scale = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t c = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(scale);
  for (; c < n; c += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - c));
    __m512 y = round_to(x, _mm512_mul_ps(load16(x + c, m), sv));
    if (w) y = _mm512_mul_ps(y, load16(w + c, m));
    store16(out + c, y, m);
  }
#endif
  for (; c < n; ++c) {
    const T y = T(static_cast<float>(x[c]) * scale);
    out[c] = w ? T(static_cast<float>(y) * static_cast<float>(w[c])) : y;
  }
}

void rms_norm(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& w,
              double eps) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes(), "x and out must be [N, H]");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "rows must be unit-stride");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "x and out must share a dtype");
  TORCH_CHECK(!w.has_value() || (w->scalar_type() == x.scalar_type() && w->is_contiguous() &&
                                 w->numel() == x.size(1)), "w must be contiguous [H]");
  const int64_t rows = x.size(0), n = x.size(1);
  auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = w.has_value() ? static_cast<const T*>(w->data_ptr()) : nullptr;
    T* op = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        rms_norm_row(xp + r * x.stride(0), wp, op + r * out.stride(0), n,
                     static_cast<float>(eps));
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: return go(static_cast<float*>(nullptr));
    case at::kBFloat16: return go(static_cast<c10::BFloat16*>(nullptr));
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// out [N, F] = T(silu(gate)) * up with gate_up [N, 2F] = [gate | up].
void silu_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && out.dim() == 2 && gate_up.size(1) == 2 * out.size(1) &&
                  gate_up.size(0) == out.size(0), "gate_up [N, 2F], out [N, F]");
  TORCH_CHECK(gate_up.stride(1) == 1 && out.stride(1) == 1, "rows must be unit-stride");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "gate_up and out must share a dtype");
  const int64_t rows = out.size(0), n = out.size(1);
  auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* g = static_cast<const T*>(gate_up.data_ptr()) + r * gate_up.stride(0);
        const T* u = g + n;
        T* o = static_cast<T*>(out.data_ptr()) + r * out.stride(0);
        int64_t c = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.f);
        for (; c < n; c += 16) {
          const int m = static_cast<int>(std::min<int64_t>(16, n - c));
          const __m512 gv = load16(g + c, m);
          const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
          const __m512 s = round_to(g, _mm512_div_ps(gv, _mm512_add_ps(one, exp16(neg))));
          store16(o + c, _mm512_mul_ps(s, load16(u + c, m)), m);
        }
#endif
        for (; c < n; ++c) {
          const float gf = static_cast<float>(g[c]);
          const T s = T(gf / (1.f + std::exp(-gf)));
          o[c] = T(static_cast<float>(s) * static_cast<float>(u[c]));
        }
      }
    });
  };
  switch (out.scalar_type()) {
    case at::kFloat: return go(static_cast<float*>(nullptr));
    case at::kBFloat16: return go(static_cast<c10::BFloat16*>(nullptr));
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aegaeon, m) {
  m.def("linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
  m.def("linear_supported(ScalarType dtype) -> bool", linear_supported);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor? w, float eps) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(aegaeon, CPU, m) {
  m.impl("linear", linear);
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
}
