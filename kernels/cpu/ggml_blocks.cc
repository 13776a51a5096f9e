#include "kernels/cpu/ggml_blocks.h"

#include <cstring>

#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

#define KVGRID_INLINE inline __attribute__((always_inline))

KVGRID_INLINE float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return model::F16ToF32(h);
}

// IQ4_NL's 16 levels (ggml's kvalues_iq4nl): a non-uniform grid fitted to
// normal weights.
constexpr int8_t kIq4NlLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// The nibble of element i (0..31) of a 32-element block whose 16 bytes hold
// value i low and value i + 16 high in byte i.
KVGRID_INLINE int Nibble(const uint8_t* qs, int i) {
  return i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4;
}

KVGRID_INLINE void DecodeQ5_0(const uint8_t* b, float* y) {
  const float d = F16At(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, sizeof(qh));
  const uint8_t* qs = b + 6;
  for (int i = 0; i < 32; ++i) {
    const int q = (Nibble(qs, i) | static_cast<int>((qh >> i) & 1u) << 4) - 16;
    y[i] = static_cast<float>(q) * d;
  }
}

KVGRID_INLINE void DecodeQ5_1(const uint8_t* b, float* y) {
  const float d = F16At(b), m = F16At(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, sizeof(qh));
  const uint8_t* qs = b + 8;
  for (int i = 0; i < 32; ++i) {
    const int q = Nibble(qs, i) | static_cast<int>((qh >> i) & 1u) << 4;
    y[i] = static_cast<float>(q) * d + m;
  }
}

KVGRID_INLINE void DecodeIq4Nl(const uint8_t* b, float* y) {
  const float d = F16At(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    y[i] = d * static_cast<float>(kIq4NlLevels[qs[i] & 0x0F]);
    y[i + 16] = d * static_cast<float>(kIq4NlLevels[qs[i] >> 4]);
  }
}

KVGRID_INLINE void DecodeQ2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* qs = b + 16;
  const float d = F16At(b + 80), dmin = F16At(b + 82);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int half = 0; half < 2; ++half) {
        const int j = 8 * h + 2 * s + half;  // sub-block of 16
        const float dl = d * static_cast<float>(scales[j] & 0x0F);
        const float ml = dmin * static_cast<float>(scales[j] >> 4);
        const uint8_t* q = qs + 32 * h + 16 * half;
        float* o = y + 16 * j;
        for (int l = 0; l < 16; ++l) {
          o[l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
        }
      }
    }
  }
}

KVGRID_INLINE void DecodeQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = F16At(b + 108);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const int bit = 4 * h + s;  // of hmask, = e / 32
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * bit + half;  // sub-block of 16
        const int lo = j < 8 ? sc[j] & 0x0F : sc[j - 8] >> 4;
        const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        const float dl = d * static_cast<float>((lo | hi << 4) - 32);
        float* o = y + 16 * j;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hmask[l] >> bit) & 1) ? 0 : 4);
          o[l - 16 * half] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block g (0..7).
KVGRID_INLINE void ScaleMinK4(const uint8_t* sc, int g, int* scale, int* min) {
  if (g < 4) {
    *scale = sc[g] & 63;
    *min = sc[g + 4] & 63;
  } else {
    *scale = (sc[g + 4] & 0x0F) | (sc[g - 4] >> 6) << 4;
    *min = (sc[g + 4] >> 4) | (sc[g] >> 6) << 4;
  }
}

KVGRID_INLINE void DecodeQ4_K(const uint8_t* b, float* y) {
  const float d = F16At(b), dmin = F16At(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    ScaleMinK4(sc, g, &scale, &min);
    const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      y[32 * g + l] = d1 * static_cast<float>((q[l] >> shift) & 0x0F) - m1;
    }
  }
}

KVGRID_INLINE void DecodeQ5_K(const uint8_t* b, float* y) {
  const float d = F16At(b), dmin = F16At(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    int scale, min;
    ScaleMinK4(sc, g, &scale, &min);
    const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      const int v = ((q[l] >> shift) & 0x0F) | ((qh[l] >> g) & 1) << 4;
      y[32 * g + l] = d1 * static_cast<float>(v) - m1;
    }
  }
}

