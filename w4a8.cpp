// W4A8 on a CPU (--quantize=int4-dynamic, quantize.Int4DynamicLinear): y = x W^T + b, with W's 4-bit weights
// multiplied in integers by x quantized to 8 bits in blocks of 32 at each call, as llama.cpp multiplies Q4_0 by
// Q8_0. Decoding is bound by the products' instructions more than by memory at 4 bits: turning each weight into a
// float before its multiply-add (torch's int4 kernel) costs several instructions a weight, where VNNI's dpbusd
// multiplies and sums 64 byte pairs in one. quantize.w4a8_kernel compiles this file for the processor it runs on
// (-march=native), once, and loads it as torch.ops.nanoformer.w4a8_linear.
//
// W (N, K/2) uint8: each chunk of 32 weights along K is 16 bytes, weight i of the chunk in the low nibble of byte i
// and weight i + 16 in the high one (llama.cpp's Q4_0 order), q in 0..15; weight = q * scale + zero, with
// scale and zero (N, K / group_size) fp32 for each group of group_size weights.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#ifndef W4A8_NAME  // another name builds a second copy beside the first (tests/test_quantize.py's AVX2 build)
#define W4A8_NAME w4a8_linear
#endif
#define STR2(x) #x
#define STR(x) STR2(x)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1
#else
#define VNNI 0
#endif

