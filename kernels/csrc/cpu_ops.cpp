// raylm's native CPU ops (kernels/cpu_ops.py): decode attention straight from the paged KV cache, the
// Llama block's elementwise ops fused into one pass each, and the sampler's draw of one token per row and its
// top-p cut.
//
// Decode attention: one query token per request, the keys and values are read once, in place, block by block.
// The torch path would gather them into a padded copy first and hand that to SDPA, which moves every byte
// three times; decode attention is memory-bound, so that copy was half its cost.
//
// Elementwise: in eager torch, RMSNorm with its residual add, rotary embedding and SiLU-and-multiply are
// several passes each over the activations; a decode step's rows are few, so each pass is mostly a dispatch
// and a parallel region.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

// glibc's libmvec has vector expf variants (8 floats per AVX2 call), but math.h announces them only under
// -ffast-math, which would also license reassociating every sum here. Announce them alone: GCC then calls
// them in `omp simd` loops, 9x faster than a scalar expf per element. (Elsewhere the loops call expf.)
#if defined(__x86_64__) && defined(__GLIBC__)
#pragma omp declare simd notinbranch
extern "C" float expf(float) noexcept;
#endif

namespace {

// A GCC/Clang vector of kLanes floats: one register of the widest kind -march=native offers (AVX-512's 16
// floats, else 8: one AVX register, or two NEON ones on Arm). The unaligned variant loads at any float offset.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef float vfu __attribute__((vector_size(kLanes * 4), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }

// The sum of a vector's lanes, by the ISA's shuffles: a loop over the lanes compiles to a round trip through
// memory per lane, and a tile of dot_tile ends in NT * MT of these.
inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 a = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// out[j] = hsum(v[j]) * scale for eight vectors. With AVX's 8 lanes, as one transpose by pairwise sums: ten
// shuffles and adds for the eight, where eight hsums take thirty-two.
inline void hsum8(const vf* v, float scale, float* out) {
#if defined(__AVX__) && !defined(__AVX512F__)
  const __m256* a = reinterpret_cast<const __m256*>(v);
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
  _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
#else
  for (int j = 0; j < 8; ++j) out[j] = hsum(v[j]) * scale;
#endif
}

// The largest of x[0 : n]. std::max_element kept its running maximum in memory, a store and a load per key: a
// fifth of paged_decode's time.
inline float row_max(const float* x, int64_t n) {
  float mx = -INFINITY;
  int64_t i = 0;
  if (n >= kLanes) {
    vf m = load(x);
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      const vf v = load(x + i);
      m = m > v ? m : v;
    }
    for (int j = 0; j < kLanes; ++j) mx = std::max(mx, m[j]);
  }
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// Blocks sit at random places in the cache, so the hardware prefetcher cannot see the next one coming: while
// one block's rows are used, ask for the next block's (D floats each, a few cache lines).
inline void prefetch_rows(const float* row, int64_t rows, int64_t stride, int64_t D) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(row + r * stride + i, 0, 1);
}

// One (request, KV head)'s L keys or values from position t0 on, walked a block at a time: `visit(row, t, rows)`
// gets the first row of `rows` consecutive positions in one block (`token_stride` floats apart), t counting from
// t0. `prefetch`: ask for the next block while this one is used (the first pass over the rows; later passes find
// them in cache).
struct BlockWalk {
  const int32_t* table;
  int64_t t0, L, block_size, block_stride, token_stride, D;

  template <typename Visit>
  void operator()(const float* cache, bool prefetch, Visit visit) const {
    int64_t blk = t0 / block_size, off = t0 % block_size;
    for (int64_t t = 0; t < L; ++blk, off = 0) {
      const int64_t rows = std::min(block_size - off, L - t);
      if (prefetch && t + rows < L)
        prefetch_rows(cache + table[blk + 1] * block_stride, std::min(block_size, L - t - rows), token_stride, D);
      visit(cache + table[blk] * block_stride + off * token_stride, t, rows);
      t += rows;
    }
  }
};

