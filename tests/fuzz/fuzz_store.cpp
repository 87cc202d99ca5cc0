// libFuzzer harness for the store server's frame parser and request handler
// (ddp::detail::StoreEngine, the I/O-free core of StoreServer): whatever several clients send,
// in whatever pieces and order, the server never crashes, never reads out of bounds (ASan), hits
// no undefined behaviour (UBSan), buffers no more than the frame being read and never more than
// its limits allow, keeps its output well framed, and never writes the token into its log.
//
// The input is a little program of client actions, so the fuzzer reaches the authenticated
// request parser without having to forge HMACs: "authenticate" computes the proof from the
// session's nonce the way a real client would.
#include <ddp/store/server.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace sp = ddp::detail::store_proto;
using ddp::detail::StoreEngine;

constexpr std::string_view token = "fuzz-token-3b1f";

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "store fuzzer: %s\n", what);
  std::abort();
}

struct Input {
  const std::uint8_t* p;
  std::size_t n;
  bool empty() const { return n == 0; }
  std::uint8_t byte() {
    if (n == 0) return 0;
    --n;
    return *p++;
  }
  std::size_t u16() {
    const std::size_t lo = byte();
    return lo | (std::size_t{byte()} << 8);
  }
  std::string_view bytes(std::size_t k) {
    k = std::min(k, n);
    std::string_view v(reinterpret_cast<const char*>(p), k);
    p += k;
    n -= k;
    return v;
  }
};

std::string framed(std::string_view payload) {
  std::string f;
  ddp::detail::ByteWriter w(f);
  w.put(static_cast<std::uint32_t>(payload.size()));
  f.append(payload);
  return f;
}

// The output queued for a client must be a sequence of whole frames (a partial last one only
// while it is still being written, which the engine never leaves behind).
void check_output(const StoreEngine::Session& s) {
  std::size_t at = 0;
  while (at < s.out.size()) {
    if (s.out.size() - at < 4) fail("output ends in a partial length prefix");
    ddp::detail::ByteReader r(s.out.data() + at, 4, "frame");
    const auto len = r.get<std::uint32_t>();
    if (s.out.size() - at - 4 < len) fail("output ends in a partial frame");
    at += 4 + len;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{data, size};
  const std::uint8_t mode = in.byte();
  ddp::StoreOptions o;
  if ((mode & 1) != 0) o.token = std::string(token);
  o.max_key_bytes = 64;
  o.max_value_bytes = 512;
  o.max_keys = 16;
  o.max_total_bytes = 4096;
  o.max_connections = 8;
  o.handshake_timeout = std::chrono::seconds(10);
  bool token_logged = false;
  o.log = [&](std::string_view line) {
    if (line.find(token) != std::string_view::npos) token_logged = true;
  };
  const std::size_t limit = sp::frame_limit(o);

  StoreEngine engine(o);
  auto now = ddp::detail::Clock::time_point{} + std::chrono::hours(1);
  std::vector<std::uint64_t> ids;
  const auto pick = [&]() -> std::uint64_t {
    if (ids.empty()) return 0;
    return ids[in.byte() % ids.size()];
  };

  while (!in.empty()) {
    switch (in.byte() % 8) {
      case 0:  // a client connects
        if (const auto id = engine.open("fuzz-peer", now); id != 0) ids.push_back(id);
        break;
      case 1: {  // a client authenticates properly (or with a wrong version / token)
        const auto id = pick();
        auto* s = engine.session(id);
        if (s == nullptr) break;
        const std::uint8_t how = in.byte();
        sp::Nonce client{};
        for (auto& b : client) b = in.byte();
        const auto mac =
            ddp::detail::hmac_sha256((how & 1) != 0 ? std::string_view("wrong") : token,
                                     sp::client_label, sp::as_view(s->nonce), sp::as_view(client));
        std::string hs;
        ddp::detail::ByteWriter w(hs);
        w.put(sp::magic);
        w.put(static_cast<std::uint16_t>((how & 2) != 0 ? sp::version + 1 : sp::version));
        w.raw(client.data(), client.size());
        w.raw(mac.data(), mac.size());
        engine.receive(id, framed(hs), now);
        break;
      }
      case 2: {  // raw bytes, any length prefix
        const auto id = pick();
        const std::size_t k = in.u16();
        engine.receive(id, in.bytes(k), now);
        break;
      }
      case 3: {  // one frame whose length prefix is right: reaches the request parser
        const auto id = pick();
        const std::size_t k = in.u16() % 2048;
        engine.receive(id, framed(in.bytes(k)), now);
        break;
      }
      case 4:  // a client hangs up
        engine.peer_closed(pick());
        break;
      case 5:  // time passes: waits and handshakes expire
        now += std::chrono::milliseconds(100 * in.byte());
        engine.expire(now);
        break;
      case 6:  // the server writes what it queued
        for (auto& [id, s] : engine.sessions()) {
          check_output(s);
          s.out.clear();
          s.out_sent = 0;
          if (s.close_after_write) s.closed = true;
        }
        break;
      default:
        engine.reap();
        std::erase_if(ids, [&](std::uint64_t id) { return engine.session(id) == nullptr; });
        break;
    }
    for (auto& [id, s] : engine.sessions()) {
      const std::size_t cap = (s.authed ? limit : sp::handshake_frame_limit) + 4;
      if (s.in.size() > cap) fail("a connection buffered more than one frame");
      if (s.out.size() > (std::size_t{1} << 20)) fail("output grew without bound");
    }
    std::size_t live = 0;
    for (auto& [id, s] : engine.sessions()) live += s.closed ? 0 : 1;
    if (live > o.max_connections) fail("more open sessions than max_connections");
    if (engine.keys() > o.max_keys) fail("more keys than max_keys");
  }
  for (auto& [id, s] : engine.sessions()) check_output(s);
  if (token_logged) fail("the token appeared in the log");
  return 0;
}
