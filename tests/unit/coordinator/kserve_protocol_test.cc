#include "coordinator/kserve_protocol.h"

#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvgrid::coordinator::kserve {
namespace {

using ::testing::HasSubstr;

std::string Le32(uint32_t v) {
  std::string s(4, '\0');
  std::memcpy(s.data(), &v, 4);
  return s;
}

inference::ModelInferRequest Raw(const std::string& prompt) {
  inference::ModelInferRequest r;
  r.set_model_name("m");
  auto* t = r.add_inputs();
  t->set_name("text_input");
  t->set_datatype("BYTES");
  t->add_shape(1);
  r.add_raw_input_contents(Le32(static_cast<uint32_t>(prompt.size())) + prompt);
  return r;
}

void AddRaw(inference::ModelInferRequest* r, const std::string& name, const std::string& type,
            std::string raw) {
  auto* t = r->add_inputs();
  t->set_name(name);
  t->set_datatype(type);
  t->add_shape(1);
  r->add_raw_input_contents(std::move(raw));
}

TEST(KServeProtocolTest, BytesElementsRoundTripAndRefuseTruncation) {
  const std::string raw = EncodeBytesElements({"ab", "", "xyz"});
  absl::StatusOr<std::vector<std::string>> back = DecodeBytesElements(raw, "t");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, (std::vector<std::string>{"ab", "", "xyz"}));
  for (size_t cut = 1; cut < raw.size(); ++cut) {
    absl::StatusOr<std::vector<std::string>> bad = DecodeBytesElements(raw.substr(0, cut), "t");
    if (cut == 6 || cut == 10) continue;  // ends exactly after an element
    EXPECT_FALSE(bad.ok()) << cut;
  }
  EXPECT_THAT(DecodeBytesElements(Le32(1u << 31), "input 'x'").status().message(),
              HasSubstr("runs past"));
}

TEST(KServeProtocolTest, RawInputsBecomeTheRequest) {
  inference::ModelInferRequest r = Raw("hello");
  r.set_id("id-1");
  int32_t max_tokens = 7;
  AddRaw(&r, "max_tokens", "INT32", std::string(reinterpret_cast<char*>(&max_tokens), 4));
  float temperature = 0.5f;
  AddRaw(&r, "temperature", "FP32", std::string(reinterpret_cast<char*>(&temperature), 4));
  AddRaw(&r, "stream", "BOOL", std::string(1, '\1'));
  AddRaw(&r, "stop_words", "BYTES", EncodeBytesElements({"\n\n"}));
  absl::StatusOr<GenerateCall> call = ParseInferRequest(r);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->request.prompt(), "hello");
  EXPECT_EQ(call->request.request_id(), "id-1");
  EXPECT_EQ(call->request.stopping().max_new_tokens(), 7);
  EXPECT_FLOAT_EQ(call->request.sampling().temperature(), 0.5f);
  EXPECT_TRUE(call->stream);
  ASSERT_EQ(call->request.stopping().stop_size(), 1);
  EXPECT_EQ(call->outputs, std::vector<Output>{Output::kTextOutput});
}

TEST(KServeProtocolTest, InputsOverrideSamplingParametersWhichOverrideParameters) {
  inference::ModelInferRequest r = Raw("p");
  (*r.mutable_parameters())["temperature"].set_double_param(0.9);
  (*r.mutable_parameters())["max_tokens"].set_int64_param(3);
  AddRaw(&r, "sampling_parameters", "BYTES",
         EncodeBytesElements({R"({"temperature": "0.2", "top_k": 5, "max_tokens": 4})"}));
  float t = 0.1f;
  AddRaw(&r, "temperature", "FP32", std::string(reinterpret_cast<char*>(&t), 4));
  absl::StatusOr<GenerateCall> call = ParseInferRequest(r);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_FLOAT_EQ(call->request.sampling().temperature(), 0.1f);
  EXPECT_EQ(call->request.sampling().top_k(), 5);
  EXPECT_EQ(call->request.stopping().max_new_tokens(), 4);
}

