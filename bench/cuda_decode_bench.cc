// cuda_decode_bench: decode tokens/s of a Llama-3-8B-shaped model with random bf16 weights on
// one GPU (worker/executor/cuda_llama_model.h), at batch 1 and 32, with fp16, int8, int4 and
// fp8_e4m3 KV, every sequence at --context tokens, each step run kernel by kernel (eager) and
// from a CUDA graph (--graphs both, the default; vs_eager is the graph's speedup, vs_fp16
// compares graph rows). The cache is not prefilled: decode reads every cached row
// whatever its value, so the zero-filled pool times the same. Each (batch, dtype) runs --warmup
// steps, then --steps timed with CUDA events (logits stay on the device, as a sampler on the
// device would leave them); output tokens/s = batch x steps / time. Prints JSON with --json and
// exits 0 with a message where no GPU is visible.
//
//   build/bin/cuda_decode_bench [--json] [--context 8192] [--steps 20] [--warmup 3]
//                               [--batches 1,32] [--graphs on|off|both] [--shape 8b|tiny]
//
// --shape tiny (bench_models.h's TinyLlama3Config) runs the program's own code at a size the
// CUDA emulator (tests/cuda_emu) gets through in seconds; its figures mean nothing.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_models.h"
#include "kernels/kv_dtype.h"
#include "nlohmann/json.hpp"
#include "worker/executor/cuda_llama_model.h"
#include "worker/executor/llama_model.h"
#include "worker/kv/block_manager.h"

namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "cuda_decode_bench: %s: %s\n", what.c_str(), std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using kvgrid::kernels::KvDType;
  bool json = false;
  int64_t context = 8192, steps = 20, warmup = 3;
  std::vector<int64_t> batches = {1, 32};
  std::vector<bool> modes = {false, true};  // eager, then CUDA graphs
  bool tiny = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if ((a == "--context" || a == "--steps" || a == "--warmup") && i + 1 < argc) {
      const int64_t v = std::atoll(argv[++i]);
      (a == "--context" ? context : a == "--steps" ? steps : warmup) = v;
    } else if (a == "--graphs" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "on" && v != "off" && v != "both") {
        std::fprintf(stderr, "cuda_decode_bench: --graphs on|off|both, got '%s'\n", v.c_str());
        return 2;
      }
      modes = v == "on" ? std::vector<bool>{true}
              : v == "off" ? std::vector<bool>{false}
                           : std::vector<bool>{false, true};
    } else if (a == "--shape" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v != "8b" && v != "tiny") {
        std::fprintf(stderr, "cuda_decode_bench: --shape 8b|tiny, got '%s'\n", v.c_str());
        return 2;
      }
      tiny = v == "tiny";
    } else if (a == "--batches" && i + 1 < argc) {
      batches.clear();
      std::stringstream ss(argv[++i]);
      for (std::string part; std::getline(ss, part, ',');) batches.push_back(std::atoll(part.c_str()));
    } else {
      std::fprintf(stderr, "usage: cuda_decode_bench [--json] [--context N] [--steps N] "
                           "[--warmup N] [--batches 1,32] [--graphs on|off|both] [--shape 8b|tiny]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cuda_decode_bench: no CUDA device visible; nothing measured\n");
    return 0;
  }
  if (context < 1 || steps < 1 || warmup < 1 || batches.empty()) {
    // At least one warmup step: with graphs it is the one that captures.
    std::fprintf(stderr, "cuda_decode_bench: --context, --steps, --warmup >= 1\n");
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const kvgrid::model::ModelConfig config =
      tiny ? kvgrid::bench::TinyLlama3Config() : kvgrid::bench::Llama3_8BConfig();
  auto model = kvgrid::worker::CudaLlamaModel::Random(config, kvgrid::model::DType::kBF16, 1234);
  if (!model.ok()) return Fail("model", model.status());
  cudaStream_t stream = (*model)->stream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);

  nlohmann::json rows = nlohmann::json::array();
  for (int64_t batch : batches) {
    double fp16_rate = 0;
    for (auto [name, kv] : {std::pair{"fp16", KvDType::kF16}, std::pair{"int8", KvDType::kInt8},
                            std::pair{"int4", KvDType::kInt4},
                            std::pair{"fp8_e4m3", KvDType::kFp8E4m3}}) {
      const kvgrid::worker::KvGeometry g = (*model)->KvGeometryFor(16, kv, kv);
      // Both modes run on one pool, the second continuing where the first stopped.
      const int64_t tokens = context + static_cast<int64_t>(modes.size()) * (warmup + steps);
      const int64_t blocks_needed = batch * ((tokens + 15) / 16);
      auto pool = kvgrid::worker::CudaKvPool::Create(g, blocks_needed * g.BytesPerBlock());
      if (!pool.ok()) return Fail("KV pool", pool.status());
      kvgrid::worker::BlockManager blocks((*pool)->num_blocks(), 16);
      std::vector<kvgrid::worker::SequenceId> seqs;
      for (int64_t s = 1; s <= batch; ++s) {
        if (!blocks.Reserve(s, tokens).ok()) return Fail("blocks", absl::InternalError("reserve"));
        seqs.push_back(s);
      }
      const auto step = [&](int64_t pos) {
        std::vector<int32_t> next(batch);
        for (int64_t s = 0; s < batch; ++s) next[s] = static_cast<int32_t>((pos * 7919 + s) % config.vocab_size);
        return (*model)->Forward(kvgrid::worker::DecodeBatch(blocks, seqs, pos, next), **pool,
                                 nullptr);
      };
      int64_t pos = context;
      double eager_rate = 0;
      for (bool graphs : modes) {
        (*model)->SetDecodeGraphs(graphs);
        // The warmup captures the graph (the context bound stays one power of two throughout).
        for (int64_t i = 0; i < warmup; ++i) {
          if (absl::Status s = step(pos++); !s.ok()) return Fail("warmup", s);
        }
        cudaStreamSynchronize(stream);
        const int64_t replays_before = (*model)->decode_graph_stats().replays;
        cudaEventRecord(start, stream);
        for (int64_t i = 0; i < steps; ++i) {
          if (absl::Status s = step(pos++); !s.ok()) return Fail("step", s);
        }
        cudaEventRecord(stop, stream);
        if (cudaEventSynchronize(stop) != cudaSuccess) {
          return Fail("timing", absl::InternalError(cudaGetErrorString(cudaGetLastError())));
        }
        const auto& stats = (*model)->decode_graph_stats();
        if (graphs && stats.replays - replays_before != steps) {
          return Fail("graphs", absl::InternalError("timed steps did not all replay a graph: " +
                                                    stats.disabled_by));
        }
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        const double rate = static_cast<double>(batch * steps) / (ms / 1e3);
        if (kv == KvDType::kF16 && (graphs || modes.size() == 1)) fp16_rate = rate;
        if (!graphs) eager_rate = rate;
        nlohmann::json row = {{"batch", batch},
                              {"kv_dtype", name},
                              {"cuda_graphs", graphs},
                              {"context", context},
                              {"step_ms", ms / static_cast<double>(steps)},
                              {"output_tokens_per_s", rate},
                              {"kv_bytes", (*pool)->bytes()}};
        if (graphs && eager_rate > 0) row["vs_eager"] = rate / eager_rate;
        if (graphs || modes.size() == 1) row["vs_fp16"] = rate / fp16_rate;
        rows.push_back(row);
      }
    }
  }
  nlohmann::json j = {{"model", tiny ? "tiny llama-3 shape (random bf16 weights)"
                                      : "llama-3-8b-shape (random bf16 weights)"},
                      {"device", prop.name},
                      {"weight_bytes", (*model)->WeightBytes()},
                      {"steps", steps},
                      {"results", rows}};
  std::printf("%s\n", json ? j.dump().c_str() : j.dump(2).c_str());
  return 0;
}
