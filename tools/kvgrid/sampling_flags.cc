#include "tools/kvgrid/sampling_flags.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "model/status_macros.h"

namespace kvgrid::cli {

absl::StatusOr<std::vector<std::pair<int32_t, float>>> ParseLogitBias(const std::string& text) {
  std::vector<std::pair<int32_t, float>> out;
  std::set<int32_t> ids;
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(entry, ':');
    int32_t id = 0;
    float bias = 0;
    if (std::count(entry.begin(), entry.end(), ':') != 1 || !absl::SimpleAtoi(kv.first, &id) ||
        !absl::SimpleAtof(kv.second, &bias)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--logit-bias: '", entry, "' is not ID:BIAS (e.g. 13:-100,42:5.5)"));
    }
    if (!ids.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--logit-bias: token id ", id, " is given more than once"));
    }
    out.emplace_back(id, bias);
  }
  return out;
}

absl::StatusOr<SamplingFlags> ReadSamplingFlags(Args& args) {
  SamplingFlags f;
  KVGRID_ASSIGN_OR_RETURN(f.temperature, args.GetDouble("temperature"));
  KVGRID_ASSIGN_OR_RETURN(f.top_p, args.GetDouble("top-p"));
  KVGRID_ASSIGN_OR_RETURN(f.top_k, args.GetInt("top-k"));
  KVGRID_ASSIGN_OR_RETURN(f.min_p, args.GetDouble("min-p"));
  KVGRID_ASSIGN_OR_RETURN(f.repetition_penalty, args.GetDouble("repetition-penalty"));
  KVGRID_ASSIGN_OR_RETURN(f.presence_penalty, args.GetDouble("presence-penalty"));
  KVGRID_ASSIGN_OR_RETURN(f.frequency_penalty, args.GetDouble("frequency-penalty"));
  if (std::optional<std::string> bias = args.GetString("logit-bias")) {
    KVGRID_ASSIGN_OR_RETURN(f.logit_bias, ParseLogitBias(*bias));
  }
  KVGRID_ASSIGN_OR_RETURN(f.seed, args.GetInt("seed"));
  KVGRID_ASSIGN_OR_RETURN(f.max_new_tokens, args.GetInt("max-new-tokens"));
  KVGRID_ASSIGN_OR_RETURN(f.min_tokens, args.GetInt("min-tokens"));
  KVGRID_ASSIGN_OR_RETURN(f.ignore_eos, args.GetBool("ignore-eos", false));
  KVGRID_ASSIGN_OR_RETURN(f.stop_token_ids, args.GetIntList("stop-token-ids"));
  f.stop = args.GetString("stop");
  KVGRID_ASSIGN_OR_RETURN(f.include_stop_str_in_output,
                          args.GetBool("include-stop-str-in-output", false));
  return f;
}

}  // namespace kvgrid::cli
