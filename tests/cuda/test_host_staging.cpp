// backend::Host with CUDA buffers, staged through pinned host memory: how several processes
// that share one GPU train together (NCCL refuses two ranks on one device). Every collective on
// CudaBuffers across 2 and 4 forked processes on device 0, against the same references as the
// host tests (bit for bit: the host backend reduces in rank order); pieces larger than the
// staging size; ordering after a slow producer kernel on the tensor's stream; the
// GradientAverager on CUDA gradients.
//
// The parent process never touches CUDA (a CUDA context does not survive fork()): it asks a
// forked child whether a device exists. Without one it prints "no CUDA device; skipped" and
// exits 0, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

#include "../unit/collective_cases.hpp"
#include "kernels.hpp"

namespace {

using Host = ddp::Communicator<ddp::backend::Host>;
using ddp::ReduceOp;
using namespace std::chrono_literals;

/// Runs body(comm, stream) on `world` forked ranks, all on CUDA device 0.
void run(int world, const std::function<void(Host&, ddp::CudaStream&)>& body,
         ddp::Options options = {}) {
  options.timeout = 120s;
  try {
    ddp::spawn(world, [&](ddp::Environment env) {
      DDP_CUDA_CHECK(cudaSetDevice(0));
      ddp::CudaStream stream(0);
      auto comm = Host::init(env, options);
      body(comm, stream);
    });
  } catch (const ddp::Error& e) {
    FAIL_CHECK("world " << world << ": " << std::string(e.what()));
  }
}

struct Param {
  ddp::CudaBuffer<float> value, grad;
};

template <class T>
ddp::CudaBuffer<T> device(const std::vector<T>& h, cudaStream_t s) {
  return ddp::CudaBuffer<T>(std::span<const T>(h), 0, s);
}

template <class T>
std::vector<T> host(const ddp::CudaBuffer<T>& d) {
  std::vector<T> h(d.size());
  d.copy_to(h);
  return h;
}

template <class T>
std::vector<T> inputs(int rank, std::size_t n, int salt = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = cases::value<T>(rank, i, salt);
  return v;
}

/// Counts: one element, an odd count, and one that needs three staging pieces (1 MiB pieces).
template <class T>
std::vector<std::size_t> counts() {
  return {1, 1001, (std::size_t{5} << 19) / sizeof(T) + 3};
}

ddp::Options small_pieces() {
  ddp::Options o;
  o.cuda_staging_bytes = std::size_t{1} << 20;
  return o;
}

template <class T>
void all_reduce_case(Host& comm, cudaStream_t s) {
  const int p = comm.size(), r = comm.rank();
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
    if (op == ReduceOp::avg && std::is_integral_v<T>) continue;
    for (const std::size_t n : counts<T>()) {
      auto buf = device(inputs<T>(r, n), s);
      if (n % 2 == 0)
        comm.all_reduce(buf, op);
      else
        comm.all_reduce_async(buf, op).wait();
      cases::check_values<T>(
          host(buf), [&](std::size_t i) { return cases::reference<T>(op, p, i); },
          std::string("all_reduce ") + std::string(to_string(ddp::dtype_of<T>)) + " " +
              std::string(to_string(op)) + " n=" + std::to_string(n));
    }
  }
}

/// Copies n elements between host and device memory (either side), on `s`; done on return.
template <class T>
void copy(T* dst, const T* src, std::size_t n, cudaStream_t s) {
  DDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDefault, s));
  DDP_CUDA_CHECK(cudaStreamSynchronize(s));
}

