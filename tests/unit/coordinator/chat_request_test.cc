// Chat requests through GenerationService::Prepare: messages become template variables with
// vLLM's conventions, are rendered by the model's chat template and tokenized into the same
// worker request a prompt becomes; BOS is never doubled; the template's eos_token stops a
// turn; every malformed field is refused naming it. Models are built in a temporary directory
// from models/kjv-tiny's config and tokenizer with a tokenizer_config.json of each test's
// making, and from the generated llama3-tiny/qwen2-tiny fixtures with their real templates.
#include "coordinator/chat_request.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "auth/bearer_auth.h"
#include "coordinator/frontend.h"
#include "coordinator/model_catalog.h"
#include "coordinator/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvgrid::coordinator {
namespace {

namespace fs = std::filesystem;
namespace jinja = model::jinja;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int32_t kBos = 4094;  // kjv-tiny's <|begin_of_text|>
constexpr int32_t kEos = 4095;  // <|end_of_text|>, its generation_config.json EOS
constexpr int32_t kThe = 258;   // "Ġthe"

// A template that shows everything a message carries.
constexpr char kPlainTemplate[] =
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}";

fs::path SourceDir() { return fs::path(KVGRID_SOURCE_DIR); }
fs::path FixturesDir() { return fs::path(KVGRID_FIXTURES_DIR); }

void WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

// This process's scratch directory, removed when the tests end.
fs::path ScratchDir() {
  return fs::temp_directory_path() / ("kvgrid-chat-test-" + std::to_string(getpid()));
}

class RemoveScratch : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(ScratchDir(), ec);
  }
};
const ::testing::Environment* const kRemoveScratch =
    ::testing::AddGlobalTestEnvironment(new RemoveScratch);

// A fresh directory in the scratch directory.
fs::path TempDir(const std::string& name) {
  const fs::path dir = ScratchDir() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A model directory named `name`: kjv-tiny's config, generation config and tokenizer, and
// `tokenizer_config` (a JSON object) when not null.
fs::path KjvModel(const std::string& name, const nlohmann::json& tokenizer_config) {
  const fs::path dir = TempDir(name);
  const fs::path kjv = SourceDir() / "models" / "kjv-tiny";
  // Copies: a model file that links outside its directory is refused.
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json"}) {
    fs::copy_file(kjv / f, dir / f, fs::copy_options::overwrite_existing);
  }
  if (!tokenizer_config.is_null()) {
    WriteFile(dir / "tokenizer_config.json", tokenizer_config.dump());
  }
  return dir;
}

nlohmann::json Config(const std::string& chat_template,
                      const std::string& eos_token = "<|end_of_text|>") {
  return {{"bos_token", "<|begin_of_text|>"},
          {"eos_token", eos_token},
          {"chat_template", chat_template}};
}

// A served catalog and the service whose Prepare is under test.
struct Served {
  explicit Served(ModelCatalog c)
      : catalog(std::move(c)),
        registry(RegistryOptions{}),
        keys(auth::BearerAuth::FromTokens({})),
        service(&catalog, &registry, nullptr, RelayOptions{}, &keys) {}

  absl::StatusOr<v1::WorkerGenerateRequest> Prepare(const v1::GenerateRequest& r) const {
    const ServedModel* m = nullptr;
    return service.Prepare(r, &m);
  }
  const ServedModel& model(size_t i = 0) const { return *catalog.models()[i]; }

  ModelCatalog catalog;
  WorkerRegistry registry;
  auth::BearerAuth keys;
  GenerationService service;
};

std::unique_ptr<Served> Serve(const std::vector<fs::path>& dirs,
                              const std::vector<std::string>& chat_templates = {}) {
  absl::StatusOr<ModelCatalog> c = ModelCatalog::Load(dirs, chat_templates);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return nullptr;
  return std::make_unique<Served>(*std::move(c));
}

