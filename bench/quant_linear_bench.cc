// quant_linear_bench: the quantized linear layer at decode and batched-decode sizes, 8-bit
// inputs with integer dot products (LinearPrecision::kFast) on row-major blocks and, where the
// CPU has AVX-512 VNNI, on rows interleaved 16 at a time (kernels/cpu/interleaved_linear.h,
// what the model runs there), against fp32 inputs (kExact: the weights decoded in registers up
// to 4 tokens, SGEMM on decoded tiles above), on a
// Qwen2-0.5B layer's matrices (gate/up 9728 x 896, down 896 x 4864) and its head
// (151936 x 896, Q8_0), and the small q/k/v (1152 x 896) and o (896 x 896) matrices whose
// fixed cost per call shows, measured interleaved in one run. Each call reads another copy of the
// weights from a set of >= 512 MiB, so they come from memory as in decode. Reports, per dtype
// and token count, the milliseconds of one call, the weight bandwidth it reached and the ratio.
//
//   build/bin/quant_linear_bench [--json] [--repeats 5] [--tokens 1,4,8,16]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/cpu/interleaved_linear.h"
#include "kernels/cpu/q8_activations.h"
#include "kernels/cpu/quant_linear.h"
#include "nlohmann/json.hpp"

namespace {

using kvgrid::kernels::cpu::LinearPrecision;
using kvgrid::kernels::cpu::QuantMatrix;
using kvgrid::kernels::cpu::WeightDType;
using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  int64_t out, in;
  WeightDType dtype;  // kF32: the run's dtype
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int repeats = 5;
  std::vector<int64_t> token_counts = {1, 4, 8, 16};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--tokens" && i + 1 < argc) {
      token_counts.clear();
      std::stringstream ss(argv[++i]);
      for (std::string v; std::getline(ss, v, ',');) token_counts.push_back(std::atoll(v.c_str()));
    } else {
      std::fprintf(stderr, "usage: quant_linear_bench [--json] [--repeats N] [--tokens 1,4,8,16]\n");
      return 2;
    }
  }
  const Shape shapes[] = {{"qkv", 1152, 896, WeightDType::kF32},
                          {"o", 896, 896, WeightDType::kF32},
                          {"gate_up", 9728, 896, WeightDType::kF32},
                          {"down", 896, 4864, WeightDType::kF32},
                          {"head", 151936, 896, WeightDType::kQ8_0}};
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 0.05f);
  nlohmann::json rows = nlohmann::json::array();
  for (WeightDType dtype : {WeightDType::kQ8_0, WeightDType::kQ4_0}) {
    for (const Shape& s : shapes) {
      const WeightDType d = s.dtype == WeightDType::kF32 ? dtype : s.dtype;
      if (s.dtype != WeightDType::kF32 && dtype != WeightDType::kQ8_0) continue;  // head once
      std::vector<float> w(static_cast<size_t>(s.out * s.in));
      for (float& v : w) v = normal(rng);
      auto q = kvgrid::kernels::cpu::QuantizeMatrix(w.data(), s.out, s.in, d);
      if (!q.ok()) return 1;
      const int64_t bytes = static_cast<int64_t>(q->data.size());
      const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{512} << 20) / bytes + 1));
      std::vector<QuantMatrix> set(copies, *q);
      const bool interleave = kvgrid::kernels::cpu::HaveInterleavedInt8();
      std::vector<QuantMatrix> interleaved;
      if (interleave) {
        interleaved.assign(copies, *q);
        for (QuantMatrix& c : interleaved) kvgrid::kernels::cpu::InterleaveRows(&c);
      }
      for (int64_t m : token_counts) {
        std::vector<float> x(static_cast<size_t>(m * s.in)), y(static_cast<size_t>(m * s.out));
        for (float& v : x) v = normal(rng) * 20.f;
        double best[3] = {1e30, 1e30, 1e30};
        int next = 0;
        for (int r = 0; r < repeats; ++r) {
          for (int variant = 0; variant < (interleave ? 3 : 2); ++variant) {
            const LinearPrecision precision =
                variant == 1 ? LinearPrecision::kExact : LinearPrecision::kFast;
            const QuantMatrix* weight =
                variant == 2 ? &interleaved[next++ % copies] : &set[next++ % copies];
            const auto t0 = Clock::now();
            const absl::Status st = kvgrid::kernels::cpu::QuantLinear(
                {.input = x.data(), .weight = weight, .output = y.data(),
                 .num_tokens = m, .precision = precision});
            const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
            if (!st.ok()) return 1;
            best[variant] = std::min(best[variant], dt);
          }
        }
        rows.push_back({{"dtype", std::string(kvgrid::kernels::cpu::WeightDTypeName(d))},
                        {"matrix", s.name},
                        {"out", s.out},
                        {"in", s.in},
                        {"tokens", m},
                        {"int8_ms", best[0] * 1e3},
                        {"fp32_inputs_ms", best[1] * 1e3},
                        {"int8_weight_gbs", bytes / best[0] / 1e9},
                        {"fp32_inputs_weight_gbs", bytes / best[1] / 1e9},
                        {"speedup", best[1] / best[0]}});
        if (interleave) {
          rows.back()["interleaved_ms"] = best[2] * 1e3;
          rows.back()["interleaved_weight_gbs"] = bytes / best[2] / 1e9;
          rows.back()["interleaved_vs_fp32_inputs"] = best[1] / best[2];
        }
      }
    }
  }
  const char* isa[] = {"portable", "avx2", "avx512vnni"};
  nlohmann::json j = {
      {"threads", omp_get_max_threads()},
      {"int8_isa", isa[static_cast<int>(kvgrid::kernels::cpu::BestInt8DotIsa())]},
      {"repeats", repeats},
      {"rows", rows}};
  if (json) {
    std::printf("%s\n", j.dump().c_str());
  } else {
    for (const auto& r : rows) {
      std::printf("%-5s %-8s tokens %3lld  int8 %8.3f ms (%5.1f GB/s)  fp32 inputs %8.3f ms  x%.2f",
                  r["dtype"].get<std::string>().c_str(), r["matrix"].get<std::string>().c_str(),
                  static_cast<long long>(r["tokens"].get<int64_t>()), r["int8_ms"].get<double>(),
                  r["int8_weight_gbs"].get<double>(), r["fp32_inputs_ms"].get<double>(),
                  r["speedup"].get<double>());
      if (r.contains("interleaved_ms")) {
        std::printf("  interleaved %8.3f ms (%5.1f GB/s) x%.2f", r["interleaved_ms"].get<double>(),
                    r["interleaved_weight_gbs"].get<double>(),
                    r["interleaved_vs_fp32_inputs"].get<double>());
      }
      std::printf("\n");
    }
  }
  return 0;
}
