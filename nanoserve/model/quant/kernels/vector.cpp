// The vector tiers, one source: built once per tier with NANOSERVE_TIER_<NAME> defined and that
// tier's own instruction flags (nanoserve/model/quant/cpu_kernels.py), never -march=native. The
// algorithm is the scalar reference's (reference.cpp); a tier supplies its vector primitives
// (simd_x86.h, simd_neon.h) and its name.
#include <algorithm>
#include <type_traits>
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

// Whether a block of `rows` rows with 8-bit activations, holding both halves' integer sums beside
// its fp32 sums, a code vector and an activation, needs more vector registers than the tier has.
constexpr bool halves_spill(int rows) { return 2 * rows + SUB * rows + 2 > V::REGISTERS; }
// Codes are fetched into L1 this many bytes ahead of their use: the hardware prefetcher alone
// leaves a one-row product short of the memory bandwidth, and fetching further ahead into L1
// (4-32 KB) reads slower again on a Sapphire Rapids VM (a 1-row 1B pass on 2 MB pages: 2 KB 27 ms,
// 8 KB 32 ms).
constexpr int64_t PREFETCH_BYTES = 2048;
// ... and into L2 this far ahead, which keeps more lines in flight than L1's fill buffers do (32
// lines at 2 KB hold one core's stream near 16 GB/s on Zen 4). It pays where a product is short
// or streams alone: on a Zen 4 VM a pass of SmolLM2-135M's products at one row 0.87-0.94x the
// time (8-16 KB alike), its 28 MB head 0.69-0.88x, a 1B pass unchanged (it was at its read floor).
constexpr int64_t PREFETCH_L2_BYTES = 12288;
// A hint to fetch the line holding p into L2 (x86 prefetcht1, ARM PLDL2KEEP), where more misses
// can be in flight than L1's fill buffers hold.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }
// The `#pragma GCC unroll` lines below unroll the loops over rows, chains and code vectors, so
// that the accumulator arrays they index stay in registers; left as loops, GCC keeps them on the
// stack.

// reference.cpp's quantiser in vector operations, the same IEEE operations in the same order (so the
// codes equal the reference's bit for bit): per group, coarse = max |x| / 127, hi = rint(x /
// coarse), lo = rint((x - hi * coarse) / fine), both clamped to -127..127.
template <typename E>
void quantize_rows_typed(const E* x, int64_t M, int64_t K, int64_t row_begin, int64_t row_end, int8_t* xq, float* xd,
                         float* xs, int32_t* xsum) {
  constexpr int C = GROUP / V::LANES;
  const int64_t G = K / GROUP;
  const V::F top = V::set1(127.f), bottom = V::set1(-127.f);
  for (int64_t i = row_begin * G; i < row_end * G; ++i) {
    V::F v[C];
    V::F amax = V::fzero();
    for (int c = 0; c < C; ++c) {
      v[c] = V::load(x + i * GROUP + V::LANES * c);
      amax = V::max(amax, V::abs(v[c]));
    }
    const GroupScales sc = group_scales(V::hmax(amax));
    const V::F inv_coarse = V::set1(sc.inv_coarse), inv_fine = V::set1(sc.inv_fine), coarse = V::set1(sc.coarse);
    V::F sum_h[2] = {V::fzero(), V::fzero()}, sum_l[2] = {V::fzero(), V::fzero()};  // per half: exact integers
    for (int c = 0; c < C; ++c) {
      const V::F h = V::min(V::max(V::rint(V::mul(v[c], inv_coarse)), bottom), top);
      const V::F rest = V::sub(v[c], V::mul(h, coarse));
      const V::F l = V::min(V::max(V::rint(V::mul(rest, inv_fine)), bottom), top);
      V::store_int8(xq + x_group_at(i, G) + V::LANES * c, V::to_int(h));
      V::store_int8(xq + M * x_row_stride(K) + x_group_at(i, G) + V::LANES * c, V::to_int(l));
      sum_h[2 * c / C] = V::add(sum_h[2 * c / C], h);
      sum_l[2 * c / C] = V::add(sum_l[2 * c / C], l);
    }
    float sums[4];  // exact integers: the same in any order of adds
    V::hsum4(sum_h[0], sum_h[1], sum_l[0], sum_l[1], sums);
    const int32_t sum_hi[2] = {static_cast<int32_t>(sums[0]), static_cast<int32_t>(sums[1])};
    const int32_t sum_lo[2] = {static_cast<int32_t>(sums[2]), static_cast<int32_t>(sums[3])};
    store_group(i, M, G, sum_hi, sum_lo, sc.fine, xd, xs, xsum);
  }
}

// reference.cpp's one-code quantiser (x_bits 8) in vector operations: per half group of 16, the
// step half_scales gives, the same codes bit for bit.
template <typename E>
void quantize_halves_typed(const E* x, int64_t M, int64_t K, int64_t row_begin, int64_t row_end, int8_t* xq,
                           float* xd, float* xs, int32_t* xsum) {
  constexpr int C = 16 / V::LANES;
  const int64_t G = K / GROUP;
  const V::F top = V::set1(127.f), bottom = V::set1(-127.f);
  for (int64_t group = row_begin * G; group < row_end * G; ++group) {  // its halves i = 2 group, 2 group + 1
    V::F v[2][C];
    float amax[2];
    for (int h = 0; h < 2; ++h) {
      V::F m = V::fzero();
      for (int c = 0; c < C; ++c) {
        v[h][c] = V::load(x + (2 * group + h) * 16 + V::LANES * c);
        m = V::max(m, V::abs(v[h][c]));
      }
      amax[h] = V::hmax(m);
    }
    const float group_max = amax[0] > amax[1] ? amax[0] : amax[1];
    for (int h = 0; h < 2; ++h) {
      const int64_t i = 2 * group + h;
      const GroupScales sc = half_scales(amax[h], group_max);
      const V::F inv_step = V::set1(sc.inv_coarse);
      V::F sum = V::fzero();  // exact integers
      for (int c = 0; c < C; ++c) {
        const V::F q = V::min(V::max(V::rint(V::mul(v[h][c], inv_step)), bottom), top);
        V::store_int8(xq + x_half_at(i, G) + V::LANES * c, V::to_int(q));
        sum = V::add(sum, q);
      }
      store_half(i, M, G, static_cast<int32_t>(V::hsum(sum)), sc.coarse, xq, xd, xs, xsum);
    }
  }
}

void quantize_rows(const void* x, int32_t x_bf16, int64_t M, int64_t K, int64_t row_begin, int64_t row_end,
                   int32_t x_bits, int8_t* xq, float* xd, float* xs, int32_t* xsum) {
  if (x_bits == 8) {
    if (x_bf16) quantize_halves_typed(static_cast<const uint16_t*>(x), M, K, row_begin, row_end, xq, xd, xs, xsum);
    else quantize_halves_typed(static_cast<const float*>(x), M, K, row_begin, row_end, xq, xd, xs, xsum);
  } else if (x_bf16) {
    quantize_rows_typed(static_cast<const uint16_t*>(x), M, K, row_begin, row_end, xq, xd, xs, xsum);
  } else {
    quantize_rows_typed(static_cast<const float*>(x), M, K, row_begin, row_end, xq, xd, xs, xsum);
  }
}

// LANES fp32 sums to out[at ..] as fp32 or (rounded to nearest even) bf16.
inline void store_out(void* out, int64_t at, V::F v, bool bf16) {
  if (!bf16) return V::store(static_cast<float*>(out) + at, v);
  float lanes[V::LANES];
  V::store(lanes, v);
  for (int i = 0; i < V::LANES; ++i) static_cast<uint16_t*>(out)[at + i] = float_to_bf16(lanes[i]);
}

// The code vector j (of 8) of one group for the vector s of outputs: it multiplies the 4
// activations at k offset code_offset(j) of the group. 5-bit codes are the 4-bit vector with each
// fifth bit, from the bit plane after the group's nibbles, set back as 16; 6-bit codes take their
// fifth and sixth bits from the crumb vector after the nibbles, shifted into place (common.h).
// A table's 4-bit codes are looked up in `lut` (lut_register), which gives them as byte codes.
template <int BITS, bool LUT = false>
inline V::C code_vector(const uint8_t* wg, int s, int j, V::C lut) {
  if constexpr (BITS == 8) {
    return V::flip(V::load_codes(wg + 64 * j + 4 * V::LANES * s));
  } else {
    const V::C b = V::load_codes(wg + 64 * (j / 2) + 4 * V::LANES * s);
    const V::C low = j % 2 ? V::high_nibbles(b) : V::low_nibbles(b);
    if constexpr (LUT) return V::lookup(lut, low);
    if constexpr (BITS == 4) return low;
    if constexpr (BITS == 5) return V::or_bit(low, wg + 256 + 8 * j, s, 16);
    const V::C crumbs = V::load_codes(wg + 256 + 64 * (j / 4) + 4 * V::LANES * s);
    switch (j % 4) {
      case 0: return V::template or_crumbs<0>(low, crumbs);
      case 1: return V::template or_crumbs<1>(low, crumbs);
      case 2: return V::template or_crumbs<2>(low, crumbs);
      default: return V::template or_crumbs<3>(low, crumbs);
    }
  }
}

