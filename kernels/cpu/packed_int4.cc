#include "kernels/cpu/packed_int4.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

// AWQ packs outputs 0, 2, 4, 6, 1, 3, 5, 7 from the low nibble up: output c sits in nibble
// kAwqNibble[c].
constexpr int kAwqNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

int Nibble(int32_t word, int index) {
  return static_cast<int>((static_cast<uint32_t>(word) >> (4 * index)) & 0xFu);
}

// Reads one layer's packed values; Validate must have passed.
class Unpacker {
 public:
  explicit Unpacker(const PackedInt4Params& p) : p_(p), packed_out_(p.out_features / 8) {}

  int Q(int64_t in, int64_t out) const {
    if (p_.layout == PackedInt4Layout::kAwq) {
      return Nibble(p_.qweight[in * packed_out_ + out / 8], kAwqNibble[out % 8]);
    }
    return Nibble(p_.qweight[(in / 8) * p_.out_features + out], static_cast<int>(in % 8));
  }
  int Z(int64_t group, int64_t out) const {
    const int32_t word = p_.qzeros[group * packed_out_ + out / 8];
    if (p_.layout == PackedInt4Layout::kAwq) return Nibble(word, kAwqNibble[out % 8]);
    // The original GPTQ format stores z - 1; its kernels add the one back without wrapping.
    return Nibble(word, static_cast<int>(out % 8)) + (p_.zeros_minus_one ? 1 : 0);
  }
  float S(int64_t group, int64_t out) const { return p_.scales[group * p_.out_features + out]; }
  int64_t Group(int64_t in) const {
    if (!p_.g_idx.empty()) return p_.g_idx[in];
    return p_.group_size < 0 ? 0 : in / p_.group_size;
  }

 private:
  const PackedInt4Params& p_;
  int64_t packed_out_;
};

absl::Status SizeError(const std::string& name, const char* what, size_t got,
                       int64_t want) {
  return absl::InvalidArgumentError(absl::StrCat(name, ".", what, " has ", got,
                                                 " elements, the layer's shape implies ", want));
}

}  // namespace

absl::Status PackedInt4Params::Validate() const {
  if (in_features <= 0 || out_features <= 0 || in_features % 8 != 0 || out_features % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": [", out_features, ", ", in_features,
                                                   "] is not a multiple of 8 on both sides"));
  }
  if (group_size == 0 || group_size < -1 || (group_size > 0 && group_size % 8 != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": group size ", group_size, " is not a multiple of 8 or -1"));
  }
  const int64_t packed = in_features * out_features / 8;
  if (static_cast<int64_t>(qweight.size()) != packed) {
    return SizeError(name, "qweight", qweight.size(), packed);
  }
  if (static_cast<int64_t>(qzeros.size()) != groups() * out_features / 8) {
    return SizeError(name, "qzeros", qzeros.size(), groups() * out_features / 8);
  }
  if (static_cast<int64_t>(scales.size()) != groups() * out_features) {
    return SizeError(name, "scales", scales.size(), groups() * out_features);
  }
  if (!g_idx.empty()) {
    if (static_cast<int64_t>(g_idx.size()) != in_features) {
      return SizeError(name, "g_idx", g_idx.size(), in_features);
    }
    for (int64_t i = 0; i < in_features; ++i) {
      if (g_idx[i] < 0 || g_idx[i] >= groups()) {
        return absl::InvalidArgumentError(absl::StrCat(name, ".g_idx[", i, "] = ", g_idx[i],
                                                       " is outside [0, ", groups(), ")"));
      }
    }
  }
  return absl::OkStatus();
}

bool PackedInt4Params::FitsBlocks() const {
  if (in_features % kQuantBlock != 0) return false;
  std::vector<int64_t> count(static_cast<size_t>(groups()), 0);
  const Unpacker u(*this);
  for (int64_t i = 0; i < in_features; ++i) ++count[u.Group(i)];
  return std::all_of(count.begin(), count.end(), [](int64_t c) { return c % kQuantBlock == 0; });
}

absl::StatusOr<QuantMatrix> QuantMatrixFromPackedInt4(const PackedInt4Params& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  if (!p.FitsBlocks()) {
    return absl::InvalidArgumentError(
        absl::StrCat(p.name, ": its groups are not whole blocks of 32 inputs"));
  }
  const Unpacker u(p);
  const int64_t in = p.in_features, out = p.out_features;
  // Inputs sorted by group (stable, so the identity when groups are already contiguous).
  std::vector<int32_t> perm(static_cast<size_t>(in));
  std::iota(perm.begin(), perm.end(), 0);
  std::stable_sort(perm.begin(), perm.end(),
                   [&](int32_t a, int32_t b) { return u.Group(a) < u.Group(b); });
  QuantMatrix m;
  m.dtype = WeightDType::kQ4_Z;
  m.rows = out;
  m.cols = in;
  m.data.resize(static_cast<size_t>(out * m.RowBytes()));
  const int64_t bb = QuantMatrix::BlockBytes(m.dtype);
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t b = 0; b < in / kQuantBlock; ++b) {
      const int32_t* cols = perm.data() + b * kQuantBlock;
      const int64_t g = u.Group(cols[0]);
      const float s = u.S(g, o);
      const uint16_t d = model::F32ToF16(s);
      const uint16_t z = model::F32ToF16(static_cast<float>(u.Z(g, o)));  // exact: 0..16
      uint8_t* block = m.data.data() + o * m.RowBytes() + b * bb;
      std::memcpy(block, &d, sizeof(d));
      std::memcpy(block + 2, &z, sizeof(z));
      for (int i = 0; i < 16; ++i) {
        block[4 + i] = static_cast<uint8_t>(u.Q(cols[i], o) | (u.Q(cols[i + 16], o) << 4));
      }
    }
  }
  if (!std::is_sorted(perm.begin(), perm.end())) m.input_perm = std::move(perm);
  return m;
}

absl::StatusOr<std::vector<float>> DequantizePackedInt4(const PackedInt4Params& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const Unpacker u(p);
  std::vector<float> w(static_cast<size_t>(p.out_features * p.in_features));
#pragma omp parallel for schedule(static)
  for (int64_t o = 0; o < p.out_features; ++o) {
    for (int64_t i = 0; i < p.in_features; ++i) {
      const int64_t g = u.Group(i);
      w[o * p.in_features + i] = u.S(g, o) * static_cast<float>(u.Q(i, o) - u.Z(g, o));
    }
  }
  return w;
}

}  // namespace kvgrid::kernels::cpu
