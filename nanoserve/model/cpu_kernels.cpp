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

namespace {

constexpr int64_t GROUP = 32;
constexpr int MAX_ROWS = 8;  // rows sharing one pass over the weights (registers: 2 per row)

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
    const float coarse = amax / 127.f, fine = coarse / 254.f;
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

}  // namespace

TORCH_LIBRARY(nanoserve, lib) {
  lib.def("int4_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
  lib.def("int8_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("int4_mm", &int4_mm);
  lib.impl("int8_mm", &int8_mm);
}
