// KV row codecs: round-trip error bounds per dtype, edge rows (zero, constant, extreme, tiny),
// the bit layout of the formats, and the AVX2 row kernels against the portable ones.
#include "kernels/cpu/kv_quant.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/simd_x86.h"
#include "model/dtype.h"

namespace kvgrid::kernels::cpu {
namespace {

constexpr KvDType kAllDTypes[] = {KvDType::kF32,  KvDType::kF16,  KvDType::kBF16,
                                  KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3};
constexpr int64_t kHeadDims[] = {2, 6, 16, 34, 48, 80, 128, 256};

struct Encoded {
  std::vector<uint8_t> values, meta;
};

Encoded Encode(KvDType dtype, const std::vector<float>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  const KvRowLayout l = KvRowLayoutFor(dtype, n);
  // Poisoned, so a byte the encoder forgets to write shows up.
  Encoded e{std::vector<uint8_t>(l.value_bytes, 0xa5), std::vector<uint8_t>(l.meta_bytes, 0xa5)};
  QuantizeRow(dtype, x.data(), n, e.values.data(), e.meta.data());
  return e;
}

std::vector<float> Decode(KvDType dtype, const Encoded& e, int64_t n) {
  std::vector<float> out(n);
  DequantizeRow(dtype, e.values.data(), e.meta.data(), n, out.data());
  return out;
}

uint16_t MetaWord(const Encoded& e, int64_t i) {
  uint16_t w;
  std::memcpy(&w, e.meta.data() + 2 * i, 2);
  return w;
}

// Checks |x - x̂| against the per-element bound the format promises.
void ExpectWithinBound(KvDType dtype, const std::vector<float>& x, const char* what) {
  const int64_t n = static_cast<int64_t>(x.size());
  const Encoded e = Encode(dtype, x);
  const std::vector<float> y = Decode(dtype, e, n);
  for (int64_t i = 0; i < n; ++i) {
    double bound = 0;
    switch (dtype) {
      case KvDType::kF32:
        bound = 0;
        break;
      case KvDType::kF16:  // half an ulp at 11 bits, or half the subnormal step
        bound = std::max(std::abs(x[i]) * std::ldexp(1.0, -11), std::ldexp(1.0, -25));
        break;
      case KvDType::kBF16:
        bound = std::abs(x[i]) * std::ldexp(1.0, -8);
        break;
      case KvDType::kInt8:  // half a step of the stored (fp16-rounded) scale
        bound = 0.5 * model::F16ToF32(MetaWord(e, 0));
        break;
      case KvDType::kInt4:
        bound = 0.5 * model::F16ToF32(MetaWord(e, i / kInt4GroupSize) & 0xfff0);
        break;
      case KvDType::kFp8E4m3:  // half a step of E4M3 in x / s's binade, or a subnormal one
        bound = std::max(std::abs(x[i]) * std::ldexp(1.0, -4),
                         model::F16ToF32(MetaWord(e, 0)) * std::ldexp(1.0, -10));
        break;
    }
    ASSERT_LE(std::abs(static_cast<double>(x[i]) - y[i]), bound * (1 + 1e-6))
        << KvDTypeName(dtype) << " " << what << " n=" << n << " i=" << i << " x=" << x[i]
        << " x̂=" << y[i];
  }
}

TEST(KvQuantTest, RoundTripWithinFormatBounds) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(-3.f, 7.f);
  for (KvDType dtype : kAllDTypes) {
    for (int64_t n : kHeadDims) {
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<float> x(n);
        const float spread = std::ldexp(1.f, static_cast<int>(rng() % 24) - 12);
        for (float& v : x) v = (trial % 2 ? normal(rng) : uniform(rng)) * spread;
        ExpectWithinBound(dtype, x, "random");
      }
    }
  }
}

