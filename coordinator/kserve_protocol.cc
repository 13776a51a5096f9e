#include "coordinator/kserve_protocol.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <variant>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/openai_protocol.h"
#include "model/json_util.h"
#include "model/status_macros.h"
#include "model/utf8.h"
#include "nlohmann/json.hpp"

namespace kvgrid::coordinator::kserve {
namespace {

using Json = nlohmann::json;

// Bounds that keep one request small: the elements of one tensor, and the request id that
// every response echoes (as the Generation API bounds request_id).
constexpr int64_t kMaxElements = 1 << 16;
constexpr size_t kMaxIdBytes = 256;

// One element of an input tensor, a request parameter or a sampling_parameters entry.
using Value = std::variant<bool, int64_t, uint64_t, double, std::string>;

// An input, parameter or sampling_parameters entry as the request carried it.
struct Field {
  std::string name;
  std::string where;     // how errors name it: "input 'top_k'", "parameter 'top_k'", ...
  std::string datatype;  // a tensor's datatype; "" for JSON and parameters
  std::vector<Value> values;
  bool list = false;  // a JSON array or a tensor: a list even with one element
};

absl::Status Bad(const Field& f, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(f.where, ": ", model::Sv(what)));
}

bool IsIntType(std::string_view t) {
  return t == "INT8" || t == "INT16" || t == "INT32" || t == "INT64" || t == "UINT8" ||
         t == "UINT16" || t == "UINT32" || t == "UINT64";
}

// The one element of a scalar field. Errors: INVALID_ARGUMENT when it has another count.
absl::StatusOr<const Value*> One(const Field& f) {
  if (f.values.size() != 1) {
    return Bad(f, absl::StrCat("expected 1 element, got ", f.values.size()));
  }
  return &f.values[0];
}

absl::StatusOr<bool> AsBool(const Field& f) {
  if (!f.datatype.empty() && f.datatype != "BOOL") {
    return Bad(f, absl::StrCat("datatype ", f.datatype, " does not fit (BOOL)"));
  }
  absl::StatusOr<const Value*> v = One(f);
  if (!v.ok()) return v.status();
  if (const bool* b = std::get_if<bool>(*v)) return *b;
  // sampling_parameters carries its values as strings in the vLLM backend's examples.
  if (const std::string* s = std::get_if<std::string>(*v)) {
    if (*s == "true" || *s == "True") return true;
    if (*s == "false" || *s == "False") return false;
  }
  return Bad(f, "must be a boolean");
}

absl::StatusOr<int64_t> AsInt(const Field& f, int64_t lo, int64_t hi) {
  if (!f.datatype.empty() && !IsIntType(f.datatype)) {
    return Bad(f, absl::StrCat("datatype ", f.datatype, " does not fit (an integer type)"));
  }
  absl::StatusOr<const Value*> v = One(f);
  if (!v.ok()) return v.status();
  std::optional<int64_t> n;
  if (const int64_t* i = std::get_if<int64_t>(*v)) n = *i;
  if (const uint64_t* u = std::get_if<uint64_t>(*v);
      u != nullptr && *u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    n = static_cast<int64_t>(*u);
  }
  if (const double* d = std::get_if<double>(*v);
      d != nullptr && std::isfinite(*d) && *d == std::floor(*d) && std::abs(*d) < 9e15) {
    n = static_cast<int64_t>(*d);
  }
  if (const std::string* s = std::get_if<std::string>(*v)) {
    int64_t parsed = 0;
    if (absl::SimpleAtoi(*s, &parsed)) n = parsed;
  }
  if (!n) return Bad(f, "must be an integer");
  if (*n < lo || *n > hi) return Bad(f, absl::StrCat("must be in [", lo, ", ", hi, "], got ", *n));
  return *n;
}

absl::StatusOr<uint64_t> AsUint64(const Field& f) {
  if (!f.datatype.empty() && !IsIntType(f.datatype)) {
    return Bad(f, absl::StrCat("datatype ", f.datatype, " does not fit (an integer type)"));
  }
  absl::StatusOr<const Value*> v = One(f);
  if (!v.ok()) return v.status();
  if (const uint64_t* u = std::get_if<uint64_t>(*v)) return *u;
  if (const int64_t* i = std::get_if<int64_t>(*v); i != nullptr && *i >= 0) {
    return static_cast<uint64_t>(*i);
  }
  if (const std::string* s = std::get_if<std::string>(*v)) {
    uint64_t parsed = 0;
    if (absl::SimpleAtoi(*s, &parsed)) return parsed;
  }
  return Bad(f, "must be an integer in [0, 2^64)");
}

absl::StatusOr<double> AsFloat(const Field& f, double lo, double hi) {
  if (!f.datatype.empty() && f.datatype != "FP32" && f.datatype != "FP64" &&
      !IsIntType(f.datatype)) {
    return Bad(f, absl::StrCat("datatype ", f.datatype, " does not fit (FP32 or FP64)"));
  }
  absl::StatusOr<const Value*> v = One(f);
  if (!v.ok()) return v.status();
  std::optional<double> x;
  if (const double* d = std::get_if<double>(*v)) x = *d;
  if (const int64_t* i = std::get_if<int64_t>(*v)) x = static_cast<double>(*i);
  if (const uint64_t* u = std::get_if<uint64_t>(*v)) x = static_cast<double>(*u);
  if (const std::string* s = std::get_if<std::string>(*v)) {
    double parsed = 0;
    if (absl::SimpleAtod(*s, &parsed)) x = parsed;
  }
  if (!x) return Bad(f, "must be a number");
  if (!(*x >= lo && *x <= hi)) {  // NaN fails too
    return Bad(f, absl::StrCat("must be in [", lo, ", ", hi, "], got ", *x));
  }
  return *x;
}

absl::StatusOr<std::vector<std::string>> AsStrings(const Field& f) {
  if (!f.datatype.empty() && f.datatype != "BYTES") {
    return Bad(f, absl::StrCat("datatype ", f.datatype, " does not fit (BYTES)"));
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < f.values.size(); ++i) {
    const std::string* s = std::get_if<std::string>(&f.values[i]);
    if (s == nullptr) return Bad(f, "must hold strings");
    if (!model::IsValidUtf8(*s)) {
      return Bad(f, absl::StrCat("element ", i, " is not valid UTF-8"));
    }
    out.push_back(*s);
  }
  return out;
}

absl::StatusOr<std::string> AsString(const Field& f) {
  absl::StatusOr<std::vector<std::string>> all = AsStrings(f);
  if (!all.ok()) return all.status();
  if (all->size() != 1) return Bad(f, absl::StrCat("expected 1 element, got ", all->size()));
  return std::move(all->front());
}

// The optional outputs a request turned on (return_*), by Output.
struct Wanted {
  bool finish_reason = false;
  bool num_input_tokens = false;
  bool num_output_tokens = false;
  bool logprobs = false;
  bool cumulative_logprob = false;
};

// The state a request's fields build up.
struct Builder {
  GenerateCall call;
  Wanted wanted;
  bool has_text = false;
  std::optional<std::string> sampling_parameters;  // the JSON string, applied before inputs
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// Applies one field. `known` is false for a name that is none of ours.
absl::Status Apply(const Field& f, Builder* b, bool* known) {
  *known = true;
  v1::SamplingParams* s = b->call.request.mutable_sampling();
  v1::StoppingParams* st = b->call.request.mutable_stopping();
  const std::string& n = f.name;
  if (n == "text_input") {
    KVGRID_ASSIGN_OR_RETURN(auto text, AsString(f));
    b->call.request.set_prompt(std::move(text));
    b->has_text = true;
  } else if (n == "stream") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->call.stream = v;
  } else if (n == "exclude_input_in_output") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->call.exclude_input_in_output = v;
  } else if (n == "return_finish_reason") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->wanted.finish_reason = v;
  } else if (n == "return_num_input_tokens") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->wanted.num_input_tokens = v;
  } else if (n == "return_num_output_tokens") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->wanted.num_output_tokens = v;
  } else if (n == "return_logprobs" || n == "return_log_probs") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->wanted.logprobs = v;
  } else if (n == "return_cumulative_logprob") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    b->wanted.cumulative_logprob = v;
  } else if (n == "max_tokens") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, 1, std::numeric_limits<int32_t>::max()));
    st->set_max_new_tokens(static_cast<int32_t>(v));
  } else if (n == "min_tokens" || n == "min_length") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, 0, std::numeric_limits<int32_t>::max()));
    st->set_min_tokens(static_cast<int32_t>(v));
  } else if (n == "temperature") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsFloat(f, 0, 1e6));
    s->set_temperature(static_cast<float>(v));
  } else if (n == "top_p") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsFloat(f, 0, 1));
    // 0 means off in TensorRT-LLM's runtime, as 1 does here.
    s->set_top_p(v == 0 ? 1.f : static_cast<float>(v));
  } else if (n == "top_k") {
    // -1 is the vLLM backend's "off", 0 TensorRT-LLM's.
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, -1, std::numeric_limits<int32_t>::max()));
    s->set_top_k(v < 0 ? 0 : static_cast<int32_t>(v));
  } else if (n == "min_p") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsFloat(f, 0, 1));
    s->set_min_p(static_cast<float>(v));
  } else if (n == "repetition_penalty") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsFloat(f, 1e-6, 1e6));
    s->set_repetition_penalty(static_cast<float>(v));
  } else if (n == "presence_penalty") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsFloat(f, -kInf, kInf));
    s->set_presence_penalty(static_cast<float>(v));
  } else if (n == "frequency_penalty") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsFloat(f, -kInf, kInf));
    s->set_frequency_penalty(static_cast<float>(v));
  } else if (n == "random_seed" || n == "seed") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsUint64(f));
    s->set_seed(v);
  } else if (n == "logprobs") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, 0, 20));
    s->set_logprobs(static_cast<int32_t>(v));
  } else if (n == "stop_words" || n == "stop") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsStrings(f));
    st->clear_stop();
    for (std::string& w : v) {
      if (!w.empty()) st->add_stop(std::move(w));
    }
  } else if (n == "bad_words") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsStrings(f));
    b->call.bad_words.clear();
    for (std::string& w : v) {
      if (!w.empty()) b->call.bad_words.push_back(std::move(w));
    }
  } else if (n == "ignore_eos") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    st->set_ignore_eos(v);
  } else if (n == "include_stop_str_in_output") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    st->set_include_stop_str_in_output(v);
  } else if (n == "end_id") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, 0, std::numeric_limits<int32_t>::max()));
    st->add_stop_token_ids(static_cast<int32_t>(v));
  } else if (n == "pad_id") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, 0, std::numeric_limits<int32_t>::max()));
    (void)v;  // nothing is padded: sequences are never batched into one tensor
  } else if (n == "beam_width" || n == "n") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, 1, 1));
    (void)v;
  } else if (n == "priority") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsInt(f, std::numeric_limits<int32_t>::min(),
                                  std::numeric_limits<int32_t>::max()));
    b->call.request.set_priority(static_cast<int32_t>(v));
  } else if (n == "triton_enable_empty_final_response") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsBool(f));
    (void)v;  // the last response is always marked final, and is never empty-only
  } else if (n == "sampling_parameters") {
    KVGRID_ASSIGN_OR_RETURN(auto v, AsString(f));
    b->sampling_parameters = std::move(v);
  } else {
    *known = false;
  }
  return absl::OkStatus();
}

