// The portable scalar tier: plain C++, no intrinsics, the reference every other tier is tested
// against (integer group sums exactly, outputs within the format's tolerance). It runs where no
// vector tier does, and under NANOSERVE_CPU_KERNELS=scalar.
#include <algorithm>
#include <vector>

#include "common.h"

namespace {

using namespace nanoserve;

// Two int8 codes per activation: hi = round(x / coarse) with coarse = max |x| / 127, lo = round
// of the remainder / fine with fine = coarse / 254, so |x - fine * (254 hi + lo)| <= fine / 2 =
// max |x| / 64516, finer than bf16's own rounding. Plain IEEE operations in a fixed order, built
// without contraction (-ffp-contract=off): vector.cpp does the same operations in the same
// order, so every tier writes the same codes for the same x.
template <bool BF16>
inline void quantize_rows_typed(const void* x, int64_t M, int64_t K, int64_t row_begin, int64_t row_end, int8_t* xq,
                                float* xd, float* xs, int32_t* xsum) {
  const int64_t G = K / GROUP;
  for (int64_t i = row_begin * G; i < row_end * G; ++i) {
    float v[GROUP], hi[GROUP], lo[GROUP];
    for (int64_t k = 0; k < GROUP; ++k) {
      v[k] = BF16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i * GROUP + k]) : static_cast<const float*>(x)[i * GROUP + k];
    }
    float amax = 0.f;
    for (int64_t k = 0; k < GROUP; ++k) {
      const float a = v[k] < 0.f ? -v[k] : v[k];
      amax = a > amax ? a : amax;
    }
    const GroupScales sc = group_scales(amax);
    for (int64_t k = 0; k < GROUP; ++k) {
      const float h = __builtin_rintf(v[k] * sc.inv_coarse);  // ties to even
      hi[k] = h > 127.f ? 127.f : (h < -127.f ? -127.f : h);
      const float product = hi[k] * sc.coarse;
      const float l = __builtin_rintf((v[k] - product) * sc.inv_fine);
      lo[k] = l > 127.f ? 127.f : (l < -127.f ? -127.f : l);
    }
    int32_t sum_hi[2] = {0, 0}, sum_lo[2] = {0, 0};
    for (int64_t k = 0; k < GROUP; ++k) {
      const int32_t h = static_cast<int32_t>(hi[k]), l = static_cast<int32_t>(lo[k]);
      xq[x_group_at(i, G) + k] = static_cast<int8_t>(h);
      xq[M * x_row_stride(K) + x_group_at(i, G) + k] = static_cast<int8_t>(l);
      sum_hi[k / 16] += h;
      sum_lo[k / 16] += l;
    }
    store_group(i, M, G, sum_hi, sum_lo, sc.fine, xd, xs, xsum);
  }
}

// One int8 code per activation (x_bits 8): per half group of 16, hi = round(x / step) with the
// half's step (half_scales), as the hi codes above are rounded.
template <bool BF16>
inline void quantize_halves_typed(const void* x, int64_t M, int64_t K, int64_t row_begin, int64_t row_end, int8_t* xq,
                                  float* xd, float* xs, int32_t* xsum) {
  const int64_t G = K / GROUP;
  for (int64_t group = row_begin * G; group < row_end * G; ++group) {  // its halves i = 2 group, 2 group + 1
    float v[32];
    float amax[2] = {0.f, 0.f};
    for (int64_t k = 0; k < 32; ++k) {
      v[k] = BF16 ? bf16_to_float(static_cast<const uint16_t*>(x)[group * 32 + k])
                  : static_cast<const float*>(x)[group * 32 + k];
      const float a = v[k] < 0.f ? -v[k] : v[k];
      amax[k / 16] = a > amax[k / 16] ? a : amax[k / 16];
    }
    const float group_max = amax[0] > amax[1] ? amax[0] : amax[1];
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t i = 2 * group + h;
      const GroupScales sc = half_scales(amax[h], group_max);
      int32_t sum = 0;
      for (int64_t k = 0; k < 16; ++k) {
        const float q = __builtin_rintf(v[16 * h + k] * sc.inv_coarse);
        const int32_t code = static_cast<int32_t>(q > 127.f ? 127.f : (q < -127.f ? -127.f : q));
        xq[x_half_at(i, G) + k] = static_cast<int8_t>(code);
        sum += code;
      }
      store_half(i, M, G, sum, sc.coarse, xq, xd, xs, xsum);
    }
  }
}

void quantize_rows(const void* x, int32_t x_bf16, int64_t M, int64_t K, int64_t row_begin, int64_t row_end,
                   int32_t x_bits, int8_t* xq, float* xd, float* xs, int32_t* xsum) {
  if (x_bits == 8) {
    if (x_bf16) quantize_halves_typed<true>(x, M, K, row_begin, row_end, xq, xd, xs, xsum);
    else quantize_halves_typed<false>(x, M, K, row_begin, row_end, xq, xd, xs, xsum);
  } else if (x_bf16) {
    quantize_rows_typed<true>(x, M, K, row_begin, row_end, xq, xd, xs, xsum);
  } else {
    quantize_rows_typed<false>(x, M, K, row_begin, row_end, xq, xd, xs, xsum);
  }
}