// A table's 16 values as the register code_vector looks nibbles up in: each value v as the
// byte code v + 128 (a byte code with zero point 128, whose sums group_sums corrects), flipped
// as the tier flips byte codes (to v itself on the tiers that multiply signed codes).
inline V::C lut_register(const int8_t* table) {
  uint8_t biased[16];
  for (int i = 0; i < 16; ++i) biased[i] = static_cast<uint8_t>(table[i]) ^ 0x80;
  return V::flip(V::load_table(biased));
}

// The zero point group_sums takes out of a format's sums: a table's byte codes' 128.
inline int32_t sums_zero_point(nanoserve_format f) { return f.table ? 128 : f.zero_point; }

template <int BITS>
constexpr int code_offset(int j) { return BITS == 8 ? 4 * j : 8 * (j / 2) + 4 * (j % 2); }

template <int BITS, bool LUT>
inline V::A dot_codes(V::A acc, V::C code, const int8_t* x) {
  if constexpr (LUT || BITS == 8) return V::dot_bytes(acc, code, x);
  else if constexpr (BITS == 4) return V::dot_nibbles(acc, code, x);
  else return V::dot_wide(acc, code, x);
}

// Whether a tier multiplies a format's codes two code vectors at a time (V::WIDE_PAIRS: AVX2,
// whose 5- and 6-bit products are each widened from int16 at once): then group_sums and
// half_block_sums take the code vectors in pairs, one widening for two. The sums are integers,
// the same in any order. Only these formats on this tier take the pair loop: every format in
// pairs (one loop, two dot_codes a pair elsewhere) gave the same bits but measured slower on
// other paths (in cache, one thread: avx-vnni's 8-bit Q4_0 at 32 rows 93 -> 89 G/s, avx2's
// one-row Q6_K at 16 bits 22 -> 19).
template <typename S> constexpr bool has_wide_pairs(decltype(S::WIDE_PAIRS)) { return S::WIDE_PAIRS; }
template <typename S> constexpr bool has_wide_pairs(...) { return false; }
template <int BITS, bool LUT>
constexpr bool wide_pairs() { return !LUT && (BITS == 5 || BITS == 6) && has_wide_pairs<V>(true); }
// V::dot_wide_pair, looked up only where wide_pairs holds (S makes the name dependent).
template <int BITS, typename S = V>
inline V::A dot_wide_pair(V::A acc, V::C c0, const int8_t* x0, V::C c1, const int8_t* x1) {
  return S::dot_wide_pair(acc, c0, x0, c1, x1);
}

// Whether a tier folds the two halves of a group's 8-bit products at once (V::HALF_MULTIPLIERS:
// AVX2). Its 4-bit products keep each half's sums in int16 until one vpmaddwd widens them; by
// each half's n (common.h's half_scales: the half's step is n / 16 of its group's) instead of
// ones, the group's sums n0 s0 + n1 s1 fold into fp32 with one convert, one multiply (by the
// group's step / 16) and one multiply-add, where each half took all three. A Q4_0 or Q4_K product
// at 32 rows in cache, one thread: 75 -> 83 G multiply-adds/s. Integer sums, so any row count
// folds them the same. 4-bit codes in groups of 32 (Q4_0, Q4_1, Q4_K): the others widen each
// product apart (byte codes, tables, the 5- and 6-bit pairs) or have a scale per half.
template <typename S> constexpr bool has_half_multipliers(decltype(S::HALF_MULTIPLIERS)) { return S::HALF_MULTIPLIERS; }
template <typename S> constexpr bool has_half_multipliers(...) { return false; }
template <typename F, bool LO>
constexpr bool sixteenths() { return !LO && F::BITS == 4 && !F::SPLIT && !F::LUT && has_half_multipliers<V>(true); }

// What sixteenths reads besides the steps, per activation row r and group g (of G): each half's
// n as the int16 pair (n, n) (n[2 (r G + g) + h]) and the group's step / 16 (step16[r G + g]).
struct Sixteenths {
  const int32_t* n = nullptr;
  const float* step16 = nullptr;
  int64_t G = 0;
  // Row r's n of half h of group g in every lane pair: widen's multipliers.
  V::I multipliers(int64_t r, int64_t g, int h) const { return V::iset1(n[2 * (r * G + g) + h]); }
  // Row r's dot with group g's codes from its halves' widened sums: (n0 s0 + n1 s1) x step / 16.
  V::F dot(V::I s0, V::I s1, int64_t r, int64_t g) const {
    return V::mul(V::to_float(V::iadd(s0, s1)), V::set1(step16[r * G + g]));
  }
};

// Sixteenths for M rows of G groups, read back from the steps per half (xd [M, 2G], x_bits 8)
// into this thread's scratch: the larger step is the group's (n = 16), the other's n is
// rint(16 step / the group's), exact (the steps are n / 16 of the group's within a few roundings).
// Made once per piece of a product's blocks (group_mm_typed: a thread takes ~14 a call), so a
// tier does most groups in vectors (S::sixteenths): a 1B Q4_0 pass of products on avx2, the same
// bits, 0.987x the time at one row, 0.965x at 8 and 0.986x at 32 (the scalar divisions alone).
template <typename S = V>
Sixteenths sixteenths_of(const float* xd, int64_t M, int64_t G) {
  thread_local std::vector<int32_t> n;
  thread_local std::vector<float> step16;
  if (static_cast<int64_t>(step16.size()) < M * G) n.resize(2 * M * G), step16.resize(M * G);
  int64_t i = 0;
  if constexpr (has_half_multipliers<S>(true)) i = S::sixteenths(xd, M * G, n.data(), step16.data());
  for (; i < M * G; ++i) {
    const float a = xd[2 * i], b = xd[2 * i + 1], group = a > b ? a : b;
    for (int h = 0; h < 2; ++h) {
      const uint32_t nh = group > 0.f ? static_cast<uint32_t>(__builtin_rintf(16.f * xd[2 * i + h] / group)) : 16u;
      n[2 * i + h] = static_cast<int32_t>(nh | nh << 16);
    }
    step16[i] = group / 16.f;
  }
  return {n.data(), step16.data(), G};
}

// Whether a tier's group-16 formats at 8-bit activations, where their per-vector sums would spill,
// sum each scale group for both vectors of outputs at once and fold it before the next
// (V::FOLD_SCALE_GROUPS: AVX2), as group-32 formats' halves are.
template <typename S> constexpr bool folds_scale_groups(decltype(S::FOLD_SCALE_GROUPS)) { return S::FOLD_SCALE_GROUPS; }
template <typename S> constexpr bool folds_scale_groups(...) { return false; }

// V::widen, looked up only where sixteenths holds (S makes the name dependent).
template <typename S = V>
inline V::I widen_by(V::A a, V::I m) { return S::widen(a, m); }

template <int BITS, bool LUT>
inline V::I finish_codes(V::A a) {
  if constexpr (LUT || BITS == 8) return V::finish_bytes(a);
  else if constexpr (BITS == 4) return V::finish_nibbles(a);
  else return V::finish_wide(a);
}

// What a product adds per unit of the activation codes' sums: it undoes the byte tiers' flip to
// signed codes and, with a zero point z, makes the code sums those of c - z.
template <int BITS, bool LUT>
constexpr int32_t sums_offset(int32_t zero_point) {
  return ((BITS == 8 || LUT) && !V::UNSIGNED_BYTES ? 128 : 0) - zero_point;
}

