// The torch side of nanoserve's CPU kernels: custom ops that check their tensors, split the work
// over torch's threads and call one tier's kernel table (kernels/common.h). Built with no
// instruction-set flags, so it loads on any CPU; the tiers are shared libraries of their own,
// each built with its own flags and loaded (load_tier) only where cpu_features says it can run.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <dlfcn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common.h"

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace {

// Loaded tiers, by handle. A library, once loaded, stays for the process (as torch's own do).
std::mutex tiers_mutex;
std::vector<const nanoserve_kernel_table*> tiers;

const nanoserve_kernel_table& tier_of(int64_t handle) {
  std::lock_guard<std::mutex> lock(tiers_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(tiers.size()), "no kernel tier loaded as ", handle);
  return *tiers[handle];
}

int64_t load_tier(const std::string& path) {
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(library, "cannot load kernel tier ", path, ": ", dlerror());
  auto entry = reinterpret_cast<const nanoserve_kernel_table* (*)(void)>(dlsym(library, "nanoserve_kernels"));
  TORCH_CHECK(entry, "kernel tier ", path, " exports no nanoserve_kernels");
  const nanoserve_kernel_table* table = entry();
  TORCH_CHECK(table->abi == NANOSERVE_KERNEL_ABI, "kernel tier ", path, " has ABI ", table->abi, ", expected ",
              NANOSERVE_KERNEL_ABI);
  std::lock_guard<std::mutex> lock(tiers_mutex);
  tiers.push_back(table);
  return static_cast<int64_t>(tiers.size()) - 1;
}

std::string tier_name(int64_t handle) { return tier_of(handle).tier; }

// The tier's dot_peak on every intra-op thread at once, `rounds` each: the multiply-adds done.
int64_t dot_peak(int64_t rounds, int64_t handle) {
  TORCH_CHECK(rounds > 0, "rounds must be positive, got ", rounds);
  const nanoserve_kernel_table& tier = tier_of(handle);
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> done(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) done[t] = tier.dot_peak(rounds);
  });
  int64_t total = 0;
  for (int64_t d : done) total += d;
  return total;
}

// The instruction-set features the kernel tiers and the compute dtype depend on, from the CPU
// itself (cpuid on x86, the kernel's hwcaps on Linux ARM, sysctl on macOS), comma-separated.
std::string cpu_features() {
  std::vector<std::string> found;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const std::pair<const char*, int> x86[] = {
      {"avx2", __builtin_cpu_supports("avx2")}, {"fma", __builtin_cpu_supports("fma")},
      {"f16c", __builtin_cpu_supports("f16c")}, {"avx512f", __builtin_cpu_supports("avx512f")},
      {"avx512bw", __builtin_cpu_supports("avx512bw")}, {"avx512vl", __builtin_cpu_supports("avx512vl")},
      {"avx512vnni", __builtin_cpu_supports("avx512vnni")}, {"avxvnni", __builtin_cpu_supports("avxvnni")},
      {"avx512bf16", __builtin_cpu_supports("avx512bf16")}, {"amx-bf16", __builtin_cpu_supports("amx-bf16")}};
  for (const auto& [name, has] : x86) {
    if (has) found.emplace_back(name);
  }
#elif defined(__aarch64__)
  found.emplace_back("neon");  // every AArch64 CPU has Advanced SIMD
#if defined(__linux__)
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  if (hwcap & HWCAP_ASIMDDP) found.emplace_back("dotprod");
#ifdef HWCAP2_BF16
  if (hwcap2 & HWCAP2_BF16) found.emplace_back("bf16");
#endif
  (void)hwcap2;
#elif defined(__APPLE__)
  auto has = [](const char* name) {
    int value = 0;
    size_t size = sizeof(value);
    return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value;
  };
  if (has("hw.optional.arm.FEAT_DotProd")) found.emplace_back("dotprod");
  if (has("hw.optional.arm.FEAT_BF16")) found.emplace_back("bf16");
#endif
#endif
  std::string joined;
  for (const auto& f : found) joined += (joined.empty() ? "" : ",") + f;
  return joined;
}

bool is_float_input(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat; }

// The storage bits of a packed weight's codes, from their count: 4, 5, 6 or 8 bits a weight.
int32_t code_bits(const at::Tensor& codes, int64_t n, int64_t k) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  int32_t found = 0;
  for (int32_t bits : {4, 5, 6, 8}) {
    if (8 * codes.numel() == n * k * bits) found = bits;
  }
  TORCH_CHECK(found, "codes must be contiguous uint8 holding ", n, " x ", k, " codes of 4, 5, 6 or 8 bits, got ",
              codes.numel(), " bytes");
  return found;
}

