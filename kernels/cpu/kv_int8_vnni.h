// Int8 KV-cache row kernels on integer dot products (AVX-512 VNNI), used by kv_quant.cc's
// KvRowKernelsFor when the CPU has them.
//
// Decode attention over an int8 cache is bound by arithmetic on a few cores, not by reading
// the cache: the float kernels convert every int8 value to fp32 before each multiply-add.
// These kernels instead round the float operand to int8 and let VPDPBUSD multiply-add 64
// byte pairs per instruction:
//   dot:  the query heads, per call and head, symmetric: qs = max|q| / 127, q' = round(q / qs);
//         score = qs * s_r * sum_i q'_i k_r,i.
//   axpy: the weights times each row's scale, alpha_r = p_r s_r, per call, head and tile of 16
//         rows: as = max|alpha| / 127, alpha' = round(alpha / as);
//         out_i += as * sum_r alpha'_r v_r,i.
// The integer sums are exact, so the only error beyond fp32 rounding is that of rounding the
// float operand: |score - exact| <= qs / 2 * s_r * sum_i |k_r,i| and
// |out_i - exact| <= as / 2 * sum_r |v_r,i| (k, v the stored int8 codes, s_r the row scale).
// Cache bytes enter VPDPBUSD as unsigned (x + 128, a sign-bit flip) and the float operand as
// signed; the 128 * sum of the rounded operand is subtracted once per head.
// The rows `ahead` (kernels/cpu/kv_quant.h) are asked for at the start: spread through the
// loops as the float kernels do, they made attention no faster (the int8 arithmetic per line
// is short) and cost a few microseconds an attention call with the K/V in cache.
#ifndef KVGRID_KERNELS_CPU_KV_INT8_VNNI_H_
#define KVGRID_KERNELS_CPU_KV_INT8_VNNI_H_

#include <cstdint>

#include "kernels/cpu/kv_quant.h"

namespace kvgrid::kernels::cpu {

// True when this CPU has AVX-512 F/BW/VL and VNNI.
bool HaveInt8Vnni();

// Limit of the integer kernels (channels per row); longer rows must use the float kernels.
inline constexpr int64_t kVnniMaxChannels = 512;
inline bool Int8VnniCovers(int64_t n) { return n <= kVnniMaxChannels; }

// True when every x[i] is finite: only then do the integer kernels' bounds hold (callers use
// the float kernels otherwise, which propagate NaN and Inf as they are).
bool Int8VnniRounds(const float* x, int64_t n);

// One query head rounded to int8 for DotInt8VnniPrepared: codes zero-padded to a multiple of
// 64 channels, the scale and the sum of the codes.
struct Int8Query {
  alignas(64) int8_t codes[kVnniMaxChannels];
  float scale;
  int32_t code_sum;
};

// Rounds q [num_q, n] into out[0, num_q) (n <= kVnniMaxChannels).
void RoundQueriesInt8(const float* q, int64_t n, int64_t num_q, Int8Query* out);

// KvRowKernels' dot over queries rounded once by RoundQueriesInt8 (attention rounds a work
// item's queries once for all its blocks). n <= kVnniMaxChannels.
void DotInt8VnniPrepared(const void* values, const void* meta, int64_t n, int64_t rows,
                         const Int8Query* q, int64_t num_q, float* scores, int64_t score_stride,
                         KvRows ahead);

// KvRowKernels' dot and axpy (kernels/cpu/kv_quant.h) for int8 rows, with the rounding above.
// Call only when HaveInt8Vnni() and Int8VnniCovers(n).
void DotInt8Vnni(const void* values, const void* meta, int64_t n, int64_t rows, const float* q,
                 int64_t num_q, float* scores, int64_t score_stride, KvRows ahead);
void AxpyInt8Vnni(const void* values, const void* meta, int64_t n, int64_t rows, const float* p,
                  int64_t num_q, int64_t p_stride, float* out, KvRows ahead);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_KV_INT8_VNNI_H_
