// x86 vector primitives for vector.cpp: AVX-512 VNNI (16 outputs a vector, vpdpbusd), AVX-VNNI
// (8 outputs, the 256-bit vpdpbusd) and AVX2 (8 outputs, vpmaddubsw + vpmaddwd).
#pragma once
#include <immintrin.h>

#include "common.h"

namespace nanoserve {
namespace {  // internal: each tier defines its own Simd

typedef int32_t __attribute__((may_alias)) aliased_int32;
inline int32_t four_codes(const int8_t* p) { return *reinterpret_cast<const aliased_int32*>(p); }

#if defined(NANOSERVE_TIER_AVX512_VNNI)
struct Simd {
  static constexpr int LANES = 16, ROWS = 8, ROWS_A8 = 8;  // rows sharing each code vector
  static constexpr int ROWS_A8_G16 = ROWS_A8;  // with 8-bit activations, in a format of scale groups of 16
  static constexpr int REGISTERS = 32;  // vector registers: a block's live sums must fit them
  static constexpr bool UNSIGNED_BYTES = true;  // vpdpbusd takes unsigned codes up to 255
  using I = __m512i;
  using A = __m512i;
  using C = __m512i;
  using F = __m512;
  static I load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F)); }
  static I flip(I b) { return b; }
  // A 16-byte table in every 128-bit lane, and each nibble's entry of it (vpshufb).
  static I load_table(const uint8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I lookup(I table, I nibbles) { return _mm512_shuffle_epi8(table, nibbles); }
  // Codes | value where their bit (one per byte, 64 from bits) is set.
  static I or_bit(I codes, const uint8_t* bits, int, char value) {
    uint64_t mask;
    memcpy(&mask, bits, 8);
    return _mm512_or_si512(codes, _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(value)));
  }
  // codes | the bits 4 and 5 at bits 2 T, 2 T + 1 of each byte of crumbs, moved to bits 4, 5
  template <int T>
  static I or_crumbs(I codes, I crumbs) {
    const I at = T == 0 ? _mm512_slli_epi16(crumbs, 4) : T == 1 ? _mm512_slli_epi16(crumbs, 2)
               : T == 2 ? crumbs : _mm512_srli_epi16(crumbs, 2);
    return _mm512_ternarylogic_epi32(codes, at, _mm512_set1_epi8(0x30), 0xF8);  // codes | (at & 0x30)
  }
  static A azero() { return _mm512_setzero_si512(); }
  // acc += codes (unsigned bytes) x the four signed bytes at x in every lane, the four bytes read
  // as vpdpbusd's own broadcast operand ({1to16}): GCC emits a separate vpbroadcastd for
  // _mm512_set1_epi32 of a load, one more instruction for every dot. (AVX-VNNI's VEX vpdpbusd
  // has no broadcast operand: its tier keeps the separate broadcast.)
  static A dot_nibbles(A acc, I codes, const int8_t* x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const aliased_int32*>(x)));
    return acc;
  }
  static A dot_wide(A acc, I codes, const int8_t* x) { return dot_nibbles(acc, codes, x); }
  static A dot_bytes(A acc, I codes, const int8_t* x) { return dot_nibbles(acc, codes, x); }
  static I finish_nibbles(A a) { return a; }
  static I finish_wide(A a) { return a; }
  static I finish_bytes(A a) { return a; }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I iset1(int32_t v) { return _mm512_set1_epi32(v); }
  static void istore(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* bf16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16))), 16));
  }
  static F load_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F load_int8(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  // The sums of four vectors at once, into out[0..3]: the shuffles shared, not four reductions.
  static void hsum4(F a, F b, F c, F d, float* out) {
    const F ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a02 b02 a13 b13 per 128
    const F cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const F abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d per 128
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
  }
  static F abs(F v) { return _mm512_abs_ps(v); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static F rint(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I to_int(F v) { return _mm512_cvtps_epi32(v); }
  static void store_int8(int8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(v)); }
  static F pow2(I n) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)); }
};
#elif defined(NANOSERVE_TIER_AVX_VNNI) || defined(NANOSERVE_TIER_AVX2)
struct Simd {
  // Rows sharing each code vector (16 registers: their sums, fp32 and integer, and the code);
  // with 8-bit activations (ROWS_A8) a row holds no lo sums.
  // AVX2's group-16 8-bit products take 8, each scale group for both vectors of outputs at once
  // (vector.cpp's FOLD_HALVES): their sums spill, but each code vector's unpacking is shared by
  // twice the rows (1B Q4_K_M's Q6_K shapes at 32 rows, 8 against 4: 0.78-0.84x the time against
  // 0.77-0.84x, alike; AVX-VNNI's vpdpbusd leaves less to share and runs 3% slower at 8).
#if defined(NANOSERVE_TIER_AVX_VNNI)
  static constexpr int LANES = 8, ROWS = 4, ROWS_A8 = 4, ROWS_A8_G16 = 4;
#else
  static constexpr int LANES = 8, ROWS = 2, ROWS_A8 = 4, ROWS_A8_G16 = 8;
#endif
  static constexpr int REGISTERS = 16;  // vector registers: a block's live sums must fit them
  using I = __m256i;
  using A = __m256i;
  using C = __m256i;
  using F = __m256;
  static I load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low_nibbles(I b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }
  // A 16-byte table in both 128-bit lanes, and each nibble's entry of it (vpshufb).
  static I load_table(const uint8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I lookup(I table, I nibbles) { return _mm256_shuffle_epi8(table, nibbles); }
  // Codes | value where their bit (one per byte: the 32 bits of vector s) is set.
  static I or_bit(I codes, const uint8_t* bits, int s, char value) {
    uint32_t word;
    memcpy(&word, bits + 4 * s, 4);
    const I spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(word)),
                                         _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const I select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
    const I set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_or_si256(codes, _mm256_and_si256(set, _mm256_set1_epi8(value)));
  }
  // codes | the bits 4 and 5 at bits 2 T, 2 T + 1 of each byte of crumbs, moved to bits 4, 5
  template <int T>
  static I or_crumbs(I codes, I crumbs) {
    const I at = T == 0 ? _mm256_slli_epi16(crumbs, 4) : T == 1 ? _mm256_slli_epi16(crumbs, 2)
               : T == 2 ? crumbs : _mm256_srli_epi16(crumbs, 2);
    return _mm256_or_si256(codes, _mm256_and_si256(at, _mm256_set1_epi8(0x30)));
  }
  static A azero() { return _mm256_setzero_si256(); }
#if defined(NANOSERVE_TIER_AVX_VNNI)
  static constexpr bool UNSIGNED_BYTES = true;
  static I flip(I b) { return b; }
  static A dot_nibbles(A acc, I codes, const int8_t* x) {
    return _mm256_dpbusd_avx_epi32(acc, codes, _mm256_set1_epi32(four_codes(x)));
  }
  static A dot_bytes(A acc, I codes, const int8_t* x) { return dot_nibbles(acc, codes, x); }
  static A dot_wide(A acc, I codes, const int8_t* x) { return dot_nibbles(acc, codes, x); }
  static I finish_nibbles(A a) { return a; }
  static I finish_wide(A a) { return a; }
#else
  // vpmaddubsw multiplies unsigned codes by signed int8 and adds pairs into int16, saturating:
  // nibble pairs reach 2 * 15 * 127 = 3810, so a whole group's 8 products per lane pair stay
  // below 32767 and are widened once (finish_nibbles); byte codes are flipped to signed
  // (c - 128) and multiplied as |c| * sign(x, c), at most 2 * 128 * 127 = 32512, widened at once.
  static constexpr bool UNSIGNED_BYTES = false;
  static I flip(I b) { return _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(0x80))); }
  // Each product is added to its accumulator where it is made: GCC would otherwise reassociate a
  // group's unrolled adds into a tree, keep every product live and spill them to the stack.
  static A accumulate(A sum) {
    asm("" : "+x"(sum));
    return sum;
  }
  static A dot_nibbles(A acc, I codes, const int8_t* x) {
    return accumulate(_mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, _mm256_set1_epi32(four_codes(x)))));
  }
  static A dot_bytes(A acc, I codes, const int8_t* x) {
    const I xs = _mm256_sign_epi8(_mm256_set1_epi32(four_codes(x)), codes);
    return accumulate(_mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(codes), xs),
                                                              _mm256_set1_epi16(1))));
  }
  static I finish_nibbles(A a) { return widen(a, _mm256_set1_epi16(1)); }
  // int16 sums' lane pairs times m's and added into int32 (vpmaddwd): by ones, or by a half's n
  // (HALF_MULTIPLIERS: vector.cpp's sixteenths).
  static I widen(A a, I m) { return _mm256_madd_epi16(a, m); }
  static constexpr bool HALF_MULTIPLIERS = true;
  // vector.cpp's sixteenths_of for the first groups of `count`, four a vector, in its scalar loop's
  // IEEE operations (so the same multipliers and steps); returns how many it did.
  static int64_t sixteenths(const float* xd, int64_t count, int32_t* n, float* step16) {
    const __m256 sixteen = _mm256_set1_ps(16.f);
    const __m256i evens = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
      const __m256 steps = _mm256_loadu_ps(xd + 2 * i);  // a0 b0 a1 b1 ...: each group's halves
      const __m256 a = _mm256_moveldup_ps(steps), b = _mm256_movehdup_ps(steps);
      const __m256 group = _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_GT_OQ));  // a > b ? a : b
      const __m256 nf = _mm256_blendv_ps(sixteen, _mm256_round_ps(_mm256_div_ps(_mm256_mul_ps(sixteen, steps), group),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                         _mm256_cmp_ps(group, _mm256_setzero_ps(), _CMP_GT_OQ));
      const __m256i nh = _mm256_cvtps_epi32(nf);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(n + 2 * i), _mm256_or_si256(nh, _mm256_slli_epi32(nh, 16)));
      const __m256 per_group = _mm256_permutevar8x32_ps(_mm256_div_ps(group, sixteen), evens);
      _mm_storeu_ps(step16 + i, _mm256_castps256_ps128(per_group));
    }
    return i;
  }
  // Group-16 formats at 8 rows: per vector of outputs, both scale groups' sums of 8 rows are all 16
  // registers, and the loop stored and reloaded its code vectors every group; one scale group for
  // both vectors at a time (vector.cpp's FOLD_HALVES) instead: 1B Q4_K_M's Q6_K shapes at 8 and
  // 32 rows 0.78-0.83x the time, 1B Q3_K_M's Q3_K (4-bit storage) 0.76-0.80x, the same bits.
  static constexpr bool FOLD_SCALE_GROUPS = true;
  // One row at 16-bit activations: each broadcast multiplies both vectors of outputs where it is
  // made (vector.cpp's group_sums over every vector), not stored for the second vector's sums to read back.
  static constexpr bool SHARED_BROADCASTS = true;
  // 5- and 6-bit codes: a pair reaches 2 * 63 * 127 = 16002, so the int16 sums are widened at once.
  static A dot_wide(A acc, I codes, const int8_t* x) {
    const I pairs = _mm256_maddubs_epi16(codes, _mm256_set1_epi32(four_codes(x)));
    return accumulate(_mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
  }
  static I finish_wide(A a) { return a; }
  // Two code vectors' products (vector.cpp's wide_pairs): their pairs added in int16, at most
  // 2 * 16002 = 32004, and widened once, one vpmaddwd for two products where dot_wide takes one each.
  static constexpr bool WIDE_PAIRS = true;
  static A dot_wide_pair(A acc, I c0, const int8_t* x0, I c1, const int8_t* x1) {
    const I pairs = _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_set1_epi32(four_codes(x0))),
                                     _mm256_maddubs_epi16(c1, _mm256_set1_epi32(four_codes(x1))));
    return accumulate(_mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))));
  }
#endif
  static I finish_bytes(A a) { return a; }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I iset1(int32_t v) { return _mm256_set1_epi32(v); }
  static void istore(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* bf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bf16))), 16));
  }
  static F load_fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load_int8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F abs(F v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static F rint(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static I to_int(F v) { return _mm256_cvtps_epi32(v); }
  static void store_int8(int8_t* p, I v) {  // 8 int32 in -127..127 -> 8 bytes
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // The sums of four vectors at once, into out[0..3]: the shuffles shared, not four reductions.
  static void hsum4(F a, F b, F c, F d, float* out) {
    const F ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));  // a02 b02 a13 b13 per 128
    const F cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const F abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));  // a b c d per 128
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static F pow2(I n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
};
#endif

}  // namespace
}  // namespace nanoserve
