#include "coordinator/http_server.h"

#include <atomic>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "boost/asio/ip/tcp.hpp"
#include "boost/asio/ssl.hpp"
#include "boost/asio/strand.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "boost/beast/ssl.hpp"
#include "coordinator/openai_protocol.h"

namespace kvgrid::coordinator {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;

class SessionBase;

}  // namespace

// Members in destruction order: sessions left in the io_context's queues when it is destroyed
// still unlist themselves and use the TLS context.
struct HttpServer::Impl {
  HttpServerOptions options;
  HttpHandler handler;
  absl::Mutex mu;
  absl::flat_hash_set<SessionBase*> sessions ABSL_GUARDED_BY(mu);
  std::optional<net::ssl::context> ssl;
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;
  int port = 0;
  std::atomic<bool> stopped{false};

  void Accept();
};

namespace {

// Reason phrases for the statuses this server sends.
absl::string_view Reason(int status) {
  const beast::string_view br = http::obsolete_reason(static_cast<http::status>(status));
  const absl::string_view r(br.data(), br.size());
  return r.empty() || r == "<unknown-status>" ? "Status" : r;
}

// One connection. Everything runs on its strand; the session lives while a handler, a pending
// operation or a responder holds it.
class SessionBase : public std::enable_shared_from_this<SessionBase> {
 public:
  explicit SessionBase(HttpServer::Impl* server) : server_(server) {
    absl::MutexLock lock(&server_->mu);
    server_->sessions.insert(this);
  }
  virtual ~SessionBase() {
    absl::MutexLock lock(&server_->mu);
    server_->sessions.erase(this);
  }

  virtual void Run() = 0;
  // Completions of the stream's operations (on the strand: the socket's executor is it).
  void OnReadDone(error_code ec) { OnRead(ec); }
  void OnWriteDone(error_code ec) { OnWrite(ec); }
  void OnWatchDone(error_code ec, size_t n) { OnWatch(ec, n); }
  void OnHeaderDone(error_code ec) { OnHeader(ec); }
  void OnContinueDone(error_code ec) {
    if (ec) {
      Close();
      return;
    }
    AsyncRead();
  }
  // On the strand.
  virtual void Post(std::function<void()> fn) = 0;
  // Ends the connection from outside (server stop); any thread.
  void Kill() {
    Post([self = shared_from_this()] { self->MarkGone(); });
  }

  // Responder calls, on the strand; `seq` is the request they answer.
  void Respond(uint64_t seq, int status, const std::string& type, std::string body) {
    if (seq != seq_ || !in_response_ || ended_ || head_sent_) return;
    std::string out = absl::StrCat("HTTP/1.1 ", status, " ", Reason(status), "\r\n",
                                   "Content-Type: ", type, "\r\n", "Content-Length: ",
                                   body.size(), "\r\n", KeepAliveHeader(), "\r\n");
    out += body;
    head_sent_ = true;
    ended_ = true;
    Enqueue(std::move(out), nullptr);
  }
  void StartStream(uint64_t seq, int status, const std::string& type) {
    if (seq != seq_ || !in_response_ || ended_ || head_sent_) return;
    head_sent_ = true;
    Enqueue(absl::StrCat("HTTP/1.1 ", status, " ", Reason(status), "\r\n", "Content-Type: ", type,
                         "\r\n", "Cache-Control: no-cache\r\n", "X-Accel-Buffering: no\r\n",
                         "Transfer-Encoding: chunked\r\n", KeepAliveHeader(), "\r\n"),
            nullptr);
  }
  void WriteChunk(uint64_t seq, std::string data, std::function<void(bool)> done) {
    if (seq != seq_ || !in_response_ || ended_ || !head_sent_ || data.empty()) {
      const bool ok = !gone_ && data.empty() && seq == seq_ && !ended_;
      if (done) Post([done = std::move(done), ok] { done(ok); });
      return;
    }
    std::string framed = absl::StrCat(absl::Hex(data.size()), "\r\n");
    framed += data;
    framed += "\r\n";
    Enqueue(std::move(framed), std::move(done));
  }
  void EndStream(uint64_t seq) {
    if (seq != seq_ || !in_response_ || ended_ || !head_sent_) return;
    ended_ = true;
    Enqueue("0\r\n\r\n", nullptr);
  }
  void OnClientGone(uint64_t seq, std::function<void()> gone) {
    if (seq != seq_ || !in_response_) return;
    if (gone_) {
      Post(std::move(gone));
      return;
    }
    gone_callback_ = std::move(gone);
  }

