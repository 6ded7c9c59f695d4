// Spike (docs/speed.md, twenty-second session): an exact Q4_1 x int8-activation GEMM for 1..8 rows
// on AVX-512 VNNI, to size what the kernel onnxruntime 1.32 lacks (a float per-block minimum, i.e.
// the GGUF's Q4_1 carried as is) would buy. Measurement code, not part of the package.
//
// y[r, n] = sum_b s[r,b] * (d[b,n] * dot(qa[r,b,:], q[b,:,n]) + m[b,n] * sum(qa[r,b,:])): the
// activations rounded to int8 per row and block of 32 (as MatMulNBits' accuracy level 4 does),
// the weights' 4-bit levels, scale d and minimum m as the file holds them. 16 columns per tile,
// vpdpbusd over 4 levels per lane; every row runs the same instructions whatever the row count,
// so a row's bits are the same alone as among 8 (checked below).
//
// Build and run: g++ -O3 -march=native -fopenmp -o q41 q41_gemm.cpp && OMP_NUM_THREADS=2 ./q41 30
// The counterpart through onnxruntime's MatMulNBits on the same shapes: python mlas_body.py 30
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <algorithm>
#include <chrono>
#include <random>

constexpr int BL = 32;   // block length along K
constexpr int TN = 16;   // columns per tile (zmm lanes)

struct Q41 {
  int K, N, nb, tiles;
  // per tile, per block: 256 bytes of nibbles (4 loads of 64B; load j holds groups j (low) and j+4 (high))
  std::vector<uint8_t> q;
  std::vector<float> d, m;  // [tiles][nb][16]
  std::vector<uint8_t> qref; std::vector<float> dref, mref;  // [N][K], [N][nb]
};

static Q41 make(int K, int N, std::mt19937& rng) {
  Q41 w; w.K = K; w.N = N; w.nb = K / BL; w.tiles = N / TN;
  std::uniform_int_distribution<int> qd(0, 15);
  std::uniform_real_distribution<float> fd(0.005f, 0.02f), md(-0.2f, -0.05f);
  w.qref.resize((size_t)N * K); w.dref.resize((size_t)N * w.nb); w.mref.resize((size_t)N * w.nb);
  for (auto& x : w.qref) x = (uint8_t)qd(rng);
  for (auto& x : w.dref) x = fd(rng);
  for (auto& x : w.mref) x = md(rng);
  w.q.resize((size_t)w.tiles * w.nb * 256); w.d.resize((size_t)w.tiles * w.nb * TN); w.m.resize(w.d.size());
  for (int t = 0; t < w.tiles; t++)
    for (int b = 0; b < w.nb; b++) {
      uint8_t* dst = &w.q[((size_t)t * w.nb + b) * 256];
      for (int j = 0; j < 4; j++)          // load j: groups j and j+4
        for (int lane = 0; lane < TN; lane++)
          for (int e = 0; e < 4; e++) {
            int n = t * TN + lane;
            uint8_t lo = w.qref[(size_t)n * K + b * BL + 4 * j + e];
            uint8_t hi = w.qref[(size_t)n * K + b * BL + 4 * (j + 4) + e];
            dst[j * 64 + lane * 4 + e] = (uint8_t)(lo | (hi << 4));
          }
      for (int lane = 0; lane < TN; lane++) {
        int n = t * TN + lane;
        w.d[((size_t)t * w.nb + b) * TN + lane] = w.dref[(size_t)n * w.nb + b];
        w.m[((size_t)t * w.nb + b) * TN + lane] = w.mref[(size_t)n * w.nb + b];
      }
    }
  return w;
}

// activations: per row, per block: int8 values, scale, and (scale * sum of int8) as MLAS's BlkSum uses
struct QA { std::vector<int8_t> q; std::vector<float> s, sum; int K, nb; };

static void quantize(const float* x, int M, int K, QA& a) {
  a.K = K; a.nb = K / BL; a.q.resize((size_t)M * K); a.s.resize((size_t)M * a.nb); a.sum.resize(a.s.size());
  for (int r = 0; r < M; r++)
    for (int b = 0; b < a.nb; b++) {
      const float* v = x + (size_t)r * K + b * BL;
      float amax = 0; for (int i = 0; i < BL; i++) amax = std::max(amax, std::fabs(v[i]));
      float s = amax / 127.f, inv = s ? 1.f / s : 0.f; int tot = 0;
      for (int i = 0; i < BL; i++) { int qv = (int)std::nearbyint(v[i] * inv); a.q[(size_t)r * K + b * BL + i] = (int8_t)qv; tot += qv; }
      a.s[(size_t)r * a.nb + b] = s; a.sum[(size_t)r * a.nb + b] = s * (float)tot;
    }
}

