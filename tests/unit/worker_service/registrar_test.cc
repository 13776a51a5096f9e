// The registrar with several coordinators: it registers and heartbeats with each on its own,
// so one that never answers does not delay the others; a coordinator that forgets the worker
// (a restart) gets it registered again at once.
#include "worker/service/registrar.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace kvgrid::worker {
namespace {

// A coordinator that counts registrations and heartbeats; `forget` makes it answer the next
// heartbeat as unknown, as a restarted coordinator does.
class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest*,
                              v1::RegisterWorkerResponse* response) override {
    const int n = ++registrations;
    response->set_worker_id(absl::StrCat("w", n));
    response->set_heartbeat_interval_ms(50);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    ++heartbeats;
    response->set_known(!forget.exchange(false) &&
                        request->worker_id() == absl::StrCat("w", registrations.load()));
    return grpc::Status::OK;
  }
  std::atomic<int> registrations{0};
  std::atomic<int> heartbeats{0};
  std::atomic<bool> forget{false};
};

struct Server {
  FakeCoordinator service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  Server() {
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    server = b.BuildAndStart();
    address = absl::StrCat("127.0.0.1:", port);
  }
  ~Server() { server->Shutdown(std::chrono::system_clock::now()); }
};

// A TCP port that accepts connections and never answers: a coordinator that hangs.
struct BlackHole {
  int fd = -1;
  std::string address;
  BlackHole() {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(listen(fd, 16), 0);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    address = absl::StrCat("127.0.0.1:", ntohs(a.sin_port));
  }
  ~BlackHole() { close(fd); }
};

v1::RegisterWorkerRequest Registration() {
  v1::RegisterWorkerRequest r;
  r.set_address("127.0.0.1:1");
  r.set_model("tiny");
  return r;
}

bool WaitFor(const std::function<bool()>& f, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (f()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return f();
}

TEST(RegistrarTest, RegistersWithEveryCoordinator) {
  Server a, b;
  Registrar r({a.address, b.address}, "", Registration(), [] { return v1::KvUsage(); },
              [] { return false; });
  ASSERT_TRUE(WaitFor([&] { return !r.worker_id(0).empty() && !r.worker_id(1).empty(); },
                      absl::Seconds(10)));
  EXPECT_TRUE(WaitFor([&] { return a.service.heartbeats >= 3 && b.service.heartbeats >= 3; },
                      absl::Seconds(10)));
  EXPECT_EQ(a.service.registrations, 1);
  EXPECT_EQ(b.service.registrations, 1);
  r.Stop();
}

TEST(RegistrarTest, AHangingCoordinatorDoesNotDelayTheOthersHeartbeats) {
  BlackHole hole;
  Server live;
  Registrar r({hole.address, live.address}, "", Registration(), [] { return v1::KvUsage(); },
              [] { return false; });
  ASSERT_TRUE(WaitFor([&] { return !r.worker_id(1).empty(); }, absl::Seconds(10)));
  // The hanging coordinator's calls wait out their 2 s deadline; the live one's heartbeats
  // (every 50 ms) must go on meanwhile: 1 s holds about 20.
  const int before = live.service.heartbeats;
  absl::SleepFor(absl::Seconds(1));
  EXPECT_GE(live.service.heartbeats - before, 8);
  EXPECT_TRUE(r.worker_id(0).empty());
  r.Stop();
}

TEST(RegistrarTest, RegistersAgainAtOnceWhenForgotten) {
  Server a;
  Registrar r({a.address}, "", Registration(), [] { return v1::KvUsage(); },
              [] { return false; });
  ASSERT_TRUE(WaitFor([&] { return a.service.registrations == 1; }, absl::Seconds(10)));
  a.service.forget = true;
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(WaitFor([&] { return a.service.registrations == 2; }, absl::Seconds(10)));
  // Within one heartbeat (50 ms) of the unknown answer, with slack for a loaded machine.
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(1000));
  // The coordinator counts the registration before its answer reaches the registrar.
  EXPECT_TRUE(WaitFor([&] { return r.worker_id(0) == "w2"; }, absl::Seconds(10)))
      << r.worker_id(0);
  r.Stop();
}

}  // namespace
}  // namespace kvgrid::worker
