// The CUDA suite: ddp::CudaBuffer and friends, and Communicator<backend::Nccl> on one GPU (NCCL
// world of one: every collective, stream ordering under a deliberately slow producer, the
// timeout and abort paths). Without a CUDA device the program prints "no CUDA device" and
// exits 0, which CTest reports as skipped (SKIP_REGULAR_EXPRESSION).
#define DOCTEST_CONFIG_IMPLEMENT
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kernels.hpp"

namespace {

using Nccl = ddp::Communicator<ddp::backend::Nccl>;
using namespace std::chrono_literals;

Nccl single(std::chrono::milliseconds timeout = 60s) {
  ddp::Options o;
  o.timeout = timeout;
  o.device = 0;
  return Nccl::init(ddp::Environment{}, o);
}

template <class T>
std::vector<T> host(const ddp::CudaBuffer<T>& d) {
  std::vector<T> h(d.size());
  d.copy_to(h);
  return h;
}

}  // namespace

TEST_CASE("CudaBuffer: copies in and out, moves, and its view says cuda with its stream") {
  ddp::CudaStream stream(0);
  std::vector<float> in(1000);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * 0.5f;
  ddp::CudaBuffer<float> d(std::span<const float>(in), 0, stream.get());
  CHECK(host(d) == in);
  const auto v = ddp::view(d);
  CHECK(v.device == ddp::Device::cuda(0));
  CHECK(v.stream == static_cast<void*>(stream.get()));
  CHECK(v.size == in.size());
  static_assert(ddp::CudaTensor<ddp::CudaBuffer<float>>);
  static_assert(!ddp::HostTensor<ddp::CudaBuffer<float>>);
  ddp::CudaBuffer<float> moved = std::move(d);
  CHECK(d.data() == nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  CHECK(host(moved) == in);
  std::vector<float> wrong(3);
  CHECK_THROWS_AS(moved.copy_to(wrong), ddp::Error);
  ddp::PinnedBuffer<double> pinned(16);
  static_assert(ddp::HostTensor<ddp::PinnedBuffer<double>>);
  CHECK(pinned.size() == 16);
}

TEST_CASE("a failing CUDA call raises Errc::backend naming the call") {
  void* p = nullptr;
  try {
    DDP_CUDA_CHECK(cudaMalloc(&p, std::size_t{1} << 62));
    FAIL("a 4 EiB cudaMalloc succeeded");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::backend);
    CHECK(std::string(e.what()).find("cudaMalloc") != std::string::npos);
  }
}

TEST_CASE("Communicator<backend::Nccl>, world of one: every collective") {
  auto comm = single();
  CHECK(comm.size() == 1);
  CHECK(comm.backend().device() == 0);
  std::vector<float> h{1, 2, 3, 4};
  ddp::CudaBuffer<float> a{std::span<const float>(h)}, b(4);
  comm.all_reduce(a, ddp::ReduceOp::sum);
  CHECK(host(a) == h);
  comm.all_reduce(a, ddp::ReduceOp::avg);
  CHECK(host(a) == h);
  comm.broadcast(a, 0);
  comm.reduce(a, 0, ddp::ReduceOp::max);
  CHECK(host(a) == h);
  comm.all_gather(a, b);
  CHECK(host(b) == h);
  comm.gather(a, b, 0);
  CHECK(host(b) == h);
  comm.scatter(a, b, 0);
  CHECK(host(b) == h);
  comm.reduce_scatter(a, b, ddp::ReduceOp::sum);
  CHECK(host(b) == h);
  comm.all_to_all(a, b);
  CHECK(host(b) == h);
  comm.barrier();
  auto w = comm.all_reduce_async(a);
  w.wait();
  CHECK(host(a) == h);
  std::vector<ddp::half> hh{ddp::half(1.5f), ddp::half(-2.0f)};
  ddp::CudaBuffer<ddp::half> half_buf{std::span<const ddp::half>(hh)};
  comm.all_reduce(half_buf, ddp::ReduceOp::avg);
  const auto back = host(half_buf);
  CHECK(static_cast<float>(back[0]) == 1.5f);
  CHECK(static_cast<float>(back[1]) == -2.0f);
}

TEST_CASE("object collectives and split on backend::Nccl go through device memory") {
  auto comm = single();
  const auto all = comm.all_gather_object(std::string("rank zero"));
  REQUIRE(all.size() == 1);
  CHECK(all[0] == "rank zero");
  std::vector<int> v{1, 2, 3};
  comm.broadcast_object(v, 0);
  CHECK(v == std::vector<int>{1, 2, 3});
  CHECK(comm.gather_object(7, 0) == std::vector<int>{7});
  auto sub = comm.split(0);
  REQUIRE(sub.valid());
  CHECK(sub.size() == 1);
  ddp::CudaBuffer<float> a(std::vector<float>{2, 4}, 0);
  sub.all_reduce(a, ddp::ReduceOp::avg);
  CHECK(host(a) == std::vector<float>{2, 4});
}

