// Q41MatMul (domain dejavuu.q41, opset 1): an exact Q4_1 x int8-activation matmul as an onnxruntime
// custom operator, compiled on the user's machine on first use by dejavuu_build/kernels/q41.py
// (which also writes the weights, pack(), and holds the same arithmetic in numpy, reference()).
// Grown from docs/spikes/q41_op.cpp and q41_gemm.cpp.
//
// Inputs   A float [..., K]; packed uint8 [tiles*nb*256]; d float [tiles*nb*16]; m float [tiles*nb*16]
// Attrs    K (a multiple of 32), N (the real output width); tiles = ceil(N/16), nb = K/32
// Output   Y float [..., N]
//
// Weights: column n, block b (32 consecutive k): w[k, n] = d[b,n] * q + m[b,n], q a 4-bit level
// 0..15 (GGUF Q4_1, Q4_K and Q4_0 all have this form per 32). Per tile of 16 columns and block, 256
// bytes: 4 groups of 64 (16 columns x 4 bytes); byte g*64 + lane*4 + e holds the level of k = 4g+e
// in its low nibble and of k = 16+4g+e in its high one. Columns past N are zero levels, d = m = 0.
//
// Arithmetic, the same float operations in the same order on every ISA path (so every path gives
// the same bits) and for every row whatever the row count (a row alone and among 8 gives the same
// bits, which is what keeps speculative verification lossless):
//   per row and block:  sc = amax/127.f; inv = sc ? 1.f/sc : 0.f; qa = round_half_even(v*inv);
//                       ssum = sc * (float)sum(qa)
//   per row and column: acc = 0.f; for b in order: dot = int32 sum_j q*qa;
//                       acc = acc + fmaf(m, ssum, (float)dot * (d*sc))
// Non-finite activations give non-finite outputs whose bits are left unspecified.
//
// ISA paths, chosen at compile time from the predefined macros (the JIT builds with -march=native):
//   avx512vnni  AVX-512 F+BW+VNNI: vpdpbusd over 4 levels per lane, 16 columns per zmm
//   avx2        AVX2+FMA (AVX-512 CPUs without VNNI too): two 8-column halves, vpmaddubsw (levels
//               0..15 unsigned x int8 activations: at most 2*15*127 per pair, and 8 groups summed
//               in int16 stay under 8*3810 = 30480, so no saturation) then vpmaddwd with ones
//   scalar      portable C++ (std::nearbyint under the default rounding mode, std::fma)
// Build flags: -ffp-contract=off and never -ffast-math (the order above is the contract).
//
// onnxruntime: only its C API (onnxruntime_c_api.h), and of that only functions of API version
// <= 17 (KernelContext_ParallelFor, onnxruntime 1.17, is the newest one used). RegisterCustomOps
// asks for the highest API version both the headers and the running library have, down to 17, and
// stamps the operator with it (onnxruntime refuses an OrtCustomOp whose version is above its own).
#include "onnxruntime_c_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q41_AVX512VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define Q41_AVX2 1
#include <immintrin.h>
#endif

#define Q41_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int BL = 32;               // block length along K
constexpr int TN = 16;               // columns per tile
constexpr int64_t kTileBytes = 256;  // packed bytes per tile and block
constexpr size_t kBatches = 0;       // ParallelFor: no cap on the number of batches (as timed)
constexpr uint32_t kMinApi = 17;     // KernelContext_ParallelFor
constexpr const char* kDomain = "dejavuu.q41";
constexpr const char* kOp = "Q41MatMul";

