// Test helpers for the gpu-labelled tests: a device allocation that frees itself, and the
// "is there a GPU" check every test starts with.
#ifndef KVGRID_TESTS_GPU_DEVICE_BUFFER_H_
#define KVGRID_TESTS_GPU_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace kvgrid::testing {

inline bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// `size` elements of T on the device, freed on destruction. Failures are reported as test
// failures (get() is then null), so a test never aborts on a device error.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t size) : size_(size) {
    if (size == 0) return;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, size * sizeof(T));
    EXPECT_EQ(err, cudaSuccess) << "cudaMalloc of " << size * sizeof(T) << " bytes";
    if (err == cudaSuccess) data_ = static_cast<T*>(p);
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }

  [[nodiscard]] T* get() const { return data_; }
  [[nodiscard]] size_t size() const { return size_; }

  // host.size() must equal size().
  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), size_);
    if (size_ == 0 || data_ == nullptr) return;
    ASSERT_EQ(cudaMemcpy(data_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  // Waits for all prior work on the device, then copies the buffer back.
  [[nodiscard]] std::vector<T> Download() const {
    std::vector<T> host(size_);
    if (size_ == 0 || data_ == nullptr) return host;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvgrid::testing

#endif  // KVGRID_TESTS_GPU_DEVICE_BUFFER_H_
