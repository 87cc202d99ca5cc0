// The CUDA suite: ddp::CudaBuffer and friends, and Communicator<backend::Nccl> on one GPU (NCCL
// world of one: every collective, stream ordering under a deliberately slow producer, the
// timeout and abort paths). Without a CUDA device the program prints "no CUDA device" and
// exits 0, which CTest reports as skipped (SKIP_REGULAR_EXPRESSION).
#define DOCTEST_CONFIG_IMPLEMENT
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
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
  const std::vector<std::size_t> four{4};  // the uneven forms: one rank's count
  comm.all_to_all(a, b, four, four);
  CHECK(host(b) == h);
  comm.all_gather(a, b, four);
  CHECK(host(b) == h);
  comm.gather(a, b, four, 0);
  CHECK(host(b) == h);
  comm.scatter_async(a, b, four, 0).wait();
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

TEST_CASE("16-bit integers on backend::Nccl: moved bitwise, reductions refused") {
  auto comm = single();
  // NCCL has no 16-bit integer type: they travel as float16, whose copies are bitwise; these
  // bit patterns include float16 NaNs and negative zero.
  std::vector<std::int16_t> h{-1, 0x7e01, -32768, 0x7c00, 12345};
  ddp::CudaBuffer<std::int16_t> a{std::span<const std::int16_t>(h)}, b(h.size());
  comm.broadcast(a, 0);
  CHECK(host(a) == h);
  comm.all_gather(a, b);
  CHECK(host(b) == h);
  comm.all_to_all(a, b);
  CHECK(host(b) == h);
  ddp::CudaBuffer<std::uint16_t> u(3);
  for (auto call : {0, 1, 2}) {
    try {
      if (call == 0) comm.all_reduce(a);
      if (call == 1) comm.reduce(u, 0);
      if (call == 2) comm.reduce_scatter(a, b);
      FAIL("a 16-bit integer reduction was accepted by backend::Nccl");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find("NCCL cannot reduce 16-bit integers") != std::string::npos);
    }
  }
  ddp::CudaBuffer<std::int32_t> wide(3);
  comm.all_reduce(wide);  // still usable: the refused calls sent nothing
}

TEST_CASE("bool, premul_sum and the bitwise ops on backend::Nccl") {
  auto comm = single();
  // bool travels as ncclUint8: sum/bor as max, band as min; bxor is refused (NCCL has none).
  const bool flags[] = {true, false, true};
  ddp::CudaBuffer<bool> f{std::span<const bool>(flags)};
  for (const auto op : {ddp::ReduceOp::sum, ddp::ReduceOp::bor, ddp::ReduceOp::band,
                        ddp::ReduceOp::max, ddp::ReduceOp::min, ddp::ReduceOp::prod}) {
    comm.all_reduce(f, op);
    std::array<bool, 3> got{};
    f.copy_to(got);
    CHECK((got[0] && !got[1] && got[2]));
  }
  std::vector<std::int32_t> ints{6, 3};
  ddp::CudaBuffer<std::int32_t> i32{std::span<const std::int32_t>(ints)};
  for (const auto op : {ddp::ReduceOp::band, ddp::ReduceOp::bor, ddp::ReduceOp::bxor}) {
    try {
      comm.all_reduce(i32, op);
      FAIL("a bitwise reduction was accepted by backend::Nccl");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find("NCCL has no bitwise reductions") != std::string::npos);
    }
  }
  try {
    comm.all_reduce(f, ddp::ReduceOp::bxor);
    FAIL("bxor on bool was accepted by backend::Nccl");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
  }
  comm.all_reduce(i32, ddp::ReduceOp::sum);  // still usable
  CHECK(host(i32) == ints);
  // premul_sum with ncclRedOpCreatePreMulSum: one rank, so the result is the input times the
  // factor, in every reducing collective and every floating-point type.
  std::vector<float> h{1, -2, 3, 4.5f};
  std::vector<float> quarter{0.25f, -0.5f, 0.75f, 1.125f};
  ddp::CudaBuffer<float> a{std::span<const float>(h)}, b(4);
  comm.all_reduce(a, ddp::premul_sum(0.25));
  CHECK(host(a) == quarter);
  a.copy_from(h);
  comm.reduce(a, 0, ddp::premul_sum(0.25));
  CHECK(host(a) == quarter);
  a.copy_from(h);
  comm.reduce_scatter(a, b, ddp::premul_sum(0.25));
  CHECK(host(b) == quarter);
  CHECK(host(a) == h);  // `in` unchanged
  std::vector<ddp::CudaBuffer<float>> many;
  many.emplace_back(std::span<const float>(h));
  many.emplace_back(std::span<const float>(h));
  comm.all_reduce_coalesced(many, ddp::premul_sum(0.25));  // one NCCL group
  CHECK(host(many[0]) == quarter);
  CHECK(host(many[1]) == quarter);
  std::vector<double> hd{2, -8};
  ddp::CudaBuffer<double> d{std::span<const double>(hd)};
  comm.all_reduce(d, ddp::premul_sum(0.5));
  CHECK(host(d) == std::vector<double>{1, -4});
  std::vector<ddp::bfloat16> hb{ddp::bfloat16(3.0f), ddp::bfloat16(-1.0f)};
  ddp::CudaBuffer<ddp::bfloat16> bf{std::span<const ddp::bfloat16>(hb)};
  comm.all_reduce(bf, ddp::premul_sum(2.0));
  const auto bb = host(bf);
  CHECK(static_cast<float>(bb[0]) == 6.0f);
  CHECK(static_cast<float>(bb[1]) == -2.0f);
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