v1::ChatMessage* Add(v1::GenerateRequest* r, const std::string& role, const std::string& content) {
  v1::ChatMessage* m = r->add_messages();
  m->set_role(role);
  m->set_content(content);
  return m;
}

v1::GenerateRequest Chat(const std::string& user, const std::string& system = "") {
  v1::GenerateRequest r;
  if (!system.empty()) Add(&r, "system", system);
  Add(&r, "user", user);
  return r;
}

std::vector<int32_t> Ids(const v1::WorkerGenerateRequest& w) {
  return {w.prompt_token_ids().begin(), w.prompt_token_ids().end()};
}

std::vector<int32_t> Encode(const ServedModel& m, const std::string& text) {
  return m.tokenizer->Encode(text);
}

void ExpectInvalid(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
}

const jinja::Value& At(const jinja::Value& dict, const std::string& key) {
  static const jinja::Value kMissing;
  const jinja::Value* v = dict.Find(std::string_view(key));
  return v != nullptr ? *v : kMissing;
}

// ---------------------------------------------------------------------------------------
// The variables a conversation becomes.

TEST(ChatTemplateVariablesTest, MessagesCarryWhatIsSetAndDefaultsAreVllms) {
  v1::GenerateRequest r = Chat("hi", "be brief");
  v1::ChatMessage* a = Add(&r, "assistant", "");
  v1::ToolCall* call = a->add_tool_calls();
  call->set_id("call-1");
  call->mutable_function()->set_name("weather");
  call->mutable_function()->set_arguments(R"({"city": "Paris", "days": 2})");
  v1::ToolCall* raw = a->add_tool_calls();
  raw->set_type("function");
  raw->mutable_function()->set_name("echo");
  raw->mutable_function()->set_arguments("not json");
  a->set_reasoning_content("");
  v1::ChatMessage* tool = Add(&r, "tool", "sunny");
  tool->set_tool_call_id("call-1");
  tool->set_name("weather");
  absl::StatusOr<jinja::Value> vars = ChatTemplateVariables(r);
  ASSERT_TRUE(vars.ok()) << vars.status();

  const jinja::List& msgs = At(*vars, "messages").as_list();
  ASSERT_EQ(msgs.size(), 4u);
  EXPECT_EQ(At(msgs[0], "role").as_string(), "system");
  EXPECT_EQ(At(msgs[0], "content").as_string(), "be brief");
  EXPECT_TRUE(At(msgs[1], "name").is_undefined()) << "unset fields are absent";
  EXPECT_TRUE(At(msgs[1], "tool_calls").is_undefined());
  EXPECT_TRUE(At(msgs[1], "reasoning_content").is_undefined());
  const jinja::List& calls = At(msgs[2], "tool_calls").as_list();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(At(calls[0], "id").as_string(), "call-1");
  EXPECT_EQ(At(calls[0], "type").as_string(), "function") << "type defaults to function";
  const jinja::Value& args = At(At(calls[0], "function"), "arguments");
  ASSERT_TRUE(args.is_dict()) << "JSON-object arguments are a dict: " << args.Repr();
  EXPECT_EQ(At(args, "city").as_string(), "Paris");
  EXPECT_EQ(At(args, "days").as_int(), 2);
  EXPECT_TRUE(At(calls[1], "id").is_undefined());
  EXPECT_EQ(At(At(calls[1], "function"), "arguments").as_string(), "not json");
  EXPECT_TRUE(At(msgs[2], "reasoning_content").is_string()) << "set, even empty";
  EXPECT_EQ(At(msgs[3], "tool_call_id").as_string(), "call-1");
  EXPECT_EQ(At(msgs[3], "name").as_string(), "weather");

  EXPECT_TRUE(At(*vars, "tools").is_none());
  EXPECT_TRUE(At(*vars, "documents").is_none());
  EXPECT_TRUE(At(*vars, "add_generation_prompt").is_bool());
  EXPECT_TRUE(At(*vars, "add_generation_prompt").as_bool()) << "unset means true";
}

