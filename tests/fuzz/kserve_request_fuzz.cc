// libFuzzer target for the KServe v2 request parsers (coordinator/kserve_protocol.h): the
// bytes as a ModelInferRequest's wire form and as an HTTP generate body are parsed or refused
// with INVALID_ARGUMENT or NOT_FOUND, never a crash, a hang or an internal error; what parses
// has a prompt, and the response builders accept it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coordinator/kserve_protocol.h"

namespace kserve = kvgrid::coordinator::kserve;

namespace {

void Check(const absl::StatusOr<kserve::GenerateCall>& call) {
  if (!call.ok()) {
    const absl::StatusCode code = call.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kNotFound) {
      std::abort();
    }
    if (call.status().message().empty()) std::abort();
    return;
  }
  if (call->outputs.empty() || call->id.size() > 256) std::abort();
  kserve::Result result{.text = "x", .finish_reason = kvgrid::v1::FINISH_REASON_STOP};
  (void)kserve::MakeInferResponse(*call, "m", result, true);
  (void)kserve::MakeGenerateJson(*call, "m", result);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  inference::ModelInferRequest request;
  if (request.ParseFromArray(data, static_cast<int>(size))) Check(kserve::ParseInferRequest(request));
  Check(kserve::ParseGenerateBody("m", bytes, false));
  Check(kserve::ParseGenerateBody("m", bytes, true));
  (void)kserve::DecodeBytesElements(bytes, "fuzz");
  return 0;
}