// The elements of a JSON value: a scalar, or a flat array of scalars.
absl::StatusOr<Field> FieldFromJson(std::string name, std::string where, const Json& j) {
  Field f{.name = std::move(name), .where = std::move(where)};
  auto add = [&f](const Json& e) -> absl::Status {
    if (e.is_boolean()) {
      f.values.emplace_back(e.get<bool>());
    } else if (e.is_number_unsigned()) {
      f.values.emplace_back(e.get<uint64_t>());
    } else if (e.is_number_integer()) {
      f.values.emplace_back(e.get<int64_t>());
    } else if (e.is_number_float()) {
      f.values.emplace_back(e.get<double>());
    } else if (e.is_string()) {
      f.values.emplace_back(e.get<std::string>());
    } else {
      return Bad(f, "must be a string, number, boolean or a flat array of them");
    }
    return absl::OkStatus();
  };
  if (j.is_array()) {
    f.list = true;
    if (static_cast<int64_t>(j.size()) > kMaxElements) {
      return Bad(f, absl::StrCat("at most ", kMaxElements, " elements"));
    }
    for (const Json& e : j) {
      if (absl::Status s = add(e); !s.ok()) return s;
    }
  } else if (absl::Status s = add(j); !s.ok()) {
    return s;
  }
  return f;
}