TEST(ChatTemplateVariablesTest, TextPartsAreJoinedIntoAString) {
  v1::GenerateRequest r;
  v1::ChatMessage* m = r.add_messages();
  m->set_role("user");
  for (const char* t : {"first", "second"}) {
    v1::ContentPart* p = m->add_content_parts();
    p->set_type("text");
    p->set_text(t);
  }
  absl::StatusOr<jinja::Value> vars = ChatTemplateVariables(r);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const jinja::Value& content = At(At(*vars, "messages").as_list()[0], "content");
  ASSERT_TRUE(content.is_string()) << content.Repr();
  EXPECT_EQ(content.as_string(), "first\nsecond");
}

TEST(ChatTemplateVariablesTest, ToolsDocumentsAndKwargsAreTopLevel) {
  v1::GenerateRequest r = Chat("hi");
  r.set_tools_json(R"([{"type": "function", "function": {"name": "f", "parameters": {}}}])");
  r.set_documents_json(R"([{"title": "t", "text": "body"}])");
  r.set_add_generation_prompt(true);
  r.set_chat_template_kwargs_json(R"({"enable_thinking": false, "add_generation_prompt": false,
                                      "bos_token": "<B>"})");
  absl::StatusOr<jinja::Value> vars = ChatTemplateVariables(r);
  ASSERT_TRUE(vars.ok()) << vars.status();
  ASSERT_TRUE(At(*vars, "tools").is_list());
  EXPECT_EQ(At(At(At(*vars, "tools").as_list()[0], "function"), "name").as_string(), "f");
  EXPECT_EQ(At(At(*vars, "documents").as_list()[0], "text").as_string(), "body");
  EXPECT_FALSE(At(*vars, "enable_thinking").as_bool());
  EXPECT_TRUE(At(*vars, "enable_thinking").is_bool());
  EXPECT_FALSE(At(*vars, "add_generation_prompt").as_bool()) << "kwargs are applied last";
  EXPECT_EQ(At(*vars, "bos_token").as_string(), "<B>") << "kwargs are template variables";
}

TEST(ChatTemplateVariablesTest, MalformedFieldsAreNamed) {
  struct Case {
    const char* what;
    v1::GenerateRequest request;
    std::string needle;
  };
  std::vector<Case> cases;
  {
    v1::GenerateRequest r = Chat("hi");
    Add(&r, "", "no role");
    cases.push_back({"role", r, "messages[1].role"});
  }
  {
    v1::GenerateRequest r = Chat("hi");
    r.mutable_messages(0)->add_content_parts()->set_type("text");
    cases.push_back({"both contents", r, "messages[0]: give content or content_parts"});
  }
  {
    v1::GenerateRequest r;
    v1::ChatMessage* m = r.add_messages();
    m->set_role("user");
    m->add_content_parts()->set_type("text");
    m->add_content_parts()->set_type("image_url");
    cases.push_back({"image part", r, "messages[0].content_parts[1].type: 'image_url'"});
  }
  {
    v1::GenerateRequest r = Chat("hi");
    Add(&r, "assistant", "")->add_tool_calls()->mutable_function()->set_arguments("{}");
    cases.push_back({"nameless call", r, "messages[1].tool_calls[0].function.name"});
  }
  for (const char* bad : {"[{", "{\"type\": \"function\"}", "[1]", "nope"}) {
    v1::GenerateRequest r = Chat("hi");
    r.set_tools_json(bad);
    cases.push_back({bad, r, "tools_json"});
  }
  {
    v1::GenerateRequest r = Chat("hi");
    r.set_documents_json("{}");
    cases.push_back({"documents object", r, "documents_json: must be a JSON array"});
  }
  for (const char* bad : {"[]", "{\"a\": ", "{\"messages\": []}"}) {
    v1::GenerateRequest r = Chat("hi");
    r.set_chat_template_kwargs_json(bad);
    cases.push_back({bad, r, "chat_template_kwargs_json"});
  }
  {
    v1::GenerateRequest r;
    for (int i = 0; i <= kMaxChatMessages; ++i) Add(&r, "user", "x");
    cases.push_back({"too many", r, "messages: at most 8192 messages"});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<jinja::Value> vars = ChatTemplateVariables(c.request);
    ExpectInvalid(vars.status(), c.needle);
    EXPECT_EQ(std::string(vars.status().message()).rfind(c.needle.substr(0, 5), 0), 0u)
        << "the message begins with the field: " << vars.status();
  }
}

