// Spike (docs/speed.md, twenty-second session): the exact Q4_1 kernel of q41_gemm.cpp as an
// onnxruntime custom operator (domain dejavuu.q41, op Q41MatMul: A [..., K] float, packed levels,
// scales, minima; attributes K, N), run on onnxruntime's intra-op pool (KernelContext::ParallelFor),
// to time a whole decode step with it (q41_graph.py puts it in place of the body's MatMulNBits,
// on the GGUF's own Q4_1 blocks, or --random levels; q41_step.py times it). Measurement code, not
// part of the package.
//
// Build: the onnxruntime C/C++ API headers (include/onnxruntime/core/session/*.h of onnxruntime's
// repository, API version <= the installed runtime's) in inc/, then
//   g++ -O3 -march=native -shared -fPIC -std=c++17 -DNBATCH=0 -I inc -o libq41op.so q41_op.cpp
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>
#include <algorithm>

constexpr int BL = 32, TN = 16;

struct Job {
  const uint8_t* q; const float* d; const float* m;
  const int8_t* qa; const float* s; const float* sum;
  float* y; int K, N, nb, rows;
};

template <int M>
static void tile(const Job& j, int t, int r0) {
  __m512 acc[M];
  for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < j.nb; b++) {
    const uint8_t* p = j.q + ((size_t)t * j.nb + b) * 256;
    __m512i wv[8];
    for (int g = 0; g < 4; g++) {
      __m512i raw = _mm512_loadu_si512(p + 64 * g);
      wv[g] = _mm512_and_si512(raw, lo4);
      wv[g + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo4);
    }
    __m512 dv = _mm512_loadu_ps(j.d + ((size_t)t * j.nb + b) * TN);
    __m512 mv = _mm512_loadu_ps(j.m + ((size_t)t * j.nb + b) * TN);
    for (int r = 0; r < M; r++) {
      const int32_t* qa = (const int32_t*)(j.qa + (size_t)(r0 + r) * j.K + b * BL);
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        d0 = _mm512_dpbusd_epi32(d0, wv[g], _mm512_set1_epi32(qa[g]));
        d1 = _mm512_dpbusd_epi32(d1, wv[g + 1], _mm512_set1_epi32(qa[g + 1]));
      }
      __m512i dot = _mm512_add_epi32(d0, d1);
      const float s = j.s[(size_t)(r0 + r) * j.nb + b], sm = j.sum[(size_t)(r0 + r) * j.nb + b];
      __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(s)));
      acc[r] = _mm512_add_ps(acc[r], _mm512_fmadd_ps(mv, _mm512_set1_ps(sm), t1));
    }
  }
  for (int r = 0; r < M; r++) _mm512_storeu_ps(j.y + (size_t)(r0 + r) * j.N + t * TN, acc[r]);
}

static void run_tile(void* data, size_t t) {
  const Job& j = *static_cast<const Job*>(data);
  for (int r0 = 0; r0 < j.rows; r0 += 8) {
    switch (std::min(8, j.rows - r0)) {
      case 1: tile<1>(j, (int)t, r0); break;
      case 2: tile<2>(j, (int)t, r0); break;
      case 3: tile<3>(j, (int)t, r0); break;
      case 4: tile<4>(j, (int)t, r0); break;
      case 5: tile<5>(j, (int)t, r0); break;
      case 6: tile<6>(j, (int)t, r0); break;
      case 7: tile<7>(j, (int)t, r0); break;
      default: tile<8>(j, (int)t, r0); break;
    }
  }
}

struct Q41Kernel {
  int64_t K, N;
  Q41Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    K = ki.GetAttribute<int64_t>("K");
    N = ki.GetAttribute<int64_t>("N");
  }
  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto a = ctx.GetInput(0);
    auto shape = a.GetTensorTypeAndShapeInfo().GetShape();
    size_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); i++) rows *= shape[i];
    std::vector<int64_t> oshape = shape; oshape.back() = N;
    auto out = ctx.GetOutput(0, oshape);
    const float* x = a.GetTensorData<float>();
    int nb = (int)K / BL;
    thread_local std::vector<int8_t> qa; thread_local std::vector<float> s, sum;
    qa.resize(rows * K); s.resize(rows * nb); sum.resize(rows * nb);
    for (size_t r = 0; r < rows; r++)
      for (int b = 0; b < nb; b++) {  // AVX-512: the same values as rounding each v * inv to nearest even
        const float* v = x + r * K + b * BL;
        __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float sc = amax / 127.f, inv = sc ? 1.f / sc : 0.f;
        __m512 vi = _mm512_set1_ps(inv);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
        _mm_storeu_si128((__m128i*)&qa[r * K + b * BL], _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)&qa[r * K + b * BL + 16], _mm512_cvtepi32_epi8(q1));
        int tot = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        s[r * nb + b] = sc; sum[r * nb + b] = sc * (float)tot;
      }
    Job j{ctx.GetInput(1).GetTensorData<uint8_t>(), ctx.GetInput(2).GetTensorData<float>(), ctx.GetInput(3).GetTensorData<float>(),
          qa.data(), s.data(), sum.data(), out.GetTensorMutableData<float>(), (int)K, (int)N, nb, (int)rows};
    ctx.ParallelFor(run_tile, (size_t)(N / TN), NBATCH, &j);
  }
};

struct Q41Op : Ort::CustomOpBase<Q41Op, Q41Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Q41Kernel(api, info); }
  const char* GetName() const { return "Q41MatMul"; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

extern "C" OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api) {
  Ort::InitApi(api->GetApi(ORT_API_VERSION));
  static Ort::CustomOpDomain domain("dejavuu.q41");
  static Q41Op op;
  domain.Add(&op);
  Ort::UnownedSessionOptions(options).Add(domain);
  return nullptr;
}