// scores[g * L + r] = dot(q_g, row r) * scale for G query heads and `rows` rows of D floats, `stride` apart.
// Eight rows at a time: each load of q serves eight products, and their sums reduce together.
inline void score_rows(const float* q, int64_t G, int64_t D, const float* k, int64_t rows, int64_t stride,
                       float scale, float* scores, int64_t L) {
  const int64_t DV = D / kLanes * kLanes;
  auto tail = [&](const float* qg, const float* row) {
    float sum = 0.f;
    for (int64_t c = DV; c < D; ++c) sum += qg[c] * row[c];
    return sum * scale;
  };
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8, k += 8 * stride)
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      vf acc[8] = {};
      for (int64_t c = 0; c < DV; c += kLanes) {
        const vf qv = load(qg + c);
        for (int j = 0; j < 8; ++j) acc[j] += qv * load(k + j * stride + c);
      }
      float* out = scores + g * L + r;
      hsum8(acc, scale, out);
      if (DV < D)
        for (int j = 0; j < 8; ++j) out[j] += tail(qg, k + j * stride);
    }
  for (; r < rows; ++r, k += stride)
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      vf acc = {};
      for (int64_t c = 0; c < DV; c += kLanes) acc += load(qg + c) * load(k + c);
      scores[g * L + r] = hsum(acc) * scale + tail(qg, k);
    }
}

// out[0 : NV * kLanes] = sum over the walk's positions of p[t] * value row t (from v, a row's first float of
// the chunk): NV accumulators held in registers across every row, where adding into memory would store each of
// them once per row.
template <int NV>
inline void weigh_values(const BlockWalk& walk, const float* v, bool prefetch, const float* p, float* out) {
  vf acc[NV] = {};
  walk(v, prefetch, [&](const float* row, int64_t t, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r, row += walk.token_stride) {
      const vf w = vf{} + p[t + r];
      for (int i = 0; i < NV; ++i) acc[i] += w * load(row + i * kLanes);
    }
  });
  for (int i = 0; i < NV; ++i) *reinterpret_cast<vfu*>(out + i * kLanes) = acc[i];
}

// The same for the n < kLanes floats a row's vectors leave.
inline void weigh_values_tail(const BlockWalk& walk, const float* v, int64_t n, const float* p, float* out) {
  std::fill(out, out + n, 0.f);
  walk(v, false, [&](const float* row, int64_t t, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r, row += walk.token_stride)
      for (int64_t i = 0; i < n; ++i) out[i] += p[t + r] * row[i];
  });
}

// q [n, heads, D], caches [num_blocks, block_size, kv_heads, D] (each contiguous), block_tables
// [n, max_blocks] int32, seq_lens [n] int32 -> [n, heads, D]. Query heads h*G .. h*G+G-1 share KV head h, so
// each (request, KV head) is one task that reads its keys and values from memory once for G heads. window > 0:
// the query (its context's last token) sees only the last `window` keys, itself included.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(), "paged_decode: contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: int32 block_tables and seq_lens");
  const int64_t n = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == D, "paged_decode: head shapes disagree");
  const int64_t G = heads / kv_heads;
  at::Tensor out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t token_stride = kv_heads * D, block_stride = block_size * token_stride;
  const float s = static_cast<float>(scale);

  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      // Keys before t0 fell out of the window: never read. L counts the keys read, t0 + t their positions.
      const int64_t t0 = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0, L = lens[b] - t0;
      const float* qb = qp + (b * heads + h * G) * D;
      const BlockWalk walk{tables + b * max_blocks, t0, L, block_size, block_stride, token_stride, D};
      scores.resize(G * L);
      walk(kp + h * D, true, [&](const float* k, int64_t t, int64_t rows) {
        score_rows(qb, G, D, k, rows, token_stride, s, scores.data() + t, L);
      });
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * L;
        const float mx = row_max(row, L);
        float sum = 0.f;  // in vector lanes: a plain loop is one dependent scalar add per key
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
          row[t] = expf(row[t] - mx);
          sum += row[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) row[t] *= inv;
      }
      // Each query head's values in chunks of 8, 4 and 1 vectors, then the floats left; the first pass
      // prefetches.
      float* ob = op + (b * heads + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* p = scores.data() + g * L;
        const float* v = vp + h * D;
        float* o = ob + g * D;
        int64_t c = 0;
        for (; c + 8 * kLanes <= D; c += 8 * kLanes) weigh_values<8>(walk, v + c, g == 0 && c == 0, p, o + c);
        for (; c + 4 * kLanes <= D; c += 4 * kLanes) weigh_values<4>(walk, v + c, g == 0 && c == 0, p, o + c);
        for (; c + kLanes <= D; c += kLanes) weigh_values<1>(walk, v + c, g == 0 && c == 0, p, o + c);
        if (c < D) weigh_values_tail(walk, v + c, D - c, p, o + c);
      }
    }
  });
  return out;
}