TEST(KvQuantTest, EdgeRows) {
  for (KvDType dtype : kAllDTypes) {
    for (int64_t n : {int64_t{16}, int64_t{48}, int64_t{80}, int64_t{128}}) {
      ExpectWithinBound(dtype, std::vector<float>(n, 0.f), "zeros");
      ExpectWithinBound(dtype, std::vector<float>(n, 2.5f), "constant");
      ExpectWithinBound(dtype, std::vector<float>(n, -0.37f), "negative constant");
      ExpectWithinBound(dtype, std::vector<float>(n, 1e-7f), "tiny constant");
      std::vector<float> x(n, 0.f);
      x[n / 3] = 1000.f;  // one outlier
      ExpectWithinBound(dtype, x, "outlier");
      for (int64_t i = 0; i < n; ++i) x[i] = 5.f + 0.01f * i;  // far from zero, narrow
      ExpectWithinBound(dtype, x, "offset");
      for (int64_t i = 0; i < n; ++i) x[i] = (i % 2 ? 1.f : -1.f) * std::ldexp(1.f, i % 30 - 15);
      ExpectWithinBound(dtype, x, "wide dynamic range");
    }
  }
}

TEST(KvQuantTest, ZeroRowsDecodeExactly) {
  for (KvDType dtype : kAllDTypes) {
    const std::vector<float> x(80, 0.f);
    for (float y : Decode(dtype, Encode(dtype, x), 80)) EXPECT_EQ(y, 0.f) << KvDTypeName(dtype);
  }
}

TEST(KvQuantTest, Int8Format) {
  std::vector<float> x(16, 0.f);
  x[0] = 127.f;
  x[1] = -63.6f;
  x[2] = 0.49f;
  const Encoded e = Encode(KvDType::kInt8, x);
  EXPECT_EQ(MetaWord(e, 0), model::F32ToF16(1.f));  // s = 127 / 127
  EXPECT_EQ(static_cast<int8_t>(e.values[0]), 127);
  EXPECT_EQ(static_cast<int8_t>(e.values[1]), -64);
  EXPECT_EQ(static_cast<int8_t>(e.values[2]), 0);
  // The scale saturates at the largest finite fp16 instead of becoming infinite.
  x[0] = 1e30f;
  const Encoded big = Encode(KvDType::kInt8, x);
  EXPECT_EQ(MetaWord(big, 0), 0x7bff);
  EXPECT_EQ(static_cast<int8_t>(big.values[0]), 127);
  // Values whose scale underflows fp16 still get a nonzero scale.
  std::vector<float> tiny(16, 1e-9f);
  const Encoded t = Encode(KvDType::kInt8, tiny);
  EXPECT_GT(MetaWord(t, 0), 0);
}

TEST(KvQuantTest, Int4Format) {
  // Group 0: [-1, 2] -> s = 3 / 15 = 0.2 rounded up to 4 clear low bits, z = round(1 / s) = 5.
  // Group 1 (16 channels, the short last group of a 48-channel row): all zero.
  std::vector<float> x(48, 0.f);
  for (int i = 0; i < 32; ++i) x[i] = -1.f + 3.f * i / 31.f;
  const Encoded e = Encode(KvDType::kInt4, x);
  ASSERT_EQ(e.values.size(), 24u);
  ASSERT_EQ(e.meta.size(), 4u);
  const uint16_t w0 = MetaWord(e, 0);
  const float s = model::F16ToF32(w0 & 0xfff0);
  EXPECT_GE(s, 0.2f);
  EXPECT_LT(s, 0.2f * (1 + 1.f / 32));
  EXPECT_EQ(w0 & 0xf, static_cast<int>(std::lrint(1.f / s)));
  // Low nibble first: channel 0 is the minimum (q = 0), channel 31 the maximum (q = 15).
  EXPECT_EQ(e.values[0] & 0xf, 0);
  EXPECT_EQ(e.values[15] >> 4, static_cast<int>(std::lrint(2.f / s)) + (w0 & 0xf));
  EXPECT_EQ(MetaWord(e, 1), 0);
  for (int i = 16; i < 24; ++i) EXPECT_EQ(e.values[i], 0) << i;
  // Scale words are rounded up and keep the zero point in bits they never use.
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> u(-50.f, 50.f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> y(32);
    for (float& v : y) v = u(rng) * std::ldexp(1.f, trial % 20 - 10);
    const float lo = std::min(0.f, *std::min_element(y.begin(), y.end()));
    const float hi = std::max(0.f, *std::max_element(y.begin(), y.end()));
    const uint16_t w = MetaWord(Encode(KvDType::kInt4, y), 0);
    EXPECT_GE(model::F16ToF32(w & 0xfff0), (hi - lo) / 15.f) << trial;
  }
}

