// What every kernel tier shares: the table each tier's library exports, the number formats,
// and the activation quantiser. No torch here: the tiers are plain shared libraries (and the
// standalone self-test links them directly), loaded by the torch glue in ../cpu_ops.cpp.
//
// Weight layout (nanoserve/model/quant/cpu_kernels.py packs it): outputs in blocks of 16; per block,
// per group of 32 along K, 4-byte lanes, lane r holding 4 consecutive codes of output r, so 64
// bytes cover 16 outputs x 4 k:
//   4 bits:  byte (block, g, j < 4, r, i < 4) = c[16 block + r, 32 g + 8 j + i] & 15
//                                              | (c[16 block + r, 32 g + 8 j + 4 + i] & 15) << 4
//   5 bits:  those 256 bytes of low nibbles, then 64 bytes of fifth bits: bit b of the 8 bytes
//            at 256 + 8 v is bit 4 of the code in byte b of nibble vector v (v = 2 j, low
//            nibbles of row j; v = 2 j + 1, high nibbles), 320 bytes a group
//   6 bits:  those 256 bytes of low nibbles, then 2 crumb vectors of 64 bytes: bits 2 t and 2 t + 1
//            of byte b of crumb vector q are bits 4 and 5 of the code in byte b of code vector
//            v = 4 q + t (v as above), 384 bytes a group: a code vector's high bits are one
//            shift and mask of a vector load, where a bit plane takes a spread and a compare
//   8 bits:  byte (block, g, j < 8, r, i < 4) = c[16 block + r, 32 g + 4 j + i]
//   d, m:    [N / 16, K / group, 16], fp16 or fp32 (nanoserve_format), or exponent bytes e for
//            d = 2^(e - 128) (SCALES_E8M0: MXFP4's scale, its table's values doubled); or, as a
//            K-quant holds them, per block and super-block of 256 k a record of 16 fp16
//            super-scales, then S = 256 / group rows of 16 int8 multipliers: d = super *
//            multiplier. A symmetric format stores no m: m = -zero_point * d
// Per scale group h (group = 32 or 16 weights along K) of output n: w[n, k] = d[n, h] * c[n, k] +
// m[n, h], c unsigned, of 4, 5, 6 or 8 bits; or, in a format with a code table (IQ4_NL, IQ4_XS,
// MXFP4: 4-bit codes, the file's nibbles), w[n, k] = d[n, h] * table[c[n, k]], no m.
// Activations, x_bits 16: per row and group of 32, x[k] ~= xd * (254 * hi[k] + lo[k]), hi and lo
// int8 in -127..127, so over a scale group sum_k w x ~= d * xd * (254 * sum c hi + sum c lo) + m *
// xs, xs = xd * sum(254 hi + lo) over the scale group's k (kept per half group of 16). x_bits 8:
// one int8 code a value, x[k] ~= xd[h] * hi[k] with a step xd[h] per half group h of 16, in
// sixteenths of its group's max |x| / 127 (half_scales; llama.cpp's q8_0 steps are per 32:
// halving the group halves the rounding error where one large value sets the step, which keeps
// a step's logits as faithful as llama.cpp's after bf16's own rounding); lo is zero and xs = xd[h] * sum hi. Each code meets one activation
// vector instead of two, and the minimum meets the same rounded activations, so the rounding
// errors of d c and m, of opposite signs, cancel as they do in sum (d c + m) x_q.
#pragma once
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#define NANOSERVE_KERNEL_ABI 14

