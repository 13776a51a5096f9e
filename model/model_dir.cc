#include "model/model_dir.h"

#include <string>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace kvgrid::model {
namespace {

namespace fs = std::filesystem;

// `p` lies at or below `root` (both canonical).
bool Under(const fs::path& p, const fs::path& root) {
  auto r = root.begin(), q = p.begin();
  for (; r != root.end(); ++r, ++q) {
    if (q == p.end() || *q != *r) return false;
  }
  return true;
}

}  // namespace

absl::Status CheckInsideModelDir(const fs::path& dir, const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(file, ec))) return absl::OkStatus();
  const fs::path resolved = fs::canonical(file, ec);
  // A dangling link: the loader reports the file missing.
  if (ec) return absl::OkStatus();
  const fs::path root = fs::canonical(dir, ec);
  if (ec) return absl::OkStatus();
  if (Under(resolved, root)) return absl::OkStatus();
  // A Hugging Face cache snapshot: models--ORG--NAME/snapshots/REV links into ../../blobs.
  fs::path allowed = root;
  const fs::path snapshots = root.parent_path();
  const fs::path repo = snapshots.parent_path();
  if (snapshots.filename() == "snapshots" && repo.filename().string().starts_with("models--")) {
    allowed = repo;
    if (Under(resolved, repo)) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      file.string(), ": a symbolic link to ", resolved.string(), ", outside the model directory ",
      allowed.string(), "; kvgrid reads only files inside it"));
}

}  // namespace kvgrid::model
