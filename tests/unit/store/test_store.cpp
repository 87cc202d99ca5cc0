#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <ddp/store.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

ddp::StoreOptions quiet(std::vector<std::string>* log = nullptr, std::mutex* mu = nullptr) {
  ddp::StoreOptions o;
  o.timeout = 5s;
  o.log = [log, mu](std::string_view m) {
    if (log != nullptr) {
      std::lock_guard lock(*mu);
      log->emplace_back(m);
    }
  };
  return o;
}

template <class F>
ddp::Errc error_code_of(F&& f) {
  try {
    f();
  } catch (const ddp::Error& e) {
    return e.code();
  }
  return ddp::Errc{};
}

template <class F>
std::string error_text_of(F&& f) {
  try {
    f();
  } catch (const ddp::Error& e) {
    return e.what();
  }
  return "";
}

// A raw TCP connection for sending hostile bytes.
ddp::detail::Fd raw_connect(int port) {
  return ddp::detail::connect_tcp("127.0.0.1", port, ddp::detail::Deadline::after(2s), "test");
}

}  // namespace

TEST_CASE("store: set, get, add, compare_set, erase, check") {
  ddp::StoreServer server("127.0.0.1", 0, quiet());
  ddp::Store store("127.0.0.1", server.port(), quiet());
  store.set("a", "1");
  CHECK(store.get("a") == "1");
  store.set("a", std::string("bin\0ary", 7));
  CHECK(store.get("a") == std::string("bin\0ary", 7));
  CHECK(store.add("n", 5) == 5);
  CHECK(store.add("n", -2) == 3);
  CHECK(store.compare_set("c", "", "first") == "first");        // absent + empty expected: set
  CHECK(store.compare_set("c", "wrong", "second") == "first");  // no swap
  CHECK(store.compare_set("c", "first", "third") == "third");
  const std::vector<std::string> keys{"a", "c"};
  CHECK(store.check(keys));
  CHECK(store.erase("a"));
  CHECK_FALSE(store.erase("a"));
  CHECK_FALSE(store.check(keys));
  auto p = store.prefixed("job/");
  p.set("x", "y");
  CHECK(store.get("job/x") == "y");
  CHECK(p.get("x") == "y");
  CHECK(error_code_of([&] { store.add("c", 1); }) == ddp::Errc::protocol);  // not a counter
}

TEST_CASE("store: get waits for a value set later by another client") {
  ddp::StoreServer server("127.0.0.1", 0, quiet());
  ddp::Store reader("127.0.0.1", server.port(), quiet());
  std::thread writer([port = server.port()] {
    ddp::Store w("127.0.0.1", port, quiet());
    std::this_thread::sleep_for(100ms);
    w.set("late", "value");
  });
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(reader.get("late", 3s) == "value");
  CHECK(std::chrono::steady_clock::now() - t0 >= 90ms);
  writer.join();
}

TEST_CASE("store: a wait that times out names the missing keys and the client keeps working") {
  ddp::StoreServer server("127.0.0.1", 0, quiet());
  ddp::Store store("127.0.0.1", server.port(), quiet());
  store.set("rank/0", "");
  const std::vector<std::string> keys{"rank/0", "rank/1", "rank/2"};
  const auto t0 = std::chrono::steady_clock::now();
  const auto text = error_text_of([&] { store.wait(keys, 200ms); });
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(text.find("\"rank/1\", \"rank/2\"") != std::string::npos);
  CHECK(text.find("rank/0") == std::string::npos);
  CHECK(took >= 190ms);
  CHECK(took < 3s);
  CHECK(error_code_of([&] { (void)store.get("never", 100ms); }) == ddp::Errc::timeout);
  store.set("after", "ok");  // the connection is still in sync
  CHECK(store.get("after") == "ok");
  CHECK(store.missing_after(keys, 50ms) == std::vector<std::string>{"rank/1", "rank/2"});
}

TEST_CASE("store: token authentication") {
  std::vector<std::string> log;
  std::mutex mu;
  auto with_token = quiet(&log, &mu);
  with_token.token = "s3cret-token";
  ddp::StoreServer server("127.0.0.1", 0, with_token);
  {
    ddp::Store ok("127.0.0.1", server.port(), with_token);
    ok.set("k", "v");
  }
  auto wrong = quiet();
  wrong.token = "not-the-token";
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(error_code_of([&] { ddp::Store s("127.0.0.1", server.port(), wrong); }) ==
        ddp::Errc::unauthorized);
  CHECK(std::chrono::steady_clock::now() - t0 < 1s);
  const auto text = error_text_of([&] { ddp::Store s("127.0.0.1", server.port(), quiet()); });
  CHECK(text.find("requires a token") != std::string::npos);
  // The server keeps serving the right clients.
  ddp::Store again("127.0.0.1", server.port(), with_token);
  CHECK(again.get("k") == "v");
  // A client with a token refuses a server that cannot prove it knows it.
  ddp::StoreServer open_server("127.0.0.1", 0, quiet());
  CHECK(error_code_of([&] { ddp::Store s("127.0.0.1", open_server.port(), with_token); }) ==
        ddp::Errc::unauthorized);
  std::lock_guard lock(mu);
  CHECK(server.refused() == 2);
  for (const auto& line : log) CHECK(line.find("s3cret") == std::string::npos);  // never logged
  CHECK(log.size() == 2);
}

