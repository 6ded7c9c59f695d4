// dejavuu.attn.GroupAttention: one decoder layer's attention over an in-place KV buffer, as an
// onnxruntime custom operator (compiled into the same library as Q41MatMul: q41.py builds both).
//
// Why our own: onnxruntime's GroupQueryAttention gives a lone query row other bits than the same
// row among several (its one-row kernel), so the static graph runs it on two rows at least (a
// floor), and on a 2-core AMD EPYC (AVX2, Zen 3) it took 28% of a one-token step's kernel time at
// a past of 256 and 58% at 1024 (docs/speed.md, twenty-fourth session). This operator computes
// every query row alone, in one fixed order of float operations that depends on nothing but the
// row's own keys: a row gives the same bits alone as among any number of rows, at any total
// length (keys it does not see contribute exact zeros), so speculative verification stays
// lossless without a floor.
//
// Inputs (one request):
//   0 qkv      float [1, S, (H + 2*KV) * D]  packed q | k | v of S slots (query heads first)
//   1 past_key float [1, KV, CAP, D]          the layer's key buffer (bound as present_key too)
//   2 past_val float [1, KV, CAP, D]          its value buffer (bound as present_value)
//   3 cos      float [P_max, D/2]             rotary tables (non-interleaved halves)
//   4 sin      float [P_max, D/2]
//   5 position_ids int64 [1, S]
//   6 bias     float [1, 1, S, T]             additive; T = P + S, P the past length
//   7 slot_rows int64 [S], 8 row_slots int64 [R] (optional, together): slot s reads qkv row
//     slot_rows[s] and qkv holds R rows, output row r being slot row_slots[r]'s query
// A batch of B requests (the serving graph, export.passes.serve_batch) adds
//   9 seqlens_k int32 [B] (P_b + w_b - 1), 10 query_seqlens int32 [B] (w_b, the slots request b
//     writes; 0: idle, nothing written) and takes past_key/past_val [B, KV, CAP, D], position_ids
//     [B, S], bias [B, 1, S, T] (T >= every P_b + w_b), slot_rows [B, S] (rows of qkv) and
//     row_slots [R] (flat b*S + s, qkv's rows grouped by request in order): each request's rows
//     get exactly the bits they get alone.
//   11 q_norm float [D], 12 k_norm float [D] (optional, together): a per-head RMS norm of every q
//     and k head before its rotary (Gemma 3's q_norm / k_norm), scale as given (the model's own
//     weight, 1 + w for Gemma), epsilon the attribute norm_epsilon
// Outputs: 0 out float [1, R, H*D]; 1 present_key, 2 present_value as the pasts.
// Attributes: num_heads H, kv_num_heads KV (H % KV == 0), scale (float), window (int, optional:
//   a sliding window's layer, a row at position q seeing no key at position k with q - k >= window;
//   the bias as given where absent or 0), norm_epsilon (float, with q_norm / k_norm; absent: 1e-6).
//
// The contract (the scalar and AVX2 paths give the same bits: tests/kernels/test_attn.py):
//   norm (q_norm / k_norm given): ss = sum of x[i]*x[i] in order i = 0..D-1; r = 1 / sqrt(ss / D +
//     eps); x[i] = (x[i] * r) * w[i];
//   rotary: for i < D/2, with c = cos[pos][i], s = sin[pos][i]: y[i] = x[i]*c - x[i+D/2]*s,
//     y[i+D/2] = x[i+D/2]*c + x[i]*s (each product rounded, then the sum); k rotated and v as
//     given are written at row P + slot of the buffers before any row attends;
//   a row sees keys lo..n-1, n - 1 the last key whose bias is above -1e30 and lo its first such
//     key rounded down to a multiple of 8 (outside them nothing: their weights would be exact
//     zeros; a sliding window's row reads its window only);
//   score_j = dot(q, k_j) * scale + bias_j, dot over 8 lanes: lane l accumulates
//     q[8c+l]*k[8c+l] for c = 0.. in order (first a product, then fused multiply-adds), then
//     ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7));
//   m = max_j score_j; e_j = exp(score_j - m) by one polynomial (expf below, 0 below -87);
//   sum = the same lane reduction of 8 lane sums, lane l adding e_j for j = l mod 8 in order;
//   out[d] = (fma over j in order of e_j * v_j[d], skipping e_j == 0) / sum.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "onnxruntime_c_api.h"

#if defined(__AVX2__) && defined(__FMA__)
#define ATTN_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr const char* kOp = "GroupAttention";
constexpr float kUnseen = -1e30f;  // a bias at or below it: a key the row does not see
constexpr float kExpZero = -87.0f;  // exp below it is 0 (keeps 2^n normal)
constexpr float kExpTop = 88.0f;    // exp above it is exp(88) (finite: 2^n at most 2^127)

// Cephes' expf polynomial, every path the same operations: n = floor(x*log2e + 0.5),
// r = (x - n*C1) - n*C2, p(r) by Horner with fused multiply-adds, (p*r*r + r) + 1, times 2^n.
constexpr float kLog2e = 1.44269504088896341f, kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline float exp1(float x) {
  if (!(x >= kExpZero)) return 0.f;
  x = std::min(x, kExpTop);
  const float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kC1;
  r = r - n * kC2;
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float r2 = r * r;
  p = std::fma(p, r2, r);
  p = p + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

inline float hsum8(const float* a) {  // ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
  const float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
  return (b0 + b2) + (b1 + b3);
}

#if defined(ATTN_AVX2)
inline float hsum8(__m256 v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // b0..b3
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                   // b0+b2, b1+b3
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

inline __m256 exp8(__m256 x) {
  const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(kExpZero), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpZero)), _mm256_set1_ps(kExpTop));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kC1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kC2)));
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), zero_below);
}
#endif

constexpr int64_t kSplitSlices = 2;  // see split_scores

struct Job {
  const float* q;        // [R][H][D] rotated queries, one per output row
  const int64_t* qslot;  // [R] the slot (bias row) of each output row
  const float* kbuf;     // [KV][CAP][D]
  const float* vbuf;
  const float* bias;  // [S][T]
  float* out;         // [R][H*D]
  int64_t S, H, KV, D, CAP, T;
  float scale;
  int64_t R;
  std::atomic<bool>* failed;  // a work item ran out of memory
  int64_t hb, rb;     // heads and rows per work item (a block of one kv group's queries)
  int64_t hblocks, rblocks;
  int phase = 0;       // run_jobs: 0 whole blocks (attend); 1 and 2 a split request's passes (AVX2)
  float* sc = nullptr;  // a split request's scores [H*R][stride] and slice maxima [H*R][kSlices] (split_scores)
  float* mx = nullptr;
  int64_t stride = 0;
};

