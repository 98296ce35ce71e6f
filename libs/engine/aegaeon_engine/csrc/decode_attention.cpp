// Paged decode attention on CPU: each sequence's one new query token (all q
// heads) attends over that sequence's K/V, read in place from the paged KV
// cache of the Aegaeon engine. Registered as torch.ops.aegaeon.paged_decode.
//
// KV cache layout (one model's region, see model.py KVViews):
//   cache[num_blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]
// The K rows of (block b, layer l, kv head h) start at
//   ((b * layers + l) * 2) * block_size * kv_heads * head_dim + h * head_dim,
// one position every kv_heads * head_dim elements; the V rows follow
// block_size * kv_heads * head_dim elements later.
//
// Algorithm: one task per (sequence, kv head, query group). A group is the
// G <= 8 q heads sharing the kv head (GQA: q head j reads kv head j / (q_heads
// / kv_heads), as transformers' repeat_kv), so each K/V row is read from memory
// once for G queries. The task walks the sequence's blocks in chunks of <= 16
// positions with an online softmax in float32 (running max m, running sum l,
// accumulator acc[G, head_dim]):
//   s = scale * q.K^T,  m' = max(m, max s),  p = exp(s - m'),
//   acc = acc * exp(m - m') + p.V,  l = l * exp(m - m') + sum p,  out = acc / l.
// Nothing is gathered; no score row longer than one chunk exists. The next
// block's rows of the head are prefetched while a block is computed (a head's
// rows are scattered, head_dim of every kv_heads * head_dim elements).
//
// Inputs are float32, bfloat16 or float16; arithmetic is float32. Code paths,
// chosen per call from the head_dim and what the compiler targets:
// - bf16 pairs (AVX512-BF16, head_dim % 32 == 0): q.K with vdpbf16ps (products
//   of bfloat16 are exact in float32), V widened as even/odd lanes by a shift
//   and a mask, so acc holds each 32-wide chunk as [16 even, 16 odd] elements;
// - AVX-512 (head_dim % 16 == 0): q in float32, K and V widened 16 at a time;
// - generic: plain loops (the compiler vectorises the head_dim loops).
// The two vector paths sum 16 positions' dot products with one transpose-add.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kChunk = 16;     // positions per online-softmax step (one AVX-512 vector)
constexpr int kMaxGroup = 8;   // q heads per task; larger GQA groups are split
constexpr int kMaxDim = 1024;  // head_dim bound of the per-task stack buffers

// Where everything is, in elements of the input dtype.
struct Args {
  const void* q;
  int64_t q_stride_b, q_stride_h, q_stride_d;  // any strides (decode's q is column-major)
  const void* cache;
  int64_t block_elems;   // layers * 2 * block_size * kv_heads * head_dim
  int64_t layer_offset;  // layer * 2 * block_size * kv_heads * head_dim
  int64_t v_offset;      // block_size * kv_heads * head_dim
  int64_t row_stride;    // kv_heads * head_dim: one position to the next
  const int64_t* table;
  int64_t table_stride;
  const int64_t* lens;
  void* out;
  int64_t out_stride_b, out_stride_h;
  int64_t num_blocks, block_size, head_dim, group;
  float scale;
};

// Per-task state of G queries: m, l and acc as in the algorithm above.
template <int G>
struct State {
  float m[G], l[G];
  alignas(64) float acc[G * kMaxDim];
};

enum class Path { kGeneric, kAvx512, kBf16Pairs };

template <typename T>
Path pick_path(int64_t dim) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, c10::BFloat16> && dim % 32 == 0) return Path::kBf16Pairs;
#endif
  if (dim % 16 == 0) return Path::kAvx512;
#endif
  return Path::kGeneric;
}

template <typename T>
inline void prefetch_rows(const T* p, int64_t row_stride, int64_t rows, int64_t dim) {
  for (int64_t t = 0; t < rows; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * row_stride);
    for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) {
      __builtin_prefetch(row + off);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen and shift
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2; degree-7 Taylor
// polynomial for exp(r) (relative error < 1e-8 before float32 rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 y = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) {
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(y, n);
}

