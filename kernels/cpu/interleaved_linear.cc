#include "kernels/cpu/interleaved_linear.h"

#include <immintrin.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/huge_pages.h"
#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

constexpr int64_t kScaleBytes = 2 * kInterleaveRows;  // one fp16 field of the 16 rows

// The 16 rows' fp16 scales, then for Q4_1 and Q4_Z their offsets or zero points.
int64_t GroupHeaderBytes(WeightDType dtype) {
  return dtype == WeightDType::kQ4_1 || dtype == WeightDType::kQ4_Z ? 4 * kInterleaveRows
                                                                     : 2 * kInterleaveRows;
}

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return model::F16ToF32(h);
}

// Bytes of one group's block (16 rows' blocks) and of its weight chunks.
int64_t GroupBlockBytes(WeightDType dtype) {
  return kInterleaveRows * QuantMatrix::BlockBytes(dtype);
}

// Where row `row`'s block `b` starts in an interleaved matrix: its group's block.
const uint8_t* GroupBlock(const QuantMatrix& m, int64_t row, int64_t b) {
  const int64_t blocks = m.cols / kQuantBlock;
  const int64_t g = row / kInterleaveRows;
  return m.data.data() + (g * blocks + b) * GroupBlockBytes(m.dtype);
}

// Tokens one call of the kernel carries through a group (its accumulators stay in registers).
constexpr int64_t kTileTokens = 8;
// Tokens whose activations one pass over the row groups reads (so they stay in L2).
constexpr int64_t kChunkTokens = 64;
// Above this many 16-row blocks times tokens (64 Ki weight-token products, as the other
// kernels), a call runs on all threads: one core streams about half of the machine's memory
// bandwidth, so a batch-1 q/k/v or o matrix (2,016 and 1,568 blocks in Qwen2-0.5B) ran at
// ~10 GB/s on one thread and ~20 GB/s on two (decode +8-10%, bench/RESULTS.md).
constexpr int64_t kParallelBlocks = 128;

#if defined(__x86_64__)
#define KVGRID_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

// Activations p[0..3] in every 32-bit lane (one vpbroadcastd, or vpdpbusd's {1to16} operand).
KVGRID_AVX512_VNNI inline __m512i Broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// The 16 rows of one group against T tokens of `a` from `first`: acc[t] lane r is row r's dot
// product with token first + t over all the group's blocks.
// Format D's block in an interleaved group (the header's layout).
template <WeightDType D>
struct GroupFormat {
  // Q4_1's and Q4_Z's second fp16 field per row: their offsets or zero points.
  static constexpr bool kSecondHalf = D == WeightDType::kQ4_1 || D == WeightDType::kQ4_Z;
  static constexpr int64_t kHeader = (kSecondHalf ? 4 : 2) * kInterleaveRows;
  static constexpr int64_t kGroupBlock =
      kHeader + kInterleaveRows * (D == WeightDType::kQ8_0 ? 32 : 16);
  // The unsigned weights' offset times the activation block's sum, subtracted in integers
  // (Q4_1's and Q4_Z's offsets are per row: added in floats, m d_x sum(q_x)).
  static constexpr uint32_t kOffset =
      D == WeightDType::kQ8_0 ? 128 : D == WeightDType::kQ4_0 ? 8 : 0;
};

// The first tile over a group streams it from memory (simd_x86.h's kStreamPrefetchBytes);
// later tiles read it from cache.
template <WeightDType D>
inline void PrefetchBlock(const uint8_t* blk) {
  for (int64_t o = 0; o < GroupFormat<D>::kGroupBlock; o += 64) {
    PrefetchAhead(blk + o, kStreamPrefetchBytes);
  }
}

// What the integer sum of a block starts from: minus the weights' offset times the activation
// block's sum `xsum` (int32 arithmetic, as the sums wrap).
template <WeightDType D>
KVGRID_AVX512_VNNI inline __m512i OffsetStart(int32_t xsum) {
  return _mm512_set1_epi32(
      static_cast<int32_t>(0u - GroupFormat<D>::kOffset * static_cast<uint32_t>(xsum)));
}

