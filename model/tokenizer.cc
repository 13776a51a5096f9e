#include "model/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <utility>

#include "model/jinja/unicode.h"
#include "model/json_util.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "unicode/normalizer2.h"
#include "unicode/unistr.h"

namespace kvgrid::model {
namespace {

using Json = nlohmann::json;

// This abseil build has its own string_view type; the public API speaks std::string_view.

// ---------------------------------------------------------------------------------------
// UTF-8.

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD

struct Utf8Scan {
  size_t len;      // bytes of the character, or of the maximal ill-formed subpart
  bool valid;      // a complete, well-formed character
  bool truncated;  // ill-formed only because the input ended: more bytes could complete it
};

// Classifies the bytes at s[i]. Ill-formed input is measured in "maximal subparts" (Unicode
// ch. 3, U+FFFD substitution), the same policy as Rust's from_utf8_lossy, so that our
// replacement characters line up with the reference implementation's.
Utf8Scan ScanUtf8(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return {1, true, false};
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {1, false, false};
  }
  size_t k = 1;
  for (; k < need; ++k) {
    if (i + k >= s.size()) return {k, false, true};
    const auto b = static_cast<uint8_t>(s[i + k]);
    const uint8_t l = k == 1 ? lo : 0x80;
    const uint8_t h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {k, false, false};
  }
  return {need, true, false};
}

// Replaces every ill-formed subpart of `bytes` with U+FFFD.
std::string ToValidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const Utf8Scan scan = ScanUtf8(bytes, i);
    if (scan.valid) {
      out.append(bytes.substr(i, scan.len));
    } else {
      out.append(kReplacement);
    }
    i += scan.len;
  }
  return out;
}

// Decodes a well-formed character of `len` bytes at s[i].
char32_t DecodeUtf8(std::string_view s, size_t i, size_t len) {
  const auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<uint8_t>(s[i + k])); };
  switch (len) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

// Unicode White_Space, for lstrip/rstrip of added tokens.
bool IsWhiteSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Canonical composition (NFC) of `in` appended to `out`. Ill-formed bytes pass through
// unchanged and block composition across them. Defined at the end of this file.
void NormalizeNfc(std::string_view in, std::string* out);

// ---------------------------------------------------------------------------------------
// Byte-level alphabet: every byte gets a printable character so that BPE vocabularies can
// be written as text. Printable Latin-1 bytes stand for themselves; the other 68 bytes take
// U+0100 upwards, in byte order.

struct ByteAlphabet {
  std::array<char32_t, 256> byte_to_char;
  std::array<int16_t, 324> char_to_byte;  // -1: not in the alphabet

  ByteAlphabet() {
    char_to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      byte_to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
    }
  }

  // The bytes a token's text stands for, or nullopt when some character is outside the
  // alphabet (the ByteLevel decoder then keeps the token's text as it is).
  std::optional<std::string> ToBytes(std::string_view text) const {
    std::string bytes;
    for (size_t i = 0; i < text.size();) {
      const Utf8Scan scan = ScanUtf8(text, i);
      if (!scan.valid) return std::nullopt;
      const char32_t c = DecodeUtf8(text, i, scan.len);
      if (c >= char_to_byte.size() || char_to_byte[c] < 0) return std::nullopt;
      bytes.push_back(static_cast<char>(char_to_byte[c]));
      i += scan.len;
    }
    return bytes;
  }

  std::string ToText(uint8_t byte) const {
    std::string s;
    jinja::AppendUtf8(byte_to_char[byte], &s);
    return s;
  }
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet* alphabet = new ByteAlphabet();
  return *alphabet;
}

// ---------------------------------------------------------------------------------------
// PCRE2.

// GPT-2's pre-tokenizer pattern, used by ByteLevel with use_regex=true.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class Regex {
 public:
  // `literal`: the pattern is a plain string (Split with pattern.String).
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    // MATCH_INVALID_UTF: the subject may hold ill-formed bytes (Encode takes any bytes);
    // they never match and so end up in the gaps between matches.
    uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
    options |= literal ? PCRE2_LITERAL : PCRE2_UCP;  // PCRE2 refuses UCP with LITERAL
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      return absl::InvalidArgumentError(
          absl::StrFormat("PCRE2 cannot compile the pattern: %s (at offset %d)",
                          reinterpret_cast<const char*>(message), static_cast<int>(offset)));
    }
    // JIT is an optimization only; without it pcre2_match interprets.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    return std::unique_ptr<Regex>(new Regex(code));
  }

  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-empty matches of the pattern in `text`, left to right, as [begin, end) offsets. If
  // PCRE2 gives up (a resource limit), the rest of the text is left unmatched.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const {
    matches->clear();
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (data == nullptr) return;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t offset = 0;
    while (offset < text.size()) {
      const int rc = pcre2_match(code_, subject, text.size(), offset, 0, data, nullptr);
      if (rc < 0) break;  // PCRE2_ERROR_NOMATCH, or a limit
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
      const size_t begin = ovector[0], end = ovector[1];
      if (end > begin) {
        matches->emplace_back(begin, end);
        offset = end;
      } else {
        // An empty match says nothing; step over one character and look again.
        offset = begin + 1;
        while (offset < text.size() && (static_cast<uint8_t>(text[offset]) & 0xC0) == 0x80) {
          ++offset;
        }
      }
    }
    pcre2_match_data_free(data);
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// ---------------------------------------------------------------------------------------
// Pipeline pieces, as parsed from the file.

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel } kind;
  std::unique_ptr<Regex> regex;  // kSplit, or kByteLevel with use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special;
  bool normalized;  // matched after the normalizer rather than on the raw text
  bool lstrip;
  bool rstrip;
};