/// The fully sharded units of the GPU cases and their initial values (every rank's the same).
const std::vector<std::vector<std::size_t>> fsdp_units{{7, 1001}, {300'000}, {3}};
void fsdp_init(std::size_t u, std::size_t i, std::size_t offset, std::span<float> v) {
  for (std::size_t k = 0; k < v.size(); ++k)
    v[k] = cases::value<float>(0, offset + k, 50 + static_cast<int>(u * 10 + i));
}

/// Three steps of SGD on `fsdp` (host or device units alike): rank r's gradients
/// cases::value(r, j, step), the update value -= 0.5 * grad done on the host; returns every
/// unit's values gathered at the end, as float.
template <class E>
std::vector<std::vector<float>> fsdp_train(const Host& comm, E& fsdp, cudaStream_t s) {
  for (int step = 0; step < 3; ++step) {
    fsdp.prefetch(0);
    for (std::size_t u = 0; u < fsdp.units(); ++u) {
      (void)fsdp.gather(u);
      if (u + 1 < fsdp.units()) fsdp.prefetch(u + 1);
      fsdp.release(u);
    }
    for (std::size_t u = fsdp.units(); u-- > 0;) {
      (void)fsdp.gather(u);
      const auto g = fsdp.grad(u);
      using R = typename decltype(g)::value_type;
      std::vector<R> h(g.size());
      for (std::size_t j = 0; j < h.size(); ++j)
        h[j] = ddp::detail::convert_value<R>(cases::value<float>(comm.rank(), j, 40 + step));
      copy(g.data(), h.data(), h.size(), s);
      fsdp.release(u);
      fsdp.reduce(u);
    }
    fsdp.synchronize();
    for (const auto& sl : fsdp.shard()) {
      std::vector<float> v(sl.value.size), g(sl.grad.size);
      copy(v.data(), sl.value.data, v.size(), s);
      copy(g.data(), sl.grad.data, g.size(), s);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] -= 0.5f * g[i];
      copy(sl.value.data, v.data(), v.size(), s);
    }
  }
  std::vector<std::vector<float>> out;
  for (std::size_t u = 0; u < fsdp.units(); ++u) {
    const auto w = fsdp.gather(u);
    using P = typename decltype(w)::value_type;
    std::vector<P> h(w.size());
    copy(h.data(), w.data(), h.size(), s);
    out.emplace_back();
    for (const P x : h) out.back().push_back(static_cast<float>(x));
    fsdp.release(u);
  }
  return out;
}

}  // namespace

TEST_CASE("all_reduce of CUDA buffers over backend::Host: dtypes, ops, multi-piece sizes") {
  for (const int world : {2, 4}) {
    run(
        world,
        [](Host& comm, ddp::CudaStream& stream) {
          all_reduce_case<float>(comm, stream.get());
          all_reduce_case<ddp::half>(comm, stream.get());
          all_reduce_case<std::int64_t>(comm, stream.get());
        },
        small_pieces());
  }
}

TEST_CASE("broadcast and reduce of CUDA buffers: the root's side and the others'") {
  for (const int world : {2, 4}) {
    run(
        world,
        [](Host& comm, ddp::CudaStream& stream) {
          const int p = comm.size(), r = comm.rank();
          for (const std::size_t n : counts<float>()) {
            for (int root = 0; root < p; ++root) {
              auto b = device(inputs<float>(r, n), stream.get());
              comm.broadcast(b, root);
              cases::check_values<float>(
                  host(b), [&](std::size_t i) { return cases::value<float>(root, i); },
                  "broadcast root " + std::to_string(root));
              auto red = device(inputs<float>(r, n), stream.get());
              comm.reduce(red, root, ReduceOp::sum);
              cases::check_values<float>(
                  host(red),
                  [&](std::size_t i) {
                    return r == root ? cases::reference<float>(ReduceOp::sum, p, i)
                                     : cases::value<float>(r, i);
                  },
                  "reduce root " + std::to_string(root));
            }
          }
        },
        small_pieces());
  }
}