// The 16 rows' scales d of block `blk` and, for Q4_1/Q4_Z, their offsets m of w = d q + m
// (zero otherwise). The maskz forms: GCC 12 warns that the plain conversions read an
// undefined vector.
template <WeightDType D>
KVGRID_AVX512_VNNI inline void BlockScales(const uint8_t* blk, __m512* dw, __m512* offset) {
  *dw = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  *offset = _mm512_setzero_ps();
  if constexpr (GroupFormat<D>::kSecondHalf) {
    const __m512 second = _mm512_maskz_cvtph_ps(
        0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
    *offset = D == WeightDType::kQ4_1 ? second
                                      : _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(*dw, second));
  }
}

// One token's block into its accumulator: d_w d_x times the integer sum `dot`, and for
// Q4_1/Q4_Z m d_x sum(q_x) (`xss`).
template <WeightDType D>
KVGRID_AVX512_VNNI inline __m512 AddBlock(__m512 acc, __m512i dot, __m512 dw, __m512 offset,
                                          float xd, float xss) {
  acc = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, dot),
                        _mm512_mul_ps(dw, _mm512_set1_ps(xd)), acc);
  if constexpr (GroupFormat<D>::kSecondHalf) {
    acc = _mm512_fmadd_ps(offset, _mm512_set1_ps(xss), acc);
  }
  return acc;
}

template <WeightDType D, int T>
KVGRID_AVX512_VNNI void GroupDot(const uint8_t* group, int64_t blocks, const Q8Activations& a,
                                 int64_t first, bool prefetch, __m512 acc[T]) {
  constexpr int64_t kHeader = GroupFormat<D>::kHeader;
  constexpr int64_t kGroupBlock = GroupFormat<D>::kGroupBlock;
  constexpr uint32_t kOffset = GroupFormat<D>::kOffset;
  const int8_t* xq[T];
  const float* xd[T];
  const int32_t* xs[T];
  const float* xss[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm512_setzero_ps();
    xq[t] = a.q.data() + (first + t) * a.cols;
    xd[t] = a.scale.data() + (first + t) * blocks;
    xs[t] = a.sum.data() + (first + t) * blocks;
    xss[t] = a.scaled_sum.data() + (first + t) * blocks;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kGroupBlock;
    if (prefetch) PrefetchBlock<D>(blk);
    __m512 dw, offset;
    BlockScales<D>(blk, &dw, &offset);
    const uint8_t* chunks = blk + kHeader;
    __m512i dot[T];
    for (int t = 0; t < T; ++t) {
      dot[t] = kOffset == 0 ? _mm512_setzero_si512() : OffsetStart<D>(xs[t][b]);
    }
    const int8_t* xb[T];
    for (int t = 0; t < T; ++t) xb[t] = xq[t] + b * kQuantBlock;
    if constexpr (D == WeightDType::kQ8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_loadu_si512(chunks + 64 * j);
        for (int t = 0; t < T; ++t) dot[t] = _mm512_dpbusd_epi32(dot[t], w, Broadcast4(xb[t] + 4 * j));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i packed = _mm512_loadu_si512(chunks + 64 * j);
        const __m512i lo = _mm512_and_si512(packed, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        for (int t = 0; t < T; ++t) {
          dot[t] = _mm512_dpbusd_epi32(dot[t], lo, Broadcast4(xb[t] + 4 * j));
          dot[t] = _mm512_dpbusd_epi32(dot[t], hi, Broadcast4(xb[t] + 16 + 4 * j));
        }
      }
    }
    for (int t = 0; t < T; ++t) acc[t] = AddBlock<D>(acc[t], dot[t], dw, offset, xd[t][b], xss[t][b]);
  }
}

// acc[t] (+ the 16 rows' bias) written, or added, to out[t * ldo, t * ldo + 16) for t < T.
template <int T>
KVGRID_AVX512_VNNI inline void StoreTile(const __m512 acc[T], const float* bias, float* out,
                                         int64_t ldo, bool accumulate) {
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int t = 0; t < T; ++t) {
    float* y = out + t * ldo;
    __m512 v = _mm512_add_ps(acc[t], b);
    if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(y));
    _mm512_storeu_ps(y, v);
  }
}

