// Standalone self-test of one vector tier against the scalar reference, no torch: built by
// `make kernels-selftest` for the host's x86 tiers and by `make kernels-arm` with a cross
// compiler for the NEON tiers (run under qemu-user). Prints "N passed, N failed".
//   integer group sums and activation codes: equal exactly;
//   products and attention: within 2^-7 of the largest |output| (bf16) or 1e-5 (fp32).
#include <stdio.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "common.h"

extern "C" const nanoserve_kernel_table* nanoserve_kernels_reference(void);
extern "C" const nanoserve_kernel_table* nanoserve_kernels_tier(void);

namespace {

int passed = 0, failed = 0;
std::mt19937 rng(1234);

void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    printf("FAILED: %s\n", what.c_str());
  }
}

// Random fp16 bits of either sign, magnitudes 2^-5 .. 2^3 (a scale's or a minimum's range).
std::vector<uint16_t> random_fp16(size_t n) {
  std::uniform_int_distribution<int> mant(0, 1023), expo(10, 17), sign(0, 1);
  std::vector<uint16_t> v(n);
  for (auto& h : v) h = static_cast<uint16_t>((sign(rng) << 15) | (expo(rng) << 10) | mant(rng));
  return v;
}

std::vector<float> random_floats(size_t n) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& f : v) f = normal(rng);
  return v;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b, float* scale) {
  float diff = 0.f, top = 0.f;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i])), top = std::max(top, std::fabs(a[i]));
  *scale = top;
  return diff;
}

std::vector<float> as_floats(const std::vector<uint8_t>& raw, bool bf16, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = nanoserve::load_float(raw.data(), i, bf16);
  return out;
}

// Scales or minimums of a format, n of them (of blocks of 16 outputs, K = 256 k): fp16 bits;
// fp32 (a K-quant's exact d * sc, fp16 times a 6-bit integer); super-block records of fp16
// super-scales and int8 multipliers (common.h); or exponent bytes (2^-10 .. 2^3). Magnitudes
// about 2^-5 .. 2^3.
std::vector<uint16_t> random_scales(size_t n, int32_t kind, int64_t group) {
  if (kind == nanoserve::SCALES_FP16) return random_fp16(n);
  if (kind == nanoserve::SCALES_E8M0) {
    std::vector<uint16_t> raw((n + 1) / 2);
    std::uniform_int_distribution<int> exponent(118, 131);
    for (size_t i = 0; i < n; ++i) reinterpret_cast<uint8_t*>(raw.data())[i] = static_cast<uint8_t>(exponent(rng));
    return raw;
  }
  if (kind == nanoserve::SCALES_SUPER) {
    const int64_t records = n / 16 / (256 / group);
    std::vector<uint16_t> raw(records * nanoserve::super_record_bytes(group) / 2);
    std::uniform_int_distribution<int> multiplier(-128, 127);
    for (int64_t i = 0; i < records; ++i) {
      uint16_t* record = raw.data() + i * nanoserve::super_record_bytes(group) / 2;
      const std::vector<uint16_t> supers = random_fp16(16);
      memcpy(record, supers.data(), 32);
      int8_t* multipliers = reinterpret_cast<int8_t*>(record + 16);
      for (int64_t j = 0; j < 16 * (256 / group); ++j) multipliers[j] = static_cast<int8_t>(multiplier(rng) / 16);
    }
    return raw;
  }
  std::vector<uint16_t> bits = random_fp16(n), raw(2 * n);
  std::uniform_int_distribution<int> six(-32, 63);
  for (size_t i = 0; i < n; ++i) {
    const float v = nanoserve::fp16_to_float(bits[i]) * static_cast<float>(six(rng)) / 16.f;
    memcpy(&raw[2 * i], &v, 4);
  }
  return raw;
}

// The code tables the formats carry: none, IQ4_NL's (and IQ4_XS's) and MXFP4's doubled E2M1.
const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t E2M1_TABLE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const int8_t* const TABLES[] = {nullptr, IQ4_TABLE, E2M1_TABLE};

