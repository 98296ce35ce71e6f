// Skinny matmul for decode: out[N, O] = x[N, I] @ w[O, I]^T (+ bias) for a few
// rows N (one per sequence of a decode step). Registered as torch.ops.<ns>.linear
// (<ns> = aegaeon_<level>, one namespace per ISA level, see native.py).
//
// Why: a decode step streams every weight once; at N <= 16 the work is bound
// by that stream, and oneDNN through torch.mm reaches ~10-15 GB/s here (with
// a fixed cost of ~50 us per call on small weights) while a plain loop over the
// weight rows reaches the memory's ~25 GB/s. The weight is read in place,
// row-major [O, I] as the checkpoint (and the engine's packed layout) stores
// it: nothing is prepacked, so the weights stay views of caller-owned bytes.
//
// Algorithm (every level): the rows of w are cut into tasks of kTaskRows (the
// parallel unit; one task for everything on one thread), and a task's rows into
// strips read side by side, each one sequential stream: one core keeps more lines
// in flight on several streams than on one (docs/results.md, issue 28). One x row (batch 1)
// takes a row of each of kStreams1 = 4 strips at a time. Several x rows go in
// blocks of NB (kBlockX: 4 in AVX2's 16 registers, 8 in AVX-512's and NEON's 32;
// then 4, 2, 1) against blocks of R = kStrips = 3 rows, one per strip, in tiles of
// kStripTile rows per strip (every x block over a tile while its rows are in
// cache), so that R * NB accumulators hold partial dot products of every (row, x
// row) pair while the inner loop walks I, each widened weight register feeding NB
// FMAs; they are summed lane-wise with transposes (simd.h sum_lanes). Every row is
// prefetched kPrefetch bytes ahead, a cache line at a time. Arithmetic is float32:
// x is packed once per call as float32, and a bfloat16 weight is widened in
// registers, 2 * kLanes elements per load split into even and odd elements (a
// shift and a mask, no shuffle), x packed in that order. The two halves go one
// after the other, so only R weight registers are live beside the accumulators and
// one of x (AVX2: 12 + 3 + 1 = 16; two live halves would leave room for 8
// accumulators, too few chains to keep both FMA ports busy at FMA latency 4). A
// ragged end of I is read through zeroed buffers. AVX2's bfloat16 blocks of 3 x 4
// run in assembly over whole cache lines of the rows (dots_bf16_3x4: GCC kept one of
// the 12 accumulators on the stack), x is packed from a cache line's start, and the
// results are rounded to bfloat16 in registers (issue 28: b8 on AMD Zen 3).
//
// Specialisations on the amx level (bfloat16 only): AMX tiles (I % 32 == 0,
// O >= 16), else vdpbf16ps on bfloat16 x (32 exact products per instruction).
// `linear_supported` tells Python which dtypes this build can run.

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

#if !defined(AEGAEON_OPS)
#define AEGAEON_OPS aegaeon
#endif
// TORCH_LIBRARY stringifies its argument: expand AEGAEON_OPS first
#define AEGAEON_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define AEGAEON_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AEGAEON_AMX 1
#endif

