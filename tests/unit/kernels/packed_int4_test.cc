// AWQ and GPTQ layers (packed here from known q, z and s) become Q4_Z blocks that dequantize to
// exactly s (q - z), act-order groups included; layers that do not fit blocks dequantize exactly; sizes
// that disagree with the shape are refused naming the tensor.
#include "kernels/cpu/packed_int4.h"

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

using ::testing::HasSubstr;

// A layer's true values and their packed forms.
struct Layer {
  int64_t in, out, group;
  std::vector<int> q = {};          // [in, out]
  std::vector<int> z = {};          // [groups, out]
  std::vector<float> s = {};        // [groups, out], fp16 values
  std::vector<int32_t> g_idx = {};  // [in]
  std::vector<int32_t> qweight = {}, qzeros = {};

  int64_t groups() const { return group < 0 ? 1 : (in + group - 1) / group; }
  float W(int64_t i, int64_t o) const {
    const int64_t g = g_idx[i];
    return s[g * out + o] * static_cast<float>(q[i * out + o] - z[g * out + o]);
  }
};

Layer MakeLayer(int64_t in, int64_t out, int64_t group, bool act_order, uint64_t seed) {
  Layer l{in, out, group};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> nibble(0, 15);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  l.q.resize(in * out);
  for (int& v : l.q) v = nibble(rng);
  l.z.resize(l.groups() * out);
  for (int& v : l.z) v = nibble(rng);
  l.s.resize(l.groups() * out);
  for (float& v : l.s) v = model::F16ToF32(model::F32ToF16(scale(rng)));
  l.g_idx.resize(in);
  for (int64_t i = 0; i < in; ++i) l.g_idx[i] = group < 0 ? 0 : static_cast<int32_t>(i / group);
  if (act_order) std::shuffle(l.g_idx.begin(), l.g_idx.end(), rng);
  return l;
}

void PackAwq(Layer& l) {
  const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // output held by nibble i
  auto pack = [&](const std::vector<int>& v, int64_t rows) {
    std::vector<int32_t> packed(rows * l.out / 8, 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < l.out / 8; ++c) {
        uint32_t word = 0;
        for (int i = 0; i < 8; ++i) word |= static_cast<uint32_t>(v[r * l.out + c * 8 + order[i]]) << (4 * i);
        packed[r * l.out / 8 + c] = static_cast<int32_t>(word);
      }
    }
    return packed;
  };
  l.qweight = pack(l.q, l.in);
  l.qzeros = pack(l.z, l.groups());
}

void PackGptq(Layer& l, bool zeros_minus_one) {
  l.qweight.assign(l.in / 8 * l.out, 0);
  for (int64_t i = 0; i < l.in; ++i) {
    for (int64_t o = 0; o < l.out; ++o) {
      l.qweight[(i / 8) * l.out + o] = static_cast<int32_t>(
          static_cast<uint32_t>(l.qweight[(i / 8) * l.out + o]) |
          (static_cast<uint32_t>(l.q[i * l.out + o]) << (4 * (i % 8))));
    }
  }
  l.qzeros.assign(l.groups() * l.out / 8, 0);
  for (int64_t g = 0; g < l.groups(); ++g) {
    for (int64_t o = 0; o < l.out; ++o) {
      const uint32_t z = static_cast<uint32_t>(l.z[g * l.out + o] - (zeros_minus_one ? 1 : 0)) & 0xF;
      uint32_t& word = reinterpret_cast<uint32_t&>(l.qzeros[g * l.out / 8 + o / 8]);
      word |= z << (4 * (o % 8));
    }
  }
}

PackedInt4Params ParamsOf(const Layer& l, PackedInt4Layout layout, bool with_g_idx,
                          bool zeros_minus_one = false) {
  return {.layout = layout, .name = "layer", .in_features = l.in, .out_features = l.out,
          .group_size = l.group, .qweight = l.qweight, .qzeros = l.qzeros, .scales = l.s,
          .g_idx = with_g_idx ? std::span<const int32_t>(l.g_idx) : std::span<const int32_t>(),
          .zeros_minus_one = zeros_minus_one};
}

