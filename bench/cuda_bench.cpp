// cuda-bench: the GPU figures of the GPU/MPI issue, each against its peer in the same run.
//
//   cuda-bench nccl [--iters N] [--blocks B]
//       Communicator<backend::Nccl> (world of one) against raw ncclAllReduce +
//       cudaStreamSynchronize on the same device and stream, small messages: microseconds per
//       synchronous call, the median over B interleaved blocks of N calls each, and what ddp adds.
//   cuda-bench staged [-n RANKS] [--bytes B] [--reps R] [--piece BYTES]
//       backend::Host all_reduce of a CUDA buffer across RANKS forked processes sharing device 0
//       (staged through pinned memory), against the pinned cudaMemcpy rate (device to host and
//       host to device, one process alone) and against the same all_reduce on host memory.
//
// Plain argv parsing and printf: it builds wherever ddp::nccl does (the GPU machines have no
// CLI11 or fmt). Without a CUDA device it prints "no CUDA device; skipped" and exits 0.
#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The value after `flag` in argv, or `fallback`.
std::size_t arg(int argc, char** argv, std::string_view flag, std::size_t fallback) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (flag == argv[i]) return static_cast<std::size_t>(std::strtoull(argv[i + 1], nullptr, 0));
  }
  return fallback;
}

void nccl_check(ncclResult_t rc, const char* call) {
  if (rc != ncclSuccess) {
    std::fprintf(stderr, "cuda-bench: %s: %s\n", call, ncclGetErrorString(rc));
    std::exit(1);
  }
}

int run_nccl(std::size_t iters, std::size_t blocks) {
  if (ddp::cuda_device_count() == 0) {
    std::puts("no CUDA device; skipped");
    return 0;
  }
  DDP_CUDA_CHECK(cudaSetDevice(0));
  ddp::Options o;
  o.device = 0;
  o.timeout = 60s;
  auto comm = ddp::Communicator<ddp::backend::Nccl>::init(ddp::Environment{}, o);
  ncclComm_t raw = nullptr;
  ncclUniqueId id;
  nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
  nccl_check(ncclCommInitRank(&raw, 1, id, 0), "ncclCommInitRank");
  ddp::CudaStream stream(0);
  cudaDeviceProp prop{};
  DDP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "%s, NCCL %d, world of one, synchronous all_reduce (float32, sum), median of %zu "
      "interleaved blocks of %zu calls\n\n",
      prop.name, NCCL_VERSION_CODE, blocks, iters);
  std::printf(
      "| bytes | raw ncclAllReduce + sync (us) | backend::Nccl alone (us) | "
      "Communicator<Nccl> (us) | ddp adds (us) |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (const std::size_t bytes : {std::size_t{4}, std::size_t{64}, std::size_t{1024},
                                  std::size_t{4096}, std::size_t{65536}}) {
    const std::size_t n = bytes / sizeof(float);
    ddp::CudaBuffer<float> a(n, 0, stream.get()), b(n, 0, stream.get());
    a.fill_bytes(0);
    b.fill_bytes(0);
    const auto raw_call = [&] {
      nccl_check(ncclAllReduce(a.data(), a.data(), n, ncclFloat, ncclSum, raw, stream.get()),
                 "ncclAllReduce");
      DDP_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    };
    // The backend without the Communicator's layers (ordering, flight recorder, checks).
    const ddp::detail::Buf view{reinterpret_cast<std::byte*>(b.data()), n, ddp::DType::float32,
                                ddp::Device::cuda(0), stream.get()};
    const auto backend_call = [&] { comm.backend().all_reduce(view, ddp::ReduceOp::sum); };
    for (int i = 0; i < 200; ++i) {  // warm up all three
      raw_call();
      backend_call();
      comm.all_reduce(b);
    }
    std::vector<double> raw_us, backend_us, ddp_us;
    for (std::size_t k = 0; k < blocks; ++k) {
      auto t0 = Clock::now();
      for (std::size_t i = 0; i < iters; ++i) raw_call();
      raw_us.push_back(seconds_since(t0) * 1e6 / static_cast<double>(iters));
      t0 = Clock::now();
      for (std::size_t i = 0; i < iters; ++i) backend_call();
      backend_us.push_back(seconds_since(t0) * 1e6 / static_cast<double>(iters));
      t0 = Clock::now();
      for (std::size_t i = 0; i < iters; ++i) comm.all_reduce(b);
      ddp_us.push_back(seconds_since(t0) * 1e6 / static_cast<double>(iters));
    }
    const double r = median(raw_us), be = median(backend_us), d = median(ddp_us);
    std::printf("| %zu | %.2f | %.2f | %.2f | %+.2f |\n", bytes, r, be, d, d - r);
  }
  nccl_check(ncclCommDestroy(raw), "ncclCommDestroy");
  return 0;
}

