#include "kernels/cpu/quant_linear.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ggml_blocks.h"
#include "kernels/cpu/interleaved_linear.h"
#include "kernels/cpu/q8_activations.h"
#include "kernels/cpu/vec.h"
#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

constexpr int64_t kTileRows = 64;  // rows dequantized per SGEMM tile

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return model::F16ToF32(h);
}

bool HasSecondHalf(WeightDType dtype) {
  return dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z;
}

// Bytes before a block's values: the fp16 scale, and Q4_1's offset or Q4_Z's zero point.
int64_t HeaderBytes(WeightDType dtype) { return HasSecondHalf(dtype) ? 4 : 2; }

// The offset m in w = d q + m of a Q4_1 or Q4_Z block (exact in fp32 for Q4_Z: an fp16 times
// a small integer).
float Offset(WeightDType dtype, const uint8_t* block) {
  return dtype == WeightDType::kQ4_1 ? F16At(block + 2) : -F16At(block) * F16At(block + 2);
}

void DequantRowPortable(const QuantMatrix& m, const uint8_t* row, float* out) {
  const int64_t blocks = m.cols / kQuantBlock;
  const int64_t bb = QuantMatrix::BlockBytes(m.dtype);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bb;
    const float d = F16At(block);
    float* o = out + b * kQuantBlock;
    switch (m.dtype) {
      case WeightDType::kQ8_0:
        for (int i = 0; i < 32; ++i) {
          o[i] = d * static_cast<float>(static_cast<int8_t>(block[2 + i]));
        }
        break;
      case WeightDType::kQ4_0:
        for (int i = 0; i < 16; ++i) {
          o[i] = d * static_cast<float>((block[2 + i] & 0x0F) - 8);
          o[i + 16] = d * static_cast<float>((block[2 + i] >> 4) - 8);
        }
        break;
      default: {  // Q4_1, Q4_Z; fused like the AVX2 path, so both give the same floats
        const float mn = Offset(m.dtype, block);
        for (int i = 0; i < 16; ++i) {
          o[i] = std::fma(d, static_cast<float>(block[4 + i] & 0x0F), mn);
          o[i + 16] = std::fma(d, static_cast<float>(block[4 + i] >> 4), mn);
        }
      }
    }
  }
}

void Float16RowPortable(WeightDType dtype, const uint8_t* src, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, sizeof(h));
    out[i] = dtype == WeightDType::kF16 ? model::F16ToF32(h) : model::BF16ToF32(h);
  }
}

#if defined(__x86_64__)
// The sum of every lane of A accumulators.
template <int A>
__attribute__((target("avx2,fma,f16c"))) inline float SumOfAccumulators(const __m256* acc) {
  __m256 sum = acc[0];
  for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[a]);
  return HorizontalSum(sum);
}

// Eight 16-bit weights as fp32: F16 through F16C, BF16 as the top half of an fp32.
template <bool kBf16>
__attribute__((target("avx2,fma,f16c"))) inline __m256 Load8Float16(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(h);
  }
}

__attribute__((target("avx2,fma,f16c"))) void Float16RowAvx2(WeightDType dtype,
                                                               const uint8_t* src, int64_t n,
                                                               float* out) {
  int64_t i = 0;
  if (dtype == WeightDType::kF16) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, Load8Float16<false>(src + 2 * i));
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, Load8Float16<true>(src + 2 * i));
  }
  Float16RowPortable(dtype, src + 2 * i, n - i, out + i);
}