// The format of a packed weight of n x k as the tiers read it (kernels/common.h), from its
// tensors: contiguous codes of 4, 5, 6 or 8 bits a weight (n * k * bits / 8 bytes); scales and
// minimums [n / 16, k / group, 16] with group 32 or 16, as fp16 bits (int16), fp32 bits (int32)
// or exponent bytes (uint8, d = 2^(e - 128)), or super-block records [n / 16, k / 256, 32 + 16 *
// 256 / group] (uint8); with a zero point z > 0, no minimums (an empty tensor): m = -z * d. A
// format with a code table (4-bit codes, zero point 0) holds its 16 int8 values where the
// minimums would be: m int8 [16], w = d * m[c].
nanoserve_format format_of(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t zero_point,
                           int64_t n, int64_t k) {
  TORCH_CHECK(n % 16 == 0 && k % 32 == 0, "a packed weight is n x k with n a multiple of 16 and k of 32, got ", n, " x ", k);
  const bool exponents = d.scalar_type() == at::kByte && d.dim() == 3 && d.size(2) == 16;
  const bool fp32 = d.scalar_type() == at::kInt, super = d.scalar_type() == at::kByte && !exponents;
  int64_t group = 0;
  if (super) {
    const bool fits = d.dim() == 3 && k % 256 == 0 && d.size(0) == n / 16 && d.size(1) == k / 256 && d.is_contiguous();
    group = fits && d.size(2) == nanoserve::super_record_bytes(32) ? 32 : fits && d.size(2) == nanoserve::super_record_bytes(16) ? 16 : 0;
    TORCH_CHECK(group, "super-block scales must be contiguous uint8 [", n / 16, ", ", k / 256, ", 160 or 288], got ",
                d.sizes());
  } else {
    TORCH_CHECK(d.dim() == 3 && d.size(0) == n / 16 && d.size(1) > 0 && (d.size(1) == k / 32 || d.size(1) == k / 16) &&
                d.size(2) == 16 && (fp32 || exponents || d.scalar_type() == at::kShort) && d.is_contiguous(),
                "scales must be contiguous fp16 bits (int16), fp32 bits (int32) or exponent bytes (uint8) [", n / 16,
                ", ", k / 32, " or ", k / 16, ", 16], got ", d.sizes(), " ", d.scalar_type());
    group = k / d.size(1);
  }
  TORCH_CHECK(zero_point >= 0 && zero_point <= 128, "the zero point must lie in 0..128, got ", zero_point);
  const int32_t bits = code_bits(codes, n, k);
  const int32_t kind = super ? nanoserve::SCALES_SUPER
                       : exponents ? nanoserve::SCALES_E8M0
                       : fp32 ? nanoserve::SCALES_FP32 : nanoserve::SCALES_FP16;
  if (m.scalar_type() == at::kChar) {
    TORCH_CHECK(m.dim() == 1 && m.numel() == 16 && m.is_contiguous() && zero_point == 0 && bits == 4,
                "a code table is 16 int8 values for 4-bit codes with zero point 0, got ", m.sizes(), ", ", bits,
                "-bit codes, zero point ", zero_point);
    return {bits, static_cast<int32_t>(group), kind, 0, m.data_ptr<int8_t>()};
  }
  if (zero_point) {
    TORCH_CHECK(m.numel() == 0, "a format with a zero point stores no minimums, got ", m.sizes());
  } else {
    TORCH_CHECK(m.sizes() == d.sizes() && m.scalar_type() == d.scalar_type() && m.is_contiguous(),
                "mins must match the scales");
  }
  return {bits, static_cast<int32_t>(group), kind, static_cast<int32_t>(zero_point), nullptr};
}

void check_x_bits(int64_t x_bits) {
  TORCH_CHECK(x_bits == 8 || x_bits == 16, "x_bits must be 8 or 16, got ", x_bits);
}

// x [M, K] bf16 or fp32 -> its int8 codes into xq [2, M, K] (two a value with x_bits 16, one and
// zeros with 8), xd [M, G] (x_bits 16) or [M, 2G] (8), xs [M, 2G] and the codes' sums per half
// group [2, M, 2G] (common.h); rows split over threads only when there are enough of them to pay
// for it (a prefill).
void quantize_into(const nanoserve_kernel_table& tier, const at::Tensor& x, int64_t x_bits, int8_t* xq, float* xd,
                   float* xs, int32_t* sums) {
  TORCH_CHECK(x.dim() == 2 && is_float_input(x) && x.device().is_cpu(),
              "x must be a [rows, K] bf16 or fp32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  check_x_bits(x_bits);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "K = ", K, " is not a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, M, M >= 16 ? 4 : M, [&](int64_t begin, int64_t end) {
    tier.quantize_rows(xc.data_ptr(), bf16, M, K, begin, end, static_cast<int32_t>(x_bits), xq, xd, xs, sums);
  });
}

