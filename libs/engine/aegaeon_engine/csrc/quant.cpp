// GGUF block-quantized weights (q8_0, q4_0, q4_1) read as such: a decode step's
// projection unpacks each block's codes in registers (torch.ops.<ns>.qlinear);
// prefill dequantizes a block of rows to float32 for torch's GEMM
// (torch.ops.<ns>.qdequant). <ns> = aegaeon_<level>, see native.py.
//
// Formats (GGML's, block of 32 elements; aegaeon_common.dtypes.QUANT_BLOCKS):
//   q8_0 (type 8): f16 d, int8 q[32]         w[j] = d * q[j]
//   q4_0 (type 2): f16 d, uint8 qs[16]        w[j] = d * (nib[j] - 8)
//   q4_1 (type 3): f16 d, f16 m, uint8 qs[16] w[j] = d * nib[j] + m
// with nib[j] = qs[j] & 15 and nib[j + 16] = qs[j] >> 4 (j < 16).
//
// Why: a decode step streams every weight once; a q4 block is 20 bytes for 32
// weights where bfloat16 takes 64, so a step reads about a third of the bytes. But
// widening 4-bit codes to float32 costs ~35 instructions per block and row (more
// than the bfloat16 kernel's whole work on the same weights, docs/results.md), so
// decode multiplies integers as llama.cpp does:
// x is quantized per block to int8 (Q8 activations, `quantize_x`), a block's dot
// product is exact in int32 (maddubs + madd), then scaled by d_w * d_x in float32;
// the offset term m_w * d_x * sum(q_x) is added apart. Two 4-bit blocks go at a
// time: one 32-byte register of codes, x's codes laid out to match (~10
// instructions per block and row).
// The result is x_q8 @ dequant(w)^T up to float32 rounding (quant.py's reference).
//
// Prefill dequantizes: the weights rounded once, as the reference (quant.py) does
// for q8_0 and q4_0 (d * q - 8 d is one rounding of the exact d (q - 8)), q4_1 as
// one fused d * q + m (within one rounding of d * q + m).
//
// Algorithm (AVX2: the avx2, avx512 and amx levels): output rows in tiles of
// kTile (the parallel unit); on a tile, x rows in chunks of NB = 8, 4, 2, 1
// against R = 1, 2, 2, 4 weight rows at a time: a block's codes are unpacked
// once per chunk and feed NB rows of x, the tile's rows stay in cache between
// chunks. Other levels (NEON) run the same integer arithmetic one element at a time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if !defined(AEGAEON_OPS)
#define AEGAEON_OPS aegaeon
#endif
#define AEGAEON_QUANT_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define AEGAEON_QUANT_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {

constexpr int kQ8_0 = 8, kQ4_0 = 2, kQ4_1 = 3;  // GGML's type numbers
constexpr int kBlock = 32;
constexpr int kMaxRows = 16;  // x rows qlinear takes (decode batches)
constexpr int64_t kTile = 16;  // weight rows per parallel task
constexpr int kPrefetch = 1024;  // bytes ahead in a weight row (as dense.cpp)
constexpr int kStrips = 4;  // one x row: strips of the weight read side by side
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kPairedX = true;  // 4-bit blocks are read two at a time (AVX2 `pairs`)
#else
constexpr bool kPairedX = false;
#endif

inline int block_bytes(int qtype) {
  switch (qtype) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    default: TORCH_CHECK(false, "unknown quantization type ", qtype);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The 32 weights of one block as float32, element order (scalar: every level).
template <int QT>
inline void dequant_scalar(const uint8_t* blk, float* w) {
  const float d = half_at(blk);
  if constexpr (QT == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < kBlock; ++j) w[j] = d * static_cast<float>(q[j]);
  } else if constexpr (QT == kQ4_0) {
    const uint8_t* qs = blk + 2;
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((qs[j] & 15) - 8);
      w[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  } else {
    const float m = half_at(blk + 2);
    const uint8_t* qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
      w[j] = std::fma(d, static_cast<float>(qs[j] & 15), m);
      w[j + 16] = std::fma(d, static_cast<float>(qs[j] >> 4), m);
    }
  }
}

