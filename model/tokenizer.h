// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (Llama 3, Qwen2 and
// GPT-2-style files): added/special tokens matched first, the pre-tokenizer split regex run
// through PCRE2 with Unicode properties (UCP), the byte-to-unicode mapping, merges applied
// by rank, and the post-processor's BOS when asked for.
//
// Thread-safety: immutable after construction; Encode/Decode may run concurrently.
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
  // (e.g. "model.merges[12]") for malformed or unsupported files.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::filesystem::path& path);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json_text,
                                                             std::string_view source);
  ~Tokenizer();

  // Token ids for `text`. With `add_special_tokens`, prepends what the file's post-processor
  // prepends (Llama 3: <|begin_of_text|>; Qwen2: nothing). Special tokens written in the text
  // are recognized as such. Never fails: every byte has a token in a byte-level BPE.
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = false) const;

  // Bytes for `ids` (may end in the middle of a UTF-8 character). Errors: INVALID_ARGUMENT
  // naming the first id outside the vocabulary.
  absl::StatusOr<std::string> DecodeBytes(std::span<const int32_t> ids,
                                          bool skip_special_tokens = false) const;

  // Text for `ids`; invalid UTF-8 at the end or inside is replaced by U+FFFD.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // largest id + 1, added tokens included
  std::optional<int32_t> TokenToId(std::string_view token) const;
  bool IsSpecial(int32_t id) const;
  std::optional<int32_t> bos_token_id() const;  // from the post-processor, if any

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