// The value of an E4M3 code from the format's definition: 4 exponent bits with bias 7,
// 3 mantissa bits, subnormals at exponent 0.
double E4m3Value(int code) {
  const int e = (code >> 3) & 0xf, m = code & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return (code & 0x80) ? -mag : mag;
}

// The encoder by brute force: the nearest finite code, ties to the even mantissa, saturating.
uint8_t NearestE4m3(double x) {
  int best = 0;
  double best_err = INFINITY;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN codes
    if ((code & 0x80) != (std::signbit(x) ? 0x80 : 0)) continue;
    const double err = std::abs(E4m3Value(code) - x);
    if (err < best_err || (err == best_err && (code & 1) == 0)) best = code, best_err = err;
  }
  return static_cast<uint8_t>(best);
}

TEST(KvQuantTest, Fp8E4m3Codes) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) {
      EXPECT_EQ(Fp8E4m3ToF32(static_cast<uint8_t>(code)), code & 0x80 ? -480.f : 480.f);
      continue;
    }
    const double v = E4m3Value(code);
    ASSERT_EQ(Fp8E4m3ToF32(static_cast<uint8_t>(code)), v) << code;
    // Every value encodes to itself (-0 keeps its sign).
    EXPECT_EQ(F32ToFp8E4m3(static_cast<float>(v)), code) << code;
  }
  EXPECT_EQ(E4m3Value(0x7e), 448.0);
  // Halfway points (ties to even), one float ulp either side of them, and random values over
  // the whole range, subnormals and saturation included.
  std::vector<float> xs = {464.f, 465.f, 1e6f, 3.4e38f, std::ldexp(1.f, -10), std::ldexp(3.f, -11),
                           std::ldexp(1.f, -6), std::ldexp(15.f, -10)};
  for (int code = 0; code < 0x7e; ++code) {
    const float mid = static_cast<float>((E4m3Value(code) + E4m3Value(code + 1)) / 2);
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.f));
    xs.push_back(std::nextafter(mid, 1e9f));
  }
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> exponent(-14.f, 10.f);
  for (int i = 0; i < 20000; ++i) xs.push_back(std::exp2(exponent(rng)));
  for (float x : xs) {
    for (float v : {x, -x}) {
      ASSERT_EQ(F32ToFp8E4m3(v), NearestE4m3(v)) << v;
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(F32ToFp8E4m3(inf), 0x7e);
  EXPECT_EQ(F32ToFp8E4m3(-inf), 0xfe);
  EXPECT_EQ(F32ToFp8E4m3(std::numeric_limits<float>::quiet_NaN()), 0xfe);
}

TEST(KvQuantTest, Fp8Format) {
  std::vector<float> x(16, 0.f);
  x[0] = 448.f;
  x[1] = -3.3f;     // between 3.25 and 3.5: nearer 3.25
  x[2] = 0.0029f;   // subnormal: 1.48 steps of 2^-9 -> 1 step
  x[3] = 300.f;     // between 288 and 320: nearer 288
  const Encoded e = Encode(KvDType::kFp8E4m3, x);
  EXPECT_EQ(MetaWord(e, 0), model::F32ToF16(1.f));  // s = 448 / 448
  EXPECT_EQ(e.values[0], 0x7e);
  EXPECT_EQ(Fp8E4m3ToF32(e.values[1]), -3.25f);
  EXPECT_EQ(e.values[2], 0x01);
  EXPECT_EQ(Fp8E4m3ToF32(e.values[3]), 288.f);
  EXPECT_EQ(e.values[4], 0);
  // The scale saturates at the largest finite fp16, and the values at 448 under it.
  x[0] = 1e30f;
  const Encoded big = Encode(KvDType::kFp8E4m3, x);
  EXPECT_EQ(MetaWord(big, 0), 0x7bff);
  EXPECT_EQ(big.values[0], 0x7e);
  // A subnormal scale steps up rather than clip the largest value.
  std::vector<float> tiny(16, 0.f);
  tiny[0] = 1e-5f;  // / 448 is a subnormal fp16 of ~0.37 steps
  const Encoded t = Encode(KvDType::kFp8E4m3, tiny);
  ASSERT_GT(MetaWord(t, 0), 0);
  EXPECT_LE(1e-5f / model::F16ToF32(MetaWord(t, 0)), 464.f);
}

TEST(KvQuantTest, NonFiniteInputsStayInRange) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (KvDType dtype : {KvDType::kInt8, KvDType::kInt4, KvDType::kFp8E4m3}) {
    std::vector<float> x(32, 1.f);
    x[3] = inf;
    x[7] = nan;
    x[9] = -inf;
    const Encoded e = Encode(dtype, x);
    for (float y : Decode(dtype, e, 32)) EXPECT_TRUE(std::isfinite(y)) << KvDTypeName(dtype);
  }
}