// The integer sums of one group of 32 for the LANES outputs of vector s, for R rows at once:
// hi[h][r] = sum_k c x_hi, lo[h][r] = sum_k c x_lo, over the group's 32 k (h = 0) or, with SPLIT,
// over each half of 16 (h = 0, 1: a group-16 format's two scale groups, or 8-bit activations' two
// steps; code vectors j < 4 hold k < 16 in both layouts). Row r's codes at + row[r] * stride,
// int8 in -127..127. The sums are the raw products of the codes as the tier multiplies them: the
// offset (sums_offset) is the caller's to take out. Each code vector is loaded once for all rows;
// each sum is split over two accumulators (the halves, or even and odd j with few rows), so
// dependent multiply-adds do not wait on each other.
// LUT: 4-bit codes through the table in `lut`, as byte codes (zero_point 128: sums_zero_point).
// MUL (sixteenths): half h's sums of row r are widened by mult[h][r].
// VECTORS: the sums of vectors s .. s + VECTORS - 1 at once, vector s + v's in hi[v H + h] (H = 2
// with SPLIT, else 1), each activation broadcast once for all of them (one row on a tier that
// shares its broadcasts, block16's ROW_BLOCK).
template <int BITS, bool LUT, bool SPLIT, int R, bool LO = true, bool MUL = false, int VECTORS = 1>
inline void group_sums(const uint8_t* wg, int s, V::C lut, const int8_t* hi_x, const int8_t* lo_x, const int64_t* row,
                       int64_t stride, V::I (*hi)[R], V::I (*lo)[R], const V::I (*mult)[R] = nullptr) {
  static_assert(!MUL || (BITS == 4 && !LUT && SPLIT && !LO), "multipliers widen 8-bit nibble sums per half");
  static_assert(!MUL || VECTORS == 1, "multipliers are given for one vector");
  constexpr int CHAINS = SPLIT || R <= 2 ? 2 : 1, H = SPLIT ? 2 : 1;
  V::A ah[VECTORS][CHAINS][R], al[VECTORS][CHAINS][R];
  #pragma GCC unroll 16
  for (int v = 0; v < VECTORS; ++v) {
    #pragma GCC unroll 16
    for (int c = 0; c < CHAINS; ++c) {
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) ah[v][c][r] = al[v][c][r] = V::azero();
    }
  }
  if constexpr (wide_pairs<BITS, LUT>()) {
    #pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const int c = SPLIT ? j / 4 : (j / 2) % CHAINS, at0 = code_offset<BITS>(j), at1 = code_offset<BITS>(j + 1);
      #pragma GCC unroll 16
      for (int v = 0; v < VECTORS; ++v) {
        const V::C c0 = code_vector<BITS, LUT>(wg, s + v, j, lut), c1 = code_vector<BITS, LUT>(wg, s + v, j + 1, lut);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const int8_t* xh = hi_x + row[r] * stride;
          ah[v][c][r] = dot_wide_pair<BITS>(ah[v][c][r], c0, xh + at0, c1, xh + at1);
          if constexpr (LO) {
            const int8_t* xl = lo_x + row[r] * stride;
            al[v][c][r] = dot_wide_pair<BITS>(al[v][c][r], c0, xl + at0, c1, xl + at1);
          }
        }
      }
    }
  } else
  #pragma GCC unroll 16
  for (int j = 0; j < 8; ++j) {
    V::C code[VECTORS];
    #pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) code[v] = code_vector<BITS, LUT>(wg, s + v, j, lut);
    const int c = SPLIT ? j / 4 : j % CHAINS, at = code_offset<BITS>(j);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      #pragma GCC unroll 16
      for (int v = 0; v < VECTORS; ++v) {
        ah[v][c][r] = dot_codes<BITS, LUT>(ah[v][c][r], code[v], hi_x + row[r] * stride + at);
        if constexpr (LO) al[v][c][r] = dot_codes<BITS, LUT>(al[v][c][r], code[v], lo_x + row[r] * stride + at);
      }
    }
  }
  const auto finish = [](V::A a) { return finish_codes<BITS, LUT>(a); };
  #pragma GCC unroll 16
  for (int v = 0; v < VECTORS; ++v) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      #pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        if constexpr (MUL) hi[v * H + h][r] = widen_by(ah[v][h][r], mult[h][r]);
        else hi[v * H + h][r] = finish(ah[v][h][r]);
        if constexpr (LO) lo[v * H + h][r] = finish(al[v][h][r]);
      }
      if constexpr (!SPLIT && CHAINS == 2) {
        hi[v * H][r] = V::iadd(hi[v * H][r], finish(ah[v][1][r]));
        if constexpr (LO) lo[v * H][r] = V::iadd(lo[v * H][r], finish(al[v][1][r]));
      }
    }
  }
}

// Whether a tier sums one row's group for every vector s of the block per activation broadcast
// (V::SHARED_BROADCASTS: AVX2; group_sums' VECTORS), where group_sums called per s broadcasts the
// row's activations again for each s (GCC shares the broadcasts between the calls, but stores
// them to the stack to do it).
template <typename S> constexpr bool shares_broadcasts(decltype(S::SHARED_BROADCASTS)) { return S::SHARED_BROADCASTS; }
template <typename S> constexpr bool shares_broadcasts(...) { return false; }

// The hi sums of half a group (code vectors J0 .. J0 + 3, the k of one 8-bit activation step) for
// every vector s of the 16-output block at once: sums[s][r] for the LANES outputs of vector s and
// row r. Each row's four activations are broadcast once per code offset and multiplied by the SUB
// code vectors, where group_sums, called per s, broadcasts them SUB times. With wide_pairs, two
// code offsets at a time (a 5-bit product at 4 rows on avx2, 32 rows in cache: 52 -> 54 G/s).
// MUL (sixteenths): row r's sums are widened by mult[r].
template <int BITS, bool LUT, int R, int J0, bool MUL = false>
inline void half_block_sums(const uint8_t* wg, V::C lut, const int8_t* x, const int64_t* row, int64_t stride,
                            V::I (*sums)[R], const V::I* mult = nullptr) {
  V::A a[SUB][R];
  #pragma GCC unroll 16
  for (int s = 0; s < SUB; ++s) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[s][r] = V::azero();
  }
  if constexpr (wide_pairs<BITS, LUT>()) {
    #pragma GCC unroll 2
    for (int j = J0; j < J0 + 4; j += 2) {
      V::C c0[SUB], c1[SUB];
      #pragma GCC unroll 16
      for (int s = 0; s < SUB; ++s) {
        c0[s] = code_vector<BITS, LUT>(wg, s, j, lut);
        c1[s] = code_vector<BITS, LUT>(wg, s, j + 1, lut);
      }
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x + row[r] * stride;
        #pragma GCC unroll 16
        for (int s = 0; s < SUB; ++s)
          a[s][r] = dot_wide_pair<BITS>(a[s][r], c0[s], xr + code_offset<BITS>(j), c1[s], xr + code_offset<BITS>(j + 1));
      }
    }
  } else
  #pragma GCC unroll 4
  for (int j = J0; j < J0 + 4; ++j) {
    V::C code[SUB];
    #pragma GCC unroll 16
    for (int s = 0; s < SUB; ++s) code[s] = code_vector<BITS, LUT>(wg, s, j, lut);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      #pragma GCC unroll 16
      for (int s = 0; s < SUB; ++s)
        a[s][r] = dot_codes<BITS, LUT>(a[s][r], code[s], x + row[r] * stride + code_offset<BITS>(j));
    }
  }
  #pragma GCC unroll 16
  for (int s = 0; s < SUB; ++s) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if constexpr (MUL) sums[s][r] = widen_by(a[s][r], mult[r]);
      else sums[s][r] = finish_codes<BITS, LUT>(a[s][r]);
    }
  }
}

// LANES scales (or minimums) of kind KIND from element i = 16 h + lane of a block's numbers (common.h).
template <bool SPLIT, int KIND>
__attribute__((always_inline)) inline V::F scales_of(const void* p, int64_t i) {
  if constexpr (KIND == SCALES_FP32) {
    return V::load(static_cast<const float*>(p) + i);
  } else if constexpr (KIND == SCALES_FP16) {
    return V::load_fp16(static_cast<const uint16_t*>(p) + i);
  } else if constexpr (KIND == SCALES_E8M0) {
    float lanes[V::LANES];
    for (int l = 0; l < V::LANES; ++l) lanes[l] = e8m0_half(static_cast<const uint8_t*>(p)[i + l]);
    return V::load(lanes);
  } else {
    constexpr int64_t group = SPLIT ? 16 : 32, per_record = 256 / group;
    const int64_t h = i / 16, lane = i % 16;
    const uint8_t* record = static_cast<const uint8_t*>(p) + (h / per_record) * super_record_bytes(group);
    const V::F super = V::load_fp16(reinterpret_cast<const uint16_t*>(record) + lane);
    return V::mul(super, V::load_int8(reinterpret_cast<const int8_t*>(record) + 32 + 16 * (h % per_record) + lane));
  }
}

// What of a weight format the code is specialised on: the codes' storage bits, scale groups of
// 16 and a code table (the scales' kind, the zero point and the table's values are run-time values).
template <int BITS_, bool SPLIT_, bool LUT_ = false>
struct Format {
  static constexpr int BITS = BITS_;
  static constexpr bool SPLIT = SPLIT_;
  static constexpr bool LUT = LUT_;
  static constexpr int PER = SPLIT ? 2 : 1;                         // scale groups per group of 32
  static constexpr int64_t GROUP_BYTES = group_bytes(BITS);          // codes of 16 outputs x 32 k
  // their scales (or minimums): a super-block record spread over its 8 groups of 32
  static int64_t scale_bytes(int kind) {
    if (kind == SCALES_SUPER) return super_record_bytes(32 / PER) / 8;
    return 16 * PER * (kind == SCALES_FP32 ? 4 : kind == SCALES_E8M0 ? 1 : 2);
  }
  // Rows sharing each code vector, with 16-bit activations (LO) or 8: a group-16 format's 16-bit
  // sums hold twice the accumulators (8-bit sums come per half in every format: ROWS_A8 counts
  // them, ROWS_A8_G16 for a group-16 format's, where a tier shares its code vectors wider).
  template <bool LO>
  static constexpr int rows() {
    if constexpr (!LO) return SPLIT ? V::ROWS_A8_G16 : V::ROWS_A8;
    return SPLIT ? (V::ROWS > 1 ? V::ROWS / 2 : 1) : V::ROWS;
  }
};

