// GGUF block tensors straight from the file's bytes into the kernels' packed layout
// (kernels/common.h): one pass over the blocks, no float or unpacked copy of the weight. The
// codes, scales and minimums written are the file's own (the same as gguf_blocks.py reads them
// and cpu_kernels.pack_groups packs them), so the product is exactly the one of the slow path.
// The table types keep the file's nibbles as 4-bit codes with their table (IQ4_NL's and IQ4_XS's
// non-linear values, MXFP4's doubled E2M1) in place of minimums, and their numbers as the file
// has them (fp16 d, IQ4_XS's super-block d and 6-bit scales as records, MXFP4's exponent byte):
// as many bits a weight as the file, give or take IQ4_XS's records (4.31 against 4.25). Q2_K's
// and Q3_K's codes go in the 4-bit layout at group 16 (one pass still).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/common.h"

namespace {

// gguf's GGMLQuantizationType values of the block types read here.
enum : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39
};

struct BlockType {
  int64_t weights, bytes;  // weights and bytes of one block
  int bits;                // the codes' storage bits in the kernels' layout
  int64_t group;           // weights per scale group
  bool has_mins;           // minimums stored (else a zero point)
};

// IQ4_NL's (and IQ4_XS's) non-linear values of a nibble, and MXFP4's (E2M1, doubled: its
// exponent byte's scale 2^(e - 128) holds the half), as gguf_blocks.py's: the code tables.
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The type's code table (nullptr: none).
constexpr const int8_t* code_table(int64_t qtype) {
  return qtype == IQ4_NL || qtype == IQ4_XS ? IQ4_VALUES : qtype == MXFP4 ? MXFP4_VALUES : nullptr;
}

// The block type's record ({} where qtype is none of the above).
constexpr BlockType block_type_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18, 4, 32, false};
    case Q4_1: return {32, 20, 4, 32, true};
    case Q5_0: return {32, 22, 5, 32, false};
    case Q5_1: return {32, 24, 5, 32, true};
    case Q8_0: return {32, 34, 8, 32, false};
    case Q4_K: return {256, 144, 4, 32, true};
    case Q5_K: return {256, 176, 5, 32, true};
    case Q6_K: return {256, 210, 6, 16, false};
    case Q2_K: return {256, 84, 4, 16, true};     // 2-bit codes held in 4
    case Q3_K: return {256, 110, 4, 16, false};   // 3-bit codes held in 4, zero point 4
    case IQ4_NL: return {32, 18, 4, 32, false};   // nibbles, through the IQ4 table
    case IQ4_XS: return {256, 136, 4, 32, false};
    case MXFP4: return {32, 17, 4, 32, false};    // nibbles, through the E2M1 table
  }
  return {0, 0, 0, 0, false};
}

BlockType block_type(int64_t qtype) {
  const BlockType t = block_type_of(qtype);
  TORCH_CHECK(t.weights, "GGUF type ", qtype, " does not pack from its blocks");
  return t;
}

// The types whose numbers are super-block records (an fp16 number times int8 multipliers).
bool is_k_quant(int64_t qtype) {
  return qtype == Q2_K || qtype == Q3_K || qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == IQ4_XS;
}

