// model::ChatTemplate (where templates are found, named templates, special tokens, parts) and
// the limits and error positions of the Jinja interpreter behind it. Rendering fidelity is
// checked against Python's jinja2 in tests/reference/test_chat_template.py.
#include "model/chat_template.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/jinja/template.h"
#include "model/jinja/value.h"
#include "tests/unit/model/gguf_test_writer.h"

namespace kvgrid::model {
namespace {

using ::testing::HasSubstr;
using jinja::Value;

std::filesystem::path Dir(const std::string& name) {
  const auto d = gguf_test::GgufTestWriter::TestDir() / name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

void WriteFile(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
}

Value Vars(const std::string& json) {
  auto v = Value::FromJson(json, "test");
  EXPECT_TRUE(v.ok()) << v.status();
  return *v;
}

absl::StatusOr<std::string> RenderSource(const std::string& source, const std::string& vars = "{}",
                                         jinja::RenderLimits limits = {}) {
  auto t = jinja::Template::Parse(source, "t");
  if (!t.ok()) return t.status();
  return t->Render(Vars(vars), limits);
}

TEST(JinjaTemplate, SyntaxErrorsNameLineAndColumn) {
  auto r = RenderSource("line one\n  {{ 1 + }}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("t:2:"));
  r = RenderSource("{% if x %}never closed");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("endif"));
  r = RenderSource("{{ x | no_such_filter }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("no_such_filter"));
}

TEST(JinjaTemplate, RenderErrorsNamePosition) {
  auto r = RenderSource("ok\n{{ raise_exception('Conversation roles must alternate') }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("t:2:"));
  EXPECT_THAT(r.status().message(), HasSubstr("raise_exception: Conversation roles must alternate"));
  r = RenderSource("{{ missing.attr }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("'missing' is undefined"));
}

TEST(JinjaTemplate, EndlessLoopsStopAtTheStepLimit) {
  jinja::RenderLimits limits;
  limits.max_steps = 100000;
  const auto start = std::chrono::steady_clock::now();
  auto r = RenderSource(
      "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "{}",
      limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("step limit"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// Copying a long string each time through a loop costs steps by its size: 100000 copies of
// 1 MB would otherwise take minutes within both limits.
TEST(JinjaTemplate, LoopsCopyingLongStringsStopAtTheStepLimit) {
  jinja::RenderLimits limits;
  limits.max_steps = 100000;
  auto r = RenderSource(
      "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(100000) %}"
      "{% set ns.s = (ns.s ~ 'a')[:-1] %}{% endfor %}{{ ns.s | length }}",
      "{}", limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("step limit"));
  r = RenderSource("{% set l = [0] * 100000 %}{% for i in range(100000) %}{% set x = l + [] %}"
                   "{% endfor %}", "{}", limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("step limit"));
}

TEST(JinjaTemplate, RecursionStopsAtTheDepthLimit) {
  auto r = RenderSource("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("macro calls deeper than"));
}

TEST(JinjaTemplate, GrowingStringsStopAtTheSizeLimit) {
  jinja::RenderLimits limits;
  limits.max_output_bytes = 1 << 20;
  auto r = RenderSource(
      "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}{{ ns.s | length }}",
      "{}", limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("size limit"));
  r = RenderSource("{{ 'x' * 100000000000 }}", "{}", limits);
  ASSERT_FALSE(r.ok());
  r = RenderSource("{{ [1] * 100000000000 }}", "{}", limits);
  ASSERT_FALSE(r.ok());
}

TEST(JinjaTemplate, PercentFormatWidthsPastTheSizeLimitFailBeforePrinting) {
  // printf would pad (or print digits) up to the width or precision first: a width of 2e9 in
  // a loop took minutes (the jinja fuzzer's timeout). Each fails at the limit instead; widths
  // within it print in full (snippets.txt's str_percent_wide checks them against jinja2).
  jinja::RenderLimits limits;
  limits.max_output_bytes = 1 << 20;
  for (const char* source :
       {"{% for i in range(100) %}{{ '%1999999999d' % i }}{% endfor %}",
        "{{ '%.1999999999f' % 1.5 }}", "{{ '%-1999999999x' % 255 }}",
        "{{ '%1999999999s' % 'a' }}", "{{ '%99999999999999999999999999d' % 1 }}",
        "{{ '%.99999999999999999999999999e' % 1.5 }}"}) {
    auto r = RenderSource(source, "{}", limits);
    ASSERT_FALSE(r.ok()) << source;
    EXPECT_THAT(r.status().message(), HasSubstr("size limit")) << source;
  }
  auto r = RenderSource("{{ ('%5000d' % 7) | length }} {{ '%.9999s' % 'abc' }}", "{}", limits);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "5000 abc");
}

TEST(JinjaTemplate, DeepValuesAndExpressionsFailCleanly) {
  auto r = RenderSource(
      "{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] %}"
      "{% endfor %}{{ ns.x }}");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("deeper than"));
  std::string deep = "{{ 1";
  for (int i = 0; i < 100000; ++i) deep += " + 1";
  r = RenderSource(deep + " }}");
  ASSERT_FALSE(r.ok());
  r = RenderSource("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}");
  ASSERT_FALSE(r.ok());
}

// A namespace (or loop.changed's memory) can come to hold itself. Printing such a value stops
// where Python's recursion guard does, and the render frees it: the sanitizer build's leak
// checker fails this test otherwise.
TEST(JinjaTemplate, ValuesHoldingThemselvesPrintAndAreFreed) {
  auto r = RenderSource("{% set ns = namespace(n=0) %}{% set ns.me = (ns, ns) %}{{ ns.me }}");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "(<Namespace {'n': 0, 'me': (...)}>, <Namespace {'n': 0, 'me': (...)}>)");
  r = RenderSource("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "<Namespace {'me': <Namespace {...}>}>");
  r = RenderSource("{% for i in [1, 2] %}{{ loop.changed(loop) }}{% endfor %}");
  ASSERT_TRUE(r.ok()) << r.status();
  r = RenderSource("{% set ns = namespace() %}{% set c = cycler(ns) %}{% set ns.c = c %}"
                   "{{ c.next() is not none }}");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "True");
  // Functions that keep a value (joiner's separator, a bound method's object) count as holding
  // it, so a chain of them is refused like nested lists instead of overflowing the stack
  // when it is freed.
  r = RenderSource("{% set ns = namespace(j=none) %}{% for i in range(100000) %}"
                   "{% set ns.j = joiner(ns.j) %}{% endfor %}done");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("deeper than"));
  r = RenderSource("{% set ns = namespace(d={}) %}{% for i in range(100000) %}"
                   "{% set ns.d = {'a': ns.d.get} %}{% endfor %}done");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("deeper than"));
  // A render that fails after making the cycle frees it too.
  r = RenderSource("{% set ns = namespace() %}{% set ns.me = [ns] %}{{ missing.attr }}");
  EXPECT_FALSE(r.ok());
}

TEST(JinjaTemplate, SharedPartsCannotStandForUnboundedWork) {
  jinja::RenderLimits limits;
  limits.max_output_bytes = 1 << 20;
  // 2^64 elements in 64 lists; 2^64 characters through 64 namespaces; 1000 copies of 1 MB.
  auto r = RenderSource("{% set ns = namespace(l=[0]) %}{% for i in range(64) %}"
                        "{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l == ns.l }}",
                        "{}", limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("size limit"));
  r = RenderSource("{% set ns = namespace(a=1) %}{% for i in range(64) %}{% set n = namespace() %}"
                   "{% set n.a = (ns.a, ns.a) %}{% set ns.a = n %}{% endfor %}{{ ns.a }}",
                   "{}", limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("size limit"));
  r = RenderSource("{% set s = 'x' * 1000000 %}{{ ([s] * 1000) | string | length }}", "{}", limits);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("size limit"));
}

TEST(JinjaTemplate, ValuesFromJsonKeepKeyOrderAndNumbers) {
  auto r = RenderSource("{{ d | tojson }} {{ d.b }} {{ d.a is integer }} {{ d.c is float }}",
                        R"({"d": {"b": 1, "a": 2, "c": 1.5, "é": "ü"}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, R"({"b": 1, "a": 2, "c": 1.5, "é": "ü"} 1 True True)");
}

TEST(ChatTemplate, DirectoryPrefersJinjaFileThenConfig) {
  const auto d = Dir("chat_dir");
  WriteFile(d / "tokenizer_config.json",
            R"({"chat_template": "config:{{ bos_token }}", "bos_token": {"content": "<s>"},
                "eos_token": "</s>", "pad_token": ""})");
  auto t = ChatTemplate::ForModel(d);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_NE(*t, nullptr);
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": []})")), "config:<s>");
  EXPECT_EQ((*t)->bos_token(), "<s>");
  EXPECT_EQ((*t)->eos_token(), "</s>");
  WriteFile(d / "chat_template.jinja", "file:{{ eos_token }}|{{ pad_token is defined }}\n");
  t = ChatTemplate::ForModel(d);
  ASSERT_TRUE(t.ok()) << t.status();
  // The file's template with the config's special tokens; an empty token is no variable; the
  // template's single trailing newline is dropped, as jinja2 does.
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": []})")), "file:</s>|False");
}