// One row of 16-bit weights dotted with T (<= 4) fp32 inputs, widened in registers: the
// decode step reads 2 bytes per weight instead of 4.
template <int T, bool kBf16>
__attribute__((target("avx2,fma,f16c"))) void DotRow16Avx2(const uint8_t* row, int64_t k,
                                                            const float* x, float* y) {
  constexpr int A = T == 1 ? 4 : 2;  // accumulators per token: two chains of FMAs at least
  __m256 acc[T][A];
  for (int t = 0; t < T; ++t) {
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  }
  int64_t c = 0;
  for (; c + 8 * A <= k; c += 8 * A) {
    if (c % 32 == 0) PrefetchAhead(row + 2 * c, kStreamPrefetchBytes);  // once a 64-byte line
    for (int a = 0; a < A; ++a) {
      const __m256 w = Load8Float16<kBf16>(row + 2 * (c + 8 * a));
      for (int t = 0; t < T; ++t) {
        acc[t][a] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * k + c + 8 * a), acc[t][a]);
      }
    }
  }
  for (; c + 8 <= k; c += 8) {
    const __m256 w = Load8Float16<kBf16>(row + 2 * c);
    for (int t = 0; t < T; ++t) acc[t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * k + c), acc[t][0]);
  }
  for (int t = 0; t < T; ++t) {
    float tail = 0.f;
    for (int64_t j = c; j < k; ++j) {
      uint16_t h;
      std::memcpy(&h, row + 2 * j, sizeof(h));
      tail += (kBf16 ? model::BF16ToF32(h) : model::F16ToF32(h)) * x[t * k + j];
    }
    y[t] = SumOfAccumulators<A>(acc[t]) + tail;
  }
}

template <bool kBf16>
void DotRow16(const uint8_t* row, int64_t k, const float* x, int64_t tokens, float* y) {
  switch (tokens) {
    case 1: return DotRow16Avx2<1, kBf16>(row, k, x, y);
    case 2: return DotRow16Avx2<2, kBf16>(row, k, x, y);
    case 3: return DotRow16Avx2<3, kBf16>(row, k, x, y);
    default: return DotRow16Avx2<4, kBf16>(row, k, x, y);
  }
}

// AVX-512: 4 rows of 16-bit weights (row_bytes apart) against 4 tokens at once, 16
// accumulators, so each 16 weights widened and each 16 inputs loaded serve 4 products.
// y[t * 4 + r] = w_r . x_t; k % 16 == 0.
template <bool kBf16>
__attribute__((target("avx512f,avx512bw,fma,f16c"))) void Dot4x4Float16Avx512(
    const uint8_t* w, int64_t row_bytes, const float* x, int64_t k, float* y) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r) {
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < k; c += 16) {
    __m512 wv[4];
    if (c % 32 == 0) {  // a cache line of each row every other step
      for (int r = 0; r < 4; ++r) PrefetchAhead(w + r * row_bytes + 2 * c, kStreamPrefetchBytes);
    }
    for (int r = 0; r < 4; ++r) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + 2 * c));
      if constexpr (kBf16) {
        wv[r] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        wv[r] = _mm512_maskz_cvtph_ps(0xFFFF, h);
      }
    }
    for (int t = 0; t < 4; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * k + c);
      for (int r = 0; r < 4; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < 4; ++t) {
    for (int r = 0; r < 4; ++r) y[t * 4 + r] = HorizontalSum16(acc[r][t]);
  }
}

// The 32 weights of one block as fp32 (scale and offset applied), in four vectors of 8.
__attribute__((target("avx2,fma,f16c"))) inline void DecodeBlockAvx2(WeightDType dtype,
                                                                      const uint8_t* block,
                                                                      __m256 w[4]) {
  // The block's fp16 header through F16C (the portable conversion branches).
  uint16_t h[2];
  std::memcpy(h, block, HasSecondHalf(dtype) ? 4 : 2);
  const float df = _cvtsh_ss(h[0]);
  const __m256 d = _mm256_set1_ps(df);
  __m128i lo, hi;  // 16 int8 values each: block values 0..15 and 16..31
  if (dtype == WeightDType::kQ8_0) {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
  } else {
    const __m128i packed =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + HeaderBytes(dtype)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm_and_si128(packed, mask);
    hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    if (dtype == WeightDType::kQ4_0) {
      const __m128i eight = _mm_set1_epi8(8);
      lo = _mm_sub_epi8(lo, eight);
      hi = _mm_sub_epi8(hi, eight);
    }
  }
  const __m256i q[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
  if (HasSecondHalf(dtype)) {
    const float second = _cvtsh_ss(h[1]);
    const __m256 mn = _mm256_set1_ps(dtype == WeightDType::kQ4_1 ? second : -df * second);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), d, mn);
  } else {
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), d);
  }
}