// Four parameters of 5, 200k, 3 and 7 floats on `stream`, value and gradient both i % 13 + 0.5.
std::vector<Param> cuda_model(ddp::CudaStream& stream) {
  std::vector<Param> model;
  for (const std::size_t n : {5UL, 200'000UL, 3UL, 7UL}) {
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 13) + 0.5f;
    model.push_back({ddp::CudaBuffer<float>(std::span<const float>(g), 0, stream.get()),
                     ddp::CudaBuffer<float>(std::span<const float>(g), 0, stream.get())});
  }
  return model;
}

float expected(std::size_t i) { return static_cast<float>(i % 13) + 0.5f; }
}  // namespace

TEST_CASE(
    "the training layer's host values work on backend::Nccl: exact_mean, "
    "sync_batch_stats, ZeroFirstGuard, all_reduce_host, broadcast_host") {
  auto comm = single();
  std::vector<double> v{1.5, -2.0};
  comm.all_reduce_host(std::span<double>(v), ddp::ReduceOp::sum);
  CHECK(v == std::vector<double>{1.5, -2.0});
  comm.broadcast_host(std::span<double>(v), 0);
  CHECK(v[1] == -2.0);
  CHECK(ddp::exact_mean(comm, 6.0, 4) == 1.5);
  const std::vector<float> sum{3.0f}, sq{5.0f};  // samples 1 and 2
  const auto s =
      ddp::sync_batch_stats(comm, std::span<const float>(sum), std::span<const float>(sq), 2);
  CHECK(s.mean[0] == 1.5);
  CHECK(s.var[0] == doctest::Approx(0.25));
  { ddp::ZeroFirstGuard guard(comm); }
}

TEST_CASE("GradientAverager on backend::Nccl: device buckets, in place, unused parameters") {
  auto comm = single();
  ddp::CudaStream stream(0);
  auto model = cuda_model(stream);  // parameter 1 (200k floats) is averaged in place
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
  ddp::BucketOptions compressed;
  compressed.compression = ddp::Compression::bfloat16;
  try {
    ddp::GradientAverager bad(comm, model, compressed);
    FAIL("compression of CUDA gradients on NCCL was accepted");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::unsupported);
  }
}