uint16_t fp16_bits(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

// Q4_K's and Q5_K's 6-bit scale (mins = false) or minimum of group g (0..7) from its 12 bytes.
inline uint8_t k_scale(const uint8_t* s, int g, bool mins) {
  const int lo = mins ? 4 : 0;
  if (g < 4) return s[g + lo] & 63;
  const uint8_t low = mins ? (s[g + 4] >> 4) : (s[g + 4] & 15);
  return low | ((s[g - 4 + lo] >> 6) << 4);
}

// The 32 codes of group g (32 weights along K) of one row whose blocks start at `row` (a table
// type's: the file's nibbles).
void group_codes(int64_t qtype, const uint8_t* row, int64_t g, uint8_t* out) {
  if (!is_k_quant(qtype)) {
    const BlockType t = block_type(qtype);
    const uint8_t* b = row + g * t.bytes;
    if (qtype == Q8_0) {
      for (int i = 0; i < 32; ++i) out[i] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + i]) + 128);
      return;
    }
    if (qtype == IQ4_NL || qtype == MXFP4) {  // Q4_0's nibbles
      const uint8_t* qs = b + (qtype == MXFP4 ? 1 : 2);
      for (int i = 0; i < 32; ++i) out[i] = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
      return;
    }
    const bool five = qtype == Q5_0 || qtype == Q5_1, mins = qtype == Q4_1 || qtype == Q5_1;
    const uint8_t* qs = b + (mins ? 4 : 2) + (five ? 4 : 0);
    uint32_t high = 0;
    if (five) memcpy(&high, b + (mins ? 4 : 2), 4);
    for (int i = 0; i < 32; ++i) {
      const uint8_t nibble = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
      out[i] = nibble | (five ? ((high >> i) & 1) << 4 : 0);
    }
    return;
  }
  const int64_t s = g / 8, gg = g % 8;
  if (qtype == Q6_K) {
    // Weight 32 gg + i: in half gg / 4 of the super-block, the low nibble of byte 32 (gg % 2) + i
    // of that half's 64 (high nibble for gg % 4 >= 2), the 2 bits at 2 (gg % 4) of byte i of its 32.
    const int half = static_cast<int>(gg / 4), quarter = static_cast<int>(gg % 4);
    const uint8_t* ql = row + s * 210 + 64 * half + 32 * (quarter % 2);
    const uint8_t* qh = row + s * 210 + 128 + 32 * half;
    const int low_shift = 4 * (quarter / 2), high_shift = 2 * quarter;
    for (int i = 0; i < 32; ++i) out[i] = ((ql[i] >> low_shift) & 15) | (((qh[i] >> high_shift) & 3) << 4);
    return;
  }
  if (qtype == Q2_K || qtype == Q3_K) {
    // 64 bytes of 2-bit parts in two halves of 32: weight 32 gg + i in half gg / 4, byte i, bits
    // 2 (gg % 4); Q3_K's high bit g of byte i of its first 32 bytes is weight 32 g + i's.
    const uint8_t* b = row + s * block_type(qtype).bytes;
    const uint8_t* qs = b + (qtype == Q2_K ? 16 : 32) + 32 * (gg / 4);
    const int shift = static_cast<int>(2 * (gg % 4));
    for (int i = 0; i < 32; ++i) {
      out[i] = ((qs[i] >> shift) & 3) | (qtype == Q3_K ? ((b[i] >> gg) & 1) << 2 : 0);
    }
    return;
  }
  if (qtype == IQ4_XS) {  // group gg's 16 bytes of nibbles, Q4_0's order
    const uint8_t* qs = row + s * 136 + 8 + 16 * gg;
    for (int i = 0; i < 32; ++i) out[i] = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
    return;
  }
  const bool five = qtype == Q5_K;
  const uint8_t* b = row + s * (five ? 176 : 144);
  const uint8_t* qs = b + (five ? 48 : 16) + 32 * (gg / 2);
  const int shift = 4 * (gg % 2);
  for (int i = 0; i < 32; ++i) {
    out[i] = ((qs[i] >> shift) & 15) | (five ? ((b[16 + i] >> gg) & 1) << 4 : 0);
  }
}

// The vectorised path: group_codes per type (decode_group) and the kernels' code layout per
// storage width (store_codes_words), as loops of a fixed count over bytes with shifts uniform
// across them (which the compiler turns into vector code at the baseline instruction set: no
// target flags, so the library runs on any CPU of its architecture) and 64-bit words of 8 codes.
// The decoders equal group_codes byte for byte, and the layout pack_groups' (tests/test_gguf_pack.py).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the 8-code words are little-endian");

// The 8 bits of a byte, bit i as byte i of the word (0 or 1).
inline uint64_t spread_bits(uint8_t bits) {
  const uint64_t x = (bits * 0x0101010101010101ull) & 0x8040201008040201ull;  // byte i: bit i, in place
  return ((x + 0x7F7F7F7F7F7F7F7Full) >> 7) & 0x0101010101010101ull;           // nonzero -> 1
}