struct Job {
  const uint8_t* q;
  const float* d;
  const float* m;
  const int8_t* qa;   // [rows][K]
  const float* s;     // [rows][nb]
  const float* ssum;  // [rows][nb]
  float* y;           // [rows][N]
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

// ------------------------------------------------------------------ activations, per row and block
#if defined(Q41_AVX512VNNI)
constexpr const char* kIsa = "avx512vnni";

void quantize_block(const float* v, int8_t* qa, float* s, float* ssum) {
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
}

#elif defined(Q41_AVX2)
constexpr const char* kIsa = "avx2";

void quantize_block(const float* v, int8_t* qa, float* s, float* ssum) {
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
}

#else
constexpr const char* kIsa = "scalar";

void quantize_block(const float* v, int8_t* qa, float* s, float* ssum) {
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
}
#endif

void quantize_rows(const float* x, int64_t rows, int64_t K, int8_t* qa, float* s, float* ssum) {
  const int64_t nb = K / BL;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < nb; b++)
      quantize_block(x + r * K + b * BL, qa + r * K + b * BL, s + r * nb + b, ssum + r * nb + b);
}

// ------------------------------------------------------------------ one tile of 16 columns, M rows
#if defined(Q41_AVX512VNNI)
template <int M>
void tile(const Job& j, int64_t t, int64_t r0) {
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  __m512 acc[M];
  for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < j.nb; b++) {
    const uint8_t* p = j.q + (t * j.nb + b) * kTileBytes;
    __m512i wv[8];
    for (int g = 0; g < 4; g++) {
      __m512i raw = _mm512_loadu_si512(p + 64 * g);
      wv[g] = _mm512_and_si512(raw, lo4);
      wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
    }
    __m512 dv = _mm512_loadu_ps(j.d + (t * j.nb + b) * TN);
    __m512 mv = _mm512_loadu_ps(j.m + (t * j.nb + b) * TN);
    for (int r = 0; r < M; r++) {
      const int8_t* qa = j.qa + (r0 + r) * j.K + b * BL;
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        d0 = _mm512_dpbusd_epi32(d0, wv[g], _mm512_set1_epi32(load_i32(qa + 4 * g)));
        d1 = _mm512_dpbusd_epi32(d1, wv[g + 1], _mm512_set1_epi32(load_i32(qa + 4 * g + 4)));
      }
      __m512i dot = _mm512_add_epi32(d0, d1);
      const float s = j.s[(r0 + r) * j.nb + b], sm = j.ssum[(r0 + r) * j.nb + b];
      __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(s)));
      acc[r] = _mm512_add_ps(acc[r], _mm512_fmadd_ps(mv, _mm512_set1_ps(sm), t1));
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
template <int M>
void tile(const Job& j, int64_t t, int64_t r0) {
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2 && 8 * h < width; h++) {  // a half wholly past N is not computed
    __m256 acc[M];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < j.nb; b++) {
      const uint8_t* p = j.q + (t * j.nb + b) * kTileBytes + 32 * h;  // columns 8h..8h+7
      __m256i wv[8];
      for (int g = 0; g < 4; g++) {
        __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 64 * g));
        wv[g] = _mm256_and_si256(raw, lo4);
        wv[g + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4);
      }
      __m256 dv = _mm256_loadu_ps(j.d + (t * j.nb + b) * TN + 8 * h);
      __m256 mv = _mm256_loadu_ps(j.m + (t * j.nb + b) * TN + 8 * h);
      for (int r = 0; r < M; r++) {
        const int8_t* qa = j.qa + (r0 + r) * j.K + b * BL;
        __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(load_i32(qa)));
        for (int g = 1; g < 8; g++)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[g], _mm256_set1_epi32(load_i32(qa + 4 * g))));
        __m256i dot = _mm256_madd_epi16(s16, ones);
        const float s = j.s[(r0 + r) * j.nb + b], sm = j.ssum[(r0 + r) * j.nb + b];
        __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, _mm256_set1_ps(s)));
        acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(mv, _mm256_set1_ps(sm), t1));
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

