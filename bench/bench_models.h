// Model shapes the benchmarks share.
#ifndef KVGRID_BENCH_BENCH_MODELS_H_
#define KVGRID_BENCH_BENCH_MODELS_H_

#include "model/model_config.h"

namespace kvgrid::bench {

// Qwen2-0.5B's architecture (24 layers, hidden 896, 14 heads / 2 KV heads, head_dim 64,
// intermediate 4864, vocab 151936, tied head, q/k/v bias), for random-weight benchmarks.
inline model::ModelConfig Qwen2HalfBConfig() {
  model::ModelConfig c;
  c.model_type = "qwen2";
  c.vocab_size = 151936;
  c.hidden_size = 896;
  c.intermediate_size = 4864;
  c.num_hidden_layers = 24;
  c.num_attention_heads = 14;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 32768;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1000000.0;
  c.tie_word_embeddings = true;
  c.attention_bias = true;
  return c;
}

// Llama-3-8B's architecture (32 layers, hidden 4096, 32 heads / 8 KV heads, head_dim 128,
// intermediate 14336, vocab 128256, untied head).
inline model::ModelConfig Llama3_8BConfig() {
  model::ModelConfig c;
  c.model_type = "llama";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 8192;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  return c;
}

// Llama-3-8B's layout at a size a CPU runs in seconds (2 layers, hidden 256, 4 heads / 2 KV
// heads, head_dim 64, vocab 2048): for running a GPU benchmark's own code where no GPU is.
inline model::ModelConfig TinyLlama3Config() {
  model::ModelConfig c = Llama3_8BConfig();
  c.vocab_size = 2048;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  return c;
}

}  // namespace kvgrid::bench

#endif  // KVGRID_BENCH_BENCH_MODELS_H_