// group_codes of one type.
template <int64_t QT>
inline void decode_group(const uint8_t* __restrict row, int64_t g, uint8_t* __restrict out) {
  constexpr BlockType t = block_type_of(QT);
  if constexpr (QT == IQ4_NL || QT == MXFP4 || QT == IQ4_XS) {  // Q4_0's nibbles
    const uint8_t* qs = QT == IQ4_XS ? row + (g / 8) * t.bytes + 8 + 16 * (g % 8) : row + g * t.bytes + (QT == MXFP4 ? 1 : 2);
    for (int i = 0; i < 16; ++i) {
      out[i] = qs[i] & 15;
      out[16 + i] = qs[i] >> 4;
    }
  } else if constexpr (QT == Q8_0) {
    const uint8_t* qs = row + g * t.bytes + 2;
    for (int i = 0; i < 32; ++i) out[i] = qs[i] ^ 0x80;  // int8 c -> c + 128
  } else if constexpr (t.weights == 32) {  // Q4_0, Q4_1, Q5_0, Q5_1
    constexpr bool five = t.bits == 5;
    constexpr int at = t.has_mins ? 4 : 2;  // the high bits, then (or else) the nibbles
    const uint8_t* b = row + g * t.bytes;
    const uint8_t* qs = b + at + (five ? 4 : 0);
    for (int i = 0; i < 16; ++i) {
      out[i] = qs[i] & 15;
      out[16 + i] = qs[i] >> 4;
    }
    if constexpr (five) {
      for (int j = 0; j < 4; ++j) {  // byte j of the high bits: weights 8 j .. 8 j + 7
        uint64_t word;
        memcpy(&word, out + 8 * j, 8);
        word |= spread_bits(b[at + j]) << 4;
        memcpy(out + 8 * j, &word, 8);
      }
    }
  } else if constexpr (QT == Q6_K) {  // as group_codes
    const int64_t s = g / 8, gg = g % 8;
    const int half = static_cast<int>(gg / 4), quarter = static_cast<int>(gg % 4);
    const uint8_t* ql = row + s * 210 + 64 * half + 32 * (quarter % 2);
    const uint8_t* qh = row + s * 210 + 128 + 32 * half;
    const int low_shift = 4 * (quarter / 2), high_shift = 2 * quarter;
    for (int i = 0; i < 32; ++i) out[i] = ((ql[i] >> low_shift) & 15) | (((qh[i] >> high_shift) & 3) << 4);
  } else if constexpr (QT == Q2_K || QT == Q3_K) {
    const int64_t s = g / 8, gg = g % 8;
    const uint8_t* b = row + s * t.bytes;
    const uint8_t* qs = b + (QT == Q2_K ? 16 : 32) + 32 * (gg / 4);
    const int shift = static_cast<int>(2 * (gg % 4));
    for (int i = 0; i < 32; ++i) {
      out[i] = ((qs[i] >> shift) & 3) | (QT == Q3_K ? ((b[i] >> gg) & 1) << 2 : 0);
    }
  } else {  // Q4_K, Q5_K
    const int64_t s = g / 8, gg = g % 8;
    constexpr bool five = QT == Q5_K;
    const uint8_t* b = row + s * t.bytes;
    const uint8_t* qs = b + (five ? 48 : 16) + 32 * (gg / 2);
    const int shift = static_cast<int>(4 * (gg % 2));
    for (int i = 0; i < 32; ++i) out[i] = ((qs[i] >> shift) & 15) | (five ? ((b[16 + i] >> gg) & 1) << 4 : 0);
  }
}

// The 4 codes of bytes 0..3 of `word`'s low 32 bits (bit `bit` of each) as a nibble, byte i at bit i.
inline uint32_t bit_nibble(uint32_t word, int bit) { return (((word >> bit) & 0x01010101u) * 0x01020408u) >> 24; }