std::string table_name(const int8_t* table) {
  return table == IQ4_TABLE ? " table iq4" : table == E2M1_TABLE ? " table e2m1" : "";
}

// The formats tried: every storage width and group with each kind of scales, minimums held or a
// zero point (2^(bits - 1): Q4_0, Q5_0, Q6_K, Q8_0; 4: Q3_K's 3-bit codes in the 4-bit layout),
// and the 4-bit codes through each table (IQ4_NL, IQ4_XS, MXFP4: no minimums, no zero point).
// Exponent-byte scales with 4-bit codes only (MXFP4's).
std::vector<nanoserve_format> formats() {
  std::vector<nanoserve_format> out;
  for (int32_t bits : {4, 5, 6, 8}) {
    for (int32_t group : {32, 16}) {
      for (int32_t scale_kind : {0, 1, 2, 3}) {
        if (scale_kind == nanoserve::SCALES_E8M0 && bits != 4) continue;
        for (int32_t zero_point : {0, 1 << (bits - 1), 4}) {
          if (zero_point == 4 && bits != 4) continue;
          for (const int8_t* table : TABLES) {
            if (table && (bits != 4 || zero_point != 0)) continue;
            out.push_back({bits, group, scale_kind, zero_point, table});
          }
        }
      }
    }
  }
  return out;
}

void test_products(const nanoserve_kernel_table* ref, const nanoserve_kernel_table* tier, nanoserve_format f,
                   int64_t N, int64_t K, int64_t M, bool bf16) {
  const std::string name = std::string(tier->tier) + " " + std::to_string(f.bits) + "-bit" + table_name(f.table) + " group " +
                           std::to_string(f.group) + " scales " + std::to_string(f.scale_kind) + " " +
                           "zero point " + std::to_string(f.zero_point) + " " + std::to_string(N) + "x" + std::to_string(K) + " rows " + std::to_string(M) +
                           (bf16 ? " bf16" : " fp32");
  const int64_t G = K / 32, H = K / f.group;
  std::uniform_int_distribution<int> byte(0, 255), xcode(-127, 127);
  std::vector<uint8_t> w(N * K * f.bits / 8);  // every byte pattern is a valid set of codes
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  // integer group sums
  std::vector<int8_t> xc(K);
  for (auto& c : xc) c = static_cast<int8_t>(xcode(rng));
  std::vector<int32_t> dots_ref(N * H), dots(N * H);
  ref->group_dots(f, w.data(), N, K, xc.data(), dots_ref.data());
  tier->group_dots(f, w.data(), N, K, xc.data(), dots.data());
  check(dots == dots_ref, name + ": integer group sums");
  // activation codes
  std::vector<float> xf = random_floats(M * K);
  std::vector<uint8_t> x(M * K * (bf16 ? 2 : 4));
  for (int64_t i = 0; i < M * K; ++i) nanoserve::store_float(x.data(), i, xf[i], bf16);
  const int64_t stride = nanoserve::x_row_stride(K);  // rows padded: a padding byte is never written
  std::vector<uint16_t> d = random_scales(N * H, f.scale_kind, f.group), m = random_scales(N * H, f.scale_kind, f.group);
  for (int32_t x_bits : {16, 8}) {
    const std::string bits = " x_bits " + std::to_string(x_bits);
    std::vector<int8_t> xq_ref(2 * M * stride), xq(2 * M * stride);
    std::vector<float> xd_ref(2 * M * G), xs_ref(2 * M * G), xd(2 * M * G), xs(2 * M * G);
    std::vector<int32_t> sum_ref(4 * M * G), sum(4 * M * G);
    ref->quantize_rows(x.data(), bf16, M, K, 0, M, x_bits, xq_ref.data(), xd_ref.data(), xs_ref.data(), sum_ref.data());
    tier->quantize_rows(x.data(), bf16, M, K, 0, M / 2, x_bits, xq.data(), xd.data(), xs.data(), sum.data());
    tier->quantize_rows(x.data(), bf16, M, K, M / 2, M, x_bits, xq.data(), xd.data(), xs.data(), sum.data());
    check(xq == xq_ref && xd == xd_ref && xs == xs_ref && sum == sum_ref, name + bits + ": activation codes");
    // products
    std::vector<uint8_t> out_ref(M * N * 4), out(M * N * 4);
    ref->group_mm(f, w.data(), d.data(), m.data(), N, K, 0, N / 16, M, xq.data(), xd.data(), xs.data(), x_bits,
                  out_ref.data(), bf16);
    // two calls over halves of the blocks, as the glue splits them over threads
    tier->group_mm(f, w.data(), d.data(), m.data(), N, K, 0, N / 32, M, xq.data(), xd.data(), xs.data(), x_bits,
                   out.data(), bf16);
    tier->group_mm(f, w.data(), d.data(), m.data(), N, K, N / 32, N / 16, M, xq.data(), xd.data(), xs.data(),
                   x_bits, out.data(), bf16);
    float scale;
    const float diff = max_abs_diff(as_floats(out_ref, bf16, M * N), as_floats(out, bf16, M * N), &scale);
    check(diff <= (bf16 ? 0x1p-7f : 1e-5f) * scale, name + bits + ": products, max diff " + std::to_string(diff) +
                                                       " of " + std::to_string(scale));
  }
  // the dequantised weight is the same on both
  std::vector<uint8_t> dense_ref(N * K * 4), dense(N * K * 4);
  ref->dequantize(f, w.data(), d.data(), m.data(), K, 0, N / 16, dense_ref.data(), bf16);
  tier->dequantize(f, w.data(), d.data(), m.data(), K, 0, N / 16, dense.data(), bf16);
  check(dense == dense_ref, name + ": dequantised weight");
}