// Rows [16 g, 16 g + 16) for tokens [first, first + T): written (or added) to the output.
template <WeightDType D, int T>
KVGRID_AVX512_VNNI void GroupTile(const uint8_t* group, int64_t blocks, const Q8Activations& a,
                                  int64_t first, bool prefetch, const float* bias, float* out,
                                  int64_t ldo, bool accumulate) {
  __m512 acc[T];
  GroupDot<D, T>(group, blocks, a, first, prefetch, acc);
  StoreTile<T>(acc, bias, out + first * ldo, ldo, accumulate);
}

using TileFn = void (*)(const uint8_t*, int64_t, const Q8Activations&, int64_t, bool,
                        const float*, float*, int64_t, bool);

template <WeightDType D>
TileFn TileFor(int64_t tokens) {
  switch (tokens) {
    case 1: return GroupTile<D, 1>;
    case 2: return GroupTile<D, 2>;
    case 3: return GroupTile<D, 3>;
    case 4: return GroupTile<D, 4>;
    case 5: return GroupTile<D, 5>;
    case 6: return GroupTile<D, 6>;
    case 7: return GroupTile<D, 7>;
    default: return GroupTile<D, 8>;
  }
}
TileFn TileFor(WeightDType dtype, int64_t tokens) {
  switch (dtype) {
    case WeightDType::kQ8_0: return TileFor<WeightDType::kQ8_0>(tokens);
    case WeightDType::kQ4_0: return TileFor<WeightDType::kQ4_0>(tokens);
    case WeightDType::kQ4_1: return TileFor<WeightDType::kQ4_1>(tokens);
    default: return TileFor<WeightDType::kQ4_Z>(tokens);
  }
}

// AMX (Sapphire Rapids and later): one tile product per block multiplies kAmxTokens tokens'
// 32 activations with the group's 16 rows. The interleaved chunks are the B tile's layout as
// they stand (row j of the tile: 4 consecutive inputs of each of the 16 rows; Q4_*'s nibbles
// are unpacked into 8 such rows first); the activations are the A tile, read in place (one row
// per token, a row of `a` apart). The tile's int32 sums then take GroupDot's offset, scale and
// accumulation in the same order, so the results are bit-identical to the VNNI kernel's; only
// the integer products move to the tile unit (16 x 16 x 32 per instruction; vpdpbusd: 16 x 4).
//
// Blocks overlap. With one set of tiles and each block's sums scaled as soon as they were
// stored, about 70% of the Q4_0 kernel's samples (perf, 16 sequences) sat on three waits: the
// tile load of weights just unpacked, the product, and the store of its sums ahead of their
// loads. Now two tile sets alternate: block b + 1's product is asked for before block b's
// sums are stored, and those are scaled after block b + 1's are stored; Q4_*'s weights are
// unpacked kAmxStage blocks at a time, Q4_0's as signed bytes (kAmxSignedStage). Measured in
// bench/RESULTS.md, with what was slower (staging Q8_0's weights signed too, which costs it
// a staging pass; storing each block's sums right after its product; unpacking a stage
// ahead).
#define KVGRID_AMX \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

constexpr int64_t kAmxTokens = 16;
constexpr int64_t kAmxStage = 8;  // Q4_* blocks unpacked at a time: 4 KiB

// Tiles 0 and 3: the int32 sums (16 tokens x 16 rows); 1 and 4: activations (16 tokens x 32
// bytes); 2 and 5: one block's weights (8 rows of 64 bytes). GCC's tile intrinsics paste
// these numbers into the instructions' text, so they are literals below.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 32, 64, 64, 32, 64};
  uint8_t rows[16] = {kAmxTokens, kAmxTokens, 8, kAmxTokens, kAmxTokens, 8};
};

KVGRID_AMX void ConfigureTiles() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

KVGRID_AMX void ReleaseTiles() { _tile_release(); }

// Q4_0's nibbles are staged less their offset of 8, as signed bytes: the tile product
// (signed by signed) is then the block's whole integer sum, the same int32 that the VNNI
// kernel reaches from -8 times the activations' sum, and no token's sums need that added.
template <WeightDType D>
inline constexpr bool kAmxSignedStage = D == WeightDType::kQ4_0;

