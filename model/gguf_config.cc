#include "model/gguf_config.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/status_macros.h"

namespace kvgrid::model {
namespace {

// <arch>.rope.scaling.* and rope_freqs.weight, as llama.cpp's converter writes them: linear and
// yarn scaling carry a type and a factor (yarn also the original context); Llama 3.1's
// frequency-dependent scaling is a tensor of per-frequency divisors instead of keys.
absl::Status ReadRopeScaling(const GgufFile& f, const std::string& arch, ModelConfig* c) {
  const std::string path = f.path().string();
  const std::string key = arch + ".rope.scaling.";
  RopeScaling& s = c->rope_scaling;
  double factor = f.GetFloat(key + "factor").value_or(0.0);
  if (factor == 0.0) factor = f.GetFloat(arch + ".rope.scale_linear").value_or(0.0);  // old name
  // As in llama.cpp, a factor without a type is linear scaling.
  std::string type = f.GetString(key + "type").value_or(factor != 0.0 ? "linear" : "none");
  if (type == "linear" && (factor == 0.0 || factor == 1.0)) type = "none";
  if (type == "none") {
    s.type = RopeScalingType::kNone;
  } else if (type == "linear" || type == "yarn") {
    if (!(factor > 0) || !std::isfinite(factor)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", key, "factor: ", factor, " must be positive"));
    }
    s.factor = factor;
    s.type = type == "yarn" ? RopeScalingType::kYarn : RopeScalingType::kLinear;
    if (type == "yarn") {
      s.original_max_position_embeddings =
          f.GetInt(key + "original_context_length").value_or(c->max_position_embeddings);
      s.beta_fast = f.GetFloat(key + "yarn_beta_fast").value_or(32.0);
      s.beta_slow = f.GetFloat(key + "yarn_beta_slow").value_or(1.0);
      // The converter writes transformers' attention_factor as yarn_attn_factor; attn_factor
      // multiplies whatever mscale results, as in llama.cpp.
      s.attention_factor = f.GetFloat(key + "yarn_attn_factor").value_or(0.0);
      const double extra = f.GetFloat(key + "attn_factor").value_or(1.0);
      if (extra != 1.0) {
        const double base = s.attention_factor > 0 ? s.attention_factor
                                                   : 0.1 * std::log(s.factor) + 1.0;
        s.attention_factor = base * extra;
      }
      if (s.original_max_position_embeddings <= 0 || !(s.beta_fast > s.beta_slow) ||
          !(s.beta_slow > 0) || s.attention_factor < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": ", key, "*: yarn needs original_context_length > 0, yarn_beta_fast > "
            "yarn_beta_slow > 0 and yarn_attn_factor >= 0"));
      }
    }
  } else {
    return absl::UnimplementedError(absl::StrCat(path, ": ", key, "type '", type,
                                                 "' (supported: none, linear, yarn)"));
  }
  auto it = f.tensors().find("rope_freqs.weight");
  if (it == f.tensors().end()) return absl::OkStatus();
  const GgufTensor& t = it->second;
  const int64_t half = c->head_dim / 2;
  if (t.type != GgmlType::kF32 || t.ne.size() != 1 || t.ne[0] != half) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": rope_freqs.weight must be F32 [", half, "] (head_dim / 2), got ",
        GgmlTypeName(t.type), " of ", t.NumElements(), " elements"));
  }
  std::vector<float> values(static_cast<size_t>(half));
  std::memcpy(values.data(), t.data.data(), values.size() * sizeof(float));
  s.freq_divisors.assign(values.begin(), values.end());
  for (int64_t i = 0; i < half; ++i) {
    if (!(s.freq_divisors[i] > 0) || !std::isfinite(s.freq_divisors[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": rope_freqs.weight[", i, "] = ", s.freq_divisors[i], " must be positive"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfigFromGguf(const GgufFile& f) {
  const std::string path = f.path().string();
  KVGRID_ASSIGN_OR_RETURN(const std::string arch, f.GetString("general.architecture"));
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3") {
    return absl::UnimplementedError(absl::StrCat(
        path, ": architecture '", arch, "' (llama, qwen2 and qwen3 are supported)"));
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
  // Qwen3 (and Mistral-Nemo) state head_dim; it need not be hidden / heads.
  const absl::StatusOr<int64_t> key_length = f.GetInt(arch + ".attention.key_length");
  if (!key_length.ok() && c.hidden_size % c.num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", arch, ".attention.key_length is absent and embedding_length ",
        c.hidden_size, " is not a multiple of head_count ", c.num_attention_heads));
  }
  c.head_dim = key_length.value_or(c.hidden_size / c.num_attention_heads);
  if (c.head_dim <= 0 || c.head_dim % 2 != 0 || c.head_dim > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": ", arch, ".attention.key_length: ", c.head_dim, " must be even, in (0, 1024]"));
  }
  if (auto value_length = f.GetInt(arch + ".attention.value_length");
      value_length.ok() && *value_length != c.head_dim) {
    return absl::UnimplementedError(absl::StrCat(
        path, ": ", arch, ".attention.value_length ", *value_length, " differs from key_length ",
        c.head_dim, " (one head_dim for K and V is supported)"));
  }
  KVGRID_RETURN_IF_ERROR(ReadRopeScaling(f, arch, &c));
  c.max_position_embeddings = ScaledContextLength(c.rope_scaling, c.max_position_embeddings);
  c.qk_norm = arch == "qwen3";
  // llama.cpp writes Mistral's window for every layer.
  if (auto window = f.GetInt(arch + ".attention.sliding_window"); window.ok() && *window > 0) {
    c.sliding_window = *window;
    c.sliding_layers.assign(c.num_hidden_layers, true);
  }
  c.tie_word_embeddings = !f.tensors().contains("output.weight");
  c.attention_bias = f.tensors().contains("blk.0.attn_q.bias");
  // The embedding's rows are the vocabulary: a token list or a stated vocab_size that
  // disagrees means ids the model cannot embed (or tokens it cannot produce), as llama.cpp,
  // which sizes token_embd by the token list, also refuses.
  if (auto tokens = f.GetStringArray("tokenizer.ggml.tokens"); tokens.ok()) {
    if (static_cast<int64_t>((*tokens)->size()) != c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tokenizer.ggml.tokens has ", (*tokens)->size(),
          " entries but token_embd.weight has ", c.vocab_size, " rows"));
    }
  }
  if (auto stated = f.GetInt(arch + ".vocab_size"); stated.ok() && *stated != c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", arch, ".vocab_size ", *stated,
                                                   " differs from token_embd.weight's ",
                                                   c.vocab_size, " rows"));
  }
  for (const char* key : {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                          "tokenizer.ggml.padding_token_id"}) {
    absl::StatusOr<int64_t> id = f.GetInt(key);
    if (!id.ok()) continue;
    if (*id < 0 || *id >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " ", *id,
                                                     " is outside the vocabulary [0, ",
                                                     c.vocab_size, ")"));
    }
  }
  if (auto bos = f.GetInt("tokenizer.ggml.bos_token_id"); bos.ok()) c.bos_token_id = *bos;
  if (auto eos = f.GetInt("tokenizer.ggml.eos_token_id"); eos.ok()) c.eos_token_ids = {*eos};
  return c;
}

}  // namespace kvgrid::model