// The keys output row r sees: 0..n-1, n - 1 its last key whose bias (its slot's row) is above
// kUnseen (0: none).
inline int64_t visible(const Job& j, int64_t r) {
  const float* bias = j.bias + j.qslot[r] * j.T;
  int64_t n = j.T;
  while (n > 0 && !(bias[n - 1] > kUnseen)) n--;
  return n;
}

// Where output row r's keys begin: its first key whose bias is above kUnseen, rounded down to a
// multiple of 8 (0 where it sees none of its first n). The whole groups of 8 before it hold only
// keys the row does not see: their weights are exact zeros, their lanes' sums start at +0 either
// way and a key keeps its lane (j mod 8), so skipping them changes no bit (a sliding window's
// layer then reads its window, not the whole context).
inline int64_t first_seen(const Job& j, int64_t r, int64_t n) {
  const float* bias = j.bias + j.qslot[r] * j.T;
  int64_t k = 0;
  while (k < n && !(bias[k] > kUnseen)) k++;
  return k < n ? k / 8 * 8 : 0;
}

struct Scratch {
  std::vector<float> sc, acc;
  std::vector<int64_t> n, lo;
  std::vector<float> m;
};

// A block of queries: heads h0..h0+nh-1 (one kv group's) of rows r0.., query i being row
// r0 + i / nh's head h0 + i % nh.
struct Block {
  int64_t h0, r0, nh, nq;
  const float* query(const Job& j, int64_t i) const { return j.q + ((r0 + i / nh) * j.H + h0 + i % nh) * j.D; }
  const float* bias(const Job& j, int64_t i) const { return j.bias + j.qslot[r0 + i / nh] * j.T; }
  float* out(const Job& j, int64_t i) const { return j.out + (r0 + i / nh) * j.H * j.D + (h0 + i % nh) * j.D; }
};

// Each query's keys lo..n-1 into w.n and w.lo (its row's); returns {the largest n, the smallest lo}.
inline std::pair<int64_t, int64_t> block_keys(const Job& j, const Block& b, Scratch& w) {
  w.n.assign((size_t)b.nq, 0);
  w.lo.assign((size_t)b.nq, 0);
  int64_t nmax = 0, lomin = j.T;
  for (int64_t r = b.r0; r < b.r0 + b.nq / b.nh; r++) {
    const int64_t n = visible(j, r), lo = first_seen(j, r, n);
    for (int64_t h = 0; h < b.nh; h++) {
      w.n[(size_t)((r - b.r0) * b.nh + h)] = n;
      w.lo[(size_t)((r - b.r0) * b.nh + h)] = lo;
    }
    nmax = std::max(nmax, n);
    lomin = std::min(lomin, lo);
  }
  return {nmax, lomin};
}

#if defined(ATTN_AVX2)
// The block's scores over keys k_from..k_to-1 (whole groups of 8 from a multiple of 8 off lo):
// 8 keys at a time (8 independent chains), their lane sums reduced together in hsum8's order;
// query i's into sc + i * stride (-inf past its n inside its last group), its running maximum in
// m[i].
template <int DC>
void score_keys(const Job& j, const Block& b, const Scratch& w, const float* kb, int64_t k_from, int64_t k_to,
                float* sc0, int64_t stride, float* m) {
  constexpr int D = 8 * DC;
  alignas(32) float tail[8 * D];
  const __m256 scale = _mm256_set1_ps(j.scale);
  for (int64_t k0 = k_from; k0 < k_to; k0 += 8) {
    const float* kr = kb + k0 * D;
    if (k0 + 8 > j.CAP) {  // the buffer ends inside this group: its last rows from a zeroed copy
      std::fill(tail, tail + 8 * D, 0.f);
      std::memcpy(tail, kr, sizeof(float) * (size_t)((j.CAP - k0) * D));
      kr = tail;
    }
    for (int64_t i = 0; i < b.nq; i++) {
      const int64_t n = w.n[(size_t)i];
      if (k0 >= n || k0 < w.lo[(size_t)i]) continue;
      const float* q = b.query(j, i);
      __m256 a[8];
      const __m256 q0 = _mm256_loadu_ps(q);
      for (int r = 0; r < 8; r++) a[r] = _mm256_mul_ps(q0, _mm256_loadu_ps(kr + r * D));
      for (int c = 1; c < DC; c++) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kr + r * D + 8 * c), a[r]);
      }
      __m256 bb[4];
      for (int r = 0; r < 4; r++)  // [b_r | b_{r+4}], b_k[i] = a_k[i] + a_k[i+4], as [b0 b2 b1 b3]
        bb[r] = _mm256_permute_ps(_mm256_add_ps(_mm256_permute2f128_ps(a[r], a[r + 4], 0x20),
                                                _mm256_permute2f128_ps(a[r], a[r + 4], 0x31)),
                                  0xD8);
      const __m256 dots = _mm256_hadd_ps(_mm256_hadd_ps(bb[0], bb[1]), _mm256_hadd_ps(bb[2], bb[3]));
      alignas(32) float x[8];
      _mm256_store_ps(x, _mm256_mul_ps(dots, scale));
      const float* bias = b.bias(j, i);
      float* sc = sc0 + i * stride;
      float mi = m[i];
      for (int r = 0; r < 8; r++) {
        const int64_t k = k0 + r;
        if (k < n) {
          const float v = x[r] + bias[k];
          sc[k] = v;
          mi = std::max(mi, v);
        } else {
          sc[k] = -INFINITY;
        }
      }
      m[i] = mi;
    }
  }
}

// A query's weights exp(sc - m) over keys lo..n8-1 into e (may be sc itself); returns their sum,
// lane l adding the keys l mod 8 in order, reduced in hsum8's order.
inline float weights(const float* sc, float* e, float m, int64_t lo, int64_t n8) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t k = lo; k < n8; k += 8) {
    const __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + k), mv));
    _mm256_storeu_ps(e + k, ev);
    sum8 = _mm256_add_ps(sum8, ev);
  }
  return hsum8(sum8);
}

