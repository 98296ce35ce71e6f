// Paged decode attention on CPU: each sequence's one new query token (all q
// heads) attends over that sequence's K/V, read in place from the paged KV
// cache of the Aegaeon engine. Registered as torch.ops.<ns>.paged_decode
// (<ns> = aegaeon_<level>, one namespace per ISA level, see native.py).
//
// KV cache layout (one model's region, see model.py KVViews):
//   cache[num_blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]
// The K rows of (block b, layer l, kv head h) start at
//   ((b * layers + l) * 2) * block_size * kv_heads * head_dim + h * head_dim,
// one position every kv_heads * head_dim elements; the V rows follow
// block_size * kv_heads * head_dim elements later.
//
// Algorithm: the work of a sequence is cut into units, one per (kv head, query
// group): a group is the G <= 8 q heads sharing the kv head (GQA: q head j reads
// kv head j / (q_heads / kv_heads), as transformers' repeat_kv; larger groups
// are split), so each K/V row is read once for G queries. A task (the parallel
// unit) is a sequence and a range of its units, all of them when there are
// enough sequences for the threads: the task walks the sequence's blocks once,
// and per block each unit takes the block in chunks of <= 16 positions with an
// online softmax in float32 (running max m, running sum l, accumulator
// acc[G, head_dim]):
//   s = scale * q.K^T,  m' = max(m, max s),  p = exp(s - m'),
//   acc = acc * exp(m - m') + p.V,  l = l * exp(m - m') + sum p,  out = acc / l.
// Nothing is gathered; no score row longer than one chunk exists. Each kv head's
// work prefetches the next head's rows (the first head's of the next block after
// the last) a cache line at a time along its work (a burst of a whole block's
// lines stalls on the fill buffers; interleaved, the loads overlap the arithmetic).
//
// Inputs are float32, bfloat16 or float16; arithmetic is float32. Code paths,
// chosen per call from the head_dim and what the compiler targets:
// - bf16 pairs (amx level: AVX512-BF16, head_dim % 32 == 0): q.K with vdpbf16ps
//   (products of bfloat16 are exact in float32), V widened as even/odd lanes by
//   a shift and a mask, so acc holds each 32-wide chunk as [16 even, 16 odd];
// - vector (every level, head_dim % 16 == 0): q in float32, K and V widened 16
//   at a time (simd.h F16: one AVX-512 register, two AVX2, four NEON);
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
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

#if !defined(AEGAEON_OPS)
#define AEGAEON_OPS aegaeon
#endif
// TORCH_LIBRARY stringifies its argument: expand AEGAEON_OPS first
#define AEGAEON_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define AEGAEON_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {

#if defined(AEGAEON_SIMD)
using namespace aegaeon_simd;
#endif

constexpr int kChunk = 16;     // positions per online-softmax step (one F16)
constexpr int kMaxGroup = 8;   // q heads per task; larger GQA groups are split
#if defined(AEGAEON_SIMD)
// F16 accumulators of p.V: 8 (AVX-512), 4 on AVX2 and NEON (2 and 4 registers each)
constexpr int kChains = std::min(8, kRegs / (2 * kParts));
#endif

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

// One unit's state (G queries): m, l and acc as in the algorithm above, in a task buffer.
struct State {
  float* m;
  float* l;
  float* acc;  // [G, head_dim]
};

enum class Path { kGeneric, kVector, kBf16Pairs };

template <typename T>
Path pick_path(int64_t dim) {
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, c10::BFloat16> && dim % 32 == 0) return Path::kBf16Pairs;
#endif
#if defined(AEGAEON_SIMD)
  if (dim % 16 == 0) return Path::kVector;
#endif
  return Path::kGeneric;
}

// V rows are a fixed distance after the K rows (the same for the next block's)
template <typename T>
inline int64_t v_offset_of(const T* k, const T* v) { return v - k; }

template <typename T>
inline void prefetch_rows(const T* p, int64_t row_stride, int64_t rows, int64_t dim) {
  for (int64_t t = 0; t < rows; ++t) {
    const char* row = reinterpret_cast<const char*>(p + t * row_stride);
    for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) {
      __builtin_prefetch(row + off);
    }
  }
}