__attribute__((target("avx2,fma,f16c"))) void DequantRowAvx2(const QuantMatrix& m,
                                                               const uint8_t* row, float* out) {
  const int64_t bb = QuantMatrix::BlockBytes(m.dtype);
  for (int64_t b = 0; b < m.cols / kQuantBlock; ++b) {
    __m256 w[4];
    DecodeBlockAvx2(m.dtype, row + b * bb, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * kQuantBlock + 8 * i, w[i]);
  }
}

// Decode: row `row` of `m` dotted with each of T (<= 4) inputs, dequantizing each block in
// registers (no store): y[t] = sum_blocks d * sum_i q_i x_t,i. With fewer tokens each keeps
// more independent accumulators, so the FMA latency stays hidden.
template <int T>
__attribute__((target("avx2,fma,f16c"))) void DotRowAvx2(const QuantMatrix& m, const uint8_t* row,
                                                           const float* x, float* y) {
  constexpr int A = T == 1 ? 4 : 2;  // accumulators per token: two chains of FMAs at least
  const int64_t blocks = m.cols / kQuantBlock;
  const int64_t bb = QuantMatrix::BlockBytes(m.dtype);
  const int64_t k = m.cols;
  __m256 acc[T][A];
  for (int t = 0; t < T; ++t) {
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[4];
    DecodeBlockAvx2(m.dtype, row + b * bb, w);
    const float* xb = x + b * kQuantBlock;
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < 4; ++i) {
        acc[t][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + t * k + 8 * i), acc[t][i % A]);
      }
    }
  }
  for (int t = 0; t < T; ++t) y[t] = SumOfAccumulators<A>(acc[t]);
}

void DotRow(const QuantMatrix& m, const uint8_t* row, const float* x, int64_t tokens, float* y) {
  if (m.dtype == WeightDType::kF16) return DotRow16<false>(row, m.cols, x, tokens, y);
  if (m.dtype == WeightDType::kBF16) return DotRow16<true>(row, m.cols, x, tokens, y);
  if (DotGgmlRow(m.dtype, row, m.cols, x, m.cols, tokens, y)) return;  // ggml_blocks.h's
  switch (tokens) {
    case 1: return DotRowAvx2<1>(m, row, x, y);
    case 2: return DotRowAvx2<2>(m, row, x, y);
    case 3: return DotRowAvx2<3>(m, row, x, y);
    default: return DotRowAvx2<4>(m, row, x, y);
  }
}
#endif

using DequantFn = void (*)(const QuantMatrix&, const uint8_t*, float*);

DequantFn BestDequant() {
#if defined(__x86_64__)
  if (HaveAvx2Fma()) return DequantRowAvx2;
#endif
  return DequantRowPortable;
}

}  // namespace

std::string_view WeightDTypeName(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::kF32: return "fp32";
    case WeightDType::kQ8_0: return "q8_0";
    case WeightDType::kQ4_0: return "q4_0";
    case WeightDType::kQ4_1: return "q4_1";
    case WeightDType::kQ4_Z: return "q4_z";
    case WeightDType::kQ5_0: return "q5_0";
    case WeightDType::kQ5_1: return "q5_1";
    case WeightDType::kIQ4_NL: return "iq4_nl";
    case WeightDType::kQ2_K: return "q2_k";
    case WeightDType::kQ3_K: return "q3_k";
    case WeightDType::kQ4_K: return "q4_k";
    case WeightDType::kQ5_K: return "q5_k";
    case WeightDType::kQ6_K: return "q6_k";
    case WeightDType::kF16: return "fp16";
    case WeightDType::kBF16: return "bf16";
  }
  return "?";
}