// Output chunks c_from..c_from+CN-1 (8 dimensions each) of the block's queries: each the sum over
// its keys in order of e_k * v_k (a zero weight skipped), in acc + i * 8 * CN (zeroed by the
// caller), then divided by the query's sum into its output (zeros where it sees no key). V tiles
// of 32 keys (8 KB at D = 64) stay in L1 across the block's queries; up to 64 outputs at a time
// keep their sums in registers (all D of them spilled at D = 128 and 256: a load and a store per
// fused multiply-add).
template <int DC, int CN>
void value_sums(const Job& j, const Block& b, const Scratch& w, const float* vb, int64_t lomin, int64_t nmax,
                const float* e0, int64_t stride, const float* sums, float* acc0, int c_from) {
  constexpr int D = 8 * DC, CB = CN < 8 ? CN : 8;
  static_assert(CN % CB == 0, "whole blocks of outputs");
  constexpr int64_t VT = 32;
  for (int64_t k0 = lomin / VT * VT; k0 < nmax; k0 += VT) {
    for (int64_t i = 0; i < b.nq; i++) {
      const int64_t kbeg = std::max(k0, w.lo[(size_t)i]), kend = std::min(k0 + VT, w.n[(size_t)i]);
      if (kbeg >= kend) continue;
      const float* e = e0 + i * stride;
      float* ap = acc0 + i * 8 * CN;
      for (int c0 = 0; c0 < CN; c0 += CB) {
        __m256 acc[CB];
        for (int c = 0; c < CB; c++) acc[c] = _mm256_loadu_ps(ap + 8 * (c0 + c));
        for (int64_t k = kbeg; k < kend; k++) {
          if (e[k] == 0.f) continue;
          const __m256 ev = _mm256_set1_ps(e[k]);
          const float* vr = vb + k * D + 8 * (c_from + c0);
          for (int c = 0; c < CB; c++) acc[c] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
        for (int c = 0; c < CB; c++) _mm256_storeu_ps(ap + 8 * (c0 + c), acc[c]);
      }
    }
  }
  for (int64_t i = 0; i < b.nq; i++) {
    float* out = b.out(j, i) + 8 * c_from;
    const __m256 sv = _mm256_set1_ps(sums[i]);
    for (int c = 0; c < CN; c++)
      _mm256_storeu_ps(out + 8 * c, w.n[(size_t)i] == 0 ? _mm256_setzero_ps()
                                                        : _mm256_div_ps(_mm256_loadu_ps(acc0 + i * 8 * CN + 8 * c), sv));
  }
}
#endif

// A block of queries -- heads h0..h1-1 (one kv group's) of rows r0..r1-1 -- in the contract's
// order for each query; the block shares each 8 keys' K rows and each 32 keys' V rows among its
// queries (read once from memory), which changes no query's arithmetic: a row's bits are the
// same in any block, alone or not.
template <int DC>
void attend(const Job& j, int64_t g, int64_t h0, int64_t h1, int64_t r0, int64_t r1, Scratch& w) {
  constexpr int D = 8 * DC;
  const Block b{h0, r0, h1 - h0, (h1 - h0) * (r1 - r0)};
  const int64_t nq = b.nq;
  const float* kb = j.kbuf + g * j.CAP * D;
  const float* vb = j.vbuf + g * j.CAP * D;
  const auto [nmax, lomin] = block_keys(j, b, w);
  w.m.assign((size_t)nq, -INFINITY);
  const int64_t stride = (nmax + 7) / 8 * 8;  // a query's scores, then its weights
  w.sc.resize((size_t)(nq * stride));
  w.acc.assign((size_t)(nq * D), 0.f);
#if defined(ATTN_AVX2)
  score_keys<DC>(j, b, w, kb, lomin, nmax, w.sc.data(), stride, w.m.data());
  std::vector<float> sums((size_t)nq);
  for (int64_t i = 0; i < nq; i++) {
    float* sc = w.sc.data() + i * stride;
    sums[(size_t)i] = weights(sc, sc, w.m[(size_t)i], w.lo[(size_t)i], (w.n[(size_t)i] + 7) / 8 * 8);
  }
  value_sums<DC, DC>(j, b, w, vb, lomin, nmax, w.sc.data(), stride, sums.data(), w.acc.data(), 0);
#else
  for (int64_t i = 0; i < nq; i++) {
    const float* q = b.query(j, i);
    const float* bias = b.bias(j, i);
    float* out = b.out(j, i);
    const int64_t n = w.n[(size_t)i], n8 = (n + 7) / 8 * 8, lo = w.lo[(size_t)i];
    if (n == 0) {  // a row that sees nothing (a pad slot's): zeros
      std::fill(out, out + D, 0.f);
      continue;
    }
    float* sc = w.sc.data() + i * stride;
    float m = -INFINITY;
    for (int64_t k = lo; k < n; k++) {
      const float* kr = kb + k * D;
      float lanes[8];
      for (int l = 0; l < 8; l++) lanes[l] = q[l] * kr[l];
      for (int c = 1; c < DC; c++)
        for (int l = 0; l < 8; l++) lanes[l] = std::fma(q[8 * c + l], kr[8 * c + l], lanes[l]);
      const float x = hsum8(lanes) * j.scale + bias[k];
      sc[k] = x;
      m = std::max(m, x);
    }
    for (int64_t k = n; k < n8; k++) sc[k] = -INFINITY;
    float sum8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k = lo; k < n8; k += 8)
      for (int l = 0; l < 8; l++) {
        const float e = exp1(sc[k + l] - m);
        sc[k + l] = e;
        sum8[l] = sum8[l] + e;
      }
    const float sum = hsum8(sum8);
    float acc[D];
    for (int d = 0; d < D; d++) acc[d] = 0.f;
    for (int64_t k = lo; k < n; k++) {
      const float e = sc[k];
      if (e == 0.f) continue;
      const float* vr = vb + k * D;
      for (int d = 0; d < D; d++) acc[d] = std::fma(e, vr[d], acc[d]);
    }
    for (int d = 0; d < D; d++) out[d] = acc[d] / sum;
  }
#endif
}

#if defined(ATTN_AVX2)
// ------------------------------------------------------------------ a split request (two passes)
// One request of one to four rows (one row block), AVX2, in two passes: each kv group's queries
// score a slice of its keys (work item: group x key slice), then each computes its weights over
// all keys and a slice of its output dimensions (group x dimension slice). A query's arithmetic is
// attend's, op for op (a key's score is its own; the maximum is the same in any order; the
// weights, their lane sums and each output's sum over the keys run as attend runs them), so its
// bits are too (tests/kernels: every path, a row alone and among others). Why: attend's blocks
// hold all of a group's keys and values, so a lone row had one block per group -- Gemma-3 (one kv
// group of four heads) a head per block, each block reading the whole past again (its one-row
// step spent ~130 us a layer there, 2 threads, where one thread ran all four heads in 85 us
// outside the decoder), SmolLM2 (three groups) three blocks on two threads. Here every group's
// keys and values are read once, by both threads. Measured in the decoders (AVX2 Zen 3, 2
// threads, old and new alternating in one process): Gemma-3 steps of 1 / 2 / 4 rows -10 / -6 /
// -11%, SmolLM2 1 / 4 rows -2.5 / -6%; at 8 rows (two row blocks) the split measured no better
// (SmolLM2 +6%), so it stops at one row block.
constexpr int64_t kSlices = kSplitSlices;  // key and dimension slices per group: one per thread of a 2-core CPU