// Rows of random data for every dtype, laid out as an arena plane of `rows` rows.
struct Plane {
  std::vector<uint8_t> values, meta;
  std::vector<float> decoded;  // [rows, n], by DequantizeRow
};

Plane MakePlane(KvDType dtype, int64_t n, int64_t rows, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const KvRowLayout l = KvRowLayoutFor(dtype, n);
  Plane p{std::vector<uint8_t>(rows * l.value_bytes), std::vector<uint8_t>(rows * l.meta_bytes),
          std::vector<float>(rows * n)};
  std::vector<float> x(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float bias = r % 3 == 0 ? 2.f : 0.f;
    for (float& v : x) v = normal(rng) + bias;
    QuantizeRow(dtype, x.data(), n, p.values.data() + r * l.value_bytes,
                p.meta.data() + r * l.meta_bytes);
    DequantizeRow(dtype, p.values.data() + r * l.value_bytes, p.meta.data() + r * l.meta_bytes, n,
                  p.decoded.data() + r * n);
  }
  return p;
}

// Row r's int8 scale (the kernels that round operands are int8 kernels).
double RowScale(const Plane& p, int64_t r) {
  uint16_t h;
  std::memcpy(&h, p.meta.data() + 2 * r, sizeof(h));
  return model::F16ToF32(h);
}