// Where block16 reads a block's scales (scale) and what a scale group adds per unit of the
// activations' sum (minimum: its minimum, and the offset sums_offset gives as d * offset), for
// element i = 16 h + lane of the block's numbers (scales_of).
//   KindScales: the block's scales as the file holds them, decoded at each fold with the kind a
//     template argument (one_row and few_rows_block pick it once per block): right for one row
//     or a few, which use each scale once (few_rows says what decoding ahead costs). With the kind a run-time
//     value the decode was an out-of-line call per scale group, which spilled the live sums: a
//     one-row product in cache, one thread, ran at 51 (Q4_0) and 44 (Q4_K) G multiply-adds/s on
//     avx512-vnni, 59 and 52 inline.
//   DecodedScales: decoded to fp32 once for every chunk of rows that multiplies the block
//     (decode_scales), read as plain vectors.
// BlockScales: where a block's scales are, whatever their kind.
template <bool SPLIT>
struct BlockScales {
  nanoserve_format f;
  const void* d;
  const void* m;
  int64_t group_bytes;  // a group of 32's scale bytes: prefetched as far ahead as its codes
  bool symmetric() const { return f.zero_point != 0 || f.table; }  // no minimums stored
  // Whether a product adds anything per unit of the activations' sums (minimums, or an offset).
  template <int BITS, bool LUT>
  bool has_minimums() const { return !symmetric() || sums_offset<BITS, LUT>(sums_zero_point(f)) != 0; }
  // Group g's scales as far ahead as its codes are fetched (code_bytes: a group's codes).
  void prefetch(int64_t g, int64_t code_bytes) const {
    for (int64_t l = 0; l < group_bytes; l += 64) {
      const int64_t at = g * group_bytes + PREFETCH_BYTES * group_bytes / code_bytes + l;
      __builtin_prefetch(static_cast<const char*>(d) + at);
      if (!symmetric()) __builtin_prefetch(static_cast<const char*>(m) + at);
    }
  }
};

template <bool SPLIT, int KIND>
struct KindScales : BlockScales<SPLIT> {
  V::F scale(int64_t i) const { return scales_of<SPLIT, KIND>(this->d, i); }
  template <int BITS, bool LUT>
  V::F minimum(int64_t i, V::F dv) const {
    const V::F mv = this->symmetric() ? V::fzero() : scales_of<SPLIT, KIND>(this->m, i);
    const int32_t offset = sums_offset<BITS, LUT>(sums_zero_point(this->f));
    return offset != 0 ? V::fma(dv, V::set1(static_cast<float>(offset)), mv) : mv;
  }
};

struct DecodedScales {
  const float* ds;
  const float* ms;
  V::F scale(int64_t i) const { return V::load(ds + i); }
  template <int BITS, bool LUT>
  V::F minimum(int64_t i, V::F) const { return V::load(ms + i); }
  void prefetch(int64_t, int64_t) const {}  // the block's scales are in cache
};

// A block's scales decoded into this thread's scratch, the same operations in the same order
// (so the products are the same bit for bit). `ahead`: the bytes of the next block's scales (and
// minimums), prefetched meanwhile, as they are read in a burst at its start (0: none).
template <typename F, int KIND>
void decode_kind(const BlockScales<F::SPLIT>& kind, int64_t count, float* ds, float* ms) {
  const bool symmetric = kind.symmetric();
  const int32_t offset = sums_offset<F::BITS, F::LUT>(sums_zero_point(kind.f));
  const V::F offset_v = V::set1(static_cast<float>(offset));
  for (int64_t i = 0; i < count; i += V::LANES) {
    const V::F dv = scales_of<F::SPLIT, KIND>(kind.d, i);
    const V::F mv = symmetric ? V::fzero() : scales_of<F::SPLIT, KIND>(kind.m, i);
    V::store(ds + i, dv);
    V::store(ms + i, offset != 0 ? V::fma(dv, offset_v, mv) : mv);  // as KindScales::minimum
  }
}

template <typename F>
DecodedScales decode_scales(const BlockScales<F::SPLIT>& kind, int64_t K, int64_t ahead) {
  thread_local std::vector<float> scratch;
  const int64_t count = K / GROUP * F::PER * 16;
  if (static_cast<int64_t>(scratch.size()) < 2 * count) scratch.resize(2 * count);
  float* ds = scratch.data();
  float* ms = ds + count;
  for (int64_t l = 0; l < ahead; l += 64) {
    __builtin_prefetch(static_cast<const char*>(kind.d) + ahead + l);
    if (!kind.symmetric()) __builtin_prefetch(static_cast<const char*>(kind.m) + ahead + l);
  }
  switch (kind.f.scale_kind) {
    case SCALES_FP32: decode_kind<F, SCALES_FP32>(kind, count, ds, ms); break;
    case SCALES_FP16: decode_kind<F, SCALES_FP16>(kind, count, ds, ms); break;
    case SCALES_E8M0: decode_kind<F, SCALES_E8M0>(kind, count, ds, ms); break;
    default: decode_kind<F, SCALES_SUPER>(kind, count, ds, ms);
  }
  return {ds, ms};
}


// Which activation rows a block16 call multiplies, and where each one's outputs go (in rows of
// ldo from out): consecutive rows from r0 into consecutive rows (group_mm), or some of a step's
// routed pairs, pair p reading activation row p / per_x and writing output row p (experts_mm).
// skip(n): the same rows past their first n.
struct RowRun {
  int64_t r0;
  int64_t o0 = 0;  // where row r0's outputs go
  int64_t in(int r) const { return r0 + r; }
  int64_t out(int r) const { return o0 + r; }
  RowRun skip(int n) const { return {r0 + n, o0 + n}; }
};

struct RoutedPairs {
  const int64_t* pairs;
  int64_t per_x;  // pairs per activation row: top_k, or 1 where each pair has its own row
  int64_t in(int r) const { return pairs[r] / per_x; }
  int64_t out(int r) const { return pairs[r]; }
  RoutedPairs skip(int n) const { return {pairs + n, per_x}; }
};