// residual += x (in place), then out = residual / rms(residual) * weight; rows [T, H] contiguous.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && residual.scalar_type() == at::kFloat &&
                  weight.scalar_type() == at::kFloat, "add_rms_norm: float32 only");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() &&
                  x.sizes() == residual.sizes() && x.dim() == 2 && weight.numel() == x.size(1),
              "add_rms_norm: contiguous [T, H] x and residual, [H] weight");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * H;
      float* rr = rp + t * H;
      float* orow = op + t * H;
      // Eight partial sums, so the loop vectorizes without reassociating a single chain (no -ffast-math).
      float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 8 <= H; i += 8)
        for (int j = 0; j < 8; ++j) {
          const float r = rr[i + j] + xr[i + j];
          rr[i + j] = r;
          lanes[j] += r * r;
        }
      float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      for (; i < H; ++i) {
        const float r = rr[i] + xr[i];
        rr[i] = r;
        sum += r * r;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + e);
      for (int64_t k = 0; k < H; ++k) orow[k] = rr[k] * inv * wp[k];
    }
  });
  return out;
}

// x [T, 2I] contiguous -> silu(x[:, :I]) * x[:, I:], [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) % 2 == 0,
              "silu_and_mul: contiguous float32 [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * 2 * I;
      const float* up = gate + I;
      float* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
  });
  return out;
}

// Neox-style rotation, in place, of x [T, heads, D] (any row and head strides, contiguous last dim) by
// cos, sin [T, D/2]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == x.size(0) * x.size(2) / 2 && sin.numel() == cos.numel(),
              "rotary_: [T, heads, D] x with a contiguous last dim, contiguous [T, D/2] cos and sin");
  const int64_t T = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + t * row_stride + h * head_stride;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}


// How far ahead a product asks for its weights (see dot_tile): enough to cover memory's latency even at one
// row of x. Through SmolLM2's 30 layers at one row: 11 GB/s with the next four rows prefetched, 17 at 128 KB.
constexpr int64_t kAheadBytes = 128 << 10;

// y[m, n] = dot(x[m], w[n]) for NT rows of w and MT rows of x: NT * MT accumulators of kLanes floats, so each
// kLanes floats of the NT weight rows are loaded once for MT rows of x. The first tile of a block also asks
// for the weights kAheadBytes on (the rows that follow these), a line per row per step, into L2 (L1's few miss
// buffers would hold the loads up): the weights stream from memory at the pace they are used, where the
// hardware's prefetcher sees only short runs.
template <int NT, int MT, bool kPrefetch>
inline void dot_tile(const float* __restrict x, const float* __restrict w, int64_t K, float* __restrict y,
                     int64_t ldy) {
  vf acc[NT][MT] = {};
  const int64_t ahead = std::max<int64_t>(1, kAheadBytes / (NT * K * 4)) * NT;
  const int64_t KV = K / kLanes * kLanes;
  for (int64_t k = 0; k < KV; k += kLanes) {
    vf wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = *reinterpret_cast<const vfu*>(w + n * K + k);
    if (kPrefetch)
      for (int n = 0; n < NT; ++n) __builtin_prefetch(w + (ahead + n) * K + k, 0, 1);
    for (int m = 0; m < MT; ++m) {
      const vf xv = *reinterpret_cast<const vfu*>(x + m * K + k);
      for (int n = 0; n < NT; ++n) acc[n][m] += wv[n] * xv;
    }
  }
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) {
      float s = hsum(acc[n][m]);
      for (int64_t k = KV; k < K; ++k) s += w[n * K + k] * x[m * K + k];
      y[m * ldy + n] = s;
    }
}

