#include "kernels/cuda/kv_write.cuh"

#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.h"
#include "kernels/cuda/numeric.cuh"

namespace kvgrid::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kInt4GroupSize == 32, "one int4 group per warp step assumes 32-channel groups");

// What the kernel needs of one arena (K or V).
struct Arena {
  uint8_t* values;
  uint8_t* meta;
  int64_t value_bytes;  // per row
  int64_t meta_bytes;   // per row
  KvDType dtype;
};

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

__device__ __forceinline__ float WarpMin(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fminf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Encodes one row of n channels (n even) with the whole warp; every lane must call it.
// Lane l handles channels l, l + 32, ...; for int4 that is one group of 32 per step, so a
// group's min and max are one warp reduction and lane pairs share a byte.
__device__ void EncodeRow(KvDType dtype, const float* __restrict__ x, int64_t n, uint8_t* values,
                          uint8_t* meta, int lane) {
  switch (dtype) {
    case KvDType::kF32: {
      float* out = reinterpret_cast<float*>(values);
      for (int64_t c = lane; c < n; c += 32) out[c] = x[c];
      return;
    }
    case KvDType::kF16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(values);
      for (int64_t c = lane; c < n; c += 32) out[c] = F32ToF16Bits(x[c]);
      return;
    }
    case KvDType::kBF16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(values);
      for (int64_t c = lane; c < n; c += 32) out[c] = F32ToBF16Bits(x[c]);
      return;
    }
    case KvDType::kInt8:
    case KvDType::kFp8E4m3: {
      float amax = 0.f;  // fmaxf skips NaNs, as the CPU encoder's std::max does
      for (int64_t c = lane; c < n; c += 32) amax = fmaxf(amax, fabsf(x[c]));
      amax = WarpMax(amax);
      const bool fp8 = dtype == KvDType::kFp8E4m3;
      const uint16_t s16 = fp8 ? KvFp8ScaleBits(amax) : KvInt8ScaleBits(amax);
      const float s = F16BitsToF32(s16);
      if (lane == 0) *reinterpret_cast<uint16_t*>(meta) = s16;
      for (int64_t c = lane; c < n; c += 32) {
        values[c] = fp8 ? KvFp8Code(x[c], s) : static_cast<uint8_t>(KvInt8Code(x[c], s));
      }
      return;
    }
    case KvDType::kInt4: {
      uint16_t* words = reinterpret_cast<uint16_t*>(meta);
      for (int64_t g0 = 0; g0 < n; g0 += kInt4GroupSize) {
        const int64_t c = g0 + lane;
        const bool active = c < n;  // the last group may be shorter
        const float v = active ? x[c] : 0.f;
        // The range always holds 0, so an idle lane's 0 changes neither end.
        const float lo = WarpMin(fminf(0.f, v));
        const float hi = WarpMax(fmaxf(0.f, v));
        const uint16_t s16 = KvInt4ScaleBits(lo, hi);
        const float s = F16BitsToF32(s16);
        const int z = KvInt4Zero(lo, s);
        if (lane == 0) words[g0 / kInt4GroupSize] = KvInt4MetaWord(s16, z);
        const int q = active ? KvInt4Code(v, s, z) : 0;
        const int next = __shfl_down_sync(kFullMask, q, 1);
        // n and g0 are even, so an active even lane's odd neighbour is active too: each byte
        // is written whole (low nibble first), by one lane.
        if (active && (lane & 1) == 0) values[c / 2] = static_cast<uint8_t>(q | (next << 4));
      }
      return;
    }
  }
}

// One warp per (token, kv head, K or V) row, grid-stride over rows.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    KvWriteKernel(const float* __restrict__ key, const float* __restrict__ value,
                  const int64_t* __restrict__ slots, Arena k_arena, Arena v_arena,
                  int32_t* invalid_slot_flag, int64_t num_tokens, int64_t num_slots,
                  int64_t num_kv_heads, int64_t block_size, int64_t head_dim) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = num_tokens * num_kv_heads * 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       r < rows; r += stride) {
    const bool is_v = (r & 1) != 0;
    const int64_t token_head = r / 2;
    const int64_t t = token_head / num_kv_heads;
    const int64_t h = token_head - t * num_kv_heads;
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) {  // the whole warp skips: r is per warp
      if (slot != -1 && lane == 0 && invalid_slot_flag != nullptr) {
        atomicExch(invalid_slot_flag, 1);
      }
      continue;
    }
    const int64_t block = slot / block_size;
    const int64_t offset = slot - block * block_size;
    const int64_t row = (block * num_kv_heads + h) * block_size + offset;
    const Arena a = is_v ? v_arena : k_arena;
    uint8_t* meta = a.meta != nullptr ? a.meta + row * a.meta_bytes : nullptr;
    EncodeRow(a.dtype, (is_v ? value : key) + token_head * head_dim, head_dim,
              a.values + row * a.value_bytes, meta, lane);
  }
}