template <int M>
static void tile(const Q41& w, const QA& a, int t, float* y, int ldy) {
  __m512 acc[M];
  for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < w.nb; b++) {
    const uint8_t* p = &w.q[((size_t)t * w.nb + b) * 256];
    __m512i wv[8];
    for (int j = 0; j < 4; j++) {
      __m512i raw = _mm512_loadu_si512(p + 64 * j);
      wv[j] = _mm512_and_si512(raw, lo4);
      wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
    }
    __m512 dv = _mm512_loadu_ps(&w.d[((size_t)t * w.nb + b) * TN]);
    __m512 mv = _mm512_loadu_ps(&w.m[((size_t)t * w.nb + b) * TN]);
    for (int r = 0; r < M; r++) {
      const int32_t* qa = (const int32_t*)&a.q[(size_t)r * a.K + b * BL];
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        d0 = _mm512_dpbusd_epi32(d0, wv[g], _mm512_set1_epi32(qa[g]));
        d1 = _mm512_dpbusd_epi32(d1, wv[g + 1], _mm512_set1_epi32(qa[g + 1]));
      }
      __m512i dot = _mm512_add_epi32(d0, d1);
      const float s = a.s[(size_t)r * a.nb + b], sm = a.sum[(size_t)r * a.nb + b];
      // acc += s * d * dot + m * (s * sum)
      __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(s)));
      acc[r] = _mm512_add_ps(acc[r], _mm512_fmadd_ps(mv, _mm512_set1_ps(sm), t1));
    }
  }
  for (int r = 0; r < M; r++) _mm512_storeu_ps(y + (size_t)r * ldy + t * TN, acc[r]);
}

static void gemm(const Q41& w, const QA& a, int M, float* y) {
#pragma omp parallel for schedule(static)
  for (int t = 0; t < w.tiles; t++) {
    switch (M) {
      case 1: tile<1>(w, a, t, y, w.N); break;
      case 2: tile<2>(w, a, t, y, w.N); break;
      case 3: tile<3>(w, a, t, y, w.N); break;
      case 4: tile<4>(w, a, t, y, w.N); break;
      case 5: tile<5>(w, a, t, y, w.N); break;
      case 6: tile<6>(w, a, t, y, w.N); break;
      case 7: tile<7>(w, a, t, y, w.N); break;
      case 8: tile<8>(w, a, t, y, w.N); break;
    }
  }
}

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  int layers = argc > 1 ? atoi(argv[1]) : 30;
  std::vector<std::pair<int, int>> shapes;
  for (int l = 0; l < layers; l++) { shapes.push_back({576, 960}); shapes.push_back({576, 576}); shapes.push_back({576, 3072}); shapes.push_back({1536, 576}); }
  std::vector<Q41> ws; for (auto [k, n] : shapes) ws.push_back(make(k, n, rng));
  size_t bytes = 0; for (auto& w : ws) bytes += w.q.size() + 4 * (w.d.size() + w.m.size());
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> x576(8 * 576), x1536(8 * 1536);
  for (auto& v : x576) v = nd(rng); for (auto& v : x1536) v = nd(rng);
  // correctness: one projection vs a double reference on the same int8 activations; row invariance
  {
    const Q41& w = ws[2]; QA a; quantize(x576.data(), 8, 576, a);
    std::vector<float> y8(8 * w.N), y1(w.N);
    gemm(w, a, 8, y8.data());
    double maxrel = 0;
    for (int r = 0; r < 8; r++) for (int n = 0; n < w.N; n++) {
      double ref = 0;
      for (int b = 0; b < w.nb; b++) {
        long dot = 0; for (int i = 0; i < BL; i++) dot += (long)a.q[r * 576 + b * BL + i] * w.qref[(size_t)n * 576 + b * BL + i];
        ref += (double)a.s[r * a.nb + b] * w.dref[n * w.nb + b] * dot + (double)w.mref[n * w.nb + b] * a.sum[r * a.nb + b];
      }
      maxrel = std::max(maxrel, std::fabs(ref - y8[r * w.N + n]) / (std::fabs(ref) + 1e-3));
    }
    int same = 0;
    for (int r = 0; r < 8; r++) {
      QA a1; quantize(x576.data() + r * 576, 1, 576, a1); gemm(w, a1, 1, y1.data());
      same += memcmp(y1.data(), &y8[r * w.N], 4 * w.N) == 0;
    }
    printf("check: max rel err vs double %.2e; rows bit-equal alone and among 8: %d/8\n", maxrel, same);
  }
  printf("weights %.1f MB (4-bit + fp32 d, m), threads %d\n", bytes / 1e6, omp_get_max_threads());
  std::vector<float> y(8 * 3072);
  for (int M : {1, 2, 4, 8}) {
    QA a576, a1536;
    std::vector<double> ts;
    for (int rep = 0; rep < 40; rep++) {
      auto t0 = std::chrono::steady_clock::now();
      for (auto& w : ws) {  // each projection quantizes its own input, as MatMulNBits does
        QA& a = w.K == 576 ? a576 : a1536;
        quantize(w.K == 576 ? x576.data() : x1536.data(), M, w.K, a);
        gemm(w, a, M, y.data());
      }
      ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    printf("M=%d: body %.3f ms (median of 40), %.1f GB/s\n", M, ts[20], bytes / ts[20] / 1e6);
  }
}
