#include "auth/bearer_auth.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvgrid::auth {
namespace {

std::array<uint8_t, 32> Digest(std::string_view token) {
  std::array<uint8_t, 32> d;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), d.data());
  return d;
}

constexpr std::string_view kScheme = "Bearer ";

}  // namespace

BearerAuth BearerAuth::FromTokens(const std::vector<std::string>& tokens) {
  BearerAuth auth;
  for (const std::string& t : tokens) {
    const absl::string_view trimmed = absl::StripAsciiWhitespace(t);
    if (!trimmed.empty()) auth.digests_.push_back(Digest(std::string_view(trimmed.data(), trimmed.size())));
  }
  return auth;
}

namespace {

absl::StatusOr<std::vector<std::string>> ReadTokens(const std::filesystem::path& path,
                                                    const std::string& flag) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--", flag, ": cannot read ", path.string()));
  }
  std::vector<std::string> tokens;
  for (std::string line; std::getline(in, line);) {
    const absl::string_view t = absl::StripAsciiWhitespace(line);
    if (t.empty() || t.front() == '#') continue;
    tokens.emplace_back(t.data(), t.size());
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path.string(), " holds no token"));
  }
  return tokens;
}

}  // namespace

absl::StatusOr<BearerAuth> BearerAuth::FromFile(const std::filesystem::path& path,
                                                const std::string& flag) {
  absl::StatusOr<std::vector<std::string>> tokens = ReadTokens(path, flag);
  if (!tokens.ok()) return tokens.status();
  return FromTokens(*tokens);
}

absl::StatusOr<std::string> ResolveToken(const std::optional<std::string>& file,
                                         const std::optional<std::string>& value,
                                         const std::string& file_flag) {
  if (file) {
    absl::StatusOr<std::vector<std::string>> tokens = ReadTokens(*file, file_flag);
    if (!tokens.ok()) return tokens.status();
    return tokens->front();
  }
  return std::string(absl::StripAsciiWhitespace(value.value_or("")));
}

absl::StatusOr<BearerAuth> BearerAuth::FromFlags(const std::optional<std::string>& file,
                                                 const std::optional<std::string>& list,
                                                 const std::string& file_flag) {
  if (file) return FromFile(*file, file_flag);
  if (list) return FromTokens(absl::StrSplit(*list, ','));
  return BearerAuth();
}

grpc::Status BearerAuth::Check(const grpc::ServerContextBase& context) const {
  if (digests_.empty()) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing credentials: send metadata 'authorization: Bearer <key>'");
  }
  return CheckHeader(std::string_view(it->second.data(), it->second.size()));
}

grpc::Status BearerAuth::CheckHeader(std::optional<std::string_view> authorization) const {
  if (digests_.empty()) return grpc::Status::OK;
  if (!authorization) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing credentials: send 'authorization: Bearer <key>'");
  }
  const std::string_view value = *authorization;
  if (value.substr(0, kScheme.size()) != kScheme) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the authorization metadata must be 'Bearer <key>'");
  }
  const std::array<uint8_t, 32> d = Digest(value.substr(kScheme.size()));
  // Every accepted digest is compared, in constant time each, whatever matches.
  int match = 0;
  for (const auto& accepted : digests_) {
    match |= CRYPTO_memcmp(d.data(), accepted.data(), d.size()) == 0;
  }
  if (!match) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "the key is not valid");
  return grpc::Status::OK;
}

void AttachBearer(grpc::ClientContext* context, const std::string& token) {
  if (!token.empty()) context->AddMetadata("authorization", std::string(kScheme) + token);
}

}  // namespace kvgrid::auth