absl::StatusOr<WeightDType> ParseWeightDType(std::string_view name) {
  if (name == "fp32" || name == "f32") return WeightDType::kF32;
  if (name == "q8_0") return WeightDType::kQ8_0;
  if (name == "q4_0") return WeightDType::kQ4_0;
  if (name == "q4_1") return WeightDType::kQ4_1;
  if (name == "fp16" || name == "f16") return WeightDType::kF16;
  if (name == "bf16") return WeightDType::kBF16;
  return absl::InvalidArgumentError(absl::StrCat(
      "weight dtype '", std::string(name), "': expected fp32, fp16, bf16, q8_0, q4_0 or q4_1"));
}

int64_t QuantMatrix::BlockElements(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::kF32: return 0;
    case WeightDType::kF16:
    case WeightDType::kBF16: return 1;
    case WeightDType::kQ2_K:
    case WeightDType::kQ3_K:
    case WeightDType::kQ4_K:
    case WeightDType::kQ5_K:
    case WeightDType::kQ6_K: return kSuperBlock;
    default: return kQuantBlock;
  }
}

int64_t QuantMatrix::BlockBytes(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::kF32: return 0;
    case WeightDType::kQ8_0: return 2 + 32;
    case WeightDType::kQ4_0: return 2 + 16;
    case WeightDType::kQ4_1:
    case WeightDType::kQ4_Z: return 4 + 16;
    case WeightDType::kQ5_0: return model::GgmlBlockBytes(model::GgmlType::kQ5_0);
    case WeightDType::kQ5_1: return model::GgmlBlockBytes(model::GgmlType::kQ5_1);
    case WeightDType::kIQ4_NL: return model::GgmlBlockBytes(model::GgmlType::kIQ4_NL);
    case WeightDType::kQ2_K: return model::GgmlBlockBytes(model::GgmlType::kQ2_K);
    case WeightDType::kQ3_K: return model::GgmlBlockBytes(model::GgmlType::kQ3_K);
    case WeightDType::kQ4_K: return model::GgmlBlockBytes(model::GgmlType::kQ4_K);
    case WeightDType::kQ5_K: return model::GgmlBlockBytes(model::GgmlType::kQ5_K);
    case WeightDType::kQ6_K: return model::GgmlBlockBytes(model::GgmlType::kQ6_K);
    case WeightDType::kF16:
    case WeightDType::kBF16: return 2;
  }
  return 0;
}

