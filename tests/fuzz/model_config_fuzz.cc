// libFuzzer target for the config.json and generation_config.json parsers.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "model/generation_config.h"
#include "model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = kvgrid::model::ParseModelConfig(text, "config.json");
  if (config.ok()) {
    // What the parser promises to everyone downstream of it.
    if (config->num_key_value_heads <= 0 || config->head_dim <= 0 || config->head_dim % 2 != 0 ||
        config->num_attention_heads % config->num_key_value_heads != 0 || config->vocab_size <= 0 ||
        !(config->rms_norm_eps > 0)) {
      std::abort();
    }
  }
  (void)kvgrid::model::ParseGenerationConfig(text, "generation_config.json");
  return 0;
}
