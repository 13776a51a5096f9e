// The Worker gRPC service (proto/kvgrid/v1/worker.proto) over an EngineLoop: Generate streams
// a request's tokens as the engine produces them, coalescing tokens while a write is in
// flight; cancelling the call aborts the request; Abort and GetStats are unary.
//
// Thread-safety: all methods may be called concurrently (gRPC's callback threads).
#ifndef KVGRID_WORKER_SERVICE_WORKER_SERVICE_H_
#define KVGRID_WORKER_SERVICE_WORKER_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "auth/bearer_auth.h"
#include "kvgrid/v1/worker.grpc.pb.h"
#include "worker/engine/engine.h"
#include "worker/service/engine_loop.h"

namespace kvgrid::worker {

class WorkerService final : public v1::Worker::CallbackService {
 public:
  // `loop` and `cluster` are not owned and must outlive the service (and the server running
  // it). When `cluster` holds a token every call must present it (UNAUTHENTICATED otherwise),
  // so only the coordinator can use the worker. A Generate call finding `max_num_seqs` +
  // `max_queue_depth` requests already running or waiting is refused with
  // RESOURCE_EXHAUSTED: coordinators count only the requests they placed themselves, so with
  // several of them this is the bound that holds.
  WorkerService(EngineLoop* loop, const auth::BearerAuth* cluster, v1::KvCapacity capacity,
                int32_t max_num_seqs, int64_t max_queue_depth = 64);

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::WorkerGenerateRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;

  // While draining, new Generate calls get UNAVAILABLE; running ones go on.
  void SetDraining(bool draining) { draining_.store(draining); }
  [[nodiscard]] bool draining() const { return draining_.load(); }
  // While the engine is stalled (worker/service/stall_watchdog.h), new Generate calls get
  // UNAVAILABLE naming the stall.
  void SetStalled(bool stalled) { stalled_.store(stalled); }
  [[nodiscard]] bool stalled() const { return stalled_.load(); }

 private:
  EngineLoop* loop_;
  const auth::BearerAuth* cluster_;
  v1::KvCapacity capacity_;
  int32_t max_num_seqs_;
  int64_t max_queue_depth_;
  std::atomic<bool> draining_{false};
  std::atomic<bool> stalled_{false};
};

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_WORKER_SERVICE_H_