struct Shared {  // the passes' common state: [kv group][query][stride] scores, [..][query][slice] maxima
  float* sc;
  float* mx;
  int64_t stride;
};

// Group g's queries (all its heads, every row) as one block.
inline Block group_block(const Job& j, int64_t g) {
  const int64_t nh = j.H / j.KV;
  return {g * nh, 0, nh, nh * j.R};
}

// The scores of group g's queries over key slice s (whole groups of 8 keys), as attend computes
// them, and each query's maximum over the slice.
template <int DC>
void split_scores(const Job& j, const Shared& sh, int64_t g, int64_t s, Scratch& w) {
  constexpr int D = 8 * DC;
  const Block b = group_block(j, g);
  const auto [nmax, lomin] = block_keys(j, b, w);
  const int64_t groups = (nmax - lomin + 7) / 8;
  const int64_t k_from = lomin + 8 * (groups * s / kSlices);
  const int64_t k_to = std::min(nmax, lomin + 8 * (groups * (s + 1) / kSlices));
  w.m.assign((size_t)b.nq, -INFINITY);
  score_keys<DC>(j, b, w, j.kbuf + g * j.CAP * D, k_from, k_to, sh.sc + g * b.nq * sh.stride, sh.stride, w.m.data());
  for (int64_t i = 0; i < b.nq; i++) sh.mx[(g * b.nq + i) * kSlices + s] = w.m[(size_t)i];
}

// Group g's queries' weights (attend's: the maximum over the slices' maxima, the exponentials and
// their lane sums over all keys) and output dimensions of slice s, each a sum over the keys in
// attend's order.
template <int DC>
void split_values(const Job& j, const Shared& sh, int64_t g, int64_t s, Scratch& w) {
  constexpr int D = 8 * DC, CS = DC / kSlices;  // a slice's chunks of 8 dimensions
  static_assert(DC % kSlices == 0, "whole chunks per slice");
  const Block b = group_block(j, g);
  const auto [nmax, lomin] = block_keys(j, b, w);
  w.sc.resize((size_t)(b.nq * sh.stride));  // this item's weights (the scores stay for the other slices)
  w.acc.assign((size_t)(b.nq * 8 * CS), 0.f);
  std::vector<float> sums((size_t)b.nq);
  for (int64_t i = 0; i < b.nq; i++) {
    float m = -INFINITY;
    for (int64_t t = 0; t < kSlices; t++) m = std::max(m, sh.mx[(g * b.nq + i) * kSlices + t]);
    sums[(size_t)i] = weights(sh.sc + (g * b.nq + i) * sh.stride, w.sc.data() + i * sh.stride, m, w.lo[(size_t)i],
                              (w.n[(size_t)i] + 7) / 8 * 8);
  }
  value_sums<DC, CS>(j, b, w, j.vbuf + g * j.CAP * D, lomin, nmax, w.sc.data(), sh.stride, sums.data(), w.acc.data(),
                     (int)(CS * s));
}
#endif

// Work item -> (kv group, head block, row block).
template <int DC>
void run_item(void* data, size_t item) {
  thread_local Scratch w;
  const Job& j = *static_cast<const Job*>(data);
  try {
#if defined(ATTN_AVX2)
  if (j.phase != 0) {  // a split request's pass: item -> (kv group, slice)
    const Shared sh{j.sc, j.mx, j.stride};
    const int64_t g = (int64_t)item / kSlices, s = (int64_t)item % kSlices;
    if (j.phase == 1) split_scores<DC>(j, sh, g, s, w);
    else split_values<DC>(j, sh, g, s, w);
    return;
  }
#endif
  const int64_t per_group = j.hblocks * j.rblocks, G = j.H / j.KV;
  const int64_t g = (int64_t)item / per_group, rest = (int64_t)item % per_group;
  const int64_t hb = rest / j.rblocks, rbk = rest % j.rblocks;
  const int64_t h0 = g * G + hb * j.hb, r0 = rbk * j.rb;
  attend<DC>(j, g, h0, std::min(h0 + j.hb, (g + 1) * G), r0, std::min(r0 + j.rb, j.R), w);
  } catch (const std::bad_alloc&) {  // on a pool thread: said after ParallelFor, never thrown through it
    j.failed->store(true);
  }
}

// How the queries are blocked where run_jobs does not split the request (a batch, more than one
// row block, or no AVX2): rows in blocks of up to 4 and a kv group's heads together, so that a
// block reads its keys and values once (on a 2-core AMD EPYC, AVX2, a lone row at a past of 1024:
// 67 us a layer against 89-95 with a head per block); one head per block where a single block
// would leave every thread but one idle (one kv group and one row block).
void plan(Job& j) {
  const int64_t G = j.H / j.KV;
  j.rb = std::max<int64_t>(1, std::min<int64_t>(4, j.R));
  j.rblocks = (j.R + j.rb - 1) / j.rb;
  j.hb = j.KV * j.rblocks >= 2 ? G : 1;
  j.hblocks = (G + j.hb - 1) / j.hb;
}

inline size_t items(const Job& j) { return (size_t)(j.phase == 0 ? j.KV * j.hblocks * j.rblocks : j.KV * kSplitSlices); }

using RunItem = void (*)(void*, size_t);

constexpr int64_t kMaxHead = 256;  // the largest head size pick() runs

RunItem pick(int64_t D) {
  switch (D) {
    case 64: return run_item<8>;
    case 128: return run_item<16>;
    case 256: return run_item<32>;
    default: return nullptr;
  }
}

// y = x rotated at `pos` (non-interleaved halves), the contract's order.
void rotate(const float* x, const float* cs, const float* sn, int64_t D, float* y) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i++) {
    const float x1 = x[i], x2 = x[i + half], c = cs[i], s = sn[i];
    const float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
    y[i] = a - b;
    y[i + half] = e + f;
  }
}

// A head's RMS norm (q_norm / k_norm), the contract's order: y = (x * r) * w.
void rms_norm(const float* x, const float* w, float eps, int64_t D, float* y) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; i++) ss = ss + x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / (float)D + eps);
  for (int64_t i = 0; i < D; i++) y[i] = (x[i] * r) * w[i];
}

// The per-head norms before the rotary (null: none) and their epsilon.
struct Norms {
  const float* q;
  const float* k;
  float eps;
};

// x's head at `head` rotated at `cs`/`sn` into y, normed first with `w` where given.
inline void head_in(const float* x, const float* w, float eps, const float* cs, const float* sn, int64_t D,
                    float* tmp, float* y) {
  if (w != nullptr) {
    rms_norm(x, w, eps, D, tmp);
    x = tmp;
  }
  rotate(x, cs, sn, D, y);
}