 protected:
  using Parser = http::request_parser<http::string_body>;

  virtual beast::tcp_stream& Tcp() = 0;
  // The request's header, then OnHeaderDone; its body (the parser's rest), then OnReadDone.
  virtual void AsyncReadHeader() = 0;
  virtual void AsyncRead() = 0;
  // Writes kContinue, then OnContinueDone.
  virtual void AsyncWriteContinue() = 0;
  virtual void AsyncWrite(const std::string& data) = 0;
  // Reads what is available into `into` (at least one byte, or an error), then OnWatch.
  virtual void AsyncWatchRead(beast::flat_buffer::mutable_buffers_type into) = 0;

  std::string KeepAliveHeader() const {
    return keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  }

  void DoRead() {
    if (gone_) return;
    parser_.emplace();
    parser_->body_limit(server_->options.max_body_bytes);
    parser_->header_limit(64 << 10);
    Tcp().expires_after(server_->options.idle_timeout);
    AsyncReadHeader();
  }

  // A client that sent `Expect: 100-continue` waits for "100 Continue" before it sends the
  // body (curl for a second, others longer): it is sent once the header was read (and passed
  // the limits), then the body is read.
  static constexpr char kContinue[] = "HTTP/1.1 100 Continue\r\n\r\n";
  void OnHeader(error_code ec) {
    if (ec || parser_->is_done()) {
      OnRead(ec);
      return;
    }
    const auto& head = parser_->get();
    const auto expect = head.find(http::field::expect);
    if (head.version() >= 11 && expect != head.end() &&
        beast::iequals(expect->value(), "100-continue")) {
      AsyncWriteContinue();
      return;
    }
    AsyncRead();
  }

  void OnRead(error_code ec);

  void Enqueue(std::string data, std::function<void(bool)> done) {
    if (gone_) {
      if (done) Post([done = std::move(done)] { done(false); });
      return;
    }
    out_.push_back({std::move(data), std::move(done)});
    if (!writing_) DoWrite();
  }
  void DoWrite() {
    writing_ = true;
    ArmWriteTimer();
    AsyncWrite(out_.front().data);
  }
  // A write that makes no progress for write_timeout closes the connection (its pending write
  // then fails, and the request is aborted as for a disconnect).
  void ArmWriteTimer() {
    if (!write_timer_) write_timer_.emplace(Tcp().get_executor());
    write_timer_->expires_after(server_->options.write_timeout);
    write_timer_->async_wait([self = shared_from_this(), id = ++write_id_](error_code ec) {
      if (ec || !self->writing_ || self->write_id_ != id) return;
      self->MarkGone();
    });
  }
  void OnWrite(error_code ec) {
    writing_ = false;
    if (write_timer_) write_timer_->cancel();
    Out done = std::move(out_.front());
    out_.pop_front();
    if (ec) {
      MarkGone();
      if (done.done) done.done(false);
      return;
    }
    if (done.done) done.done(true);
    if (!out_.empty()) {
      DoWrite();
    } else if (ended_) {
      FinishResponse();
    }
  }

  // The response was written: the connection reads the next request, or closes.
  void FinishResponse() {
    in_response_ = false;
    gone_callback_ = nullptr;
    if (!keep_alive_ || gone_) {
      Close();
      return;
    }
    if (watching_) {
      // The read-readiness wait must end before a read starts.
      read_after_watch_ = true;
      error_code ignored;
      Tcp().socket().cancel(ignored);
      return;
    }
    DoRead();
  }