// A step's routing: rows x top_k expert ids of E experts.
struct Routing {
  const char* what;
  int64_t rows, top_k;
  std::vector<int64_t> ids;
};

// Uneven routings of E = 6 experts: one row; every row to expert 1 in slot 0 while experts 3
// and 5 get none; every row to one expert; pairs skipped (negative ids); random ids (duplicates
// within a row too).
std::vector<Routing> routings() {
  std::vector<Routing> out = {{"one row", 1, 3, {4, 0, 2}}, {"one expert", 3, 1, {5, 5, 5}},
                              {"skipped pairs", 3, 2, {-1, 2, 0, -1, 2, 2}}};
  Routing uneven{"uneven", 9, 2, {}};
  for (int64_t r = 0; r < 9; ++r) uneven.ids.push_back(1), uneven.ids.push_back(2 * (r % 3));
  out.push_back(uneven);
  Routing random{"random", 17, 4, {}};
  std::uniform_int_distribution<int64_t> expert(0, 5);
  for (int64_t i = 0; i < 17 * 4; ++i) random.ids.push_back(expert(rng));
  out.push_back(random);
  return out;
}

// experts_mm against the reference, its tasks split over two calls as the glue splits them over
// threads; activations one row per row of the step, or one per pair.
void test_experts(const nanoserve_kernel_table* ref, const nanoserve_kernel_table* tier, nanoserve_format f,
                  int64_t N, int64_t K, const Routing& routing, bool x_per_pair, bool bf16, int32_t x_bits) {
  const std::string name = std::string(tier->tier) + " experts " + std::to_string(f.bits) + "-bit" +
                           table_name(f.table) + " group " +
                           std::to_string(f.group) + " scales " + std::to_string(f.scale_kind) + " zero point " +
                           std::to_string(f.zero_point) + " " + std::to_string(N) + "x" + std::to_string(K) + " " +
                           routing.what + (x_per_pair ? " per pair" : " per row") + (bf16 ? " bf16" : " fp32") +
                           " x_bits " + std::to_string(x_bits);
  const int64_t E = 6, H = K / f.group, G = K / 32, pairs = routing.rows * routing.top_k;
  const int64_t M = x_per_pair ? pairs : routing.rows, w_stride = N * K * f.bits / 8;
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> w(E * w_stride);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  std::vector<uint16_t> d, m;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<uint16_t> de = random_scales(N * H, f.scale_kind, f.group), me = random_scales(N * H, f.scale_kind, f.group);
    d.insert(d.end(), de.begin(), de.end());
    m.insert(m.end(), me.begin(), me.end());
  }
  const int64_t scale_stride = 2 * static_cast<int64_t>(d.size()) / E;
  std::vector<float> xf = random_floats(M * K);
  std::vector<uint8_t> x(M * K * (bf16 ? 2 : 4));
  for (int64_t i = 0; i < M * K; ++i) nanoserve::store_float(x.data(), i, xf[i], bf16);
  const int64_t stride = nanoserve::x_row_stride(K);
  std::vector<int8_t> xq(2 * M * stride);
  std::vector<float> xd(2 * M * G), xs(2 * M * G);
  std::vector<int32_t> sum(4 * M * G);
  ref->quantize_rows(x.data(), bf16, M, K, 0, M, x_bits, xq.data(), xd.data(), xs.data(), sum.data());
  const int64_t steps = x_bits == 8 ? 2 * G : G;  // xd's per row
  const int64_t tasks = static_cast<int64_t>(nanoserve::ExpertGroups(routing.ids.data(), pairs).experts.size()) * (N / 16);
  std::vector<uint8_t> out_ref(pairs * N * 4), out(pairs * N * 4);
  ref->experts_mm(f, w.data(), d.data(), m.data(), w_stride, scale_stride, N, K, routing.rows, routing.top_k,
                  routing.ids.data(), x_per_pair, xq.data(), xd.data(), xs.data(), x_bits, 0, tasks,
                  out_ref.data(), bf16);
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, tasks / 2}, {tasks / 2, tasks}}) {
    tier->experts_mm(f, w.data(), d.data(), m.data(), w_stride, scale_stride, N, K, routing.rows, routing.top_k,
                     routing.ids.data(), x_per_pair, xq.data(), xd.data(), xs.data(), x_bits, begin, end,
                     out.data(), bf16);
  }
  float scale;
  const float diff = max_abs_diff(as_floats(out_ref, bf16, pairs * N), as_floats(out, bf16, pairs * N), &scale);
  check(scale > 0.f && diff <= (bf16 ? 0x1p-7f : 1e-5f) * scale,
        name + ": products, max diff " + std::to_string(diff) + " of " + std::to_string(scale));
  // the reference itself: pair p is its expert's weight times its row, as group_mm's one row;
  // a skipped pair's output is left as it was (zeros)
  bool alone = true;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = routing.ids[p], row = x_per_pair ? p : p / routing.top_k;
    if (e < 0) {
      const auto first = out.begin() + p * N * (bf16 ? 2 : 4);
      alone = alone && std::all_of(first, first + N * (bf16 ? 2 : 4), [](uint8_t b) { return b == 0; });
      continue;
    }
    std::vector<int8_t> q(2 * stride);
    std::copy(xq.begin() + row * stride, xq.begin() + row * stride + K, q.begin());
    std::copy(xq.begin() + (M + row) * stride, xq.begin() + (M + row) * stride + K, q.begin() + stride);
    std::vector<uint8_t> one(N * 4);
    ref->group_mm(f, w.data() + e * w_stride, reinterpret_cast<const char*>(d.data()) + e * scale_stride,
                  reinterpret_cast<const char*>(m.data()) + e * scale_stride, N, K, 0, N / 16, 1, q.data(),
                  xd.data() + row * steps, xs.data() + 2 * row * G, x_bits, one.data(), bf16);
    alone = alone && std::equal(one.begin(), one.begin() + N * (bf16 ? 2 : 4), out_ref.begin() + p * N * (bf16 ? 2 : 4));
  }
  check(alone, name + ": the reference is each pair through group_mm alone");
}