namespace {

constexpr int kTile = 16;   // output rows per parallel task of the amx level
constexpr int kMaxRows = 16;  // x rows the kernel takes (decode batches)
constexpr int kPrefetch = 1024;  // bytes ahead in a weight row (farther ran slower)

#if defined(AEGAEON_SIMD)
using namespace aegaeon_simd;

// Strips read side by side (see the top): kStreams1 for one x row, kStrips for
// several, whose blocks of kBlockX x rows against kStrips w rows hold 12 + 3 + 1
// registers on AVX2, 24 + 3 + 1 on AVX-512 and NEON.
constexpr int kStreams1 = 4;
constexpr int kBlockX = kRegs >= 32 ? 8 : 4;
constexpr int kStrips = 3;
// positions of the strips per tile (all x blocks): 1, the rows' second pass from L1
// and their prefetches into the next rows (8 measured no faster on AMD Zen 3)
constexpr int64_t kStripTile = 1;
constexpr int64_t kTaskRows = 24;  // w rows per parallel task, at least 4 of them (grain)

struct LinearArgs {
  const void* w;
  int64_t w_stride, rows, in;
  const void* bias;  // [rows] or null
  void* out;
  int64_t out_stride_n, out_stride_o;
};

// How a weight of dtype T is widened: kStep elements of a row per step, as kVecs
// float32 registers; element i of a step lands in lane slot(i) of those registers
// (x is packed in the same order).
template <typename T>
struct Widen;

// part<k>(p): register k of load(p) alone.
template <>
struct Widen<float> {
  static constexpr int kStep = kLanes, kVecs = 1;
  static void load(const float* p, VF* out) { out[0] = vload(p); }
  template <int k>
  static VF part(const float* p) { return vload(p); }
  static int slot(int i) { return i; }
};

template <>
struct Widen<c10::BFloat16> {
  static constexpr int kStep = 2 * kLanes, kVecs = 2;
  static void load(const c10::BFloat16* p, VF* out) { vload_bf16_pairs(p, out[0], out[1]); }
  template <int k>
  static VF part(const c10::BFloat16* p) { return k == 0 ? vload_bf16_even(p) : vload_bf16_odd(p); }
  static int slot(int i) { return (i & 1) * kLanes + i / 2; }  // even elements, then odd
};

// x [N, I] (any strides) as float32 [N, I'] in Widen's order, I' = I rounded up
// to whole steps, zero-padded; a per-thread buffer (no allocation per call), from a
// cache line's start: a load split across two lines costs two (AVX2 on AMD Zen 3:
// the blocks of several x rows ran ~1.3x faster aligned).
template <typename T>
const float* pack_x(const at::Tensor& x_in, int64_t in_padded) {
  using W = Widen<T>;
  const int64_t num = x_in.size(0), in = x_in.size(1);
  const int64_t sn = x_in.stride(0), si = x_in.stride(1);
  const T* x = static_cast<const T*>(x_in.data_ptr());
  thread_local std::vector<float> buffer;
  constexpr int64_t kLineFloats = 64 / sizeof(float);
  buffer.resize(num * in_padded + kLineFloats);
  const uintptr_t skip = (-reinterpret_cast<uintptr_t>(buffer.data()) & 63) / sizeof(float);
  float* packed = buffer.data() + skip;
  for (int64_t n = 0; n < num; ++n) {
    float* dst = packed + n * in_padded;
    const T* row = x + n * sn;
    int64_t c = 0;
    if (si == 1) {  // whole steps widened as the weight's are: Widen's order for free
      for (; c + W::kStep <= in; c += W::kStep) {
        VF v[W::kVecs];
        W::load(row + c, v);
        for (int k = 0; k < W::kVecs; ++k) vstore(dst + c + k * kLanes, v[k]);
      }
    }
    std::fill(dst + c, dst + in_padded, 0.f);
    for (int64_t i = c; i < in; ++i) {
      dst[i / W::kStep * W::kStep + W::slot(static_cast<int>(i % W::kStep))] =
          static_cast<float>(row[i * si]);
    }
  }
  return packed;
}

#if defined(AEGAEON_SIMD_AVX2) && defined(__x86_64__)
// AVX2, bfloat16, 3 w rows x 4 x rows (the blocks of several x rows): dots' loop in
// assembly, so that its 16 registers hold exactly what the blocking needs (12
// accumulators ymm0-11, 3 widened w ymm12-14, x ymm15; the odd elements' mask is a
// memory operand). GCC spilled an accumulator of the same loop to the stack (two,
// with the prefetches), a store and reload on that sum's chain every step. One
// iteration is a cache line of each row (2 steps of 16 elements), every lane summed
// in the order of the intrinsics' loop (the same bits as the other blocks and N = 1).
alignas(32) constexpr uint32_t kOddMask[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                              0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};

// One part (8 lanes of x at byte offset X) into the 12 accumulators.
#define AEGAEON_PART(X)                                               \
  "vmovups " X "(%[x0]), %%ymm15\n\t"                                 \
  "vfmadd231ps %%ymm15, %%ymm12, %%ymm0\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm13, %%ymm4\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm14, %%ymm8\n\t"                          \
  "vmovups " X "(%[x0],%[xs]), %%ymm15\n\t"                           \
  "vfmadd231ps %%ymm15, %%ymm12, %%ymm1\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm13, %%ymm5\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n\t"                          \
  "vmovups " X "(%[x2]), %%ymm15\n\t"                                 \
  "vfmadd231ps %%ymm15, %%ymm12, %%ymm2\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm13, %%ymm6\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm14, %%ymm10\n\t"                         \
  "vmovups " X "(%[x2],%[xs]), %%ymm15\n\t"                           \
  "vfmadd231ps %%ymm15, %%ymm12, %%ymm3\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm13, %%ymm7\n\t"                          \
  "vfmadd231ps %%ymm15, %%ymm14, %%ymm11\n\t"
// One step at byte offsets W (weights) and X, X2 (x): even elements, then odd.
#define AEGAEON_STEP(W, X, X2)                     \
  "vmovdqu " W "(%[w0]), %%ymm12\n\t"              \
  "vmovdqu " W "(%[w1]), %%ymm13\n\t"              \
  "vmovdqu " W "(%[w2]), %%ymm14\n\t"              \
  "vpslld $16, %%ymm12, %%ymm12\n\t"               \
  "vpslld $16, %%ymm13, %%ymm13\n\t"               \
  "vpslld $16, %%ymm14, %%ymm14\n\t"               \
  AEGAEON_PART(X)                                  \
  "vmovdqu " W "(%[w0]), %%ymm12\n\t"              \
  "vmovdqu " W "(%[w1]), %%ymm13\n\t"              \
  "vmovdqu " W "(%[w2]), %%ymm14\n\t"              \
  "vpand %[mask], %%ymm12, %%ymm12\n\t"            \
  "vpand %[mask], %%ymm13, %%ymm13\n\t"            \
  "vpand %[mask], %%ymm14, %%ymm14\n\t"            \
  AEGAEON_PART(X2)

// lines > 0 cache lines of each row from w0, w1, w2; x rows at x0 + n * xs bytes;
// acc receives the 12 accumulators (8 lanes each), in dots' order r * 4 + n.
inline void dots_bf16_3x4(const c10::BFloat16* w0, const c10::BFloat16* w1,
                          const c10::BFloat16* w2, const float* x0, int64_t xs, int64_t lines,
                          float* acc) {
  const float* x2 = x0 + 2 * (xs / 4);
  __asm__ volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "1:\n\t"
      "prefetcht0 1024(%[w0])\n\t"
      "prefetcht0 1024(%[w1])\n\t"
      "prefetcht0 1024(%[w2])\n\t"
      AEGAEON_STEP("0", "0", "32")
      AEGAEON_STEP("32", "64", "96")
      "addq $64, %[w0]\n\t"
      "addq $64, %[w1]\n\t"
      "addq $64, %[w2]\n\t"
      "addq $128, %[x0]\n\t"
      "addq $128, %[x2]\n\t"
      "decq %[lines]\n\t"
      "jnz 1b\n\t"
      "vmovups %%ymm0, 0(%[acc])\n\t"
      "vmovups %%ymm1, 32(%[acc])\n\t"
      "vmovups %%ymm2, 64(%[acc])\n\t"
      "vmovups %%ymm3, 96(%[acc])\n\t"
      "vmovups %%ymm4, 128(%[acc])\n\t"
      "vmovups %%ymm5, 160(%[acc])\n\t"
      "vmovups %%ymm6, 192(%[acc])\n\t"
      "vmovups %%ymm7, 224(%[acc])\n\t"
      "vmovups %%ymm8, 256(%[acc])\n\t"
      "vmovups %%ymm9, 288(%[acc])\n\t"
      "vmovups %%ymm10, 320(%[acc])\n\t"
      "vmovups %%ymm11, 352(%[acc])\n\t"
      : [w0] "+r"(w0), [w1] "+r"(w1), [w2] "+r"(w2), [x0] "+r"(x0), [x2] "+r"(x2),
        [lines] "+r"(lines)
      : [xs] "r"(xs), [acc] "r"(acc), [mask] "m"(kOddMask)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
        "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
#undef AEGAEON_STEP
#undef AEGAEON_PART
#endif

// The R * NB dot products of w rows wr[0 .. R) with x rows xr, xr + in_padded, ..
// (NB of them, packed) into res[r * NB + n]. A step's kVecs parts go one at a time:
// R registers of widened w, one of x, R * NB accumulators (kFetch: and the lines
// kPrefetch bytes past each row's, one per cache line of it).
template <typename T, int R, int NB, bool kFetch>
inline void dots(const T* const* wr, int64_t in, const float* xr, int64_t in_padded, float* res) {
#if defined(AEGAEON_SIMD_AVX2) && defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && R == 3 && NB == 4 && kFetch) {
    if (in > 0 && in % 32 == 0) {  // whole cache lines: all in assembly
      alignas(32) float sums[16 * kLanes];
      dots_bf16_3x4(wr[0], wr[1], wr[2], xr, in_padded * 4, in / 32, sums);
      VF v[16];
      for (int i = 0; i < 16; ++i) v[i] = i < R * NB ? vload(sums + i * kLanes) : vzero();
      vstore(res, transpose_sum(v));
      vstore(res + kLanes, transpose_sum(v + kLanes));
      return;
    }
  }
#endif
  using W = Widen<T>;
  VF acc[R * NB];
  for (VF& v : acc) v = vzero();
  int64_t c = 0;
  auto part = [&](auto k_, const T* const* rows, int64_t c) {
    constexpr int k = decltype(k_)::value;
    VF wv[R];
    for (int r = 0; r < R; ++r) wv[r] = W::template part<k>(rows[r] + c);
    for (int n = 0; n < NB; ++n) {
      const VF xv = vload(xr + n * in_padded + c + k * kLanes);
      for (int r = 0; r < R; ++r) acc[r * NB + n] = vfmadd(wv[r], xv, acc[r * NB + n]);
    }
  };
  auto step = [&](const T* const* rows, int64_t c) {
    part(std::integral_constant<int, 0>{}, rows, c);
    if constexpr (W::kVecs == 2) part(std::integral_constant<int, 1>{}, rows, c);
  };
  constexpr int kLine = std::max<int>(1, 64 / static_cast<int>(W::kStep * sizeof(T)));  // steps
  for (; c + kLine * W::kStep <= in; c += kLine * W::kStep) {
    if constexpr (kFetch) {
      for (int r = 0; r < R; ++r) __builtin_prefetch(reinterpret_cast<const char*>(wr[r] + c) + kPrefetch);
    }
    for (int j = 0; j < kLine; ++j) step(wr, c + j * W::kStep);
  }
  for (; c + W::kStep <= in; c += W::kStep) step(wr, c);
  if (c < in) {  // the ragged end through zeroed buffers (x is zero-padded there)
    T buf[R][W::kStep] = {};
    const T* rows[R];
    for (int r = 0; r < R; ++r) {
      std::memcpy(buf[r], wr[r] + c, static_cast<size_t>(in - c) * sizeof(T));
      rows[r] = buf[r] - c;
    }
    step(rows, c);
  }
  sum_lanes<R * NB>(acc, res);
}

// v as T, v already representable (rounded): bfloat16 takes its high half, no rounding.
template <typename T>
inline T exact(float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
  } else {
    return v;
  }
}