void group_dots(nanoserve_format f, const uint8_t* w, int64_t N, int64_t K, const int8_t* x, int32_t* out) {
  const int64_t G = K / GROUP, bytes_per_group = group_bytes(f.bits), H = K / f.group;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h * f.group / GROUP;
      const uint8_t* wg = w + ((n / 16) * G + g) * bytes_per_group;
      int32_t sum = 0;
      for (int64_t k = h * f.group - g * GROUP; k < (h + 1) * f.group - g * GROUP; ++k) {
        sum += code_value(f.table, code_in_group(wg, f.bits, n % 16, k)) * x[g * GROUP + k];
      }
      out[n * H + h] = sum;
    }
  }
}

// Per group of 32 and scale group h within it (one, or two halves of 16), the integer sums of
// the codes (a table's values) with the activation codes, then acc += d * (activations' dot) + m
// * xs over h's k (m = -zero_point * d in a symmetric format; none with a table). The dot is xd
// * (254 dot_hi + dot_lo) with x_bits 16, and with 8 each half's dot_hi times its own step. The
// minimum meets the activations as rounded (xs): sum_k (d c + m) x_q, whose error (d c + m) (x_q
// - x) is centred where the exact sum's, d c (x_q - x), is not (c >= 0).
void group_mm(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t N, int64_t K,
              int64_t block_begin, int64_t block_end, int64_t M, const int8_t* xq, const float* xd, const float* xs,
              int32_t x_bits, void* out, int32_t out_bf16) {
  const int64_t G = K / GROUP, bytes_per_group = group_bytes(f.bits), per = GROUP / f.group;
  std::vector<float> acc(16 * M);
  int32_t codes[16][GROUP];
  for (int64_t b = block_begin; b < block_end; ++b) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = w + (b * G + g) * bytes_per_group;
      for (int64_t r = 0; r < 16; ++r) {
        for (int64_t k = 0; k < GROUP; ++k) codes[r][k] = code_value(f.table, code_in_group(wg, f.bits, r, k));
      }
      for (int64_t row = 0; row < M; ++row) {
        const int8_t* hi = xq + row * x_row_stride(K) + g * GROUP;
        const int8_t* lo = hi + M * x_row_stride(K);
        const float* halves = xs + row * 2 * G + 2 * g;
        for (int64_t h = 0; h < per; ++h) {
          // the activations' sum over this scale group: one half of 16, or both
          const float x_sum = per == 2 ? halves[h] : halves[0] + halves[1];
          for (int64_t r = 0; r < 16; ++r) {
            int32_t dot[2] = {0, 0}, dot_lo = 0;  // hi's per half of 16
            for (int64_t k = h * f.group; k < (h + 1) * f.group; ++k) {
              dot[k / 16] += codes[r][k] * hi[k];
              dot_lo += codes[r][k] * lo[k];
            }
            const int64_t at = ((b * G + g) * per + h) * 16 + r;
            const float d_at = load_scale(d, at, f.scale_kind, f.group);
            const float low = f.table ? 0.f
                              : f.zero_point ? -static_cast<float>(f.zero_point) * d_at
                                             : load_scale(m, at, f.scale_kind, f.group);
            float x_dot;
            if (x_bits == 16) {
              x_dot = static_cast<float>(254 * (dot[0] + dot[1]) + dot_lo) * xd[row * G + g];
            } else {
              const float* steps = xd + row * 2 * G + 2 * g;
              x_dot = per == 2 ? static_cast<float>(dot[h]) * steps[h]
                               : static_cast<float>(dot[0]) * steps[0] + static_cast<float>(dot[1]) * steps[1];
            }
            acc[row * 16 + r] += x_dot * d_at;
            acc[row * 16 + r] += low * x_sum;
          }
        }
      }
    }
    for (int64_t row = 0; row < M; ++row) {
      for (int64_t r = 0; r < 16; ++r) store_float(out, row * N + 16 * b + r, acc[row * 16 + r], out_bf16);
    }
  }
}