namespace {

constexpr int64_t CHUNK = 32;

// One row of K activations as int8 in chunks of 32, each chunk's largest |x| mapped to 127: q (K), d (K / 32)
// its scales, s (K / group_size) the sums of x over each group (for the zero points' term, exact).
void quantize_row(const float* x, int64_t K, int64_t group_size, int8_t* q, float* d, float* s) {
  for (int64_t c = 0; c < K / CHUNK; c++) {
    const float* xc = x + c * CHUNK;
    float amax = 0.f;
    for (int i = 0; i < CHUNK; i++) amax = std::max(amax, std::fabs(xc[i]));
    const bool tiny = !(amax > 1e-30f);  // 127 / amax would overflow (or x holds NaN): the block counts as zeros
    const float inv = tiny ? 0.f : 127.f / amax;
    d[c] = tiny ? 0.f : amax / 127.f;
    for (int i = 0; i < CHUNK; i++) q[c * CHUNK + i] = (int8_t)std::nearbyint(xc[i] * inv);
  }
  for (int64_t g = 0; g < K / group_size; g++) {
    double sum = 0.;  // in double, so that the sum rounds once: its group's zero multiplies all of it
    for (int64_t i = 0; i < group_size; i++) sum += x[g * group_size + i];
    s[g] = (float)sum;
  }
#if VNNI  // 4 chunks (128 bytes) as dot_row reads them with 64-byte registers: their low halves, then high halves
  int8_t t[4 * CHUNK];
  for (int64_t c = 0; c + 4 <= K / CHUNK; c += 4) {
    for (int i = 0; i < 4; i++) {
      std::memcpy(t + i * 16, q + (c + i) * CHUNK, 16);
      std::memcpy(t + 64 + i * 16, q + (c + i) * CHUNK + 16, 16);
    }
    std::memcpy(q + c * CHUNK, t, sizeof t);
  }
#endif
}

// The integer part of a row's product: sum over chunks c of scale[c / cpg] * d[c] * sum(q4 * q8). A row at a time,
// so the weights stream through memory in order (4 rows interleaved read slower: 3.2 against 2.6 ms for GPT-2's
// products), prefetched 8 KB ahead (a few percent).
float dot_row(const uint8_t* w, const float* scale, int64_t cpg, const int8_t* q, const float* d, int64_t K) {
  int64_t c = 0;
  const int64_t C = K / CHUNK;
  float total = 0.f;
#if VNNI
  __m512 acc = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lanes 4i..4i+3: chunk i
  const __m512i by8 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  // 8i..8i+7: group i
  for (; c + 4 <= C; c += 4) {  // 128 weights: 4 chunks, 64 bytes
    _mm_prefetch((const char*)(w + c * 16 + 8192), _MM_HINT_T0);
    const __m512i b = _mm512_loadu_si512(w + c * 16);
    const __m512i lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    // q holds the 4 chunks' low halves, then their high halves (quantize_row)
    const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                              _mm512_loadu_si512(q + c * CHUNK)),
                                          hi, _mm512_loadu_si512(q + c * CHUNK + 64));
    const __m512 dd = _mm512_permutexvar_ps(by4, _mm512_castps128_ps512(_mm_loadu_ps(d + c)));
    const float* sc = scale + c / cpg;  // groups of 32 or 64 weights put 4 or 2 scales in a step
    __m512 ss;
    if (cpg >= 4) ss = _mm512_set1_ps(*sc);
    else if (cpg == 2)  // 2 floats, no further: the last row's last step may end the array there
      ss = _mm512_permutexvar_ps(by8, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)sc))));
    else ss = _mm512_permutexvar_ps(by4, _mm512_castps128_ps512(_mm_loadu_ps(sc)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dd, ss), acc);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (; c < C; c++) {  // 32 weights: one chunk; q4 * q8 fits int16 (15 * 127 * 2 < 2^15)
    const __m128i b = _mm_loadu_si128((const __m128i*)(w + c * 16));
    const __m256i wc = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);
    const __m256i qc = _mm256_loadu_si256((const __m256i*)(q + c * CHUNK));
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wc, qc), ones);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d[c] * scale[c / cpg]), acc);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  total = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
  for (; c < C; c++) {  // what is left (all of it without AVX2), a chunk at a time, in the natural order
    int32_t s = 0;
    for (int i = 0; i < 16; i++)
      s += (w[c * 16 + i] & 15) * q[c * CHUNK + i] + (w[c * 16 + i] >> 4) * q[c * CHUNK + 16 + i];
    total += s * d[c] * scale[c / cpg];
  }
  return total;
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& zero,
                       int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "w4a8_linear: x is (M, K) fp32 on a CPU");
  // groups of 32, 64 or a multiple of 128: a step of dot_row's 4 chunks holds 4, 2 or 1 group scales
  TORCH_CHECK(group_size == 32 || group_size == 64 || (group_size > 0 && group_size % 128 == 0),
              "w4a8_linear: group_size is 32, 64 or a multiple of 128");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), G = K / group_size, cpg = group_size / CHUNK;
  TORCH_CHECK(K % group_size == 0 && weight.dim() == 2 && weight.size(1) == K / 2 && weight.is_contiguous() &&
              scale.is_contiguous() && zero.is_contiguous() && scale.numel() == N * G && zero.numel() == N * G &&
              (!bias.has_value() || (bias->numel() == N && bias->is_contiguous())),
              "w4a8_linear: weight (N, K / 2), scale and zero (N, K / group_size), bias (N)");
  auto y = at::empty({M, N}, x.options());
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * (K / CHUNK)), sx(M * G);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      quantize_row(xp + m * K, K, group_size, q.data() + m * K, d.data() + m * (K / CHUNK), sx.data() + m * G);
  });
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
      for (int64_t m = 0; m < M; m++) {  // a row of weights stays in L1 across the rows of x
        float out = dot_row(wp + n * (K / 2), sp + n * G, cpg, q.data() + m * K, d.data() + m * (K / CHUNK), K);
        for (int64_t g = 0; g < G; g++) out += zp[n * G + g] * sx[m * G + g];  // the zero points' term
        yp[m * N + n] = out + (bp ? bp[n] : 0.f);
      }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoformer, m) {
  m.def(STR(W4A8_NAME) "(Tensor x, Tensor weight, Tensor scale, Tensor zero, int group_size, Tensor? bias) -> Tensor");
  m.impl(STR(W4A8_NAME), c10::DispatchKey::CPU, &w4a8_linear);
}
