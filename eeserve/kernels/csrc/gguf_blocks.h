// eeserve CPU kernels: GGUF block formats, decoded 32 weights at a time into float registers.
//
// Contract: for each supported ggml type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K) a Format struct gives
// its block geometry (QK weights in TYPE_SIZE bytes) and decode(blk, g, w): group g (0..QK/32) of
// the block at blk -> the group's 32 weights in w[32 / L] vectors of L lanes. The values equal
// gguf.quants.dequantize (the converter's reference, ggml's dequantize_row_*) bit for bit.
//
// Why bit-exact under -ffast-math: every product below is exact in float32 (an fp16 scale has 11
// significant bits, a 4- or 5-bit quant 4 or 5, a 6-bit super-block scale 6: Q4_K's (d * sc) * q has at
// most 21 bits), so the only rounding is the reference's own one of a sum (Q4_1's d * q + m,
// Q4_K's d * q - dm) or of a product (Q6_K's (d * sc) * q, 25 bits, rounded once whether the
// compiler computes it as d * (sc * q) or not). Fusing a multiply with its add (FMA) or
// reassociating the products therefore leaves every value unchanged.
//
// Lanes: AVX-512 16, AVX2 (with FMA and F16C) 8, elsewhere a plain 8-lane loop that the compiler
// vectorises; the choice is made at compile time (native.py builds for this CPU).

#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace eeserve_gguf {

