#include "worker/comm/gloo_worker_group.h"

#include "absl/strings/str_cat.h"
#include "gloo/rendezvous/prefix_store.h"
#include "model/status_macros.h"
#include "worker/comm/gloo_communicator.h"

namespace kvgrid::worker {

absl::StatusOr<std::unique_ptr<GlooWorkerGroup>> GlooWorkerGroup::Connect(
    int rank, int tp_size, int cp_size, gloo::rendezvous::Store& store,
    const std::string& hostname, std::chrono::milliseconds timeout,
    std::chrono::milliseconds join_timeout) {
  if (tp_size < 1 || cp_size < 1 || tp_size * cp_size < 2 || rank < 0 ||
      rank >= tp_size * cp_size) {
    return absl::InvalidArgumentError(absl::StrCat("worker group: rank ", rank, " of ",
                                                   tp_size, " x ", cp_size, " ranks"));
  }
  std::unique_ptr<GlooWorkerGroup> g(new GlooWorkerGroup());
  g->tp_rank_ = rank % tp_size;
  g->cp_rank_ = rank / tp_size;
  gloo::rendezvous::PrefixStore whole("group", store);
  KVGRID_ASSIGN_OR_RETURN(g->group_, GlooCommunicator::Connect(rank, tp_size * cp_size, whole,
                                                               hostname, timeout, join_timeout));
  if (tp_size > 1 && cp_size > 1) {
    gloo::rendezvous::PrefixStore tp(absl::StrCat("tp", g->cp_rank_), store);
    KVGRID_ASSIGN_OR_RETURN(g->tp_, GlooCommunicator::Connect(g->tp_rank_, tp_size, tp, hostname,
                                                              timeout, join_timeout));
    gloo::rendezvous::PrefixStore cp(absl::StrCat("cp", g->tp_rank_), store);
    KVGRID_ASSIGN_OR_RETURN(g->cp_, GlooCommunicator::Connect(g->cp_rank_, cp_size, cp, hostname,
                                                              timeout, join_timeout));
    g->tp_view_ = g->tp_.get();
    g->cp_view_ = g->cp_.get();
  } else if (tp_size > 1) {
    g->tp_view_ = g->group_.get();
  } else {
    g->cp_view_ = g->group_.get();
  }
  return g;
}

}  // namespace kvgrid::worker