// `rows` rows of x times NT rows of w: tiles of MT rows, then one tile of the rows left. Only the first tile
// prefetches: the later ones find the weights in cache.
template <int NT, int MT>
inline void dot_rows(const float* x, int64_t rows, const float* w, int64_t K, float* y, int64_t N, bool prefetch) {
  if constexpr (MT > 0) {
    int64_t m = 0;
    for (; m + MT <= rows; m += MT, prefetch = false) {
      if (prefetch)
        dot_tile<NT, MT, true>(x + m * K, w, K, y + m * N, N);
      else
        dot_tile<NT, MT, false>(x + m * K, w, K, y + m * N, N);
    }
    dot_rows<NT, MT - 1>(x + m * K, rows - m, w, K, y + m * N, N, prefetch);
  }
}

// Rows per tile: 4 * 6 accumulators, 4 weight vectors and one of x fill AVX-512's 32 registers; AVX2 has 16
// (4 * 2 + 4 + 1 of them).
constexpr int kTileRows = kLanes == 16 ? 6 : 2;

// y [M, N] = each group's rows of x [M, K] times its own w[g] [N, K] transposed, group g holding rows
// ends[g-1] .. ends[g]-1. For groups of few rows (a decode step's tokens per expert, or a decode step's few
// requests): BLAS and oneDNN run such products at a fraction of the memory bandwidth (a 16-row group at
// ~6 GB/s here), or pay a fixed cost per call that a small layer's product does not cover, while this reads
// each weight row from memory once for all rows of its group. Threads split the output columns, so each reads
// its share of every group's weights whatever the group sizes.
at::Tensor rows_times_weights(const at::Tensor& x, const at::Tensor& w, const int32_t* ends, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, op, ": float32 x and w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), op, ": x [M, K] and w [G, N, K] or [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), G = w.size(0), N = w.size(1);
  TORCH_CHECK(G == 0 || ends[G - 1] == M, op, ": the groups must end at x's rows");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t NT = 4;
  at::parallel_for(0, (N + NT - 1) / NT, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r0 = g == 0 ? 0 : ends[g - 1], rows = ends[g] - r0;
      const float* xr = xp + r0 * K;
      for (int64_t b = begin; b < end && rows > 0; ++b) {
        const int64_t n = b * NT;
        const float* wn = wp + (g * N + n) * K;
        float* yr = yp + r0 * N + n;
        if (n + NT <= N) {
          dot_rows<NT, kTileRows>(xr, rows, wn, K, yr, N, true);
        } else {
          for (int64_t j = 0; n + j < N; ++j) dot_rows<1, kTileRows>(xr, rows, wn + j * K, K, yr + j, N, true);
        }
      }
    }
  });
  return y;
}

// x [M, K] grouped by rows, offs [G] int32 (each group's end), w [G, N, K] -> [M, N]: the MoE experts' product.
at::Tensor grouped_small_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  TORCH_CHECK(offs.scalar_type() == at::kInt && offs.is_contiguous() && offs.dim() == 1 && offs.numel() == w.size(0),
              "grouped_small_mm: int32 offs [G] for w [G, N, K]");
  return rows_times_weights(x, w, offs.data_ptr<int32_t>(), "grouped_small_mm");
}

// x [M, K], w [N, K] -> x w^T [M, N]: a linear layer's product at a decode step's few rows.
at::Tensor small_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "small_mm: w [N, K]");
  const int32_t rows = static_cast<int32_t>(x.size(0));
  return rows_times_weights(x, w.unsqueeze(0), &rows, "small_mm");
}

// One draw per row from the categorical distribution of the row's weights (nonnegative, any total: softmax
// probabilities, or those with some zeroed) at the row's uniform u in [0, 1): the first token whose cumulative
// weight exceeds u times the row's total. One uniform per row where an exponential race draws one per token (the
// race's S x V draws took 60 ms of a 200 ms two-core decode step of SmolLM2 at 64 rows; this takes about 1).
// Sums are in double, by blocks of kDrawBlock: the row's total and the scan that inverts it add the same block
// sums in the same order, so the scan stops in a block of positive weight, and within it at a positive token.
constexpr int64_t kDrawBlock = 256;

