#include "coordinator/openai_protocol.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"

namespace kvgrid::coordinator::openai {
namespace {

using Json = nlohmann::json;

constexpr int kMaxLogprobs = 20;
constexpr uint32_t kMaxN = 256;
constexpr size_t kMaxStop = 16;

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// A SAX pass over a body the parser refused, to name the field its error lies in: the path of
// keys and array indices open at the error ("messages[1].content"), and whether the error is
// text that is not UTF-8 (or a \u escape of a lone surrogate).
class ErrorLocator final : public nlohmann::json_sax<Json> {
 public:
  bool null() override { return Value(); }
  bool boolean(bool) override { return Value(); }
  bool number_integer(number_integer_t) override { return Value(); }
  bool number_unsigned(number_unsigned_t) override { return Value(); }
  bool number_float(number_float_t, const string_t&) override { return Value(); }
  bool string(string_t&) override { return Value(); }
  bool binary(binary_t&) override { return Value(); }
  bool start_object(std::size_t) override { return Open(false); }
  bool key(string_t& k) override {
    stack_.back().key = k;
    stack_.back().has_key = true;
    return true;
  }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(true); }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& e) override {
    const std::string what = e.what();
    utf8_ = what.find("UTF-8") != std::string::npos || what.find("surrogate") != std::string::npos;
    for (const Level& l : stack_) {
      if (l.array) {
        absl::StrAppend(&path_, "[", l.index, "]");
      } else if (l.has_key) {
        absl::StrAppend(&path_, path_.empty() ? "" : ".", l.key);
      }
    }
    return false;
  }

  [[nodiscard]] bool utf8() const { return utf8_; }
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  struct Level {
    bool array = false;
    size_t index = 0;  // arrays: the element being read
    bool has_key = false;
    std::string key;   // objects: the member being read
  };
  bool Value() {
    if (!stack_.empty() && stack_.back().array) ++stack_.back().index;
    return true;
  }
  bool Open(bool array) {
    stack_.push_back(Level{.array = array});
    return true;
  }
  bool Close() {
    stack_.pop_back();
    return Value();
  }

  std::vector<Level> stack_;
  std::string path_;
  bool utf8_ = false;
};

}  // namespace

absl::Status JsonError(absl::string_view body) {
  ErrorLocator locator;
  Json::sax_parse(body.begin(), body.end(), &locator);
  if (locator.utf8()) {
    return Bad(locator.path().empty() ? "body" : locator.path(), "invalid UTF-8");
  }
  return Bad("body", "not valid JSON");
}

namespace {

absl::StatusOr<Json> ParseObject(absl::string_view body) {
  if (body.size() > kMaxBodyBytes) {
    return Bad("body", absl::StrCat("larger than ", kMaxBodyBytes, " bytes"));
  }
  // Refused before the parser sees it, which would recurse that deep.
  if (absl::Status s = model::CheckJsonDepth(std::string_view(body.data(), body.size()), "body");
      !s.ok()) {
    return s;
  }
  Json j = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return JsonError(body);
  if (!j.is_object()) return Bad("body", "must be a JSON object");
  return j;
}

// Typed reads of an object's fields: absent and null read as unset; a value of another type
// is INVALID_ARGUMENT naming the field.
class Fields {
 public:
  Fields(const Json& object, std::string prefix) : j_(object), prefix_(std::move(prefix)) {}