#else
template <int M>
void tile(const Job& j, int64_t t, int64_t r0) {
  const int width = (int)std::min<int64_t>(TN, j.N - t * TN);
  float acc[M][TN];
  for (int r = 0; r < M; r++)
    for (int n = 0; n < TN; n++) acc[r][n] = 0.f;
  for (int64_t b = 0; b < j.nb; b++) {
    const uint8_t* p = j.q + (t * j.nb + b) * kTileBytes;
    const float* dp = j.d + (t * j.nb + b) * TN;
    const float* mp = j.m + (t * j.nb + b) * TN;
    for (int r = 0; r < M; r++) {
      const int8_t* qa = j.qa + (r0 + r) * j.K + b * BL;
      const float s = j.s[(r0 + r) * j.nb + b], sm = j.ssum[(r0 + r) * j.nb + b];
      for (int n = 0; n < TN; n++) {
        int32_t dot = 0;
        for (int g = 0; g < 4; g++)
          for (int e = 0; e < 4; e++) {
            const int byte = p[64 * g + 4 * n + e];
            dot += (byte & 15) * qa[4 * g + e] + (byte >> 4) * qa[16 + 4 * g + e];
          }
        const float t1 = (float)dot * (dp[n] * s);
        acc[r][n] = acc[r][n] + std::fma(mp[n], sm, t1);
      }
    }
  }
  for (int r = 0; r < M; r++) store_cols(j.y + (r0 + r) * j.N + t * TN, acc[r], width);
}
#endif

// Every row of the tile, in groups of up to 8: each row's arithmetic is its own, so the grouping
// changes the speed only, never a bit.
void run_tile(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  for (int64_t r0 = 0; r0 < j.rows; r0 += 8) {
    switch (std::min<int64_t>(8, j.rows - r0)) {
      case 1: tile<1>(j, (int64_t)t, r0); break;
      case 2: tile<2>(j, (int64_t)t, r0); break;
      case 3: tile<3>(j, (int64_t)t, r0); break;
      case 4: tile<4>(j, (int64_t)t, r0); break;
      case 5: tile<5>(j, (int64_t)t, r0); break;
      case 6: tile<6>(j, (int64_t)t, r0); break;
      case 7: tile<7>(j, (int64_t)t, r0); break;
      default: tile<8>(j, (int64_t)t, r0); break;
    }
  }
}

// ------------------------------------------------------------------ the onnxruntime operator
struct Kernel {
  const OrtApi* api;
  int64_t K, N;
};

OrtStatus* invalid(const OrtApi* api, const std::string& what) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, (std::string(kOp) + ": " + what).c_str());
}

#define Q41_CHECK(expr)             \
  do {                              \
    OrtStatus* st_ = (expr);        \
    if (st_ != nullptr) return st_; \
  } while (0)