// x rows n0 .. n0 + NB against the R rows p0 + r * len + j (r < R) for positions j
// in [j0, j1): one row of each strip per block.
template <typename T, int R, int NB>
void pass_strips(const LinearArgs& a, const float* x, int64_t in_padded, int64_t p0, int64_t len,
                 int64_t j0, int64_t j1, int64_t n0) {
  const T* w = static_cast<const T*>(a.w);
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  for (int64_t j = j0; j < j1; ++j) {
    const T* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (p0 + r * len + j) * a.w_stride;
    constexpr int kPadded = (R * NB + kLanes - 1) / kLanes * kLanes;
    alignas(64) float res[kPadded];
    dots<T, R, NB, true>(wr, a.in, x + n0 * in_padded, in_padded, res);
    if (bias) {
      for (int r = 0; r < R; ++r) {
        const float b = static_cast<float>(bias[p0 + r * len + j]);
        for (int n = 0; n < NB; ++n) res[r * NB + n] += b;
      }
    }
    if constexpr (std::is_same_v<T, c10::BFloat16>) {  // rounded in registers as T(float) rounds
      for (int i = 0; i < kPadded; i += kLanes) vstore(res + i, vround_bf16(vload(res + i)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t o = p0 + r * len + j;
      for (int n = 0; n < NB; ++n) out[(n0 + n) * a.out_stride_n + o * a.out_stride_o] = exact<T>(res[r * NB + n]);
    }
  }
}

// x rows [0, num) in blocks of NB = kBlockX, then 4, 2, 1, against R strips' positions [j0, j1).
template <typename T, int R>
void passes(const LinearArgs& a, const float* x, int64_t in_padded, int64_t num, int64_t p0,
            int64_t len, int64_t j0, int64_t j1) {
  int64_t n0 = 0;
  for (; n0 + kBlockX <= num; n0 += kBlockX) pass_strips<T, R, kBlockX>(a, x, in_padded, p0, len, j0, j1, n0);
  if (kBlockX > 4 && n0 + 4 <= num) { pass_strips<T, R, 4>(a, x, in_padded, p0, len, j0, j1, n0); n0 += 4; }
  if (n0 + 2 <= num) { pass_strips<T, R, 2>(a, x, in_padded, p0, len, j0, j1, n0); n0 += 2; }
  if (n0 < num) pass_strips<T, R, 1>(a, x, in_padded, p0, len, j0, j1, n0);
}

// Rows [p0, p1) as R strips of len = (p1 - p0) / R rows, in tiles of `tile` positions
// (every x block over a tile, whose rows stay in cache), then the < R rows left.
template <typename T, int R>
void strips(const LinearArgs& a, const float* x, int64_t in_padded, int64_t num, int64_t p0,
            int64_t p1, int64_t tile) {
  const int64_t len = (p1 - p0) / R;
  for (int64_t j0 = 0; j0 < len; j0 += tile) {
    passes<T, R>(a, x, in_padded, num, p0, len, j0, std::min(j0 + tile, len));
  }
  passes<T, 1>(a, x, in_padded, num, p0 + R * len, 1, 0, p1 - p0 - R * len);
}

template <typename T>
void run_linear(const LinearArgs& a, const at::Tensor& x_in) {
  constexpr int kStep = Widen<T>::kStep;
  const int64_t num = x_in.size(0), in_padded = (a.in + kStep - 1) / kStep * kStep;
  const float* x = pack_x<T>(x_in, in_padded);  // this thread's buffer, not a worker's
  at::parallel_for(0, (a.rows + kTaskRows - 1) / kTaskRows, 4, [&](int64_t begin, int64_t end) {
    const int64_t p0 = begin * kTaskRows, p1 = std::min(end * kTaskRows, a.rows);
    if (num == 1) {
      strips<T, kStreams1>(a, x, in_padded, num, p0, p1, p1 - p0);
    } else {
      strips<T, kStrips>(a, x, in_padded, num, p0, p1, kStripTile);
    }
  });
}

#if defined(__AVX512BF16__)
// amx level: bfloat16 x kept as bfloat16, 32 exact products per vdpbf16ps.
template <int R, int NB>
inline __m512 dots_bf16(const LinearArgs& a, const c10::BFloat16* x, int64_t o0, int64_t n0) {
  static_assert(R * NB == 16, "16 accumulators");
  const auto* w = static_cast<const c10::BFloat16*>(a.w);
  const int64_t in = a.in;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const c10::BFloat16* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + std::min<int64_t>(o0 + r, a.rows - 1) * a.w_stride;
  const c10::BFloat16* xr = x + n0 * in;
  int64_t c = 0;
  for (; c + 32 <= in; c += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(wr[r] + c);
    for (int n = 0; n < NB; ++n) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + n * in + c);
      for (int r = 0; r < R; ++r) acc[r * NB + n] = _mm512_dpbf16_ps(acc[r * NB + n], wv[r], xv);
    }
  }
  if (c < in) {
    const auto mask = static_cast<__mmask32>((1ull << (in - c)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[r] + c);
    for (int n = 0; n < NB; ++n) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr + n * in + c);
      for (int r = 0; r < R; ++r) acc[r * NB + n] = _mm512_dpbf16_ps(acc[r * NB + n], wv[r], xv);
    }
  }
  return transpose_sum(acc);
}

