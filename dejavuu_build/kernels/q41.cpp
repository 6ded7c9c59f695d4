// Q41MatMul (domain dejavuu.q41, opset 1): an exact matmul of block-quantized weights (4-, 5- or
// 8-bit levels, blocks of 32 along K) by int8-rounded activations, as an onnxruntime custom operator,
// compiled on the user's machine on first use by dejavuu_build/kernels/q41.py (which also writes
// the weights, pack(), and holds the same arithmetic in numpy, reference()).
// Grown from the spike of the twenty-second session (docs/spikes/q41_gemm.cpp; its operator is in the history at 4c95ac3).
//
// Inputs   A float [..., K]
//          packed uint8 [tiles*nb*64*bits] (per tile and block: 256 bytes at 4 bits, 320 at 5, 512 at 8)
//          d float or float16 [tiles*nb*16]
//          m optional, d's type, [tiles*nb*16]: omitted (an empty name, or no 4th input) is the
//            centred form below
// Attrs    K (a multiple of 32), N (the real output width), bits (4, 5 or 8; absent: 4);
//          tiles = ceil(N/16), nb = K/32
// Output   Y float [..., N]
//
// Weights, column n, block b (32 consecutive k), levels q in 0..2^bits-1:
//   minimum form (m given):  w[k, n] = d[b,n] * q + m[b,n]       (GGUF Q4_1; Q4_K, Q4_0 per 32 too)
//   centred form (no m):     w[k, n] = d[b,n] * (q - 2^(bits-1))  (GGUF Q4_0: q, d; Q5_0: q, d;
//                                                                   Q8_0: q_s8 + 128, d)
// float16 d and m are converted to float exactly: the same bits as the same values given as float.
// Layout, per tile of 16 columns and block (d and m: [tiles][nb][16]; columns past N are zero
// levels, d = m = 0):
//   bits 4: 256 bytes, 4 groups of 64 (16 columns x 4 bytes); byte g*64 + lane*4 + e holds the
//           level of k = 4g+e in its low nibble and of k = 16+4g+e in its high one
//   bits 5: 320 bytes: the 4-bit layout of the levels' low 4 bits, then 64 bytes of fifth bits:
//           byte 256 + lane*4 + e holds, in its bit j (0..7), the fifth bit of the level of
//           k = 4j+e (so a byte of the plane sits where the nibbles' bytes of its lane and e do,
//           and one shift and mask per level vector puts its bits at 0x10: GGUF Q5_0/Q5_1/Q5_K's
//           levels, 0.625 bytes a weight instead of 1 at 8 bits)
//   bits 8: 512 bytes, 8 groups of 64; byte g*64 + lane*4 + e holds the level of k = 4g+e
//
// Arithmetic, the same float operations in the same order on every ISA path (so every path gives
// the same bits) and for every row whatever the row count (a row alone and among 8 gives the same
// bits, which is what keeps speculative verification lossless):
//   per row and block:  sc = amax/127.f; inv = sc ? 1.f/sc : 0.f; qa = round_half_even(v*inv);
//                       isum = sum(qa) (int32); ssum = sc * (float)isum
//   per row and column: acc = 0.f; for b in order: dot = int32 sum_j q*qa;
//     minimum form:     acc = acc + fmaf(m, ssum, (float)dot * (d*sc))
//     centred form:     dotc = dot - 2^(bits-1) * isum (exact); acc = acc + (float)dotc * (d*sc)
//   (|dot| <= 32*255*127 < 2^24: every int32 -> float conversion is exact)
// Non-finite activations or scales give non-finite outputs whose bits are left unspecified.
//
// ISA paths, chosen at compile time from the predefined macros (the JIT builds with -march=native):
//   avx512vnni  AVX-512 F+BW+VNNI: vpdpbusd over 4 levels per lane, 16 columns per zmm (8-bit
//               levels straight from memory, no unpacking; 5-bit: nibbles OR the plane's bit at
//               0x10); float16 scales by vcvtph2ps
//   avx2        AVX2+FMA (AVX-512 CPUs without VNNI too): two 8-column halves (in one pass over a
//               tile; from three rows the rows in chunks whose int16 sums stay in registers, 5-bit
//               levels one half after the other), vpmaddubsw (levels
//               0..15 unsigned x int8 activations: at most 2*15*127 per pair, and 8 groups summed
//               in int16 stay under 8*3810 = 30480, so no saturation) then vpmaddwd with ones;
//               8-bit levels split into nibbles, dot = dot(lo) + 16*dot(hi) (each as above: a
//               byte x 127 pair could reach 2*255*127 and saturate int16); 5-bit levels whole
//               (0..31: a pair at most 2*31*127 = 7874, so 4 groups per int16 sum, 31496); float16
//               scales by F16C
//               where the compiler has it (-mf16c), else converted one by one
//   scalar      portable C++ (std::nearbyint under the default rounding mode, std::fma)
// Build flags: -ffp-contract=off and never -ffast-math (the order above is the contract).
//
// onnxruntime: only its C API (onnxruntime_c_api.h), and of that only functions of API version
// <= 17 (KernelContext_ParallelFor, onnxruntime 1.17, is the newest one used). RegisterCustomOps
// asks for the highest API version both the headers and the running library have, down to 17, and
// stamps the operator with it (onnxruntime refuses an OrtCustomOp whose version is above its own).
// The optional m (GetInputCharacteristic: OrtCustomOp version >= 8) and d/m of any element type
// (GetInputType UNDEFINED: each input its own "all types" constraint, onnxruntime >= 1.17;
// checked at Compute) need nothing newer.
#include "onnxruntime_c_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q41_AVX512VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define Q41_AVX2 1
#include <immintrin.h>
#endif

#define Q41_EXPORT extern "C" __attribute__((visibility("default")))

// attn.cpp: the attention operator, registered here in its own domain (one library, one load),
// and SwiGLU and GeGLU in this one (the MLP's activations); version 0 returns the op as last stamped
OrtCustomOp* dejavuu_attention_op(uint32_t version);
OrtCustomOp* dejavuu_swiglu_op(uint32_t version);
OrtCustomOp* dejavuu_geglu_op(uint32_t version);

