// chat_template_bench: time to render a chat template for a realistic chat request, the
// coordinator's work before tokenizing. The default case is Qwen3's template (tools and
// thinking) over a 20-turn conversation with a system prompt, 4 tools, and assistant turns
// with <think> blocks and tool calls: the heaviest template in tests/data.
//
//   build/bin/chat_template_bench [--json] [--turns 20] [--iterations 2000]
//                                 [--template FILE] (a tokenizer_config.json or .jinja)
//
// Prints the median, p90 and minimum of per-render times (µs), the rendered size, and the
// median time to turn the request's JSON into template values (not part of the render).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/chat_template.h"
#include "model/jinja/value.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
namespace jinja = kvgrid::model::jinja;

nlohmann::ordered_json Tool(const std::string& name, const std::string& description) {
  return {{"type", "function"},
          {"function",
           {{"name", name},
            {"description", description},
            {"parameters",
             {{"type", "object"},
              {"properties",
               {{"query", {{"type", "string"}, {"description", "What to look up, in full."}}},
                {"limit", {{"type", "integer"}, {"minimum", 1}, {"maximum", 50}}},
                {"strict", {{"type", "boolean"}, {"default", false}}}}},
              {"required", {"query"}}}}}}};
}

// A conversation of `turns` user turns: answers with reasoning, every third turn a tool call
// and its result.
nlohmann::ordered_json Conversation(int turns) {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  messages.push_back({{"role", "system"},
                      {"content", "You are a careful assistant. Answer briefly, cite sources, "
                                  "and call a tool when a fact needs checking."}});
  for (int i = 0; i < turns; ++i) {
    messages.push_back({{"role", "user"},
                        {"content", "Question " + std::to_string(i) +
                                        ": what changed in the report since the last draft, "
                                        "and which section needs the most work?"}});
    if (i % 3 == 2) {
      messages.push_back(
          {{"role", "assistant"},
           {"content", ""},
           {"tool_calls",
            {{{"type", "function"},
              {"function",
               {{"name", "search_documents"},
                {"arguments", {{"query", "report draft section " + std::to_string(i)},
                               {"limit", 5}}}}}}}}});
      messages.push_back({{"role", "tool"},
                          {"content", "{\"results\": [\"section 2 rewritten\", \"figures "
                                      "updated\", \"appendix unchanged\"]}"}});
    }
    messages.push_back(
        {{"role", "assistant"},
         {"content", "<think>\nThe user wants the differences; list them, then judge.\n</think>\n\n"
                     "Section 2 was rewritten and the figures were updated; section 4 needs the "
                     "most work, since its argument no longer matches the new data."}});
  }
  messages.push_back({{"role", "user"}, {"content", "Thanks. Summarize in one line."}});
  return messages;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  int turns = 20;
  int iterations = 2000;
  std::string file = std::string(KVGRID_SOURCE_DIR) +
                     "/tests/data/chat_templates/templates/qwen3_tokenizer_config.json";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) {
      json = true;
    } else if (!std::strcmp(argv[i], "--turns") && i + 1 < argc) {
      turns = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--iterations") && i + 1 < argc) {
      iterations = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--template") && i + 1 < argc) {
      file = argv[++i];
    } else {
      std::fprintf(stderr, "usage: chat_template_bench [--json] [--turns N] [--iterations N] "
                           "[--template FILE]\n");
      return 2;
    }
  }
  auto tmpl = kvgrid::model::ChatTemplate::FromFile(file);
  if (!tmpl.ok()) {
    std::fprintf(stderr, "chat_template_bench: %s\n", std::string(tmpl.status().message()).c_str());
    return 1;
  }
  nlohmann::ordered_json request = {
      {"messages", Conversation(turns)},
      {"tools",
       {Tool("search_documents", "Search the user's documents."),
        Tool("get_weather", "Current weather for a city."),
        Tool("run_sql", "Run a read-only SQL query on the reports database."),
        Tool("send_email", "Send an email on the user's behalf.")}},
      {"add_generation_prompt", true}};
  // The render alone (what the target is about), and separately the conversion of the
  // request's JSON into template values, which a chat request also costs the coordinator.
  const std::string wire = request.dump();
  std::vector<double> us, json_us;
  us.reserve(static_cast<size_t>(iterations));
  size_t bytes = 0;
  for (int i = 0; i < iterations + 50; ++i) {
    const auto t0 = Clock::now();
    auto vars = jinja::Value::FromJson(wire, "request");
    if (!vars.ok()) return 1;
    const auto t1 = Clock::now();
    auto text = (*tmpl)->Render(*vars);
    const auto t2 = Clock::now();
    if (!text.ok()) {
      std::fprintf(stderr, "chat_template_bench: %s\n", std::string(text.status().message()).c_str());
      return 1;
    }
    bytes = text->size();
    if (i >= 50) {
      json_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    }
  }
  std::sort(us.begin(), us.end());
  std::sort(json_us.begin(), json_us.end());
  const double median = us[us.size() / 2];
  const double p90 = us[us.size() * 9 / 10];
  const double best = us.front();
  const double json_median = json_us[json_us.size() / 2];
  const int messages = static_cast<int>(request["messages"].size());
  if (json) {
    nlohmann::ordered_json out = {{"bench", "chat_template"},
                                  {"template", file.substr(file.find_last_of('/') + 1)},
                                  {"turns", turns},
                                  {"messages", messages},
                                  {"tools", 4},
                                  {"iterations", iterations},
                                  {"rendered_bytes", bytes},
                                  {"render_us_median", median},
                                  {"render_us_p90", p90},
                                  {"render_us_min", best},
                                  {"json_to_values_us_median", json_median}};
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("%s: %d turns (%d messages, 4 tools) -> %zu bytes: render median %.1f us, p90 "
                "%.1f us, min %.1f us over %d renders; request JSON to values %.1f us\n",
                file.c_str(), turns, messages, bytes, median, p90, best, iterations, json_median);
  }
  return 0;
}