// x rows quantized per block of 32 as llama.cpp's Q8 activations: d = max|x| / 127,
// q = round-to-nearest-even(x * (1 / d)) in int8 (0 where d is 0), and s = d * sum(q)
// for the weights' offset term (q4_1's m; q4_0's -8 d). quant.py's quantize_x is the
// same arithmetic in torch (the tests' reference).
struct XQ {
  std::vector<int8_t> q;  // [N, I], in the order the weight type reads (`quantize_x`)
  std::vector<float> d, s;  // [N, I / 32]
  std::vector<float> pair;  // [N, I / 64, 4]: d0, s0', d1, s1' of each pair of blocks
};

// The int8 codes of x in the order a block pair of 4-bit weights reads them (`pairs`,
// below): per pair, the first 16 elements of both blocks, then their last 16; a last
// odd block as it is. s' is s (q4_1's offset m multiplies it) or -8 s (q4_0's).
template <typename T>
const XQ& quantize_x(const at::Tensor& x_in, int qtype) {
  const int64_t num = x_in.size(0), in = x_in.size(1), nb = in / kBlock, np = nb / 2;
  const int64_t sn = x_in.stride(0), si = x_in.stride(1);
  const T* x = static_cast<const T*>(x_in.data_ptr());
  const bool paired = kPairedX && qtype != kQ8_0;
  thread_local XQ xq;
  xq.q.resize(static_cast<size_t>(num * in));
  xq.d.resize(static_cast<size_t>(num * nb));
  xq.s.resize(static_cast<size_t>(num * nb));
  xq.pair.resize(static_cast<size_t>(num * np * 4));
  float v[kBlock];
  for (int64_t n = 0; n < num; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) {
        v[j] = static_cast<float>(x[n * sn + (b * kBlock + j) * si]);
        amax = std::max(amax, std::fabs(v[j]));
      }
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* row = xq.q.data() + n * in;
      for (int j = 0; j < kBlock; ++j) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(v[j] * id));
        sum += q;
        int64_t at = b * kBlock + j;
        if (paired && b / 2 < np) at = b / 2 * 64 + (j / 16) * 32 + (b % 2) * 16 + j % 16;
        row[at] = q;
      }
      const float s = d * static_cast<float>(sum);
      xq.d[n * nb + b] = d;
      xq.s[n * nb + b] = s;
      if (paired && b / 2 < np) {
        float* p = xq.pair.data() + (n * np + b / 2) * 4 + (b % 2) * 2;
        p[0] = d;
        p[1] = qtype == kQ4_0 ? -8.f * s : s;
      }
    }
  }
  return xq;
}

struct QArgs {
  const uint8_t* w;
  int64_t w_stride, rows, in, nblocks;
  const void* bias;  // [rows] in out's dtype, or null
  void* out;
  int64_t out_stride_n, out_stride_o;
};

// A weight block's scale d and offset m (w = d * code + m; q8_0: codes signed, m = 0).
template <int QT>
inline void block_scales(const uint8_t* blk, float& d, float& m) {
  d = half_at(blk);
  m = QT == kQ4_1 ? half_at(blk + 2) : QT == kQ4_0 ? -8.f * d : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Decode: the codes unpacked in registers (4-bit: both nibbles as 32 unsigned bytes
// in element order; q8_0: as they are), multiplied by x's int8 codes with
// maddubs (exact int16 pair sums: 15 * 127 * 2 and 128 * 127 * 2 fit), summed to
// int32 with madd, then scaled by d_w * d_x into a float32 accumulator (exact
// until that conversion and scale); m_w * s_x is summed apart.
template <int QT>
inline __m256i codes(const uint8_t* blk) {
  if constexpr (QT == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == kQ4_1 ? 4 : 2)));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
  }
}

