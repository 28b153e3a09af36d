// The vector tiers, one source: built once per tier with NANOSERVE_TIER_<NAME> defined and that
// tier's own instruction flags (nanoserve/model/cpu_kernels.py), never -march=native. The
// algorithm is the scalar reference's (reference.cpp); a tier supplies its vector primitives
// (simd_x86.h, simd_neon.h) and its name.
#include <algorithm>

#include "common.h"
#if defined(__x86_64__) || defined(__i386__)
#include "simd_x86.h"
#else
#include "simd_neon.h"
#endif

#if defined(NANOSERVE_TIER_AVX512_VNNI)
#define TIER_NAME "avx512-vnni"
#elif defined(NANOSERVE_TIER_AVX_VNNI)
#define TIER_NAME "avx-vnni"
#elif defined(NANOSERVE_TIER_AVX2)
#define TIER_NAME "avx2"
#elif defined(NANOSERVE_TIER_NEON_DOT)
#define TIER_NAME "neon-dot"
#elif defined(NANOSERVE_TIER_NEON)
#define TIER_NAME "neon"
#else
#error "build vector.cpp with one NANOSERVE_TIER_<NAME> defined"
#endif

namespace {

using namespace nanoserve;
using V = Simd;
constexpr int SUB = 16 / V::LANES;  // vectors per 16-output block
// Codes are fetched this many bytes ahead of their use: the hardware prefetcher alone leaves a
// one-row product short of the memory bandwidth.
constexpr int64_t PREFETCH_BYTES = 8192;

// The integer sums of one group for ROWS rows and the outputs of vector `s` of a block:
// hi[r] = sum_k c x_hi, lo[r] = sum_k c x_lo over the group's 32 k. Rows r read x at x + r * K.
// With few rows each sum is split over two accumulators (even and odd chunks), so dependent
// multiply-adds do not wait on each other.
template <bool NIBBLES, int ROWS, bool LO>
inline void group_sums(const uint8_t* wg, int s, const int8_t* hi_x, const int8_t* lo_x, int64_t K,
                       const int32_t* sum_hi, const int32_t* sum_lo, int64_t sum_stride, V::I* hi, V::I* lo) {
  constexpr int CHAINS = ROWS <= 2 ? 2 : 1;
  V::A ah[CHAINS][ROWS], al[CHAINS][ROWS];
  for (int c = 0; c < CHAINS; ++c) {
    for (int r = 0; r < ROWS; ++r) ah[c][r] = al[c][r] = V::azero();
  }
  if constexpr (NIBBLES) {
    for (int j = 0; j < 4; ++j) {
      const V::C b = V::load_codes(wg + 64 * j + 4 * V::LANES * s);
      const V::C low = V::low_nibbles(b), high = V::high_nibbles(b);
      const int c = j % CHAINS;
      for (int r = 0; r < ROWS; ++r) {
        ah[c][r] = V::dot_nibbles(ah[c][r], low, hi_x + r * K + 8 * j);
        ah[c][r] = V::dot_nibbles(ah[c][r], high, hi_x + r * K + 8 * j + 4);
        if constexpr (LO) {
          al[c][r] = V::dot_nibbles(al[c][r], low, lo_x + r * K + 8 * j);
          al[c][r] = V::dot_nibbles(al[c][r], high, lo_x + r * K + 8 * j + 4);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      hi[r] = V::finish_nibbles(ah[0][r]);
      lo[r] = V::finish_nibbles(al[0][r]);
      if constexpr (CHAINS == 2) {
        hi[r] = V::iadd(hi[r], V::finish_nibbles(ah[1][r]));
        lo[r] = V::iadd(lo[r], V::finish_nibbles(al[1][r]));
      }
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      const V::C b = V::flip(V::load_codes(wg + 64 * j + 4 * V::LANES * s));
      const int c = j % CHAINS;
      for (int r = 0; r < ROWS; ++r) {
        ah[c][r] = V::dot_bytes(ah[c][r], b, hi_x + r * K + 4 * j);
        if constexpr (LO) al[c][r] = V::dot_bytes(al[c][r], b, lo_x + r * K + 4 * j);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      hi[r] = V::finish_bytes(ah[0][r]);
      lo[r] = V::finish_bytes(al[0][r]);
      if constexpr (CHAINS == 2) {
        hi[r] = V::iadd(hi[r], V::finish_bytes(ah[1][r]));
        lo[r] = V::iadd(lo[r], V::finish_bytes(al[1][r]));
      }
      if constexpr (!V::UNSIGNED_BYTES) {  // the codes were multiplied as c - 128
        hi[r] = V::iadd(hi[r], V::iset1(128 * sum_hi[r * sum_stride]));
        if constexpr (LO) lo[r] = V::iadd(lo[r], V::iset1(128 * sum_lo[r * sum_stride]));
      }
    }
  }
}

// One block of 16 outputs for ROWS rows (row stride of out: ldo).
template <bool NIBBLES, int ROWS>
void block16(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int8_t* xq, int64_t lo_offset,
             const float* xd, const float* xs, const int32_t* xsum, int64_t xsum_lo_offset, void* out, bool out_bf16,
             int64_t ldo) {
  constexpr int64_t GROUP_BYTES = NIBBLES ? 256 : 512;
  const int64_t G = K / GROUP;
  V::F acc[SUB][ROWS];
  for (int s = 0; s < SUB; ++s) {
    for (int r = 0; r < ROWS; ++r) acc[s][r] = V::fzero();
  }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * GROUP_BYTES;
    // A prefetch is a hint: past the end of the weights it fetches nothing and cannot fault.
    for (int64_t l = 0; l < GROUP_BYTES; l += 64) __builtin_prefetch(wg + PREFETCH_BYTES + l);
    __builtin_prefetch(reinterpret_cast<const char*>(d + 16 * g) + PREFETCH_BYTES * 32 / GROUP_BYTES);
    __builtin_prefetch(reinterpret_cast<const char*>(m + 16 * g) + PREFETCH_BYTES * 32 / GROUP_BYTES);
    for (int s = 0; s < SUB; ++s) {
      V::I hi[ROWS], lo[ROWS];
      group_sums<NIBBLES, ROWS, true>(wg, s, xq + g * GROUP, xq + lo_offset + g * GROUP, K, xsum + g,
                                      xsum + xsum_lo_offset + g, G, hi, lo);
      const V::F dv = V::load_fp16(d + 16 * g + V::LANES * s), mv = V::load_fp16(m + 16 * g + V::LANES * s);
      for (int r = 0; r < ROWS; ++r) {
        const V::F dot = V::to_float(V::iadd(V::times254(hi[r]), lo[r]));
        acc[s][r] = V::fma(dot, V::mul(dv, V::set1(xd[r * G + g])), acc[s][r]);
        acc[s][r] = V::fma(mv, V::set1(xs[r * G + g]), acc[s][r]);
      }
    }
  }
  for (int s = 0; s < SUB; ++s) {
    for (int r = 0; r < ROWS; ++r) {
      float lanes[V::LANES];
      V::store(lanes, acc[s][r]);
      for (int i = 0; i < V::LANES; ++i) store_float(out, r * ldo + V::LANES * s + i, lanes[i], out_bf16);
    }
  }
}

template <bool NIBBLES, int ROWS = V::MAX_ROWS>
void rows_block(int rows, const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, const int8_t* xq,
                int64_t lo_offset, const float* xd, const float* xs, const int32_t* xsum, int64_t xsum_lo_offset,
                void* out, bool out_bf16, int64_t ldo) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) {
      return rows_block<NIBBLES, ROWS - 1>(rows, w, d, m, K, xq, lo_offset, xd, xs, xsum, xsum_lo_offset, out,
                                           out_bf16, ldo);
    }
  }
  block16<NIBBLES, ROWS>(w, d, m, K, xq, lo_offset, xd, xs, xsum, xsum_lo_offset, out, out_bf16, ldo);
}

