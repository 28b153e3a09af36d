// One token per row of logits, each row by its own law (temperature, top-k, top-p, min-p) and
// its own uniform draw u in [0, 1): the token at u of the law's cumulative distribution. It
// draws from the same law as the sampler's torch path (nanoserve/worker/sampler.py), without
// sorting the vocabulary or drawing a random number per token: the passes over every token are
// vectorised (torch's max; the weights, top-k's block maxima and greedy's search cloned for the
// CPU's vector width), and the rest is selection among the few tokens a filter can keep.
//
// A row's weights are e = exp((x - max) / T), the max's weight 1 (a token's probability is e / Z).
//   top-k: the tokens at or above the k-th largest logit (ties with it stay in);
//   top-p: of those, by descending logit, each token whose predecessors' mass is below p Z;
//   min-p: of those, each token whose e is at least min_p (its probability / the largest's);
//   then u picks the token where the kept weights' running sum first passes u times their sum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace {

struct Law {
  float temperature;  // 0: greedy
  int64_t top_k;      // 0 or >= vocab: off
  float top_p;        // 1: off
  float min_p;        // 0: off
  double u;           // the row's uniform draw
};

struct Candidate {
  float x;  // the logit
  float e;  // its weight
  int64_t i;
};

// The k-th largest of x[0, n), 0 < k < n: a min-heap of the k largest seen, most values
// rejected by one comparison with its least.
float kth_largest(const float* x, int64_t n, int64_t k) {
  std::vector<float> heap(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int64_t i = k; i < n; ++i) {
    if (x[i] > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = x[i];
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  }
  return heap.front();
}

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
// This library is built with no instruction flags (it loads on any x86-64); the weights' pass
// is cloned for AVX-512 and AVX2 and the loader picks the widest the CPU has (GCC's ifunc).
#define NANOSERVE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define NANOSERVE_VECTOR_CLONES
#endif

// e^y for y <= 0, 0 below -87 (and for -inf): 2^n times a degree-6 polynomial of the rest
// (relative error ~1e-7), written so that the compiler vectorises a loop of it.
inline float exp_nonpositive(float y) {
  const float z = y < -87.f ? -87.f : y;
  const float n = (z * 1.44269504f + 12582912.f) - 12582912.f;  // rint, for |z| < 2^22
  const float f = n * -0.693147181f + z;
  float p = 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return y < -87.f ? 0.f : p * two_n;
}

constexpr int64_t CHUNK = 512;  // the weights' sums are kept per chunk of this many tokens

// e[i] = exp((x[i] - top) * scale) over [0, n), and each chunk's sum of them into chunks[].
NANOSERVE_VECTOR_CLONES
void weights_of(const float* __restrict x, int64_t n, float top, float scale, float* __restrict e,
                double* __restrict chunks) {
  constexpr int L = 16;
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t end = std::min(n, c + CHUNK);
    float lanes[L] = {};
    int64_t i = c;
    for (; i + L <= end; i += L) {
      for (int l = 0; l < L; ++l) {
        const float w = exp_nonpositive((x[i + l] - top) * scale);
        e[i + l] = w;
        lanes[l] += w;
      }
    }
    double sum = 0.0;
    for (; i < end; ++i) sum += e[i] = exp_nonpositive((x[i] - top) * scale);
    for (float v : lanes) sum += v;
    chunks[c / CHUNK] = sum;
  }
}

// The first index of `top` in the row, a run of 16 compared at once (-1: none).
NANOSERVE_VECTOR_CLONES
int64_t first_equal(const float* __restrict x, int64_t n, float top) {
  constexpr int L = 16;
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    int hit = 0;
    for (int l = 0; l < L; ++l) hit |= x[i + l] == top;
    if (hit) break;
  }
  for (; i < n; ++i) {
    if (x[i] == top) return i;
  }
  return -1;
}

constexpr int64_t BLOCK = 64;  // top-k reads the row's block maxima first