// One layer's cells of KV heads for the attention tests: dense (q's type) or q8_0 (int8 codes in
// -127..127 and positive fp16 steps of 2^-7 .. 2^-5, so values stay near the dense ones' range).
struct TestCells {
  std::vector<uint8_t> data;
  std::vector<uint16_t> steps;
  nanoserve_cells view(int64_t h, int64_t KV, int64_t D, int64_t size) const {
    const bool q8 = !steps.empty();
    return {data.data() + h * D * (q8 ? 1 : size), q8 ? steps.data() + h * (D / 32) : nullptr, KV * D, KV * (D / 32)};
  }
};

TestCells test_cells(int64_t cells, int64_t KV, int64_t D, bool bf16, bool q8) {
  TestCells out;
  if (!q8) {
    const std::vector<float> f = random_floats(cells * KV * D);
    out.data.resize(f.size() * (bf16 ? 2 : 4));
    for (size_t i = 0; i < f.size(); ++i) nanoserve::store_float(out.data.data(), i, f[i], bf16);
    return out;
  }
  std::uniform_int_distribution<int> code(-127, 127), mant(0, 1023), expo(8, 10);
  out.data.resize(cells * KV * D);
  for (auto& c : out.data) c = static_cast<uint8_t>(static_cast<int8_t>(code(rng)));
  out.steps.resize(cells * KV * (D / 32));
  for (auto& h : out.steps) h = static_cast<uint16_t>((expo(rng) << 10) | mant(rng));
  return out;
}

