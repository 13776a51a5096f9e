// Prometheus metrics: counters, gauges and histograms with fixed label values, grouped into
// families, rendered in the Prometheus text exposition format (version 0.0.4).
//
// A family is created once per name (with its help text and type); each labelled series is
// created once and then updated lock-free. Gauges whose value lives elsewhere (engine or
// registry statistics) are set from a collect callback run before each render.
//
// Thread-safety: everything may be used from any thread.
#ifndef KVGRID_METRICS_METRICS_H_
#define KVGRID_METRICS_METRICS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvgrid::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Increment(double by = 1.0);
  // For a total counted elsewhere (a worker's engine statistics): mirrors its value.
  void SetTotal(double total) { value_.store(total, std::memory_order_relaxed); }
  [[nodiscard]] double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double by);
  [[nodiscard]] double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: upper bounds of the buckets, increasing; +Inf is implied.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  // Cumulative counts per bound (then +Inf), the sum and the count.
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // bounds.size() + 1 entries
    double sum = 0;
    uint64_t count = 0;
  };
  [[nodiscard]] Snapshot Read() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

class Registry {
 public:
  // The series of family `name` with `labels`, created on first use. A name keeps the type
  // it was first created with (a mismatch is a programming error and aborts).
  Counter* GetCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bounds, const Labels& labels = {});

  // Runs before every Render, e.g. to copy engine statistics into gauges.
  void AddCollector(std::function<void()> collect);

  // Every family in the text exposition format.
  [[nodiscard]] std::string Render();

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Series {
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
  };
  struct Family {
    Type type;
    std::string help;
    std::map<std::string, Series> series;  // by rendered label set
  };
  Family& FamilyLocked(const std::string& name, const std::string& help, Type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
};

// Latency buckets (seconds) as vLLM uses for time-to-first-token, inter-token and end-to-end
// latency, so dashboards built for it read ours.
std::vector<double> TtftBuckets();
std::vector<double> InterTokenBuckets();
std::vector<double> RequestLatencyBuckets();

}  // namespace kvgrid::metrics

#endif  // KVGRID_METRICS_METRICS_H_