template <int NB>
void tile_rows_bf16(const LinearArgs& a, const c10::BFloat16* x, int64_t o0, int64_t n0) {
  constexpr int R = 16 / NB;
  const auto* bias = static_cast<const c10::BFloat16*>(a.bias);
  auto* out = static_cast<c10::BFloat16*>(a.out);
  for (int64_t s = o0; s < std::min(o0 + kTile, a.rows); s += R) {
    alignas(64) float res[16];
    _mm512_store_ps(res, dots_bf16<R, NB>(a, x, s, n0));
    for (int r = 0; r < R && s + r < a.rows; ++r) {
      const float b = bias ? static_cast<float>(bias[s + r]) : 0.f;
      for (int n = 0; n < NB; ++n) {
        out[(n0 + n) * a.out_stride_n + (s + r) * a.out_stride_o] =
            c10::BFloat16(res[r * NB + n] + b);
      }
    }
  }
}

void run_linear_dpbf16(const LinearArgs& a, const at::Tensor& x_in) {
  // x packed as contiguous [N, I] in a per-thread buffer (no allocation per call)
  const int64_t num = x_in.size(0), in = a.in;
  thread_local std::vector<c10::BFloat16> packed;
  const auto* x = static_cast<const c10::BFloat16*>(x_in.data_ptr());
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
      for (; n0 + 8 <= num; n0 += 8) tile_rows_bf16<8>(a, x, t * kTile, n0);
      if (n0 + 4 <= num) { tile_rows_bf16<4>(a, x, t * kTile, n0); n0 += 4; }
      if (n0 + 2 <= num) { tile_rows_bf16<2>(a, x, t * kTile, n0); n0 += 2; }
      if (n0 < num) tile_rows_bf16<1>(a, x, t * kTile, n0);
    }
  });
}
#endif

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

