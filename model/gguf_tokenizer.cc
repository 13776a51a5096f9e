#include "model/gguf_tokenizer.h"

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "model/json_util.h"
#include "model/model_dir.h"
#include "model/status_macros.h"
#include "model/utf8.h"
#include "nlohmann/json.hpp"

namespace kvgrid::model {
namespace {

using Json = nlohmann::json;

constexpr char kModelKey[] = "tokenizer.ggml.model";
constexpr char kPreKey[] = "tokenizer.ggml.pre";
constexpr char kTokensKey[] = "tokenizer.ggml.tokens";
constexpr char kTypesKey[] = "tokenizer.ggml.token_type";
constexpr char kMergesKey[] = "tokenizer.ggml.merges";
constexpr char kBosKey[] = "tokenizer.ggml.bos_token_id";
constexpr char kEosKey[] = "tokenizer.ggml.eos_token_id";
constexpr char kAddBosKey[] = "tokenizer.ggml.add_bos_token";
constexpr char kAddEosKey[] = "tokenizer.ggml.add_eos_token";
constexpr char kScoresKey[] = "tokenizer.ggml.scores";
constexpr char kUnkKey[] = "tokenizer.ggml.unknown_token_id";
constexpr char kAddSpacePrefixKey[] = "tokenizer.ggml.add_space_prefix";

// Token ids are bounded as in tokenizer.json (the tables are sized by the largest id).
constexpr size_t kMaxTokens = size_t{1} << 24;

// llama.cpp's token types (llama_token_type), the values of tokenizer.ggml.token_type.
enum TokenType : int64_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// The split patterns of the Llama 3 and Qwen2 tokenizer.json files, as their publishers wrote
// them (llama.cpp keeps the same patterns under these pre-tokenizer names, rewritten for its
// own regex engine; PCRE2 takes the originals).
constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// What a tokenizer.ggml.pre name stands for, in tokenizer.json terms.
struct PreTokenizerSpec {
  Json pre_tokenizer;
  bool nfc = false;
  // llama.cpp emits a whole pre-token that is itself in the vocabulary without merging it
  // (tokenizer.json's ignore_merges) for the Llama 3 names; Meta's files say the same.
  bool ignore_merges = false;
  bool add_bos_default = false;
};

Json SplitThenByteLevel(const char* pattern) {
  return Json{
      {"type", "Sequence"},
      {"pretokenizers",
       Json::array({Json{{"type", "Split"},
                         {"pattern", Json{{"Regex", pattern}}},
                         {"behavior", "Isolated"},
                         {"invert", false}},
                    Json{{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", true},
                         {"use_regex", false}}})}};
}

absl::StatusOr<PreTokenizerSpec> PreTokenizerFor(const std::string& pre, const std::string& path) {
  PreTokenizerSpec spec;
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3") {
    spec.pre_tokenizer = SplitThenByteLevel(kLlama3Pattern);
    spec.ignore_merges = true;
    spec.add_bos_default = true;
  } else if (pre == "qwen2") {
    // Qwen2's tokenizer.json composes (NFC) before splitting; ids follow that file.
    spec.pre_tokenizer = SplitThenByteLevel(kQwen2Pattern);
    spec.nfc = true;
  } else if (pre == "gpt-2" || pre == "default") {
    // GPT-2's own split, which the ByteLevel step applies itself.
    spec.pre_tokenizer = Json{
        {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
        {"use_regex", true}};
  } else {
    return absl::UnimplementedError(absl::StrCat(
        path, ": ", kPreKey, " '", pre,
        "' is not supported (kvgrid knows llama-bpe, llama3, llama-v3, qwen2, gpt-2, default)"));
  }
  return spec;
}

// A token for an error message: quoted, cut short when long.
std::string Quote(std::string_view token) {
  return absl::StrCat("'", Sv(token.substr(0, 64)), token.size() > 64 ? "...'" : "'");
}

// An optional metadata value: nullopt when the key is absent, the lookup's error when the
// value has the wrong type.
template <typename T>
absl::StatusOr<std::optional<T>> Optional(absl::StatusOr<T> value) {
  if (value.ok()) return std::optional<T>(*std::move(value));
  if (absl::IsNotFound(value.status())) return std::optional<T>();
  return value.status();
}

// A special token id from `key` that the post-processor will add: it must name a token.
absl::StatusOr<int64_t> SpecialId(const GgufFile& f, const char* key, const char* flag_key,
                                  const GgufStringArray& tokens,
                                  const GgufNumberArray* types) {
  const std::string path = f.path().string();
  KVGRID_ASSIGN_OR_RETURN(std::optional<int64_t> id, Optional(f.GetInt(key)));
  if (!id) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", flag_key, " is true but ", key, " is not set"));
  }
  if (*id < 0 || static_cast<uint64_t>(*id) >= tokens.size() ||
      (types != nullptr && types->Int(static_cast<size_t>(*id)) == kUnused)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " ", *id,
                                                   " is not a token of ", kTokensKey, " (",
                                                   tokens.size(), " entries)"));
  }
  return *id;
}