extern "C" {
// How a packed weight stores its codes and per-group numbers.
struct nanoserve_format {
  int32_t bits;         // the codes' storage: 4, 5, 6 or 8 bits a code (the layouts above)
  int32_t group;        // weights per scale and minimum along K: 32, or 16 (Q6_K)
  int32_t scale_kind;   // d and m as SCALES_FP16, SCALES_FP32, SCALES_SUPER (K % 256 == 0) or SCALES_E8M0
  int32_t zero_point;   // 0: a minimum m per group; else m = -zero_point * d (Q4_0 8, Q8_0 128...), none stored
  // nullptr, or 16 int8 values a 4-bit code stands for: w = d * table[c], no m (zero_point 0).
  // The tiers look the nibble up in a register (pshufb, tbl) before their int8 dot.
  const int8_t* table;
};

// One layer's K (or V) cells of one K/V head, as decode attention reads them: cell t of a row is
// data + slots[t] * stride (elements). With scales nullptr the cells are in q's type (bf16 bits
// or fp32); else they are q8_0: int8 codes, value = code * scales[slots[t] * scale_stride + c / 32]
// (fp16 steps, one per 32 codes along the head).
struct nanoserve_cells {
  const void* data;
  const uint16_t* scales;
  int64_t stride;
  int64_t scale_stride;
};

// One tier's entry points. Every function is single-threaded; the caller splits the work.
struct nanoserve_kernel_table {
  int32_t abi;
  const char* tier;
  // x [M, K] (bf16 bits if x_bf16, else fp32) -> xq [2, M, x_row_stride(K)] (hi then lo), xd, xs [M, K / 16]
  // and xsum [2, M, K / 16] (the integer sums of hi and of lo per half group of 16, xs from them
  // as above); xd [M, K / 32] with x_bits 16, [M, K / 16] with 8; rows [row_begin, row_end) only.
  void (*quantize_rows)(const void* x, int32_t x_bf16, int64_t M, int64_t K, int64_t row_begin, int64_t row_end,
                        int32_t x_bits, int8_t* xq, float* xd, float* xs, int32_t* xsum);
  // out[M, N] (row stride N; bf16 bits if out_bf16, else fp32), output blocks [block_begin, block_end).
  // xq, xd, xs as quantize_rows wrote them for M rows with the same x_bits, 16 or 8.
  void (*group_mm)(nanoserve_format format, const uint8_t* w, const void* d, const void* m, int64_t N, int64_t K,
                   int64_t block_begin, int64_t block_end, int64_t M, const int8_t* xq, const float* xd,
                   const float* xs, int32_t x_bits, void* out, int32_t out_bf16);
  // The raw integer group sums out[n, h] = sum_k c[n, group h + k] * x[group h + k] (unsigned
  // codes, or with a table its values table[c]; x int8 in -127..127, group 32 or 16), through the
  // same instructions as group_mm: tiers are tested on these.
  void (*group_dots)(nanoserve_format format, const uint8_t* w, int64_t N, int64_t K, const int8_t* x, int32_t* out);
  // One row's query heads of `heads` consecutive K/V heads over `len` cells: out = softmax(q k^T * scale) v.
  // q [heads * group, D] (row stride q_stride; query heads h * group .. h * group + group - 1 read
  // K/V head h), k and v cells as nanoserve_cells of the first head, head h D values (and D / 32
  // steps) further on in each cell (q8_0 needs D % 32 == 0); out [heads * group, D] (row stride
  // out_stride); q and out bf16 bits if bf16, else fp32. Every head of a cell is read at once, so
  // a call streams whole cells. scratch: heads * group * (2 D + len + 16) floats. sinks (nullptr:
  // none): each query head's sink logit [heads * group] (gpt-oss), one more term in the softmax's
  // denominator that contributes no value. lse (nullptr: none): a part of a longer read, to be
  // merged with the others by the caller; out is then fp32 whatever q's type, and lse[i] = log(sum
  // of exp(score)) over these cells (and the sink, if given), each query head's weight in the merge.
  void (*attend)(const void* q, int64_t q_stride, nanoserve_cells k, nanoserve_cells v, const int64_t* slots,
                 int64_t len, int64_t heads, int64_t group, int64_t D, float scale, void* out, int64_t out_stride,
                 int32_t bf16, float* scratch, const float* sinks, float* lse);
  // The weight itself, out[n, k] = d * c + m (fp32, or bf16 bits if out_bf16), output blocks
  // [block_begin, block_end): a prompt's many rows multiply it in a dense GEMM.
  void (*dequantize)(nanoserve_format format, const uint8_t* w, const void* d, const void* m, int64_t K,
                     int64_t block_begin, int64_t block_end, void* out, int32_t out_bf16);
  // Chosen rows of the weight, out[i, k] = d * c + m for row rows[i], i < count: an embedding
  // read from a tied LM head's codes.
  void (*dequantize_rows)(nanoserve_format format, const uint8_t* w, const void* d, const void* m, int64_t K,
                          const int64_t* rows, int64_t count, void* out, int32_t out_bf16);
  // A mixture-of-experts layer's routed products, every expert of a step in one call. Pair
  // p = row * top_k + slot (p < rows * top_k) goes to expert e = ids[p] (int64, below the
  // expert count: the caller checks; a negative id skips the pair, its output row left as it
  // was, for the caller to fill otherwise), whose weight of N x K is packed at w + e * w_stride and
  // its scales and minimums at d + e * scale_stride, m + e * scale_stride (bytes). out[p, N]
  // (row stride N; bf16 bits if out_bf16, else fp32) = that weight times activation row p if
  // x_per_pair, else row p / top_k; xq, xd, xs as quantize_rows wrote them for those rows
  // (rows * top_k, or rows). The work is a list of tasks: the experts ids names, ascending, times
  // their N / 16 output blocks (ExpertGroups); this call does tasks [task_begin, task_end). Each
  // task reads its block's codes once for all of the expert's rows. x_bits as group_mm's.
  void (*experts_mm)(nanoserve_format format, const uint8_t* w, const void* d, const void* m, int64_t w_stride,
                     int64_t scale_stride, int64_t N, int64_t K, int64_t rows, int64_t top_k, const int64_t* ids,
                     int32_t x_per_pair, const int8_t* xq, const float* xd, const float* xs, int32_t x_bits, int64_t task_begin, int64_t task_end, void* out, int32_t out_bf16);
  // The tier's arithmetic peak: `rounds` passes of independent 4-bit code dots (the instructions
  // group_mm multiplies codes with) on values held in registers, no memory traffic. Returns the
  // multiply-adds done; timed, it gives the rate a product's arithmetic cannot beat.
  int64_t (*dot_peak)(int64_t rounds);
};
}