int64_t draw_one(const float* row, int64_t V, double u, std::vector<double>& block_sums) {
  const int64_t nb = static_cast<int64_t>(block_sums.size());
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kDrawBlock, hi = std::min(V, lo + kDrawBlock);
    double lanes[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4)
      for (int j = 0; j < 4; ++j) lanes[j] += row[i + j];
    double sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
    for (; i < hi; ++i) sum += row[i];
    block_sums[b] = sum;
    total += sum;
  }
  const double target = u * total;
  // Rounding may leave u * total equal to the total: then the last block of positive weight.
  int64_t block = -1;
  double before = 0.0, block_before = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (block_sums[b] > 0.0) {
      block = b;
      block_before = before;
      if (before + block_sums[b] > target) break;
    }
    before += block_sums[b];
  }
  // No positive weight (every token masked, so the softmax was NaN): token 0, which argmax over NaN gives.
  if (block < 0) return 0;
  // The scan in token order may round differently from the block's lanes: then the block's last positive token.
  const int64_t lo = block * kDrawBlock, hi = std::min(V, lo + kDrawBlock);
  double cumulative = block_before;
  int64_t token = lo;
  for (int64_t i = lo; i < hi; ++i) {
    if (row[i] > 0.0f) {
      token = i;
      cumulative += row[i];
      if (cumulative > target) break;
    }
  }
  return token;
}

// weights [S, V] float32 contiguous, uniforms [S] float64 in [0, 1) -> [S] int64 token ids.
at::Tensor sample_categorical(const at::Tensor& weights, const at::Tensor& uniforms) {
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2,
              "sample_categorical: contiguous float32 weights [S, V]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.dim() == 1 &&
                  uniforms.size(0) == weights.size(0),
              "sample_categorical: contiguous float64 uniforms [S]");
  const int64_t S = weights.size(0), V = weights.size(1);
  at::Tensor out = at::empty({S}, weights.options().dtype(at::kLong));
  const float* wp = weights.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> block_sums((V + kDrawBlock - 1) / kDrawBlock);
    for (int64_t s = begin; s < end; ++s) op[s] = draw_one(wp + s * V, V, up[s], block_sums);
  });
  return out;
}

// Top-p (nucleus) filtering of one row of logits, in place: keep the smallest most-likely-first set of tokens
// whose probability reaches top_p, set the others to -inf. A token stays exactly when the tokens more likely than
// it hold less than top_p of the mass; tokens tied at the cut stay together. A sort of the row found that set at
// 1.6 ms a row (SmolLM2's 49,152 tokens: 105 ms of a 64-row decode step); here a radix select finds the cut in
// a few passes. Probabilities are exp(logit - max) (the row's softmax times its total, which is never formed) and
// nonnegative floats order as their bit patterns, so a histogram of the top bits, summed from the largest bucket
// down, names the one bucket the cut falls in, a second histogram the part of it; only that part is sorted.
constexpr int kCutShift = 19;  // 4,096 buckets: 8 exponent bits and 3 mantissa bits (a bucket spans a factor 1.09)
constexpr int64_t kCutBuckets = int64_t{1} << (31 - kCutShift);

inline uint32_t float_bits(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof bits);
  return bits;
}

inline int64_t cut_bucket(float e) {  // NaN's bits land in the top bucket
  return std::min<int64_t>(float_bits(e) >> kCutShift, kCutBuckets - 1);
}

inline int64_t sub_bucket(float e) {  // the 12 bits after cut_bucket's
  return (float_bits(e) >> (kCutShift - 12)) & (kCutBuckets - 1);
}

// Four histograms, element i in histogram i % 4: neighbouring tokens often share a bucket, and one histogram would
// chain every such add through memory.
constexpr int kCutHistograms = 4;

void top_p_row(float* __restrict logits, int64_t V, double top_p, std::vector<float>& e, std::vector<double>& mass,
               std::vector<float>& in_cut) {
  // The max by vectors of kLanes: GCC leaves a float max reduction scalar (NaN's order), a chain of V maxes.
  vf lanes_max = {};
  lanes_max -= INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    const vf x = *reinterpret_cast<const vfu*>(logits + i);
    lanes_max = lanes_max > x ? lanes_max : x;
  }
  float max = -INFINITY;
  for (int j = 0; j < kLanes; ++j) max = std::max(max, lanes_max[j]);
  for (; i < V; ++i) max = std::max(max, logits[i]);
  if (!(max > -INFINITY) || top_p >= 1.0) return;  // every token masked (or NaN), or nothing to cut
  float* __restrict ep = e.data();
