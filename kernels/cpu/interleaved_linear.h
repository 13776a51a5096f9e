// Q8_0, Q4_0, Q4_1 and Q4_Z matrices with their rows interleaved 16 at a time, multiplied with 8-bit
// activations by AVX-512 VNNI: one 512-bit register holds 4 consecutive weights of each of 16
// rows, so one vpdpbusd with 4 activation bytes broadcast advances 16 rows' dot products at
// once, each in its own lane. No horizontal sums, one activation load per 16 rows, and the
// 16 rows' block scales are one vector: a decode GEMV runs near the memory's speed, and a
// batch of tokens shares each weight register (batched decode and prefill, as llama.cpp's
// repacked CPU layouts do).
//
// Layout (QuantMatrix::interleaved): rows in groups of 16; a group holds its blocks in order,
// block b of the group being the 16 rows' fp16 scales (32 bytes), for Q4_1/Q4_Z their 16 fp16
// offsets or zero points (32 bytes), then the weights in chunks of 64 bytes, chunk j holding 4
// bytes per row (row r at bytes 4r..4r+3):
//   Q8_0: 8 chunks; byte i of row r in chunk j is q[r][4j + i] + 128 (unsigned).
//   Q4_*: 4 chunks; byte i of row r in chunk j is q[r][4j + i] | q[r][16 + 4j + i] << 4, the
//         nibbles 0..15 as the formats store them.
// A group's block takes 16 times the bytes of one row's block, so the matrix keeps its size.
//
// The unsigned weights (q + 128, or Q4_0's nibble for q - 8) against signed activations add
// 128 (8) times the activation block's sum to each dot product, which the kernel subtracts in
// integers (Q8Activations::sum): the result is exactly Int8DotRow's integer sum. Q4_1's and
// Q4_Z's offsets m (w = d q + m) add m d_x sum(q_x) in floats.
//
// Thread-safety: stateless.
#ifndef KVGRID_KERNELS_CPU_INTERLEAVED_LINEAR_H_
#define KVGRID_KERNELS_CPU_INTERLEAVED_LINEAR_H_

#include <cstdint>

#include "kernels/cpu/q8_activations.h"
#include "kernels/cpu/quant_linear.h"

namespace kvgrid::kernels::cpu {

inline constexpr int64_t kInterleaveRows = 16;

// Whether this CPU runs the interleaved kernels (AVX-512 F, BW, VL and VNNI).
[[nodiscard]] bool HaveInterleavedInt8();

// Whether `m` can be interleaved: Q8_0, Q4_0, Q4_1 or Q4_Z, rows a multiple of 16, no
// input_perm, not interleaved already.
[[nodiscard]] bool CanInterleave(const QuantMatrix& m);

// Rewrites `m` in the interleaved layout (in place; a transient copy of its data). Does nothing
// when !CanInterleave(m).
void InterleaveRows(QuantMatrix* m);

// The row-major blocks of an interleaved matrix (a copy): what a device upload or a row slice
// reads. `m` itself when it is not interleaved.
[[nodiscard]] QuantMatrix RowMajor(const QuantMatrix& m);

// out[0, cols) = row `row` of interleaved `m` as fp32 (as DequantizeRow for row-major blocks).
void DequantizeInterleavedRow(const QuantMatrix& m, int64_t row, float* out);

// Whether this CPU and kernel give the process AMX-INT8 tiles (Sapphire Rapids and later, Linux
// 5.16 and later; asked once, arch_prctl ARCH_REQ_XCOMP_PERM).
[[nodiscard]] bool HaveAmxInt8();

// Where the integer products of InterleavedInt8LinearOn run: vpdpbusd (AVX-512 VNNI) for every
// token, or AMX tile products for each whole 16 tokens (the rest by VNNI). The results are
// bit-identical: only the integer sums move.
enum class Int8TileUnit : uint8_t { kVnni, kAmx };

// output[t * ldo + j] (+)= sum over blocks of d_w d_x,t (q_w . q_x,t) (+ bias[j]) for every
// token t of `a` and row j of interleaved `w` (a.cols == w.cols). Requires
// HaveInterleavedInt8(); uses AMX where HaveAmxInt8(). Parallel over row groups (OpenMP).
void InterleavedInt8Linear(const QuantMatrix& w, const Q8Activations& a, const float* bias,
                           float* output, int64_t ldo, bool accumulate);

// The same on `unit` (kAmx runs VNNI where !HaveAmxInt8()): for tests and benchmarks comparing
// them.
void InterleavedInt8LinearOn(Int8TileUnit unit, const QuantMatrix& w, const Q8Activations& a,
                             const float* bias, float* output, int64_t ldo, bool accumulate);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_INTERLEAVED_LINEAR_H_