OrtStatus* shape_of(const OrtApi* api, const OrtValue* v, std::vector<int64_t>& dims) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Q41_CHECK(api->GetTensorTypeAndShape(v, &info));
  size_t n = 0;
  OrtStatus* st = api->GetDimensionsCount(info, &n);
  if (st == nullptr) {
    dims.assign(n, 0);
    st = api->GetDimensions(info, dims.data(), n);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

OrtStatus* input(const OrtApi* api, OrtKernelContext* ctx, size_t i, const OrtValue** v, std::vector<int64_t>& dims) {
  Q41_CHECK(api->KernelContext_GetInput(ctx, i, v));
  if (*v == nullptr) return invalid(api, "input " + std::to_string(i) + " is missing");
  return shape_of(api, *v, dims);
}

int64_t count(const std::vector<int64_t>& dims) {
  int64_t c = 1;
  for (int64_t x : dims) c *= x;
  return c;
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
  Q41_CHECK(input(api, ctx, 0, &a, ad));
  Q41_CHECK(input(api, ctx, 1, &qv, qd));
  Q41_CHECK(input(api, ctx, 2, &dv, dd));
  Q41_CHECK(input(api, ctx, 3, &mv, md));
  const int64_t nb = k.K / BL, tiles = (k.N + TN - 1) / TN;
  if (ad.empty() || ad.back() != k.K)
    return invalid(api, "A's last dimension must be K = " + std::to_string(k.K));
  if (count(qd) != tiles * nb * kTileBytes)
    return invalid(api, "packed must hold tiles*nb*256 = " + std::to_string(tiles * nb * kTileBytes) + " bytes");
  if (count(dd) != tiles * nb * TN || count(md) != tiles * nb * TN)
    return invalid(api, "d and m must hold tiles*nb*16 = " + std::to_string(tiles * nb * TN) + " floats");
  const int64_t rows = count(ad) / k.K;
  std::vector<int64_t> od = ad;
  od.back() = k.N;
  OrtValue* out = nullptr;
  Q41_CHECK(api->KernelContext_GetOutput(ctx, 0, od.data(), od.size(), &out));
  if (rows == 0) return nullptr;
  const float* x = nullptr;
  const uint8_t* q = nullptr;
  const float *d = nullptr, *m = nullptr;
  float* y = nullptr;
  Q41_CHECK(data(api, a, &x));
  Q41_CHECK(data(api, qv, &q));
  Q41_CHECK(data(api, dv, &d));
  Q41_CHECK(data(api, mv, &m));
  Q41_CHECK(data(api, out, &y));
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> s, ssum;
  qa.resize((size_t)(rows * k.K));
  s.resize((size_t)(rows * nb));
  ssum.resize((size_t)(rows * nb));
  quantize_rows(x, rows, k.K, qa.data(), s.data(), ssum.data());
  Job j{q, d, m, qa.data(), s.data(), ssum.data(), y, k.K, k.N, nb, rows};
  return api->KernelContext_ParallelFor(ctx, run_tile, (size_t)tiles, kBatches, &j);
}

struct Q41Op : OrtCustomOp {
  Q41Op() {
    static_cast<OrtCustomOp&>(*this) = OrtCustomOp{};  // every member null, the newer ones too
    version = kMinApi;                                  // negotiate() stamps the version it found
    GetName = [](const OrtCustomOp*) { return kOp; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
    GetInputType = [](const OrtCustomOp*, size_t i) {
      return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    };
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
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) -> OrtStatus* {
      int64_t K = 0, N = 0;
      Q41_CHECK(api->KernelInfoGetAttribute_int64(info, "K", &K));
      Q41_CHECK(api->KernelInfoGetAttribute_int64(info, "N", &N));
      if (K <= 0 || K % BL != 0) return invalid(api, "attribute K must be a positive multiple of 32");
      if (N <= 0) return invalid(api, "attribute N must be positive");
      *kernel = new (std::nothrow) Kernel{api, K, N};
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
      q41_op.version = v;
      return {api, v};
    }
  return {nullptr, 0};
}

}  // namespace

Q41_EXPORT const char* dejavuu_q41_isa() { return kIsa; }

// The kernel without onnxruntime, single-threaded, for tests and timing (q41.py calls it through
// ctypes). The caller checks the shapes: K a multiple of 32, packed/d/m as pack() writes them.
Q41_EXPORT void dejavuu_q41_gemm(const float* A, int64_t rows, const uint8_t* packed, const float* d, const float* m,
                                 int64_t K, int64_t N, float* Y) {
  if (rows <= 0 || K <= 0 || N <= 0) return;
  const int64_t nb = K / BL, tiles = (N + TN - 1) / TN;
  std::vector<int8_t> qa((size_t)(rows * K));
  std::vector<float> s((size_t)(rows * nb)), ssum((size_t)(rows * nb));
  quantize_rows(A, rows, K, qa.data(), s.data(), ssum.data());
  Job j{packed, d, m, qa.data(), s.data(), ssum.data(), Y, K, N, nb, rows};
  for (int64_t t = 0; t < tiles; t++) run_tile(&j, (size_t)t);
}

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
  OrtCustomOpDomain* domain = nullptr;
  Q41_CHECK(api->CreateCustomOpDomain(kDomain, &domain));
  OrtStatus* st = api->CustomOpDomain_Add(domain, &q41_op);
  if (st == nullptr) st = api->AddCustomOpDomain(options, domain);
  if (st != nullptr) api->ReleaseCustomOpDomain(domain);
  // else kept: onnxruntime does not own the domain, which must outlive every session made from
  // these options (a few bytes per registration)
  return st;
}