  std::string Name(absl::string_view key) const { return absl::StrCat(prefix_, key); }
  const Json* Get(absl::string_view key) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::StatusOr<std::optional<std::string>> String(absl::string_view key) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) return Bad(Name(key), "must be a string");
    return v->get<std::string>();
  }
  absl::StatusOr<std::optional<bool>> Bool(absl::string_view key) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) return Bad(Name(key), "must be a boolean");
    return v->get<bool>();
  }
  absl::StatusOr<std::optional<double>> Number(absl::string_view key) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) return Bad(Name(key), "must be a number");
    const double d = v->get<double>();
    if (!std::isfinite(d)) return Bad(Name(key), "must be finite");
    return d;
  }
  // An integer in [lo, hi] (an integral float such as 5.0 is accepted).
  absl::StatusOr<std::optional<int64_t>> Int(absl::string_view key, int64_t lo,
                                             int64_t hi) const {
    const Json* v = Get(key);
    if (v == nullptr) return std::nullopt;
    return IntValue(*v, Name(key), lo, hi);
  }
  static absl::StatusOr<int64_t> IntValue(const Json& v, const std::string& name, int64_t lo,
                                          int64_t hi) {
    int64_t out;
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) return OutOfRange(name, lo, hi);
      out = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      out = v.get<int64_t>();
    } else if (v.is_number_float()) {
      const double d = v.get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || d < static_cast<double>(lo) ||
          d > static_cast<double>(hi)) {
        return Bad(name, "must be an integer in range");
      }
      out = static_cast<int64_t>(d);
    } else {
      return Bad(name, "must be an integer");
    }
    if (out < lo || out > hi) return OutOfRange(name, lo, hi);
    return out;
  }

 private:
  static absl::Status OutOfRange(const std::string& name, int64_t lo, int64_t hi) {
    return Bad(name, absl::StrCat("must be in [", lo, ", ", hi, "]"));
  }
  const Json& j_;
  std::string prefix_;
};

#define KVGRID_OAI_ASSIGN(lhs, expr)    \
  auto lhs##_or = (expr);               \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = *std::move(lhs##_or)