TEST_CASE(
    "ShardedAverager on backend::Nccl: device buckets, in place, the shard updated and gathered") {
  auto comm = single();
  ddp::CudaStream stream(0);
  auto model = cuda_model(stream);
  ddp::ShardedAverager zero(comm, model);
  CHECK(zero.buckets().size() == 3);
  CHECK(zero.shard_size() == zero.total_size());  // a world of one owns everything
  zero.mark_ready(3);
  zero.mark_ready(1);
  zero.mark_ready(0);  // parameter 2 unused: its averaged gradient is zero
  zero.synchronize();
  // The update, on the host for the test: value -= grad.
  for (auto& s : zero.shard()) {
    std::vector<float> v(s.value.size), g(s.grad.size);
    ddp::detail::copy_bytes(v.data(), s.value.data, s.value.bytes(), true, nullptr);
    ddp::detail::copy_bytes(g.data(), s.grad.data, s.grad.bytes(), true, nullptr);
    ddp::detail::sync_stream(true, nullptr);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] -= g[i];
    ddp::detail::copy_bytes(s.value.data, v.data(), s.value.bytes(), true, nullptr);
    ddp::detail::sync_stream(true, nullptr);
  }
  zero.gather();
  for (std::size_t k = 0; k < model.size(); ++k) {
    const auto v = host(model[k].value);
    for (std::size_t i = 0; i < v.size(); ++i)
      REQUIRE(v[i] == (k == 2 ? static_cast<float>(i % 13) + 0.5f : 0.0f));
  }
  CHECK_FALSE(zero.found_nonfinite());
  CHECK(zero.grad_norm() > 0.0);
}

TEST_CASE(
    "comm hooks on backend::Nccl: a hook of the user's on device buckets, compression refused "
    "naming the bucket") {
  auto comm = single();
  ddp::CudaStream stream(0);
  auto model = cuda_model(stream);
  ddp::GradientAverager avg(comm, model);
  std::vector<std::size_t> seen;
  avg.register_comm_hook([&](auto& c, ddp::GradBucket<float>& b) {
    CHECK(b.buffer.device == ddp::Device::cuda(0));
    seen.push_back(b.index);
    return ddp::allreduce_hook(c, b);
  });
  for (std::size_t k = 0; k < model.size(); ++k) avg.mark_ready(k);
  avg.synchronize();
  CHECK(seen.size() == avg.buckets().size());
  for (std::size_t k = 0; k < model.size(); ++k) {
    const auto g = host(model[k].grad);
    for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == expected(i));
  }
  // (PowerSGDHook does not compile for a Communicator<Nccl>: its matrices are host memory.)
  for (const auto wire : {ddp::fp16_compress_hook, ddp::bf16_compress_hook}) {
    avg.register_comm_hook(wire);
    for (std::size_t k = 0; k < model.size(); ++k) avg.mark_ready(k);
    try {
      avg.synchronize();
      FAIL("a hook that needs host memory ran on a device bucket");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::unsupported);
      CHECK(std::string(e.what()).find("bucket") != std::string::npos);
      CHECK(std::string(e.what()).find("cuda:0") != std::string::npos);
    }
  }
  avg.register_comm_hook(ddp::allreduce_hook);  // usable again: the failed steps were dropped
  for (std::size_t k = 0; k < model.size(); ++k) avg.mark_ready(k);
  avg.synchronize();
  CHECK(host(model[0].grad)[1] == expected(1));
}

TEST_CASE("Join on backend::Nccl: a GradientAverager of device buckets in a Join") {
  auto comm = single();
  ddp::CudaStream stream(0);
  auto model = cuda_model(stream);
  ddp::GradientAverager avg(comm, model);
  {
    ddp::Join join(comm, {&avg});
    for (int step = 0; step < 3; ++step) {
      CHECK(join.step() == 1);
      for (std::size_t k = 0; k < model.size(); ++k) avg.mark_ready(k);
      avg.synchronize();  // the sum over the ranks that trained, divided by their number (1)
    }
    join.finish();
    CHECK(join.active() == 1);
  }
  for (std::size_t k = 0; k < model.size(); ++k) {
    const auto g = host(model[k].grad);
    for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == expected(i));
  }
  // A finished rank's shadow buckets: zeros in device memory, the same collectives.
  ddp::Join again(comm, {&avg});
  avg.join_step(1);
  again.finish();
}