// Byte trie over added-token contents for leftmost-longest matching.
class TokenTrie {
 public:
  TokenTrie() : nodes_(1) {}

  void Insert(std::string_view text, int32_t token_index) {
    int32_t node = 0;
    for (const char ch : text) {
      const auto b = static_cast<uint8_t>(ch);
      int32_t child = Child(node, b);
      if (child < 0) {
        child = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(b, child);
        nodes_.emplace_back();
      }
      node = child;
    }
    nodes_[node].token_index = token_index;
    first_byte_[static_cast<uint8_t>(text[0])] = true;
  }

  bool empty() const { return nodes_.size() == 1; }

  // Longest token starting at text[pos]: {token index, length}, or {-1, 0}.
  std::pair<int32_t, size_t> LongestAt(std::string_view text, size_t pos) const {
    if (!first_byte_[static_cast<uint8_t>(text[pos])]) return {-1, 0};
    std::pair<int32_t, size_t> best{-1, 0};
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      node = Child(node, static_cast<uint8_t>(text[i]));
      if (node < 0) break;
      if (nodes_[node].token_index >= 0) best = {nodes_[node].token_index, i + 1 - pos};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token_index = -1;
  };

  int32_t Child(int32_t node, uint8_t b) const {
    for (const auto& [byte, child] : nodes_[node].children) {
      if (byte == b) return child;
    }
    return -1;
  }

  std::vector<Node> nodes_;
  std::array<bool, 256> first_byte_{};
};

// ---------------------------------------------------------------------------------------
// JSON access with errors that name the file and the field.

class FieldReader {
 public:
  explicit FieldReader(std::string_view source) : source_(source) {}

  absl::Status Error(absl::string_view field, absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", field, ": ", message));
  }

  static const char* TypeName(const Json& j) { return j.type_name(); }

  // Member `key` of object `obj` (at `path`), or nullptr when absent or null.
  static const Json* Find(const Json& obj, std::string_view key) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::StatusOr<std::string> String(const Json& j, absl::string_view path) const {
    if (!j.is_string()) return Error(path, absl::StrCat("expected a string, got ", TypeName(j)));
    return j.get<std::string>();
  }

  absl::StatusOr<bool> Bool(const Json& obj, const char* key, absl::string_view path,
                            bool fallback) const {
    const Json* j = Find(obj, key);
    if (j == nullptr) return fallback;
    if (!j->is_boolean()) {
      return Error(absl::StrCat(path, ".", key),
                   absl::StrCat("expected true or false, got ", TypeName(*j)));
    }
    return j->get<bool>();
  }

  // Ids are bounded like vocab_size in config.json (2^24): tables are sized by the largest id.
  absl::StatusOr<int32_t> TokenId(const Json& j, absl::string_view path) const {
    if (!j.is_number_integer() || j.get<int64_t>() < 0 || j.get<int64_t>() >= (1 << 24)) {
      return Error(path, absl::StrCat("expected a token id (integer in [0, 2^24)), got ",
                                      j.is_number() ? j.dump() : TypeName(j)));
    }
    return static_cast<int32_t>(j.get<int64_t>());
  }

  // The "type" of a tagged object at `path`.
  absl::StatusOr<std::string> Type(const Json& j, absl::string_view path) const {
    if (!j.is_object()) return Error(path, absl::StrCat("expected an object, got ", TypeName(j)));
    const Json* type = Find(j, "type");
    if (type == nullptr) return Error(absl::StrCat(path, ".type"), "missing");
    return String(*type, absl::StrCat(path, ".type"));
  }

 private:
  std::string source_;
};

// Shows a token in an error message: quoted, and cut short when long.
std::string Quote(absl::string_view token) {
  std::string s(token.substr(0, 64));
  if (token.size() > 64) s += "...";
  return absl::StrCat("'", ToValidUtf8(s), "'");
}

}  // namespace

// ---------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  // Text of every id (vocab, then added tokens over it) and the bytes the decoder turns it
  // into; has_token_ marks ids that exist (the id space may have holes).
  std::vector<std::string> id_to_token;
  std::vector<std::string> id_to_bytes;
  std::vector<bool> has_token;
  std::vector<bool> special;

  absl::flat_hash_map<std::string, int32_t> vocab;           // model.vocab, as written
  absl::flat_hash_map<std::string, int32_t> vocab_by_bytes;  // for ignore_merges
  absl::flat_hash_map<std::string, int32_t> added_by_content;
  // (left id << 32 | right id) -> {rank, merged id}
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  std::array<int32_t, 256> byte_token{};  // id of each byte's one-character token, or -1
  int32_t unk_id = -1;
  bool ignore_merges = false;

  bool nfc = false;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<AddedToken> added;
  TokenTrie raw_trie;         // added tokens matched on the raw input
  TokenTrie normalized_trie;  // added tokens matched after normalization

  std::vector<int32_t> prefix_ids;  // post-processor, with add_special_tokens
  std::vector<int32_t> suffix_ids;

  // Pre-token bytes -> ids. Pre-tokens repeat heavily in real text, so this saves most
  // merge work. Sharded so concurrent Encode calls rarely wait on one another; each shard
  // stops growing at a fixed size rather than evicting, which bounds memory simply.
  static constexpr int kCacheShards = 16;
  static constexpr size_t kCacheEntriesPerShard = 1 << 14;
  static constexpr size_t kMaxCachedPieceBytes = 64;
  struct CacheShard {
    std::mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> map;
  };
  mutable std::array<CacheShard, kCacheShards> cache;

  void EncodeSegment(std::string_view raw, std::vector<int32_t>* ids) const;
  void SplitAdded(const TokenTrie& trie, std::string_view text, std::vector<int32_t>* ids,
                  const std::function<void(std::string_view)>& on_gap) const;
  void PreTokenize(std::string_view text, std::vector<int32_t>* ids) const;
  void Bpe(std::string_view piece, std::vector<int32_t>* ids) const;
  void Merge(std::string_view piece, std::vector<int32_t>* ids) const;
};