// Memory no one may read: a read faults, a prefetch does not.
class UnreadableRows {
 public:
  UnreadableRows(const KvRowLayout& l, int64_t rows)
      : values_bytes_(std::max<int64_t>(1, rows * l.value_bytes)),
        meta_bytes_(std::max<int64_t>(1, rows * l.meta_bytes)) {
    values_ = mmap(nullptr, values_bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    meta_ = mmap(nullptr, meta_bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  ~UnreadableRows() {
    if (values_ != MAP_FAILED) munmap(values_, values_bytes_);
    if (meta_ != MAP_FAILED) munmap(meta_, meta_bytes_);
  }
  UnreadableRows(const UnreadableRows&) = delete;
  UnreadableRows& operator=(const UnreadableRows&) = delete;
  bool ok() const { return values_ != MAP_FAILED && meta_ != MAP_FAILED; }
  KvRows rows(bool with_meta) const { return {values_, with_meta ? meta_ : nullptr}; }

 private:
  size_t values_bytes_, meta_bytes_;
  void* values_;
  void* meta_;
};

void CheckKernels(const KvRowKernels& k, KvDType dtype, int64_t n, int64_t rows, int64_t num_q,
                  uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const Plane p = MakePlane(dtype, n, rows, rng);
  const void* meta = p.meta.empty() ? nullptr : p.meta.data();
  SCOPED_TRACE(testing::Message() << k.name << " " << KvDTypeName(dtype) << " n=" << n
                                  << " rows=" << rows << " num_q=" << num_q);

  std::vector<float> dq(rows * n, -1.f);
  k.dequantize(p.values.data(), meta, n, rows, dq.data());
  ASSERT_EQ(std::memcmp(dq.data(), p.decoded.data(), sizeof(float) * dq.size()), 0);

  std::vector<float> q(num_q * n);
  for (float& v : q) v = normal(rng);
  const int64_t stride = rows + 3;
  std::vector<float> scores(num_q * stride, 0.f);
  k.dot(p.values.data(), meta, n, rows, q.data(), num_q, scores.data(), stride, {});
  for (int64_t h = 0; h < num_q; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0, mag = 0;
      for (int64_t i = 0; i < n; ++i) {
        want += static_cast<double>(q[h * n + i]) * p.decoded[r * n + i];
        mag += std::abs(static_cast<double>(q[h * n + i]) * p.decoded[r * n + i]);
      }
      // Kernels that round q to int8 (kv_int8_vnni.h) may also be off by qs / 2 per channel.
      double bound = 1e-5 * mag + 1e-6;
      if (k.rounds_operands) {
        double qmax = 0, kabs = 0;
        for (int64_t i = 0; i < n; ++i) {
          qmax = std::max(qmax, std::abs(static_cast<double>(q[h * n + i])));
          kabs += std::abs(static_cast<double>(p.decoded[r * n + i]));
        }
        bound += 0.5 * qmax / 127 * kabs;
      }
      ASSERT_NEAR(scores[h * stride + r], want, bound) << "h=" << h << " r=" << r;
    }
  }

  // Rows named `ahead` are only prefetched: unreadable ones change nothing.
  const UnreadableRows unreadable(KvRowLayoutFor(dtype, n), rows);
  ASSERT_TRUE(unreadable.ok());
  const KvRows ahead = unreadable.rows(meta != nullptr);
  {
    std::vector<float> again(num_q * stride, 0.f);
    k.dot(p.values.data(), meta, n, rows, q.data(), num_q, again.data(), stride, ahead);
    ASSERT_EQ(again, scores);
  }

  // Queries rounded once give the same scores as dot.
  if (k.prepare_query) {
    std::vector<std::byte> buffer(num_q * k.prepared_query_bytes + 64);
    void* prepared = buffer.data();
    size_t space = buffer.size();
    prepared = std::align(64, num_q * k.prepared_query_bytes, prepared, space);
    if (k.prepare_query(q.data(), n, num_q, prepared)) {
      std::vector<float> again(num_q * stride, 0.f);
      k.dot_prepared(p.values.data(), meta, n, rows, prepared, num_q, again.data(), stride,
                     {});
      ASSERT_EQ(again, scores);
      std::fill(again.begin(), again.end(), 0.f);
      k.dot_prepared(p.values.data(), meta, n, rows, prepared, num_q, again.data(), stride,
                     ahead);
      ASSERT_EQ(again, scores);
    }
  }

  std::vector<float> w(num_q * stride);
  for (float& v : w) v = normal(rng);
  std::vector<float> out(num_q * n), init(num_q * n);
  for (float& v : init) v = normal(rng);
  out = init;
  k.axpy(p.values.data(), meta, n, rows, w.data(), num_q, stride, out.data(), {});
  {
    std::vector<float> again = init;
    k.axpy(p.values.data(), meta, n, rows, w.data(), num_q, stride, again.data(), ahead);
    ASSERT_EQ(again, out);
  }
  for (int64_t h = 0; h < num_q; ++h) {
    // Kernels that round the weights times the row scales to int8 may be off by half a step
    // (at most max_r |w_r s_r| / 254) per row: bound = that * sum_r |code_r,i|.
    double amax = 0;
    if (k.rounds_operands) {
      for (int64_t r = 0; r < rows; ++r) {
        amax = std::max(amax, std::abs(static_cast<double>(w[h * stride + r]) * RowScale(p, r)));
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      double bound = 0;
      if (k.rounds_operands) {
        for (int64_t r = 0; r < rows; ++r) {
          bound += 0.5 * amax / 127 * std::abs(static_cast<double>(
                                           static_cast<int8_t>(p.values[r * n + i])));
        }
      }
      double want = init[h * n + i], mag = std::abs(want);
      for (int64_t r = 0; r < rows; ++r) {
        want += static_cast<double>(w[h * stride + r]) * p.decoded[r * n + i];
        mag += std::abs(static_cast<double>(w[h * stride + r]) * p.decoded[r * n + i]);
      }
      ASSERT_NEAR(out[h * n + i], want, bound + 1e-5 * mag + 1e-6) << "h=" << h << " i=" << i;
    }
  }
}

TEST(KvQuantTest, RowKernelsMatchDecodedRows) {
  uint64_t seed = 10;
  for (KvDType dtype : kAllDTypes) {
    for (int64_t n : {int64_t{6}, int64_t{16}, int64_t{34}, int64_t{48}, int64_t{80},
                      int64_t{128}}) {
      for (int64_t rows : {int64_t{1}, int64_t{7}, int64_t{16}, int64_t{45}}) {
        for (int64_t num_q : {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{7}}) {
          CheckKernels(PortableKvRowKernelsFor(dtype), dtype, n, rows, num_q, seed);
          CheckKernels(KvRowKernelsFor(dtype), dtype, n, rows, num_q, seed);
          CheckKernels(KvRowKernelsFor(dtype, KvKernelPrecision::kExact), dtype, n, rows, num_q,
                       seed);
          ++seed;
        }
      }
    }
  }
}

// Shapes at the integer kernels' limits (several 64-channel chunks, 512 channels, more heads
// than are rounded at once) and past them (576 channels: the float fallback), and non-finite
// operands, which must reach the output as the float kernels give them.
TEST(KvQuantTest, Int8KernelsAtTheirLimits) {
  uint64_t seed = 500;
  for (int64_t n : {int64_t{192}, int64_t{250}, int64_t{512}, int64_t{576}}) {
    for (int64_t num_q : {int64_t{2}, int64_t{16}, int64_t{17}}) {
      CheckKernels(KvRowKernelsFor(KvDType::kInt8), KvDType::kInt8, n, 33, num_q, seed++);
    }
  }
  std::mt19937_64 rng(5);
  const int64_t n = 64, rows = 16;
  const Plane p = MakePlane(KvDType::kInt8, n, rows, rng);
  const KvRowKernels k = KvRowKernelsFor(KvDType::kInt8);
  std::vector<float> q(n, 0.5f), scores(rows);
  q[3] = std::numeric_limits<float>::quiet_NaN();
  k.dot(p.values.data(), p.meta.data(), n, rows, q.data(), 1, scores.data(), rows, {});
  for (float s : scores) EXPECT_TRUE(std::isnan(s));
  std::vector<float> w(rows, 0.25f), out(n, 0.f);
  w[5] = std::numeric_limits<float>::infinity();
  k.axpy(p.values.data(), p.meta.data(), n, rows, w.data(), 1, rows, out.data(), {});
  int64_t non_finite = 0;
  for (float o : out) non_finite += !std::isfinite(o);
  EXPECT_GT(non_finite, 0);
  // Subnormal weights still round within the bound (checked against the decoded rows).
  std::vector<float> tiny(rows, 1e-40f), got(n, 0.f);
  k.axpy(p.values.data(), p.meta.data(), n, rows, tiny.data(), 1, rows, got.data(), {});
  for (int64_t i = 0; i < n; ++i) {
    double want = 0, mag = 0;
    for (int64_t r = 0; r < rows; ++r) {
      want += 1e-40 * p.decoded[r * n + i];
      mag += std::abs(1e-40 * p.decoded[r * n + i]);
    }
    EXPECT_NEAR(got[i], want, 0.02 * mag + 1e-44) << i;
  }
}

// The float kernels' shapes on AVX-512 (kv_float_avx512.h): rows in tiles of 16 and a short
// last tile, channels in 16-lane units with a short last one and in pieces of 256, heads in
// passes of 8.
TEST(KvQuantTest, FloatKernelsAtEveryShape) {
  uint64_t seed = 700;
  for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16}) {
    for (int64_t n : {int64_t{2}, int64_t{18}, int64_t{64}, int64_t{200}, int64_t{256},
                      int64_t{290}, int64_t{576}}) {
      for (int64_t rows : {int64_t{1}, int64_t{17}, int64_t{40}}) {
        // With RowKernelsMatchDecodedRows' 1, 3, 4 and 7: every head count axpy keeps in
        // registers (1-8), and more in passes of up to 8.
        for (int64_t num_q : {int64_t{2}, int64_t{5}, int64_t{6}, int64_t{8}, int64_t{9},
                              int64_t{14}, int64_t{17}}) {
          CheckKernels(KvRowKernelsFor(dtype), dtype, n, rows, num_q, seed++);
        }
      }
    }
  }
  // A NaN in the last channel of a query (the masked last unit) reaches every row's score.
  std::mt19937_64 rng(6);
  for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16}) {
    const int64_t n = 18, rows = 20;
    const Plane p = MakePlane(dtype, n, rows, rng);
    std::vector<float> q(2 * n, 0.5f), scores(2 * rows);
    q[2 * n - 1] = std::numeric_limits<float>::quiet_NaN();
    KvRowKernelsFor(dtype).dot(p.values.data(), nullptr, n, rows, q.data(), 2, scores.data(),
                               rows, {});
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_TRUE(std::isfinite(scores[r])) << KvDTypeName(dtype) << " r=" << r;
      EXPECT_TRUE(std::isnan(scores[rows + r])) << KvDTypeName(dtype) << " r=" << r;
    }
  }
  if (HaveAvx512()) {
    for (KvDType dtype : {KvDType::kF32, KvDType::kF16, KvDType::kBF16}) {
      EXPECT_STREQ(KvRowKernelsFor(dtype).name, "avx512") << KvDTypeName(dtype);
      EXPECT_STREQ(KvRowKernelsFor(dtype, KvKernelPrecision::kExact).name, "avx512");
    }
  }
}

