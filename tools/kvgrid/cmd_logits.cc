// kvgrid logits: prefill --prompt-ids, decode --decode-ids one at a time, and print the logits
// of the last position as JSON. Drives the model, KV pool and block manager directly, so
// reference checks see exactly what the kernels compute.
#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/kv_quant.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"
#include "tools/kvgrid/model_setup.h"
#include "worker/kv/block_manager.h"
#include "worker/kv/kv_pool.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid logits [--model DIR|FILE.gguf] --prompt-ids 1,2,3 [--decode-ids 4,5]\n"
    "                     [--kv-cache-dtype fp32|fp16|bf16|int8|int4|fp8_e4m3|auto]\n"
    "                     [--block-size 16] [--prefill-chunk N] [--exact-attention]\n"
    "                     [--exact-linear]\n"
    "                     (--k-cache-dtype / --v-cache-dtype choose separately)\n"
    "prints {\"logits\": [...], \"num_tokens\": N, \"weight_bytes\": B} for the last\n"
    "position (B: the model's weights as held)\n"
    "--prefill-chunk N prefills the prompt N tokens at a time (default: all at once); with a\n"
    "sliding-window model, blocks that fall out of the window are freed as it goes\n"
    "--exact-attention: fp32 math on decoded int8 K/V instead of the fast integer kernels\n"
    "--exact-linear: fp32 inputs to Q8_0/Q4_0/Q4_1 weights instead of 8-bit ones and\n"
    "integer dot products\n";

absl::Status Logits(Args& args) {
  const std::filesystem::path dir = ResolveModelDir(args);
  KVGRID_ASSIGN_OR_RETURN(auto prompt, args.GetIntList("prompt-ids"));
  KVGRID_ASSIGN_OR_RETURN(auto decode, args.GetIntList("decode-ids"));
  KVGRID_ASSIGN_OR_RETURN(worker::EngineOptions options, EngineOptionsFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(const KvDTypeFlags kv_dtypes, KvDTypesFromArgs(args));
  KVGRID_ASSIGN_OR_RETURN(auto chunk_flag, args.GetInt("prefill-chunk"));
  KVGRID_ASSIGN_OR_RETURN(const bool exact_attention, args.GetBool("exact-attention", false));
  KVGRID_ASSIGN_OR_RETURN(const bool exact_linear, args.GetBool("exact-linear", false));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (chunk_flag && *chunk_flag < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill-chunk: must be >= 1, got ", *chunk_flag));
  }
  if (!prompt || prompt->empty()) {
    return absl::InvalidArgumentError("--prompt-ids: required and non-empty");
  }
  // A Hugging Face directory, or a .gguf file.
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<worker::LlamaModel> model,
                          dir.extension() == ".gguf" ? worker::LlamaModel::LoadGguf(dir)
                                                     : worker::LlamaModel::Load(dir));
  kv_dtypes.ApplyTo(model->config(), &options);
  if (exact_attention) model->SetAttentionPrecision(kernels::cpu::KvKernelPrecision::kExact);
  if (exact_linear) model->SetLinearPrecision(kernels::cpu::LinearPrecision::kExact);
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

  const int64_t window = model->config().KvWindow();
  std::vector<int32_t> tokens = *prompt;
  std::vector<float> logits;
  int64_t computed = 0;
  // Computes tokens [computed, end); a sliding-window model then frees the blocks its next
  // query cannot see, as the engine does, so the kernels run over tables with holes.
  auto run_step = [&](int64_t end) -> absl::Status {
    const std::span<const int32_t> step =
        std::span<const int32_t>(tokens).subspan(computed, end - computed);
    const worker::ForwardBatch b = worker::SingleSequenceBatch(manager, kSeq, computed, step);
    computed = end;
    KVGRID_RETURN_IF_ERROR(model->Forward(b, *pool, &logits));
    if (window > 0) manager.ReleaseBefore(kSeq, computed - window + 1);
    return absl::OkStatus();
  };
  const int64_t chunk = chunk_flag.value_or(static_cast<int64_t>(tokens.size()));
  while (computed < static_cast<int64_t>(tokens.size())) {
    KVGRID_RETURN_IF_ERROR(
        run_step(std::min<int64_t>(static_cast<int64_t>(tokens.size()), computed + chunk)));
  }
  for (int32_t id : extra) {
    tokens.push_back(id);
    KVGRID_RETURN_IF_ERROR(run_step(static_cast<int64_t>(tokens.size())));
  }
  nlohmann::json j;
  j["logits"] = logits;
  j["num_tokens"] = tokens.size();
  j["weight_bytes"] = model->WeightBytes();  // as held: blocks kept count as blocks
  std::printf("%s\n", j.dump().c_str());
  return absl::OkStatus();
}

}  // namespace

int LogitsCommand(Args& args) { return RunSubcommand(args, "logits", kHelp, &Logits); }

}  // namespace kvgrid::cli
