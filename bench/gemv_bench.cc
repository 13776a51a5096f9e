// gemv_bench: the decode-path linear layer (kvgrid's streaming SIMD GEMV) against OpenBLAS
// SGEMV on the matrix shapes of a Qwen2-0.5B layer and its vocabulary head, measured
// interleaved in one run so machine noise hits both alike. Each call reads a different copy of
// the matrix from a set of >= 512 MiB, so weights come from memory as they do in decode.
//
//   build/bin/gemv_bench [--json] [--repeats 5]
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  int64_t out, in;
};

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int repeats = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: gemv_bench [--json] [--repeats N]\n");
      return 2;
    }
  }
  const Shape shapes[] = {{"qkv 1152x896", 1152, 896},
                          {"gate_up 9728x896", 9728, 896},
                          {"down 896x4864", 896, 4864},
                          {"lm_head 151936x896", 151936, 896}};
  nlohmann::json results = nlohmann::json::array();
  for (const Shape& s : shapes) {
    const int64_t elems = s.out * s.in;
    const int64_t copies = std::max<int64_t>(1, (int64_t{512} << 20) / (elems * 4));
    std::vector<float> w(copies * elems), x(s.in), y(s.out);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 97) * 1e-3f;
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 1e-2f;
    // Enough calls per timing that each covers ~0.5 GB of weight traffic.
    const int64_t calls = std::max<int64_t>(copies, 500000000 / (elems * 4));
    double best_own = 1e30, best_blas = 1e30;
    for (int r = 0; r < repeats; ++r) {
      auto t0 = Clock::now();
      for (int64_t c = 0; c < calls; ++c) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(s.out), static_cast<int>(s.in),
                    1.f, w.data() + (c % copies) * elems, static_cast<int>(s.in), x.data(), 1,
                    0.f, y.data(), 1);
      }
      best_blas = std::min(best_blas, std::chrono::duration<double>(Clock::now() - t0).count());
      t0 = Clock::now();
      for (int64_t c = 0; c < calls; ++c) {
        (void)kvgrid::kernels::cpu::Linear({.input = x.data(),
                                            .weight = w.data() + (c % copies) * elems,
                                            .output = y.data(),
                                            .num_tokens = 1,
                                            .in_features = s.in,
                                            .out_features = s.out});
      }
      best_own = std::min(best_own, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double bytes = static_cast<double>(calls) * s.out * s.in * 4;
    results.push_back({{"shape", s.name},
                       {"kvgrid_gbs", bytes / best_own / 1e9},
                       {"openblas_gbs", bytes / best_blas / 1e9},
                       {"speedup", best_blas / best_own}});
  }
  nlohmann::json j = {{"threads", omp_get_max_threads()}, {"results", results}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