// One group of 16 rows x 32 codes c[r][i] into the kernels' code layout at `dst` (common.h),
// at storage width BITS.
template <int BITS>
inline void store_codes_words(const uint8_t (*c)[32], uint8_t* __restrict dst) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < 16; ++r) memcpy(dst + (j * 16 + r) * 4, c[r] + 4 * j, 4);
    return;
  }
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < 16; ++r) {
      uint64_t word;
      memcpy(&word, c[r] + 8 * j, 8);
      const uint32_t lanes = static_cast<uint32_t>((word & 0x0F0F0F0Full) | ((word >> 28) & 0xF0F0F0F0ull));
      memcpy(dst + (j * 16 + r) * 4, &lanes, 4);
    }
  if constexpr (BITS == 5) {
    uint8_t* plane = dst + 256;
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half)
        for (int p = 0; p < 8; ++p) {
          uint32_t even, odd;
          memcpy(&even, c[2 * p] + 8 * j + 4 * half, 4);
          memcpy(&odd, c[2 * p + 1] + 8 * j + 4 * half, 4);
          plane[16 * j + 8 * half + p] = static_cast<uint8_t>(bit_nibble(even, 4) | (bit_nibble(odd, 4) << 4));
        }
  } else if constexpr (BITS == 6) {
    for (int q = 0; q < 2; ++q)  // crumb vector q: bits 2 t, 2 t + 1 of a byte from code vector 4 q + t
      for (int r = 0; r < 16; ++r) {
        uint32_t crumbs = 0;
        for (int t = 0; t < 4; ++t) {
          uint32_t word;  // code vector v's 4 codes of row r: k = 4 v + i
          memcpy(&word, c[r] + 4 * (4 * q + t), 4);
          crumbs |= ((word >> 4) & 0x03030303u) << (2 * t);
        }
        memcpy(dst + 256 + 64 * q + 4 * r, &crumbs, 4);
      }
  }
}

// Q3_K's 6-bit scale of group h (0..15) from its 12 bytes, minus 32: the low nibble of byte h
// (h < 8) or the high one of byte h - 8, and 2 bits of byte 8 + h % 4 at 2 (h / 4).
int8_t q3_k_scale(const uint8_t* s, int h) {
  const int low = (s[h % 8] >> (4 * (h / 8))) & 15, high = (s[8 + h % 4] >> (2 * (h / 4))) & 3;
  return static_cast<int8_t>((low | (high << 4)) - 32);
}

// IQ4_XS's 6-bit scale of group h (0..7), minus 32: a nibble of bytes 4-7 (low first) and 2
// bits of the 16-bit scales_h at bytes 2-3.
int8_t iq4_xs_scale(const uint8_t* blk, int h) {
  const int low = (blk[4 + h / 2] >> (4 * (h % 2))) & 15, high = ((blk[2] | (blk[3] << 8)) >> (2 * h)) & 3;
  return static_cast<int8_t>((low | (high << 4)) - 32);
}

// Output rows [16 b, 16 b + 16) of the weight, read from `rows`: their codes, and their numbers
// as fp16 bits per scale group (blocks of 32; MXFP4: its exponent bytes) or as super-block
// records (the rest).
template <int64_t QT>
void pack_block(const uint8_t* const* rows, int64_t k, int64_t b, uint8_t* codes, uint8_t* scales, uint8_t* mins) {
  constexpr int64_t qtype = QT;
  constexpr BlockType t = block_type_of(QT);
  const int64_t groups = k / 32, group_bytes = 64 * t.bits;  // code bytes of 16 rows x 32 weights
  alignas(64) uint8_t c[16][32];
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < 16; ++r) decode_group<QT>(rows[r], g, c[r]);
    store_codes_words<t.bits>(c, codes + (b * groups + g) * group_bytes);
  }
  if (qtype == MXFP4) {  // [n / 16, groups, 16] exponent bytes e: d = 2^(e - 128)
    for (int64_t g = 0; g < groups; ++g)
      for (int r = 0; r < 16; ++r) scales[(b * groups + g) * 16 + r] = rows[r][g * t.bytes];
    return;
  }
  if (!is_k_quant(qtype)) {  // [n / 16, groups, 16] fp16 bits
    uint16_t* d = reinterpret_cast<uint16_t*>(scales) + b * groups * 16;
    uint16_t* m = reinterpret_cast<uint16_t*>(mins) + b * groups * 16;
    for (int64_t g = 0; g < groups; ++g)
      for (int r = 0; r < 16; ++r) {
        d[g * 16 + r] = fp16_bits(rows[r] + g * t.bytes);
        if (t.has_mins) m[g * 16 + r] = fp16_bits(rows[r] + g * t.bytes + 2);
      }
    return;
  }
  const int64_t supers = k / 256, per_super = 256 / t.group, record = nanoserve::super_record_bytes(t.group);
  for (int64_t s = 0; s < supers; ++s) {
    uint8_t* sd = scales + (b * supers + s) * record;
    uint8_t* sm = t.has_mins ? mins + (b * supers + s) * record : nullptr;
    for (int r = 0; r < 16; ++r) {
      const uint8_t* blk = rows[r] + s * t.bytes;
      if (qtype == Q6_K || qtype == Q3_K || qtype == IQ4_XS) {  // d times int8 multipliers, a zero point
        const uint16_t d = fp16_bits(blk + (qtype == Q6_K ? 208 : qtype == Q3_K ? 108 : 0));
        memcpy(sd + 2 * r, &d, 2);
        for (int h = 0; h < per_super; ++h) {
          const int8_t multiplier = qtype == Q6_K ? static_cast<int8_t>(blk[192 + h])
                                    : qtype == Q3_K ? q3_k_scale(blk + 96, h) : iq4_xs_scale(blk, h);
          memcpy(sd + 32 + 16 * h + r, &multiplier, 1);
        }
        continue;
      }
      if (qtype == Q2_K) {  // d times 4-bit scales, -dmin times 4-bit minimums (a byte each per group)
        const uint16_t d = fp16_bits(blk + 80), neg_dmin = fp16_bits(blk + 82) ^ 0x8000u;
        memcpy(sd + 2 * r, &d, 2);
        memcpy(sm + 2 * r, &neg_dmin, 2);
        for (int h = 0; h < per_super; ++h) {
          sd[32 + 16 * h + r] = blk[h] & 15;
          sm[32 + 16 * h + r] = blk[h] >> 4;
        }
        continue;
      }
      const uint16_t d = fp16_bits(blk), neg_dmin = fp16_bits(blk + 2) ^ 0x8000u;  // the minimum is -dmin * mn
      memcpy(sd + 2 * r, &d, 2);
      memcpy(sm + 2 * r, &neg_dmin, 2);
      for (int h = 0; h < per_super; ++h) {
        sd[32 + 16 * h + r] = k_scale(blk + 4, h, false);
        sm[32 + 16 * h + r] = k_scale(blk + 4, h, true);
      }
    }
  }
}