absl::StatusOr<Json> ParseJsonObject(std::string_view body, std::string_view what) {
  if (body.size() > openai::kMaxBodyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(model::Sv(what), ": larger than ", openai::kMaxBodyBytes, " bytes"));
  }
  if (absl::Status s = model::CheckJsonDepth(body, what); !s.ok()) return s;
  Json j = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    absl::Status s = openai::JsonError(absl::string_view(body.data(), body.size()));
    // The locator names a path inside `what`'s JSON, or the body as a whole.
    std::string message(s.message());
    if (message.starts_with("body")) message = absl::StrCat(model::Sv(what), message.substr(4));
    else message = absl::StrCat(model::Sv(what), ".", message);
    return absl::InvalidArgumentError(message);
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(model::Sv(what), ": must be a JSON object"));
  return j;
}

struct OutputName {
  Output output;
  const char* name;
};
constexpr OutputName kOutputNames[] = {
    {Output::kTextOutput, "text_output"},
    {Output::kFinishReason, "finish_reason"},
    {Output::kNumInputTokens, "num_input_tokens"},
    {Output::kNumOutputTokens, "num_output_tokens"},
    {Output::kLogprobs, "logprobs"},
    {Output::kCumulativeLogprob, "cumulative_logprob"},
};

const char* NameOf(Output o) {
  for (const OutputName& n : kOutputNames) {
    if (n.output == o) return n.name;
  }
  return "";
}