TEST_CASE("gather-type collectives and p2p on CUDA buffers, in place and not") {
  for (const int world : {2, 4}) {
    run(world, [](Host& comm, ddp::CudaStream& stream) {
      const int p = comm.size(), r = comm.rank();
      const auto up = static_cast<std::size_t>(p), ur = static_cast<std::size_t>(r);
      const std::size_t n = 777;
      const auto block =
          [&](std::size_t i) {  // element i of the concatenation of every rank's input
            return cases::value<std::int32_t>(static_cast<int>(i / n), i % n);
          };
      // all_gather: separate buffers, then in place (in = this rank's block of out).
      auto in = device(inputs<std::int32_t>(r, n), stream.get());
      ddp::CudaBuffer<std::int32_t> out(n * up, 0, stream.get());
      comm.all_gather(in, out);
      cases::check_values<std::int32_t>(host(out), block, "all_gather");
      std::vector<std::int32_t> staged(n * up, -1);
      for (std::size_t i = 0; i < n; ++i) staged[ur * n + i] = cases::value<std::int32_t>(r, i);
      auto whole = device(staged, stream.get());
      comm.all_gather(ddp::view(whole).subview(ur * n, n), whole);
      cases::check_values<std::int32_t>(host(whole), block, "all_gather in place");
      // gather to the last rank.
      ddp::CudaBuffer<std::int32_t> g(r == p - 1 ? n * up : 0, 0, stream.get());
      comm.gather(in, g, p - 1);
      if (r == p - 1) cases::check_values<std::int32_t>(host(g), block, "gather");
      // scatter from rank 0: rank r gets block r of rank 0's concatenation.
      std::vector<std::int32_t> all(n * up);
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = block(i);
      auto src = device(all, stream.get());
      ddp::CudaBuffer<std::int32_t> mine(n, 0, stream.get());
      comm.scatter(src, mine, 0);
      cases::check_values<std::int32_t>(
          host(mine), [&](std::size_t i) { return block(ur * n + i); }, "scatter");
      // reduce_scatter: block r of the sum of everyone's concatenated inputs.
      std::vector<float> rs_in(n * up);
      for (std::size_t i = 0; i < rs_in.size(); ++i) rs_in[i] = cases::value<float>(r, i);
      auto rs = device(rs_in, stream.get());
      ddp::CudaBuffer<float> rs_out(n, 0, stream.get());
      comm.reduce_scatter(rs, rs_out, ReduceOp::sum);
      cases::check_values<float>(
          host(rs_out),
          [&](std::size_t i) { return cases::reference<float>(ReduceOp::sum, p, ur * n + i); },
          "reduce_scatter");
      // all_to_all: block j of rank r's input goes to rank j, as block r.
      auto a2a_in = device(inputs<std::int32_t>(r, n * up), stream.get());
      ddp::CudaBuffer<std::int32_t> a2a_out(n * up, 0, stream.get());
      comm.all_to_all(a2a_in, a2a_out);
      cases::check_values<std::int32_t>(
          host(a2a_out),
          [&](std::size_t i) {
            return cases::value<std::int32_t>(static_cast<int>(i / n), ur * n + i % n);
          },
          "all_to_all");
      // send/recv around the ring.
      auto send = device(inputs<double>(r, n), stream.get());
      ddp::CudaBuffer<double> recv(n, 0, stream.get());
      if (r % 2 == 0) {
        comm.send(send, (r + 1) % p, 5);
        comm.recv(recv, (r + p - 1) % p, 5);
      } else {
        comm.recv(recv, (r + p - 1) % p, 5);
        comm.send(send, (r + 1) % p, 5);
      }
      cases::check_values<double>(
          host(recv), [&](std::size_t i) { return cases::value<double>((r + p - 1) % p, i); },
          "recv");
    });
  }
}

TEST_CASE("staging waits for a slow producer on the tensor's stream") {
  run(2, [](Host& comm, ddp::CudaStream& stream) {
    ddp::CudaBuffer<float> buf(std::size_t{3} << 20, 0, stream.get());
    buf.fill_bytes(0);
    // ~200 ms of spinning before the kernel writes rank + 1: a copy that did not wait for it
    // would stage zeros.
    launch_slow_fill(buf.data(), buf.size(), static_cast<float>(comm.rank() + 1), stream.get(),
                     400'000'000LL);
    comm.all_reduce(buf, ReduceOp::sum);
    const auto h = host(buf);
    MP_EXPECT(h.front() == 3.0f && h.back() == 3.0f, "got " << h.front() << ", " << h.back());
  });
}

namespace {
struct CudaLinear {  // a model whose parameters live on the GPU
  std::vector<ddp::CudaBuffer<float>> values, grads;
};
}  // namespace

template <>
struct ddp::parameter_traits<std::pair<ddp::CudaBuffer<float>*, ddp::CudaBuffer<float>*>> {
  static auto& value(std::pair<ddp::CudaBuffer<float>*, ddp::CudaBuffer<float>*>& p) {
    return *p.first;
  }
  static auto& grad(std::pair<ddp::CudaBuffer<float>*, ddp::CudaBuffer<float>*>& p) {
    return *p.second;
  }
};