// Blocks outermost: a block's codes (16 x K) are read from memory once and stay in cache while
// every chunk of MAX_ROWS rows multiplies them.
template <bool NIBBLES>
void group_mm_typed(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, int64_t b0,
                    int64_t b1, int64_t M, const int8_t* xq, const float* xd, const float* xs, const int32_t* xsum,
                    void* out, bool out_bf16) {
  const int64_t G = K / GROUP, block_bytes = 16 * K / (NIBBLES ? 2 : 1), size = out_bf16 ? 2 : 4;
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r = 0; r < M; r += V::MAX_ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(V::MAX_ROWS, M - r));
      rows_block<NIBBLES>(rows, w + b * block_bytes, d + b * G * 16, m + b * G * 16, K, xq + r * K, M * K,
                          xd + r * G, xs + r * G, xsum + r * G, M * G,
                          static_cast<char*>(out) + (r * N + 16 * b) * size, out_bf16, N);
    }
  }
}

void group_mm(int32_t nibbles, const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K,
              int64_t b0, int64_t b1, int64_t M, const int8_t* xq, const float* xd, const float* xs,
              const int32_t* xsum, void* out, int32_t out_bf16) {
  if (nibbles) group_mm_typed<true>(w, d, m, N, K, b0, b1, M, xq, xd, xs, xsum, out, out_bf16);
  else group_mm_typed<false>(w, d, m, N, K, b0, b1, M, xq, xd, xs, xsum, out, out_bf16);
}