  // Reads while a response is produced, so that an EOF or error shows at once that the client
  // went away. What arrives meanwhile (a pipelined request, a stray CRLF, a TLS close_notify
  // before the FIN) is kept in buffer_, where the next request's read starts; were it left
  // unread, a close after it would go unseen until the response's last write. Past
  // kMaxWatchBytes the watch stops (TCP then holds the client back) and a disconnect shows at
  // the next write.
  static constexpr size_t kWatchChunk = 4096;
  static constexpr size_t kMaxWatchBytes = 64 << 10;
  void StartWatch() {
    watching_ = true;
    AsyncWatchRead(buffer_.prepare(kWatchChunk));
  }
  void OnWatch(error_code ec, size_t n) {
    watching_ = false;
    buffer_.commit(n);
    if (read_after_watch_) {
      read_after_watch_ = false;
      DoRead();
      return;
    }
    if (!in_response_ || gone_) return;
    if (ec) {
      if (ec != net::error::operation_aborted) MarkGone();
      return;
    }
    if (buffer_.size() < kMaxWatchBytes) StartWatch();
  }

  // The client is gone (or the server stops): nothing more is written.
  void MarkGone() {
    if (gone_) return;
    gone_ = true;
    if (gone_callback_) {
      std::function<void()> cb = std::move(gone_callback_);
      gone_callback_ = nullptr;
      cb();
    }
    // Pending writes fail; their callbacks run.
    std::deque<Out> pending;
    pending.swap(out_);
    if (writing_ && !pending.empty()) {
      // The one in flight completes (with an error) through OnWrite.
      out_.push_back(std::move(pending.front()));
      pending.pop_front();
    }
    for (Out& o : pending) {
      if (o.done) Post([done = std::move(o.done)] { done(false); });
    }
    Close();
  }

  void Close() {
    gone_ = true;
    error_code ignored;
    Tcp().socket().shutdown(tcp::socket::shutdown_both, ignored);
    Tcp().socket().close(ignored);
  }

  void Fail(int status, absl::string_view message) {
    // A request that could not be read: answered, then the connection closes.
    keep_alive_ = false;
    in_response_ = true;
    ++seq_;
    head_sent_ = false;
    ended_ = false;
    Respond(seq_, status, "application/json", openai::ErrorBody(status, message));
  }

  struct Out {
    std::string data;
    std::function<void(bool)> done;
  };

  HttpServer::Impl* const server_;
  beast::flat_buffer buffer_;
  std::optional<Parser> parser_;
  std::deque<Out> out_;
  uint64_t seq_ = 0;
  bool writing_ = false;
  std::optional<net::steady_timer> write_timer_;
  uint64_t write_id_ = 0;  // which write the timer watches
  bool in_response_ = false;
  bool head_sent_ = false;
  bool ended_ = false;
  bool keep_alive_ = true;
  bool gone_ = false;
  bool watching_ = false;
  bool read_after_watch_ = false;
  std::function<void()> gone_callback_;
};

class Responder final : public HttpResponder {
 public:
  Responder(std::shared_ptr<SessionBase> session, uint64_t seq)
      : session_(std::move(session)), seq_(seq) {}

  void Respond(int status, std::string content_type, std::string body) override {
    session_->Post([s = session_, seq = seq_, status, t = std::move(content_type),
                    b = std::move(body)]() mutable { s->Respond(seq, status, t, std::move(b)); });
  }
  void StartStream(int status, std::string content_type) override {
    session_->Post([s = session_, seq = seq_, status, t = std::move(content_type)] {
      s->StartStream(seq, status, t);
    });
  }
  void WriteChunk(std::string data, std::function<void(bool)> done) override {
    session_->Post([s = session_, seq = seq_, d = std::move(data), done = std::move(done)]() mutable {
      s->WriteChunk(seq, std::move(d), std::move(done));
    });
  }
  void EndStream() override {
    session_->Post([s = session_, seq = seq_] { s->EndStream(seq); });
  }
  void OnClientGone(std::function<void()> gone) override {
    session_->Post([s = session_, seq = seq_, g = std::move(gone)]() mutable {
      s->OnClientGone(seq, std::move(g));
    });
  }
  void Post(std::function<void()> fn) override { session_->Post(std::move(fn)); }