// ---------------------------------------------------------------------------------------
// Prepare: rendering, tokens, BOS, end of turn.

TEST(PrepareChatTest, RendersTokenizesAndKeepsOneRequestPath) {
  auto s = Serve({KjvModel("plain", Config(kPlainTemplate))});
  ASSERT_TRUE(s);
  v1::GenerateRequest r = Chat("In the beginning", "Be brief.");
  r.set_n(2);
  r.mutable_sampling()->set_temperature(0);
  r.mutable_stopping()->set_max_new_tokens(7);
  absl::StatusOr<v1::WorkerGenerateRequest> w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string text =
      "<|begin_of_text|><system>Be brief.<user>In the beginning<assistant>";
  const std::vector<int32_t> ids = Ids(*w);
  EXPECT_EQ(ids, Encode(s->model(), text));
  EXPECT_EQ(ids.front(), kBos);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), kBos), 1);
  EXPECT_EQ(w->n(), 2u);
  EXPECT_EQ(w->stopping().max_new_tokens(), 7);
  EXPECT_EQ(w->sampling().temperature(), 0.f);

  absl::StatusOr<std::string> rendered = RenderChat(s->model(), r);
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_EQ(*rendered, text);

  r.set_add_generation_prompt(false);
  w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Ids(*w),
            Encode(s->model(), "<|begin_of_text|><system>Be brief.<user>In the beginning"));
}

TEST(PrepareChatTest, AddBosNeverDoublesIt) {
  auto with_bos = Serve({KjvModel("with-bos", Config(kPlainTemplate))});
  ASSERT_TRUE(with_bos);
  v1::GenerateRequest r = Chat("And God said");
  r.set_add_bos(true);
  absl::StatusOr<v1::WorkerGenerateRequest> w = with_bos->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_GE(w->prompt_token_ids_size(), 2);
  EXPECT_EQ(w->prompt_token_ids(0), kBos);
  EXPECT_NE(w->prompt_token_ids(1), kBos) << "BOS twice";

  auto without = Serve({KjvModel("without-bos", Config("{{ messages[0].content }}"))});
  ASSERT_TRUE(without);
  r.set_add_bos(false);
  w = without->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Ids(*w), Encode(without->model(), "And God said")) << "nothing added by default";
  r.set_add_bos(true);
  w = without->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  std::vector<int32_t> want = Encode(without->model(), "And God said");
  want.insert(want.begin(), kBos);
  EXPECT_EQ(Ids(*w), want);
}

TEST(PrepareChatTest, TheTemplatesEosTokenEndsTheTurn) {
  // eos_token " the": not among generation_config.json's EOS ids, so a chat request adds it.
  auto s = Serve({KjvModel("eot", Config(kPlainTemplate, "\u0120the"))});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->model().end_of_turn_token_id, kThe);
  v1::GenerateRequest r = Chat("hi");
  r.mutable_stopping()->add_stop_token_ids(7);
  absl::StatusOr<v1::WorkerGenerateRequest> w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->stopping().stop_token_ids(), ElementsAre(7, kThe));

  r.mutable_stopping()->add_stop_token_ids(kThe);  // already there: not twice
  w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->stopping().stop_token_ids(), ElementsAre(7, kThe));

  r.mutable_stopping()->clear_stop_token_ids();
  r.mutable_stopping()->set_ignore_eos(true);
  w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->stopping().stop_token_ids(), ElementsAre()) << "ignore_eos ignores it too";

  v1::GenerateRequest prompt;
  prompt.set_prompt("hi");
  w = s->Prepare(prompt);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->stopping().stop_token_ids(), ElementsAre()) << "only for chat requests";

  // The base EOS as eos_token: the workers stop there already.
  auto base = Serve({KjvModel("eos", Config(kPlainTemplate))});
  ASSERT_TRUE(base);
  EXPECT_EQ(base->model().end_of_turn_token_id, kEos);
  w = base->Prepare(Chat("hi"));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(w->stopping().stop_token_ids(), ElementsAre());
}