#endif  // AEGAEON_SIMD

bool linear_supported(c10::ScalarType dtype) {
#if defined(AEGAEON_SIMD)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  (void)dtype;
  return false;
#endif
}

// Whether this build multiplies bfloat16 natively (AVX512-BF16 / AMX) rather than
// widening it to float32 (Python picks the prefill path by it).
bool bf16_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
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
#if defined(AEGAEON_SIMD)
  LinearArgs a{w.data_ptr(), w.stride(0), w.size(0), w.size(1), b, out.data_ptr(),
               out.stride(0), out.stride(1)};
  if (x.scalar_type() == at::kBFloat16) {
#if defined(AEGAEON_AMX)
    if (a.in % 32 == 0 && a.rows >= 16 && amx_usable()) return run_amx(a, x);
#endif
#if defined(__AVX512BF16__)
    return run_linear_dpbf16(a, x);
#else
    return run_linear<c10::BFloat16>(a, x);
#endif
  }
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
#if defined(AEGAEON_SIMD)
  F16 acc = zero16();
  for (; c + 16 <= n; c += 16) acc = fmadd16(load16(x + c), load16(x + c), acc);
  if (c < n) {
    const F16 v = load16(x + c, static_cast<int>(n - c));
    acc = fmadd16(v, v, acc);
    c = n;
  }
  ss = reduce_add16(acc);