void test_attention(const nanoserve_kernel_table* ref, const nanoserve_kernel_table* tier, int64_t heads,
                    int64_t group, int64_t D, int64_t len, bool bf16, bool with_sinks, bool k_q8, bool v_q8) {
  const std::string name = std::string(tier->tier) + " attention heads " + std::to_string(heads) + " group " +
                           std::to_string(group) + " D " + std::to_string(D) + " len " + std::to_string(len) +
                           (bf16 ? " bf16" : " fp32") + (with_sinks ? " sinks" : "") + (k_q8 ? " k q8_0" : "") +
                           (v_q8 ? " v q8_0" : "");
  const int64_t KV = 3, cells = len + 7, size = bf16 ? 2 : 4, HG = heads * group;
  std::vector<float> qf = random_floats(HG * D);
  std::vector<uint8_t> q(HG * D * size);
  for (size_t i = 0; i < qf.size(); ++i) nanoserve::store_float(q.data(), i, qf[i], bf16);
  const TestCells k = test_cells(cells, KV, D, bf16, k_q8), v = test_cells(cells, KV, D, bf16, v_q8);
  std::vector<int64_t> slots(len);
  for (int64_t t = 0; t < len; ++t) slots[t] = (t * 5 + 3) % cells;
  std::vector<float> scratch(HG * (2 * D + len + 16));
  std::vector<uint8_t> out_ref(HG * D * size), out(HG * D * size);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> sinks = random_floats(HG);  // a sink above and below the scores alike
  for (int64_t i = 0; i < HG; ++i) sinks[i] *= 4.f;
  const float* sink_p = with_sinks ? sinks.data() : nullptr;
  // K/V heads 1 .. heads of each cell
  const nanoserve_cells k1 = k.view(1, KV, D, size), v1 = v.view(1, KV, D, size);
  ref->attend(q.data(), D, k1, v1, slots.data(), len, heads, group, D, scale, out_ref.data(), D, bf16, scratch.data(),
              sink_p, nullptr);
  tier->attend(q.data(), D, k1, v1, slots.data(), len, heads, group, D, scale, out.data(), D, bf16, scratch.data(),
               sink_p, nullptr);
  float top;
  const float diff = max_abs_diff(as_floats(out_ref, bf16, HG * D), as_floats(out, bf16, HG * D), &top);
  check(diff <= (bf16 ? 0x1p-7f : 1e-5f) * std::max(top, 1.f), name + ": max diff " + std::to_string(diff));
  // A part of a longer read: fp32 out whatever q's type, and each query head's log-sum-exp.
  std::vector<float> part_ref(HG * D), part(HG * D), lse_ref(HG), lse(HG);
  ref->attend(q.data(), D, k1, v1, slots.data(), len, heads, group, D, scale, part_ref.data(), D, bf16,
              scratch.data(), sink_p, lse_ref.data());
  tier->attend(q.data(), D, k1, v1, slots.data(), len, heads, group, D, scale, part.data(), D, bf16, scratch.data(),
               sink_p, lse.data());
  const float part_diff = max_abs_diff(part_ref, part, &top);
  check(part_diff <= 1e-5f * std::max(top, 1.f), name + " (a part): max diff " + std::to_string(part_diff));
  float lse_top;
  const float lse_diff = max_abs_diff(lse_ref, lse, &lse_top);
  check(lse_diff <= 1e-5f * std::max(lse_top, 1.f), name + " (a part): log-sum-exp diff " + std::to_string(lse_diff));
}

}  // namespace