// One block of 16 outputs for R rows (`rows`): for each group, each code vector is loaded (from
// cache after the first chunk of rows) and multiplied against the R rows; the rows' fp32 sums
// stay in registers across the groups. scales: the block's scales and minimums (KindScales or
// DecodedScales; minimums read only if has_minimums); out: the block's first output of output
// row 0. LO: the activations' lo codes too (x_bits 16), else hi alone, a step per half group
// (x_bits 8). A zero point (and the byte tiers' flip) is taken out in floats, with the minimums:
// one multiply-add a row per scale group, where in the integer sums it cost a broadcast and two
// adds a row (6% of a pass at 8 rows, more at -O2).
// SIXT (sixteenths, sx): a group's two halves are widened by their n and fold at once.
template <typename F, bool LO, int R, typename Rows, typename Scales>
void block16(const uint8_t* w, const Scales& scales, bool has_minimums, int64_t K, int64_t M, Rows rows,
             const int8_t* xq, const float* xd, const float* xs, Sixteenths sx, void* out, bool out_bf16,
             int64_t ldo, nanoserve_format f) {
  constexpr bool SIXT = sixteenths<F, LO>();
  const int64_t G = K / GROUP;
  V::C lut{};
  if constexpr (F::LUT) lut = lut_register(f.table);
  int64_t in[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) in[r] = rows.in(r);
  V::F acc[SUB][R];
  #pragma GCC unroll 16
  for (int s = 0; s < SUB; ++s) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[s][r] = V::fzero();
  }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * F::GROUP_BYTES;
    // A prefetch is a hint: past the end of the weights it fetches nothing and cannot fault.
    for (int64_t l = 0; l < F::GROUP_BYTES; l += 64) {
      __builtin_prefetch(wg + PREFETCH_BYTES + l);
      prefetch_l2(wg + PREFETCH_L2_BYTES + l);
    }
    scales.prefetch(g, F::GROUP_BYTES);
    // 8-bit activations have a step per half group: their sums come per half, as a group-16 format's.
    // Where both halves' integer sums and the fp32 sums would not fit the tier's registers (AVX2
    // and AVX-VNNI at 4 rows), a group-32 format's halves are summed one after the other, for both
    // vectors s at once (half_block_sums), and each folded into the fp32 sums in turn. On such a tier
    // fewer rows fold the halves one by one in the same order, so a row's result does not depend on
    // how many rows share its call. A group-16 format's halves are its two scale groups, folded the
    // same way where the tier says so (V::FOLD_SCALE_GROUPS).
    constexpr bool FOLD_HALVES = !LO && (!F::SPLIT || folds_scale_groups<V>(true)) &&
                                 halves_spill(F::template rows<LO>());
    if constexpr (FOLD_HALVES && halves_spill(R)) {
      if constexpr (SIXT) {
        V::I n[2][R], sums[2][SUB][R];
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) n[0][r] = sx.multipliers(in[r], g, 0), n[1][r] = sx.multipliers(in[r], g, 1);
        half_block_sums<F::BITS, F::LUT, R, 0, true>(wg, lut, xq + g * GROUP, in, x_row_stride(K), sums[0], n[0]);
        half_block_sums<F::BITS, F::LUT, R, 4, true>(wg, lut, xq + g * GROUP, in, x_row_stride(K), sums[1], n[1]);
        #pragma GCC unroll 16
        for (int s = 0; s < SUB; ++s) {
          const V::F dv = scales.scale(g * 16 + V::LANES * s);
          #pragma GCC unroll 16
          for (int r = 0; r < R; ++r) acc[s][r] = V::fma(sx.dot(sums[0][s][r], sums[1][s][r], in[r], g), dv, acc[s][r]);
        }
      } else {
        #pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          V::I sums[SUB][R];
          if (half == 0) half_block_sums<F::BITS, F::LUT, R, 0>(wg, lut, xq + g * GROUP, in, x_row_stride(K), sums);
          else half_block_sums<F::BITS, F::LUT, R, 4>(wg, lut, xq + g * GROUP, in, x_row_stride(K), sums);
          #pragma GCC unroll 16
          for (int s = 0; s < SUB; ++s) {
            const V::F dv = scales.scale((F::SPLIT ? g * 2 + half : g) * 16 + V::LANES * s);
            #pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
              acc[s][r] = V::fma(V::mul(V::to_float(sums[s][r]), V::set1(xd[in[r] * 2 * G + 2 * g + half])), dv, acc[s][r]);
          }
          // A scale group's minimum right after its dot, in the order the vector-at-a-time fold adds them.
          #pragma GCC unroll 16
          for (int s = 0; s < SUB && F::SPLIT && has_minimums; ++s) {
            const int64_t at = (g * 2 + half) * 16 + V::LANES * s;
            const V::F mv = scales.template minimum<F::BITS, F::LUT>(at, scales.scale(at));
            #pragma GCC unroll 16
            for (int r = 0; r < R; ++r) acc[s][r] = V::fma(mv, V::set1(xs[in[r] * 2 * G + 2 * g + half]), acc[s][r]);
          }
        }
      }
      #pragma GCC unroll 16
      for (int s = 0; s < SUB && !F::SPLIT && has_minimums; ++s) {
        const int64_t at = g * 16 + V::LANES * s;
        const V::F mv = scales.template minimum<F::BITS, F::LUT>(at, scales.scale(at));
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const float* x_sums = xs + in[r] * 2 * G + 2 * g;  // the activations' sums, per half
          acc[s][r] = V::fma(mv, V::set1(x_sums[0] + x_sums[1]), acc[s][r]);
        }
      }
      continue;
    }
    // One row at 16 bits on a tier that shares its broadcasts: every vector's sums first.
    constexpr bool ROW_BLOCK = LO && R == 1 && SUB > 1 && !wide_pairs<F::BITS, F::LUT>() && shares_broadcasts<V>(true);
    V::I row_hi[SUB * F::PER][1], row_lo[SUB * F::PER][1];
    if constexpr (ROW_BLOCK) {
      group_sums<F::BITS, F::LUT, F::SPLIT, 1, true, false, SUB>(wg, 0, lut, xq + g * GROUP,
                                                                 xq + M * x_row_stride(K) + g * GROUP, in,
                                                                 x_row_stride(K), row_hi, row_lo);
    }
    #pragma GCC unroll 16
    for (int s = 0; s < SUB; ++s) {
      constexpr bool HALVES = F::SPLIT || !LO;
      V::I hi[HALVES ? 2 : 1][R], lo[HALVES ? 2 : 1][R], n[2][R];
      if constexpr (SIXT) {
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) n[0][r] = sx.multipliers(in[r], g, 0), n[1][r] = sx.multipliers(in[r], g, 1);
      }
      if constexpr (ROW_BLOCK) {
        #pragma GCC unroll 2
        for (int h = 0; h < F::PER; ++h) hi[h][0] = row_hi[s * F::PER + h][0], lo[h][0] = row_lo[s * F::PER + h][0];
      } else {
        group_sums<F::BITS, F::LUT, HALVES, R, LO, SIXT>(wg, s, lut, xq + g * GROUP,
                                                         xq + M * x_row_stride(K) + g * GROUP, in, x_row_stride(K),
                                                         hi, lo, n);
      }
      #pragma GCC unroll 2
      for (int h = 0; h < F::PER; ++h) {
        const int64_t at = (g * F::PER + h) * 16 + V::LANES * s;
        const V::F dv = scales.scale(at);
        #pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          V::F dot;  // the activations' dot with the codes
          if constexpr (LO) {
            // 254 hi + lo, exact in either order (|254 hi| < 2^24 for 4-bit codes; one rounding)
            dot = V::mul(V::fma(V::to_float(hi[h][r]), V::set1(254.f), V::to_float(lo[h][r])),
                         V::set1(xd[in[r] * G + g]));
          } else if constexpr (F::SPLIT) {
            dot = V::mul(V::to_float(hi[h][r]), V::set1(xd[in[r] * 2 * G + 2 * g + h]));
          } else if constexpr (SIXT) {  // as the halves at once above
            dot = sx.dot(hi[0][r], hi[1][r], in[r], g);
          } else if constexpr (FOLD_HALVES) {
            const float* steps = xd + in[r] * 2 * G + 2 * g;
            acc[s][r] = V::fma(V::mul(V::to_float(hi[0][r]), V::set1(steps[0])), dv, acc[s][r]);
            dot = V::mul(V::to_float(hi[1][r]), V::set1(steps[1]));
          } else {
            const float* steps = xd + in[r] * 2 * G + 2 * g;
            dot = V::fma(V::to_float(hi[1][r]), V::set1(steps[1]), V::mul(V::to_float(hi[0][r]), V::set1(steps[0])));
          }
          acc[s][r] = V::fma(dot, dv, acc[s][r]);
        }
        if (has_minimums) {
          const V::F mv = scales.template minimum<F::BITS, F::LUT>(at, dv);
          #pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            const float* x_sums = xs + in[r] * 2 * G + 2 * g;
            acc[s][r] = V::fma(mv, V::set1(F::SPLIT ? x_sums[h] : x_sums[0] + x_sums[1]), acc[s][r]);
          }
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int s = 0; s < SUB; ++s) {
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) store_out(out, rows.out(r) * ldo + V::LANES * s, acc[s][r], out_bf16);
  }
}

// run(scales) with a block's scales as KindScales of their kind, the kind a template argument
// from here on (one_row, few_rows_block).
template <bool SPLIT, typename Run>
void with_kind_scales(const BlockScales<SPLIT>& kind, Run run) {
  switch (kind.f.scale_kind) {
    case SCALES_FP32: return run(KindScales<SPLIT, SCALES_FP32>{kind});
    case SCALES_FP16: return run(KindScales<SPLIT, SCALES_FP16>{kind});
    case SCALES_E8M0: return run(KindScales<SPLIT, SCALES_E8M0>{kind});
    default: return run(KindScales<SPLIT, SCALES_SUPER>{kind});
  }
}

// One row's block (a batch-1 product, or an expert with one pair): the scales' kind made a
// template argument here, once per block, so that block16 decodes each group's scales inline
// (KindScales). Apart from few_rows_block, whose instances for one row measured 1-2% slower
// (avx512-vnni) and 11% (avx2) in a batch-1 pass, their code placed among the larger instances.
template <typename F, bool LO, typename Rows>
void one_row(const uint8_t* w, const BlockScales<F::SPLIT>& kind, bool has_minimums, int64_t K, int64_t M, Rows rows,
             const int8_t* xq, const float* xd, const float* xs, Sixteenths sx, void* out, bool out_bf16, int64_t ldo,
             nanoserve_format f) {
  with_kind_scales(kind, [&](auto scales) {
    block16<F, LO, 1>(w, scales, has_minimums, K, M, rows, xq, xd, xs, sx, out, out_bf16, ldo, f);
  });
}

// `count` rows of `rows`, 1 .. R at the top call (R: the tier's rows, a power of two), under 2 R
// below it: R at a time, then the rest by halves, so that a tier instantiates block16 for
// log2(R) + 1 row counts, not R (at R each, the avx512-vnni tier took 63 s to build). A row's
// result does not depend on how many rows share its call, and the decode steps' row buckets
// (powers of two) take a single call.
template <typename F, bool LO, int R = F::template rows<LO>(), typename Rows, typename Scales>
void rows_block(int count, const uint8_t* w, const Scales& scales, bool has_minimums, int64_t K, int64_t M,
                Rows rows, const int8_t* xq, const float* xd, const float* xs, Sixteenths sx, void* out, bool out_bf16,
                int64_t ldo, nanoserve_format f) {
  static_assert((R & (R - 1)) == 0, "a tier's rows are a power of two");
  if constexpr (R > 1) {
    if (count < R) {
      return rows_block<F, LO, R / 2>(count, w, scales, has_minimums, K, M, rows, xq, xd, xs, sx, out, out_bf16, ldo, f);
    }
  }
  block16<F, LO, R>(w, scales, has_minimums, K, M, rows, xq, xd, xs, sx, out, out_bf16, ldo, f);
  if constexpr (R > 1) {
    if (count > R) {
      rows_block<F, LO, R / 2>(count - R, w, scales, has_minimums, K, M, rows.skip(R), xq, xd, xs, sx, out, out_bf16,
                               ldo, f);
    }
  }
}

// How many rows a block multiplies with its scales decoded at each fold (KindScales) rather than
// into scratch first (DecodedScales): a step of up to this many rows is one chunk, which uses each
// scale once, and decoding ahead writes a block's scales out and reads them back (8 KB a block
// at K = 2048, 32 KB at 8192: a whole L1 beside the codes streaming through it). A 1B Q4_K_M
// pass of products, avx512-vnni on Zen 4, the same bits (scripts/kernel_ab.py): 2 rows 0.60x
// (8-bit activations) and 0.68x (16-bit) the time, 4 rows 0.76x and 0.91x; avx2 at 8 bits, 2
// rows 0.69x. Not the tier's 8: each row count is an instance per scale kind, and 2 and 4 take
// the avx512-vnni tier's build from 41 to about 66 s; an expert's pairs keep one_row for one.
template <typename F, bool LO>
constexpr int few_rows() {
  constexpr int most = V::REGISTERS >= 32 ? 4 : 2;  // avx2's 4 rows of inline scales spill: 1.02x the time
  return F::template rows<LO>() < most ? F::template rows<LO>() : most;
}