namespace {

constexpr int BL = 32;            // block length along K
constexpr int TN = 16;            // columns per tile
constexpr size_t kBatches = 0;    // ParallelFor: no cap on the number of batches (as timed)
constexpr uint32_t kMinApi = 17;  // KernelContext_ParallelFor
constexpr const char* kDomain = "dejavuu.q41";
constexpr const char* kOp = "Q41MatMul";

// packed bytes per tile and block: 16 columns x 32 levels of `bits` bits (256 at 4, 320 at 5, 512 at 8)
constexpr int64_t tile_bytes(int bits) { return (int64_t)TN * BL * bits / 8; }
constexpr int64_t kPlane = 256;  // bits 5: where a tile's block keeps its fifth bits (after the nibbles)

struct Job {
  const uint8_t* q;
  const void* d;        // float, or uint16_t holding float16 bits (the instantiation says which)
  const void* m;        // d's type; null in the centred form
  const int8_t* qa;     // [rows][K]
  const float* s;       // [rows][nb]
  const float* ssum;    // [rows][nb]
  const int32_t* isum;  // [rows][nb]
  float* y;             // [rows][N]
  int64_t K, N, nb, rows;
};

inline int32_t load_i32(const int8_t* p) {  // 4 activations as one lane, without aliasing casts
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Writes `width` (<= 16) columns of a tile's row: all 16 in place, or the first ones of the last tile.
inline void store_cols(float* dst, const float* tmp, int width) {
  std::memcpy(dst, tmp, sizeof(float) * (size_t)width);
}

// IEEE half -> float, exact (every half is a float): subnormals normalised, inf kept, NaN quieted.
[[maybe_unused]] inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  uint32_t b;
  if (e == 0x1F) {
    b = sign | 0x7F800000u | (f << 13) | (f != 0 ? 0x400000u : 0u);
  } else if (e != 0) {
    b = sign | ((e + 112u) << 23) | (f << 13);
  } else if (f == 0) {
    b = sign;
  } else {  // f * 2^-24 = 1.x * 2^(-14-sh) once f << sh has bit 10 set
    uint32_t ff = f, sh = 0;
    while (!(ff & 0x400u)) {
      ff <<= 1;
      sh++;
    }
    b = sign | ((113u - sh) << 23) | ((ff & 0x3FFu) << 13);
  }
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

// ------------------------------------------------------------------ activations, per row and block
#if defined(Q41_AVX512VNNI)
constexpr const char* kIsa = "avx512vnni";

void quantize_block(const float* v, int8_t* qa, float* s, float* ssum, int32_t* isum) {
  __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  float sc = amax / 127.f, inv = sc != 0.f ? 1.f / sc : 0.f;
  __m512 vi = _mm512_set1_ps(inv);
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
  _mm_storeu_si128((__m128i*)qa, _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128((__m128i*)(qa + 16), _mm512_cvtepi32_epi8(q1));
  int tot = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  *s = sc;
  *ssum = sc * (float)tot;
  *isum = tot;
}

#elif defined(Q41_AVX2)
constexpr const char* kIsa = "avx2";

void quantize_block(const float* v, int8_t* qa, float* s, float* ssum, int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], a = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  float amax = _mm_cvtss_f32(h);
  float sc = amax / 127.f, inv = sc != 0.f ? 1.f / sc : 0.f;
  __m256 vi = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], vi));
  // |q| <= 127: the saturating packs are plain narrowing; packs interleave 128-bit lanes, the
  // permute puts the 8 dwords back in order
  __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
  __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)qa, p8);
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
  int tot = _mm_cvtsi128_si32(t4);
  *s = sc;
  *ssum = sc * (float)tot;
  *isum = tot;
}

#else
constexpr const char* kIsa = "scalar";

void quantize_block(const float* v, int8_t* qa, float* s, float* ssum, int32_t* isum) {
  float amax = 0.f;
  for (int j = 0; j < BL; j++) amax = std::max(amax, std::fabs(v[j]));
  float sc = amax / 127.f, inv = sc != 0.f ? 1.f / sc : 0.f;
  int tot = 0;
  for (int j = 0; j < BL; j++) {
    float r = std::nearbyint(v[j] * inv);        // nearest, ties to even (the default rounding mode)
    int qi = std::fabs(r) <= 127.f ? (int)r : 0;  // non-finite input: no undefined conversion
    qa[j] = (int8_t)qi;
    tot += qi;
  }
  *s = sc;
  *ssum = sc * (float)tot;
  *isum = tot;
}
#endif

void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* qa, float* s, float* ssum, int32_t* isum) {
  const int64_t nb = K / BL;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t i = r * nb + b;
      quantize_block(x + r * K + b * BL, qa + r * K + b * BL, s + i, ssum + i, isum + i);
    }
}