KVGRID_INLINE void DecodeQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = F16At(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t* lo = ql + 64 * h + 32 * (s % 2);
      const int lo_shift = 4 * (s / 2);
      const uint8_t* hi = qh + 32 * h;
      for (int half = 0; half < 2; ++half) {
        const int j = 8 * h + 2 * s + half;  // sub-block of 16
        const float dl = d * static_cast<float>(scales[j]);
        float* o = y + 16 * j;
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = (((lo[l] >> lo_shift) & 0x0F) | ((hi[l] >> (2 * s)) & 3) << 4) - 32;
          o[l - 16 * half] = dl * static_cast<float>(q);
        }
      }
    }
  }
}

// One body for both instantiations below: the portable one, and one compiled
// for AVX2 so the loops above vectorize 8 wide. The arithmetic is the same
// operations in the same order.
template <WeightDType D>
KVGRID_INLINE void DecodeBlocks(const uint8_t* src, int64_t blocks, float* out) {
  const int64_t bb = QuantMatrix::BlockBytes(D), be = QuantMatrix::BlockElements(D);
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = src + i * bb;
    float* y = out + i * be;
    if constexpr (D == WeightDType::kQ5_0) DecodeQ5_0(b, y);
    if constexpr (D == WeightDType::kQ5_1) DecodeQ5_1(b, y);
    if constexpr (D == WeightDType::kIQ4_NL) DecodeIq4Nl(b, y);
    if constexpr (D == WeightDType::kQ2_K) DecodeQ2_K(b, y);
    if constexpr (D == WeightDType::kQ3_K) DecodeQ3_K(b, y);
    if constexpr (D == WeightDType::kQ4_K) DecodeQ4_K(b, y);
    if constexpr (D == WeightDType::kQ5_K) DecodeQ5_K(b, y);
    if constexpr (D == WeightDType::kQ6_K) DecodeQ6_K(b, y);
  }
}

template <WeightDType D>
void DecodePortable(const uint8_t* src, int64_t blocks, float* out) {
  DecodeBlocks<D>(src, blocks, out);
}

#if defined(__x86_64__)
template <WeightDType D>
__attribute__((target("avx2,f16c"))) void DecodeAvx2(const uint8_t* src, int64_t blocks,
                                                     float* out) {
  DecodeBlocks<D>(src, blocks, out);
}
#endif

using DecodeFn = void (*)(const uint8_t*, int64_t, float*);

template <WeightDType D>
DecodeFn Best() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return DecodeAvx2<D>;
#endif
  return DecodePortable<D>;
}

}  // namespace

bool IsGgmlBlockFormat(WeightDType dtype) {
  switch (dtype) {
    case WeightDType::kQ5_0:
    case WeightDType::kQ5_1:
    case WeightDType::kIQ4_NL:
    case WeightDType::kQ2_K:
    case WeightDType::kQ3_K:
    case WeightDType::kQ4_K:
    case WeightDType::kQ5_K:
    case WeightDType::kQ6_K:
      return true;
    default:
      return false;
  }
}

bool DecodeGgmlBlocks(WeightDType dtype, const uint8_t* src, int64_t blocks, float* out) {
  static const DecodeFn q5_0 = Best<WeightDType::kQ5_0>(), q5_1 = Best<WeightDType::kQ5_1>(),
                        iq4_nl = Best<WeightDType::kIQ4_NL>(), q2_k = Best<WeightDType::kQ2_K>(),
                        q3_k = Best<WeightDType::kQ3_K>(), q4_k = Best<WeightDType::kQ4_K>(),
                        q5_k = Best<WeightDType::kQ5_K>(), q6_k = Best<WeightDType::kQ6_K>();
  DecodeFn fn = nullptr;
  switch (dtype) {
    case WeightDType::kQ5_0:
      fn = q5_0;
      break;
    case WeightDType::kQ5_1:
      fn = q5_1;
      break;
    case WeightDType::kIQ4_NL:
      fn = iq4_nl;
      break;
    case WeightDType::kQ2_K:
      fn = q2_k;
      break;
    case WeightDType::kQ3_K:
      fn = q3_k;
      break;
    case WeightDType::kQ4_K:
      fn = q4_k;
      break;
    case WeightDType::kQ5_K:
      fn = q5_k;
      break;
    case WeightDType::kQ6_K:
      fn = q6_k;
      break;
    default:
      return false;
  }
  fn(src, blocks, out);
  return true;
}

}  // namespace kvgrid::kernels::cpu