template <int QT>
inline __m256 dot_block(__m256i wc, const int8_t* xq) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  __m256i pairs;
  if constexpr (QT == kQ8_0) {  // |w| unsigned, x with w's sign
    pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wc, wc), _mm256_sign_epi8(xv, wc));
  } else {
    pairs = _mm256_maddubs_epi16(wc, xv);
  }
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Two 4-bit blocks: their codes (lo: the first 16 of each block, hi: the last 16,
// 128-bit lane k holding block k) and their scales (d0, m0, d1, m1; q4_0: d0, d0, d1,
// d1, whose offset -8 d x's pair vector carries as -8 s).
template <int QT>
inline __m128 pair_codes(const uint8_t* blk, __m256i& lo, __m256i& hi) {
  constexpr int bb = QT == kQ4_0 ? 18 : 20, at = QT == kQ4_1 ? 4 : 2;
  const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + at));
  const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + bb + at));
  const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(c0), c1, 1);
  const __m256i mask = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(raw, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  int32_t w0, w1;
  std::memcpy(&w0, blk, 4);
  std::memcpy(&w1, blk + bb, 4);
  __m128i h = _mm_insert_epi32(_mm_cvtsi32_si128(w0), w1, 1);  // halves d0 m0 d1 m1
  if constexpr (QT == kQ4_0) h = _mm_shufflelo_epi16(h, 0xA0);  // d0 d0 d1 d1
  return _mm_cvtph_ps(h);
}

// The 8 int32 partial sums (lanes 0-3 block 0, 4-7 block 1) of two 4-bit blocks' codes
// with x's (laid out by `quantize_x`): two maddubs (each pair sum <= 2 * 15 * 127), one
// int16 add (<= 4 * 15 * 127), one madd.
inline __m256 pair_dot(__m256i lo, __m256i hi, const int8_t* xc) {
  const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc));
  const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32));
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Rows os[0 .. R) against x rows n0 .. n0 + NB; results + bias written to out as T.
// Each row is prefetched kPrefetch bytes ahead.
template <typename T, int QT, int R, int NB>
inline void rows_block(const QArgs& a, const XQ& xq, const int64_t* os, int64_t n0) {
  constexpr int bb = QT == kQ8_0 ? 34 : QT == kQ4_0 ? 18 : 20;
  __m256 acc[R][NB];
  float off[R][NB] = {};
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_setzero_ps();
  const uint8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = a.w + os[r] * a.w_stride;
  const int64_t nb = a.nblocks;
  const int8_t* xqs = xq.q.data();
  const float* xds = xq.d.data();
  const float* xss = xq.s.data();
  int64_t b = 0;
  if constexpr (QT != kQ8_0) {  // two blocks at a time (`pairs`), then an odd last one
    const int64_t np = nb / 2;
    __m128 offv[R][NB];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NB; ++n) offv[r][n] = _mm_setzero_ps();
    for (int64_t p = 0; p < np; ++p) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = wr[r] + 2 * p * bb;
        __builtin_prefetch(blk + kPrefetch);
        __m256i lo, hi;
        const __m128 scales = pair_codes<QT>(blk, lo, hi);
        for (int n = 0; n < NB; ++n) {
          const int64_t xp = (n0 + n) * np + p;
          const __m128 prod = _mm_mul_ps(scales, _mm_loadu_ps(xq.pair.data() + xp * 4));
          offv[r][n] = _mm_add_ps(offv[r][n], prod);
          const int8_t* xc = xqs + (n0 + n) * a.in + p * 64;
          const __m256 sums = pair_dot(lo, hi, xc);
          const __m256 scale8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(prod),
                                                        _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
          acc[r][n] = _mm256_fmadd_ps(scale8, sums, acc[r][n]);
        }
      }
    }
    for (int r = 0; r < R; ++r)  // the offset terms sit in lanes 1 and 3
      for (int n = 0; n < NB; ++n) {
        alignas(16) float o4[4];
        _mm_store_ps(o4, offv[r][n]);
        off[r][n] = o4[1] + o4[3];
      }
    b = 2 * np;
  }
  for (; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = wr[r] + b * bb;
      __builtin_prefetch(blk + kPrefetch);
      float d, m;
      block_scales<QT>(blk, d, m);
      const __m256i wc = codes<QT>(blk);
      for (int n = 0; n < NB; ++n) {
        const int64_t xb = (n0 + n) * nb + b;
        const __m256 prod = dot_block<QT>(wc, xqs + xb * kBlock);
        acc[r][n] = _mm256_fmadd_ps(_mm256_set1_ps(d * xds[xb]), prod, acc[r][n]);
        if constexpr (QT != kQ8_0) off[r][n] = std::fma(m, xss[xb], off[r][n]);
      }
    }
  }
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < R; ++r) {
    const float bv = bias ? static_cast<float>(bias[os[r]]) : 0.f;
    for (int n = 0; n < NB; ++n) {
      out[(n0 + n) * a.out_stride_n + os[r] * a.out_stride_o] = T(hsum(acc[r][n]) + off[r][n] + bv);
    }
  }
}