// ------------------------------------------------------------------ one tile of 16 columns, M rows
// Template parameters: M rows (1..8), BITS (4, 5 or 8), CENTRED (no m), S the scales' element type
// (float, or uint16_t holding float16 bits).
#if defined(Q41_AVX512VNNI)
// bits 5: bit j of each plane byte moved to bit 4 (16-bit shifts by at most 4 keep a byte's bits
// in that byte wherever the mask 0x10 then looks)
inline __m512i fifth(__m512i plane, int j) {
  return j < 4 ? _mm512_slli_epi16(plane, 4 - j) : j == 4 ? plane : _mm512_srli_epi16(plane, j - 4);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

template <int M, int BITS, bool CENTRED, typename S>
void tile(const Job& j, int64_t t, int64_t r0) {
  constexpr int64_t TB = tile_bytes(BITS);
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  const S* ds = static_cast<const S*>(j.d);
  const S* ms = static_cast<const S*>(j.m);
  __m512 acc[M];
  for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.nb; b++) {
    const uint8_t* p = j.q + (t * j.nb + b) * TB;
    __m512i wv[8];  // wv[g]: the levels of k = 4g..4g+3, 4 bytes per column
    if constexpr (BITS == 4 || BITS == 5) {
      const __m512i lo4 = _mm512_set1_epi8(0x0F);
      for (int g = 0; g < 4; g++) {
        __m512i raw = _mm512_loadu_si512(p + 64 * g);
        wv[g] = _mm512_and_si512(raw, lo4);
        wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
      }
      if constexpr (BITS == 5) {  // bit j of the plane's byte: the fifth bit of wv[j]'s level there
        const __m512i plane = _mm512_loadu_si512(p + kPlane), b4 = _mm512_set1_epi8(0x10);
        for (int g = 0; g < 8; g++) wv[g] = _mm512_or_si512(wv[g], _mm512_and_si512(fifth(plane, g), b4));
      }
    } else {
      for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512(p + 64 * g);
    }
    const int64_t o = (t * j.nb + b) * TN;
    const __m512 dv = load16(ds + o);
    __m512 mv = _mm512_setzero_ps();
    if constexpr (!CENTRED) mv = load16(ms + o);
    // rows unrolled: each row's acc stays in a register (8 rows at 8 bits: 3.2 -> 2.0 ms on the
    // lm-head's K 576 x N 49152, one Zen 4 core), not in a stack slot that every block reloads
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) {
      const int8_t* qa = j.qa + (r0 + r) * j.K + b * BL;
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        d0 = _mm512_dpbusd_epi32(d0, wv[g], _mm512_set1_epi32(load_i32(qa + 4 * g)));
        d1 = _mm512_dpbusd_epi32(d1, wv[g + 1], _mm512_set1_epi32(load_i32(qa + 4 * g + 4)));
      }
      __m512i dot = _mm512_add_epi32(d0, d1);
      const int64_t rb = (r0 + r) * j.nb + b;
      const __m512 dsc = _mm512_mul_ps(dv, _mm512_set1_ps(j.s[rb]));
      if constexpr (CENTRED) {
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(j.isum[rb] * (1 << (BITS - 1))));
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_cvtepi32_ps(dot), dsc));
      } else {
        __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), dsc);
        acc[r] = _mm512_add_ps(acc[r], _mm512_fmadd_ps(mv, _mm512_set1_ps(j.ssum[rb]), t1));
      }
    }
  }
  for (int r = 0; r < M; r++) {
    float* dst = j.y + (r0 + r) * j.N + t * TN;
    if (width == TN) {
      _mm512_storeu_ps(dst, acc[r]);
    } else {
      alignas(64) float tmp[TN];
      _mm512_store_ps(tmp, acc[r]);
      store_cols(dst, tmp, width);
    }
  }
}

#elif defined(Q41_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  alignas(32) float tmp[8];
  for (int i = 0; i < 8; i++) tmp[i] = half_to_float(p[i]);
  return _mm256_load_ps(tmp);
#endif
}

// The int32 dot of 8 columns' levels (4 bytes per column per group) over G groups with the row's
// activations, through int16 sums of vpmaddubsw pairs: exact while G * 2 * top * 127 fits int16
// (5-bit levels 0..31 over 4 groups: 31496).
template <int G>
inline __m256i dot_groups(const __m256i* w, const int8_t* qa, __m256i mul16) {
  __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load_i32(qa)));
  for (int g = 1; g < G; g++)
    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(load_i32(qa + 4 * g))));
  return _mm256_madd_epi16(s16, mul16);
}

// bits 5: bit j of each plane byte moved to bit 4 and OR-ed into level vector j (16-bit shifts by
// at most 4 keep a byte's bits in that byte wherever the mask 0x10 then looks)
inline __m256i with_fifth(__m256i w, __m256i plane, int j) {
  const __m256i b = j < 4 ? _mm256_slli_epi16(plane, 4 - j) : j == 4 ? plane : _mm256_srli_epi16(plane, j - 4);
  return _mm256_or_si256(w, _mm256_and_si256(b, _mm256_set1_epi8(0x10)));
}

// Asks for a block of the tile kPrefetch tiles ahead while this one computes (its levels, and its
// scales every other block: 32 bytes of float16 d and m, or 64 of float): the weights stream from
// memory at one and two rows and the hardware prefetcher alone does not run far enough ahead
// (with the single pass below: one-row step -5 to -10%, two-row -15%, AVX2 Zen 3, 2 threads).
constexpr int64_t kPrefetch = 2;

template <int BITS, bool CENTRED, typename S>
inline void prefetch(const Job& j, const uint8_t* p, int64_t tb) {
  for (int64_t i = 0; i < tile_bytes(BITS); i += 64) _mm_prefetch((const char*)(p + i), _MM_HINT_T0);
  if ((tb & 1) == 0) {
    _mm_prefetch((const char*)(static_cast<const S*>(j.d) + tb * TN), _MM_HINT_T0);
    if constexpr (!CENTRED) _mm_prefetch((const char*)(static_cast<const S*>(j.m) + tb * TN), _MM_HINT_T0);
  }
}

// Group g's 64 bytes (16 columns x 4) as the low and high nibbles of each 8-column half.
inline void nibbles(const uint8_t* p, __m256i lo4, __m256i& lo, __m256i& hi) {  // one half's 32 bytes
  const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  lo = _mm256_and_si256(raw, lo4);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
}
inline void nibbles(const uint8_t* p, __m256i lo4, __m256i& lo0, __m256i& hi0, __m256i& lo1, __m256i& hi1) {
  nibbles(p, lo4, lo0, hi0);
  nibbles(p + 32, lo4, lo1, hi1);
}