// A tier library exports its table under this name; the self-test links several tiers into
// one program and renames each (-DNANOSERVE_ENTRY=...).
#ifndef NANOSERVE_ENTRY
#define NANOSERVE_ENTRY nanoserve_kernels
#endif
extern "C" const nanoserve_kernel_table* NANOSERVE_ENTRY(void);

// Internal to each translation unit: every tier compiles these with its own flags, and the
// self-test links several tiers into one program.
namespace nanoserve {
namespace {

constexpr int64_t GROUP = 32;

// The activation codes' row stride in xq: K and one cache line more. A product reads up to 8
// rows' hi and lo codes in step; with K a multiple of 4 KB those 16 streams would share one set
// of an 8-way L1 and evict each other (an 8192-K product ran 3x slower at 8 rows).
constexpr int64_t x_row_stride(int64_t K) { return K + 64; }

// Where group i (of M rows x G groups of 32) of the hi codes starts in xq; the lo codes' plane
// follows the hi plane, M rows on.
constexpr int64_t x_group_at(int64_t i, int64_t G) { return (i / G) * x_row_stride(G * GROUP) + (i % G) * GROUP; }

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch rounds float to bf16.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int shift = 0;
      while (!(mantissa & 0x400u)) mantissa <<= 1, ++shift;
      bits = sign | ((113u - shift) << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline float load_float(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Element c of cell `slot` (nanoserve_cells), as fp32: the reference tier's and the tests' read.
inline float load_cell(const nanoserve_cells& cells, int64_t slot, int64_t c, bool bf16) {
  if (cells.scales == nullptr) return load_float(cells.data, slot * cells.stride + c, bf16);
  const float step = fp16_to_float(cells.scales[slot * cells.scale_stride + c / 32]);
  return step * static_cast<float>(static_cast<const int8_t*>(cells.data)[slot * cells.stride + c]);
}

// K/V head h of `cells` (head 0's): D values (and D / 32 steps) further on in each cell.
inline nanoserve_cells cells_head(const nanoserve_cells& cells, int64_t h, int64_t D, bool bf16) {
  const int64_t element = cells.scales ? 1 : bf16 ? 2 : 4;
  return {static_cast<const char*>(cells.data) + h * D * element, cells.scales ? cells.scales + h * (D / 32) : nullptr,
          cells.stride, cells.scale_stride};
}

inline void store_float(void* p, int64_t i, float v, bool bf16) {
  if (bf16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else static_cast<float*>(p)[i] = v;
}

// One activation group's scales, from its largest |x|: coarse = max |x| / 127 for the hi codes,
// fine = coarse / 254 for the lo codes (reference.cpp's quantiser, which every tier repeats in
// its own instructions). A group this small (bf16 reaches 1e-38) counts as zeros: 1 / fine
// would overflow.
struct GroupScales {
  float coarse, fine, inv_coarse, inv_fine;
};

inline GroupScales group_scales(float amax) {
  const float coarse = amax > 1e-30f ? amax / 127.f : 0.f, fine = coarse / 254.f;
  return {coarse, fine, coarse > 0.f ? 1.f / coarse : 0.f, fine > 0.f ? 1.f / fine : 0.f};
}

// The step of a half group of 8-bit activations: sixteenths of its group's step (max |x| over the
// 32 / 127), n / 16 of it with n = ceil(16 max |x| over the half / max over the group), 1 .. 16.
// The half holding the group's largest value keeps its own step, the other is at most a sixteenth
// of the group's step coarser than its own; and a tier can widen each half's integer sums by its
// n and fold the group's two halves at once (vector.cpp's sixteenths). Against a free step per
// half, a whole-text forward's fidelity is the same (avx2: top-1 97.7% against 97.4%, mean KL
// 0.00155 against 0.00153); one step per 32 is not (96.2%, 0.00287: below llama.cpp's 96.5%).
inline GroupScales half_scales(float half_max, float group_max) {
  const float n = group_max > 0.f ? __builtin_ceilf(16.f * half_max / group_max) : 16.f;
  return group_scales(group_max * n / 16.f);
}

// What the products read of group i (of M rows x G groups of 32) besides its codes: its fine
// scale, and per half h (16 k each) the sums of its hi and lo codes and fine * sum(254 hi + lo).
inline void store_group(int64_t i, int64_t M, int64_t G, const int32_t sum_hi[2], const int32_t sum_lo[2], float fine,
                        float* xd, float* xs, int32_t* xsum) {
  xd[i] = fine;
  for (int64_t h = 0; h < 2; ++h) {
    xsum[2 * i + h] = sum_hi[h];
    xsum[2 * M * G + 2 * i + h] = sum_lo[h];
    xs[2 * i + h] = fine * static_cast<float>(254 * sum_hi[h] + sum_lo[h]);
  }
}

// Where half group i (of M rows x 2 G halves of 16) of the hi codes starts in xq.
constexpr int64_t x_half_at(int64_t i, int64_t G) { return (i / (2 * G)) * x_row_stride(G * GROUP) + (i % (2 * G)) * 16; }

// What an 8-bit product reads of half group i besides its codes: its step, and the sum of its
// codes (as an integer, and times the step). Its lo codes are zero.
inline void store_half(int64_t i, int64_t M, int64_t G, int32_t sum_hi, float step, int8_t* xq, float* xd, float* xs,
                       int32_t* xsum) {
  memset(xq + M * x_row_stride(G * GROUP) + x_half_at(i, G), 0, 16);
  xd[i] = step;
  xsum[i] = sum_hi;
  xsum[2 * M * G + i] = 0;
  xs[i] = step * static_cast<float>(sum_hi);
}

enum { SCALES_FP16 = 0, SCALES_FP32 = 1, SCALES_SUPER = 2, SCALES_E8M0 = 3 };

// An exponent byte's scale 2^(e - 128), exact in fp32 (gguf's e8m0_to_fp32_half: e 0 and 1 are
// fp32 subnormals).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Bytes of a super-block's record of scales: 16 fp16 super-scales and S rows of 16 multipliers.
constexpr int64_t super_record_bytes(int64_t group) { return 32 + 16 * (256 / group); }

// Scale or minimum i = 16 h + r (scale group h, output r of the block; the layout above) of a
// weight whose scale groups are `group` wide. A super-scale times a multiplier is exact in fp32.
inline float load_scale(const void* p, int64_t i, int32_t kind, int64_t group) {
  if (kind == SCALES_FP32) return static_cast<const float*>(p)[i];
  if (kind == SCALES_FP16) return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
  if (kind == SCALES_E8M0) return e8m0_half(static_cast<const uint8_t*>(p)[i]);
  const int64_t per_record = 256 / group, h = i / 16, r = i % 16;
  const uint8_t* record = static_cast<const uint8_t*>(p) + (h / per_record) * super_record_bytes(group);
  uint16_t super;
  memcpy(&super, record + 2 * r, 2);
  return fp16_to_float(super) * static_cast<float>(reinterpret_cast<const int8_t*>(record)[32 + 16 * (h % per_record) + r]);
}

// Bytes of codes per group of 32 for a block of 16 outputs.
constexpr int64_t group_bytes(int bits) { return 64 * bits; }

// The code of output r (of 16) at k (of 32) within one group of a block (the layout above); with
// a table, its nibble (code_value gives what it stands for).
inline uint8_t code_in_group(const uint8_t* wg, int bits, int64_t r, int64_t k) {
  if (bits == 8) return wg[64 * (k / 4) + 4 * r + k % 4];
  const uint8_t byte = wg[64 * (k / 8) + 4 * r + k % 4];
  const uint8_t low = (k % 8) < 4 ? (byte & 15) : (byte >> 4);
  const int64_t vector = 2 * (k / 8) + (k % 8) / 4, at = 4 * r + k % 4;  // the code's byte in its vector
  if (bits == 4) return low;
  if (bits == 5) return low | ((wg[256 + 8 * vector + at / 8] >> (at % 8)) & 1) << 4;
  return low | ((wg[256 + 64 * (vector / 4) + at] >> (2 * (vector % 4))) & 3) << 4;
}

// What code c multiplies: itself, or its table's value.
inline int32_t code_value(const int8_t* table, uint8_t c) { return table ? table[c] : c; }

// Row r's 32 codes of group wg (code_in_group's, a word at a time): 4-bit codes come four to a
// word per pair of code vectors (low nibbles, then high), a 5-bit code's fifth bit from its
// plane, a 6-bit code's fifth and sixth from its crumbs.
template <int BITS>
inline void codes_of_row(const uint8_t* wg, int64_t r, uint8_t* c) {
  if constexpr (BITS == 8) {
    for (int q = 0; q < 8; ++q) memcpy(c + 4 * q, wg + 64 * q + 4 * r, 4);
  } else {
    for (int q = 0; q < 4; ++q) {
      uint32_t word;
      memcpy(&word, wg + 64 * q + 4 * r, 4);
      const uint32_t low = word & 0x0F0F0F0Fu, high = (word >> 4) & 0x0F0F0F0Fu;  // byte i: k = i, 4 + i
      memcpy(c + 8 * q, &low, 4);
      memcpy(c + 8 * q + 4, &high, 4);
    }
    if constexpr (BITS == 4) return;
    for (int v = 0; v < 8; ++v) {  // vector v's four codes of row r: k = 8 (v / 2) + 4 (v % 2) + i
      uint8_t* out = c + 8 * (v / 2) + 4 * (v % 2);
      if constexpr (BITS == 5) {
        const int bits = (wg[256 + 8 * v + r / 2] >> (4 * (r % 2))) & 15;
        for (int i = 0; i < 4; ++i) out[i] |= static_cast<uint8_t>(((bits >> i) & 1) << 4);
      } else {
        const uint8_t* crumbs = wg + 256 + 64 * (v / 4) + 4 * r;
        for (int i = 0; i < 4; ++i) out[i] |= static_cast<uint8_t>(((crumbs[i] >> (2 * (v % 4))) & 3) << 4);
      }
    }
  }
}

// Output row n of the weight, out[k] = d * c + m (or d * table[c]) over its K codes (out fp32,
// or bf16 bits); each group's 32 codes are read first, so the loops stay simple enough to vectorise.
template <int BITS, bool BF16>
inline void dequantize_row_typed(const uint8_t* w, const void* d, const void* m, nanoserve_format f, int64_t K,
                                 int64_t n, void* out) {
  const int64_t G = K / GROUP, b = n / 16, r = n % 16, per = GROUP / f.group, group = f.group;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + (b * G + g) * group_bytes(BITS);
    uint8_t raw[GROUP];
    codes_of_row<BITS>(wg, r, raw);
    float codes[GROUP];
    for (int64_t k = 0; k < GROUP; ++k) codes[k] = static_cast<float>(code_value(f.table, raw[k]));
    for (int64_t h = 0; h < per; ++h) {
      const int64_t at = ((b * G + g) * per + h) * 16 + r;
      const float scale = load_scale(d, at, f.scale_kind, f.group);
      const float low = f.table ? 0.f
                        : f.zero_point ? -static_cast<float>(f.zero_point) * scale
                                       : load_scale(m, at, f.scale_kind, f.group);
      for (int64_t k = h * group; k < (h + 1) * group; ++k) {
        if constexpr (BF16) static_cast<uint16_t*>(out)[g * GROUP + k] = float_to_bf16(scale * codes[k] + low);
        else static_cast<float*>(out)[g * GROUP + k] = scale * codes[k] + low;
      }
    }
  }
}

inline void dequantize_row(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t K, int64_t n,
                           void* out, bool out_bf16) {
  if (f.bits == 4) {
    out_bf16 ? dequantize_row_typed<4, true>(w, d, m, f, K, n, out) : dequantize_row_typed<4, false>(w, d, m, f, K, n, out);
  } else if (f.bits == 5) {
    out_bf16 ? dequantize_row_typed<5, true>(w, d, m, f, K, n, out) : dequantize_row_typed<5, false>(w, d, m, f, K, n, out);
  } else if (f.bits == 6) {
    out_bf16 ? dequantize_row_typed<6, true>(w, d, m, f, K, n, out) : dequantize_row_typed<6, false>(w, d, m, f, K, n, out);
  } else {
    out_bf16 ? dequantize_row_typed<8, true>(w, d, m, f, K, n, out) : dequantize_row_typed<8, false>(w, d, m, f, K, n, out);
  }
}

// A step's (row, slot) pairs grouped by expert: experts[j] (ascending) takes pairs
// pairs[starts[j] .. starts[j + 1]), each expert's pairs in their own order (experts_mm's tasks);
// pairs of negative ids are in none.
struct ExpertGroups {
  std::vector<int64_t> pairs, starts, experts;

  ExpertGroups(const int64_t* ids, int64_t count) {
    for (int64_t p = 0; p < count; ++p) {
      if (ids[p] >= 0) pairs.push_back(p);
    }
    std::stable_sort(pairs.begin(), pairs.end(), [ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    const int64_t grouped = static_cast<int64_t>(pairs.size());
    for (int64_t i = 0; i < grouped; ++i) {
      if (i == 0 || ids[pairs[i]] != ids[pairs[i - 1]]) starts.push_back(i), experts.push_back(ids[pairs[i]]);
    }
    starts.push_back(grouped);
  }
};

// Every output row of blocks [block_begin, block_end) into out [N, K] (a prompt's dense GEMM).
inline void dequantize_portable(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t K,
                                int64_t block_begin, int64_t block_end, void* out, int32_t out_bf16) {
  const int64_t size = out_bf16 ? 2 : 4;
  for (int64_t n = 16 * block_begin; n < 16 * block_end; ++n) {
    dequantize_row(f, w, d, m, K, n, static_cast<char*>(out) + n * K * size, out_bf16);
  }
}

// Rows rows[0 .. count) into out [count, K] (an embedding read from a tied head's codes).
inline void dequantize_rows_portable(nanoserve_format f, const uint8_t* w, const void* d, const void* m, int64_t K,
                                     const int64_t* rows, int64_t count, void* out, int32_t out_bf16) {
  const int64_t size = out_bf16 ? 2 : 4;
  for (int64_t i = 0; i < count; ++i) {
    dequantize_row(f, w, d, m, K, rows[i], static_cast<char*>(out) + i * K * size, out_bf16);
  }
}

}  // namespace
}  // namespace nanoserve