TEST(KServeProtocolTest, BadRequestsNameWhatIsWrong) {
  auto error = [](inference::ModelInferRequest r) {
    absl::StatusOr<GenerateCall> call = ParseInferRequest(r);
    EXPECT_FALSE(call.ok());
    return std::string(call.status().message());
  };
  {
    inference::ModelInferRequest r = Raw("p");
    AddRaw(&r, "temperature", "BYTES", EncodeBytesElements({"hot"}));
    EXPECT_THAT(error(r), HasSubstr("input 'temperature': datatype BYTES"));
  }
  {
    inference::ModelInferRequest r = Raw("p");
    r.mutable_inputs(0)->set_shape(0, 2);
    EXPECT_THAT(error(r), HasSubstr("input 'text_input': shape [2] holds 2 elements"));
  }
  {
    inference::ModelInferRequest r = Raw("p");
    r.add_raw_input_contents("x");
    EXPECT_THAT(error(r), HasSubstr("raw_input_contents: 2 entries for 1 inputs"));
  }
  {
    inference::ModelInferRequest r = Raw("\xff\xfe");
    EXPECT_THAT(error(r), HasSubstr("not valid UTF-8"));
  }
  {
    inference::ModelInferRequest r = Raw("p");
    AddRaw(&r, "text_input", "BYTES", EncodeBytesElements({"q"}));
    EXPECT_THAT(error(r), HasSubstr("given twice"));
  }
  {
    inference::ModelInferRequest r = Raw("p");
    r.add_outputs()->set_name("nope");
    EXPECT_THAT(error(r), HasSubstr("unexpected inference output 'nope'"));
  }
  {
    inference::ModelInferRequest r = Raw("p");
    r.set_model_version("2");
    absl::StatusOr<GenerateCall> call = ParseInferRequest(r);
    EXPECT_EQ(call.status().code(), absl::StatusCode::kNotFound);
  }
  {
    inference::ModelInferRequest r = Raw("p");
    AddRaw(&r, "sampling_parameters", "BYTES", EncodeBytesElements({R"({"best": 1})"}));
    EXPECT_THAT(error(r), HasSubstr("sampling_parameters.best: not a sampling parameter"));
  }
}

TEST(KServeProtocolTest, ResponsesCarryTheRequestedOutputs) {
  inference::ModelInferRequest r = Raw("Hi");
  AddRaw(&r, "return_finish_reason", "BOOL", std::string(1, '\1'));
  AddRaw(&r, "return_num_output_tokens", "BOOL", std::string(1, '\1'));
  absl::StatusOr<GenerateCall> call = ParseInferRequest(r);
  ASSERT_TRUE(call.ok()) << call.status();
  Result result{.text = " there", .finish_reason = v1::FINISH_REASON_STOP, .num_output_tokens = 2};
  inference::ModelInferResponse out = MakeInferResponse(*call, "m", result, std::nullopt);
  ASSERT_EQ(out.outputs_size(), 3);
  EXPECT_EQ(out.outputs(0).name(), "text_output");
  EXPECT_EQ(out.raw_output_contents(0), EncodeBytesElements({"Hi there"}));  // prompt first
  EXPECT_EQ(out.raw_output_contents(1), EncodeBytesElements({"stop"}));
  EXPECT_EQ(out.raw_output_contents(2), Le32(2));
  EXPECT_TRUE(out.parameters().empty());
  call->stream = true;
  out = MakeInferResponse(*call, "m", result, true);
  EXPECT_EQ(out.raw_output_contents(0), EncodeBytesElements({" there"}));
  EXPECT_TRUE(out.parameters().at(kFinalResponseParam).bool_param());
}

TEST(KServeProtocolTest, GenerateBodies) {
  absl::StatusOr<GenerateCall> call = ParseGenerateBody(
      "m", R"({"text_input": "x", "id": "a", "parameters": {"max_tokens": 5, "stop": ["."]}})",
      false);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->request.stopping().max_new_tokens(), 5);
  EXPECT_EQ(call->id, "a");
  EXPECT_THAT(ParseGenerateBody("m", R"({"text_input": "x", "stream": true})", false)
                  .status()
                  .message(),
              HasSubstr("generate_stream"));
  EXPECT_THAT(ParseGenerateBody("m", "[1]", false).status().message(),
              HasSubstr("body: must be a JSON object"));
  EXPECT_THAT(ParseGenerateBody("m", R"({"text_input": "x", "parameters": {"top_p": 3}})", false)
                  .status()
                  .message(),
              HasSubstr("parameters.top_p: must be in [0, 1]"));
  EXPECT_THAT(ParseGenerateBody("m", R"({"text_input": "x", "max_tokens": {}})", false)
                  .status()
                  .message(),
              HasSubstr("max_tokens"));
}

}  // namespace
}  // namespace kvgrid::coordinator::kserve