// x [M, K] bf16 or fp32 -> (codes [2, M, K] int8, xd [M, G] or [M, 2G], xs [M, 2G], sums [2, M, 2G] int32).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t handle,
                                                                         int64_t x_bits) {
  const int64_t M = x.dim() == 2 ? x.size(0) : 0, G = x.dim() == 2 ? x.size(1) / 32 : 0;
  const at::Tensor xq = at::empty({2, M, nanoserve::x_row_stride(32 * G)}, x.options().dtype(at::kChar));
  const at::Tensor xd = at::empty({M, x_bits == 8 ? 2 * G : G}, x.options().dtype(at::kFloat));
  const at::Tensor xs = at::empty({M, 2 * G}, xd.options()), sums = at::empty({2, M, 2 * G}, x.options().dtype(at::kInt));
  quantize_into(tier_of(handle), x, x_bits, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
                sums.data_ptr<int32_t>());
  return {xq.narrow(2, 0, 32 * G), xd, xs, sums};  // the codes without their rows' padding
}

// x's codes, steps and sums as quantize_into writes them, in one scratch allocation.
struct QuantizedRows {
  at::Tensor scratch;
  int8_t* xq;
  float* xd;
  float* xs;
  int32_t* sums;

  QuantizedRows(const nanoserve_kernel_table& tier, const at::Tensor& x, int64_t x_bits) {
    const int64_t M = x.size(0), K = x.size(1), G = K / 32, codes = 2 * M * nanoserve::x_row_stride(K);
    scratch = at::empty({codes + 32 * M * G}, x.options().dtype(at::kChar));
    xq = scratch.data_ptr<int8_t>();
    xd = reinterpret_cast<float*>(xq + codes);  // codes is a multiple of 64: aligned
    xs = xd + 2 * M * G;
    sums = reinterpret_cast<int32_t*>(xs + 2 * M * G);
    quantize_into(tier, x, x_bits, xq, xd, xs, sums);
  }
};

// A product's work items (group_mm's output blocks, experts_mm's tasks) over torch's threads:
// each thread a contiguous run of its own, which it takes from the front in shrinking pieces; a
// thread that runs out takes the back half of what the thread with most left has not started,
// and that becomes its own run. Every thread streams long runs of weights, and one slowed down
// (its memory queue, the hypervisor taking its core) does not hold the product's end while the
// other waits. An item's output does not depend on which thread computes it.
class BlockRuns {
 public:
  // Thread t's run is [start(t), start(t + 1)): start ascending from 0 to the work's end.
  template <typename Start>
  BlockRuns(int64_t threads, const Start& start) : runs_(threads) {
    for (int64_t t = 0; t < threads; ++t) runs_[t].span.store(pack(start(t), start(t + 1)));
  }

  // The next piece of thread t's work, [begin, end), or an empty one when none is left anywhere.
  std::pair<int64_t, int64_t> next(int64_t t) {
    std::atomic<uint64_t>& own = runs_[t].span;
    for (;;) {
      uint64_t span = own.load(std::memory_order_acquire);
      const int64_t lo = low(span), hi = high(span);
      if (lo < hi) {
        const int64_t take = std::max<int64_t>(1, (hi - lo) / 4);
        if (own.compare_exchange_weak(span, pack(lo + take, hi), std::memory_order_acq_rel)) return {lo, lo + take};
        continue;
      }
      if (!steal_into(t)) return {0, 0};
    }
  }