// out[b] = the largest of x's block b of BLOCK values (the last block may be shorter).
NANOSERVE_VECTOR_CLONES
void block_maxima(const float* __restrict x, int64_t n, float* __restrict out) {
  constexpr int L = 16;
  for (int64_t b = 0; b * BLOCK < n; ++b) {
    const int64_t begin = b * BLOCK, end = std::min(n, begin + BLOCK);
    float lanes[L];
    for (int l = 0; l < L; ++l) lanes[l] = -INFINITY;
    int64_t i = begin;
    for (; i + L <= end; i += L) {
      for (int l = 0; l < L; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
    }
    float top = -INFINITY;
    for (; i < end; ++i) top = x[i] > top ? x[i] : top;
    for (float v : lanes) top = v > top ? v : top;
    out[b] = top;
  }
}

// The first index of the row's largest value (of its first NaN where it has one, as torch.argmax).
int64_t first_max(const float* x, int64_t n, float top) {
  if (top == top) return std::max<int64_t>(0, first_equal(x, n, top));
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] != x[i]) return i;
  }
  return 0;
}

// Top-k's survivors of a row, unweighed: the tokens at or above its k-th largest logit (ties
// with it stay in), none masked. The k-th largest of the block maxima bounds the k-th largest
// logit from below (k blocks each hold a value at least that large), so only the blocks whose
// maximum reaches it are read, and the k-th largest is selected among their values.
std::vector<Candidate> top_k_of(const float* x, int64_t n, int64_t k, std::vector<float>& maxima) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<Candidate> kept;
  float bound = -INFINITY;
  if (k < blocks) {
    maxima.resize(blocks);
    block_maxima(x, n, maxima.data());
    bound = kth_largest(maxima.data(), blocks, k);
  } else {
    bound = kth_largest(x, n, k);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    if (k < blocks && !(maxima[b] >= bound && maxima[b] > -INFINITY)) continue;
    for (int64_t i = b * BLOCK; i < std::min(n, (b + 1) * BLOCK); ++i) {
      if (x[i] >= bound && x[i] > -INFINITY) kept.push_back({x[i], 0.f, i});
    }
  }
  if (static_cast<int64_t>(kept.size()) > k) {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(),
                     [](const Candidate& a, const Candidate& b) { return a.x > b.x; });
    const float kth = kept[k - 1].x;
    kept.erase(std::remove_if(kept.begin(), kept.end(), [kth](const Candidate& c) { return c.x < kth; }),
               kept.end());
  }
  return kept;
}

// The token at u among the candidates (in their order, every weight positive), by their
// weights; rounding past the end takes the last.
int64_t walk_candidates(const std::vector<Candidate>& kept, double u) {
  double total = 0.0;
  for (const Candidate& c : kept) total += c.e;
  const double target = u * total;
  double seen = 0.0;
  for (const Candidate& c : kept) {
    seen += c.e;
    if (seen > target) return c.i;
  }
  return kept.back().i;
}

// A positive weight's bucket: its float bits' exponent and top 6 mantissa bits, increasing with
// the weight (buckets 1/64 of an octave wide; e <= 1 keeps them below WEIGHT_BUCKETS).
constexpr int WEIGHT_BUCKETS = (0x3f800000 >> 17) + 1;
int weight_bucket(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, 4);
  return static_cast<int>(bits >> 17);
}

// Descending logit order, ties by index.
bool before_in_order(const Candidate& a, const Candidate& b) { return a.x > b.x || (a.x == b.x && a.i < b.i); }

// What a top-p of p keeps of candidates in descending order from `above` (the mass before
// them) on: each whose predecessors' mass is below target = p times the whole mass.
void keep_nucleus(std::vector<Candidate>& kept, std::vector<Candidate>& edge, double above, double target) {
  std::sort(edge.begin(), edge.end(), before_in_order);
  for (const Candidate& c : edge) {
    if (above >= target && !kept.empty()) break;
    kept.push_back(c);
    above += c.e;
  }
}

// Top-p of p over a few weighed candidates: all sorted.
std::vector<Candidate> nucleus_of(std::vector<Candidate> candidates, float p) {
  double z = 0.0;
  for (const Candidate& c : candidates) z += c.e;
  std::vector<Candidate> kept;
  keep_nucleus(kept, candidates, 0.0, static_cast<double>(p) * z);
  return kept;
}

// The chunk sums (as weights_of's) of the weights at or above `least`. Written out as weights_of
// is: one loop shared through a lambda lost the pointers' __restrict, and GCC's vectorisation with it.
NANOSERVE_VECTOR_CLONES
void sums_at_least(const float* __restrict e, int64_t n, float least, double* __restrict chunks) {
  constexpr int L = 16;
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t end = std::min(n, c + CHUNK);
    float lanes[L] = {};
    int64_t i = c;
    for (; i + L <= end; i += L) {
      for (int l = 0; l < L; ++l) lanes[l] += e[i + l] >= least ? e[i + l] : 0.f;
    }
    double sum = 0.0;
    for (; i < end; ++i) sum += e[i] >= least ? e[i] : 0.f;
    for (float v : lanes) sum += v;
    chunks[c / CHUNK] = sum;
  }
}