namespace {

absl::Status ParseModel(const FieldReader& r, const Json& root, Tokenizer::Impl* impl) {
  const Json* model = FieldReader::Find(root, "model");
  if (model == nullptr) return r.Error("model", "missing");
  if (!model->is_object()) {
    return r.Error("model", absl::StrCat("expected an object, got ", model->type_name()));
  }
  if (const Json* type = FieldReader::Find(*model, "type")) {
    auto t = r.String(*type, "model.type");
    if (!t.ok()) return t.status();
    if (*t != "BPE") {
      return r.Error("model.type",
                     absl::StrCat("'", *t, "' is not supported; only byte-level BPE is"));
    }
  }

  const Json* vocab = FieldReader::Find(*model, "vocab");
  if (vocab == nullptr) return r.Error("model.vocab", "missing");
  if (!vocab->is_object()) {
    return r.Error("model.vocab",
                   absl::StrCat("expected an object of token -> id, got ", vocab->type_name()));
  }
  if (vocab->empty()) return r.Error("model.vocab", "empty");
  impl->vocab.reserve(vocab->size());
  for (const auto& [token, id_json] : vocab->items()) {
    auto id = r.TokenId(id_json, absl::StrCat("model.vocab[", Json(token).dump(), "]"));
    if (!id.ok()) return id.status();
    if (static_cast<size_t>(*id) >= impl->id_to_token.size()) {
      impl->id_to_token.resize(*id + 1);
      impl->has_token.resize(*id + 1);
    }
    if (impl->has_token[*id]) {
      return r.Error(
          absl::StrCat("model.vocab[", Json(token).dump(), "]"),
          absl::StrCat("id ", *id, " is already used by ", Quote(impl->id_to_token[*id])));
    }
    impl->has_token[*id] = true;
    impl->id_to_token[*id] = token;
    impl->vocab.emplace(token, *id);
  }

  const Json* merges = FieldReader::Find(*model, "merges");
  if (merges == nullptr) return r.Error("model.merges", "missing");
  if (!merges->is_array()) {
    return r.Error("model.merges", absl::StrCat("expected an array, got ", merges->type_name()));
  }
  impl->merges.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    const Json& m = (*merges)[i];
    const std::string path = absl::StrCat("model.merges[", i, "]");
    std::string left, right;
    if (m.is_string()) {
      // Legacy form "left right": byte-level tokens never contain a space (it is 'Ġ').
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos) {
        return r.Error(path,
                       absl::StrCat("expected \"left right\" with one space, got ", Quote(s)));
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return r.Error(path, absl::StrCat("expected \"left right\" or [left, right], got ",
                                        m.dump().substr(0, 64)));
    }
    auto l = impl->vocab.find(left);
    if (l == impl->vocab.end()) {
      return r.Error(path, absl::StrCat(Quote(left), " is not in model.vocab"));
    }
    auto rt = impl->vocab.find(right);
    if (rt == impl->vocab.end()) {
      return r.Error(path, absl::StrCat(Quote(right), " is not in model.vocab"));
    }
    auto merged = impl->vocab.find(left + right);
    if (merged == impl->vocab.end()) {
      return r.Error(path,
                     absl::StrCat("merged token ", Quote(left + right), " is not in model.vocab"));
    }
    const uint64_t key =
        (static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(rt->second);
    // A pair listed twice keeps its first (highest-priority) rank.
    impl->merges.emplace(key, std::make_pair(static_cast<int32_t>(i), merged->second));
  }

  auto ignore_merges = r.Bool(*model, "ignore_merges", "model", false);
  if (!ignore_merges.ok()) return ignore_merges.status();
  impl->ignore_merges = *ignore_merges;

  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const Json* j = FieldReader::Find(*model, key)) {
      auto s = r.String(*j, absl::StrCat("model.", key));
      if (!s.ok()) return s.status();
      if (!s->empty()) {
        return r.Error(absl::StrCat("model.", key),
                       "not supported for byte-level BPE (only null or \"\")");
      }
    }
  }
  if (const Json* dropout = FieldReader::Find(*model, "dropout")) {
    if (!dropout->is_number() || dropout->get<double>() != 0.0) {
      return r.Error("model.dropout", "BPE dropout is for training; only null or 0 is supported");
    }
  }
  if (const Json* unk = FieldReader::Find(*model, "unk_token")) {
    auto s = r.String(*unk, "model.unk_token");
    if (!s.ok()) return s.status();
    auto it = impl->vocab.find(*s);
    if (it == impl->vocab.end()) {
      return r.Error("model.unk_token", absl::StrCat(Quote(*s), " is not in model.vocab"));
    }
    impl->unk_id = it->second;
  }

  const ByteAlphabet& alphabet = Alphabet();
  for (int b = 0; b < 256; ++b) {
    auto it = impl->vocab.find(alphabet.ToText(static_cast<uint8_t>(b)));
    impl->byte_token[b] = it == impl->vocab.end() ? -1 : it->second;
  }
  if (impl->ignore_merges) {
    impl->vocab_by_bytes.reserve(impl->vocab.size());
    for (const auto& [token, id] : impl->vocab) {
      if (auto bytes = alphabet.ToBytes(token)) impl->vocab_by_bytes.emplace(*bytes, id);
    }
  }
  return absl::OkStatus();
}