// Applies the fields in order of precedence and checks what the request must have. `inputs`
// are the tensors (or top-level JSON keys); `parameters` the request's parameters.
absl::StatusOr<GenerateCall> Build(Builder b, const std::vector<Field>& parameters,
                                   const std::vector<Field>& inputs,
                                   const std::vector<std::string>& requested_outputs) {
  const std::string& model = b.call.model_name;
  for (const Field& f : parameters) {
    bool known = false;
    if (absl::Status s = Apply(f, &b, &known); !s.ok()) return s;
    if (!known || f.name == "sampling_parameters" || f.name == "text_input") {
      return Bad(f, absl::StrCat("not a parameter of model '", model, "'"));
    }
  }
  // sampling_parameters first, so that inputs of their own override it.
  for (const Field& f : inputs) {
    if (f.name != "sampling_parameters") continue;
    bool known = false;
    if (absl::Status s = Apply(f, &b, &known); !s.ok()) return s;
  }
  if (b.sampling_parameters) {
    absl::StatusOr<Json> j = ParseJsonObject(*b.sampling_parameters, "sampling_parameters");
    if (!j.ok()) return j.status();
    for (const auto& [key, value] : j->items()) {
      if (value.is_null()) continue;
      absl::StatusOr<Field> f = FieldFromJson(key, absl::StrCat("sampling_parameters.", key), value);
      if (!f.ok()) return f.status();
      bool known = false;
      if (absl::Status s = Apply(*f, &b, &known); !s.ok()) return s;
      if (!known || key == "sampling_parameters" || key == "text_input") {
        return Bad(*f, "not a sampling parameter");
      }
    }
  }
  absl::flat_hash_set<std::string> seen;
  for (const Field& f : inputs) {
    if (!seen.insert(f.name).second) return Bad(f, "given twice");
    if (f.name == "sampling_parameters") continue;
    bool known = false;
    if (absl::Status s = Apply(f, &b, &known); !s.ok()) return s;
    if (!known || f.name == "triton_enable_empty_final_response") {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected inference input '", f.name, "' for model '", model, "'"));
    }
  }
  if (!b.has_text) {
    return absl::InvalidArgumentError(
        absl::StrCat("input 'text_input': required by model '", model, "'"));
  }
  if ((b.wanted.logprobs || b.wanted.cumulative_logprob) &&
      !b.call.request.sampling().has_logprobs()) {
    b.call.request.mutable_sampling()->set_logprobs(0);  // the chosen tokens' own
  }
  if (requested_outputs.empty()) {
    b.call.outputs.push_back(Output::kTextOutput);
    if (b.wanted.finish_reason) b.call.outputs.push_back(Output::kFinishReason);
    if (b.wanted.num_input_tokens) b.call.outputs.push_back(Output::kNumInputTokens);
    if (b.wanted.num_output_tokens) b.call.outputs.push_back(Output::kNumOutputTokens);
    if (b.wanted.logprobs) b.call.outputs.push_back(Output::kLogprobs);
    if (b.wanted.cumulative_logprob) b.call.outputs.push_back(Output::kCumulativeLogprob);
  } else {
    for (const std::string& name : requested_outputs) {
      const OutputName* found = nullptr;
      for (const OutputName& o : kOutputNames) {
        if (name == o.name) found = &o;
      }
      if (found == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("unexpected inference output '", name, "' for model '", model, "'"));
      }
      bool dup = false;
      for (Output o : b.call.outputs) dup = dup || o == found->output;
      if (dup) {
        return absl::InvalidArgumentError(absl::StrCat("output '", name, "': requested twice"));
      }
      b.call.outputs.push_back(found->output);
      if (found->output == Output::kLogprobs || found->output == Output::kCumulativeLogprob) {
        if (!b.call.request.sampling().has_logprobs()) {
          b.call.request.mutable_sampling()->set_logprobs(0);
        }
      }
    }
  }
  b.call.request.set_model(b.call.model_name);
  b.call.request.set_request_id(b.call.id);
  return std::move(b.call);
}