// Q4_*'s blocks [b0, b1) unpacked into stage[b - b0]: each chunk's low nibbles, then its high
// ones, 8 rows of 64 bytes a block (Q4_0's less 8).
template <WeightDType D>
KVGRID_AMX void UnpackNibbles(const uint8_t* group, int64_t b0, int64_t b1,
                              uint8_t (*stage)[8 * 64]) {
  constexpr int64_t kHeader = GroupFormat<D>::kHeader;
  constexpr int64_t kGroupBlock = GroupFormat<D>::kGroupBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i offset = _mm512_set1_epi8(kAmxSignedStage<D> ? 8 : 0);
  // GCC's tile loads are asm statements that name no memory: no store moves across this.
  asm volatile("" ::: "memory");
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* chunks = group + b * kGroupBlock + kHeader;
    uint8_t* out = stage[b - b0];
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(chunks + 64 * j);
      const __m512i lo = _mm512_and_si512(packed, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      _mm512_store_si512(out + 64 * j, kAmxSignedStage<D> ? _mm512_sub_epi8(lo, offset) : lo);
      _mm512_store_si512(out + 64 * (4 + j), kAmxSignedStage<D> ? _mm512_sub_epi8(hi, offset) : hi);
    }
  }
  asm volatile("" ::: "memory");
}

// Block b's weights as the B tile reads them: Q8_0's in place; Q4_*'s from `stage`, the next
// kAmxStage blocks unpacked when b starts them. Prefetches as GroupDot does, 3 KiB ahead: a
// stage of 8 reads 2.3-2.6 KiB from block b, inside that (16 blocks read past it and measured
// 6-8% slower; a stage unpacked ahead, slower still).
template <WeightDType D>
KVGRID_AMX inline const uint8_t* AmxWeights(const uint8_t* group, int64_t b, int64_t blocks,
                                            bool prefetch, uint8_t (*stage)[8 * 64]) {
  constexpr int64_t kGroupBlock = GroupFormat<D>::kGroupBlock;
  if (prefetch) PrefetchBlock<D>(group + b * kGroupBlock);
  if constexpr (D == WeightDType::kQ8_0) {
    (void)blocks, (void)stage;
    return group + b * kGroupBlock + GroupFormat<D>::kHeader;
  } else {
    if (b % kAmxStage == 0) UnpackNibbles<D>(group, b, std::min(blocks, b + kAmxStage), stage);
    return stage[b % kAmxStage];
  }
}

// Block b's int32 sums (`sums`, 16 tokens x 16 rows) into the tokens' accumulators, as
// GroupDot adds a block.
template <WeightDType D>
KVGRID_AMX inline void ScaleSumsAmx(const int32_t* sums, const uint8_t* group, int64_t b,
                                    int64_t blocks, const float* xd, const int32_t* xs,
                                    const float* xss, __m512 acc[kAmxTokens]) {
  __m512 dw, offset;
  BlockScales<D>(group + b * GroupFormat<D>::kGroupBlock, &dw, &offset);
  for (int t = 0; t < kAmxTokens; ++t) {
    __m512i dot = _mm512_load_si512(sums + t * kInterleaveRows);
    if constexpr (GroupFormat<D>::kOffset != 0 && !kAmxSignedStage<D>) {
      dot = _mm512_add_epi32(dot, OffsetStart<D>(xs[t * blocks + b]));
    }
    acc[t] = AddBlock<D>(acc[t], dot, dw, offset, xd[t * blocks + b], xss[t * blocks + b]);
  }
}