std::string Dump(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// Sampling and stopping fields common to both endpoints, into `req`.
absl::Status ParseSampling(const Fields& f, Endpoint endpoint, GenerateCall* call,
                           v1::GenerateRequest* req) {
  v1::SamplingParams* s = req->mutable_sampling();
  v1::StoppingParams* st = req->mutable_stopping();
  constexpr int64_t kI32 = std::numeric_limits<int32_t>::max();

  KVGRID_OAI_ASSIGN(max_tokens, f.Int("max_tokens", 1, kI32));
  std::optional<int64_t> max_new = max_tokens;
  if (endpoint == Endpoint::kChat) {
    KVGRID_OAI_ASSIGN(max_completion, f.Int("max_completion_tokens", 1, kI32));
    if (max_completion) max_new = max_completion;
  }
  if (max_new) {
    st->set_max_new_tokens(static_cast<int32_t>(*max_new));
    call->max_tokens_given = true;
  }
  KVGRID_OAI_ASSIGN(temperature, f.Number("temperature"));
  if (temperature) {
    if (*temperature < 0 || *temperature > 100) return Bad("temperature", "must be in [0, 100]");
    s->set_temperature(static_cast<float>(*temperature));
  }
  KVGRID_OAI_ASSIGN(top_p, f.Number("top_p"));
  if (top_p) {
    if (*top_p <= 0 || *top_p > 1) return Bad("top_p", "must be in (0, 1]");
    s->set_top_p(static_cast<float>(*top_p));
  }
  KVGRID_OAI_ASSIGN(top_k, f.Int("top_k", -1, kI32));
  if (top_k && *top_k > 0) s->set_top_k(static_cast<int32_t>(*top_k));
  KVGRID_OAI_ASSIGN(min_p, f.Number("min_p"));
  if (min_p) {
    if (*min_p < 0 || *min_p > 1) return Bad("min_p", "must be in [0, 1]");
    s->set_min_p(static_cast<float>(*min_p));
  }
  KVGRID_OAI_ASSIGN(rep, f.Number("repetition_penalty"));
  if (rep) {
    if (*rep <= 0) return Bad("repetition_penalty", "must be > 0");
    s->set_repetition_penalty(static_cast<float>(*rep));
  }
  KVGRID_OAI_ASSIGN(presence, f.Number("presence_penalty"));
  if (presence) {
    if (*presence < -2 || *presence > 2) return Bad("presence_penalty", "must be in [-2, 2]");
    s->set_presence_penalty(static_cast<float>(*presence));
  }
  KVGRID_OAI_ASSIGN(frequency, f.Number("frequency_penalty"));
  if (frequency) {
    if (*frequency < -2 || *frequency > 2) return Bad("frequency_penalty", "must be in [-2, 2]");
    s->set_frequency_penalty(static_cast<float>(*frequency));
  }
  if (const Json* bias = f.Get("logit_bias")) {
    // OpenAI's keys are token ids written as strings.
    if (!bias->is_object()) return Bad("logit_bias", "must be an object of token id -> bias");
    constexpr size_t kMaxBias = 1024;
    if (bias->size() > kMaxBias) return Bad("logit_bias", absl::StrCat("at most ", kMaxBias, " entries"));
    for (auto it = bias->begin(); it != bias->end(); ++it) {
      const std::string at = absl::StrCat("logit_bias[", it.key(), "]");
      int32_t id = 0;
      if (!absl::SimpleAtoi(it.key(), &id) || id < 0) return Bad(at, "the key must be a token id");
      if (!it.value().is_number()) return Bad(at, "must be a number");
      const double b = it.value().get<double>();
      if (!(b >= -100 && b <= 100)) return Bad(at, "must be in [-100, 100]");
      (*s->mutable_logit_bias())[id] = static_cast<float>(b);
    }
  }
  KVGRID_OAI_ASSIGN(seed, f.Int("seed", std::numeric_limits<int64_t>::min(),
                                std::numeric_limits<int64_t>::max()));
  if (seed) s->set_seed(static_cast<uint64_t>(*seed));
  KVGRID_OAI_ASSIGN(n, f.Int("n", 1, kMaxN));
  call->n = n ? static_cast<uint32_t>(*n) : 1;
  req->set_n(call->n);

  if (endpoint == Endpoint::kCompletions) {
    if (const Json* lp = f.Get("logprobs")) {
      if (lp->is_boolean()) {
        if (lp->get<bool>()) call->logprobs = 0;
      } else {
        KVGRID_OAI_ASSIGN(k, Fields::IntValue(*lp, "logprobs", 0, kMaxLogprobs));
        call->logprobs = static_cast<int32_t>(k);
      }
    }
  } else {
    KVGRID_OAI_ASSIGN(logprobs, f.Bool("logprobs"));
    KVGRID_OAI_ASSIGN(top, f.Int("top_logprobs", 0, kMaxLogprobs));
    if (top && !logprobs.value_or(false)) {
      return Bad("top_logprobs", "needs \"logprobs\": true");
    }
    if (logprobs.value_or(false)) call->logprobs = static_cast<int32_t>(top.value_or(0));
  }
  if (call->logprobs) s->set_logprobs(*call->logprobs);

  if (const Json* stop = f.Get("stop")) {
    if (stop->is_string()) {
      if (!stop->get<std::string>().empty()) st->add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (stop->size() > kMaxStop) return Bad("stop", absl::StrCat("at most ", kMaxStop, " strings"));
      for (size_t i = 0; i < stop->size(); ++i) {
        if (!(*stop)[i].is_string()) return Bad(absl::StrCat("stop[", i, "]"), "must be a string");
        if (!(*stop)[i].get<std::string>().empty()) st->add_stop((*stop)[i].get<std::string>());
      }
    } else {
      return Bad("stop", "must be a string or a list of strings");
    }
  }
  if (const Json* ids = f.Get("stop_token_ids")) {
    if (!ids->is_array()) return Bad("stop_token_ids", "must be a list of token ids");
    for (size_t i = 0; i < ids->size(); ++i) {
      KVGRID_OAI_ASSIGN(id, Fields::IntValue((*ids)[i], absl::StrCat("stop_token_ids[", i, "]"),
                                             0, kI32));
      st->add_stop_token_ids(static_cast<int32_t>(id));
    }
  }
  KVGRID_OAI_ASSIGN(min_tokens, f.Int("min_tokens", 0, kI32));
  if (min_tokens) st->set_min_tokens(static_cast<int32_t>(*min_tokens));
  KVGRID_OAI_ASSIGN(ignore_eos, f.Bool("ignore_eos"));
  if (ignore_eos) st->set_ignore_eos(*ignore_eos);
  KVGRID_OAI_ASSIGN(include_stop, f.Bool("include_stop_str_in_output"));
  if (include_stop) st->set_include_stop_str_in_output(*include_stop);
  KVGRID_OAI_ASSIGN(skip_special, f.Bool("skip_special_tokens"));
  call->skip_special_tokens = skip_special.value_or(true);
  KVGRID_OAI_ASSIGN(priority, f.Int("priority", std::numeric_limits<int32_t>::min(), kI32));
  if (priority) req->set_priority(static_cast<int32_t>(*priority));

  KVGRID_OAI_ASSIGN(stream, f.Bool("stream"));
  call->stream = stream.value_or(false);
  if (const Json* opts = f.Get("stream_options")) {
    if (!opts->is_object()) return Bad("stream_options", "must be an object");
    if (!call->stream) return Bad("stream_options", "only allowed with \"stream\": true");
    Fields o(*opts, "stream_options.");
    KVGRID_OAI_ASSIGN(include_usage, o.Bool("include_usage"));
    call->include_usage = include_usage.value_or(false);
  }
  KVGRID_OAI_ASSIGN(user, f.String("user"));  // accepted, unused
  (void)user;
  if (const Json* format = f.Get("response_format")) {
    if (!format->is_object()) return Bad("response_format", "must be an object");
    Fields rf(*format, "response_format.");
    KVGRID_OAI_ASSIGN(type, rf.String("type"));
    if (type.value_or("text") != "text") {
      return Bad("response_format.type",
                 absl::StrCat("'", *type, "' is not supported (structured output is not served "
                              "yet); only 'text'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseMessage(const Json& m, size_t i, v1::ChatMessage* out) {
  const std::string at = absl::StrCat("messages[", i, "]");
  if (!m.is_object()) return Bad(at, "must be an object");
  Fields f(m, at + ".");
  KVGRID_OAI_ASSIGN(role, f.String("role"));
  if (!role || role->empty()) return Bad(f.Name("role"), "required");
  out->set_role(*role);
  if (const Json* content = f.Get("content")) {
    if (content->is_string()) {
      out->set_content(content->get<std::string>());
    } else if (content->is_array()) {
      for (size_t p = 0; p < content->size(); ++p) {
        const Json& part = (*content)[p];
        const std::string pat = absl::StrCat(at, ".content[", p, "]");
        if (!part.is_object()) return Bad(pat, "must be an object");
        Fields pf(part, pat + ".");
        KVGRID_OAI_ASSIGN(type, pf.String("type"));
        if (type.value_or("") != "text") {
          return Bad(pf.Name("type"),
                     absl::StrCat("'", type.value_or(""), "' parts are not served; only 'text'"));
        }
        KVGRID_OAI_ASSIGN(text, pf.String("text"));
        v1::ContentPart* cp = out->add_content_parts();
        cp->set_type("text");
        cp->set_text(text.value_or(""));
      }
    } else {
      return Bad(f.Name("content"), "must be a string or a list of content parts");
    }
  }
  KVGRID_OAI_ASSIGN(name, f.String("name"));
  if (name) out->set_name(*name);
  KVGRID_OAI_ASSIGN(tool_call_id, f.String("tool_call_id"));
  if (tool_call_id) out->set_tool_call_id(*tool_call_id);
  KVGRID_OAI_ASSIGN(reasoning, f.String("reasoning_content"));
  if (reasoning) out->set_reasoning_content(*reasoning);
  if (const Json* calls = f.Get("tool_calls")) {
    if (!calls->is_array()) return Bad(f.Name("tool_calls"), "must be a list");
    for (size_t c = 0; c < calls->size(); ++c) {
      const std::string cat = absl::StrCat(at, ".tool_calls[", c, "]");
      const Json& call = (*calls)[c];
      if (!call.is_object()) return Bad(cat, "must be an object");
      Fields cf(call, cat + ".");
      v1::ToolCall* tc = out->add_tool_calls();
      KVGRID_OAI_ASSIGN(id, cf.String("id"));
      if (id) tc->set_id(*id);
      KVGRID_OAI_ASSIGN(type, cf.String("type"));
      if (type) tc->set_type(*type);
      const Json* fn = cf.Get("function");
      if (fn == nullptr || !fn->is_object()) return Bad(cf.Name("function"), "must be an object");
      Fields ff(*fn, cat + ".function.");
      KVGRID_OAI_ASSIGN(fname, ff.String("name"));
      if (!fname || fname->empty()) return Bad(ff.Name("name"), "required");
      tc->mutable_function()->set_name(*fname);
      if (const Json* args = ff.Get("arguments")) {
        // OpenAI sends JSON text; an object given as such is taken as its text.
        tc->mutable_function()->set_arguments(args->is_string() ? args->get<std::string>()
                                                                : Dump(*args));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ParseChatFields(const Fields& f, v1::GenerateRequest* req, bool require_messages) {
  const Json* messages = f.Get("messages");
  if (messages == nullptr) {
    if (require_messages) return Bad("messages", "required");
    return absl::OkStatus();
  }
  if (!messages->is_array() || messages->empty()) {
    return Bad("messages", "must be a non-empty list of messages");
  }
  for (size_t i = 0; i < messages->size(); ++i) {
    if (absl::Status s = ParseMessage((*messages)[i], i, req->add_messages()); !s.ok()) return s;
  }
  if (const Json* tools = f.Get("tools")) {
    if (!tools->is_array()) return Bad("tools", "must be a list of tool schemas");
    for (size_t i = 0; i < tools->size(); ++i) {
      if (!(*tools)[i].is_object()) return Bad(absl::StrCat("tools[", i, "]"), "must be an object");
    }
    if (!tools->empty()) req->set_tools_json(Dump(*tools));
  }
  if (const Json* docs = f.Get("documents")) {
    if (!docs->is_array()) return Bad("documents", "must be a list");
    req->set_documents_json(Dump(*docs));
  }
  KVGRID_OAI_ASSIGN(add_gen, f.Bool("add_generation_prompt"));
  if (add_gen) req->set_add_generation_prompt(*add_gen);
  Json kwargs = Json::object();
  if (const Json* k = f.Get("chat_template_kwargs")) {
    if (!k->is_object()) return Bad("chat_template_kwargs", "must be an object");
    kwargs = *k;
  }
  if (const Json* choice = f.Get("tool_choice")) {
    if (!choice->is_string() && !choice->is_object()) {
      return Bad("tool_choice", "must be a string or an object");
    }
    // Templates that read it see it; the output is not parsed for tool calls.
    if (!kwargs.contains("tool_choice")) kwargs["tool_choice"] = *choice;
  }
  if (!kwargs.empty()) req->set_chat_template_kwargs_json(Dump(kwargs));
  return absl::OkStatus();
}

// A prompt that is a list of token ids, into `req`.
absl::Status TokenIds(const Json& ids, const std::string& field, v1::GenerateRequest* req) {
  if (ids.empty()) return Bad(field, "must not be empty");
  for (size_t i = 0; i < ids.size(); ++i) {
    KVGRID_OAI_ASSIGN(id, Fields::IntValue(ids[i], absl::StrCat(field, "[", i, "]"), 0,
                                           std::numeric_limits<int32_t>::max()));
    req->add_prompt_token_ids(static_cast<int32_t>(id));
  }
  return absl::OkStatus();
}

absl::Status ParsePrompts(const Fields& f, const v1::GenerateRequest& base,
                          std::vector<v1::GenerateRequest>* out) {
  const Json* prompt = f.Get("prompt");
  if (prompt == nullptr) return Bad("prompt", "required");
  auto add = [&]() -> v1::GenerateRequest* {
    out->push_back(base);
    return &out->back();
  };
  if (prompt->is_string()) {
    if (prompt->get<std::string>().empty()) return Bad("prompt", "must not be empty");
    add()->set_prompt(prompt->get<std::string>());
    return absl::OkStatus();
  }
  if (!prompt->is_array() || prompt->empty()) {
    return Bad("prompt", "must be a string, a list of strings, token ids or lists of token ids");
  }
  const Json& first = (*prompt)[0];
  if (first.is_number()) return TokenIds(*prompt, "prompt", add());
  constexpr size_t kMaxPrompts = 256;
  if (prompt->size() > kMaxPrompts) return Bad("prompt", absl::StrCat("at most ", kMaxPrompts, " prompts"));
  for (size_t i = 0; i < prompt->size(); ++i) {
    const Json& p = (*prompt)[i];
    const std::string at = absl::StrCat("prompt[", i, "]");
    if (p.is_string()) {
      if (p.get<std::string>().empty()) return Bad(at, "must not be empty");
      add()->set_prompt(p.get<std::string>());
    } else if (p.is_array()) {
      if (absl::Status s = TokenIds(p, at, add()); !s.ok()) return s;
    } else {
      return Bad(at, "must be a string or a list of token ids");
    }
  }
  return absl::OkStatus();
}

Json LogprobEntry(const v1::TokenLogprob& lp, const TokenText& tokens, bool with_top);

Json TokenJson(int32_t id, float logprob, const TokenText& tokens) {
  Json e = Json::object();
  e["token"] = tokens.text ? tokens.text(id) : absl::StrCat("token_id:", id);
  e["logprob"] = logprob;
  if (tokens.bytes) {
    if (std::optional<std::string> b = tokens.bytes(id)) {
      Json bytes = Json::array();
      for (unsigned char c : *b) bytes.push_back(static_cast<int>(c));
      e["bytes"] = std::move(bytes);
    } else {
      e["bytes"] = nullptr;
    }
  }
  return e;
}

Json LogprobEntry(const v1::TokenLogprob& lp, const TokenText& tokens, bool with_top) {
  Json e = TokenJson(lp.token_id(), lp.logprob(), tokens);
  if (with_top) {
    Json top = Json::array();
    for (const v1::TopLogprob& t : lp.top()) top.push_back(TokenJson(t.token_id(), t.logprob(), tokens));
    e["top_logprobs"] = std::move(top);
  }
  return e;
}

// The logprobs object of a choice: chat's {"content": [...]}, or completions' token lists.
Json LogprobsJson(const GenerateCall& call, const std::vector<v1::TokenLogprob>& logprobs,
                  const TokenText& tokens, int64_t text_offset) {
  if (call.endpoint == Endpoint::kChat) {
    Json content = Json::array();
    for (const v1::TokenLogprob& lp : logprobs) content.push_back(LogprobEntry(lp, tokens, true));
    return Json{{"content", std::move(content)}, {"refusal", nullptr}};
  }
  Json toks = Json::array(), lps = Json::array(), tops = Json::array(), offsets = Json::array();
  for (const v1::TokenLogprob& lp : logprobs) {
    const std::string text =
        tokens.text ? tokens.text(lp.token_id()) : absl::StrCat("token_id:", lp.token_id());
    toks.push_back(text);
    lps.push_back(lp.logprob());
    Json top = Json::object();
    for (const v1::TopLogprob& t : lp.top()) {
      top[tokens.text ? tokens.text(t.token_id()) : absl::StrCat("token_id:", t.token_id())] =
          t.logprob();
    }
    tops.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(text.size());
  }
  return Json{{"tokens", std::move(toks)},
              {"token_logprobs", std::move(lps)},
              {"top_logprobs", std::move(tops)},
              {"text_offset", std::move(offsets)}};
}

Json FinishJson(v1::FinishReason r) {
  if (r == v1::FINISH_REASON_UNSPECIFIED) return nullptr;
  return std::string(FinishReasonName(r));
}

Json UsageJson(const Usage& u) {
  return Json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", Json{{"cached_tokens", u.cached_tokens}}}};
}

Json Envelope(const GenerateCall& call, const ResponseHeader& h, bool chunk) {
  const char* object = call.endpoint == Endpoint::kChat
                           ? (chunk ? "chat.completion.chunk" : "chat.completion")
                           : "text_completion";
  return Json{{"id", h.id}, {"object", object}, {"created", h.created}, {"model", h.model}};
}

absl::string_view ErrorType(int http_status) {
  switch (http_status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return http_status >= 500 ? "internal_server_error" : "invalid_request_error";
  }
}

Json ErrorJson(int http_status, absl::string_view message) {
  // A message that starts with a field name ("temperature: ...") names the param.
  Json param = nullptr;
  if (http_status == 400) {
    const size_t colon = message.find(": ");
    if (colon != absl::string_view::npos && colon > 0 &&
        message.substr(0, colon).find(' ') == absl::string_view::npos) {
      param = std::string(message.substr(0, colon));
    }
  }
  return Json{{"error", Json{{"message", std::string(message)},
                             {"type", std::string(ErrorType(http_status))},
                             {"param", std::move(param)},
                             {"code", http_status}}}};
}

}  // namespace

absl::StatusOr<GenerateCall> ParseGenerateCall(Endpoint endpoint, absl::string_view body) {
  KVGRID_OAI_ASSIGN(j, ParseObject(body));
  try {
    Fields f(j, "");
    GenerateCall call;
    call.endpoint = endpoint;
    KVGRID_OAI_ASSIGN(model, f.String("model"));
    call.model = model.value_or("");
    v1::GenerateRequest base;
    base.set_model(call.model);
    if (absl::Status s = ParseSampling(f, endpoint, &call, &base); !s.ok()) return s;
    if (endpoint == Endpoint::kChat) {
      if (absl::Status s = ParseChatFields(f, &base, /*require_messages=*/true); !s.ok()) return s;
      call.requests.push_back(std::move(base));
    } else {
      if (const Json* echo = f.Get("echo")) {
        if (!echo->is_boolean()) return Bad("echo", "must be a boolean");
        if (echo->get<bool>()) return Bad("echo", "not supported (the prompt is not echoed)");
      }
      KVGRID_OAI_ASSIGN(suffix, f.String("suffix"));
      if (suffix && !suffix->empty()) return Bad("suffix", "not supported (no insertion)");
      KVGRID_OAI_ASSIGN(best_of, f.Int("best_of", 1, kMaxN));
      if (best_of && *best_of != call.n) return Bad("best_of", "not supported (only best_of = n)");
      KVGRID_OAI_ASSIGN(add_special, f.Bool("add_special_tokens"));
      call.add_special_tokens = add_special.value_or(true);
      if (absl::Status s = ParsePrompts(f, base, &call.requests); !s.ok()) return s;
      if (call.requests.size() * call.n > kMaxN) {
        return Bad("n", absl::StrCat("prompts times n must be at most ", kMaxN));
      }
    }
    return call;
  } catch (const std::exception& e) {
    // The checks above read only what they tested; this is a bug, not a bad request.
    return absl::InternalError(absl::StrCat("parsing the request: ", e.what()));
  }
}

absl::StatusOr<TokenizeCall> ParseTokenizeCall(absl::string_view body) {
  KVGRID_OAI_ASSIGN(j, ParseObject(body));
  try {
    Fields f(j, "");
    TokenizeCall call;
    KVGRID_OAI_ASSIGN(model, f.String("model"));
    call.model = model.value_or("");
    call.chat.set_model(call.model);
    KVGRID_OAI_ASSIGN(prompt, f.String("prompt"));
    call.prompt = prompt;
    KVGRID_OAI_ASSIGN(add_special, f.Bool("add_special_tokens"));
    call.add_special_tokens = add_special.value_or(true);
    if (absl::Status s = ParseChatFields(f, &call.chat, /*require_messages=*/false); !s.ok()) {
      return s;
    }
    if (call.prompt.has_value() == (call.chat.messages_size() > 0)) {
      return Bad("prompt", "give one of prompt and messages");
    }
    return call;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("parsing the request: ", e.what()));
  }
}

absl::StatusOr<DetokenizeCall> ParseDetokenizeCall(absl::string_view body) {
  KVGRID_OAI_ASSIGN(j, ParseObject(body));
  try {
    Fields f(j, "");
    DetokenizeCall call;
    KVGRID_OAI_ASSIGN(model, f.String("model"));
    call.model = model.value_or("");
    const Json* tokens = f.Get("tokens");
    if (tokens == nullptr || !tokens->is_array()) return Bad("tokens", "must be a list of token ids");
    for (size_t i = 0; i < tokens->size(); ++i) {
      KVGRID_OAI_ASSIGN(id, Fields::IntValue((*tokens)[i], absl::StrCat("tokens[", i, "]"), 0,
                                             std::numeric_limits<int32_t>::max()));
      call.tokens.push_back(static_cast<int32_t>(id));
    }
    return call;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("parsing the request: ", e.what()));
  }
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kCancelled: return 499;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

std::string ErrorBody(const absl::Status& status) {
  return Dump(ErrorJson(HttpStatusFor(status.code()), status.message()));
}

std::string ErrorBody(int http_status, absl::string_view message) {
  return Dump(ErrorJson(http_status, message));
}

absl::string_view FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_LENGTH: return "length";
    default: return "null";
  }
}

std::string CompletionResponse(const GenerateCall& call, const ResponseHeader& header,
                               const std::vector<Choice>& choices, const Usage& usage,
                               const TokenText& tokens) {
  Json out = Envelope(call, header, /*chunk=*/false);
  Json list = Json::array();
  for (const Choice& c : choices) {
    Json choice = Json{{"index", c.index}};
    if (call.endpoint == Endpoint::kChat) {
      choice["message"] = Json{{"role", "assistant"}, {"content", c.text}, {"tool_calls", Json::array()}};
    } else {
      choice["text"] = c.text;
    }
    choice["logprobs"] = call.logprobs ? LogprobsJson(call, c.logprobs, tokens, 0) : Json(nullptr);
    choice["finish_reason"] = FinishJson(c.finish_reason);
    list.push_back(std::move(choice));
  }
  out["choices"] = std::move(list);
  out["usage"] = UsageJson(usage);
  return Dump(out);
}

std::string ChunkEvent(const GenerateCall& call, const ResponseHeader& header, uint32_t index,
                       bool first, const std::string& text,
                       const std::vector<v1::TokenLogprob>& logprobs,
                       v1::FinishReason finish_reason, const TokenText& tokens,
                       int64_t text_offset) {
  Json out = Envelope(call, header, /*chunk=*/true);
  Json choice = Json{{"index", index}};
  if (call.endpoint == Endpoint::kChat) {
    Json delta = Json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || !first) delta["content"] = text;
    if (first && text.empty()) delta["content"] = "";
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] =
      call.logprobs ? LogprobsJson(call, logprobs, tokens, text_offset) : Json(nullptr);
  choice["finish_reason"] = FinishJson(finish_reason);
  out["choices"] = Json::array({std::move(choice)});
  if (call.include_usage) out["usage"] = nullptr;
  return absl::StrCat("data: ", Dump(out), "\n\n");
}

std::string UsageEvent(const GenerateCall& call, const ResponseHeader& header,
                       const Usage& usage) {
  Json out = Envelope(call, header, /*chunk=*/true);
  out["choices"] = Json::array();
  out["usage"] = UsageJson(usage);
  return absl::StrCat("data: ", Dump(out), "\n\n");
}

std::string ErrorEvent(const absl::Status& status) {
  return absl::StrCat("data: ", ErrorBody(status), "\n\n");
}

}  // namespace kvgrid::coordinator::openai