TEST_CASE("store: a replayed handshake is refused") {
  auto opts = quiet();
  opts.token = "tok";
  ddp::StoreServer server("127.0.0.1", 0, opts);
  namespace sp = ddp::detail::store_proto;
  const auto deadline = ddp::detail::Deadline::after(2s);
  // A legitimate client's handshake, recorded.
  auto a = raw_connect(server.port());
  std::string hello;
  REQUIRE(sp::recv_frame(a.get(), hello, 256, deadline, "hello") == ddp::detail::IoResult::ok);
  ddp::detail::ByteReader r(hello, "hello");
  (void)r.get<std::uint32_t>();
  (void)r.get<std::uint16_t>();
  (void)r.get<std::uint8_t>();
  sp::Nonce server_nonce{};
  r.raw(server_nonce.data(), server_nonce.size());
  sp::Nonce client_nonce{};
  const auto mac = ddp::detail::hmac_sha256(std::string_view("tok"), sp::client_label,
                                            sp::as_view(server_nonce), sp::as_view(client_nonce));
  std::string auth;
  ddp::detail::ByteWriter w(auth);
  w.put(sp::magic);
  w.put(sp::version);
  w.raw(client_nonce.data(), client_nonce.size());
  w.raw(mac.data(), mac.size());
  REQUIRE(sp::send_frame(a.get(), auth, deadline) == ddp::detail::IoResult::ok);
  std::string reply;
  REQUIRE(sp::recv_frame(a.get(), reply, 256, deadline, "reply") == ddp::detail::IoResult::ok);
  CHECK(reply[0] == 0);  // accepted
  // The same bytes on a new connection: the server's nonce differs, so the MAC is wrong.
  auto b = raw_connect(server.port());
  REQUIRE(sp::recv_frame(b.get(), hello, 256, deadline, "hello") == ddp::detail::IoResult::ok);
  REQUIRE(sp::send_frame(b.get(), auth, deadline) == ddp::detail::IoResult::ok);
  REQUIRE(sp::recv_frame(b.get(), reply, 256, deadline, "reply") == ddp::detail::IoResult::ok);
  CHECK(reply[0] == 1);  // unauthorized
}

TEST_CASE("store: binds only the address it is given") {
  ddp::StoreServer server("127.0.0.1", 0, quiet());
  char port_hex[8];
  std::snprintf(port_hex, sizeof port_hex, "%04X", static_cast<unsigned>(server.port()));
  bool found_loopback = false;
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      if (state != "0A" || local.substr(local.size() - 4) != port_hex) continue;  // LISTEN
      const auto addr = local.substr(0, local.size() - 5);
      CHECK_MESSAGE(addr != "00000000", "listening on 0.0.0.0");
      CHECK_MESSAGE(addr != "00000000000000000000000000000000", "listening on ::");
      if (addr == "0100007F") found_loopback = true;
    }
  }
  CHECK(found_loopback);
}

TEST_CASE("store: a port in use is reported as such") {
  ddp::StoreServer first("127.0.0.1", 0, quiet());
  try {
    ddp::StoreServer second("127.0.0.1", first.port(), quiet());
    FAIL("a second server bound the same port");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::address_in_use);
    CHECK(std::string(e.what()).find("address 127.0.0.1:" + std::to_string(first.port()) +
                                     " is in use") != std::string::npos);
  }
}