int64_t ElementBytes(KvDType dtype) {
  switch (dtype) {
    case KvDType::kF32: return 4;
    case KvDType::kF16:
    case KvDType::kBF16: return 2;
    default: return 1;
  }
}

}  // namespace

absl::Status KvWriteParams::Validate() const {
  if (num_tokens > 0) {
    if (key == nullptr) return absl::InvalidArgumentError("KvWriteParams.key is null");
    if (value == nullptr) return absl::InvalidArgumentError("KvWriteParams.value is null");
    if (slots == nullptr) return absl::InvalidArgumentError("KvWriteParams.slots is null");
  }
  if (!IsAligned(key, alignof(float))) {
    return absl::InvalidArgumentError("KvWriteParams.key is not 4-byte aligned");
  }
  if (!IsAligned(value, alignof(float))) {
    return absl::InvalidArgumentError("KvWriteParams.value is not 4-byte aligned");
  }
  if (!IsAligned(slots, alignof(int64_t))) {
    return absl::InvalidArgumentError("KvWriteParams.slots is not 8-byte aligned");
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvWriteParams.num_tokens must be >= 0: ", num_tokens));
  }
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvWriteParams.num_blocks must be > 0: ", num_blocks));
  }
  if (num_kv_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvWriteParams.num_kv_heads must be > 0: ", num_kv_heads));
  }
  if (block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvWriteParams.block_size must be > 0: ", block_size));
  }
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KvWriteParams.head_dim must be positive and even: ", head_dim));
  }
  for (auto [cache, meta, dtype, cache_name, meta_name] :
       {std::tuple{k_cache, k_meta, k_dtype, "k_cache", "k_meta"},
        std::tuple{v_cache, v_meta, v_dtype, "v_cache", "v_meta"}}) {
    if (cache == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("KvWriteParams.", cache_name, " is null"));
    }
    if (!IsAligned(cache, ElementBytes(dtype))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KvWriteParams.", cache_name, " is not aligned to ", ElementBytes(dtype), " bytes"));
    }
    if (KvRowLayoutFor(dtype, head_dim).meta_bytes > 0) {
      if (meta == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "KvWriteParams.", meta_name, ": required for ", std::string(KvDTypeName(dtype))));
      }
      if (!IsAligned(meta, alignof(uint16_t))) {
        return absl::InvalidArgumentError(
            absl::StrCat("KvWriteParams.", meta_name, " is not 2-byte aligned"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LaunchKvWrite(const KvWriteParams& p, cudaStream_t stream) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (p.num_tokens == 0) return absl::OkStatus();
  const KvRowLayout kl = KvRowLayoutFor(p.k_dtype, p.head_dim);
  const KvRowLayout vl = KvRowLayoutFor(p.v_dtype, p.head_dim);
  const Arena k_arena{static_cast<uint8_t*>(p.k_cache),
                      kl.meta_bytes > 0 ? static_cast<uint8_t*>(p.k_meta) : nullptr,
                      kl.value_bytes, kl.meta_bytes, p.k_dtype};
  const Arena v_arena{static_cast<uint8_t*>(p.v_cache),
                      vl.meta_bytes > 0 ? static_cast<uint8_t*>(p.v_meta) : nullptr,
                      vl.value_bytes, vl.meta_bytes, p.v_dtype};
  const int64_t rows = p.num_tokens * p.num_kv_heads * 2;
  KvWriteKernel<<<GridStrideBlocks(rows, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
      p.key, p.value, p.slots, k_arena, v_arena, p.invalid_slot_flag, p.num_tokens,
      p.num_blocks * p.block_size, p.num_kv_heads, p.block_size, p.head_dim);
  KVGRID_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cuda