// Lane t of the result is the sum of the 16 lanes of v[t]: pairs are
// interleaved and added in four levels (45 instructions instead of 16 reductions).
inline __m512 sum16x16(const __m512 v[16]) {
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

// The online-softmax update of query g for raw scores s (lanes < n valid):
// updates m and l, writes p, returns the factor exp(m - m') for acc.
template <int G>
inline float softmax_step(State<G>& st, int g, __m512 s, int n, float scale, float* p) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
  const float m_new = std::max(st.m[g], _mm512_mask_reduce_max_ps(valid, s));
  __m512 pv = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  const float alpha = std::exp(st.m[g] - m_new);  // 0 on the first chunk (m = -inf)
  st.l[g] = st.l[g] * alpha + _mm512_reduce_add_ps(pv);
  st.m[g] = m_new;
  _mm512_storeu_ps(p, pv);
  return alpha;
}

// One chunk of n <= 16 positions; q is float32 [G, dim], acc in natural order.
template <typename T, int G>
inline void chunk_avx512(const float* q, const T* k, const T* v, int64_t rs, int n,
                         int64_t dim, float scale, State<G>& st) {
  alignas(64) float p[G][kChunk];
  float alpha[G];
  for (int g = 0; g < G; ++g) {
    __m512 dot[kChunk];
    for (int t = 0; t < kChunk; ++t) dot[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      const __m512 qv = _mm512_loadu_ps(q + g * dim + c);
      for (int t = 0; t < kChunk; ++t) {  // rows past n repeat row n - 1 (masked out)
        dot[t] = _mm512_fmadd_ps(qv, load16(k + std::min(t, n - 1) * rs + c), dot[t]);
      }
    }
    alpha[g] = softmax_step(st, g, sum16x16(dot), n, scale, p[g]);
  }
  // CB 16-wide chunks per pass: >= 8 independent FMA chains over the positions
  constexpr int CB = G >= 8 ? 1 : 8 / G;
  for (int64_t c0 = 0; c0 < dim; c0 += 16 * CB) {
    __m512 a[CB][G];
    for (int j = 0; j < CB; ++j) {
      if (c0 + 16 * j >= dim) break;
      for (int g = 0; g < G; ++g) {
        a[j][g] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + g * dim + c0 + 16 * j),
                                _mm512_set1_ps(alpha[g]));
      }
    }
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < CB; ++j) {
        if (c0 + 16 * j >= dim) break;
        const __m512 vv = load16(v + t * rs + c0 + 16 * j);
        for (int g = 0; g < G; ++g) {
          a[j][g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), vv, a[j][g]);
        }
      }
    }
    for (int j = 0; j < CB; ++j) {
      if (c0 + 16 * j >= dim) break;
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(st.acc + g * dim + c0 + 16 * j, a[j][g]);
    }
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 with q kept as bfloat16 [G, dim]; acc in even/odd order.
template <int G>
inline void chunk_bf16(const c10::BFloat16* q, const c10::BFloat16* k,
                       const c10::BFloat16* v, int64_t rs, int n, int64_t dim, float scale,
                       State<G>& st) {
  alignas(64) float p[G][kChunk];
  float alpha[G];
  for (int g = 0; g < G; ++g) {
    __m512 dot[kChunk];
    for (int t = 0; t < kChunk; ++t) dot[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * dim + c);
      for (int t = 0; t < kChunk; ++t) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + std::min(t, n - 1) * rs + c);
        dot[t] = _mm512_dpbf16_ps(dot[t], qv, kv);
      }
    }
    alpha[g] = softmax_step(st, g, sum16x16(dot), n, scale, p[g]);
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // CB 32-wide chunks per pass: >= 8 independent FMA chains over the positions
  constexpr int CB = G >= 4 ? 1 : 4 / G;
  for (int64_t c0 = 0; c0 < dim; c0 += 32 * CB) {
    __m512 even[CB][G], odd[CB][G];
    for (int j = 0; j < CB; ++j) {
      if (c0 + 32 * j >= dim) break;
      for (int g = 0; g < G; ++g) {
        const __m512 f = _mm512_set1_ps(alpha[g]);
        even[j][g] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + g * dim + c0 + 32 * j), f);
        odd[j][g] = _mm512_mul_ps(_mm512_loadu_ps(st.acc + g * dim + c0 + 32 * j + 16), f);
      }
    }
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < CB; ++j) {
        if (c0 + 32 * j >= dim) break;
        const __m512i x = _mm512_loadu_si512(v + t * rs + c0 + 32 * j);
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        for (int g = 0; g < G; ++g) {
          const __m512 pt = _mm512_set1_ps(p[g][t]);
          even[j][g] = _mm512_fmadd_ps(pt, ve, even[j][g]);
          odd[j][g] = _mm512_fmadd_ps(pt, vo, odd[j][g]);
        }
      }
    }
    for (int j = 0; j < CB; ++j) {
      if (c0 + 32 * j >= dim) break;
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(st.acc + g * dim + c0 + 32 * j, even[j][g]);
        _mm512_storeu_ps(st.acc + g * dim + c0 + 32 * j + 16, odd[j][g]);
      }
    }
  }
}
#endif
#endif

