// KServe v2 (Open Inference Protocol) requests and responses for LLMs, as Triton's vLLM and
// TensorRT-LLM backends shape them, turned into the one internal generate request and back.
// No I/O: kserve_service.h (gRPC) and kserve_http.h (the HTTP generate extension) are the
// doors; this is fuzzed.
//
// A request names its inputs as tensors (gRPC ModelInfer), or as top-level JSON keys (HTTP
// generate); sampling settings may also come as request parameters or, as the vLLM backend
// takes them, in a `sampling_parameters` JSON string. Later sources override earlier ones:
// request parameters, then sampling_parameters, then inputs. The names:
//
//   text_input (BYTES)                 the prompt, one element
//   stream (BOOL)                      one response per chunk of new text (ModelStreamInfer,
//                                      generate_stream); ModelInfer and generate refuse it
//   max_tokens, min_tokens|min_length  StoppingParams' max_new_tokens, min_tokens
//   temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty
//   random_seed|seed (UINT64)          SamplingParams
//   stop_words|stop (BYTES list)       stop strings; bad_words (BYTES list) words never
//                                      generated (each must be one token of the vocabulary)
//   ignore_eos, include_stop_str_in_output, end_id (a stop token id), priority
//   logprobs (INT)                     alternatives per token in the logprobs output
//   exclude_input_in_output (BOOL)     leave the prompt out of a whole response's text_output
//                                      (default: prepended, as the vLLM backend; streamed
//                                      chunks never carry it)
//   return_finish_reason, return_num_input_tokens, return_num_output_tokens,
//   return_logprobs|return_log_probs, return_cumulative_logprob (BOOL)   optional outputs
//   beam_width, n                      1 only; pad_id taken and unused (nothing is padded)
//   triton_enable_empty_final_response (parameter)   taken; the last response is always
//                                      marked with triton_final_response
//
// Outputs: text_output (BYTES), finish_reason (BYTES: "stop", "length"), num_input_tokens and
// num_output_tokens (UINT32; a streamed chunk's own count), logprobs (BYTES: a JSON list, one
// {"token_id","logprob","top_logprobs"} per token), cumulative_logprob (FP32).
//
// Thread-safety: stateless functions.
#ifndef KVGRID_COORDINATOR_KSERVE_PROTOCOL_H_
#define KVGRID_COORDINATOR_KSERVE_PROTOCOL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "inference/grpc_service.pb.h"
#include "kvgrid/v1/generation.pb.h"

namespace kvgrid::coordinator::kserve {

// The response parameter that marks a request's last streamed response.
inline constexpr char kFinalResponseParam[] = "triton_final_response";
// kvgrid serves one version of each model.
inline constexpr char kModelVersion[] = "1";

enum class Output {
  kTextOutput,
  kFinishReason,
  kNumInputTokens,
  kNumOutputTokens,
  kLogprobs,
  kCumulativeLogprob,
};

// One input or output as ModelMetadata and ModelConfig describe it.
struct TensorSpec {
  const char* name;
  const char* datatype;  // the protocol's: "BYTES", "BOOL", "INT32", "UINT64", "FP32"
  int64_t dim;           // 1, or -1 for any length
  bool optional;
};
const std::vector<TensorSpec>& InputSpecs();
const std::vector<TensorSpec>& OutputSpecs();

// One generate request from either door.
struct GenerateCall {
  std::string model_name;  // as the client named it; "" for the only model (HTTP: the path's)
  std::string id;          // the client's request id, echoed in every response
  // model, prompt, sampling, stopping, priority and request_id (= id) set; what Prepare checks
  // is left to it.
  v1::GenerateRequest request;
  bool stream = false;
  bool exclude_input_in_output = false;
  // Words the model must not generate: the door turns each into a logit bias of -100 on its
  // one token (INVALID_ARGUMENT when a word is not one token).
  std::vector<std::string> bad_words;
  // What each response carries, in this order.
  std::vector<Output> outputs;
};

// A request's generation so far: the whole completion (ModelInfer, generate), or one chunk.
struct Result {
  std::string text;  // the completion's text (prompt not included)
  v1::FinishReason finish_reason = v1::FINISH_REASON_UNSPECIFIED;
  int64_t num_input_tokens = 0;
  int64_t num_output_tokens = 0;
  std::vector<v1::TokenLogprob> logprobs;
};

// A request's responses from the relay, gathered: each message adds to the whole and is
// one chunk.
class Progress {
 public:
  explicit Progress(int64_t num_input_tokens) { total_.num_input_tokens = num_input_tokens; }
  // Adds `msg` (of the request's one continuation) and returns it as a chunk.
  Result Add(const v1::GenerateResponse& msg);
  [[nodiscard]] const Result& total() const { return total_; }

 private:
  Result total_;
};

// The call a ModelInfer request asks for. Errors: INVALID_ARGUMENT naming the input,
// parameter or output ("input 'max_tokens': ...", "unexpected inference input 'x' for model
// 'm'"): a datatype that does not fit, a shape whose element count is not the contents', raw
// contents that are not every input's or do not decode, a second input of one name, a value
// out of range, invalid UTF-8 in a BYTES element, a sampling_parameters string that is not
// a JSON object of known keys.
absl::StatusOr<GenerateCall> ParseInferRequest(const inference::ModelInferRequest& request);

// The call of an HTTP generate body ({"text_input": ..., "parameters": {...}, "id": ...,
// other inputs by name}) for `model_name` (from the path), `stream` for generate_stream.
// Errors: as ParseInferRequest, and INVALID_ARGUMENT for a body that is not a JSON object.
absl::StatusOr<GenerateCall> ParseGenerateBody(std::string_view model_name,
                                               std::string_view body, bool stream);

// A ModelInferResponse for `result`: the outputs `call` asks for, in raw_output_contents, the
// prompt prepended to text_output unless `call` streams or excludes it. `final_response`:
// the triton_final_response parameter, on streamed responses only (nullopt: none).
inference::ModelInferResponse MakeInferResponse(const GenerateCall& call,
                                                const std::string& model_name,
                                                const Result& result,
                                                std::optional<bool> final_response);

// The JSON object of an HTTP generate response (or of one generate_stream event).
std::string MakeGenerateJson(const GenerateCall& call, const std::string& model_name,
                             const Result& result);

// {"error": message}.
std::string ErrorJson(std::string_view message);

// The BYTES elements of `raw` (each a 4-byte little-endian length, then the bytes). Errors:
// INVALID_ARGUMENT ("<what>: ...") when a length runs past the end.
absl::StatusOr<std::vector<std::string>> DecodeBytesElements(std::string_view raw,
                                                             std::string_view what);
// The raw encoding of BYTES elements.
std::string EncodeBytesElements(const std::vector<std::string>& elements);

}  // namespace kvgrid::coordinator::kserve

#endif  // KVGRID_COORDINATOR_KSERVE_PROTOCOL_H_
