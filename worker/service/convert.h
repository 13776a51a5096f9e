// Conversions between the wire messages of proto/kvgrid/v1 and the engine's structs. Unset
// optional fields take the engine's defaults (temperature 1, top_p 1, repetition penalty 1,
// max_new_tokens 16, no logprobs); validation stays with the engine.
#ifndef KVGRID_WORKER_SERVICE_CONVERT_H_
#define KVGRID_WORKER_SERVICE_CONVERT_H_

#include "kvgrid/v1/generation.pb.h"
#include "kvgrid/v1/worker.pb.h"
#include "worker/engine/engine.h"
#include "worker/executor/sampler.h"

namespace kvgrid::worker {

SamplingParams SamplingFromProto(const v1::SamplingParams& p);
StoppingParams StoppingFromProto(const v1::StoppingParams& p);
void SamplingToProto(const SamplingParams& s, v1::SamplingParams* p);
void StoppingToProto(const StoppingParams& s, v1::StoppingParams* p);

// The engine request for a worker request (ids, n, priority, resume tokens included).
GenerationRequest RequestFromProto(const v1::WorkerGenerateRequest& p);

v1::FinishReason FinishReasonToProto(FinishReason reason);

// Appends `out` (one token of continuation out.index) to `msg`: token id, text, logprob, and
// on the finishing output the finish reason, usage and timings.
void AppendOutput(const TokenOutput& out, v1::GenerateResponse* msg);

v1::KvCapacity CapacityToProto(const EngineStats& stats, const EngineOptions& options,
                               int64_t max_model_len);
v1::KvUsage UsageToProto(const EngineStats& stats);

}  // namespace kvgrid::worker

#endif  // KVGRID_WORKER_SERVICE_CONVERT_H_
