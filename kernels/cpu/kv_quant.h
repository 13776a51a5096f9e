// Row codecs of the KV-cache dtypes (formats in kernels/kv_dtype.h) and the fused row kernels
// attention reads the cache through, so that no full-precision copy of the cache is made.
//
// QuantizeRow / DequantizeRow are the reference definition of each format; the row kernels
// come in a portable version and an AVX2/FMA/F16C version chosen at run time (as in
// kernels/cpu/vec.h). Both versions decode every element to the same float as DequantizeRow,
// so they differ from each other, and from fp32 math on DequantizeRow's output, only in the
// order of the sums. On CPUs with AVX-512 VNNI the fast int8 kernels instead round the float
// operand (queries, attention weights) to int8 and use integer dot products, within the bounds
// stated in kernels/cpu/kv_int8_vnni.h; KvKernelPrecision::kExact keeps the float kernels.
// All functions are pure and thread-safe.
#ifndef KVGRID_KERNELS_CPU_KV_QUANT_H_
#define KVGRID_KERNELS_CPU_KV_QUANT_H_

#include <cstdint>

#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cpu {

// Encodes one row of `n` channels (n > 0 and even): `values` receives
// KvRowLayoutFor(dtype, n).value_bytes bytes and `meta` .meta_bytes bytes (`meta` is not
// touched, and may be null, for float dtypes).
//   int8: s = max|x| / 127 rounded to the nearest fp16 (up instead where a subnormal s would
//         clip max|x|; at least the smallest subnormal when some x != 0, at most the largest
//         finite fp16); q = clamp(round(x / s), -127, 127) with the rounded s, so
//         |x - s q| <= s / 2 unless max|x| overflows the fp16 scale.
//   int4: per group, the range [min(0, min x), max(0, max x)] (it must hold 0 because the
//         zero point is an integer in [0, 15]); s = range / 15 rounded up to an fp16 with its
//         4 low mantissa bits clear; z = clamp(round(-min / s), 0, 15);
//         q = clamp(round(x / s) + z, 0, 15), so |x - s (q - z)| <= s / 2. An all-zero group
//         stores s = 0 and decodes exactly.
//   fp8_e4m3: s as for int8 with 448 in place of 127 (stepped up only where amax / s would
//         pass 464, the rounding limit above 448); q = F32ToFp8E4m3(x / s), so
//         |x - s e(q)| <= max(|x| 2^-4, s 2^-10) (half a step of E4M3 in x's binade, or in
//         the subnormal range) unless max|x| overflows the fp16 scale.
// round() is round-half-to-even. Non-finite inputs give unspecified (but valid) codes.
void QuantizeRow(KvDType dtype, const float* x, int64_t n, void* values, void* meta);

// Decodes one row written by QuantizeRow: out[i] = x̂[i] (int8: s * q; int4: s * (q - z);
// fp8_e4m3: Fp8E4m3ToF32(q) * s).
void DequantizeRow(KvDType dtype, const void* values, const void* meta, int64_t n, float* out);

// Where rows of one arena plane start: their values, and their metadata (null for float
// dtypes).
struct KvRows {
  const void* values = nullptr;
  const void* meta = nullptr;
};

// Kernels over `rows` consecutive rows of one arena plane (row r's values at
// values + r * value_bytes, its metadata at meta + r * meta_bytes), each row `n` channels
// (n > 0 and even); x̂_r is row r as DequantizeRow decodes it. `meta` may be null for float
// dtypes.
//
// `ahead`: rows the caller reads soon after this call's, `rows` of them laid out as the call's
// own (null values: none). The kernels only prefetch them, so that their reads from DRAM
// overlap this call's arithmetic; they change no result. The AVX-512 float kernels spread the
// requests a line at a time through their loops, the others issue them all at the start
// (PrefetchRows).
struct KvRowKernels {
  // scores[h * score_stride + r] = sum_i q[h * n + i] * x̂_r[i]     for h < num_q, r < rows
  //   q: [num_q, n]
  void (*dot)(const void* values, const void* meta, int64_t n, int64_t rows, const float* q,
              int64_t num_q, float* scores, int64_t score_stride, KvRows ahead);
  // out[h * n + i] += sum_r p[h * p_stride + r] * x̂_r[i]          for h < num_q, i < n
  //   out: [num_q, n]
  void (*axpy)(const void* values, const void* meta, int64_t n, int64_t rows, const float* p,
               int64_t num_q, int64_t p_stride, float* out, KvRows ahead);
  // out[r * n + i] = x̂_r[i]; bit-identical to DequantizeRow row by row.
  void (*dequantize)(const void* values, const void* meta, int64_t n, int64_t rows, float* out);
  const char* name;  // "avx512-vnni", "avx512", "avx2" or "portable"
  // True when dot/axpy round their float operand to int8 (kernels/cpu/kv_int8_vnni.h).
  bool rounds_operands = false;
  // Optional (null when absent), for callers that run many dots over the same queries:
  // prepare_query rounds q [num_q, n] once into `prepared` (num_q * prepared_query_bytes bytes,
  // 64-byte aligned) and returns false when it does not take this shape (then call dot);
  // dot_prepared is dot on those queries.
  bool (*prepare_query)(const float* q, int64_t n, int64_t num_q, void* prepared) = nullptr;
  void (*dot_prepared)(const void* values, const void* meta, int64_t n, int64_t rows,
                       const void* prepared, int64_t num_q, float* scores, int64_t score_stride,
                       KvRows ahead) = nullptr;
  int64_t prepared_query_bytes = 0;
};

// Prefetches all of `ahead`'s `rows` rows of layout `l` at once.
void PrefetchRows(KvRows ahead, const KvRowLayout& l, int64_t rows);

enum class KvKernelPrecision {
  kFast,   // the fastest kernels on this CPU (int8: integer dot products where available)
  kExact,  // fp32 arithmetic on the decoded rows (references, tests)
};

// The best kernels for `dtype` on this CPU at `precision`.
KvRowKernels KvRowKernelsFor(KvDType dtype,
                             KvKernelPrecision precision = KvKernelPrecision::kFast);
// The portable kernels (for tests comparing the two).
KvRowKernels PortableKvRowKernelsFor(KvDType dtype);

inline constexpr float kFp8E4m3Max = 448.f;

// x rounded to the nearest fp8 E4M3 value, half to even, saturating at +-448 (a NaN gives
// -448's code, as int8's encoder gives -127); never returns 0x7f or 0xff.
uint8_t F32ToFp8E4m3(float x);
// The value of an E4M3 code, exactly (0x7f and 0xff, which no encoder writes, read as +-480).
float Fp8E4m3ToF32(uint8_t code);

// The int4 group metadata word: fp16 scale with the zero point in its 4 low mantissa bits.
inline uint16_t Int4MetaWord(uint16_t scale_f16, int zero) {
  return static_cast<uint16_t>((scale_f16 & 0xfff0u) | (static_cast<unsigned>(zero) & 0xfu));
}

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_KV_QUANT_H_
