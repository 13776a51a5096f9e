// The tokenizer a GGUF file carries in its metadata (llama.cpp's tokenizer.ggml.* keys), so a
// .gguf model needs no tokenizer.json beside it.
//
// tokenizer.ggml.model "gpt2" (byte-level BPE) gives the same ids as the Hugging Face
// tokenizer.json it was exported from (tests/reference/test_gguf_tokenizer.py). The
// pre-tokenizer is named, not stored: tokenizer.ggml.pre selects the split regex and the flags
// llama.cpp ties to that name (kvgrid knows llama-bpe/llama3/llama-v3, qwen2, gpt-2 and
// default; see gguf_tokenizer.cc). Token types map to the tokenizer.json roles: normal (and
// unknown, byte, undefined) tokens form the vocabulary, control tokens are special added
// tokens, user-defined tokens are non-special added tokens, unused tokens (padding up to the
// embedding's rows) have no text.
//
// tokenizer.ggml.model "llama" (SentencePiece: Llama 2, Mistral, TinyLlama, CodeLlama, Phi-3)
// is tokenized as llama.cpp does (Tokenizer::FromSentencePiece): tokenizer.ggml.scores drive
// the merges, tokenizer.ggml.token_type says which tokens are matched in the text first,
// tokenizer.ggml.add_space_prefix (default true) puts "▁" before text, and a general.name
// naming Phi-3 makes its special tokens swallow the whitespace after them (llama.cpp's
// RSTRIP); ids equal llama.cpp's
// on its own test vocabularies (tests/reference/test_llama_cpp_vocab.py). Other models
// (bert, t5, rwkv, ...) are refused.
#ifndef KVGRID_MODEL_GGUF_TOKENIZER_H_
#define KVGRID_MODEL_GGUF_TOKENIZER_H_

#include <filesystem>
#include <memory>

#include "absl/status/statusor.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

namespace kvgrid::model {

// Builds the tokenizer embedded in `file`. With tokenizer.ggml.add_bos_token (default, as in
// llama.cpp: true for "llama" and for the Llama 3 pre-tokenizer, else false),
// Encode(text, true) puts tokenizer.ggml.bos_token_id in front; add_eos_token likewise
// appends eos_token_id. Errors, each naming the file and the key: NOT_FOUND when
// tokenizer.ggml.model, tokens or ("gpt2") merges is missing; UNIMPLEMENTED for a model other
// than "gpt2" or "llama" or an unknown tokenizer.ggml.pre; INVALID_ARGUMENT for a token_type
// or scores array whose length differs from the token list's, an unknown token type, a
// repeated token ("gpt2"), text that is not UTF-8, a merge that names a token the list lacks,
// or a BOS/EOS id outside the list.
absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufFile& file);

// The tokenizer that goes with the model at `model_path`, as the CLI, the worker and the
// coordinator all resolve it: for a directory, its tokenizer.json; for a .gguf file, the
// tokenizer.json beside it when there is one (it overrides the embedded one), else the
// tokenizer embedded in the file. nullptr when there is none (the caller then works with
// token ids only). Errors: as Tokenizer::FromFile, GgufFile::Open and TokenizerFromGguf.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadModelTokenizer(
    const std::filesystem::path& model_path);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_GGUF_TOKENIZER_H_