absl::StatusOr<QuantMatrix> QuantizeMatrix(const float* w, int64_t rows, int64_t cols,
                                           WeightDType dtype) {
  if (dtype != WeightDType::kQ8_0 && dtype != WeightDType::kQ4_0 && dtype != WeightDType::kQ4_1 &&
      dtype != WeightDType::kQ4_Z && !IsFloat16(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeMatrix: cannot write ",
                                                   std::string(WeightDTypeName(dtype)),
                                                   " (q8_0, q4_0, q4_1, q4_z, fp16, bf16 only)"));
  }
  if (IsFloat16(dtype)) {
    if (cols <= 0 || rows < 0) {
      return absl::InvalidArgumentError(absl::StrCat("QuantizeMatrix: ", rows, " x ", cols));
    }
    QuantMatrix m{.dtype = dtype, .rows = rows, .cols = cols};
    m.data.resize(static_cast<size_t>(rows * cols * 2));
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t i = 0; i < rows * cols; ++i) {
      const uint16_t h = dtype == WeightDType::kF16 ? model::F32ToF16(w[i]) : model::F32ToBF16(w[i]);
      std::memcpy(m.data.data() + 2 * i, &h, sizeof(h));
    }
    return m;
  }
  if (cols <= 0 || cols % kQuantBlock != 0 || rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantizeMatrix: ", cols, " columns are not a multiple of the block size 32"));
  }
  QuantMatrix m;
  m.dtype = dtype;
  m.rows = rows;
  m.cols = cols;
  m.data.resize(static_cast<size_t>(rows * m.RowBytes()));
  const int64_t bb = QuantMatrix::BlockBytes(dtype);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
      const float* x = w + r * cols + b * kQuantBlock;
      uint8_t* block = m.data.data() + r * m.RowBytes() + b * bb;
      if (dtype == WeightDType::kQ8_0) {
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
        // Quantize against the scale as stored (fp16), so the error stays within half a step.
        const uint16_t h = model::F32ToF16(amax / 127.f);
        const float d = model::F16ToF32(h);
        std::memcpy(block, &h, sizeof(h));
        const float inv = d > 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < 32; ++i) {
          block[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(
              std::clamp(std::lround(x[i] * inv), -127l, 127l)));
        }
      } else if (HasSecondHalf(dtype)) {
        const auto [lo, hi] = std::minmax_element(x, x + 32);
        const uint16_t hd = model::F32ToF16((*hi - *lo) / 15.f);
        const float d = model::F16ToF32(hd);
        uint16_t hm;
        if (dtype == WeightDType::kQ4_1) {
          hm = model::F32ToF16(*lo);
        } else {
          hm = model::F32ToF16(d > 0.f ? std::clamp(std::round(-*lo / d), 0.f, 15.f) : 0.f);
        }
        const float mn = dtype == WeightDType::kQ4_1 ? model::F16ToF32(hm)
                                                     : -d * model::F16ToF32(hm);
        std::memcpy(block, &hd, sizeof(hd));
        std::memcpy(block + 2, &hm, sizeof(hm));
        const float inv = d > 0.f ? 1.f / d : 0.f;
        const auto q = [&](float v) {
          return static_cast<uint8_t>(std::clamp(std::lround((v - mn) * inv), 0l, 15l));
        };
        for (int i = 0; i < 16; ++i) {
          block[4 + i] = static_cast<uint8_t>(q(x[i]) | (q(x[i + 16]) << 4));
        }
      } else {
        float max = 0.f;  // the value of largest magnitude, with its sign
        for (int i = 0; i < 32; ++i) {
          if (std::fabs(x[i]) > std::fabs(max)) max = x[i];
        }
        const uint16_t h = model::F32ToF16(max / -8.f);
        const float d = model::F16ToF32(h);
        std::memcpy(block, &h, sizeof(h));
        const float inv = d != 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < 16; ++i) {
          const auto q = [&](float v) {
            return static_cast<uint8_t>(std::clamp(std::lround(v * inv) + 8, 0l, 15l));
          };
          block[2 + i] = static_cast<uint8_t>(q(x[i]) | (q(x[i + 16]) << 4));
        }
      }
    }
  }
  return m;
}

void DequantizeRow(const QuantMatrix& m, int64_t row, float* out) {
  static const DequantFn dequant = BestDequant();
  if (m.interleaved) return DequantizeInterleavedRow(m, row, out);
  const uint8_t* src = m.data.data() + row * m.RowBytes();
  if (IsFloat16(m.dtype)) {
#if defined(__x86_64__)
    static const bool avx2 = HaveAvx2Fma();
    if (avx2) return Float16RowAvx2(m.dtype, src, m.cols, out);
#endif
    return Float16RowPortable(m.dtype, src, m.cols, out);
  }
  if (DecodeGgmlBlocks(m.dtype, src, m.cols / QuantMatrix::BlockElements(m.dtype), out)) return;
  dequant(m, src, out);
}

