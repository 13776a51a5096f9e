#include "coordinator/chat_request.h"

#include <algorithm>
#include <string_view>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/chat_template.h"
#include "model/json_util.h"
#include "model/status_macros.h"

namespace kvgrid::coordinator {
namespace {

namespace jinja = model::jinja;
using model::Sv;
using std::string_view_literals::operator""sv;

// `status` (an error about `field`) with a message that begins with the field's name.
absl::Status Naming(std::string_view field, const absl::Status& status) {
  if (absl::StartsWith(status.message(), Sv(field))) return status;
  return absl::Status(status.code(), absl::StrCat(Sv(field), ": ", status.message()));
}

// A JSON field of the request: an array when `want_list`, else an object.
absl::StatusOr<jinja::Value> ParseJsonField(const std::string& text, std::string_view field,
                                            bool want_list) {
  absl::StatusOr<jinja::Value> v = jinja::Value::FromJson(text, field);
  if (!v.ok()) return Naming(field, v.status());
  if (want_list ? !v->is_list() : !v->is_dict()) {
    return absl::InvalidArgumentError(absl::StrCat(Sv(field), ": must be a JSON ",
                                                   want_list ? "array" : "object", ", got ",
                                                   Sv(v->TypeName())));
  }
  return v;
}

// A tool call's arguments: a dict when they are a JSON object (templates such as Llama 3.1's
// apply tojson to them, as vLLM passes them), else the text as sent.
jinja::Value ToolArguments(const std::string& arguments) {
  if (absl::StatusOr<jinja::Value> v = jinja::Value::FromJson(arguments, "arguments");
      v.ok() && v->is_dict()) {
    return *std::move(v);
  }
  return jinja::Value(arguments);
}

absl::StatusOr<jinja::Value> MessageValue(const v1::ChatMessage& m, int i) {
  const std::string field = absl::StrCat("messages[", i, "]");
  if (m.role().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".role: must be set (system, user, assistant, tool, ...)"));
  }
  if (!m.content().empty() && m.content_parts_size() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": give content or content_parts, not both"));
  }
  jinja::DictBuilder d;
  d.Set("role"sv, m.role());
  if (m.content_parts_size() > 0) {
    jinja::List parts;
    for (int j = 0; j < m.content_parts_size(); ++j) {
      const v1::ContentPart& part = m.content_parts(j);
      if (part.type() != "text") {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".content_parts[", j, "].type: '", part.type(),
            "' is not served (only \"text\" parts: the models served read no other input)"));
      }
      jinja::DictBuilder p;
      p.Set("type"sv, "text").Set("text"sv, part.text());
      parts.push_back(std::move(p).Build());
    }
    d.Set("content"sv, jinja::Value(std::move(parts)));  // joined by FlattenTextParts
  } else {
    d.Set("content"sv, m.content());
  }
  if (!m.name().empty()) d.Set("name"sv, m.name());
  if (m.tool_calls_size() > 0) {
    jinja::List calls;
    for (int j = 0; j < m.tool_calls_size(); ++j) {
      const v1::ToolCall& call = m.tool_calls(j);
      if (call.function().name().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".tool_calls[", j, "].function.name: must be set"));
      }
      jinja::DictBuilder c;
      if (!call.id().empty()) c.Set("id"sv, call.id());
      c.Set("type"sv, call.type().empty() ? std::string("function") : call.type());
      jinja::DictBuilder function;
      function.Set("name"sv, call.function().name())
          .Set("arguments"sv, ToolArguments(call.function().arguments()));
      c.Set("function"sv, std::move(function).Build());
      calls.push_back(std::move(c).Build());
    }
    d.Set("tool_calls"sv, jinja::Value(std::move(calls)));
  }
  if (!m.tool_call_id().empty()) d.Set("tool_call_id"sv, m.tool_call_id());
  if (m.has_reasoning_content()) d.Set("reasoning_content"sv, m.reasoning_content());
  return std::move(d).Build();
}

}  // namespace

absl::Status CheckNoChatFields(const v1::GenerateRequest& request) {
  const char* field = nullptr;
  if (!request.tools_json().empty()) {
    field = "tools_json";
  } else if (!request.documents_json().empty()) {
    field = "documents_json";
  } else if (request.has_add_generation_prompt()) {
    field = "add_generation_prompt";
  } else if (!request.chat_template_kwargs_json().empty()) {
    field = "chat_template_kwargs_json";
  }
  if (field == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": only for chat requests (set messages instead of a prompt)"));
}