namespace {
struct Param {
  ddp::CudaBuffer<float> value, grad;
};
}  // namespace

TEST_CASE("GradientAverager on backend::Nccl: device buckets, in place, unused parameters") {
  auto comm = single();
  ddp::CudaStream stream(0);
  std::vector<Param> model;
  for (const std::size_t n : {5UL, 200'000UL, 3UL, 7UL}) {  // 200k floats: averaged in place
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 13) + 0.5f;
    model.push_back({ddp::CudaBuffer<float>(std::span<const float>(g), 0, stream.get()),
                     ddp::CudaBuffer<float>(std::span<const float>(g), 0, stream.get())});
  }
  ddp::GradientAverager avg(comm, model);
  CHECK(avg.buckets().size() == 3);  // {3, 2} packed, {1} in place, {0} packed
  avg.mark_ready(3);
  avg.mark_ready(1);
  avg.mark_ready(0);  // parameter 2 unused: its gradient becomes zero
  avg.synchronize();
  for (std::size_t k = 0; k < model.size(); ++k) {
    const auto g = host(model[k].grad);
    for (std::size_t i = 0; i < g.size(); ++i) {
      REQUIRE(g[i] == (k == 2 ? 0.0f : static_cast<float>(i % 13) + 0.5f));
    }
  }
  CHECK_FALSE(avg.found_nonfinite());
  ddp::AveragerOptions compressed;
  compressed.compression = ddp::Compression::bfloat16;
  try {
    ddp::GradientAverager bad(comm, model, compressed);
    FAIL("compression of CUDA gradients on NCCL was accepted");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::unsupported);
  }
}

TEST_CASE("a host buffer seen only at run time, or one on another device, is refused") {
  auto comm = single();
  std::vector<float> h(4);
  ddp::TensorView<float> on_host{h.data(), h.size()};  // type says nothing: checked at run time
  try {
    comm.all_reduce(on_host);
    FAIL("a host view was accepted by backend::Nccl");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    CHECK(std::string(e.what()).find("backend::nccl cannot use that memory") != std::string::npos);
  }
  ddp::CudaBuffer<float> d(4);
  ddp::TensorView<float> elsewhere{d.data(), d.size(), ddp::Device::cuda(7)};
  CHECK_THROWS_AS(comm.all_reduce(elsewhere), ddp::Error);
}

TEST_CASE("stream ordering: a collective waits for a slow producer on the tensor's stream") {
  auto comm = single();
  ddp::CudaStream producer(0);
  ddp::CudaBuffer<float> buf(1 << 20, 0, producer.get());
  buf.fill_bytes(0);
  // About 200 ms of spinning before the kernel writes 3.0: a collective that did not wait would
  // reduce the zeros.
  launch_slow_fill(buf.data(), buf.size(), 3.0f, producer.get(), 400'000'000LL);
  comm.all_reduce(buf, ddp::ReduceOp::max);
  const auto h = host(buf);
  CHECK(h.front() == 3.0f);
  CHECK(h.back() == 3.0f);
}

TEST_CASE("timeout: a collective stuck behind a kernel fails with Errc::timeout and aborts") {
  auto comm = single(300ms);
  ddp::CudaStream producer(0);
  ddp::CudaBuffer<float> buf(16, 0, producer.get());
  launch_slow_fill(buf.data(), buf.size(), 1.0f, producer.get(), 8'000'000'000LL);  // seconds
  const auto t0 = std::chrono::steady_clock::now();
  try {
    comm.all_reduce(buf);
    FAIL("the collective returned before the producer finished");
  } catch (const ddp::Error& e) {
    const auto waited = std::chrono::steady_clock::now() - t0;
    CHECK(e.code() == ddp::Errc::timeout);
    CHECK(waited >= 300ms);
    CHECK(waited < 3s);
    CHECK(std::string(e.what()).find("all_reduce") != std::string::npos);
  }
  CHECK_THROWS_AS(comm.barrier(), ddp::Error);  // poisoned: fails at once
  producer.synchronize();
}

TEST_CASE("abort() from another thread unblocks a waiting collective") {
  auto comm = single(60s);
  ddp::CudaStream producer(0);
  ddp::CudaBuffer<float> buf(16, 0, producer.get());
  launch_slow_fill(buf.data(), buf.size(), 1.0f, producer.get(), 8'000'000'000LL);
  std::thread watchdog([&] {
    std::this_thread::sleep_for(200ms);
    comm.abort("the test's watchdog");
  });
  const auto t0 = std::chrono::steady_clock::now();
  try {
    comm.all_reduce(buf);
    FAIL("the collective returned");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::aborted);
    CHECK(std::chrono::steady_clock::now() - t0 < 15s);  // timeout/4
  }
  watchdog.join();
  producer.synchronize();
}

int main(int argc, char** argv) {
  if (ddp::cuda_device_count() == 0) {
    std::puts("ddp CUDA tests: no CUDA device; skipped");
    return 0;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