// ------------------------------------------------------------------ the onnxruntime operator
struct Kernel {
  const OrtApi* api;
  int64_t H, KV;
  float scale;
  int64_t window;  // 0: none
  float norm_eps;
};

// The bias a sliding window's layer attends under: ``bias`` with kFill wherever a slot's query at
// position q would see a key at position k with q - k >= window (a key at buffer index k < P sits
// at position k; the slots' own keys at their position_ids), what Gemma 3's exported graph writes
// with a Where over its whole bias; here per layer, only where the window bites (the context's
// prefix), so the graph's bias is the caller's and every layer reads it as given.
constexpr float kFill = -3.40282347e38f;  // the graph's fill: torch.finfo(float32).min

const float* windowed(const float* bias, int64_t B, int64_t S, int64_t T, const int64_t* P, const int64_t* w,
                      const int64_t* pos, int64_t window, std::vector<float>& buf) {
  buf.assign(bias, bias + B * S * T);
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < w[b]; s++) {
      const int64_t q = pos[b * S + s];
      float* row = buf.data() + (b * S + s) * T;
      for (int64_t k = 0; k < std::min(P[b], q - window + 1); k++) row[k] = kFill;
      for (int64_t t = 0; t < w[b]; t++)
        if (q - pos[b * S + t] >= window) row[P[b] + t] = kFill;
    }
  return buf.data();
}

OrtStatus* invalid(const OrtApi* api, const std::string& what) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(kOp) + ": " + what).c_str());
}

#define ATTN_CHECK(expr)            \
  do {                              \
    OrtStatus* st_ = (expr);        \
    if (st_ != nullptr) return st_; \
  } while (0)