// The chunk step in plain loops (any head_dim, any target); q float32, acc natural order.
template <typename T, int G>
inline void chunk_generic(const float* q, const T* k, const T* v, int64_t rs, int n,
                          int64_t dim, float scale, State<G>& st) {
  float s[kChunk];
  for (int g = 0; g < G; ++g) {
    float m_new = st.m[g];
    for (int t = 0; t < n; ++t) {
      const T* krow = k + t * rs;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[g * dim + d] * static_cast<float>(krow[d]);
      s[t] = dot * scale;
      m_new = std::max(m_new, s[t]);
    }
    const float alpha = std::exp(st.m[g] - m_new);
    float sum = 0.f;
    for (int t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - m_new));
    st.l[g] = st.l[g] * alpha + sum;
    st.m[g] = m_new;
    float* acc = st.acc + g * dim;
    for (int64_t d = 0; d < dim; ++d) acc[d] *= alpha;
    for (int t = 0; t < n; ++t) {
      const T* vrow = v + t * rs;
      for (int64_t d = 0; d < dim; ++d) acc[d] += s[t] * static_cast<float>(vrow[d]);
    }
  }
}

// One task: sequence b, kv head h, q heads h * group + g0 .. + G.
template <typename T, int G>
void attend(const Args& a, int64_t b, int64_t h, int64_t g0) {
  const int64_t dim = a.head_dim, rs = a.row_stride;
  const Path path = pick_path<T>(dim);
  alignas(64) float qf[G * kMaxDim];  // q in float32, or its bf16 bits for kBf16Pairs
  State<G> st;
  const int64_t head0 = h * a.group + g0;
  const T* qb = static_cast<const T*>(a.q) + b * a.q_stride_b + head0 * a.q_stride_h;
  for (int g = 0; g < G; ++g) {
    const T* qh = qb + g * a.q_stride_h;
    for (int64_t d = 0; d < dim; ++d) {
      if (path == Path::kBf16Pairs) {
        reinterpret_cast<T*>(qf)[g * dim + d] = qh[d * a.q_stride_d];
      } else {
        qf[g * dim + d] = static_cast<float>(qh[d * a.q_stride_d]);
      }
    }
    st.m[g] = -std::numeric_limits<float>::infinity();
    st.l[g] = 0.f;
  }
  std::fill(st.acc, st.acc + G * dim, 0.f);
  const T* cache = static_cast<const T*>(a.cache) + a.layer_offset + h * dim;
  const int64_t len = a.lens[b];
  TORCH_CHECK(len >= 1 && len <= a.table_stride * a.block_size, "context length ", len,
              " of sequence ", b, " outside its block table");
  const int64_t* blocks = a.table + b * a.table_stride;
  for (int64_t pos = 0; pos < len; pos += a.block_size) {
    const int64_t block = blocks[pos / a.block_size];
    TORCH_CHECK(block >= 0 && block < a.num_blocks, "block id ", block, " out of range");
    if (pos + a.block_size < len) {
      const int64_t next = blocks[pos / a.block_size + 1];
      if (next >= 0 && next < a.num_blocks) {
        const T* nk = cache + next * a.block_elems;
        prefetch_rows(nk, rs, a.block_size, dim);
        prefetch_rows(nk + a.v_offset, rs, a.block_size, dim);
      }
    }
    const T* k = cache + block * a.block_elems;
    const int64_t in_block = std::min(a.block_size, len - pos);
    for (int64_t t = 0; t < in_block; t += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, in_block - t));
      const T* kt = k + t * rs;
      const T* vt = kt + a.v_offset;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (path == Path::kBf16Pairs) {
          chunk_bf16<G>(reinterpret_cast<const T*>(qf), kt, vt, rs, n, dim, a.scale, st);
          continue;
        }
      }
