// kvgrid tokenize: JSON lines through a tokenizer.json (or the tokenizer a .gguf file embeds),
// for scripts and reference checks.
//
//   encode (default): each stdin line is a JSON string; prints a JSON array of ids.
//   --decode:         each stdin line is a JSON array of ids; prints a JSON string.
//   --decode --stream: the same ids through IncrementalDetokenizer; prints the JSON array of
//                     its deltas, one per id, then what Finish flushed.
//
// One output line per input line, in order, so a caller can batch many inputs into one
// process. The first bad line stops the run with exit 1 (lines before it are printed).
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/gguf.h"
#include "model/gguf_tokenizer.h"
#include "model/json_util.h"
#include "model/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tools/kvgrid/commands.h"

namespace kvgrid::cli {
namespace {

constexpr char kHelp[] =
    "usage: kvgrid tokenize --tokenizer FILE [--decode [--stream]] [--add-special-tokens]\n"
    "                       [--skip-special-tokens]\n"
    "\n"
    "FILE is a tokenizer.json, a model directory holding one, or a .gguf file whose\n"
    "embedded tokenizer is used.\n"
    "Reads JSON lines from stdin and writes one JSON line per input to stdout.\n"
    "  encode (default)       input: a JSON string; output: a JSON array of token ids\n"
    "  --decode               input: a JSON array of ids; output: the text as a JSON string\n"
    "  --add-special-tokens   encode: add what the post-processor adds (e.g. BOS)\n"
    "  --skip-special-tokens  decode: drop special tokens from the text\n"
    "  --stream               decode: print the streaming detokenizer's deltas as a JSON array\n"
    "                         (one per id, then the final flush)\n";

int Fail(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "kvgrid tokenize: %s\n", message.c_str());
  return 1;
}

}  // namespace

int TokenizeCommand(Args& args) {
  if (args.Has("help")) {
    std::fputs(kHelp, stdout);
    return 0;
  }
  const std::optional<std::string> path = args.GetString("tokenizer");
  auto decode = args.GetBool("decode", false);
  auto add_special = args.GetBool("add-special-tokens", false);
  auto skip_special = args.GetBool("skip-special-tokens", false);
  auto stream = args.GetBool("stream", false);
  for (const absl::Status& s : {decode.status(), add_special.status(), skip_special.status(),
                                stream.status(), args.Finish()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "kvgrid tokenize: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  if (!path.has_value()) {
    std::fprintf(stderr, "kvgrid tokenize: --tokenizer FILE is required\n\n%s", kHelp);
    return 2;
  }

  absl::StatusOr<std::unique_ptr<model::Tokenizer>> tokenizer;
  if (std::filesystem::path(*path).extension() == ".gguf") {
    absl::StatusOr<std::unique_ptr<model::GgufFile>> gguf = model::GgufFile::Open(*path);
    tokenizer = gguf.ok() ? model::TokenizerFromGguf(**gguf) : gguf.status();
  } else if (std::error_code ec; std::filesystem::is_directory(*path, ec)) {
    // A model directory, as Hugging Face lays it out: its tokenizer.json.
    tokenizer = model::Tokenizer::FromFile(std::filesystem::path(*path) / "tokenizer.json");
  } else {
    tokenizer = model::Tokenizer::FromFile(*path);
  }
  if (!tokenizer.ok()) return Fail(std::string(tokenizer.status().message()));

  // Only iostreams read stdin here; unsyncing them from stdio makes getline several times
  // faster on large batches.
  std::ios::sync_with_stdio(false);
  std::string line;
  std::string out;
  for (int64_t number = 1; std::getline(std::cin, line); ++number) {
    const std::string where = absl::StrCat("stdin line ", number, ": ");
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!model::CheckJsonDepth(line, "stdin", 4).ok())
      return Fail(where + "JSON nested too deeply");
    nlohmann::json input = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (input.is_discarded()) return Fail(where + "not valid JSON");
    if (!*decode) {
      if (!input.is_string()) return Fail(where + "expected a JSON string");
      const std::vector<int32_t> ids =
          (*tokenizer)->Encode(input.get_ref<const std::string&>(), *add_special);
      out = nlohmann::json(ids).dump();
    } else {
      if (!input.is_array()) return Fail(where + "expected a JSON array of token ids");
      std::vector<int32_t> ids;
      ids.reserve(input.size());
      for (const nlohmann::json& id : input) {
        if (!id.is_number_integer() || id.get<int64_t>() < INT32_MIN ||
            id.get<int64_t>() > INT32_MAX) {
          return Fail(where + "expected integer token ids, got " + id.dump());
        }
        ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
      }
      if (*stream) {
        model::IncrementalDetokenizer detok(tokenizer->get(), *skip_special);
        nlohmann::json deltas = nlohmann::json::array();
        for (const int32_t id : ids) {
          auto delta = detok.Push(id);
          if (!delta.ok()) return Fail(where + std::string(delta.status().message()));
          deltas.push_back(*std::move(delta));
        }
        deltas.push_back(detok.Finish());
        // Deltas are valid UTF-8 (whole characters or U+FFFD), so dump() cannot throw.
        out = deltas.dump();
      } else {
        auto text = (*tokenizer)->Decode(ids, *skip_special);
        if (!text.ok()) return Fail(where + std::string(text.status().message()));
        // Decode returns valid UTF-8, so dump() cannot throw; non-ASCII stays as UTF-8.
        out = nlohmann::json(*text).dump();
      }
    }
    out.push_back('\n');
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace kvgrid::cli
