// The store under attack, live: a server in its own process takes 10^4 hostile frames over 8
// connections, 16 clients dribbling a byte a second and one that pipelines requests without
// reading the replies, while four real ranks rendezvous through it and a client does 1,000
// set/get. The server must not crash, must refuse oversized frames before allocating them (its
// peak RSS grows < 16 MiB), and must keep the token out of its log.
#include "multiprocess.hpp"

#include <doctest/doctest.h>

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

namespace sp = ddp::detail::store_proto;
using ddp::detail::Deadline;
using ddp::detail::Fd;
using ddp::detail::IoResult;

constexpr const char* token = "attack-test-token-9d2e";

/// A field of /proc/<pid>/status in KiB (VmRSS, VmHWM).
long long status_kib(pid_t pid, const std::string& field) {
  std::istringstream in(mp::TempDir::read("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

std::string frame_of(std::string_view payload) {
  std::string f;
  ddp::detail::ByteWriter(f).put(static_cast<std::uint32_t>(payload.size()));
  f.append(payload);
  return f;
}

/// An attacker's connection: connects and reads the server's hello (which carries its nonce).
struct Raw {
  Fd fd;
  sp::Nonce server_nonce{};
  bool ok = false;

  explicit Raw(int port) {
    try {
      fd = ddp::detail::connect_tcp("127.0.0.1", port, Deadline::after(5s), "attacker");
    } catch (const ddp::Error&) {
      return;
    }
    std::string hello;
    if (sp::recv_frame(fd.get(), hello, 256, Deadline::after(5s), "hello") != IoResult::ok) return;
    if (hello.size() != 4 + 2 + 1 + sp::nonce_bytes) return;
    std::copy(hello.end() - sp::nonce_bytes, hello.end(), server_nonce.begin());
    ok = true;
  }
  void send(std::string_view bytes) const {
    (void)ddp::detail::send_all(fd.get(), bytes.data(), bytes.size(), Deadline::after(1s));
  }
  /// Authenticates with `key`; returns whether the server accepted.
  bool authenticate(std::string_view key) const {
    sp::Nonce mine{};
    const auto mac = ddp::detail::hmac_sha256(key, sp::client_label, sp::as_view(server_nonce),
                                              sp::as_view(mine));
    std::string hs;
    ddp::detail::ByteWriter w(hs);
    w.put(sp::magic);
    w.put(sp::version);
    w.raw(mine.data(), mine.size());
    w.raw(mac.data(), mac.size());
    send(frame_of(hs));
    std::string reply;
    return sp::recv_frame(fd.get(), reply, 256, Deadline::after(5s), "reply") == IoResult::ok &&
           !reply.empty() && reply[0] == 0;
  }
};

/// One hostile exchange of kind `kind` on a fresh connection.
void attack_once(int port, int kind, std::mt19937_64& rng) {
  Raw c(port);
  if (!c.ok) return;
  const auto random_bytes = [&](std::size_t n) {
    std::string s(n, '\0');
    for (auto& ch : s) ch = static_cast<char>(rng());
    return s;
  };
  const auto le32 = [](std::uint32_t v) {
    std::string s;
    ddp::detail::ByteWriter(s).put(v);
    return s;
  };
  switch (kind) {
    case 0: c.send(le32(0)); break;                               // length 0
    case 1: c.send(le32(0xffffffffu) + random_bytes(64)); break;  // length 2^32 - 1
    case 2: {                                                     // length 2^63
      std::string s;
      ddp::detail::ByteWriter(s).put(std::uint64_t{1} << 63);
      c.send(s + random_bytes(32));
      break;
    }
    case 3: c.send(random_bytes(1 + rng() % 300)); break;            // noise
    case 4: c.send(le32(200) + random_bytes(rng() % 200)); break;    // truncated handshake
    case 5: (void)c.authenticate("not-the-token"); break;            // wrong token
    case 6: c.send("GET / HTTP/1.1\r\nHost: store\r\n\r\n"); break;  // stray HTTP
    case 7: break;                                                   // connect, then close
    default: {  // authenticated (a leaked token or a buggy client), then garbage
      if (!c.authenticate(token)) return;
      switch (rng() % 4) {
        case 0: c.send(le32(0xffffffffu)); break;                        // beyond the limit
        case 1: c.send(le32(100u << 20) + random_bytes(1024)); break;    // 100 MiB claimed
        case 2: c.send(frame_of(random_bytes(1 + rng() % 512))); break;  // random request
        default: {                                                       // a truncated request
          c.send(le32(4096) + random_bytes(rng() % 4096));
          break;
        }
      }
      break;
    }
  }
}

/// The attacking process: 8 threads sending 10^4 hostile frames in all, 16 slow clients and one
/// client that never reads. Writes a byte to `ready` once all are under way.
[[noreturn]] void attacker(int port, int ready) {
  std::atomic<bool> done{false};
  // 16 slow clients: a well-formed handshake, one byte per second.
  std::thread slow_clients([&] {
    std::vector<Raw> slow;
    for (int i = 0; i < 16; ++i) slow.emplace_back(port);
    const std::string hs = frame_of(std::string(4 + 2 + 16 + 32, 'x'));
    for (std::size_t at = 0; !done.load() && at < hs.size(); ++at) {
      for (auto& s : slow) s.send(hs.substr(at, 1));
      for (int t = 0; t < 10 && !done.load(); ++t) std::this_thread::sleep_for(100ms);
    }
  });
  // A client that stores 1 MiB and asks for it 3,000 times without reading a reply.
  std::thread non_reader([&] {
    Raw c(port);
    if (!c.ok || !c.authenticate(token)) return;
    const auto request = [](sp::Op op, std::uint64_t id, std::string_view key,
                            std::string_view value, bool with_value) {
      std::string r;
      ddp::detail::ByteWriter w(r);
      w.put(op);
      w.put(id);
      w.str(key);
      if (with_value)
        w.str(value);
      else
        w.put(std::uint64_t{1000});
      return frame_of(r);
    };
    c.send(request(sp::Op::set, 1, "big", std::string(1 << 20, 'b'), true));
    std::string gets;
    for (std::uint64_t i = 0; i < 3000; ++i) gets += request(sp::Op::get, 2 + i, "big", {}, false);
    (void)ddp::detail::send_all(c.fd.get(), gets.data(), gets.size(), Deadline::after(3s));
    while (!done.load()) std::this_thread::sleep_for(50ms);
  });
  std::atomic<int> sent{0};
  std::array<std::thread, 8> senders;
  for (int t = 0; t < 8; ++t) {
    senders[static_cast<std::size_t>(t)] = std::thread([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      for (int i = 0; i < 1250; ++i) {
        attack_once(port, static_cast<int>(rng() % 10), rng);
        sent.fetch_add(1);
      }
    });
  }
  while (sent.load() < 100) std::this_thread::sleep_for(1ms);
  (void)!::write(ready, "s", 1);
  for (auto& t : senders) t.join();
  done.store(true);
  slow_clients.join();
  non_reader.join();
  ::_exit(sent.load() == 10000 ? 0 : 1);
}

}  // namespace

TEST_CASE(
    "store under attack: 10^4 hostile frames, slow and non-reading clients, while rendezvous, "
    "1,000 set/get and bounded memory") {
  mp::TempDir dir;
  const std::string log_file = dir.file("store.log");
  int port_pipe[2], stop_pipe[2], ready_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  REQUIRE(::pipe(stop_pipe) == 0);
  REQUIRE(::pipe(ready_pipe) == 0);
  std::fflush(nullptr);
  // The server runs in a process of its own, so its memory can be measured alone.
  const pid_t server_pid = ::fork();
  REQUIRE(server_pid >= 0);
  if (server_pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int code = 1;
    try {
      ddp::StoreOptions o;
      o.token = token;
      o.timeout = 30s;
      // Every refusal logged: the checks below look for each kind, and in a fast build the whole
      // attack fits in one 10 s window, where the default burst of 20 lines may miss a kind
      // (the rate limit itself is tested in test_outsider.cpp).
      o.log_burst = 1'000'000;
      auto log = std::make_shared<std::ofstream>(log_file);
      o.log = [log](std::string_view m) { *log << m << '\n'; };
      ddp::StoreServer server("127.0.0.1", 0, o);
      const int port = server.port();
      (void)!::write(port_pipe[1], &port, sizeof port);
      char c;
      (void)!::read(stop_pipe[0], &c, 1);  // until the parent says stop
      server.stop();
      log->flush();
      code = 0;
    } catch (...) {
    }
    ::_exit(code);
  }
  int port = 0;
  REQUIRE(::read(port_pipe[0], &port, sizeof port) == static_cast<ssize_t>(sizeof port));

  ddp::StoreOptions client_options;
  client_options.token = token;
  client_options.timeout = 30s;
  client_options.log = [](std::string_view) {};
  {  // warm up: one client, one value; then the baseline
    ddp::Store warm("127.0.0.1", port, client_options);
    warm.set("warm", "up");
    CHECK(warm.get("warm") == "up");
  }
  std::this_thread::sleep_for(200ms);
  const long long rss_before = status_kib(server_pid, "VmRSS");

  const pid_t attacker_pid = ::fork();
  REQUIRE(attacker_pid >= 0);
  if (attacker_pid == 0) attacker(port, ready_pipe[1]);
  char c;
  REQUIRE(::read(ready_pipe[0], &c, 1) == 1);

  // While the attack goes on: a real rendezvous of four ranks, and 1,000 set/get.
  try {
    ddp::spawn(4, [&](ddp::Environment env) {
      env.store_port = port;
      ddp::Options o;
      o.token = token;
      o.external_store = true;
      o.timeout = 60s;
      auto comm = mp::Comm::init(env, o);
      std::vector<int> v{comm.rank() + 1};
      comm.all_reduce(v);
      MP_EXPECT(v[0] == 10, "all_reduce gave " << v[0]);
    });
  } catch (const ddp::Error& e) {
    FAIL_CHECK("rendezvous under attack failed: " << std::string(e.what()));
  }
  {
    ddp::Store store("127.0.0.1", port, client_options);
    int wrong = 0;
    for (int i = 0; i < 1000; ++i) {
      const std::string key = "key/" + std::to_string(i),
                        value = std::string(static_cast<std::size_t>(i % 97), 'v');
      store.set(key, value);
      if (store.get(key) != value) ++wrong;
    }
    CHECK(wrong == 0);
  }
  int status = 0;
  REQUIRE(::waitpid(attacker_pid, &status, 0) == attacker_pid);
  CHECK_MESSAGE(WIFEXITED(status), "the attacker died");
  CHECK_MESSAGE(WEXITSTATUS(status) == 0, "the attacker could not send all 10^4 frames");

  // Still alive and serving, and its memory stayed bounded.
  CHECK(::kill(server_pid, 0) == 0);
  const long long peak = status_kib(server_pid, "VmHWM");
  MESSAGE("store server RSS before " << rss_before << " KiB, peak " << peak << " KiB");
#if !MP_SANITIZED
  CHECK(peak - rss_before < 16 * 1024);
#endif
  REQUIRE(::write(stop_pipe[1], "q", 1) == 1);
  REQUIRE(::waitpid(server_pid, &status, 0) == server_pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::string log = mp::TempDir::read(log_file);
  CHECK(log.find(token) == std::string::npos);
  CHECK(log.find("frame of 4294967295 bytes refused") != std::string::npos);
  CHECK(log.find("stray traffic starting \"GET \"") != std::string::npos);
  CHECK(log.find("connected and closed without a handshake") != std::string::npos);
  CHECK(log.find("wrong or missing token") != std::string::npos);
  for (int fd :
       {port_pipe[0], port_pipe[1], stop_pipe[0], stop_pipe[1], ready_pipe[0], ready_pipe[1]}) {
    ::close(fd);
  }
}