#endif
#if defined(__AVX512F__)
      if (path == Path::kAvx512) {
        chunk_avx512<T, G>(qf, kt, vt, rs, n, dim, a.scale, st);
        continue;
      }
#endif
      chunk_generic<T, G>(qf, kt, vt, rs, n, dim, a.scale, st);
    }
  }
  T* ob = static_cast<T*>(a.out) + b * a.out_stride_b + head0 * a.out_stride_h;
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / st.l[g];
    const float* acc = st.acc + g * dim;
    T* o = ob + g * a.out_stride_h;
    for (int64_t d = 0; d < dim; ++d) {
      // kBf16Pairs: element c + 2i of a 32-chunk c is acc[c + i], c + 2i + 1 is acc[c + 16 + i]
      const int64_t i = path == Path::kBf16Pairs ? (d & ~31) + (d & 1) * 16 + ((d & 31) >> 1) : d;
      o[d] = T(acc[i] * inv);
    }
  }
}

template <typename T>
void run(const Args& a, int64_t batch, int64_t kv_heads) {
  // a group larger than kMaxGroup is split into equal parts of at most kMaxGroup
  int64_t parts = (a.group + kMaxGroup - 1) / kMaxGroup;
  while (a.group % parts) ++parts;
  const int64_t size = a.group / parts;
  using Fn = void (*)(const Args&, int64_t, int64_t, int64_t);
  static constexpr Fn fns[kMaxGroup] = {attend<T, 1>, attend<T, 2>, attend<T, 3>, attend<T, 4>,
                                        attend<T, 5>, attend<T, 6>, attend<T, 7>, attend<T, 8>};
  const Fn fn = fns[size - 1];
  at::parallel_for(0, batch * kv_heads * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      fn(a, i / (kv_heads * parts), (i / parts) % kv_heads, (i % parts) * size);
    }
  });
}

// out [B, Hq, D] = attention of q [B, Hq, D] over each sequence's first
// context_lens[b] positions, found through block_table [B, max_blocks] (int64)
// in cache [num_blocks, layers, 2, block_size, Hkv, D] at `layer`.
void paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& cache,
                  const at::Tensor& block_table, const at::Tensor& context_lens, int64_t layer,
                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_decode runs on CPU");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && cache.dim() == 6, "q/out [B, Hq, D], cache 6-D");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, cache and out must share a dtype");
  TORCH_CHECK(q.sizes() == out.sizes(), "out must have q's shape");
  TORCH_CHECK(out.stride(2) == 1, "out must be unit-stride in head_dim");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == q.size(0),
              "block_table must be contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be contiguous int64 [B]");
  const int64_t layers = cache.size(1), block_size = cache.size(3);
  const int64_t kv_heads = cache.size(4), dim = cache.size(5);
  TORCH_CHECK(cache.size(2) == 2 && dim == q.size(2) && dim <= kMaxDim, "bad head_dim");
  TORCH_CHECK(layer >= 0 && layer < layers, "layer out of range");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "q heads must be a multiple of kv heads");
  const int64_t block_rows = block_size * kv_heads * dim;
  Args a{q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), cache.data_ptr(),
         layers * 2 * block_rows, layer * 2 * block_rows, block_rows, kv_heads * dim,
         block_table.data_ptr<int64_t>(), block_table.size(1), context_lens.data_ptr<int64_t>(),
         out.data_ptr(), out.stride(0), out.stride(1), cache.size(0), block_size, dim,
         q.size(1) / kv_heads, static_cast<float>(scale)};
  switch (q.scalar_type()) {
    case at::kFloat: return run<float>(a, q.size(0), kv_heads);
    case at::kBFloat16: return run<c10::BFloat16>(a, q.size(0), kv_heads);
    case at::kHalf: return run<c10::Half>(a, q.size(0), kv_heads);
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(aegaeon, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor cache, Tensor block_table, "
        "Tensor context_lens, int layer, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(aegaeon, CPU, m) { m.impl("paged_decode", paged_decode); }
