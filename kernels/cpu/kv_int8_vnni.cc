#include "kernels/cpu/kv_int8_vnni.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
// GCC 12 reports the `_mm512_undefined_*` placeholders inside its own AVX-512 intrinsics
// (reductions, narrowing conversions) as maybe-uninitialized once they are inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"
#endif

namespace kvgrid::kernels::cpu {

#if defined(__x86_64__)

bool HaveInt8Vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("f16c");
}

namespace {

#define KVGRID_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

constexpr int64_t kTile = 16;  // rows per reduction (dot) and per weight scale (axpy)
constexpr int64_t kMaxChunks = kVnniMaxChannels / 64;

// Lanes [0, n) of a 64-byte chunk.
KVGRID_VNNI inline __mmask64 ByteMask(int64_t n) {
  return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
}

// Rounds x[0, n) to int8 with scale max|x| / 127 into out (zero-padded to `padded` bytes);
// returns the scale and the sum of the codes. A zero row gets scale 0 and codes 0.
KVGRID_VNNI float RoundToInt8(const float* x, int64_t n, int8_t* out, int64_t padded,
                              int32_t* code_sum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(LaneMask16(n - i), x + i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
  }
  const float m = _mm512_reduce_max_ps(amax);
  std::memset(out, 0, padded);
  *code_sum = 0;
  if (!(m > 0.f) || !std::isfinite(m)) return 0.f;
  // x / m first: 127 / m would overflow for a subnormal m.
  const __m512 max = _mm512_set1_ps(m);
  const __m512 full = _mm512_set1_ps(127.f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = LaneMask16(n - i);
    const __m512i c = _mm512_cvtps_epi32(
        _mm512_mul_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), max), full));
    sum = _mm512_add_epi32(sum, c);
    _mm_mask_storeu_epi8(out + i, k, _mm512_cvtsepi32_epi8(c));
  }
  *code_sum = _mm512_reduce_add_epi32(sum);
  return m / 127.f;
}

// Lane r of the result is the sum of the 16 lanes of a[r] (r < 16).
KVGRID_VNNI inline __m512i ReduceRows16(const __m512i a[16]) {
  __m512i p[8], q[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: [a0 x+z, a1 x+z, a0 y+w, a1 y+w]
    p[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                            _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per block: rows 4i..4i+3, partial over the block
    q[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                            _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
  }
  // Sum the four blocks of each q[i] into block i of the result.
  const __m512i z01 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i z23 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_i32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The fp16 row scales of rows [0, rows) (rows <= 16), meta rows 2 bytes apart.
KVGRID_VNNI inline __m512 RowScales(const uint8_t* meta, int64_t rows) {
  const __m256i h = _mm256_maskz_loadu_epi16(LaneMask16(rows), meta);
  return _mm512_cvtph_ps(h);
}

}  // namespace

KVGRID_VNNI bool Int8VnniRounds(const float* x, int64_t n) {
  __mmask16 bad = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(LaneMask16(n - i), x + i));
    // NaN (unordered with itself) or infinite.
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) |
           _mm512_cmp_ps_mask(v, _mm512_set1_ps(3.40282347e38f), _CMP_GT_OQ);
  }
  return bad == 0;
}

KVGRID_VNNI void RoundQueriesInt8(const float* q, int64_t n, int64_t num_q, Int8Query* out) {
  const int64_t padded = (n + 63) / 64 * 64;
  for (int64_t h = 0; h < num_q; ++h) {
    out[h].scale = RoundToInt8(q + h * n, n, out[h].codes, padded, &out[h].code_sum);
  }
}

KVGRID_VNNI void DotInt8VnniPrepared(const void* values, const void* meta, int64_t n,
                                     int64_t rows, const Int8Query* q, int64_t num_q,
                                     float* scores, int64_t score_stride, KvRows ahead) {
  PrefetchRows(ahead, KvRowLayoutFor(KvDType::kInt8, n), rows);
  const auto* v = static_cast<const uint8_t*>(values);
  const auto* m = static_cast<const uint8_t*>(meta);
  const int64_t chunks = (n + 63) / 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  alignas(64) uint8_t tile[kTile][kMaxChunks * 64];  // k + 128, zero codes past n
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t tr = std::min(kTile, rows - r0);
    for (int64_t r = 0; r < tr; ++r) {
      const uint8_t* row = v + (r0 + r) * n;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512i x = _mm512_maskz_loadu_epi8(ByteMask(n - 64 * c), row + 64 * c);
        _mm512_store_si512(tile[r] + 64 * c, _mm512_xor_si512(x, flip));
      }
    }
    const __m512 row_scale = RowScales(m + 2 * r0, tr);
    for (int64_t h = 0; h < num_q; ++h) {
      __m512i acc[kTile];
      for (int64_t r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_si512();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512i qc = _mm512_load_si512(q[h].codes + 64 * c);
        for (int64_t r = 0; r < tr; ++r) {
          acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_load_si512(tile[r] + 64 * c), qc);
        }
      }
      // sum (k + 128) q' = sum k q' + 128 sum q'; lanes past n held 128 * 0.
      const __m512i dots =
          _mm512_sub_epi32(ReduceRows16(acc), _mm512_set1_epi32(128 * q[h].code_sum));
      const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dots),
                                     _mm512_mul_ps(row_scale, _mm512_set1_ps(q[h].scale)));
      _mm512_mask_storeu_ps(scores + h * score_stride + r0, LaneMask16(tr), s);
    }
  }
}