std::vector<float> DequantizeMatrix(const QuantMatrix& m) {
  std::vector<float> out(static_cast<size_t>(m.rows * m.cols));
  std::vector<float> row(static_cast<size_t>(m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    float* o = out.data() + r * m.cols;
    if (m.input_perm.empty()) {
      DequantizeRow(m, r, o);
      continue;
    }
    DequantizeRow(m, r, row.data());
    for (int64_t j = 0; j < m.cols; ++j) o[m.input_perm[j]] = row[j];
  }
  return out;
}

absl::Status QuantLinearParams::Validate() const {
  if (!input || !weight || !output) {
    return absl::InvalidArgumentError("QuantLinearParams: null input, weight or output");
  }
  if (weight->dtype == WeightDType::kF32 ||
      weight->cols % QuantMatrix::BlockElements(weight->dtype) != 0 ||
      static_cast<int64_t>(weight->data.size()) != weight->rows * weight->RowBytes() ||
      num_tokens < 0) {
    return absl::InvalidArgumentError("QuantLinearParams: malformed weight or sizes");
  }
  if (!weight->input_perm.empty() &&
      static_cast<int64_t>(weight->input_perm.size()) != weight->cols) {
    return absl::InvalidArgumentError("QuantLinearParams: input_perm is not [cols]");
  }
  if (output_stride != 0 && output_stride < weight->rows) {
    return absl::InvalidArgumentError("QuantLinearParams: output_stride below the weight's rows");
  }
  return absl::OkStatus();
}

absl::Status QuantLinear(const QuantLinearParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const QuantMatrix& w = *p.weight;
  const int64_t m = p.num_tokens, n = w.rows, k = w.cols, ldo = p.OutputStride();
  if (m == 0) return absl::OkStatus();
  const float* input = p.input;
  if (!w.input_perm.empty()) {
    // The inputs in the order the columns are stored (a gather of m x k floats, small next to
    // the n x k weights).
    thread_local std::vector<float> gathered;
    gathered.resize(static_cast<size_t>(m * k));
    for (int64_t t = 0; t < m; ++t) {
      const float* x = p.input + t * k;
      float* g = gathered.data() + t * k;
      for (int64_t j = 0; j < k; ++j) g[j] = x[w.input_perm[j]];
    }
    input = gathered.data();
  }
  if (w.interleaved && p.precision == LinearPrecision::kFast && HaveInterleavedInt8()) {
    // Every batch size on 8-bit inputs, 16 rows at a time (kernels/cpu/interleaved_linear.h).
    thread_local Q8Activations calling_threads;
    QuantizeActivations(input, m, k, &calling_threads);
    InterleavedInt8Linear(w, calling_threads, p.bias, p.output, ldo, p.accumulate);
    return absl::OkStatus();
  }
  if (m <= kInt8BatchTokens && p.precision == LinearPrecision::kFast && HasInt8Dot(w.dtype) &&
      !w.interleaved) {
    // Decode (batched up to kInt8BatchTokens) on 8-bit inputs: quantized once here, each weight
    // row read once as stored and multiplied with up to kInt8DotMaxTokens tokens at a time.
    thread_local Q8Activations calling_threads;
    // The team reads the calling thread's copy (a thread_local named inside the region would be
    // each thread's own).
    const Q8Activations& activations = calling_threads;
    QuantizeActivations(input, m, k, &calling_threads);
#pragma omp parallel for schedule(static) if (n * k * m > 32768)
    for (int64_t j = 0; j < n; ++j) {
      float dots[kInt8BatchTokens];
      const uint8_t* row = w.data.data() + j * w.RowBytes();
      for (int64_t t0 = 0; t0 < m; t0 += kInt8DotMaxTokens) {
        Int8DotRow(w.dtype, row, activations, t0, std::min(kInt8DotMaxTokens, m - t0), dots + t0);
      }
      const float b = p.bias ? p.bias[j] : 0.f;
      for (int64_t t = 0; t < m; ++t) {
        float* y = p.output + t * ldo + j;
        *y = p.accumulate ? *y + dots[t] + b : dots[t] + b;
      }
    }
    return absl::OkStatus();
  }
#if defined(__x86_64__)
  if (IsFloat16(w.dtype) && m >= 4 && m <= kStreamTokens && n % 4 == 0 && k % 16 == 0 &&
      HaveAvx512()) {
    // 16-bit weights at batched-decode sizes: blocks of 4 rows x 4 tokens, each row read once
    // (the SGEMM path below would widen tiles and pack them for every call).
    const bool bf16 = w.dtype == WeightDType::kBF16;
    const int64_t rb = w.RowBytes();
#pragma omp parallel for schedule(static) if (n * k > 32768)
    for (int64_t j = 0; j < n; j += 4) {
      const uint8_t* rows = w.data.data() + j * rb;
      for (int64_t t0 = 0; t0 < m; t0 += 4) {
        float dots[16];
        const int64_t count = std::min<int64_t>(4, m - t0);
        if (count == 4) {
          (bf16 ? Dot4x4Float16Avx512<true> : Dot4x4Float16Avx512<false>)(rows, rb, input + t0 * k,
                                                                        k, dots);
        } else {
          for (int r = 0; r < 4; ++r) {
            float row[4];
            DotRow(w, rows + r * rb, input + t0 * k, count, row);
            for (int64_t t = 0; t < count; ++t) dots[t * 4 + r] = row[t];
          }
        }
        for (int64_t t = 0; t < count; ++t) {
          for (int r = 0; r < 4; ++r) {
            float* y = p.output + (t0 + t) * ldo + j + r;
            const float v = dots[t * 4 + r] + (p.bias ? p.bias[j + r] : 0.f);
            *y = p.accumulate ? *y + v : v;
          }
        }
      }
    }
    return absl::OkStatus();
  }
#endif
  if (m <= kSmallBatchTokens) {
    // Decode: each row is read once (quantized) and dotted with every token, dequantized in
    // registers (AVX2) or into an L1-resident row (portable).
    static const bool avx2 = HaveAvx2Fma();
    const VecOps& vec = Vec();
#pragma omp parallel if (n * k > 32768)
    {
      std::vector<float> row(avx2 && !w.interleaved ? 0 : static_cast<size_t>(k));
      float dots[kSmallBatchTokens];
#pragma omp for schedule(static)
      for (int64_t j = 0; j < n; ++j) {
#if defined(__x86_64__)
        if (avx2 && !w.interleaved) {
          DotRow(w, w.data.data() + j * w.RowBytes(), input, m, dots);
        } else
#endif
        {
          DequantizeRow(w, j, row.data());
          for (int64_t t = 0; t < m; ++t) dots[t] = vec.dot(input + t * k, row.data(), k);
        }
        const float b = p.bias ? p.bias[j] : 0.f;
        for (int64_t t = 0; t < m; ++t) {
          float* y = p.output + t * ldo + j;
          *y = p.accumulate ? *y + dots[t] + b : dots[t] + b;
        }
      }
    }
    return absl::OkStatus();
  }
  // Prefill and large batches: tiles of rows dequantized and multiplied with SGEMM.
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
#pragma omp parallel
  {
    std::vector<float> tile(static_cast<size_t>(kTileRows * k));
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * kTileRows, rows = std::min(kTileRows, n - r0);
      for (int64_t r = 0; r < rows; ++r) DequantizeRow(w, r0 + r, tile.data() + r * k);
      float* out = p.output + r0;
      if (p.bias) {
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t r = 0; r < rows; ++r) {
            out[i * ldo + r] = (p.accumulate ? out[i * ldo + r] : 0.f) + p.bias[r0 + r];
          }
        }
      }
      const float beta = (p.accumulate || p.bias) ? 1.f : 0.f;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                  static_cast<int>(rows), static_cast<int>(k), 1.f, input, static_cast<int>(k),
                  tile.data(), static_cast<int>(k), beta, out, static_cast<int>(ldo));
    }
  }
  return absl::OkStatus();
}