TEST(PrepareChatTest, ExactlyOneOfPromptIdsAndMessages) {
  auto s = Serve({KjvModel("one-of", Config(kPlainTemplate))});
  ASSERT_TRUE(s);
  v1::GenerateRequest r = Chat("hi");
  r.set_prompt("hi");
  ExpectInvalid(s->Prepare(r).status(), "messages: give one of prompt, prompt_token_ids and");
  r.clear_prompt();
  r.add_prompt_token_ids(5);
  ExpectInvalid(s->Prepare(r).status(), "messages: give one of");
  v1::GenerateRequest none;
  ExpectInvalid(s->Prepare(none).status(), "prompt: must not be empty (set prompt, ");

  v1::GenerateRequest prompt;
  prompt.set_prompt("hi");
  prompt.set_tools_json("[]");
  ExpectInvalid(s->Prepare(prompt).status(), "tools_json: only for chat requests");
  prompt.clear_tools_json();
  prompt.set_add_generation_prompt(true);
  ExpectInvalid(s->Prepare(prompt).status(), "add_generation_prompt: only for chat requests");
  prompt.clear_add_generation_prompt();
  prompt.set_chat_template_kwargs_json("{}");
  ExpectInvalid(s->Prepare(prompt).status(), "chat_template_kwargs_json: only for chat");
}

TEST(PrepareChatTest, AModelWithoutATemplateSaysHowToGiveOne) {
  auto s = Serve({KjvModel("no-template", {{"bos_token", "<|begin_of_text|>"}})});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->model().chat_template, nullptr);
  const absl::Status st = s->Prepare(Chat("hi")).status();
  ExpectInvalid(st, "messages: model 'no-template' has no chat template (");
  EXPECT_THAT(std::string(st.message()), HasSubstr("--chat-template FILE"));
  v1::GenerateRequest prompt;
  prompt.set_prompt("hi");
  EXPECT_TRUE(s->Prepare(prompt).ok()) << "prompts are served as before";
}

TEST(PrepareChatTest, ABrokenTemplateLeavesPromptsServedAndSaysWhy) {
  auto s = Serve({KjvModel("broken", Config("{% for m in messages %}{{ m.content }}"))});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->model().chat_template, nullptr);
  EXPECT_FALSE(s->model().chat_template_error.empty());
  const absl::Status st = s->Prepare(Chat("hi")).status();
  ExpectInvalid(st, "has no chat template (its template does not load: ");
  v1::GenerateRequest prompt;
  prompt.set_prompt("hi");
  EXPECT_TRUE(s->Prepare(prompt).ok());
}

TEST(PrepareChatTest, RaisedErrorsKeepTheTemplatesMessage) {
  auto s = Serve({KjvModel(
      "strict",
      Config("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start "
             "with a user message') }}{% endif %}{{ messages[0].content }}"))});
  ASSERT_TRUE(s);
  const absl::Status st = s->Prepare(Chat("hi", "system first")).status();
  ExpectInvalid(st, "Conversations must start with a user message");
  EXPECT_EQ(std::string(st.message()).rfind("messages: ", 0), 0u) << st;
  EXPECT_TRUE(s->Prepare(Chat("hi")).ok());

  auto empty = Serve({KjvModel("empty", Config("{% if false %}x{% endif %}"))});
  ASSERT_TRUE(empty);
  ExpectInvalid(empty->Prepare(Chat("hi")).status(), "rendered an empty prompt");
}