TEST_CASE("store: hostile traffic is dropped and the server keeps serving") {
  std::vector<std::string> log;
  std::mutex mu;
  ddp::StoreServer server("127.0.0.1", 0, quiet(&log, &mu));
  ddp::Store good("127.0.0.1", server.port(), quiet());
  good.set("k", "v");
  {  // an oversized frame length before authentication
    auto fd = raw_connect(server.port());
    const unsigned char frame[] = {0xff, 0xff, 0xff, 0xff, 1, 2, 3};
    CHECK(ddp::detail::send_all(fd.get(), frame, sizeof frame, ddp::detail::Deadline::after(1s)) ==
          ddp::detail::IoResult::ok);
  }
  {  // an HTTP request
    auto fd = raw_connect(server.port());
    const std::string get = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    CHECK(ddp::detail::send_all(fd.get(), get.data(), get.size(),
                                ddp::detail::Deadline::after(1s)) == ddp::detail::IoResult::ok);
    char c;
    // The server closes on us (after its hello).
    std::string hello;
    (void)ddp::detail::store_proto::recv_frame(fd.get(), hello, 256,
                                               ddp::detail::Deadline::after(2s), "hello");
    CHECK(ddp::detail::recv_all(fd.get(), &c, 1, ddp::detail::Deadline::after(2s)) ==
          ddp::detail::IoResult::closed);
  }
  { auto fd = raw_connect(server.port()); }  // connect, then close
  {  // an authenticated client claiming a frame beyond the limit is dropped before allocation
    namespace sp = ddp::detail::store_proto;
    const auto deadline = ddp::detail::Deadline::after(2s);
    auto fd = raw_connect(server.port());
    std::string frame;
    REQUIRE(sp::recv_frame(fd.get(), frame, 256, deadline, "hello") == ddp::detail::IoResult::ok);
    std::string auth;
    ddp::detail::ByteWriter w(auth);
    w.put(sp::magic);
    w.put(sp::version);
    const std::string zeros(16 + 32, '\0');  // no token: any nonce, MAC ignored
    w.raw(zeros.data(), zeros.size());
    REQUIRE(sp::send_frame(fd.get(), auth, deadline) == ddp::detail::IoResult::ok);
    REQUIRE(sp::recv_frame(fd.get(), frame, 256, deadline, "reply") == ddp::detail::IoResult::ok);
    REQUIRE(frame[0] == 0);
    const unsigned char huge[] = {0x00, 0x00, 0x00, 0xf0};  // 4026531840 bytes
    REQUIRE(ddp::detail::send_all(fd.get(), huge, sizeof huge, deadline) ==
            ddp::detail::IoResult::ok);
    char c;
    CHECK(ddp::detail::recv_all(fd.get(), &c, 1, deadline) == ddp::detail::IoResult::closed);
  }
  CHECK(good.get("k") == "v");
  std::this_thread::sleep_for(100ms);
  std::lock_guard lock(mu);
  std::string all;
  for (const auto& l : log) all += l + "\n";
  CHECK(all.find("frame of 4294967295 bytes refused") != std::string::npos);
  CHECK(all.find("stray traffic starting \"GET \"") != std::string::npos);
  CHECK(all.find("connected and closed without a handshake") != std::string::npos);
  CHECK(all.find("frame of 4026531840 bytes refused") != std::string::npos);
  CHECK(server.refused() == 4);
}

TEST_CASE("store: connecting to nothing times out with a clear message") {
  int port;
  {
    ddp::StoreServer tmp("127.0.0.1", 0, quiet());
    port = tmp.port();
  }
  auto o = quiet();
  o.timeout = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  const auto text = error_text_of([&] { ddp::Store s("127.0.0.1", port, o); });
  CHECK(text.find("cannot connect to the rendezvous store at 127.0.0.1:" + std::to_string(port)) !=
        std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < 3s);
}