#if defined(AEGAEON_SIMD)
// The online-softmax update of query g for raw scores s (lanes < n valid):
// updates m and l, writes p, returns the factor exp(m - m') for acc.
inline float softmax_step(const State& st, int g, F16 s, int n, float scale, float* p) {
  s = s * set16(scale);
  alignas(64) float raw[kChunk];
  store16(raw, s);
  float m_new = st.m[g];
  for (int t = 0; t < n; ++t) m_new = std::max(m_new, raw[t]);
  const F16 pv = keep_first16(exp16(s - set16(m_new)), n);
  const float alpha = std::exp(st.m[g] - m_new);  // 0 on the first chunk (m = -inf)
  st.l[g] = st.l[g] * alpha + reduce_add16(pv);
  st.m[g] = m_new;
  store16(p, pv);
  return alpha;
}

// One chunk of n <= 16 positions; q is float32 [G, dim], acc in natural order.
template <typename T, int G>
inline void chunk_vector(const float* q, const T* k, const T* v, int64_t rs, int n,
                         int64_t dim, float scale, const State& st, const T* pf) {
  alignas(64) float p[G][kChunk];
  float alpha[G];
  for (int g = 0; g < G; ++g) {
    // kLanes positions per pass, one register each (16 registers would not fit AVX2's)
    F16 scores;
    for (int j = 0; j < kParts; ++j) {
      VF dot[kLanes];
      for (int t = 0; t < kLanes; ++t) dot[t] = vzero();
      for (int64_t c = 0; c < dim; c += kLanes) {
        const VF qv = vload(q + g * dim + c);
        for (int t = 0; t < kLanes; ++t) {  // rows past n repeat row n - 1 (masked out)
          const int pos = j * kLanes + t;
          dot[t] = vfmadd(qv, vloadw(k + std::min(pos, n - 1) * rs + c), dot[t]);
          if (pf && g == 0 && c % (64 / sizeof(T)) == 0) __builtin_prefetch(pf + pos * rs + c);
        }
      }
      scores.v[j] = transpose_sum(dot);
    }
    alpha[g] = softmax_step(st, g, scores, n, scale, p[g]);
  }
  // CB 16-wide chunks per pass: >= kChains independent FMA chains over the positions
  constexpr int CB = G >= kChains ? 1 : kChains / G;
  for (int64_t c0 = 0; c0 < dim; c0 += 16 * CB) {
    F16 a[CB][G];
    for (int j = 0; j < CB; ++j) {
      if (c0 + 16 * j >= dim) break;
      for (int g = 0; g < G; ++g) {
        a[j][g] = load16(st.acc + g * dim + c0 + 16 * j) * set16(alpha[g]);
      }
    }
    for (int t = 0; t < n; ++t) {
      for (int j = 0; j < CB; ++j) {
        if (c0 + 16 * j >= dim) break;
        if (pf && (c0 + 16 * j) % (64 / sizeof(T)) == 0) {
          __builtin_prefetch(pf + v_offset_of(k, v) + t * rs + c0 + 16 * j);
        }
        const F16 vv = load16(v + t * rs + c0 + 16 * j);
        for (int g = 0; g < G; ++g) a[j][g] = fmadd16(set16(p[g][t]), vv, a[j][g]);
      }
    }
    for (int j = 0; j < CB; ++j) {
      if (c0 + 16 * j >= dim) break;
      for (int g = 0; g < G; ++g) store16(st.acc + g * dim + c0 + 16 * j, a[j][g]);
    }
  }
}