absl::Status CheckId(const std::string& id) {
  if (id.size() > kMaxIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("id: at most ", kMaxIdBytes, " bytes, got ", id.size()));
  }
  return absl::OkStatus();
}

size_t ElementSize(std::string_view t) {
  if (t == "BOOL" || t == "INT8" || t == "UINT8") return 1;
  if (t == "INT16" || t == "UINT16") return 2;
  if (t == "INT32" || t == "UINT32" || t == "FP32") return 4;
  if (t == "INT64" || t == "UINT64" || t == "FP64") return 8;
  return 0;
}

template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// One fixed-size element of `t` at `p` (little-endian, as x86 and ARM hosts store them).
Value LoadElement(std::string_view t, const char* p) {
  if (t == "BOOL") return *p != 0;
  if (t == "INT8") return static_cast<int64_t>(Load<int8_t>(p));
  if (t == "UINT8") return static_cast<int64_t>(Load<uint8_t>(p));
  if (t == "INT16") return static_cast<int64_t>(Load<int16_t>(p));
  if (t == "UINT16") return static_cast<int64_t>(Load<uint16_t>(p));
  if (t == "INT32") return static_cast<int64_t>(Load<int32_t>(p));
  if (t == "UINT32") return static_cast<int64_t>(Load<uint32_t>(p));
  if (t == "INT64") return Load<int64_t>(p);
  if (t == "UINT64") return Load<uint64_t>(p);
  if (t == "FP32") return static_cast<double>(Load<float>(p));
  return Load<double>(p);  // FP64
}

// The elements of input `t`, from `raw` when the request carries raw contents.
absl::StatusOr<Field> DecodeInput(const inference::ModelInferRequest::InferInputTensor& t,
                                  const std::string* raw) {
  Field f{.name = t.name(), .where = absl::StrCat("input '", t.name(), "'"),
          .datatype = t.datatype(), .list = true};
  const std::string& type = t.datatype();
  if (type != "BYTES" && ElementSize(type) == 0) {
    if (type == "FP16" || type == "BF16") {
      return Bad(f, absl::StrCat("datatype ", type, " is not taken (send FP32)"));
    }
    return Bad(f, absl::StrCat("datatype '", type, "' is not a KServe datatype"));
  }
  int64_t count = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) return Bad(f, absl::StrCat("shape [", absl::StrJoin(t.shape(), ","), "] has a negative dimension"));
    if (d > kMaxElements || count * d > kMaxElements) {
      return Bad(f, absl::StrCat("at most ", kMaxElements, " elements"));
    }
    count *= d;
  }
  const std::string shape = absl::StrCat("[", absl::StrJoin(t.shape(), ","), "]");
  if (raw != nullptr) {
    if (t.has_contents()) return Bad(f, "has contents and raw_input_contents both");
    if (type == "BYTES") {
      absl::StatusOr<std::vector<std::string>> elements = DecodeBytesElements(*raw, f.where);
      if (!elements.ok()) return elements.status();
      for (std::string& e : *elements) f.values.emplace_back(std::move(e));
    } else {
      const size_t size = ElementSize(type);
      if (raw->size() % size != 0) {
        return Bad(f, absl::StrCat(raw->size(), " raw bytes are not whole ", type, " elements"));
      }
      for (size_t i = 0; i < raw->size(); i += size) f.values.push_back(LoadElement(type, raw->data() + i));
    }
  } else {
    const inference::InferTensorContents& c = t.contents();
    if (type == "BOOL") {
      for (bool v : c.bool_contents()) f.values.emplace_back(v);
    } else if (type == "INT64") {
      for (int64_t v : c.int64_contents()) f.values.emplace_back(v);
    } else if (type == "UINT64") {
      for (uint64_t v : c.uint64_contents()) f.values.emplace_back(v);
    } else if (type == "INT8" || type == "INT16" || type == "INT32") {
      for (int32_t v : c.int_contents()) f.values.emplace_back(static_cast<int64_t>(v));
    } else if (type == "UINT8" || type == "UINT16" || type == "UINT32") {
      for (uint32_t v : c.uint_contents()) f.values.emplace_back(static_cast<int64_t>(v));
    } else if (type == "FP32") {
      for (float v : c.fp32_contents()) f.values.emplace_back(static_cast<double>(v));
    } else if (type == "FP64") {
      for (double v : c.fp64_contents()) f.values.emplace_back(v);
    } else {
      for (const std::string& v : c.bytes_contents()) f.values.emplace_back(v);
    }
  }
  if (static_cast<int64_t>(f.values.size()) != count) {
    return Bad(f, absl::StrCat("shape ", shape, " holds ", count, " elements, the contents ",
                               f.values.size()));
  }
  return f;
}