// Appends the tokens whose weights lie in [low, high), in row order: a run of 16 is tested at
// once (one predictable branch), since few tokens do.
NANOSERVE_VECTOR_CLONES
void weights_between(const float* __restrict x, const float* __restrict e, int64_t n, float low, float high,
                     std::vector<Candidate>& out) {
  constexpr int L = 16;
  const auto between = [low, high](float w) { return (w >= low) & (w < high); };
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    int hit = 0;
    for (int l = 0; l < L; ++l) hit |= between(e[i + l]);
    if (!hit) continue;
    for (int l = 0; l < L; ++l) {
      if (between(e[i + l])) out.push_back({x[i + l], e[i + l], i + l});
    }
  }
  for (; i < n; ++i) {
    if (between(e[i])) out.push_back({x[i], e[i], i});
  }
}

// What a law keeps of a whole row of weights: every token at or above `least`, and `extra`, top-p's
// crossing-bucket tokens below it (in row order).
struct RowKept {
  float least;
  std::vector<Candidate> extra;

  bool keeps(const float* e, int64_t i) const {
    return e[i] >= least || std::binary_search(extra.begin(), extra.end(), Candidate{0.f, 0.f, i},
                                               [](const Candidate& a, const Candidate& b) { return a.i < b.i; });
  }
};

// Temperature alone keeps every token of positive weight (weights_of's chunk sums are its kept mass).
const RowKept EVERY_WEIGHED{std::numeric_limits<float>::denorm_min(), {}};

// The sum of a row's chunk sums.
double total_of(const std::vector<double>& chunks) { return std::accumulate(chunks.begin(), chunks.end(), 0.0); }

// Top-p of p over a whole row of weights e (chunks: weights_of's sums, replaced by the kept mass
// of each chunk), then min-p. A histogram of the weights finds the bucket where the running mass
// (heaviest first) crosses p times the total: the buckets above it are kept whole, the crossing
// bucket's tokens are sorted for the prefix the nucleus takes. The kept mass is summed per chunk
// in one vectorised pass (a flat row's nucleus can hold most of the vocabulary).
RowKept nucleus_of_row(const float* x, const float* e, int64_t n, std::vector<double>& chunks, const Law& law) {
  const double z = total_of(chunks);
  std::vector<double> mass(WEIGHT_BUCKETS, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] > 0.f) mass[weight_bucket(e[i])] += e[i];
  }
  const double target = static_cast<double>(law.top_p) * z;
  double above = 0.0;  // the mass of the buckets above the crossing one
  int cross = WEIGHT_BUCKETS - 1;
  while (cross > 0 && above + mass[cross] < target) above += mass[cross--];
  // The crossing bucket's weights lie in [low, high): a float compare tells most tokens apart.
  const auto bound = [](int bucket) {
    const uint32_t bits = static_cast<uint32_t>(bucket) << 17;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
  };
  const float low = std::max(bound(cross), FLT_MIN), high = bound(cross + 1);
  std::vector<Candidate> kept, edge;
  weights_between(x, e, n, low, high, edge);
  keep_nucleus(kept, edge, above, target);
  RowKept nucleus{std::max(high, law.min_p), {}};  // edge weights are below high, so below least
  for (const Candidate& c : kept) {
    if (c.e >= law.min_p) nucleus.extra.push_back(c);
  }
  std::sort(nucleus.extra.begin(), nucleus.extra.end(), [](const Candidate& a, const Candidate& b) { return a.i < b.i; });
  sums_at_least(e, n, nucleus.least, chunks.data());
  for (const Candidate& c : nucleus.extra) chunks[c.i / CHUNK] += c.e;
  return nucleus;
}