// Block b's tile product on tile set kSet (0: tiles 0-2, 1: tiles 3-5): signed activations
// (A) times the weights (B: unsigned, Q4_0's signed) into zeroed int32 sums.
template <WeightDType D, int kSet>
KVGRID_AMX inline void IssueAmx(const uint8_t* group, int64_t b, int64_t blocks,
                                const Q8Activations& a, const int8_t* xq, bool prefetch,
                                uint8_t (*stage)[8 * 64]) {
  const uint8_t* w = AmxWeights<D>(group, b, blocks, prefetch, stage);
  if constexpr (kSet == 0) {
    _tile_zero(0);
    _tile_loadd(1, xq + b * kQuantBlock, a.cols);
    _tile_loadd(2, w, 64);
    if constexpr (kAmxSignedStage<D>) {
      _tile_dpbssd(0, 1, 2);
    } else {
      _tile_dpbsud(0, 1, 2);
    }
  } else {
    _tile_zero(3);
    _tile_loadd(4, xq + b * kQuantBlock, a.cols);
    _tile_loadd(5, w, 64);
    if constexpr (kAmxSignedStage<D>) {
      _tile_dpbssd(3, 4, 5);
    } else {
      _tile_dpbsud(3, 4, 5);
    }
  }
}

template <WeightDType D>
KVGRID_AMX void GroupTileAmx(const uint8_t* group, int64_t blocks, const Q8Activations& a,
                             int64_t first, bool prefetch, const float* bias, float* out,
                             int64_t ldo, bool accumulate) {
  constexpr int T = kAmxTokens;
  alignas(64) int32_t sums[2][T * kInterleaveRows];  // [even, odd blocks][token][row]
  // Q4_*'s unpacked weights: [block % kAmxStage][8 tile rows of 64 bytes].
  alignas(64) uint8_t stage[D == WeightDType::kQ8_0 ? 1 : kAmxStage][8 * 64];
  const int8_t* xq = a.q.data() + first * a.cols;  // [token][cols]
  // [token][block]: the activation blocks' scales, integer sums, and scales times sums.
  const float* xd = a.scale.data() + first * blocks;
  const int32_t* xs = a.sum.data() + first * blocks;
  const float* xss = a.scaled_sum.data() + first * blocks;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  if (blocks == 0) {
    StoreTile<T>(acc, bias, out + first * ldo, ldo, accumulate);
    return;
  }
  // Block b on tile set b % 2: block b + 1's product is asked for before block b's sums are
  // stored, and block b - 1's sums, stored a block earlier, are scaled after. GCC's tile
  // stores name no memory either: barriers keep each buffer's loads on the right side of its
  // stores.
  IssueAmx<D, 0>(group, 0, blocks, a, xq, prefetch, stage);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) {
      if (b % 2 == 0) {
        IssueAmx<D, 1>(group, b + 1, blocks, a, xq, prefetch, stage);
      } else {
        IssueAmx<D, 0>(group, b + 1, blocks, a, xq, prefetch, stage);
      }
    }
    asm volatile("" ::: "memory");  // block b - 2's loads of this buffer stay before the store
    if (b % 2 == 0) {
      _tile_stored(0, sums[0], 64);
    } else {
      _tile_stored(3, sums[1], 64);
    }
    asm volatile("" ::: "memory");  // and block b's after it
    if (b > 0) ScaleSumsAmx<D>(sums[(b - 1) % 2], group, b - 1, blocks, xd, xs, xss, acc);
  }
  ScaleSumsAmx<D>(sums[(blocks - 1) % 2], group, blocks - 1, blocks, xd, xs, xss, acc);
  StoreTile<T>(acc, bias, out + first * ldo, ldo, accumulate);
}

TileFn AmxTileFor(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::kQ8_0: return GroupTileAmx<WeightDType::kQ8_0>;
    case WeightDType::kQ4_0: return GroupTileAmx<WeightDType::kQ4_0>;
    case WeightDType::kQ4_1: return GroupTileAmx<WeightDType::kQ4_1>;
    default: return GroupTileAmx<WeightDType::kQ4_Z>;
  }
}
#endif  // __x86_64__

}  // namespace

bool HaveInterleavedInt8() {
#if defined(__x86_64__)
  static const bool have = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return have;
#else
  return false;
#endif
}