// Rows [o0, o1) against x rows n0 .. n0 + NB: R consecutive ones at a time, then one.
template <typename T, int QT, int R, int NB>
inline void rows_range(const QArgs& a, const XQ& xq, int64_t o0, int64_t o1, int64_t n0) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    int64_t os[R];
    for (int r = 0; r < R; ++r) os[r] = o + r;
    rows_block<T, QT, R, NB>(a, xq, os, n0);
  }
  for (; o < o1; ++o) rows_block<T, QT, 1, NB>(a, xq, &o, n0);
}

// One x row: rows [p0, p1) as kStrips strips read side by side (one row of each at a
// time), each a sequential stream: one core keeps more lines in flight on several
// streams than on one (dense.cpp, docs/results.md issue 28); then the rows left.
template <typename T, int QT>
void strips(const QArgs& a, const XQ& xq, int64_t p0, int64_t p1) {
  const int64_t len = (p1 - p0) / kStrips;
  for (int64_t j = 0; j < len; ++j) {
    int64_t os[kStrips];
    for (int r = 0; r < kStrips; ++r) os[r] = p0 + r * len + j;
    rows_block<T, QT, kStrips, 1>(a, xq, os, 0);
  }
  for (int64_t o = p0 + kStrips * len; o < p1; ++o) rows_block<T, QT, 1, 1>(a, xq, &o, 0);
}

template <typename T, int QT>
void run_qlinear(const QArgs& a, const XQ& xq, int64_t num) {
  at::parallel_for(0, (a.rows + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
    if (num == 1) return strips<T, QT>(a, xq, begin * kTile, std::min(end * kTile, a.rows));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o0 = t * kTile, o1 = std::min(o0 + kTile, a.rows);
      int64_t n0 = 0;
      for (; n0 + 8 <= num; n0 += 8) rows_range<T, QT, 1, 8>(a, xq, o0, o1, n0);
      if (n0 + 4 <= num) { rows_range<T, QT, 2, 4>(a, xq, o0, o1, n0); n0 += 4; }
      if (n0 + 2 <= num) { rows_range<T, QT, 2, 2>(a, xq, o0, o1, n0); n0 += 2; }
      if (n0 < num) rows_range<T, QT, 4, 1>(a, xq, o0, o1, n0);
    }
  });
}

// Prefill: one block's 32 weights as float32 (element order).
template <int QT>
inline void dequant(const uint8_t* blk, float* w) {
  float d, m;
  block_scales<QT>(blk, d, m);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m256i wc = codes<QT>(blk);
  const __m128i lo = _mm256_castsi256_si128(wc), hi = _mm256_extracti128_si256(wc, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k) {
    const __m256i ints = QT == kQ8_0 ? _mm256_cvtepi8_epi32(parts[k]) : _mm256_cvtepu8_epi32(parts[k]);
    const __m256 q = _mm256_cvtepi32_ps(ints);
    // q8_0: d * q (m = 0 adds nothing); q4_0: d * q - 8 d, one rounding of d (q - 8)
    _mm256_storeu_ps(w + 8 * k, QT == kQ8_0 ? _mm256_mul_ps(q, vd) : _mm256_fmadd_ps(q, vd, vm));
  }
}
#else
// Other levels (NEON): the same integer arithmetic, one element at a time.
template <typename T, int QT>
void run_qlinear(const QArgs& a, const XQ& xq, int64_t num) {
  constexpr int bb = QT == kQ8_0 ? 34 : QT == kQ4_0 ? 18 : 20;
  const int64_t nb = a.nblocks;
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out);
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t n = 0; n < num; ++n) {
        float acc = 0.f, off = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = a.w + o * a.w_stride + b * bb;
          float d, m;
          block_scales<QT>(blk, d, m);
          const int8_t* xv = xq.q.data() + (n * nb + b) * kBlock;
          int32_t isum = 0;
          for (int j = 0; j < kBlock; ++j) {
            int code;
            if constexpr (QT == kQ8_0) {
              code = reinterpret_cast<const int8_t*>(blk + 2)[j];
            } else {
              const uint8_t byte = blk[(QT == kQ4_1 ? 4 : 2) + (j & 15)];
              code = j < 16 ? (byte & 15) : (byte >> 4);
            }
            isum += code * xv[j];
          }
          acc = std::fma(d * xq.d[n * nb + b], static_cast<float>(isum), acc);
          off = std::fma(m, xq.s[n * nb + b], off);
        }
        out[n * a.out_stride_n + o * a.out_stride_o] = T(acc + off + (bias ? static_cast<float>(bias[o]) : 0.f));
      }
    }
  });
}