// `count` (2 .. few_rows) rows of a block (a decode step of a few rows), its scales decoded inline
// as one_row's are.
template <typename F, bool LO, typename Rows>
void few_rows_block(int count, const uint8_t* w, const BlockScales<F::SPLIT>& kind, bool has_minimums, int64_t K,
                    int64_t M, Rows rows, const int8_t* xq, const float* xd, const float* xs, Sixteenths sx, void* out,
                    bool out_bf16, int64_t ldo, nanoserve_format f) {
  with_kind_scales(kind, [&](auto scales) {
    rows_block<F, LO, few_rows<F, LO>()>(count, w, scales, has_minimums, K, M, rows, xq, xd, xs, sx, out, out_bf16,
                                         ldo, f);
  });
}

// Blocks outermost: a block's codes (16 x K) come from memory once and stay in cache while
// every chunk of F::rows<LO>() rows multiplies them.
template <typename F, bool LO>
void group_mm_typed(const uint8_t* w, const void* d, const void* m, int64_t N, int64_t K, int64_t b0, int64_t b1,
                    int64_t M, const int8_t* xq, const float* xd, const float* xs, void* out,
                    bool out_bf16, nanoserve_format f) {
  const int64_t G = K / GROUP, block_bytes = G * F::GROUP_BYTES, scale_bytes = G * F::scale_bytes(f.scale_kind);
  const int64_t size = out_bf16 ? 2 : 4;
  const Sixteenths sx = sixteenths<F, LO>() ? sixteenths_of(xd, M, G) : Sixteenths{};
  for (int64_t b = b0; b < b1; ++b) {
    const BlockScales<F::SPLIT> kind{f, static_cast<const char*>(d) + b * scale_bytes,
                                     static_cast<const char*>(m) + b * scale_bytes, F::scale_bytes(f.scale_kind)};
    const bool minimums = kind.template has_minimums<F::BITS, F::LUT>();
    if (M == 1) {
      one_row<F, LO>(w + b * block_bytes, kind, minimums, K, M, RowRun{0}, xq, xd, xs, sx,
                     static_cast<char*>(out) + 16 * b * size, out_bf16, N, f);
      continue;
    }
    if constexpr (few_rows<F, LO>() > 1) {
      if (M > 1 && M <= few_rows<F, LO>()) {  // (a step of no rows, a prefill chunk no row ends in, writes nothing)
        few_rows_block<F, LO>(static_cast<int>(M), w + b * block_bytes, kind, minimums, K, M, RowRun{0}, xq, xd, xs,
                              sx, static_cast<char*>(out) + 16 * b * size, out_bf16, N, f);
        continue;
      }
    }
    const DecodedScales scales = decode_scales<F>(kind, K, b + 1 < b1 ? scale_bytes : 0);
    constexpr int64_t ROWS = F::template rows<LO>();
    for (int64_t r = 0; r < M; r += ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(ROWS, M - r));
      rows_block<F, LO>(rows, w + b * block_bytes, scales, minimums, K, M, RowRun{r}, xq, xd, xs, sx,
                    static_cast<char*>(out) + (r * N + 16 * b) * size, out_bf16, N, f);
    }
  }
}

template <template <typename> class Op, int BITS, bool LUT = false, typename... Args>
void with_group(nanoserve_format f, Args... args) {
  if (f.group == 16) Op<Format<BITS, true, LUT>>::run(args...);
  else Op<Format<BITS, false, LUT>>::run(args...);
}

// The format's template instance for a runtime format (a table's codes are 4-bit).
template <template <typename> class Op, typename... Args>
void with_format(nanoserve_format f, Args... args) {
  if (f.table) with_group<Op, 4, true>(f, args...);
  else if (f.bits == 4) with_group<Op, 4>(f, args...);
  else if (f.bits == 5) with_group<Op, 5>(f, args...);
  else if (f.bits == 6) with_group<Op, 6>(f, args...);
  else with_group<Op, 8>(f, args...);
}

template <typename F>
struct GroupMm {
  static void run(const uint8_t* w, const void* d, const void* m, int64_t N, int64_t K, int64_t b0, int64_t b1,
                  int64_t M, const int8_t* xq, const float* xd, const float* xs, bool lo,
                  void* out, bool out_bf16, nanoserve_format f) {
    if (lo) group_mm_typed<F, true>(w, d, m, N, K, b0, b1, M, xq, xd, xs, out, out_bf16, f);
    else group_mm_typed<F, false>(w, d, m, N, K, b0, b1, M, xq, xd, xs, out, out_bf16, f);
  }
};

void group_mm(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t N, int64_t K, int64_t b0,
              int64_t b1, int64_t M, const int8_t* xq, const float* xd, const float* xs,
              int32_t x_bits, void* out, int32_t out_bf16) {
  with_format<GroupMm>(f, w, d, m, N, K, b0, b1, M, xq, xd, xs, x_bits == 16, out, static_cast<bool>(out_bf16),
                       f);
}

// Tasks (expert j of the step's, ascending; output block b) as ExpertGroups lists them: each
// task's block multiplies its expert's pairs F::rows() at a time, the codes read from memory once.
template <typename F>
struct ExpertsMm {
  static void run(const uint8_t* w, const void* d, const void* m, int64_t w_stride, int64_t scale_stride, int64_t N,
                  int64_t K, int64_t rows, int64_t top_k, const int64_t* ids, bool x_per_pair, const int8_t* xq,
                  const float* xd, const float* xs, bool lo, int64_t task_begin, int64_t task_end,
                  void* out, bool out_bf16, nanoserve_format f) {
    if (lo) tasks<true>(w, d, m, w_stride, scale_stride, N, K, rows, top_k, ids, x_per_pair, xq, xd, xs,
                        task_begin, task_end, out, out_bf16, f);
    else tasks<false>(w, d, m, w_stride, scale_stride, N, K, rows, top_k, ids, x_per_pair, xq, xd, xs,
                      task_begin, task_end, out, out_bf16, f);
  }

  template <bool LO>
  static void tasks(const uint8_t* w, const void* d, const void* m, int64_t w_stride, int64_t scale_stride, int64_t N,
                    int64_t K, int64_t rows, int64_t top_k, const int64_t* ids, bool x_per_pair, const int8_t* xq,
                    const float* xd, const float* xs, int64_t task_begin, int64_t task_end,
                    void* out, bool out_bf16, nanoserve_format f) {
    const ExpertGroups groups(ids, rows * top_k);
    const int64_t blocks = N / 16, G = K / GROUP, block_bytes = G * F::GROUP_BYTES;
    const int64_t scale_bytes = G * F::scale_bytes(f.scale_kind), M = x_per_pair ? rows * top_k : rows;
    const int64_t size = out_bf16 ? 2 : 4, per_x = x_per_pair ? 1 : top_k;
    const Sixteenths sx = sixteenths<F, LO>() ? sixteenths_of(xd, M, G) : Sixteenths{};
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t j = task / blocks, b = task % blocks, e = groups.experts[j];
      const int64_t first = groups.starts[j], count = groups.starts[j + 1] - first;
      const uint8_t* w_b = w + e * w_stride + b * block_bytes;
      const char* d_b = static_cast<const char*>(d) + e * scale_stride + b * scale_bytes;
      const char* m_b = m ? static_cast<const char*>(m) + e * scale_stride + b * scale_bytes : nullptr;
      const BlockScales<F::SPLIT> kind{f, d_b, m_b, F::scale_bytes(f.scale_kind)};
      const bool minimums = kind.template has_minimums<F::BITS, F::LUT>();
      if (count == 1) {  // one pair: as group_mm's one row
        const RoutedPairs pair{groups.pairs.data() + first, per_x};
        one_row<F, LO>(w_b, kind, minimums, K, M, pair, xq, xd, xs, sx,
                       static_cast<char*>(out) + 16 * b * size, out_bf16, N, f);
        continue;
      }
      const DecodedScales scales = decode_scales<F>(kind, K, 0);
      constexpr int64_t ROWS = F::template rows<LO>();
      for (int64_t i = 0; i < count; i += ROWS) {
        rows_block<F, LO>(static_cast<int>(std::min<int64_t>(ROWS, count - i)), w_b, scales, minimums, K, M,
                      RoutedPairs{groups.pairs.data() + first + i, per_x}, xq, xd, xs, sx,
                      static_cast<char*>(out) + 16 * b * size, out_bf16, N, f);
      }
    }
  }
};

void experts_mm(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t w_stride,
                int64_t scale_stride, int64_t N, int64_t K, int64_t rows, int64_t top_k, const int64_t* ids,
                int32_t x_per_pair, const int8_t* xq, const float* xd, const float* xs,
                int32_t x_bits, int64_t task_begin, int64_t task_end, void* out, int32_t out_bf16) {
  with_format<ExpertsMm>(f, w, d, m, w_stride, scale_stride, N, K, rows, top_k, ids, static_cast<bool>(x_per_pair),
                         xq, xd, xs, x_bits == 16, task_begin, task_end, out, static_cast<bool>(out_bf16), f);
}