absl::StatusOr<Field> FieldFromParameter(const std::string& key,
                                         const inference::InferParameter& p) {
  Field f{.name = key, .where = absl::StrCat("parameter '", key, "'")};
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      f.values.emplace_back(p.bool_param());
      break;
    case inference::InferParameter::kInt64Param:
      f.values.emplace_back(p.int64_param());
      break;
    case inference::InferParameter::kUint64Param:
      f.values.emplace_back(p.uint64_param());
      break;
    case inference::InferParameter::kDoubleParam:
      f.values.emplace_back(p.double_param());
      break;
    case inference::InferParameter::kStringParam:
      f.values.emplace_back(p.string_param());
      break;
    default:
      return Bad(f, "has no value");
  }
  return f;
}

std::string Le32(uint32_t v) {
  std::string out(4, '\0');
  std::memcpy(out.data(), &v, 4);
  return out;
}

std::string FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    default:
      return "";
  }
}

Json LogprobsJson(const std::vector<v1::TokenLogprob>& logprobs) {
  Json out = Json::array();
  for (const v1::TokenLogprob& lp : logprobs) {
    Json top = Json::array();
    for (const v1::TopLogprob& t : lp.top()) {
      top.push_back(Json{{"token_id", t.token_id()}, {"logprob", t.logprob()}});
    }
    out.push_back(Json{{"token_id", lp.token_id()}, {"logprob", lp.logprob()},
                       {"top_logprobs", std::move(top)}});
  }
  return out;
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

double CumulativeLogprob(const Result& r) {
  double sum = 0;
  for (const v1::TokenLogprob& lp : r.logprobs) sum += lp.logprob();
  return sum;
}

std::string TextOf(const GenerateCall& call, const Result& result) {
  if (call.stream || call.exclude_input_in_output) return result.text;
  return call.request.prompt() + result.text;
}

}  // namespace

const std::vector<TensorSpec>& InputSpecs() {
  static const std::vector<TensorSpec> specs = {
      {"text_input", "BYTES", 1, false},
      {"stream", "BOOL", 1, true},
      {"sampling_parameters", "BYTES", 1, true},
      {"exclude_input_in_output", "BOOL", 1, true},
      {"max_tokens", "INT32", 1, true},
      {"min_tokens", "INT32", 1, true},
      {"temperature", "FP32", 1, true},
      {"top_p", "FP32", 1, true},
      {"top_k", "INT32", 1, true},
      {"min_p", "FP32", 1, true},
      {"repetition_penalty", "FP32", 1, true},
      {"presence_penalty", "FP32", 1, true},
      {"frequency_penalty", "FP32", 1, true},
      {"random_seed", "UINT64", 1, true},
      {"stop_words", "BYTES", -1, true},
      {"bad_words", "BYTES", -1, true},
      {"ignore_eos", "BOOL", 1, true},
      {"end_id", "INT32", 1, true},
      {"pad_id", "INT32", 1, true},
      {"beam_width", "INT32", 1, true},
      {"return_finish_reason", "BOOL", 1, true},
      {"return_num_input_tokens", "BOOL", 1, true},
      {"return_num_output_tokens", "BOOL", 1, true},
      {"return_logprobs", "BOOL", 1, true},
      {"return_log_probs", "BOOL", 1, true},
      {"return_cumulative_logprob", "BOOL", 1, true},
  };
  return specs;
}