// u's token among what a law keeps of the row (chunks: its kept mass per chunk): the walk skips
// whole chunks, then goes token by token through the one it lands in; rounding past the end
// takes the last kept token.
int64_t draw_kept(const float* e, int64_t n, const RowKept& kept, const std::vector<double>& chunks, double u) {
  const double kept_mass = total_of(chunks);
  TORCH_CHECK(kept_mass > 0.0, "the law kept no token of a row whose largest weight is 1");
  const double at = u * kept_mass;
  double seen = 0.0;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    if (seen + chunks[c] <= at) {
      seen += chunks[c];
      continue;
    }
    for (int64_t i = c * CHUNK; i < std::min(n, (c + 1) * CHUNK); ++i) {
      if (!kept.keeps(e, i)) continue;
      seen += e[i];
      if (seen > at) return i;
    }
  }
  int64_t last = n - 1;
  while (last > 0 && !kept.keeps(e, last)) --last;
  return last;
}

// The candidates' weights, one exp each: the few tokens a top-k or min-p admits.
void weigh(std::vector<Candidate>& kept, float top, float scale) {
  for (Candidate& c : kept) c.e = std::exp((c.x - top) * scale);
}

// Whether a law keeps a few candidates found without weighing the whole row: top-k, or min-p alone.
bool keeps_few(const Law& law, int64_t n) {
  return (law.top_k > 0 && law.top_k < n) || (law.top_p == 1.f && law.min_p > 0.f);
}

// What such a law keeps, weighed, in the order a draw walks them (scratch: top-k's block maxima).
std::vector<Candidate> few_kept(const float* x, int64_t n, float top, float scale, const Law& law,
                                std::vector<float>& scratch) {
  std::vector<Candidate> kept;
  if (law.top_k > 0 && law.top_k < n) {
    kept = top_k_of(x, n, law.top_k, scratch);
    weigh(kept, top, scale);
    kept.erase(std::remove_if(kept.begin(), kept.end(), [](const Candidate& c) { return !(c.e > 0.f); }),
               kept.end());
    if (law.top_p < 1.f) kept = nucleus_of(std::move(kept), law.top_p);
  } else {
    // min-p alone: e >= min_p where x >= top + ln(min_p) / scale; the logits admit a little more
    // than that (e >= min_p / 1.001) and the weights decide.
    const float floor = top + (std::log(law.min_p) - 1e-3f) / scale;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] >= floor && x[i] > -INFINITY) kept.push_back({x[i], 0.f, i});
    }
    weigh(kept, top, scale);
  }
  if (law.min_p > 0.f) {  // the largest (e = 1) always stays
    kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Candidate& c) { return !(c.e >= law.min_p); }),
               kept.end());
  }
  return kept;
}

float scale_of(float temperature) { return std::min(std::max(1.f / temperature, FLT_MIN), FLT_MAX); }

// e: scratch for the row's weights (or top-k's block maxima); chunks: the weights' chunk sums.
int64_t sample_row(const float* x, int64_t n, float top, const Law& law, std::vector<float>& e,
                   std::vector<double>& chunks) {
  if (law.temperature == 0.f || !std::isfinite(top)) return first_max(x, n, top);
  const float scale = scale_of(law.temperature);
  if (keeps_few(law, n)) return walk_candidates(few_kept(x, n, top, scale, law, e), law.u);
  e.resize(n);
  chunks.resize((n + CHUNK - 1) / CHUNK);
  weights_of(x, n, top, scale, e.data(), chunks.data());
  const RowKept kept = law.top_p < 1.f ? nucleus_of_row(x, e.data(), n, chunks, law) : EVERY_WEIGHED;
  return draw_kept(e.data(), n, kept, chunks, law.u);
}

// The law sample_row draws a row from, as probabilities into out[0, n) (a greedy row's: at
// temperature 1); a row whose largest logit is not finite gets NaN, as torch's softmax gives it.
void law_of_row(const float* x, int64_t n, float top, const Law& law, float* out, std::vector<float>& scratch,
                std::vector<double>& chunks) {
  if (!std::isfinite(top)) {
    std::fill(out, out + n, NAN);
    return;
  }
  const float scale = scale_of(law.temperature > 0.f ? law.temperature : 1.f);
  if (keeps_few(law, n)) {
    const std::vector<Candidate> kept = few_kept(x, n, top, scale, law, scratch);
    double total = 0.0;
    for (const Candidate& c : kept) total += c.e;
    std::fill(out, out + n, 0.f);
    for (const Candidate& c : kept) out[c.i] = static_cast<float>(c.e / total);
    return;
  }
  chunks.resize((n + CHUNK - 1) / CHUNK);
  weights_of(x, n, top, scale, out, chunks.data());
  const RowKept kept = law.top_p < 1.f ? nucleus_of_row(x, out, n, chunks, law) : EVERY_WEIGHED;
  const double total = total_of(chunks);
  const float inverse = static_cast<float>(1.0 / total), least = kept.least;
  for (int64_t i = 0; i < n; ++i) out[i] = out[i] >= least ? out[i] * inverse : 0.f;
  for (const Candidate& c : kept.extra) out[c.i] = static_cast<float>(c.e / total);
}

