// An asynchronous HTTP/1.1 server (Boost.Beast over Asio) for the coordinator's HTTP API: a
// small fixed pool of threads runs every connection, so a long streaming response costs a
// socket and a few buffers, never a thread. Keep-alive, a request body limit, an idle/read
// timeout (a request's headers and body, and the wait for the next request on a kept-alive
// connection), optional TLS, chunked streaming responses with one write in flight per
// connection and a completion callback per chunk (flow control), and disconnect detection
// while a response is being produced (a client that closes its socket is reported at once,
// not at the next write).
//
// What the requests mean is the handler's business (openai_api.h).
//
// Thread-safety: HttpResponder methods may be called from any thread; they and the handler's
// callbacks run on the connection's strand, one at a time.
#ifndef KVGRID_COORDINATOR_HTTP_SERVER_H_
#define KVGRID_COORDINATOR_HTTP_SERVER_H_

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace kvgrid::coordinator {

struct HttpRequest {
  std::string method;         // "GET", "POST", ...
  std::string path;           // the target without its query
  std::string authorization;  // the Authorization header; empty when absent
  std::string body;
};

// The response to one request. Exactly one of Respond, or StartStream ... EndStream, is used;
// calls after the response ended, or after the client went away, are dropped (but a
// WriteChunk's callback still runs, with false).
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  // A whole response with Content-Length.
  virtual void Respond(int status, std::string content_type, std::string body) = 0;
  // The head of a chunked response.
  virtual void StartStream(int status, std::string content_type) = 0;
  // One chunk; `done(ok)` runs on the strand once it was written (ok false: the client is gone
  // and nothing more will be written). Always called, exactly once.
  virtual void WriteChunk(std::string data, std::function<void(bool)> done) = 0;
  // The end of a chunked response.
  virtual void EndStream() = 0;
  // `gone` runs once, on the strand, when the client disconnects (or the server stops) before
  // the response ended; at once when that already happened.
  virtual void OnClientGone(std::function<void()> gone) = 0;
  // Runs `fn` on the connection's strand.
  virtual void Post(std::function<void()> fn) = 0;
};

// Called on the connection's strand for each request; must not block.
using HttpHandler =
    std::function<void(HttpRequest request, std::shared_ptr<HttpResponder> responder)>;

struct HttpServerOptions {
  std::string listen;  // HOST:PORT; port 0 picks one
  int threads = 2;
  size_t max_body_bytes = 32 << 20;
  // Reading one request, and waiting for the next on a kept-alive connection.
  std::chrono::milliseconds idle_timeout{std::chrono::seconds(60)};
  // One write of a response: a client that accepts none of its bytes for this long is taken
  // as gone and its request aborted, so a connected client that stopped reading cannot hold a
  // request (paused by flow control) and its KV blocks forever.
  std::chrono::milliseconds write_timeout{std::chrono::seconds(60)};
  // TLS: PEM certificate chain and key files (both or neither).
  std::optional<std::string> tls_cert;
  std::optional<std::string> tls_key;
};

class HttpServer {
 public:
  // Listens and starts the threads. Errors: INVALID_ARGUMENT for a listen address that does
  // not parse or TLS files that do not load (naming them); UNAVAILABLE when the port cannot
  // be bound (taken).
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options,
                                                           HttpHandler handler);
  // Stop().
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  [[nodiscard]] int port() const;
  // Connections open now.
  [[nodiscard]] int64_t NumConnections() const;

  // Stops accepting, ends every connection (responses in progress see their client gone),
  // waits up to `grace` for them to close, then stops the threads. Idempotent.
  void Stop(std::chrono::milliseconds grace = std::chrono::seconds(2));

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvgrid::coordinator

#endif  // KVGRID_COORDINATOR_HTTP_SERVER_H_
