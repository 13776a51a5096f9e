// Minimal `--flag value` / `--flag=value` parsing for the kvgrid subcommands.
//
// Every flag a subcommand reads must be declared by reading it; Finish() then reports any
// flag the user gave that nothing read, so typos are errors rather than silently ignored.
#ifndef KVGRID_TOOLS_KVGRID_ARGS_H_
#define KVGRID_TOOLS_KVGRID_ARGS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvgrid::cli {

class Args {
 public:
  // Parses argv[first..argc). Errors: INVALID_ARGUMENT for a positional argument or a flag
  // given twice.
  static absl::StatusOr<Args> Parse(int argc, char** argv, int first);

  // Flags not on the command line are then read from the environment: --max-num-seqs from
  // <prefix>MAX_NUM_SEQS (e.g. KVGRID_MAX_NUM_SEQS), as containers are configured.
  void UseEnvironment(std::string prefix) { env_prefix_ = std::move(prefix); }

  bool Has(const std::string& name);
  // Boolean flag: present without value, or with value true/false/1/0.
  absl::StatusOr<bool> GetBool(const std::string& name, bool fallback);
  std::optional<std::string> GetString(const std::string& name);
  absl::StatusOr<std::optional<int64_t>> GetInt(const std::string& name);
  absl::StatusOr<std::optional<double>> GetDouble(const std::string& name);
  // Comma-separated integers, e.g. "1,2,3".
  absl::StatusOr<std::optional<std::vector<int32_t>>> GetIntList(const std::string& name);

  // INVALID_ARGUMENT naming every flag that was given but never read.
  absl::Status Finish() const;

 private:
  // The flag's value from the command line, else the environment: nullopt when absent, an
  // empty inner optional for a bare flag.
  std::optional<std::optional<std::string>> Find(const std::string& name) const;

  std::map<std::string, std::optional<std::string>> values_;
  std::set<std::string> read_;
  std::string env_prefix_;
};

// The shared shell of a subcommand: prints `help` for --help, else runs `body` and maps its
// Status to an exit code (0 ok, 2 INVALID_ARGUMENT, 1 otherwise) with the message on stderr
// as "kvgrid <name>: <message>".
int RunSubcommand(Args& args, const char* name, const char* help,
                  absl::Status (*body)(Args& args));

}  // namespace kvgrid::cli

#endif  // KVGRID_TOOLS_KVGRID_ARGS_H_
