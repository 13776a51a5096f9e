// OpenAI's HTTP API shapes, converted: /v1/completions and /v1/chat/completions request
// bodies become the one internal GenerateRequest (one per prompt), and the relay's
// GenerateResponse messages become OpenAI's responses, SSE chunks and error bodies. Nothing
// here does I/O or touches the cluster, so the parsers are fuzzed (tests/fuzz).
//
// Accepted fields are OpenAI's (model, prompt/messages, max_tokens, max_completion_tokens,
// temperature, top_p, n, stop, seed, stream, stream_options.include_usage, logprobs,
// top_logprobs, presence_penalty, frequency_penalty, logit_bias, user, response_format {"type": "text"}, tools, tool_choice) and vLLM's extras
// (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
// skip_special_tokens, include_stop_str_in_output, priority, chat_template_kwargs,
// add_generation_prompt, documents). Unknown fields are ignored, as OpenAI-compatible servers
// do; a field of the wrong type or out of range is INVALID_ARGUMENT whose message starts with
// the field's name ("temperature: ..."), which ErrorBody reports as `param`.
//
// Thread-safety: free functions of their arguments.
#ifndef KVGRID_COORDINATOR_OPENAI_PROTOCOL_H_
#define KVGRID_COORDINATOR_OPENAI_PROTOCOL_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvgrid/v1/generation.pb.h"

namespace kvgrid::coordinator::openai {

// Largest body a request may have (its JSON nests at most model::kMaxJsonDepth levels).
inline constexpr size_t kMaxBodyBytes = 32 << 20;

enum class Endpoint { kCompletions, kChat };

// A parsed generate request.
struct GenerateCall {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // as the client named it (echoed when not empty)
  // One request per prompt (chat: exactly one). Each carries n, sampling, stopping.
  std::vector<v1::GenerateRequest> requests;
  uint32_t n = 1;
  bool stream = false;
  bool include_usage = false;
  // Completions: `logprobs: k`; chat: `top_logprobs` when `logprobs` is true. Unset: none.
  std::optional<int32_t> logprobs;
  bool skip_special_tokens = true;  // for the logprob token strings
  // The client set max_tokens / max_completion_tokens.
  bool max_tokens_given = false;
  // Completions: vLLM's add_special_tokens (default true): text prompts are tokenized with
  // what the tokenizer's post-processor adds (Llama 2's <s>; Qwen: nothing).
  bool add_special_tokens = true;
};

// Parses a request body. Errors: INVALID_ARGUMENT naming the field (or "body" for text that is
// no JSON object, too large or too deeply nested).
absl::StatusOr<GenerateCall> ParseGenerateCall(Endpoint endpoint, absl::string_view body);

// POST /tokenize: {"model", "prompt" | "messages", "add_special_tokens"} (vLLM's names).
struct TokenizeCall {
  std::string model;
  v1::GenerateRequest chat;  // messages etc. when the body gave messages
  std::optional<std::string> prompt;
  bool add_special_tokens = true;
};
absl::StatusOr<TokenizeCall> ParseTokenizeCall(absl::string_view body);

// POST /detokenize: {"model", "tokens": [ids]}.
struct DetokenizeCall {
  std::string model;
  std::vector<int32_t> tokens;
};
absl::StatusOr<DetokenizeCall> ParseDetokenizeCall(absl::string_view body);

// The HTTP status for a request that failed with `status` (the one place absl/gRPC codes
// become HTTP): INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION 400; UNAUTHENTICATED 401;
// PERMISSION_DENIED 403; NOT_FOUND 404; RESOURCE_EXHAUSTED 429; CANCELLED 499;
// UNAVAILABLE 503; DEADLINE_EXCEEDED 504; anything else 500.
int HttpStatusFor(absl::StatusCode code);

// Why the JSON parser refused `body`: INVALID_ARGUMENT "<path>: invalid UTF-8" naming the
// field whose text is not UTF-8 ("messages[1].content"), else "body: not valid JSON".
absl::Status JsonError(absl::string_view body);

// {"error": {"message", "type", "param", "code"}} as OpenAI's servers send it, for `status`.
std::string ErrorBody(const absl::Status& status);
// The same, with the HTTP status of a transport-level refusal (413 body too large, 404 path,
// 405 method).
std::string ErrorBody(int http_status, absl::string_view message);

// What the response builder needs of the model's tokenizer: a token's text and bytes (for
// logprobs). Either may be null (then ids are shown as text, bytes left out).
struct TokenText {
  std::function<std::string(int32_t)> text;
  std::function<std::optional<std::string>(int32_t)> bytes;
};

// One choice's accumulated output.
struct Choice {
  uint32_t index = 0;
  std::string text;
  int64_t num_tokens = 0;
  std::vector<v1::TokenLogprob> logprobs;
  v1::FinishReason finish_reason = v1::FINISH_REASON_UNSPECIFIED;
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
};

// Identity of one response: one id, created time and model for all its chunks.
struct ResponseHeader {
  std::string id;
  int64_t created = 0;
  std::string model;
};

// The non-streamed response of `call` (chat.completion or text_completion).
std::string CompletionResponse(const GenerateCall& call, const ResponseHeader& header,
                               const std::vector<Choice>& choices, const Usage& usage,
                               const TokenText& tokens);

// One SSE event ("data: {...}\n\n"): a chunk of choice `index` carrying `delta` (the new
// text, its logprobs), the assistant role first for chat (`first`), and finish_reason when
// set. Usage is never in a choice chunk.
std::string ChunkEvent(const GenerateCall& call, const ResponseHeader& header, uint32_t index,
                       bool first, const std::string& text,
                       const std::vector<v1::TokenLogprob>& logprobs,
                       v1::FinishReason finish_reason, const TokenText& tokens,
                       int64_t text_offset);
// The usage chunk (choices: []) sent before [DONE] when include_usage.
std::string UsageEvent(const GenerateCall& call, const ResponseHeader& header,
                       const Usage& usage);
// An error after streaming began: a data: event with the error object.
std::string ErrorEvent(const absl::Status& status);
inline constexpr char kDoneEvent[] = "data: [DONE]\n\n";

// "stop" or "length" (null for unspecified, as JSON text "null").
absl::string_view FinishReasonName(v1::FinishReason reason);

}  // namespace kvgrid::coordinator::openai

#endif  // KVGRID_COORDINATOR_OPENAI_PROTOCOL_H_