absl::StatusOr<jinja::Value> ChatTemplateVariables(const v1::GenerateRequest& request) {
  if (request.messages_size() > kMaxChatMessages) {
    return absl::InvalidArgumentError(absl::StrCat("messages: at most ", kMaxChatMessages,
                                                   " messages, got ", request.messages_size()));
  }
  jinja::List messages;
  messages.reserve(request.messages_size());
  for (int i = 0; i < request.messages_size(); ++i) {
    KVGRID_ASSIGN_OR_RETURN(jinja::Value m, MessageValue(request.messages(i), i));
    messages.push_back(std::move(m));
  }
  absl::StatusOr<jinja::Value> flat = model::FlattenTextParts(jinja::Value(std::move(messages)));
  if (!flat.ok()) return Naming("messages", flat.status());

  jinja::DictBuilder vars;
  vars.Set("messages"sv, *std::move(flat));
  jinja::Value tools = jinja::Value::None();
  if (!request.tools_json().empty()) {
    KVGRID_ASSIGN_OR_RETURN(tools, ParseJsonField(request.tools_json(), "tools_json", true));
    const jinja::List& list = tools.as_list();
    for (size_t k = 0; k < list.size(); ++k) {
      if (!list[k].is_dict()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tools_json[", k, "]: must be a JSON object (a tool schema), got ",
                         Sv(list[k].TypeName())));
      }
    }
  }
  vars.Set("tools"sv, std::move(tools));
  jinja::Value documents = jinja::Value::None();
  if (!request.documents_json().empty()) {
    KVGRID_ASSIGN_OR_RETURN(documents,
                            ParseJsonField(request.documents_json(), "documents_json", true));
  }
  vars.Set("documents"sv, std::move(documents));
  vars.Set("add_generation_prompt"sv,
           request.has_add_generation_prompt() ? request.add_generation_prompt() : true);
  if (!request.chat_template_kwargs_json().empty()) {
    KVGRID_ASSIGN_OR_RETURN(
        const jinja::Value kwargs,
        ParseJsonField(request.chat_template_kwargs_json(), "chat_template_kwargs_json", false));
    for (const auto& [key, value] : kwargs.as_dict()) {
      if (key.is_string() && key.as_string() == "messages") {
        return absl::InvalidArgumentError(
            "chat_template_kwargs_json: must not set 'messages' (the messages field does)");
      }
      vars.Set(key, value);
    }
  }
  return std::move(vars).Build();
}

absl::StatusOr<std::string> RenderChat(const ServedModel& m, const v1::GenerateRequest& request) {
  if (!m.chat_template) {
    const std::string why = m.chat_template_error.empty()
                                ? std::string("none in its tokenizer_config.json, "
                                              "chat_template.jinja or GGUF metadata")
                                : absl::StrCat("its template does not load: ",
                                               m.chat_template_error);
    return absl::InvalidArgumentError(
        absl::StrCat("messages: model '", m.name, "' has no chat template (", why,
                     "); send a prompt, or start the coordinator with --chat-template FILE"));
  }
  KVGRID_ASSIGN_OR_RETURN(const jinja::Value vars,
                          ChatTemplateVariables(request));
  absl::StatusOr<std::string> text = m.chat_template->Render(vars);
  if (!text.ok()) return Naming("messages", text.status());
  return text;
}

absl::StatusOr<std::vector<int32_t>> EncodeChat(const ServedModel& m,
                                                const v1::GenerateRequest& request) {
  if (!m.tokenizer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "messages: model '", m.name, "' has no tokenizer to encode a conversation with"));
  }
  KVGRID_ASSIGN_OR_RETURN(const std::string text, RenderChat(m, request));
  if (text.empty()) {
    return absl::InvalidArgumentError(
        "messages: the chat template rendered an empty prompt for this conversation");
  }
  std::vector<int32_t> ids = m.tokenizer->Encode(text);
  if (request.add_bos()) {
    if (!m.bos_token_id) {
      return absl::InvalidArgumentError(
          absl::StrCat("add_bos: model '", m.name, "' defines no BOS token"));
    }
    const std::string& bos = m.chat_template->bos_token();
    const bool has_bos = (!bos.empty() && absl::StartsWith(text, bos)) ||
                         (!ids.empty() && ids.front() == *m.bos_token_id);
    if (!has_bos) ids.insert(ids.begin(), *m.bos_token_id);
  }
  return ids;
}

void AddEndOfTurn(const ServedModel& m, v1::StoppingParams* stopping) {
  if (!m.end_of_turn_token_id || stopping->ignore_eos()) return;
  const int32_t id = *m.end_of_turn_token_id;
  if (std::find(m.eos_token_ids.begin(), m.eos_token_ids.end(), id) != m.eos_token_ids.end()) {
    return;
  }
  const auto& stops = stopping->stop_token_ids();
  if (std::find(stops.begin(), stops.end(), id) != stops.end()) return;
  stopping->add_stop_token_ids(id);
}

}  // namespace kvgrid::coordinator