TEST_CASE(
    "TrainingState, shrink() and grow() on backend::Nccl: device parameters restored over a new "
    "NCCL communicator agreed in the store") {
  // A world of one under a launcher's store (hosted here, as ddprun's is): grow() with nobody
  // waiting keeps the communicator; shrink() makes a new NCCL communicator at epoch 1, the old
  // one fails every call, and TrainingState restores the last commit over the new one.
  ddp::StoreServer server("127.0.0.1", 0);
  ::setenv("DDP_STORE_HOSTED", "1", 1);
  ddp::Environment env;
  env.master_addr = "127.0.0.1";
  env.master_port = server.port();
  ddp::Options o;
  o.timeout = 60s;
  o.device = 0;
  auto comm = Nccl::init(env, o);
  ::unsetenv("DDP_STORE_HOSTED");
  ddp::CudaStream stream(0);
  auto model = cuda_model(stream);
  std::uint64_t done = 0;
  ddp::TrainingState state;
  state.track_model("model", model).track_object("done", done);
  state.start(comm);
  done = 1;
  CHECK(state.commit(comm) == 1);
  CHECK(state.bytes() >= (5 + 200'000 + 3 + 7) * sizeof(float));
  CHECK(comm.waiting_to_enter() == 0);
  auto same = comm.grow({.ticket = state.ticket()});
  CHECK(same.epoch() == 0);
  auto next = comm.shrink();
  CHECK(next.epoch() == 1);
  CHECK(next.size() == 1);
  CHECK(next.previous_ranks() == std::vector<int>{0});
  try {
    ddp::CudaBuffer<float> x(4);
    comm.all_reduce(x);
    FAIL("the replaced communicator still works");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::aborted);
  }
  std::vector<float> zeros(200'000, 0.0f);
  model[1].value.copy_from(zeros);  // a half-applied step, then the failure
  done = 2;
  CHECK(state.restore(next) == 1);
  CHECK(done == 1);
  const auto v = host(model[1].value);
  for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(v[i] == expected(i));
  std::vector<float> h{1, 2, 3, 4};
  ddp::CudaBuffer<float> a{std::span<const float>(h)};
  next.all_reduce(a);
  CHECK(host(a) == h);
}

namespace {
/// Copies n elements between host and device memory (either side) on `s`; done on return.
template <class T>
void copy(T* dst, const T* src, std::size_t n, cudaStream_t s) {
  DDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDefault, s));
  DDP_CUDA_CHECK(cudaStreamSynchronize(s));
}

/// A FullyShard parameter: views that FullyShard points at its unit's (device) memory.
struct ViewParam {
  ddp::TensorView<float> value, grad;
};

/// Fully sharded units of the Nccl case: element j of unit u after `steps` updates value -= grad
/// (gradient expected(j)); exact in float.
float fsdp_value(std::size_t u, std::size_t j, int steps) {
  const std::size_t i = u == 0 && j >= 5 ? 1 : 0, offset = i == 1 ? j - 5 : j;
  return static_cast<float>(u * 3 + i) + static_cast<float>(offset % 7) * 0.25f -
         static_cast<float>(steps) * expected(j);
}
void fsdp_init(std::size_t u, std::size_t i, std::size_t offset, std::span<float> v) {
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = fsdp_value(u, (i == 1 ? 5 : 0) + offset + k, 0);
}

/// Unit u's gathered values, on the host.
template <class E>
std::vector<float> fsdp_gathered(E& fsdp, std::size_t u, cudaStream_t s) {
  const auto w = fsdp.gather(u);
  using P = typename decltype(w)::value_type;
  std::vector<P> h(w.size());
  copy(h.data(), w.data(), h.size(), s);
  fsdp.release(u);
  return std::vector<float>(h.begin(), h.end());
}

/// Whether every unit holds fsdp_value(u, j, steps) (in P's precision).
template <class P, class E>
bool fsdp_holds(E& fsdp, int steps, cudaStream_t s) {
  for (std::size_t u = 0; u < fsdp.units(); ++u) {
    const auto got = fsdp_gathered(fsdp, u, s);
    for (std::size_t j = 0; j < got.size(); ++j)
      if (got[j] != static_cast<float>(static_cast<P>(fsdp_value(u, j, steps)))) return false;
  }
  return true;
}

/// A backward over every unit with gradients expected(j), reduced; then synchronize().
template <class E>
void fsdp_backward(E& fsdp, cudaStream_t s) {
  for (std::size_t u = fsdp.units(); u-- > 0;) {
    (void)fsdp.gather(u);
    const auto g = fsdp.grad(u);
    std::vector<float> h(g.size());
    for (std::size_t j = 0; j < h.size(); ++j) h[j] = expected(j);
    copy(g.data(), h.data(), h.size(), s);
    fsdp.release(u);
    fsdp.reduce(u);
  }
  fsdp.synchronize();
}

/// value -= grad over a shard, wherever it is (on the host for the test).
void fsdp_update(const std::vector<ddp::ShardSlice<float>>& shard, cudaStream_t s) {
  for (const auto& sl : shard) {
    std::vector<float> v(sl.value.size), g(sl.grad.size);
    copy(v.data(), sl.value.data, v.size(), s);
    copy(g.data(), sl.grad.data, g.size(), s);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] -= g[i];
    copy(sl.value.data, v.data(), v.size(), s);
  }
}
}  // namespace