KVGRID_VNNI void DotInt8Vnni(const void* values, const void* meta, int64_t n, int64_t rows,
                             const float* q, int64_t num_q, float* scores,
                             int64_t score_stride, KvRows ahead) {
  constexpr int64_t kHeads = 8;  // rounded on the stack, a few heads at a time
  Int8Query prepared[kHeads];
  for (int64_t h0 = 0; h0 < num_q; h0 += kHeads) {
    const int64_t hn = std::min(kHeads, num_q - h0);
    RoundQueriesInt8(q + h0 * n, n, hn, prepared);
    DotInt8VnniPrepared(values, meta, n, rows, prepared, hn, scores + h0 * score_stride,
                        score_stride, h0 == 0 ? ahead : KvRows{});
  }
}

KVGRID_VNNI void AxpyInt8Vnni(const void* values, const void* meta, int64_t n, int64_t rows,
                              const float* p, int64_t num_q, int64_t p_stride, float* out,
                              KvRows ahead) {
  PrefetchRows(ahead, KvRowLayoutFor(KvDType::kInt8, n), rows);
  const auto* v = static_cast<const uint8_t*>(values);
  const auto* m = static_cast<const uint8_t*>(meta);
  const int64_t chunks = (n + 63) / 64;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // The tile's rows, four at a time, interleaved so that 32-bit lane j of chunk c holds
  // channel ch(c, j) of rows 4g..4g+3 (as VPDPBUSD multiplies them with four weights), plus
  // 128. ch: see Deinterleave below.
  alignas(64) uint8_t tile[kTile / 4][kMaxChunks][4][64];
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t tr = std::min(kTile, rows - r0);
    const int64_t groups = (tr + 3) / 4;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = 0; c < chunks; ++c) {
        const __mmask64 k = ByteMask(n - 64 * c);
        __m512i x[4];
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t r = 4 * g + i;
          // Rows past the tile: code 0, i.e. 128 after the flip, times weight 0.
          x[i] = r < tr ? _mm512_maskz_loadu_epi8(k, v + (r0 + r) * n + 64 * c)
                        : _mm512_setzero_si512();
          x[i] = _mm512_xor_si512(x[i], flip);
        }
        const __m512i a = _mm512_unpacklo_epi8(x[0], x[1]);
        const __m512i b = _mm512_unpackhi_epi8(x[0], x[1]);
        const __m512i cc = _mm512_unpacklo_epi8(x[2], x[3]);
        const __m512i d = _mm512_unpackhi_epi8(x[2], x[3]);
        _mm512_store_si512(tile[g][c][0], _mm512_unpacklo_epi16(a, cc));
        _mm512_store_si512(tile[g][c][1], _mm512_unpackhi_epi16(a, cc));
        _mm512_store_si512(tile[g][c][2], _mm512_unpacklo_epi16(b, d));
        _mm512_store_si512(tile[g][c][3], _mm512_unpackhi_epi16(b, d));
      }
    }
    const __m512 row_scale = RowScales(m + 2 * r0, tr);
    for (int64_t h = 0; h < num_q; ++h) {
      alignas(64) float alpha[kTile];
      const __m512 weights = _mm512_maskz_loadu_ps(LaneMask16(tr), p + h * p_stride + r0);
      _mm512_store_ps(alpha, _mm512_mul_ps(weights, row_scale));
      alignas(64) int8_t ai[kTile];
      int32_t asum = 0;
      const float as = RoundToInt8(alpha, kTile, ai, kTile, &asum);
      if (as == 0.f) continue;
      const __m512i corr = _mm512_set1_epi32(128 * asum);
      const __m512 scale = _mm512_set1_ps(as);
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(),
                          _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int64_t g = 0; g < groups; ++g) {
          int32_t w4;
          std::memcpy(&w4, ai + 4 * g, sizeof(w4));
          const __m512i w = _mm512_set1_epi32(w4);
          for (int i = 0; i < 4; ++i) {
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_load_si512(tile[g][c][i]), w);
          }
        }
        // acc[i] lane 4L + j holds channel 16L + 4i + j of the chunk: transpose the 128-bit
        // blocks so that result k holds channels 16k..16k+15.
        __m512 f[4];
        for (int i = 0; i < 4; ++i) {
          f[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], corr)), scale);
        }
        const __m512 t0 = _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 t1 = _mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 t2 = _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 t3 = _mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 o[4] = {_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1))};
        float* dst = out + h * n + 64 * c;
        for (int k = 0; k < 4; ++k) {
          const int64_t left = n - 64 * c - 16 * k;
          if (left <= 0) break;
          const __mmask16 mk = LaneMask16(left);
          _mm512_mask_storeu_ps(dst + 16 * k, mk,
                                _mm512_add_ps(_mm512_maskz_loadu_ps(mk, dst + 16 * k), o[k]));
        }
      }
    }
  }
}

#else  // !__x86_64__

bool HaveInt8Vnni() { return false; }
bool Int8VnniRounds(const float*, int64_t) { return false; }
void RoundQueriesInt8(const float*, int64_t, int64_t, Int8Query*) {}
void DotInt8VnniPrepared(const void*, const void*, int64_t, int64_t, const Int8Query*, int64_t,
                         float*, int64_t, KvRows) {}
void DotInt8Vnni(const void*, const void*, int64_t, int64_t, const float*, int64_t, float*,
                 int64_t, KvRows) {}
void AxpyInt8Vnni(const void*, const void*, int64_t, int64_t, const float*, int64_t, int64_t,
                  float*, KvRows) {}

#endif

}  // namespace kvgrid::kernels::cpu