// Each pair alone: its activation row copied out and multiplied by its expert's block as
// group_mm's one row.
void experts_mm(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t w_stride,
                int64_t scale_stride, int64_t N, int64_t K, int64_t rows, int64_t top_k, const int64_t* ids,
                int32_t x_per_pair, const int8_t* xq, const float* xd, const float* xs,
                int32_t x_bits, int64_t task_begin, int64_t task_end, void* out, int32_t out_bf16) {
  const ExpertGroups groups(ids, rows * top_k);
  const int64_t blocks = N / 16, G = K / GROUP, M = x_per_pair ? rows * top_k : rows, size = out_bf16 ? 2 : 4;
  const int64_t S = x_row_stride(K);
  std::vector<int8_t> q(2 * S);
  const int64_t steps = x_bits == 8 ? 2 * G : G;  // xd's per row
  std::vector<float> q_d(steps), q_s(2 * G);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t j = task / blocks, b = task % blocks, e = groups.experts[j];
    const void* d_e = static_cast<const char*>(d) + e * scale_stride;
    const void* m_e = m ? static_cast<const char*>(m) + e * scale_stride : m;
    for (int64_t i = groups.starts[j]; i < groups.starts[j + 1]; ++i) {
      const int64_t p = groups.pairs[i], x = x_per_pair ? p : p / top_k;
      std::copy(xq + x * S, xq + x * S + K, q.begin());
      std::copy(xq + M * S + x * S, xq + M * S + x * S + K, q.begin() + S);
      std::copy(xd + x * steps, xd + (x + 1) * steps, q_d.begin());
      std::copy(xs + 2 * x * G, xs + 2 * (x + 1) * G, q_s.begin());
      group_mm(f, w + e * w_stride, d_e, m_e, N, K, b, b + 1, 1, q.data(), q_d.data(), q_s.data(),
               x_bits, static_cast<char*>(out) + p * N * size, out_bf16);
    }
  }
}

// One K/V head's query heads (attend, head by head).
void attend_head(const void* q, int64_t q_stride, nanoserve_cells k, nanoserve_cells v, const int64_t* slots,
                 int64_t len, int64_t group, int64_t D, float scale, void* out, int64_t out_stride, int32_t bf16,
                 float* scratch, const float* sinks, float* lse) {
  float* scores = scratch;             // [len]
  float* acc = scratch + len;          // [D]
  for (int64_t g = 0; g < group; ++g) {
    float top = sinks ? sinks[g] : -INFINITY;
    for (int64_t t = 0; t < len; ++t) {
      float s = 0.f;
      for (int64_t c = 0; c < D; ++c) s += load_float(q, g * q_stride + c, bf16) * scale * load_cell(k, slots[t], c, bf16);
      scores[t] = s;
      top = std::max(top, s);
    }
    float total = sinks ? std::exp(sinks[g] - top) : 0.f;  // the sink's share: no value
    for (int64_t t = 0; t < len; ++t) total += scores[t] = std::exp(scores[t] - top);
    std::fill(acc, acc + D, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      for (int64_t c = 0; c < D; ++c) acc[c] += scores[t] * load_cell(v, slots[t], c, bf16);
    }
    for (int64_t c = 0; c < D; ++c) store_float(out, g * out_stride + c, acc[c] / total, bf16 && !lse);
    if (lse) lse[g] = top + std::log(total);
  }
}

void attend(const void* q, int64_t q_stride, nanoserve_cells k, nanoserve_cells v, const int64_t* slots,
            int64_t len, int64_t heads, int64_t group, int64_t D, float scale, void* out, int64_t out_stride,
            int32_t bf16, float* scratch, const float* sinks, float* lse) {
  const int64_t size = bf16 ? 2 : 4, out_size = bf16 && !lse ? 2 : 4;
  for (int64_t h = 0; h < heads; ++h) {
    attend_head(static_cast<const char*>(q) + h * group * q_stride * size, q_stride, cells_head(k, h, D, bf16),
                cells_head(v, h, D, bf16), slots, len, group, D, scale,
                static_cast<char*>(out) + h * group * out_stride * out_size, out_stride, bf16, scratch,
                sinks ? sinks + h * group : nullptr, lse ? lse + h * group : nullptr);
  }
}

// group_mm's inner product as plain C++: 64 codes times 4 activations a round, into 16 sums.
int64_t dot_peak(int64_t rounds) {
  int32_t codes[64], sums[16] = {};
  for (int i = 0; i < 64; ++i) codes[i] = (i * 37) & 15;
  const int32_t x[4] = {3, -5, 7, -9};
  const int32_t* c = codes;
  for (int64_t i = 0; i < rounds; ++i) {
    asm volatile("" : "+r"(c));  // c may point anywhere now: the codes are read again, not folded
    for (int r = 0; r < 16; ++r) {
      for (int k = 0; k < 4; ++k) sums[r] += c[4 * r + k] * x[k];
    }
  }
  volatile int32_t sink = sums[0] + sums[15];
  (void)sink;
  return rounds * 64;
}

const nanoserve_kernel_table TABLE = {NANOSERVE_KERNEL_ABI, "scalar", quantize_rows, group_mm, group_dots,
                                      attend, dequantize_portable,
                                      dequantize_rows_portable, experts_mm, dot_peak};

}  // namespace

extern "C" const nanoserve_kernel_table* NANOSERVE_ENTRY(void) { return &TABLE; }