template <typename F>
struct GroupDots {
  static void run(const uint8_t* w, int64_t N, int64_t K, const int8_t* x, int32_t* out, nanoserve_format f) {
    V::C lut{};
    if constexpr (F::LUT) lut = lut_register(f.table);
    const int64_t G = K / GROUP, H = G * F::PER, block_bytes = G * F::GROUP_BYTES;
    const int32_t offset = sums_offset<F::BITS, F::LUT>(sums_zero_point(f));  // back to the codes' own sums
    for (int64_t b = 0; b < N / 16; ++b) {
      for (int64_t g = 0; g < G; ++g) {
        int32_t x_sums[2] = {0, 0};
        for (int64_t k = 0; k < GROUP; ++k) x_sums[k / 16] += x[g * GROUP + k];
        for (int s = 0; s < SUB; ++s) {
          int32_t lanes[V::LANES];
          V::I sums[F::PER][1], unused[F::PER][1];
          const int64_t row[1] = {0};
          group_sums<F::BITS, F::LUT, F::SPLIT, 1, false>(w + b * block_bytes + g * F::GROUP_BYTES, s, lut,
                                                          x + g * GROUP, nullptr, row, 0, sums, unused);
          for (int h = 0; h < F::PER; ++h) {
            V::istore(lanes, sums[h][0]);
            const int32_t x_sum = F::SPLIT ? x_sums[h] : x_sums[0] + x_sums[1];
            for (int i = 0; i < V::LANES; ++i)
              out[(16 * b + V::LANES * s + i) * H + g * F::PER + h] = lanes[i] + offset * x_sum;
          }
        }
      }
    }
  }
};

void group_dots(nanoserve_format f, const uint8_t* w, int64_t N, int64_t K, const int8_t* x, int32_t* out) {
  f.zero_point = 0;  // the raw sums of the codes (a table's values): no scales, no zero point
  f.scale_kind = SCALES_FP16;
  with_format<GroupDots>(f, w, N, K, x, out, f);
}

// e^x for x <= 0 (softmax after its maximum is taken out): x = n ln2 + f with |f| <= ln2 / 2,
// e^f by its degree-6 Taylor polynomial (relative error < 3e-7), 2^n through the exponent bits.
inline V::F exp_nonpositive(V::F x) {
  x = V::max(x, V::set1(-87.f));  // e^-87 is below fp32's normal range: ~0
  const V::F n = V::rint(V::mul(x, V::set1(1.44269504f)));
  const V::F f = V::fma(n, V::set1(-0.693147181f), x);
  V::F p = V::set1(1.f / 720.f);
  for (float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = V::fma(p, f, V::set1(c));
  return V::mul(p, V::pow2(V::to_int(n)));
}

// A K/V head's cells as attend_typed reads them: a cell's codes at `cell(slot)`, LANES of them
// at c by `load` (unscaled), and with SCALED each run of 32 scaled by `step(slot, block)`.
template <typename E>
struct DenseCells {
  static constexpr bool SCALED = false;
  const E* data;
  int64_t stride;
  const E* cell(int64_t slot) const { return data + slot * stride; }
  DenseCells head(int64_t h, int64_t D) const { return {data + h * D, stride}; }
  const void* steps(int64_t) const { return nullptr; }
  float step(int64_t, int64_t) const { return 1.f; }
  V::F load(const E* cell, int64_t c) const { return V::load(cell + c); }
};

struct Q8Cells {  // q8_0: int8 codes, an fp16 step per 32
  static constexpr bool SCALED = true;
  const int8_t* data;
  const uint16_t* scales;
  int64_t stride, scale_stride;
  const int8_t* cell(int64_t slot) const { return data + slot * stride; }
  Q8Cells head(int64_t h, int64_t D) const { return {data + h * D, scales + h * (D / 32), stride, scale_stride}; }
  const void* steps(int64_t slot) const { return scales + slot * scale_stride; }
  float step(int64_t slot, int64_t block) const { return fp16_to_float(scales[slot * scale_stride + block]); }
  V::F load(const int8_t* cell, int64_t c) const { return V::load_int8(cell + c); }
};

// Prefetches the cache lines of values [from, from + count) of the cell in `slot` (counted from
// this view's first head: every head's, for a whole cell) and, if scaled, their steps. Into L2
// (prefetch_l2): a step's scattered cells read 0.78-0.9x the time on Zen 4 (Gemma 3 270M's and
// Llama 3.2 1B's shapes, 2048-8192 cells).
template <typename C>
inline void fetch_cell(const C& cells, int64_t slot, int64_t from, int64_t count) {
  const char* cell = reinterpret_cast<const char*>(cells.cell(slot) + from);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(*cells.cell(slot)));
  for (int64_t l = 0; l < bytes; l += 64) prefetch_l2(cell + l);
  prefetch_l2(cell + bytes - 1);  // a cell need not start on a line
  if constexpr (C::SCALED) {
    const char* steps = static_cast<const char*>(cells.steps(slot)) + from / 32 * 2;
    prefetch_l2(steps);
    prefetch_l2(steps + (count / 32) * 2 - 1);
  }
}

// f(std::integral_constant<int, n>) for a run-time n in 1..4 (at most MAX): a count of heads or
// vectors a kernel's registers are sized by.
template <int MAX = 4, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (MAX >= 4) if (n == 4) return f(std::integral_constant<int, 4>{});
  if constexpr (MAX >= 3) if (n == 3) return f(std::integral_constant<int, 3>{});
  if (n == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// Scores of NC cells from slots[t] for NG query heads from g0 (NC * NG <= 4): each cell's values
// converted once for all its heads, the four dots reduced together (hsum4) rather than one at a time.
template <int NC, int NG, typename KC>
inline void score_cells(const KC& k, const int64_t* slots, int64_t t, const float* qf, int64_t g0, int64_t D,
                        float* scores, int64_t padded) {
  static_assert(NC * NG <= 4, "hsum4 reduces four dots");
  V::F sum[4] = {V::fzero(), V::fzero(), V::fzero(), V::fzero()};
  decltype(k.cell(0)) cell[NC];
#pragma GCC unroll 16
  for (int n = 0; n < NC; ++n) cell[n] = k.cell(slots[t + n]);
  for (int64_t c = 0; c < D; c += V::LANES) {
#pragma GCC unroll 16
    for (int n = 0; n < NC; ++n) {
      V::F codes = k.load(cell[n], c);
      if constexpr (KC::SCALED) codes = V::mul(codes, V::set1(k.step(slots[t + n], c / 32)));
#pragma GCC unroll 16
      for (int i = 0; i < NG; ++i) sum[n * NG + i] = V::fma(V::load(qf + (g0 + i) * D + c), codes, sum[n * NG + i]);
    }
  }
  float dots[4];
  V::hsum4(sum[0], sum[1], sum[2], sum[3], dots);
#pragma GCC unroll 16
  for (int n = 0; n < NC; ++n)
#pragma GCC unroll 16
    for (int i = 0; i < NG; ++i) scores[(g0 + i) * padded + t + n] = dots[n * NG + i];
}

// Cells are scattered over the cache and, at batch 1, cold (the step's weights streamed through
// the caches since this layer wrote them): every line a pass reads is fetched AHEAD cells early.
constexpr int64_t AHEAD = 16;

// The scores of NC cells from slots[t] (a whole cell, every K/V head, fetched AHEAD cells early):
// NC = 4 for a group of 1 and 2 for a group of 2 (4 dots a reduction), else 1 and 4 heads at a time.
template <int NC, typename KC>
inline void score_tile(const KC& k, const int64_t* slots, int64_t t, int64_t len, int64_t heads, int64_t group,
                       int64_t D, const float* qf, float* scores, int64_t padded) {
  for (int n = 0; n < NC; ++n)
    if (t + AHEAD + n < len) fetch_cell(k, slots[t + AHEAD + n], 0, heads * D);
  for (int64_t h = 0; h < heads; ++h) {
    const KC kh = k.head(h, D);
    const float* qh = qf + h * group * D;
    float* sh = scores + h * group * padded;
    if constexpr (NC == 4) {
      score_cells<4, 1>(kh, slots, t, qh, 0, D, sh, padded);
    } else if constexpr (NC == 2) {
      score_cells<2, 2>(kh, slots, t, qh, 0, D, sh, padded);
    } else {
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        with_count(std::min<int64_t>(4, group - g0),
                   [&](auto ng) { score_cells<1, ng>(kh, slots, t, qh, g0, D, sh, padded); });
      }
    }
  }
}

// Value cells a run of the value pass reads for every head before the next run: small enough to
// stay in L1 while each head's query heads and vectors go over them, the first going over them
// fetching the next run's whole cells.
constexpr int64_t VALUE_RUN = 16;