 private:
  std::shared_ptr<SessionBase> session_;
  uint64_t seq_;
};

void SessionBase::OnRead(error_code ec) {
  if (gone_) return;
  if (ec == http::error::body_limit) {
    Fail(413, absl::StrCat("body: larger than ", server_->options.max_body_bytes, " bytes"));
    return;
  }
  if (ec == http::error::header_limit) {
    Fail(431, "headers: larger than 64 KiB");
    return;
  }
  if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
      ec == net::error::operation_aborted || ec == net::error::connection_reset ||
      ec == net::ssl::error::stream_truncated) {
    Close();
    return;
  }
  if (ec) {
    if (ec.category() == http::make_error_code(http::error::bad_target).category()) {
      Fail(400, absl::StrCat("body: not a valid HTTP/1.1 request (", ec.message(), ")"));
    } else {
      Close();
    }
    return;
  }
  http::request<http::string_body> req = parser_->release();
  parser_.reset();
  Tcp().expires_never();
  keep_alive_ = req.keep_alive();
  ++seq_;
  in_response_ = true;
  head_sent_ = false;
  ended_ = false;
  HttpRequest request;
  request.method = std::string(req.method_string());
  const std::string_view target(req.target().data(), req.target().size());
  request.path = std::string(target.substr(0, target.find('?')));
  if (auto it = req.find(http::field::authorization); it != req.end()) {
    request.authorization = std::string(it->value());
  }
  request.body = std::move(req.body());
  StartWatch();
  server_->handler(std::move(request), std::make_shared<Responder>(shared_from_this(), seq_));
}

// The transport-specific half of a session: the same reads and writes on a plain TCP stream
// or a TLS stream over one.
template <typename Stream>
class StreamSession : public SessionBase {
 public:
  template <typename... StreamArgs>
  StreamSession(HttpServer::Impl* server, StreamArgs&&... stream_args)
      : SessionBase(server), stream_(std::forward<StreamArgs>(stream_args)...) {}

  void Post(std::function<void()> fn) override { net::post(stream_.get_executor(), std::move(fn)); }

 protected:
  beast::tcp_stream& Tcp() override { return beast::get_lowest_layer(stream_); }
  void AsyncReadHeader() override {
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](error_code ec, size_t) { self->OnHeaderDone(ec); });
  }
  void AsyncRead() override {
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](error_code ec, size_t) { self->OnReadDone(ec); });
  }
  void AsyncWriteContinue() override {
    net::async_write(stream_, net::buffer(kContinue, sizeof(kContinue) - 1),
                     [self = shared_from_this()](error_code ec, size_t) {
                       self->OnContinueDone(ec);
                     });
  }
  void AsyncWrite(const std::string& data) override {
    net::async_write(stream_, net::buffer(data),
                     [self = shared_from_this()](error_code ec, size_t) { self->OnWriteDone(ec); });
  }
  void AsyncWatchRead(beast::flat_buffer::mutable_buffers_type into) override {
    stream_.async_read_some(into, [self = shared_from_this()](error_code ec, size_t n) {
      self->OnWatchDone(ec, n);
    });
  }

  Stream stream_;
};

class PlainSession final : public StreamSession<beast::tcp_stream> {
 public:
  PlainSession(HttpServer::Impl* server, tcp::socket socket)
      : StreamSession(server, std::move(socket)) {}

  void Run() override {
    Post([self = shared_from_this()] { static_cast<PlainSession*>(self.get())->DoRead(); });
  }
};