 private:
  struct alignas(64) Run {
    std::atomic<uint64_t> span{0};
  };
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32; }
  static int64_t low(uint64_t span) { return static_cast<int64_t>(span & 0xffffffffu); }
  static int64_t high(uint64_t span) { return static_cast<int64_t>(span >> 32); }

  // Moves the back half of the largest unstarted run (at least 2 items) to thread t's own.
  bool steal_into(int64_t t) {
    for (;;) {
      int64_t victim = -1, most = 1;
      uint64_t seen = 0;
      for (int64_t v = 0; v < static_cast<int64_t>(runs_.size()); ++v) {
        const uint64_t span = runs_[v].span.load(std::memory_order_acquire);
        if (v != t && high(span) - low(span) > most) victim = v, most = high(span) - low(span), seen = span;
      }
      if (victim < 0) return false;
      const int64_t hi = high(seen), cut = hi - most / 2;
      if (runs_[victim].span.compare_exchange_strong(seen, pack(low(seen), cut), std::memory_order_acq_rel)) {
        runs_[t].span.store(pack(cut, hi), std::memory_order_release);  // t's run was empty: no one else writes it
        return true;
      }
    }
  }

  std::vector<Run> runs_;
};

// run(begin, end) over [start(0), start(threads)) on `threads` of torch's threads, thread t's run
// first [start(t), start(t + 1)) (BlockRuns).
template <typename Start, typename Fn>
void parallel_runs(int64_t threads, const Start& start, const Fn& run) {
  if (threads <= 1 || at::in_parallel_region()) {
    run(start(0), start(threads));
    return;
  }
  BlockRuns runs(threads, start);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (auto piece = runs.next(t); piece.first < piece.second; piece = runs.next(t)) run(piece.first, piece.second);
    }
  });
}

// x [M, K] @ w.T for the packed weight w of N x K (format_of; N from the scales).
// x_bits: the activations' precision, 16 (hi and lo codes) or 8 (one code, a step per 16; kernels/common.h).
at::Tensor group_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                    int64_t zero_point, int64_t handle, int64_t x_bits) {
  TORCH_CHECK(x.dim() == 2 && d.dim() == 3, "x must be [rows, K] and the scales [N / 16, K / group, 16]");
  check_x_bits(x_bits);
  const int64_t M = x.size(0), K = x.size(1), N = 16 * d.size(0);
  const nanoserve_format format = format_of(codes, d, m, zero_point, N, K);
  const nanoserve_kernel_table& tier = tier_of(handle);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;  // a prefill chunk no row's prompt ends in asks the head for no logits
  const QuantizedRows q(tier, x, x_bits);
  const auto run = [&](int64_t begin, int64_t end) {
    tier.group_mm(format, codes.data_ptr<uint8_t>(), d.data_ptr(), m.data_ptr(), N, K, begin, end, M, q.xq, q.xd,
                  q.xs, static_cast<int32_t>(x_bits), out.data_ptr(), x.scalar_type() == at::kBFloat16);
  };
  const int64_t blocks = N / 16, threads = std::min<int64_t>(at::get_num_threads(), blocks);
  parallel_runs(threads, [&](int64_t t) { return blocks * t / threads; }, run);
  return out;
}