OrtStatus* dims_of(const OrtApi* api, const OrtValue* v, std::vector<int64_t>& dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ATTN_CHECK(api->GetTensorTypeAndShape(v, &info));
  size_t n = 0;
  OrtStatus* st = api->GetDimensionsCount(info, &n);
  if (st == nullptr) {
    dims.assign(n, 0);
    st = api->GetDimensions(info, dims.data(), n);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

template <typename T>
OrtStatus* input(const OrtApi* api, OrtKernelContext* ctx, size_t i, std::vector<int64_t>& dims, T** p) {
  const OrtValue* v = nullptr;
  ATTN_CHECK(api->KernelContext_GetInput(ctx, i, &v));
  if (v == nullptr) return invalid(api, "input " + std::to_string(i) + " is missing");
  ATTN_CHECK(dims_of(api, v, dims));
  void* raw = nullptr;
  ATTN_CHECK(api->GetTensorMutableData(const_cast<OrtValue*>(v), &raw));
  *p = static_cast<T*>(raw);
  return nullptr;
}

// Rotary and the KV write of every written slot (request b's slots s < w[b], slot s reading qkv
// row slot_rows[b*S + s] -- null: row s -- written at P[b] + s of its buffers), then every output
// row's rotated queries (row r is flat slot row_slots[r] -- null: r --, b*S + s); the rows of each
// request (contiguous: checked by the caller) become one Job over its own buffers and bias block.
// qrot and qslot are the Jobs' storage.
void prepare(const float* x, int64_t R, int64_t S, int64_t B, const int64_t* slot_rows, const int64_t* row_slots,
             const int64_t* P, const int64_t* w, float* kb, float* vb, int64_t CAP, int64_t T, const float* cs,
             const float* sn, const int64_t* pos, const float* bias, int64_t H, int64_t KV, int64_t D, float scale,
             const Norms& nm, float* out, std::vector<float>& qrot, std::vector<int64_t>& qslot,
             std::vector<Job>& jobs) {
  const int64_t W = (H + 2 * KV) * D, half = D / 2;
  float tmp[kMaxHead];  // a normed head (D <= kMaxHead: pick() ran first), no allocation per call
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < w[b]; s++) {
      const int64_t f = b * S + s;
      const float* row = x + (slot_rows ? slot_rows[f] : s) * W;
      const float* c = cs + pos[f] * half;
      const float* sv = sn + pos[f] * half;
      for (int64_t g = 0; g < KV; g++) {
        const int64_t at = ((b * KV + g) * CAP + P[b] + s) * D;
        head_in(row + (H + g) * D, nm.k, nm.eps, c, sv, D, tmp, kb + at);
        std::memcpy(vb + at, row + (H + KV + g) * D, sizeof(float) * (size_t)D);
      }
    }
  qrot.resize((size_t)(R * H * D));
  qslot.resize((size_t)R);
  jobs.clear();
  int64_t request = -1;  // the request of the last Job
  for (int64_t r = 0; r < R; r++) {
    const int64_t f = row_slots ? row_slots[r] : r, b = f / S;
    qslot[(size_t)r] = f % S;
    const float* row = x + (slot_rows ? slot_rows[f] : f) * W;
    for (int64_t h = 0; h < H; h++)
      head_in(row + h * D, nm.q, nm.eps, cs + pos[f] * half, sn + pos[f] * half, D, tmp,
              qrot.data() + (r * H + h) * D);
    if (b != request) {  // request b's first row
      request = b;
      const int64_t kv0 = b * KV * CAP * D;
      jobs.push_back(Job{qrot.data() + r * H * D, qslot.data() + r, kb + kv0, vb + kv0, bias + b * S * T,
                         out + r * H * D, S, H, KV, D, CAP, T, scale, 0, nullptr, 0, 0, 0, 0});
    }
    jobs.back().R++;
  }
  for (Job& j : jobs) plan(j);
}

// Every request's work items in one ParallelFor: item -> (its request's Job, that Job's item).
struct Batch {
  std::vector<Job>* jobs;
  std::vector<size_t> first;  // the first item of each Job, then the total
  RunItem run;
};

void run_batch(void* data, size_t item) {
  const Batch& bt = *static_cast<const Batch*>(data);
  const size_t k = (size_t)(std::upper_bound(bt.first.begin(), bt.first.end(), item) - bt.first.begin()) - 1;
  bt.run(&(*bt.jobs)[k], item - bt.first[k]);
}

// Runs every Job through ``parallel_for(run_batch, items, data)``: onnxruntime's pool, or a loop on
// this thread (the ctypes entry). Returns false when a work item ran out of memory.
template <typename ParallelFor>
bool run_jobs(std::vector<Job>& jobs, RunItem run, ParallelFor&& parallel_for) {
  std::atomic<bool> failed{false};
  auto pass = [&]() {
    Batch bt{&jobs, {}, run};
    size_t total = 0;
    for (Job& j : jobs) {
      j.failed = &failed;
      bt.first.push_back(total);
      total += items(j);
    }
    bt.first.push_back(total);
    parallel_for(run_batch, total, &bt);
  };
#if defined(ATTN_AVX2)
  // one request of one to four rows (one row block): two passes, keys then dimensions split
  if (jobs.size() == 1 && jobs[0].rblocks == 1) {
    Job& j = jobs[0];
    thread_local std::vector<float> sc, mx;
    j.stride = (j.T + 7) / 8 * 8;
    sc.resize((size_t)(j.H * j.R * j.stride));
    mx.resize((size_t)(j.H * j.R * kSplitSlices));
    j.sc = sc.data();
    j.mx = mx.data();
    j.phase = 1;
    pass();
    if (!failed.load()) {
      j.phase = 2;
      pass();
    }
    j.phase = 0;
    return !failed.load();
  }
#endif
  pass();
  return !failed.load();
}

OrtStatus* compute(const Kernel& k, OrtKernelContext* ctx) {
  const OrtApi* api = k.api;
  std::vector<int64_t> xd, kd, vd, cd, sd, pd, bd, srd, rsd, skd, qsd;
  const float *x = nullptr, *pk = nullptr, *pv = nullptr, *cs = nullptr, *sn = nullptr, *bias = nullptr;
  const int64_t *pos = nullptr, *slot_rows = nullptr, *row_slots = nullptr;
  const int32_t *seqlens = nullptr, *qlens = nullptr;
  const float *qn = nullptr, *kn = nullptr;
  std::vector<int64_t> qnd, knd;
  ATTN_CHECK(input(api, ctx, 0, xd, &x));
  ATTN_CHECK(input(api, ctx, 1, kd, &pk));
  ATTN_CHECK(input(api, ctx, 2, vd, &pv));
  ATTN_CHECK(input(api, ctx, 3, cd, &cs));
  ATTN_CHECK(input(api, ctx, 4, sd, &sn));
  ATTN_CHECK(input(api, ctx, 5, pd, &pos));
  ATTN_CHECK(input(api, ctx, 6, bd, &bias));
  size_t n_in = 0;
  ATTN_CHECK(api->KernelContext_GetInputCount(ctx, &n_in));
  const OrtValue* probe[13] = {};
  for (size_t i = 7; i < 13 && i < n_in; i++) ATTN_CHECK(api->KernelContext_GetInput(ctx, i, &probe[i]));
  if ((probe[11] == nullptr) != (probe[12] == nullptr)) return invalid(api, "q_norm and k_norm come together");
  if (probe[11] != nullptr) {
    ATTN_CHECK(input(api, ctx, 11, qnd, &qn));
    ATTN_CHECK(input(api, ctx, 12, knd, &kn));
  }
  if ((probe[7] == nullptr) != (probe[8] == nullptr)) return invalid(api, "slot_rows and row_slots come together");
  if ((probe[9] == nullptr) != (probe[10] == nullptr)) return invalid(api, "seqlens_k and query_seqlens come together");
  const bool slots = probe[7] != nullptr, batched = probe[9] != nullptr;
  if (batched && !slots) return invalid(api, "a batch (seqlens_k, query_seqlens) needs slot_rows and row_slots");
  if (slots) {
    ATTN_CHECK(input(api, ctx, 7, srd, &slot_rows));
    ATTN_CHECK(input(api, ctx, 8, rsd, &row_slots));
  }
  if (batched) {
    ATTN_CHECK(input(api, ctx, 9, skd, &seqlens));
    ATTN_CHECK(input(api, ctx, 10, qsd, &qlens));
  }
  const int64_t H = k.H, KV = k.KV;
  if (xd.size() != 3 || xd[0] != 1 || xd[2] % (H + 2 * KV) != 0)
    return invalid(api, "qkv must be [1, rows, (num_heads + 2*kv_num_heads) * head_size]");
  const int64_t rows = xd[1], D = xd[2] / (H + 2 * KV);
  RunItem run = pick(D);
  if (run == nullptr) return invalid(api, "head size must be 64, 128 or 256, got " + std::to_string(D));
  if (qn != nullptr && (qnd.size() != 1 || qnd[0] != D || knd != qnd))
    return invalid(api, "q_norm and k_norm must both be [head_size]");
  if (kd.size() != 4 || kd[0] < 1 || (!batched && kd[0] != 1) || kd[1] != KV || kd[3] != D || kd != vd)
    return invalid(api, std::string("past key and value must both be [") + (batched ? "batch" : "1") +
                            ", kv_num_heads, capacity, head_size]");
  const int64_t B = kd[0], CAP = kd[2];
  if (bd.size() != 4 || bd[0] != B || bd[1] != 1) return invalid(api, "bias must be [batch, 1, slots, width]");
  const int64_t S = bd[2], R = rows, T = bd[3];
  if (T > CAP)
    return invalid(api, "the bias's width (past + slots) " + std::to_string(T) + " must fit the buffer's " +
                            std::to_string(CAP));
  if ((int64_t)pd.size() != 2 || pd[0] != B || pd[1] != S) return invalid(api, "position_ids must be [batch, slots]");
  std::vector<int64_t> P((size_t)B), w((size_t)B);
  if (batched) {
    if (skd.size() != 1 || skd[0] != B || qsd != skd) return invalid(api, "seqlens_k and query_seqlens must be [batch]");
    for (int64_t b = 0; b < B; b++) {
      w[b] = qlens[b];
      P[b] = w[b] > 0 ? (int64_t)seqlens[b] + 1 - w[b] : 0;
      if (w[b] < 0 || w[b] > S || P[b] < 0 || P[b] + w[b] > T)
        return invalid(api, "request " + std::to_string(b) + ": query_seqlens must be 0..slots and seqlens_k + 1 - "
                            "query_seqlens a past whose slots fit the bias's width");
    }
  } else {
    P[0] = T - S;
    w[0] = S;
    if (P[0] < 0) return invalid(api, "bias must be [1, 1, S, past + S]");
  }
  if (slots) {
    if (srd.size() != (batched ? 2u : 1u) || srd[0] != (batched ? B : S) || (batched && srd[1] != S))
      return invalid(api, batched ? "slot_rows must be [batch, slots]" : "slot_rows must be [slots] (the bias's rows)");
    if (rsd.size() != 1 || rsd[0] != R) return invalid(api, "row_slots must be [rows] (qkv's rows)");
    for (int64_t b = 0; b < B; b++)
      for (int64_t s = 0; s < w[b]; s++)
        if (slot_rows[b * S + s] < 0 || slot_rows[b * S + s] >= R) return invalid(api, "slot_rows holds a row outside qkv");
    int64_t last = 0;
    for (int64_t r = 0; r < R; r++) {
      const int64_t f = row_slots[r], b = f / S;
      if (f < 0 || f >= B * S || f % S >= w[b]) return invalid(api, "row_slots holds a slot outside the written ones");
      if (b < last) return invalid(api, "qkv's rows must be grouped by request, in request order");
      last = b;
    }
  } else if (S != R) {
    return invalid(api, "bias must be [1, 1, S, past + S] for qkv's S rows");
  }
  if (cd.size() != 2 || cd != sd || cd[1] != D / 2)
    return invalid(api, "cos and sin must both be [positions, head_size / 2]");
  for (int64_t b = 0; b < B; b++)
    for (int64_t s = 0; s < w[b]; s++)
      if (pos[b * S + s] < 0 || pos[b * S + s] >= cd[0])
        return invalid(api, "position " + std::to_string(pos[b * S + s]) + " is outside the rotary tables");
  const int64_t od[3] = {1, R, H * D};
  OrtValue *ov = nullptr, *okv = nullptr, *ovv = nullptr;
  ATTN_CHECK(api->KernelContext_GetOutput(ctx, 0, od, 3, &ov));
  ATTN_CHECK(api->KernelContext_GetOutput(ctx, 1, kd.data(), kd.size(), &okv));
  ATTN_CHECK(api->KernelContext_GetOutput(ctx, 2, vd.data(), vd.size(), &ovv));
  void *out = nullptr, *kraw = nullptr, *vraw = nullptr;
  ATTN_CHECK(api->GetTensorMutableData(ov, &out));
  ATTN_CHECK(api->GetTensorMutableData(okv, &kraw));
  ATTN_CHECK(api->GetTensorMutableData(ovv, &vraw));
  float* kb = static_cast<float*>(kraw);
  float* vb = static_cast<float*>(vraw);
  // a present not bound to its past (no I/O binding): the whole buffer carried over, so no row of
  // the output is left undefined
  if (kb != pk) std::memcpy(kb, pk, sizeof(float) * (size_t)(B * KV * CAP * D));
  if (vb != pv) std::memcpy(vb, pv, sizeof(float) * (size_t)(B * KV * CAP * D));
  if (S == 0) return nullptr;
  thread_local std::vector<float> qrot, wbias;
  thread_local std::vector<int64_t> qslot;
  thread_local std::vector<Job> jobs;
  if (k.window > 0) bias = windowed(bias, B, S, T, P.data(), w.data(), pos, k.window, wbias);
  prepare(x, R, S, B, slot_rows, row_slots, P.data(), w.data(), kb, vb, CAP, T, cs, sn, pos, bias, H, KV, D, k.scale,
          Norms{qn, kn, k.norm_eps}, static_cast<float*>(out), qrot, qslot, jobs);
  OrtStatus* st = nullptr;
  const bool ok = run_jobs(jobs, run, [&](RunItem f, size_t n, void* data) {
    if (n > 0) st = api->KernelContext_ParallelFor(ctx, f, n, 0, data);
  });
  if (st != nullptr) return st;
  return ok ? nullptr : api->CreateStatus(ORT_FAIL, "GroupAttention: out of memory");
}

struct AttnOp : OrtCustomOp {
  AttnOp() {
    static_cast<OrtCustomOp&>(*this) = OrtCustomOp{};
    version = 17;
    GetName = [](const OrtCustomOp*) { return kOp; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 13; };
    GetInputType = [](const OrtCustomOp*, size_t i) {
      return i >= 11      ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT   // q_norm, k_norm
             : i >= 9     ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32   // seqlens_k, query_seqlens
             : i == 5 || i >= 7 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64
                                : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 3; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i >= 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;  // slots, a batch's lengths, norms
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
      int64_t H = 0, KV = 0;
      float scale = 0.f;
      ATTN_CHECK(api->KernelInfoGetAttribute_int64(info, "num_heads", &H));
      ATTN_CHECK(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &KV));
      ATTN_CHECK(api->KernelInfoGetAttribute_float(info, "scale", &scale));
      if (H <= 0 || KV <= 0 || H % KV != 0)
        return invalid(api, "num_heads must be a positive multiple of kv_num_heads");
      if (!(scale > 0.f)) return invalid(api, "scale must be positive");
      int64_t window = 0;  // optional: absent, no window
      if (OrtStatus* st = api->KernelInfoGetAttribute_int64(info, "window", &window)) {
        api->ReleaseStatus(st);
        window = 0;
      }
      if (window < 0) return invalid(api, "window must be positive (or 0: none)");
      float eps = 1e-6f;  // optional: with q_norm / k_norm
      if (OrtStatus* st = api->KernelInfoGetAttribute_float(info, "norm_epsilon", &eps)) {
        api->ReleaseStatus(st);
        eps = 1e-6f;
      }
      if (!(eps >= 0.f)) return invalid(api, "norm_epsilon must be >= 0");
      *kernel = new (std::nothrow) Kernel{api, H, KV, scale, window, eps};
      return *kernel ? nullptr : api->CreateStatus(ORT_FAIL, "GroupAttention: out of memory");
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) -> OrtStatus* {
      const Kernel& k = *static_cast<const Kernel*>(kernel);
      try {
        return compute(k, ctx);
      } catch (const std::bad_alloc&) {
        return k.api->CreateStatus(ORT_FAIL, "GroupAttention: out of memory");
      }
    };
    KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  }
};