// A batch's logits as fp32 rows with their maxima, and each row's law, checked: logits [n, vocab]
// (any float type), temperature/top_p/min_p [n] fp32, top_k [n] int64, uniform [n] fp64.
struct RowLaws {
  int64_t rows, vocab;
  at::Tensor x, top, t, k, p, mp, u;

  RowLaws(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
          const at::Tensor& min_p, const at::Tensor& uniform) {
    TORCH_CHECK(logits.dim() == 2 && logits.is_floating_point() && logits.device().is_cpu(),
                "logits must be a [rows, vocab] float CPU tensor, got ", logits.sizes(), " ", logits.scalar_type());
    rows = logits.size(0), vocab = logits.size(1);
    TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "a vocabulary of ", vocab, " tokens");
    const auto check = [this](const at::Tensor& v, at::ScalarType type, const char* name) {
      TORCH_CHECK(v.dim() == 1 && v.size(0) == rows && v.scalar_type() == type && v.device().is_cpu(), name,
                  " must be a CPU ", type, " tensor of ", rows, " values, got ", v.sizes(), " ", v.scalar_type());
      return v.contiguous();
    };
    t = check(temperature, at::kFloat, "temperature");
    k = check(top_k, at::kLong, "top_k");
    p = check(top_p, at::kFloat, "top_p");
    mp = check(min_p, at::kFloat, "min_p");
    u = check(uniform, at::kDouble, "uniform");
    if (rows == 0) return;
    x = logits.to(at::kFloat).contiguous();
    top = at::amax(x, 1, true);
  }

  const float* row(int64_t r) const { return x.data_ptr<float>() + r * vocab; }
  float top_of(int64_t r) const { return top.data_ptr<float>()[r]; }
  Law law(int64_t r) const {
    return Law{t.data_ptr<float>()[r], k.data_ptr<int64_t>()[r], p.data_ptr<float>()[r], mp.data_ptr<float>()[r],
               u.data_ptr<double>()[r]};
  }
};

// -> tokens [n] int64, uniform in [0, 1). A greedy row (temperature 0) takes its first largest
// logit; so does a row whose largest is not finite (every token masked, or a NaN).
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform) {
  const RowLaws laws(logits, temperature, top_k, top_p, min_p, uniform);
  at::Tensor out = at::empty({laws.rows}, logits.options().dtype(at::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, laws.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e;  // a row's weights, where its law needs every token's
    std::vector<double> chunks;
    for (int64_t r = begin; r < end; ++r) {
      tokens[r] = sample_row(laws.row(r), laws.vocab, laws.top_of(r), laws.law(r), e, chunks);
    }
  });
  return out;
}

// -> probs [n, vocab] fp32: each row's law as sample_rows draws from it (law_of_row), rows
// summing to 1, without sorting the vocabulary (speculative decoding's acceptance reads it).
at::Tensor law_probabilities(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                             const at::Tensor& top_p, const at::Tensor& min_p) {
  const int64_t rows = logits.dim() == 2 ? logits.size(0) : 0;
  const at::Tensor unused = at::zeros({rows}, logits.options().dtype(at::kDouble));
  const RowLaws laws(logits, temperature, top_k, top_p, min_p, unused);
  at::Tensor out = at::empty({laws.rows, laws.vocab}, logits.options().dtype(at::kFloat));
  float* probs = out.data_ptr<float>();
  at::parallel_for(0, laws.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<double> chunks;
    for (int64_t r = begin; r < end; ++r) {
      law_of_row(laws.row(r), laws.vocab, laws.top_of(r), laws.law(r), probs + r * laws.vocab, scratch, chunks);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
          "Tensor uniform) -> Tensor");
  lib.def("law_probabilities(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("sample_rows", &sample_rows);
  lib.impl("law_probabilities", &law_probabilities);
}