template <bool NIBBLES>
void group_dots_typed(const uint8_t* w, int64_t N, int64_t K, const int8_t* x, int32_t* out) {
  const int64_t G = K / GROUP, block_bytes = 16 * K / (NIBBLES ? 2 : 1);
  for (int64_t b = 0; b < N / 16; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      int32_t sum = 0;  // the x codes' sum for the byte tiers' flip
      for (int64_t k = 0; k < GROUP; ++k) sum += x[g * GROUP + k];
      for (int s = 0; s < SUB; ++s) {
        V::I hi[1], lo[1];
        group_sums<NIBBLES, 1, false>(w + b * block_bytes + g * (NIBBLES ? 256 : 512), s, x + g * GROUP, nullptr,
                                      K, &sum, nullptr, 0, hi, lo);
        int32_t lanes[V::LANES];
        V::istore(lanes, hi[0]);
        for (int i = 0; i < V::LANES; ++i) out[(16 * b + V::LANES * s + i) * G + g] = lanes[i];
      }
    }
  }
}

void group_dots(int32_t nibbles, const uint8_t* w, int64_t N, int64_t K, const int8_t* x, int32_t* out) {
  if (nibbles) group_dots_typed<true>(w, N, K, x, out);
  else group_dots_typed<false>(w, N, K, x, out);
}

template <typename E>
void attend_typed(const E* q, int64_t q_stride, const E* k_base, const E* v_base, int64_t cache_stride,
                  const int64_t* slots, int64_t len, int64_t group, int64_t D, float scale, E* out,
                  int64_t out_stride, float* scratch) {
  constexpr bool BF16 = sizeof(E) == 2;
  const int64_t C = D / V::LANES, padded = (len + V::LANES - 1) / V::LANES * V::LANES;
  float* qf = scratch;                  // [group, D], q * scale
  float* acc = qf + group * D;          // [group, D]
  float* scores = acc + group * D;      // [group, padded]
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < C; ++c) {
      V::store(qf + g * D + V::LANES * c, V::mul(V::load(q + g * q_stride + V::LANES * c), V::set1(scale)));
      V::store(acc + g * D + V::LANES * c, V::fzero());
    }
  }
  constexpr int64_t AHEAD = 8;  // cells are scattered over the cache: fetch a few ahead
  for (int64_t t = 0; t < len; ++t) {
    if (t + AHEAD < len) __builtin_prefetch(k_base + slots[t + AHEAD] * cache_stride);
    const E* k = k_base + slots[t] * cache_stride;
    for (int64_t g = 0; g < group; ++g) {
      V::F sum = V::fzero();
      for (int64_t c = 0; c < C; ++c) sum = V::fma(V::load(qf + g * D + V::LANES * c), V::load(k + V::LANES * c), sum);
      scores[g * padded + t] = V::hsum(sum);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * padded;
    const float top = *std::max_element(row, row + len);
    const int64_t whole = len / V::LANES * V::LANES;
    V::F sum = V::fzero();
    for (int64_t t = 0; t < whole; t += V::LANES) {
      const V::F e = V::exp_nonpositive(V::sub(V::load(row + t), V::set1(top)));
      V::store(row + t, e);
      sum = V::add(sum, e);
    }
    float total = V::hsum(sum);
    for (int64_t t = whole; t < len; ++t) total += row[t] = std::exp(row[t] - top);
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) row[t] *= inv;
  }
  for (int64_t t = 0; t < len; ++t) {
    if (t + AHEAD < len) __builtin_prefetch(v_base + slots[t + AHEAD] * cache_stride);
    const E* v = v_base + slots[t] * cache_stride;
    for (int64_t c = 0; c < C; ++c) {
      const V::F vc = V::load(v + V::LANES * c);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * D + V::LANES * c;
        V::store(a, V::fma(V::set1(scores[g * padded + t]), vc, V::load(a)));
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t c = 0; c < D; ++c) {
      if constexpr (BF16) out[g * out_stride + c] = float_to_bf16(acc[g * D + c]);
      else out[g * out_stride + c] = acc[g * D + c];
    }
  }
}

void attend(const void* q, int64_t q_stride, const void* k_base, const void* v_base, int64_t cache_stride,
            const int64_t* slots, int64_t len, int64_t group, int64_t D, float scale, void* out, int64_t out_stride,
            int32_t bf16, float* scratch) {
  if (bf16) {
    attend_typed(static_cast<const uint16_t*>(q), q_stride, static_cast<const uint16_t*>(k_base),
                 static_cast<const uint16_t*>(v_base), cache_stride, slots, len, group, D, scale,
                 static_cast<uint16_t*>(out), out_stride, scratch);
  } else {
    attend_typed(static_cast<const float*>(q), q_stride, static_cast<const float*>(k_base),
                 static_cast<const float*>(v_base), cache_stride, slots, len, group, D, scale,
                 static_cast<float*>(out), out_stride, scratch);
  }
}

const nanoserve_kernel_table TABLE = {NANOSERVE_KERNEL_ABI, TIER_NAME, quantize_rows_portable, group_mm, group_dots,
                                      attend, dequantize_portable,
                                      dequantize_rows_portable};

}  // namespace

extern "C" const nanoserve_kernel_table* NANOSERVE_ENTRY(void) { return &TABLE; }