const std::vector<TensorSpec>& OutputSpecs() {
  static const std::vector<TensorSpec> specs = {
      {"text_output", "BYTES", -1, false},
      {"finish_reason", "BYTES", -1, true},
      {"num_input_tokens", "UINT32", 1, true},
      {"num_output_tokens", "UINT32", -1, true},
      {"logprobs", "BYTES", -1, true},
      {"cumulative_logprob", "FP32", -1, true},
  };
  return specs;
}

absl::StatusOr<std::vector<std::string>> DecodeBytesElements(std::string_view raw,
                                                             std::string_view what) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < raw.size()) {
    if (raw.size() - at < 4) {
      return absl::InvalidArgumentError(
          absl::StrCat(model::Sv(what), ": BYTES contents end inside an element's 4-byte length"));
    }
    const uint32_t len = Load<uint32_t>(raw.data() + at);
    at += 4;
    if (len > raw.size() - at) {
      return absl::InvalidArgumentError(absl::StrCat(
          model::Sv(what), ": a BYTES element of ", len, " bytes runs past the contents' end (",
          raw.size() - at, " bytes left)"));
    }
    if (static_cast<int64_t>(out.size()) >= kMaxElements) {
      return absl::InvalidArgumentError(absl::StrCat(model::Sv(what), ": at most ", kMaxElements, " elements"));
    }
    out.emplace_back(raw.substr(at, len));
    at += len;
  }
  return out;
}

std::string EncodeBytesElements(const std::vector<std::string>& elements) {
  std::string out;
  for (const std::string& e : elements) {
    out += Le32(static_cast<uint32_t>(e.size()));
    out += e;
  }
  return out;
}

absl::StatusOr<GenerateCall> ParseInferRequest(const inference::ModelInferRequest& request) {
  Builder b;
  b.call.model_name = request.model_name();
  b.call.id = request.id();
  if (absl::Status s = CheckId(b.call.id); !s.ok()) return s;
  if (!request.model_version().empty() && request.model_version() != kModelVersion) {
    return absl::NotFoundError(absl::StrCat("model '", request.model_name(), "' has no version '",
                                            request.model_version(), "' (kvgrid serves version ",
                                            kModelVersion, ")"));
  }
  const int raw_count = request.raw_input_contents_size();
  if (raw_count > 0 && raw_count != request.inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("raw_input_contents: ", raw_count,
                                                   " entries for ", request.inputs_size(),
                                                   " inputs (give every input's, or none)"));
  }
  std::vector<Field> parameters;
  for (const auto& [key, p] : request.parameters()) {
    absl::StatusOr<Field> f = FieldFromParameter(key, p);
    if (!f.ok()) return f.status();
    parameters.push_back(*std::move(f));
  }
  std::vector<Field> inputs;
  for (int i = 0; i < request.inputs_size(); ++i) {
    absl::StatusOr<Field> f =
        DecodeInput(request.inputs(i), raw_count > 0 ? &request.raw_input_contents(i) : nullptr);
    if (!f.ok()) return f.status();
    inputs.push_back(*std::move(f));
  }
  std::vector<std::string> outputs;
  for (const auto& o : request.outputs()) outputs.push_back(o.name());
  return Build(std::move(b), parameters, inputs, outputs);
}

absl::StatusOr<GenerateCall> ParseGenerateBody(std::string_view model_name,
                                               std::string_view body, bool stream) {
  absl::StatusOr<Json> j = ParseJsonObject(body, "body");
  if (!j.ok()) return j.status();
  Builder b;
  b.call.model_name = std::string(model_name);
  std::vector<Field> parameters;
  std::vector<Field> inputs;
  for (const auto& [key, value] : j->items()) {
    if (key == "id") {
      if (!value.is_string()) return absl::InvalidArgumentError("id: must be a string");
      b.call.id = value.get<std::string>();
      if (absl::Status s = CheckId(b.call.id); !s.ok()) return s;
    } else if (key == "parameters") {
      if (value.is_null()) continue;
      if (!value.is_object()) return absl::InvalidArgumentError("parameters: must be an object");
      for (const auto& [pk, pv] : value.items()) {
        if (pv.is_null()) continue;
        absl::StatusOr<Field> f = FieldFromJson(pk, absl::StrCat("parameters.", pk), pv);
        if (!f.ok()) return f.status();
        parameters.push_back(*std::move(f));
      }
    } else {
      if (value.is_null()) continue;
      absl::StatusOr<Field> f = FieldFromJson(key, key, value);
      if (!f.ok()) return f.status();
      inputs.push_back(*std::move(f));
    }
  }
  absl::StatusOr<GenerateCall> call = Build(std::move(b), parameters, inputs, {});
  if (!call.ok()) return call.status();
  if (call->stream && !stream) {
    return absl::InvalidArgumentError("stream: generate returns one response; use generate_stream");
  }
  call->stream = stream;
  return call;
}