TEST_CASE(
    "FullyShardedAverager on backend::Nccl: units on the device, the shard there or offloaded, "
    "Join, export, save and load, bfloat16") {
  auto comm = single();
  ddp::CudaStream stream(0);
  const cudaStream_t s = stream.get();
  const std::vector<std::vector<std::size_t>> units{{5, 3}, {200'000}};
  for (const bool offload : {false, true}) {
    CAPTURE(offload);
    ddp::FullyShardedAverager fsdp(comm, units, fsdp_init, {.offload = offload, .stream = s});
    CHECK(fsdp.device() == ddp::Device::cuda(0));  // the communicator's device
    CHECK(fsdp.shard()[0].value.device == (offload ? ddp::Device::cpu() : ddp::Device::cuda(0)));
    for (int step = 0; step < 2; ++step) {
      CHECK(fsdp_holds<float>(fsdp, step, s));
      fsdp_backward(fsdp, s);
      fsdp_update(fsdp.shard(), s);
    }
    CHECK(fsdp_holds<float>(fsdp, 2, s));
    // A step in a Join (a sum divided by the ranks that trained it, one here).
    fsdp.on_join_step([&](const std::vector<ddp::ShardSlice<float>>& sh) { fsdp_update(sh, s); });
    {
      ddp::Join join(comm, {&fsdp});
      CHECK(join.step() == 1);
      fsdp_backward(fsdp, s);
      fsdp_update(fsdp.shard(), s);
      join.finish();
    }
    CHECK(fsdp_holds<float>(fsdp, 3, s));
    std::vector<float> exported;
    fsdp.gather_to(0, [&](std::size_t u, std::size_t, std::span<const float> v) {
      if (u == 1) exported.assign(v.begin(), v.end());
    });
    CHECK(exported == fsdp_gathered(fsdp, 1, s));
    const std::string path = std::string("/tmp/ddp-cuda-fsdp-") + std::to_string(::getpid()) +
                             (offload ? "-offloaded" : "-on-device");
    (void)fsdp.save(path);
    fsdp.scatter_from(0, [](std::size_t, std::size_t, std::span<float> v) {
      for (float& x : v) x = -1.0f;
    });
    CHECK(fsdp_gathered(fsdp, 0, s) == std::vector<float>(8, -1.0f));
    CHECK(fsdp.load(path).has_value());
    CHECK(fsdp_holds<float>(fsdp, 3, s));
    for (const auto& f : std::filesystem::directory_iterator("/tmp"))
      if (f.path().string().starts_with(path)) std::filesystem::remove(f.path());
  }
  // bfloat16 gathers and float masters: this rank's block converted through the host.
  ddp::FullyShardedAverager<ddp::backend::Nccl, float, ddp::bfloat16, float> mixed(
      comm, units, fsdp_init, {.stream = s});
  CHECK(fsdp_holds<ddp::bfloat16>(mixed, 0, s));
  fsdp_backward(mixed, s);
  fsdp_update(mixed.shard(), s);
  CHECK(fsdp_holds<ddp::bfloat16>(mixed, 1, s));
  // NCCL moves device memory only: units on the host are refused, naming the way out.
  try {
    ddp::FullyShardedAverager host_units(comm, units, fsdp_init,
                                         {.device = ddp::Device::cpu(), .stream = s});
    FAIL("units on the host accepted by backend::Nccl");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::unsupported);
    CHECK(std::string(e.what()).find("offload") != std::string::npos);
  }
}

TEST_CASE("FullyShard on backend::Nccl: a model's device views pointed at gathered device units") {
  auto comm = single();
  ddp::CudaStream stream(0);
  const cudaStream_t s = stream.get();
  auto owned = cuda_model(stream);  // rank 0's values: read once at construction
  std::vector<ViewParam> net;
  for (auto& p : owned) net.push_back({ddp::view(p.value), ddp::view(p.grad)});
  ddp::FullyShardOptions o;
  o.memory.stream = s;
  ddp::FullyShard fs(comm, net, {{0, 1}, {2, 3}}, o);
  owned.clear();  // the shard holds the values now
  CHECK(net[0].value.size == 0);
  for (int step = 0; step < 2; ++step) {
    for (std::size_t u = 0; u < 2; ++u) {
      fs.forward(u, [&] {
        for (const std::size_t i : fs.unit_parameters(u)) {
          CHECK(net[i].value.device == ddp::Device::cuda(0));
          CHECK(net[i].grad.size == 0);
          std::vector<float> v(net[i].value.size);
          copy(v.data(), net[i].value.data, v.size(), s);
          for (std::size_t k = 0; k < v.size(); ++k)
            REQUIRE(v[k] == expected(k) - static_cast<float>(step) * 0.5f);
        }
      });
    }
    for (std::size_t u = 2; u-- > 0;) {
      fs.backward(u, [&] {
        for (const std::size_t i : fs.unit_parameters(u)) {
          CHECK(net[i].grad.device == ddp::Device::cuda(0));
          const std::vector<float> g(net[i].grad.size, 0.5f);
          copy(net[i].grad.data, g.data(), g.size(), s);
        }
      });
    }
    fs.step([&](const std::vector<ddp::ShardSlice<float>>& shard) { fsdp_update(shard, s); });
  }
  CHECK(net[1].value.size == 0);  // released between units
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
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);  // not held up by the producer
  }
  watchdog.join();
  producer.synchronize();
}

