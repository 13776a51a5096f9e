#include "kernels/cpu/kv_float_avx512.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
// GCC 12 reports the `_mm512_undefined_*` placeholders inside its own AVX-512 intrinsics
// (conversions) as maybe-uninitialized once they are inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include "kernels/cpu/prefetch.h"
#include "kernels/cpu/simd_x86.h"
#include "kernels/kv_dtype.h"

namespace kvgrid::kernels::cpu {

#if defined(__x86_64__)

namespace {

#define KVGRID_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

constexpr int64_t kTileRows = 16;       // rows reduced together (dot), or walked per chunk (axpy)
constexpr int64_t kTileChannels = 256;  // channels of a row decoded at once (dot)
constexpr int64_t kMaxHeads = 8;        // heads whose accumulators stay in registers (axpy)

template <KvDType D>
constexpr int64_t kValueBytes = D == KvDType::kF32 ? 4 : 2;

// Channels i..i+15 of a row as floats; lanes outside `mask` read nothing and give 0.
template <KvDType D>
KVGRID_AVX512 inline __m512 Load16(const uint8_t* row, int64_t i, __mmask16 mask) {
  if constexpr (D == KvDType::kF32) {
    return _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float*>(row) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, row + 2 * i);
    if constexpr (D == KvDType::kF16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}
template <KvDType D>
KVGRID_AVX512 inline __m512 Load16(const uint8_t* row, int64_t i) {
  if constexpr (D == KvDType::kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i));
    if constexpr (D == KvDType::kF16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// Lane r of the result is the sum of the 16 lanes of a[r].
KVGRID_AVX512 inline __m512 ReduceRows16(const __m512 a[16]) {
  __m512 p[8], q[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: [a0 x+z, a1 x+z, a0 y+w, a1 y+w]
    p[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per block: rows 4i..4i+3, partial over the block
    const __m512d x = _mm512_castps_pd(p[2 * i]), y = _mm512_castps_pd(p[2 * i + 1]);
    q[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Sum the four blocks of each q[i] into block i of the result.
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The rows whose lines the kernels ask for: `ahead`'s, else their own (which they read anyway,
// so a request costs only its load slot); this keeps branches out of the loops.
inline const uint8_t* AheadOr(KvRows ahead, const uint8_t* v) {
  return ahead.values != nullptr ? static_cast<const uint8_t*>(ahead.values) : v;
}

template <KvDType D>
KVGRID_AVX512 void DotFloat(const void* values, int64_t n, int64_t rows, const float* q,
                            int64_t num_q, float* scores, int64_t score_stride,
                            KvRows ahead) {
  const auto* v = static_cast<const uint8_t*>(values);
  const uint8_t* a = AheadOr(ahead, v);
  const int64_t row_bytes = n * kValueBytes<D>;
  alignas(64) float tile[kTileRows][kTileChannels];  // decoded rows, 0 past the tile's rows
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t tr = std::min(kTileRows, rows - r0);
    const __mmask16 row_mask = LaneMask16(tr);
    // Longer rows in pieces of kTileChannels, each piece's sums added to the scores.
    for (int64_t c0 = 0; c0 < n; c0 += kTileChannels) {
      const int64_t units = (std::min(kTileChannels, n - c0) + 15) / 16;
      const __mmask16 last = LaneMask16(n - c0 - 16 * (units - 1));
      for (int64_t r = 0; r < tr; ++r) {
        const uint8_t* row = v + (r0 + r) * row_bytes;
        for (int64_t u = 0; u + 1 < units; ++u) {
          _mm512_store_ps(tile[r] + 16 * u, Load16<D>(row, c0 + 16 * u));
        }
        _mm512_store_ps(tile[r] + 16 * (units - 1), Load16<D>(row, c0 + 16 * (units - 1), last));
      }
      // The 16 accumulators are registers only with a fixed row count: absent rows are 0.
      for (int64_t r = tr; r < kTileRows; ++r) std::memset(tile[r], 0, sizeof(float) * 16 * units);
      // The same rows and channels of `a`, lines_per_row lines a row, spread over the heads.
      const int64_t lines_per_row =
          (16 * units * kValueBytes<D> + kCacheLineBytes - 1) / kCacheLineBytes;
      const int64_t lines = tr * lines_per_row;
      const int64_t lines_per_head = (lines + num_q - 1) / std::max<int64_t>(num_q, 1);
      const uint8_t* a_piece = a + r0 * row_bytes + c0 * kValueBytes<D>;
      int64_t a_row = 0, a_line = 0;  // the next line to ask for
      for (int64_t h = 0; h < num_q; ++h) {
        for (int64_t i = 0; i < lines_per_head && a_row < tr; ++i) {
          PrefetchLine(a_piece + a_row * row_bytes + kCacheLineBytes * a_line);
          if (++a_line == lines_per_row) {
            a_line = 0;
            ++a_row;
          }
        }
        const float* qh = q + h * n + c0;
        __m512 acc[kTileRows];
        for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t u = 0; u < units; ++u) {
          const __m512 qu = u + 1 < units ? _mm512_loadu_ps(qh + 16 * u)
                                          : _mm512_maskz_loadu_ps(last, qh + 16 * u);
          for (int r = 0; r < kTileRows; ++r) {
            acc[r] = _mm512_fmadd_ps(qu, _mm512_load_ps(tile[r] + 16 * u), acc[r]);
          }
        }
        __m512 s = ReduceRows16(acc);
        float* out = scores + h * score_stride + r0;
        if (c0 > 0) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(row_mask, out));
        _mm512_mask_storeu_ps(out, row_mask, s);
      }
    }
  }
}

// out[h * n + c + i] += sum_r p[h * p_stride + r] * row r's channel c + i, for h < H and
// i < 16 U, the last 16 lanes limited to `last`; asks for the lines of `a`'s rows that hold
// those channels. Each weight is broadcast straight from `p`: gathering a tile's weights
// row-major first (16 H scalar loads and stores) made a tile of 16 fp16 rows of 64 channels
// and 7 heads take 130 ns instead of 112 in L2. Inlined by force: GCC 12 otherwise keeps it
// out of line and stores every accumulator to the stack each row.
template <KvDType D, int H, int U>
KVGRID_AVX512 inline __attribute__((always_inline)) void AxpyChunk(
    const uint8_t* v, int64_t row_bytes, int64_t rows, const float* p, int64_t p_stride,
    float* out, int64_t n, int64_t c, __mmask16 last, const uint8_t* a) {
  // 16 channels are 64 bytes of fp32 and 32 of fp16/bf16: a line every 4 / bytes units.
  constexpr int kUnitsPerLine = 4 / kValueBytes<D>;
  __m512 acc[H][U];
  for (int h = 0; h < H; ++h) {
    for (int u = 0; u < U; ++u) {
      acc[h][u] = _mm512_maskz_loadu_ps(u + 1 < U ? __mmask16{0xffff} : last,
                                        out + h * n + c + 16 * u);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = v + r * row_bytes;
    for (int u = 0; u < U; u += kUnitsPerLine) {
      PrefetchLine(a + r * row_bytes + (c + 16 * u) * kValueBytes<D>);
    }
    __m512 x[U];
    for (int u = 0; u + 1 < U; ++u) x[u] = Load16<D>(row, c + 16 * u);
    x[U - 1] = Load16<D>(row, c + 16 * (U - 1), last);
    for (int h = 0; h < H; ++h) {
      const __m512 wh = _mm512_set1_ps(p[h * p_stride + r]);
      for (int u = 0; u < U; ++u) acc[h][u] = _mm512_fmadd_ps(wh, x[u], acc[h][u]);
    }
  }
  for (int h = 0; h < H; ++h) {
    for (int u = 0; u < U; ++u) {
      _mm512_mask_storeu_ps(out + h * n + c + 16 * u, u + 1 < U ? __mmask16{0xffff} : last,
                            acc[h][u]);
    }
  }
}

// AxpyFloat for H heads, in tiles of kTileRows rows, each walked once per chunk of channels
// (its lines stay in L1 from one chunk to the next).
template <KvDType D, int H>
KVGRID_AVX512 void AxpyHeads(const uint8_t* v, int64_t n, int64_t rows, const float* p,
                             int64_t p_stride, float* out, const uint8_t* a) {
  const int64_t row_bytes = n * kValueBytes<D>;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t tr = std::min(kTileRows, rows - r0);
    const uint8_t* vt = v + r0 * row_bytes;
    const uint8_t* at = a + r0 * row_bytes;
    const float* pt = p + r0;
    int64_t c = 0;
    for (; c + 32 <= n; c += 32) {
      AxpyChunk<D, H, 2>(vt, row_bytes, tr, pt, p_stride, out, n, c, 0xffff, at);
    }
    for (; c < n; c += 16) {
      AxpyChunk<D, H, 1>(vt, row_bytes, tr, pt, p_stride, out, n, c, LaneMask16(n - c), at);
    }
  }
}

template <KvDType D>
KVGRID_AVX512 void AxpyFloat(const void* values, int64_t n, int64_t rows, const float* p,
                             int64_t num_q, int64_t p_stride, float* out, KvRows ahead) {
  const auto* v = static_cast<const uint8_t*>(values);
  // More than kMaxHeads heads pass over the rows again; only the first pass asks for `ahead`.
  const uint8_t* a = AheadOr(ahead, v);
  for (int64_t h0 = 0; h0 < num_q; h0 += kMaxHeads) {
    if (h0 > 0) a = v;
    const float* ph = p + h0 * p_stride;
    float* oh = out + h0 * n;
    switch (std::min(kMaxHeads, num_q - h0)) {
      case 1: AxpyHeads<D, 1>(v, n, rows, ph, p_stride, oh, a); break;
      case 2: AxpyHeads<D, 2>(v, n, rows, ph, p_stride, oh, a); break;
      case 3: AxpyHeads<D, 3>(v, n, rows, ph, p_stride, oh, a); break;
      case 4: AxpyHeads<D, 4>(v, n, rows, ph, p_stride, oh, a); break;
      case 5: AxpyHeads<D, 5>(v, n, rows, ph, p_stride, oh, a); break;
      case 6: AxpyHeads<D, 6>(v, n, rows, ph, p_stride, oh, a); break;
      case 7: AxpyHeads<D, 7>(v, n, rows, ph, p_stride, oh, a); break;
      default: AxpyHeads<D, 8>(v, n, rows, ph, p_stride, oh, a); break;
    }
  }
}

}  // namespace

void DotF32Avx512(const void* values, const void*, int64_t n, int64_t rows, const float* q,
                  int64_t num_q, float* scores, int64_t score_stride, KvRows ahead) {
  DotFloat<KvDType::kF32>(values, n, rows, q, num_q, scores, score_stride, ahead);
}
void DotF16Avx512(const void* values, const void*, int64_t n, int64_t rows, const float* q,
                  int64_t num_q, float* scores, int64_t score_stride, KvRows ahead) {
  DotFloat<KvDType::kF16>(values, n, rows, q, num_q, scores, score_stride, ahead);
}
void DotBf16Avx512(const void* values, const void*, int64_t n, int64_t rows, const float* q,
                   int64_t num_q, float* scores, int64_t score_stride, KvRows ahead) {
  DotFloat<KvDType::kBF16>(values, n, rows, q, num_q, scores, score_stride, ahead);
}
void AxpyF32Avx512(const void* values, const void*, int64_t n, int64_t rows, const float* p,
                   int64_t num_q, int64_t p_stride, float* out, KvRows ahead) {
  AxpyFloat<KvDType::kF32>(values, n, rows, p, num_q, p_stride, out, ahead);
}
void AxpyF16Avx512(const void* values, const void*, int64_t n, int64_t rows, const float* p,
                   int64_t num_q, int64_t p_stride, float* out, KvRows ahead) {
  AxpyFloat<KvDType::kF16>(values, n, rows, p, num_q, p_stride, out, ahead);
}
void AxpyBf16Avx512(const void* values, const void*, int64_t n, int64_t rows, const float* p,
                    int64_t num_q, int64_t p_stride, float* out, KvRows ahead) {
  AxpyFloat<KvDType::kBF16>(values, n, rows, p, num_q, p_stride, out, ahead);
}

#endif  // __x86_64__

}  // namespace kvgrid::kernels::cpu
