#include "metrics/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"

namespace kvgrid::metrics {
namespace {

void AtomicAdd(std::atomic<double>& a, double by) {
  double old = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(old, old + by, std::memory_order_relaxed)) {
  }
}

std::string EscapeLabel(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// `{a="x",b="y"}` (empty for no labels), optionally with one more label appended.
std::string RenderLabels(const Labels& labels, const std::string& extra_key = "",
                         const std::string& extra_value = "") {
  Labels all = labels;
  if (!extra_key.empty()) all.emplace_back(extra_key, extra_value);
  if (all.empty()) return "";
  std::string s = "{";
  for (size_t i = 0; i < all.size(); ++i) {
    if (i > 0) s += ",";
    absl::StrAppend(&s, all[i].first, "=\"", EscapeLabel(all[i].second), "\"");
  }
  return s + "}";
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

}  // namespace

void Counter::Increment(double by) { AtomicAdd(value_, by); }
void Gauge::Add(double by) { AtomicAdd(value_, by); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();  // first >= v
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.bounds = bounds_;
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += counts_[i].load(std::memory_order_relaxed);
    s.cumulative.push_back(acc);
  }
  s.sum = sum_.load(std::memory_order_relaxed);
  s.count = acc;
  return s;
}

Registry::Family& Registry::FamilyLocked(const std::string& name, const std::string& help,
                                         Type type) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
  }
  ABSL_RAW_CHECK(it->second.type == type, "a metric name was reused with another type");
  return it->second;
}

Counter* Registry::GetCounter(const std::string& name, const std::string& help,
                              const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = FamilyLocked(name, help, Type::kCounter).series[RenderLabels(labels)];
  if (!s.counter) {
    s.labels = labels;
    s.counter = std::make_unique<Counter>();
  }
  return s.counter.get();
}

Gauge* Registry::GetGauge(const std::string& name, const std::string& help,
                          const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = FamilyLocked(name, help, Type::kGauge).series[RenderLabels(labels)];
  if (!s.gauge) {
    s.labels = labels;
    s.gauge = std::make_unique<Gauge>();
  }
  return s.gauge.get();
}

Histogram* Registry::GetHistogram(const std::string& name, const std::string& help,
                                  const std::vector<double>& bounds, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = FamilyLocked(name, help, Type::kHistogram).series[RenderLabels(labels)];
  if (!s.histogram) {
    s.labels = labels;
    s.histogram = std::make_unique<Histogram>(bounds);
  }
  return s.histogram.get();
}

void Registry::AddCollector(std::function<void()> collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::string Registry::Render() {
  std::vector<std::function<void()>> collectors;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c();
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter"
                       : f.type == Type::kGauge ? "gauge"
                                                : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, s] : f.series) {
      if (s.counter) absl::StrAppend(&out, name, labels, " ", Number(s.counter->value()), "\n");
      if (s.gauge) absl::StrAppend(&out, name, labels, " ", Number(s.gauge->value()), "\n");
      if (!s.histogram) continue;
      const Histogram::Snapshot h = s.histogram->Read();
      for (size_t i = 0; i <= h.bounds.size(); ++i) {
        const double le = i < h.bounds.size() ? h.bounds[i] : INFINITY;
        absl::StrAppend(&out, name, "_bucket", RenderLabels(s.labels, "le", Number(le)), " ",
                        h.cumulative[i], "\n");
      }
      absl::StrAppend(&out, name, "_sum", labels, " ", Number(h.sum), "\n");
      absl::StrAppend(&out, name, "_count", labels, " ", h.count, "\n");
    }
  }
  return out;
}

std::vector<double> TtftBuckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> InterTokenBuckets() {
  return {0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
          0.15,  0.2,   0.3,  0.4,   0.5,  0.75,  1.0,  2.5,  5.0,   7.5,   10.0, 20.0, 40.0, 80.0};
}

std::vector<double> RequestLatencyBuckets() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,  2.5,   5.0,   10.0,  15.0, 20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

}  // namespace kvgrid::metrics