absl::Status ParseAddedTokens(const FieldReader& r, const Json& root, Tokenizer::Impl* impl) {
  const Json* added = FieldReader::Find(root, "added_tokens");
  if (added == nullptr) return absl::OkStatus();
  if (!added->is_array()) {
    return r.Error("added_tokens", absl::StrCat("expected an array, got ", added->type_name()));
  }
  for (size_t i = 0; i < added->size(); ++i) {
    const Json& t = (*added)[i];
    const std::string path = absl::StrCat("added_tokens[", i, "]");
    if (!t.is_object())
      return r.Error(path, absl::StrCat("expected an object, got ", t.type_name()));
    AddedToken token;
    const Json* id = FieldReader::Find(t, "id");
    if (id == nullptr) return r.Error(path + ".id", "missing");
    auto id_value = r.TokenId(*id, path + ".id");
    if (!id_value.ok()) return id_value.status();
    token.id = *id_value;
    const Json* content = FieldReader::Find(t, "content");
    if (content == nullptr) return r.Error(path + ".content", "missing");
    auto content_value = r.String(*content, path + ".content");
    if (!content_value.ok()) return content_value.status();
    if (content_value->empty()) return r.Error(path + ".content", "empty");
    token.content = std::move(*content_value);
    auto special = r.Bool(t, "special", path, false);
    if (!special.ok()) return special.status();
    token.special = *special;
    auto normalized = r.Bool(t, "normalized", path, !token.special);
    if (!normalized.ok()) return normalized.status();
    token.normalized = *normalized;
    auto lstrip = r.Bool(t, "lstrip", path, false);
    if (!lstrip.ok()) return lstrip.status();
    token.lstrip = *lstrip;
    auto rstrip = r.Bool(t, "rstrip", path, false);
    if (!rstrip.ok()) return rstrip.status();
    token.rstrip = *rstrip;
    auto single_word = r.Bool(t, "single_word", path, false);
    if (!single_word.ok()) return single_word.status();
    if (*single_word) return r.Error(path + ".single_word", "true is not supported");

    if (static_cast<size_t>(token.id) >= impl->id_to_token.size()) {
      impl->id_to_token.resize(token.id + 1);
      impl->has_token.resize(token.id + 1);
    }
    impl->has_token[token.id] = true;
    impl->id_to_token[token.id] = token.content;
    impl->added_by_content[token.content] = token.id;
    impl->added.push_back(std::move(token));
  }
  impl->special.assign(impl->id_to_token.size(), false);
  for (size_t i = 0; i < impl->added.size(); ++i) {
    const AddedToken& token = impl->added[i];
    if (token.special) impl->special[token.id] = true;
    (token.normalized ? impl->normalized_trie : impl->raw_trie)
        .Insert(token.content, static_cast<int32_t>(i));
  }
  return absl::OkStatus();
}