// acc[g0 + i, d0 + j L ...] += sum over the cells of w[g0 + i, t] v_t[d0 + j L ...] for NQ query heads
// and NV vectors of the head, the sums in registers over the cells (scaled cells: a vector of codes
// times its step first, shared by the heads); the first `fetch` cells each fetch the whole cell
// (`cell_values`) VALUE_RUN slots on.
template <int NQ, int NV, typename VC>
void weigh_values(const VC& v, const int64_t* slots, int64_t len, const float* w, int64_t padded, int64_t g0,
                  int64_t d0, int64_t D, float* acc, int64_t fetch, int64_t cell_values) {
  V::F sum[NQ][NV];
#pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) sum[i][j] = V::load(acc + (g0 + i) * D + d0 + j * V::LANES);
  for (int64_t t = 0; t < len; ++t) {
    if (t < fetch) fetch_cell(v, slots[t + VALUE_RUN], 0, cell_values);
    const auto* cell = v.cell(slots[t]);
    V::F x[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      x[j] = v.load(cell, d0 + j * V::LANES);
      if constexpr (VC::SCALED) x[j] = V::mul(x[j], V::set1(v.step(slots[t], (d0 + j * V::LANES) / 32)));
    }
#pragma GCC unroll 16
    for (int i = 0; i < NQ; ++i) {
      const V::F wi = V::set1(w[(g0 + i) * padded + t]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) sum[i][j] = V::fma(wi, x[j], sum[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) V::store(acc + (g0 + i) * D + d0 + j * V::LANES, sum[i][j]);
}

// Vectors of a head a value pass keeps in registers: NQ * NV sums beside NV values.
constexpr int VALUE_VECTORS = V::REGISTERS >= 32 ? 4 : 2;

template <typename E, typename KC, typename VC>
void attend_typed(const E* q, int64_t q_stride, KC k, VC v, const int64_t* slots, int64_t len, int64_t heads,
                  int64_t group, int64_t D, float scale, void* out, int64_t out_stride, float* scratch,
                  const float* sinks, float* lse) {
  constexpr bool BF16 = sizeof(E) == 2;
  const int64_t HG = heads * group, C = D / V::LANES, padded = (len + V::LANES - 1) / V::LANES * V::LANES;
  const int64_t cell_values = heads * D;  // a whole cell: every K/V head
  float* qf = scratch;                  // [HG, D], q * scale
  float* acc = qf + HG * D;             // [HG, D]
  float* scores = acc + HG * D;         // [HG, padded]
  for (int64_t i = 0; i < HG; ++i) {
    for (int64_t c = 0; c < C; ++c) {
      V::store(qf + i * D + V::LANES * c, V::mul(V::load(q + i * q_stride + V::LANES * c), V::set1(scale)));
      V::store(acc + i * D + V::LANES * c, V::fzero());
    }
  }
  // The keys, cell by cell: every head's scores from a cell before the next cell.
  for (int64_t t = 0; t < std::min(AHEAD, len); ++t) fetch_cell(k, slots[t], 0, cell_values);
  int64_t t = 0;
  if (group == 1) for (; t + 4 <= len; t += 4) score_tile<4>(k, slots, t, len, heads, group, D, qf, scores, padded);
  if (group == 2) for (; t + 2 <= len; t += 2) score_tile<2>(k, slots, t, len, heads, group, D, qf, scores, padded);
  for (; t < len; ++t) score_tile<1>(k, slots, t, len, heads, group, D, qf, scores, padded);
  for (int64_t u = 0; u < std::min(VALUE_RUN, len); ++u) fetch_cell(v, slots[u], 0, cell_values);
  for (int64_t i = 0; i < HG; ++i) {
    float* row = scores + i * padded;
    const float top = sinks ? std::max(sinks[i], *std::max_element(row, row + len)) : *std::max_element(row, row + len);
    const int64_t whole = len / V::LANES * V::LANES;
    V::F sum = V::fzero();
    for (int64_t u = 0; u < whole; u += V::LANES) {
      const V::F e = exp_nonpositive(V::sub(V::load(row + u), V::set1(top)));
      V::store(row + u, e);
      sum = V::add(sum, e);
    }
    float total = V::hsum(sum) + (sinks ? std::exp(sinks[i] - top) : 0.f);  // the sink's share: no value
    for (int64_t u = whole; u < len; ++u) total += row[u] = std::exp(row[u] - top);
    const float inv = 1.f / total;
    for (int64_t u = 0; u < len; ++u) row[u] *= inv;
    if (lse) lse[i] = top + std::log(total);
  }
  // The values, a run of cells at a time: each head's query heads (4 at a time) and vectors
  // (VALUE_VECTORS at a time) over the run, their sums in registers.
  for (int64_t t0 = 0; t0 < len; t0 += VALUE_RUN) {
    const int64_t run = std::min(VALUE_RUN, len - t0);
    for (int64_t h = 0; h < heads; ++h) {
      const VC vh = v.head(h, D);
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t nq = std::min<int64_t>(4, group - g0);
        for (int64_t c0 = 0; c0 < C; c0 += VALUE_VECTORS) {
          const int64_t nv = std::min<int64_t>(VALUE_VECTORS, C - c0), d0 = c0 * V::LANES;
          // The first pass over the run fetches the next run's cells.
          const int64_t fetch = h == 0 && g0 == 0 && c0 == 0 ? std::max<int64_t>(0, std::min(run, len - t0 - run)) : 0;
          const float* w = scores + h * group * padded + t0;
          float* a = acc + h * group * D;
          with_count(nq, [&](auto q_heads) {
            with_count<VALUE_VECTORS>(nv, [&](auto vectors) {
              weigh_values<q_heads, vectors>(vh, slots + t0, run, w, padded, g0, d0, D, a, fetch, cell_values);
            });
          });
        }
      }
    }
  }
  for (int64_t i = 0; i < HG; ++i) {
    for (int64_t c = 0; c < D; ++c) {
      if (lse || !BF16) static_cast<float*>(out)[i * out_stride + c] = acc[i * D + c];
      else static_cast<uint16_t*>(out)[i * out_stride + c] = float_to_bf16(acc[i * D + c]);
    }
  }
}

// The four K/V cell kinds of one q type: each of K and V dense (q's type) or q8_0.
template <typename E>
void attend_cells(const E* q, int64_t q_stride, nanoserve_cells k, nanoserve_cells v, const int64_t* slots,
                  int64_t len, int64_t heads, int64_t group, int64_t D, float scale, void* out, int64_t out_stride, float* scratch,
                  const float* sinks, float* lse) {
  const DenseCells<E> k_dense{static_cast<const E*>(k.data), k.stride}, v_dense{static_cast<const E*>(v.data), v.stride};
  const Q8Cells k_q8{static_cast<const int8_t*>(k.data), k.scales, k.stride, k.scale_stride};
  const Q8Cells v_q8{static_cast<const int8_t*>(v.data), v.scales, v.stride, v.scale_stride};
  if (k.scales && v.scales) attend_typed(q, q_stride, k_q8, v_q8, slots, len, heads, group, D, scale, out, out_stride, scratch, sinks, lse);
  else if (k.scales) attend_typed(q, q_stride, k_q8, v_dense, slots, len, heads, group, D, scale, out, out_stride, scratch, sinks, lse);
  else if (v.scales) attend_typed(q, q_stride, k_dense, v_q8, slots, len, heads, group, D, scale, out, out_stride, scratch, sinks, lse);
  else attend_typed(q, q_stride, k_dense, v_dense, slots, len, heads, group, D, scale, out, out_stride, scratch, sinks, lse);
}

void attend(const void* q, int64_t q_stride, nanoserve_cells k, nanoserve_cells v, const int64_t* slots, int64_t len,
            int64_t heads, int64_t group, int64_t D, float scale, void* out, int64_t out_stride, int32_t bf16,
            float* scratch, const float* sinks, float* lse) {
  if (bf16) {
    attend_cells(static_cast<const uint16_t*>(q), q_stride, k, v, slots, len, heads, group, D, scale, out,
                 out_stride, scratch, sinks, lse);
  } else {
    attend_cells(static_cast<const float*>(q), q_stride, k, v, slots, len, heads, group, D, scale, out,
                 out_stride, scratch, sinks, lse);
  }
}

// Hides a register's value from the optimiser, so a loop of dots on constant codes is not folded.
inline void opaque(V::C& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(v));
#else
  asm volatile("" : "+w"(v));
#endif
}

int64_t dot_peak(int64_t rounds) {
  constexpr int CHAINS = 12;  // independent accumulators: more than a dot's latency times its issue rate
  V::A acc[CHAINS];
  #pragma GCC unroll 16
  for (int c = 0; c < CHAINS; ++c) acc[c] = V::azero();
  uint8_t bytes[64];
  for (int i = 0; i < 64; ++i) bytes[i] = static_cast<uint8_t>(i * 37);
  V::C codes = V::low_nibbles(V::load_codes(bytes));
  int8_t x[4 * CHAINS];  // each chain its own activations, as each row has: no product shared
  for (int i = 0; i < 4 * CHAINS; ++i) x[i] = static_cast<int8_t>(i * 29 % 255 - 127);
  for (int64_t i = 0; i < rounds; ++i) {
    opaque(codes);
    #pragma GCC unroll 16
    for (int c = 0; c < CHAINS; ++c) acc[c] = V::dot_nibbles(acc[c], codes, x + 4 * c);
  }
  int32_t lanes[V::LANES], total = 0;
  // Unrolled, so that acc is registers alone: an array left in memory would be stored every round
  // (avx512-vnni's dot reads its activations as a memory operand, which GCC lets alias it).
  #pragma GCC unroll 16
  for (int c = 0; c < CHAINS; ++c) {
    V::istore(lanes, V::finish_nibbles(acc[c]));
    for (int l = 0; l < V::LANES; ++l) total += lanes[l];
  }
  volatile int32_t sink = total;  // the sums are used: the loop stays
  (void)sink;
  return rounds * CHAINS * V::LANES * 4;
}

const nanoserve_kernel_table TABLE = {NANOSERVE_KERNEL_ABI, TIER_NAME, quantize_rows, group_mm, group_dots,
                                      attend, dequantize_portable,
                                      dequantize_rows_portable, experts_mm, dot_peak};

}  // namespace

extern "C" const nanoserve_kernel_table* NANOSERVE_ENTRY(void) { return &TABLE; }
