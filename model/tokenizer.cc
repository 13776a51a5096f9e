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

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "model/jinja/unicode.h"
#include "model/json_util.h"
#include "nlohmann/json.hpp"
#include "unicode/normalizer2.h"
#include "unicode/uchar.h"
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

// Canonical (NFC) or compatibility (NFKC, with `compatibility`) composition of `in` appended
// to `out`. Ill-formed bytes pass through unchanged and block composition across them.
// Defined at the end of this file.
void NormalizeUnicode(std::string_view in, bool compatibility, std::string* out);

// Unicode \w as the regex crate defines it (Alphabetic, M, Nd, Pc, Join_Control), for
// single_word added tokens. Defined at the end of this file.
bool IsWordChar(char32_t c);

// The character that ends at s[end) (scanning back over continuation bytes), or nullopt
// when the bytes there are not a well-formed character.
std::optional<char32_t> CharBefore(std::string_view s, size_t end) {
  if (end == 0) return std::nullopt;
  size_t k = end - 1;
  while (k > 0 && end - k < 4 && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
  const Utf8Scan scan = ScanUtf8(s, k);
  if (!scan.valid || k + scan.len != end) return std::nullopt;
  return DecodeUtf8(s, k, scan.len);
}

std::optional<char32_t> CharAt(std::string_view s, size_t pos) {
  if (pos >= s.size()) return std::nullopt;
  const Utf8Scan scan = ScanUtf8(s, pos);
  if (!scan.valid) return std::nullopt;
  return DecodeUtf8(s, pos, scan.len);
}

// Replaces every occurrence of `from` (non-empty) in `in` with `to`, appending to `out`.
void ReplaceAll(std::string_view in, std::string_view from, std::string_view to, std::string* out) {
  size_t last = 0;
  for (size_t at = in.find(from); at != std::string_view::npos; at = in.find(from, last)) {
    out->append(in.substr(last, at - last));
    out->append(to);
    last = at + from.size();
  }
  out->append(in.substr(last));
}

// "<0xAB>" -> 0xAB, as the ByteFallback decoder reads byte tokens (either case of hex).
std::optional<uint8_t> ByteTokenValue(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = token[i];
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      return std::nullopt;
    }
    value = value * 16 + digit;
  }
  return static_cast<uint8_t>(value);
}

std::string ByteTokenText(uint8_t b) { return absl::StrFormat("<0x%02X>", b); }

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

enum class PrependScheme { kFirst, kAlways, kNever };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace } kind;
  std::unique_ptr<Regex> regex;  // kSplit, or kByteLevel with use_regex
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
  std::string replacement;        // kMetaspace: the character spaces become ("▁")
  PrependScheme prepend = PrependScheme::kAlways;
  bool split = true;
};

struct NormalizerStep {
  enum class Kind { kNfc, kNfkc, kPrepend, kReplace };
  explicit NormalizerStep(Kind k) : kind(k) {}
  Kind kind;
  std::string text;              // kPrepend: what to prepend; kReplace: the replacement
  std::string literal;           // kReplace with a String pattern
  std::unique_ptr<Regex> regex;  // kReplace with a Regex pattern
};