// Every routed product of a mixture-of-experts step: ids [rows, top_k] int64 below E, experts
// stacked codes [E, ...], scales and mins [E, ...] (each expert as group_mm takes its weight of
// N x K), x [rows, K] (a row's slots share it) or [rows * top_k, K] (a row per pair) ->
// out [rows, top_k, N] in x's dtype, out[r, s] = w_{ids[r, s]} x[r] or x[r * top_k + s]; an id
// of -1 skips its pair, whose output is zeros (a prompt's busiest experts go another way). The work splits over threads by
// (expert, output block) tasks, each thread first a share of their cost: a block's read and its
// expert's rows (a prompt's experts have very different numbers of rows); then as BlockRuns.
at::Tensor experts_mm(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& d,
                      const at::Tensor& m, int64_t zero_point, int64_t handle, int64_t x_bits) {
  check_x_bits(x_bits);
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be contiguous int64 "
              "[rows, top_k], got ", ids.sizes(), " ", ids.scalar_type());
  TORCH_CHECK(codes.dim() == 2 && d.dim() == 4 && (m.dim() == 4 || (m.dim() == 2 && m.scalar_type() == at::kChar)) &&
              codes.size(0) == d.size(0) && m.size(0) == d.size(0) && codes.size(0) > 0 && codes.is_contiguous() &&
              d.is_contiguous() && m.is_contiguous(), "experts must be stacked contiguously: codes [E, bytes], "
              "scales and mins (or code tables) [E, ...] as group_mm takes one expert's, got ", codes.sizes(), ", ",
              d.sizes(), ", ", m.sizes());
  const int64_t rows = ids.size(0), top_k = ids.size(1), pairs = rows * top_k, E = codes.size(0);
  TORCH_CHECK(x.dim() == 2 && (x.size(0) == rows || x.size(0) == pairs), "x must be [rows, K] or [rows * top_k, K] "
              "for ids ", ids.sizes(), ", got ", x.sizes());
  const int64_t K = x.size(1), N = 16 * d.size(1);
  const nanoserve_format format = format_of(codes[0], d[0], m[0], zero_point, N, K);
  // the experts of one tensor share their type, so their table: expert 0's is read
  const void* mins = format.table || !m.numel() ? nullptr : m.data_ptr();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {  // an expert past the stack would read past its codes
    TORCH_CHECK(id[p] >= -1 && id[p] < E, "expert ids must lie in [-1, ", E, ") (-1: skip the pair), got ", id[p]);
  }
  at::Tensor out = at::empty({rows, top_k, N}, x.options());
  const nanoserve::ExpertGroups groups(id, pairs);
  if (static_cast<int64_t>(groups.pairs.size()) < pairs) {
    out.masked_fill_(ids.eq(-1).unsqueeze(-1), 0);
  }
  const int64_t blocks = N / 16, experts = static_cast<int64_t>(groups.experts.size()), tasks = experts * blocks;
  if (tasks == 0) return out;
  const nanoserve_kernel_table& tier = tier_of(handle);
  const int64_t M = x.size(0);
  const QuantizedRows q(tier, x, x_bits);
  // a task of expert j costs about READ + its rows, READ rows' worth of arithmetic for reading its block
  constexpr int64_t READ = 2;
  int64_t total = 0;
  for (int64_t j = 0; j < experts; ++j) total += blocks * (READ + groups.starts[j + 1] - groups.starts[j]);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  const auto first_task = [&](int64_t thread) {  // the first task from thread / threads of the cost on (threads: tasks)
    const int64_t target = total * thread / threads;
    int64_t before = 0;
    for (int64_t j = 0; j < experts; ++j) {
      const int64_t cost = READ + groups.starts[j + 1] - groups.starts[j];
      if (before + blocks * cost > target) return j * blocks + (target - before + cost - 1) / cost;
      before += blocks * cost;
    }
    return tasks;
  };
  const int64_t scale_stride = d[0].numel() * d.element_size();
  parallel_runs(threads, first_task, [&](int64_t begin, int64_t end) {
    tier.experts_mm(format, codes.data_ptr<uint8_t>(), d.data_ptr(), mins, codes.size(1), scale_stride, N, K, rows,
                    top_k, id, M == pairs && M != rows, q.xq, q.xd, q.xs, static_cast<int32_t>(x_bits), begin, end,
                    out.data_ptr(), x.scalar_type() == at::kBFloat16);
  });
  return out;
}

// The packed weight of n x k back as a dense [n, k] tensor in `dtype` (fp32 or bf16).
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t zero_point, int64_t n,
                      int64_t k, at::ScalarType dtype, int64_t handle) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize writes fp32 or bf16");
  const nanoserve_format format = format_of(codes, d, m, zero_point, n, k);
  const nanoserve_kernel_table& tier = tier_of(handle);
  at::Tensor out = at::empty({n, k}, codes.options().dtype(dtype));
  at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
    tier.dequantize(format, codes.data_ptr<uint8_t>(), d.data_ptr(), m.data_ptr(), k, begin, end, out.data_ptr(),
                    dtype == at::kBFloat16);
  });
  return out;
}

// Rows `rows` (int64, any shape) of the packed weight of n x k as a dense [*rows.shape, k] tensor.
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m, int64_t zero_point,
                           const at::Tensor& rows, int64_t n, int64_t k, at::ScalarType dtype, int64_t handle) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize_rows writes fp32 or bf16");
  const nanoserve_format format = format_of(codes, d, m, zero_point, n, k);
  TORCH_CHECK(rows.scalar_type() == at::kLong, "rows must be int64");
  const at::Tensor flat = rows.contiguous().view(-1);
  const int64_t* r = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {  // a row past the weight would read past its codes
    TORCH_CHECK(r[i] >= 0 && r[i] < n, "rows must lie in [0, ", n, "), got ", r[i]);
  }
  const nanoserve_kernel_table& tier = tier_of(handle);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  const int64_t size = out.element_size();
  at::parallel_for(0, flat.numel(), 16, [&](int64_t begin, int64_t end) {
    tier.dequantize_rows(format, codes.data_ptr<uint8_t>(), d.data_ptr(), m.data_ptr(), k, r + begin, end - begin,
                         static_cast<char*>(out.data_ptr()) + begin * k * size, dtype == at::kBFloat16);
  });
  return out;
}