TEST(PrepareChatTest, TooLongForTheContextIsRefused) {
  auto s = Serve({KjvModel("long", Config(kPlainTemplate))});
  ASSERT_TRUE(s);
  std::string text;
  for (int i = 0; i < 400; ++i) text += " and the";
  ExpectInvalid(s->Prepare(Chat(text)).status(), "context window");
}

// ---------------------------------------------------------------------------------------
// --chat-template.

TEST(ChatTemplateFlagTest, ABareJinjaKeepsTheModelsSpecialTokens) {
  const fs::path dir = KjvModel("override", Config("{{ 'own' }}", "\u0120the"));
  const fs::path jinja = TempDir("override-files") / "chat.jinja";
  WriteFile(jinja, "{{ bos_token }}[{{ messages[0].content }}]{{ eos_token }}");
  auto s = Serve({dir}, {jinja.string()});
  ASSERT_TRUE(s);
  absl::StatusOr<std::string> text = RenderChat(s->model(), Chat("x"));
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "<|begin_of_text|>[x]\u0120the");
  EXPECT_EQ(s->model().end_of_turn_token_id, kThe);
  absl::StatusOr<v1::WorkerGenerateRequest> w = s->Prepare(Chat("x"));
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_GT(w->prompt_token_ids_size(), 0);
  EXPECT_EQ(w->prompt_token_ids(0), kBos);
}

TEST(ChatTemplateFlagTest, ABareJinjaForAModelWithoutATemplateReadsItsTokenizerConfig) {
  const fs::path dir = KjvModel("base", {{"bos_token", {{"content", "<|begin_of_text|>"}}},
                                         {"eos_token", "\u0120the"}});
  const fs::path jinja = TempDir("base-files") / "chat.jinja";
  WriteFile(jinja, "{{ bos_token }}{{ messages[0].content }}");
  auto s = Serve({dir}, {jinja.string()});
  ASSERT_TRUE(s);
  ASSERT_NE(s->model().chat_template, nullptr);
  absl::StatusOr<std::string> text = RenderChat(s->model(), Chat("x"));
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "<|begin_of_text|>x");
  EXPECT_EQ(s->model().end_of_turn_token_id, kThe);
}

TEST(ChatTemplateFlagTest, ATokenizerConfigBringsItsOwnTokens) {
  const fs::path dir = KjvModel("json-override", Config(kPlainTemplate));
  const fs::path file = TempDir("json-files") / "tokenizer_config.json";
  WriteFile(file, Config("{{ eos_token }}{{ messages[0].content }}", "\u0120and").dump());
  auto s = Serve({dir}, {file.string()});
  ASSERT_TRUE(s);
  absl::StatusOr<std::string> text = RenderChat(s->model(), Chat("x"));
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "\u0120andx");
  EXPECT_EQ(s->model().end_of_turn_token_id, 267);  // "Ġand"
}