TEST(ChatTemplate, ModelWithoutTemplateHasNone) {
  const auto d = Dir("no_template");
  WriteFile(d / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  auto t = ChatTemplate::ForModel(d);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, nullptr);
  auto f = ChatTemplate::FromFile(d / "tokenizer_config.json");
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("no chat template"));
  EXPECT_EQ(ChatTemplate::FromFile(d / "absent.jinja").status().code(), absl::StatusCode::kNotFound);
}

TEST(ChatTemplate, MalformedTemplateNamesTheFile) {
  const auto d = Dir("bad_template");
  WriteFile(d / "tokenizer_config.json", R"({"chat_template": "{% for %}"})");
  auto t = ChatTemplate::ForModel(d);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer_config.json:1:"));
}

TEST(ChatTemplate, NamedTemplatesChooseToolUseWithTools) {
  const auto d = Dir("named");
  WriteFile(d / "tokenizer_config.json",
            R"({"chat_template": [{"name": "default", "template": "plain"},
                                  {"name": "tool_use", "template": "tools:{{ tools | length }}"}]})");
  auto t = ChatTemplate::ForModel(d);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": []})")), "plain");
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": [], "tools": [{"type": "function"}]})")), "tools:1");
  EXPECT_THAT((*t)->names(), ::testing::ElementsAre("default", "tool_use"));
}