class TlsSession final : public StreamSession<beast::ssl_stream<beast::tcp_stream>> {
 public:
  TlsSession(HttpServer::Impl* server, tcp::socket socket, net::ssl::context& ssl)
      : StreamSession(server, std::move(socket), ssl) {}

  // The handshake first, within the idle timeout.
  void Run() override {
    Post([self = shared_from_this()] {
      auto* s = static_cast<TlsSession*>(self.get());
      s->Tcp().expires_after(s->server_->options.idle_timeout);
      s->stream_.async_handshake(net::ssl::stream_base::server, [self](error_code ec) {
        auto* s = static_cast<TlsSession*>(self.get());
        if (ec) {
          s->Close();
          return;
        }
        s->DoRead();
      });
    });
  }
};

}  // namespace

void HttpServer::Impl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](error_code ec, tcp::socket socket) {
    if (stopped.load()) return;
    if (!ec) {
      error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::shared_ptr<SessionBase> session;
      if (ssl) {
        session = std::make_shared<TlsSession>(this, std::move(socket), *ssl);
      } else {
        session = std::make_shared<PlainSession>(this, std::move(socket));
      }
      session->Run();
    }
    Accept();
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port; }

int64_t HttpServer::NumConnections() const {
  absl::MutexLock lock(&impl_->mu);
  return static_cast<int64_t>(impl_->sessions.size());
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options,
                                                              HttpHandler handler) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->handler = std::move(handler);
  const size_t colon = options.listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-listen: '", options.listen, "' is not HOST:PORT"));
  }
  std::string host = options.listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "0.0.0.0";
  error_code ec;
  tcp::resolver resolver(impl->ioc);
  auto endpoints = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
  if (ec || endpoints.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--http-listen: cannot resolve '", host,
                                                   "': ", ec.message()));
  }
  const tcp::endpoint endpoint = endpoints.begin()->endpoint();
  impl->acceptor.open(endpoint.protocol(), ec);
  // SO_REUSEADDR only (never SO_REUSEPORT): a port another process listens on is refused.
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("--http-listen: cannot listen on ", options.listen, ": ", ec.message()));
  }
  impl->port = impl->acceptor.local_endpoint().port();
  if (options.tls_cert.has_value() != options.tls_key.has_value()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key: give both or neither");
  }
  if (options.tls_cert) {
    impl->ssl.emplace(net::ssl::context::tls_server);
    impl->ssl->set_options(net::ssl::context::default_workarounds | net::ssl::context::no_sslv2 |
                           net::ssl::context::no_sslv3 | net::ssl::context::no_tlsv1 |
                           net::ssl::context::no_tlsv1_1);
    impl->ssl->use_certificate_chain_file(*options.tls_cert, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-cert: cannot load ", *options.tls_cert, ": ", ec.message()));
    }
    impl->ssl->use_private_key_file(*options.tls_key, net::ssl::context::pem, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls-key: cannot load ", *options.tls_key, ": ", ec.message()));
    }
  }
  impl->work.emplace(impl->ioc.get_executor());
  impl->Accept();
  const int threads = std::max(1, options.threads);
  for (int i = 0; i < threads; ++i) {
    impl->threads.emplace_back([ioc = &impl->ioc] { ioc->run(); });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::Stop(std::chrono::milliseconds grace) {
  if (impl_->stopped.exchange(true)) return;
  net::post(impl_->ioc, [impl = impl_.get()] {
    error_code ignored;
    impl->acceptor.close(ignored);
  });
  std::vector<std::shared_ptr<SessionBase>> alive;
  {
    absl::MutexLock lock(&impl_->mu);
    for (SessionBase* s : impl_->sessions) {
      // A session being destroyed is still listed until its destructor takes the lock, which
      // this holds: take a reference only if it is still alive.
      if (std::shared_ptr<SessionBase> a = s->weak_from_this().lock()) alive.push_back(a);
    }
  }
  for (const auto& s : alive) s->Kill();
  alive.clear();
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (NumConnections() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  impl_->work.reset();
  impl_->ioc.stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace kvgrid::coordinator