// ---- NcclClique: one process, every visible device (a clique of one on a one-GPU machine) ----

namespace {

/// One buffer per clique slot, on its device, holding value(slot, element).
template <class F>
std::vector<ddp::CudaBuffer<float>> per_device(const ddp::NcclClique& c, std::size_t n, F value) {
  std::vector<ddp::CudaBuffer<float>> out;
  for (int i = 0; i < c.size(); ++i) {
    const ddp::CudaDeviceGuard g(c.device(i));
    std::vector<float> h(n);
    for (std::size_t k = 0; k < n; ++k) h[k] = value(i, k);
    out.emplace_back(std::span<const float>(h), c.device(i));
  }
  return out;
}

}  // namespace

TEST_CASE(
    "NcclClique over every visible device: all_reduce, broadcast, reduce, all_gather, "
    "reduce_scatter against host references") {
  ddp::NcclClique clique;
  const int n = clique.size();
  REQUIRE(n == ddp::cuda_device_count());
  const auto un = static_cast<std::size_t>(n);
  constexpr std::size_t count = 1000;
  auto value = [](int slot, std::size_t k) {
    return static_cast<float>(slot + 1) * 0.5f + static_cast<float>(k % 7);
  };

  auto bufs = per_device(clique, count, value);
  clique.all_reduce(bufs, ddp::ReduceOp::sum);
  for (int i = 0; i < n; ++i) {
    const auto h = host(bufs[static_cast<std::size_t>(i)]);
    for (std::size_t k = 0; k < count; k += 97) {
      float want = 0;
      for (int j = 0; j < n; ++j) want += value(j, k);
      CHECK(h[k] == want);
    }
  }

  bufs = per_device(clique, count, value);
  clique.broadcast(bufs, n - 1);
  for (auto& b : bufs) CHECK(host(b)[5] == value(n - 1, 5));

  bufs = per_device(clique, count, value);
  clique.reduce(bufs, 0, ddp::ReduceOp::max);
  CHECK(host(bufs[0])[3] == value(n - 1, 3));
  if (n > 1) CHECK(host(bufs[1])[3] == value(1, 3));  // not the root: untouched

  auto in = per_device(clique, 4, value);
  auto gathered = per_device(clique, 4 * un, [](int, std::size_t) { return -1.0f; });
  clique.all_gather(in, gathered);
  for (auto& g : gathered) {
    const auto h = host(g);
    for (int j = 0; j < n; ++j) CHECK(h[4 * static_cast<std::size_t>(j) + 2] == value(j, 2));
  }

  auto big = per_device(clique, 4 * un, value);
  auto part = per_device(clique, 4, [](int, std::size_t) { return -1.0f; });
  clique.reduce_scatter(big, part, ddp::ReduceOp::sum);
  for (int i = 0; i < n; ++i) {
    const auto h = host(part[static_cast<std::size_t>(i)]);
    float want = 0;
    for (int j = 0; j < n; ++j) want += value(j, 4 * static_cast<std::size_t>(i) + 1);
    CHECK(h[1] == want);
  }

  // avg over half precision, the DataParallel gradient step.
  std::vector<ddp::CudaBuffer<ddp::half>> halves;
  for (int i = 0; i < n; ++i) {
    const ddp::CudaDeviceGuard g(clique.device(i));
    const std::vector<ddp::half> h(8, ddp::half(2.0f));
    halves.emplace_back(std::span<const ddp::half>(h), clique.device(i));
  }
  clique.all_reduce(halves, ddp::ReduceOp::avg);
  CHECK(static_cast<float>(host(halves[0])[7]) == 2.0f);
}

