// libFuzzer target for the OpenAI HTTP API's request parsers (coordinator/openai_protocol.h):
// any body is parsed or refused with INVALID_ARGUMENT naming a field, never a crash, a hang or
// an internal error; what parses keeps the bounds the rest of the path relies on, and the
// response builders accept it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "coordinator/openai_protocol.h"

namespace openai = kvgrid::coordinator::openai;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view body(reinterpret_cast<const char*>(data), size);
  for (openai::Endpoint e : {openai::Endpoint::kCompletions, openai::Endpoint::kChat}) {
    auto call = openai::ParseGenerateCall(e, body);
    if (!call.ok()) {
      if (call.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
      if (openai::ErrorBody(call.status()).empty()) std::abort();
      continue;
    }
    if (call->requests.empty() || call->n < 1 || call->n > 256 ||
        call->requests.size() * call->n > 256) {
      std::abort();
    }
    if (call->logprobs && (*call->logprobs < 0 || *call->logprobs > 20)) std::abort();
    const openai::ResponseHeader header{"id", 0, call->model};
    std::vector<openai::Choice> choices(call->requests.size() * call->n);
    (void)openai::CompletionResponse(*call, header, choices, {}, {});
    (void)openai::ChunkEvent(*call, header, 0, true, call->model, {},
                             kvgrid::v1::FINISH_REASON_STOP, {}, 0);
  }
  auto tok = openai::ParseTokenizeCall(body);
  if (!tok.ok() && tok.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  auto detok = openai::ParseDetokenizeCall(body);
  if (!detok.ok() && detok.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  return 0;
}
