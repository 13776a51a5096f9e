// Activations quantized to 8 bits for integer dot products with 8- and 4-bit weight rows, as
// decode runs them: a matrix's input rows are quantized once per call (blocks of 32 along a
// row, one fp32 scale each: d = max|x| / 127, q = round(x / d)), then every weight block is
// multiplied with the matching activation block in integers (AVX2 vpmaddubsw + vpmaddwd, or
// AVX-512 VNNI's vpdpbusd where the CPU has it, chosen at run time) and scaled once by d_w d_x. The weight row is
// read once, as stored, and never widened to fp32.
//
// Error against fp32 activations: each activation moves by at most half its block's step, so
// one output moves by at most sum over blocks b of (d_x,b / 2) sum_{i in b} |w_i| (plus fp32
// rounding); Int8DotErrorBound computes it for tests.
//
// Thread-safety: stateless; Q8Activations is the caller's.
#ifndef KVGRID_KERNELS_CPU_Q8_ACTIVATIONS_H_
#define KVGRID_KERNELS_CPU_Q8_ACTIVATIONS_H_

#include <cstdint>
#include <vector>

#include "kernels/cpu/quant_linear.h"

namespace kvgrid::kernels::cpu {

// Up to this many tokens share one pass over each weight row in Int8DotRow.
inline constexpr int64_t kInt8DotMaxTokens = 4;

// `tokens` rows of `cols` activations (cols % 32 == 0) in 8 bits.
struct Q8Activations {
  int64_t tokens = 0;
  int64_t cols = 0;
  std::vector<int8_t> q;            // [tokens, cols]
  std::vector<float> scale;         // [tokens, cols / 32]: d of each block
  std::vector<float> scaled_sum;    // [tokens, cols / 32]: d times the sum of the block's q
  std::vector<int32_t> sum;         // [tokens, cols / 32]: the sum of the block's q
};

// Quantizes x [tokens, cols] (row-major, cols % 32 == 0) into `out`, reusing its storage.
// A block of zeros gets scale 0. Uses AVX2 where the CPU has it; the values are the same
// either way (round half to even).
void QuantizeActivations(const float* x, int64_t tokens, int64_t cols, Q8Activations* out);

// The instruction sets the dot products come in; the best the CPU has is chosen at run time.
enum class Int8DotIsa : uint8_t { kPortable, kAvx2, kAvx512Vnni };
[[nodiscard]] Int8DotIsa BestInt8DotIsa();

// Whether Int8DotRow computes `dtype` on this CPU: Q8_0, Q4_0, Q4_1 and Q4_Z with AVX2.
[[nodiscard]] bool HasInt8Dot(WeightDType dtype);

// y[t] = sum over the row's blocks of d_w d_x,t (sum_i q_w,i q_x,t,i) (Q4_1/Q4_Z add
// m_w d_x,t sum_i q_x,t,i) for tokens t in [first, first + count) of `a`, count in
// 1..kInt8DotMaxTokens, for one weight row of a.cols weights at `row` in `dtype`'s blocks.
// Requires HasInt8Dot(dtype). The sums' order is the kernel's own.
void Int8DotRow(WeightDType dtype, const uint8_t* row, const Q8Activations& a, int64_t first,
                int64_t count, float* y);

// Int8DotRow on instruction set `isa`, which the CPU must have (tests compare them).
void Int8DotRowOn(Int8DotIsa isa, WeightDType dtype, const uint8_t* row, const Q8Activations& a,
                  int64_t first, int64_t count, float* y);

// The same in plain C++, whatever the CPU (for tests comparing the two; integer sums are
// exact, so only the order of the fp32 sums differs).
void Int8DotRowPortable(WeightDType dtype, const uint8_t* row, const Q8Activations& a,
                        int64_t first, int64_t count, float* y);

// The bound above for token t of x [tokens, cols] against weight row `w` [cols] (fp32, as
// dequantized): how far Int8DotRow's result may be from the fp32 dot product, before fp32
// rounding.
[[nodiscard]] double Int8DotErrorBound(const float* w, const float* x_row, int64_t cols);

}  // namespace kvgrid::kernels::cpu

#endif  // KVGRID_KERNELS_CPU_Q8_ACTIVATIONS_H_
