// kvgrid gguf-info: what a GGUF file holds — metadata and tensor directory — and, with
// --dump NAME, one tensor's values as fp32 (block formats dequantized by kvgrid's kernels).
#include <cstdio>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/quant_linear.h"
#include "model/gguf.h"
#include "model/status_macros.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid gguf-info --file F [--dump TENSOR] [--json]\n"
    "\n"
    "  --file F        a GGUF file (version 2 or 3)\n"
    "  --dump TENSOR   print that tensor's values as fp32 (JSON array)\n"
    "  --json          print the metadata and tensor directory as one JSON object\n";

nlohmann::json ToJson(const model::GgufValue& v) {
  return std::visit(
      [](const auto& x) -> nlohmann::json {
        if constexpr (std::is_same_v<std::decay_t<decltype(x)>, model::GgufNumberArray>) {
          nlohmann::json out = nlohmann::json::array();
          for (size_t i = 0; i < x.size(); ++i) {
            if (x.is_float()) {
              out.push_back(x.Float(i));
            } else {
              out.push_back(x.Int(i));
            }
          }
          return out;
        } else if constexpr (std::is_same_v<std::decay_t<decltype(x)>, model::GgufStringArray>) {
          return nlohmann::json(x.ToVector());
        } else {
          return nlohmann::json(x);
        }
      },
      v);
}

absl::Status GgufInfo(Args& args) {
  const std::optional<std::string> file = args.GetString("file");
  const std::optional<std::string> dump = args.GetString("dump");
  KVGRID_ASSIGN_OR_RETURN(bool json, args.GetBool("json", false));
  KVGRID_RETURN_IF_ERROR(args.Finish());
  if (!file) return absl::InvalidArgumentError("--file: required (a GGUF file)");
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<model::GgufFile> gguf, model::GgufFile::Open(*file));
  if (dump) {
    KVGRID_ASSIGN_OR_RETURN(const model::GgufTensor* t, gguf->Find(*dump));
    std::vector<float> values;
    KVGRID_RETURN_IF_ERROR(kernels::cpu::GgufTensorToF32(*t, &values));
    std::printf("%s\n", nlohmann::json(values).dump().c_str());
    return absl::OkStatus();
  }
  if (json) {
    // Only --json renders the metadata: a large array is expanded only when asked for.
    nlohmann::json meta = nlohmann::json::object(), tensors = nlohmann::json::array();
    for (const auto& [key, value] : gguf->metadata()) meta[key] = ToJson(value);
    for (const auto& [name, t] : gguf->tensors()) {
      tensors.push_back({{"name", name}, {"type", model::GgmlTypeName(t.type)}, {"ne", t.ne},
                         {"bytes", t.data.size()}});
    }
    const nlohmann::json j = {{"version", gguf->version()}, {"metadata", meta},
                              {"tensors", tensors}};
    std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("GGUF v%u: %zu metadata entries, %zu tensors\n", gguf->version(),
                gguf->metadata().size(), gguf->tensors().size());
    for (const auto& [name, t] : gguf->tensors()) {
      std::string shape;
      for (int64_t d : t.ne) absl::StrAppend(&shape, shape.empty() ? "" : " x ", d);
      std::printf("  %-40s %-6s [%s] %zu bytes\n", name.c_str(),
                  model::GgmlTypeName(t.type).c_str(), shape.c_str(), t.data.size());
    }
  }
  return absl::OkStatus();
}

}  // namespace

int GgufInfoCommand(Args& args) { return RunSubcommand(args, "gguf-info", kHelp, GgufInfo); }

}  // namespace kvgrid::cli
