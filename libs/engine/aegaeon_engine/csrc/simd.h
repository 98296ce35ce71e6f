// Vector helpers of the engine's kernels (attention.cpp, dense.cpp), one set per
// ISA level; which set compiles follows the build's target flags (native.py):
//
//   level   flags                                VF (one register)   F16 (16 float32 lanes)
//   avx512  -mavx512f/bw/vl/dq (+ avx2, fma)     __m512              1 x VF
//   amx     avx512 + -mavx512bf16 -mamx-*        __m512              1 x VF
//   avx2    -mavx2 -mfma -mf16c                  __m256              2 x VF
//   neon    aarch64 (NEON is baseline)           float32x4_t         4 x VF
//
// The kernels are written once against F16 (elementwise work, attention: the
// algorithm thinks in 16 lanes; on AVX2 and NEON each op is 2 or 4
// instructions) and VF (the decode projection, whose register blocking
// depends on the register count kRegs: accumulators of kLanes lanes).
// AVX512-BF16 / AMX specialisations stay in the kernels, under their macros.
//
// Everything here has internal linkage: the libraries of several levels are
// loaded into one process (tests, benches), and an inline function of one
// level must never be bound to another level's copy.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define AEGAEON_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AEGAEON_SIMD_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define AEGAEON_SIMD_NEON 1
#endif

#if defined(AEGAEON_SIMD_AVX512) || defined(AEGAEON_SIMD_AVX2) || defined(AEGAEON_SIMD_NEON)
#define AEGAEON_SIMD 1