// x_codes [K] int8 in -127..127, codes the packed weight of n outputs (4, 5, 6 or 8 bits, from
// their count) -> int32 [n, K / group], group 32 or 16.
at::Tensor group_dots(const at::Tensor& x_codes, const at::Tensor& codes, int64_t n, int64_t group, int64_t handle) {
  TORCH_CHECK(x_codes.dim() == 1 && x_codes.scalar_type() == at::kChar && x_codes.is_contiguous(), "x_codes: [K] int8");
  const int64_t K = x_codes.size(0);
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0, "codes must hold ", n, " x ", K, " packed codes");
  TORCH_CHECK(group == 32 || group == 16, "group must be 32 or 16, got ", group);
  TORCH_CHECK(x_codes.abs().max().item<int8_t>() <= 127, "x codes must lie in -127..127");
  at::Tensor out = at::empty({n, K / group}, x_codes.options().dtype(at::kInt));
  const nanoserve_format format{code_bits(codes, n, K), static_cast<int32_t>(group), 0, 0, nullptr};
  tier_of(handle).group_dots(format, codes.data_ptr<uint8_t>(), n, K, x_codes.data_ptr<int8_t>(),
                             out.data_ptr<int32_t>());
  return out;
}

// One layer's K or V cells for the tier: [slots, KV, D] in q's dtype, or q8_0 (int8 codes with
// `scales` [slots, KV, D / 32] fp16). Head h's cells start at head h.
struct Cells {
  const char* data;
  const uint16_t* scales;
  int64_t element, D;

  Cells(const at::Tensor& cache, const std::optional<at::Tensor>& scales, const at::Tensor& q, const char* name) {
    const int64_t D_ = q.size(2);
    TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == D_, name,
                " cache must be contiguous [slots, KV, ", D_, "], got ", cache.sizes());
    if (scales.has_value()) {
      TORCH_CHECK(cache.scalar_type() == at::kChar && D_ % 32 == 0 && D_ <= 1024, name,
                  " q8_0 cells must be int8 codes with head_dim a multiple of 32 up to 1024");
      TORCH_CHECK(scales->scalar_type() == at::kHalf && scales->is_contiguous() && scales->dim() == 3 &&
                  scales->size(0) == cache.size(0) && scales->size(1) == cache.size(1) && scales->size(2) == D_ / 32,
                  name, " scales must be contiguous fp16 [slots, KV, ", D_ / 32, "]");
    } else {
      TORCH_CHECK(cache.scalar_type() == q.scalar_type(), name, " cells must be in q's dtype or q8_0");
    }
    data = static_cast<const char*>(cache.data_ptr());
    this->scales = scales.has_value() ? reinterpret_cast<const uint16_t*>(scales->data_ptr<at::Half>()) : nullptr;
    element = cache.element_size();
    D = D_;
  }

  nanoserve_cells head(int64_t h, int64_t KV) const {
    return {data + h * D * element, scales ? scales + h * (D / 32) : nullptr, KV * D, KV * (D / 32)};
  }
};

// A long row's cells are read in parts, by several threads at once, each part's every K/V head by
// one task (a thread streams whole cells, not one head's slice of each), and the parts merged by
// their log-sum-exps: as many parts as threads, or a multiple of them when a part would pass
// PART_CELLS (a part's scores stay in L2). A row too short for parts of MIN_PART_CELLS (merging
// costs more than it saves there) is read whole, its K/V heads split over the threads instead.
// The tasks depend on the row's length, the heads and the thread count, never on the batch, and a
// head's bits do not depend on the heads read beside it, so a row's bits do not depend on the batch.
constexpr int64_t PART_CELLS = 1024, MIN_PART_CELLS = 256;

int64_t parts_of_row(int64_t count, int64_t threads) {
  const int64_t parts = (count + PART_CELLS - 1) / PART_CELLS;
  return std::max<int64_t>(1, std::min((parts + threads - 1) / threads * threads, count / MIN_PART_CELLS));
}