TEST_CASE("GradientAverager on CUDA gradients over backend::Host") {
  run(4, [](Host& comm, ddp::CudaStream& stream) {
    const int p = comm.size(), r = comm.rank();
    const std::vector<std::size_t> sizes = {3, 100'000, 17, 300'000};  // in place and packed
    std::vector<ddp::CudaBuffer<float>> values, grads;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      values.push_back(device(inputs<float>(r, sizes[k], 10 + static_cast<int>(k)), stream.get()));
      grads.push_back(device(inputs<float>(r, sizes[k], static_cast<int>(k)), stream.get()));
    }
    std::vector<std::pair<ddp::CudaBuffer<float>*, ddp::CudaBuffer<float>*>> model;
    for (std::size_t k = 0; k < sizes.size(); ++k) model.emplace_back(&values[k], &grads[k]);
    ddp::GradientAverager avg(comm, model);
    avg.mark_ready(3);
    avg.mark_ready(2);
    // parameter 1 is never marked: it counts as zero; parameter 0 is marked last.
    avg.mark_ready(0);
    avg.synchronize();
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      cases::check_values<float>(
          host(values[k]),
          [&](std::size_t i) { return cases::value<float>(0, i, 10 + static_cast<int>(k)); },
          "parameter values broadcast from rank 0");
      if (k == 1) {
        cases::check_values<float>(
            host(grads[k]), [](std::size_t) { return 0.0f; }, "unused parameter");
        continue;
      }
      const auto got = host(grads[k]);
      for (std::size_t i = 0; i < got.size(); ++i) {
        float sum = 0;
        for (int q = 0; q < p; ++q) sum += cases::value<float>(q, i, static_cast<int>(k));
        MP_EXPECT(std::abs(got[i] - sum / static_cast<float>(p)) <= 1e-5f * std::abs(sum),
                  "parameter " << k << " element " << i);
      }
    }
    MP_EXPECT(!avg.found_nonfinite(), "finite gradients");
  });
}

