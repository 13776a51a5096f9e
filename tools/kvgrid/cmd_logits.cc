// kvgrid logits: prefill --prompt-ids, decode --decode-ids one at a time, and print the logits
// of the last position as JSON. Drives the model, KV pool and block manager directly, so
// reference checks see exactly what the kernels compute.
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/model_setup.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid logits [--model DIR] --prompt-ids 1,2,3 [--decode-ids 4,5]\n"
    "                     [--kv-cache-dtype fp32|fp16|bf16|int8|int4|fp8_e4m3|auto]\n"
    "                     [--block-size 16]\n"
    "                     (--k-cache-dtype / --v-cache-dtype choose separately)\n"
    "prints {\"logits\": [...], \"num_tokens\": N} for the last position\n";

absl::Status Logits(Args& args) {
  const std::filesystem::path dir = ResolveModelDir(args);
  KVGRID_ASSIGN_OR_RETURN(auto prompt, args.GetIntList("prompt-ids"));
  KVGRID_ASSIGN_OR_RETURN(auto decode, args.GetIntList("decode-ids"));
  KVGRID_ASSIGN_OR_RETURN(worker::EngineOptions options, EngineOptionsFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const KvDTypeFlags kv_dtypes, KvDTypesFromArgs(args));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (!prompt || prompt->empty()) {
    return absl::InvalidArgumentError("--prompt-ids: required and non-empty");
  }
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<worker::LlamaModel> model, worker::LlamaModel::Load(dir));
  kv_dtypes.ApplyTo(model->config(), &options);
  const std::vector<int32_t> extra = decode.value_or(std::vector<int32_t>{});
  const int64_t total = static_cast<int64_t>(prompt->size() + extra.size());
  if (total > model->config().max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--prompt-ids/--decode-ids: ", total, " tokens exceed the context window of ",
        model->config().max_position_embeddings));
  }
  const worker::KvGeometry geometry =
      model->KvGeometryFor(options.block_size, options.k_dtype, options.v_dtype);
  const int64_t blocks = (total + options.block_size - 1) / options.block_size;
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<worker::KvPool> pool,
                          worker::KvPool::Create(geometry, blocks * geometry.BytesPerBlock()));
  worker::BlockManager manager(pool->num_blocks(), static_cast<int32_t>(options.block_size));
  constexpr worker::SequenceId kSeq = 1;
  KVGRID_RETURN_IF_ERROR(manager.Reserve(kSeq, total));

  std::vector<int32_t> tokens = *prompt;
  std::vector<float> logits;
  int64_t computed = 0;
  auto run_step = [&]() -> absl::Status {
    const worker::ForwardBatch b = worker::SingleSequenceBatch(
        manager, kSeq, computed, std::span<const int32_t>(tokens).subspan(computed));
    computed = static_cast<int64_t>(tokens.size());
    return model->Forward(b, *pool, &logits);
  };
  KVGRID_RETURN_IF_ERROR(run_step());
  for (int32_t id : extra) {
    tokens.push_back(id);
    KVGRID_RETURN_IF_ERROR(run_step());
  }
  nlohmann::json j;
  j["logits"] = logits;
  j["num_tokens"] = tokens.size();
  std::printf("%s\n", j.dump().c_str());
  return absl::OkStatus();
}

}  // namespace

int LogitsCommand(Args& args) { return RunSubcommand(args, "logits", kHelp, &Logits); }

}  // namespace kvgrid::cli