// A SentencePiece vocabulary (tokenizer.ggml.model "llama"), tokenized as llama.cpp does.
// Its defaults when a key is missing: BOS 1, EOS 2, unk 0, add_bos true, add_eos false,
// add_space_prefix true, every score 0, every type normal.
absl::StatusOr<std::unique_ptr<Tokenizer>> SentencePieceFromGguf(const GgufFile& f) {
  const std::string path = f.path().string();
  const auto invalid = [&path](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", parts...));
  };
  Tokenizer::SentencePieceVocab v;
  KVGRID_ASSIGN_OR_RETURN(const GgufStringArray* tokens, f.GetStringArray(kTokensKey));
  if (tokens->empty()) return invalid(kTokensKey, " is empty");
  if (tokens->size() > kMaxTokens) {
    return invalid(kTokensKey, " has ", tokens->size(), " entries, more than ", kMaxTokens);
  }
  for (size_t i = 0; i < tokens->size(); ++i) {
    if (!IsValidUtf8((*tokens)[i])) return invalid(kTokensKey, "[", i, "] is not valid UTF-8");
  }
  v.tokens = tokens->ToVector();
  const size_t n = tokens->size();

  v.scores.assign(n, 0.0f);
  if (f.metadata().contains(kScoresKey)) {
    KVGRID_ASSIGN_OR_RETURN(const GgufNumberArray* scores, f.GetNumberArray(kScoresKey));
    if (scores->size() != n) {
      return invalid(kScoresKey, " has ", scores->size(), " entries but ", kTokensKey, " has ", n);
    }
    for (size_t i = 0; i < n; ++i) v.scores[i] = static_cast<float>(scores->Float(i));
  }
  KVGRID_ASSIGN_OR_RETURN(const std::optional<const GgufNumberArray*> types,
                          Optional(f.GetIntArray(kTypesKey)));
  v.types.assign(n, kNormal);
  if (types) {
    if ((*types)->size() != n) {
      return invalid(kTypesKey, " has ", (*types)->size(), " entries but ", kTokensKey, " has ",
                     n);
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t type = (*types)->Int(i);
      if (type < kUndefined || type > kByte) {
        return invalid(kTypesKey, "[", i, "]: ", type, " is not a llama.cpp token type (0 to 6)");
      }
      v.types[i] = static_cast<int32_t>(type);
    }
  }
  KVGRID_ASSIGN_OR_RETURN(const std::optional<bool> add_space_prefix,
                          Optional(f.GetBool(kAddSpacePrefixKey)));
  v.add_space_prefix = add_space_prefix.value_or(true);

  // A special id names a token of the list; an id the file sets to -1 (or omits for unk
  // beyond the list) means none.
  const auto special_id = [&](const char* key, int64_t fallback,
                              bool required) -> absl::StatusOr<std::optional<int32_t>> {
    KVGRID_ASSIGN_OR_RETURN(const std::optional<int64_t> id, Optional(f.GetInt(key)));
    const int64_t value = id.value_or(fallback);
    if (value >= 0 && static_cast<uint64_t>(value) < n) return static_cast<int32_t>(value);
    if (!required) return std::optional<int32_t>();
    return invalid(key, " ", value, " is not a token of ", kTokensKey, " (", n, " entries)");
  };
  KVGRID_ASSIGN_OR_RETURN(const std::optional<bool> add_bos, Optional(f.GetBool(kAddBosKey)));
  KVGRID_ASSIGN_OR_RETURN(const std::optional<bool> add_eos, Optional(f.GetBool(kAddEosKey)));
  if (add_bos.value_or(true)) {
    KVGRID_ASSIGN_OR_RETURN(v.bos_id, special_id(kBosKey, 1, /*required=*/true));
  }
  if (add_eos.value_or(false)) {
    KVGRID_ASSIGN_OR_RETURN(v.eos_id, special_id(kEosKey, 2, /*required=*/true));
  }
  KVGRID_ASSIGN_OR_RETURN(v.unk_id, special_id(kUnkKey, 0, /*required=*/false));
  // llama.cpp gives Phi-3's matched tokens (by general.name) the RSTRIP attribute, as the
  // tokenizer.json of those models marks them rstrip: all but <unk>, <s> and <|endoftext|>.
  KVGRID_ASSIGN_OR_RETURN(const std::optional<std::string> name,
                          Optional(f.GetString("general.name")));
  const std::string lower = absl::AsciiStrToLower(name.value_or(""));
  if (absl::StrContains(lower, "phi-3") || absl::StrContains(lower, "phi3")) {
    for (size_t i = 0; i < n; ++i) {
      const int32_t type = v.types[i];
      const std::string& token = v.tokens[i];
      const bool matched = type == kControl || type == kUserDefined || type == kUnknown;
      if ((matched || token == "</s>") && token != "<unk>" && token != "<s>" &&
          token != "<|endoftext|>") {
        v.rstrip_ids.push_back(static_cast<int32_t>(i));
      }
    }
  }
  return Tokenizer::FromSentencePiece(v, absl::StrCat(path, " (embedded tokenizer)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufFile& f) {
  const std::string path = f.path().string();
  const auto invalid = [&path](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", parts...));
  };

  KVGRID_ASSIGN_OR_RETURN(const std::string model, f.GetString(kModelKey));
  if (model == "llama") return SentencePieceFromGguf(f);
  if (model != "gpt2") {
    return absl::UnimplementedError(absl::StrCat(
        path, ": ", kModelKey, " '", model,
        "' is not supported (kvgrid reads byte-level BPE 'gpt2' and SentencePiece 'llama')"));
  }
  // llama.cpp reads a missing pre-tokenizer name as "default" (files from before the key).
  KVGRID_ASSIGN_OR_RETURN(const std::optional<std::string> pre,
                          Optional(f.GetString(kPreKey)));
  KVGRID_ASSIGN_OR_RETURN(const PreTokenizerSpec spec,
                          PreTokenizerFor(pre.value_or("default"), path));

  KVGRID_ASSIGN_OR_RETURN(const GgufStringArray* tokens, f.GetStringArray(kTokensKey));
  if (tokens->empty()) return invalid(kTokensKey, " is empty");
  if (tokens->size() > kMaxTokens) {
    return invalid(kTokensKey, " has ", tokens->size(), " entries, more than ", kMaxTokens);
  }
  // Without types every token is normal, as llama.cpp reads such files.
  KVGRID_ASSIGN_OR_RETURN(const std::optional<const GgufNumberArray*> types_or,
                          Optional(f.GetIntArray(kTypesKey)));
  const GgufNumberArray* types = types_or.value_or(nullptr);
  if (types != nullptr && types->size() != tokens->size()) {
    return invalid(kTypesKey, " has ", types->size(), " entries but ", kTokensKey, " has ",
                   tokens->size());
  }
  KVGRID_ASSIGN_OR_RETURN(const GgufStringArray* merges, f.GetStringArray(kMergesKey));

  Json vocab = Json::object();
  Json added = Json::array();
  absl::flat_hash_map<std::string_view, size_t> first_index;
  first_index.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const std::string_view token = (*tokens)[i];
    const int64_t type = types != nullptr ? types->Int(i) : kNormal;
    if (!IsValidUtf8(token)) return invalid(kTokensKey, "[", i, "] is not valid UTF-8");
    switch (type) {
      case kUndefined:
      case kNormal:
      case kUnknown:
      case kByte:
        if (auto [it, inserted] = first_index.emplace(token, i); !inserted) {
          return invalid(kTokensKey, "[", i, "] ", Quote(token), " repeats ", kTokensKey, "[",
                         it->second, "]");
        }
        vocab[std::string(token)] = i;
        break;
      case kControl:
      case kUserDefined:
        if (token.empty()) return invalid(kTokensKey, "[", i, "] is an empty added token");
        // GGUF keeps no per-token normalize/strip flags; llama.cpp matches added tokens on
        // the raw text, which is what normalized=false says.
        added.push_back(Json{{"id", i},
                             {"content", std::string(token)},
                             {"special", type == kControl},
                             {"normalized", false},
                             {"lstrip", false},
                             {"rstrip", false},
                             {"single_word", false}});
        break;
      case kUnused:
        break;  // padding rows of the embedding: an id with no text
      default:
        return invalid(kTypesKey, "[", i, "]: ", type,
                       " is not a llama.cpp token type (0 to 6)");
    }
  }
  for (size_t i = 0; i < merges->size(); ++i) {
    if (!IsValidUtf8((*merges)[i])) return invalid(kMergesKey, "[", i, "] is not valid UTF-8");
  }

  KVGRID_ASSIGN_OR_RETURN(const std::optional<bool> add_bos_flag,
                          Optional(f.GetBool(kAddBosKey)));
  KVGRID_ASSIGN_OR_RETURN(const std::optional<bool> add_eos_flag,
                          Optional(f.GetBool(kAddEosKey)));
  Json single = Json::array();
  Json special_tokens = Json::object();
  const auto add_special = [&](const char* name, int64_t id) {
    single.push_back(Json{{"SpecialToken", Json{{"id", name}, {"type_id", 0}}}});
    special_tokens[name] =
        Json{{"id", name}, {"ids", Json::array({id})}, {"tokens", Json::array({std::string((*tokens)[id])})}};
  };
  bool add_bos = add_bos_flag.value_or(false);
  if (!add_bos_flag && spec.add_bos_default) {
    // The default applies only when there is a BOS to add; an explicit true without one is
    // an error below.
    KVGRID_ASSIGN_OR_RETURN(const std::optional<int64_t> bos, Optional(f.GetInt(kBosKey)));
    add_bos = bos.has_value();
  }
  if (add_bos) {
    KVGRID_ASSIGN_OR_RETURN(const int64_t bos, SpecialId(f, kBosKey, kAddBosKey, *tokens, types));
    add_special("bos", bos);
  }
  single.push_back(Json{{"Sequence", Json{{"id", "A"}, {"type_id", 0}}}});
  if (add_eos_flag.value_or(false)) {
    KVGRID_ASSIGN_OR_RETURN(const int64_t eos, SpecialId(f, kEosKey, kAddEosKey, *tokens, types));
    add_special("eos", eos);
  }

  Json root = {
      {"version", "1.0"},
      {"added_tokens", std::move(added)},
      {"normalizer", spec.nfc ? Json{{"type", "NFC"}} : Json()},
      {"pre_tokenizer", spec.pre_tokenizer},
      {"post_processor", special_tokens.empty()
                             ? Json()
                             : Json{{"type", "TemplateProcessing"},
                                    {"single", std::move(single)},
                                    {"special_tokens", std::move(special_tokens)}}},
      {"decoder", Json{{"type", "ByteLevel"}}},
      {"model", Json{{"type", "BPE"},
                     {"vocab", std::move(vocab)},
                     {"merges", merges->ToVector()},
                     {"ignore_merges", spec.ignore_merges}}},
  };
  const std::string source = absl::StrCat(path, " (embedded tokenizer)");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromJson(root.dump(), source);
  if (!tokenizer.ok()) {
    // What can still fail here is a merge; say it in the file's own keys.
    return absl::Status(tokenizer.status().code(),
                        absl::StrReplaceAll(tokenizer.status().message(),
                                            {{"model.merges[", "tokenizer.ggml.merges["},
                                             {"model.vocab", kTokensKey}}));
  }
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadModelTokenizer(
    const std::filesystem::path& model_path) {
  std::error_code ec;
  if (std::filesystem::is_directory(model_path, ec)) {
    if (!std::filesystem::exists(model_path / "tokenizer.json", ec)) return nullptr;
    KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(model_path, model_path / "tokenizer.json"));
    return Tokenizer::FromFile(model_path / "tokenizer.json");
  }
  const std::filesystem::path beside = model_path.parent_path() / "tokenizer.json";
  if (std::filesystem::exists(beside, ec)) {
    KVGRID_RETURN_IF_ERROR(CheckInsideModelDir(model_path.parent_path(), beside));
    return Tokenizer::FromFile(beside);
  }
  if (model_path.extension() != ".gguf") return nullptr;
  KVGRID_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(model_path));
  // A GGUF written without tokenizer metadata is like a directory without tokenizer.json.
  if (!file->metadata().contains(kModelKey)) return nullptr;
  return TokenizerFromGguf(*file);
}

}  // namespace kvgrid::model