bool HaveAmxInt8() {
#if defined(__x86_64__)
  static const bool have = [] {
    if (!HaveInterleavedInt8()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0) return false;  // AMX-TILE, AMX-INT8
    // Linux hands out the tile registers' state only on request (5.16 and later); a kernel
    // or a tool (valgrind) that refuses leaves the VNNI kernels.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return have;
#else
  return false;
#endif
}

bool CanInterleave(const QuantMatrix& m) {
  return (m.dtype == WeightDType::kQ8_0 || m.dtype == WeightDType::kQ4_0 ||
          m.dtype == WeightDType::kQ4_1 || m.dtype == WeightDType::kQ4_Z) &&
         !m.interleaved &&
         m.rows > 0 && m.rows % kInterleaveRows == 0 && m.input_perm.empty() &&
         m.cols % kQuantBlock == 0 &&
         static_cast<int64_t>(m.data.size()) == m.rows * m.RowBytes();
}

void InterleaveRows(QuantMatrix* m) {
  if (!CanInterleave(*m)) return;
  const int64_t blocks = m->cols / kQuantBlock, bb = QuantMatrix::BlockBytes(m->dtype);
  const int64_t gbb = GroupBlockBytes(m->dtype), row_bytes = m->RowBytes();
  const bool q8 = m->dtype == WeightDType::kQ8_0;
  const int64_t header = GroupHeaderBytes(m->dtype), fields = header / kScaleBytes;
  std::vector<uint8_t> out;
  out.reserve(m->data.size());
  AdviseHugePages(out.data(), m->data.size());
  out.resize(m->data.size());
  const int64_t groups = m->rows / kInterleaveRows;
#pragma omp parallel for schedule(static) if (groups > 64)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* dst = out.data() + (g * blocks + b) * gbb;
      for (int64_t r = 0; r < kInterleaveRows; ++r) {
        const uint8_t* src = m->data.data() + (g * kInterleaveRows + r) * row_bytes + b * bb;
        for (int64_t f = 0; f < fields; ++f) {  // the fp16 scale (and offset or zero point)
          std::memcpy(dst + f * kScaleBytes + 2 * r, src + 2 * f, 2);
        }
        const uint8_t* values = src + 2 * fields;
        uint8_t* chunks = dst + header;
        if (q8) {
          for (int j = 0; j < 8; ++j) {
            for (int i = 0; i < 4; ++i) {
              chunks[64 * j + 4 * r + i] = static_cast<uint8_t>(values[4 * j + i] ^ 0x80);
            }
          }
        } else {
          // Value v is the low nibble of byte v (v < 16) or the high nibble of byte v - 16.
          const auto nibble = [&](int v) {
            return v < 16 ? values[v] & 0x0F : values[v - 16] >> 4;
          };
          for (int j = 0; j < 4; ++j) {
            for (int i = 0; i < 4; ++i) {
              chunks[64 * j + 4 * r + i] =
                  static_cast<uint8_t>(nibble(4 * j + i) | nibble(16 + 4 * j + i) << 4);
            }
          }
        }
      }
    }
  }
  m->data = std::move(out);
  m->interleaved = true;
}

QuantMatrix RowMajor(const QuantMatrix& m) {
  if (!m.interleaved) return m;
  QuantMatrix r{.dtype = m.dtype, .rows = m.rows, .cols = m.cols};
  const int64_t blocks = m.cols / kQuantBlock, bb = QuantMatrix::BlockBytes(m.dtype);
  r.data.resize(m.data.size());
  for (int64_t row = 0; row < m.rows; ++row) {
    const int64_t lane = row % kInterleaveRows;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = GroupBlock(m, row, b);
      uint8_t* dst = r.data.data() + row * r.RowBytes() + b * bb;
      const int64_t header = GroupHeaderBytes(m.dtype), fields = header / kScaleBytes;
      for (int64_t f = 0; f < fields; ++f) {
        std::memcpy(dst + 2 * f, src + f * kScaleBytes + 2 * lane, 2);
      }
      uint8_t* values = dst + 2 * fields;
      const uint8_t* chunks = src + header + 4 * lane;
      if (m.dtype == WeightDType::kQ8_0) {
        for (int v = 0; v < 32; ++v) values[v] = chunks[64 * (v / 4) + v % 4] ^ 0x80;
      } else {
        // Byte v of the row's block (values v and v + 16) is kept whole.
        for (int v = 0; v < 16; ++v) values[v] = chunks[64 * (v / 4) + v % 4];
      }
    }
  }
  return r;
}

