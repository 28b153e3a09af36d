// ARM NEON vector primitives for vector.cpp: 4 outputs a vector; with the dot-product extension
// (sdot, vdotq_s32) or without it (smull + sadalp). NEON multiplies signed codes only, so byte
// codes are flipped to signed (c - 128) and vector.cpp adds 128 * sum(x) back per group.
#pragma once
#include <arm_neon.h>

#include "common.h"

namespace nanoserve {
namespace {  // internal: each tier defines its own Simd

typedef int32_t __attribute__((may_alias)) aliased_int32;
inline int32_t four_codes(const int8_t* p) { return *reinterpret_cast<const aliased_int32*>(p); }

struct Simd {
  // rows sharing each code vector (a row's 16 sums: 4 vectors); with 8-bit activations a row
  // holds half the integer sums, so twice the rows fit
  static constexpr int LANES = 4, ROWS = 2, ROWS_A8 = 4;
  static constexpr int ROWS_A8_G16 = ROWS_A8;  // with 8-bit activations, in a format of scale groups of 16
  static constexpr int REGISTERS = 32;  // vector registers: a block's live sums must fit them
  static constexpr bool UNSIGNED_BYTES = false;
  using I = int32x4_t;
  using F = float32x4_t;
  using C = int8x16_t;  // 4 outputs x 4 codes
  static C load_codes(const uint8_t* p) { return vreinterpretq_s8_u8(vld1q_u8(p)); }
  static C low_nibbles(C b) { return vandq_s8(b, vdupq_n_s8(0x0F)); }
  static C high_nibbles(C b) { return vreinterpretq_s8_u8(vshrq_n_u8(vreinterpretq_u8_s8(b), 4)); }
  static C flip(C b) { return veorq_s8(b, vdupq_n_s8(static_cast<int8_t>(0x80))); }
  // A 16-byte table, and each nibble's entry of it (tbl).
  static C load_table(const uint8_t* p) { return vreinterpretq_s8_u8(vld1q_u8(p)); }
  static C lookup(C table, C nibbles) { return vqtbl1q_s8(table, vreinterpretq_u8_s8(nibbles)); }
  // codes | the bits 4 and 5 at bits 2 T, 2 T + 1 of each byte of crumbs, moved to bits 4, 5
  template <int T>
  static C or_crumbs(C codes, C crumbs) {
    const uint8x16_t c = vreinterpretq_u8_s8(crumbs);
    const uint8x16_t at = T == 0 ? vshlq_n_u8(c, 4) : T == 1 ? vshlq_n_u8(c, 2) : T == 2 ? c : vshrq_n_u8(c, 2);
    return vorrq_s8(codes, vreinterpretq_s8_u8(vandq_u8(at, vdupq_n_u8(0x30))));
  }
  // Codes | value where their bit (one per byte: the 16 bits of vector s) is set.
  static C or_bit(C codes, const uint8_t* bits, int s, char value) {
    const uint8x16_t spread = vcombine_u8(vdup_n_u8(bits[2 * s]), vdup_n_u8(bits[2 * s + 1]));
    static const uint8_t select_bytes[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t set = vtstq_u8(spread, vld1q_u8(select_bytes));
    return vorrq_s8(codes, vreinterpretq_s8_u8(vandq_u8(set, vdupq_n_u8(static_cast<uint8_t>(value)))));
  }
  static int8x16_t broadcast(const int8_t* x) { return vreinterpretq_s8_s32(vdupq_n_s32(four_codes(x))); }
#if defined(NANOSERVE_TIER_NEON_DOT)
  using A = int32x4_t;
  static A azero() { return vdupq_n_s32(0); }
  static A dot_nibbles(A acc, C codes, const int8_t* x) { return vdotq_s32(acc, codes, broadcast(x)); }
  static I finish_nibbles(A a) { return a; }
#else
  // Products into int16 (|c x| <= 128 * 127), pairs added into int32: each lane's 4 products
  // end in two neighbouring int32s, added pairwise in finish.
  struct A { int32x4_t low, high; };
  static A azero() { return {vdupq_n_s32(0), vdupq_n_s32(0)}; }
  static A dot_nibbles(A acc, C codes, const int8_t* x) {
    const int8x16_t xb = broadcast(x);
    acc.low = vpadalq_s16(acc.low, vmull_s8(vget_low_s8(codes), vget_low_s8(xb)));
    acc.high = vpadalq_s16(acc.high, vmull_high_s8(codes, xb));
    return acc;
  }
  static I finish_nibbles(A a) { return vpaddq_s32(a.low, a.high); }
#endif
  static A dot_bytes(A acc, C codes, const int8_t* x) { return dot_nibbles(acc, codes, x); }
  static A dot_wide(A acc, C codes, const int8_t* x) { return dot_nibbles(acc, codes, x); }
  static I finish_bytes(A a) { return finish_nibbles(a); }
  static I finish_wide(A a) { return finish_nibbles(a); }
  static I iadd(I a, I b) { return vaddq_s32(a, b); }
  static I iset1(int32_t v) { return vdupq_n_s32(v); }
  static void istore(int32_t* p, I v) { vst1q_s32(p, v); }
  static F to_float(I v) { return vcvtq_f32_s32(v); }
  static F fzero() { return vdupq_n_f32(0.f); }
  static F set1(float v) { return vdupq_n_f32(v); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F load(const float* p) { return vld1q_f32(p); }
  static F load(const uint16_t* bf16) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(bf16), 16)); }
  static F load_fp16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static F load_int8(const int8_t* p) {
    const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four_codes(p))));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
  }
  static void store(float* p, F v) { vst1q_f32(p, v); }
  static float hsum(F v) { return vaddvq_f32(v); }
  // The sums of four vectors at once, into out[0..3]: two pairwise adds, not four reductions.
  static void hsum4(F a, F b, F c, F d, float* out) { vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d))); }
  static F abs(F v) { return vabsq_f32(v); }
  static F max(F a, F b) { return vmaxq_f32(a, b); }
  static F min(F a, F b) { return vminq_f32(a, b); }
  static float hmax(F v) { return vmaxvq_f32(v); }
  static F rint(F v) { return vrndnq_f32(v); }  // ties to even
  static I to_int(F v) { return vcvtq_s32_f32(v); }  // exact: v is integral
  static void store_int8(int8_t* p, I v) {  // 4 int32 in -127..127 -> 4 bytes
    const int8x8_t bytes = vqmovn_s16(vcombine_s16(vqmovn_s32(v), vdup_n_s16(0)));
    vst1_lane_s32(reinterpret_cast<int32_t*>(p), vreinterpret_s32_s8(bytes), 0);
  }
  static F pow2(I n) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23)); }
};

}  // namespace
}  // namespace nanoserve