TEST_CASE("store: a socket connected to itself is recognized (and connect_tcp retries it)") {
  // A real self-connection: bound to a port and connected to that same port, with nothing
  // listening there (TCP simultaneous open), which connect_tcp can meet by chance when the
  // store's port lies in the ephemeral range.
  int port;
  {
    ddp::StoreServer tmp("127.0.0.1", 0, quiet());
    port = tmp.port();
  }
  ddp::detail::Fd self(::socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(self);
  const int one = 1;
  ::setsockopt(self.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(self.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::connect(self.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  CHECK(ddp::detail::connected_to_itself(self.get()));
  // An ordinary connection is not.
  ddp::StoreServer server("127.0.0.1", 0, quiet());
  const auto fd = ddp::detail::connect_tcp("127.0.0.1", server.port(),
                                           ddp::detail::Deadline::after(5s), "the store");
  CHECK(!ddp::detail::connected_to_itself(fd.get()));
}

TEST_CASE("store: a client whose server goes away gets peer_lost") {
  auto server = std::make_unique<ddp::StoreServer>("127.0.0.1", 0, quiet());
  ddp::Store store("127.0.0.1", server->port(), quiet());
  store.set("k", "v");
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    server->stop();
  });
  CHECK(error_code_of([&] { (void)store.get("never", 3s); }) == ddp::Errc::peer_lost);
  stopper.join();
}

TEST_CASE(
    "store: a lease that runs out (the process stopped) applies its records and the on-close "
    "ones, once, and the connection stays open: a new lease re-arms it") {
  // Every process here forks while it has one thread (the server's and the lease's threads are
  // made after): the server runs in a process of its own, the stopped client in another.
  int port_pipe[2], stop_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  REQUIRE(::pipe(stop_pipe) == 0);
  std::fflush(nullptr);
  const pid_t server = ::fork();
  REQUIRE(server >= 0);
  if (server == 0) {
    int code = 1;
    try {
      ddp::StoreServer s("127.0.0.1", 0, quiet());
      const int port = s.port();
      (void)!::write(port_pipe[1], &port, sizeof port);
      char c;
      (void)!::read(stop_pipe[0], &c, 1);  // until the test says stop
      code = 0;
    } catch (...) {
    }
    std::_Exit(code);
  }
  int port = 0;
  REQUIRE(::read(port_pipe[0], &port, sizeof port) == static_cast<ssize_t>(sizeof port));
  struct StopServer {
    int fd;
    pid_t pid;
    ~StopServer() {
      (void)!::write(fd, "x", 1);
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
  } stop_server{stop_pipe[1], server};
  const pid_t child = ::fork();
  if (child == 0) {
    ddp::Store s("127.0.0.1", port, quiet());
    const std::pair<std::string, std::string> on_close[] = {{"gone/1", ""}};
    s.set_on_close(on_close);
    const ddp::LeaseRecord on_expire[] = {{"stalled/1", "", 0, false}, {"stalls", "", 1, true}};
    s.lease(300ms, on_expire);
    s.set("leased", "");
    ::raise(SIGSTOP);  // no sign of life from here on
    // Continued: the connection still works, and a new lease re-arms.
    s.set("woke", s.check(std::vector<std::string>{"stalled/1"}) ? "stalled" : "not stalled");
    s.lease(300ms, on_expire);
    std::this_thread::sleep_for(1s);  // signing all along: nothing applies
    s.set("alive after", "");
    (void)s.get("may exit");
    std::_Exit(0);
  }
  REQUIRE(child > 0);
  ddp::Store watcher("127.0.0.1", port, quiet());
  (void)watcher.get("leased");
  std::this_thread::sleep_for(100ms);
  CHECK(!watcher.check(std::vector<std::string>{"stalled/1"}));  // within the lease: nothing
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string> marks{"stalled/1", "gone/1"};
  watcher.wait(marks, 5s);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took < 3s);
  CHECK(watcher.add("stalls", 0) == 1);
  ::kill(child, SIGCONT);
  CHECK(watcher.get("woke") == "stalled");
  (void)watcher.get("alive after", 5s);
  CHECK(watcher.add("stalls", 0) == 1);  // the re-armed lease did not run out
  // Its on-close records were used up when the lease ran out: closing sets nothing again.
  CHECK(watcher.erase("gone/1"));
  watcher.set("may exit", "");
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFEXITED(status));
  std::this_thread::sleep_for(200ms);
  CHECK(!watcher.check(std::vector<std::string>{"gone/1"}));
}

TEST_CASE("store: a watched key's stop value throws the error it holds, its fields kept") {
  ddp::StoreServer server("127.0.0.1", 0, quiet());
  ddp::Store store("127.0.0.1", server.port(), quiet());
  const ddp::Error e(ddp::Errc::peer_lost, "the rendezvous failed on rank 3: ", 3, "rank 1 died",
                     {1});
  store.set("failed", ddp::Store::stop_value(e));
  ddp::Store watched = store.watching("failed");
  try {
    (void)watched.get("never");
    FAIL("get() returned");
  } catch (const ddp::Error& got) {
    CHECK(got.code() == ddp::Errc::peer_lost);
    CHECK(std::string_view(got.what()) == e.what());
    CHECK(got.origin_rank() == 3);
    CHECK(got.origin_message() == "rank 1 died");
    CHECK(got.lost_ranks() == std::vector<int>{1});
  }
  // The plain form (no fields) and bytes that are no stop value
  CHECK(
      ddp::detail::decode_stop(ddp::Store::stop_value(ddp::Errc::timeout, "late"))->origin_rank() ==
      -1);
  CHECK_FALSE(ddp::detail::decode_stop("short").has_value());
  std::string hostile = ddp::Store::stop_value(e);
  hostile.resize(hostile.size() - 2);  // a lost-rank list cut short
  CHECK_FALSE(ddp::detail::decode_stop(hostile).has_value());
  hostile = ddp::Store::stop_value(e);
  hostile[hostile.size() - 5] = '\x7f';  // a count of lost ranks larger than the bytes left
  CHECK_FALSE(ddp::detail::decode_stop(hostile).has_value());
}