// q [n, H, D] bf16 or fp32; k_cache, v_cache [slots, KV, D] each in q's dtype or q8_0 (int8
// codes with k_scales / v_scales [slots, KV, D / 32] fp16); slots [m, W] int64 (unit column
// stride) with m dividing n: query r reads slot row r / (n / m), so a verify step's queries of one
// row share its row of slots; lens [n] int64. Row r attends to its first len = min(max(lens[r], 1), W) cells:
// a padded row of length 0 reads cell 0, finite garbage nobody reads. With window > 0 (a
// sliding-window layer) only the last `window` of them: cells max(len - window, 0) .. len - 1,
// which the tier reads as a shorter row of slots. Query heads h * group .. h * group + group - 1
// share K/V head h.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale, int64_t handle,
                            int64_t window, const std::optional<at::Tensor>& sinks,
                            const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && is_float_input(q) && q.stride(2) == 1, "q must be [n, H, D] bf16 or fp32");
  const Cells k_cells(k_cache, k_scales, q, "k"), v_cells(v_cache, v_scales, q, "v");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
              "k and v caches must hold the same cells: ", k_cache.sizes(), " against ", v_cache.sizes());
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KV = k_cache.size(1);
  TORCH_CHECK(D % 16 == 0 && H % KV == 0, "head sizes disagree: q ", q.sizes(), ", cache ", k_cache.sizes());
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) >= 1 && n % slots.size(0) == 0 && slots.scalar_type() == at::kLong &&
              slots.stride(1) == 1, "slots must be [m, W] int64 with unit column stride, m dividing q's ", n, " rows");
  const int64_t per_row = n / slots.size(0);  // queries sharing one row of slots
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == n && lens.scalar_type() == at::kLong, "lens must be [n] int64");
  const int64_t W = slots.size(1), group = H / KV;
  TORCH_CHECK(W >= 1, "the window must have a column");
  TORCH_CHECK(window >= 0, "a sliding window must be positive (0: none), got ", window);
  const nanoserve_kernel_table& tier = tier_of(handle);
  // gpt-oss's sink logits [H], read in fp32 (nullptr: none).
  at::Tensor sinks_f;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H, "sinks must be [H] = [", H, "], got ", sinks->sizes());
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_p = sinks_f.defined() ? sinks_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({n, H, D}, q.options());
  const at::Tensor lens_c = lens.contiguous();
  const int64_t* len_p = lens_c.data_ptr<int64_t>();
  const int64_t size = q.element_size();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const char* q_p = static_cast<const char*>(q.data_ptr());
  char* o_p = static_cast<char*>(out.data_ptr());
  const int64_t* s_p = slots.data_ptr<int64_t>();
  const auto cells_of = [&](int64_t r) {  // (first, count): row r reads cells [first, first + count)
    const int64_t len = std::min(std::max<int64_t>(len_p[r], 1), W);
    const int64_t first = window > 0 ? std::max<int64_t>(len - window, 0) : 0;
    return std::pair<int64_t, int64_t>(first, len - first);
  };
  // Prefix sums over the rows of their tasks (parts) and of their merged parts (a row of one part
  // has none); the longest part sizes the scratch.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> task_start(n + 1, 0), part_start(n + 1, 0);
  int64_t longest = 1;
  const int64_t chunks = std::min(KV, threads);  // a row of one part: tasks of KV / chunks heads
  for (int64_t r = 0; r < n; ++r) {
    const int64_t count = cells_of(r).second, parts = parts_of_row(count, threads);
    task_start[r + 1] = task_start[r] + (parts > 1 ? parts : chunks);
    part_start[r + 1] = part_start[r] + (parts > 1 ? parts : 0);
    longest = std::max(longest, (count + parts - 1) / parts);
  }
  // The merged parts' outputs [part, H, D] and log-sum-exps [part, H]; the last of a row's parts
  // to finish merges them (done[r] counts its finished parts).
  const bool merges = part_start[n] > 0;
  const at::TensorOptions fp32 = q.options().dtype(at::kFloat);
  const at::Tensor partial = merges ? at::empty({part_start[n], H, D}, fp32) : at::Tensor();
  const at::Tensor partial_lse = merges ? at::empty({part_start[n], H}, fp32) : at::Tensor();
  std::vector<std::atomic<int64_t>> done(merges ? n : 0);
  for (auto& d : done) d.store(0, std::memory_order_relaxed);
  // out = sum_p w_p o_p / sum_p w_p (and the sink's share in the denominator), w_p = exp(lse_p -
  // the largest lse), query head by query head.
  const auto merge = [&](int64_t r, int64_t parts, std::vector<float>& acc, std::vector<float>& weights) {
    for (int64_t head = 0; head < H; ++head) {
      const float* o = partial.data_ptr<float>() + (part_start[r] * H + head) * D;  // part p at o + p H D
      const float* lse = partial_lse.data_ptr<float>() + part_start[r] * H + head;  // part p at lse[p H]
      float top = sink_p ? sink_p[head] : -INFINITY;
      for (int64_t part = 0; part < parts; ++part) top = std::max(top, lse[part * H]);
      float total = sink_p ? std::exp(sink_p[head] - top) : 0.f;
      weights.resize(parts);
      for (int64_t part = 0; part < parts; ++part) total += weights[part] = std::exp(lse[part * H] - top);
      acc.assign(D, 0.f);
      for (int64_t part = 0; part < parts; ++part) {
        for (int64_t c = 0; c < D; ++c) acc[c] += weights[part] * o[part * H * D + c];
      }
      char* dst = o_p + (r * H + head) * D * size;
      for (int64_t c = 0; c < D; ++c) {
        if (bf16) reinterpret_cast<at::BFloat16*>(dst)[c] = static_cast<at::BFloat16>(acc[c] / total);
        else reinterpret_cast<float*>(dst)[c] = acc[c] / total;
      }
    }
  };
  const nanoserve_cells k_all = k_cells.head(0, KV), v_all = v_cells.head(0, KV);  // a part: every head
  at::parallel_for(0, task_start[n], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(H * (2 * D + longest + 16)), acc, weights;
    int64_t r = std::upper_bound(task_start.begin(), task_start.end(), begin) - task_start.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_start[r + 1]) ++r;
      // parts: the row's merged parts (0: read whole, task `part` a chunk of its heads)
      const int64_t parts = part_start[r + 1] - part_start[r], part = task - task_start[r];
      const auto [first, count] = cells_of(r);
      const char* q_r = q_p + r * q.stride(0) * size;
      const int64_t* slots_r = s_p + (r / per_row) * slots.stride(0) + first;
      if (parts == 0) {  // chunk `part` of the heads, over the whole row
        const int64_t h = KV * part / chunks, heads = KV * (part + 1) / chunks - h;
        tier.attend(q_r + h * group * q.stride(1) * size, q.stride(1), k_cells.head(h, KV), v_cells.head(h, KV),
                    slots_r, count, heads, group, D, static_cast<float>(scale), o_p + (r * H + h * group) * D * size,
                    D, bf16, scratch.data(), sink_p ? sink_p + h * group : nullptr, nullptr);
        continue;
      }
      const int64_t at = count * part / parts, cells = count * (part + 1) / parts - at;
      const int64_t* slots_at = slots_r + at;
      const int64_t at_part = part_start[r] + part;
      tier.attend(q_r, q.stride(1), k_all, v_all, slots_at, cells, KV, group, D, static_cast<float>(scale),
                  partial.data_ptr<float>() + at_part * H * D, D, bf16, scratch.data(), nullptr,
                  partial_lse.data_ptr<float>() + at_part * H);
      if (done[r].fetch_add(1, std::memory_order_acq_rel) + 1 == parts) merge(r, parts, acc, weights);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoserve, lib) {
  lib.def("load_tier(str path) -> int");
  lib.def("tier_name(int tier) -> str");
  lib.def("dot_peak(int rounds, int tier) -> int");
  lib.def("cpu_features() -> str");
  lib.def("quantize_rows(Tensor x, int tier, int x_bits=16) -> (Tensor, Tensor, Tensor, Tensor)");
  lib.def("group_mm(Tensor x, Tensor codes, Tensor scales, Tensor mins, int zero_point, int tier, int x_bits=16) "
          "-> Tensor");
  lib.def("experts_mm(Tensor x, Tensor ids, Tensor codes, Tensor scales, Tensor mins, int zero_point, int tier, "
          "int x_bits=16) -> Tensor");
  lib.def("dequantize(Tensor codes, Tensor scales, Tensor mins, int zero_point, int n, int k, ScalarType dtype, "
          "int tier) -> Tensor");
  lib.def("dequantize_rows(Tensor codes, Tensor scales, Tensor mins, int zero_point, Tensor rows, int n, int k, "
          "ScalarType dtype, int tier) -> Tensor");
  lib.def("group_dots(Tensor x_codes, Tensor codes, int n, int group, int tier) -> Tensor");
  lib.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, float scale, "
          "int tier, int window=0, Tensor? sinks=None, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
  lib.impl("load_tier", &load_tier);
  lib.impl("tier_name", &tier_name);
  lib.impl("dot_peak", &dot_peak);
  lib.impl("cpu_features", &cpu_features);
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("quantize_rows", &quantize_rows);
  lib.impl("group_mm", &group_mm);
  lib.impl("experts_mm", &experts_mm);
  lib.impl("group_dots", &group_dots);
  lib.impl("dequantize", &dequantize);
  lib.impl("dequantize_rows", &dequantize_rows);
  lib.impl("decode_attention", &decode_attention);
}
