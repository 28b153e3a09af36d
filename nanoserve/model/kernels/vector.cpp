// The vector tiers, one source: built once per tier with NANOSERVE_TIER_<NAME> defined and that
// tier's own instruction flags (nanoserve/model/cpu_kernels.py), never -march=native. The
// algorithm is the scalar reference's (reference.cpp); a tier supplies its vector primitives
// (simd_x86.h, simd_neon.h) and its name.
#include <algorithm>
#include <vector>

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

// A block's codes for one group and one vector of outputs (LANES of the 16), unpacked once:
// codes[j] multiplies the 4 activations at k offset at(j) of the group.
struct GroupCodes {
  V::C codes[8];
  static constexpr int at(bool nibbles, int j) { return nibbles ? 8 * (j / 2) + 4 * (j % 2) : 4 * j; }
};

template <bool NIBBLES>
inline GroupCodes load_group(const uint8_t* wg, int s) {
  GroupCodes c;
  for (int j = 0; j < 8; ++j) {
    if constexpr (NIBBLES) {
      const V::C b = V::load_codes(wg + 64 * (j / 2) + 4 * V::LANES * s);
      c.codes[j] = j % 2 ? V::high_nibbles(b) : V::low_nibbles(b);
    } else {
      c.codes[j] = V::flip(V::load_codes(wg + 64 * j + 4 * V::LANES * s));
    }
  }
  return c;
}

// sum_k c[n, k] x[k] over the group's 32 k for the vector's LANES outputs (x int8 in -127..127;
// x_sum, the sum of x, undoes the byte tiers' flip to signed codes).
// Two accumulators (even and odd j), so that dependent multiply-adds do not wait on each other.
template <bool NIBBLES>
inline V::I group_sum(const GroupCodes& c, const int8_t* x, int32_t x_sum) {
  V::A acc[2] = {V::azero(), V::azero()};
  for (int j = 0; j < 8; ++j) {
    acc[j % 2] = NIBBLES ? V::dot_nibbles(acc[j % 2], c.codes[j], x + GroupCodes::at(NIBBLES, j))
                         : V::dot_bytes(acc[j % 2], c.codes[j], x + GroupCodes::at(NIBBLES, j));
  }
  if constexpr (NIBBLES) return V::iadd(V::finish_nibbles(acc[0]), V::finish_nibbles(acc[1]));
  V::I sum = V::iadd(V::finish_bytes(acc[0]), V::finish_bytes(acc[1]));
  if constexpr (!V::UNSIGNED_BYTES) sum = V::iadd(sum, V::iset1(128 * x_sum));  // multiplied as c - 128
  return sum;
}

// One block of 16 outputs for all M rows, codes-stationary: each (group, vector) of codes is
// unpacked once into registers and multiplied against every row in turn, so the live set is the
// codes and two accumulators whatever the rows (no spills with 16 registers), and the block is
// read from memory once per call. acc [M, 16] collects the rows' fp32 sums.
template <bool NIBBLES>
void block16(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t K, int64_t M, const int8_t* xq,
             const float* xd, const float* xs, const int32_t* xsum, float* acc) {
  constexpr int64_t GROUP_BYTES = NIBBLES ? 256 : 512;
  const int64_t G = K / GROUP;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * GROUP_BYTES;
    // A prefetch is a hint: past the end of the weights it fetches nothing and cannot fault.
    for (int64_t l = 0; l < GROUP_BYTES; l += 64) __builtin_prefetch(wg + PREFETCH_BYTES + l);
    __builtin_prefetch(reinterpret_cast<const char*>(d + 16 * g) + PREFETCH_BYTES * 32 / GROUP_BYTES);
    __builtin_prefetch(reinterpret_cast<const char*>(m + 16 * g) + PREFETCH_BYTES * 32 / GROUP_BYTES);
    for (int s = 0; s < SUB; ++s) {
      const GroupCodes codes = load_group<NIBBLES>(wg, s);
      const V::F dv = V::load_fp16(d + 16 * g + V::LANES * s), mv = V::load_fp16(m + 16 * g + V::LANES * s);
      for (int64_t r = 0; r < M; ++r) {
        const int8_t* hi_x = xq + r * K + g * GROUP;
        const V::I hi = group_sum<NIBBLES>(codes, hi_x, xsum[r * G + g]);
        const V::I lo = group_sum<NIBBLES>(codes, hi_x + M * K, xsum[M * G + r * G + g]);
        const V::F dot = V::to_float(V::iadd(V::times254(hi), lo));
        float* a = acc + r * 16 + V::LANES * s;
        const V::F sum = V::fma(dot, V::mul(dv, V::set1(xd[r * G + g])), V::load(a));
        V::store(a, V::fma(mv, V::set1(xs[r * G + g]), sum));
      }
    }
  }
}

template <bool NIBBLES>
void group_mm_typed(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t N, int64_t K, int64_t b0,
                    int64_t b1, int64_t M, const int8_t* xq, const float* xd, const float* xs, const int32_t* xsum,
                    void* out, bool out_bf16) {
  const int64_t G = K / GROUP, block_bytes = 16 * K / (NIBBLES ? 2 : 1);
  std::vector<float> acc(M * 16);
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(acc.begin(), acc.end(), 0.f);
    block16<NIBBLES>(w + b * block_bytes, d + b * G * 16, m + b * G * 16, K, M, xq, xd, xs, xsum, acc.data());
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t i = 0; i < 16; ++i) store_float(out, r * N + 16 * b + i, acc[r * 16 + i], out_bf16);
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
      int32_t x_sum = 0;
      for (int64_t k = 0; k < GROUP; ++k) x_sum += x[g * GROUP + k];
      for (int s = 0; s < SUB; ++s) {
        const GroupCodes codes = load_group<NIBBLES>(w + b * block_bytes + g * (NIBBLES ? 256 : 512), s);
        int32_t lanes[V::LANES];
        V::istore(lanes, group_sum<NIBBLES>(codes, x + g * GROUP, x_sum));
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
