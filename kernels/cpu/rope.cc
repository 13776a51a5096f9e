#include "kernels/cpu/rope.h"

#include <algorithm>
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
  const model::RopeScaling& s = config.rope_scaling;
  const int64_t half = d / 2;
  if (!s.freq_divisors.empty() && static_cast<int64_t>(s.freq_divisors.size()) != half) {
    return absl::InvalidArgumentError(absl::StrCat("rope_freqs: ", s.freq_divisors.size(),
                                                   " divisors for head_dim / 2 = ", half));
  }
  double theta = config.rope_theta;
  if (s.type == model::RopeScalingType::kDynamic) {
    if (!(s.factor > 0) || d <= 2) {
      return absl::InvalidArgumentError(
          "rope_scaling (dynamic): need factor > 0 and head_dim > 2");
    }
    // vLLM's fixed NTK scaling: transformers' per-length formula evaluated at a sequence of
    // original * factor positions, where factor * len / original - (factor - 1) is
    // factor^2 - factor + 1.
    theta *= std::pow(s.factor * s.factor - s.factor + 1.0,
                      static_cast<double>(d) / static_cast<double>(d - 2));
  }
  std::vector<double> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / d);
    if (!s.freq_divisors.empty()) {
      if (!(s.freq_divisors[i] > 0)) {
        return absl::InvalidArgumentError(absl::StrCat("rope_freqs[", i, "] must be > 0"));
      }
      inv_freq[i] /= s.freq_divisors[i];
    }
  }
  switch (s.type) {
    case model::RopeScalingType::kDynamic:  // the base above
      break;
    case model::RopeScalingType::kYarn: {
      if (!(s.factor > 0) || s.original_max_position_embeddings <= 0 ||
          !(s.beta_fast > s.beta_slow) || !(s.beta_slow > 0)) {
        return absl::InvalidArgumentError(
            "rope_scaling (yarn): need factor > 0, original_max_position_embeddings > 0 and "
            "beta_fast > beta_slow > 0");
      }
      // The dimension (of d) at which a wavelength fits `rotations` times into the original
      // context: d * ln(original / (2 pi rotations)) / (2 ln theta).
      const double orig = static_cast<double>(s.original_max_position_embeddings);
      const auto dim_of = [&](double rotations) {
        return static_cast<double>(d) * std::log(orig / (rotations * 2.0 * std::numbers::pi)) /
               (2.0 * std::log(config.rope_theta));
      };
      double low = dim_of(s.beta_fast), high = dim_of(s.beta_slow);
      if (!std::isfinite(low) || !std::isfinite(high)) {  // theta 1, or a degenerate context
        return absl::InvalidArgumentError(absl::StrCat(
            "rope_scaling (yarn): no correction range for rope_theta ", config.rope_theta,
            " and original_max_position_embeddings ", s.original_max_position_embeddings));
      }
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(d - 1));
      if (low == high) high += 0.001;  // a step instead of a ramp
      for (int64_t i = 0; i < half; ++i) {
        // ramp 0: the frequency kept (extrapolated); 1: divided by factor (interpolated).
        const double ramp =
            std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double keep = 1.0 - ramp;
        inv_freq[i] = inv_freq[i] / s.factor * (1.0 - keep) + inv_freq[i] * keep;
      }
      break;
    }
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

double RopeAttentionFactor(const model::ModelConfig& config) {
  const model::RopeScaling& s = config.rope_scaling;
  if (s.type != model::RopeScalingType::kYarn) return 1.0;
  if (s.attention_factor > 0) return s.attention_factor;
  const auto mscale = [&](double m) {
    return s.factor <= 1.0 ? 1.0 : 0.1 * m * std::log(s.factor) + 1.0;
  };
  if (s.mscale > 0 && s.mscale_all_dim > 0) return mscale(s.mscale) / mscale(s.mscale_all_dim);
  return mscale(1.0);
}

absl::Status RopeParams::Validate() const {
  if ((!query && num_heads > 0) || (!key && num_kv_heads > 0) || !positions || !inv_freq) {
    return absl::InvalidArgumentError("RopeParams: null pointer");
  }
  if (num_tokens < 0 || num_heads < 0 || num_kv_heads < 0 || head_dim <= 0 || head_dim % 2) {
    return absl::InvalidArgumentError("RopeParams: sizes out of range (head_dim must be even)");
  }
  if (!(scale > 0) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat("RopeParams.scale must be > 0: ", scale));
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
        cos_t[i] = static_cast<float>(std::cos(angle) * p.scale);
        sin_t[i] = static_cast<float>(std::sin(angle) * p.scale);
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