absl::Status ParseNormalizer(const FieldReader& r, const Json& j, absl::string_view path,
                             Tokenizer::Impl* impl) {
  auto type = r.Type(j, path);
  if (!type.ok()) return type.status();
  if (*type == "NFC") {
    impl->nfc = true;
    return absl::OkStatus();
  }
  if (*type == "Sequence") {
    const Json* list = FieldReader::Find(j, "normalizers");
    const std::string list_path = absl::StrCat(path, ".normalizers");
    if (list == nullptr || !list->is_array()) return r.Error(list_path, "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      absl::Status s = ParseNormalizer(r, (*list)[i], absl::StrCat(list_path, "[", i, "]"), impl);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  return r.Error(absl::StrCat(path, ".type"),
                 absl::StrCat("'", *type, "' is not supported (only NFC or none)"));
}

absl::Status ParsePreTokenizer(const FieldReader& r, const Json& j, absl::string_view path,
                               Tokenizer::Impl* impl) {
  auto type = r.Type(j, path);
  if (!type.ok()) return type.status();
  if (*type == "Sequence") {
    const Json* list = FieldReader::Find(j, "pretokenizers");
    const std::string list_path = absl::StrCat(path, ".pretokenizers");
    if (list == nullptr || !list->is_array()) return r.Error(list_path, "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      absl::Status s = ParsePreTokenizer(r, (*list)[i], absl::StrCat(list_path, "[", i, "]"), impl);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  PreTokenizerStep step;
  if (*type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    auto prefix = r.Bool(j, "add_prefix_space", path, true);
    if (!prefix.ok()) return prefix.status();
    step.add_prefix_space = *prefix;
    auto use_regex = r.Bool(j, "use_regex", path, true);
    if (!use_regex.ok()) return use_regex.status();
    if (*use_regex) {
      auto regex = Regex::Compile(kGpt2Pattern, /*literal=*/false);
      if (!regex.ok()) return regex.status();
      step.regex = std::move(*regex);
    }
  } else if (*type == "Split") {
    for (const PreTokenizerStep& earlier : impl->pre_tokenizer) {
      if (earlier.kind == PreTokenizerStep::Kind::kByteLevel) {
        return r.Error(path, "a Split after ByteLevel is not supported");
      }
    }
    step.kind = PreTokenizerStep::Kind::kSplit;
    const std::string pattern_path = absl::StrCat(path, ".pattern");
    const Json* pattern = FieldReader::Find(j, "pattern");
    if (pattern == nullptr || !pattern->is_object()) {
      return r.Error(pattern_path, "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const bool literal = !pattern->contains("Regex");
    const char* key = literal ? "String" : "Regex";
    const Json* text = FieldReader::Find(*pattern, key);
    if (text == nullptr) {
      return r.Error(pattern_path, "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    const std::string text_path = absl::StrCat(pattern_path, ".", key);
    auto text_value = r.String(*text, text_path);
    if (!text_value.ok()) return text_value.status();
    auto regex = Regex::Compile(*text_value, literal);
    if (!regex.ok()) return r.Error(text_path, regex.status().message());
    step.regex = std::move(*regex);

    const Json* behavior = FieldReader::Find(j, "behavior");
    const std::string behavior_path = absl::StrCat(path, ".behavior");
    if (behavior == nullptr) return r.Error(behavior_path, "missing");
    auto b = r.String(*behavior, behavior_path);
    if (!b.ok()) return b.status();
    if (*b == "Isolated") {
      step.behavior = SplitBehavior::kIsolated;
    } else if (*b == "Removed") {
      step.behavior = SplitBehavior::kRemoved;
    } else if (*b == "MergedWithPrevious") {
      step.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (*b == "MergedWithNext") {
      step.behavior = SplitBehavior::kMergedWithNext;
    } else if (*b == "Contiguous") {
      step.behavior = SplitBehavior::kContiguous;
    } else {
      return r.Error(behavior_path, absl::StrCat("unknown behavior '", *b, "'"));
    }
    auto invert = r.Bool(j, "invert", path, false);
    if (!invert.ok()) return invert.status();
    step.invert = *invert;
  } else {
    return r.Error(
        absl::StrCat(path, ".type"),
        absl::StrCat("'", *type, "' is not supported (only Split, ByteLevel, Sequence)"));
  }
  impl->pre_tokenizer.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status ParseDecoder(const FieldReader& r, const Json& j, absl::string_view path) {
  auto type = r.Type(j, path);
  if (!type.ok()) return type.status();
  if (*type == "ByteLevel") return absl::OkStatus();
  if (*type == "Sequence") {
    const Json* list = FieldReader::Find(j, "decoders");
    const std::string list_path = absl::StrCat(path, ".decoders");
    if (list == nullptr || !list->is_array()) return r.Error(list_path, "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      absl::Status s = ParseDecoder(r, (*list)[i], absl::StrCat(list_path, "[", i, "]"));
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  return r.Error(absl::StrCat(path, ".type"),
                 absl::StrCat("'", *type, "' is not supported (only ByteLevel)"));
}

absl::StatusOr<int32_t> ParseIdPair(const FieldReader& r, const Json& j, absl::string_view path) {
  // RobertaProcessing/BertProcessing write tokens as ["<s>", 0].
  if (!j.is_array() || j.size() != 2) return r.Error(path, "expected [token, id]");
  return r.TokenId(j[1], absl::StrCat(path, "[1]"));
}

absl::Status ParsePostProcessor(const FieldReader& r, const Json& j, absl::string_view path,
                                Tokenizer::Impl* impl) {
  auto type = r.Type(j, path);
  if (!type.ok()) return type.status();
  if (*type == "ByteLevel") return absl::OkStatus();  // offsets only; ids unchanged
  if (*type == "Sequence") {
    const Json* list = FieldReader::Find(j, "processors");
    const std::string list_path = absl::StrCat(path, ".processors");
    if (list == nullptr || !list->is_array()) return r.Error(list_path, "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      absl::Status s =
          ParsePostProcessor(r, (*list)[i], absl::StrCat(list_path, "[", i, "]"), impl);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (*type == "RobertaProcessing" || *type == "BertProcessing") {
    const Json* cls = FieldReader::Find(j, "cls");
    const Json* sep = FieldReader::Find(j, "sep");
    if (cls == nullptr) return r.Error(absl::StrCat(path, ".cls"), "missing");
    if (sep == nullptr) return r.Error(absl::StrCat(path, ".sep"), "missing");
    auto cls_id = ParseIdPair(r, *cls, absl::StrCat(path, ".cls"));
    if (!cls_id.ok()) return cls_id.status();
    auto sep_id = ParseIdPair(r, *sep, absl::StrCat(path, ".sep"));
    if (!sep_id.ok()) return sep_id.status();
    impl->prefix_ids.push_back(*cls_id);
    impl->suffix_ids.push_back(*sep_id);
    return absl::OkStatus();
  }
  if (*type != "TemplateProcessing") {
    return r.Error(absl::StrCat(path, ".type"),
                   absl::StrCat("'", *type,
                                "' is not supported (only TemplateProcessing, "
                                "ByteLevel, RobertaProcessing, BertProcessing, Sequence)"));
  }
  const std::string single_path = absl::StrCat(path, ".single");
  const Json* single = FieldReader::Find(j, "single");
  if (single == nullptr || !single->is_array()) return r.Error(single_path, "expected an array");
  const Json* specials = FieldReader::Find(j, "special_tokens");
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const Json& piece = (*single)[i];
    const std::string piece_path = absl::StrCat(single_path, "[", i, "]");
    if (piece.is_object() && piece.contains("Sequence")) {
      if (seen_sequence) return r.Error(piece_path, "the input sequence appears twice");
      seen_sequence = true;
      continue;
    }
    const Json* special = piece.is_object() ? FieldReader::Find(piece, "SpecialToken") : nullptr;
    const Json* name =
        special != nullptr && special->is_object() ? FieldReader::Find(*special, "id") : nullptr;
    if (name == nullptr || !name->is_string()) {
      return r.Error(piece_path,
                     "expected {\"Sequence\": ...} or {\"SpecialToken\": {\"id\": ...}}");
    }
    const std::string& token = name->get_ref<const std::string&>();
    const std::string token_path = absl::StrCat(path, ".special_tokens[", Json(token).dump(), "]");
    const Json* entry = specials != nullptr ? FieldReader::Find(*specials, token) : nullptr;
    if (entry == nullptr || !entry->is_object()) return r.Error(token_path, "missing");
    const Json* ids = FieldReader::Find(*entry, "ids");
    if (ids == nullptr || !ids->is_array()) {
      return r.Error(absl::StrCat(token_path, ".ids"), "expected an array of ids");
    }
    for (size_t k = 0; k < ids->size(); ++k) {
      auto id = r.TokenId((*ids)[k], absl::StrCat(token_path, ".ids[", k, "]"));
      if (!id.ok()) return id.status();
      (seen_sequence ? impl->suffix_ids : impl->prefix_ids).push_back(*id);
    }
  }
  if (!seen_sequence) return r.Error(single_path, "has no {\"Sequence\": ...} for the input");
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Encoding.

void Tokenizer::Impl::SplitAdded(const TokenTrie& trie, std::string_view text,
                                 std::vector<int32_t>* ids,
                                 const std::function<void(std::string_view)>& on_gap) const {
  if (trie.empty()) {
    if (!text.empty()) on_gap(text);
    return;
  }
  size_t gap_begin = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    auto [index, len] = trie.LongestAt(text, pos);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = added[index];
    size_t begin = pos, end = pos + len;
    if (token.lstrip) {
      // Swallow whitespace before the token (back to the previous match at most).
      while (begin > gap_begin) {
        size_t k = begin - 1;
        while (k > gap_begin && (static_cast<uint8_t>(text[k]) & 0xC0) == 0x80) --k;
        const Utf8Scan scan = ScanUtf8(text, k);
        if (!scan.valid || k + scan.len != begin || !IsWhiteSpace(DecodeUtf8(text, k, scan.len))) {
          break;
        }
        begin = k;
      }
    }
    if (token.rstrip) {
      while (end < text.size()) {
        const Utf8Scan scan = ScanUtf8(text, end);
        if (!scan.valid || !IsWhiteSpace(DecodeUtf8(text, end, scan.len))) break;
        end += scan.len;
      }
    }
    if (begin > gap_begin) on_gap(text.substr(gap_begin, begin - gap_begin));
    ids->push_back(token.id);
    pos = gap_begin = end;
  }
  if (gap_begin < text.size()) on_gap(text.substr(gap_begin));
}

void Tokenizer::Impl::EncodeSegment(std::string_view raw, std::vector<int32_t>* ids) const {
  SplitAdded(raw_trie, raw, ids, [&](std::string_view gap) {
    if (nfc) {
      std::string normalized;
      NormalizeNfc(gap, &normalized);
      SplitAdded(normalized_trie, normalized, ids,
                 [&](std::string_view piece) { PreTokenize(piece, ids); });
    } else {
      SplitAdded(normalized_trie, gap, ids,
                 [&](std::string_view piece) { PreTokenize(piece, ids); });
    }
  });
}

void Tokenizer::Impl::PreTokenize(std::string_view text, std::vector<int32_t>* ids) const {
  std::vector<std::string_view> pieces{text};
  std::vector<std::string_view> next;
  std::deque<std::string> arena;  // pieces that gained a prefix space; stable addresses
  std::vector<std::pair<size_t, size_t>> matches;
  std::vector<std::pair<std::string_view, bool>> parts;  // (text, is a match)

  for (const PreTokenizerStep& step : pre_tokenizer) {
    next.clear();
    for (std::string_view piece : pieces) {
      SplitBehavior behavior = step.behavior;
      bool invert = step.invert;
      if (step.kind == PreTokenizerStep::Kind::kByteLevel) {
        if (step.add_prefix_space && piece[0] != ' ') {
          arena.push_back(absl::StrCat(" ", Sv(piece)));
          piece = arena.back();
        }
        if (step.regex == nullptr) {
          next.push_back(piece);
          continue;
        }
        behavior = SplitBehavior::kIsolated;
        invert = false;
      }
      step.regex->FindAll(piece, &matches);
      parts.clear();
      size_t last = 0;
      for (const auto& [begin, end] : matches) {
        if (begin > last) parts.emplace_back(piece.substr(last, begin - last), invert);
        parts.emplace_back(piece.substr(begin, end - begin), !invert);
        last = end;
      }
      if (last < piece.size()) parts.emplace_back(piece.substr(last), invert);

      // Parts are adjacent views of `piece`, so joining two is widening a view.
      const auto join = [](std::string_view a, std::string_view b) {
        return std::string_view(a.data(), a.size() + b.size());
      };
      switch (behavior) {
        case SplitBehavior::kIsolated:
          for (const auto& [part, is_match] : parts) next.push_back(part);
          break;
        case SplitBehavior::kRemoved:
          for (const auto& [part, is_match] : parts) {
            if (!is_match) next.push_back(part);
          }
          break;
        case SplitBehavior::kMergedWithPrevious: {
          bool previous_match = false;
          const size_t first = next.size();
          for (const auto& [part, is_match] : parts) {
            if (is_match && !previous_match && next.size() > first) {
              next.back() = join(next.back(), part);
            } else {
              next.push_back(part);
            }
            previous_match = is_match;
          }
          break;
        }
        case SplitBehavior::kMergedWithNext: {
          bool previous_match = false;
          const size_t first = next.size();
          for (const auto& [part, is_match] : parts) {
            if (previous_match && !is_match && next.size() > first) {
              next.back() = join(next.back(), part);
            } else {
              next.push_back(part);
            }
            previous_match = is_match;
          }
          break;
        }
        case SplitBehavior::kContiguous: {
          // Runs of parts on the same side join. Two gaps can be neighbours too: with
          // `invert`, adjacent matches of the pattern become adjacent gaps.
          bool previous_match = false;
          const size_t first = next.size();
          for (const auto& [part, is_match] : parts) {
            if (is_match == previous_match && next.size() > first) {
              next.back() = join(next.back(), part);
            } else {
              next.push_back(part);
            }
            previous_match = is_match;
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
  for (std::string_view piece : pieces) Bpe(piece, ids);
}

void Tokenizer::Impl::Bpe(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.empty()) return;
  if (ignore_merges) {
    auto it = vocab_by_bytes.find(Sv(piece));
    if (it != vocab_by_bytes.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  if (piece.size() == 1) {
    const int32_t id = byte_token[static_cast<uint8_t>(piece[0])];
    if (id >= 0) {
      ids->push_back(id);
    } else if (unk_id >= 0) {
      ids->push_back(unk_id);
    }
    return;
  }
  if (piece.size() > kMaxCachedPieceBytes) {
    Merge(piece, ids);
    return;
  }
  const size_t hash = absl::HashOf(Sv(piece));
  CacheShard& shard = cache[hash % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.map.find(Sv(piece));
    if (it != shard.map.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids->size();
  Merge(piece, ids);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() < kCacheEntriesPerShard) {
    shard.map.emplace(std::string(piece), std::vector<int32_t>(ids->begin() + first, ids->end()));
  }
}

// Applies merges by rank: always the lowest-ranked adjacent pair next, leftmost first among
// equals. Symbols form a linked list over the piece's bytes; a heap holds candidate pairs,
// and candidates made stale by an earlier merge are dropped when popped.
void Tokenizer::Impl::Merge(std::string_view piece, std::vector<int32_t>* ids) const {
  struct Symbol {
    int32_t id;  // -1 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t left;  // symbol index
    int32_t left_id;
    int32_t right_id;
    int32_t merged_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (const char ch : piece) {
    int32_t id = byte_token[static_cast<uint8_t>(ch)];
    if (id < 0) id = unk_id;
    if (id < 0) continue;  // no token for this byte and no unk: dropped
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  std::vector<Candidate> heap;
  const auto push_pair = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    const uint64_t key =
        (static_cast<uint64_t>(symbols[left].id) << 32) | static_cast<uint32_t>(symbols[right].id);
    auto it = merges.find(key);
    if (it == merges.end()) return;
    heap.push_back(
        {it->second.first, left, symbols[left].id, symbols[right].id, it->second.second});
    std::push_heap(heap.begin(), heap.end(), std::greater<>());
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = symbols[c.left];
    if (left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != c.right_id) continue;
    left.id = c.merged_id;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = c.left;
    push_pair(left.prev);
    push_pair(c.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

// ---------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path.string(), ": no such file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path.string(), ": read failed"));
  return FromJson(text.str(), path.string());
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text,
                                                               std::string_view source) {
  const FieldReader r(source);
  if (absl::Status s = CheckJsonDepth(json_text, source); !s.ok()) return s;
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    // e.what() reads "[json.exception.parse_error.101] parse error at line 1, column 5: ...".
    std::string_view what = e.what();
    if (const size_t bracket = what.find("] "); bracket != std::string_view::npos) {
      what.remove_prefix(bracket + 2);
    }
    return absl::InvalidArgumentError(absl::StrCat(Sv(source), ": not valid JSON: ", Sv(what)));
  }
  if (!root.is_object()) {
    return r.Error("(top level)", absl::StrCat("expected an object, got ", root.type_name()));
  }

  auto impl = std::make_unique<Impl>();
  absl::Status status = ParseModel(r, root, impl.get());
  if (!status.ok()) return status;
  status = ParseAddedTokens(r, root, impl.get());
  if (!status.ok()) return status;
  if (const Json* normalizer = FieldReader::Find(root, "normalizer")) {
    status = ParseNormalizer(r, *normalizer, "normalizer", impl.get());
    if (!status.ok()) return status;
  }
  const Json* pre_tokenizer = FieldReader::Find(root, "pre_tokenizer");
  if (pre_tokenizer == nullptr)
    return r.Error("pre_tokenizer", "missing; byte-level BPE needs ByteLevel");
  status = ParsePreTokenizer(r, *pre_tokenizer, "pre_tokenizer", impl.get());
  if (!status.ok()) return status;
  if (std::none_of(
          impl->pre_tokenizer.begin(), impl->pre_tokenizer.end(),
          [](const PreTokenizerStep& s) { return s.kind == PreTokenizerStep::Kind::kByteLevel; })) {
    return r.Error("pre_tokenizer", "has no ByteLevel step; only byte-level BPE is supported");
  }
  const Json* decoder = FieldReader::Find(root, "decoder");
  if (decoder == nullptr) return r.Error("decoder", "missing; byte-level BPE needs ByteLevel");
  status = ParseDecoder(r, *decoder, "decoder");
  if (!status.ok()) return status;
  if (const Json* post = FieldReader::Find(root, "post_processor")) {
    status = ParsePostProcessor(r, *post, "post_processor", impl.get());
    if (!status.ok()) return status;
  }
  for (const int32_t id : impl->prefix_ids) {
    if (static_cast<size_t>(id) >= impl->has_token.size() || !impl->has_token[id]) {
      return r.Error("post_processor", absl::StrCat("token id ", id, " is not in the vocabulary"));
    }
  }
  for (const int32_t id : impl->suffix_ids) {
    if (static_cast<size_t>(id) >= impl->has_token.size() || !impl->has_token[id]) {
      return r.Error("post_processor", absl::StrCat("token id ", id, " is not in the vocabulary"));
    }
  }

  impl->special.resize(impl->id_to_token.size(), false);
  impl->id_to_bytes.resize(impl->id_to_token.size());
  const ByteAlphabet& alphabet = Alphabet();
  for (size_t id = 0; id < impl->id_to_token.size(); ++id) {
    if (!impl->has_token[id]) continue;
    const std::string& token = impl->id_to_token[id];
    // Like the ByteLevel decoder: a token whose text is not all byte-alphabet characters
    // (an added token such as "<|im_start|>" is, by luck, but "思考" would not be) decodes
    // to its text unchanged.
    auto bytes = alphabet.ToBytes(token);
    impl->id_to_bytes[id] = bytes.has_value() ? *std::move(bytes) : token;
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = impl_->prefix_ids;
  impl_->EncodeSegment(text, &ids);
  if (add_special_tokens) ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
  return ids;
}

absl::StatusOr<std::string> Tokenizer::DecodeBytes(std::span<const int32_t> ids,
                                                   bool skip_special_tokens) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || static_cast<size_t>(id) >= impl_->has_token.size() || !impl_->has_token[id]) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " (at position ", i,
                                                     ") is not in the vocabulary of ",
                                                     impl_->has_token.size(), " ids"));
    }
    if (skip_special_tokens && impl_->special[id]) continue;
    out += impl_->id_to_bytes[id];
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  auto bytes = DecodeBytes(ids, skip_special_tokens);
  if (!bytes.ok()) return bytes.status();
  return ToValidUtf8(*bytes);
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(Sv(token)); it != impl_->added_by_content.end()) {
    return it->second;
  }
  if (auto it = impl_->vocab.find(Sv(token)); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[id];
}

std::optional<int32_t> Tokenizer::bos_token_id() const {
  if (impl_->prefix_ids.empty()) return std::nullopt;
  return impl_->prefix_ids.front();
}

// ---------------------------------------------------------------------------------------

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

absl::StatusOr<std::string> IncrementalDetokenizer::Push(int32_t id) {
  auto bytes = tokenizer_->DecodeBytes(std::span<const int32_t>(&id, 1), skip_special_tokens_);
  if (!bytes.ok()) return bytes.status();
  pending_ += *bytes;
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const Utf8Scan scan = ScanUtf8(pending_, i);
    if (scan.truncated) break;  // a later token may complete it
    if (scan.valid) {
      out.append(pending_, i, scan.len);
    } else {
      out.append(kReplacement);
    }
    i += scan.len;
  }
  pending_.erase(0, i);
  return out;
}

std::string IncrementalDetokenizer::Finish() {
  std::string out = ToValidUtf8(pending_);
  pending_.clear();
  return out;
}

// ---------------------------------------------------------------------------------------
// NFC normalization through ICU. ICU works on well-formed text only, so each run of valid
// UTF-8 is normalized on its own and ill-formed bytes pass through unchanged between runs
// (they block composition across them, as a non-character would).

namespace {

void NormalizeValidRun(std::string_view run, const icu::Normalizer2& nfc, std::string* out) {
  if (run.empty()) return;
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString text =
      icu::UnicodeString::fromUTF8(icu::StringPiece(run.data(), static_cast<int32_t>(run.size())));
  if (nfc.isNormalized(text, status) && U_SUCCESS(status)) {
    out->append(run);
    return;
  }
  status = U_ZERO_ERROR;
  const icu::UnicodeString normalized = nfc.normalize(text, status);
  if (U_FAILURE(status)) {  // cannot happen for well-formed input; keep the text as it was
    out->append(run);
    return;
  }
  normalized.toUTF8String(*out);
}

void NormalizeNfc(std::string_view in, std::string* out) {
  // Below U+0300 nothing combines or reorders, so text made only of such characters (any
  // byte under 0xCC) is already NFC. That covers ASCII and most Latin text.
  if (std::all_of(in.begin(), in.end(), [](char ch) { return static_cast<uint8_t>(ch) < 0xCC; })) {
    out->append(in);
    return;
  }
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status) || nfc == nullptr) {  // ICU data missing: leave the text as it is
    out->append(in);
    return;
  }
  size_t run_start = 0;
  for (size_t i = 0; i < in.size();) {
    const Utf8Scan scan = ScanUtf8(in, i);
    if (!scan.valid) {
      NormalizeValidRun(in.substr(run_start, i - run_start), *nfc, out);
      out->append(in.substr(i, scan.len));
      run_start = i + scan.len;
    }
    i += scan.len;
  }
  NormalizeValidRun(in.substr(run_start), *nfc, out);
}

}  // namespace
}  // namespace kvgrid::model
