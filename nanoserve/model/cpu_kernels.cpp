// Weight-only products for a few rows on AVX-512 VNNI CPUs: y = x @ w.T, w in groups of 32 along K.
//
// A step of one to a few rows is bound by reading the weights, so the weights stay 4-bit (or
// 8-bit) codes and each activation becomes two int8 codes per group of 32 (quantize_rows), so
// that one vpdpbusd multiplies 64 code/activation pairs. Per group g of output n:
//   w[n, k] = d[n, g] * c[n, k] + m[n, g]            (c unsigned: 0..15 or 0..255)
//   x[k]   ~= xd[g] * xq[k],  xq = 254 hi + lo       (hi, lo signed int8)
//   sum_k w x ~= d * xd * sum_k c xq  +  m * (xd * sum_k xq)
// The second term uses the rounded activations too, so the error is sum_k w[n, k] * (rounding of x[k]).
//
// Layout (nanoserve/model/cpu_kernels.py packs it): outputs in blocks of 16; per block, per
// group, 4-byte lanes, lane r holding 4 consecutive codes of output r, so one 64-byte vector
// covers 16 outputs x 4 k:
//   nibbles: byte (block, g, j < 4, r, i < 4) = c[16 block + r, 32 g + 8 j + i]
//                                              | c[16 block + r, 32 g + 8 j + 4 + i] << 4
//   bytes:   byte (block, g, j < 8, r, i < 4) = c[16 block + r, 32 g + 4 j + i]
//   d, m:    fp16 [N / 16, K / 32, 16], passed as int16 tensors of their bits
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int MAX_ROWS = 8;  // rows sharing one pass over the weights (registers: 2 per row)
// Codes are fetched this many bytes ahead of their use (their scales and mins as far ahead in
// groups): the hardware prefetcher alone left a 1-row product at 9-11 GB/s of this VM's ~16.
constexpr int64_t PREFETCH_BYTES = 8192;

inline __m512 bf16x16_to_float(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 fp16x16_to_float(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Round to nearest even, as torch rounds float to bf16.
inline void store_bf16x16(uint16_t* dst, __m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// Four int8 codes as one int32 in every lane (a load the compiler folds into vpdpbusd's {1to16}).
typedef int32_t __attribute__((may_alias)) aliased_int32;
inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const aliased_int32*>(p)); }

// x [M, K] bf16 -> two int8 codes per value, x ~= xd * (254 * hi + lo) per group of 32:
// hi = round(x / (254 xd)) with 254 xd = max |x| / 127, lo = round of the remainder / xd, so
// |x - xd * (254 hi + lo)| <= xd / 2 = max |x| / 64516, finer than x's own bf16 rounding.
// xq [2, M, K] (hi then lo), xd [M, G], xs [M, G] = xd * sum(254 hi + lo).
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
  const int64_t G = K / GROUP;
  constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t i = 0; i < M * G; ++i) {
    __m512 v[2] = {bf16x16_to_float(x + i * GROUP), bf16x16_to_float(x + i * GROUP + 16)};
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    // A group this small (bf16 reaches 1e-38) counts as zeros: 1 / fine would overflow.
    const float coarse = amax > 1e-30f ? amax / 127.f : 0.f, fine = coarse / 254.f;
    const __m512 inv_coarse = _mm512_set1_ps(coarse > 0.f ? 1.f / coarse : 0.f);
    const __m512 inv_fine = _mm512_set1_ps(fine > 0.f ? 1.f / fine : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i hi = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[h], inv_coarse), ROUND);
      const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(coarse), v[h]);
      const __m512i lo = _mm512_cvt_roundps_epi32(_mm512_mul_ps(rest, inv_fine), ROUND);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i * GROUP + 16 * h), _mm512_cvtsepi32_epi8(hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + M * K + i * GROUP + 16 * h), _mm512_cvtsepi32_epi8(lo));
      sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_mullo_epi32(hi, _mm512_set1_epi32(254)), lo));
    }
    xd[i] = fine;
    xs[i] = fine * static_cast<float>(_mm512_reduce_add_epi32(sum));
  }
}

