// Test helper: a tensor-parallel group inside one process, its ranks on threads joined by Gloo
// over loopback through an in-memory store (the unit tests' CPU groups, and the gpu tests'
// host collectives).
#ifndef KVGRID_TESTS_UNIT_COMM_GLOO_GROUP_H_
#define KVGRID_TESTS_UNIT_COMM_GLOO_GROUP_H_

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "gloo/rendezvous/hash_store.h"
#include "gtest/gtest.h"
#include "worker/comm/gloo_communicator.h"

namespace kvgrid::testing {

// Runs `body(rank, comm)` on `size` threads and joins them. A rank that cannot connect fails
// the test; a collective a peer never joins fails after `timeout`.
inline void RunGroup(int size, const std::function<void(int, worker::Communicator&)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  gloo::rendezvous::HashStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto comm = worker::GlooCommunicator::Connect(r, size, store, "127.0.0.1", timeout);
      ASSERT_TRUE(comm.ok()) << comm.status();
      body(r, **comm);
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace kvgrid::testing

#endif  // KVGRID_TESTS_UNIT_COMM_GLOO_GROUP_H_
