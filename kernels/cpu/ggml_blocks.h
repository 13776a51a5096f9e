// Decoding of ggml's block formats past Q8_0/Q4_0/Q4_1 (which kernels/cpu/quant_linear.cc
// decodes itself): Q5_0, Q5_1 and IQ4_NL (blocks of 32) and the K-quants Q2_K..Q6_K
// (super-blocks of 256 weights in 16 or 8 sub-blocks, each with its own small integer scale,
// and for Q2_K/Q4_K/Q5_K a minimum, under one or two fp16 factors).
//
// Values are exactly those of ggml's dequantize_row_* (and of gguf.quants.dequantize): every
// product there is of an fp16 factor and small integers, exact in fp32, so the only rounding
// is the final subtraction or addition of the minimum, which fused or not gives the same float.
//
// Layouts, byte offsets within a block (e = element 0..255 of a super-block, h = e / 128,
// s = e % 128 / 32, l = e % 32):
//   Q5_0    [d f16][qh u32][qs 16]: 5-bit q = nibble | bit e of qh << 4, the nibbles as
//           Q4_0's (value i low, i + 16 high in byte i); w = d (q - 16).
//   Q5_1    [d f16][m f16][qh u32][qs 16]: as Q5_0 without the offset; w = d q + m.
//   IQ4_NL  [d f16][qs 16]: nibbles as Q4_0's index a fixed table of 16 int8; w = d table[q].
//   Q2_K    [scales 16][qs 64][d f16][dmin f16]: q = qs[32h + l] >> 2s & 3; sub-block
//           j = e / 16 has scale scales[j] & 15 and minimum scales[j] >> 4;
//           w = d sc q - dmin mn.
//   Q3_K    [hmask 32][qs 64][scales 12][d f16]: q = (qs[32h + l] >> 2s & 3), minus 4 unless
//           bit e / 32 of hmask[l] is set; 16 6-bit scales (low 4 bits: nibbles of bytes 0..7,
//           j < 8 low, j >= 8 high nibble of byte j - 8; high 2 bits: pair j / 4 of byte
//           8 + j % 4), minus 32; w = d sc q.
//   Q4_K    [d f16][dmin f16][scales 12][qs 128]: sub-block g = e / 32 has a 6-bit scale and
//           minimum (g < 4: low 6 bits of bytes g and g + 4; else the nibbles of byte g + 4
//           and the top 2 bits of bytes g - 4 and g); q = qs[32 (g / 2) + l] >> 4 (g % 2) & 15;
//           w = d sc q - dmin mn.
//   Q5_K    [d f16][dmin f16][scales 12][qh 32][qs 128]: Q4_K plus bit g of qh[l] as bit 4.
//   Q6_K    [ql 128][qh 64][scales 16 int8][d f16]:
//           q = (ql[64h + 32 (s % 2) + l] >> 4 (s / 2) & 15 | (qh[32h + l] >> 2s & 3) << 4) - 32;
//           w = d scales[e / 16] q.
//
// Thread-safety: stateless.
#ifndef KVGRID_KERNELS_CPU_GGML_BLOCKS_H_
#define KVGRID_KERNELS_CPU_GGML_BLOCKS_H_

#include <cstdint>

#include "kernels/cpu/quant_linear.h"

namespace kvgrid::kernels::cpu {

// True for the formats this file decodes.
[[nodiscard]] bool IsGgmlBlockFormat(WeightDType dtype);

// out[0, blocks * QuantMatrix::BlockElements(dtype)) = the weights of `blocks`
// consecutive blocks of `dtype` starting at `src` (blocks * BlockBytes(dtype)
// bytes, no alignment needed). Uses AVX2 where the CPU has it; the floats are
// the same either way. Returns false, writing nothing, for a dtype that is not
// IsGgmlBlockFormat.
bool DecodeGgmlBlocks(WeightDType dtype, const uint8_t* src, int64_t blocks, float* out);

// y[t] = sum over c < cols of w[c] * x[t * x_stride + c], t < tokens, for one row of `cols`
// weights (whole blocks) at `row`: each block decoded in registers (AVX2) as DecodeGgmlBlocks
// decodes it and multiplied in, never stored. The sums' order is the kernel's own. Returns false,
// computing nothing, without AVX2/FMA, for tokens outside 1..4 or a dtype that is not
// IsGgmlBlockFormat (the caller then decodes the row and dots it).
bool DotGgmlRow(WeightDType dtype, const uint8_t* row, int64_t cols, const float* x,
                int64_t x_stride, int64_t tokens, float* y);

// The same without SIMD, whatever the CPU: for tests comparing the two.
bool DecodeGgmlBlocksPortable(WeightDType dtype, const uint8_t* src, int64_t blocks, float* out);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_GGML_BLOCKS_H_