TEST(KvQuantTest, BestKernelsAgreeWithPortable) {
  // Same inputs through both: dequantize is bit-identical, dot/axpy differ in sum order only
  // (the exact kernels; RowKernelsMatchDecodedRows bounds the ones that round operands).
  std::mt19937_64 rng(99);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (KvDType dtype : kAllDTypes) {
    const int64_t n = 128, rows = 16, num_q = 4;
    const Plane p = MakePlane(dtype, n, rows, rng);
    const void* meta = p.meta.empty() ? nullptr : p.meta.data();
    const KvRowKernels best = KvRowKernelsFor(dtype, KvKernelPrecision::kExact);
    const KvRowKernels portable = PortableKvRowKernelsFor(dtype);
    std::vector<float> a(rows * n), b(rows * n);
    best.dequantize(p.values.data(), meta, n, rows, a.data());
    portable.dequantize(p.values.data(), meta, n, rows, b.data());
    EXPECT_EQ(a, b) << KvDTypeName(dtype);
    std::vector<float> q(num_q * n);
    for (float& v : q) v = normal(rng);
    std::vector<float> sa(num_q * rows), sb(num_q * rows);
    best.dot(p.values.data(), meta, n, rows, q.data(), num_q, sa.data(), rows, {});
    portable.dot(p.values.data(), meta, n, rows, q.data(), num_q, sb.data(), rows, {});
    for (size_t i = 0; i < sa.size(); ++i) EXPECT_NEAR(sa[i], sb[i], 1e-4) << KvDTypeName(dtype);
    std::vector<float> oa(num_q * n, 0.f), ob(num_q * n, 0.f);
    best.axpy(p.values.data(), meta, n, rows, sa.data(), num_q, rows, oa.data(), {});
    portable.axpy(p.values.data(), meta, n, rows, sa.data(), num_q, rows, ob.data(), {});
    for (size_t i = 0; i < oa.size(); ++i) EXPECT_NEAR(oa[i], ob[i], 1e-3) << KvDTypeName(dtype);
  }
}

}  // namespace
}  // namespace kvgrid::kernels::cpu

