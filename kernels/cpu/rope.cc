#include "kernels/cpu/rope.h"

#include <cmath>
#include <numbers>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvgrid::kernels::cpu {

absl::StatusOr<std::vector<double>> RopeInvFreq(const model::ModelConfig& config) {
  const int64_t d = config.head_dim;
  if (d <= 0 || d % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be positive and even for RoPE, got ", d));
  }
  if (!(config.rope_theta > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("rope_theta must be > 0, got ",
                                                   config.rope_theta));
  }
  std::vector<double> inv_freq(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) {
    inv_freq[i] = 1.0 / std::pow(config.rope_theta, static_cast<double>(2 * i) / d);
  }
  const model::RopeScaling& s = config.rope_scaling;
  switch (s.type) {
    case model::RopeScalingType::kNone:
      break;
    case model::RopeScalingType::kLinear:
      if (!(s.factor > 0)) return absl::InvalidArgumentError("rope_scaling.factor must be > 0");
      for (double& f : inv_freq) f /= s.factor;
      break;
    case model::RopeScalingType::kLlama3: {
      if (!(s.factor > 0) || !(s.high_freq_factor > s.low_freq_factor) ||
          s.original_max_position_embeddings <= 0 || !(s.low_freq_factor > 0)) {
        return absl::InvalidArgumentError(
            "rope_scaling (llama3): need factor > 0, high_freq_factor > low_freq_factor > 0 and "
            "original_max_position_embeddings > 0");
      }
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const double low_freq_wavelen = old_len / s.low_freq_factor;
      const double high_freq_wavelen = old_len / s.high_freq_factor;
      for (double& f : inv_freq) {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen < high_freq_wavelen) continue;  // high frequencies are kept
        if (wavelen > low_freq_wavelen) {           // low frequencies are interpolated
          f /= s.factor;
          continue;
        }
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1.0 - smooth) * f / s.factor + smooth * f;
      }
      break;
    }
  }
  return inv_freq;
}

absl::Status RopeParams::Validate() const {
  if ((!query && num_heads > 0) || (!key && num_kv_heads > 0) || !positions || !inv_freq) {
    return absl::InvalidArgumentError("RopeParams: null pointer");
  }
  if (num_tokens < 0 || num_heads < 0 || num_kv_heads < 0 || head_dim <= 0 || head_dim % 2) {
    return absl::InvalidArgumentError("RopeParams: sizes out of range (head_dim must be even)");
  }
  return absl::OkStatus();
}

namespace {

void Rotate(float* x, const float* cos_t, const float* sin_t, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i];
    const float b = x[i + half];
    x[i] = a * cos_t[i] - b * sin_t[i];
    x[i + half] = b * cos_t[i] + a * sin_t[i];
  }
}

}  // namespace

absl::Status Rope(const RopeParams& p) {
  if (absl::Status s = p.Validate(); !s.ok()) return s;
  const int64_t half = p.head_dim / 2;
#pragma omp parallel if (p.num_tokens > 1)
  {
    std::vector<float> cos_t(half), sin_t(half);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      const double pos = static_cast<double>(p.positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * p.inv_freq[i];
        cos_t[i] = static_cast<float>(std::cos(angle));
        sin_t[i] = static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < p.num_heads; ++h) {
        Rotate(p.query + (t * p.num_heads + h) * p.head_dim, cos_t.data(), sin_t.data(), half);
      }
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        Rotate(p.key + (t * p.num_kv_heads + h) * p.head_dim, cos_t.data(), sin_t.data(), half);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvgrid::kernels::cpu