AttnOp attn_op;

// ------------------------------------------------------------------ SwiGLU
// y = silu(g) * u for x = [g | u] along the last axis (each half F wide): silu(g) = g / (1 + e),
// e = exp(-g) by the polynomial above; each element on its own, so a row's bits never depend on
// the others. It replaces the MLP's Split, Sigmoid, Mul, Mul (four nodes a layer: one).
constexpr const char* kSwiGLU = "SwiGLU";

void swiglu(const float* x, int64_t rows, int64_t F, float* y) {
  for (int64_t r = 0; r < rows; r++) {
    const float* g = x + r * 2 * F;
    const float* u = g + F;
    float* o = y + r * F;
    int64_t i = 0;
#if defined(ATTN_AVX2)
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= F; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp8(_mm256_sub_ps(zero, gv));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < F; i++) {
      const float e = exp1(0.f - g[i]);
      o[i] = (g[i] / (1.f + e)) * u[i];
    }
  }
}

// ------------------------------------------------------------------ GeGLU
// y = gelu_tanh(g) * u for x = [g | u]: gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))),
// c = sqrt(2/pi), tanh(z) = 1 - 2 / (exp(2z) + 1) with the exp above (saturating to +-1 at its
// bounds); each element on its own, every path the same operations in the same order. It replaces
// Gemma's MLP Split, Gelu(approximate="tanh") and Mul (three nodes a layer: one).
constexpr const char* kGeGLU = "GeGLU";
constexpr float kGeluC = 0.7978845608028654f, kGeluK = 0.044715f;