#endif
  for (; c < n; ++c) ss += static_cast<float>(x[c]) * static_cast<float>(x[c]);
  return ss;
}

// out = T(x * rsqrt(mean(x^2) + eps)) (* w, rounded again) for one row of n.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float scale = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  int64_t c = 0;
#if defined(AEGAEON_SIMD)
  const F16 sv = set16(scale);
  for (; c + 16 <= n; c += 16) {
    F16 y = round_to(x, load16(x + c) * sv);
    if (w) y = y * load16(w + c);
    store16(out + c, y);
  }
  if (c < n) {
    const int m = static_cast<int>(n - c);
    F16 y = round_to(x, load16(x + c, m) * sv);
    if (w) y = y * load16(w + c, m);
    store16(out + c, y, m);
    c = n;
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

#if defined(AEGAEON_SIMD)
// T(silu(g)) * u of 16 lanes
template <typename T>
inline F16 silu_mul16(const T* tag, F16 g, F16 u) {
  const F16 s = round_to(tag, g / (set16(1.f) + exp16(zero16() - g)));
  return s * u;
}
#endif

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
#if defined(AEGAEON_SIMD)
        for (; c + 16 <= n; c += 16) store16(o + c, silu_mul16(g, load16(g + c), load16(u + c)));
        if (c < n) {
          const int m = static_cast<int>(n - c);
          store16(o + c, silu_mul16(g, load16(g + c, m), load16(u + c, m)), m);
          c = n;
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

AEGAEON_LIBRARY_FRAGMENT(AEGAEON_OPS, m) {
  m.def("linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
  m.def("linear_supported(ScalarType dtype) -> bool", linear_supported);
  m.def("bf16_native() -> bool", bf16_native);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor? w, float eps) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
}

AEGAEON_LIBRARY_IMPL(AEGAEON_OPS, CPU, m) {
  m.impl("linear", linear);
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
}