// The types pack_block and decode_group are instantiated for, by gguf's type number.
#define NANOSERVE_GGUF_TYPES(X) \
  X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(IQ4_NL) X(IQ4_XS) X(MXFP4)

using PackBlock = void (*)(const uint8_t* const*, int64_t, int64_t, uint8_t*, uint8_t*, uint8_t*);

PackBlock pack_block_of(int64_t qtype) {
  switch (qtype) {
#define NANOSERVE_CASE(T) case T: return &pack_block<T>;
    NANOSERVE_GGUF_TYPES(NANOSERVE_CASE)
#undef NANOSERVE_CASE
  }
  TORCH_CHECK(false, "GGUF type ", qtype, " does not pack from its blocks");
}

// parts: uint8 [rows_i, row_bytes] each, block tensors of one type and width k as the file holds
// them, stacked along their rows in the output; row_orders (int64 [rows_i] or empty, one per
// part): the part's row of each of its output rows. -> (codes, scales, mins) of the stacked
// weight as cpu_kernels.pack_groups lays them out; mins is empty for a format with a zero point,
// and a table type's code table (int8 [16]; its scales: fp16 d, IQ4_XS's records, MXFP4's
// exponent bytes uint8 [n / 16, k / 32, 16]). Written in place, once: no part is packed apart and
// copied.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_gguf(at::TensorList parts, int64_t qtype, at::IntArrayRef rows,
                                                         int64_t k, at::TensorList row_orders) {
  const BlockType t = block_type(qtype);
  TORCH_CHECK(!parts.empty() && parts.size() == rows.size() && parts.size() == row_orders.size(),
              "pack_gguf takes one row count and one row order per part");
  const int64_t row_bytes = k / t.weights * t.bytes;
  std::vector<const uint8_t*> src(parts.size());
  std::vector<const int64_t*> order(parts.size(), nullptr);
  std::vector<int64_t> first_block(parts.size() + 1, 0);  // each part's first output block of 16 rows
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t n = rows[p];
    TORCH_CHECK(n % 16 == 0 && k % t.weights == 0 && k % 32 == 0, "a ", n, " x ", k,
                " weight does not pack in blocks of 16 rows and whole blocks of ", t.weights);
    const at::Tensor& blocks = parts[p];
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.numel() == n * row_bytes,
                "blocks must be contiguous uint8 of ", n * row_bytes, " bytes, got ", blocks.numel());
    src[p] = blocks.data_ptr<uint8_t>();
    const at::Tensor& row_order = row_orders[p];
    if (row_order.numel()) {
      TORCH_CHECK(row_order.scalar_type() == at::kLong && row_order.is_contiguous() && row_order.numel() == n,
                  "row_order must be contiguous int64 [", n, "]");
      order[p] = row_order.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK(order[p][i] >= 0 && order[p][i] < n, "row_order must lie in [0, ", n, ")");
    }
    first_block[p + 1] = first_block[p] + n / 16;
  }
  const int64_t n = first_block.back() * 16;
  const auto bytes = parts[0].options();
  at::Tensor codes = at::empty({n * k * t.bits / 8}, bytes), scales, mins;
  if (is_k_quant(qtype)) {
    const int64_t record = nanoserve::super_record_bytes(t.group);
    scales = at::empty({n / 16, k / 256, record}, bytes);
    mins = t.has_mins ? at::empty({n / 16, k / 256, record}, bytes) : at::empty({n / 16, k / 256, 0}, bytes);
  }
  if (!is_k_quant(qtype)) {
    scales = at::empty({n / 16, k / 32, 16}, bytes.dtype(qtype == MXFP4 ? at::kByte : at::kShort));
    mins = at::empty({n / 16, t.has_mins ? k / 32 : 0, 16}, bytes.dtype(at::kShort));
  }
  if (const int8_t* table = code_table(qtype)) {
    mins = at::empty({16}, bytes.dtype(at::kChar));
    memcpy(mins.data_ptr<int8_t>(), table, 16);
  }
  auto* c = codes.data_ptr<uint8_t>();
  auto* d = static_cast<uint8_t*>(scales.data_ptr());
  auto* m = static_cast<uint8_t*>(mins.data_ptr());
  const PackBlock pack = pack_block_of(qtype);
  at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (b >= first_block[p + 1]) ++p;  // b rises within a thread's range
      const int64_t local = b - first_block[p];
      const uint8_t* block_rows[16];
      for (int r = 0; r < 16; ++r) {
        const int64_t row = 16 * local + r;
        block_rows[r] = src[p] + (order[p] ? order[p][row] : row) * row_bytes;
      }
      pack(block_rows, k, b, c, d, m);
    }
  });
  return {codes, scales, mins};
}