// One or two rows: both 8-column halves of the tile in one pass over its bytes (each row's
// activations broadcast once for 16 columns), rows innermost over one group of 4 k at a time: the
// int16 sums of a block stay in registers.
template <int M, int BITS, bool CENTRED, typename S>
void tile_pass(const Job& j, int64_t t, int64_t r0) {
  static_assert(M <= 2, "two rows' sums of both halves fill the 16 ymm registers");
  constexpr int64_t TB = tile_bytes(BITS);
  const S* ds = static_cast<const S*>(j.d);
  const S* ms = static_cast<const S*>(j.m);
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const bool ahead = r0 == 0 && (t + kPrefetch) * TN < j.N;  // no address past the weights is formed
  alignas(32) float acc[M][TN];
  for (int r = 0; r < M; r++) {
    _mm256_store_ps(acc[r], _mm256_setzero_ps());
    _mm256_store_ps(acc[r] + 8, _mm256_setzero_ps());
  }
  for (int64_t b = 0; b < j.nb; b++) {
    const uint8_t* p = j.q + (t * j.nb + b) * TB;
    const int8_t* qa = j.qa + r0 * j.K + b * BL;
    if (ahead) prefetch<BITS, CENTRED, S>(j, p + kPrefetch * j.nb * TB, (t + kPrefetch) * j.nb + b);
    __m256i s16[M][2], s16h[BITS == 4 ? 1 : M][2];  // [row][half]; 8 bits: low and high nibbles
    if constexpr (BITS == 5) {  // as 4 bits with the plane's fifth bits; k < 16 and k >= 16 summed apart
      const __m256i pl0 = _mm256_loadu_si256((const __m256i*)(p + kPlane));
      const __m256i pl1 = _mm256_loadu_si256((const __m256i*)(p + kPlane + 32));
      for (int g = 0; g < 4; g++) {
        __m256i lo0, hi0, lo1, hi1;
        nibbles(p + 64 * g, lo4, lo0, hi0, lo1, hi1);
        lo0 = with_fifth(lo0, pl0, g), hi0 = with_fifth(hi0, pl0, g + 4);
        lo1 = with_fifth(lo1, pl1, g), hi1 = with_fifth(hi1, pl1, g + 4);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
          const int8_t* a = qa + r * j.K + 4 * g;
          const __m256i al = _mm256_set1_epi32(load_i32(a)), ah = _mm256_set1_epi32(load_i32(a + 16));
          const __m256i l0 = _mm256_maddubs_epi16(lo0, al), h0 = _mm256_maddubs_epi16(hi0, ah);
          const __m256i l1 = _mm256_maddubs_epi16(lo1, al), h1 = _mm256_maddubs_epi16(hi1, ah);
          s16[r][0] = g == 0 ? l0 : _mm256_add_epi16(s16[r][0], l0);
          s16[r][1] = g == 0 ? l1 : _mm256_add_epi16(s16[r][1], l1);
          s16h[r][0] = g == 0 ? h0 : _mm256_add_epi16(s16h[r][0], h0);
          s16h[r][1] = g == 0 ? h1 : _mm256_add_epi16(s16h[r][1], h1);
        }
      }
    } else if constexpr (BITS == 4) {  // group g: low nibbles k = 4g+e, high ones k = 16+4g+e
      for (int g = 0; g < 4; g++) {
        __m256i lo0, hi0, lo1, hi1;
        nibbles(p + 64 * g, lo4, lo0, hi0, lo1, hi1);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
          const int8_t* a = qa + r * j.K + 4 * g;
          const __m256i al = _mm256_set1_epi32(load_i32(a)), ah = _mm256_set1_epi32(load_i32(a + 16));
          __m256i x0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, al), _mm256_maddubs_epi16(hi0, ah));
          __m256i x1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, al), _mm256_maddubs_epi16(hi1, ah));
          s16[r][0] = g == 0 ? x0 : _mm256_add_epi16(s16[r][0], x0);
          s16[r][1] = g == 0 ? x1 : _mm256_add_epi16(s16[r][1], x1);
        }
      }
    } else {  // group g: both nibbles of k = 4g+e, dot = dot(low) + 16 * dot(high)
      for (int g = 0; g < 8; g++) {
        __m256i lo0, hi0, lo1, hi1;
        nibbles(p + 64 * g, lo4, lo0, hi0, lo1, hi1);
#pragma GCC unroll 8
        for (int r = 0; r < M; r++) {
          const __m256i av = _mm256_set1_epi32(load_i32(qa + r * j.K + 4 * g));
          __m256i l0 = _mm256_maddubs_epi16(lo0, av), h0 = _mm256_maddubs_epi16(hi0, av);
          __m256i l1 = _mm256_maddubs_epi16(lo1, av), h1 = _mm256_maddubs_epi16(hi1, av);
          s16[r][0] = g == 0 ? l0 : _mm256_add_epi16(s16[r][0], l0);
          s16[r][1] = g == 0 ? l1 : _mm256_add_epi16(s16[r][1], l1);
          s16h[r][0] = g == 0 ? h0 : _mm256_add_epi16(s16h[r][0], h0);
          s16h[r][1] = g == 0 ? h1 : _mm256_add_epi16(s16h[r][1], h1);
        }
      }
    }
    const int64_t o = (t * j.nb + b) * TN;
    const __m256 dv[2] = {load8(ds + o), load8(ds + o + 8)};
    __m256 mv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if constexpr (!CENTRED) mv[0] = load8(ms + o), mv[1] = load8(ms + o + 8);
#pragma GCC unroll 8
    for (int r = 0; r < M; r++) {
      const int64_t rb = (r0 + r) * j.nb + b;
      const __m256 sv = _mm256_set1_ps(j.s[rb]);
      for (int h = 0; h < 2; h++) {
        __m256i dot = _mm256_madd_epi16(s16[r][h], _mm256_set1_epi16(1));
        if constexpr (BITS == 8) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(s16h[r][h], _mm256_set1_epi16(16)));
        if constexpr (BITS == 5) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(s16h[r][h], _mm256_set1_epi16(1)));
        const __m256 dsc = _mm256_mul_ps(dv[h], sv);
        __m256 inc;
        if constexpr (CENTRED) {
          dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(j.isum[rb] * (1 << (BITS - 1))));
          inc = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dsc);
        } else {
          __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dsc);
          inc = _mm256_fmadd_ps(mv[h], _mm256_set1_ps(j.ssum[rb]), t1);
        }
        _mm256_store_ps(acc[r] + 8 * h, _mm256_add_ps(_mm256_load_ps(acc[r] + 8 * h), inc));
      }
    }
  }
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  for (int r = 0; r < M; r++) store_cols(j.y + (r0 + r) * j.N + t * TN, acc[r], width);
}