TEST_CASE("NcclClique: wrong inputs are refused with the slot and the rule") {
  ddp::NcclClique clique({0});
  CHECK(clique.size() == 1);
  CHECK(clique.device(0) == 0);
  auto error_of = [](auto&& f) -> std::pair<std::optional<ddp::Errc>, std::string> {
    try {
      f();
    } catch (const ddp::Error& e) {
      return {e.code(), e.what()};
    }
    return {std::nullopt, "no error"};
  };
  auto [code, text] = error_of([&] { ddp::NcclClique bad({0, 0}); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("listed twice") != std::string::npos);
  std::tie(code, text) = error_of([&] { ddp::NcclClique bad({ddp::cuda_device_count()}); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("does not exist") != std::string::npos);

  std::vector<ddp::CudaBuffer<float>> two;
  two.emplace_back(4);
  two.emplace_back(4);
  std::tie(code, text) = error_of([&] { clique.all_reduce(two); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("one tensor per device") != std::string::npos);

  ddp::CudaBuffer<float> d(4);
  std::vector<ddp::TensorView<float>> elsewhere{{d.data(), d.size(), ddp::Device::cuda(7)}};
  std::tie(code, text) = error_of([&] { clique.all_reduce(elsewhere); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("tensors[0]` is on cuda:7") != std::string::npos);

  std::vector<ddp::CudaBuffer<float>> in(1), out(1);
  in[0] = ddp::CudaBuffer<float>(4);
  out[0] = ddp::CudaBuffer<float>(3);
  std::tie(code, text) = error_of([&] { clique.all_gather(in, out); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("all_gather") != std::string::npos);
  std::vector<ddp::CudaBuffer<std::int32_t>> ints(1);
  ints[0] = ddp::CudaBuffer<std::int32_t>(4);
  std::tie(code, text) = error_of([&] { clique.all_reduce(ints, ddp::ReduceOp::avg); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("NcclClique: all_reduce: op avg is not defined on int32 (avg needs a "
                  "floating-point type)") != std::string::npos);
  std::tie(code, text) = error_of([&] { clique.broadcast(in, 1); });
  CHECK(code == ddp::Errc::invalid_argument);
  CHECK(text.find("NcclClique: broadcast: root 1 is not a slot of the clique [0, 1)") !=
        std::string::npos);
}

TEST_CASE("NcclClique: ordered after a slow producer, a stuck one times out and aborts") {
  {
    ddp::NcclClique clique({0});
    ddp::CudaStream producer(0);
    std::vector<ddp::CudaBuffer<float>> bufs(1);
    bufs[0] = ddp::CudaBuffer<float>(1 << 20, 0, producer.get());
    bufs[0].fill_bytes(0);
    launch_slow_fill(bufs[0].data(), bufs[0].size(), 3.0f, producer.get(), 400'000'000LL);
    clique.all_reduce(bufs, ddp::ReduceOp::max);
    CHECK(host(bufs[0]).back() == 3.0f);
  }
  ddp::NcclClique clique({0}, 300ms);
  ddp::CudaStream producer(0);
  std::vector<ddp::CudaBuffer<float>> bufs(1);
  bufs[0] = ddp::CudaBuffer<float>(16, 0, producer.get());
  launch_slow_fill(bufs[0].data(), bufs[0].size(), 1.0f, producer.get(), 8'000'000'000LL);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    clique.all_reduce(bufs);
    FAIL("the collective returned before the producer finished");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::timeout);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s);
  }
  try {
    clique.broadcast(bufs);
    FAIL("an aborted clique ran a collective");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::aborted);
  }
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