#if defined(__AVX512BF16__)
// The same for bfloat16 with q kept as bfloat16 [G, dim]; acc in even/odd order.
template <int G>
inline void chunk_bf16(const c10::BFloat16* q, const c10::BFloat16* k,
                       const c10::BFloat16* v, int64_t rs, int n, int64_t dim, float scale,
                       const State& st, const c10::BFloat16* pf) {
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
        if (pf && g == 0) __builtin_prefetch(pf + t * rs + c);
      }
    }
    alpha[g] = softmax_step(st, g, F16{{transpose_sum(dot)}}, n, scale, p[g]);
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
        if (pf) __builtin_prefetch(pf + v_offset_of(k, v) + t * rs + c0 + 32 * j);
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
                          int64_t dim, float scale, const State& st) {
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

// One task: sequence b, units [u0, u1) (unit u: kv head u / parts, its q heads
// from (u % parts) * G, G of them). Blocks are walked once for all the units,
// so a task over every kv head reads each block's K and V rows whole.
template <typename T, int G>
void attend(const Args& a, int64_t b, int64_t u0, int64_t u1, int64_t parts) {
  const int64_t dim = a.head_dim, rs = a.row_stride;
  const Path path = pick_path<T>(dim);
  // per unit: q (float32, or its bf16 bits for kBf16Pairs), acc, m, l
  const int64_t unit_floats = (2 * G * dim + 2 * G + 15) / 16 * 16;
  thread_local std::vector<float> buffer;
  buffer.resize((u1 - u0) * unit_floats + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~63);
  auto q_of = [&](int64_t u) { return base + (u - u0) * unit_floats; };
  auto state_of = [&](int64_t u) {
    float* q = q_of(u);
    return State{q + 2 * G * dim, q + 2 * G * dim + G, q + G * dim};
  };
  auto head_of = [&](int64_t u) { return u / parts * a.group + u % parts * G; };  // first q head
  for (int64_t u = u0; u < u1; ++u) {
    const T* qh = static_cast<const T*>(a.q) + b * a.q_stride_b + head_of(u) * a.q_stride_h;
    float* q = q_of(u);
    const State st = state_of(u);
    for (int g = 0; g < G; ++g, qh += a.q_stride_h) {
      for (int64_t d = 0; d < dim; ++d) {
        if (path == Path::kBf16Pairs) {
          reinterpret_cast<T*>(q)[g * dim + d] = qh[d * a.q_stride_d];
        } else {
          q[g * dim + d] = static_cast<float>(qh[d * a.q_stride_d]);
        }
      }
      st.m[g] = -std::numeric_limits<float>::infinity();
      st.l[g] = 0.f;
    }
    std::fill(st.acc, st.acc + G * dim, 0.f);
  }
  const T* cache = static_cast<const T*>(a.cache) + a.layer_offset;
  const int64_t len = a.lens[b];
  TORCH_CHECK(len >= 1 && len <= a.table_stride * a.block_size, "context length ", len,
              " of sequence ", b, " outside its block table");
  const int64_t* blocks = a.table + b * a.table_stride;
  for (int64_t pos = 0; pos < len; pos += a.block_size) {
    const int64_t block = blocks[pos / a.block_size];
    TORCH_CHECK(block >= 0 && block < a.num_blocks, "block id ", block, " out of range");
    const T* next_k = nullptr;
    if (pos + a.block_size < len) {
      const int64_t next = blocks[pos / a.block_size + 1];
      if (next >= 0 && next < a.num_blocks) next_k = cache + next * a.block_elems;
    }
    const int64_t in_block = std::min(a.block_size, len - pos);
    for (int64_t u = u0; u < u1; ++u) {
      const State st = state_of(u);
      const float* q = q_of(u);
      const int64_t head = u / parts;
      const T* k = cache + block * a.block_elems + head * dim;
      // the rows the next kv head reads, of this block (or the first head's of the next
      // block), prefetched along this head's work: one head's rows ahead stay in L1,
      // where a whole block ahead (as many bytes as L1 holds) was evicted before use
      const T* ahead = nullptr;
      if (u % parts == 0 || u == u0) {
        if ((head + 1) * parts < u1) {
          ahead = cache + block * a.block_elems + (head + 1) * dim;
        } else if (next_k) {
          ahead = next_k + u0 / parts * dim;
        }
      }
      for (int64_t t = 0; t < in_block; t += kChunk) {
        const int n = static_cast<int>(std::min<int64_t>(kChunk, in_block - t));
        const T* kt = k + t * rs;
        const T* vt = kt + a.v_offset;
        const T* pf = ahead ? ahead + t * rs : nullptr;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (path == Path::kBf16Pairs) {
            chunk_bf16<G>(reinterpret_cast<const T*>(q), kt, vt, rs, n, dim, a.scale, st, pf);
            continue;
          }
        }
#endif
#if defined(AEGAEON_SIMD)
        if (path == Path::kVector) {
          chunk_vector<T, G>(q, kt, vt, rs, n, dim, a.scale, st, pf);
          continue;
        }
#endif
        if (pf) {
          prefetch_rows(pf, rs, n, dim);
          prefetch_rows(pf + a.v_offset, rs, n, dim);
        }
        chunk_generic<T, G>(q, kt, vt, rs, n, dim, a.scale, st);
      }
    }
  }
  for (int64_t u = u0; u < u1; ++u) {
    const State st = state_of(u);
    T* o = static_cast<T*>(a.out) + b * a.out_stride_b + head_of(u) * a.out_stride_h;
    for (int g = 0; g < G; ++g, o += a.out_stride_h) {
      const float inv = 1.f / st.l[g];
      const float* acc = st.acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) {
        // kBf16Pairs: element c + 2i of a 32-chunk c is acc[c + i], c + 2i + 1 acc[c + 16 + i]
        const int64_t i = path == Path::kBf16Pairs ? (d & ~31) + (d & 1) * 16 + ((d & 31) >> 1) : d;
        o[d] = T(acc[i] * inv);
      }
    }
  }
}