namespace aegaeon_simd {
namespace {

// ---- VF: one native register of float32 -------------------------------------------------
// vfmadd(a, b, c) = a * b + c, fused. vload_bf16 widens kLanes bfloat16 (zero-extend,
// shift left 16: bfloat16 is the top half of a float32). vload_bf16_pairs reads
// 2 * kLanes bfloat16 as kLanes 32-bit words and splits them into the even elements
// (low halves, shifted up) and the odd ones (high halves, masked): no shuffle;
// vload_bf16_even / _odd give one of the two (one register instead of two live).
// bf16_bits(v): float32 -> bfloat16 rounding to nearest even as c10::BFloat16(float)
// (NaN -> quiet NaN), the result in the high half of each 32-bit lane.

#if defined(AEGAEON_SIMD_AVX512)
using VF = __m512;
using VI = __m512i;
constexpr int kLanes = 16;
constexpr int kRegs = 32;

inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vset1(float x) { return _mm512_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
inline VF vmin(VF a, VF b) { return _mm512_min_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vfnmadd(VF a, VF b, VF c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vround(VF x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline VF vscale2(VF y, VF n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
inline float vsum(VF v) { return _mm512_reduce_add_ps(v); }
inline float vmaxall(VF v) { return _mm512_reduce_max_ps(v); }
inline VF vkeep_first(VF v, int n) {
  return _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), v);
}
inline VF vload_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline VF vload_half(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vload_bf16_pairs(const c10::BFloat16* p, VF& even, VF& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline VF vload_bf16_even(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
inline VF vload_bf16_odd(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline VI bf16_bits(VF v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
}
inline VF vround_bf16(VF v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore_bf16(c10::BFloat16* p, VF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}

// Lane t of the result is the sum of the 16 lanes of v[t]: pairs are
// interleaved and added in four levels (45 instructions instead of 16 reductions).
inline VF transpose_sum(const VF v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: 2 partial sums of v[2i], v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of 4 vectors
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes (0+1, 2+3) of 4 vectors, then of the next 4
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

#elif defined(AEGAEON_SIMD_AVX2)
using VF = __m256;
using VI = __m256i;
constexpr int kLanes = 8;
constexpr int kRegs = 16;

inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vset1(float x) { return _mm256_set1_ps(x); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
inline VF vmin(VF a, VF b) { return _mm256_min_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vfnmadd(VF a, VF b, VF c) { return _mm256_fnmadd_ps(a, b, c); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vround(VF x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VF vscale2(VF y, VF n) {  // n integral in [-127, 127]: 2^n built in the exponent field
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline float vsum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmaxall(VF v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline VF vkeep_first(VF v, int n) {
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_and_ps(v, _mm256_castsi256_ps(keep));
}
inline VF vload_bf16(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline VF vload_half(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vload_bf16_pairs(const c10::BFloat16* p, VF& even, VF& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// A shift and a mask, as the pairs: a byte shuffle and a word blend (Intel's port 5,
// away from the FMAs') ran no faster on AMD Zen 3 and cost the projection's 16-register
// blocking a spilled accumulator (the blend's zero register).
inline VF vload_bf16_even(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
inline VF vload_bf16_odd(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                              _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline VI bf16_bits(VF v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
}
inline VF vround_bf16(VF v) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore_bf16(c10::BFloat16* p, VF v) {
  const __m256i h = _mm256_srli_epi32(bf16_bits(v), 16);  // <= 0xFFFF: packus keeps it
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// Lane t of the result is the sum of the 8 lanes of v[t].
inline VF transpose_sum(const VF v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..3 lo | v0..3 hi]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#elif defined(AEGAEON_SIMD_NEON)
using VF = float32x4_t;
using VI = uint32x4_t;
constexpr int kLanes = 4;
constexpr int kRegs = 32;

inline VF vzero() { return vdupq_n_f32(0.f); }
inline VF vset1(float x) { return vdupq_n_f32(x); }
inline VF vadd(VF a, VF b) { return vaddq_f32(a, b); }
inline VF vsub(VF a, VF b) { return vsubq_f32(a, b); }
inline VF vmul(VF a, VF b) { return vmulq_f32(a, b); }
inline VF vdiv(VF a, VF b) { return vdivq_f32(a, b); }
inline VF vmax(VF a, VF b) { return vmaxq_f32(a, b); }
inline VF vmin(VF a, VF b) { return vminq_f32(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return vfmaq_f32(c, a, b); }
inline VF vfnmadd(VF a, VF b, VF c) { return vfmsq_f32(c, a, b); }
inline VF vload(const float* p) { return vld1q_f32(p); }
inline void vstore(float* p, VF v) { vst1q_f32(p, v); }
inline VF vround(VF x) { return vrndnq_f32(x); }
inline VF vscale2(VF y, VF n) {
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(y, vreinterpretq_f32_s32(e));
}
inline float vsum(VF v) { return vaddvq_f32(v); }
inline float vmaxall(VF v) { return vmaxvq_f32(v); }
inline VF vkeep_first(VF v, int n) {
  static const uint32_t iota[4] = {0, 1, 2, 3};
  const uint32x4_t keep = vcltq_u32(vld1q_u32(iota), vdupq_n_u32(static_cast<uint32_t>(n)));
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(v), keep));
}
inline VF vload_bf16(const c10::BFloat16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline VF vload_half(const c10::Half* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline void vload_bf16_pairs(const c10::BFloat16* p, VF& even, VF& odd) {
  const uint32x4_t x = vld1q_u32(reinterpret_cast<const uint32_t*>(p));
  even = vreinterpretq_f32_u32(vshlq_n_u32(x, 16));
  odd = vreinterpretq_f32_u32(vandq_u32(x, vdupq_n_u32(0xFFFF0000u)));
}
inline VF vload_bf16_even(const c10::BFloat16* p) {
  return vreinterpretq_f32_u32(vshlq_n_u32(vld1q_u32(reinterpret_cast<const uint32_t*>(p)), 16));
}
inline VF vload_bf16_odd(const c10::BFloat16* p) {
  return vreinterpretq_f32_u32(
      vandq_u32(vld1q_u32(reinterpret_cast<const uint32_t*>(p)), vdupq_n_u32(0xFFFF0000u)));
}
inline VI bf16_bits(VF v) {
  const uint32x4_t x = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(x, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(x, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
  return vbslq_u32(vceqq_f32(v, v), r, vdupq_n_u32(0x7FC00000u));  // v != v: NaN
}
inline VF vround_bf16(VF v) {
  return vreinterpretq_f32_u32(vandq_u32(bf16_bits(v), vdupq_n_u32(0xFFFF0000u)));
}
inline void vstore_bf16(c10::BFloat16* p, VF v) {
  vst1_u16(reinterpret_cast<uint16_t*>(p), vshrn_n_u32(bf16_bits(v), 16));
}

// Lane t of the result is the sum of the 4 lanes of v[t].
inline VF transpose_sum(const VF v[4]) {
  return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}
#endif

// kLanes elements of any input dtype, widened to float32
inline VF vloadw(const float* p) { return vload(p); }
inline VF vloadw(const c10::BFloat16* p) { return vload_bf16(p); }
inline VF vloadw(const c10::Half* p) { return vload_half(p); }

// out[i] = the sum of the lanes of acc[i], i < n (out: n rounded up to kLanes).
template <int n>
inline void sum_lanes(const VF* acc, float* out) {
  constexpr int kPadded = (n + kLanes - 1) / kLanes * kLanes;
  VF all[kPadded];
  for (int i = 0; i < kPadded; ++i) all[i] = i < n ? acc[i] : vzero();
  for (int j = 0; j < kPadded; j += kLanes) vstore(out + j, transpose_sum(all + j));
}

// ---- F16: 16 float32 lanes as kParts registers -------------------------------------------
constexpr int kParts = 16 / kLanes;

struct F16 {
  VF v[kParts];
};

#define AEGAEON_F16_BINARY(name, op)                          \
  inline F16 name(F16 a, F16 b) {                             \
    F16 r;                                                    \
    for (int i = 0; i < kParts; ++i) r.v[i] = op(a.v[i], b.v[i]); \
    return r;                                                 \
  }
AEGAEON_F16_BINARY(operator+, vadd)
AEGAEON_F16_BINARY(operator-, vsub)
AEGAEON_F16_BINARY(operator*, vmul)
AEGAEON_F16_BINARY(operator/, vdiv)
AEGAEON_F16_BINARY(max16, vmax)
AEGAEON_F16_BINARY(min16, vmin)
#undef AEGAEON_F16_BINARY

inline F16 set16(float x) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = vset1(x);
  return r;
}
inline F16 zero16() { return set16(0.f); }
inline F16 fmadd16(F16 a, F16 b, F16 c) {  // a * b + c, fused
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = vfmadd(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline F16 fnmadd16(F16 a, F16 b, F16 c) {  // c - a * b, fused
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = vfnmadd(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float reduce_add16(F16 a) {
  VF s = a.v[0];
  for (int i = 1; i < kParts; ++i) s = vadd(s, a.v[i]);
  return vsum(s);
}
inline float reduce_max16(F16 a) {
  VF s = a.v[0];
  for (int i = 1; i < kParts; ++i) s = vmax(s, a.v[i]);
  return vmaxall(s);
}
// lanes >= n (0 < n <= 16) set to zero
inline F16 keep_first16(F16 a, int n) {
  for (int i = 0; i < kParts; ++i) a.v[i] = vkeep_first(a.v[i], std::clamp(n - i * kLanes, 0, kLanes));
  return a;
}

inline F16 load16(const float* p) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = vload(p + i * kLanes);
  return r;
}
inline F16 load16(const c10::BFloat16* p) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = vload_bf16(p + i * kLanes);
  return r;
}
inline F16 load16(const c10::Half* p) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = vload_half(p + i * kLanes);
  return r;
}
inline void store16(float* p, F16 a) {
  for (int i = 0; i < kParts; ++i) vstore(p + i * kLanes, a.v[i]);
}
inline void store16(c10::BFloat16* p, F16 a) {
  for (int i = 0; i < kParts; ++i) vstore_bf16(p + i * kLanes, a.v[i]);
}

// n < 16 elements: loads leave the other lanes zero, stores write n elements.
#if defined(AEGAEON_SIMD_AVX512)
inline F16 load16(const float* p, int n) {
  return F16{{_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)}};
}
inline F16 load16(const c10::BFloat16* p, int n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return F16{{_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))}};
}
inline void store16(float* p, F16 a, int n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a.v[0]);
}
inline void store16(c10::BFloat16* p, F16 a, int n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1),
                           _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(a.v[0]), 16)));
}
#else  // through a zeroed buffer: only ragged row ends take this
template <typename T>
inline F16 load16(const T* p, int n) {
  T buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(T));
  return load16(static_cast<const T*>(buf));
}
template <typename T>
inline void store16(T* p, F16 a, int n) {
  T buf[16];
  store16(buf, a);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(T));
}
#endif

// the value rounded to T and back (identity for float32)
inline F16 round_to(const float*, F16 a) { return a; }
inline F16 round_to(const c10::BFloat16*, F16 a) {
  for (int i = 0; i < kParts; ++i) a.v[i] = vround_bf16(a.v[i]);
  return a;
}

// exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2; degree-7 Taylor
// polynomial for exp(r) (relative error < 1e-8 before float32 rounding). Inputs are
// clamped to [-88, 88]; below ~-87.3 the AVX2/NEON scaling flushes to 0 where
// AVX-512's scalef gives a denormal.
inline F16 exp16(F16 a) {
  F16 r;
  for (int i = 0; i < kParts; ++i) {
    const VF x = vmax(vmin(a.v[i], vset1(88.f)), vset1(-88.f));
    const VF n = vround(vmul(x, vset1(1.44269504f)));
    VF t = vfnmadd(n, vset1(0.693145752f), x);  // ln2 split in two
    t = vfnmadd(n, vset1(1.42860677e-6f), t);
    VF y = vset1(1.f / 5040);
    for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
      y = vfmadd(y, t, vset1(c));
    }
    r.v[i] = vscale2(y, n);
  }
  return r;
}

// Lane t of the result is the sum of the 16 lanes of v[t].
inline F16 sum16x16(const F16 v[16]) {
  F16 r;
  for (int j = 0; j < kParts; ++j) {  // lanes j * kLanes .. of the result
    VF s[kLanes];
    for (int t = 0; t < kLanes; ++t) {
      const F16& x = v[j * kLanes + t];
      s[t] = x.v[0];
      for (int i = 1; i < kParts; ++i) s[t] = vadd(s[t], x.v[i]);
    }
    r.v[j] = transpose_sum(s);
  }
  return r;
}

}  // namespace
}  // namespace aegaeon_simd
#endif