#pragma omp simd
  for (int64_t k = 0; k < V; ++k) ep[k] = expf(logits[k] - max);
  std::fill(mass.begin(), mass.end(), 0.0);
  double* h = mass.data();
  for (i = 0; i + kCutHistograms <= V; i += kCutHistograms)
    for (int j = 0; j < kCutHistograms; ++j) h[j * kCutBuckets + cut_bucket(ep[i + j])] += ep[i + j];
  for (; i < V; ++i) h[cut_bucket(ep[i])] += ep[i];
  double total = 0.0;
  for (int64_t b = 0; b < kCutBuckets * kCutHistograms; ++b) total += h[b];
  const double target = top_p * total;
  double above = 0.0;  // the mass of the buckets above the one the cut is in
  int64_t bucket = kCutBuckets - 1;
  for (; bucket > 0; --bucket) {
    double in_bucket = 0.0;
    for (int j = 0; j < kCutHistograms; ++j) in_bucket += h[j * kCutBuckets + bucket];
    if (above + in_bucket >= target) break;
    above += in_bucket;
  }
  // A nearly flat row puts thousands of tokens in that bucket: split it again by the next 12 bits of their values,
  // and sort only the part the cut falls in. Gathered a vector at a time: most vectors hold none of it.
  in_cut.clear();
  for (int64_t k = 0; k < V; k += kLanes) {
    const int64_t end = std::min(V, k + kLanes);
    bool any = false;
    for (int64_t j = k; j < end; ++j) any |= cut_bucket(ep[j]) == bucket;
    if (any)
      for (int64_t j = k; j < end; ++j)
        if (cut_bucket(ep[j]) == bucket) in_cut.push_back(ep[j]);
  }
  std::fill(h, h + kCutBuckets, 0.0);
  for (float v : in_cut) h[sub_bucket(v)] += v;
  int64_t sub = kCutBuckets - 1;
  for (; sub > 0 && above + h[sub] < target; --sub) above += h[sub];
  in_cut.erase(std::remove_if(in_cut.begin(), in_cut.end(), [&](float v) { return sub_bucket(v) != sub; }),
               in_cut.end());
  std::sort(in_cut.begin(), in_cut.end(), std::greater<float>());
  // Summed in another order, the part's values may fall an ulp short of the target: then all of them stay.
  float threshold = in_cut.empty() ? 0.0f : in_cut.back();
  for (float v : in_cut) {
    above += v;
    if (above >= target) {
      threshold = v;
      break;
    }
  }
#pragma omp simd
  for (int64_t k = 0; k < V; ++k) logits[k] = ep[k] < threshold ? -INFINITY : logits[k];
}

// logits [S, V] float32 contiguous (modified in place), top_p [S] float32 in (0, 1].
void top_p_mask_(at::Tensor& logits, const at::Tensor& top_p) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.dim() == 2,
              "top_p_mask_: contiguous float32 logits [S, V]");
  TORCH_CHECK(top_p.scalar_type() == at::kFloat && top_p.is_contiguous() && top_p.dim() == 1 &&
                  top_p.size(0) == logits.size(0),
              "top_p_mask_: contiguous float32 top_p [S]");
  const int64_t S = logits.size(0), V = logits.size(1);
  float* lp = logits.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V), in_cut;
    std::vector<double> mass(kCutBuckets * kCutHistograms);
    for (int64_t s = begin; s < end; ++s) top_p_row(lp + s * V, V, pp[s], e, mass, in_cut);
  });
}

}  // namespace

TORCH_LIBRARY(raylm, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("grouped_small_mm(Tensor x, Tensor w, Tensor offs) -> Tensor");
  m.def("small_mm(Tensor x, Tensor w) -> Tensor");
  m.def("sample_categorical(Tensor weights, Tensor uniforms) -> Tensor");
  m.def("top_p_mask_(Tensor(a!) logits, Tensor top_p) -> ()");
}

TORCH_LIBRARY_IMPL(raylm, CPU, m) {
  m.impl("paged_decode", paged_decode);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rotary_", rotary_);
  m.impl("grouped_small_mm", grouped_small_mm);
  m.impl("small_mm", small_mm);
  m.impl("sample_categorical", sample_categorical);
  m.impl("top_p_mask_", top_p_mask_);
}