// Three to eight rows of 5-bit levels: one 8-column half at a time, its levels unpacked once per
// block for all rows.
template <int M, int BITS, bool CENTRED, typename S>
void tile_halves(const Job& j, int64_t t, int64_t r0) {
  static_assert(BITS == 5, "4- and 8-bit levels run tile_chunk");
  constexpr int64_t TB = tile_bytes(BITS);
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  const S* ds = static_cast<const S*>(j.d);
  const S* ms = static_cast<const S*>(j.m);
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const bool ahead = r0 == 0 && (t + kPrefetch) * TN < j.N;
  for (int h = 0; h < 2 && 8 * h < width; h++) {  // a half wholly past N is not computed
    __m256 acc[M];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < j.nb; b++) {
      const uint8_t* p = j.q + (t * j.nb + b) * TB + 32 * h;  // columns 8h..8h+7
      if (h == 0 && ahead) prefetch<BITS, CENTRED, S>(j, p + kPrefetch * j.nb * TB, (t + kPrefetch) * j.nb + b);
      __m256i wv[8];  // [g]: k = 4g..4g+3 ([4+g]: k = 16+4g..)
      for (int g = 0; g < 4; g++) nibbles(p + 64 * g, lo4, wv[g], wv[g + 4]);
      const __m256i plane = _mm256_loadu_si256((const __m256i*)(j.q + (t * j.nb + b) * TB + kPlane + 32 * h));
      for (int g = 0; g < 8; g++) wv[g] = with_fifth(wv[g], plane, g);
      const int64_t o = (t * j.nb + b) * TN + 8 * h;
      const __m256 dv = load8(ds + o);
      __m256 mv = _mm256_setzero_ps();
      if constexpr (!CENTRED) mv = load8(ms + o);
      for (int r = 0; r < M; r++) {
        const int8_t* qa = j.qa + (r0 + r) * j.K + b * BL;
        // levels to 31: 4 groups per int16 sum
        __m256i dot = _mm256_add_epi32(dot_groups<4>(wv, qa, ones), dot_groups<4>(wv + 4, qa + 16, ones));
        const int64_t rb = (r0 + r) * j.nb + b;
        const __m256 dsc = _mm256_mul_ps(dv, _mm256_set1_ps(j.s[rb]));
        if constexpr (CENTRED) {
          dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(j.isum[rb] * (1 << (BITS - 1))));
          acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dsc));
        } else {
          __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dsc);
          acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(mv, _mm256_set1_ps(j.ssum[rb]), t1));
        }
      }
    }
    const int w = std::min(8, width - 8 * h);
    for (int r = 0; r < M; r++) {
      float* dst = j.y + (r0 + r) * j.N + t * TN + 8 * h;
      if (w == 8) {
        _mm256_storeu_ps(dst, acc[r]);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, acc[r]);
        store_cols(dst, tmp, w);
      }
    }
  }
}

// Three to eight rows of 4- or 8-bit levels, block by block with both halves, the rows in one
// chunk whose int16 sums stay in registers (8 bits: two per row, so up to 5 rows; 4 bits: one, up
// to 8) while each group's levels are unpacked once for the chunk; more rows than a chunk holds are
// two calls over the tile (its bytes then come from L1/L2). tile_halves kept the unpacked levels
// in an array and reloaded them for every row (two loads per vpmaddubsw): against it, Gemma-3's
// 8-bit lm-head (262144 x 640, one thread, AVX2 Zen 3) 3 / 4 / 5 / 8 rows 17.2 / 21.3 / 26.0 /
// 39.4 ms -> 12.0 / 15.0 / 17.8 / 29.9; 4-bit blocks 3-8 rows 5-13% less. 5-bit levels keep
// tile_halves (their fifth-bit merge needs registers a chunk would spill: 10-30% slower).
constexpr int chunk_rows(int bits) { return bits == 8 ? 5 : 8; }

template <int C, int BITS>
inline void chunk_dots(const uint8_t* p, const int8_t* const* qa, __m256i* dot) {
  static_assert(BITS == 4 || BITS == 8, "5-bit levels run tile_halves");
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  // (the loop forms are what measured fastest: GCC unrolling the group loop whole hoists every
  // activation load of the chunk and spills them; 8 bits summing into zeros measured 10% slower)
  if constexpr (BITS == 8) {  // group g: both nibbles of k = 4g+e, dot = dot(low) + 16 * dot(high)
    __m256i s16[C], s16h[C];  // set at g = 0
#pragma GCC unroll 2
    for (int g = 0; g < 8; g++) {
      __m256i lo, hi;
      nibbles(p + 64 * g, lo4, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < C; r++) {
        const __m256i av = _mm256_set1_epi32(load_i32(qa[r] + 4 * g));
        const __m256i l = _mm256_maddubs_epi16(lo, av), h = _mm256_maddubs_epi16(hi, av);
        s16[r] = g == 0 ? l : _mm256_add_epi16(s16[r], l);
        s16h[r] = g == 0 ? h : _mm256_add_epi16(s16h[r], h);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < C; r++)
      dot[r] = _mm256_add_epi32(_mm256_madd_epi16(s16[r], _mm256_set1_epi16(1)),
                                _mm256_madd_epi16(s16h[r], _mm256_set1_epi16(16)));
  } else {  // group g: low nibbles k = 4g+e, high ones k = 16+4g+e
    __m256i s16[C];
    for (int r = 0; r < C; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int g = 0; g < 4; g++) {
      __m256i lo, hi;
      nibbles(p + 64 * g, lo4, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < C; r++) {
        const __m256i al = _mm256_set1_epi32(load_i32(qa[r] + 4 * g));
        const __m256i ah = _mm256_set1_epi32(load_i32(qa[r] + 16 + 4 * g));
        s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, al), _mm256_maddubs_epi16(hi, ah)));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < C; r++) dot[r] = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
  }
}