// 16 outputs (one block) for ROWS rows: out[r, 0..15] for r < ROWS, row stride ldo. xq holds
// the rows' hi codes, xq + lo_offset their lo codes. Each row sums hi and lo in separate
// accumulators, split again by step parity when there are few rows: chains of dependent
// vpdpbusd (5 cycles each) would otherwise leave the units idle.
template <bool NIBBLES, int ROWS>
void block16(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int8_t* xq,
             int64_t lo_offset, const float* xd, const float* xs, uint16_t* out, int64_t ldo) {
  constexpr int CHAINS = ROWS <= 2 ? 2 : 1;
  constexpr int64_t GROUP_BYTES = NIBBLES ? 16 * GROUP / 2 : 16 * GROUP;
  const int64_t G = K / GROUP;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * GROUP_BYTES;
    // A prefetch is a hint: past the end of the weights it fetches nothing and cannot fault.
    for (int64_t l = 0; l < GROUP_BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(wg + PREFETCH_BYTES + l), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(d + 16 * g) + PREFETCH_BYTES * 32 / GROUP_BYTES, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + 16 * g) + PREFETCH_BYTES * 32 / GROUP_BYTES, _MM_HINT_T0);
    const int8_t* hi_g = xq + g * GROUP;
    const int8_t* lo_g = hi_g + lo_offset;
    __m512i hi[CHAINS][ROWS], lo[CHAINS][ROWS];
    for (int c = 0; c < CHAINS; ++c) {
      for (int r = 0; r < ROWS; ++r) hi[c][r] = lo[c][r] = _mm512_setzero_si512();
    }
    // codes: 64 bytes = 16 outputs x 4 k, against the 4 x codes at offset `at` of each row
    auto step = [&](int c, __m512i codes, int64_t at) {
      for (int r = 0; r < ROWS; ++r) {
        hi[c][r] = _mm512_dpbusd_epi32(hi[c][r], codes, broadcast4(hi_g + r * K + at));
        lo[c][r] = _mm512_dpbusd_epi32(lo[c][r], codes, broadcast4(lo_g + r * K + at));
      }
    };
    if constexpr (NIBBLES) {
      for (int j = 0; j < 4; ++j) {
        const __m512i b = _mm512_loadu_si512(wg + 64 * j);
        step(j % CHAINS, _mm512_and_si512(b, low4), 8 * j);
        step(j % CHAINS, _mm512_and_si512(_mm512_srli_epi16(b, 4), low4), 8 * j + 4);
      }
    } else {
      for (int j = 0; j < 8; ++j) step(j % CHAINS, _mm512_loadu_si512(wg + 64 * j), 4 * j);
    }
    const __m512 dv = fp16x16_to_float(d + 16 * g), mv = fp16x16_to_float(m + 16 * g);
    for (int r = 0; r < ROWS; ++r) {
      __m512i h = hi[0][r], l = lo[0][r];
      if constexpr (CHAINS == 2) h = _mm512_add_epi32(h, hi[1][r]), l = _mm512_add_epi32(l, lo[1][r]);
      // 254 * hi + lo (fits: |hi| <= 32 * 255 * 127)
      const __m512i dot = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(h, 8), _mm512_slli_epi32(h, 1)), l);
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(xd[r * G + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) store_bf16x16(out + r * ldo, acc[r]);
}

// ROWS rows against every block, the blocks split across torch's threads.
template <bool NIBBLES, int ROWS>
void pass(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, const int8_t* xq,
          int64_t lo_offset, const float* xd, const float* xs, uint16_t* out) {
  const int64_t G = K / GROUP, block_bytes = 16 * K / (NIBBLES ? 2 : 1);
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      block16<NIBBLES, ROWS>(w + b * block_bytes, d + b * G * 16, m + b * G * 16, K, xq, lo_offset, xd, xs,
                             out + 16 * b, N);
    }
  });
}

template <bool NIBBLES, int ROWS = MAX_ROWS>
void dispatch(int rows, const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K,
              const int8_t* xq, int64_t lo_offset, const float* xd, const float* xs, uint16_t* out) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return dispatch<NIBBLES, ROWS - 1>(rows, w, d, m, N, K, xq, lo_offset, xd, xs, out);
  }
  pass<NIBBLES, ROWS>(w, d, m, N, K, xq, lo_offset, xd, xs, out);
}

template <bool NIBBLES>
at::Tensor group_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a [rows, K] bf16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "K = ", K, " is not a multiple of ", GROUP);
  TORCH_CHECK(d.dim() == 3 && d.size(1) == G && d.size(2) == 16 && d.scalar_type() == at::kShort && d.is_contiguous(),
              "scales must be contiguous fp16 bits (int16) [N / 16, ", G, ", 16], got ", d.sizes(), " ", d.scalar_type());
  TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == at::kShort && m.is_contiguous(), "mins must match the scales");
  const int64_t N = 16 * d.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == N * K / (NIBBLES ? 2 : 1),
              "codes must be contiguous uint8 holding ", N, " x ", K, NIBBLES ? " nibbles" : " bytes");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor xq = at::empty({2, M, K}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, M, G}, x.options().dtype(at::kFloat));
  float* xd = scales.data_ptr<float>();
  float* xs = xd + M * G;
  quantize_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr()), M, K, xq.data_ptr<int8_t>(), xd, xs);
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(m.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for (int64_t r = 0; r < M; r += MAX_ROWS) {
    const int rows = static_cast<int>(std::min<int64_t>(MAX_ROWS, M - r));
    dispatch<NIBBLES>(rows, codes.data_ptr<uint8_t>(), dp, mp, N, K, xq.data_ptr<int8_t>() + r * K, M * K,
                      xd + r * G, xs + r * G, op + r * N);
  }
  return out;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  return group_mm<true>(x, codes, d, m);
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  return group_mm<false>(x, codes, d, m);
}