std::optional<WeightDType> WeightDTypeOfGgml(model::GgmlType type) {
  switch (type) {
    case model::GgmlType::kQ8_0: return WeightDType::kQ8_0;
    case model::GgmlType::kQ4_0: return WeightDType::kQ4_0;
    case model::GgmlType::kQ4_1: return WeightDType::kQ4_1;
    case model::GgmlType::kQ5_0: return WeightDType::kQ5_0;
    case model::GgmlType::kQ5_1: return WeightDType::kQ5_1;
    case model::GgmlType::kIQ4_NL: return WeightDType::kIQ4_NL;
    case model::GgmlType::kQ2_K: return WeightDType::kQ2_K;
    case model::GgmlType::kQ3_K: return WeightDType::kQ3_K;
    case model::GgmlType::kQ4_K: return WeightDType::kQ4_K;
    case model::GgmlType::kQ5_K: return WeightDType::kQ5_K;
    case model::GgmlType::kQ6_K: return WeightDType::kQ6_K;
    default: return std::nullopt;
  }
}

std::optional<WeightDType> HeldDTypeOfGgml(model::GgmlType type) {
  if (type == model::GgmlType::kF16) return WeightDType::kF16;
  if (type == model::GgmlType::kBF16) return WeightDType::kBF16;
  return WeightDTypeOfGgml(type);
}