// The codes [n, k] of a block tensor's rows, one byte each, as pack_gguf reads them (a table
// type's: its nibbles): through the vectorised decoders, or (scalar) through group_codes. Tests
// pin the one to the other.
template <int64_t QT>
void decode_rows(const uint8_t* src, int64_t n, int64_t k, bool scalar, uint8_t* out) {
  const int64_t row_bytes = k / block_type_of(QT).weights * block_type_of(QT).bytes;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < k / 32; ++g) {
      uint8_t* dst = out + r * k + 32 * g;
      if (scalar) group_codes(QT, src + r * row_bytes, g, dst);
      else decode_group<QT>(src + r * row_bytes, g, dst);
    }
}

at::Tensor gguf_codes(const at::Tensor& blocks, int64_t qtype, int64_t n, int64_t k, bool scalar) {
  const BlockType t = block_type(qtype);
  TORCH_CHECK(k % t.weights == 0 && k % 32 == 0, "a row of ", k, " is no whole number of blocks of ", t.weights);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.numel() == n * (k / t.weights) * t.bytes,
              "blocks must be contiguous uint8 of ", n * (k / t.weights) * t.bytes, " bytes, got ", blocks.numel());
  at::Tensor out = at::empty({n, k}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  switch (qtype) {
#define NANOSERVE_CASE(T) \
  case T:                 \
    decode_rows<T>(src, n, k, scalar, out.data_ptr<uint8_t>()); \
    break;
    NANOSERVE_GGUF_TYPES(NANOSERVE_CASE)
#undef NANOSERVE_CASE
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def("pack_gguf(Tensor[] parts, int qtype, int[] rows, int k, Tensor[] row_orders) -> (Tensor, Tensor, Tensor)");
  lib.def("gguf_codes(Tensor blocks, int qtype, int n, int k, bool scalar) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) {
  lib.impl("pack_gguf", &pack_gguf);
  lib.impl("gguf_codes", &gguf_codes);
}
