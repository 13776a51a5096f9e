#include "tools/kvgrid/sampling_flags.h"

#include "model/status_macros.h"

namespace kvgrid::cli {

absl::StatusOr<SamplingFlags> ReadSamplingFlags(Args& args) {
  SamplingFlags f;
  KVGRID_ASSIGN_OR_RETURN(f.temperature, args.GetDouble("temperature"));
  KVGRID_ASSIGN_OR_RETURN(f.top_p, args.GetDouble("top-p"));
  KVGRID_ASSIGN_OR_RETURN(f.top_k, args.GetInt("top-k"));
  KVGRID_ASSIGN_OR_RETURN(f.min_p, args.GetDouble("min-p"));
  KVGRID_ASSIGN_OR_RETURN(f.repetition_penalty, args.GetDouble("repetition-penalty"));
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