// One decoder step of a SentencePiece-style file. Per-token steps come before the first
// Fuse; after it the tokens are one text, and only Strip and a one-character Replace are
// supported there.
struct DecoderStep {
  enum class Kind { kReplace, kByteFallback, kStrip, kMetaspace };
  explicit DecoderStep(Kind k = Kind::kReplace) : kind(k) {}
  Kind kind;
  std::string literal;           // kReplace with a String pattern
  std::unique_ptr<Regex> regex;  // kReplace with a Regex pattern
  std::string content;           // kReplace: the replacement; kStrip: the character
  int64_t start = 0;             // kStrip: up to this many leading `content` characters
  int64_t stop = 0;              // kStrip: up to this many trailing ones
  std::string replacement;       // kMetaspace
  bool strip_first = true;       // kMetaspace: prepend_scheme is not never
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special;
  bool normalized;  // matched after the normalizer rather than on the raw text
  bool lstrip;
  bool rstrip;
  bool single_word;   // only where no word character touches it
  std::string match;  // what is matched: content, normalized when `normalized`
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
  // `max_token_id`: ids at or above it are refused. An id sizes the id -> token tables, so a
  // file must not be able to claim one far past what it holds: a real vocabulary is dense,
  // and every entry costs the file more than one byte.
  explicit FieldReader(std::string_view source, int64_t max_token_id = int64_t{1} << 24)
      : source_(source), max_token_id_(max_token_id) {}

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
    if (j.get<int64_t>() >= max_token_id_) {
      return Error(path, absl::StrCat("token id ", j.get<int64_t>(), " is larger than a file of ",
                                      max_token_id_, " bytes can hold a vocabulary for"));
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
  int64_t max_token_id_;
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

  // What the initial BPE symbols are: bytes (ByteLevel files) or characters (SentencePiece-
  // style files), or llama.cpp's score-driven SentencePiece merging (FromSentencePiece).
  enum class Model { kByteBpe, kCharBpe, kSentencePiece } model = Model::kByteBpe;
  bool byte_fallback = false;                 // kCharBpe: unknown characters -> <0xXX>
  bool fuse_unk = false;                      // kCharBpe: consecutive unknowns -> one unk
  std::array<int32_t, 256> fallback_token{};  // id of each byte's "<0xXX>" token, or -1
  std::vector<float> scores;                  // kSentencePiece, by id
  bool add_space_prefix = false;              // kSentencePiece
  // kSentencePiece: tokens matched in the text before merging, longest first (llama.cpp),
  // and whether each id strips ASCII whitespace after (1), before (2) or on both sides (3).
  std::vector<int32_t> partition_ids;
  absl::flat_hash_map<int32_t, int> strip_sides;

  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<AddedToken> added;
  TokenTrie raw_trie;         // added tokens matched on the raw input
  TokenTrie normalized_trie;  // added tokens matched after normalization

  std::vector<int32_t> prefix_ids;  // post-processor, with add_special_tokens
  std::vector<int32_t> suffix_ids;

  // Decoding. Byte-level files decode through id_to_bytes; the others through the steps,
  // fed each id's decoder_text (a normalized added token decodes as its normalized form).
  bool byte_level_decoder = true;
  std::vector<DecoderStep> token_steps;  // before the first Fuse (or all, without one)
  std::vector<DecoderStep> text_steps;   // after it: Strip, one-character Replace
  bool fused = false;
  std::vector<std::string> decoder_text;

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
  // Splits `text` on the trie's tokens; `on_gap` gets each non-empty text between them and
  // its offset in `text`.
  void SplitAdded(const TokenTrie& trie, std::string_view text, std::vector<int32_t>* ids,
                  const std::function<void(std::string_view, size_t)>& on_gap) const;
  void Normalize(std::string_view in, std::string* out) const;
  // `at_start`: the text begins at offset 0 of the input (Metaspace's prepend_scheme first).
  void PreTokenize(std::string_view text, bool at_start, std::vector<int32_t>* ids) const;
  void Bpe(std::string_view piece, std::vector<int32_t>* ids) const;
  void Merge(std::string_view piece, std::vector<int32_t>* ids) const;
  void MergeSymbols(std::vector<int32_t> initial, std::vector<int32_t>* ids) const;
  void InitialChars(std::string_view piece, std::vector<int32_t>* symbols) const;
  void EncodeSentencePiece(std::string_view text, std::vector<int32_t>* ids) const;
  void MergeByScore(std::string_view text, std::vector<int32_t>* ids) const;

  // Decoding through the steps. `raw_bytes`: a byte run that is not UTF-8 stays bytes
  // (DecodeBytes) instead of one U+FFFD per byte (Decode).
  void StartDecode(IncrementalDetokenizer* d, bool continues_text) const;
  void DecodeToken(IncrementalDetokenizer* d, int32_t id, bool raw_bytes, std::string* out) const;
  void FinishDecode(IncrementalDetokenizer* d, bool raw_bytes, std::string* out) const;
  void FeedStep(IncrementalDetokenizer* d, size_t k, std::string_view token, bool raw_bytes,
                std::string* out) const;
  void FlushRun(IncrementalDetokenizer* d, size_t k, bool raw_bytes, std::string* out) const;
  void FeedText(IncrementalDetokenizer* d, size_t k, std::string_view text, std::string* out) const;
  absl::Status CheckId(int32_t id, size_t position) const;
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
      return r.Error(
          "model.type",
          absl::StrCat("'", *t,
                       "' is not supported; only BPE is (byte-level or SentencePiece-style)"));
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
  auto byte_fallback = r.Bool(*model, "byte_fallback", "model", false);
  if (!byte_fallback.ok()) return byte_fallback.status();
  impl->byte_fallback = *byte_fallback;
  auto fuse_unk = r.Bool(*model, "fuse_unk", "model", false);
  if (!fuse_unk.ok()) return fuse_unk.status();
  impl->fuse_unk = *fuse_unk;
  for (int b = 0; b < 256; ++b) {
    auto it = impl->vocab.find(ByteTokenText(static_cast<uint8_t>(b)));
    impl->fallback_token[b] = it == impl->vocab.end() ? -1 : it->second;
  }

  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const Json* j = FieldReader::Find(*model, key)) {
      auto s = r.String(*j, absl::StrCat("model.", key));
      if (!s.ok()) return s.status();
      if (!s->empty()) {
        return r.Error(absl::StrCat("model.", key), "not supported (only null or \"\")");
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
    token.single_word = *single_word;
    token.match = token.content;

    if (static_cast<size_t>(token.id) >= impl->id_to_token.size()) {
      impl->id_to_token.resize(token.id + 1);
      impl->has_token.resize(token.id + 1);
    }
    impl->has_token[token.id] = true;
    impl->id_to_token[token.id] = token.content;
    impl->added_by_content[token.content] = token.id;
    impl->added.push_back(std::move(token));
  }
  return absl::OkStatus();
}

// Builds the added-token tries once the normalizer is known: like `tokenizers` (0.23), a
// normalized token is matched, and decoded, as the normalizer's output for its content
// (with Llama 2's normalizer "<x>" becomes "▁<x>").
void IndexAddedTokens(Tokenizer::Impl* impl) {
  impl->special.assign(impl->id_to_token.size(), false);
  for (size_t i = 0; i < impl->added.size(); ++i) {
    AddedToken& token = impl->added[i];
    if (token.special) impl->special[token.id] = true;
    if (token.normalized && !impl->normalizers.empty()) {
      token.match.clear();
      impl->Normalize(token.content, &token.match);
      if (token.match.empty()) token.match = token.content;
    }
    (token.normalized ? impl->normalized_trie : impl->raw_trie)
        .Insert(token.match, static_cast<int32_t>(i));
  }
}

// A Replace normalizer or decoder: {"pattern": {"String": s} or {"Regex": r}, "content": c}.
absl::Status ParseReplace(const FieldReader& r, const Json& j, absl::string_view path,
                          std::string* literal, std::unique_ptr<Regex>* regex,
                          std::string* content) {
  const std::string pattern_path = absl::StrCat(path, ".pattern");
  const Json* pattern = FieldReader::Find(j, "pattern");
  const bool is_regex = pattern != nullptr && pattern->is_object() && pattern->contains("Regex");
  const Json* text = pattern != nullptr && pattern->is_object()
                         ? FieldReader::Find(*pattern, is_regex ? "Regex" : "String")
                         : nullptr;
  if (text == nullptr) {
    return r.Error(pattern_path, "expected {\"String\": ...} or {\"Regex\": ...}");
  }
  const std::string text_path = absl::StrCat(pattern_path, is_regex ? ".Regex" : ".String");
  auto value = r.String(*text, text_path);
  if (!value.ok()) return value.status();
  if (value->empty()) return r.Error(text_path, "empty patterns are not supported");
  if (is_regex) {
    auto compiled = Regex::Compile(*value, /*literal=*/false);
    if (!compiled.ok()) return r.Error(text_path, compiled.status().message());
    *regex = *std::move(compiled);
  } else {
    *literal = *std::move(value);
  }
  const Json* c = FieldReader::Find(j, "content");
  if (c == nullptr) return r.Error(absl::StrCat(path, ".content"), "missing");
  auto content_value = r.String(*c, absl::StrCat(path, ".content"));
  if (!content_value.ok()) return content_value.status();
  *content = *std::move(content_value);
  return absl::OkStatus();
}

// Replaces the matches of a literal or a regex, as `tokenizers`' Replace does.
void ApplyReplace(const std::string& literal, const Regex* regex, const std::string& content,
                  std::string_view in, std::string* out) {
  if (regex == nullptr) {
    ReplaceAll(in, literal, content, out);
    return;
  }
  std::vector<std::pair<size_t, size_t>> matches;
  regex->FindAll(in, &matches);
  size_t last = 0;
  for (const auto& [begin, end] : matches) {
    out->append(in.substr(last, begin - last));
    out->append(content);
    last = end;
  }
  out->append(in.substr(last));
}

absl::Status ParseNormalizer(const FieldReader& r, const Json& j, absl::string_view path,
                             Tokenizer::Impl* impl) {
  auto type = r.Type(j, path);
  if (!type.ok()) return type.status();
  if (*type == "NFC" || *type == "NFKC") {
    impl->normalizers.emplace_back(*type == "NFC" ? NormalizerStep::Kind::kNfc
                                                  : NormalizerStep::Kind::kNfkc);
    return absl::OkStatus();
  }
  if (*type == "Prepend") {
    const Json* prepend = FieldReader::Find(j, "prepend");
    if (prepend == nullptr) return r.Error(absl::StrCat(path, ".prepend"), "missing");
    auto text = r.String(*prepend, absl::StrCat(path, ".prepend"));
    if (!text.ok()) return text.status();
    NormalizerStep step{NormalizerStep::Kind::kPrepend};
    step.text = *std::move(text);
    impl->normalizers.push_back(std::move(step));
    return absl::OkStatus();
  }
  if (*type == "Replace") {
    NormalizerStep step{NormalizerStep::Kind::kReplace};
    absl::Status s = ParseReplace(r, j, path, &step.literal, &step.regex, &step.text);
    if (!s.ok()) return s;
    impl->normalizers.push_back(std::move(step));
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
                 absl::StrCat("'", *type,
                              "' is not supported (only NFC, NFKC, Prepend, Replace, Sequence "
                              "or none)"));
}

// Metaspace's replacement and prepend scheme, shared by the pre-tokenizer and the decoder.
// As `tokenizers` reads them: prepend_scheme defaults to always, and the legacy
// add_prefix_space=false is accepted only with prepend_scheme never.
absl::Status ParseMetaspace(const FieldReader& r, const Json& j, absl::string_view path,
                            std::string* replacement, PrependScheme* prepend) {
  const Json* rep = FieldReader::Find(j, "replacement");
  const std::string rep_path = absl::StrCat(path, ".replacement");
  if (rep == nullptr) return r.Error(rep_path, "missing");
  auto text = r.String(*rep, rep_path);
  if (!text.ok()) return text.status();
  const Utf8Scan scan = text->empty() ? Utf8Scan{0, false, false} : ScanUtf8(*text, 0);
  if (!scan.valid || scan.len != text->size()) {
    return r.Error(rep_path, "expected one character");
  }
  *replacement = *std::move(text);
  *prepend = PrependScheme::kAlways;
  if (const Json* scheme = FieldReader::Find(j, "prepend_scheme")) {
    auto name = r.String(*scheme, absl::StrCat(path, ".prepend_scheme"));
    if (!name.ok()) return name.status();
    if (*name == "first") {
      *prepend = PrependScheme::kFirst;
    } else if (*name == "always") {
      *prepend = PrependScheme::kAlways;
    } else if (*name == "never") {
      *prepend = PrependScheme::kNever;
    } else {
      return r.Error(absl::StrCat(path, ".prepend_scheme"),
                     absl::StrCat("unknown scheme '", *name, "' (first, always or never)"));
    }
  }
  auto add_prefix_space = r.Bool(j, "add_prefix_space", path, true);
  if (!add_prefix_space.ok()) return add_prefix_space.status();
  if (!*add_prefix_space) {
    if (*prepend != PrependScheme::kNever) {
      return r.Error(absl::StrCat(path, ".add_prefix_space"),
                     "false does not match prepend_scheme");
    }
    *prepend = PrependScheme::kNever;
  }
  return absl::OkStatus();
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
  } else if (*type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    absl::Status s = ParseMetaspace(r, j, path, &step.replacement, &step.prepend);
    if (!s.ok()) return s;
    auto split = r.Bool(j, "split", path, true);
    if (!split.ok()) return split.status();
    step.split = *split;
  } else {
    return r.Error(absl::StrCat(path, ".type"),
                   absl::StrCat("'", *type,
                                "' is not supported (only Split, ByteLevel, Metaspace, Sequence)"));
  }
  impl->pre_tokenizer.push_back(std::move(step));
  return absl::OkStatus();
}