inference::ModelInferResponse MakeInferResponse(const GenerateCall& call,
                                                const std::string& model_name,
                                                const Result& result,
                                                std::optional<bool> final_response) {
  inference::ModelInferResponse out;
  out.set_model_name(model_name);
  out.set_model_version(kModelVersion);
  out.set_id(call.id);
  if (final_response) {
    (*out.mutable_parameters())[kFinalResponseParam].set_bool_param(*final_response);
  }
  for (Output o : call.outputs) {
    auto* t = out.add_outputs();
    t->set_name(NameOf(o));
    t->add_shape(1);
    std::string raw;
    switch (o) {
      case Output::kTextOutput:
        t->set_datatype("BYTES");
        raw = EncodeBytesElements({TextOf(call, result)});
        break;
      case Output::kFinishReason:
        t->set_datatype("BYTES");
        raw = EncodeBytesElements({FinishName(result.finish_reason)});
        break;
      case Output::kNumInputTokens:
        t->set_datatype("UINT32");
        raw = Le32(static_cast<uint32_t>(result.num_input_tokens));
        break;
      case Output::kNumOutputTokens:
        t->set_datatype("UINT32");
        raw = Le32(static_cast<uint32_t>(result.num_output_tokens));
        break;
      case Output::kLogprobs:
        t->set_datatype("BYTES");
        raw = EncodeBytesElements({Dump(LogprobsJson(result.logprobs))});
        break;
      case Output::kCumulativeLogprob: {
        t->set_datatype("FP32");
        const float v = static_cast<float>(CumulativeLogprob(result));
        raw.assign(4, '\0');
        std::memcpy(raw.data(), &v, 4);
        break;
      }
    }
    out.add_raw_output_contents(std::move(raw));
  }
  return out;
}

std::string MakeGenerateJson(const GenerateCall& call, const std::string& model_name,
                             const Result& result) {
  Json j{{"model_name", model_name}, {"model_version", kModelVersion}};
  if (!call.id.empty()) j["id"] = call.id;
  for (Output o : call.outputs) {
    switch (o) {
      case Output::kTextOutput:
        j["text_output"] = TextOf(call, result);
        break;
      case Output::kFinishReason:
        j["finish_reason"] = FinishName(result.finish_reason);
        break;
      case Output::kNumInputTokens:
        j["num_input_tokens"] = result.num_input_tokens;
        break;
      case Output::kNumOutputTokens:
        j["num_output_tokens"] = result.num_output_tokens;
        break;
      case Output::kLogprobs:
        j["logprobs"] = Dump(LogprobsJson(result.logprobs));
        break;
      case Output::kCumulativeLogprob:
        j["cumulative_logprob"] = CumulativeLogprob(result);
        break;
    }
  }
  return Dump(j);
}

Result Progress::Add(const v1::GenerateResponse& msg) {
  Result chunk;
  chunk.text = msg.text();
  chunk.finish_reason = msg.finish_reason();
  chunk.num_input_tokens = total_.num_input_tokens;
  chunk.num_output_tokens = msg.token_ids_size();
  chunk.logprobs.assign(msg.logprobs().begin(), msg.logprobs().end());
  total_.text += chunk.text;
  if (chunk.finish_reason != v1::FINISH_REASON_UNSPECIFIED) total_.finish_reason = chunk.finish_reason;
  total_.num_output_tokens += chunk.num_output_tokens;
  total_.logprobs.insert(total_.logprobs.end(), chunk.logprobs.begin(), chunk.logprobs.end());
  return chunk;
}

std::string ErrorJson(std::string_view message) {
  return Dump(Json{{"error", std::string(message)}});
}

}  // namespace kvgrid::coordinator::kserve