namespace {

// The shape checks QuantMatrixFromGguf and GgufTensorToF32 share: the dtype, and rows of ne[0]
// in whole blocks with the bytes they need.
absl::StatusOr<WeightDType> CheckBlockTensor(const model::GgufTensor& t) {
  const std::optional<WeightDType> dtype = HeldDTypeOfGgml(t.type);
  if (!dtype) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF tensor '", t.name, "' (",
                                                   model::GgmlTypeName(t.type),
                                                   ") is not in blocks or 16-bit floats"));
  }
  const int64_t be = QuantMatrix::BlockElements(*dtype);
  if (t.ne.empty() || t.ne[0] % be != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GGUF tensor '", t.name, "' (", model::GgmlTypeName(t.type), "): rows of ",
        t.ne.empty() ? 0 : t.ne[0], " are not whole blocks of ", be));
  }
  const int64_t n = t.NumElements();
  if (static_cast<int64_t>(t.data.size()) != n / be * QuantMatrix::BlockBytes(*dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GGUF tensor '", t.name, "' (", model::GgmlTypeName(t.type), "): ", t.data.size(),
        " bytes for ", n, " elements"));
  }
  return *dtype;
}

}  // namespace

absl::StatusOr<QuantMatrix> QuantMatrixFromGguf(const model::GgufTensor& t) {
  absl::StatusOr<WeightDType> dtype = CheckBlockTensor(t);
  if (!dtype.ok()) return dtype.status();
  QuantMatrix m;
  m.dtype = *dtype;
  m.cols = t.ne[0];
  m.rows = t.NumElements() / t.ne[0];
  const auto* p = reinterpret_cast<const uint8_t*>(t.data.data());
  m.data.assign(p, p + t.data.size());
  return m;
}

absl::Status GgufTensorToF32(const model::GgufTensor& t, std::vector<float>* out) {
  const std::byte* p = t.data.data();
  switch (t.type) {
    case model::GgmlType::kF32:
      out->resize(static_cast<size_t>(t.NumElements()));
      std::memcpy(out->data(), p, out->size() * sizeof(float));
      return absl::OkStatus();
    case model::GgmlType::kF16:
    case model::GgmlType::kBF16:
      out->resize(static_cast<size_t>(t.NumElements()));
      for (size_t i = 0; i < out->size(); ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, sizeof(h));
        (*out)[i] = t.type == model::GgmlType::kF16 ? model::F16ToF32(h) : model::BF16ToF32(h);
      }
      return absl::OkStatus();
    default:
      break;
  }
  absl::StatusOr<WeightDType> dtype = CheckBlockTensor(t);
  if (!dtype.ok()) return dtype.status();
  out->resize(static_cast<size_t>(t.NumElements()));
  // A view of the mapping as one matrix (no copy of the blocks): rows decoded in parallel.
  const int64_t cols = t.ne[0], rows = t.NumElements() / cols;
  const int64_t row_bytes = cols / QuantMatrix::BlockElements(*dtype) *
                            QuantMatrix::BlockBytes(*dtype);
  const auto* src = reinterpret_cast<const uint8_t*>(p);
  if (IsGgmlBlockFormat(*dtype)) {
    const int64_t blocks = cols / QuantMatrix::BlockElements(*dtype);
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t r = 0; r < rows; ++r) {
      DecodeGgmlBlocks(*dtype, src + r * row_bytes, blocks, out->data() + r * cols);
    }
    return absl::OkStatus();
  }
  static const DequantFn dequant = BestDequant();
  QuantMatrix shape{.dtype = *dtype, .rows = 1, .cols = cols};  // the row decoders read only these
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) dequant(shape, src + r * row_bytes, out->data() + r * cols);
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