#if defined(__AVX512F__)
constexpr int L = 16;
using V = __m512;
using VI = __m512i;
inline VI ld_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VI ld_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VI shr(VI a, int s) { return _mm512_srlv_epi32(a, _mm512_set1_epi32(s)); }
inline VI shl(VI a, int s) { return _mm512_sllv_epi32(a, _mm512_set1_epi32(s)); }
inline VI band(VI a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline VI bor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI subi(VI a, int s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }
inline V tof(VI a) { return _mm512_cvtepi32_ps(a); }
inline V set1(float f) { return _mm512_set1_ps(f); }
inline V zero() { return _mm512_setzero_ps(); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V fmsub(V a, V b, V c) { return _mm512_fmsub_ps(a, b, c); }
inline V ldf(const float* p) { return _mm512_loadu_ps(p); }
inline void stf(float* p, V a) { _mm512_storeu_ps(p, a); }
inline float hsum(V a) { return _mm512_reduce_add_ps(a); }
// Lane l: bit base + l of word.
inline VI bits(uint32_t word, int base) {
  const VI lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const VI at = _mm512_add_epi32(lanes, _mm512_set1_epi32(base));
  return band(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), at), 1);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int L = 8;
using V = __m256;
using VI = __m256i;
inline VI ld_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline VI ld_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline VI shr(VI a, int s) { return _mm256_srlv_epi32(a, _mm256_set1_epi32(s)); }
inline VI shl(VI a, int s) { return _mm256_sllv_epi32(a, _mm256_set1_epi32(s)); }
inline VI band(VI a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
inline VI bor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI subi(VI a, int s) { return _mm256_sub_epi32(a, _mm256_set1_epi32(s)); }
inline V tof(VI a) { return _mm256_cvtepi32_ps(a); }
inline V set1(float f) { return _mm256_set1_ps(f); }
inline V zero() { return _mm256_setzero_ps(); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V fmsub(V a, V b, V c) { return _mm256_fmsub_ps(a, b, c); }
inline V ldf(const float* p) { return _mm256_loadu_ps(p); }
inline void stf(float* p, V a) { _mm256_storeu_ps(p, a); }
inline float hsum(V a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline VI bits(uint32_t word, int base) {
  const VI at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(base));
  return band(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), at), 1);
}
#else
// The portable lanes: plain arrays whose loops the compiler vectorises for what the CPU has.
constexpr int L = 8;
struct V { float v[L]; };
struct VI { int32_t v[L]; };
template <class F> inline VI mapi(VI a, F f) { for (int i = 0; i < L; ++i) a.v[i] = f(a.v[i]); return a; }
inline VI ld_u8(const uint8_t* p) { VI a; for (int i = 0; i < L; ++i) a.v[i] = p[i]; return a; }
inline VI ld_i8(const uint8_t* p) {
  VI a;
  for (int i = 0; i < L; ++i) a.v[i] = static_cast<int8_t>(p[i]);
  return a;
}
inline VI shr(VI a, int s) { return mapi(a, [s](int32_t x) { return x >> s; }); }
inline VI shl(VI a, int s) { return mapi(a, [s](int32_t x) { return x << s; }); }
inline VI band(VI a, int m) { return mapi(a, [m](int32_t x) { return x & m; }); }
inline VI bor(VI a, VI b) { for (int i = 0; i < L; ++i) a.v[i] |= b.v[i]; return a; }
inline VI subi(VI a, int s) { return mapi(a, [s](int32_t x) { return x - s; }); }
inline V tof(VI a) { V r; for (int i = 0; i < L; ++i) r.v[i] = static_cast<float>(a.v[i]); return r; }
inline V set1(float f) { V r; for (int i = 0; i < L; ++i) r.v[i] = f; return r; }
inline V zero() { return set1(0.f); }
inline V mul(V a, V b) { for (int i = 0; i < L; ++i) a.v[i] *= b.v[i]; return a; }
inline V fmadd(V a, V b, V c) { for (int i = 0; i < L; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline V fmsub(V a, V b, V c) {
  for (int i = 0; i < L; ++i) c.v[i] = a.v[i] * b.v[i] - c.v[i];
  return c;
}
inline V ldf(const float* p) { V r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void stf(float* p, V a) { std::memcpy(p, a.v, sizeof a.v); }
inline float hsum(V a) { float s = 0.f; for (int i = 0; i < L; ++i) s += a.v[i]; return s; }
inline VI bits(uint32_t word, int base) {
  VI a;
  for (int i = 0; i < L; ++i) a.v[i] = (word >> (base + i)) & 1u;
  return a;
}
#endif

constexpr int GROUP = 32;        // weights one decode call yields
constexpr int NW = GROUP / L;    // vectors per group

// An fp16 scale (little-endian bytes at p) as float32: exact, as numpy's astype(np.float32).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// ggml type ids (gguf.GGMLQuantizationType), as the ops take them.
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

// Q4_0: d (fp16), 16 bytes of nibbles: weight i < 16 the low nibble of byte i, i >= 16 the high
// nibble of byte i - 16; value d * (q - 8).
struct FQ4_0 {
  static constexpr int64_t QK = 32, TYPE_SIZE = 18;
  static inline void decode(const uint8_t* b, int, V* w) {
    const V d = set1(half_at(b));
    for (int c = 0; c < NW; ++c) {
      const int i = c * L;  // weights i..i+L: bytes (i % 16).., nibble i / 16
      const VI q = band(shr(ld_u8(b + 2 + i % 16), 4 * (i / 16)), 15);
      w[c] = mul(d, tof(subi(q, 8)));
    }
  }
};

// Q4_1: d, m (fp16), then Q4_0's nibbles; value d * q + m.
struct FQ4_1 {
  static constexpr int64_t QK = 32, TYPE_SIZE = 20;
  static inline void decode(const uint8_t* b, int, V* w) {
    const V d = set1(half_at(b)), m = set1(half_at(b + 2));
    for (int c = 0; c < NW; ++c) {
      const int i = c * L;
      const VI q = band(shr(ld_u8(b + 4 + i % 16), 4 * (i / 16)), 15);
      w[c] = fmadd(d, tof(q), m);  // d * q is exact: one rounding, the reference's
    }
  }
};

// Q5_0: d (fp16), 32 high bits (a little-endian word: bit i is weight i's fifth bit), then Q4_0's
// nibbles; value d * (q - 16). Q4_K_M files keep rows whose width is no multiple of 256 in it.
struct FQ5_0 {
  static constexpr int64_t QK = 32, TYPE_SIZE = 22;
  static inline void decode(const uint8_t* b, int, V* w) {
    const V d = set1(half_at(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof qh);
    for (int c = 0; c < NW; ++c) {
      const int i = c * L;
      const VI lo = band(shr(ld_u8(b + 6 + i % 16), 4 * (i / 16)), 15);
      w[c] = mul(d, tof(subi(bor(lo, shl(bits(qh, i), 4)), 16)));
    }
  }
};

// Q5_1: d, m (fp16), then Q5_0's high bits and nibbles; value d * q + m.
struct FQ5_1 {
  static constexpr int64_t QK = 32, TYPE_SIZE = 24;
  static inline void decode(const uint8_t* b, int, V* w) {
    const V d = set1(half_at(b)), m = set1(half_at(b + 2));
    uint32_t qh;
    std::memcpy(&qh, b + 4, sizeof qh);
    for (int c = 0; c < NW; ++c) {
      const int i = c * L;
      const VI lo = band(shr(ld_u8(b + 8 + i % 16), 4 * (i / 16)), 15);
      w[c] = fmadd(d, tof(bor(lo, shl(bits(qh, i), 4))), m);  // d * q exact, as Q4_1
    }
  }
};

// Q8_0: d (fp16), 32 int8; value q * d.
struct FQ8_0 {
  static constexpr int64_t QK = 32, TYPE_SIZE = 34;
  static inline void decode(const uint8_t* b, int, V* w) {
    const V d = set1(half_at(b));
    for (int c = 0; c < NW; ++c) w[c] = mul(tof(ld_i8(b + 2 + c * L)), d);
  }
};

// Q4_K: a super-block of 256 = 8 groups of 32. d, dmin (fp16), 12 bytes of 6-bit scales and mins
// (groups 0-3 in the low 6 bits of bytes 0-3 / 4-7; groups 4-7 in the nibbles of bytes 8-11 plus
// the top 2 bits of bytes 0-3 / 4-7), 128 bytes of nibbles: group g's weight i is nibble g % 2 of
// byte 32 * (g / 2) + i. Value (d * sc) * q - dmin * mn.
struct FQ4_K {
  static constexpr int64_t QK = 256, TYPE_SIZE = 144;
  static inline void decode(const uint8_t* b, int g, V* w) {
    const uint8_t* s = b + 4;
    int sc, mn;
    if (g < 4) {
      sc = s[g] & 63;
      mn = s[g + 4] & 63;
    } else {
      sc = (s[g + 4] & 15) | ((s[g - 4] >> 6) << 4);
      mn = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
    }
    const V d = set1(half_at(b) * static_cast<float>(sc));
    const V dm = set1(half_at(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + 16 + 32 * (g / 2);
    for (int c = 0; c < NW; ++c)
      w[c] = fmsub(d, tof(band(shr(ld_u8(qs + c * L), 4 * (g % 2)), 15)), dm);
  }
};

// Q6_K: a super-block of 256 in two halves of 128. 128 bytes ql (low 4 bits), 64 bytes qh (high
// 2 bits), 16 int8 scales (one per 16 weights), d (fp16). Group g = 4 h + t (half h): weight i
// has low bits nibble t / 2 of ql[64 h + 32 (t % 2) + i], high bits (qh[32 h + i] >> 2 t) & 3;
// value (d * scale) * (q - 32).
struct FQ6_K {
  static constexpr int64_t QK = 256, TYPE_SIZE = 210;
  static inline void decode(const uint8_t* b, int g, V* w) {
    const int h = g / 4, t = g % 4;
    const uint8_t* ql = b + 64 * h + 32 * (t % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const float d = half_at(b + 208);
    for (int c = 0; c < NW; ++c) {
      const int i = c * L;
      const VI lo = band(shr(ld_u8(ql + i), 4 * (t / 2)), 15);
      const VI hi = shl(band(shr(ld_u8(qh + i), 2 * t), 3), 4);
      const float sc = static_cast<float>(static_cast<int8_t>(b[192 + (32 * g + i) / 16]));
      w[c] = mul(set1(d * sc), tof(subi(bor(lo, hi), 32)));
    }
  }
};

}  // namespace eeserve_gguf