TEST_CASE(
    "Join with CUDA gradients over backend::Host: uneven inputs average over the ranks left") {
  // Rank 0 trains 3 steps, rank 1 one: step 0 averages both, steps 1-2 rank 0's alone (a sum
  // over the ranks, divided by those that trained it: a device bucket divided on the host).
  run(2, [](Host& comm, ddp::CudaStream& stream) {
    const int r = comm.rank();
    std::vector<Param> model;
    for (const std::size_t n : {5UL, 300'000UL})  // packed in a host bucket; in place
      model.push_back({device(inputs<float>(0, n, 1), stream.get()),
                       device(std::vector<float>(n, 0.0f), stream.get())});
    ddp::GradientAverager avg(comm, model);
    {
      ddp::Join join(comm, {&avg});
      for (int step = 0; step < (r == 0 ? 3 : 1); ++step) {
        const int active = join.step();
        MP_EXPECT(active == (step == 0 ? 2 : 1), "ranks training step " << step);
        for (auto& p : model) p.grad.copy_from(inputs<float>(r, p.grad.size(), 30 + step));
        for (std::size_t k = 0; k < model.size(); ++k) avg.mark_ready(k);
        avg.synchronize();
        for (auto& p : model) {
          const auto g = host(p.grad);
          for (std::size_t i = 0; i < g.size(); i += 997) {
            const float mine = cases::value<float>(r, i, 30 + step);
            const float want =
                step == 0 ? (cases::value<float>(0, i, 30) + cases::value<float>(1, i, 30)) / 2
                          : mine;
            MP_EXPECT(std::abs(g[i] - want) <= 1e-5f * std::abs(want),
                      "step " << step << " element " << i << ": " << g[i] << " vs " << want);
          }
        }
      }
      join.finish();
    }
  });
}

TEST_CASE("a rank lost mid-step: the others shrink and go on from the last commit, on CUDA") {
  // 3 ranks train CUDA parameters; rank 1 dies in step 2, before its average. The survivors
  // shrink(), restore() the commit of step 2 (the parameters on the device) and train steps 2-4
  // on their own: bitwise equal, step 2 applied once, over the two of them.
  mp::TempDir dir;
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  ddp::Options o;
  o.timeout = 60s;
  std::string spawn_error;
  try {
    ddp::spawn(
        3,
        [&](ddp::Environment env) {
          DDP_CUDA_CHECK(cudaSetDevice(0));
          ddp::CudaStream stream(0);
          auto comm = Host::init(env, o);
          const int me = comm.rank();
          std::vector<Param> model;
          for (const std::size_t n : {7UL, 50'000UL}) {
            model.push_back({device(inputs<float>(0, n, 3), stream.get()),
                             device(std::vector<float>(n, 0.0f), stream.get())});
          }
          ddp::GradientAverager avg(comm, model);
          int step = 0, done = 0;
          ddp::TrainingState state;
          state.track_model("model", model).track_object("done", done);
          state.start(comm);
          for (;;) {
            try {
              for (; step < 5; ++step) {
                for (auto& p : model) {  // this rank's gradient for this step
                  auto g = inputs<float>(comm.rank(), p.grad.size(), 20 + step);
                  p.grad.copy_from(g);
                }
                if (me == 1 && step == 2) std::_Exit(5);
                avg.average();
                for (auto& p : model) {
                  auto v = host(p.value);
                  const auto g = host(p.grad);
                  for (std::size_t i = 0; i < v.size(); ++i) v[i] -= 0.5f * g[i];
                  p.value.copy_from(v);
                }
                done = step + 1;
                state.commit(comm);
              }
              break;
            } catch (const ddp::Error& e) {
              MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted,
                        e.what());
              comm = comm.shrink({.wait_for_ranks = 20s});
              MP_EXPECT(state.restore(comm) == 2U, "the commit of step 2");
              step = done;
            }
          }
          std::string bytes;
          for (auto& p : model) {
            const auto v = host(p.value);
            bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
          }
          mp::TempDir::write(dir.file("net" + std::to_string(me)), bytes);
          mp::TempDir::write(dir.file("size" + std::to_string(me)), std::to_string(comm.size()));
        },
        so);
  } catch (const ddp::Error& e) {
    spawn_error = e.what();
  }
  CHECK_MESSAGE(spawn_error.find("rank 1") != std::string::npos, spawn_error);
  const std::string a = mp::TempDir::read(dir.file("net0")),
                    b = mp::TempDir::read(dir.file("net2"));
  CHECK(a.size() == (7 + 50'000) * sizeof(float));
  CHECK_MESSAGE(a == b, "the survivors' parameters differ");
  CHECK(mp::TempDir::read(dir.file("size0")) == "2");
  CHECK(mp::TempDir::read(dir.file("size2")) == "2");
  // Step 2 applied once: rank 0's value of element 0 against the same arithmetic on the host
  // (steps 0-1 averaged over 3 ranks, steps 2-4 over the 2 survivors).
  float v = cases::value<float>(0, 0, 3);
  for (int step = 0; step < 5; ++step) {  // after shrink(), rank 2 is rank 1
    const std::vector<int> ranks = step < 2 ? std::vector<int>{0, 1, 2} : std::vector<int>{0, 1};
    float sum = 0;
    for (const int q : ranks) sum += cases::value<float>(q, 0, 20 + step);
    v -= 0.5f * (sum / static_cast<float>(ranks.size()));
  }
  float got = 0;
  std::memcpy(&got, a.data(), sizeof(float));
  CHECK(got == doctest::Approx(v).epsilon(1e-5));
}

TEST_CASE(
    "FullyShardedAverager with units on the GPU over backend::Host: bitwise the host engine, "
    "the shard offloaded, bfloat16 gathers, exported and loaded") {
  for (const int world : {2, 4}) {
    run(world, [](Host& comm, ddp::CudaStream& stream) {
      const cudaStream_t s = stream.get();
      ddp::FullyShardedAverager on_host(comm, fsdp_units, fsdp_init);
      const auto want = fsdp_train(comm, on_host, s);
      for (const bool offload : {false, true}) {
        const ddp::FullyShardedOptions o{
            .device = ddp::Device::cuda(0), .offload = offload, .stream = s};
        ddp::FullyShardedAverager on_gpu(comm, fsdp_units, fsdp_init, o);
        MP_EXPECT(on_gpu.device() == ddp::Device::cuda(0), "units on the GPU");
        MP_EXPECT(
            on_gpu.shard()[0].value.device == (offload ? ddp::Device::cpu() : ddp::Device::cuda(0)),
            "the shard where asked, offload " << offload);
        MP_EXPECT(fsdp_train(comm, on_gpu, s) == want, "device units, offload " << offload);
        // Exported at rank 1, a unit at a time, in host memory.
        std::vector<std::vector<float>> got(fsdp_units.size());
        on_gpu.gather_to(1, [&](std::size_t u, std::size_t, std::span<const float> v) {
          got[u].insert(got[u].end(), v.begin(), v.end());
        });
        if (comm.rank() == 1) MP_EXPECT(got == want, "gather_to, offload " << offload);
        // Saved, overwritten from rank 0 (scatter_from), loaded back.
        const std::string dir = "/tmp/ddp-cuda-fsdp-" + std::to_string(::getppid());
        std::filesystem::create_directories(dir);
        const std::string path = dir + (offload ? "/offloaded" : "/on-device");
        (void)on_gpu.save(path);
        on_gpu.scatter_from(0, [](std::size_t, std::size_t, std::span<float> v) {
          for (float& x : v) x = 3.0f;
        });
        const auto w = on_gpu.gather(1);
        std::vector<float> h(w.size());
        copy(h.data(), w.data(), h.size(), s);
        on_gpu.release(1);
        MP_EXPECT(h == std::vector<float>(h.size(), 3.0f), "scatter_from, offload " << offload);
        MP_EXPECT(on_gpu.load(path).has_value(), "load");
        for (std::size_t u = 0; u < fsdp_units.size(); ++u) {
          const auto x = on_gpu.gather(u);
          std::vector<float> back(x.size());
          copy(back.data(), x.data(), back.size(), s);
          on_gpu.release(u);
          MP_EXPECT(back == want[u], "loaded unit " << u << ", offload " << offload);
        }
        comm.barrier();
        if (comm.rank() == 0) std::filesystem::remove_all(dir);
      }
      // bfloat16 gathers and gradients, float masters: the conversions on the host either way.
      using Mixed = ddp::FullyShardedAverager<ddp::backend::Host, float, ddp::bfloat16, float>;
      Mixed mixed_host(comm, fsdp_units, fsdp_init);
      const auto mixed_want = fsdp_train(comm, mixed_host, s);
      using Mixed16 = ddp::FullyShardedAverager<ddp::backend::Host, float, ddp::bfloat16>;
      for (const bool offload : {false, true}) {
        Mixed mixed_gpu(comm, fsdp_units, fsdp_init,
                        {.device = ddp::Device::cuda(0), .offload = offload, .stream = s});
        MP_EXPECT(fsdp_train(comm, mixed_gpu, s) == mixed_want, "bfloat16, offload " << offload);
        Mixed16 reduced16_host(comm, fsdp_units, fsdp_init);
        Mixed16 reduced16_gpu(comm, fsdp_units, fsdp_init,
                              {.device = ddp::Device::cuda(0), .offload = offload, .stream = s});
        MP_EXPECT(fsdp_train(comm, reduced16_gpu, s) == fsdp_train(comm, reduced16_host, s),
                  "bfloat16 gradients, offload " << offload);
      }
    });
  }
}

int main(int argc, char** argv) {
  // Ask a child: the parent must not create a CUDA context before forking the ranks.
  if (ddp::cuda_device_count_before_fork() == 0) {
    // What runs without a device: fully sharded units asked for on one are refused, named.
    try {
      auto comm = Host::init(ddp::Environment{});
      ddp::FullyShardedAverager f(comm, {{4}}, nullptr, {.device = ddp::Device::cuda(0)});
      std::puts("FAILED: units on cuda:0 were accepted without a CUDA device");
      return 1;
    } catch (const ddp::Error& e) {
      if (e.code() != ddp::Errc::invalid_argument ||
          std::string(e.what()).find("sees 0 CUDA device(s)") == std::string::npos) {
        std::printf("FAILED: %s\n", e.what());
        return 1;
      }
    }
    std::puts("ddp CUDA staging tests: no CUDA device; skipped");
    return 0;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