// Decoder steps into impl->token_steps / text_steps; `byte_level` and `other` record which
// family the steps belong to (the caller refuses a mix).
absl::Status ParseDecoder(const FieldReader& r, const Json& j, absl::string_view path,
                          Tokenizer::Impl* impl, bool* byte_level, bool* other) {
  auto type = r.Type(j, path);
  if (!type.ok()) return type.status();
  if (*type == "ByteLevel") {
    *byte_level = true;
    return absl::OkStatus();
  }
  if (*type == "Sequence") {
    const Json* list = FieldReader::Find(j, "decoders");
    const std::string list_path = absl::StrCat(path, ".decoders");
    if (list == nullptr || !list->is_array()) return r.Error(list_path, "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      absl::Status s = ParseDecoder(r, (*list)[i], absl::StrCat(list_path, "[", i, "]"), impl,
                                    byte_level, other);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  if (*type == "Fuse") {
    *other = true;
    impl->fused = true;
    return absl::OkStatus();
  }
  DecoderStep step;
  if (*type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    absl::Status s = ParseReplace(r, j, path, &step.literal, &step.regex, &step.content);
    if (!s.ok()) return s;
  } else if (*type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
    for (const DecoderStep& earlier : impl->token_steps) {
      if (earlier.kind == DecoderStep::Kind::kByteFallback) {
        return r.Error(path, "a second ByteFallback is not supported");
      }
    }
  } else if (*type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    const Json* content = FieldReader::Find(j, "content");
    const std::string content_path = absl::StrCat(path, ".content");
    if (content == nullptr) return r.Error(content_path, "missing");
    auto text = r.String(*content, content_path);
    if (!text.ok()) return text.status();
    const Utf8Scan scan = text->empty() ? Utf8Scan{0, false, false} : ScanUtf8(*text, 0);
    if (!scan.valid || scan.len != text->size()) {
      return r.Error(content_path, "expected one character");
    }
    step.content = *std::move(text);
    for (const char* key : {"start", "stop"}) {
      const Json* n = FieldReader::Find(j, key);
      const std::string n_path = absl::StrCat(path, ".", key);
      if (n == nullptr) return r.Error(n_path, "missing");
      if (!n->is_number_unsigned() || n->get<uint64_t>() > (1u << 20)) {
        return r.Error(n_path, "expected a count (integer in [0, 2^20])");
      }
      (std::string_view(key) == "start" ? step.start : step.stop) = n->get<int64_t>();
    }
  } else if (*type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    PrependScheme prepend;
    absl::Status s = ParseMetaspace(r, j, path, &step.replacement, &prepend);
    if (!s.ok()) return s;
    step.strip_first = prepend != PrependScheme::kNever;
  } else {
    return r.Error(absl::StrCat(path, ".type"),
                   absl::StrCat("'", *type,
                                "' is not supported (only ByteLevel, or Replace, ByteFallback, "
                                "Fuse, Strip, Metaspace, Sequence)"));
  }
  *other = true;
  if (impl->fused) {
    // After Fuse the tokens are one text; a Strip of it can stream (its end held back), and
    // so can a Replace of one character (transformers' GGUF conversion writes
    // ByteFallback, Fuse, Replace("▁", " "), Strip): a character never spans two pieces of
    // the text. Anything else could reach across tokens.
    const bool one_char_replace =
        step.kind == DecoderStep::Kind::kReplace && step.regex == nullptr &&
        !step.literal.empty() && ScanUtf8(step.literal, 0).valid &&
        ScanUtf8(step.literal, 0).len == step.literal.size();
    if (step.kind != DecoderStep::Kind::kStrip && !one_char_replace) {
      return r.Error(absl::StrCat(path, ".type"),
                     absl::StrCat("'", *type,
                                  "' after Fuse is not supported (only Strip, or Replace of a "
                                  "one-character String)"));
    }
    impl->text_steps.push_back(std::move(step));
  } else {
    impl->token_steps.push_back(std::move(step));
  }
  return absl::OkStatus();
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

void Tokenizer::Impl::SplitAdded(
    const TokenTrie& trie, std::string_view text, std::vector<int32_t>* ids,
    const std::function<void(std::string_view, size_t)>& on_gap) const {
  if (trie.empty()) {
    if (!text.empty()) on_gap(text, 0);
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
    if (token.single_word) {
      // Like `tokenizers`: a match touching a word character is dropped, and the text it
      // covered stays text (the search goes on after it).
      const std::optional<char32_t> before = CharBefore(text, begin);
      const std::optional<char32_t> after = CharAt(text, end);
      if ((before && IsWordChar(*before)) || (after && IsWordChar(*after))) {
        pos = end;
        continue;
      }
    }
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
    if (begin > gap_begin) on_gap(text.substr(gap_begin, begin - gap_begin), gap_begin);
    ids->push_back(token.id);
    pos = gap_begin = end;
  }
  if (gap_begin < text.size()) on_gap(text.substr(gap_begin), gap_begin);
}

void Tokenizer::Impl::Normalize(std::string_view in, std::string* out) const {
  std::string text(in);
  std::string next;
  for (const NormalizerStep& step : normalizers) {
    next.clear();
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc:
      case NormalizerStep::Kind::kNfkc:
        NormalizeUnicode(text, step.kind == NormalizerStep::Kind::kNfkc, &next);
        break;
      case NormalizerStep::Kind::kPrepend:
        if (!text.empty()) next = absl::StrCat(step.text, text);  // only non-empty text
        break;
      case NormalizerStep::Kind::kReplace:
        ApplyReplace(step.literal, step.regex.get(), step.text, text, &next);
        break;
    }
    text.swap(next);
  }
  out->append(text);
}

void Tokenizer::Impl::EncodeSegment(std::string_view raw, std::vector<int32_t>* ids) const {
  if (model == Model::kSentencePiece) {
    EncodeSentencePiece(raw, ids);
    return;
  }
  SplitAdded(raw_trie, raw, ids, [&](std::string_view gap, size_t gap_offset) {
    const auto pre_tokenize = [&](std::string_view piece, size_t offset) {
      PreTokenize(piece, gap_offset == 0 && offset == 0, ids);
    };
    if (!normalizers.empty()) {
      std::string normalized;
      Normalize(gap, &normalized);
      SplitAdded(normalized_trie, normalized, ids, pre_tokenize);
    } else {
      SplitAdded(normalized_trie, gap, ids, pre_tokenize);
    }
  });
}

void Tokenizer::Impl::PreTokenize(std::string_view text, bool at_start,
                                  std::vector<int32_t>* ids) const {
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
      if (step.kind == PreTokenizerStep::Kind::kMetaspace) {
        // Spaces become the replacement, which goes in front as the scheme says ("first":
        // only where the piece starts the input, so not after an added token), then the
        // text splits before each replacement.
        std::string replaced;
        ReplaceAll(piece, " ", step.replacement, &replaced);
        const bool first = at_start && piece.data() == pieces.front().data();
        const bool prepend = step.prepend == PrependScheme::kAlways ||
                             (step.prepend == PrependScheme::kFirst && first);
        if (prepend && !replaced.starts_with(step.replacement)) {
          replaced.insert(0, step.replacement);
        }
        arena.push_back(std::move(replaced));
        const std::string_view all = arena.back();
        if (!step.split) {
          next.push_back(all);
          continue;
        }
        size_t begin = 0;
        for (size_t at = all.find(step.replacement, 1); at != std::string_view::npos;
             at = all.find(step.replacement, at + step.replacement.size())) {
          if (at > begin) next.push_back(all.substr(begin, at - begin));
          begin = at;
        }
        if (begin < all.size()) next.push_back(all.substr(begin));
        continue;
      }
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
    const auto& whole = model == Model::kByteBpe ? vocab_by_bytes : vocab;
    auto it = whole.find(Sv(piece));
    if (it != whole.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  if (model == Model::kByteBpe && piece.size() == 1) {
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

void Tokenizer::Impl::Merge(std::string_view piece, std::vector<int32_t>* ids) const {
  std::vector<int32_t> initial;
  initial.reserve(piece.size());
  if (model == Model::kCharBpe) {
    InitialChars(piece, &initial);
  } else {
    for (const char ch : piece) {
      int32_t id = byte_token[static_cast<uint8_t>(ch)];
      if (id < 0) id = unk_id;
      if (id >= 0) initial.push_back(id);  // no token for this byte and no unk: dropped
    }
  }
  MergeSymbols(std::move(initial), ids);
}

// The symbols a character-level BPE starts from, as `tokenizers` builds them: a character's
// token; else, with byte_fallback, its <0xXX> tokens when all exist; else unk (consecutive
// ones fused into one with fuse_unk). As there, a pending unk is written only when a
// character with a token (or the end) follows, so it goes after byte-fallback tokens that
// come between. An ill-formed byte is a character of its own here (it can only fall back).
void Tokenizer::Impl::InitialChars(std::string_view piece, std::vector<int32_t>* symbols) const {
  bool unk_pending = false;
  for (size_t i = 0; i < piece.size();) {
    const Utf8Scan scan = ScanUtf8(piece, i);
    const std::string_view ch = piece.substr(i, scan.len);
    i += scan.len;
    if (scan.valid) {
      if (auto it = vocab.find(Sv(ch)); it != vocab.end()) {
        if (unk_pending) symbols->push_back(unk_id);
        unk_pending = false;
        symbols->push_back(it->second);
        continue;
      }
    }
    if (byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char b) {
          return fallback_token[static_cast<uint8_t>(b)] >= 0;
        })) {
      for (const char b : ch) symbols->push_back(fallback_token[static_cast<uint8_t>(b)]);
      continue;
    }
    if (unk_id < 0) continue;  // no unk_token: the character is dropped
    if (unk_pending && !fuse_unk) symbols->push_back(unk_id);
    unk_pending = true;
  }
  if (unk_pending) symbols->push_back(unk_id);
}

// Applies merges by rank: always the lowest-ranked adjacent pair next, leftmost first among
// equals. Symbols form a linked list; a heap holds candidate pairs, and candidates made
// stale by an earlier merge are dropped when popped.
void Tokenizer::Impl::MergeSymbols(std::vector<int32_t> initial, std::vector<int32_t>* ids) const {
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
  if (initial.empty()) return;
  std::vector<Symbol> symbols;
  symbols.reserve(initial.size());
  for (const int32_t id : initial) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  }
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
// llama.cpp's SentencePiece tokenizer (FromSentencePiece).

// Splits `raw` on the control, unknown and user-defined tokens, longest token first, each
// at every occurrence in what is still text (the order llama.cpp partitions in); the text
// between goes through MergeByScore, with a space in front where it follows a token or
// starts the input (add_space_prefix), and every space written as "▁".
void Tokenizer::Impl::EncodeSentencePiece(std::string_view raw, std::vector<int32_t>* ids) const {
  struct Fragment {
    int32_t id;  // -1: text
    std::string_view text;
  };
  std::vector<Fragment> fragments;
  if (!raw.empty()) fragments.push_back({-1, raw});
  std::vector<Fragment> next;
  for (const int32_t token_id : partition_ids) {
    const std::string& token = id_to_token[token_id];
    next.clear();
    for (const Fragment& f : fragments) {
      if (f.id >= 0) {
        next.push_back(f);
        continue;
      }
      const auto strip = strip_sides.find(token_id);
      const int sides = strip == strip_sides.end() ? 0 : strip->second;
      const auto is_space = [](char c) {
        return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
      };
      size_t last = 0;
      for (size_t at = f.text.find(token); at != std::string_view::npos;
           at = f.text.find(token, last)) {
        size_t left_end = at;
        if (sides & 2) {
          while (left_end > last && is_space(f.text[left_end - 1])) --left_end;
        }
        if (left_end > last) next.push_back({-1, f.text.substr(last, left_end - last)});
        next.push_back({token_id, f.text.substr(at, token.size())});
        last = at + token.size();
        if (sides & 1) {
          while (last < f.text.size() && is_space(f.text[last])) ++last;
        }
      }
      if (last < f.text.size()) next.push_back({-1, f.text.substr(last)});
    }
    fragments.swap(next);
  }
  bool after_token = true;  // the start of the input counts as after a token
  std::string text;
  for (const Fragment& f : fragments) {
    if (f.id >= 0) {
      ids->push_back(f.id);
      after_token = true;
      continue;
    }
    text.clear();
    if (add_space_prefix && after_token) text = "\xE2\x96\x81";  // ▁
    ReplaceAll(f.text, " ", "\xE2\x96\x81", &text);
    MergeByScore(text, ids);
    after_token = false;
  }
}

// Symbols start as UTF-8 characters (by the lead byte's length, as llama.cpp cuts them);
// the adjacent pair whose concatenation is a token with the highest score merges next,
// leftmost first among equal scores. What is left that is no token becomes its bytes'
// <0xXX> tokens (or the byte's own one-character token, or unk).
void Tokenizer::Impl::MergeByScore(std::string_view text, std::vector<int32_t>* ids) const {
  struct Symbol {
    size_t begin;
    size_t len;  // 0 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  struct Bigram {
    float score;
    int32_t left;
    int32_t right;
    size_t len;
    bool operator<(const Bigram& o) const {  // for a max-heap: best on top
      return score != o.score ? score < o.score : left > o.left;
    }
  };
  static constexpr size_t kLeadLength[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  std::vector<Symbol> symbols;
  for (size_t offset = 0; offset < text.size();) {
    const size_t len =
        std::min(kLeadLength[static_cast<uint8_t>(text[offset]) >> 4], text.size() - offset);
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({offset, len, index - 1, index + 1});
    offset += len;
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  std::vector<Bigram> heap;
  const auto try_pair = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const size_t len = symbols[left].len + symbols[right].len;
    auto it = vocab.find(Sv(text.substr(symbols[left].begin, len)));
    if (it == vocab.end()) return;
    heap.push_back({scores[it->second], left, right, len});
    std::push_heap(heap.begin(), heap.end());
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_pair(i - 1, i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Bigram b = heap.back();
    heap.pop_back();
    Symbol& left = symbols[b.left];
    Symbol& right = symbols[b.right];
    if (left.len == 0 || right.len == 0 || left.len + right.len != b.len) continue;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = b.left;
    try_pair(left.prev, b.left);
    try_pair(b.left, left.next);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const std::string_view piece = text.substr(symbols[i].begin, symbols[i].len);
    if (auto it = vocab.find(Sv(piece)); it != vocab.end()) {
      ids->push_back(it->second);
      continue;
    }
    for (const char ch : piece) {
      const auto b = static_cast<uint8_t>(ch);
      const int32_t id = fallback_token[b] >= 0 ? fallback_token[b] : byte_token[b];
      if (id >= 0) {
        ids->push_back(id);
      } else if (unk_id >= 0) {
        ids->push_back(unk_id);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Decoding through SentencePiece-style decoder steps, one token at a time, so that Decode
// and IncrementalDetokenizer are the same computation.

absl::Status Tokenizer::Impl::CheckId(int32_t id, size_t position) const {
  if (id < 0 || static_cast<size_t>(id) >= has_token.size() || !has_token[id]) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", id, " (at position ", position,
                                                   ") is not in the vocabulary of ",
                                                   has_token.size(), " ids"));
  }
  return absl::OkStatus();
}

void Tokenizer::Impl::StartDecode(IncrementalDetokenizer* d, bool continues_text) const {
  d->pending_.clear();
  // Continuing text: every step is past the first token, every Strip past the start.
  d->step_count_.assign(token_steps.size(), continues_text ? 1 : 0);
  d->stripped_.assign(text_steps.size(), continues_text ? -1 : 0);
  d->held_.assign(text_steps.size(), std::string());
}

void Tokenizer::Impl::DecodeToken(IncrementalDetokenizer* d, int32_t id, bool raw_bytes,
                                  std::string* out) const {
  FeedStep(d, 0, decoder_text[id], raw_bytes, out);
}

void Tokenizer::Impl::FeedStep(IncrementalDetokenizer* d, size_t k, std::string_view token,
                               bool raw_bytes, std::string* out) const {
  if (k == token_steps.size()) {
    FeedText(d, 0, token, out);
    return;
  }
  const DecoderStep& step = token_steps[k];
  std::string result;
  switch (step.kind) {
    case DecoderStep::Kind::kReplace:
      ApplyReplace(step.literal, step.regex.get(), step.content, token, &result);
      break;
    case DecoderStep::Kind::kByteFallback:
      if (const std::optional<uint8_t> b = ByteTokenValue(token)) {
        d->pending_.push_back(static_cast<char>(*b));  // held until the run ends
        return;
      }
      FlushRun(d, k, raw_bytes, out);
      result.assign(token);
      break;
    case DecoderStep::Kind::kStrip: {
      // Per token: up to `start` leading and `stop` trailing copies of the character.
      std::string_view t = token;
      for (int64_t n = 0; n < step.start && t.starts_with(step.content); ++n) {
        t.remove_prefix(step.content.size());
      }
      for (int64_t n = 0; n < step.stop && t.ends_with(step.content); ++n) {
        t.remove_suffix(step.content.size());
      }
      result.assign(t);
      break;
    }
    case DecoderStep::Kind::kMetaspace: {
      // The replacement is a space, except in the first token, where (unless the scheme
      // is never) every replacement is dropped, as `tokenizers` does.
      const bool first = d->step_count_[k]++ == 0;
      if (first && step.strip_first) {
        ReplaceAll(token, step.replacement, "", &result);
      } else {
        ReplaceAll(token, step.replacement, " ", &result);
      }
      break;
    }
  }
  FeedStep(d, k + 1, result, raw_bytes, out);
}

void Tokenizer::Impl::FlushRun(IncrementalDetokenizer* d, size_t k, bool raw_bytes,
                               std::string* out) const {
  if (d->pending_.empty()) return;
  std::string run;
  run.swap(d->pending_);
  bool valid = true;
  for (size_t i = 0; i < run.size() && valid;) {
    const Utf8Scan scan = ScanUtf8(run, i);
    valid = scan.valid;
    i += scan.len;
  }
  if (valid || raw_bytes) {
    FeedStep(d, k + 1, run, raw_bytes, out);
    return;
  }
  // Not UTF-8 as a whole: one U+FFFD per byte, each a token of its own.
  for (size_t i = 0; i < run.size(); ++i) FeedStep(d, k + 1, kReplacement, raw_bytes, out);
}

void Tokenizer::Impl::FeedText(IncrementalDetokenizer* d, size_t k, std::string_view text,
                               std::string* out) const {
  if (k == text_steps.size()) {
    out->append(text);
    return;
  }
  const DecoderStep& step = text_steps[k];
  if (step.kind == DecoderStep::Kind::kReplace) {
    std::string replaced;
    ApplyReplace(step.literal, nullptr, step.content, text, &replaced);
    FeedText(d, k + 1, replaced, out);
    return;
  }
  int64_t& stripped = d->stripped_[k];
  while (stripped >= 0 && !text.empty()) {
    if (stripped < step.start && text.starts_with(step.content)) {
      text.remove_prefix(step.content.size());
      ++stripped;
    } else {
      stripped = -1;  // the start of the text is past
    }
  }
  if (step.stop == 0) {
    FeedText(d, k + 1, text, out);
    return;
  }
  // Up to `stop` copies of the character at the end may be the end of the whole text: hold
  // them until text that is not them follows.
  std::string& held = d->held_[k];
  held.append(text);
  std::string_view all = held;
  int64_t n = 0;
  while (n < step.stop && all.ends_with(step.content)) {
    all.remove_suffix(step.content.size());
    ++n;
  }
  const std::string emit = held.substr(0, all.size());
  held.erase(0, all.size());
  FeedText(d, k + 1, emit, out);
}

void Tokenizer::Impl::FinishDecode(IncrementalDetokenizer* d, bool raw_bytes,
                                   std::string* out) const {
  for (size_t k = 0; k < token_steps.size(); ++k) {
    if (token_steps[k].kind == DecoderStep::Kind::kByteFallback) FlushRun(d, k, raw_bytes, out);
  }
  // What the Strips held at the end is what they strip. Then start over.
  StartDecode(d, d->continues_text_);
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
  const FieldReader r(source, std::min<int64_t>(int64_t{1} << 24,
                                                 static_cast<int64_t>(json_text.size())));
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
  IndexAddedTokens(impl.get());
  // A ByteLevel step makes a byte-level file; without one (Llama 2: no pre-tokenizer at all,
  // Mistral: Metaspace) BPE starts from characters.
  if (const Json* pre_tokenizer = FieldReader::Find(root, "pre_tokenizer")) {
    status = ParsePreTokenizer(r, *pre_tokenizer, "pre_tokenizer", impl.get());
    if (!status.ok()) return status;
  }
  const bool byte_level = std::any_of(
      impl->pre_tokenizer.begin(), impl->pre_tokenizer.end(),
      [](const PreTokenizerStep& s) { return s.kind == PreTokenizerStep::Kind::kByteLevel; });
  impl->model = byte_level ? Impl::Model::kByteBpe : Impl::Model::kCharBpe;
  const Json* decoder = FieldReader::Find(root, "decoder");
  if (decoder == nullptr) {
    return r.Error("decoder", byte_level ? "missing; byte-level BPE needs ByteLevel"
                                         : "missing (a decoder such as Metaspace is needed)");
  }
  bool byte_level_decoder = false, other_decoder = false;
  status = ParseDecoder(r, *decoder, "decoder", impl.get(), &byte_level_decoder, &other_decoder);
  if (!status.ok()) return status;
  if (byte_level && other_decoder) {
    return r.Error("decoder",
                   "a byte-level file (ByteLevel pre-tokenizer) decodes with ByteLevel "
                   "only");
  }
  if (!byte_level && byte_level_decoder) {
    return r.Error("pre_tokenizer",
                   "has no ByteLevel step, but the decoder is ByteLevel (byte-level BPE needs "
                   "both)");
  }
  impl->byte_level_decoder = byte_level;
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
  if (!byte_level) {
    impl->decoder_text = impl->id_to_token;
    for (const AddedToken& token : impl->added) impl->decoder_text[token.id] = token.match;
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  }
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

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSentencePiece(const SentencePieceVocab& v,
                                                                        std::string_view source) {
  const auto invalid = [&source](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(Sv(source), ": ", parts...));
  };
  const size_t n = v.tokens.size();
  if (n == 0) return invalid("the vocabulary is empty");
  if (n > (size_t{1} << 24)) return invalid("the vocabulary has ", n, " tokens, more than 2^24");
  if (v.scores.size() != n) {
    return invalid("the scores have ", v.scores.size(), " entries but the tokens ", n);
  }
  if (v.types.size() != n) {
    return invalid("the token types have ", v.types.size(), " entries but the tokens ", n);
  }
  auto impl = std::make_unique<Impl>();
  impl->model = Impl::Model::kSentencePiece;
  impl->byte_level_decoder = false;
  impl->add_space_prefix = v.add_space_prefix;
  impl->id_to_token = v.tokens;
  impl->has_token.assign(n, true);
  impl->special.assign(n, false);
  impl->scores = v.scores;
  impl->vocab.reserve(n);
  std::optional<int32_t> first_unknown;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    impl->vocab.insert_or_assign(v.tokens[i], id);  // a repeated text: the last id, as llama.cpp
    switch (v.types[i]) {
      case 0:  // undefined: read as normal
      case 1:  // normal
      case 5:  // unused
      case 6:  // byte
        break;
      case 2:  // unknown
        if (!first_unknown) first_unknown = id;
        [[fallthrough]];
      case 3:  // control
        impl->special[i] = true;
        [[fallthrough]];
      case 4:  // user-defined
        if (!v.tokens[i].empty()) impl->partition_ids.push_back(id);
        break;
      default:
        return invalid("token ", i, " has type ", v.types[i],
                       ", not a llama.cpp token type (0 to 6)");
    }
  }
  for (const auto& [ids, side] : {std::pair{&v.rstrip_ids, 1}, std::pair{&v.lstrip_ids, 2}}) {
    for (const int32_t id : *ids) {
      if (id < 0 || static_cast<size_t>(id) >= n) {
        return invalid("strip id ", id, " is not in the vocabulary of ", n, " tokens");
      }
      impl->strip_sides[id] |= side;
    }
  }
  std::stable_sort(impl->partition_ids.begin(), impl->partition_ids.end(),
                   [&](int32_t a, int32_t b) { return v.tokens[a].size() > v.tokens[b].size(); });
  for (const auto& [name, id] : {std::pair<const char*, std::optional<int32_t>>{"BOS", v.bos_id},
                                 {"EOS", v.eos_id},
                                 {"unk", v.unk_id}}) {
    if (id && (*id < 0 || static_cast<size_t>(*id) >= n)) {
      return invalid("the ", name, " id ", *id, " is not in the vocabulary of ", n, " tokens");
    }
  }
  impl->unk_id = v.unk_id.value_or(first_unknown.value_or(-1));
  if (v.bos_id) impl->prefix_ids.push_back(*v.bos_id);
  if (v.eos_id) impl->suffix_ids.push_back(*v.eos_id);
  for (int b = 0; b < 256; ++b) {
    auto it = impl->vocab.find(ByteTokenText(static_cast<uint8_t>(b)));
    impl->fallback_token[b] = it == impl->vocab.end() ? -1 : it->second;
    it = impl->vocab.find(std::string(1, static_cast<char>(b)));
    impl->byte_token[b] = it == impl->vocab.end() ? -1 : it->second;
  }
  // The decoder of the tokenizer.json files these vocabularies come from (Llama 2's).
  DecoderStep replace{DecoderStep::Kind::kReplace};
  replace.literal = "\xE2\x96\x81";
  replace.content = " ";
  impl->token_steps.push_back(std::move(replace));
  impl->token_steps.push_back(DecoderStep{DecoderStep::Kind::kByteFallback});
  impl->fused = true;
  if (v.add_space_prefix) {
    DecoderStep strip{DecoderStep::Kind::kStrip};
    strip.content = " ";
    strip.start = 1;
    impl->text_steps.push_back(std::move(strip));
  }
  impl->decoder_text = v.tokens;
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
  if (!impl_->byte_level_decoder) {
    IncrementalDetokenizer d(this, skip_special_tokens);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (absl::Status s = impl_->CheckId(ids[i], i); !s.ok()) return s;
      if (skip_special_tokens && impl_->special[ids[i]]) continue;
      impl_->DecodeToken(&d, ids[i], /*raw_bytes=*/true, &out);
    }
    impl_->FinishDecode(&d, /*raw_bytes=*/true, &out);
    return out;
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (absl::Status s = impl_->CheckId(id, i); !s.ok()) return s;
    if (skip_special_tokens && impl_->special[id]) continue;
    out += impl_->id_to_bytes[id];
  }
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  if (!impl_->byte_level_decoder) {
    std::string out;
    IncrementalDetokenizer d(this, skip_special_tokens);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (absl::Status s = impl_->CheckId(ids[i], i); !s.ok()) return s;
      if (skip_special_tokens && impl_->special[ids[i]]) continue;
      impl_->DecodeToken(&d, ids[i], /*raw_bytes=*/false, &out);
    }
    impl_->FinishDecode(&d, /*raw_bytes=*/false, &out);
    return out;
  }
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

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens,
                                               bool continues_text)
    : tokenizer_(tokenizer),
      skip_special_tokens_(skip_special_tokens),
      continues_text_(continues_text) {
  Reset();
}

void IncrementalDetokenizer::Reset() {
  pending_.clear();
  if (!tokenizer_->impl_->byte_level_decoder) tokenizer_->impl_->StartDecode(this, continues_text_);
}

absl::StatusOr<std::string> IncrementalDetokenizer::Push(int32_t id) {
  const Tokenizer::Impl& impl = *tokenizer_->impl_;
  if (!impl.byte_level_decoder) {
    if (absl::Status s = impl.CheckId(id, 0); !s.ok()) return s;
    std::string out;
    if (skip_special_tokens_ && impl.special[id]) return out;
    impl.DecodeToken(this, id, /*raw_bytes=*/false, &out);
    return out;
  }
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
  std::string out;
  if (!tokenizer_->impl_->byte_level_decoder) {
    tokenizer_->impl_->FinishDecode(this, /*raw_bytes=*/false, &out);
    return out;
  }
  out = ToValidUtf8(pending_);
  pending_.clear();
  return out;
}

// ---------------------------------------------------------------------------------------
// NFC/NFKC normalization through ICU. ICU works on well-formed text only, so each run of valid
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

void NormalizeUnicode(std::string_view in, bool compatibility, std::string* out) {
  // Below U+0300 nothing combines or reorders, so text made only of such characters (any
  // byte under 0xCC) is already NFC. That covers ASCII and most Latin text. NFKC also
  // changes Latin-1 characters (U+00A0 becomes a space), so only ASCII passes as it is.
  const uint8_t limit = compatibility ? 0x80 : 0xCC;
  if (std::all_of(in.begin(), in.end(),
                  [limit](char ch) { return static_cast<uint8_t>(ch) < limit; })) {
    out->append(in);
    return;
  }
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = compatibility ? icu::Normalizer2::getNFKCInstance(status)
                                              : icu::Normalizer2::getNFCInstance(status);
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

bool IsWordChar(char32_t c) {
  const auto u = static_cast<UChar32>(c);
  if (u_hasBinaryProperty(u, UCHAR_ALPHABETIC) || u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  switch (u_charType(u)) {
    case U_NON_SPACING_MARK:
    case U_COMBINING_SPACING_MARK:
    case U_ENCLOSING_MARK:
    case U_DECIMAL_DIGIT_NUMBER:
    case U_CONNECTOR_PUNCTUATION:
      return true;
    default:
      return false;
  }
}

}  // namespace
}  // namespace kvgrid::model