template <typename T>
void run(const Args& a, int64_t batch, int64_t kv_heads) {
  // a group larger than kMaxGroup is split into equal parts of at most kMaxGroup
  int64_t parts = (a.group + kMaxGroup - 1) / kMaxGroup;
  while (a.group % parts) ++parts;
  const int64_t size = a.group / parts, units = kv_heads * parts;
  // one task per sequence when that keeps the threads busy, else split its kv heads
  const int64_t threads = at::get_num_threads();
  const int64_t splits = threads == 1 ? 1 : std::min(units, (4 * threads + batch - 1) / batch);
  using Fn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t);
  static constexpr Fn fns[kMaxGroup] = {attend<T, 1>, attend<T, 2>, attend<T, 3>, attend<T, 4>,
                                        attend<T, 5>, attend<T, 6>, attend<T, 7>, attend<T, 8>};
  const Fn fn = fns[size - 1];
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / splits, s = i % splits;
      fn(a, b, s * units / splits, (s + 1) * units / splits, parts);
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
  TORCH_CHECK(cache.size(2) == 2 && dim == q.size(2), "q and cache head_dim differ");
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

// ---- the attention's prologue for new tokens: q/k norm, rope, K/V into the cache ----
// qkv [N, Hq + 2 Hkv, D] (rows of heads: q, then k, then v) is rewritten in place:
// q and k heads get the optional per-head RMSNorm (qwen3's q_norm / k_norm) and
// rope; then K and V of token n go to the cache at block slot_blocks[n], row
// slot_offsets[n] of `layer`. Rope, with sin_signed = sin with its first half
// negated (see rope.py): out = T(y * cos) + T(roll(y, D/2) * sin_signed), rounded
// where transformers' q * cos + rotate_half(q) * sin rounds.

struct RopeArgs {
  void* qkv;
  int64_t qkv_stride_n, qkv_stride_h;
  const void *q_norm, *k_norm, *cos, *sin;
  int64_t cos_stride, sin_stride;
  void* cache;
  int64_t block_elems, layer_offset, v_offset, row_stride, num_blocks, block_size;
  const int64_t *slot_blocks, *slot_offsets;
  int64_t num_q, num_kv, dim;
  float eps;
};

template <typename T>
void rope_head(const RopeArgs& a, T* x, const T* norm, const T* cos, const T* sin, float* buf) {
  const int64_t dim = a.dim, half = dim / 2;
#if defined(AEGAEON_SIMD)
  if constexpr (!std::is_same_v<T, c10::Half>) {
    if (dim % 16 == 0) {
      F16 sv = set16(1.f);
      if (norm) {
        F16 acc = zero16();
        for (int64_t c = 0; c < dim; c += 16) acc = fmadd16(load16(x + c), load16(x + c), acc);
        sv = set16(1.f / std::sqrt(reduce_add16(acc) / dim + a.eps));
      }
      for (int64_t c = 0; c < dim; c += 16) {
        F16 y = load16(x + c);
        if (norm) y = round_to(x, round_to(x, y * sv) * load16(norm + c));
        store16(buf + c, y);
        store16(buf + c + dim, y);
      }
      for (int64_t c = 0; c < dim; c += 16) {
        const F16 yc = round_to(x, load16(buf + c) * load16(cos + c));
        const F16 ys = round_to(x, load16(buf + c + half) * load16(sin + c));
        store16(x + c, yc + ys);
      }
      return;
    }
  }
#endif
  float scale = 1.f;
  if (norm) {
    float ss = 0.f;
    for (int64_t d = 0; d < dim; ++d) ss += static_cast<float>(x[d]) * static_cast<float>(x[d]);
    scale = 1.f / std::sqrt(ss / static_cast<float>(dim) + a.eps);
  }
  for (int64_t d = 0; d < dim; ++d) {  // y, twice, so that roll(y)[d] = buf[d + half]
    float y = static_cast<float>(x[d]);
    if (norm) y = static_cast<float>(T(static_cast<float>(T(y * scale)) * norm[d]));
    buf[d] = buf[d + dim] = y;
  }
  for (int64_t d = 0; d < dim; ++d) {
    const float c = static_cast<float>(T(buf[d] * static_cast<float>(cos[d])));
    const float s = static_cast<float>(T(buf[d + half] * static_cast<float>(sin[d])));
    x[d] = T(c + s);
  }
}

