#include "model/gguf_config.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"

namespace kvgrid::model {

absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufFile& f) {
  const std::string path = f.path().string();
  KVGRID_ASSIGN_OR_RETURN(const std::string arch, f.GetString("general.architecture"));
  if (arch != "llama" && arch != "qwen2") {
    return absl::UnimplementedError(
        absl::StrCat(path, ": architecture '", arch, "' (llama and qwen2 are supported)"));
  }
  if (f.tensors().contains("rope_freqs.weight")) {
    return absl::UnimplementedError(
        absl::StrCat(path, ": rope_freqs (RoPE scaling) is not supported"));
  }
  ModelConfig c;
  c.model_type = arch;
  KVGRID_ASSIGN_OR_RETURN(c.hidden_size, f.GetInt(arch + ".embedding_length"));
  KVGRID_ASSIGN_OR_RETURN(c.intermediate_size, f.GetInt(arch + ".feed_forward_length"));
  KVGRID_ASSIGN_OR_RETURN(c.num_hidden_layers, f.GetInt(arch + ".block_count"));
  KVGRID_ASSIGN_OR_RETURN(c.num_attention_heads, f.GetInt(arch + ".attention.head_count"));
  c.num_key_value_heads =
      f.GetInt(arch + ".attention.head_count_kv").value_or(c.num_attention_heads);
  KVGRID_ASSIGN_OR_RETURN(c.max_position_embeddings, f.GetInt(arch + ".context_length"));
  KVGRID_ASSIGN_OR_RETURN(c.rms_norm_eps,
                          f.GetFloat(arch + ".attention.layer_norm_rms_epsilon"));
  c.rope_theta = f.GetFloat(arch + ".rope.freq_base").value_or(10000.0);
  KVGRID_ASSIGN_OR_RETURN(const GgufTensor* embed, f.Find("token_embd.weight"));
  if (embed->ne.size() != 2 || embed->ne[0] != c.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": token_embd.weight is not [vocab, ", c.hidden_size, "]"));
  }
  c.vocab_size = embed->ne[1];
  if (c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.hidden_size <= 0 ||
      c.num_attention_heads % c.num_key_value_heads != 0 || c.num_hidden_layers <= 0 ||
      c.num_hidden_layers > 1024 || c.intermediate_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": inconsistent hyperparameters"));
  }
  c.head_dim =
      f.GetInt(arch + ".attention.key_length").value_or(c.hidden_size / c.num_attention_heads);
  // llama.cpp writes Mistral's window for every layer.
  if (auto window = f.GetInt(arch + ".attention.sliding_window"); window.ok() && *window > 0) {
    c.sliding_window = *window;
    c.sliding_layers.assign(c.num_hidden_layers, true);
  }
  c.tie_word_embeddings = !f.tensors().contains("output.weight");
  c.attention_bias = f.tensors().contains("blk.0.attn_q.bias");
  if (auto bos = f.GetInt("tokenizer.ggml.bos_token_id"); bos.ok()) c.bos_token_id = *bos;
  if (auto eos = f.GetInt("tokenizer.ggml.eos_token_id"); eos.ok()) c.eos_token_ids = {*eos};
  return c;
}

}  // namespace kvgrid::model