void DequantizeInterleavedRow(const QuantMatrix& m, int64_t row, float* out) {
  const int64_t blocks = m.cols / kQuantBlock, lane = row % kInterleaveRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = GroupBlock(m, row, b);
    const float d = F16At(blk + 2 * lane);
    const uint8_t* chunks = blk + GroupHeaderBytes(m.dtype) + 4 * lane;
    float* o = out + b * kQuantBlock;
    if (m.dtype == WeightDType::kQ8_0) {
      for (int v = 0; v < 32; ++v) {
        o[v] = d * static_cast<float>(static_cast<int>(chunks[64 * (v / 4) + v % 4]) - 128);
      }
    } else if (m.dtype == WeightDType::kQ4_0) {
      for (int v = 0; v < 16; ++v) {
        const uint8_t byte = chunks[64 * (v / 4) + v % 4];
        o[v] = d * static_cast<float>((byte & 0x0F) - 8);
        o[v + 16] = d * static_cast<float>((byte >> 4) - 8);
      }
    } else {  // w = d q + m, fused as DequantizeRow does for the row-major blocks
      const float second = F16At(blk + kScaleBytes + 2 * lane);
      const float mn = m.dtype == WeightDType::kQ4_1 ? second : -d * second;
      for (int v = 0; v < 16; ++v) {
        const uint8_t byte = chunks[64 * (v / 4) + v % 4];
        o[v] = std::fma(d, static_cast<float>(byte & 0x0F), mn);
        o[v + 16] = std::fma(d, static_cast<float>(byte >> 4), mn);
      }
    }
  }
}

void InterleavedInt8Linear(const QuantMatrix& w, const Q8Activations& a, const float* bias,
                           float* output, int64_t ldo, bool accumulate) {
  // kAmx runs VNNI where the tiles are not there.
  InterleavedInt8LinearOn(Int8TileUnit::kAmx, w, a, bias, output, ldo, accumulate);
}

void InterleavedInt8LinearOn(Int8TileUnit unit, const QuantMatrix& w, const Q8Activations& a,
                             const float* bias, float* output, int64_t ldo, bool accumulate) {
#if defined(__x86_64__)
  const int64_t blocks = w.cols / kQuantBlock, groups = w.rows / kInterleaveRows;
  const int64_t group_bytes = blocks * GroupBlockBytes(w.dtype);
  const TileFn amx_tile =
      unit == Int8TileUnit::kAmx && HaveAmxInt8() ? AmxTileFor(w.dtype) : nullptr;
  for (int64_t c0 = 0; c0 < a.tokens; c0 += kChunkTokens) {
    const int64_t c1 = std::min(a.tokens, c0 + kChunkTokens);
    // Whole tiles of kAmxTokens on the tile unit, the rest (and all of it without AMX) by VNNI.
    const int64_t amx_end = amx_tile ? c0 + (c1 - c0) / kAmxTokens * kAmxTokens : c0;
#pragma omp parallel if (groups * blocks * (c1 - c0) > kParallelBlocks)
    {
      if (amx_end > c0) ConfigureTiles();  // per thread
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = w.data.data() + g * group_bytes;
        const float* b = bias ? bias + g * kInterleaveRows : nullptr;
        float* out = output + g * kInterleaveRows;
        int64_t t = c0;
        for (; t < amx_end; t += kAmxTokens) {
          amx_tile(group, blocks, a, t, /*prefetch=*/t == c0, b, out, ldo, accumulate);
        }
        for (; t < c1; t += kTileTokens) {
          const int64_t n = std::min(kTileTokens, c1 - t);
          const TileFn tile = TileFor(w.dtype, n);
          tile(group, blocks, a, t, /*prefetch=*/t == c0, b, out, ldo, accumulate);
        }
      }
      if (amx_end > c0) ReleaseTiles();
    }
  }
#else
  (void)unit, (void)w, (void)a, (void)bias, (void)output, (void)ldo, (void)accumulate;
#endif
}

}  // namespace kvgrid::kernels::cpu
