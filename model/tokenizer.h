// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (Llama 3, Qwen2 and
// GPT-2-style files): added/special tokens matched first (leftmost, then longest), the NFC
// normalizer when the file has one (Qwen2), the pre-tokenizer split regex run through PCRE2
// with Unicode properties (UCP), the byte-to-unicode mapping, merges applied by rank (with
// `ignore_merges`), and the post-processor's BOS when asked for. Ids agree with the
// Hugging Face `tokenizers` library (tests/reference/test_tokenizer.py).
//
// Supported file sections: model BPE (merges as "a b" or [a, b]); normalizer NFC/Sequence/
// none; pre_tokenizer Split (any behavior), ByteLevel, Sequence; decoder ByteLevel;
// post_processor TemplateProcessing, ByteLevel, Roberta/BertProcessing, Sequence; added
// tokens with lstrip/rstrip (not single_word). Anything else is refused at load time rather
// than tokenized differently from the reference.
//
// Thread-safety: immutable after construction except for an internal, locked cache;
// Encode/Decode may run concurrently.
#ifndef KVGRID_MODEL_TOKENIZER_H_
#define KVGRID_MODEL_TOKENIZER_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvgrid::model {

class Tokenizer {
 public:
  // Errors: NOT_FOUND (missing file); INVALID_ARGUMENT naming the file and the JSON field
  // (e.g. "tokenizer.json: model.merges[12]: ...") for malformed or unsupported files,
  // including a model.type other than BPE. `source` names the text in messages.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::filesystem::path& path);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json_text,
                                                             std::string_view source);
  ~Tokenizer();

  // Token ids for `text`. With `add_special_tokens`, adds what the file's post-processor
  // adds (Meta's Llama 3 files: <|begin_of_text|> in front; Qwen2 and the copy in
  // tests/data: nothing, so callers prepend BOS themselves). Added and special tokens
  // written in the text are recognized as such. Never fails: every byte has a token in a
  // byte-level BPE, so even ill-formed UTF-8 encodes (and DecodeBytes gives it back).
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = false) const;

  // Bytes for `ids` (may end in the middle of a UTF-8 character). Errors: INVALID_ARGUMENT
  // naming the first id outside the vocabulary.
  absl::StatusOr<std::string> DecodeBytes(std::span<const int32_t> ids,
                                          bool skip_special_tokens = false) const;

  // Text for `ids`; invalid UTF-8 at the end or inside is replaced by U+FFFD (one per
  // maximal ill-formed subsequence, as the reference does).
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // largest id + 1, added tokens included
  std::optional<int32_t> TokenToId(std::string_view token) const;
  bool IsSpecial(int32_t id) const;
  // The first token the post-processor prepends, if any (nullopt for the files in
  // tests/data; use TokenToId("<|begin_of_text|>") there).
  std::optional<int32_t> bos_token_id() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of token ids into text deltas that never split a UTF-8 character: bytes of
// an incomplete character are held until it completes (or replaced by U+FFFD once it can no
// longer complete). Not thread-safe; one per sequence. The tokenizer must outlive it.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens = true);

  // Appends one token; returns the newly complete text (possibly empty).
  // Errors: INVALID_ARGUMENT for an id outside the vocabulary.
  absl::StatusOr<std::string> Push(int32_t id);

  // Flushes held bytes at the end of the stream (as U+FFFD if they never completed).
  std::string Finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes of a UTF-8 sequence that is not complete yet
};

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_TOKENIZER_H_
