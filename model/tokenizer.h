// BPE tokenizer read from a Hugging Face tokenizer.json, in the two families real LLM files
// use, plus SentencePiece vocabularies with scores (as GGUF files carry them):
//
//   * Byte-level BPE (Llama 3, Qwen2, GPT-2): the pre-tokenizer has a ByteLevel step; text is
//     split by regex (PCRE2 with Unicode properties), bytes map to the byte-to-unicode
//     alphabet, merges apply by rank; decoder ByteLevel.
//   * SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, CodeLlama, Phi-3): no ByteLevel
//     step; spaces become "▁" (normalizer Prepend + Replace, or the Metaspace pre-tokenizer),
//     the initial symbols are Unicode characters, a character outside the vocabulary becomes
//     its <0xXX> byte tokens (byte_fallback) or unk_token (fused with fuse_unk); decoders
//     Replace/ByteFallback/Fuse/Strip/Metaspace turn tokens back into text.
//   * FromSentencePiece: llama.cpp's SentencePiece tokenizer (GGUF tokenizer.ggml.model
//     "llama"): adjacent symbols merge when their concatenation is a token, highest score
//     first; what is left that is no token becomes byte tokens.
//
// Added/special tokens are matched first (leftmost, then longest; normalized ones on the
// normalized text, by their normalized form as `tokenizers` 0.23 does), with lstrip, rstrip
// and single_word. The post-processor's tokens are added when asked for. Ids agree with the
// Hugging Face `tokenizers` library (tests/reference/test_tokenizer.py,
// test_sentencepiece_tokenizer.py) and with llama.cpp (test_llama_cpp_vocab.py).
//
// Supported file sections: model BPE (merges as "a b" or [a, b]; ignore_merges,
// byte_fallback, unk_token, fuse_unk); normalizer NFC, NFKC, Prepend, Replace (String or
// Regex), Sequence, none; pre_tokenizer Split (any behavior), ByteLevel, Metaspace
// (prepend_scheme first/always/never or legacy add_prefix_space, split), Sequence, none;
// decoder ByteLevel (byte-level files) or Replace, ByteFallback, Strip, Metaspace, Fuse and
// Sequence (after a Fuse only Strip and a one-character Replace); post_processor
// TemplateProcessing, ByteLevel, Roberta/BertProcessing, Sequence. Anything else (Unigram and WordPiece models, other
// normalizers, continuing_subword_prefix, ...) is refused at load time, naming the field,
// rather than tokenized differently from the reference.
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

  // A SentencePiece vocabulary with scores, tokenized as llama.cpp does it (its "SPM"
  // tokenizer; GGUF tokenizer.ggml.model "llama"). `types` are llama.cpp's token types:
  // 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte (0 is read as normal).
  struct SentencePieceVocab {
    std::vector<std::string> tokens;  // id -> text, "▁" for a space, "<0xXX>" for bytes
    std::vector<float> scores;        // same length as tokens
    std::vector<int32_t> types;       // same length as tokens
    bool add_space_prefix = true;     // a "▁" before text at the start and after specials
    std::optional<int32_t> bos_id;    // added in front with add_special_tokens
    std::optional<int32_t> eos_id;    // appended with add_special_tokens
    std::optional<int32_t> unk_id;    // for a byte that has no token
    // Ids of matched tokens that swallow the whitespace after them (llama.cpp's RSTRIP
    // attribute; it sets it for Phi-3's special tokens) or before them (LSTRIP).
    std::vector<int32_t> rstrip_ids;
    std::vector<int32_t> lstrip_ids;
  };
  // Control, unknown and user-defined tokens written in the text are matched as tokens
  // (longest first, as llama.cpp with parse_special); control and unknown ones are special.
  // Decoding turns "▁" into a space, byte tokens into their bytes, and drops the first space
  // when add_space_prefix. Errors: INVALID_ARGUMENT naming `source` for lengths that differ,
  // an empty vocabulary, an unknown type, or a BOS/EOS/unk id outside the vocabulary.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromSentencePiece(
      const SentencePieceVocab& vocab, std::string_view source);
  ~Tokenizer();

  // Token ids for `text`. With `add_special_tokens`, adds what the file's post-processor
  // adds (Meta's Llama 3 files: <|begin_of_text|> in front; Llama 2: <s>; Qwen2 and the copy
  // in tests/data: nothing, so callers prepend BOS themselves). Added and special tokens
  // written in the text are recognized as such. Never fails: every byte has a token in a
  // byte-level BPE, so even ill-formed UTF-8 encodes (and DecodeBytes gives it back); with
  // byte_fallback an ill-formed byte becomes its <0xXX> token, else unk (or nothing).
  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = false) const;

  // Bytes for `ids` (may end in the middle of a UTF-8 character), through the file's decoder
  // (so a SentencePiece file's first space is stripped as in Decode), but with byte-fallback
  // runs that are not UTF-8 kept as raw bytes. Errors: INVALID_ARGUMENT naming the first id
  // outside the vocabulary.
  absl::StatusOr<std::string> DecodeBytes(std::span<const int32_t> ids,
                                          bool skip_special_tokens = false) const;

  // Text for `ids`, as the reference decodes it. Byte-level files: invalid UTF-8 is replaced
  // by U+FFFD, one per maximal ill-formed subsequence. ByteFallback decoders: a run of byte
  // tokens that is not UTF-8 as a whole becomes one U+FFFD per byte (as `tokenizers` does).
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
  friend class IncrementalDetokenizer;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of token ids into text deltas whose concatenation (with Finish) is exactly
// Decode of all the ids: bytes of an incomplete UTF-8 character are held until it completes
// (or replaced by U+FFFD once it can no longer complete); with a ByteFallback decoder a run
// of byte tokens is held until a token that is not a byte ends it (the reference replaces a
// run that is not UTF-8 as a whole); text a Strip decoder may still cut off the end is held
// too. Not thread-safe; one per sequence; copyable (a copy continues independently). The
// tokenizer must outlive it.
class IncrementalDetokenizer {
 public:
  // `continues_text`: the ids continue text decoded before (a completion after its prompt),
  // so what the decoder does only at the start of the text (Strip's and Metaspace's removal
  // of the first space in SentencePiece files) is not done: "▁Paris" streams as " Paris",
  // as vLLM streams it. False (the default): the deltas add up to Decode(ids).
  explicit IncrementalDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens = true,
                                  bool continues_text = false);

  // Appends one token; returns the newly complete text (possibly empty).
  // Errors: INVALID_ARGUMENT for an id outside the vocabulary (the state is unchanged).
  absl::StatusOr<std::string> Push(int32_t id);

  // Flushes held bytes at the end of the stream (as U+FFFD if they never completed). The
  // detokenizer may be reused afterwards as if new (with continues_text as constructed).
  std::string Finish();

 private:
  friend struct Tokenizer::Impl;
  void Reset();

  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  bool continues_text_;
  std::string pending_;  // bytes of an incomplete UTF-8 sequence, or of a byte-token run
  // Decoder state (SentencePiece-style decoders): tokens each per-token step has seen (its
  // Metaspace index), start characters each text step has stripped (-1: done), and the
  // characters each text step holds back because a Strip may remove them at the end.
  std::vector<int64_t> step_count_;
  std::vector<int64_t> stripped_;
  std::vector<std::string> held_;
};

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_TOKENIZER_H_
