// Chat requests: a GenerateRequest's conversation (messages, tools, documents, template
// kwargs) turned into the variables of the model's chat template, rendered, and tokenized —
// with the conventions clients know from vLLM's OpenAI server, so that the same conversation
// gives the same prompt tokens:
//   - a message is a dict with "role" and "content" (a string: text-only content parts are
//     joined by "\n", vLLM's default "string" content format) and "name", "tool_calls",
//     "tool_call_id", "reasoning_content" only when set;
//   - a tool call's arguments that parse as a JSON object are a dict, else the string;
//   - tools and documents are None when not given; add_generation_prompt defaults to true;
//     chat_template_kwargs are top-level variables applied last;
//   - the rendered text is tokenized with special tokens recognized and nothing added:
//     templates write their own BOS, and add_bos never doubles it.
//
// Thread-safety: functions of immutable inputs; run concurrently.
#ifndef KVGRID_COORDINATOR_CHAT_REQUEST_H_
#define KVGRID_COORDINATOR_CHAT_REQUEST_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/model_catalog.h"
#include "kvgrid/v1/generation.pb.h"
#include "model/jinja/value.h"

namespace kvgrid::coordinator {

// Messages one chat request may hold (its bytes are bounded by the server's message size).
inline constexpr int kMaxChatMessages = 8192;

// True when `request` carries a conversation (messages).
[[nodiscard]] inline bool IsChatRequest(const v1::GenerateRequest& request) {
  return request.messages_size() > 0;
}

// INVALID_ARGUMENT naming the first chat-only field (tools_json, documents_json,
// add_generation_prompt, chat_template_kwargs_json) set on a request without messages.
absl::Status CheckNoChatFields(const v1::GenerateRequest& request);

// The template variables of a chat request: "messages", "tools", "documents",
// "add_generation_prompt", then chat_template_kwargs, each replacing an earlier one of the
// same name. Errors: INVALID_ARGUMENT naming the field — more than kMaxChatMessages messages,
// messages[i].role unset, content and content_parts both set, a part that is not text,
// a tool call without a function name, tools_json or documents_json that is not a JSON
// array (of objects, for tools), chat_template_kwargs_json that is not a JSON object or sets
// "messages".
absl::StatusOr<model::jinja::Value> ChatTemplateVariables(const v1::GenerateRequest& request);

// The prompt text `model`'s chat template renders for `request`. Errors: as
// ChatTemplateVariables; INVALID_ARGUMENT naming messages when the model has no chat template
// (saying how to give one) or the template fails or raises (with its message).
absl::StatusOr<std::string> RenderChat(const ServedModel& model,
                                       const v1::GenerateRequest& request);

// The prompt token ids of a chat request: RenderChat, tokenized with special tokens
// recognized, BOS prepended only for add_bos and only when the text does not begin with it.
// Errors: as RenderChat; INVALID_ARGUMENT naming messages for a model without a tokenizer or
// an empty rendering, naming add_bos when the model defines no BOS.
absl::StatusOr<std::vector<int32_t>> EncodeChat(const ServedModel& model,
                                                const v1::GenerateRequest& request);

// Adds `model`'s end-of-turn token to `stopping`'s stop ids for a chat request, unless
// ignore_eos, or it is already an EOS id or a stop id: an assistant's turn then ends there.
void AddEndOfTurn(const ServedModel& model, v1::StoppingParams* stopping);

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_CHAT_REQUEST_H_
