// Status propagation macros shared by every room (model is the root of the dependency graph).
#ifndef KVGRID_MODEL_STATUS_MACROS_H_
#define KVGRID_MODEL_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the Status of `expr` from the enclosing function when it is not OK.
#define KVGRID_RETURN_IF_ERROR(expr)                      \
  do {                                                    \
    ::absl::Status kvgrid_status_ = (expr);               \
    if (!kvgrid_status_.ok()) return kvgrid_status_;      \
  } while (0)

#define KVGRID_STATUS_CONCAT_INNER_(a, b) a##b
#define KVGRID_STATUS_CONCAT_(a, b) KVGRID_STATUS_CONCAT_INNER_(a, b)

// `KVGRID_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from an OK StatusOr, or returns its
// Status.
#define KVGRID_ASSIGN_OR_RETURN(lhs, expr) \
  KVGRID_ASSIGN_OR_RETURN_IMPL_(KVGRID_STATUS_CONCAT_(kvgrid_statusor_, __LINE__), lhs, expr)
#define KVGRID_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return statusor.status();            \
  lhs = *std::move(statusor)

#endif  // KVGRID_MODEL_STATUS_MACROS_H_