// Whether this CPU runs the tier under test (checked before any of its code runs).
bool host_runs_tier() {
#if defined(NANOSERVE_TIER_AVX512_VNNI)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#elif defined(NANOSERVE_TIER_AVX_VNNI)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#elif defined(NANOSERVE_TIER_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return true;  // NEON: run where the build targets (under qemu-user, -cpu max has every extension)
#endif
}

int main() {
  if (!host_runs_tier()) {
    printf("skipped: this CPU lacks the tier's instructions\n");
    return 0;
  }
  const nanoserve_kernel_table* ref = nanoserve_kernels_reference();
  const nanoserve_kernel_table* tier = nanoserve_kernels_tier();
  check(ref->abi == NANOSERVE_KERNEL_ABI && tier->abi == NANOSERVE_KERNEL_ABI, "kernel ABI");
  // the multiply-adds a run of dots did: in proportion to its rounds (64 a round in the reference)
  check(tier->dot_peak(3) > 0 && tier->dot_peak(6) == 2 * tier->dot_peak(3) && ref->dot_peak(2) == 128,
        "dot_peak counts its multiply-adds");
  const int64_t shapes[][2] = {{16, 32}, {48, 96}, {64, 576}, {48, 256}, {32, 1536}};
  for (bool bf16 : {true, false}) {
    for (const nanoserve_format& format : formats()) {
      for (const auto& s : shapes) {
        if (format.scale_kind == nanoserve::SCALES_SUPER && s[1] % 256) continue;  // super-blocks of 256
        for (int64_t rows : {1, 2, 3, 4, 5, 8, 9, 17}) test_products(ref, tier, format, s[0], s[1], rows, bf16);
      }
    }
    for (const nanoserve_format& format : formats()) {  // every format again, through the experts' products
      for (const Routing& routing : routings()) {
        for (bool x_per_pair : {false, true}) {
          for (int32_t x_bits : {16, 8}) test_experts(ref, tier, format, 48, 256, routing, x_per_pair, bf16, x_bits);
        }
      }
    }
    // Groups of 1-2 (cells read in fours and pairs), 3-8 (query heads four at a time, a remainder);
    // heads of 1 to 16 vectors (kept in registers 4 at a time on AVX-512, 2 on AVX2).
    // One K/V head or two of a cell's three at once; runs of value cells whole and cut short (len).
    for (int64_t heads : {1, 2}) {
      for (int64_t group : {1, 2, 3, 4, 5, 8}) {
        for (int64_t D : {16, 48, 64, 80, 128, 256}) {
          for (int64_t len : {1, 7, 16, 33, 300}) {
            for (bool with_sinks : {false, true}) {
              for (int cells = 0; cells < (D % 32 ? 1 : 4); ++cells) {  // K, V: dense or q8_0 (D a multiple of 32)
                test_attention(ref, tier, heads, group, D, len, bf16, with_sinks, cells & 1, cells & 2);
              }
            }
          }
        }
      }
    }
  }
  printf("%s: %d passed, %d failed\n", tier->tier, passed, failed);
  return failed ? 1 : 0;
}