template <int QT>
inline void dequant(const uint8_t* blk, float* w) { dequant_scalar<QT>(blk, w); }
#endif

template <typename T, int QT>
void qlinear_typed(const QArgs& a, const at::Tensor& x) {
  run_qlinear<T, QT>(a, quantize_x<T>(x, QT), x.size(0));
}

void check_w(const at::Tensor& w, int64_t qtype, int64_t in) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1,
              "w must be uint8 [O, row_bytes], rows unit-stride");
  const int bb = block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(in % kBlock == 0 && w.size(1) == in / kBlock * bb,
              "w rows must hold ", in / kBlock, " blocks of ", bb, " bytes");
}

// out [N, O] = x [N, I] @ dequant(w)^T (+ bias), N <= 16; out, x, bias share a dtype.
void qlinear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "x [N, I], out [N, O]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "qlinear takes 1..16 rows of x");
  check_w(w, qtype, x.size(1));
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == w.size(0), "out must be [N, O]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and out must share a dtype, float32 or bfloat16");
  const void* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == w.size(0), "bias must be contiguous [O] in x's dtype");
    b = bias->data_ptr();
  }
  const QArgs a{w.data_ptr<uint8_t>(), w.stride(0), w.size(0), x.size(1), x.size(1) / kBlock,
                b, out.data_ptr(), out.stride(0), out.stride(1)};
  auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    switch (qtype) {
      case kQ8_0: return qlinear_typed<T, kQ8_0>(a, x);
      case kQ4_0: return qlinear_typed<T, kQ4_0>(a, x);
      default: return qlinear_typed<T, kQ4_1>(a, x);
    }
  };
  if (x.scalar_type() == at::kBFloat16) return go(static_cast<c10::BFloat16*>(nullptr));
  return go(static_cast<float*>(nullptr));
}

template <int QT>
void dequant_rows(const uint8_t* w, int64_t w_stride, float* out, int64_t out_stride,
                  int64_t rows, int64_t nblocks) {
  constexpr int bb = QT == kQ8_0 ? 34 : QT == kQ4_0 ? 18 : 20;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t b = 0; b < nblocks; ++b) dequant<QT>(w + o * w_stride + b * bb, out + o * out_stride + b * kBlock);
    }
  });
}

// out float32 [O, I] = the weights of w [O, row_bytes] (prefill: a block of rows at a time).
void qdequant(const at::Tensor& out, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == w.size(0), "out must be float32 [O, I], rows unit-stride");
  check_w(w, qtype, out.size(1));
  const int64_t nb = out.size(1) / kBlock;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (qtype) {
    case kQ8_0: return dequant_rows<kQ8_0>(wp, w.stride(0), op, out.stride(0), w.size(0), nb);
    case kQ4_0: return dequant_rows<kQ4_0>(wp, w.stride(0), op, out.stride(0), w.size(0), nb);
    default: return dequant_rows<kQ4_1>(wp, w.stride(0), op, out.stride(0), w.size(0), nb);
  }
}

}  // namespace

AEGAEON_QUANT_FRAGMENT(AEGAEON_OPS, m) {
  m.def("qlinear(Tensor(a!) out, Tensor x, Tensor w, int qtype, Tensor? bias) -> ()");
  m.def("qdequant(Tensor(a!) out, Tensor w, int qtype) -> ()");
}

AEGAEON_QUANT_IMPL(AEGAEON_OPS, CPU, m) {
  m.impl("qlinear", qlinear);
  m.impl("qdequant", qdequant);
}