template <int M, int BITS, bool CENTRED, typename S>
void tile_chunk(const Job& j, int64_t t, int64_t r0) {
  static_assert(M <= chunk_rows(BITS), "one chunk");
  constexpr int64_t TB = tile_bytes(BITS);
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  const int halves = width > 8 ? 2 : 1;  // a half wholly past N is not computed
  const S* ds = static_cast<const S*>(j.d);
  const S* ms = static_cast<const S*>(j.m);
  const bool ahead = r0 == 0 && (t + kPrefetch) * TN < j.N;
  __m256 acc[2][M];
  for (int h = 0; h < 2; h++)
    for (int r = 0; r < M; r++) acc[h][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < j.nb; b++) {
    const uint8_t* blk = j.q + (t * j.nb + b) * TB;
    if (ahead) prefetch<BITS, CENTRED, S>(j, blk + kPrefetch * j.nb * TB, (t + kPrefetch) * j.nb + b);
    const int8_t* qa[M];
    for (int r = 0; r < M; r++) qa[r] = j.qa + (r0 + r) * j.K + b * BL;
    for (int h = 0; h < halves; h++) {
      __m256i dot[M];
      chunk_dots<M, BITS>(blk + 32 * h, qa, dot);  // columns 8h..8h+7
      const int64_t o = (t * j.nb + b) * TN + 8 * h;
      const __m256 dv = load8(ds + o);
      __m256 mv = _mm256_setzero_ps();
      if constexpr (!CENTRED) mv = load8(ms + o);
#pragma GCC unroll 8
      for (int r = 0; r < M; r++) {
        const int64_t rb = (r0 + r) * j.nb + b;
        const __m256 dsc = _mm256_mul_ps(dv, _mm256_set1_ps(j.s[rb]));
        if constexpr (CENTRED) {
          const __m256i dc = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(j.isum[rb] * (1 << (BITS - 1))));
          acc[h][r] = _mm256_add_ps(acc[h][r], _mm256_mul_ps(_mm256_cvtepi32_ps(dc), dsc));
        } else {
          const __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), dsc);
          acc[h][r] = _mm256_add_ps(acc[h][r], _mm256_fmadd_ps(mv, _mm256_set1_ps(j.ssum[rb]), t1));
        }
      }
    }
  }
  for (int r = 0; r < M; r++) {
    alignas(32) float tmp[TN];
    _mm256_store_ps(tmp, acc[0][r]);
    _mm256_store_ps(tmp + 8, acc[1][r]);
    store_cols(j.y + (r0 + r) * j.N + t * TN, tmp, width);
  }
}

// The pass by row count (measured on an AVX2 Zen 3: the single pass wins at one and two rows, the
// chunks from three, tile_halves for 5-bit levels); each row's arithmetic is the same in all three,
// so the choice never changes a bit.
template <int M, int BITS, bool CENTRED, typename S>
void tile(const Job& j, int64_t t, int64_t r0) {
  if constexpr (M <= 2) {
    tile_pass<M, BITS, CENTRED, S>(j, t, r0);
  } else if constexpr (BITS == 5) {
    tile_halves<M, BITS, CENTRED, S>(j, t, r0);
  } else if constexpr (M <= chunk_rows(BITS)) {
    tile_chunk<M, BITS, CENTRED, S>(j, t, r0);
  } else {  // 8 bits, 6-8 rows: 3 + 3, 4 + 3, 4 + 4
    constexpr int C0 = (M + 1) / 2;
    tile_chunk<C0, BITS, CENTRED, S>(j, t, r0);
    tile_chunk<M - C0, BITS, CENTRED, S>(j, t, r0 + C0);
  }
}

#else
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return half_to_float(*p); }

template <int M, int BITS, bool CENTRED, typename S>
void tile(const Job& j, int64_t t, int64_t r0) {
  constexpr int64_t TB = tile_bytes(BITS);
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  const S* ds = static_cast<const S*>(j.d);
  const S* ms = static_cast<const S*>(j.m);
  float acc[M][TN];
  for (int r = 0; r < M; r++)
    for (int n = 0; n < TN; n++) acc[r][n] = 0.f;
  for (int64_t b = 0; b < j.nb; b++) {
    const uint8_t* p = j.q + (t * j.nb + b) * TB;
    const int64_t o = (t * j.nb + b) * TN;
    for (int r = 0; r < M; r++) {
      const int8_t* qa = j.qa + (r0 + r) * j.K + b * BL;
      const int64_t rb = (r0 + r) * j.nb + b;
      const float s = j.s[rb];
      for (int n = 0; n < TN; n++) {
        int32_t dot = 0;
        if constexpr (BITS == 4 || BITS == 5) {
          for (int g = 0; g < 4; g++)
            for (int e = 0; e < 4; e++) {
              const int byte = p[64 * g + 4 * n + e];
              int lo = byte & 15, hi = byte >> 4;
              if constexpr (BITS == 5) {  // the plane's bit j: the fifth bit of k = 4j+e
                const int plane = p[kPlane + 4 * n + e];
                lo |= ((plane >> g) & 1) << 4;
                hi |= ((plane >> (g + 4)) & 1) << 4;
              }
              dot += lo * qa[4 * g + e] + hi * qa[16 + 4 * g + e];
            }
        } else {
          for (int g = 0; g < 8; g++)
            for (int e = 0; e < 4; e++) dot += (int)p[64 * g + 4 * n + e] * qa[4 * g + e];
        }
        const float dsc = load1(ds + o + n) * s;
        if constexpr (CENTRED) {
          const int32_t dotc = dot - j.isum[rb] * (1 << (BITS - 1));
          acc[r][n] = acc[r][n] + (float)dotc * dsc;
        } else {
          const float t1 = (float)dot * dsc;
          acc[r][n] = acc[r][n] + std::fma(load1(ms + o + n), j.ssum[rb], t1);
        }
      }
    }
  }
  for (int r = 0; r < M; r++) store_cols(j.y + (r0 + r) * j.N + t * TN, acc[r], width);
}
#endif

// Every row of the tile, in groups of up to 8: each row's arithmetic is its own, so the grouping
// changes the speed only, never a bit.
template <int BITS, bool CENTRED, typename S>
void run_tile(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  for (int64_t r0 = 0; r0 < j.rows; r0 += 8) {
    switch (std::min<int64_t>(8, j.rows - r0)) {
      case 1: tile<1, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      case 2: tile<2, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      case 3: tile<3, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      case 4: tile<4, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      case 5: tile<5, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      case 6: tile<6, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      case 7: tile<7, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
      default: tile<8, BITS, CENTRED, S>(j, (int64_t)t, r0); break;
    }
  }
}

using RunTile = void (*)(void*, size_t);

// The instantiation for a form: bits 4, 5 or 8, centred (no m) or not, float16 scales or float.
RunTile pick(int bits, bool centred, bool half) {
  static const RunTile table[3][2][2] = {
      {{run_tile<4, false, float>, run_tile<4, false, uint16_t>}, {run_tile<4, true, float>, run_tile<4, true, uint16_t>}},
      {{run_tile<5, false, float>, run_tile<5, false, uint16_t>}, {run_tile<5, true, float>, run_tile<5, true, uint16_t>}},
      {{run_tile<8, false, float>, run_tile<8, false, uint16_t>}, {run_tile<8, true, float>, run_tile<8, true, uint16_t>}},
  };
  return table[bits == 4 ? 0 : bits == 5 ? 1 : 2][centred][half];
}