TEST(ChatTemplate, VariablesAsApplyChatTemplatePassesThem) {
  auto t = ChatTemplate::FromSource(
      "{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }} {{ extra }}", "t");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": [], "extra": 7})")), "True True False 7");
}

TEST(ChatTemplate, RaisedErrorsAreInvalidArgument) {
  auto t = ChatTemplate::FromSource("{{ raise_exception('no system role') }}", "t");
  ASSERT_TRUE(t.ok());
  auto r = (*t)->Render(Vars(R"({"messages": []})"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("chat template: t:1:"));
  EXPECT_THAT(r.status().message(), HasSubstr("no system role"));
}

TEST(ChatTemplate, GgufCarriesTemplateAndTokens) {
  gguf_test::GgufTestWriter w;
  w.String("general.architecture", "llama");
  w.String("tokenizer.chat_template", "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}");
  w.String("tokenizer.chat_template.tool_use", "T");
  w.StringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>"});
  w.U32("tokenizer.ggml.bos_token_id", 1);
  w.U32("tokenizer.ggml.eos_token_id", 2);
  const auto path = w.Write("chat.gguf");
  auto t = ChatTemplate::FromFile(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": [{"role": "user", "content": "hi"}]})")),
            "<s>hi</s>");
  EXPECT_EQ(*(*t)->Render(Vars(R"({"messages": [], "tools": []})")), "T");
  auto m = ChatTemplate::ForModel(path);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_NE(*m, nullptr);
  EXPECT_EQ((*m)->bos_token(), "<s>");
}

TEST(FlattenTextParts, JoinsTextPartsAndRefusesOthers) {
  auto flat = FlattenTextParts(Vars(R"({"m": [{"role": "user", "content": [
      {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})").Find("m")[0]);
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(flat->as_list()[0].Find("content")->as_string(), "a\nb");
  auto bad = FlattenTextParts(Vars(R"({"m": [{"role": "user", "content": "x"}, {"role": "user",
      "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]})").Find("m")[0]);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("messages[1].content[0]"));
  EXPECT_THAT(bad.status().message(), HasSubstr("image_url"));
}

}  // namespace
}  // namespace kvgrid::model