void geglu(const float* x, int64_t rows, int64_t F, float* y) {
  for (int64_t r = 0; r < rows; r++) {
    const float* g = x + r * 2 * F;
    const float* u = g + F;
    float* o = y + r * F;
    int64_t i = 0;
#if defined(ATTN_AVX2)
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
    const __m256 c = _mm256_set1_ps(kGeluC), kk = _mm256_set1_ps(kGeluK);
    for (; i + 8 <= F; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 inner = _mm256_add_ps(gv, _mm256_mul_ps(_mm256_mul_ps(kk, _mm256_mul_ps(gv, gv)), gv));
      const __m256 z = _mm256_mul_ps(c, inner);
      const __m256 e = exp8(_mm256_add_ps(z, z));
      const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
      const __m256 act = _mm256_mul_ps(_mm256_mul_ps(half, gv), _mm256_add_ps(one, t));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < F; i++) {
      const float gi = g[i];
      const float z = kGeluC * (gi + (kGeluK * (gi * gi)) * gi);
      const float e = exp1(z + z);
      const float t = 1.f - 2.f / (e + 1.f);
      o[i] = ((0.5f * gi) * (1.f + t)) * u[i];
    }
  }
}

// The gated activations' operator: x [..., 2F] = [gate | up] -> act(gate) * up [..., F].
using GatedFn = void (*)(const float*, int64_t, int64_t, float*);

struct GatedKernel {
  const OrtApi* api;
  GatedFn fn;
  const char* name;
};

OrtStatus* gated_compute(const GatedKernel& k, OrtKernelContext* ctx) {
  const OrtApi* api = k.api;
  std::vector<int64_t> xd;
  const float* x = nullptr;
  ATTN_CHECK(input(api, ctx, 0, xd, &x));
  if (xd.empty() || xd.back() % 2 != 0)
    return api->CreateStatus(ORT_INVALID_ARGUMENT,
                             (std::string(k.name) + ": the last dimension must be even ([gate | up])").c_str());
  const int64_t F = xd.back() / 2;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < xd.size(); i++) rows *= xd[i];
  std::vector<int64_t> od = xd;
  od.back() = F;
  OrtValue* ov = nullptr;
  ATTN_CHECK(api->KernelContext_GetOutput(ctx, 0, od.data(), od.size(), &ov));
  void* out = nullptr;
  ATTN_CHECK(api->GetTensorMutableData(ov, &out));
  k.fn(x, rows, F, static_cast<float*>(out));
  return nullptr;
}

template <GatedFn FN, const char* const* NAME>
struct GatedOp : OrtCustomOp {
  GatedOp() {
    static_cast<OrtCustomOp&>(*this) = OrtCustomOp{};
    version = 17;
    GetName = [](const OrtCustomOp*) { return *NAME; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 1; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo*, void** kernel) -> OrtStatus* {
      *kernel = new (std::nothrow) GatedKernel{api, FN, *NAME};
      return *kernel ? nullptr : api->CreateStatus(ORT_FAIL, (std::string(*NAME) + ": out of memory").c_str());
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) -> OrtStatus* {
      const GatedKernel& k = *static_cast<const GatedKernel*>(kernel);
      try {
        return gated_compute(k, ctx);
      } catch (const std::bad_alloc&) {
        return k.api->CreateStatus(ORT_FAIL, (std::string(k.name) + ": out of memory").c_str());
      }
    };
    KernelDestroy = [](void* kernel) { delete static_cast<GatedKernel*>(kernel); };
  }
};

const char* const kSwiGLUName = kSwiGLU;
const char* const kGeGLUName = kGeGLU;
GatedOp<swiglu, &kSwiGLUName> swiglu_op;
GatedOp<geglu, &kGeGLUName> geglu_op;

// An operator stamped with the API version q41.cpp negotiated (0: as last stamped).
OrtCustomOp* stamped(OrtCustomOp& op, uint32_t version) {
  if (version != 0) op.version = version;
  return &op;
}

}  // namespace

// q41.cpp registers this in the Q4_1 operators' domain (the int4op graphs' MLP activation).
OrtCustomOp* dejavuu_swiglu_op(uint32_t version) { return stamped(swiglu_op, version); }

extern "C" __attribute__((visibility("default"))) void dejavuu_swiglu(const float* x, int64_t rows, int64_t F,
                                                                      float* y) {
  swiglu(x, rows, F, y);
}

// q41.cpp registers this beside SwiGLU (Gemma's MLP activation).
OrtCustomOp* dejavuu_geglu_op(uint32_t version) { return stamped(geglu_op, version); }

extern "C" __attribute__((visibility("default"))) void dejavuu_geglu(const float* x, int64_t rows, int64_t F,
                                                                     float* y) {
  geglu(x, rows, F, y);
}

// q41.cpp's RegisterCustomOps adds this operator in its own domain, at the negotiated version.
OrtCustomOp* dejavuu_attention_op(uint32_t version) { return stamped(attn_op, version); }

// The operator without onnxruntime, one thread, for tests (attn.py calls it through ctypes): the
// same arguments as the graph's inputs (kbuf/vbuf updated in place, out [R][H*D]; slot_rows and
// row_slots null: rows are slots; q_norm and k_norm null: no per-head norm); returns 0, -1 for a head size other than 64/128/256, -2 for
// heads that are not a positive multiple of kv heads or past + S outside the buffer, -3 out of memory.
extern "C" __attribute__((visibility("default"))) int dejavuu_attention(
    const float* qkv, int64_t R, int64_t S, const int64_t* slot_rows, const int64_t* row_slots, float* kbuf,
    float* vbuf, int64_t CAP, const float* cos, const float* sin, const int64_t* pos, const float* bias, int64_t T,
    int64_t H, int64_t KV, int64_t D, float scale, int64_t window, const float* q_norm, const float* k_norm,
    float norm_eps, float* out) {
  RunItem run = pick(D);
  if (run == nullptr) return -1;
  if (H <= 0 || KV <= 0 || H % KV != 0 || T < S || T > CAP || window < 0) return -2;
  std::vector<float> qrot, wbias;
  std::vector<int64_t> qslot;
  std::vector<Job> jobs;
  const int64_t P = T - S, w = S;
  if (window > 0) bias = windowed(bias, 1, S, T, &P, &w, pos, window, wbias);
  prepare(qkv, R, S, 1, slot_rows, row_slots, &P, &w, kbuf, vbuf, CAP, T, cos, sin, pos, bias, H, KV, D, scale,
          Norms{q_norm, k_norm, norm_eps}, out, qrot, qslot, jobs);
  const bool ok = run_jobs(jobs, run, [](RunItem f, size_t n, void* data) {
    for (size_t i = 0; i < n; i++) f(data, i);
  });
  return ok ? 0 : -3;
}