/// Best rate of `reps` pinned copies of `bytes` in one direction, GB/s.
double pinned_rate(std::size_t bytes, bool to_host, int reps) {
  ddp::PinnedBuffer<float> host(bytes / sizeof(float));
  ddp::CudaBuffer<float> dev(bytes / sizeof(float), 0);
  ddp::CudaStream s(0);
  double best = 0;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    if (to_host) {
      DDP_CUDA_CHECK(
          cudaMemcpyAsync(host.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, s.get()));
    } else {
      DDP_CUDA_CHECK(
          cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice, s.get()));
    }
    s.synchronize();
    best = std::max(best, static_cast<double>(bytes) / seconds_since(t0) / 1e9);
  }
  return best;
}

int run_staged(int nproc, std::size_t bytes, int reps, std::size_t piece) {
  if (ddp::cuda_device_count_before_fork() == 0) {  // no CUDA context in the parent of fork()
    std::puts("no CUDA device; skipped");
    return 0;
  }
  using Host = ddp::Communicator<ddp::backend::Host>;
  ddp::spawn(nproc, [&](ddp::Environment env) {
    DDP_CUDA_CHECK(cudaSetDevice(0));
    ddp::CudaStream stream(0);
    ddp::Options o;
    o.timeout = 120s;
    if (piece != 0) o.cuda_staging_bytes = piece;
    auto comm = Host::init(env, o);
    double d2h = 0, h2d = 0;
    if (comm.rank() == 0) {  // alone: the others wait in the barrier
      d2h = pinned_rate(bytes, true, 10);
      h2d = pinned_rate(bytes, false, 10);
    }
    comm.barrier();
    const std::size_t n = bytes / sizeof(float);
    ddp::CudaBuffer<float> dev(n, 0, stream.get());
    dev.fill_bytes(0);
    std::vector<float> host(n, 0.0f);
    const auto time = [&](auto& buf) {
      for (int i = 0; i < 3; ++i) comm.all_reduce(buf);
      std::vector<double> s;
      for (int i = 0; i < reps; ++i) {
        comm.barrier();
        const auto t0 = Clock::now();
        comm.all_reduce(buf);
        s.push_back(seconds_since(t0));
      }
      return median(s);
    };
    const double dev_s = time(dev), host_s = time(host);
    if (comm.rank() == 0) {
      const double gb = static_cast<double>(bytes) / 1e9;
      std::printf(
          "staged all_reduce, %d processes on one GPU, %zu bytes (pieces of %zu): "
          "%.2f ms, %.2f GB/s\n",
          nproc, bytes, o.cuda_staging_bytes, dev_s * 1e3, gb / dev_s);
      std::printf("  same all_reduce on host memory: %.2f ms, %.2f GB/s\n", host_s * 1e3,
                  gb / host_s);
      std::printf(
          "  pinned cudaMemcpy, one process: device to host %.2f GB/s, host to device "
          "%.2f GB/s\n",
          d2h, h2d);
      std::printf("  staged all_reduce / pinned device-to-host rate: %.0f%%\n",
                  100.0 * gb / dev_s / d2h);
      std::fflush(stdout);
    }
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string_view mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "nccl")
      return run_nccl(arg(argc, argv, "--iters", 2000), arg(argc, argv, "--blocks", 9));
    if (mode == "staged") {
      return run_staged(static_cast<int>(arg(argc, argv, "-n", 2)),
                        arg(argc, argv, "--bytes", std::size_t{64} << 20),
                        static_cast<int>(arg(argc, argv, "--reps", 10)),
                        arg(argc, argv, "--piece", 0));
    }
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "cuda-bench: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr,
               "usage: cuda-bench nccl [--iters N] [--blocks B]\n"
               "       cuda-bench staged [-n RANKS] [--bytes B] [--reps R] [--piece BYTES]\n");
  return 2;
}