// e^x for x <= 0 (softmax after its max is taken out), 16 lanes: x = n ln2 + f with |f| <= ln2 / 2,
// e^f by its degree-6 Taylor polynomial (relative error < 3e-7), 2^n through the exponent bits.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));  // e^-87 is below fp32's normal range: ~0
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  for (float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// One row's query heads of one K/V head over the row's first `len` cells: out = softmax(q k^T
// * scale) v, in fp32, rounded to bf16 once. q [group, D], out [group, D] (row stride out_stride).
void attend_one(const uint16_t* q, int64_t q_stride, const uint16_t* k_base, const uint16_t* v_base,
                int64_t cache_stride, const int64_t* slots, int64_t len, int64_t group, int64_t D, float scale,
                uint16_t* out, int64_t out_stride, std::vector<float>& scratch) {
  const int64_t C = D / 16, padded = (len + 15) / 16 * 16;
  scratch.assign(group * D + group * padded, 0.f);
  float* qf = scratch.data();
  float* scores = qf + group * D;
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < C; ++c) {
      _mm512_storeu_ps(qf + g * D + 16 * c, _mm512_mul_ps(bf16x16_to_float(q + g * q_stride + 16 * c), _mm512_set1_ps(scale)));
    }
  }
  constexpr int64_t AHEAD = 8;  // cells are scattered over the cache: fetch a few ahead
  for (int64_t t = 0; t < len; ++t) {
    if (t + AHEAD < len) _mm_prefetch(reinterpret_cast<const char*>(k_base + slots[t + AHEAD] * cache_stride), _MM_HINT_T0);
    const uint16_t* k = k_base + slots[t] * cache_stride;
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + 16 * c), bf16x16_to_float(k + 16 * c), acc);
      scores[g * padded + t] = _mm512_reduce_add_ps(acc);
    }
  }
  std::vector<float> total(group);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * padded;
    float top = row[0];
    for (int64_t t = 1; t < len; ++t) top = std::max(top, row[t]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      const __mmask16 live = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + t), _mm512_set1_ps(top))));
      _mm512_storeu_ps(row + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  std::vector<__m512> acc(group * C, _mm512_setzero_ps());
  for (int64_t t = 0; t < len; ++t) {
    if (t + AHEAD < len) _mm_prefetch(reinterpret_cast<const char*>(v_base + slots[t + AHEAD] * cache_stride), _MM_HINT_T0);
    const uint16_t* v = v_base + slots[t] * cache_stride;
    for (int64_t c = 0; c < C; ++c) {
      const __m512 vc = bf16x16_to_float(v + 16 * c);
      for (int64_t g = 0; g < group; ++g) acc[g * C + c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * padded + t]), vc, acc[g * C + c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / total[g]);
    for (int64_t c = 0; c < C; ++c) store_bf16x16(out + g * out_stride + 16 * c, _mm512_mul_ps(acc[g * C + c], inv));
  }
}

// q [n, H, D] bf16; k_cache, v_cache [slots, KV, D] bf16; slots [n, W] int64 (unit column stride);
// lens [n] int64. Row r attends to its first min(max(lens[r], 1), W) cells: a padded row of length 0
// reads cell 0, finite garbage nobody reads. Query heads h * group .. h * group + group - 1 share K/V head h.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q must be [n, H, D] bf16");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.scalar_type() == at::kBFloat16 && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kBFloat16 && v_cache.is_contiguous(),
              "caches must be contiguous bf16 [slots, KV, D] of one shape");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D % 16 == 0 && H % KV == 0, "head sizes disagree: q ", q.sizes(), ", cache ", k_cache.sizes());
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == n && slots.scalar_type() == at::kLong && slots.stride(1) == 1,
              "slots must be [n, W] int64 with unit column stride");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == n && lens.scalar_type() == at::kLong, "lens must be [n] int64");
  const int64_t W = slots.size(1), group = H / KV;
  TORCH_CHECK(W >= 1, "the window must have a column");
  at::Tensor out = at::empty({n, H, D}, q.options());
  const at::Tensor lens_c = lens.contiguous();
  const int64_t* len_p = lens_c.data_ptr<int64_t>();
  const auto* q_p = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* k_p = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* v_p = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* o_p = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* s_p = slots.data_ptr<int64_t>();
  at::parallel_for(0, n * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / KV, h = task % KV;
      const int64_t len = std::min(std::max<int64_t>(len_p[r], 1), W);
      attend_one(q_p + r * q.stride(0) + h * group * q.stride(1), q.stride(1), k_p + h * D, v_p + h * D, KV * D,
                 s_p + r * slots.stride(0), len, group, D, static_cast<float>(scale), o_p + (r * H + h * group) * D, D,
                 scratch);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoserve, lib) {
  lib.def("int4_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  lib.def("int8_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  lib.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("int4_mm", &int4_mm);
  lib.impl("int8_mm", &int8_mm);
  lib.impl("decode_attention", &decode_attention);
}
