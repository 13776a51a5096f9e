// A model's architecture read from a GGUF file's metadata (llama.cpp's keys), so the worker,
// which loads the weights, and the coordinator, which only sizes and routes, derive the same
// ModelConfig from one file.
#ifndef KVGRID_MODEL_GGUF_CONFIG_H_
#define KVGRID_MODEL_GGUF_CONFIG_H_

#include "absl/status/statusor.h"
#include "model/gguf.h"
#include "model/model_config.h"

namespace kvgrid::model {

// general.architecture llama, qwen2 or qwen3 (q/k norms) with its <arch>.* hyperparameters
// (head_dim from attention.key_length, which value_length must equal); RoPE scaling from
// <arch>.rope.scaling.type/factor/original_context_length (none, linear, yarn) and the
// per-frequency divisors of rope_freqs.weight (Llama 3.1); the context window extended as
// ModelConfig's is. yarn's yarn_beta_fast/yarn_beta_slow/yarn_attn_factor keys, which
// llama.cpp's converter copies from config.json, are honoured as transformers means them
// (llama.cpp itself reads the betas only for some architectures and derives its own mscale),
// and attn_factor multiplies the result as in llama.cpp; vocab_size from
// token_embd.weight's rows; tie_word_embeddings when there is no output.weight;
// attention_bias when blk.0.attn_q.bias exists; <arch>.attention.sliding_window, when present
// and positive, on every layer; BOS/EOS from tokenizer.ggml.bos_token_id and
// eos_token_id when present. torch_dtype stays empty (GGUF tensors carry their own types).
// Errors: NOT_FOUND naming a missing key or tensor; UNIMPLEMENTED for another architecture,
// another rope.scaling.type or a value_length other than key_length; INVALID_ARGUMENT naming
// the file and key for inconsistent hyperparameters, a bad head_dim, scaling factor or
// rope_freqs.weight, or a token_embd.weight of the wrong shape.
absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufFile& file);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_GGUF_CONFIG_H_