TEST(ChatTemplateFlagTest, SeveralModelsNeedNames) {
  const fs::path a = KjvModel("model-a", Config(kPlainTemplate));
  const fs::path b = KjvModel("model-b", {{"bos_token", "<|begin_of_text|>"}});
  const fs::path jinja = TempDir("several") / "chat.jinja";
  WriteFile(jinja, "B:{{ messages[0].content }}");

  absl::StatusOr<ModelCatalog> bare = ModelCatalog::Load({a, b}, {jinja.string()});
  ExpectInvalid(bare.status(), "--chat-template: '");
  EXPECT_THAT(std::string(bare.status().message()), HasSubstr("NAME=FILE"));
  ExpectInvalid(ModelCatalog::Load({a, b}, {"model-c=" + jinja.string()}).status(),
                "--chat-template: 'model-c' is not a model served here (served: model-a, "
                "model-b)");
  ExpectInvalid(
      ModelCatalog::Load({a, b}, {"model-b=" + jinja.string(), "model-b=" + jinja.string()})
          .status(),
      "--chat-template: two templates for model 'model-b'");
  EXPECT_EQ(ModelCatalog::Load({a}, {(jinja.parent_path() / "missing.jinja").string()})
                .status()
                .message()
                .substr(0, 16),
            "--chat-template:");

  auto s = Serve({a, b}, {"model-b=" + jinja.string()});
  ASSERT_TRUE(s);
  v1::GenerateRequest r = Chat("x");
  r.set_model("model-b");
  absl::StatusOr<std::string> text = RenderChat(s->model(1), r);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "B:x");
  text = RenderChat(s->model(0), r);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "<|begin_of_text|><user>x<assistant>") << "model-a keeps its own";
}

// ---------------------------------------------------------------------------------------
// Real templates on the generated fixtures (Llama 3's and Qwen3's tokenizer_config.json).

TEST(RealTemplatesTest, Llama3RendersOneBos) {
  auto s = Serve({FixturesDir() / "llama3-tiny"});
  ASSERT_TRUE(s);
  ASSERT_NE(s->model().chat_template, nullptr);
  v1::GenerateRequest r = Chat("Hello!", "You are terse.");
  r.set_add_bos(true);
  absl::StatusOr<v1::WorkerGenerateRequest> w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string text =
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n";
  const std::vector<int32_t> ids = Ids(*w);
  EXPECT_EQ(ids, Encode(s->model(), text));
  EXPECT_EQ(ids.front(), 128000);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 128000), 1);
  // <|end_of_text|> is the fixture's eos_token and already an EOS id.
  EXPECT_EQ(s->model().end_of_turn_token_id, 128001);
  EXPECT_THAT(w->stopping().stop_token_ids(), ElementsAre());
}

TEST(RealTemplatesTest, QwenToolsArgumentsAndThinking) {
  auto s = Serve({FixturesDir() / "qwen2-tiny"});
  ASSERT_TRUE(s);
  ASSERT_NE(s->model().chat_template, nullptr);
  EXPECT_EQ(s->model().end_of_turn_token_id, 151645);  // <|im_end|>
  v1::GenerateRequest r = Chat("Weather in Paris?", "You help.");
  r.set_tools_json(
      R"([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])");
  v1::ChatMessage* a = Add(&r, "assistant", "");
  v1::ToolCall* call = a->add_tool_calls();
  call->mutable_function()->set_name("get_weather");
  call->mutable_function()->set_arguments(R"({"city":"Paris"})");
  Add(&r, "tool", "sunny")->set_tool_call_id("c1");
  r.set_chat_template_kwargs_json(R"({"enable_thinking": false})");
  absl::StatusOr<std::string> text = RenderChat(s->model(), r);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("<|im_start|>system\nYou help.\n\n# Tools"));
  EXPECT_THAT(*text, HasSubstr(R"({"type": "function", "function": {"name": "get_weather")"));
  // The arguments were a dict, written back by tojson (with json.dumps' spaces).
  EXPECT_THAT(*text,
              HasSubstr(R"(<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>)"));
  EXPECT_THAT(*text, HasSubstr("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"));
  EXPECT_TRUE(text->ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n")) << *text;

  r.clear_chat_template_kwargs_json();
  text = RenderChat(s->model(), r);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_TRUE(text->ends_with("<|im_start|>assistant\n")) << *text;
  EXPECT_THAT(*text, Not(HasSubstr("<think>")));

  absl::StatusOr<v1::WorkerGenerateRequest> w = s->Prepare(r);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<int32_t> ids = Ids(*w);
  EXPECT_EQ(ids, Encode(s->model(), *text));
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151644), 5) << "<|im_start|> as one token";
}

}  // namespace
}  // namespace kvgrid::coordinator