template <typename T>
void rope_write_tokens(const RopeArgs& a, int64_t begin, int64_t end) {
  std::vector<float> buf(2 * a.dim);
  T* cache = static_cast<T*>(a.cache) + a.layer_offset;
  for (int64_t n = begin; n < end; ++n) {
    T* row = static_cast<T*>(a.qkv) + n * a.qkv_stride_n;
    const T* cos = static_cast<const T*>(a.cos) + n * a.cos_stride;
    const T* sin = static_cast<const T*>(a.sin) + n * a.sin_stride;
    for (int64_t h = 0; h < a.num_q + a.num_kv; ++h) {
      const void* norm = h < a.num_q ? a.q_norm : a.k_norm;
      rope_head<T>(a, row + h * a.qkv_stride_h, static_cast<const T*>(norm), cos, sin,
                   buf.data());
    }
    const int64_t block = a.slot_blocks[n], offset = a.slot_offsets[n];
    TORCH_CHECK(block >= 0 && block < a.num_blocks && offset >= 0 && offset < a.block_size,
                "KV slot (", block, ", ", offset, ") out of range");
    T* k = cache + block * a.block_elems + offset * a.row_stride;
    for (int64_t h = 0; h < a.num_kv; ++h) {
      const T* src_k = row + (a.num_q + h) * a.qkv_stride_h;
      const T* src_v = row + (a.num_q + a.num_kv + h) * a.qkv_stride_h;
      std::copy(src_k, src_k + a.dim, k + h * a.dim);
      std::copy(src_v, src_v + a.dim, k + a.v_offset + h * a.dim);
    }
  }
}

void rope_write(const at::Tensor& qkv, const std::optional<at::Tensor>& q_norm,
                const std::optional<at::Tensor>& k_norm, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& cache, int64_t layer,
                const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t num_q,
                double eps) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1, "qkv must be [N, heads, D], D unit-stride");
  TORCH_CHECK(cache.dim() == 6 && cache.is_contiguous(), "cache must be contiguous 6-D");
  const int64_t n = qkv.size(0), dim = qkv.size(2), num_kv = cache.size(4);
  TORCH_CHECK(qkv.size(1) == num_q + 2 * num_kv && cache.size(5) == dim && dim % 2 == 0,
              "qkv heads / head_dim do not match the cache");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "layer out of range");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == dim && t->stride(1) == 1,
                "cos/sin must be [N, D] with unit-stride rows");
  }
  for (const auto* t : {&q_norm, &k_norm}) {
    TORCH_CHECK(!t->has_value() || ((*t)->is_contiguous() && (*t)->numel() == dim &&
                                    (*t)->scalar_type() == qkv.scalar_type()),
                "q_norm / k_norm must be contiguous [D]");
  }
  for (const at::Tensor* t : {&slot_blocks, &slot_offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "slots must be contiguous int64 [N]");
  }
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  cache.scalar_type() == qkv.scalar_type(), "qkv, cos, sin, cache: one dtype");
  const int64_t block_size = cache.size(3), rows = block_size * num_kv * dim;
  RopeArgs a{qkv.data_ptr(), qkv.stride(0), qkv.stride(1),
             q_norm.has_value() ? q_norm->data_ptr() : nullptr,
             k_norm.has_value() ? k_norm->data_ptr() : nullptr, cos.data_ptr(), sin.data_ptr(),
             cos.stride(0), sin.stride(0), cache.data_ptr(), cache.size(1) * 2 * rows,
             layer * 2 * rows, rows, num_kv * dim, cache.size(0), block_size,
             slot_blocks.data_ptr<int64_t>(), slot_offsets.data_ptr<int64_t>(), num_q, num_kv,
             dim, static_cast<float>(eps)};
  auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) { rope_write_tokens<T>(a, b, e); });
  };
  switch (qkv.scalar_type()) {
    case at::kFloat: return go(static_cast<float*>(nullptr));
    case at::kBFloat16: return go(static_cast<c10::BFloat16*>(nullptr));
    default: TORCH_CHECK(false, "rope_write: unsupported dtype ", qkv.scalar_type());
  }
}

}  // namespace

AEGAEON_LIBRARY(AEGAEON_OPS, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor cache, Tensor block_table, "
        "Tensor context_lens, int layer, float scale) -> ()");
  m.def("rope_write(Tensor(a!) qkv, Tensor? q_norm, Tensor? k_norm, Tensor cos, Tensor sin, "
        "Tensor(b!) cache, int layer, Tensor slot_blocks, Tensor slot_offsets, int num_q, "
        "float eps) -> ()");
}

AEGAEON_LIBRARY_IMPL(AEGAEON_OPS, CPU, m) {
  m.impl("paged_decode", paged_decode);
  m.impl("rope_write", rope_write);
}
