// The staging pipeline that runs collectives on CUDA buffers over host-memory backends
// (comm/staging.hpp), driven here by a copier that copies with memcpy and checks the rules a
// real one relies on: no slot resized or refilled while a copy into or out of it is pending,
// every fetch waited for before its data is used. The CUDA copier itself is tested on a GPU
// (tests/cuda/test_host_staging.cpp).
#include <ddp/comm/staging.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using ddp::detail::Buf;

/// Copies at once, but keeps each copy "pending" until waited for, and refuses what a real
/// asynchronous copier could not survive.
struct CheckingCopier {
  std::vector<std::vector<std::byte>> slots = std::vector<std::vector<std::byte>>(5);
  std::vector<bool> fetching = std::vector<bool>(5), storing = std::vector<bool>(5);
  std::vector<std::string> log;
  int afters = 0;

  static std::size_t u(int s) { return static_cast<std::size_t>(s); }
  static void expect(bool ok, const std::string& what) {
    if (!ok) throw std::logic_error(what);
  }
  std::byte* slot(int s, std::size_t n) {
    auto& b = slots.at(u(s));
    if (b.size() < n) {
      expect(!fetching[u(s)] && !storing[u(s)], "slot resized while a copy is pending");
      b.resize(n);
    }
    return b.data();
  }
  void after(void*) { ++afters; }
  void fetch(int s, std::byte* host, const std::byte* dev, std::size_t n) {
    expect(!fetching[u(s)] && !storing[u(s)], "fetch into a slot with a pending copy");
    expect(host >= slots[u(s)].data() && host + n <= slots[u(s)].data() + slots[u(s)].size(),
           "fetch outside its slot");
    std::memcpy(host, dev, n);
    fetching[u(s)] = true;
    log.push_back("fetch" + std::to_string(s));
  }
  void wait_fetch(int s) {
    expect(fetching[u(s)], "wait_fetch without a fetch");
    fetching[u(s)] = false;
  }
  void store(int s, std::byte* dev, const std::byte* host, std::size_t n) {
    expect(!fetching[u(s)] && !storing[u(s)], "store from a slot with a pending copy");
    std::memcpy(dev, host, n);
    storing[u(s)] = true;
    log.push_back("store" + std::to_string(s));
  }
  void wait_store(int s) { storing[u(s)] = false; }
  [[nodiscard]] bool idle() const {
    for (std::size_t s = 0; s < slots.size(); ++s)
      if (fetching[s] || storing[s]) return false;
    return true;
  }
};
static_assert(ddp::detail::StagingCopier<CheckingCopier>);

Buf device_buf(std::vector<float>& v) {
  return {reinterpret_cast<std::byte*>(v.data()), v.size(), ddp::DType::float32,
          ddp::Device::cuda(0), nullptr};
}

}  // namespace

TEST_CASE("staged elementwise collectives: pieces cover the buffer, carry its size, overlap") {
  constexpr std::size_t piece_bytes = 64;  // 16 floats
  for (const std::size_t count : {0UL, 1UL, 15UL, 16UL, 17UL, 53UL, 160UL}) {
    CAPTURE(count);
    std::vector<float> dev(count);
    std::iota(dev.begin(), dev.end(), 1.0f);
    CheckingCopier c;
    std::vector<std::size_t> lengths;
    ddp::detail::stage_elementwise(c, device_buf(dev), true, true, piece_bytes, [&](const Buf& h) {
      CHECK(h.device.is_cpu());
      CHECK(h.whole == count);  // the fingerprint shows the whole buffer
      CHECK(h.fingerprint_count() == (count == 0 ? 0 : count));
      auto* f = reinterpret_cast<float*>(h.data);
      for (std::size_t i = 0; i < h.count; ++i) f[i] *= 2.0f;
      lengths.push_back(h.count);
    });
    CHECK(c.idle());
    const std::size_t pieces = count == 0 ? 1 : (count + 15) / 16;
    REQUIRE(lengths.size() == pieces);
    CHECK(std::accumulate(lengths.begin(), lengths.end(), std::size_t{0}) == count);
    for (std::size_t i = 0; i < count; ++i) REQUIRE(dev[i] == 2.0f * static_cast<float>(i + 1));
    if (pieces >= 3) {
      // Pipelined: the next piece is fetched before this one is stored, and slots rotate.
      CHECK(c.log[0] == "fetch0");
      CHECK(c.log[1] == "fetch1");
      CHECK(c.log[2] == "store0");
      CHECK(c.log[3] == "fetch2");
      CHECK(c.log[4] == "store1");
      CHECK(c.log[5] == "fetch0");  // piece 3 reuses slot 0 after its store was waited for
    }
  }
}

TEST_CASE("staged elementwise collectives: receive-only and send-only sides") {
  std::vector<float> dev(40, 7.0f);
  CheckingCopier in_only;
  ddp::detail::stage_elementwise(in_only, device_buf(dev), true, false, 64, [](const Buf& h) {
    auto* f = reinterpret_cast<float*>(h.data);
    CHECK(f[0] == 7.0f);
    f[0] = -1.0f;  // a scratch write must not reach the device buffer
  });
  CHECK(dev[0] == 7.0f);
  CHECK(dev[16] == 7.0f);

  CheckingCopier out_only;
  std::size_t at = 0;
  ddp::detail::stage_elementwise(out_only, device_buf(dev), false, true, 64, [&](const Buf& h) {
    auto* f = reinterpret_cast<float*>(h.data);
    for (std::size_t i = 0; i < h.count; ++i) f[i] = static_cast<float>(at++);
  });
  for (std::size_t i = 0; i < dev.size(); ++i) REQUIRE(dev[i] == static_cast<float>(i));
  for (const auto& e : out_only.log) CHECK(e.rfind("store", 0) == 0);
  CHECK(out_only.idle());
}

TEST_CASE("staged whole collectives: device buffers in and out, host and empty ones unchanged") {
  std::vector<float> in(6, 3.0f), out(12, 0.0f), host(4, 1.0f);
  CheckingCopier c;
  ddp::detail::stage_whole(
      c,
      std::array<ddp::detail::StagedArg, 4>{
          ddp::detail::StagedArg{device_buf(in), true, false},
          ddp::detail::StagedArg{device_buf(out), false, true},
          ddp::detail::StagedArg{{reinterpret_cast<std::byte*>(host.data()), host.size(),
                                  ddp::DType::float32, ddp::Device::cpu(), nullptr},
                                 true,
                                 true},
          ddp::detail::StagedArg{
              {nullptr, 0, ddp::DType::float32, ddp::Device::cuda(0), nullptr}, false, true}},
      [&](const Buf& i, const Buf& o, const Buf& h, const Buf& e) {
        CHECK(i.device.is_cpu());
        CHECK(o.device.is_cpu());
        CHECK(i.data != reinterpret_cast<std::byte*>(in.data()));    // staged
        CHECK(h.data == reinterpret_cast<std::byte*>(host.data()));  // passed through
        CHECK(e.data == nullptr);
        const auto* src = reinterpret_cast<const float*>(i.data);
        auto* dst = reinterpret_cast<float*>(o.data);
        for (std::size_t k = 0; k < o.count; ++k) dst[k] = src[k % i.count] + 1.0f;
        reinterpret_cast<float*>(h.data)[0] = 9.0f;
      });
  for (const float x : out) CHECK(x == 4.0f);
  CHECK(in[0] == 3.0f);
  CHECK(host[0] == 9.0f);
  CHECK(c.idle());
  CHECK(c.afters == 2);  // both staged buffers order their copies after their streams
}