// ------------------------------------------------------------------ the onnxruntime operator
struct Kernel {
  const OrtApi* api;
  int64_t K, N, bits;
};

OrtStatus* invalid(const OrtApi* api, const std::string& what) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(kOp) + ": " + what).c_str());
}

#define Q41_CHECK(expr)             \
  do {                              \
    OrtStatus* st_ = (expr);        \
    if (st_ != nullptr) return st_; \
  } while (0)

OrtStatus* shape_of(const OrtApi* api, const OrtValue* v, std::vector<int64_t>& dims,
                    ONNXTensorElementDataType* type) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Q41_CHECK(api->GetTensorTypeAndShape(v, &info));
  size_t n = 0;
  OrtStatus* st = api->GetTensorElementType(info, type);
  if (st == nullptr) st = api->GetDimensionsCount(info, &n);
  if (st == nullptr) {
    dims.assign(n, 0);
    st = api->GetDimensions(info, dims.data(), n);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

// Input i, its dimensions and element type; a missing input is refused unless `optional` (then
// *v is null: onnxruntime gives null for an omitted optional input, an empty name or none at all).
OrtStatus* input(const OrtApi* api, OrtKernelContext* ctx, size_t i, const OrtValue** v, std::vector<int64_t>& dims,
                 ONNXTensorElementDataType* type, bool optional = false) {
  Q41_CHECK(api->KernelContext_GetInput(ctx, i, v));
  if (*v == nullptr) return optional ? nullptr : invalid(api, "input " + std::to_string(i) + " is missing");
  return shape_of(api, *v, dims, type);
}

int64_t count(const std::vector<int64_t>& dims) {
  int64_t c = 1;
  for (int64_t x : dims) c *= x;
  return c;
}

std::string type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "double";
    default: return "element type " + std::to_string((int)t);
  }
}

template <typename T>
OrtStatus* data(const OrtApi* api, const OrtValue* v, T** out) {  // GetTensorData is API 23: not used
  void* p = nullptr;
  Q41_CHECK(api->GetTensorMutableData(const_cast<OrtValue*>(v), &p));
  *out = static_cast<T*>(p);
  return nullptr;
}

OrtStatus* compute(const Kernel& k, OrtKernelContext* ctx) {
  const OrtApi* api = k.api;
  const OrtValue *a = nullptr, *qv = nullptr, *dv = nullptr, *mv = nullptr;
  std::vector<int64_t> ad, qd, dd, md;
  ONNXTensorElementDataType at{}, qt{}, dt{}, mt{};
  Q41_CHECK(input(api, ctx, 0, &a, ad, &at));
  Q41_CHECK(input(api, ctx, 1, &qv, qd, &qt));
  Q41_CHECK(input(api, ctx, 2, &dv, dd, &dt));
  Q41_CHECK(input(api, ctx, 3, &mv, md, &mt, /*optional=*/true));
  const bool centred = mv == nullptr;
  const int64_t nb = k.K / BL, tiles = (k.N + TN - 1) / TN, tb = tile_bytes((int)k.bits);
  if (ad.empty() || ad.back() != k.K)
    return invalid(api, "A's last dimension must be K = " + std::to_string(k.K));
  if (count(qd) != tiles * nb * tb)
    return invalid(api, "packed must hold tiles*nb*" + std::to_string(tb) + " = " + std::to_string(tiles * nb * tb) +
                            " bytes (bits = " + std::to_string(k.bits) + ")");
  if (dt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && dt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)
    return invalid(api, "d must be float or float16, got " + type_name(dt));
  if (!centred && mt != dt)
    return invalid(api, "d and m must have the same element type (float or float16), got d " + type_name(dt) +
                            " and m " + type_name(mt));
  if (count(dd) != tiles * nb * TN || (!centred && count(md) != tiles * nb * TN))
    return invalid(api, std::string(centred ? "d" : "d and m") + " must hold tiles*nb*16 = " +
                            std::to_string(tiles * nb * TN) + " values");
  const int64_t rows = count(ad) / k.K;
  std::vector<int64_t> od = ad;
  od.back() = k.N;
  OrtValue* out = nullptr;
  Q41_CHECK(api->KernelContext_GetOutput(ctx, 0, od.data(), od.size(), &out));
  if (rows == 0) return nullptr;
  const float* x = nullptr;
  const uint8_t* q = nullptr;
  const void *d = nullptr, *m = nullptr;
  float* y = nullptr;
  Q41_CHECK(data(api, a, &x));
  Q41_CHECK(data(api, qv, &q));
  Q41_CHECK(data(api, dv, &d));
  if (!centred) Q41_CHECK(data(api, mv, &m));
  Q41_CHECK(data(api, out, &y));
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> s, ssum;
  thread_local std::vector<int32_t> isum;
  qa.resize((size_t)(rows * k.K));
  s.resize((size_t)(rows * nb));
  ssum.resize((size_t)(rows * nb));
  isum.resize((size_t)(rows * nb));
  quantize_rows(x, rows, k.K, qa.data(), s.data(), ssum.data(), isum.data());
  Job j{q, d, m, qa.data(), s.data(), ssum.data(), isum.data(), y, k.K, k.N, nb, rows};
  RunTile run = pick((int)k.bits, centred, dt == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
  return api->KernelContext_ParallelFor(ctx, run, (size_t)tiles, kBatches, &j);
}

// Whether attribute `name` exists as a float, a string or ints (reading it as one int failed).
bool other_attribute(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  float f = 0.f;
  size_t size = 0;
  OrtStatus* sts[3] = {api->KernelInfoGetAttribute_float(info, name, &f),
                       api->KernelInfoGetAttribute_string(info, name, nullptr, &size),
                       api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size)};
  bool found = false;
  for (OrtStatus* st : sts) {
    if (st == nullptr) found = true;
    else api->ReleaseStatus(st);
  }
  return found;
}

