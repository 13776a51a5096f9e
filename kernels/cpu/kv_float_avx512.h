// Float KV-cache row kernels (fp32, fp16 and bf16 rows) on AVX-512, used by kv_quant.cc's
// KvRowKernelsFor when the CPU has AVX-512 F/BW/VL.
//
// Decode attention over a float cache at a few thousand positions is bound by arithmetic on a
// few cores as much as by reading the cache: the AVX2 kernels sum each (row, head) dot product
// across the lanes of its own vector and convert each row once per four heads. These kernels
// work 16 lanes wide and touch each decoded value once per call:
//   dot:  16 rows at a time are decoded into an fp32 tile; each head's products with the 16
//         rows accumulate in 16 vectors of channel partials, which one transpose-and-add
//         reduces to the 16 scores together.
//   axpy: 32 channels at a time, up to 8 heads' accumulators stay in registers while the rows
//         stream past, each row's channels decoded once.
// The rows `ahead` (kernels/cpu/kv_quant.h) are asked for a line at a time through the
// arithmetic: dot spreads a tile's lines over its heads, axpy asks for the line of the next
// rows at the offset each row's load reads. Issued all at once before the arithmetic (measured
// into L1), the requests wait for the core's few fill buffers and the arithmetic waits behind
// them. With a single head (no grouped queries) dot still asks for a tile's lines all at once.
// Every element decodes to DequantizeRow's float, so results differ from fp32 math on the
// decoded rows only in the order of the sums (as the AVX2 kernels do).
#ifndef KVGRID_KERNELS_CPU_KV_FLOAT_AVX512_H_
#define KVGRID_KERNELS_CPU_KV_FLOAT_AVX512_H_

#include <cstdint>

#include "kernels/cpu/kv_quant.h"

namespace kvgrid::kernels::cpu {

// KvRowKernels' dot and axpy (kernels/cpu/kv_quant.h) for fp32, fp16 and bf16 rows, any even
// n; `meta` is not read. Call only when HaveAvx512() (kernels/cpu/simd_x86.h).
void DotF32Avx512(const void* values, const void* meta, int64_t n, int64_t rows,
                  const float* q, int64_t num_q, float* scores, int64_t score_stride,
                  KvRows ahead);
void DotF16Avx512(const void* values, const void* meta, int64_t n, int64_t rows,
                  const float* q, int64_t num_q, float* scores, int64_t score_stride,
                  KvRows ahead);
void DotBf16Avx512(const void* values, const void* meta, int64_t n, int64_t rows,
                   const float* q, int64_t num_q, float* scores, int64_t score_stride,
                   KvRows ahead);
void AxpyF32Avx512(const void* values, const void* meta, int64_t n, int64_t rows,
                   const float* p, int64_t num_q, int64_t p_stride, float* out,
                   KvRows ahead);
void AxpyF16Avx512(const void* values, const void* meta, int64_t n, int64_t rows,
                   const float* p, int64_t num_q, int64_t p_stride, float* out,
                   KvRows ahead);
void AxpyBf16Avx512(const void* values, const void* meta, int64_t n, int64_t rows,
                    const float* p, int64_t num_q, int64_t p_stride, float* out,
                    KvRows ahead);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_KV_FLOAT_AVX512_H_
