// Which files of a model directory kvgrid will read: a file found in a directory (by its fixed
// name — config.json, tokenizer.json, model.safetensors, ... — or through the index's
// weight_map) must, once every symbolic link is followed, lie inside that directory. A link
// inside the directory is fine; one that leaves it (to /etc/shadow, to another user's files)
// is refused naming the file, so a downloaded directory cannot make a server read or serve
// what lies outside it.
//
// The one exception is the Hugging Face cache, whose snapshots are links into the repository's
// blob store: when the directory is `.../models--ORG--NAME/snapshots/REV`, files may resolve
// anywhere under `.../models--ORG--NAME/` (its blobs/). A file the operator names explicitly
// (a .gguf path, a config.json path) is taken as given; only what is found inside a directory
// is checked.
//
// Thread-safety: stateless functions.
#ifndef KVGRID_MODEL_MODEL_DIR_H_
#define KVGRID_MODEL_MODEL_DIR_H_

#include <filesystem>

#include "absl/status/status.h"

namespace kvgrid::model {

// OK when `file` (a path inside `dir`, which need not exist) resolves inside `dir` (or, for a
// Hugging Face snapshot, inside its cache repository), or does not exist (the loader then
// reports it missing). Errors: INVALID_ARGUMENT naming the file, where its links lead, and the
// directory it must stay in.
absl::Status CheckInsideModelDir(const std::filesystem::path& dir,
                                 const std::filesystem::path& file);

}  // namespace kvgrid::model

#endif  // KVGRID_MODEL_MODEL_DIR_H_