void ExpectMatches(const Layer& l, const PackedInt4Params& p) {
  ASSERT_TRUE(p.FitsBlocks());
  absl::StatusOr<QuantMatrix> m = QuantMatrixFromPackedInt4(p);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->dtype, WeightDType::kQ4_Z);
  const std::vector<float> blocks = DequantizeMatrix(*m);
  absl::StatusOr<std::vector<float>> exact = DequantizePackedInt4(p);
  ASSERT_TRUE(exact.ok()) << exact.status();
  for (int64_t o = 0; o < l.out; ++o) {
    for (int64_t i = 0; i < l.in; ++i) {
      const float want = l.W(i, o);
      ASSERT_EQ((*exact)[o * l.in + i], want) << "o=" << o << " i=" << i;
      ASSERT_EQ(blocks[o * l.in + i], want) << "o=" << o << " i=" << i;
    }
  }
}

TEST(PackedInt4Test, Awq) {
  Layer l = MakeLayer(256, 48, 128, false, 1);
  PackAwq(l);
  ExpectMatches(l, ParamsOf(l, PackedInt4Layout::kAwq, false));
  EXPECT_TRUE(QuantMatrixFromPackedInt4(ParamsOf(l, PackedInt4Layout::kAwq, false))
                  ->input_perm.empty());
}

TEST(PackedInt4Test, GptqBothZeroFormatsAndPerRowGroups) {
  for (bool minus_one : {false, true}) {
    Layer l = MakeLayer(128, 40, 64, false, 2);
    if (minus_one) {
      for (int& z : l.z) z = std::max(z, 1);  // the original format cannot store a zero of 0
    }
    PackGptq(l, minus_one);
    ExpectMatches(l, ParamsOf(l, PackedInt4Layout::kGptq, true, minus_one));
  }
  Layer row = MakeLayer(96, 16, -1, false, 3);
  PackGptq(row, false);
  ExpectMatches(row, ParamsOf(row, PackedInt4Layout::kGptq, false));
}

TEST(PackedInt4Test, GptqActOrderGathersEachGroup) {
  Layer l = MakeLayer(256, 24, 64, true, 4);
  PackGptq(l, false);
  const PackedInt4Params p = ParamsOf(l, PackedInt4Layout::kGptq, true);
  ExpectMatches(l, p);
  absl::StatusOr<QuantMatrix> m = QuantMatrixFromPackedInt4(p);
  ASSERT_EQ(m->input_perm.size(), 256u);
  for (int b = 0; b < 256 / 32; ++b) {  // every block holds one group's inputs
    for (int i = 1; i < 32; ++i) {
      EXPECT_EQ(l.g_idx[m->input_perm[b * 32 + i]], l.g_idx[m->input_perm[b * 32]]);
    }
  }
}

TEST(PackedInt4Test, GroupsThatAreNotWholeBlocksDequantize) {
  // 688 inputs in groups of 128: the last group holds 48.
  Layer l = MakeLayer(688, 8, 128, false, 5);
  PackGptq(l, false);
  const PackedInt4Params p = ParamsOf(l, PackedInt4Layout::kGptq, false);
  EXPECT_FALSE(p.FitsBlocks());
  EXPECT_THAT(QuantMatrixFromPackedInt4(p).status().message(), HasSubstr("whole blocks"));
  absl::StatusOr<std::vector<float>> w = DequantizePackedInt4(p);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)[3 * 688 + 687], l.W(687, 3));
}

TEST(PackedInt4Test, SizesThatDisagreeAreRefused) {
  Layer l = MakeLayer(256, 48, 128, false, 6);
  PackAwq(l);
  PackedInt4Params p = ParamsOf(l, PackedInt4Layout::kAwq, false);
  p.name = "model.layers.0.mlp.up_proj";
  p.group_size = 64;  // the scales hold 2 groups, not 4
  EXPECT_THAT(p.Validate().message(),
              HasSubstr("model.layers.0.mlp.up_proj.qzeros has 12 elements, the layer's shape "
                        "implies 24"));
  p.group_size = 128;
  p.qweight = p.qweight.subspan(1);
  EXPECT_THAT(p.Validate().message(), HasSubstr("up_proj.qweight has"));
  Layer g = MakeLayer(64, 8, 32, false, 7);
  g.g_idx[5] = 2;
  PackGptq(g, false);
  EXPECT_THAT(ParamsOf(g, PackedInt4Layout::kGptq, true).Validate().message(),
              HasSubstr("layer.g_idx[5] = 2 is outside [0, 2)"));
}

}  // namespace
}  // namespace kvgrid::kernels::cpu