struct Q41Op : OrtCustomOp {
  Q41Op() {
    static_cast<OrtCustomOp&>(*this) = OrtCustomOp{};  // every member null, the newer ones too
    version = kMinApi;                                  // negotiate() stamps the version it found
    GetName = [](const OrtCustomOp*) { return kOp; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
    // d and m: any type here (each input its own constraint), float or float16 checked at Compute
    GetInputType = [](const OrtCustomOp*, size_t i) {
      return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
                    : i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // m: omitted is the centred form
    };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 1; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      int64_t K = 0, N = 0, bits = 4;
      Q41_CHECK(api->KernelInfoGetAttribute_int64(info, "K", &K));
      Q41_CHECK(api->KernelInfoGetAttribute_int64(info, "N", &N));
      if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "bits", &bits)) {  // absent: 4
        api->ReleaseStatus(st);
        if (other_attribute(api, info, "bits")) return invalid(api, "attribute bits must be an int, 4, 5 or 8");
        bits = 4;
      }
      if (K <= 0 || K % BL != 0) return invalid(api, "attribute K must be a positive multiple of 32");
      if (N <= 0) return invalid(api, "attribute N must be positive");
      if (bits != 4 && bits != 5 && bits != 8)
        return invalid(api, "attribute bits must be 4, 5 or 8, got " + std::to_string(bits));
      *kernel = new (std::nothrow) Kernel{api, K, N, bits};
      return *kernel ? nullptr : api->CreateStatus(ORT_FAIL, "Q41MatMul: out of memory");
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) -> OrtStatus* {
      const Kernel& k = *static_cast<const Kernel*>(kernel);
      try {
        return compute(k, ctx);
      } catch (const std::bad_alloc&) {
        return k.api->CreateStatus(ORT_FAIL, "Q41MatMul: out of memory");
      }
    };
    KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  }
};

Q41Op q41_op;

struct Negotiated {
  const OrtApi* api;
  uint32_t version;
};

// The highest API version both these headers and the running onnxruntime have, down to kMinApi;
// the running library's version string names its own (1.x has API version x) so that no request
// above it is made (onnxruntime prints a complaint for each).
Negotiated negotiate(const OrtApiBase* base) {
  uint32_t start = ORT_API_VERSION;
  int major = 0, minor = 0;
  const char* vs = base->GetVersionString ? base->GetVersionString() : nullptr;
  if (vs != nullptr && std::sscanf(vs, "%d.%d", &major, &minor) == 2 && major == 1 && minor > 0)
    start = std::min<uint32_t>(start, (uint32_t)minor);
  for (uint32_t v = start; v >= kMinApi; v--)
    if (const OrtApi* api = base->GetApi(v)) {
      q41_op.version = v;  // every op's version, stamped once (negotiate runs once per process)
      dejavuu_attention_op(v);
      dejavuu_swiglu_op(v);
      dejavuu_geglu_op(v);
      return {api, v};
    }
  return {nullptr, 0};
}

void gemm(const float* A, int64_t rows, const uint8_t* packed, const void* d, const void* m, int64_t K, int64_t N,
          int bits, bool half, float* Y) {
  const int64_t nb = K / BL, tiles = (N + TN - 1) / TN;
  std::vector<int8_t> qa((size_t)(rows * K));
  std::vector<float> s((size_t)(rows * nb)), ssum((size_t)(rows * nb));
  std::vector<int32_t> isum((size_t)(rows * nb));
  quantize_rows(A, rows, K, qa.data(), s.data(), ssum.data(), isum.data());
  Job j{packed, d, m, qa.data(), s.data(), ssum.data(), isum.data(), Y, K, N, nb, rows};
  RunTile run = pick(bits, m == nullptr, half);
  for (int64_t t = 0; t < tiles; t++) run(&j, (size_t)t);
}

}  // namespace

Q41_EXPORT const char* dejavuu_q41_isa() { return kIsa; }

// The kernel without onnxruntime, single-threaded, for tests and timing (q41.py calls it through
// ctypes). The caller checks the shapes: K a multiple of 32, packed/d/m as pack() writes them.
// The original form: 4-bit levels, float d and m.
Q41_EXPORT void dejavuu_q41_gemm(const float* A, int64_t rows, const uint8_t* packed, const float* d, const float* m,
                                 int64_t K, int64_t N, float* Y) {
  if (rows <= 0 || K <= 0 || K % BL != 0 || N <= 0 || m == nullptr) return;
  gemm(A, rows, packed, d, m, K, N, 4, false, Y);
}

// Every form: bits 4, 5 or 8; m null is the centred form; half != 0: d and m are float16 (uint16
// bits), else float. Returns 0, or -1 (nothing computed) for bits not 4/5/8 or K not a positive
// multiple of 32.
Q41_EXPORT int dejavuu_q41_gemm2(const float* A, int64_t rows, const uint8_t* packed, const void* d, const void* m,
                                 int64_t K, int64_t N, int64_t bits, int32_t half, float* Y) {
  if ((bits != 4 && bits != 5 && bits != 8) || K <= 0 || K % BL != 0) return -1;
  if (rows > 0 && N > 0) gemm(A, rows, packed, d, m, K, N, (int)bits, half != 0, Y);
  return 0;
}

constexpr const char* kAttnDomain = "dejavuu.attn";

Q41_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  static const Negotiated n = negotiate(base);  // once per process (thread-safe initialisation)
  if (n.api == nullptr) {
    const OrtApi* api1 = base->GetApi(1);
    std::string msg = std::string(kDomain) + "." + kOp + " needs onnxruntime >= 1." + std::to_string(kMinApi) +
                      " (its C API version " + std::to_string(kMinApi) + "); this is onnxruntime " +
                      (base->GetVersionString ? base->GetVersionString() : "?");
    return api1 != nullptr ? api1->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  const OrtApi* api = n.api;
  const std::pair<const char*, std::vector<OrtCustomOp*>> domains[2] = {
      {kDomain, {&q41_op, dejavuu_swiglu_op(0), dejavuu_geglu_op(0)}}, {kAttnDomain, {dejavuu_attention_op(0)}}};
  for (const auto& [name, ops] : domains) {
    OrtCustomOpDomain* domain = nullptr;
    Q41_CHECK(api->CreateCustomOpDomain(name, &domain));
    OrtStatus* st = nullptr;
    for (OrtCustomOp* op : ops)
      if (st == nullptr) st = api->CustomOpDomain_Add(domain, op);
    if (st == nullptr) st = api->AddCustomOpDomain(options, domain);
    if (st != nullptr) {
      api->ReleaseCustomOpDomain(domain);
      return st;
    }
    // else kept: onnxruntime does not own the domain, which must outlive every session made from
    // these options (a few bytes per registration)
  }
  return nullptr;
}
